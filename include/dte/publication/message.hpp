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
// the digest of the trainer's BF16 state after this version, and each chunk's size and xxh3 (and
// its writer: a sharded trainer's ranks each write their part, and merge() lists the parts'
// chunks writer by writer, each writer's numbered from 0, and sums their digests). So
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
// One writer's part of a publication (a sharded trainer's rank): the same framing, for merge()
// only, so no receiver mistakes a part for a publication.
inline constexpr std::string_view part_format = "dte-publication-part-v1";
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
                    std::span<const Bytes> chunks, std::string_view what = format) {
  if (chunks.size() != manifest.chunks.size()) {
    throw invalid_argument("dte::publication::encode: the manifest lists " +
                           std::to_string(manifest.chunks.size()) + " chunks, given " +
                           std::to_string(chunks.size()));
  }
  nlohmann::ordered_json h;
  h["format"] = what;
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

inline Envelope envelope(std::span<const std::byte> bytes, const std::string& source,
                         std::string_view what = format) {
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
  const std::string f = r.string(h, "format", "");
  if (f != what) {
    if (f == part_format) {
      throw format_error(source + ": one writer's part of a publication, not a publication; " +
                         "merge the parts of every trainer rank (dte::publication::merge)");
    }
    if (f == format) {
      throw format_error(source + ": a whole publication where one writer's part was expected");
    }
    r.fail("format", "is not \"" + std::string(what) + "\" (a newer or foreign writer)");
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
                   const std::string& source, std::string_view what = format) {
  Envelope e = envelope(bytes, source, what);
  View v;
  v.manifest = storage::manifest_from_json(e.manifest, source + " manifest", hf);
  std::size_t at = 0;
  for (std::size_t k = 0; k < v.manifest.chunks.size(); ++k) {
    const storage::ChunkEntry& c = v.manifest.chunks[k];
    const storage::ChunkEntry* prev = k == 0 ? nullptr : &v.manifest.chunks[k - 1];
    const bool next = prev != nullptr && c.writer == prev->writer
                          ? c.chunk == prev->chunk + 1
                          : c.chunk == 0 && (prev == nullptr || c.writer > prev->writer);
    if (!next) {
      throw protocol_error(source + ": entry " + std::to_string(k) + " of the manifest is chunk " +
                           std::to_string(c.chunk) + " of writer " + std::to_string(c.writer) +
                           "; chunks are listed writer by writer, each writer's numbered from 0");
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
                                      v.manifest.chunks[k].chunk, v.manifest.chunks[k].writer};
    out.push_back(
        storage::decode_chunk(hf, v.chunks[k], source + " chunk " + std::to_string(k), &expect));
  }
  return out;
}

// The parts of one version (parts[w]: writer w's, as its Publisher returned it) as one
// message: every part checked as decode() checks a message, all of the same model, version and
// base and of this many writers, each holding only its writer's chunks; the chunks listed writer
// by writer, the changed counts and the digests summed (each writer's digest covers what it
// sends; together they send every element once). manifest: where the merged manifest goes, for a
// caller that wants its digest and counts without decoding the message again.
inline Bytes merge(const layout::ModelSpec& model,
                   std::span<const std::span<const std::byte>> parts,
                   storage::Manifest* manifest = nullptr) {
  const layout::ModelSpec spec = named_by_structure(model);
  const layout::HfModel hf(spec);
  if (parts.empty()) throw invalid_argument("dte::publication::merge: no parts");
  storage::Manifest m;
  std::vector<Bytes> blobs;
  for (std::size_t w = 0; w < parts.size(); ++w) {
    const std::string who = "part " + std::to_string(w);
    View v = decode(hf, parts[w], who, part_format);
    const storage::Manifest& p = v.manifest;
    if (p.writers != parts.size()) {
      throw protocol_error(who + " is one of " + std::to_string(p.writers) + " writers' parts; " +
                           std::to_string(parts.size()) + " parts were given");
    }
    if (w == 0) {
      m.model = p.model;
      m.version = p.version;
      m.base = p.base;
      m.writers = p.writers;
      m.digest.assign(p.digest.size(), 0);
    } else if (p.version != m.version || p.base != m.base) {
      throw protocol_error(who + " is of version " + std::to_string(p.version) + " on base " +
                           (p.anchor() ? std::string("none") : std::to_string(p.base)) +
                           ", part 0 of version " + std::to_string(m.version) + " on base " +
                           (m.anchor() ? std::string("none") : std::to_string(m.base)) +
                           "; the writers disagree on the version (one of them missed a step)");
    }
    for (std::size_t k = 0; k < p.chunks.size(); ++k) {
      if (p.chunks[k].writer != w) {
        throw protocol_error(who + " holds a chunk of writer " +
                             std::to_string(p.chunks[k].writer) + "; parts are in writer order");
      }
      m.chunks.push_back(p.chunks[k]);
      blobs.emplace_back(v.chunks[k].begin(), v.chunks[k].end());
    }
    m.changed += p.changed;
    for (std::size_t t = 0; t < p.digest.size(); ++t)
      m.digest[t] += p.digest[t];
  }
  Bytes out = encode(spec, m, blobs);
  if (manifest != nullptr) *manifest = std::move(m);
  return out;
}

}  // namespace dte::publication
