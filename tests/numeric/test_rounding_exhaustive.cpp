// SPDX-License-Identifier: Apache-2.0
// Every one of the 2^32 FP32 bit patterns: dte's rounding equals CUDA's own host implementation
// of __float2bfloat16_rn and __float2half_rn (cuda_bf16.h / cuda_fp16.h, code nobody here wrote),
// and every value lies inside the rounding interval dte reports for its 16-bit result.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ios>
#include <limits>
#include <string>

#include "dte/numeric/round.hpp"

namespace {

std::uint16_t cuda_bf16(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  std::uint16_t u;
  std::memcpy(&u, &b, sizeof u);
  return u;
}

std::uint16_t cuda_fp16(float x) {
  const __half h = __float2half_rn(x);
  std::uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

std::string hex(std::uint64_t x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%08llx", static_cast<unsigned long long>(x));
  return buf;
}

struct Mismatches {
  std::uint64_t count = 0;
  std::uint64_t first = std::numeric_limits<std::uint64_t>::max();
};

template <class F>
Mismatches scan_all(F&& bad) {
  std::uint64_t count = 0;
  std::uint64_t first = std::numeric_limits<std::uint64_t>::max();
#pragma omp parallel for schedule(static, 1 << 16) reduction(+ : count) reduction(min : first)
  for (std::uint64_t i = 0; i <= 0xFFFFFFFFull; ++i) {
    if (bad(static_cast<std::uint32_t>(i))) {
      ++count;
      if (i < first) first = i;
    }
  }
  return {count, first};
}

template <class Format>
bool outside_interval(std::uint32_t u) {
  const float x = dte::bits_float(u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return false;  // NaN: no interval
  const std::uint16_t b = Format::round(x);
  const dte::RoundingInterval iv = Format::interval(b);
  if (!(iv.lo <= x && x <= iv.hi)) return true;
  // +0 and -0 compare equal as floats; the sign bit must still match.
  return ((u >> 31) != 0) != ((b >> 15) != 0);
}

}  // namespace

TEST_CASE("bf16 rounding equals CUDA __float2bfloat16_rn on all 2^32 inputs") {
  const Mismatches m = scan_all([](std::uint32_t u) {
    const float x = dte::bits_float(u);
    return dte::round_bf16(x) != cuda_bf16(x);
  });
  INFO("mismatches: " << m.count << ", first input bits: " << hex(m.first));
  CHECK(m.count == 0);
}

TEST_CASE("fp16 rounding equals CUDA __float2half_rn on all 2^32 inputs") {
  const Mismatches m = scan_all([](std::uint32_t u) {
    const float x = dte::bits_float(u);
    return dte::round_fp16(x) != cuda_fp16(x);
  });
  INFO("mismatches: " << m.count << ", first input bits: " << hex(m.first));
  CHECK(m.count == 0);
}

TEST_CASE("every FP32 value lies in the rounding interval of its bf16 and fp16 result") {
  const Mismatches bf = scan_all(outside_interval<dte::Bf16Format>);
  INFO("bf16: " << bf.count << " outside, first input bits: " << hex(bf.first));
  CHECK(bf.count == 0);
  const Mismatches fp = scan_all(outside_interval<dte::Fp16Format>);
  INFO("fp16: " << fp.count << " outside, first input bits: " << hex(fp.first));
  CHECK(fp.count == 0);
}
