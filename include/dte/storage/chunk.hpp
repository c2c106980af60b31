// SPDX-License-Identifier: Apache-2.0
// Canonical sparse chunks (issue 12, first piece: the codec): the changed elements of a version
// as HF tensor names, indices in the unsharded HF tensor and BF16 bits with overwrite semantics,
// so a reader of any topology can apply them. A chunk is a safetensors container compressed as
// a whole with zstd (`zstd -d` and any safetensors reader open it); per HF tensor it holds
//   "<name>:index"  U8 [k]     the sorted indices, gap-coded (put_gaps): one byte per gap below
//                              255, else 255 and the gap as a little-endian u32;
//   "<name>:value"  U8 [2, n]  the n values' BF16 bits as two byte planes (high bytes, then low
//                              bytes: the exponent-carrying bytes compress together);
// and in __metadata__: dte.format = "chunk-v1", dte.version, dte.base, dte.chunk (its number in
// the version), dte.writer (the trainer rank), dte.encoding = "value". The zstd frame carries a
// content checksum (a flipped bit fails decompression); the manifest that lists a chunk adds its
// size and xxh3-64 (checksum()).
//
// decode_chunk refuses, before returning anything: a frame that does not state its size or
// states more than max_decoded_bytes (no allocation first), a size that does not match, a
// safetensors file the strict parser refuses, foreign or missing metadata, a header other than
// the expected one (a chunk of another version or slot), unknown tensor names, an index without
// its values or the reverse, wrong dtypes or shapes, gap streams that end early or late,
// indices at or beyond the tensor's size. Indices are strictly increasing by construction.
#pragma once

#include <zstd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dte/bounds.hpp"
#include "dte/engine/message.hpp"
#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"

namespace dte::storage {

// The largest chunk a reader decompresses (a frame stating more is refused unread).
inline constexpr std::uint64_t max_decoded_bytes = std::uint64_t{1} << 30;
inline constexpr std::string_view chunk_format = "chunk-v1";

// The changed elements of one HF tensor: strictly increasing indices, their BF16 bits.
struct TensorDelta {
  std::int64_t tensor = -1;  // HfModel id
  std::vector<std::uint32_t> index;
  std::vector<std::uint16_t> bits;
  friend bool operator==(const TensorDelta&, const TensorDelta&) = default;
};

struct ChunkHeader {
  Version version = 0;
  Version base = no_version;  // the version the delta applies to (no_version: an anchor)
  std::uint32_t chunk = 0;    // its number within the version
  std::uint32_t writer = 0;   // the trainer rank that wrote it
  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

struct Chunk {
  ChunkHeader header;
  std::vector<TensorDelta> tensors;  // at most one per HF tensor
};

// xxh3-64 of a chunk's bytes, as the manifest records it.
inline std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
}

// ---- The index gap code ----

// Appends the gap code of `sorted` (strictly increasing): the first index itself, then each
// index minus the previous minus one; below 255 one byte, else 255 and four bytes.
inline void put_gaps(std::span<const std::uint32_t> sorted, std::vector<std::uint8_t>& out) {
  std::uint64_t next = 0;  // the smallest index the next one may be
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    if (sorted[k] < next) {
      throw invalid_argument("dte::storage::put_gaps: index " + std::to_string(sorted[k]) +
                             " at position " + std::to_string(k) +
                             " does not follow the previous one; sort and deduplicate first");
    }
    const std::uint64_t gap = sorted[k] - next;
    if (gap < 255) {
      out.push_back(static_cast<std::uint8_t>(gap));
    } else {
      out.push_back(255);
      for (int b = 0; b < 4; ++b)
        out.push_back(static_cast<std::uint8_t>(gap >> (8 * b)));
    }
    next = std::uint64_t{sorted[k]} + 1;
  }
}

// Decodes exactly `count` indices from `in` (every byte used), each below `numel`; format_error
// naming `where` otherwise.
inline std::vector<std::uint32_t> get_gaps(std::span<const std::uint8_t> in, std::uint64_t count,
                                           std::uint64_t numel, const std::string& where) {
  if (count > in.size()) {
    throw format_error(where + ": " + std::to_string(count) + " values but only " +
                       std::to_string(in.size()) + " index bytes (each index takes at least one)");
  }
  std::vector<std::uint32_t> out;
  out.reserve(static_cast<std::size_t>(count));
  std::uint64_t next = 0;
  std::size_t at = 0;
  for (std::uint64_t k = 0; k < count; ++k) {
    if (at >= in.size()) {
      throw format_error(where + ": the index stream ends after " + std::to_string(k) + " of " +
                         std::to_string(count) + " indices");
    }
    std::uint64_t gap = in[at++];
    if (gap == 255) {
      if (in.size() - at < 4) {
        throw format_error(where + ": index " + std::to_string(k) +
                           " is escaped but the stream ends inside its four bytes");
      }
      gap = 0;
      for (int b = 0; b < 4; ++b)
        gap |= std::uint64_t{in[at++]} << (8 * b);
    }
    const std::uint64_t index = next + gap;
    if (index >= numel) {
      throw format_error(where + ": index " + std::to_string(index) + " (entry " +
                         std::to_string(k) + ") is outside the tensor's " + std::to_string(numel) +
                         " elements");
    }
    out.push_back(static_cast<std::uint32_t>(index));
    next = index + 1;
  }
  if (at != in.size()) {
    throw format_error(where + ": " + std::to_string(in.size() - at) +
                       " bytes follow the last of the " + std::to_string(count) + " indices");
  }
  return out;
}

namespace detail {

inline std::string metadata_or_refuse(const std::map<std::string, std::string>& m,
                                      const std::string& key, const std::string& source) {
  const auto it = m.find(key);
  if (it == m.end()) {
    throw format_error(source + ": __metadata__ lacks '" + key + "'; not a dte chunk");
  }
  return it->second;
}

inline std::uint64_t metadata_u64(const std::map<std::string, std::string>& m,
                                  const std::string& key, const std::string& source) {
  const std::string text = metadata_or_refuse(m, key, source);
  std::uint64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ptr != end || ec != std::errc{}) {
    throw format_error(source + ": __metadata__ '" + key + "' is \"" + text +
                       "\", not an unsigned 64-bit decimal");
  }
  return v;
}

}  // namespace detail

// ---- Encode and decode ----

// The chunk's compressed bytes. zstd_level: 1 (fast) to 19.
inline std::vector<std::byte> encode_chunk(const layout::HfModel& hf, const Chunk& c,
                                           int zstd_level = 3) {
  if (zstd_level < 1 || zstd_level > ZSTD_maxCLevel()) {
    throw invalid_argument("dte::storage::encode_chunk: zstd level " + std::to_string(zstd_level) +
                           " is outside 1.." + std::to_string(ZSTD_maxCLevel()));
  }
  io::SafetensorsWriter w;
  w.set_metadata("dte.format", std::string(chunk_format));
  w.set_metadata("dte.version", std::to_string(c.header.version));
  w.set_metadata("dte.base", std::to_string(c.header.base));
  w.set_metadata("dte.chunk", std::to_string(c.header.chunk));
  w.set_metadata("dte.writer", std::to_string(c.header.writer));
  w.set_metadata("dte.encoding", "value");
  for (const TensorDelta& t : c.tensors) {
    if (t.tensor < 0 || t.tensor >= hf.size()) {
      throw invalid_argument("dte::storage::encode_chunk: tensor id " + std::to_string(t.tensor) +
                             " is not one of the model's " + std::to_string(hf.size()));
    }
    const std::string name = hf.name(t.tensor);
    if (t.index.size() != t.bits.size()) {
      throw invalid_argument("dte::storage::encode_chunk: " + name + " has " +
                             std::to_string(t.index.size()) + " indices but " +
                             std::to_string(t.bits.size()) + " values");
    }
    if (!t.index.empty() &&
        std::uint64_t{t.index.back()} >= static_cast<std::uint64_t>(hf[t.tensor].numel())) {
      throw invalid_argument("dte::storage::encode_chunk: " + name + " index " +
                             std::to_string(t.index.back()) + " is outside its " +
                             std::to_string(hf[t.tensor].numel()) + " elements");
    }
    std::vector<std::uint8_t> gaps;
    put_gaps(t.index, gaps);
    std::vector<std::uint8_t> planes(2 * t.bits.size());
    for (std::size_t k = 0; k < t.bits.size(); ++k) {
      planes[k] = static_cast<std::uint8_t>(t.bits[k] >> 8);
      planes[t.bits.size() + k] = static_cast<std::uint8_t>(t.bits[k]);
    }
    w.add<std::uint8_t>(name + ":index", {gaps.size()}, gaps, io::DType::U8);
    w.add<std::uint8_t>(name + ":value", {2, t.bits.size()}, planes, io::DType::U8);
  }
  const std::vector<std::byte> plain = w.serialize();
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  if (cctx == nullptr) throw error("dte::storage::encode_chunk: zstd could not allocate a context");
  std::vector<std::byte> out(ZSTD_compressBound(plain.size()));
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, zstd_level);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
  const std::size_t n = ZSTD_compress2(cctx, out.data(), out.size(), plain.data(), plain.size());
  ZSTD_freeCCtx(cctx);
  if (ZSTD_isError(n)) {
    throw error(std::string("dte::storage::encode_chunk: zstd failed: ") + ZSTD_getErrorName(n));
  }
  out.resize(n);
  return out;
}

// The chunk in `bytes` (as read from storage; `source` names it in errors). expect: the header
// the manifest says this chunk has (null: any); max_bytes: the decompressed size refused
// unread. Refuses everything the header comment lists.
inline Chunk decode_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                          const std::string& source, const ChunkHeader* expect = nullptr,
                          std::uint64_t max_bytes = max_decoded_bytes) {
  const unsigned long long size = ZSTD_getFrameContentSize(bytes.data(), bytes.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    throw format_error(source + ": not a zstd frame (" + std::to_string(bytes.size()) +
                       " bytes); not a dte chunk, or a truncated one");
  }
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
    throw format_error(source +
                       ": the zstd frame does not state its decompressed size; dte "
                       "chunks always do");
  }
  if (size > max_bytes) {
    throw bounds_error(source + ": the zstd frame decompresses to " + std::to_string(size) +
                       " bytes, over the chunk limit of " + std::to_string(max_bytes));
  }
  std::vector<std::byte> plain(static_cast<std::size_t>(size));
  const std::size_t got = ZSTD_decompress(plain.data(), plain.size(), bytes.data(), bytes.size());
  if (ZSTD_isError(got)) {
    throw format_error(source + ": zstd refused the chunk (" + ZSTD_getErrorName(got) +
                       "); it is corrupt or truncated");
  }
  if (got != plain.size()) {
    throw format_error(source + ": the zstd frame stated " + std::to_string(size) +
                       " bytes but decompressed to " + std::to_string(got));
  }
  const io::SafetensorsFile file = io::SafetensorsFile::parse(std::move(plain), source);
  const auto& meta = file.metadata();
  if (detail::metadata_or_refuse(meta, "dte.format", source) != chunk_format) {
    throw format_error(source + ": dte.format is \"" + meta.at("dte.format") + "\", this reader " +
                       "reads \"" + std::string(chunk_format) + "\"");
  }
  if (detail::metadata_or_refuse(meta, "dte.encoding", source) != "value") {
    throw format_error(source + ": dte.encoding \"" + meta.at("dte.encoding") +
                       "\" is not one this reader applies (value)");
  }
  Chunk c;
  c.header.version = detail::metadata_u64(meta, "dte.version", source);
  c.header.base = detail::metadata_u64(meta, "dte.base", source);
  const std::uint64_t chunk = detail::metadata_u64(meta, "dte.chunk", source);
  const std::uint64_t writer = detail::metadata_u64(meta, "dte.writer", source);
  if (chunk > 0xFFFFFFFFull || writer > 0xFFFFFFFFull) {
    throw bounds_error(source + ": dte.chunk or dte.writer does not fit 32 bits");
  }
  c.header.chunk = static_cast<std::uint32_t>(chunk);
  c.header.writer = static_cast<std::uint32_t>(writer);
  if (expect != nullptr && !(c.header == *expect)) {
    throw protocol_error(
        source + ": the chunk says version " + std::to_string(c.header.version) + " base " +
        std::to_string(c.header.base) + " chunk " + std::to_string(c.header.chunk) + " writer " +
        std::to_string(c.header.writer) + ", the manifest expects version " +
        std::to_string(expect->version) + " base " + std::to_string(expect->base) + " chunk " +
        std::to_string(expect->chunk) + " writer " + std::to_string(expect->writer) +
        " (a chunk of another version or slot in its place)");
  }
  std::map<std::string, std::int64_t, std::less<>> ids;
  for (std::int64_t t = 0; t < hf.size(); ++t)
    ids.emplace(hf.name(t), t);
  for (const io::TensorInfo& info : file.tensors()) {
    const auto colon = info.name.rfind(':');
    const std::string_view suffix =
        colon == std::string::npos ? std::string_view{} : std::string_view(info.name).substr(colon);
    if (suffix != ":index" && suffix != ":value") {
      throw format_error(source + ": tensor '" + info.name +
                         "' is neither '<name>:index' nor '<name>:value'");
    }
    const std::string name = info.name.substr(0, colon);
    if (!ids.contains(name)) {
      throw format_error(source + ": tensor '" + name + "' is not a tensor of " + hf.spec().name);
    }
    const char* other = suffix == ":index" ? ":value" : ":index";
    if (file.find(name + other) == nullptr) {
      throw format_error(source + ": '" + info.name + "' without '" + name + other + "'");
    }
  }
  for (const io::TensorInfo& info : file.tensors()) {
    if (!info.name.ends_with(":index")) continue;
    const std::string name = info.name.substr(0, info.name.size() - 6);
    const io::TensorInfo& values = file.at(name + ":value");
    const std::string where = source + ": " + name;
    if (info.dtype != io::DType::U8 || info.shape.size() != 1 || values.dtype != io::DType::U8 ||
        values.shape.size() != 2 || values.shape[0] != 2) {
      throw format_error(where + ": ':index' must be U8 [k] and ':value' U8 [2, n]");
    }
    const std::int64_t id = ids.find(name)->second;
    const std::uint64_t n = values.shape[1];
    const auto gap_bytes = file.bytes(info);
    TensorDelta t;
    t.tensor = id;
    t.index = get_gaps({reinterpret_cast<const std::uint8_t*>(gap_bytes.data()), gap_bytes.size()},
                       n, static_cast<std::uint64_t>(hf[id].numel()), where);
    const auto planes = file.bytes(values);
    t.bits.resize(static_cast<std::size_t>(n));
    for (std::size_t k = 0; k < t.bits.size(); ++k) {
      t.bits[k] =
          static_cast<std::uint16_t>((std::to_integer<std::uint16_t>(planes[k]) << 8) |
                                     std::to_integer<std::uint16_t>(planes[t.bits.size() + k]));
    }
    c.tensors.push_back(std::move(t));
  }
  return c;
}

}  // namespace dte::storage
