// SPDX-License-Identifier: Apache-2.0
// The pipeline on the CUDA executor against the host pipeline, bit for bit: the same trainer
// state through pipeline/device.cuh (detect, compact, route, bucket) and through SenderFrame's
// host stages must give the same send sets, digests, counts and per-receiver entries in the same
// order; every mode (detect, mark + mask for K > 1, all), a refused element, a shard above 2^31
// elements, and the receiver's device apply (the golden invariant: after a full publication
// and deltas, every live receiver element equals the BF16 rounding of the trainer's weight, and
// the digest equals the tensors' digest); and DeltaEngine on both backends, down to the bytes of
// every message a trainer rank sends. Runs only on a GPU (exit 77 otherwise).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "../device_on_host/engine_world.hpp"
#include "../device_on_host/stage_reference.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/device_receiver.cuh"
#include "dte/engine/device_sender.cuh"
#include "dte/engine/engine.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/wire.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/exec/host.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/snapshot.hpp"
#include "dte/pipeline/device.cuh"
#include "dte/pipeline/frame.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"
#include "engine_backend.cuh"

namespace {

constexpr int kSkipCode = 77;

using dte::exec::DeviceArray;
using dte::layout::BufferKind;
using dte::pipeline::ScanMode;
namespace dev = dte::pipeline::device;

using dte_test::kBuffers;

using DeviceTrainer = dte::sim::DeviceAdamWAccess;

using dte_test::Case;
using dte_test::check_same;
using dte_test::device_scan;
using dte_test::Entry;
using dte_test::host_stages;
using dte_test::HostSender;
using dte_test::kCases;
using dte_test::mismatches;
using dte_test::StageResult;

using Stream = dte::exec::Stream;

template <class T>
__global__ void fill(T* p, std::size_t n, T value) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

}  // namespace

TEST_CASE("device stages == host stages, every mode, every rank, pooled and plain memory") {
  // plain: cudaMalloc/cudaFree, the executor's fallback on a device without memory pools.
  // batched: a scratch limit that routes each shard in many batches (pipeline/route_batches.hpp);
  // the entries must arrive the same, and the scratch held must stay within the limit.
  const std::uint64_t small = dte::pipeline::route_bytes_per_batch + (1u << 16);
  for (const bool plain : {false, true})
    for (const std::uint64_t limit : {dte::exec::default_scratch_limit, small})
      for (const Case& c : kCases) {
        INFO(c.model << " train " << c.train << " infer " << c.infer << (plain ? " plain" : " pool")
                     << " scratch limit " << limit);
        const dte::layout::HfModel hf(dte::layout::model_preset(c.model));
        const auto train = dte::layout::parse_train_topology(c.train);
        const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology(c.infer));
        dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 7, .lr = 3e-4});
        const dte::sim::AdamWAccess host_access{&trainer};
        const auto tensors = static_cast<std::size_t>(hf.size());
        const auto receivers = static_cast<std::size_t>(recv.topology().ranks());
        Stream stream;
        const auto e = dte::exec::Cuda(stream, plain ? dte::exec::CudaAllocator::plain()
                                                     : dte::exec::CudaAllocator{})
                           .with_scratch_limit(limit);
        std::size_t batches = 0;
        for (std::int64_t rank = 0; rank < train.world(); ++rank) {
          INFO("trainer rank " << rank);
          HostSender host(hf, train, &recv, rank, true, dte::exec::Host(1));
          dev::SenderPipeline<dte::AdamWInverse, dte::BF16Detect, dte::layout::TransferPlan,
                              dte::exec::Cuda>
              device(hf, train, recv, rank, true, e);
          DeviceTrainer dt(trainer, rank, e);
          auto check_scratch = [&] {
            for (const BufferKind b : kBuffers) {
              CHECK(device.routed(b).peak_scratch <= limit);
              batches += device.routed(b).batches;
            }
          };
          // A full publication, then K = 1 deltas, then a K = 2 window (mark, then mask).
          check_same(host_stages(host, host_access, ScanMode::all, tensors, receivers),
                     device_scan(device, dt, ScanMode::all, tensors, receivers));
          check_scratch();
          for (const ScanMode mode : {ScanMode::detect, ScanMode::mark, ScanMode::mask}) {
            trainer.step();
            dt.upload();
            INFO("mode " << static_cast<int>(mode));
            const StageResult h = host_stages(host, host_access, mode, tensors, receivers);
            const StageResult d = device_scan(device, dt, mode, tensors, receivers);
            check_same(h, d);
            if (mode != ScanMode::mark) check_scratch();
            if (mode == ScanMode::detect) CHECK(h.flagged > 0);  // the case exercises changes
          }
        }
        if (limit == small) CHECK(batches > static_cast<std::size_t>(4 * train.world()));
      }
}

TEST_CASE("a refused element is refused on the device too, naming the host's segment") {
  const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3"));
  const auto train = dte::layout::parse_train_topology("tp=2,dp=2");
  const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology("tp=2"));
  dte::sim::SyntheticTrainer trainer(hf, train, {.lr = 3e-4});
  trainer.step();
  const std::int64_t rank = 1;
  auto v = trainer.exp_avg_sq(rank, BufferKind::dense);
  v[v.size() / 2] = -1.0f;  // a negative second moment
  HostSender host(hf, train, &recv, rank, false, dte::exec::Host(1));
  const dte::sim::AdamWAccess host_access{&trainer};
  host.bind(host_access, BufferKind::dense);
  HostSender::Tile tile;
  std::int32_t host_segment = -1;
  for (std::size_t t = 0; t < host.tiles(BufferKind::dense) && host_segment < 0; ++t) {
    if (!host.detect_tile(host_access.theta(rank, BufferKind::dense), BufferKind::dense, t,
                          ScanMode::detect, tile)) {
      host_segment = tile.invalid_segment;
    }
  }
  REQUIRE(host_segment >= 0);
  const auto& seg = host.plan().segments(BufferKind::dense)[static_cast<std::size_t>(host_segment)];
  const std::string name(host.plan().params()[static_cast<std::size_t>(seg.param)].name());

  Stream stream;
  const dte::exec::Cuda e(stream);
  dev::SenderPipeline<dte::AdamWInverse, dte::BF16Detect, dte::layout::TransferPlan,
                      dte::exec::Cuda>
      device(hf, train, recv, rank, false, e);
  DeviceTrainer dt(trainer, rank, e);
  try {
    (void)device.scan(dt, ScanMode::detect, [](BufferKind, const dev::BucketBatch&) {});
    FAIL("the device scan accepted a negative second moment");
  } catch (const dte::invalid_argument& err) {
    CHECK(std::string(err.what()).find(name) != std::string::npos);
  }
}

TEST_CASE(
    "more than 2^31 elements: 64-bit offsets through detect, compact, route and bucket, in "
    "batches") {
  const std::int64_t n = (std::int64_t{1} << 31) + 4099;
  std::size_t free_bytes = 0, total_bytes = 0;
  DTE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < static_cast<std::size_t>(n) * 8) {
    MESSAGE("skipped: needs " << n * 8 / (1 << 30) << " GiB of free device memory");
    return;
  }
  Stream stream;
  const dte::exec::Cuda e(stream);
  using Kernel = dte::detail::SnapshotKernel<dte::Bf16Format>;
  DeviceArray<float> theta(e, static_cast<std::size_t>(n));
  DeviceArray<std::uint16_t> published(e, static_cast<std::size_t>(n));
  const std::uint16_t one = dte::BF16Detect::store(1.0f);
  fill<<<1024, 256, 0, stream>>>(theta.data(), static_cast<std::size_t>(n), 1.0f);
  fill<<<1024, 256, 0, stream>>>(published.data(), static_cast<std::size_t>(n), one);
  const std::vector<std::int64_t> changed = {0,
                                             4095,
                                             4096,
                                             (std::int64_t{1} << 31) - 1,
                                             std::int64_t{1} << 31,
                                             (std::int64_t{1} << 31) + 1,
                                             n - 1};
  const float two = 2.0f;
  for (std::int64_t o : changed) {
    DTE_CUDA_TRY(cudaMemcpyAsync(theta.data() + o, &two, 4, cudaMemcpyHostToDevice, stream));
  }
  // One segment, one run, one receiver copy at index 0 of receiver tensor 3 on receiver 1.
  const std::vector<dte::layout::PlanSegment> segs = {{0, n, 0, 0, true}};
  const std::vector<dte::pipeline::Run> runs = {{0, n, 0, 0, 0, 0, 1, true}};
  const std::vector<dte::pipeline::RunTarget> targets = {{1, 3, 0}};
  const dte::pipeline::WorkTable work(runs, segs, dev::item_elements);
  const dev::DeviceTables tables(e, work, runs, targets, n);
  const auto weights = dev::buffer_weights(e, theta.data(), segs);
  const Kernel host_kernel{theta.data(), published.data(), static_cast<std::size_t>(n)};
  const auto kernels = DeviceArray<Kernel>::copy_of(e, std::span<const Kernel>(&host_kernel, 1));
  DeviceArray<std::uint64_t> send(e, static_cast<std::size_t>((n + 63) / 64));
  const dev::DetectResult d = dev::detect<dte::BF16Detect>(
      e, tables, kernels.data(), weights.data(), ScanMode::detect, nullptr, send.data(), 1, 2);
  CHECK(d.invalid_segment == -1);
  CHECK(d.flagged == changed.size());
  CHECK(d.entries == changed.size());
  CHECK(d.scanned == static_cast<std::uint64_t>(n));
  CHECK(d.per_receiver == std::vector<std::uint64_t>{0, changed.size()});
  dte::Digest want = 0;
  const std::uint16_t two_bits = dte::BF16Detect::store(2.0f);
  for (std::int64_t i = 0; i < n; ++i)
    want += dte::element_digest(i, one);
  for (std::int64_t o : changed)
    want += dte::element_digest(o, two_bits) - dte::element_digest(o, one);
  CHECK(d.digest[0] == want);
  // Routed in several batches (a 64 MiB scratch limit: each holds ~1.0 M elements), then whole.
  for (const std::uint64_t limit : {std::uint64_t{64} << 20, std::uint64_t{1} << 40}) {
    INFO("scratch limit " << limit);
    const auto batches = dte::pipeline::route_batches(runs, n, limit);
    const std::uint64_t per_batch =  // (elements of one receiver copy each that fit the limit)
        (limit - dte::pipeline::route_bytes_per_batch) /
        (dte::pipeline::route_bytes_per_element + dte::pipeline::route_bytes_per_entry);
    CHECK(batches.size() == (static_cast<std::uint64_t>(n) + per_batch - 1) / per_batch);
    std::vector<std::uint64_t> offset, count;
    std::vector<std::uint32_t> tensor, index;
    std::vector<std::uint16_t> bits;
    dte::exec::PinnedBuffer staging;
    const dev::RouteTotals routed = dev::route_and_bucket<dte::BF16Detect>(
        e, tables, weights.data(), send.data(), d, batches, staging,
        [&](const dev::BucketBatch& k) {
          CHECK(k.offset[0] == 0);
          CHECK(k.count[0] == 0);
          CHECK(k.offset[1] == 0);
          tensor.insert(tensor.end(), k.tensor.begin(), k.tensor.end());
          index.insert(index.end(), k.index.begin(), k.index.end());
          bits.insert(bits.end(), k.bits.begin(), k.bits.end());
        });
    CHECK(routed.entries == changed.size());
    CHECK(routed.peak_scratch <= limit);
    REQUIRE(index.size() == changed.size());
    for (std::size_t k = 0; k < changed.size(); ++k) {
      CHECK(index[k] == static_cast<std::uint32_t>(changed[k]));
      CHECK(tensor[k] == 3u);
      CHECK(bits[k] == two_bits);
    }
  }
}

namespace {

// One receiver rank's tensors in device memory, with the host-side reference checks.
struct DeviceReceiverTensors {
  std::vector<DeviceArray<std::uint16_t>> tensors;
  std::vector<std::uint16_t*> pointers;
  std::vector<std::uint64_t> live;

  DeviceReceiverTensors(const dte::exec::Cuda& e, const dte::layout::ServingLayout& recv,
                        std::int64_t rank) {
    const std::int64_t ts = rank % recv.topology().tp;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      tensors.push_back(
          DeviceArray<std::uint16_t>::zeros(e, static_cast<std::size_t>(recv[k].numel)));
      pointers.push_back(tensors.back().data());
      live.push_back(static_cast<std::uint64_t>(recv.live_end(ts, k)));
    }
  }
  std::vector<std::vector<std::uint16_t>> download() const {
    std::vector<std::vector<std::uint16_t>> out;
    for (const auto& t : tensors)
      out.push_back(t.to_host());
    return out;
  }
};

}  // namespace

TEST_CASE("device apply: a full publication then deltas leave every receiver dense-equal") {
  for (const Case& c : kCases) {
    INFO(c.model << " train " << c.train << " infer " << c.infer);
    const dte::layout::HfModel hf(dte::layout::model_preset(c.model));
    const auto train = dte::layout::parse_train_topology(c.train);
    const dte::layout::ServingLayout recv(hf, dte::layout::parse_infer_topology(c.infer));
    dte::sim::SyntheticTrainer trainer(hf, train, {.seed = 3, .lr = 3e-4});
    const auto tensors = static_cast<std::size_t>(hf.size());
    const auto receivers = static_cast<std::size_t>(recv.topology().ranks());
    Stream stream;
    const dte::exec::Cuda e(stream);
    std::vector<dev::SenderPipeline<dte::AdamWInverse, dte::BF16Detect, dte::layout::TransferPlan,
                                    dte::exec::Cuda>>
        senders;
    std::vector<DeviceTrainer> access;
    senders.reserve(static_cast<std::size_t>(train.world()));
    access.reserve(static_cast<std::size_t>(train.world()));
    for (std::int64_t r = 0; r < train.world(); ++r) {
      senders.emplace_back(hf, train, recv, r, false, e);
      access.emplace_back(trainer, r, e);
    }
    std::vector<DeviceReceiverTensors> held;
    std::vector<dev::DeviceReceiver<dte::exec::Cuda>> rx;
    for (std::size_t d = 0; d < receivers; ++d) {
      held.emplace_back(e, recv, static_cast<std::int64_t>(d));
      rx.emplace_back(e, held.back().pointers, held.back().live,
                      dte::pipeline::ReceiverSourceTable(hf, recv, static_cast<std::int64_t>(d)),
                      tensors);
    }
    for (int publication = 0; publication < 4; ++publication) {
      INFO("publication " << publication);
      const bool full = publication == 0;
      if (!full) {
        trainer.step();
        for (DeviceTrainer& a : access)
          a.upload();
      }
      for (std::size_t s = 0; s < senders.size(); ++s) {
        // (each batch's bucket uploaded to the receiver's device and applied there)
        (void)senders[s].scan(
            access[s], full ? ScanMode::all : ScanMode::detect,
            [&](BufferKind, const dev::BucketBatch& k) {
              for (std::size_t d = 0; d < receivers; ++d) {
                if (k.count[d] == 0) continue;
                const std::size_t at = k.offset[d], n = k.count[d];
                const auto tensor = DeviceArray<std::uint32_t>::copy_of(e, k.tensor.subspan(at, n));
                const auto index = DeviceArray<std::uint32_t>::copy_of(e, k.index.subspan(at, n));
                const auto bits = DeviceArray<std::uint16_t>::copy_of(e, k.bits.subspan(at, n));
                dev::apply_entries(e, rx[d], tensor.data(), index.data(), bits.data(), n, full);
              }
            });
      }
      const std::vector<float> canonical = trainer.canonical_weights();
      for (std::size_t d = 0; d < receivers; ++d) {
        INFO("receiver " << d);
        std::vector<dte::Digest> want;
        CHECK(mismatches(hf, recv, static_cast<std::int64_t>(d), held[d].download(), canonical,
                         want) == 0);
        CHECK(rx[d].digest.to_host() == want);
      }
    }
    // A bad entry (beyond the live elements of tensor 0) is refused before anything is written.
    const auto before = held[0].download();
    const std::vector<std::uint32_t> t = {0, 0};
    const std::vector<std::uint32_t> i = {0, static_cast<std::uint32_t>(held[0].live[0])};
    const std::vector<std::uint16_t> b = {0x1234, 0x1234};
    const auto dt = DeviceArray<std::uint32_t>::copy_of(e, t);
    const auto di = DeviceArray<std::uint32_t>::copy_of(e, i);
    const auto db = DeviceArray<std::uint16_t>::copy_of(e, b);
    CHECK_THROWS_AS(dev::apply_entries(e, rx[0], dt.data(), di.data(), db.data(), 2, false),
                    dte::protocol_error);
    CHECK(held[0].download() == before);
  }
}

TEST_CASE("DeltaEngine on exec::Cuda (device state, device receivers) == the host engine") {
  // The differential of tests/device_on_host/engine_world.hpp (the host twin runs it in CI):
  // every report's counts and digest, and every message each trainer rank sends each receiver,
  // byte for byte, the device receivers dense-equal and verified. Over the golden pairs and an
  // MoE trainer with data parallelism, K = 1 and 3, in one routing batch and in many.
  using namespace dte;
  const std::uint64_t small = pipeline::route_bytes_per_batch + (1u << 16);
  std::vector<dte_test::Pair> pairs(std::begin(dte_test::kGoldenPairs),
                                    std::end(dte_test::kGoldenPairs));
  pairs.push_back({"tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,replicas=2"});
  for (const dte_test::Pair& p : pairs) {
    for (const std::int64_t K : {1, 3}) {
      for (const std::uint64_t scratch : {exec::default_scratch_limit, small})
        dte_test::same_publications<dte_test::CudaBackend>(p, K, scratch);
    }
  }
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipped (exit %d)\n", kSkipCode);
    return kSkipCode;
  }
  return context.run();
}
