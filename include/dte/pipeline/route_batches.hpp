// SPDX-License-Identifier: Apache-2.0
// How the device sender routes a shard within a stated device-memory bound: the shard is cut, in
// shard order, into batches whose routing scratch would fit the bound even if every element in
// them changed (a full publication, or a first delta that changes everything). Each batch is
// then routed, bucketed by receiver and read into the messages before the next one starts
// (pipeline/device_stages.hpp, route_and_bucket), so the scratch a publication holds at once is one
// batch's, whatever the shard's size; the messages are the same bytes as one unbatched pass,
// since every receiver's entries still arrive in shard order.
//
// The scratch of a batch, in device memory (route_and_bucket allocates exactly these):
//   per element of the batch, 24 B: its offset if it changed (8), its receiver copies (8), their
//     first entry's position (8);
//   per routed entry, 45 B: the radix sort's keys and values, double-buffered (receiver 2 x 4,
//     position 2 x 8), the entry's tensor, index and bits as routed (4 + 4 + 2) and in bucket
//     order (4 + 4 + 2), and 1 B for CUB's own temp (its histograms and tile states: a few
//     hundred KiB at millions of entries, checked on the GPU by test_cuda_pipeline);
//   per batch, a constant 64 KiB for the counts and CUB's temp of the small calls.
// Host code: the plan is made when the sender is built, from the run table alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/pipeline/runs.hpp"

namespace dte::pipeline {

inline constexpr std::uint64_t route_bytes_per_element = 24;
inline constexpr std::uint64_t route_bytes_per_entry = 45;
inline constexpr std::uint64_t route_bytes_per_batch = 64 * 1024;
// (The bound is exec::Cuda::scratch_limit(): by default 256 MiB, about 5.9 M routed entries per
// batch.)

// The scratch of a batch of `elements` shard elements whose changes route to `entries` entries.
[[nodiscard]] constexpr std::uint64_t route_scratch(std::uint64_t elements,
                                                    std::uint64_t entries) noexcept {
  return route_bytes_per_batch + route_bytes_per_element * elements +
         route_bytes_per_entry * entries;
}

// Shard offsets [begin, end), and the entries they route to if every one changed.
struct RouteBatch {
  std::int64_t begin = 0, end = 0;
  std::uint64_t max_entries = 0;
};

// The shard [0, shard) of one buffer, whose runs (RunTable::runs, in shard order) give each
// element's receiver copies (elements outside every run, padding and TP replicas have none), cut
// greedily into batches with route_scratch(end - begin, max_entries) <= bytes. Throws
// invalid_argument when bytes cannot hold even one element of some run.
[[nodiscard]] inline std::vector<RouteBatch> route_batches(std::span<const Run> runs,
                                                           std::int64_t shard,
                                                           std::uint64_t bytes) {
  std::vector<RouteBatch> out;
  if (shard <= 0) return out;
  RouteBatch cur;
  auto room = [&](std::uint64_t per_element) -> std::uint64_t {  // elements that still fit cur
    const std::uint64_t used =
        route_scratch(static_cast<std::uint64_t>(cur.end - cur.begin), cur.max_entries);
    return used >= bytes ? 0 : (bytes - used) / per_element;
  };
  // Adds [at, at + n) whose elements each route to `copies` entries.
  auto add = [&](std::int64_t n, std::uint64_t copies) {
    const std::uint64_t per_element = route_bytes_per_element + route_bytes_per_entry * copies;
    if (route_scratch(1, copies) > bytes) {
      throw invalid_argument("dte::pipeline::route_batches: a scratch bound of " +
                             std::to_string(bytes) + " bytes cannot route one element with " +
                             std::to_string(copies) + " receiver copies (it needs " +
                             std::to_string(route_scratch(1, copies)) +
                             "); raise exec::Cuda's scratch limit (with_scratch_limit)");
    }
    while (n > 0) {
      std::uint64_t fit = room(per_element);
      if (fit == 0) {
        out.push_back(cur);
        cur = RouteBatch{cur.end, cur.end, 0};
        fit = room(per_element);
      }
      const auto take = static_cast<std::int64_t>(std::min<std::uint64_t>(fit, n));
      cur.end += take;
      cur.max_entries += copies * static_cast<std::uint64_t>(take);
      n -= take;
    }
  };
  std::int64_t at = 0;
  for (const Run& r : runs) {
    if (r.shard_begin < at || r.shard_begin + r.length > shard) {
      throw error("dte::pipeline::route_batches: the runs are not in shard order within [0, " +
                  std::to_string(shard) + "); report this");
    }
    add(r.shard_begin - at, 0);  // (a gap: elements no run covers)
    add(r.length, r.sender ? r.target_count : 0);
    at = r.shard_begin + r.length;
  }
  add(shard - at, 0);
  out.push_back(cur);
  return out;
}

}  // namespace dte::pipeline
