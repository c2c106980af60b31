// SPDX-License-Identifier: Apache-2.0
// An FP8 part: what one TP rank of an online-FP8 engine writes for one publication
// (docs/fp8.md). Unlike a chunk (storage/chunk.hpp), which is canonical, a part is in the rank's
// own coordinates, because a code depends on the block the rank's weight puts the element in.
// Per quantized serving tensor (layout/fp8_grid.hpp) it holds
//   "<name>:index"  U8 [k]  the local offsets written, ascending, gap-coded as a chunk's indices
//   "<name>:code"   U8 [n]  their E4M3FN codes
//   "<name>:block"  U8 [j]  the blocks whose scale is written, ascending, gap-coded
//   "<name>:scale"  F32 [m] their new scales (weight_scale_inv)
// with __metadata__ dte.format = "fp8-part-v1", dte.version, dte.base, dte.rank, dte.recipe (the
// recipe's name), as a safetensors file in one zstd frame. decode_fp8_part refuses, before
// returning anything, what decode_chunk refuses (sizes, strict safetensors, foreign metadata or
// header, unknown names, missing companions, dtypes, shapes, gap streams, indices out of range),
// and an offset or block beyond its tensor's.
#pragma once

#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/gap_code.hpp"

namespace dte::storage {

inline constexpr std::string_view fp8_part_format = "fp8-part-v1";

// One quantized tensor's writes.
struct Fp8Writes {
  std::int64_t tensor = -1;          // serving tensor id
  std::vector<std::uint32_t> index;  // local offsets, ascending
  std::vector<std::uint8_t> code;    // per offset
  std::vector<std::uint32_t> block;  // blocks, ascending
  std::vector<float> scale;          // per block
  friend bool operator==(const Fp8Writes&, const Fp8Writes&) = default;
};

struct Fp8PartHeader {
  Version version = 0;
  Version base = no_version;
  std::uint32_t rank = 0;
  friend bool operator==(const Fp8PartHeader&, const Fp8PartHeader&) = default;
};

struct Fp8Part {
  Fp8PartHeader header;
  std::vector<Fp8Writes> tensors;  // ascending tensor id, each once
};

inline std::vector<std::byte> encode_fp8_part(const layout::Fp8Grid& grid, std::string_view recipe,
                                              const Fp8Part& p, int zstd_level) {
  const layout::ServingLayout& l = grid.layout();
  io::SafetensorsWriter w;
  w.set_metadata("dte.format", std::string(fp8_part_format));
  w.set_metadata("dte.version", std::to_string(p.header.version));
  w.set_metadata("dte.base", std::to_string(p.header.base));
  w.set_metadata("dte.rank", std::to_string(p.header.rank));
  w.set_metadata("dte.recipe", std::string(recipe));
  std::vector<std::uint8_t> gaps;
  for (const Fp8Writes& t : p.tensors) {
    const std::string name = l.name(t.tensor);
    if (!grid.quantized(t.tensor) || t.index.size() != t.code.size() ||
        t.block.size() != t.scale.size()) {
      throw invalid_argument("encode_fp8_part: tensor " + name +
                             " is not quantized or its lists differ in length");
    }
    gaps.clear();
    put_gaps(t.index, gaps);
    w.add<std::uint8_t>(name + ":index", {gaps.size()}, gaps);
    w.add<std::uint8_t>(name + ":code", {t.code.size()}, t.code);
    gaps.clear();
    put_gaps(t.block, gaps);
    w.add<std::uint8_t>(name + ":block", {gaps.size()}, gaps);
    w.add<float>(name + ":scale", {t.scale.size()}, t.scale);
  }
  const std::vector<std::byte> plain = w.serialize();
  std::vector<std::byte> out(ZSTD_compressBound(plain.size()));
  const std::size_t n =
      ZSTD_compress(out.data(), out.size(), plain.data(), plain.size(), zstd_level);
  if (ZSTD_isError(n)) {
    throw error(std::string("dte::storage::encode_fp8_part: zstd failed: ") + ZSTD_getErrorName(n));
  }
  out.resize(n);
  return out;
}

// The part in `bytes`, checked against `grid` and the header the message implies.
inline Fp8Part decode_fp8_part(const layout::Fp8Grid& grid, std::string_view recipe,
                               std::span<const std::byte> bytes, const std::string& source,
                               const Fp8PartHeader& expect) {
  const layout::ServingLayout& l = grid.layout();
  io::SafetensorsFile file = io::SafetensorsFile::parse(decompress_frames(bytes, source), source);
  const auto& meta = file.metadata();
  if (detail::metadata_or_refuse(meta, "dte.format", source) != fp8_part_format) {
    throw format_error(source + ": not an FP8 part (dte.format is not \"fp8-part-v1\")");
  }
  if (detail::metadata_or_refuse(meta, "dte.recipe", source) != recipe) {
    throw format_error(source + ": quantized by recipe \"" + meta.at("dte.recipe") +
                       "\", this receiver serves \"" + std::string(recipe) + "\"");
  }
  Fp8Part p;
  p.header.version = detail::metadata_u64(meta, "dte.version", source);
  p.header.base = detail::metadata_u64(meta, "dte.base", source);
  const std::uint64_t rank = detail::metadata_u64(meta, "dte.rank", source);
  p.header.rank = static_cast<std::uint32_t>(rank);
  if (rank != expect.rank || p.header.version != expect.version || p.header.base != expect.base) {
    throw format_error(source + ": the part says version " + std::to_string(p.header.version) +
                       " on " + std::to_string(p.header.base) + " for rank " +
                       std::to_string(rank) + ", the message " + std::to_string(expect.version) +
                       " on " + std::to_string(expect.base) + " for rank " +
                       std::to_string(expect.rank));
  }
  if (meta.size() != 5) throw format_error(source + ": unknown keys in __metadata__");
  std::map<std::string, std::int64_t, std::less<>> ids;
  for (std::int64_t id : grid.quantized_ids())
    ids.emplace(l.name(id), id);
  std::map<std::int64_t, int> parts_seen;  // per tensor: how many of its four tensors
  const auto u8 = [&](const io::TensorInfo& t) {
    const std::span<const std::byte> b = file.bytes(t);
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
  };
  for (const io::TensorInfo& t : file.tensors()) {
    const auto colon = t.name.rfind(':');
    const std::string base = colon == std::string::npos ? t.name : t.name.substr(0, colon);
    const auto it = ids.find(base);
    const std::string field = colon == std::string::npos ? "" : t.name.substr(colon + 1);
    if (it == ids.end() ||
        (field != "index" && field != "code" && field != "block" && field != "scale")) {
      throw format_error(source + ": tensor '" + t.name +
                         "' is not a part of a quantized tensor of this layout");
    }
    const io::DType want = field == "scale" ? io::DType::F32 : io::DType::U8;
    if (t.dtype != want || t.shape.size() != 1) {
      throw format_error(source + ": tensor '" + t.name + "' is not " +
                         std::string(io::dtype_name(want)) + " of one dimension");
    }
    ++parts_seen[it->second];
  }
  for (const auto& [id, n] : parts_seen) {
    const std::string name = l.name(id);
    if (n != 4) {
      throw format_error(source + ": " + name + " lacks one of :index, :code, :block, :scale");
    }
    const layout::BlockGrid& g = grid.grid(id);
    Fp8Writes w;
    w.tensor = id;
    const io::TensorInfo& code = file.at(name + ":code");
    const io::TensorInfo& scale = file.at(name + ":scale");
    w.index = get_gaps(u8(file.at(name + ":index")), code.numel(),
                       static_cast<std::uint64_t>(g.numel()), source + " " + name + ":index");
    w.code.assign(u8(code).begin(), u8(code).end());
    w.block = get_gaps(u8(file.at(name + ":block")), scale.numel(),
                       static_cast<std::uint64_t>(g.blocks()), source + " " + name + ":block");
    w.scale.resize(static_cast<std::size_t>(scale.numel()));
    if (!w.scale.empty()) std::memcpy(w.scale.data(), file.bytes(scale).data(), 4 * w.scale.size());
    p.tensors.push_back(std::move(w));
  }
  return p;
}

}  // namespace dte::storage
