// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <ios>
#include <limits>

#include "dte/numeric/fp32.hpp"
#include "dte/numeric/round.hpp"

using dte::bits_float;
using dte::float_bits;

namespace {

float next_up(float x) {
  return std::nextafter(x, std::numeric_limits<float>::infinity());
}
float next_down(float x) {
  return std::nextafter(x, -std::numeric_limits<float>::infinity());
}

// For every non-NaN 16-bit value: both ends of its interval round to it, and the FP32 neighbours
// just outside round to something else (the interval is exact, not just safe).
template <class Format>
void check_intervals_are_exact() {
  int failures = 0;
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    if (Format::is_nan(h)) continue;
    const dte::RoundingInterval iv = Format::interval(h);
    bool ok = Format::round(iv.lo) == h && Format::round(iv.hi) == h && iv.lo <= iv.hi;
    if (!std::isinf(iv.lo) && float_bits(iv.lo) != 0x80000000u && float_bits(iv.lo) != 0u) {
      ok = ok && Format::round(next_down(iv.lo)) != h;
    }
    if (!std::isinf(iv.hi) && float_bits(iv.hi) != 0x80000000u && float_bits(iv.hi) != 0u) {
      ok = ok && Format::round(next_up(iv.hi)) != h;
    }
    ok = ok && Format::round(Format::widen(h)) == h;  // widening is exact
    if (!ok && ++failures < 5) {
      MESSAGE(Format::name << " value 0x" << std::hex << b << ": interval [" << iv.lo << ", "
                           << iv.hi << "]");
    }
  }
  CHECK(failures == 0);
}

}  // namespace

TEST_CASE("bf16 rounding: ties to even, specials, subnormals") {
  CHECK(dte::round_bf16(1.0f) == 0x3F80);
  CHECK(dte::round_bf16(bits_float(0x3F808000u)) == 0x3F80);  // tie, 0x3F80 even: down
  CHECK(dte::round_bf16(bits_float(0x3F818000u)) == 0x3F82);  // tie, 0x3F81 odd: up
  CHECK(dte::round_bf16(bits_float(0x3F808001u)) == 0x3F81);  // just above the tie
  CHECK(dte::round_bf16(0.0f) == 0x0000);
  CHECK(dte::round_bf16(-0.0f) == 0x8000);
  CHECK(dte::round_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(dte::round_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(dte::round_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // overflows to Inf
  CHECK(dte::round_bf16(bits_float(0x7F7F7FFFu)) == 0x7F7F);
  CHECK(dte::round_bf16(bits_float(0x7F7F8000u)) == 0x7F80);  // tie above the largest finite
  CHECK(dte::round_bf16(bits_float(0x00008000u)) == 0x0000);  // 2^-134: tie to +0
  CHECK(dte::round_bf16(bits_float(0x00008001u)) == 0x0001);
  CHECK(dte::round_bf16(bits_float(0x80018000u)) == 0x8002);  // negative subnormal tie, odd: up
  // Every NaN, quiet or signalling, either sign, becomes the canonical 0x7FFF (as CUDA).
  CHECK(dte::round_bf16(bits_float(0x7FC00000u)) == 0x7FFF);
  CHECK(dte::round_bf16(bits_float(0xFF800001u)) == 0x7FFF);
  CHECK(dte::round_bf16(bits_float(0x7F80FFFFu)) == 0x7FFF);
}

TEST_CASE("fp16 rounding: ties to even, overflow, subnormals") {
  CHECK(dte::round_fp16(1.0f) == 0x3C00);
  CHECK(dte::round_fp16(65504.0f) == 0x7BFF);
  CHECK(dte::round_fp16(65519.996f) == 0x7BFF);
  CHECK(dte::round_fp16(65520.0f) == 0x7C00);  // tie to the even Inf
  CHECK(dte::round_fp16(-1e9f) == 0xFC00);
  CHECK(dte::round_fp16(std::ldexp(1.0f, -24)) == 0x0001);             // smallest subnormal
  CHECK(dte::round_fp16(std::ldexp(1.0f, -25)) == 0x0000);             // tie to +0
  CHECK(dte::round_fp16(std::ldexp(1.5f, -24)) == 0x0002);             // tie, 1 odd: up
  CHECK(dte::round_fp16(std::ldexp(1.0f, -14)) == 0x0400);             // smallest normal
  CHECK(dte::round_fp16(next_down(std::ldexp(1.0f, -14))) == 0x0400);  // rounds up into normal
  CHECK(dte::round_fp16(-0.0f) == 0x8000);
  CHECK(dte::round_fp16(bits_float(0x7FC00000u)) == 0x7FFF);
  CHECK(dte::fp16_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(dte::fp16_to_float(0xFBFF) == -65504.0f);
  CHECK(std::isinf(dte::fp16_to_float(0x7C00)));
}

TEST_CASE("rounding intervals are exact for every bf16 value") {
  check_intervals_are_exact<dte::Bf16Format>();
}

TEST_CASE("rounding intervals are exact for every fp16 value") {
  check_intervals_are_exact<dte::Fp16Format>();
}

TEST_CASE("the zero intervals are split by sign") {
  const auto pz = dte::Bf16Format::interval(0x0000);
  const auto nz = dte::Bf16Format::interval(0x8000);
  CHECK(float_bits(pz.lo) == 0x00000000u);
  CHECK(float_bits(pz.hi) == 0x00008000u);
  CHECK(float_bits(nz.lo) == 0x80008000u);
  CHECK(float_bits(nz.hi) == 0x80000000u);
  const auto inf = dte::Bf16Format::interval(0x7F80);
  CHECK(float_bits(inf.lo) == 0x7F7F8000u);
  CHECK(std::isinf(inf.hi));
  const auto half_inf = dte::Fp16Format::interval(0x7C00);
  CHECK(half_inf.lo == 65520.0f);
  CHECK(dte::Fp16Format::interval(0xFC00).hi == -65520.0f);
}

TEST_CASE("dte::next_up and next_down are std::nextafter towards +-infinity on finite values") {
  std::uint64_t checked = 0;
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 65521) {  // a prime stride
    const float x = bits_float(static_cast<std::uint32_t>(b));
    if (!std::isfinite(x)) continue;
    REQUIRE(float_bits(dte::next_up(x)) == float_bits(next_up(x)));
    REQUIRE(float_bits(dte::next_down(x)) == float_bits(next_down(x)));
    ++checked;
  }
  for (const float x : {0.0f, -0.0f, bits_float(1u), -bits_float(1u), 1.0f, -1.0f,
                        std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()}) {
    CHECK(float_bits(dte::next_up(x)) == float_bits(next_up(x)));
    CHECK(float_bits(dte::next_down(x)) == float_bits(next_down(x)));
  }
  CHECK(checked > 60000);
}
