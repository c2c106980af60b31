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
//                                  "forward": its forward-relevant fields (io/forward_config.hpp;
//                                             absent when the model came from a preset),
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
// agree, and a receiver of another model refuses the message; a receiver bound to a config.json
// whose forward fields (rope, norm eps, activation, attention window, ...) differ from the
// message's refuses it too, naming the field and both values (config drift: the same weights,
// another policy).
//
// decode() checks everything but the chunks' contents: the framing, the header (strictly, as
// storage checks a manifest: every integer bounded, no unknown or duplicate keys), every chunk's
// size and checksum. chunks() then decodes each chunk with its expected header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/core/digest.hpp"
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
// A publication for receivers that serve online-quantized FP8 (docs/fp8.md): the same framing;
// its chunks carry the tensors that stay BF16, and its "fp8" section lists one FP8 part per
// receiver rank (receive/fp8_part.hpp), which follow the chunks in the body.
inline constexpr std::string_view fp8_format = "dte-publication-fp8-v1";

// The "fp8" section of an FP8 publication's header:
//   {"recipe": "fp8-block", "tp": 2, "ep": 1,
//    "parts": [{"rank": 0, "bytes": 123, "xxh3": "<16 hex digits>",
//               "digest": ["<8 hex digits>", ...]}, ...]}
// one part per TP rank of one replica, in rank order; digest: per quantized tensor of the rank
// (layout::Fp8Grid::quantized_ids order), of its codes and scales after this version.
struct Fp8Section {
  struct Part {
    std::uint32_t rank = 0;
    std::uint64_t bytes = 0, xxh3 = 0;
    std::vector<Digest> digest;
  };
  std::string recipe;
  std::int64_t tp = 1, ep = 1;
  std::vector<Part> parts;
};
// A header is a few hundred bytes per 64 tensors; 64 MiB leaves room for 10^5 chunks.
inline constexpr std::uint32_t max_header_bytes = std::uint32_t{64} << 20;

using Bytes = std::vector<std::byte>;

// The model as a publication names it: its structure (what decides every element's place).
inline layout::ModelSpec named_by_structure(layout::ModelSpec m) {
  m.name = m.structure();
  return m;
}

// The message of `manifest` (model named by structure, chunks listed in order) with `chunks`.
inline nlohmann::ordered_json fp8_json(const Fp8Section& f) {
  nlohmann::ordered_json j;
  j["recipe"] = f.recipe;
  j["tp"] = f.tp;
  j["ep"] = f.ep;
  j["parts"] = nlohmann::ordered_json::array();
  for (const Fp8Section::Part& p : f.parts) {
    nlohmann::ordered_json d = nlohmann::ordered_json::array();
    for (Digest x : p.digest)
      d.push_back(storage::detail::hex(x, 8));
    j["parts"].push_back({{"rank", p.rank},
                          {"bytes", p.bytes},
                          {"xxh3", storage::detail::hex(p.xxh3, 16)},
                          {"digest", std::move(d)}});
  }
  return j;
}

inline Fp8Section fp8_from_json(const nlohmann::json& j, const std::string& source) {
  const io::JsonReader r(source);
  storage::detail::only_keys(r, j, {"recipe", "tp", "ep", "parts"}, "fp8");
  Fp8Section f;
  f.recipe = r.string(j, "recipe", "fp8");
  f.tp = r.integer(r.member(j, "tp", "fp8"), "fp8.tp", 1, 1 << 20);
  f.ep = r.integer(r.member(j, "ep", "fp8"), "fp8.ep", 1, 1 << 20);
  const nlohmann::json& parts = r.array(j, "parts", "fp8", 1 << 20);
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const std::string path = "fp8.parts[" + std::to_string(k) + "]";
    const nlohmann::json& p = parts[k];
    if (!p.is_object()) r.fail(path, "is not an object");
    storage::detail::only_keys(r, p, {"rank", "bytes", "xxh3", "digest"}, path);
    Fp8Section::Part q;
    q.rank = static_cast<std::uint32_t>(
        r.integer(r.member(p, "rank", path), path + ".rank", 0, (1 << 20) - 1));
    q.bytes = static_cast<std::uint64_t>(
        r.integer(r.member(p, "bytes", path), path + ".bytes", 0, std::int64_t{1} << 40));
    if (!storage::detail::parse_hex(r.string(p, "xxh3", path), 16, q.xxh3)) {
      r.fail(path + ".xxh3", "is not 16 lowercase hex digits");
    }
    const nlohmann::json& d = r.array(p, "digest", path, 1 << 24);
    for (std::size_t i = 0; i < d.size(); ++i) {
      std::uint64_t x = 0;
      if (!d[i].is_string() || !storage::detail::parse_hex(d[i].get<std::string>(), 8, x)) {
        r.fail(path + ".digest[" + std::to_string(i) + "]", "is not 8 lowercase hex digits");
      }
      q.digest.push_back(static_cast<Digest>(x));
    }
    if (q.rank != k)
      r.fail(path + ".rank", "is not " + std::to_string(k) + " (parts in rank order)");
    f.parts.push_back(std::move(q));
  }
  return f;
}

inline Bytes encode(const layout::ModelSpec& model, const storage::Manifest& manifest,
                    std::span<const Bytes> chunks, std::string_view what = format,
                    const Fp8Section* fp8 = nullptr, std::span<const Bytes> fp8_parts = {}) {
  if ((what == fp8_format) != (fp8 != nullptr) ||
      (fp8 != nullptr && fp8->parts.size() != fp8_parts.size())) {
    throw invalid_argument(
        "dte::publication::encode: an FP8 publication needs its fp8 section "
        "and one part per rank; no other publication has them");
  }
  if (chunks.size() != manifest.chunks.size()) {
    throw invalid_argument("dte::publication::encode: the manifest lists " +
                           std::to_string(manifest.chunks.size()) + " chunks, given " +
                           std::to_string(chunks.size()));
  }
  nlohmann::ordered_json h;
  h["format"] = what;
  h["config"] = io::config_json(model);
  if (model.forward) h["forward"] = io::forward_json(*model.forward);
  h["manifest"] = nlohmann::ordered_json::parse(storage::manifest_json(manifest));
  if (fp8 != nullptr) h["fp8"] = fp8_json(*fp8);
  const std::string text = h.dump();
  std::size_t total = magic.size() + 4 + text.size();
  for (const Bytes& c : chunks)
    total += c.size();
  for (const Bytes& c : fp8_parts)
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
  for (const Bytes& c : fp8_parts) {
    if (!c.empty()) std::memcpy(p, c.data(), c.size());
    p += c.size();
  }
  return out;
}

// The framing and the header of a message, without the model: what a receiver that has not
// learnt its model yet reads first. what: the format expected ("": any whole publication).
struct Envelope {
  nlohmann::json config;
  std::optional<io::ForwardFields> forward;  // the sender's model's, where it knew them
  nlohmann::json manifest;                   // parsed (strictly), not yet read
  nlohmann::json fp8;               // an FP8 publication's section (null otherwise), not yet read
  std::span<const std::byte> body;  // the chunks (and an FP8 publication's parts)
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
  const std::string f = r.string(h, "format", "");
  if (what.empty()) what = f == fp8_format ? fp8_format : format;  // (any whole publication)
  if (f == fp8_format && what != fp8_format) {
    throw format_error(source +
                       ": a publication for FP8 receivers (its quantized tensors are "
                       "FP8 codes and scales); apply it with a receiver that serves FP8 "
                       "(TorchReceiver(..., quantization=...)), or publish BF16 for this one");
  }
  if (what == fp8_format && f == format) {
    throw format_error(source +
                       ": a BF16 publication, but this receiver serves FP8: publish "
                       "for FP8 receivers (TorchPublisher(..., quantization=..., infer=...)) "
                       "with the receivers' recipe and TP size");
  }
  if (what == fp8_format) {
    storage::detail::only_keys(r, h, {"format", "config", "forward", "manifest", "fp8"}, "");
  } else {
    storage::detail::only_keys(r, h, {"format", "config", "forward", "manifest"}, "");
  }
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
  if (const auto it = h.find("forward"); it != h.end()) {
    e.forward = io::forward_from_json(*it, source);
  }
  if (!r.member(h, "manifest", "").is_object()) r.fail("manifest", "is not an object");
  e.manifest = std::move(h["manifest"]);  // (present: member() checked it)
  if (what == fp8_format) {
    if (!r.member(h, "fp8", "").is_object()) r.fail("fp8", "is not an object");
    e.fp8 = std::move(h["fp8"]);
  }
  e.body = bytes.subspan(magic.size() + 4 + n);
  return e;
}

// A message's forward fields against those of the config the receiver is bound to (where both
// are known): the same structure computing another function is refused, naming the field.
inline void check_forward(const Envelope& e, const layout::ModelSpec& mine,
                          const std::string& source) {
  if (!e.forward || !mine.forward) return;
  if (const auto d = io::forward_difference(*e.forward, *mine.forward, "the trainer's config",
                                            "this receiver's config")) {
    throw protocol_error(source +
                         ": the publication's model computes differently from the one "
                         "this receiver serves: " +
                         *d +
                         ". Serve the trainer's config.json (or "
                         "publish with the engine's), so that the engine samples from the "
                         "trainer's policy");
  }
}

// A message checked against the receiver's model: the manifest, and each chunk's bytes.
struct View {
  storage::Manifest manifest;
  std::vector<std::span<const std::byte>> chunks;
  std::optional<Fp8Section> fp8;                      // an FP8 publication's
  std::vector<std::span<const std::byte>> fp8_parts;  // per rank
};

inline View decode(const layout::HfModel& hf, std::span<const std::byte> bytes,
                   const std::string& source, std::string_view what = format) {
  Envelope e = envelope(bytes, source, what);
  View v;
  v.manifest = storage::manifest_from_json(e.manifest, source + " manifest", hf);
  check_forward(e, hf.spec(), source);
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
  if (what == fp8_format) {
    v.fp8 = fp8_from_json(e.fp8, source + " header");
    for (std::size_t k = 0; k < v.fp8->parts.size(); ++k) {
      const Fp8Section::Part& q = v.fp8->parts[k];
      if (q.bytes > e.body.size() - at) {
        throw format_error(source + ": FP8 part " + std::to_string(k) + " of " +
                           std::to_string(q.bytes) + " bytes runs past the end of the message " +
                           "(truncated)");
      }
      const auto part = e.body.subspan(at, q.bytes);
      if (storage::checksum(part) != q.xxh3) {
        throw format_error(source + ": FP8 part " + std::to_string(k) +
                           " fails its xxh3 checksum (corrupted in transit)");
      }
      v.fp8_parts.push_back(part);
      at += q.bytes;
    }
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
