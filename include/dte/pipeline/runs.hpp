// SPDX-License-Identifier: Apache-2.0
// The affine pieces of one trainer rank's shard, built once from its transfer plan: maximal
// ranges of shard offsets inside one plan segment where the canonical index, and the index in
// every receiver tensor that holds the element when the table routes to receivers, all advance
// by one per element. The pipeline stages work on them: detect digests a run with its canonical
// base (no per-element map), and route maps a changed offset to its receivers with one
// subtraction per target. A table without receivers (a sender writing canonical chunks) has
// runs only as fine as the canonical mapping needs, and no targets.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"

namespace dte::pipeline {

// One receiver copy of a run: receiver rank (replica * inference TP + TP rank), receiver tensor,
// index of the run's first element in that tensor.
struct RunTarget {
  std::uint32_t rank;
  std::uint32_t tensor;
  std::uint32_t index;
};

struct Run {
  std::int64_t shard_begin;  // offset in the rank's shard of this buffer
  std::int64_t length;
  std::int32_t segment;        // index into plan.segments(buffer)
  std::int32_t tensor;         // canonical (HF) tensor; -1: vocabulary padding, not sent
  std::int64_t canonical;      // global canonical index of the first element (hf[t].base + i)
  std::uint32_t first_target;  // into RunTable::targets(); none for padding and non-senders
  std::uint32_t target_count;
  bool sender;  // false for TP replicas of replicated tensors (validated only)
};

// The index in its HF tensor of the element at shard offset o of run (which sends it).
inline std::uint32_t canonical_index(const layout::HfModel& hf, const Run& run,
                                     std::int64_t o) noexcept {
  return static_cast<std::uint32_t>(run.canonical - hf[run.tensor].base + (o - run.shard_begin));
}

// The runs of both buffers of one trainer rank, in shard order, and their receiver targets.
class RunTable {
 public:
  RunTable() = default;

  // plan: a TransferPlan or IdentityPlan (segments, params, mapping); receivers: the serving
  // layout every run's targets are in, or null for none. Receiver indices must fit 32 bits (they
  // do for every receiver tensor of the supported models: checked here).
  template <class Plan>
  RunTable(const Plan& plan, const layout::HfModel& hf, const layout::ServingLayout* receivers) {
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      std::vector<Run>& out = runs_[static_cast<int>(b)];
      const auto& segs = plan.segments(b);
      for (std::size_t si = 0; si < segs.size(); ++si) {
        const layout::PlanSegment& s = segs[si];
        const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t pos = 0; pos < s.length;) {
          const std::int64_t local = s.param_begin + pos;
          std::int64_t n = std::min(s.length - pos, plan.mapping().contiguous(p, local));
          const layout::Canonical c = plan.mapping()(p, local);
          Run r{s.shard_begin + pos, n, static_cast<std::int32_t>(si), -1, 0, 0, 0, s.sender};
          if (c.tensor >= 0) {
            // (a run never crosses a multiple of 2^32 in canonical space: the digest's position
            // key of consecutive elements is then the base key plus one per element)
            const std::int64_t g = hf[c.tensor].base + c.index;
            const std::int64_t to_2_32 = (std::int64_t{1} << 32) - (g & 0xFFFFFFFFll);
            n = std::min({n, hf[c.tensor].numel() - c.index, to_2_32});
            if (receivers != nullptr) n = std::min(n, receivers->contiguous(c));
            r.length = n;
            r.tensor = static_cast<std::int32_t>(c.tensor);
            r.canonical = g;
            if (s.sender && receivers != nullptr) add_targets(r, c, n, *receivers);
          }
          append(out, r);
          pos += n;
        }
      }
    }
  }

  [[nodiscard]] std::span<const Run> runs(layout::BufferKind b) const noexcept {
    return runs_[static_cast<int>(b)];
  }
  [[nodiscard]] std::span<const RunTarget> targets(const Run& r) const noexcept {
    return {targets_.data() + r.first_target, r.target_count};
  }
  // Every target of every run (Run::first_target indexes it): what the device tables copy.
  [[nodiscard]] std::span<const RunTarget> all_targets() const noexcept { return targets_; }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (runs_[0].capacity() + runs_[1].capacity()) * sizeof(Run) +
           targets_.capacity() * sizeof(RunTarget);
  }

 private:
  void add_targets(Run& r, layout::Canonical c, std::int64_t n,
                   const layout::ServingLayout& receivers) {
    r.first_target = static_cast<std::uint32_t>(targets_.size());
    layout::route_canonical(receivers, c, [&](const layout::RouteTarget& t) {
      if (t.index + n > std::int64_t{0xFFFFFFFF} || receivers[t.tensor].numel > 0xFFFFFFFFll) {
        throw unsupported("receiver tensor " + receivers.name(t.tensor) + " has " +
                          std::to_string(receivers[t.tensor].numel) +
                          " elements; dte's wire format addresses at most 2^32 - 1 per tensor");
      }
      targets_.push_back({static_cast<std::uint32_t>(t.rank), static_cast<std::uint32_t>(t.tensor),
                          static_cast<std::uint32_t>(t.index)});
    });
    r.target_count = static_cast<std::uint32_t>(targets_.size()) - r.first_target;
  }

  // Merges r into the previous run when it continues it in every respect (rows of one
  // parameter that stay contiguous in the canonical tensor and in every receiver copy).
  void append(std::vector<Run>& out, const Run& r) {
    if (!out.empty()) {
      Run& q = out.back();
      const bool continues = q.segment == r.segment && q.shard_begin + q.length == r.shard_begin &&
                             q.tensor == r.tensor && q.sender == r.sender &&
                             (r.tensor < 0 || q.canonical + q.length == r.canonical) &&
                             q.target_count == r.target_count;
      if (continues && targets_continue(q, r)) {
        q.length += r.length;
        targets_.resize(targets_.size() - r.target_count);  // r's targets were just appended
        return;
      }
    }
    out.push_back(r);
  }

  [[nodiscard]] bool targets_continue(const Run& q, const Run& r) const noexcept {
    for (std::uint32_t k = 0; k < q.target_count; ++k) {
      const RunTarget& a = targets_[q.first_target + k];
      const RunTarget& b = targets_[r.first_target + k];
      if (a.rank != b.rank || a.tensor != b.tensor ||
          std::uint64_t{a.index} + static_cast<std::uint64_t>(q.length) != b.index) {
        return false;
      }
    }
    return true;
  }

  std::vector<Run> runs_[2];
  std::vector<RunTarget> targets_;
};

}  // namespace dte::pipeline
