// SPDX-License-Identifier: Apache-2.0
// Canonical sparse chunks (issue 12: the codec): the changed elements of a version as HF tensor
// names, indices in the unsharded HF tensor and BF16 bits with overwrite semantics, so a reader
// of any topology can apply them. A chunk is a safetensors container compressed with zstd
// (`zstd -d` and any safetensors reader open it); per HF tensor it holds
//   "<name>:index"     U8 [k]  the sorted indices, gap-coded (put_gaps): a gap below 255 in one
//                              byte, else 255 and a little-endian u16, and from 65535 on that
//                              u16 = 65535 followed by the gap as a u32;
//   "<name>:value_hi"  U8 [n]  the high bytes of the n values' BF16 bits (sign, exponent);
//   "<name>:value_lo"  U8 [n]  their low bytes (last exponent bit, mantissa);
// and in __metadata__: dte.format = "chunk-v1", dte.version, dte.base, dte.chunk (its number in
// the version), dte.writer (the trainer rank), dte.encoding = "value" (the new bits) or "diff"
// (the new bits as a step from those of the base version: storage/value_code.hpp; Encoding), and
// for a diff chunk optionally dte.index = "classes": the indices coded against the base version's
// values instead (storage/class_index.hpp; IndexCode), decoded only with the base at hand. The
// file is cut into up to
// four zstd frames, the safetensors header, then every tensor's indices, every high byte,
// every low byte (the data are laid out in that order): streams of one kind compress together
// (about 15% smaller than one frame over interleaved streams), and `zstd -d` concatenates the
// frames back into the one file. Each frame states its size and carries a
// content checksum (a flipped bit fails decompression); the manifest that lists a chunk adds
// its size and xxh3-64 (checksum()).
//
// decode_chunk refuses, before returning anything: more than max_frames frames, a frame that
// does not state its size or sizes summing over max_decoded_bytes (no allocation first), a size
// that does not match, a safetensors file the strict parser refuses, foreign or missing
// metadata, a header other than the expected one (a chunk of another version or slot), unknown
// tensor names, a tensor without its two companions, wrong dtypes or shapes, gap streams that
// end early or late, indices at or beyond the tensor's size. Indices are strictly increasing by
// construction.
#pragma once

#include <zstd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "dte/bounds.hpp"
#include "dte/core/gap_code.hpp"
#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/class_index.hpp"
#include "dte/storage/value_code.hpp"

namespace dte::storage {

// The largest chunk a reader decompresses (a frame stating more is refused unread).
inline constexpr std::uint64_t max_decoded_bytes = std::uint64_t{1} << 30;
inline constexpr std::string_view chunk_format = "chunk-v1";
// The most zstd frames a chunk may hold (dte writes three).
inline constexpr std::size_t max_frames = 16;

// The changed elements of one HF tensor: strictly increasing indices, their BF16 bits.
struct TensorDelta {
  std::int64_t tensor = -1;  // HfModel id
  std::vector<std::uint32_t> index;
  std::vector<std::uint16_t> bits;
  // To write a class index (IndexCode::classes; storage/class_index.hpp), per index its base
  // class (or unknown_class), the positions the writer owns in the entry's range and those of
  // them another chunk writes. Decoding leaves them empty.
  std::vector<std::int16_t> cls{};
  std::vector<DomainGroup> domain{};
  std::vector<std::uint32_t> skip{};
  friend bool operator==(const TensorDelta& a, const TensorDelta& b) {
    return a.tensor == b.tensor && a.index == b.index && a.bits == b.bits;
  }
};

// How a chunk's indices are coded: plain (sorted gaps), or classes (the gaps among positions
// of one base value class: storage/class_index.hpp; only a reader holding whole tensors of the
// base can decode those, and only a diff chunk has them).
enum class IndexCode : std::uint8_t { plain, classes };

// The bits a class index is coded against: bits(tensor, start, count, out) writes those of
// positions [start, start + count) of HF tensor `tensor` in the base version (the writer: its
// current weights, at the positions it does not send; a reader: what it holds before applying
// anything of the version).
class ClassBase {
 public:
  virtual void bits(std::int64_t tensor, std::uint64_t start, std::uint64_t count,
                    std::uint16_t* out) const = 0;

 protected:
  ~ClassBase() = default;
};

struct ChunkHeader {
  Version version = 0;
  Version base = no_version;  // the version the delta applies to (no_version: an anchor)
  std::uint32_t chunk = 0;    // its number within the version
  std::uint32_t writer = 0;   // the trainer rank that wrote it
  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

// What a chunk's 16-bit values are: the new bits (overwrite), or their diff code against the
// bits of the base version (storage/value_code.hpp: a reader applies those only on exactly the
// base version, which the version chain guarantees; a small change has a small code, so they
// compress far better).
enum class Encoding : std::uint8_t { value, diff };

inline std::string_view encoding_name(Encoding e) noexcept {
  return e == Encoding::value ? "value" : "diff";
}

// The new bits of an element a chunk of encoding e stores as `stored`, given the bits `held`
// of the base version (unused for value).
DTE_HOST_DEVICE constexpr std::uint16_t decode_value(Encoding e, std::uint16_t held,
                                                     std::uint16_t stored) noexcept {
  return e == Encoding::diff ? diff_apply(held, stored) : stored;
}

// A ClassBase over whole HF tensors of 16-bit values (in HfModel order).
template <class Tensors>
class TensorsBase final : public ClassBase {
 public:
  explicit TensorsBase(const Tensors& tensors) : tensors_(&tensors) {}
  void bits(std::int64_t tensor, std::uint64_t start, std::uint64_t count,
            std::uint16_t* out) const override {
    const auto& t = (*tensors_)[static_cast<std::size_t>(tensor)];
    if (start > t.size() || count > t.size() - start) {
      throw format_error("class index: positions past tensor " + std::to_string(tensor));
    }
    std::copy_n(t.begin() + static_cast<std::ptrdiff_t>(start), count, out);
  }

 private:
  const Tensors* tensors_;
};

struct Chunk {
  ChunkHeader header;
  Encoding encoding = Encoding::value;
  IndexCode index = IndexCode::plain;
  std::vector<TensorDelta> tensors;  // at most one per HF tensor
};

// xxh3-64 of a chunk's bytes, as the manifest records it.
inline std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
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

namespace detail {

inline void compress_frame(ZSTD_CCtx* cctx, std::span<const std::byte> plain,
                           std::vector<std::byte>& out) {
  const std::size_t at = out.size();
  out.resize(at + ZSTD_compressBound(plain.size()));
  const std::size_t n =
      ZSTD_compress2(cctx, out.data() + at, out.size() - at, plain.data(), plain.size());
  if (ZSTD_isError(n)) {
    throw error(std::string("dte::storage::encode_chunk: zstd failed: ") + ZSTD_getErrorName(n));
  }
  out.resize(at + n);
}

}  // namespace detail

// The zstd frames of `bytes`: where each starts and its compressed size, and their
// decompressed size summed, read from the frame headers alone; refused (format_error, or
// bounds_error past `max_bytes`) unless there are at most max_frames and each states its size.
struct FrameTable {
  std::vector<std::pair<std::size_t, std::size_t>> frames;  // (offset, compressed size)
  std::uint64_t total = 0;
};

inline FrameTable frame_table(std::span<const std::byte> bytes, const std::string& source,
                              std::uint64_t max_bytes = max_decoded_bytes) {
  FrameTable table;
  auto& frames = table.frames;
  std::uint64_t& total = table.total;
  for (std::size_t at = 0; at < bytes.size();) {
    if (frames.size() == max_frames) {
      throw format_error(source + ": more than " + std::to_string(max_frames) +
                         " zstd frames; not a dte chunk");
    }
    const auto rest = bytes.subspan(at);
    const unsigned long long size = ZSTD_getFrameContentSize(rest.data(), rest.size());
    if (size == ZSTD_CONTENTSIZE_ERROR) {
      throw format_error(source + ": not a zstd frame at byte " + std::to_string(at) + " of " +
                         std::to_string(bytes.size()) + "; not a dte chunk, or a truncated one");
    }
    if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
      throw format_error(source +
                         ": a zstd frame does not state its decompressed size; dte chunks "
                         "always do");
    }
    const std::size_t span = ZSTD_findFrameCompressedSize(rest.data(), rest.size());
    if (ZSTD_isError(span)) {
      throw format_error(source + ": zstd refused the chunk (" + ZSTD_getErrorName(span) +
                         "); it is corrupt or truncated");
    }
    total += size;
    if (total > max_bytes) {
      throw bounds_error(source + ": the zstd frames decompress to more than " +
                         std::to_string(max_bytes) + " bytes, over the chunk limit of " +
                         std::to_string(max_bytes));
    }
    frames.emplace_back(at, span);
    at += span;
  }
  if (frames.empty()) throw format_error(source + ": empty; not a zstd frame");
  return table;
}

// Memory reused from one chunk to the next by a reader that decodes many (a receiver applying
// publications): the zstd context, the decompressed bytes, one tensor entry's indices and
// values. Holding one keeps each decode free of allocations and page faults once it has grown
// to the largest chunk seen.
class ChunkScratch {
 public:
  ChunkScratch() : dctx_(ZSTD_createDCtx()) {
    if (dctx_ == nullptr) throw error("dte::storage::ChunkScratch: zstd could not allocate");
  }
  ~ChunkScratch() { ZSTD_freeDCtx(dctx_); }
  ChunkScratch(const ChunkScratch&) = delete;
  ChunkScratch& operator=(const ChunkScratch&) = delete;

  [[nodiscard]] ZSTD_DCtx* dctx() const noexcept { return dctx_; }
  std::vector<std::byte> plain;
  std::vector<std::uint32_t> index;
  std::vector<std::uint16_t> bits;
  // The decoder's table of a chunk's entries: per HF tensor (HfModel id) its row in `parts`
  // (-1: none), and per row its ':index', ':value_hi' and ':value_lo' entries.
  struct Row {
    std::int64_t id;
    std::array<const io::TensorInfo*, 3> part;
  };
  std::vector<std::int32_t> slot;
  std::vector<Row> parts;

 private:
  ZSTD_DCtx* dctx_;
};

// The zstd frames of `bytes`, decompressed and concatenated into plain[0, returned size); plain
// grows when it is too small and never shrinks, so a reused buffer is not filled with zeros
// again. Refused as frame_table refuses, before anything is allocated.
inline std::size_t decompress_frames(std::span<const std::byte> bytes, const std::string& source,
                                     std::uint64_t max_bytes, ZSTD_DCtx* dctx,
                                     std::vector<std::byte>& plain) {
  const FrameTable table = frame_table(bytes, source, max_bytes);
  const auto total = static_cast<std::size_t>(table.total);
  if (plain.size() < total) plain.resize(total);
  std::size_t out = 0;
  for (const auto& [at, span] : table.frames) {
    const std::size_t got =
        ZSTD_decompressDCtx(dctx, plain.data() + out, total - out, bytes.data() + at, span);
    if (ZSTD_isError(got)) {
      throw format_error(source + ": zstd refused the chunk (" + ZSTD_getErrorName(got) +
                         "); it is corrupt or truncated");
    }
    out += got;
  }
  if (out != total) {
    throw format_error(source + ": the zstd frames stated " + std::to_string(total) +
                       " bytes but decompressed to " + std::to_string(out));
  }
  return total;
}

inline std::vector<std::byte> decompress_frames(std::span<const std::byte> bytes,
                                                const std::string& source,
                                                std::uint64_t max_bytes = max_decoded_bytes) {
  ChunkScratch s;
  s.plain.resize(decompress_frames(bytes, source, max_bytes, s.dctx(), s.plain));
  return std::move(s.plain);
}

// The chunk's compressed bytes. zstd_level: 1 (fast) to 19. base: what a class index is coded
// against (needed when c.index is classes).
inline std::vector<std::byte> encode_chunk(const layout::HfModel& hf, const Chunk& c,
                                           int zstd_level = 3, const ClassBase* base = nullptr) {
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
  w.set_metadata("dte.encoding", std::string(encoding_name(c.encoding)));
  if (c.encoding == Encoding::diff && c.header.base == no_version) {
    throw invalid_argument(
        "dte::storage::encode_chunk: an anchor (no base) cannot be diff-encoded");
  }
  if (c.index == IndexCode::classes) {
    if (c.encoding != Encoding::diff || base == nullptr) {
      throw invalid_argument(
          "dte::storage::encode_chunk: a class index needs the diff encoding and the base bits");
    }
    w.set_metadata("dte.index", "classes");
  }
  std::vector<std::vector<std::uint8_t>> hi(c.tensors.size()), lo(c.tensors.size());
  std::size_t values = 0;
  for (std::size_t k = 0; k < c.tensors.size(); ++k) {
    const TensorDelta& t = c.tensors[k];
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
    if (c.index == IndexCode::classes) {
      // Per entry the smaller: a mode byte, then the plain gap code (0) or the class index (1)
      // (a small tensor, a norm, costs less plainly than its class table and groups). What zstd
      // makes of the plain code is estimated as the best Rice code of its gaps (about their
      // entropy when they are geometric, as the class index's are; an order-0 count of so few
      // bytes would promise far less than zstd reaches).
      std::vector<std::uint8_t> plain{0}, classed{1};
      put_gaps(t.index, plain);
      put_class_index(
          {t.index, t.cls, t.domain, t.skip},
          [&](std::uint64_t start, std::uint64_t count, std::uint16_t* out) {
            base->bits(t.tensor, start, count, out);
          },
          classed);
      const std::uint64_t plain_cost = std::min<std::uint64_t>(
          plain.size(), (detail::rice_bits(t.index, detail::best_rice(t.index)) + 7) / 8);
      gaps = classed.size() < plain_cost ? std::move(classed) : std::move(plain);
    } else {
      put_gaps(t.index, gaps);
    }
    values += t.bits.size();
    w.add<std::uint8_t>(name + ":index", {gaps.size()}, gaps, io::DType::U8);
    for (std::uint16_t b : t.bits) {
      hi[k].push_back(static_cast<std::uint8_t>(b >> 8));
      lo[k].push_back(static_cast<std::uint8_t>(b));
    }
  }
  // (the data in the order the tensors are added: every index, every high byte, every low byte)
  for (std::size_t k = 0; k < c.tensors.size(); ++k)
    w.add<std::uint8_t>(hf.name(c.tensors[k].tensor) + ":value_hi", {hi[k].size()}, hi[k],
                        io::DType::U8);
  for (std::size_t k = 0; k < c.tensors.size(); ++k)
    w.add<std::uint8_t>(hf.name(c.tensors[k].tensor) + ":value_lo", {lo[k].size()}, lo[k],
                        io::DType::U8);
  const std::vector<std::byte> plain = w.serialize();
  const std::span<const std::byte> all(plain);
  std::uint64_t header = 0;  // the safetensors header: its 8-byte length, then the JSON
  for (int b = 0; b < 8; ++b)
    header |= std::to_integer<std::uint64_t>(plain[static_cast<std::size_t>(b)]) << (8 * b);
  const auto head = static_cast<std::size_t>(8 + header);
  const std::size_t first = plain.size() - 2 * values;  // the end of the indices
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  if (cctx == nullptr) throw error("dte::storage::encode_chunk: zstd could not allocate a context");
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, zstd_level);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
  std::vector<std::byte> out;
  try {
    detail::compress_frame(cctx, all.first(head), out);
    if (first > head) detail::compress_frame(cctx, all.subspan(head, first - head), out);
    if (values > 0) {
      detail::compress_frame(cctx, all.subspan(first, values), out);
      detail::compress_frame(cctx, all.subspan(first + values), out);
    }
  } catch (...) {
    ZSTD_freeCCtx(cctx);
    throw;
  }
  ZSTD_freeCCtx(cctx);
  return out;
}

// The chunk in `bytes` (as read from storage; `source` names it in errors). expect: the header
// the manifest says this chunk has (null: any); max_bytes: the decompressed size refused
// unread; base: the bits held before the version, which a class index is resolved against (a
// chunk with one is refused, unsupported, without it). Refuses everything the header comment
// lists.
//
// visit_chunk is the one decoder: it checks the chunk's framing and header first, then decodes
// and checks its tensor entries in order, calling
// f(const Chunk& header, std::int64_t tensor, std::span<const std::uint32_t> index,
//   std::span<const std::uint16_t> bits) per entry (header: the chunk without its tensors), from
// memory in `scratch`; decode_chunk collects the entries into a Chunk. visit_chunk_into decodes
// each entry into memory the caller hands out instead: room(tensor, n) returns
// std::pair<std::uint32_t*, std::uint16_t*>, room for n indices and n values (a receiver's
// staged writes: nothing is copied between the decode and the commit).
namespace detail {
template <class Room, class F>
Chunk visit_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                  const std::string& source, const ChunkHeader* expect, std::uint64_t max_bytes,
                  const ClassBase* base, bool resolve, ChunkScratch& scratch, Room&& room, F&& f);

// The room of visit_chunk: the scratch's, overwritten by each entry.
struct ScratchRoom {
  ChunkScratch* scratch;
  std::pair<std::uint32_t*, std::uint16_t*> operator()(std::int64_t, std::size_t n) const;
};
}  // namespace detail

template <class F>
Chunk visit_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                  const std::string& source, const ChunkHeader* expect, const ClassBase* base,
                  ChunkScratch& scratch, F&& f) {
  return detail::visit_chunk(hf, bytes, source, expect, max_decoded_bytes, base, true, scratch,
                             detail::ScratchRoom{&scratch}, std::forward<F>(f));
}

template <class Room, class F>
Chunk visit_chunk_into(const layout::HfModel& hf, std::span<const std::byte> bytes,
                       const std::string& source, const ChunkHeader* expect, const ClassBase* base,
                       ChunkScratch& scratch, Room&& room, F&& f) {
  return detail::visit_chunk(hf, bytes, source, expect, max_decoded_bytes, base, true, scratch,
                             std::forward<Room>(room), std::forward<F>(f));
}

inline Chunk decode_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                          const std::string& source, const ChunkHeader* expect = nullptr,
                          std::uint64_t max_bytes = max_decoded_bytes,
                          const ClassBase* base = nullptr) {
  ChunkScratch scratch;
  std::vector<TensorDelta> tensors;
  Chunk c = detail::visit_chunk(
      hf, bytes, source, expect, max_bytes, base, true, scratch, detail::ScratchRoom{&scratch},
      [&](const Chunk&, std::int64_t tensor, std::span<const std::uint32_t> index,
          std::span<const std::uint16_t> bits) {
        TensorDelta t;
        t.tensor = tensor;
        t.index.assign(index.begin(), index.end());
        t.bits.assign(bits.begin(), bits.end());
        tensors.push_back(std::move(t));
      });
  c.tensors = std::move(tensors);
  return c;
}

// Every check of decode_chunk but the resolution of class indices, which needs the base: for
// a chunk whose base is not at hand (`dte verify` after a break in the chain).
inline void check_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                        const std::string& source, const ChunkHeader* expect = nullptr,
                        std::uint64_t max_bytes = max_decoded_bytes) {
  ChunkScratch scratch;
  (void)detail::visit_chunk(hf, bytes, source, expect, max_bytes, nullptr, false, scratch,
                            detail::ScratchRoom{&scratch},
                            [](const Chunk&, std::int64_t, std::span<const std::uint32_t>,
                               std::span<const std::uint16_t>) {});
}

inline std::pair<std::uint32_t*, std::uint16_t*> detail::ScratchRoom::operator()(
    std::int64_t, std::size_t n) const {
  // (scratch buffers only grow: a reused one is not filled with zeros first)
  if (scratch->index.size() < n) scratch->index.resize(n);
  if (scratch->bits.size() < n) scratch->bits.resize(n);
  return {scratch->index.data(), scratch->bits.data()};
}

template <class Room, class F>
Chunk detail::visit_chunk(const layout::HfModel& hf, std::span<const std::byte> bytes,
                          const std::string& source, const ChunkHeader* expect,
                          std::uint64_t max_bytes, const ClassBase* base, bool resolve,
                          ChunkScratch& scratch, Room&& room, F&& f) {
  const std::size_t size =
      decompress_frames(bytes, source, max_bytes, scratch.dctx(), scratch.plain);
  io::SafetensorsFile file = io::SafetensorsFile::parse(std::move(scratch.plain), size, source);
  // (the decompressed bytes go back to the scratch however this ends)
  struct GiveBack {
    io::SafetensorsFile& file;
    ChunkScratch& scratch;
    ~GiveBack() { scratch.plain = std::move(file).release(); }
  } give_back{file, scratch};
  const auto& meta = file.metadata();
  if (detail::metadata_or_refuse(meta, "dte.format", source) != chunk_format) {
    throw format_error(source + ": dte.format is \"" + meta.at("dte.format") + "\", this reader " +
                       "reads \"" + std::string(chunk_format) + "\"");
  }
  const std::string encoding = detail::metadata_or_refuse(meta, "dte.encoding", source);
  if (encoding != "value" && encoding != "diff") {
    throw format_error(source + ": dte.encoding \"" + encoding +
                       "\" is not one this reader applies (value, diff)");
  }
  Chunk c;
  c.encoding = encoding == "diff" ? Encoding::diff : Encoding::value;
  c.header.version = detail::metadata_u64(meta, "dte.version", source);
  c.header.base = detail::metadata_u64(meta, "dte.base", source);
  const std::uint64_t chunk = detail::metadata_u64(meta, "dte.chunk", source);
  const std::uint64_t writer = detail::metadata_u64(meta, "dte.writer", source);
  if (chunk > 0xFFFFFFFFull || writer > 0xFFFFFFFFull) {
    throw bounds_error(source + ": dte.chunk or dte.writer does not fit 32 bits");
  }
  c.header.chunk = static_cast<std::uint32_t>(chunk);
  c.header.writer = static_cast<std::uint32_t>(writer);
  if (c.encoding == Encoding::diff && c.header.base == no_version) {
    throw format_error(source + ": a diff-encoded chunk without a base version");
  }
  if (const auto it = meta.find("dte.index"); it != meta.end()) {
    if (it->second != "classes" && it->second != "plain") {
      throw format_error(source + ": dte.index \"" + it->second +
                         "\" is not one this reader decodes (plain, classes)");
    }
    c.index = it->second == "classes" ? IndexCode::classes : IndexCode::plain;
  }
  if (c.index == IndexCode::classes && c.encoding != Encoding::diff) {
    throw format_error(source + ": a class index in a chunk that is not diff-encoded");
  }
  if (expect != nullptr && !(c.header == *expect)) {
    throw protocol_error(
        source + ": the chunk says version " + std::to_string(c.header.version) + " base " +
        std::to_string(c.header.base) + " chunk " + std::to_string(c.header.chunk) + " writer " +
        std::to_string(c.header.writer) + ", the manifest expects version " +
        std::to_string(expect->version) + " base " + std::to_string(expect->base) + " chunk " +
        std::to_string(expect->chunk) + " writer " + std::to_string(expect->writer) +
        " (a chunk of another version or slot in its place)");
  }
  // Each entry's HF tensor and part, looked up once: per HF tensor its three entries, in the
  // name order of the file's entries (scratch.slot maps an HF id to its row of scratch.parts, and
  // is reset to -1 however this ends).
  constexpr std::string_view parts[3] = {":index", ":value_hi", ":value_lo"};
  auto& rows = scratch.parts;
  auto& slot = scratch.slot;
  if (slot.size() < static_cast<std::size_t>(hf.size()))
    slot.resize(static_cast<std::size_t>(hf.size()), -1);
  rows.clear();
  struct ResetSlots {
    ChunkScratch& s;
    ~ResetSlots() {
      for (const ChunkScratch::Row& r : s.parts)
        s.slot[static_cast<std::size_t>(r.id)] = -1;
    }
  } reset_slots{scratch};
  for (const io::TensorInfo& info : file.tensors()) {
    const auto colon = info.name.rfind(':');
    const std::string_view suffix =
        colon == std::string::npos ? std::string_view{} : std::string_view(info.name).substr(colon);
    const auto kind = static_cast<std::size_t>(
        std::find(std::begin(parts), std::end(parts), suffix) - std::begin(parts));
    if (kind == 3) {
      throw format_error(source + ": tensor '" + info.name +
                         "' is not '<name>:index', '<name>:value_hi' or '<name>:value_lo'");
    }
    const std::string_view name = std::string_view(info.name).substr(0, colon);
    const std::int64_t id = hf.find(name);
    if (id < 0) {
      throw format_error(source + ": tensor '" + std::string(name) + "' is not a tensor of " +
                         hf.spec().name);
    }
    std::int32_t& row = slot[static_cast<std::size_t>(id)];
    if (row < 0) {
      row = static_cast<std::int32_t>(rows.size());
      rows.push_back({id, {}});
    }
    rows[static_cast<std::size_t>(row)].part[kind] = &info;
  }
  for (const ChunkScratch::Row& r : rows) {
    for (std::size_t k = 0; k < 3; ++k) {
      if (r.part[k] != nullptr) continue;
      const io::TensorInfo* some = r.part[0] != nullptr   ? r.part[0]
                                   : r.part[1] != nullptr ? r.part[1]
                                                          : r.part[2];
      const std::string name = some->name.substr(0, some->name.rfind(':'));
      throw format_error(source + ": '" + some->name + "' without '" + name +
                         std::string(parts[k]) + "'");
    }
  }
  for (const ChunkScratch::Row& r : rows) {
    const io::TensorInfo& info = *r.part[0];
    const io::TensorInfo& hi = *r.part[1];
    const io::TensorInfo& lo = *r.part[2];
    const std::string where = source + ": " + hf.name(r.id);
    if (info.dtype != io::DType::U8 || info.shape.size() != 1 || hi.dtype != io::DType::U8 ||
        hi.shape.size() != 1 || lo.dtype != io::DType::U8 || lo.shape != hi.shape) {
      throw format_error(where +
                         ": ':index', ':value_hi' and ':value_lo' must be U8 [k], U8 [n] "
                         "and U8 [n]");
    }
    const std::int64_t id = r.id;
    const std::uint64_t n = hi.shape[0];
    const auto gap_bytes = file.bytes(info);
    const std::span<const std::uint8_t> code{
        reinterpret_cast<const std::uint8_t*>(gap_bytes.data()), gap_bytes.size()};
    const auto numel = static_cast<std::uint64_t>(hf[id].numel());
    if (c.index == IndexCode::classes && (code.empty() || code[0] > 1)) {
      throw format_error(where +
                         ": an index stream of a classes chunk starts with its mode, 0 "
                         "(plain) or 1 (class index)");
    }
    const auto n_ = static_cast<std::size_t>(n);
    const bool classes = c.index == IndexCode::classes && code[0] != 0;
    std::optional<ClassIndex> x;
    if (classes) {
      x = get_class_index(code.subspan(1), numel, where);
      if (x->values != n) {
        throw format_error(where + ": the class index names " + std::to_string(x->values) +
                           " elements, the value planes hold " + std::to_string(n));
      }
      if (base == nullptr && resolve) {
        throw unsupported(source +
                          ": its indices are coded against the base version (dte.index "
                          "classes), which this reader does not hold whole; publish with the "
                          "plain index");
      }
    }
    const auto [index, values] = room(id, n_);
    std::span<const std::uint32_t> entries(index, n_);
    if (!classes) {
      get_gaps(c.index == IndexCode::classes ? code.subspan(1) : code, n, numel, where, index);
    } else if (base == nullptr) {
      entries = {};  // (check_chunk: parsed and bounded, not resolved)
    } else {
      const std::vector<std::uint32_t> resolved = resolve_class_index(
          *x,
          [&](std::uint64_t start, std::uint64_t count, std::uint16_t* out) {
            base->bits(id, start, count, out);
          },
          where);
      std::copy(resolved.begin(), resolved.end(), index);
    }
    const auto high = file.bytes(hi);
    const auto low = file.bytes(lo);
    for (std::size_t k = 0; k < n_; ++k) {
      values[k] = static_cast<std::uint16_t>((std::to_integer<std::uint16_t>(high[k]) << 8) |
                                             std::to_integer<std::uint16_t>(low[k]));
    }
    f(static_cast<const Chunk&>(c), id, entries, std::span<const std::uint16_t>(values, n_));
  }
  return c;
}

}  // namespace dte::storage
