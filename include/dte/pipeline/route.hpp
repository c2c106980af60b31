// SPDX-License-Identifier: Apache-2.0
// Stage 3, route: only the compacted elements go through the plan. Each changed shard offset
// lies in one run (both are in shard order, so a merge walk finds it), and every receiver copy
// of the run is affine: (receiver rank, receiver tensor, first index + offset into the run).
// Replicas and TP copies each get one entry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/pipeline/runs.hpp"

namespace dte::pipeline {

// Routed entries, structure of arrays: entry e goes to receiver rank[e], tensor[e], index[e].
struct RoutedEntries {
  std::vector<std::uint32_t> rank, tensor, index;
  std::vector<std::uint16_t> bits;

  [[nodiscard]] std::size_t size() const noexcept { return bits.size(); }
  void clear() noexcept {
    rank.clear();
    tensor.clear();
    index.clear();
    bits.clear();
  }
  void push(std::uint32_t r, std::uint32_t t, std::uint32_t i, std::uint16_t b) {
    rank.push_back(r);
    tensor.push_back(t);
    index.push_back(i);
    bits.push_back(b);
  }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return rank.capacity() * 4 + tensor.capacity() * 4 + index.capacity() * 4 + bits.capacity() * 2;
  }
};

// Appends to `out` every receiver entry of the changed elements at shard offsets base +
// offsets[k] (increasing), with their bits. `runs` covers those offsets (in shard order).
inline void route(const RunTable& table, std::span<const Run> runs, std::int64_t base,
                  std::span<const std::uint32_t> offsets, std::span<const std::uint16_t> bits,
                  RoutedEntries& out) {
  std::size_t r = 0;
  for (std::size_t k = 0; k < offsets.size(); ++k) {
    const std::int64_t o = base + offsets[k];
    while (runs[r].shard_begin + runs[r].length <= o)
      ++r;
    const Run& run = runs[r];
    const auto delta = static_cast<std::uint32_t>(o - run.shard_begin);
    for (const RunTarget& t : table.targets(run)) {
      out.push(t.rank, t.tensor, t.index + delta, bits[k]);
    }
  }
}

}  // namespace dte::pipeline
