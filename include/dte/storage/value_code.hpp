// SPDX-License-Identifier: Apache-2.0
// The 16-bit value codes of canonical chunks (storage/chunk.hpp), per element, shared by every
// backend: `value` stores the new bits themselves (overwrite); `diff` stores each new value
// against the base version's bits, so the one-ulp changes that dominate a small-learning-rate
// step get small codes whose high byte is 0 and whose low byte takes few values: about a quarter
// fewer bytes through zstd than the XOR of the two bit patterns (whose carry chains vary with
// the base's trailing bits), measured by bench/bench_storage.cpp. A diff code is
//   4 + zigzag(d)  the step d = ordered(new) - ordered(base) on the ordered line, as a 16-bit
//                  two's-complement integer (zigzag: 0, -1, 1, -2, ... become 0, 1, 2, 3, ...);
//                  one ulp down is 5, one ulp up 6; a step the 16 bits cannot hold (+-32766 ulps
//                  and more) is never written: such an element goes into a value chunk;
//   r in 0..3      a near code, for an element whose base the writer knows only to within a few
//                  patterns (the reconstruction's guard band, detect/detect.hpp): the new
//                  pattern is the one at residue r modulo 4 on the ordered line nearest the base,
//                  within [base - 2, base + 2); the writer uses it only when that names the new
//                  pattern for every base it cannot rule out (near_fits).
// The near codes sit below the steps so that the high byte stays 0 (zstd codes a byte plane of
// rare 0xFF far worse than a rarer low symbol).
//
// The ordered line maps a bit pattern to an unsigned integer that increases with the value it
// stands for (negative patterns reversed below the positive ones, -0 just below +0); it is a
// bijection of the 2^16 patterns and steps are taken modulo 2^16, so every pair of patterns
// (infinities and NaN payloads included) codes and decodes exactly.
#pragma once

#include <cstdint>

#include "dte/config.hpp"

namespace dte::storage {

// The position of bit pattern b on the ordered line, and back.
DTE_HOST_DEVICE constexpr std::uint16_t ordered16(std::uint16_t b) noexcept {
  return static_cast<std::uint16_t>((b & 0x8000u) != 0 ? ~b : b | 0x8000u);
}
DTE_HOST_DEVICE constexpr std::uint16_t unordered16(std::uint16_t o) noexcept {
  return static_cast<std::uint16_t>((o & 0x8000u) != 0 ? o & 0x7FFFu : ~o);
}

// The codes below this one are the near codes.
inline constexpr std::uint16_t near_codes = 4;

// zigzag of the step from base to now (16-bit two's complement).
DTE_HOST_DEVICE constexpr std::uint16_t diff_zigzag(std::uint16_t base,
                                                    std::uint16_t now) noexcept {
  const auto d = static_cast<std::uint16_t>(ordered16(now) - ordered16(base));
  const bool negative = (d & 0x8000u) != 0;
  return static_cast<std::uint16_t>(static_cast<std::uint16_t>(d << 1) ^ (negative ? 0xFFFFu : 0));
}

// Whether the step from base to now has a diff code (else the element needs the value
// encoding).
DTE_HOST_DEVICE constexpr bool diff_fits(std::uint16_t base, std::uint16_t now) noexcept {
  return diff_zigzag(base, now) <= 0xFFFFu - near_codes;
}

// The diff code of the step from base to now (diff_fits(base, now) must hold).
DTE_HOST_DEVICE constexpr std::uint16_t diff_code(std::uint16_t base, std::uint16_t now) noexcept {
  return static_cast<std::uint16_t>(diff_zigzag(base, now) + near_codes);
}

// The near code of `now`.
DTE_HOST_DEVICE constexpr std::uint16_t near_code(std::uint16_t now) noexcept {
  return static_cast<std::uint16_t>(ordered16(now) & 3u);
}

// Whether near_code(now) decodes to `now` against every base whose ordered position lies
// between those of lo and hi: each such base within [now - 1, now + 2] on the ordered line.
DTE_HOST_DEVICE constexpr bool near_fits(std::uint16_t lo, std::uint16_t hi,
                                         std::uint16_t now) noexcept {
  const auto a = static_cast<std::uint16_t>(ordered16(lo) - ordered16(now) + 1);  // now-1 -> 0
  const auto b = static_cast<std::uint16_t>(ordered16(hi) - ordered16(now) + 1);
  return a <= b && b <= 3;
}

// The bits diff_code(base, now) or near_code(now) came from, given base.
DTE_HOST_DEVICE constexpr std::uint16_t diff_apply(std::uint16_t base,
                                                   std::uint16_t code) noexcept {
  if (code < near_codes) {
    const auto from = static_cast<std::uint16_t>(ordered16(base) - 2);
    return unordered16(static_cast<std::uint16_t>(from + ((code - from) & 3u)));
  }
  const auto z = static_cast<std::uint16_t>(code - near_codes);
  const auto d = static_cast<std::uint16_t>((z >> 1) ^ ((z & 1u) != 0 ? 0xFFFFu : 0));
  return unordered16(static_cast<std::uint16_t>(ordered16(base) + d));
}

}  // namespace dte::storage
