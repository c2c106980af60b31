// SPDX-License-Identifier: Apache-2.0
// Element math: FP32 -> BF16 / FP16 round-to-nearest-even, bit views, and for every 16-bit value
// the exact set of FP32 values that round to it. Bit-identical to CUDA's __float2bfloat16_rn and
// __float2half_rn (proven by an exhaustive test over all 2^32 inputs), NaN included: every NaN
// becomes the canonical 0x7FFF, as CUDA does. torch's CPU conversion gives 0x7FC0 instead; dte
// never publishes a NaN (validation refuses them), so the difference cannot reach a receiver.
#pragma once

#include <concepts>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dte/config.hpp"

namespace dte {

// Bit views. memcpy rather than std::bit_cast so that the same code compiles under nvcc's
// device pass and constant evaluation is not needed on the hot path.
DTE_HOST_DEVICE inline std::uint32_t float_bits(float x) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

DTE_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// A 16-bit storage format: rounding from FP32, widening back, and rounding intervals.
// Bf16Format and Fp16Format below are the two shipped ones.
struct RoundingInterval {
  float lo;  // smallest FP32 value that rounds to the 16-bit value (inclusive)
  float hi;  // largest FP32 value that rounds to it (inclusive)
};

inline constexpr std::uint16_t canonical_nan16 = 0x7FFF;

struct Bf16Format {
  static constexpr const char* name = "bf16";

  // Round-to-nearest-even; NaN -> 0x7FFF; overflow rounds to +-Inf as IEEE says.
  DTE_HOST_DEVICE static std::uint16_t round(float x) noexcept {
    const std::uint32_t u = float_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return canonical_nan16;
    return round_not_nan(x);
  }
  // round() of a value known not to be NaN (validated weights): no branch, so loops over it
  // vectorise. Adding 0x7FFF plus the lowest kept bit implements ties-to-even; the carry
  // propagates into the exponent exactly when the value rounds up to the next binade (or to Inf).
  DTE_HOST_DEVICE static std::uint16_t round_not_nan(float x) noexcept {
    const std::uint32_t u = float_bits(x);
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7FFFu + lsb) >> 16);
  }

  DTE_HOST_DEVICE static float widen(std::uint16_t b) noexcept {
    return bits_float(static_cast<std::uint32_t>(b) << 16);
  }

  DTE_HOST_DEVICE static bool is_nan(std::uint16_t b) noexcept { return (b & 0x7FFFu) > 0x7F80u; }

  // For a non-NaN value b, the inclusive FP32 range that rounds to it. Ties go to the value with
  // an even last bit, so a boundary midpoint belongs to b exactly when b is even.
  DTE_HOST_DEVICE static RoundingInterval interval(std::uint16_t b) noexcept {
    const std::uint32_t mag = b & 0x7FFFu;
    const std::uint32_t even = (mag & 1u) == 0u;
    std::uint32_t lo_bits;  // magnitudes, as FP32 bit patterns
    std::uint32_t hi_bits;
    if (mag == 0) {
      lo_bits = 0;
    } else {
      lo_bits = (mag << 16) - 0x8000u + (even ? 0u : 1u);
    }
    if (mag == 0x7F80u) {
      hi_bits = 0x7F800000u;  // Inf: everything from the overflow threshold up
    } else {
      hi_bits = (mag << 16) + 0x8000u - (even ? 0u : 1u);
    }
    if (b & 0x8000u) {
      return {bits_float(hi_bits | 0x80000000u), bits_float(lo_bits | 0x80000000u)};
    }
    return {bits_float(lo_bits), bits_float(hi_bits)};
  }
};

struct Fp16Format {
  static constexpr const char* name = "fp16";

  // Round-to-nearest-even to IEEE binary16; NaN -> 0x7FFF (as CUDA); overflow -> +-Inf;
  // results below the smallest subnormal (2^-24) round to +-0 or to it.
  DTE_HOST_DEVICE static std::uint16_t round(float x) noexcept {
    const std::uint32_t u = float_bits(x);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t mag = u & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return canonical_nan16;
    if (mag >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: Inf
    const std::uint32_t exp = mag >> 23;
    if (exp >= 113) {                                    // normal binary16 result (|x| >= 2^-14)
      const std::uint32_t rebased = mag - (112u << 23);  // re-bias the exponent from 127 to 15
      const std::uint32_t lsb = (rebased >> 13) & 1u;
      return static_cast<std::uint16_t>(sign | ((rebased + 0xFFFu + lsb) >> 13));
    }
    if (exp < 102) return static_cast<std::uint16_t>(sign);  // |x| < 2^-25: rounds to zero
    // Subnormal result: value = m * 2^-24 with m = significand >> shift, rounded to nearest even.
    const std::uint32_t significand = (mag & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // 14..24
    const std::uint32_t kept = significand >> shift;
    const std::uint32_t rest = significand & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    const std::uint32_t up = (rest > half) || (rest == half && (kept & 1u));
    return static_cast<std::uint16_t>(sign | (kept + up));
  }

  DTE_HOST_DEVICE static float widen(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu;
    const std::uint32_t man = h & 0x3FFu;
    if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));
    if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
    // Subnormal or zero: man * 2^-24 is exact in FP32.
    const float mag = static_cast<float>(man) * bits_float(0x33800000u);  // 2^-24
    return bits_float(sign | float_bits(mag));
  }

  DTE_HOST_DEVICE static bool is_nan(std::uint16_t h) noexcept { return (h & 0x7FFFu) > 0x7C00u; }

  DTE_HOST_DEVICE static RoundingInterval interval(std::uint16_t h) noexcept {
    const std::uint32_t mag = h & 0x7FFFu;
    const bool even = (mag & 1u) == 0u;
    float lo;
    float hi;
    // Midpoints between neighbouring binary16 values need 12 significant bits: exact in FP32.
    if (mag == 0) {
      lo = 0.0f;
    } else if (mag == 0x7C00u) {
      lo = 65520.0f;  // halfway from 65504 to 2^16; the tie goes to Inf (even)
    } else {
      const float mid = 0.5f * (widen(static_cast<std::uint16_t>(mag - 1)) +
                                widen(static_cast<std::uint16_t>(mag)));
      lo = even ? mid : bits_float(float_bits(mid) + 1u);
    }
    if (mag == 0x7C00u) {
      hi = bits_float(0x7F800000u);
    } else {
      // The value above 65504 would be 65536 = 2^16 if the exponent did not overflow.
      const float next = mag == 0x7BFFu ? 65536.0f : widen(static_cast<std::uint16_t>(mag + 1));
      const float mid = 0.5f * (widen(static_cast<std::uint16_t>(mag)) + next);
      hi = even ? mid : bits_float(float_bits(mid) - 1u);
    }
    if (h & 0x8000u) return {-hi, -lo};
    return {lo, hi};
  }
};

template <class F>
concept storage_format = requires(float x, std::uint16_t b) {
  { F::round(x) } -> std::same_as<std::uint16_t>;
  { F::widen(b) } -> std::same_as<float>;
  { F::interval(b) } -> std::same_as<RoundingInterval>;
  { F::is_nan(b) } -> std::same_as<bool>;
};

static_assert(storage_format<Bf16Format>);
static_assert(storage_format<Fp16Format>);

DTE_HOST_DEVICE inline std::uint16_t round_bf16(float x) noexcept {
  return Bf16Format::round(x);
}
DTE_HOST_DEVICE inline std::uint16_t round_fp16(float x) noexcept {
  return Fp16Format::round(x);
}
DTE_HOST_DEVICE inline float bf16_to_float(std::uint16_t b) noexcept {
  return Bf16Format::widen(b);
}
DTE_HOST_DEVICE inline float fp16_to_float(std::uint16_t h) noexcept {
  return Fp16Format::widen(h);
}

}  // namespace dte
