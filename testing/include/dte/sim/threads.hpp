// SPDX-License-Identifier: Apache-2.0
// The in-process clusters' one way to run every rank at once (sim/cluster.hpp,
// sim/storage_cluster.hpp): each rank on its own thread, each rank's exception kept.
#pragma once

#include <cstddef>
#include <exception>
#include <thread>
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

}  // namespace dte::sim::detail
