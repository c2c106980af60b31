// SPDX-License-Identifier: Apache-2.0
// Wire format v2: one sender's payload for one receiver in one publication, with the indices of
// sparse entries delta-coded. Entries of one receiver tensor with increasing indices form a
// sparse group, coded in blocks of 128 entries: the block's first index in full, then the other
// gaps (index - previous index - 1) bit-packed in the width that minimises the block's bytes, gaps
// too wide for it sent in full as exceptions, then the 16-bit values; a 16-bit check of the
// block's last index makes a corrupted index refused rather than applied. Every block decodes on
// its own from its header, so blocks can be decoded in parallel once their offsets are known. Dense
// groups carry a contiguous range of values with no indices at all. Values are absolute, as in
// v1 (message.hpp): applying a message twice changes nothing.
//
// The byte layout is written down once, with a worked example, in docs/wire.md. A received
// message is validated in full on construction of a MessageView (every length, reserved byte,
// width, exception and decoded index) and then read in place.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dte/core/message.hpp"
#include "dte/error.hpp"

namespace dte::wire {

static_assert(std::endian::native == std::endian::little,
              "dte::wire reads and writes little-endian values in place");

inline constexpr std::uint32_t magic = 0x32657464u;  // "dte2" in little-endian bytes
inline constexpr std::size_t header_bytes = 32;
inline constexpr std::size_t group_header_bytes = 20;
inline constexpr std::size_t block_header_bytes = 8;
inline constexpr std::size_t block_entries = 128;
inline constexpr unsigned max_width = 31;
inline constexpr std::uint8_t sparse_type = 1;
inline constexpr std::uint8_t dense_type = 2;
inline constexpr std::size_t npos = ~std::size_t{0};

// The largest block: 8-byte header, 127 gaps of 31 bits, 127 exceptions, 128 values.
inline constexpr std::size_t max_block_bytes = block_header_bytes +
                                               ((block_entries - 1) * max_width + 7) / 8 +
                                               4 * (block_entries - 1) + 2 * block_entries;

struct Group {
  std::uint32_t tensor;
  bool dense;
  std::uint32_t first, last, count;
};

namespace detail {

template <class T>
T load(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(std::byte* p, T v) noexcept {
  std::memcpy(p, &v, sizeof v);
}

inline unsigned byte_at(const std::byte* p) noexcept {
  return std::to_integer<unsigned>(*p);
}

// Bytes of `gaps` packed codes of w bits.
inline std::size_t packed_bytes(std::uint32_t gaps, unsigned w) noexcept {
  return (std::size_t{gaps} * w + 7) / 8;
}

// A block's check: its last index modulo the largest prime below 2^16. One flipped bit in a
// block's first index, a gap code or an exception either breaks the escape count or moves the
// last index by a power of two, never a multiple of the prime: it does not pass validation.
inline constexpr std::uint32_t check_modulus = 65521;
inline std::uint16_t block_check(std::uint64_t last) noexcept {
  return static_cast<std::uint16_t>(last % check_modulus);
}

// The code that marks an exception; none exists at width 0 (every gap is 0 there).
inline std::uint32_t escape_code(unsigned w) noexcept {
  return w == 0 ? ~std::uint32_t{0} : (std::uint32_t{1} << w) - 1;
}

// Unpacks `gaps` codes of w bits (0..31), LSB-first, from p into codes. `avail` is how many bytes
// may be read from p (at least packed_bytes(gaps, w)): a code is read with one 8-byte load where
// 8 bytes are readable, byte by byte only near the end of the message.
inline void unpack(const std::byte* p, std::size_t avail, std::uint32_t gaps, unsigned w,
                   std::uint32_t* codes) noexcept {
  if (w == 0) {
    std::fill_n(codes, gaps, std::uint32_t{0});
    return;
  }
  const std::uint64_t mask = (std::uint64_t{1} << w) - 1;
  if (packed_bytes(gaps, w) + 7 <= avail) {
    for (std::uint32_t j = 0; j < gaps; ++j) {
      const std::size_t bit = std::size_t{j} * w;
      codes[j] = static_cast<std::uint32_t>((load<std::uint64_t>(p + bit / 8) >> (bit % 8)) & mask);
    }
    return;
  }
  for (std::uint32_t j = 0; j < gaps; ++j) {
    const std::size_t bit = std::size_t{j} * w;
    std::uint64_t v = 0;
    std::memcpy(&v, p + bit / 8, std::min<std::size_t>(8, avail - bit / 8));
    codes[j] = static_cast<std::uint32_t>((v >> (bit % 8)) & mask);
  }
}

// The bytes a validated sparse group's blocks take, starting at p (after the group header).
inline const std::byte* skip_blocks(const std::byte* p, std::uint32_t count) noexcept {
  while (count > 0) {
    const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(count, block_entries));
    const unsigned w = byte_at(p + 4), e = byte_at(p + 5);
    p += block_header_bytes + packed_bytes(n - 1, w) + 4 * std::size_t{e} + 2 * std::size_t{n};
    count -= n;
  }
  return p;
}

// The group header at p.
inline Group read_group(const std::byte* p) noexcept {
  return Group{load<std::uint32_t>(p), byte_at(p + 4) == dense_type, load<std::uint32_t>(p + 8),
               load<std::uint32_t>(p + 12), load<std::uint32_t>(p + 16)};
}

// The byte after a validated group that starts at p.
inline const std::byte* skip_group(const std::byte* p, const Group& h) noexcept {
  p += group_header_bytes;
  return h.dense ? p + 2 * std::size_t{h.count} : skip_blocks(p, h.count);
}

}  // namespace detail

// The encoding policy, the one every sender uses (host and CUDA; engine/routing_sink.hpp and
// engine/device_sender.cuh): what a message holds is a function of the stream of (tensor, index,
// value) the sender appends for its receiver, in order, and of nothing else: not of how the
// stream was cut into calls, nor of which backend produced it. A maximal stretch of consecutive
// indices of one tensor at least dense_min_run long goes as dense groups of at most
// dense_run_piece values (cut from the stretch's start); every other element as an indexed entry.
// A message that writes whole runs (a full publication, a repair) sends every stretch dense:
// its elements are all the receiver's, and the receiver checks a full publication's coverage by
// its dense groups.
//
// Why 256: a sparse entry in a stretch costs its 2 value bytes plus its share of a block header
// (8 bytes per 128, gaps of zero take no bits), a dense element 2 bytes, and a stretch sent dense
// inside a sparse region costs two group headers (40 bytes): from 256 on that is at most 8 % more
// bytes for the stretch, and the receiver copies it instead of decoding an index per value. A
// full publication and a delta of a fully changed tensor are then dense groups only.
inline constexpr std::size_t dense_min_run = 256;
inline constexpr std::size_t dense_run_piece = std::size_t{1} << 16;

// Builds one message for one receiver in fixed 64 KiB chunks, so a sender holds its payload plus
// at most one partly filled chunk per receiver, never a doubling vector's slack. Elements arrive
// through add() and add_run() and are encoded by the policy above. An element that does not
// continue a dense group is added as an indexed entry; the open sparse group's last entries that
// are not yet coded (up to 128 plus the stretch that ends them) stay in a buffer, so a stretch
// that reaches the minimum leaves the sparse group for a dense one (a sparse group left empty is
// taken back). Blocks of 128 entries are coded as soon as the stretch has moved past them; group
// and message headers are patched in place when the group closes and at finish().
class MessageWriter {
 public:
  static constexpr std::size_t chunk_bytes = std::size_t{1} << 16;

  // Starts a message (frees any previous one); its kind, version and base are written by finish().
  // min_run: the shortest stretch sent dense, dense_min_run for a delta, 1 for a message that
  // writes whole runs (a full publication or a repair: every stretch dense).
  void begin(std::size_t min_run = dense_min_run) {
    if (min_run < 1 || min_run > dense_min_run) {
      throw invalid_argument("dte::wire::MessageWriter: min_run " + std::to_string(min_run) +
                             " is outside 1 .. " + std::to_string(dense_min_run));
    }
    clear();
    begun_ = true;
    min_run_ = static_cast<std::uint32_t>(min_run);
    const std::array<std::byte, header_bytes> zero{};
    put(zero.data(), zero.size());
  }

  // The next element of the stream: element `index` of receiver tensor `tensor` has value `bits`.
  void add(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    if (dense_) {
      if (continues(tensor, index)) {
        if (count_ == dense_run_piece) open_dense(tensor, index);  // (the stretch goes on)
        append_dense(index, bits);
        return;
      }
      close_group();
    }
    if (min_run_ == 1) {  // every stretch dense
      open_dense(tensor, index);
      append_dense(index, bits);
      return;
    }
    // An indexed entry, provisionally: run_ counts the stretch it ends among the open block's.
    if (tensor == open_tensor_ && index > last_ && count_ != max_count) {
      run_ = index == last_ + 1 ? run_ + 1 : 1;
    } else {
      open_group(tensor, index, sparse_type);
      run_ = 1;
    }
    push_entry(index, bits);
    if (run_ == min_run_) {
      stretch_to_dense();
    } else {
      settle();
    }
  }

  // Elements first, first + 1, ... of `tensor` with values `bits`: the same as add() of each in
  // turn (once the stretch is dense, copied in bulk). An empty span adds nothing.
  void add_run(std::uint32_t tensor, std::uint32_t first, std::span<const std::uint16_t> bits) {
    if (bits.empty()) return;
    check_run(tensor, first, bits.size());
    std::size_t i = 0;
    while (i < bits.size()) {
      const auto index = first + static_cast<std::uint32_t>(i);
      if (!dense_ || !continues(tensor, index) || count_ == dense_run_piece) {
        add(tensor, index, bits[i++]);
        continue;
      }
      const std::size_t n = std::min(bits.size() - i, dense_run_piece - count_);
      put_dense(index, bits.subspan(i, n));
      i += n;
    }
  }

  // One indexed entry, outside the policy: it never becomes part of a dense group. Opens a new
  // sparse group when `tensor` differs from the open group's, when the open group is dense (or
  // none is open), or when `index` is not above the last one added (and, so that a count fits
  // its u32, when the open group already holds 2^32 - 1 entries). For tests and tools that build
  // a given message; senders use add() and add_run().
  void add_entry(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    if (dense_ || tensor != open_tensor_ || index <= last_ || count_ == max_count) {
      open_group(tensor, index, sparse_type);
    }
    run_ = 0;
    push_entry(index, bits);
    settle();
  }

  // Exactly one dense group of bits.size() values from `first`, outside the policy (the open
  // group is closed first). For tests and tools that build a given message; senders use add()
  // and add_run(). An empty span adds nothing but closes the open group.
  void add_dense_group(std::uint32_t tensor, std::uint32_t first,
                       std::span<const std::uint16_t> bits) {
    close_group();
    if (bits.empty()) return;
    check_run(tensor, first, bits.size());
    open_dense(tensor, first);
    put_dense(first, bits);
    close_group();
  }

  // Ends the stream: the open group is closed (a later add() starts a new stretch). finish() does
  // it too; entries() and run_elements() are final after it.
  void flush() { close_group(); }

  // Codes the pending block, patches the open group's header and the message header.
  void finish(MessageKind kind, Version version, Version base) {
    if (!begun_) throw invalid_argument("dte::wire::MessageWriter: finish() before begin()");
    const auto k = static_cast<std::uint32_t>(kind);
    if (k < 1 || k > 4) {
      throw invalid_argument("dte::wire::MessageWriter: unknown message kind " + std::to_string(k));
    }
    flush();
    std::array<std::byte, header_bytes> h{};
    detail::store(h.data(), magic);
    h[4] = static_cast<std::byte>(k);
    detail::store(h.data() + 8, version);
    detail::store(h.data() + 16, base);
    detail::store(h.data() + 24, groups_);
    if (!attachment_.empty()) {
      if (attachment_.size() > max_count) {
        throw invalid_argument("dte::wire::MessageWriter: an attachment of 4 GiB or more");
      }
      detail::store(h.data() + 28, static_cast<std::uint32_t>(attachment_.size()));
      put(attachment_.data(), attachment_.size());
      attachment_.clear();
    }
    patch(0, h.data(), h.size());
  }

  // Bytes that follow the last group (an FP8 part: receive/fp8_part.hpp), written by finish().
  void attach(std::vector<std::byte> bytes) { attachment_ = std::move(bytes); }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return chunks_.size() * chunk_bytes; }
  // Elements written as indexed entries and in dense groups (final once the stream ended).
  [[nodiscard]] std::uint64_t entries() const noexcept { return entries_; }
  [[nodiscard]] std::uint64_t run_elements() const noexcept { return run_elements_; }

  // The message as consecutive byte spans (one per chunk).
  [[nodiscard]] std::vector<std::span<const std::byte>> spans() const {
    std::vector<std::span<const std::byte>> out;
    out.reserve(chunks_.size());
    for (std::size_t c = 0; c < chunks_.size() && c * chunk_bytes < size_; ++c) {
      out.emplace_back(chunks_[c].get(), std::min(chunk_bytes, size_ - c * chunk_bytes));
    }
    return out;
  }

  // Frees everything.
  void clear() {
    attachment_.clear();
    chunks_.clear();
    chunks_.shrink_to_fit();
    size_ = 0;
    entries_ = run_elements_ = 0;
    groups_ = 0;
    begun_ = false;
    open_tensor_ = no_group;
    dense_ = false;
    n_ = run_ = pending_ = 0;
  }

 private:
  static constexpr std::uint64_t no_group = ~std::uint64_t{0};  // never equals a u32 tensor id
  static constexpr std::uint32_t max_count = std::numeric_limits<std::uint32_t>::max();
  // The open block's room: 128 entries before the stretch plus the stretch, shorter than
  // dense_min_run until it turns dense.
  static constexpr std::size_t block_room = block_entries + dense_min_run;

  // Whether element (tensor, index) follows the open group's last one.
  [[nodiscard]] bool continues(std::uint32_t tensor, std::uint32_t index) const noexcept {
    return tensor == open_tensor_ && last_ != max_count && index == last_ + 1;
  }

  // A dense run of `n` values from `first` must end at or before the last 32-bit index.
  static void check_run(std::uint32_t tensor, std::uint32_t first, std::size_t n) {
    if (n - 1 > std::size_t{max_count - first}) {
      throw invalid_argument("dte::wire::MessageWriter: a dense run of " + std::to_string(n) +
                             " values from index " + std::to_string(first) + " of tensor " +
                             std::to_string(tensor) + " passes the last 32-bit index");
    }
  }

  // The open sparse group's next entry, not yet coded.
  void push_entry(std::uint32_t index, std::uint16_t bits) {
    index_[n_] = index;
    bits_[n_] = bits;
    last_ = index;
    ++count_;
    ++entries_;
    ++n_;
  }

  // The open dense group's next values, from index `first` (after the buffered ones).
  void put_dense(std::uint32_t first, std::span<const std::uint16_t> bits) {
    drain_dense();
    put(bits.data(), 2 * bits.size());
    last_ = first + static_cast<std::uint32_t>(bits.size() - 1);
    count_ += static_cast<std::uint32_t>(bits.size());
    run_elements_ += bits.size();
  }

  // The open dense group's next value (buffered: one put per dense_min_run values).
  void append_dense(std::uint32_t index, std::uint16_t bits) {
    pending_bits_[pending_++] = bits;
    if (pending_ == pending_bits_.size()) drain_dense();
    last_ = index;
    ++count_;
    ++run_elements_;
  }
  void drain_dense() {
    if (pending_ == 0) return;
    put(pending_bits_.data(), 2 * std::size_t{pending_});
    pending_ = 0;
  }

  // The stretch of run_ entries that ends the open sparse group reached min_run_: it leaves the
  // sparse group (which closes, or is taken back when nothing else is in it) for a dense group.
  void stretch_to_dense() {
    const std::uint32_t len = run_, start = n_ - len;
    const std::uint32_t first = index_[start];
    const auto tensor = static_cast<std::uint32_t>(open_tensor_);
    std::array<std::uint16_t, dense_min_run> bits;
    std::copy_n(bits_.data() + start, len, bits.data());
    n_ = start;
    count_ -= len;
    entries_ -= len;
    if (count_ == 0) {  // the group holds nothing else: no block of it was written, take it back
      size_ = group_at_;
      while (chunks_.size() * chunk_bytes >= size_ + chunk_bytes)
        chunks_.pop_back();  // (its header had opened a chunk: the current chunk is the last)
      --groups_;
      open_tensor_ = no_group;
    } else {
      last_ = start > 0 ? index_[start - 1] : block_last_;
      close_group();
    }
    open_dense(tensor, first);
    put_dense(first, std::span(bits).first(len));
  }

  // A dense group from `first`, its values appended by the caller (last and count patched when
  // it closes).
  void open_dense(std::uint32_t tensor, std::uint32_t first) {
    open_group(tensor, first, dense_type);
    dense_ = true;
  }

  // Closes the open group and writes the header of a new one of `type`, with `last` and `count`
  // left for close_group() to patch.
  void open_group(std::uint32_t tensor, std::uint32_t first, std::uint8_t type) {
    close_group();
    if (!begun_) {
      throw invalid_argument("dte::wire::MessageWriter: add() or add_run() before begin()");
    }
    if (groups_ == max_count) {
      throw invalid_argument("dte::wire::MessageWriter: more than 2^32 - 1 groups in a message");
    }
    ++groups_;
    std::array<std::byte, group_header_bytes> h{};
    detail::store(h.data(), tensor);
    h[4] = std::byte{type};
    detail::store(h.data() + 8, first);
    group_at_ = size_;
    put(h.data(), h.size());
    open_tensor_ = tensor;
    count_ = 0;
    n_ = 0;
    run_ = 0;
  }

  void close_group() {
    if (open_tensor_ == no_group) return;
    if (dense_) {
      drain_dense();
    } else {
      for (std::uint32_t at = 0; at < n_; at += block_entries)
        flush_block(at, std::min<std::uint32_t>(block_entries, n_ - at));
      n_ = 0;
    }
    std::array<std::byte, 8> h{};
    detail::store(h.data(), last_);
    detail::store(h.data() + 4, count_);
    patch(group_at_ + 12, h.data(), h.size());
    open_tensor_ = no_group;
    dense_ = false;
    run_ = 0;
  }

  // Codes whole blocks of 128 from the front while they lie before the stretch (the rest move to
  // the front): afterwards fewer than 128 entries precede it, so a stretch that turns dense
  // leaves at most one block, the group's last, to code.
  void settle() {
    while (n_ - run_ >= block_entries) {
      flush_block(0, block_entries);
      n_ -= static_cast<std::uint32_t>(block_entries);
      std::copy(index_.data() + block_entries, index_.data() + block_entries + n_, index_.data());
      std::copy(bits_.data() + block_entries, bits_.data() + block_entries + n_, bits_.data());
    }
  }

  // Codes the n buffered entries from `at` as one block, straight into the current chunk when
  // the largest block fits there, through scratch_ otherwise.
  void flush_block(std::uint32_t at, std::uint32_t n) {
    const std::uint32_t* const index = index_.data() + at;
    const std::uint16_t* const values = bits_.data() + at;
    const std::uint32_t gaps = n - 1;
    block_last_ = index[n - 1];
    std::array<std::uint32_t, block_entries> gap;  // gap[k]: before entry k + 1
    std::array<std::uint32_t, 34> lengths{};       // gaps g with bit_width(g + 1) == b
    for (std::uint32_t k = 0; k < gaps; ++k) {
      const std::uint32_t g = index[k + 1] - index[k] - 1;  // g + 1 < 2^32
      gap[k] = g;
      ++lengths[std::bit_width(g + 1)];
    }
    // A gap is an exception at width w >= 1 iff g >= 2^w - 1, i.e. bit_width(g + 1) > w.
    unsigned w = 0;
    std::uint32_t e = 0;
    if (lengths[1] != gaps) {
      std::size_t best = ~std::size_t{0};
      std::uint32_t exceptions = gaps - lengths[1];
      for (unsigned v = 1; v <= max_width; ++v) {
        const std::size_t cost = detail::packed_bytes(gaps, v) + 4 * std::size_t{exceptions};
        if (cost < best || (cost == best && exceptions < e)) {  // ties: fewer exceptions
          best = cost;
          w = v;
          e = exceptions;
        }
        if (exceptions == 0) break;
        exceptions -= lengths[v + 1];
      }
    }

    const std::size_t room = chunks_.size() * chunk_bytes - size_;
    const bool direct = room >= max_block_bytes;
    std::byte* const start = direct ? chunks_.back().get() + (chunk_bytes - room) : scratch_.data();
    std::byte* out = start;
    detail::store(out, index[0]);
    out[4] = static_cast<std::byte>(w);
    out[5] = static_cast<std::byte>(e);
    detail::store(out + 6, detail::block_check(index[n - 1]));
    out += block_header_bytes;
    std::byte* exc = out + detail::packed_bytes(gaps, w);
    if (w > 0) {
      const std::uint32_t escape = detail::escape_code(w);
      std::uint64_t acc = 0;
      unsigned bits = 0;
      for (std::uint32_t k = 0; k < gaps; ++k) {
        std::uint32_t code = gap[k];
        if (code >= escape) {
          detail::store(exc, code);
          exc += 4;
          code = escape;
        }
        acc |= std::uint64_t{code} << bits;
        bits += w;
        if (bits >= 32) {
          detail::store(out, static_cast<std::uint32_t>(acc));
          out += 4;
          acc >>= 32;
          bits -= 32;
        }
      }
      while (bits > 0) {
        *out++ = static_cast<std::byte>(acc & 0xFF);
        acc >>= 8;
        bits = bits > 8 ? bits - 8 : 0;
      }
    }
    std::memcpy(exc, values, 2 * std::size_t{n});
    const auto length = static_cast<std::size_t>(exc + 2 * std::size_t{n} - start);
    if (direct) {
      size_ += length;
    } else {
      put(scratch_.data(), length);
    }
  }

  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    while (n > 0) {
      if (size_ == chunks_.size() * chunk_bytes) {
        chunks_.push_back(std::make_unique_for_overwrite<std::byte[]>(chunk_bytes));
      }
      const std::size_t off = size_ % chunk_bytes;
      const std::size_t k = std::min(n, chunk_bytes - off);
      std::memcpy(chunks_.back().get() + off, b, k);
      size_ += k, b += k, n -= k;
    }
  }

  // Overwrites bytes already written at `at` (they may straddle a chunk boundary).
  void patch(std::size_t at, const std::byte* p, std::size_t n) {
    while (n > 0) {
      const std::size_t off = at % chunk_bytes;
      const std::size_t k = std::min(n, chunk_bytes - off);
      std::memcpy(chunks_[at / chunk_bytes].get() + off, p, k);
      at += k, p += k, n -= k;
    }
  }

  std::vector<std::unique_ptr<std::byte[]>> chunks_;
  std::size_t size_ = 0;
  std::uint64_t entries_ = 0, run_elements_ = 0;
  std::uint32_t groups_ = 0;
  bool begun_ = false;
  // The open group (sparse or dense_).
  std::uint64_t open_tensor_ = no_group;
  bool dense_ = false;
  std::uint32_t last_ = 0, count_ = 0;
  std::size_t group_at_ = 0;
  std::uint32_t min_run_ = dense_min_run;  // this message's (begin())
  // The open sparse group's entries not yet coded (n_), the stretch of consecutive indices that
  // ends them (run_), the last index of the last block coded.
  std::uint32_t n_ = 0, run_ = 0, block_last_ = 0;
  std::array<std::uint32_t, block_room> index_;
  std::array<std::uint16_t, block_room> bits_;
  // The open dense group's values not yet written.
  std::uint32_t pending_ = 0;
  std::array<std::uint16_t, dense_min_run> pending_bits_;
  std::array<std::byte, max_block_bytes> scratch_;
  std::vector<std::byte> attachment_;
};

// A received message, validated in full on construction and then read in place: visiting its
// entries, runs or groups needs no memory beyond the message and a block's worth of codes on the
// stack. Index ranges against the receiver's tensors are the receiver's to check (for_each_group
// gives each group's tensor and first and last index). `from` names the sender in errors.
class MessageView {
 public:
  MessageView(std::span<const std::byte> in, const std::string& from) : in_(in) {
    const std::byte* const p = in.data();
    const std::size_t size = in.size();
    if (size < header_bytes) {
      refuse(from, "only " + std::to_string(size) + " bytes, shorter than the 32-byte header");
    }
    if (const auto m = detail::load<std::uint32_t>(p); m != magic) {
      refuse(from, "bad magic " + hex(m) + " (not a dte v2 message)");
    }
    const unsigned kind = detail::byte_at(p + 4);
    if (kind < 1 || kind > 4) refuse(from, "unknown kind " + std::to_string(kind));
    if (detail::byte_at(p + 5) | detail::byte_at(p + 6) | detail::byte_at(p + 7)) {
      refuse(from, "nonzero reserved bytes in the message header");
    }
    const std::uint32_t attached = detail::load<std::uint32_t>(p + 28);
    if (attached > size - header_bytes) {
      refuse(from, "an attachment of " + std::to_string(attached) + " bytes in a message of " +
                       std::to_string(size));
    }
    kind_ = static_cast<MessageKind>(kind);
    version_ = detail::load<Version>(p + 8);
    base_ = detail::load<Version>(p + 16);
    groups_ = detail::load<std::uint32_t>(p + 24);

    std::array<std::uint32_t, block_entries> codes;
    std::size_t at = header_bytes;
    for (std::uint32_t g = 0; g < groups_; ++g) {
      const auto where = [&] {
        return "group " + std::to_string(g) + " (at byte " + std::to_string(at) + ")";
      };
      if (size - at < group_header_bytes) {
        refuse(from, where() + ": truncated group header (" + std::to_string(size - at) +
                         " of 20 bytes; " + std::to_string(groups_) + " groups announced)");
      }
      const Group h = detail::read_group(p + at);
      const unsigned type = detail::byte_at(p + at + 4);
      if (type != sparse_type && type != dense_type) {
        refuse(from, where() + ": unknown group type " + std::to_string(type));
      }
      if (detail::byte_at(p + at + 5) | detail::byte_at(p + at + 6) | detail::byte_at(p + at + 7)) {
        refuse(from, where() + ": nonzero reserved bytes in the group header");
      }
      if (h.count == 0) refuse(from, where() + ": empty group (count 0)");
      if (h.dense) {
        if (std::uint64_t{h.first} + h.count - 1 != h.last) {
          refuse(from, where() + ": dense group of " + std::to_string(h.count) +
                           " values from index " + std::to_string(h.first) + " has last index " +
                           std::to_string(h.last) + ", not " +
                           std::to_string(std::uint64_t{h.first} + h.count - 1));
        }
        if (h.count > (size - at - group_header_bytes) / 2) {
          refuse(from, where() + ": dense group of " + std::to_string(h.count) +
                           " values truncated (" + std::to_string(size - at - group_header_bytes) +
                           " bytes left)");
        }
        at += group_header_bytes + 2 * std::size_t{h.count};
        ++runs_;
        run_elements_ += h.count;
        continue;
      }
      const std::size_t group_start = at;
      at += group_header_bytes;
      std::uint64_t last = 0;
      std::uint32_t left = h.count;
      for (std::uint32_t b = 0; left > 0; ++b) {
        const auto in_block = [&] {
          return "group " + std::to_string(g) + " (at byte " + std::to_string(group_start) +
                 "), block " + std::to_string(b) + " (at byte " + std::to_string(at) + ")";
        };
        const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(left, block_entries));
        const std::uint32_t gaps = n - 1;
        if (size - at < block_header_bytes) {
          refuse(from, in_block() + ": truncated block header (" + std::to_string(size - at) +
                           " of 8 bytes)");
        }
        const auto base = detail::load<std::uint32_t>(p + at);
        const unsigned w = detail::byte_at(p + at + 4), e = detail::byte_at(p + at + 5);
        const auto check = detail::load<std::uint16_t>(p + at + 6);
        if (w > max_width) {
          refuse(from, in_block() + ": width " + std::to_string(w) + " exceeds 31");
        }
        if (gaps == 0 && w != 0) {
          refuse(from, in_block() + ": width " + std::to_string(w) +
                           " in a block of one entry (must be 0)");
        }
        if (w == 0 && e != 0) {
          refuse(from, in_block() + ": width 0 with " + std::to_string(e) + " exceptions");
        }
        if (b == 0 && base != h.first) {
          refuse(from, in_block() + ": first index " + std::to_string(base) +
                           " differs from the group's first index " + std::to_string(h.first));
        }
        if (b > 0 && base <= last) {
          refuse(from, in_block() + ": first index " + std::to_string(base) +
                           " is not above the previous block's last index " + std::to_string(last) +
                           " (indices must increase)");
        }
        const std::size_t packed = detail::packed_bytes(gaps, w);
        const std::size_t need =
            block_header_bytes + packed + 4 * std::size_t{e} + 2 * std::size_t{n};
        if (size - at < need) {
          refuse(from, in_block() + ": truncated block (" + std::to_string(need) +
                           " bytes needed, " + std::to_string(size - at) + " left)");
        }
        const std::byte* const q = p + at + block_header_bytes;
        if (const unsigned used = (gaps * w) % 8;
            used != 0 && (detail::byte_at(q + packed - 1) >> used) != 0) {
          refuse(from, in_block() + ": nonzero padding bits after the packed gaps");
        }
        detail::unpack(q, size - (at + block_header_bytes), gaps, w, codes.data());
        const std::uint32_t escape = detail::escape_code(w);
        std::uint64_t sum = 0;
        std::uint32_t escapes = 0;
        for (std::uint32_t j = 0; j < gaps; ++j) {
          const std::uint32_t c = codes[j];
          escapes += c == escape;
          sum += c == escape ? 0 : c;
        }
        if (escapes != e) {
          refuse(from, in_block() + ": " + std::to_string(e) + " exceptions announced, " +
                           std::to_string(escapes) + " escape codes found");
        }
        for (unsigned i = 0; i < e; ++i) {
          const auto x = detail::load<std::uint32_t>(q + packed + 4 * std::size_t{i});
          if (x < escape) {
            refuse(from, in_block() + ": exception " + std::to_string(x) +
                             " is below the escape code " + std::to_string(escape));
          }
          sum += x;
        }
        last = std::uint64_t{base} + gaps + sum;
        if (last > max_index) {
          refuse(from, in_block() +
                           ": indices pass the last 32-bit index (the block would end at " +
                           std::to_string(last) + ")");
        }
        if (check != detail::block_check(last)) {
          refuse(from, in_block() + ": check " + std::to_string(check) +
                           " does not match the decoded last index " + std::to_string(last) +
                           " (the block's indices are corrupt)");
        }
        at += need;
        left -= n;
      }
      if (last != h.last) {
        refuse(from, "group " + std::to_string(g) + " (at byte " + std::to_string(group_start) +
                         "): decoded last index " + std::to_string(last) +
                         " differs from the group's last index " + std::to_string(h.last));
      }
      entries_ += h.count;
    }
    if (at != size - attached) {
      refuse(from, at > size - attached
                       ? "the groups run into the " + std::to_string(attached) + "-byte attachment"
                       : std::to_string(size - attached - at) + " trailing bytes");
    }
    attachment_ = in.subspan(size - attached);
  }

  // The bytes after the last group (an FP8 part), empty if none.
  [[nodiscard]] std::span<const std::byte> attachment() const noexcept { return attachment_; }

  [[nodiscard]] MessageKind kind() const noexcept { return kind_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] Version base() const noexcept { return base_; }
  [[nodiscard]] std::uint64_t entry_count() const noexcept { return entries_; }
  [[nodiscard]] std::uint64_t run_count() const noexcept { return runs_; }
  [[nodiscard]] std::uint64_t run_elements() const noexcept { return run_elements_; }
  [[nodiscard]] std::uint32_t group_count() const noexcept { return groups_; }

  // f(const Group&) for every group, in order.
  template <class F>
  void for_each_group(F&& f) const {
    const std::byte* p = in_.data() + header_bytes;
    for (std::uint32_t g = 0; g < groups_; ++g) {
      const Group h = detail::read_group(p);
      f(static_cast<const Group&>(h));
      p = detail::skip_group(p, h);
    }
  }

  // f(const DeltaEntry&) for every sparse entry, in order.
  template <class F>
  void for_each_entry(F&& f) const {
    if (entries_ == 0) return;
    const std::byte* p = in_.data() + header_bytes;
    const std::byte* const end = in_.data() + in_.size();
    std::array<std::uint32_t, block_entries> codes;
    for (std::uint32_t g = 0; g < groups_; ++g) {
      const Group h = detail::read_group(p);
      if (h.dense) {
        p = detail::skip_group(p, h);
        continue;
      }
      p += group_header_bytes;
      for (std::uint32_t left = h.count; left > 0;) {
        const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(left, block_entries));
        const std::uint32_t gaps = n - 1;
        const unsigned w = detail::byte_at(p + 4);
        const std::byte* const q = p + block_header_bytes;
        const std::byte* exc = q + detail::packed_bytes(gaps, w);
        const std::byte* const bits = exc + 4 * std::size_t{detail::byte_at(p + 5)};
        detail::unpack(q, static_cast<std::size_t>(end - q), gaps, w, codes.data());
        const std::uint32_t escape = detail::escape_code(w);
        DeltaEntry entry{h.tensor, detail::load<std::uint32_t>(p),
                         detail::load<std::uint16_t>(bits)};
        f(static_cast<const DeltaEntry&>(entry));
        for (std::uint32_t j = 0; j < gaps; ++j) {
          std::uint32_t c = codes[j];
          if (c == escape) {
            c = detail::load<std::uint32_t>(exc);
            exc += 4;
          }
          entry.index += c + 1;
          entry.bits = detail::load<std::uint16_t>(bits + 2 * std::size_t{j + 1});
          f(static_cast<const DeltaEntry&>(entry));
        }
        p = bits + 2 * std::size_t{n};
        left -= n;
      }
    }
  }

  // f(tensor, first index, length, pointer to `length` little-endian u16 values) for every dense
  // group, in order.
  template <class F>
  void for_each_run(F&& f) const {
    const std::byte* p = in_.data() + header_bytes;
    std::uint64_t runs = runs_;
    for (std::uint32_t g = 0; g < groups_ && runs > 0; ++g) {
      const Group h = detail::read_group(p);
      if (h.dense) {
        f(h.tensor, h.first, h.count, static_cast<const std::byte*>(p + group_header_bytes));
        --runs;
      }
      p = detail::skip_group(p, h);
    }
  }

 private:
  static constexpr std::uint64_t max_index = std::numeric_limits<std::uint32_t>::max();

  [[noreturn]] static void refuse(const std::string& from, const std::string& what) {
    throw format_error("message from " + from + ": " + what + "; the version is refused");
  }

  static std::string hex(std::uint32_t v) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s = "0x";
    for (int shift = 28; shift >= 0; shift -= 4)
      s += digits[(v >> shift) & 0xF];
    return s;
  }

  std::span<const std::byte> in_;
  std::span<const std::byte> attachment_;
  MessageKind kind_ = MessageKind::delta;
  Version version_ = 0, base_ = 0;
  std::uint64_t entries_ = 0, runs_ = 0, run_elements_ = 0;
  std::uint32_t groups_ = 0;
};

// The byte offset of the first sparse value in a message (of the first dense value when it has no
// sparse group), npos when it has no value at all. Throws format_error when `in` is not a valid
// message. For fault tests, which flip a bit there.
inline std::size_t first_value_offset(std::span<const std::byte> in) {
  const MessageView view(in, "first_value_offset");
  const std::byte* const p = in.data();
  std::size_t at = header_bytes, dense = npos;
  for (std::uint32_t g = 0; g < view.group_count(); ++g) {
    const Group h = detail::read_group(p + at);
    if (!h.dense) {
      const std::size_t q = at + group_header_bytes;
      const std::uint32_t gaps =
          static_cast<std::uint32_t>(std::min<std::size_t>(h.count, block_entries)) - 1;
      return q + block_header_bytes + detail::packed_bytes(gaps, detail::byte_at(p + q + 4)) +
             4 * std::size_t{detail::byte_at(p + q + 5)};
    }
    if (dense == npos) dense = at + group_header_bytes;
    at = static_cast<std::size_t>(detail::skip_group(p + at, h) - p);
  }
  return dense;
}

// For tests and tools: a whole message as values.
struct Message {
  Version version = 0;
  Version base = no_version;
  MessageKind kind = MessageKind::delta;
  std::vector<DeltaEntry> entries;
  std::vector<DenseRun> runs;
};

// Encodes exactly as given, outside the sending policy (MessageWriter::add_entry and
// add_dense_group): the entries in the given order (a new group wherever the writer's group rule
// says), then each run as one dense group (empty ones add nothing).
inline std::vector<std::byte> encode(const Message& m) {
  MessageWriter w;
  w.begin();
  for (const DeltaEntry& e : m.entries)
    w.add_entry(e.tensor, e.index, e.bits);
  for (const DenseRun& r : m.runs)
    w.add_dense_group(r.tensor, r.index, r.bits);
  w.finish(m.kind, m.version, m.base);
  std::vector<std::byte> out;
  out.reserve(w.size());
  for (const std::span<const std::byte> s : w.spans())
    out.insert(out.end(), s.begin(), s.end());
  return out;
}

}  // namespace dte::wire
