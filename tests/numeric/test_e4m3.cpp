// SPDX-License-Identifier: Apache-2.0
// E4M3FN conversion (numeric/fp8.hpp) against its definition: the nearest of the 127 finite
// non-negative E4M3FN values with ties to the even code, the sign kept (-0 included), +-448 for
// an infinity or a magnitude that rounds past 448 (torch 2.13 saturates), NaN for a NaN. Checked on
// every FP32 value within 64 ulps of every E4M3FN value and of every midpoint between two, and
// on every 61st FP32 bit pattern. (tests/python/on_vllm/test_fp8.py compares it with torch.)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <ios>
#include <vector>

#include "dte/numeric/fp8.hpp"
#include "dte/numeric/round.hpp"

using namespace dte;

namespace {

std::uint8_t reference(float x) {
  const std::uint32_t u = float_bits(x);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7F);
  if (std::isinf(x)) return static_cast<std::uint8_t>(sign | 0x7E);
  const float a = std::fabs(x);
  // the largest code whose value is at most a
  int lo = 0, hi = 0x7E;
  if (a >= e4m3fn_to_float(0x7E)) {
    lo = 0x7E;
  } else {
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (e4m3fn_to_float(static_cast<std::uint8_t>(mid)) <= a)
        lo = mid;
      else
        hi = mid - 1;
    }
  }
  const float below = e4m3fn_to_float(static_cast<std::uint8_t>(lo));
  // the next value up: 480 past 448 (which E4M3FN cannot hold: saturated to 448)
  const float above = lo == 0x7E ? 480.0f : e4m3fn_to_float(static_cast<std::uint8_t>(lo + 1));
  const float midpoint = (below + above) / 2;  // exact: both have few mantissa bits
  int code = lo;
  if (a > midpoint || (a == midpoint && (lo & 1) != 0)) code = lo + 1;
  if (code > 0x7E) code = 0x7E;
  return static_cast<std::uint8_t>(sign | code);
}

}  // namespace

TEST_CASE("e4m3fn: the codes' values") {
  CHECK(e4m3fn_to_float(0x7E) == 448.0f);
  CHECK(e4m3fn_to_float(0x01) == std::ldexp(1.0f, -9));
  CHECK(e4m3fn_to_float(0x08) == std::ldexp(1.0f, -6));
  CHECK(e4m3fn_to_float(0x38) == 1.0f);
  CHECK(float_bits(e4m3fn_to_float(0x80)) == 0x80000000u);
  CHECK(std::isnan(e4m3fn_to_float(0x7F)));
  CHECK(std::isnan(e4m3fn_to_float(0xFF)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    CHECK(e4m3fn_from_float(e4m3fn_to_float(static_cast<std::uint8_t>(c))) == c);
  }
}

TEST_CASE("e4m3fn: conversion equals its definition") {
  std::vector<float> points;
  for (int c = 0; c < 0x7F; ++c) {
    const float v = e4m3fn_to_float(static_cast<std::uint8_t>(c));
    points.push_back(v);
    const float next = c == 0x7E ? 480.0f : e4m3fn_to_float(static_cast<std::uint8_t>(c + 1));
    points.push_back((v + next) / 2);
  }
  points.push_back(480.0f);
  std::uint64_t checked = 0, wrong = 0;
  const auto check = [&](std::uint32_t u) {
    const float x = bits_float(u);
    ++checked;
    if (e4m3fn_from_float(x) != reference(x)) {
      if (++wrong <= 10) MESSAGE("x = " << x << " (0x" << std::hex << u << ")");
    }
  };
  for (const float p : points) {
    for (const std::uint32_t sign : {0u, 0x80000000u}) {
      const std::uint32_t u = float_bits(p) | sign;
      for (std::uint32_t d = 0; d <= 64; ++d) {
        check(u + d);
        if ((u & 0x7FFFFFFFu) >= d) check(u - d);
      }
    }
  }
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFu; u += 61)
    check(static_cast<std::uint32_t>(u));
  CHECK(wrong == 0);
  CHECK(checked > 70'000'000);
}
