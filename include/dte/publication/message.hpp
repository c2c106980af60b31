// SPDX-License-Identifier: Apache-2.0
// A publication as one self-contained byte string (docs/python.md, "The message"): what
// publication::Publisher returns and every receiver kind applies, whatever its layout, in
// canonical coordinates (HF tensor, index in the unsharded tensor, BF16 bits) — so the trainer
// never needs to know its receivers, and the same bytes go to a process, a socket or storage.
//
//   "DTEPUB1\n"  8 bytes
//   u32 LE n     the length of the header
//   header       n bytes of JSON: {"format": "dte-publication-v1",
//                                  "config": the model's config.json fields (io::config_json),
//                                  "manifest": a storage manifest (storage/manifest.hpp)}
//   chunks       the manifest's chunks, back to back, in its order (storage/chunk.hpp)
//
// The manifest is storage's own: version, base (null: a full publication), per canonical tensor
// the digest of the trainer's BF16 state after this version, and each chunk's size and xxh3. So
// a publication written to storage is its chunks as files plus its manifest, and a storage
// version read back is a publication (publication/storage.hpp). The manifest's model is the
// model's structure (ModelSpec::structure()), so two sides that name one model differently still
// agree, and a receiver of another model refuses the message.
//
// decode() checks everything but the chunks' contents: the framing, the header (strictly, as
// storage checks a manifest: every integer bounded, no unknown or duplicate keys), every chunk's
// size and checksum. chunks() then decodes each chunk with its expected header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/error.hpp"
#include "dte/io/json.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/manifest.hpp"

namespace dte::publication {

inline constexpr std::string_view magic = "DTEPUB1\n";
inline constexpr std::string_view format = "dte-publication-v1";
// A header is a few hundred bytes per 64 tensors; 64 MiB leaves room for 10^5 chunks.
inline constexpr std::uint32_t max_header_bytes = std::uint32_t{64} << 20;

using Bytes = std::vector<std::byte>;

// The model as a publication names it: its structure (what decides every element's place).
inline layout::ModelSpec named_by_structure(layout::ModelSpec m) {
  m.name = m.structure();
  return m;
}

// The message of `manifest` (model named by structure, chunks listed in order) with `chunks`.
inline Bytes encode(const layout::ModelSpec& model, const storage::Manifest& manifest,
                    std::span<const Bytes> chunks) {
  if (chunks.size() != manifest.chunks.size()) {
    throw invalid_argument("dte::publication::encode: the manifest lists " +
                           std::to_string(manifest.chunks.size()) + " chunks, given " +
                           std::to_string(chunks.size()));
  }
  nlohmann::ordered_json h;
  h["format"] = format;
  h["config"] = io::config_json(model);
  h["manifest"] = nlohmann::ordered_json::parse(storage::manifest_json(manifest));
  const std::string text = h.dump();
  std::size_t total = magic.size() + 4 + text.size();
  for (const Bytes& c : chunks)
    total += c.size();
  Bytes out(total);
  std::byte* p = out.data();
  std::memcpy(p, magic.data(), magic.size());
  p += magic.size();
  const auto n = static_cast<std::uint32_t>(text.size());
  for (int b = 0; b < 4; ++b)
    *p++ = static_cast<std::byte>(n >> (8 * b));
  std::memcpy(p, text.data(), text.size());
  p += text.size();
  for (const Bytes& c : chunks) {
    if (!c.empty()) std::memcpy(p, c.data(), c.size());
    p += c.size();
  }
  return out;
}

// The framing and the header of a message, without the model: what a receiver that has not
// learnt its model yet reads first.
struct Envelope {
  nlohmann::json config;
  nlohmann::json manifest;          // parsed (strictly), not yet read
  std::span<const std::byte> body;  // the chunks
};

inline Envelope envelope(std::span<const std::byte> bytes, const std::string& source) {
  if (bytes.size() < magic.size() + 4 ||
      std::memcmp(bytes.data(), magic.data(), magic.size()) != 0) {
    throw format_error(source +
                       ": not a dte publication (it does not start with \"DTEPUB1\"); "
                       "pass the bytes TorchPublisher / publication::Publisher returned");
  }
  std::uint32_t n = 0;
  for (int b = 0; b < 4; ++b)
    n |= static_cast<std::uint32_t>(bytes[magic.size() + static_cast<std::size_t>(b)]) << (8 * b);
  if (n > max_header_bytes || n > bytes.size() - magic.size() - 4) {
    throw format_error(source + ": the header claims " + std::to_string(n) +
                       " bytes, the message " + "has " +
                       std::to_string(bytes.size() - magic.size() - 4) +
                       " after the framing (truncated or corrupt)");
  }
  const auto* text = reinterpret_cast<const char*>(bytes.data() + magic.size() + 4);
  nlohmann::json h = io::parse_strict(std::string_view(text, n), source, "publication header", 6);
  const io::JsonReader r(source);
  if (!h.is_object()) r.fail("", "is not a JSON object");
  storage::detail::only_keys(r, h, {"format", "config", "manifest"}, "");
  if (r.string(h, "format", "") != format) {
    r.fail("format", "is not \"" + std::string(format) + "\" (a newer or foreign writer)");
  }
  Envelope e;
  e.config = r.member(h, "config", "");
  if (!e.config.is_object()) r.fail("config", "is not an object");
  if (!r.member(h, "manifest", "").is_object()) r.fail("manifest", "is not an object");
  e.manifest = std::move(h["manifest"]);  // (present: member() checked it)
  e.body = bytes.subspan(magic.size() + 4 + n);
  return e;
}

// A message checked against the receiver's model: the manifest, and each chunk's bytes.
struct View {
  storage::Manifest manifest;
  std::vector<std::span<const std::byte>> chunks;
};

inline View decode(const layout::HfModel& hf, std::span<const std::byte> bytes,
                   const std::string& source) {
  Envelope e = envelope(bytes, source);
  View v;
  v.manifest = storage::manifest_from_json(e.manifest, source + " manifest", hf);
  if (v.manifest.writers != 1) {
    throw protocol_error(source + ": written by " + std::to_string(v.manifest.writers) +
                         " trainer ranks; a publication message has one writer");
  }
  std::size_t at = 0;
  for (std::size_t k = 0; k < v.manifest.chunks.size(); ++k) {
    const storage::ChunkEntry& c = v.manifest.chunks[k];
    if (c.chunk != k) {
      throw protocol_error(source + ": chunk " + std::to_string(k) + " of the manifest says " +
                           "it is number " + std::to_string(c.chunk) + "; chunks are in order");
    }
    if (c.bytes > e.body.size() - at) {
      throw format_error(source + ": chunk " + std::to_string(k) + " of " +
                         std::to_string(c.bytes) + " bytes runs past the end of the message " +
                         "(truncated)");
    }
    const auto part = e.body.subspan(at, c.bytes);
    if (storage::checksum(part) != c.xxh3) {
      throw format_error(source + ": chunk " + std::to_string(k) +
                         " fails its xxh3 checksum (corrupted in transit)");
    }
    v.chunks.push_back(part);
    at += c.bytes;
  }
  if (at != e.body.size()) {
    throw format_error(source + ": " + std::to_string(e.body.size() - at) +
                       " bytes follow the last chunk the manifest lists");
  }
  return v;
}

// Every chunk of a decoded message, each checked against the header the manifest implies.
inline std::vector<storage::Chunk> chunks(const layout::HfModel& hf, const View& v,
                                          const std::string& source) {
  std::vector<storage::Chunk> out;
  for (std::size_t k = 0; k < v.chunks.size(); ++k) {
    const storage::ChunkHeader expect{v.manifest.version, v.manifest.base,
                                      static_cast<std::uint32_t>(k), 0};
    out.push_back(
        storage::decode_chunk(hf, v.chunks[k], source + " chunk " + std::to_string(k), &expect));
  }
  return out;
}

}  // namespace dte::publication
