// SPDX-License-Identifier: Apache-2.0
// Audit of an optimizer inverse against the truth: given the weights before a step (which dte
// never needs in production), count what the reconstruction + guard band detects and misses.
// It also checks the contract the guard band rests on, |theta_prev - value| <= error, element by
// element: a bound violation is a miss that has not happened yet.
// Used by `dte audit-inverse`, the oracle tests, the forward-variant and bound property tests.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/validate.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

namespace detail {

DTE_HOST_DEVICE inline bool finite_bits(float x) noexcept {
  return (float_bits(x) & 0x7FFFFFFFu) < 0x7F800000u;
}

// |a - b| > e, decided exactly: a - b in double is s + r exactly (TwoSum), and the comparison
// with e is then exact too, whatever the exponents of a and b.
DTE_HOST_DEVICE inline bool distance_exceeds(float a, float b, float e) noexcept {
  const double x = a, y = -static_cast<double>(b);
  const double s = x + y;
  const double bb = s - x;
  const double r = (x - (s - bb)) + (y - bb);
  const double as = s < 0.0 ? -s : s, ee = e;
  if (as != ee) return as > ee;
  return (s > 0.0 && r > 0.0) || (s < 0.0 && r < 0.0);
}

}  // namespace detail

// Whether a reconstruction breaks its contract (dte/reconstruction.hpp) for the true previous
// value: |theta_prev - value| > error; or error == 0 and value is not theta_prev bit for bit; or
// sign_exact and the sign bits differ. A non-finite value or error claims nothing (the detector
// flags such an element whatever it is), so it cannot break the contract.
DTE_HOST_DEVICE inline bool breaks_bound(float theta_prev, const Reconstruction& r) noexcept {
  if (!detail::finite_bits(r.value) || !detail::finite_bits(r.error)) return false;
  if (r.error == 0.0f) return float_bits(theta_prev) != float_bits(r.value);
  if (r.sign_exact && (float_bits(theta_prev) >> 31) != (float_bits(r.value) >> 31)) return true;
  return detail::distance_exceeds(theta_prev, r.value, r.error);
}

// |theta_prev - value| / error: above 1 is a violation; infinite for an inexact "exact" value.
DTE_HOST_DEVICE inline double bound_ratio(float theta_prev, const Reconstruction& r) noexcept {
  if (!detail::finite_bits(r.value) || !detail::finite_bits(r.error)) return 0.0;
  if (r.error == 0.0f) {
    return float_bits(theta_prev) == float_bits(r.value)
               ? 0.0
               : static_cast<double>(bits_float(0x7F800000u));
  }
  const double d = static_cast<double>(theta_prev) - static_cast<double>(r.value);
  return (d < 0.0 ? -d : d) / static_cast<double>(r.error);
}

struct AuditCounts {
  std::uint64_t elements = 0;
  std::uint64_t true_changed = 0;  // 16-bit value of theta differs from that of theta_prev
  std::uint64_t detected = 0;      // flagged by dte (changed or guard band)
  std::uint64_t missed = 0;        // truly changed but not flagged: must be 0
  std::uint64_t guard_extra = 0;   // flagged although unchanged: bandwidth, not correctness
  std::int64_t first_missed = -1;  // index of the first missed element, for diagnostics
  // |theta_prev - value| > error (breaks_bound): the guarantee failed, missed or not. Must be 0.
  std::uint64_t bound_violations = 0;
  std::int64_t first_violation = -1;
  double worst_bound_ratio = 0.0;  // max |theta_prev - value| / error over all elements

  AuditCounts& operator+=(const AuditCounts& o) noexcept {
    if (first_missed < 0 && o.first_missed >= 0) {
      first_missed = static_cast<std::int64_t>(elements) + o.first_missed;
    }
    if (first_violation < 0 && o.first_violation >= 0) {
      first_violation = static_cast<std::int64_t>(elements) + o.first_violation;
    }
    bound_violations += o.bound_violations;
    worst_bound_ratio = std::fmax(worst_bound_ratio, o.worst_bound_ratio);
    elements += o.elements;
    true_changed += o.true_changed;
    detected += o.detected;
    missed += o.missed;
    guard_extra += o.guard_extra;
    return *this;
  }

  [[nodiscard]] double guard_extra_fraction() const noexcept {
    return elements == 0 ? 0.0 : static_cast<double>(guard_extra) / static_cast<double>(elements);
  }
};

// Runs kernel + Detect over every element and compares with the true previous weights.
template <change_detector Detect, class Kernel>
AuditCounts audit_reconstruction(const Kernel& kernel, std::span<const float> theta_prev,
                                 std::string_view tensor = {}) {
  detail::require_same_length("audit", tensor, "theta", kernel.size(), "theta_prev",
                              theta_prev.size());
  const std::size_t n = kernel.size();
  const float* prev = theta_prev.data();
  std::uint64_t true_changed = 0, detected = 0, missed = 0, guard_extra = 0, violations = 0;
  std::size_t first_missed = n, first_violation = n;
  double worst = 0.0;
  DTE_OMP(parallel for schedule(static) \
          reduction(+ : true_changed, detected, missed, guard_extra, violations) \
          reduction(min : first_missed, first_violation) reduction(max : worst))
  for (std::size_t i = 0; i < n; ++i) {
    const float now = kernel.current(i);
    const Reconstruction r = kernel(i);
    const bool truth = Detect::store(now) != Detect::store(prev[i]);
    const bool flagged = Detect::changed(now, r);
    if (breaks_bound(prev[i], r)) {
      ++violations;
      if (i < first_violation) first_violation = i;
    }
    worst = std::fmax(worst, bound_ratio(prev[i], r));
    true_changed += truth;
    detected += flagged;
    if (truth && !flagged) {
      ++missed;
      if (i < first_missed) first_missed = i;
    }
    guard_extra += (flagged && !truth);
  }
  AuditCounts c;
  c.elements = n;
  c.true_changed = true_changed;
  c.detected = detected;
  c.missed = missed;
  c.guard_extra = guard_extra;
  c.first_missed = first_missed < n ? static_cast<std::int64_t>(first_missed) : -1;
  c.bound_violations = violations;
  c.first_violation = first_violation < n ? static_cast<std::int64_t>(first_violation) : -1;
  c.worst_bound_ratio = worst;
  return c;
}

}  // namespace dte
