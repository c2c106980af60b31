// SPDX-License-Identifier: Apache-2.0
// The two values every pipeline stage passes along per element: what an OptimizerInverse
// reconstructs (Reconstruction) and what a ChangeDetector decides (Verdict).
#pragma once

#include <cstdint>

#include "dte/numeric/fp32.hpp"

namespace dte {

// The previous value of one element as reconstructed from optimizer state.
//
// Contract: the value the element held before the step, p0, satisfies |p0 - value| <= error.
// error == 0 means value IS p0, bit for bit (sign of zero included). When sign_exact is true,
// p0 also has the sign bit of value even where the interval [value - error, value + error]
// reaches across zero (this matters only for the two zero buckets of a 16-bit format).
struct Reconstruction {
  float value;
  float error;
  bool sign_exact = false;
};

// What the previous stored value of an element can be, from its reconstruction (a
// ChangeDetector's previous()): `bits` (the stored value of the reconstruction), `certain` when
// nothing else; otherwise, when `bounded`, every candidate lies between lo and hi in value order
// (the stored values of the error interval's ends, each widened by one FP32 step for the
// rounding of value -/+ error: a superset, never fewer).
struct PreviousBits {
  std::uint16_t bits = 0;
  bool certain = false;
  bool bounded = false;
  std::uint16_t lo = 0, hi = 0;
};

// What a ChangeDetector decides for one element.
enum class Verdict : std::uint8_t {
  unchanged = 0,
  changed = 1,  // the rounded values differ
  guard = 2,    // same rounded value, but too close to a rounding boundary to be sure
};

}  // namespace dte
