// SPDX-License-Identifier: Apache-2.0
// The tables the CUDA pipeline (pipeline/device_stages.hpp) reads, built on the host once per rank
// and copied to the device as flat arrays of trivially copyable rows. Everything here is ordinary
// host code, tested on the host (tests/pipeline/test_device_tables.cpp); the kernels only index
// into these rows.
//   - WorkTable: the sender's shard as work items, each a piece of one run of at most
//     `max_length` elements (one CUDA block's work), with everything the detect kernel needs
//     already resolved: its segment's kernel and the element's index in it, its canonical base,
//     whether it is sent. Items are in shard order, so a changed shard offset finds its item (and
//     through it its run and receiver targets) by binary search.
//   - ReceiverSourceTable: one receiver rank's tensors as affine runs onto canonical elements,
//     so the device apply updates the digest with the element's canonical index (what
//     ServingLayout::source computes per element on the host).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/pipeline/runs.hpp"

namespace dte::pipeline {

// One block's piece of one run.
struct WorkItem {
  std::int64_t shard_begin;  // shard offset of its first element
  std::int64_t first;        // index of its first element in its segment's kernel
  std::int64_t canonical;    // canonical index of its first element; -1: not sent (padding,
                             // non-sending TP replicas), validated only
  std::uint32_t length;      // 1 .. max_length
  std::int32_t segment;      // plan segment: the kernel that reconstructs it
  std::int32_t tensor;       // canonical tensor (digest); -1 when not sent
  std::uint32_t run;         // into the run table (receiver targets)
};
static_assert(std::is_trivially_copyable_v<WorkItem>);
static_assert(std::is_trivially_copyable_v<Run> && std::is_trivially_copyable_v<RunTarget>);

class WorkTable {
 public:
  WorkTable() = default;

  // runs: one buffer's runs in shard order; segments: that buffer's plan segments.
  WorkTable(std::span<const Run> runs, const std::vector<layout::PlanSegment>& segments,
            std::uint32_t max_length) {
    if (max_length == 0) throw invalid_argument("WorkTable: max_length must be positive");
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const Run& run = runs[r];
      const layout::PlanSegment& seg = segments.at(static_cast<std::size_t>(run.segment));
      const bool send = run.sender && run.tensor >= 0;
      for (std::int64_t at = 0; at < run.length; at += max_length) {
        const auto n =
            static_cast<std::uint32_t>(std::min<std::int64_t>(max_length, run.length - at));
        const std::int64_t o = run.shard_begin + at;
        items_.push_back({o, o - seg.shard_begin, send ? run.canonical + at : -1, n, run.segment,
                          send ? run.tensor : -1, static_cast<std::uint32_t>(r)});
        elements_ += n;
        if (send) sent_ += n;
      }
    }
  }

  [[nodiscard]] std::span<const WorkItem> items() const noexcept { return items_; }
  // Elements in runs (the shard but its alignment padding between buckets).
  [[nodiscard]] std::int64_t elements() const noexcept { return elements_; }
  // Elements that are sent (and digested): what a full publication writes per copy.
  [[nodiscard]] std::int64_t sent() const noexcept { return sent_; }

 private:
  std::vector<WorkItem> items_;
  std::int64_t elements_ = 0, sent_ = 0;
};

// The item holding shard offset o among items sorted by shard_begin (o must be covered): the
// same search the route kernel runs on the device.
DTE_HOST_DEVICE inline std::uint32_t find_item(const WorkItem* items, std::uint32_t n,
                                               std::int64_t o) noexcept {
  std::uint32_t lo = 0, hi = n;  // the answer is the last item with shard_begin <= o
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (items[mid].shard_begin <= o) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Where a warp's 32 ballot bits for shard offsets [o, o + 32) land in a bitmap of 64-bit words:
// `low` in words[word], `high` in words[word + 1] (zero when all 32 fit in one word). The
// detect kernel ORs (or clears) them with one or two atomics.
struct WordSpread {
  std::uint64_t word;
  std::uint64_t low;
  std::uint64_t high;
};

DTE_HOST_DEVICE constexpr WordSpread spread32(std::int64_t o, std::uint32_t bits) noexcept {
  const auto at = static_cast<std::uint64_t>(o);
  const unsigned sh = static_cast<unsigned>(at & 63u);
  const std::uint64_t b = bits;
  return {at >> 6, b << sh, sh > 32 ? b >> (64 - sh) : 0};
}

// An affine piece of one receiver tensor: elements [index, index + length) hold canonical
// elements canonical .. canonical + length - 1 of canonical tensor `tensor`.
struct SourceRun {
  std::uint32_t receiver_tensor;
  std::uint32_t index;
  std::uint32_t length;
  std::int32_t tensor;
  std::int64_t canonical;  // global canonical index (hf[tensor].base + index in it)
};
static_assert(std::is_trivially_copyable_v<SourceRun>);

class ReceiverSourceTable {
 public:
  ReceiverSourceTable() = default;

  // The runs of receiver rank `rank` (replica * tp + TP rank), sorted by (tensor, index).
  ReceiverSourceTable(const layout::HfModel& hf, const layout::ServingLayout& receivers,
                      std::int64_t rank) {
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const std::int64_t numel = hf[t].numel();
      for (std::int64_t i = 0; i < numel;) {
        const layout::Canonical c{t, i};
        const std::int64_t n = std::min(numel - i, receivers.contiguous(c));
        if (n <= 0) {
          throw invalid_argument(
              "ReceiverSourceTable: the receiver layout reports no contiguous "
              "elements at " +
              hf.name(t) + "[" + std::to_string(i) + "]");
        }
        layout::route_canonical(receivers, c, [&](const layout::RouteTarget& target) {
          if (target.rank != rank) return;
          runs_.push_back({static_cast<std::uint32_t>(target.tensor),
                           static_cast<std::uint32_t>(target.index), static_cast<std::uint32_t>(n),
                           static_cast<std::int32_t>(t), hf[t].base + i});
        });
        i += n;
      }
    }
    std::sort(runs_.begin(), runs_.end(), [](const SourceRun& a, const SourceRun& b) {
      return a.receiver_tensor != b.receiver_tensor ? a.receiver_tensor < b.receiver_tensor
                                                    : a.index < b.index;
    });
    // Merge runs that continue each other in both spaces.
    std::vector<SourceRun> merged;
    for (const SourceRun& r : runs_) {
      if (!merged.empty()) {
        SourceRun& q = merged.back();
        if (q.receiver_tensor == r.receiver_tensor && q.tensor == r.tensor &&
            std::uint64_t{q.index} + q.length == r.index && q.canonical + q.length == r.canonical &&
            std::uint64_t{q.length} + r.length <= 0xFFFFFFFFull) {
          q.length += r.length;
          continue;
        }
      }
      merged.push_back(r);
    }
    runs_ = std::move(merged);
  }

  [[nodiscard]] std::span<const SourceRun> runs() const noexcept { return runs_; }

 private:
  std::vector<SourceRun> runs_;
};

// The run holding receiver element (tensor, index), or n when none does (padding, or an element
// this rank does not hold): the device apply refuses an entry that finds none.
DTE_HOST_DEVICE inline std::uint32_t find_source(const SourceRun* runs, std::uint32_t n,
                                                 std::uint32_t tensor,
                                                 std::uint32_t index) noexcept {
  std::uint32_t lo = 0, hi = n;  // first run strictly after (tensor, index)
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    const SourceRun& r = runs[mid];
    if (r.receiver_tensor < tensor || (r.receiver_tensor == tensor && r.index <= index)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return n;
  const SourceRun& r = runs[lo - 1];
  if (r.receiver_tensor != tensor || index - r.index >= r.length) return n;
  return lo - 1;
}

}  // namespace dte::pipeline
