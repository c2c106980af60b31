// SPDX-License-Identifier: Apache-2.0
// The executor conformance suite (concepts.hpp, `executor`), written once and run over each
// shipped executor:
//   exec::Host   tests/conformance/test_conformance.cpp (1, 2 and 4 threads)
//   exec::Cuda   tests/cuda/test_cuda_backend.cu (the default stream without a device; a stream
//                of its own on one)
// The concept's primitives take host callables on both backends (exec::Cuda runs them on the
// calling thread: they carry per-tile and per-receiver bookkeeping, the per-element work is in
// the device stages), so the suite's memory is host memory on both. What the pipeline relies on
// (pipeline/frame.hpp keeps per-worker scratch from par(i) to ser(i)):
//   - for_each(n, f): f(i, worker) exactly once per i in [0, n), worker in [0, threads()), and
//     no two calls at once with the same worker (per-worker scratch);
//   - for_each_ordered(n, par, ser): par(i) exactly once, then ser(i) with par(i)'s worker and
//     no other par on that worker in between; ser in increasing i;
//   - exclusive_scan(in, out): out[i] = in[0] + ... + in[i - 1], the total returned (and 0 for
//     an empty input);
//   - n = 0 calls nothing; n = 1 and n larger than the workers work.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dte/concepts.hpp"

namespace dte::executor_suite {

template <class E>
void run(const E& exec) {
  static_assert(executor<E>);
  const int workers = exec.threads();
  REQUIRE(workers >= 1);
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000}}) {
    CAPTURE(n);
    // for_each: each item once, a valid worker, never one worker twice at once.
    std::vector<std::atomic<int>> seen(n);
    std::vector<std::atomic<int>> busy(static_cast<std::size_t>(workers));
    std::atomic<std::size_t> bad_worker{0}, shared_worker{0};
    exec.for_each(n, [&](std::size_t i, int w) {
      if (w < 0 || w >= workers) {
        ++bad_worker;
      } else {
        shared_worker += busy[static_cast<std::size_t>(w)].fetch_add(1) != 0;
        ++seen[i];
        busy[static_cast<std::size_t>(w)].fetch_sub(1);
      }
    });
    CHECK(bad_worker == 0);
    CHECK(shared_worker == 0);
    std::size_t not_once = 0;
    for (const auto& s : seen)
      not_once += s != 1;
    CHECK(not_once == 0);

    // for_each_ordered: par(i) then ser(i) on par(i)'s worker, with that worker's scratch
    // untouched in between; ser in increasing i.
    std::vector<std::atomic<int>> par_ran(n);
    std::vector<std::atomic<std::size_t>> scratch(static_cast<std::size_t>(workers));
    std::vector<std::size_t> order;
    std::size_t ser_bad_worker = 0, ser_before_par = 0, scratch_lost = 0;
    std::atomic<std::size_t> par_bad_worker{0};
    exec.for_each_ordered(
        n,
        [&](std::size_t i, int w) {
          ++par_ran[i];
          if (w < 0 || w >= workers) {
            ++par_bad_worker;
            return;
          }
          scratch[static_cast<std::size_t>(w)] = i;
        },
        [&](std::size_t i, int w) {
          order.push_back(i);
          if (w < 0 || w >= workers) {
            ++ser_bad_worker;
            return;
          }
          ser_before_par += par_ran[i] != 1;
          scratch_lost += scratch[static_cast<std::size_t>(w)] != i;
        });
    CHECK(par_bad_worker == 0);
    CHECK(ser_bad_worker == 0);
    CHECK(ser_before_par == 0);
    CHECK(scratch_lost == 0);
    std::vector<std::size_t> want(n);
    for (std::size_t i = 0; i < n; ++i)
      want[i] = i;
    CHECK(order == want);
  }

  // exclusive_scan.
  const std::vector<std::uint64_t> in{3, 0, 5, 1};
  std::vector<std::uint64_t> out(4);
  CHECK(exec.exclusive_scan(in, out) == 9);
  CHECK(out == std::vector<std::uint64_t>{0, 3, 3, 8});
  CHECK(exec.exclusive_scan({}, {}) == 0);
}

}  // namespace dte::executor_suite
