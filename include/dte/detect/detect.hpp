// SPDX-License-Identifier: Apache-2.0
// ChangeDetector policies: did an element's inference-visible 16-bit value change?
//
// Changed iff the bit patterns of round(current) and round(previous) differ (never a float
// compare: +0/-0 differ, NaN == NaN), or the previous value is only known to within an error
// bound that reaches past the edge of its rounding interval (the guard band). The guard band
// makes a reconstruction error unable to hide a real change: it may add elements, never drop one.
#pragma once

#include <cstdint>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/numeric/round.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

template <storage_format F>
struct BasicDetect {
  using change_detector_tag = void;
  using format = F;

  // The bits receivers store for a value.
  DTE_HOST_DEVICE static std::uint16_t store(float x) noexcept { return F::round(x); }

  DTE_HOST_DEVICE static Verdict classify(float current, const Reconstruction& prev) noexcept {
    const std::uint16_t before = F::round(prev.value);
    if (F::round(current) != before) return Verdict::changed;
    return certain(prev, before) ? Verdict::unchanged : Verdict::guard;
  }

  // Whether store(prev.value) is certainly the previous stored value: the reconstruction is
  // exact, or its error interval lies inside one rounding interval. (A diff against the
  // previous value needs exactly this: storage/publisher.hpp.)
  DTE_HOST_DEVICE static bool certain(const Reconstruction& prev) noexcept {
    return certain(prev, F::round(prev.value));
  }

  // (before: F::round(prev.value), when the caller has it)
  DTE_HOST_DEVICE static bool certain(const Reconstruction& prev, std::uint16_t before) noexcept {
    if (prev.error == 0.0f) return true;  // bit-exact previous value
    // Not finite: no interval to reason about.
    if (!((float_bits(prev.value) & 0x7FFFFFFFu) < 0x7F800000u) ||
        !((float_bits(prev.error) & 0x7FFFFFFFu) < 0x7F800000u)) {
      return false;
    }
    const RoundingInterval iv = F::interval(before);
    // value and the interval ends lie in one rounding interval, so these differences are exact
    // (Sterbenz, or both subnormal). Strict: a value exactly error away may sit on the edge.
    const bool lower_ok =
        (prev.value - iv.lo > prev.error) || (prev.sign_exact && float_bits(iv.lo) == 0x00000000u);
    const bool upper_ok =
        (iv.hi - prev.value > prev.error) || (prev.sign_exact && float_bits(iv.hi) == 0x80000000u);
    return lower_ok && upper_ok;
  }

  // The candidates for the previous stored value (PreviousBits).
  DTE_HOST_DEVICE static PreviousBits previous(const Reconstruction& prev) noexcept {
    PreviousBits p;
    p.bits = F::round(prev.value);
    p.certain = certain(prev, p.bits);
    if (p.certain) {
      p.bounded = true;
      p.lo = p.hi = p.bits;
      return p;
    }
    const auto finite = [](float x) { return (float_bits(x) & 0x7FFFFFFFu) < 0x7F800000u; };
    const float lo = prev.value - prev.error;
    const float hi = prev.value + prev.error;
    if (!finite(prev.value) || !finite(prev.error) || !finite(lo) || !finite(hi)) return p;
    p.bounded = true;
    p.lo = F::round(next_down(lo));
    p.hi = F::round(next_up(hi));
    return p;
  }

  DTE_HOST_DEVICE static bool changed(float current, const Reconstruction& prev) noexcept {
    return classify(current, prev) != Verdict::unchanged;
  }
};

using BF16Detect = BasicDetect<Bf16Format>;
using FP16Detect = BasicDetect<Fp16Format>;
static_assert(change_detector<BF16Detect>);
static_assert(change_detector<FP16Detect>);

}  // namespace dte
