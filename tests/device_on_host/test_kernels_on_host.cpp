// SPDX-License-Identifier: Apache-2.0
// The device pipeline (pipeline/device_stages.hpp: SenderPipeline, DeviceReceiver, apply_entries)
// on the host twin (dte/sim/simt_host.hpp), against the host frame (ctest -L device-on-host; no
// GPU, no CUDA runtime). The stages, their batches, counts, copies and checks are the code a GPU
// runs, and the kernel bodies (pipeline/device_kernels.hpp, exec/element_kernels.hpp) are what
// exec/simt.cuh launches there; only the launches and CUB's algorithms are the host twin's. So a
// stage or a body that gives other send sets, digests, counts or entries than the host frame
// fails here, in CI:
//   - stages 1-4 (detect, compact, route, bucket) over the golden cases of test_cuda_pipeline
//     (every trainer rank, every mode: a full publication, K = 1 deltas, a K = 2 window), entry
//     for entry and in order per receiver, in one batch and in many; the scratch the routing
//     allocates stays within the executor's limit;
//   - the receiver's check and write: after a full publication and deltas every live receiver
//     element equals the BF16 rounding of the trainer's weight, the digest equals the tensors';
//     a bad entry is refused before anything is written;
//   - a publication's batches (gather) do not depend on their size, and carry the element's bits
//     and the previous bits its own segment's kernel gives;
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
#include "dte/pipeline/device_stages.hpp"
#include "dte/pipeline/route_batches.hpp"
#include "dte/pipeline/segment_weights.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/simt_host.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "stage_reference.hpp"

namespace {

namespace dev = dte::pipeline::device;
namespace simt = dte::simt;
using dte::layout::BufferKind;
using dte::pipeline::ScanMode;
using dte::sim::SimtHost;
using dte_test::StageResult;

constexpr unsigned kBlocks = 3;
// A scratch limit that routes the golden shards in many batches.
constexpr std::uint64_t kSmallScratch = dte::pipeline::route_bytes_per_batch + (1u << 16);
// What detect holds besides the routing while a scan runs, at most, on these tiny models: the
// bound kernels, the weights table and the counts (a few KiB).
constexpr std::uint64_t kDetectBytes = 1u << 16;
constexpr auto kThreads = static_cast<unsigned>(dev::block_threads);

using Inverse = dte::AdamWInverse;
using Detect = dte::BF16Detect;
using Kernel = Inverse::kernel;
using Pipeline = dev::SenderPipeline<Inverse, Detect, dte::layout::TransferPlan, SimtHost>;

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
        const SimtHost e(kBlocks, limit);
        Pipeline twin(hf, train, recv, rank, true, e);
        // The routing's scratch: as the stages count it, and as the twin's arrays hold it.
        const auto scan = [&](ScanMode mode) {
          const std::uint64_t held = e.stats().held;
          e.reset_peak();
          StageResult r = dte_test::device_scan(twin, access, mode, tensors, receivers);
          // Left behind: only what detect keeps bound for the next stages.
          CHECK(e.stats().held <= held + kDetectBytes);
          if (mode != ScanMode::mark) {
            CHECK(e.stats().peak - held <= limit + kDetectBytes);
            for (BufferKind b : dte_test::kBuffers) {
              CHECK(twin.routed(b).peak_scratch <= limit);
              batches += twin.routed(b).batches;
            }
          }
          return r;
        };
        dte_test::check_same(dte_test::host_stages(host, access, ScanMode::all, tensors, receivers),
                             scan(ScanMode::all));
        // Each step moves the trainer; the host frame and the twin both see it.
        for (const ScanMode mode : {ScanMode::detect, ScanMode::mark, ScanMode::mask}) {
          trainer.step();
          INFO("mode " << static_cast<int>(mode));
          const StageResult h = dte_test::host_stages(host, access, mode, tensors, receivers);
          const StageResult d = scan(mode);
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

// One receiver rank's tensors in the twin's memory, and its DeviceReceiver.
struct TwinReceiver {
  std::vector<dev::Array<SimtHost, std::uint16_t>> tensors;
  std::vector<std::uint64_t> live;
  dev::DeviceReceiver<SimtHost> rx;

  TwinReceiver(const SimtHost& e, const dte::layout::HfModel& hf,
               const dte::layout::ServingLayout& recv, std::int64_t rank) {
    const std::int64_t ts = rank % recv.topology().tp;
    std::vector<std::uint16_t*> pointers;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      tensors.push_back(
          dev::Array<SimtHost, std::uint16_t>::zeros(e, static_cast<std::size_t>(recv[k].numel)));
      pointers.push_back(tensors.back().data());
      live.push_back(static_cast<std::uint64_t>(recv.live_end(ts, k)));
    }
    rx = dev::DeviceReceiver<SimtHost>(e, pointers, live,
                                       dte::pipeline::ReceiverSourceTable(hf, recv, rank),
                                       static_cast<std::size_t>(hf.size()));
  }
  [[nodiscard]] std::vector<std::vector<std::uint16_t>> download() const {
    std::vector<std::vector<std::uint16_t>> out;
    for (const auto& t : tensors)
      out.push_back(t.to_host());
    return out;
  }
  // The entries copied to the twin's memory, then apply_entries.
  void apply(const SimtHost& e, std::span<const std::uint32_t> tensor,
             std::span<const std::uint32_t> index, std::span<const std::uint16_t> bits,
             bool fresh) {
    const auto t = dev::Array<SimtHost, std::uint32_t>::copy_of(e, tensor);
    const auto i = dev::Array<SimtHost, std::uint32_t>::copy_of(e, index);
    const auto b = dev::Array<SimtHost, std::uint16_t>::copy_of(e, bits);
    dev::apply_entries(e, rx, t.data(), i.data(), b.data(), tensor.size(), fresh);
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
    const SimtHost e(kBlocks, kSmallScratch);  // (in batches)
    std::vector<Pipeline> senders;
    senders.reserve(static_cast<std::size_t>(train.world()));
    for (std::int64_t r = 0; r < train.world(); ++r)
      senders.emplace_back(hf, train, recv, r, false, e);
    std::vector<TwinReceiver> rx;
    for (std::size_t d = 0; d < receivers; ++d)
      rx.emplace_back(e, hf, recv, static_cast<std::int64_t>(d));
    for (int publication = 0; publication < 4; ++publication) {
      INFO("publication " << publication);
      const bool full = publication == 0;
      if (!full) trainer.step();
      for (Pipeline& s : senders) {
        (void)s.scan(access, full ? ScanMode::all : ScanMode::detect,
                     [&](BufferKind, const dev::BucketBatch& k) {
                       for (std::size_t d = 0; d < receivers; ++d) {
                         if (k.count[d] == 0) continue;
                         const std::size_t at = k.offset[d], n = k.count[d];
                         rx[d].apply(e, k.tensor.subspan(at, n), k.index.subspan(at, n),
                                     k.bits.subspan(at, n), full);
                       }
                     });
      }
      const std::vector<float> canonical = trainer.canonical_weights();
      for (std::size_t d = 0; d < receivers; ++d) {
        INFO("receiver " << d);
        std::vector<dte::Digest> want;
        CHECK(dte_test::mismatches(hf, recv, static_cast<std::int64_t>(d), rx[d].download(),
                                   canonical, want) == 0);
        CHECK(rx[d].rx.digest.to_host() == want);
      }
    }
    // Entry 1 writes beyond the live elements of tensor 0: refused, nothing written.
    const auto before = rx[0].download();
    const std::vector<std::uint32_t> t = {0, 0, 0};
    const std::vector<std::uint32_t> i = {0, static_cast<std::uint32_t>(rx[0].live[0]), 1};
    const std::vector<std::uint16_t> b = {0x1234, 0x1234, 0x1234};
    CHECK_THROWS_WITH_AS(rx[0].apply(e, t, i, b, false), doctest::Contains("entry 1 writes"),
                         dte::protocol_error);
    CHECK(rx[0].download() == before);
  }
}

TEST_CASE("device-on-host: a publication's batches do not depend on their size") {
  const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3-moe"));
  const auto train = dte::layout::parse_train_topology("tp=2,ep=2,dp=2");
  const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology("tp=2"));
  dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 5, .lr = 3e-4});
  const dte::sim::AdamWAccess access{&trainer};
  trainer.step();
  const std::int64_t rank = 1;
  Pipeline twin(hf, train, recv, rank, false, SimtHost(kBlocks));
  const auto found = twin.detect(access, ScanMode::detect);
  for (BufferKind b : dte_test::kBuffers) {
    const std::int64_t shard = twin.plan().shard_size(b);
    if (shard == 0) continue;
    INFO("buffer " << static_cast<int>(b));
    const std::uint64_t flagged = found[static_cast<std::size_t>(b)].flagged;
    REQUIRE(flagged > 0);
    const auto theta = access.theta(rank, b);
    std::vector<std::int64_t> whole;
    for (const std::int64_t batch : {shard, std::int64_t{4096}, std::int64_t{1000}}) {
      INFO("batch " << batch);
      std::vector<std::int64_t> seen;
      twin.gather(
          b, flagged, true, batch,
          [&](std::int64_t begin, std::span<const std::uint32_t> offset,
              std::span<const std::uint16_t> bits, std::span<const dte::PreviousBits> previous) {
            REQUIRE(previous.size() == offset.size());
            for (std::size_t k = 0; k < offset.size(); ++k) {
              CHECK(offset[k] < batch);
              const std::int64_t o = begin + offset[k];
              seen.push_back(o);
              CHECK(bits[k] == Detect::store(theta[static_cast<std::size_t>(o)]));
              // The previous bits of the element's own segment kernel, bound on the host.
              for (const dte::layout::PlanSegment& s : twin.plan().segments(b)) {
                if (o < s.shard_begin || o >= s.shard_begin + s.length) continue;
                const Kernel k1 =
                    Inverse::bind(access.hyperparameters(rank, b, s),
                                  theta.subspan(static_cast<std::size_t>(s.shard_begin),
                                                static_cast<std::size_t>(s.length)),
                                  access.state(rank, b, s));
                const dte::PreviousBits want =
                    Detect::previous(k1(static_cast<std::size_t>(o - s.shard_begin)));
                CHECK(std::memcmp(&previous[k], &want, sizeof want) == 0);
              }
            }
          });
      CHECK(seen.size() == flagged);
      CHECK(std::is_sorted(seen.begin(), seen.end()));
      if (whole.empty()) {
        whole = seen;
      } else {
        CHECK(seen == whole);
      }
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
