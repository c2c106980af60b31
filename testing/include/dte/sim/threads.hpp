// SPDX-License-Identifier: Apache-2.0
// The tests' one way to run every rank at once (sim/cluster.hpp, sim/storage_cluster.hpp, the
// transport tests): each rank on its own thread, each rank's exception kept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

namespace dte::sim::detail {

// f(r) for every r in [0, n), each on its own thread; returns once all are done, with the
// exception each one threw (null: none).
template <class F>
std::vector<std::exception_ptr> on_threads(std::size_t n, F&& f) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::jthread> threads;
  for (std::size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  threads.clear();  // (joins)
  return errors;
}

// Rethrows rank `prefer`'s exception if it threw (a rank that refused a publication says why),
// else the lowest rank's; returns when none threw.
inline void rethrow_first(const std::vector<std::exception_ptr>& errors, std::int64_t prefer = -1) {
  if (prefer >= 0 && static_cast<std::size_t>(prefer) < errors.size() &&
      errors[static_cast<std::size_t>(prefer)]) {
    std::rethrow_exception(errors[static_cast<std::size_t>(prefer)]);
  }
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace dte::sim::detail

namespace dte::sim {

// f(r) for every r in [0, n), each on its own thread; once all are done, rethrows the lowest
// rank's exception, if any.
template <class F>
void run_ranks(std::size_t n, F&& f) {
  detail::rethrow_first(detail::on_threads(n, std::forward<F>(f)));
}

}  // namespace dte::sim
