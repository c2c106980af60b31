// SPDX-License-Identifier: Apache-2.0
// The device pipeline's kernel bodies (pipeline/device_kernels.hpp, exec/element_kernels.hpp) on
// the host, through simt::host, against the host frame (ctest -L device-on-host; no GPU, no CUDA
// runtime). The same bodies are what exec/simt.cuh launches on a GPU, so a body that gives
// other send sets, digests, counts or entries than the host frame fails here, in CI:
//   - stages 1-4 (detect, compact, route, bucket) over the golden cases of test_cuda_pipeline
//     (every trainer rank, every mode: a full publication, K = 1 deltas, a K = 2 window), entry
//     for entry and in order per receiver;
//   - the receiver's check and write: after a full publication and deltas every live receiver
//     element equals the BF16 rounding of the trainer's weight, the digest equals the tensors';
//     a bad entry is refused before anything is written;
//   - a publication's batches (gather changed) equal the compacted offsets, whatever the batch;
//   - classify and audit equal the host's per-element rules and dte::audit_reconstruction.
// The grids are small (kBlocks blocks) so that every grid-stride loop takes several turns.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "dte/audit.hpp"
#include "dte/detect/detect.hpp"
#include "dte/exec/element_kernels.hpp"
#include "dte/exec/simt.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/device_kernels.hpp"
#include "dte/pipeline/device_tables.hpp"
#include "dte/pipeline/route_batches.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/pipeline/segment_weights.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "stage_reference.hpp"

namespace {

namespace dev = dte::pipeline::device;
namespace simt = dte::simt;
using dte::layout::BufferKind;
using dte::pipeline::ScanMode;
using dte_test::StageResult;

constexpr unsigned kBlocks = 3;
// A scratch limit that routes the golden shards in many batches.
constexpr std::uint64_t kSmallScratch = dte::pipeline::route_bytes_per_batch + (1u << 16);
constexpr auto kThreads = static_cast<unsigned>(dev::block_threads);

using Inverse = dte::AdamWInverse;
using Detect = dte::BF16Detect;
using Kernel = Inverse::kernel;

// One buffer's routed entries in bucket order, per receiver (what Buckets holds on a GPU).
struct HostBuckets {
  std::vector<std::uint32_t> tensor, index;
  std::vector<std::uint16_t> bits;
  std::vector<std::uint64_t> offset, count;
};

// SenderPipeline's stages on the host: its tables, its kernel bodies run by simt::host, the host
// twins of its CUB calls, in the order pipeline/device.cuh enqueues them.
class HostTwinSender {
 public:
  HostTwinSender(const dte::layout::HfModel& hf, const dte::layout::TrainTopology& train,
                 const dte::layout::ServingLayout& recv, std::int64_t rank,
                 std::uint64_t scratch_limit = std::uint64_t{256} << 20)
      : hf_(&hf),
        scratch_limit_(scratch_limit),
        rank_(rank),
        receivers_(static_cast<std::size_t>(recv.topology().ranks())),
        plan_(hf, train, rank),
        table_(plan_, hf, &recv) {
    for (BufferKind b : dte_test::kBuffers) {
      const int x = static_cast<int>(b);
      work_[x] = dte::pipeline::WorkTable(table_.runs(b), plan_.segments(b), dev::item_elements);
      const std::size_t words = (static_cast<std::size_t>(plan_.shard_size(b)) + 63) / 64;
      send_[x].assign(words, 0);
      mask_[x].assign(words, 0);
    }
  }

  // Stage 1 on buffer b (binds the kernels and weights for the stages after it).
  dev::DetectTotals detect(const dte::sim::AdamWAccess& a, BufferKind b, ScanMode mode,
                           std::vector<dte::Digest>& digest,
                           std::vector<unsigned long long>& per_receiver) {
    const int x = static_cast<int>(b);
    weights_[x].clear();
    kernels_[x].clear();
    for (const dte::layout::PlanSegment& s : plan_.segments(b)) {
      const std::string label = "segment " + std::to_string(s.param);
      const std::span<const float> w = dte::pipeline::segment_weights(a, rank_, b, s, label);
      weights_[x].push_back(w.data());
      if (mode != ScanMode::all) {
        kernels_[x].push_back(Inverse::bind_unchecked(a.hyperparameters(rank_, b, s), w,
                                                      a.state(rank_, b, s), label));
      }
    }
    std::fill(send_[x].begin(), send_[x].end(), 0);
    dev::DetectTotals totals{0, 0, 0, 0, ~0ull};
    const auto items = work_[x].items();
    const dev::DetectItems<Detect, Kernel> body{items.data(),
                                                static_cast<std::uint32_t>(items.size()),
                                                table_.runs(b).data(),
                                                table_.all_targets().data(),
                                                kernels_[x].data(),
                                                weights_[x].data(),
                                                mode,
                                                mask_[x].data(),
                                                send_[x].data(),
                                                &totals,
                                                digest.data(),
                                                per_receiver.data()};
    simt::host::each_warp(kBlocks, kThreads, body);
    return totals;
  }

  // Stages 2-4 on buffer b after detect, batch by batch as route_and_bucket runs them (its
  // batches: route_batches within the scratch limit): per batch compact, count, scan, route,
  // sort, gather, and the bucket ends; the batches in shard order.
  std::vector<HostBuckets> route_and_bucket(BufferKind b,
                                            const std::vector<unsigned long long>& per_receiver) {
    const int x = static_cast<int>(b);
    std::vector<HostBuckets> out;
    std::vector<std::uint64_t> routed(receivers_, 0);
    const auto items = work_[x].items();
    const auto n_items = static_cast<std::uint32_t>(items.size());
    for (const dte::pipeline::RouteBatch& batch :
         dte::pipeline::route_batches(table_.runs(b), plan_.shard_size(b), scratch_limit_)) {
      std::vector<std::int64_t> offsets = simt::host::select_flagged(
          batch.end - batch.begin, dev::detail::BitFrom{send_[x].data(), batch.begin});
      for (std::int64_t& o : offsets)
        o += batch.begin;
      const auto n = static_cast<std::uint64_t>(offsets.size());
      if (n == 0) continue;
      std::vector<std::uint64_t> counts(n), positions(n);
      simt::host::each_thread(kBlocks, kThreads, n,
                              dev::CountTargets{offsets.data(), items.data(), n_items,
                                                table_.runs(b).data(), counts.data()});
      simt::host::exclusive_sum<std::uint64_t>(counts, positions);
      const std::uint64_t total = positions.back() + counts.back();
      REQUIRE(total <= batch.max_entries);
      if (total == 0) continue;
      REQUIRE(dte::pipeline::route_scratch(static_cast<std::uint64_t>(batch.end - batch.begin),
                                           total) <= scratch_limit_);
      std::vector<std::uint32_t> rank(total), rank_sorted(total), tensor(total), index(total);
      std::vector<std::uint64_t> order(total), order_sorted(total), ends(receivers_, 0);
      std::vector<std::uint16_t> bits(total);
      simt::host::each_thread(
          kBlocks, kThreads, n,
          dev::RouteEntries<Detect>{offsets.data(), items.data(), n_items, table_.runs(b).data(),
                                    table_.all_targets().data(), weights_[x].data(),
                                    positions.data(), rank.data(), order.data(), tensor.data(),
                                    index.data(), bits.data()});
      simt::host::sort_pairs<std::uint32_t, std::uint64_t>(
          rank, order, dev::receiver_bits(receivers_), rank_sorted, order_sorted);
      HostBuckets& k = out.emplace_back();
      k.tensor.resize(total);
      k.index.resize(total);
      k.bits.resize(total);
      simt::host::each_thread(
          kBlocks, kThreads, total,
          dev::GatherEntries{order_sorted.data(), tensor.data(), index.data(), bits.data(),
                             k.tensor.data(), k.index.data(), k.bits.data()});
      simt::host::each_thread(kBlocks, kThreads, total,
                              dev::BucketEnds{rank_sorted.data(), total, ends.data()});
      k.offset.resize(receivers_);
      k.count.resize(receivers_);
      dev::bucket_bounds(ends.data(), receivers_, k.offset.data(), k.count.data());
      for (std::size_t d = 0; d < receivers_; ++d)
        routed[d] += k.count[d];
    }
    for (std::size_t d = 0; d < receivers_; ++d)
      CHECK(routed[d] == per_receiver[d]);  // (the detect stage's count per receiver)
    return out;
  }

  // SenderPipeline::scan on the host: the counts into r (flagged, guard, scanned, digest; r's
  // digest sized to the model), the buckets of each buffer.
  std::vector<HostBuckets> scan(const dte::sim::AdamWAccess& a, ScanMode mode, StageResult& r) {
    std::vector<HostBuckets> out;
    for (BufferKind b : dte_test::kBuffers) {
      if (plan_.shard_size(b) == 0) continue;
      std::vector<unsigned long long> per_receiver(receivers_, 0);
      const dev::DetectTotals t = detect(a, b, mode, r.digest, per_receiver);
      REQUIRE(t.first_invalid_item == ~0ull);
      r.flagged += t.flagged;
      r.guard += t.guard;
      r.scanned += t.scanned;
      if (mode == ScanMode::mark) continue;
      std::uint64_t entries = 0;
      for (HostBuckets& k : route_and_bucket(b, per_receiver)) {
        entries += k.tensor.size();
        out.push_back(std::move(k));
      }
      CHECK(entries == t.entries);
    }
    return out;
  }

  // The same, as the reference's per-receiver lists (the batches in order).
  StageResult scan(const dte::sim::AdamWAccess& a, ScanMode mode) {
    StageResult r;
    r.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
    r.to.resize(receivers_);
    batches_ = 0;
    for (const HostBuckets& k : scan(a, mode, r)) {
      ++batches_;
      for (std::size_t d = 0; d < k.count.size(); ++d) {
        for (std::uint64_t e = 0; e < k.count[d]; ++e) {
          const std::uint64_t at = k.offset[d] + e;
          r.to[d].emplace_back(k.tensor[at], k.index[at], k.bits[at]);
        }
      }
    }
    return r;
  }
  // Batches that held a change in the last scan.
  [[nodiscard]] std::size_t batches() const noexcept { return batches_; }

  [[nodiscard]] const std::vector<std::uint64_t>& send(BufferKind b) const {
    return send_[static_cast<int>(b)];
  }
  [[nodiscard]] const dte::pipeline::WorkTable& work(BufferKind b) const {
    return work_[static_cast<int>(b)];
  }
  [[nodiscard]] const std::vector<Kernel>& kernels(BufferKind b) const {
    return kernels_[static_cast<int>(b)];
  }
  [[nodiscard]] const std::vector<const float*>& weights(BufferKind b) const {
    return weights_[static_cast<int>(b)];
  }
  [[nodiscard]] const dte::layout::TransferPlan& plan() const { return plan_; }

 private:
  const dte::layout::HfModel* hf_;
  std::uint64_t scratch_limit_;
  std::size_t batches_ = 0;
  std::int64_t rank_;
  std::size_t receivers_;
  dte::layout::TransferPlan plan_;
  dte::pipeline::RunTable table_;
  dte::pipeline::WorkTable work_[2];
  std::vector<std::uint64_t> send_[2], mask_[2];
  std::vector<Kernel> kernels_[2];
  std::vector<const float*> weights_[2];
};

}  // namespace

TEST_CASE("device-on-host: stages 1-4 == the host frame, every mode, every rank") {
  for (const dte_test::Case& c : dte_test::kCases) {
    INFO(c.model << " train " << c.train << " infer " << c.infer);
    const dte::layout::HfModel hf(dte::layout::model_preset(c.model));
    const auto train = dte::layout::parse_train_topology(c.train);
    const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology(c.infer));
    dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 7, .lr = 3e-4});
    const dte::sim::AdamWAccess access{&trainer};
    const auto tensors = static_cast<std::size_t>(hf.size());
    const auto receivers = static_cast<std::size_t>(recv.topology().ranks());
    // The default scratch limit (one batch per buffer here), and one that routes each shard in
    // many batches: the entries must arrive the same.
    for (const std::uint64_t limit : {std::uint64_t{256} << 20, kSmallScratch}) {
      INFO("scratch limit " << limit);
      std::size_t batches = 0;
      for (std::int64_t rank = 0; rank < train.world(); ++rank) {
        INFO("trainer rank " << rank);
        dte_test::HostSender host(hf, train, &recv, rank, true, dte::exec::Host(1));
        HostTwinSender twin(hf, train, recv, rank, limit);
        dte_test::check_same(dte_test::host_stages(host, access, ScanMode::all, tensors, receivers),
                             twin.scan(access, ScanMode::all));
        batches += twin.batches();
        // Each step moves the trainer; the host frame and the twin both see it.
        for (const ScanMode mode : {ScanMode::detect, ScanMode::mark, ScanMode::mask}) {
          trainer.step();
          INFO("mode " << static_cast<int>(mode));
          const StageResult h = dte_test::host_stages(host, access, mode, tensors, receivers);
          const StageResult d = twin.scan(access, mode);
          dte_test::check_same(h, d);
          if (mode == ScanMode::detect) CHECK(h.flagged > 0);  // the case exercises changes
        }
      }
      if (limit == kSmallScratch) CHECK(batches > static_cast<std::size_t>(4 * train.world()));
    }
  }
}

TEST_CASE("routing batches: cover the shard in order, each within the scratch limit") {
  for (const dte_test::Case& c : dte_test::kCases) {
    INFO(c.model << " train " << c.train << " infer " << c.infer);
    const dte::layout::HfModel hf(dte::layout::model_preset(c.model));
    const auto train = dte::layout::parse_train_topology(c.train);
    const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology(c.infer));
    for (std::int64_t rank = 0; rank < train.world(); ++rank) {
      const dte::layout::TransferPlan plan(hf, train, rank);
      const dte::pipeline::RunTable table(plan, hf, &recv);
      for (BufferKind b : dte_test::kBuffers) {
        const std::int64_t shard = plan.shard_size(b);
        // Each element's receiver copies, from the runs.
        std::vector<std::uint64_t> copies(static_cast<std::size_t>(shard), 0);
        for (const dte::pipeline::Run& r : table.runs(b)) {
          for (std::int64_t o = r.shard_begin; o < r.shard_begin + r.length; ++o)
            copies[static_cast<std::size_t>(o)] = r.sender ? r.target_count : 0;
        }
        for (const std::uint64_t limit :
             {kSmallScratch, kSmallScratch * 4, std::uint64_t{256} << 20}) {
          INFO("rank " << rank << " buffer " << static_cast<int>(b) << " limit " << limit);
          const auto batches = dte::pipeline::route_batches(table.runs(b), shard, limit);
          if (shard == 0) {
            CHECK(batches.empty());
            continue;
          }
          std::int64_t at = 0;
          for (std::size_t k = 0; k < batches.size(); ++k) {
            const dte::pipeline::RouteBatch& batch = batches[k];
            CHECK(batch.begin == at);
            CHECK(batch.end > batch.begin);
            std::uint64_t entries = 0;
            for (std::int64_t o = batch.begin; o < batch.end; ++o)
              entries += copies[static_cast<std::size_t>(o)];
            CHECK(batch.max_entries == entries);
            const auto elements = static_cast<std::uint64_t>(batch.end - batch.begin);
            CHECK(dte::pipeline::route_scratch(elements, entries) <= limit);
            // Greedy: the next element would not have fit.
            if (k + 1 < batches.size()) {
              CHECK(dte::pipeline::route_scratch(
                        elements + 1, entries + copies[static_cast<std::size_t>(batch.end)]) >
                    limit);
            }
            at = batch.end;
          }
          CHECK(at == shard);
          if (limit == kSmallScratch && shard > 100000) CHECK(batches.size() > 1);
        }
      }
    }
  }
  // A limit that cannot hold one element of a run is refused, naming the knob.
  const std::vector<dte::pipeline::Run> runs = {{0, 10, 0, 0, 0, 0, 8, true}};
  CHECK_THROWS_WITH_AS(
      (void)dte::pipeline::route_batches(runs, 10, dte::pipeline::route_scratch(1, 8) - 1),
      doctest::Contains("with_scratch_limit"), dte::invalid_argument);
  CHECK(dte::pipeline::route_batches(runs, 10, dte::pipeline::route_scratch(1, 8)).size() == 10);
}

namespace {

// One receiver rank's tensors on the host, and apply_entries' two kernels: the check body over
// every entry, then (no entry refused) the write body.
struct HostTwinReceiver {
  std::vector<std::vector<std::uint16_t>> tensors;
  std::vector<std::uint16_t*> pointers;
  std::vector<std::uint64_t> live;
  dte::pipeline::ReceiverSourceTable table;
  std::vector<dte::Digest> digest;

  HostTwinReceiver(const dte::layout::HfModel& hf, const dte::layout::ServingLayout& recv,
                   std::int64_t rank)
      : table(hf, recv, rank), digest(static_cast<std::size_t>(hf.size()), 0) {
    const std::int64_t ts = rank % recv.topology().tp;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      tensors.emplace_back(static_cast<std::size_t>(recv[k].numel), std::uint16_t{0});
      live.push_back(static_cast<std::uint64_t>(recv.live_end(ts, k)));
    }
    for (auto& t : tensors)
      pointers.push_back(t.data());
  }

  // Returns the first refused entry (~0: none, and then every entry is written).
  unsigned long long apply(const std::uint32_t* tensor, const std::uint32_t* index,
                           const std::uint16_t* bits, std::uint64_t n, bool fresh) {
    const auto runs = table.runs();
    const auto n_sources = static_cast<std::uint32_t>(runs.size());
    unsigned long long first_bad = ~0ull;
    simt::host::each_thread(
        kBlocks, kThreads, n,
        dev::CheckEntries{tensor, index, static_cast<std::uint32_t>(pointers.size()), live.data(),
                          runs.data(), n_sources, &first_bad});
    if (first_bad != ~0ull) return first_bad;
    simt::host::each_thread(kBlocks, kThreads, n,
                            dev::WriteEntries{tensor, index, bits, pointers.data(), runs.data(),
                                              n_sources, fresh, digest.data()});
    return first_bad;
  }
};

}  // namespace

TEST_CASE(
    "device-on-host: check and write leave every receiver dense-equal; a bad entry is "
    "refused before anything is written") {
  for (const dte_test::Case& c : dte_test::kCases) {
    INFO(c.model << " train " << c.train << " infer " << c.infer);
    const dte::layout::HfModel hf(dte::layout::model_preset(c.model));
    const auto train = dte::layout::parse_train_topology(c.train);
    const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology(c.infer));
    dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 3, .lr = 3e-4});
    const dte::sim::AdamWAccess access{&trainer};
    const auto receivers = static_cast<std::size_t>(recv.topology().ranks());
    std::vector<HostTwinSender> senders;
    for (std::int64_t r = 0; r < train.world(); ++r)
      senders.emplace_back(hf, train, recv, r, kSmallScratch);  // (in batches)
    std::vector<HostTwinReceiver> rx;
    for (std::size_t d = 0; d < receivers; ++d)
      rx.emplace_back(hf, recv, static_cast<std::int64_t>(d));
    for (int publication = 0; publication < 4; ++publication) {
      INFO("publication " << publication);
      const bool full = publication == 0;
      if (!full) trainer.step();
      for (HostTwinSender& s : senders) {
        StageResult counts;
        counts.digest.assign(static_cast<std::size_t>(hf.size()), 0);
        for (const HostBuckets& k :
             s.scan(access, full ? ScanMode::all : ScanMode::detect, counts)) {
          for (std::size_t d = 0; d < k.count.size(); ++d) {
            const std::uint64_t at = k.offset[d];
            CHECK(rx[d].apply(k.tensor.data() + at, k.index.data() + at, k.bits.data() + at,
                              k.count[d], full) == ~0ull);
          }
        }
      }
      const std::vector<float> canonical = trainer.canonical_weights();
      for (std::size_t d = 0; d < receivers; ++d) {
        INFO("receiver " << d);
        std::vector<dte::Digest> want;
        CHECK(dte_test::mismatches(hf, recv, static_cast<std::int64_t>(d), rx[d].tensors, canonical,
                                   want) == 0);
        CHECK(rx[d].digest == want);
      }
    }
    // Entry 1 writes beyond the live elements of tensor 0: refused, nothing written.
    const auto before = rx[0].tensors;
    const std::vector<std::uint32_t> t = {0, 0, 0};
    const std::vector<std::uint32_t> i = {0, static_cast<std::uint32_t>(rx[0].live[0]), 1};
    const std::vector<std::uint16_t> b = {0x1234, 0x1234, 0x1234};
    CHECK(rx[0].apply(t.data(), i.data(), b.data(), 3, false) == 1);
    CHECK(rx[0].tensors == before);
  }
}

TEST_CASE("device-on-host: a publication's batches are the compacted offsets, whatever the batch") {
  const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3-moe"));
  const auto train = dte::layout::parse_train_topology("tp=2,ep=2,dp=2");
  const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology("tp=2"));
  dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 5, .lr = 3e-4});
  const dte::sim::AdamWAccess access{&trainer};
  trainer.step();
  const std::int64_t rank = 1;
  HostTwinSender twin(hf, train, recv, rank);
  for (BufferKind b : dte_test::kBuffers) {
    const std::int64_t shard = twin.plan().shard_size(b);
    if (shard == 0) continue;
    INFO("buffer " << static_cast<int>(b));
    std::vector<dte::Digest> digest(static_cast<std::size_t>(hf.size()), 0);
    std::vector<unsigned long long> per_receiver(static_cast<std::size_t>(recv.topology().ranks()));
    const dev::DetectTotals t = twin.detect(access, b, ScanMode::detect, digest, per_receiver);
    REQUIRE(t.flagged > 0);
    const std::vector<std::int64_t> all =
        simt::host::select_flagged(shard, dev::detail::BitOf{twin.send(b).data()});
    REQUIRE(all.size() == t.flagged);
    const auto theta = access.theta(rank, b);
    const auto items = twin.work(b).items();
    for (const std::int64_t batch : {std::int64_t{1000}, std::int64_t{4096}, shard}) {
      INFO("batch " << batch);
      const auto capacity = static_cast<std::size_t>(std::min<std::int64_t>(batch, shard));
      std::vector<std::uint16_t> bits(capacity);
      std::vector<dte::PreviousBits> previous(capacity);
      std::vector<std::int64_t> seen;
      for (std::int64_t begin = 0; begin < shard; begin += batch) {
        const std::int64_t n = std::min(batch, shard - begin);
        const std::vector<std::uint32_t> offset = simt::host::select_flagged(
            static_cast<std::uint32_t>(n), dev::detail::BitFrom{twin.send(b).data(), begin});
        const unsigned long long count = offset.size();
        simt::host::each_thread(
            kBlocks, kThreads, capacity,
            dev::GatherChanged<Detect, Kernel>{offset.data(), &count, begin, items.data(),
                                               static_cast<std::uint32_t>(items.size()),
                                               twin.kernels(b).data(), twin.weights(b).data(),
                                               bits.data(), previous.data()});
        for (std::size_t k = 0; k < offset.size(); ++k) {
          const std::int64_t o = begin + offset[k];
          seen.push_back(o);
          CHECK(bits[k] == Detect::store(theta[static_cast<std::size_t>(o)]));
          // The previous bits of the element's own segment kernel, bound on the host.
          for (const dte::layout::PlanSegment& s : twin.plan().segments(b)) {
            if (o < s.shard_begin || o >= s.shard_begin + s.length) continue;
            const Kernel k1 = Inverse::bind(access.hyperparameters(rank, b, s),
                                            theta.subspan(static_cast<std::size_t>(s.shard_begin),
                                                          static_cast<std::size_t>(s.length)),
                                            access.state(rank, b, s));
            const dte::PreviousBits want =
                Detect::previous(k1(static_cast<std::size_t>(o - s.shard_begin)));
            CHECK(std::memcmp(&previous[k], &want, sizeof want) == 0);
          }
        }
      }
      CHECK(seen == all);
    }
  }
}

TEST_CASE("device-on-host: classify and audit == the host's rules and audit_reconstruction") {
  const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3"));
  const auto train = dte::layout::parse_train_topology("tp=2,dp=2");
  dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 11, .lr = 3e-4});
  const dte::sim::AdamWAccess access{&trainer};
  const std::int64_t rank = 0;
  const std::vector<float> before(access.theta(rank, BufferKind::dense).begin(),
                                  access.theta(rank, BufferKind::dense).end());
  trainer.step();
  const dte::layout::TransferPlan plan(hf, train, rank);
  std::uint64_t changed = 0;
  for (const dte::layout::PlanSegment& s : plan.segments(BufferKind::dense)) {
    const auto w = dte::pipeline::segment_weights(access, rank, BufferKind::dense, s, "segment");
    const Kernel k = Inverse::bind(access.hyperparameters(rank, BufferKind::dense, s), w,
                                   access.state(rank, BufferKind::dense, s));
    const std::span<const float> prev(before.data() + s.shard_begin,
                                      static_cast<std::size_t>(s.length));
    std::vector<dte::Verdict> got(k.size());
    simt::host::each_thread(kBlocks, kThreads, k.size(),
                            dte::cuda::detail::ClassifyElements<Detect, Kernel>{k, got.data()});
    for (std::size_t i = 0; i < k.size(); ++i)
      REQUIRE(got[i] == Detect::classify(k.current(i), k(i)));
    using Audit = dte::cuda::detail::AuditElements<Detect, Kernel>;
    dte::cuda::detail::AuditTally total = Audit::identity();
    simt::host::each_reduce(kBlocks, kThreads, k.size(), Audit{k, prev.data(), &total});
    const dte::AuditCounts a = dte::cuda::detail::audit_counts(total, k.size());
    const dte::AuditCounts want = dte::audit_reconstruction<Detect>(k, prev);
    CHECK(a.elements == want.elements);
    CHECK(a.true_changed == want.true_changed);
    CHECK(a.detected == want.detected);
    CHECK(a.missed == want.missed);
    CHECK(a.guard_extra == want.guard_extra);
    CHECK(a.first_missed == want.first_missed);
    CHECK(a.bound_violations == want.bound_violations);
    CHECK(a.first_violation == want.first_violation);
    CHECK(a.worst_bound_ratio == want.worst_bound_ratio);
    changed += a.true_changed;
  }
  CHECK(changed > 0);
}
