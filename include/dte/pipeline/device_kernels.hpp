// SPDX-License-Identifier: Apache-2.0
// The bodies of the device pipeline's kernels (pipeline/device_stages.hpp), as DTE_HOST_DEVICE
// functors over the SIMT context of exec/simt.hpp: written once, run on the GPU by exec/simt.cuh's
// wrappers and on the host by simt::host (tests/device_on_host/, ctest -L device-on-host).
//   DetectItems    stage 1, per warp: the verdicts, mask and send bits, the counts
//   CountTargets   stage 3a, per changed element: its receiver copies
//   RouteEntries   stage 3b, per changed element: its entries and their sort keys
//   GatherEntries  stage 4b, per entry: the entries in bucket order
//   BucketEnds     stage 4c, per entry in bucket order: where each receiver's bucket ends
//   CheckEntries   receiver, per entry: the first one outside the live elements
//   WriteEntries   receiver, per entry: the write and the digest's move
//   GatherChanged  a publication's batch, per selected element: its bits and previous bits
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "dte/config.hpp"
#include "dte/core/digest.hpp"
#include "dte/exec/simt.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/device_tables.hpp"
#include "dte/pipeline/runs.hpp"

namespace dte::pipeline::device {

// Elements per work item (one block's piece of a run): 16 passes of a 256-thread block.
inline constexpr std::uint32_t item_elements = 4096;
inline constexpr int block_threads = 256;

// The counts of the detect stage, in device memory, read back at the one synchronisation.
struct DetectTotals {
  unsigned long long flagged;             // elements to send
  unsigned long long guard;               // of the detected ones, by the guard band only
  unsigned long long entries;             // routed entries (flagged elements times their copies)
  unsigned long long scanned;             // sent elements looked at (digested)
  unsigned long long first_invalid_item;  // ULLONG_MAX: none
};

// The number of low bits that hold every receiver index below `receivers` (the bucket sort's
// key bits).
constexpr int receiver_bits(std::size_t receivers) noexcept {
  return receivers <= 1 ? 1 : std::bit_width(receivers - 1);
}

namespace detail {

// ORs (clears) a warp's 32 ballot bits for shard offsets [o, o + 32) in a bitmap, any alignment
// (spread32): atomics, since a neighbouring item's warp may share a word.
DTE_HOST_DEVICE inline void or_bits(std::uint64_t* words, std::int64_t o, unsigned bits) {
  if (bits == 0) return;
  const WordSpread s = spread32(o, bits);
  simt::atomic_or(words + s.word, s.low);
  if (s.high != 0) simt::atomic_or(words + s.word + 1, s.high);
}
DTE_HOST_DEVICE inline void clear_bits(std::uint64_t* words, std::int64_t o, unsigned bits) {
  if (bits == 0) return;
  const WordSpread s = spread32(o, bits);
  simt::atomic_and(words + s.word, ~s.low);
  if (s.high != 0) simt::atomic_and(words + s.word + 1, ~s.high);
}

// Bit o of a bitmap (the send bits, as flags of a selection).
struct BitOf {
  const std::uint64_t* words;
  DTE_HOST_DEVICE bool operator()(std::int64_t o) const { return (words[o >> 6] >> (o & 63)) & 1u; }
};

// Bit begin + o of a bitmap (a batch's flags).
struct BitFrom {
  const std::uint64_t* words;
  std::int64_t begin;
  DTE_HOST_DEVICE bool operator()(std::uint32_t o) const {
    const std::int64_t at = begin + o;
    return (words[at >> 6] >> (at & 63)) & 1u;
  }
};

}  // namespace detail

// Stage 1, per warp. kernels: one per plan segment (null in mode all, which reads the weights);
// weights: per plan segment, where its weights live (the element at index i of segment s is
// weights[s][i]). A block takes items block, block + blocks, ...; its warps take 32 consecutive
// elements at a time (the loop bounds are uniform over the block, so every ballot has the whole
// warp).
template <class Detect, class Kernel>
struct DetectItems {
  const WorkItem* items;
  std::uint32_t n_items;
  const Run* runs;
  const RunTarget* targets;
  const Kernel* kernels;
  const float* const* weights;
  ScanMode mode;
  std::uint64_t* mask;  // K > 1: the dirty mask; else null
  std::uint64_t* send;
  DetectTotals* totals;
  Digest* digest;                    // per canonical tensor
  unsigned long long* per_receiver;  // routed entries per receiver

  template <class Warp>
  DTE_HOST_DEVICE void operator()(Warp& w) const {
    for (std::uint32_t it = w.block(); it < n_items; it += w.blocks()) {
      const WorkItem item = items[it];
      const bool sent = item.canonical >= 0;
      const bool digested = sent && mode != ScanMode::mark;
      typename Warp::template Lanes<unsigned> flagged{}, guard{}, sum{};
      typename Warp::template Lanes<bool> invalid{};
      for (std::uint32_t base = 0; base < item.length; base += block_threads) {
        // The element's verdict: detect_element (pipeline/detect.hpp), the host's rule; in
        // mode all every sent element goes, read straight from its segment's weights.
        typename Warp::template Lanes<ElementVerdict> v{};
        // this element's mask bit changes: set (detect, mark), cleared (mask)
        typename Warp::template Lanes<bool> touch{}, out{};
        w.each([&](unsigned lane) {
          const std::uint32_t j = base + w.thread(lane);
          if (j >= item.length) return;
          const std::int64_t o = item.shard_begin + j;
          if (mode == ScanMode::all) {
            v[lane].send = v[lane].hit = sent;
            if (sent) {
              v[lane].term = element_digest(item.canonical + j,
                                            Detect::store(weights[item.segment][item.first + j]));
            }
          } else {
            // Only this warp changes these mask bits in this launch: the load sees the earlier
            // launches' marks.
            const bool marked = mask != nullptr && mode == ScanMode::mask && sent &&
                                ((mask[o >> 6] >> (o & 63)) & 1u);
            v[lane] = detect_element<Detect>(
                kernels[item.segment], static_cast<std::size_t>(item.first + j),
                digested ? item.canonical + j : -1, sent, mode, marked);
            touch[lane] = mode == ScanMode::mask ? marked : v[lane].hit;
            invalid[lane] = invalid[lane] || v[lane].invalid;
            guard[lane] += v[lane].guard;
          }
          out[lane] = v[lane].send;
        });
        // The warp's 32 elements start at shard offset o0 (lane 0's).
        const std::int64_t o0 = item.shard_begin + base + w.thread(0);
        if (mask != nullptr && mode != ScanMode::all) {
          // detect, mark: OR this step's changes in; mask: clear every mark (sent now).
          const unsigned bits = w.ballot(touch);
          w.lane0([&] {
            if (mode == ScanMode::mask) {
              detail::clear_bits(mask, o0, bits);
            } else {
              detail::or_bits(mask, o0, bits);
            }
          });
        }
        if (mode == ScanMode::mark) continue;
        const unsigned send_bits = w.ballot(out);
        w.lane0([&] { detail::or_bits(send, o0, send_bits); });
        w.each([&](unsigned lane) {
          flagged[lane] += v[lane].send;
          sum[lane] += v[lane].term;
        });
      }
      // The warp's sums, then one atomic per warp and counter.
      const unsigned n_flagged = w.sum(flagged);
      const unsigned n_guard = w.sum(guard);
      const unsigned digest_sum = w.sum(sum);
      const unsigned any_invalid = w.ballot(invalid);
      w.lane0([&] {
        if (any_invalid != 0)
          simt::atomic_min(&totals->first_invalid_item, static_cast<unsigned long long>(it));
        if (n_flagged != 0) {
          simt::atomic_add(&totals->flagged, static_cast<unsigned long long>(n_flagged));
          const Run& run = runs[item.run];
          simt::atomic_add(&totals->entries,
                           static_cast<unsigned long long>(n_flagged) * run.target_count);
          for (std::uint32_t t = 0; t < run.target_count; ++t)
            simt::atomic_add(&per_receiver[targets[run.first_target + t].rank],
                             static_cast<unsigned long long>(n_flagged));
        }
        if (n_guard != 0)
          simt::atomic_add(&totals->guard, static_cast<unsigned long long>(n_guard));
        if (digested) {
          if (digest_sum != 0) simt::atomic_add(&digest[item.tensor], Digest{digest_sum});
          // The scanned count once per item (warp 0), not once per warp.
          if (w.thread(0) == 0)
            simt::atomic_add(&totals->scanned, static_cast<unsigned long long>(item.length));
        }
      });
    }
  }
};

// Stage 3a, per changed element k: its receiver copies.
struct CountTargets {
  const std::int64_t* offsets;
  const WorkItem* items;
  std::uint32_t n_items;
  const Run* runs;
  std::uint64_t* counts;

  DTE_HOST_DEVICE void operator()(std::uint64_t k) const {
    const WorkItem& item = items[find_item(items, n_items, offsets[k])];
    counts[k] = runs[item.run].target_count;
  }
};

// Stage 3b, per changed element k: entry positions[k] + t for target t, with its receiver as the
// sort key and its position as the value that the bucket stage permutes.
template <class Detect>
struct RouteEntries {
  const std::int64_t* offsets;
  const WorkItem* items;
  std::uint32_t n_items;
  const Run* runs;
  const RunTarget* targets;
  const float* const* weights;
  const std::uint64_t* positions;
  std::uint32_t* rank;
  std::uint64_t* order;
  std::uint32_t* tensor;
  std::uint32_t* index;
  std::uint16_t* bits;

  DTE_HOST_DEVICE void operator()(std::uint64_t k) const {
    const std::int64_t o = offsets[k];
    const WorkItem& item = items[find_item(items, n_items, o)];
    const Run& run = runs[item.run];
    const auto delta = static_cast<std::uint32_t>(o - run.shard_begin);
    const std::uint16_t b =
        Detect::store(weights[item.segment][item.first + (o - item.shard_begin)]);
    std::uint64_t e = positions[k];
    for (std::uint32_t t = 0; t < run.target_count; ++t, ++e) {
      const RunTarget& target = targets[run.first_target + t];
      rank[e] = target.rank;
      order[e] = e;
      tensor[e] = target.tensor;
      index[e] = target.index + delta;
      bits[e] = b;
    }
  }
};

// Stage 4b, per entry e: the entries in bucket order.
struct GatherEntries {
  const std::uint64_t* order;
  const std::uint32_t* tensor;
  const std::uint32_t* index;
  const std::uint16_t* bits;
  std::uint32_t* out_tensor;
  std::uint32_t* out_index;
  std::uint16_t* out_bits;

  DTE_HOST_DEVICE void operator()(std::uint64_t e) const {
    const std::uint64_t src = order[e];
    out_tensor[e] = tensor[src];
    out_index[e] = index[src];
    out_bits[e] = bits[src];
  }
};

// Stage 4c, per entry e of n in bucket order (rank: the sorted receivers): the last entry of
// each receiver's bucket writes ends[receiver] = e + 1. Receivers without an entry keep their 0;
// bucket_bounds turns the ends into offsets and counts.
struct BucketEnds {
  const std::uint32_t* rank;
  std::uint64_t n;
  std::uint64_t* ends;

  DTE_HOST_DEVICE void operator()(std::uint64_t e) const {
    if (e + 1 == n || rank[e + 1] != rank[e]) ends[rank[e]] = e + 1;
  }
};

// Host: each receiver's bucket [offset[d], offset[d] + count[d]) from BucketEnds' ends.
inline void bucket_bounds(const std::uint64_t* ends, std::size_t receivers, std::uint64_t* offset,
                          std::uint64_t* count) noexcept {
  std::uint64_t at = 0;
  for (std::size_t d = 0; d < receivers; ++d) {
    const std::uint64_t end = ends[d] == 0 ? at : ends[d];
    offset[d] = at;
    count[d] = end - at;
    at = end;
  }
}

// Receiver, per entry e, before anything is written: the first bad one (lowest index) is
// recorded in first_bad.
struct CheckEntries {
  const std::uint32_t* tensor;
  const std::uint32_t* index;
  std::uint32_t n_tensors;
  const std::uint64_t* live_end;
  const SourceRun* sources;
  std::uint32_t n_sources;
  unsigned long long* first_bad;

  DTE_HOST_DEVICE void operator()(std::uint64_t e) const {
    const std::uint32_t t = tensor[e];
    const bool ok = t < n_tensors && index[e] < live_end[t] &&
                    find_source(sources, n_sources, t, index[e]) != n_sources;
    if (!ok) simt::atomic_min(first_bad, static_cast<unsigned long long>(e));
  }
};

// Receiver, per entry e: writes it and moves the digest by what it overwrites (fresh: nothing, a
// full publication's first write of a reset receiver) and what it writes. Entries are distinct
// elements (one sender per element); were two to hit one element, the digest would disagree
// with the tensors and the verification would repair the tensor.
struct WriteEntries {
  const std::uint32_t* tensor;
  const std::uint32_t* index;
  const std::uint16_t* bits;
  std::uint16_t* const* tensors;
  const SourceRun* sources;
  std::uint32_t n_sources;
  bool fresh;
  Digest* digest;

  DTE_HOST_DEVICE void operator()(std::uint64_t e) const {
    const std::uint32_t t = tensor[e], i = index[e];
    const SourceRun& s = sources[find_source(sources, n_sources, t, i)];
    const std::int64_t g = s.canonical + (i - s.index);
    std::uint16_t& cell = tensors[t][i];
    const Digest term = element_digest(g, bits[e]) - (fresh ? 0u : element_digest(g, cell));
    cell = bits[e];
    if (term != 0) simt::atomic_add(&digest[s.tensor], term);
  }
};

// A publication's batch, per selected element k < *count: its bits (Detect::store of its
// weight) and, with previous, what its previous bits can be (the reconstruction of the last
// step: the host frame's previous()).
template <class Detect, class Kernel>
struct GatherChanged {
  const std::uint32_t* offset;
  const unsigned long long* count;
  std::int64_t begin;
  const WorkItem* items;
  std::uint32_t n_items;
  const Kernel* kernels;  // null: no previous bits
  const float* const* weights;
  std::uint16_t* bits;
  PreviousBits* previous;

  DTE_HOST_DEVICE void operator()(std::uint64_t k) const {
    if (k >= *count) return;
    const std::int64_t o = begin + offset[k];
    const WorkItem& item = items[find_item(items, n_items, o)];
    const std::int64_t i = item.first + (o - item.shard_begin);
    bits[k] = Detect::store(weights[item.segment][i]);
    if (previous != nullptr)
      previous[k] = Detect::previous(kernels[item.segment](static_cast<std::size_t>(i)));
  }
};

}  // namespace dte::pipeline::device
