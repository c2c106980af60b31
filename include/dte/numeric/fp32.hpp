// SPDX-License-Identifier: Apache-2.0
// FP32 arithmetic the error bounds rely on: the unit roundoff and underflow constants of the
// error model, operations rounded once and never fused, constants rounded up. docs/math.md
// derives every bound built from them.
#pragma once

#include <cmath>
#include <cstdint>

#include "dte/config.hpp"
#include "dte/numeric/round.hpp"

// Host fast-math (g++/clang -ffast-math, also through nvcc -Xcompiler) is refused here. nvcc's
// --use_fast_math defines no macro (nvcc 13): dte's CMake targets add --ftz=false
// --prec-div=true --prec-sqrt=true to every CUDA file that links them, which win over it; built
// without them, a .cu file must not use --use_fast_math, -ftz=true, -prec-div=false or
// -prec-sqrt=false (docs/math.md, "fast-math").
#if defined(__FAST_MATH__)
#error \
    "dte: fast-math changes FP32 rounding, square roots and NaN tests; the error bounds of the optimizer inverses assume IEEE arithmetic. Compile dte code without -ffast-math."
#endif

namespace dte {

namespace detail {

// Unit roundoff of FP32 round-to-nearest: |fl(x op y) - x op y| <= u |x op y| (normal range).
inline constexpr double unit_roundoff = 1.0 / 16777216.0;  // 2^-24
// Smallest positive FP32 subnormal; every underflowing multiply, divide or square root is off by
// at most half of it in absolute terms.
inline constexpr double min_subnormal = 1.4012984643248171e-45;  // 2^-149

// The FP32 value nearest to a non-negative constant of an error bound, rounded up rather than to
// nearest: a bound may be loose, never short.
inline float float_up(double x) noexcept {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, bits_float(0x7F800000u));
  return f;
}

}  // namespace detail

// The FP32 neighbours of a finite x, as std::nextafter towards +-infinity gives them (from either
// zero, the smallest subnormal of that sign), from the bits alone so that device code has them.
DTE_HOST_DEVICE inline float next_up(float x) noexcept {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) == 0) return bits_float(1u);
  return bits_float((u & 0x80000000u) != 0 ? u - 1 : u + 1);
}
DTE_HOST_DEVICE inline float next_down(float x) noexcept {
  return -next_up(-x);
}

namespace detail {

// FP32 operations rounded once each, never fused: nvcc contracts a*b+c into an FMA by default,
// which would make device verdicts differ from the host's in the last bit. (The bounds hold
// either way; identical verdicts make the CUDA backend testable against the host backend.)
DTE_HOST_DEVICE inline float mul_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DTE_HOST_DEVICE inline float add_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DTE_HOST_DEVICE inline float div_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace detail
}  // namespace dte
