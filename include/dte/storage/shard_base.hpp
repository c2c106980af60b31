// SPDX-License-Identifier: Apache-2.0
// The writer's side of a class index (storage/class_index.hpp): for one trainer rank, the
// canonical positions it sends of each HF tensor (its domain) and their base bits, which at a
// position it does not send are its current weights rounded (unchanged for certain: that is
// what not sending means). Built per publication from the rank's runs and its weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/storage/chunk.hpp"

namespace dte::storage {

class ShardBase final : public ClassBase {
 public:
  // theta(b): the rank's weights of buffer b (they must outlive this object); Detect: the
  // change detector, whose FP32 -> 16-bit rounding (Detect::store) gives the bits. Throws
  // unsupported when a tensor's runs do not follow its index order in shard order (its
  // elements would not reach the chunk sink sorted).
  template <class Detect, class Theta>
  ShardBase(std::type_identity<Detect>, const layout::HfModel& hf, const pipeline::RunTable& table,
            Theta&& theta)
      : runs_(static_cast<std::size_t>(hf.size())),
        round_([](const float* w, std::uint64_t n, std::uint16_t* out) {
          for (std::uint64_t i = 0; i < n; ++i)  // (inlined: one call per run, not per element)
            out[i] = Detect::store(w[i]);
        }) {
    for_each_run(hf, table, [&](layout::BufferKind b, const pipeline::Run& r, std::uint64_t start) {
      const std::span<const float> w = theta(b);
      if (static_cast<std::size_t>(r.shard_begin + r.length) > w.size()) {
        throw invalid_argument("storage::ShardBase: a run passes the end of the rank's weights");
      }
      runs_[static_cast<std::size_t>(r.tensor)].push_back(
          {start, static_cast<std::uint64_t>(r.length), w.data() + r.shard_begin});
    });
  }

  // Throws unsupported unless every tensor's runs follow its index order in shard order (the
  // publisher checks this when it is built).
  static void check_order(const layout::HfModel& hf, const pipeline::RunTable& table) {
    for_each_run(hf, table, [](layout::BufferKind, const pipeline::Run&, std::uint64_t) {});
  }

  // The positions this rank sends of `tensor` within [first, last], as domain groups.
  [[nodiscard]] std::vector<DomainGroup> domain(std::int64_t tensor, std::uint64_t first,
                                                std::uint64_t last) const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> cut;
    for (const Piece& p : runs_[static_cast<std::size_t>(tensor)]) {
      const std::uint64_t a = std::max(p.start, first);
      const std::uint64_t b = std::min(p.start + p.length, last + 1);
      if (a < b) cut.emplace_back(a, b - a);
    }
    return group_runs(cut);
  }

  void bits(std::int64_t tensor, std::uint64_t start, std::uint64_t count,
            std::uint16_t* out) const override {
    const auto& mine = runs_[static_cast<std::size_t>(tensor)];
    auto it = std::upper_bound(mine.begin(), mine.end(), start,
                               [](std::uint64_t s, const Piece& p) { return s < p.start; });
    while (count > 0) {
      if (it == mine.begin() || start < std::prev(it)->start ||
          start >= std::prev(it)->start + std::prev(it)->length) {
        throw invalid_argument("storage::ShardBase: position " + std::to_string(start) +
                               " of tensor " + std::to_string(tensor) +
                               " is not one this rank sends");
      }
      const Piece& p = *std::prev(it);
      const std::uint64_t n = std::min(count, p.start + p.length - start);
      round_(p.theta + (start - p.start), n, out);
      out += n;
      start += n;
      count -= n;
      ++it;
    }
  }

 private:
  // f(buffer, run, its first tensor-relative index) for every sent run, in shard order.
  template <class F>
  static void for_each_run(const layout::HfModel& hf, const pipeline::RunTable& table, F&& f) {
    std::vector<std::uint64_t> end(static_cast<std::size_t>(hf.size()), 0);
    std::vector<bool> seen(end.size(), false);
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const pipeline::Run& r : table.runs(b)) {
        if (!r.sender || r.tensor < 0) continue;
        const auto t = static_cast<std::size_t>(r.tensor);
        const auto start = static_cast<std::uint64_t>(r.canonical - hf[r.tensor].base);
        if (seen[t] && start < end[t]) {
          throw unsupported(
              "storage: the classes index needs each tensor's elements in index "
              "order within a trainer rank's shard, and " +
              hf.name(r.tensor) + "'s are not in this layout; publish with the plain index");
        }
        seen[t] = true;
        end[t] = start + static_cast<std::uint64_t>(r.length);
        f(b, r, start);
      }
    }
  }

  struct Piece {
    std::uint64_t start, length;
    const float* theta;
  };
  std::vector<std::vector<Piece>> runs_;  // per HF tensor, in index order
  void (*round_)(const float*, std::uint64_t, std::uint16_t*);
};

}  // namespace dte::storage
