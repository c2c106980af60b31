// SPDX-License-Identifier: Apache-2.0
// NcclTwoRound with one thread per rank, one device per rank (NCCL refuses two ranks of one
// communicator on one device): the transport suite (tests/transport/transport_suite.hpp: counts
// with zeros, chunked payloads of several spans, sums that wrap mod 2^64, checkpoints), the whole
// composition
// DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound> verified after every
// publication, and a peer that never arrives: every other rank gets an error naming the phase
// within the deadline, never a hang, and the aborted transport refuses later calls.
// Needs two GPUs; exits 77 (skipped) with fewer.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../transport/transport_suite.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/sim/threads.hpp"
#include "dte/transport/nccl.cuh"

namespace {

constexpr int kSkipCode = 77;

struct World {
  int senders, receivers;
  [[nodiscard]] int size() const { return senders + receivers; }
};

World world_for_devices() {
  const int n = std::min(dte::cuda::device_count(), 4);
  return {n / 2, n - n / 2};
}

// Runs f(rank) on one thread per rank, each on its own device; rethrows the lowest rank's failure.
void on_every_rank(const World& w, const std::function<void(int)>& f) {
  dte::sim::run_ranks(static_cast<std::size_t>(w.size()), [&](std::size_t r) {
    DTE_CUDA_TRY(cudaSetDevice(static_cast<int>(r)));
    f(static_cast<int>(r));
  });
}

}  // namespace

TEST_CASE("transport conformance: NcclTwoRound (the transport suite)") {
  namespace suite = dte::transport_suite;
  const World w = world_for_devices();
  const ncclUniqueId id = dte::NcclTwoRound::unique_id();
  std::vector<suite::Results> results(static_cast<std::size_t>(w.size()));
  on_every_rank(w, [&](int rank) {
    dte::NcclTwoRoundConfig cfg;
    cfg.deadline = std::chrono::seconds(60);
    cfg.chunk_bytes = 1024;  // the larger payloads go as several chunks
    dte::NcclTwoRound t(id, rank, w.senders, w.receivers, cfg);
    results[static_cast<std::size_t>(rank)] =
        suite::run_rank(t, rank, w.senders, w.receivers, {.chunk = cfg.chunk_bytes});
  });
  for (const suite::Results& r : results) {
    for (const std::string& f : r.failures)
      FAIL_CHECK(f);
    CHECK(r.exchanges == suite::kRounds);
  }
}

// Both placements of the same composition: the default (exec::Cuda: device-resident trainer
// state and receiver tensors) and the host executor (host state, NCCL only for the bytes).
template <bool OnDevice>
void engine_over_nccl() {
  const World w = world_for_devices();
  const ncclUniqueId id = dte::NcclTwoRound::unique_id();
  using namespace dte;
  const layout::HfModel model(layout::model_preset("tiny-qwen3"));
  const layout::TrainTopology train =
      layout::parse_train_topology("tp=1,dp=" + std::to_string(w.senders));
  const layout::ServingLayout receivers(
      model, layout::parse_infer_topology("tp=" + std::to_string(w.receivers)));
  sim::SyntheticTrainer trainer(model, train, {.lr = 1e-4});
  std::mutex checks;
  // The trainer steps between publications on one thread: every rank reaches the barrier.
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  auto barrier = [&] {
    const int g = generation.load();
    if (arrived.fetch_add(1) + 1 == w.size()) {
      trainer.step();
      arrived = 0;
      generation.fetch_add(1);
    } else {
      while (generation.load() == g)
        std::this_thread::yield();
    }
  };
  on_every_rank(w, [&](int rank) {
    NcclTwoRound transport(id, rank, w.senders, w.receivers);
    bool verified = false;
    std::int64_t mismatched = 0;
    if constexpr (OnDevice) {
      // The composition as the card spells it: exec::Cuda is NcclTwoRound's default executor.
      using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound>;
      static_assert(
          std::is_same_v<Engine::Sender, DeviceSenderRank<AdamWInverse, BF16Detect,
                                                          layout::TransferPlan, exec::Cuda>>);
      std::vector<exec::DeviceArray<std::uint16_t>> tensors;
      std::shared_ptr<TensorSink> sink;
      const exec::Cuda e;
      if (transport.is_receiver()) {
        std::vector<std::uint16_t*> pointers;
        for (std::int64_t k = 0; k < receivers.size(); ++k) {
          tensors.push_back(exec::DeviceArray<std::uint16_t>::zeros(
              e, static_cast<std::size_t>(receivers[k].numel)));
          pointers.push_back(tensors.back().data());
        }
        sink = std::make_shared<DeviceTensors>(model, receivers, rank - w.senders, pointers);
      }
      sim::DeviceAdamWAccess access(trainer, transport.is_sender() ? rank : 0);
      Engine engine(model, train, receivers, {}, transport, sink);
      verified = engine.publish_full(access).verified;
      for (int step = 1; step <= 5; ++step) {
        barrier();
        access.upload();
        SyncReport report;
        engine.step(access, report);
        verified = verified && report.verified;
      }
      if (transport.is_receiver()) {
        const std::vector<float> canonical = trainer.canonical_weights();
        const std::int64_t ts = (rank - w.senders) % receivers.topology().tp;
        for (std::int64_t k = 0; k < receivers.size(); ++k) {
          const auto got = tensors[static_cast<std::size_t>(k)].to_host();
          for (std::size_t i = 0; i < got.size(); ++i) {
            const auto c = receivers.source({ts, k, static_cast<std::int64_t>(i)});
            const std::uint16_t want =
                c.tensor < 0
                    ? std::uint16_t{0}
                    : BF16Detect::store(
                          canonical[static_cast<std::size_t>(model[c.tensor].base + c.index)]);
            mismatched += got[i] != want;
          }
        }
      }
    } else {
      const sim::AdamWAccess access{&trainer};
      std::vector<std::vector<std::uint16_t>> storage;
      ReceiverTensors views;
      if (transport.is_receiver()) {
        for (std::int64_t k = 0; k < receivers.size(); ++k) {
          storage.emplace_back(static_cast<std::size_t>(receivers[k].numel), std::uint16_t{0});
          views.emplace_back(storage.back());
        }
      }
      DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound, HostExecutor> engine(
          model, train, receivers, {}, transport, views, exec::Host(1));
      verified = engine.publish_full(access).verified;
      for (int step = 1; step <= 5; ++step) {
        barrier();
        SyncReport report;
        engine.step(access, report);
        verified = verified && report.verified;
      }
      if (engine.is_receiver()) {
        mismatched =
            sim::dense_mismatches(model, receivers, trainer.canonical_weights(), engine.receiver());
      }
    }
    std::lock_guard lock(checks);
    CHECK(verified);
    CHECK(mismatched == 0);
  });
}

TEST_CASE("DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound>: device state") {
  engine_over_nccl<true>();
}

TEST_CASE("the same composition on the host executor: host state, NCCL for the bytes") {
  engine_over_nccl<false>();
}

TEST_CASE("a peer that never arrives: an error naming the phase within the deadline") {
  const World w = world_for_devices();
  const ncclUniqueId id = dte::NcclTwoRound::unique_id();
  const int absent = w.size() - 1;  // the last receiver skips the exchange
  std::mutex checks;
  std::vector<std::string> errors(static_cast<std::size_t>(w.size()));
  std::vector<double> seconds(static_cast<std::size_t>(w.size()), 0);
  on_every_rank(w, [&](int rank) {
    dte::NcclTwoRoundConfig cfg;
    cfg.deadline = std::chrono::seconds(3);
    dte::NcclTwoRound t(id, rank, w.senders, w.receivers, cfg);
    if (rank == absent) {
      std::this_thread::sleep_for(std::chrono::seconds(8));
      t.abort();
      return;
    }
    std::vector<std::vector<std::byte>> storage;
    std::vector<dte::Payload> out;
    if (t.is_sender()) {
      for (int d = 0; d < w.receivers; ++d) {
        storage.emplace_back(100, std::byte{1});
        out.push_back({std::span<const std::byte>(storage.back())});
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      // Receivers other than the absent one may finish round one; nobody finishes both.
      (void)t.exchange(out);
      (void)t.exchange(out);
    } catch (const dte::error& e) {
      std::lock_guard lock(checks);
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    seconds[static_cast<std::size_t>(rank)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard lock(checks);
    CHECK(t.aborted());
    CHECK_THROWS_AS(t.checkpoint("after the abort"), dte::error);
  });
  for (int r = 0; r < w.size(); ++r) {
    if (r == absent) continue;
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    CHECK(errors[static_cast<std::size_t>(r)].find("round") != std::string::npos);
    CHECK(seconds[static_cast<std::size_t>(r)] < 30.0);
  }
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() < 2) {
    std::printf("NcclTwoRound needs two CUDA devices (one per rank), found %d: skipped (exit %d)\n",
                dte::cuda::device_count(), kSkipCode);
    return kSkipCode;
  }
  return context.run();
}
