// SPDX-License-Identifier: Apache-2.0
// The gap code of sorted indices, as storage chunks and FP8 parts write them (docs/storage.md,
// docs/fp8.md): the first index
// itself, then each index minus the previous minus one; a gap below 255 in one byte, below 65535
// the byte 255 and two bytes, else 255, 0xFFFF and four bytes (little-endian). One writer
// (put_gaps), one reader (detail::take_gaps: plain indices through get_gaps, the class index's
// skips through its own stream).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/error.hpp"

namespace dte {

namespace detail {

// One gap of the gap code (put_gaps): below 255 one byte, below 65535 the byte 255 and
// two bytes, else 255, 0xFFFF and four bytes (little-endian).
inline void put_gap(std::uint64_t gap, std::vector<std::uint8_t>& out) {
  if (gap < 255) {
    out.push_back(static_cast<std::uint8_t>(gap));
    return;
  }
  out.push_back(255);
  const std::uint64_t wide = gap < 65535 ? gap : 65535;
  out.push_back(static_cast<std::uint8_t>(wide));
  out.push_back(static_cast<std::uint8_t>(wide >> 8));
  if (wide == 65535) {
    for (int b = 0; b < 4; ++b)
      out.push_back(static_cast<std::uint8_t>(gap >> (8 * b)));
  }
}

// What take_gaps found wrong.
enum class GapFault { ends, escape_ends, past_limit };

// Reads `count` values of the gap code from in[at...] (advancing at), each below `limit`, as T,
// into o[0, count); fail(fault, entry, value) throws: value is the escape's byte count for
// escape_ends, the value for past_limit.
template <class T, class Fail>
void take_gaps(std::span<const std::uint8_t> in, std::size_t& at, std::uint64_t count,
               std::uint64_t limit, Fail&& fail, T* const o) {
  const auto fixed = [&](int bytes, std::uint64_t k) {
    if (in.size() - at < static_cast<std::size_t>(bytes)) {
      fail(GapFault::escape_ends, k, static_cast<std::uint64_t>(bytes));
    }
    std::uint64_t v = 0;
    for (int b = 0; b < bytes; ++b)
      v |= std::uint64_t{in[at++]} << (8 * b);
    return v;
  };
  std::uint64_t next = 0;
  for (std::uint64_t k = 0; k < count;) {
    // Eight gap bytes at a time, with no branch on where escapes lie: the one-byte gaps before
    // the first escape (255) among them, then that escape's two-byte gap when there is one. A
    // four-byte gap (255, 0xFFFF) or a value past the limit leaves this loop: the values
    // increase, so the last one taken is checked for all.
    while (count - k >= 9 && in.size() - at >= 16) {
      std::uint64_t w = 0;
      std::memcpy(&w, in.data() + at, 8);
      const std::uint64_t x = ~w;  // a zero byte where w has an escape
      // (the lowest flag marks the first escape exactly; flags above it may be false)
      const std::uint64_t flags = (x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull;
      const auto take = static_cast<std::uint64_t>(std::countr_zero(flags) / 8);  // 0..8
      std::uint64_t after[9];  // after[j]: the value the j-th gap continues from
      after[0] = next;
      for (int j = 0; j < 8; ++j) {  // (all eight written: o has room for nine)
        const std::uint64_t v = after[j] + ((w >> (8 * j)) & 0xFF);
        o[k + static_cast<std::uint64_t>(j)] = static_cast<T>(v);
        after[j + 1] = v + 1;
      }
      std::uint16_t wide = 0;  // the escape's gap (read past the group when there is none)
      std::memcpy(&wide, in.data() + at + take + 1, 2);
      const std::uint64_t escaped = take < 8 ? 1 : 0;
      const std::uint64_t e = after[take] + wide;
      o[k + take] = static_cast<T>(e);  // (o[k + 8]: overwritten later when there is no escape)
      const std::uint64_t last = escaped != 0 ? e : after[8] - 1;
      if (((escaped != 0) & (wide == 65535)) | (last >= limit)) break;  // (then one at a time)
      next = last + 1;
      k += take + escaped;
      at += take + 3 * escaped;
    }
    // (then the next eight one at a time: the last few, a four-byte gap, or the fault)
    for (const std::uint64_t end = std::min<std::uint64_t>(count, k + 8); k < end; ++k) {
      if (at >= in.size()) fail(GapFault::ends, k, 0);
      std::uint64_t gap = in[at++];
      if (gap == 255) {
        gap = fixed(2, k);
        if (gap == 65535) gap = fixed(4, k);
      }
      const std::uint64_t v = next + gap;
      if (v >= limit) fail(GapFault::past_limit, k, v);
      o[k] = static_cast<T>(v);
      next = v + 1;
    }
  }
}

template <class T, class Fail>
std::vector<T> take_gaps(std::span<const std::uint8_t> in, std::size_t& at, std::uint64_t count,
                         std::uint64_t limit, Fail&& fail) {
  std::vector<T> out(static_cast<std::size_t>(count));
  take_gaps<T>(in, at, count, limit, std::forward<Fail>(fail), out.data());
  return out;
}

// The gaps of strictly increasing `v` (the first value, then each minus the previous minus
// one).
template <class F>
void for_each_gap(std::span<const std::uint32_t> v, F&& f) {
  std::uint64_t next = 0;
  for (const std::uint32_t x : v) {
    f(x - next);
    next = std::uint64_t{x} + 1;
  }
}

}  // namespace detail

// Appends the gap code of `sorted` (strictly increasing): the first index itself, then each
// index minus the previous minus one; below 255 one byte, below 65535 the byte 255 and two
// bytes, else 255, 0xFFFF and four bytes (little-endian).
inline void put_gaps(std::span<const std::uint32_t> sorted, std::vector<std::uint8_t>& out) {
  std::uint64_t next = 0;  // the smallest index the next one may be
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    if (sorted[k] < next) {
      throw invalid_argument("dte::storage::put_gaps: index " + std::to_string(sorted[k]) +
                             " at position " + std::to_string(k) +
                             " does not follow the previous one; sort and deduplicate first");
    }
    detail::put_gap(sorted[k] - next, out);
    next = std::uint64_t{sorted[k]} + 1;
  }
}

// Decodes exactly `count` indices from `in` (every byte used), each below `numel`, into
// out[0, count); format_error naming `where` otherwise.
inline void get_gaps(std::span<const std::uint8_t> in, std::uint64_t count, std::uint64_t numel,
                     const std::string& where, std::uint32_t* out) {
  if (count > in.size()) {
    throw format_error(where + ": " + std::to_string(count) + " values but only " +
                       std::to_string(in.size()) + " index bytes (each index takes at least one)");
  }
  std::size_t at = 0;
  detail::take_gaps<std::uint32_t>(
      in, at, count, numel,
      [&](detail::GapFault f, std::uint64_t k, std::uint64_t v) {
        if (f == detail::GapFault::ends) {
          throw format_error(where + ": the index stream ends after " + std::to_string(k) + " of " +
                             std::to_string(count) + " indices");
        }
        if (f == detail::GapFault::escape_ends) {
          throw format_error(where + ": index " + std::to_string(k) +
                             " is escaped but the stream ends inside its " + std::to_string(v) +
                             " bytes");
        }
        throw format_error(where + ": index " + std::to_string(v) + " (entry " + std::to_string(k) +
                           ") is outside the tensor's " + std::to_string(numel) + " elements");
      },
      out);
  if (at != in.size()) {
    throw format_error(where + ": " + std::to_string(in.size() - at) +
                       " bytes follow the last of the " + std::to_string(count) + " indices");
  }
}

inline std::vector<std::uint32_t> get_gaps(std::span<const std::uint8_t> in, std::uint64_t count,
                                           std::uint64_t numel, const std::string& where) {
  if (count > in.size()) {  // (before the allocation: each index takes at least one byte)
    get_gaps(in, count, numel, where, nullptr);
  }
  std::vector<std::uint32_t> out(static_cast<std::size_t>(count));
  get_gaps(in, count, numel, where, out.data());
  return out;
}

}  // namespace dte
