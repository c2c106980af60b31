// SPDX-License-Identifier: Apache-2.0
// An FP8 part: what one sender writes into one TP rank of an online-FP8 engine in one
// publication (docs/fp8.md): in an FP8 publication message one part per rank
// (publication/message.hpp), in the engine one per (trainer rank, receiver) attached to its wire
// v2 message (engine/wire.hpp). Unlike a chunk (storage/chunk.hpp), which is canonical, a part
// is in the rank's own coordinates, because a code depends on the block the rank's weight puts
// the element in. Little-endian, no padding (docs/fp8.md, "The FP8 part"):
//
//   u32 magic "dte8" | u32 recipe (1: fp8-block) | u64 version | u64 base | u32 rank |
//   u32 tensors T | then T times:
//     u32 tensor id (serving layout) | u32 n codes | u32 m scales | u32 index bytes |
//     u32 block bytes | index gap code (n offsets, ascending; core/gap_code.hpp) | n codes |
//     block gap code (m blocks, ascending) | m FP32 scales
//
// Tensors appear in ascending id order, each at most once. decode_fp8_part refuses, before
// returning anything, every length that runs past the part, a foreign magic, recipe or header,
// an id that is not a quantized tensor of the layout, tensors out of order, gap streams that end
// early or late, offsets or blocks beyond their tensor's, and trailing bytes. No dependency
// beyond the gap code: the engine attaches parts on any transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "dte/core/gap_code.hpp"
#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"

namespace dte::receive {

inline constexpr std::uint32_t fp8_part_magic = 0x38657464u;  // "dte8"

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

// The recipes a part names (detect/fp8.hpp): 1 is VllmBlockFp8.
inline std::uint32_t fp8_recipe_id(std::string_view name) {
  if (name == "fp8-block") return 1;
  throw unsupported("FP8 part: no recipe \"" + std::string(name) + "\" (docs/fp8.md)");
}

namespace part_io {

template <class T>
void put_le(std::vector<std::byte>& out, T v) {
  const std::size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

class Reader {
 public:
  Reader(std::span<const std::byte> in, const std::string& source) : in_(in), source_(source) {}
  template <class T>
  T get(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof v, what).data(), sizeof v);
    return v;
  }
  std::span<const std::byte> take(std::uint64_t n, const char* what) {
    if (n > in_.size() - at_) {
      throw format_error(source_ + ": " + what + " of " + std::to_string(n) +
                         " bytes runs past the part's end (truncated)");
    }
    const auto s = in_.subspan(at_, static_cast<std::size_t>(n));
    at_ += static_cast<std::size_t>(n);
    return s;
  }
  [[nodiscard]] bool done() const noexcept { return at_ == in_.size(); }

 private:
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
  const std::string& source_;
};

inline std::span<const std::uint8_t> as_u8(std::span<const std::byte> b) noexcept {
  return {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()};
}

}  // namespace part_io

inline std::vector<std::byte> encode_fp8_part(const layout::Fp8Grid& grid, std::string_view recipe,
                                              const Fp8Part& p) {
  std::vector<std::byte> out;
  part_io::put_le(out, fp8_part_magic);
  part_io::put_le(out, fp8_recipe_id(recipe));
  part_io::put_le(out, p.header.version);
  part_io::put_le(out, p.header.base);
  part_io::put_le(out, p.header.rank);
  part_io::put_le(out, static_cast<std::uint32_t>(p.tensors.size()));
  std::vector<std::uint8_t> index, block;
  std::int64_t previous = -1;
  for (const Fp8Writes& t : p.tensors) {
    if (t.tensor <= previous || t.tensor >= grid.layout().size() || !grid.quantized(t.tensor) ||
        t.index.size() != t.code.size() || t.block.size() != t.scale.size()) {
      throw invalid_argument("encode_fp8_part: tensor " + std::to_string(t.tensor) +
                             " is out of order, not quantized, or its lists differ in length");
    }
    previous = t.tensor;
    index.clear();
    block.clear();
    put_gaps(t.index, index);
    put_gaps(t.block, block);
    part_io::put_le(out, static_cast<std::uint32_t>(t.tensor));
    part_io::put_le(out, static_cast<std::uint32_t>(t.code.size()));
    part_io::put_le(out, static_cast<std::uint32_t>(t.scale.size()));
    part_io::put_le(out, static_cast<std::uint32_t>(index.size()));
    part_io::put_le(out, static_cast<std::uint32_t>(block.size()));
    const auto append = [&](const void* data, std::size_t n) {
      const std::size_t at = out.size();
      out.resize(at + n);
      if (n != 0) std::memcpy(out.data() + at, data, n);
    };
    append(index.data(), index.size());
    append(t.code.data(), t.code.size());
    append(block.data(), block.size());
    append(t.scale.data(), 4 * t.scale.size());
  }
  return out;
}

// The part in `bytes`, checked against `grid` and the header the message implies.
inline Fp8Part decode_fp8_part(const layout::Fp8Grid& grid, std::string_view recipe,
                               std::span<const std::byte> bytes, const std::string& source,
                               const Fp8PartHeader& expect) {
  const layout::ServingLayout& l = grid.layout();
  part_io::Reader r(bytes, source);
  if (r.get<std::uint32_t>("the magic") != fp8_part_magic) {
    throw format_error(source + ": not an FP8 part (bad magic)");
  }
  if (r.get<std::uint32_t>("the recipe") != fp8_recipe_id(recipe)) {
    throw format_error(source + ": quantized by another recipe than this receiver's \"" +
                       std::string(recipe) + "\"");
  }
  Fp8Part p;
  p.header.version = r.get<Version>("the version");
  p.header.base = r.get<Version>("the base");
  p.header.rank = r.get<std::uint32_t>("the rank");
  if (p.header != expect) {
    throw format_error(source + ": the part says version " + std::to_string(p.header.version) +
                       " on " + std::to_string(p.header.base) + " for rank " +
                       std::to_string(p.header.rank) + ", its message " +
                       std::to_string(expect.version) + " on " + std::to_string(expect.base) +
                       " for rank " + std::to_string(expect.rank));
  }
  const auto tensors = r.get<std::uint32_t>("the tensor count");
  std::int64_t previous = -1;
  for (std::uint32_t k = 0; k < tensors; ++k) {
    Fp8Writes w;
    w.tensor = r.get<std::uint32_t>("a tensor id");
    if (w.tensor <= previous || w.tensor >= l.size() || !grid.quantized(w.tensor)) {
      throw format_error(source + ": tensor id " + std::to_string(w.tensor) + " (entry " +
                         std::to_string(k) +
                         ") is not the next quantized tensor of this layout in ascending order");
    }
    previous = w.tensor;
    const std::string name = source + " " + l.name(w.tensor);
    const layout::BlockGrid& g = grid.grid(w.tensor);
    const auto n = r.get<std::uint32_t>("a code count");
    const auto m = r.get<std::uint32_t>("a scale count");
    const auto index_bytes = r.get<std::uint32_t>("an index length");
    const auto block_bytes = r.get<std::uint32_t>("a block length");
    w.index = get_gaps(part_io::as_u8(r.take(index_bytes, "the index code")), n,
                       static_cast<std::uint64_t>(g.numel()), name + " offsets");
    const auto codes = part_io::as_u8(r.take(n, "the codes"));
    w.code.assign(codes.begin(), codes.end());
    w.block = get_gaps(part_io::as_u8(r.take(block_bytes, "the block code")), m,
                       static_cast<std::uint64_t>(g.blocks()), name + " blocks");
    const auto scales = r.take(std::uint64_t{4} * m, "the scales");
    w.scale.resize(m);
    if (m != 0) std::memcpy(w.scale.data(), scales.data(), scales.size());
    p.tensors.push_back(std::move(w));
  }
  if (!r.done()) throw format_error(source + ": bytes follow the part's last tensor");
  return p;
}

}  // namespace dte::receive
