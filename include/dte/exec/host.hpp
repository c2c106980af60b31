// SPDX-License-Identifier: Apache-2.0
// The host executor: the data-parallel primitives the pipeline stages run on, over OpenMP
// threads (a plain loop without OpenMP or with one thread). A stage takes its executor as its
// first argument (MatX's model); the CUDA executor provides the same primitives on a stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/exec/scan.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace dte::exec {

class Host {
 public:
  using executor_tag = void;

  // threads = 0: OpenMP's default (every core). A rank that shares the machine with other ranks
  // of an in-process world passes its share.
  Host() noexcept : Host(0) {}
  explicit Host(int threads) noexcept : threads_(threads > 0 ? threads : default_threads()) {}

  [[nodiscard]] int threads() const noexcept { return threads_; }

  // f(i, worker) for i in [0, n), in parallel; worker in [0, threads()) names the thread, for
  // per-thread scratch.
  template <class F>
  void for_each(std::size_t n, F&& f) const {
#if defined(_OPENMP)
    if (threads_ > 1 && n > 1) {
      DTE_OMP(parallel for schedule(dynamic, 1) num_threads(threads_))
      for (std::size_t i = 0; i < n; ++i)
        f(i, omp_get_thread_num());
      return;
    }
#endif
    for (std::size_t i = 0; i < n; ++i)
      f(i, 0);
  }

  // For i in [0, n): par(i, worker) in parallel, then ser(i, worker) on the same thread, in
  // increasing i (each ser(i) after ser(i - 1)): the pattern of a stage whose output must keep
  // its input's order (appending to messages) while its work per item runs concurrently.
  template <class Par, class Ser>
  void for_each_ordered(std::size_t n, Par&& par, Ser&& ser) const {
#if defined(_OPENMP)
    if (threads_ > 1 && n > 1) {
      DTE_OMP(parallel for ordered schedule(static, 1) num_threads(threads_))
      for (std::size_t i = 0; i < n; ++i) {
        const int w = omp_get_thread_num();
        par(i, w);
        DTE_OMP(ordered)
        ser(i, w);
      }
      return;
    }
#endif
    for (std::size_t i = 0; i < n; ++i) {
      par(i, 0);
      ser(i, 0);
    }
  }

  // out[i] = in[0] + ... + in[i - 1]; returns the total. (Sequential: the pipeline scans
  // per-tile or per-receiver counts, never per element.)
  std::uint64_t exclusive_scan(std::span<const std::uint64_t> in,
                               std::span<std::uint64_t> out) const noexcept {
    return detail::exclusive_scan(in, out);
  }

 private:
  static int default_threads() noexcept {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
  }

  int threads_;
};

static_assert(executor<Host>);

}  // namespace dte::exec

namespace dte {
using HostExecutor = exec::Host;
}  // namespace dte
