// SPDX-License-Identifier: Apache-2.0
// The manifest of one published version (issue 12): what a reader needs to take the version
// whole or not at all. JSON, written last into the version's directory (io::write_file_atomic);
// format "dte-manifest-v1":
//   {"format": "dte-manifest-v1", "model": "<ModelSpec name>", "version": V,
//    "base": B | null (an anchor: a full state, no base), "writers": W, "changed": N,
//    "chunks": [{"file": "c3-w1.zst", "bytes": 12345, "xxh3": "<16 hex digits>",
//                "chunk": 3, "writer": 1}, ...],
//    "digest": ["<8 hex digits>", ...]}   (per canonical tensor: DESIGN section 5)
// parse_manifest reads untrusted storage: every key known and present, nothing else (an
// unknown key is refused, so a newer writer cannot be half-understood); integers as JSON
// integers within their limits; a delta's base below its version; chunk files plain names
// (letters, digits, '.', '_', '-'; not starting with '.'; at most 128 bytes), so they resolve
// inside the version directory and nowhere else (no '..', no '/', no absolute path); every
// (writer, chunk) and file once; writers and chunk numbers within range; the digest one per
// canonical tensor of the model the reader holds.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/core/digest.hpp"
#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/hf.hpp"

namespace dte::storage {

inline constexpr std::string_view manifest_format = "dte-manifest-v1";
inline constexpr std::int64_t max_version = std::int64_t{1} << 62;
inline constexpr std::int64_t max_chunks = std::int64_t{1} << 20;
inline constexpr std::int64_t max_chunk_file_bytes = std::int64_t{1} << 40;

struct ChunkEntry {
  std::string file;  // a plain name inside the version directory
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
  std::uint32_t chunk = 0;
  std::uint32_t writer = 0;
  friend bool operator==(const ChunkEntry&, const ChunkEntry&) = default;
};

struct Manifest {
  std::string model;
  Version version = 0;
  Version base = no_version;  // no_version: an anchor
  std::uint32_t writers = 1;
  std::uint64_t changed = 0;
  std::vector<ChunkEntry> chunks;
  std::vector<Digest> digest;  // per canonical tensor
  [[nodiscard]] bool anchor() const noexcept { return base == no_version; }
  friend bool operator==(const Manifest&, const Manifest&) = default;
};

// Chunk and manifest files are plain names (io::plain_file_name): see the top of this file.
using io::max_file_name;
using io::plain_file_name;

namespace detail {

inline std::string hex(std::uint64_t v, int digits) {
  static constexpr char d[] = "0123456789abcdef";
  std::string s(static_cast<std::size_t>(digits), '0');
  for (int i = digits - 1; i >= 0; --i, v >>= 4)
    s[static_cast<std::size_t>(i)] = d[v & 15];
  return s;
}

// Exactly `digits` lowercase hex digits.
inline bool parse_hex(std::string_view s, int digits, std::uint64_t& out) noexcept {
  if (s.size() != static_cast<std::size_t>(digits)) return false;
  out = 0;
  for (const char c : s) {
    const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return false;
    out = out << 4 | static_cast<std::uint64_t>(v);
  }
  return true;
}

// Refuses any key of `obj` not in `known`.
inline void only_keys(const io::JsonReader& r, const nlohmann::json& obj,
                      std::initializer_list<std::string_view> known, const std::string& path) {
  for (const auto& [key, value] : obj.items()) {
    bool ok = false;
    for (std::string_view k : known)
      ok = ok || key == k;
    if (!ok)
      r.fail(io::JsonReader::join(path, key), "is not a field of a dte-manifest-v1 manifest");
  }
}

}  // namespace detail

inline std::string manifest_json(const Manifest& m) {
  nlohmann::json j = nlohmann::json::object();
  j["format"] = manifest_format;
  j["model"] = m.model;
  j["version"] = m.version;
  j["base"] = m.anchor() ? nlohmann::json(nullptr) : nlohmann::json(m.base);
  j["writers"] = m.writers;
  j["changed"] = m.changed;
  nlohmann::json chunks = nlohmann::json::array();
  for (const ChunkEntry& c : m.chunks) {
    chunks.push_back({{"file", c.file},
                      {"bytes", c.bytes},
                      {"xxh3", detail::hex(c.xxh3, 16)},
                      {"chunk", c.chunk},
                      {"writer", c.writer}});
  }
  j["chunks"] = std::move(chunks);
  nlohmann::json digest = nlohmann::json::array();
  for (Digest d : m.digest)
    digest.push_back(detail::hex(d, 8));
  j["digest"] = std::move(digest);
  return j.dump(1) + "\n";
}

// The manifest in `j`, parsed strictly (io::parse_strict) by the caller (`source` names it).
// hf: the reader's model (the name and the digest's length must match it). format_error /
// bounds_error / protocol_error as the top says.
inline Manifest manifest_from_json(const nlohmann::json& j, const std::string& source,
                                   const layout::HfModel& hf) {
  const io::JsonReader r(source);
  if (!j.is_object()) r.fail("", "is not a JSON object");
  detail::only_keys(
      r, j, {"format", "model", "version", "base", "writers", "changed", "chunks", "digest"}, "");
  Manifest m;
  if (r.string(j, "format", "") != manifest_format) {
    r.fail("format", "is not \"" + std::string(manifest_format) + "\" (a newer or foreign writer)");
  }
  m.model = r.string(j, "model", "");
  if (m.model != hf.spec().name) {
    throw protocol_error(source + ": the manifest is for model '" + m.model +
                         "', this reader holds '" + hf.spec().name + "'");
  }
  m.version = static_cast<Version>(r.integer(j, "version", "", 0, max_version));
  const nlohmann::json& base = r.member(j, "base", "");
  if (!base.is_null()) {
    m.base = static_cast<Version>(r.integer(base, "base", 0, max_version));
    if (m.base >= m.version) {
      throw protocol_error(source + ": version " + std::to_string(m.version) + " says base " +
                           std::to_string(m.base) + "; a delta's base comes before it");
    }
  }
  m.writers = static_cast<std::uint32_t>(r.integer(j, "writers", "", 1, limits::world));
  m.changed = static_cast<std::uint64_t>(
      r.integer(j, "changed", "", 0, static_cast<std::int64_t>(limits::model_elements)));
  const nlohmann::json& chunks = r.array(j, "chunks", "", static_cast<std::size_t>(max_chunks));
  std::set<std::pair<std::uint32_t, std::uint32_t>> slots;
  std::set<std::string> files;
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const std::string path = "chunks[" + std::to_string(k) + "]";
    const nlohmann::json& c = chunks[k];
    if (!c.is_object()) r.fail(path, "is not an object");
    detail::only_keys(r, c, {"file", "bytes", "xxh3", "chunk", "writer"}, path);
    ChunkEntry e;
    e.file = r.string(c, "file", path);
    if (!plain_file_name(e.file)) {
      throw bounds_error(source + ": " + path + ".file \"" + e.file.substr(0, 200) +
                             "\" is not a plain file name (letters, digits, '.', '_', '-'; not "
                             "starting with '.'; at most 128 bytes): chunks live inside the "
                             "version directory",
                         about(source, path + ".file"));
    }
    e.bytes = static_cast<std::uint64_t>(r.integer(c, "bytes", path, 1, max_chunk_file_bytes));
    if (!detail::parse_hex(r.string(c, "xxh3", path), 16, e.xxh3)) {
      r.fail(path + ".xxh3", "is not 16 lowercase hex digits");
    }
    e.chunk = static_cast<std::uint32_t>(r.integer(c, "chunk", path, 0, max_chunks - 1));
    e.writer = static_cast<std::uint32_t>(
        r.integer(c, "writer", path, 0, static_cast<std::int64_t>(m.writers) - 1));
    if (!slots.insert({e.writer, e.chunk}).second) {
      throw protocol_error(source + ": " + path + " repeats writer " + std::to_string(e.writer) +
                           " chunk " + std::to_string(e.chunk));
    }
    if (!files.insert(e.file).second) {
      throw protocol_error(source + ": " + path + " names file " + e.file + " a second time");
    }
    m.chunks.push_back(std::move(e));
  }
  const nlohmann::json& digest =
      r.array(j, "digest", "", static_cast<std::size_t>(limits::model_tensors));
  if (digest.size() != static_cast<std::size_t>(hf.size())) {
    throw protocol_error(source + ": the digest lists " + std::to_string(digest.size()) +
                         " tensors, the model has " + std::to_string(hf.size()));
  }
  for (std::size_t t = 0; t < digest.size(); ++t) {
    const std::string path = "digest[" + std::to_string(t) + "]";
    std::uint64_t d = 0;
    if (!digest[t].is_string() || !detail::parse_hex(digest[t].get<std::string>(), 8, d)) {
      r.fail(path, "is not 8 lowercase hex digits");
    }
    m.digest.push_back(static_cast<Digest>(d));
  }
  return m;
}

// The same from its text.
inline Manifest parse_manifest(std::string_view text, const std::string& source,
                               const layout::HfModel& hf) {
  return manifest_from_json(io::parse_strict(text, source, "manifest", 4), source, hf);
}

}  // namespace dte::storage
