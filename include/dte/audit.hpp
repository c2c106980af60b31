// SPDX-License-Identifier: Apache-2.0
// Audit of an optimizer inverse against the truth: given the weights before a step (which dte
// never needs in production), count what the reconstruction + guard band detects and misses.
// Used by `dte audit-inverse`, the oracle tests and the forward-variant tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/optim/validate.hpp"

namespace dte {

struct AuditCounts {
  std::uint64_t elements = 0;
  std::uint64_t true_changed = 0;  // 16-bit value of theta differs from that of theta_prev
  std::uint64_t detected = 0;      // flagged by dte (changed or guard band)
  std::uint64_t missed = 0;        // truly changed but not flagged: must be 0
  std::uint64_t guard_extra = 0;   // flagged although unchanged: bandwidth, not correctness
  std::int64_t first_missed = -1;  // index of the first missed element, for diagnostics

  AuditCounts& operator+=(const AuditCounts& o) noexcept {
    if (first_missed < 0 && o.first_missed >= 0) {
      first_missed = static_cast<std::int64_t>(elements) + o.first_missed;
    }
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
  std::uint64_t true_changed = 0, detected = 0, missed = 0, guard_extra = 0;
  std::size_t first_missed = n;
  DTE_OMP(parallel for schedule(static) reduction(+ : true_changed, detected, missed, guard_extra) \
          reduction(min : first_missed))
  for (std::size_t i = 0; i < n; ++i) {
    const float now = kernel.current(i);
    const bool truth = Detect::store(now) != Detect::store(prev[i]);
    const bool flagged = Detect::changed(now, kernel(i));
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
  return c;
}

}  // namespace dte
