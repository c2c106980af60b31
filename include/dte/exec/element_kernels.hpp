// SPDX-License-Identifier: Apache-2.0
// The bodies of the CUDA backend's per-element passes (exec/cuda.cuh: dte::cuda::classify and
// dte::cuda::audit), as DTE_HOST_DEVICE functors over the SIMT context of exec/simt.hpp, run on
// the GPU by exec/simt.cuh and on the host by simt::host (ctest -L device-on-host).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "dte/audit.hpp"
#include "dte/config.hpp"
#include "dte/exec/simt.hpp"
#include "dte/reconstruction.hpp"

namespace dte::cuda::detail {

// Per element i: Detect's verdict.
template <class Detect, class Kernel>
struct ClassifyElements {
  Kernel kernel;
  Verdict* out;

  DTE_HOST_DEVICE void operator()(std::uint64_t i) const {
    out[i] = Detect::classify(kernel.current(i), kernel(i));
  }
};

// The audit counts of one thread, then of one block, then of the grid. One type for every
// (Detect, Kernel) pair, so the whole backend instantiates a single block reduction.
struct AuditTally {
  unsigned long long true_changed;
  unsigned long long detected;
  unsigned long long missed;
  unsigned long long guard_extra;
  unsigned long long first_missed;  // ULLONG_MAX: none
  unsigned long long violations;    // breaks_bound
  unsigned long long first_violation;
  unsigned long long worst_ratio;  // bits of the largest bound_ratio (non-negative doubles
                                   // order as their bit patterns)
};

// dte::audit_reconstruction's counts as a reduction: accumulate per element into a thread's
// tally, combine tallies within a block, publish a block's tally into the grid's total (atomics).
template <class Detect, class Kernel>
struct AuditElements {
  using tally = AuditTally;
  Kernel kernel;
  const float* theta_prev;  // the true previous weights
  AuditTally* total;        // starts as identity()

  DTE_HOST_DEVICE static constexpr AuditTally identity() noexcept {
    return {0, 0, 0, 0, ~0ull, 0, ~0ull, 0};
  }

  DTE_HOST_DEVICE void accumulate(AuditTally& mine, std::uint64_t i) const {
    const float now = kernel.current(i);
    const bool truth = Detect::store(now) != Detect::store(theta_prev[i]);
    const Reconstruction r = kernel(i);
    const bool flagged = Detect::changed(now, r);
    if (breaks_bound(theta_prev[i], r)) {
      ++mine.violations;
      if (i < mine.first_violation) mine.first_violation = i;
    }
    const unsigned long long ratio = simt::bits_of(bound_ratio(theta_prev[i], r));
    if (ratio > mine.worst_ratio) mine.worst_ratio = ratio;
    mine.true_changed += truth;
    mine.detected += flagged;
    if (truth && !flagged) {
      ++mine.missed;
      if (i < mine.first_missed) mine.first_missed = i;
    }
    mine.guard_extra += (flagged && !truth);
  }

  DTE_HOST_DEVICE static AuditTally combine(const AuditTally& a, const AuditTally& b) noexcept {
    return {a.true_changed + b.true_changed,
            a.detected + b.detected,
            a.missed + b.missed,
            a.guard_extra + b.guard_extra,
            a.first_missed < b.first_missed ? a.first_missed : b.first_missed,
            a.violations + b.violations,
            a.first_violation < b.first_violation ? a.first_violation : b.first_violation,
            a.worst_ratio > b.worst_ratio ? a.worst_ratio : b.worst_ratio};
  }

  DTE_HOST_DEVICE void publish(const AuditTally& block) const {
    if (block.true_changed != 0) simt::atomic_add(&total->true_changed, block.true_changed);
    if (block.detected != 0) simt::atomic_add(&total->detected, block.detected);
    if (block.missed != 0) simt::atomic_add(&total->missed, block.missed);
    if (block.guard_extra != 0) simt::atomic_add(&total->guard_extra, block.guard_extra);
    if (block.missed != 0) simt::atomic_min(&total->first_missed, block.first_missed);
    if (block.violations != 0) {
      simt::atomic_add(&total->violations, block.violations);
      simt::atomic_min(&total->first_violation, block.first_violation);
    }
    if (block.worst_ratio != 0) simt::atomic_max(&total->worst_ratio, block.worst_ratio);
  }
};

// The AuditCounts of a grid's total over n elements.
inline AuditCounts audit_counts(const AuditTally& total, std::size_t n) {
  AuditCounts counts;
  counts.elements = n;
  counts.true_changed = total.true_changed;
  counts.detected = total.detected;
  counts.missed = total.missed;
  counts.guard_extra = total.guard_extra;
  counts.first_missed =
      total.missed != 0 ? static_cast<std::int64_t>(total.first_missed) : std::int64_t{-1};
  counts.bound_violations = total.violations;
  counts.first_violation =
      total.violations != 0 ? static_cast<std::int64_t>(total.first_violation) : std::int64_t{-1};
  counts.worst_bound_ratio = std::bit_cast<double>(total.worst_ratio);
  return counts;
}

}  // namespace dte::cuda::detail
