// SPDX-License-Identifier: Apache-2.0
// The pipeline's device stages over a device executor E (concepts.hpp: device_executor; exec::Cuda
// on a GPU, dte/sim/simt_host.hpp's host twin in CI), over one trainer rank's shard of one
// buffer in the executor's memory, with the host stages' rules and results (tests/cuda/
// test_cuda_pipeline.cu compares them bit for bit):
//   1. detect  (one kernel over the WorkTable's items, one block per item): theta, m, v read
//      once; the inverse's valid(i), reconstruction and Detect::classify, the digest term per
//      sent element, the K-step dirty mask, one send bit per element (warp ballots, atomics
//      only where two items share a 64-bit word), and the counts: flagged, guard, the first
//      refused item, the digest per canonical tensor, the entries per receiver.
//   -- the publication's one host synchronisation: the counts come back --
//   Stages 2-4 run batch by batch over the shard (pipeline/route_batches.hpp: each batch's
//   scratch fits exec::Cuda::scratch_limit(), were every element in it changed), each batch
//   read into the messages before the next starts:
//   2. compact (CUB DeviceSelect::Flagged over a counting iterator, the send bits as flags):
//      the batch's changed shard offsets in increasing order (64-bit: shards above 2^31).
//   3. route   (one thread per changed element: binary search of its item, then its run's
//      receiver targets; the entries' positions by CUB DeviceScan over the target counts).
//   4. bucket  (CUB DeviceRadixSort of the entries by receiver, stable, over the receiver bits
//      only): one contiguous bucket per receiver, in shard order inside it, and its bounds.
//   5. apply   (receiver side, apply_entries): a check kernel refuses an entry outside the
//      receiver's live elements before anything is written; then scatter into the caller's live
//      BF16 tensors and update the receiver's digest by what is overwritten and written.
// This file is host code written once for every device executor: what it asks of E goes through
// E's memory (concepts.hpp: device_memory; exec::BasicDeviceArray) and exec::device_ops<E>
// (launches, CUB's algorithms), and every kernel's body is a DTE_HOST_DEVICE functor
// (pipeline/device_kernels.hpp). On a GPU pipeline/device.cuh gives it
// exec::Cuda's ops (exec/cuda_device_ops.cuh); in CI the host twin runs these same stages, the
// same bodies and the same orchestration, on the CPU (ctest -L device-on-host).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/digest.hpp"
#include "dte/error.hpp"
#include "dte/exec/device_array.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/device_kernels.hpp"
#include "dte/pipeline/device_tables.hpp"
#include "dte/pipeline/route_batches.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/pipeline/segment_weights.hpp"

namespace dte::pipeline::device {

// The executor's arrays and pinned host buffers.
template <class E, class T>
using Array = exec::BasicDeviceArray<E, T>;
template <class E>
using Pinned = typename exec::device_ops<E>::pinned;

// The device copy of one buffer's tables: work items, runs, receiver targets.
template <device_executor E>
struct DeviceTables {
  Array<E, WorkItem> items;
  Array<E, Run> runs;
  Array<E, RunTarget> targets;
  std::uint32_t n_items = 0;
  std::int64_t shard_size = 0;

  DeviceTables() = default;
  DeviceTables(const E& e, const WorkTable& work, std::span<const Run> host_runs,
               std::span<const RunTarget> all_targets, std::int64_t shard)
      : items(Array<E, WorkItem>::copy_of(e, work.items())),
        runs(Array<E, Run>::copy_of(e, host_runs)),
        targets(Array<E, RunTarget>::copy_of(e, all_targets)),
        n_items(static_cast<std::uint32_t>(work.items().size())),
        shard_size(shard) {
    if (work.items().size() > 0xFFFFFFFFull) {
      throw unsupported("dte::pipeline::device: a shard of more than 2^32 work items (" +
                        std::to_string(work.items().size()) + ")");
    }
  }
};

// What stage 1 found, on the host after the one synchronisation.
struct DetectResult {
  std::uint64_t flagged = 0, guard = 0, entries = 0, scanned = 0;
  std::uint64_t first_invalid_item = ~0ull;  // the work item of the first refused element
  std::int64_t invalid_segment = -1;         // its plan segment (invalid_segment()), or -1
  std::vector<Digest> digest;                // per canonical tensor
  std::vector<std::uint64_t> per_receiver;   // routed entries per receiver
};

// The plan segment of the first refused element (-1: none), read from the device's items.
template <device_executor E>
std::int64_t invalid_segment(const E& e, const DeviceTables<E>& t, const DetectResult& r) {
  if (r.first_invalid_item == ~0ull) return -1;
  WorkItem item{};
  exec::read(e, &item, t.items.data() + r.first_invalid_item, sizeof item);
  return item.segment;
}

// Stage 1 enqueued: its counts are copied into pinned memory on the stream and read by
// finish() once the stream has passed them, so several buffers' detect passes share one
// synchronisation (SenderPipeline::scan).
template <device_executor E>
class PendingDetect {
 public:
  PendingDetect() = default;

  // Reads the counts; the caller synchronised the stream after the launch.
  [[nodiscard]] DetectResult finish() const {
    DetectResult r;
    r.digest.assign(canonical_tensors_, 0);
    r.per_receiver.assign(receivers_, 0);
    if (!launched_) return r;
    const auto* p = reinterpret_cast<const std::byte*>(host_ptr_);
    DetectTotals totals{};
    std::memcpy(&totals, p, sizeof totals);
    std::memcpy(r.digest.data(), p + digest_at(), canonical_tensors_ * sizeof(Digest));
    std::memcpy(r.per_receiver.data(), p + receivers_at(), receivers_ * 8);
    r.flagged = totals.flagged;
    r.guard = totals.guard;
    r.entries = totals.entries;
    r.scanned = totals.scanned;
    r.first_invalid_item = totals.first_invalid_item;
    return r;
  }

 private:
  template <change_detector Detect, device_executor X, class Kernel>
  friend PendingDetect<X> detect_async(const X&, const DeviceTables<X>&, const Kernel*,
                                       const float* const*, ScanMode, std::uint64_t*,
                                       std::uint64_t*, std::size_t, std::size_t, Pinned<X>&);

  [[nodiscard]] std::size_t digest_at() const noexcept { return sizeof(DetectTotals); }
  [[nodiscard]] std::size_t receivers_at() const noexcept {
    return (digest_at() + canonical_tensors_ * sizeof(Digest) + 7) / 8 * 8;
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return receivers_at() + receivers_ * 8; }

  bool launched_ = false;
  std::size_t canonical_tensors_ = 0, receivers_ = 0;
  Array<E, std::byte> counts_;  // the same layout as the pinned copy
  const std::byte* host_ptr_ = nullptr;
};

// Per plan segment, where its weights start in one buffer's weights theta (device memory): the
// weights table of a trainer that holds its shard as one buffer.
template <device_executor E>
Array<E, const float*> buffer_weights(const E& e, const float* theta,
                                      const std::vector<layout::PlanSegment>& segments) {
  std::vector<const float*> at;
  at.reserve(segments.size());
  for (const layout::PlanSegment& s : segments)
    at.push_back(theta + s.shard_begin);
  return Array<E, const float*>::copy_of(e, at);  // (pageable: copied before it returns)
}

// Stage 1 over a buffer, enqueued. kernels: one per plan segment, pointing at device memory
// (bind with Inverse::bind_unchecked on the device spans: it reads no element); weights: per
// plan segment, where its device weights start (read in mode all; buffer_weights for one
// buffer). mask: K > 1, one bit per shard element (else null). send: zeroed here, one bit per
// shard element. pinned: where the counts land (one buffer per pending pass, alive until
// finish()).
template <change_detector Detect, device_executor E, class Kernel>
PendingDetect<E> detect_async(const E& e, const DeviceTables<E>& t, const Kernel* kernels,
                              const float* const* weights, ScanMode mode, std::uint64_t* mask,
                              std::uint64_t* send, std::size_t canonical_tensors,
                              std::size_t receivers, Pinned<E>& pinned) {
  using Ops = exec::device_ops<E>;
  PendingDetect<E> p;
  p.canonical_tensors_ = canonical_tensors;
  p.receivers_ = receivers;
  if (t.n_items == 0) return p;
  const std::size_t words = (static_cast<std::size_t>(t.shard_size) + 63) / 64;
  e.fill(send, 0, words * 8);
  p.counts_ = Array<E, std::byte>::zeros(e, p.bytes());
  std::byte* d = p.counts_.data();
  auto* totals = reinterpret_cast<DetectTotals*>(d);
  e.fill(&totals->first_invalid_item, 0xFF, 8);
  const DetectItems<Detect, Kernel> body{
      t.items.data(),
      t.n_items,
      t.runs.data(),
      t.targets.data(),
      kernels,
      weights,
      mode,
      mask,
      send,
      totals,
      reinterpret_cast<Digest*>(d + p.digest_at()),
      reinterpret_cast<unsigned long long*>(d + p.receivers_at())};
  Ops::template each_warp<block_threads>(e, body, std::uint64_t{t.n_items} * block_threads);
  std::byte* h = pinned.reserve(p.bytes());
  e.download(h, d, p.bytes());
  p.host_ptr_ = h;
  p.launched_ = true;
  return p;
}

// Stage 1 with its own synchronisation (one buffer alone: tests, benchmarks).
template <change_detector Detect, device_executor E, class Kernel>
DetectResult detect(const E& e, const DeviceTables<E>& t, const Kernel* kernels,
                    const float* const* weights, ScanMode mode, std::uint64_t* mask,
                    std::uint64_t* send, std::size_t canonical_tensors, std::size_t receivers) {
  Pinned<E> pinned;
  const PendingDetect<E> p = detect_async<Detect>(e, t, kernels, weights, mode, mask, send,
                                                  canonical_tensors, receivers, pinned);
  e.synchronize();
  DetectResult r = p.finish();
  r.invalid_segment = invalid_segment(e, t, r);
  return r;
}

// One batch of routed entries in pinned host memory, bucketed by receiver: receiver d's entries
// are [offset[d], offset[d] + count[d]), in shard order (and target order per element).
struct BucketBatch {
  std::span<const std::uint32_t> tensor, index;
  std::span<const std::uint16_t> bits;
  std::span<const std::uint64_t> offset, count;
};

// What route_and_bucket did over one buffer.
struct RouteTotals {
  std::uint64_t entries = 0;       // routed, over every batch
  std::size_t batches = 0;         // that held a change
  std::uint64_t peak_scratch = 0;  // device bytes held at once (arrays and CUB's temp)
};

// Stages 2-4 over one buffer after detect (d: its counts; send: its send bits), batch by batch
// (batches: route_batches(), whose scratch fits a stated bound): per batch, the flagged offsets
// in [begin, end) (select), their receiver copies (count, scan), their entries with the receiver
// as sort key (route), bucketed by a stable radix sort on the receiver bits (sort, gather), the
// bucket ends; the batch then comes to pinned host memory (staging) and f(const BucketBatch&)
// takes it, before the next batch starts. A single batch needs no synchronisation before its
// copy (its counts are detect's); more take two each (the batch's changed and entry counts).
template <change_detector Detect, device_executor E, class F>
RouteTotals route_and_bucket(const E& e, const DeviceTables<E>& t, const float* const* weights,
                             const std::uint64_t* send, const DetectResult& d,
                             std::span<const RouteBatch> batches, Pinned<E>& staging, F&& f) {
  using Ops = exec::device_ops<E>;
  const std::size_t receivers = d.per_receiver.size();
  const int end_bit = receiver_bits(receivers);
  const bool whole = batches.size() == 1;
  RouteTotals out;
  std::vector<std::uint64_t> per_receiver(receivers, 0);
  // Brings the 8-byte counts at from[0..k) to pinned host memory (one synchronisation).
  auto counts_of = [&](std::initializer_list<const void*> from) {
    auto* h = reinterpret_cast<std::uint64_t*>(staging.reserve(8 * from.size()));
    std::size_t i = 0;
    for (const void* p : from) {
      e.download(h + i++, p, 8);
    }
    e.synchronize();
    return h;
  };
  for (const RouteBatch& batch : batches) {
    const std::int64_t n = batch.end - batch.begin;
    if (d.flagged == 0 || n == 0) continue;
    std::size_t temp = 0;
    const std::size_t capacity = whole ? d.flagged : static_cast<std::size_t>(n);
    Array<E, std::int64_t> offsets(e, capacity);
    Array<E, std::int64_t> selected(e, 1);
    temp = std::max(temp, Ops::select_flagged(e, batch.begin, n, detail::BitOf{send},
                                              offsets.data(), selected.data()));
    const std::uint64_t changed = whole ? d.flagged : counts_of({selected.data()})[0];
    if (changed == 0) continue;
    const auto work = static_cast<std::size_t>(changed);
    Array<E, std::uint64_t> counts(e, work), positions(e, work);
    Ops::template each_thread<block_threads>(
        e, CountTargets{offsets.data(), t.items.data(), t.n_items, t.runs.data(), counts.data()},
        work);
    temp = std::max(temp, Ops::exclusive_sum(e, counts.data(), positions.data(), work));
    std::uint64_t total = d.entries;
    if (!whole) {  // (the last changed element's position plus its copies)
      const std::uint64_t* h = counts_of({positions.data() + work - 1, counts.data() + work - 1});
      total = h[0] + h[1];
    }
    if (total == 0) continue;
    if (total > batch.max_entries) {
      throw error("dte::pipeline::device: a routing batch holds " + std::to_string(total) +
                  " entries where its elements route to at most " +
                  std::to_string(batch.max_entries) + "; report this");
    }
    const auto entries = static_cast<std::size_t>(total);
    Array<E, std::uint32_t> rank(e, entries), rank_alt(e, entries), tensor(e, entries),
        index(e, entries), out_tensor(e, entries), out_index(e, entries);
    Array<E, std::uint64_t> order(e, entries), order_alt(e, entries);
    Array<E, std::uint16_t> bits(e, entries), out_bits(e, entries);
    Array<E, std::uint64_t> ends = Array<E, std::uint64_t>::zeros(e, receivers);
    Ops::template each_thread<block_threads>(
        e,
        RouteEntries<Detect>{offsets.data(), t.items.data(), t.n_items, t.runs.data(),
                             t.targets.data(), weights, positions.data(), rank.data(), order.data(),
                             tensor.data(), index.data(), bits.data()},
        work);
    // A stable sort on the receiver bits only: histogram, scan and scatter in CUB's passes.
    const auto sorted = Ops::sort_pairs(e, rank.data(), rank_alt.data(), order.data(),
                                        order_alt.data(), entries, end_bit);
    temp = std::max(temp, sorted.temp_bytes);
    Ops::template each_thread<block_threads>(
        e,
        GatherEntries{sorted.values, tensor.data(), index.data(), bits.data(), out_tensor.data(),
                      out_index.data(), out_bits.data()},
        entries);
    Ops::template each_thread<block_threads>(e, BucketEnds{sorted.keys, total, ends.data()},
                                             entries);
    out.peak_scratch = std::max<std::uint64_t>(
        out.peak_scratch, offsets.bytes() + selected.bytes() + counts.bytes() + positions.bytes() +
                              2 * rank.bytes() + tensor.bytes() + index.bytes() +
                              out_tensor.bytes() + out_index.bytes() + 2 * order.bytes() +
                              bits.bytes() + out_bits.bytes() + ends.bytes() + temp);

    // The batch to the host: ends (then offsets and counts) per receiver, then the entries.
    const std::size_t head = 24 * receivers;
    std::byte* h = staging.reserve(head + 10 * entries + 16);
    auto* end_at = reinterpret_cast<std::uint64_t*>(h);
    auto* offset = end_at + receivers;
    auto* count = offset + receivers;
    auto* host_tensor = reinterpret_cast<std::uint32_t*>(h + head);
    auto* host_index = host_tensor + entries;
    auto* host_bits = reinterpret_cast<std::uint16_t*>(host_index + entries);
    e.download(end_at, ends.data(), 8 * receivers);
    e.download(host_tensor, out_tensor.data(), 4 * entries);
    e.download(host_index, out_index.data(), 4 * entries);
    e.download(host_bits, out_bits.data(), 2 * entries);
    e.synchronize();
    bucket_bounds(end_at, receivers, offset, count);
    for (std::size_t r = 0; r < receivers; ++r)
      per_receiver[r] += count[r];
    out.entries += total;
    ++out.batches;
    f(BucketBatch{{host_tensor, entries},
                  {host_index, entries},
                  {host_bits, entries},
                  {offset, receivers},
                  {count, receivers}});
  }
  for (std::size_t r = 0; r < receivers; ++r) {
    if (per_receiver[r] != d.per_receiver[r]) {
      throw error("dte::pipeline::device: the detect stage counted " +
                  std::to_string(d.per_receiver[r]) + " entries for receiver " + std::to_string(r) +
                  " but routing gave " + std::to_string(per_receiver[r]) + "; report this");
    }
  }
  return out;
}

// ---- Receiver side ----

// One receiver rank's device view: its live tensors (caller-owned BF16/FP16 bits), their live
// element counts, and its source table (receiver element -> canonical element).
template <device_executor E>
struct DeviceReceiver {
  Array<E, std::uint16_t*> tensors;
  Array<E, std::uint64_t> live_end;
  Array<E, SourceRun> sources;
  Array<E, Digest> digest;  // per canonical tensor, of the tensors' contents
  std::uint32_t n_tensors = 0, n_sources = 0;

  DeviceReceiver() = default;
  DeviceReceiver(const E& e, std::span<std::uint16_t* const> device_tensors,
                 std::span<const std::uint64_t> live, const ReceiverSourceTable& table,
                 std::size_t canonical_tensors)
      : tensors(Array<E, std::uint16_t*>::copy_of(e, device_tensors)),
        live_end(Array<E, std::uint64_t>::copy_of(e, live)),
        sources(Array<E, SourceRun>::copy_of(e, table.runs())),
        digest(Array<E, Digest>::zeros(e, canonical_tensors)),
        n_tensors(static_cast<std::uint32_t>(device_tensors.size())),
        n_sources(static_cast<std::uint32_t>(table.runs().size())) {
    if (device_tensors.size() != live.size()) {
      throw invalid_argument("DeviceReceiver: " + std::to_string(device_tensors.size()) +
                             " tensors but " + std::to_string(live.size()) + " live sizes");
    }
  }
};

// Applies n entries (device arrays) to a receiver's device tensors. Refuses the whole batch,
// before writing anything, when an entry is outside the receiver's live elements (throws
// protocol_error naming it); synchronises once for that check.
template <device_executor E>
void apply_entries(const E& e, DeviceReceiver<E>& r, const std::uint32_t* tensor,
                   const std::uint32_t* index, const std::uint16_t* bits, std::uint64_t n,
                   bool fresh) {
  using Ops = exec::device_ops<E>;
  if (n == 0) return;
  auto first_bad = Array<E, unsigned long long>(e, 1);
  e.fill(first_bad.data(), 0xFF, 8);
  Ops::template each_thread<block_threads>(
      e,
      CheckEntries{tensor, index, r.n_tensors, r.live_end.data(), r.sources.data(), r.n_sources,
                   first_bad.data()},
      n);
  const unsigned long long bad = first_bad.to_host()[0];
  if (bad != ~0ull) {
    std::uint32_t t = 0, i = 0;
    exec::read(e, &t, tensor + bad, 4);
    exec::read(e, &i, index + bad, 4);
    throw protocol_error("dte::pipeline::device::apply_entries: entry " + std::to_string(bad) +
                         " writes element " + std::to_string(i) + " of receiver tensor " +
                         std::to_string(t) +
                         ", which this receiver does not hold as live data; nothing was written");
  }
  Ops::template each_thread<block_threads>(
      e,
      WriteEntries{tensor, index, bits, r.tensors.data(), r.sources.data(), r.n_sources, fresh,
                   r.digest.data()},
      n);
}

// ---- Changed elements in canonical coordinates (a publication's chunks) ----

// Where gather_changed() leaves one batch of changed elements: their shard offsets relative to
// the batch's first (increasing), their bits and, for a diff encoding, what their previous bits
// can be. Device memory, capacity elements each; count: how many the batch holds.
template <device_executor E>
struct ChangedBatch {
  Array<E, std::uint32_t> offset;
  Array<E, std::uint16_t> bits;
  Array<E, PreviousBits> previous;  // empty without previous bits
  Array<E, unsigned long long> count;
};

// The elements of shard offsets [begin, begin + n) whose send bit is set, with their bits (and,
// kernels non-null, their previous bits), into batch (capacity at least their number). Enqueued;
// batch.count holds their number once the stream passes it.
template <change_detector Detect, device_executor E, class Kernel>
void gather_changed(const E& e, const DeviceTables<E>& t, const Kernel* kernels,
                    const float* const* weights, const std::uint64_t* send, std::int64_t begin,
                    std::int64_t n, ChangedBatch<E>& batch) {
  using Ops = exec::device_ops<E>;
  e.fill(batch.count.data(), 0, 8);
  if (n == 0) return;
  (void)Ops::select_flagged(e, std::uint32_t{0}, n, detail::BitFrom{send, begin},
                            batch.offset.data(), batch.count.data());
  Ops::template each_thread<block_threads>(
      e,
      GatherChanged<Detect, Kernel>{batch.offset.data(), batch.count.data(), begin, t.items.data(),
                                    t.n_items, kernels, weights, batch.bits.data(),
                                    kernels != nullptr ? batch.previous.data() : nullptr},
      batch.offset.size());
}

// ---- One trainer rank's publication on the device ----

// The stages over one trainer rank's shard, both buffers: the tables are built and copied once;
// detect() binds the inverse to the access's device spans (bind_unchecked reads no element) and
// runs stage 1 on both buffers with one synchronisation; then either the engine's compact,
// route and bucket (scan()) or a publication's batches of changed elements (gather()) on the
// executor's stream. Access: trainer_access whose spans are device memory, one span per buffer
// or one per plan segment (segmented_access).
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, device_executor E>
class SenderPipeline {
 public:
  using kernel = typename Inverse::kernel;
  using Ops = exec::device_ops<E>;

  // The engine's: routed to the receivers of the serving layout.
  SenderPipeline(const layout::HfModel& hf, const layout::TrainTopology& train,
                 const layout::ServingLayout& receivers, std::int64_t rank, bool keep_mask, E e)
      : hf_(&hf),
        rank_(rank),
        receivers_(static_cast<std::size_t>(receivers.topology().ranks())),
        plan_(hf, train, rank),
        table_(plan_, hf, &receivers),
        exec_(e) {
    init(keep_mask);
  }

  // A publication's, over a plan the caller built (canonical coordinates: no receivers).
  SenderPipeline(const layout::HfModel& hf, Plan plan, std::int64_t rank, bool keep_mask, E e)
      : hf_(&hf),
        rank_(rank),
        receivers_(0),
        plan_(std::move(plan)),
        table_(plan_, hf, nullptr),
        exec_(e) {
    init(keep_mask);
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const RunTable& runs() const noexcept { return table_; }
  [[nodiscard]] const E& executor() const noexcept { return exec_; }

  // Clears the K-step dirty masks (after a refused publication: the next one is full).
  void clear_masks() {
    for (auto& m : mask_) {
      if (m.size() != 0) exec_.fill(m.data(), 0, m.bytes());
    }
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept {
    return mask_[0].bytes() + mask_[1].bytes();
  }
  // Device memory held between publications besides the masks: tables and send bits.
  [[nodiscard]] std::uint64_t table_bytes() const noexcept {
    std::uint64_t n = 0;
    for (int x = 0; x < 2; ++x) {
      n += tables_[x].items.bytes() + tables_[x].runs.bytes() + tables_[x].targets.bytes() +
           send_[x].bytes();
    }
    return n;
  }

  // Stage 1 on both buffers, one synchronisation for their counts. Throws invalid_argument,
  // naming the segment, when an element of the optimizer state is refused (nothing is then
  // complete). The inverse and the weights stay bound for the stages after it.
  template <class Access>
  std::array<DetectResult, 2> detect(const Access& access, ScanMode mode) {
    std::array<DetectResult, 2> out;
    std::array<PendingDetect<E>, 2> pending;
    for (layout::BufferKind b : buffers) {
      const int x = static_cast<int>(b);
      kernels_[x] = {};
      weights_[x] = {};
      if (plan_.shard_size(b) == 0) continue;
      check_buffer(access, b);
      std::vector<const float*> at;
      std::vector<kernel> host_kernels;
      for (const layout::PlanSegment& s : plan_.segments(b)) {
        const std::span<const float> w = pipeline::segment_weights(access, rank_, b, s, label(s));
        // (a host pointer would otherwise reach the kernels, and the context be lost)
        if (!w.empty()) {
          Ops::check_readable("dte::pipeline::device::SenderPipeline::detect", label(s).c_str(),
                              w.data());
        }
        at.push_back(w.data());
        if (mode != ScanMode::all) {
          const auto& state = access.state(rank_, b, s);
          if constexpr (requires { state.buffers(); }) {
            if (!w.empty()) {  // (an empty segment's state holds no element)
              for (const void* p : state.buffers()) {
                Ops::check_readable("dte::pipeline::device::SenderPipeline::detect",
                                    (label(s) + " (optimizer state)").c_str(), p);
              }
            }
          }
          host_kernels.push_back(
              Inverse::bind_unchecked(access.hyperparameters(rank_, b, s), w, state, label(s)));
        }
      }
      weights_[x] = Array<E, const float*>::copy_of(exec_, at);
      kernels_[x] = Array<E, kernel>::copy_of(exec_, host_kernels);
      pending[x] = detect_async<Detect>(
          exec_, tables_[x], kernels_[x].data(), weights_[x].data(), mode, mask_[x].data(),
          send_[x].data(), static_cast<std::size_t>(hf_->size()), receivers_, pinned_[x]);
    }
    exec_.synchronize();  // the publication's one synchronisation: the counts
    for (layout::BufferKind b : buffers) {
      const int x = static_cast<int>(b);
      out[x] = pending[x].finish();
      out[x].invalid_segment = invalid_segment(exec_, tables_[x], out[x]);
      if (out[x].invalid_segment >= 0) {
        const layout::PlanSegment& s =
            plan_.segments(b)[static_cast<std::size_t>(out[x].invalid_segment)];
        throw invalid_argument(label(s) + ": an element of the optimizer state fails " +
                               std::string(Inverse::name) +
                               "'s element checks (a non-finite value or moment, a negative "
                               "second moment); nothing was sent");
      }
    }
    return out;
  }

  // The engine's publication: detect, then (but in mode mark) compact, route and bucket, batch
  // by batch within the executor's scratch limit (pipeline/route_batches.hpp), each batch handed
  // to f(BufferKind, const BucketBatch&) in shard order, dense buffer first.
  template <class Access, class F>
  std::array<DetectResult, 2> scan(const Access& access, ScanMode mode, F&& f) {
    route_[0] = route_[1] = RouteTotals{};
    const std::array<DetectResult, 2> found = detect(access, mode);
    if (mode == ScanMode::mark) return found;
    for (layout::BufferKind b : buffers) {
      const int x = static_cast<int>(b);
      if (plan_.shard_size(b) == 0) continue;
      route_[x] = route_and_bucket<Detect>(exec_, tables_[x], weights_[x].data(), send_[x].data(),
                                           found[x], route_plan_[x], staging_,
                                           [&](const BucketBatch& batch) { f(b, batch); });
    }
    return found;
  }
  // What the last scan's routing did, per buffer.
  [[nodiscard]] const RouteTotals& routed(layout::BufferKind b) const noexcept {
    return route_[static_cast<int>(b)];
  }

  // After detect(): the elements of buffer b flagged to send, in batches of at most batch_size
  // shard offsets, each brought to the host (one synchronisation per batch) and handed to
  // f(begin, offsets relative to begin, bits, previous bits (empty unless with_previous)) in
  // shard order. with_previous: also what their previous bits can be (mode detect only: the
  // inverse is bound).
  template <class F>
  void gather(layout::BufferKind b, std::uint64_t flagged, bool with_previous,
              std::int64_t batch_size, F&& f) {
    const int x = static_cast<int>(b);
    const std::int64_t shard = plan_.shard_size(b);
    if (flagged == 0 || shard == 0) return;
    const auto capacity = static_cast<std::size_t>(
        std::min<std::uint64_t>(flagged, static_cast<std::uint64_t>(std::min(batch_size, shard))));
    ChangedBatch<E> batch{Array<E, std::uint32_t>(exec_, capacity),
                          Array<E, std::uint16_t>(exec_, capacity),
                          Array<E, PreviousBits>(exec_, with_previous ? capacity : 0),
                          Array<E, unsigned long long>(exec_, 1)};
    const kernel* kernels = with_previous ? kernels_[x].data() : nullptr;
    const std::size_t each = 4 + 2 + (with_previous ? sizeof(PreviousBits) : 0);
    std::byte* h = host_.reserve(8 + each * capacity + 16);
    auto* count = reinterpret_cast<unsigned long long*>(h);
    auto* offset = reinterpret_cast<std::uint32_t*>(h + 8);
    auto* previous = reinterpret_cast<PreviousBits*>(h + 8 + 4 * capacity);
    auto* bits = reinterpret_cast<std::uint16_t*>(
        h + 8 + 4 * capacity + (with_previous ? sizeof(PreviousBits) : 0) * capacity);
    for (std::int64_t begin = 0; begin < shard; begin += batch_size) {
      const std::int64_t n = std::min(batch_size, shard - begin);
      gather_changed<Detect>(exec_, tables_[x], kernels, weights_[x].data(), send_[x].data(), begin,
                             n, batch);
      exec_.download(count, batch.count.data(), 8);
      exec_.synchronize();
      const auto k = static_cast<std::size_t>(*count);
      if (k > capacity) {
        throw error("dte::pipeline::device: a batch selected " + std::to_string(k) +
                    " elements where the detect stage flagged at most " + std::to_string(capacity) +
                    "; report this");
      }
      if (k == 0) continue;
      exec_.download(offset, batch.offset.data(), 4 * k);
      exec_.download(bits, batch.bits.data(), 2 * k);
      if (with_previous) {
        exec_.download(previous, batch.previous.data(), sizeof(PreviousBits) * k);
      }
      exec_.synchronize();
      f(begin, std::span<const std::uint32_t>(offset, k), std::span<const std::uint16_t>(bits, k),
        with_previous ? std::span<const PreviousBits>(previous, k)
                      : std::span<const PreviousBits>{});
    }
  }

  // Pinned host memory held for gather()'s and scan()'s batches.
  [[nodiscard]] std::uint64_t host_bytes() const noexcept { return host_.size() + staging_.size(); }

 private:
  static constexpr layout::BufferKind buffers[2] = {layout::BufferKind::dense,
                                                    layout::BufferKind::expert};

  void init(bool keep_mask) {
    for (layout::BufferKind b : buffers) {
      const int x = static_cast<int>(b);
      const WorkTable work(table_.runs(b), plan_.segments(b), item_elements);
      tables_[x] =
          DeviceTables<E>(exec_, work, table_.runs(b), table_.all_targets(), plan_.shard_size(b));
      const std::size_t words = (static_cast<std::size_t>(plan_.shard_size(b)) + 63) / 64;
      send_[x] = Array<E, std::uint64_t>(exec_, words);
      if (keep_mask) mask_[x] = Array<E, std::uint64_t>::zeros(exec_, words);
      route_plan_[x] = route_batches(table_.runs(b), plan_.shard_size(b), exec_.scratch_limit());
    }
  }

  // A trainer that gives buffer b as one span must give the whole shard (a segmented one's
  // spans are checked one by one as they are bound: pipeline/segment_weights.hpp).
  template <class Access>
  void check_buffer(const Access& access, layout::BufferKind b) const {
    if constexpr (!segmented_access<Access>) {
      const std::size_t held = access.theta(rank_, b).size();
      if (static_cast<std::int64_t>(held) != plan_.shard_size(b)) {
        throw invalid_argument("trainer rank " + std::to_string(rank_) + "'s " +
                               (b == layout::BufferKind::dense ? "dense" : "expert") +
                               " shard has " + std::to_string(held) +
                               " elements where the plan expects " +
                               std::to_string(plan_.shard_size(b)) + ". Nothing was sent.");
      }
    }
  }

  [[nodiscard]] std::string label(const layout::PlanSegment& s) const {
    return "trainer rank " + std::to_string(rank_) + " " +
           std::string(plan_.params()[static_cast<std::size_t>(s.param)].name());
  }

  const layout::HfModel* hf_;
  std::int64_t rank_;
  std::size_t receivers_;
  Plan plan_;
  RunTable table_;
  E exec_;
  DeviceTables<E> tables_[2];
  Array<E, std::uint64_t> send_[2], mask_[2];
  Array<E, kernel> kernels_[2];        // bound by the last detect() (not in mode all)
  Array<E, const float*> weights_[2];  // per plan segment, bound by the last detect()
  Pinned<E> pinned_[2];                // the counts of each buffer's detect pass
  Pinned<E> host_;                     // gather()'s batches
  Pinned<E> staging_;                  // scan()'s batches on their way to the encoder
  std::vector<RouteBatch> route_plan_[2];
  RouteTotals route_[2];
};

}  // namespace dte::pipeline::device
