// SPDX-License-Identifier: Apache-2.0
// FP8 E4M3FN (the float8_e4m3fn of torch and CUDA's __nv_fp8_e4m3): 1 sign bit, 4 exponent bits
// (bias 7), 3 mantissa bits, no infinities, one NaN pattern per sign (S.1111.111), largest finite
// 448, smallest subnormal 2^-9.
//
// e4m3fn_from_float is torch 2.13's float -> float8_e4m3fn conversion
// (torch/headeronly/util/Float8_e4m3fn.h, fp8e4m3fn_from_fp32_value), which
// `tensor.to(torch.float8_e4m3fn)` runs on the CPU: round-to-nearest-even; a magnitude that
// rounds past 448, and an infinity, saturate to +-448; a NaN becomes NaN (0x7F with its sign);
// subnormals are rounded by one FP32 addition, as torch does. (torch releases before the
// saturation gave NaN from 464 on; docs/fp8.md.) An exhaustive test (tests/numeric) compares it
// with the nearest-value definition, and a Python test with the installed torch on every BF16
// value at several scales.
#pragma once

#include <cstdint>

#include "dte/config.hpp"
#include "dte/numeric/round.hpp"

namespace dte {

inline constexpr float e4m3fn_max = 448.0f;

// (Branch-free: every path is computed and one selected, so loops over it vectorise.)
DTE_HOST_DEVICE inline std::uint8_t e4m3fn_from_float(float x) noexcept {
  constexpr std::uint32_t past_max = std::uint32_t{1087} << 20;  // 480.0f
  constexpr std::uint32_t denorm_magic = std::uint32_t{141} << 23;
  constexpr std::uint32_t smallest_normal = std::uint32_t{121} << 23;  // 2^-6
  std::uint32_t u = float_bits(x);
  const std::uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // below 2^-6, the smallest normal: the addition rounds the value onto the subnormal grid
  const std::uint32_t sub = float_bits(bits_float(u) + bits_float(denorm_magic)) - denorm_magic;
  // a normal: the exponent rebiased, round to nearest even by adding 0x7FFFF + the kept lsb;
  // rounded up past 448 it saturates
  std::uint32_t normal =
      (u + (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
  normal -= static_cast<std::uint32_t>(normal == 0x7Fu);
  // from 480 on: NaN stays NaN (0x7F), a finite overflow or an infinity saturates (0x7E)
  const std::uint32_t big = 0x7Eu + static_cast<std::uint32_t>(u > 0x7F800000u);
  // (selected with masks: no branch)
  const std::uint32_t is_big = 0u - static_cast<std::uint32_t>(u >= past_max);
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(u < smallest_normal);
  const std::uint32_t r = (big & is_big) | (~is_big & ((sub & is_sub) | (normal & ~is_sub)));
  return static_cast<std::uint8_t>((r & 0xFFu) | (sign >> 24));
}

// The value of an E4M3FN code (NaN for S.1111.111).
DTE_HOST_DEVICE inline float e4m3fn_to_float(std::uint8_t c) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
  const std::uint32_t e = (c >> 3) & 0xFu, m = c & 0x7u;
  if (e == 0xF && m == 0x7) return bits_float(sign | 0x7FC00000u);
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    v = bits_float(((e + 120u) << 23) | (m << 20));
  }
  return bits_float(float_bits(v) | sign);
}

}  // namespace dte
