// SPDX-License-Identifier: Apache-2.0
// exec::detail::SerialHostWork: the executor concept's host primitives (threads, for_each,
// for_each_ordered, exclusive_scan) on the calling thread, one item after another. The base of
// the device executors (exec::Cuda, and its host twin sim::SimtHost), whose per-element work runs
// on the device: these carry only per-tensor and per-receiver bookkeeping there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "dte/exec/scan.hpp"

namespace dte::exec::detail {

struct SerialHostWork {
  [[nodiscard]] int threads() const noexcept { return 1; }
  template <class F>
  void for_each(std::size_t n, F&& f) const {
    for (std::size_t i = 0; i < n; ++i)
      f(i, 0);
  }
  template <class Par, class Ser>
  void for_each_ordered(std::size_t n, Par&& par, Ser&& ser) const {
    for (std::size_t i = 0; i < n; ++i) {
      par(i, 0);
      ser(i, 0);
    }
  }
  std::uint64_t exclusive_scan(std::span<const std::uint64_t> in,
                               std::span<std::uint64_t> out) const noexcept {
    return detail::exclusive_scan(in, out);
  }
};

}  // namespace dte::exec::detail
