// SPDX-License-Identifier: Apache-2.0
// The whole device path on the host twin (dte/sim/simt_host.hpp; ctest -L device-on-host): the
// engine's device sender (engine/device_sender.hpp), the device receiver (engine/
// device_receiver.hpp) and the publication's device sender (publication/device_sender.hpp),
// each over the device stages (pipeline/device_stages.hpp), the code a GPU runs but for the
// launches and CUB's algorithms. Against the host frame, over the golden suite's delivery paths
// (engine_world.hpp, which tests/cuda runs with exec::Cuda ranks on a GPU):
//   - DeltaEngine on the twin == the host engine: every message each trainer rank sends each
//     receiver, byte for byte, every report's counts and digest, K = 1 and K = 3, in one routing
//     batch and in many;
//   - the golden suite (tests/golden/golden.hpp) over DeltaEngine on the twin: device receivers
//     checked against the dense reference after every publication, verified without a repair;
//   - publication::Publisher on the twin == the host publisher, byte for byte
//     (tests/publication/device_publisher_cases.hpp, the cases test_cuda_publication runs on a
//     GPU).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "device_publisher_cases.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/model.hpp"
#include "dte/pipeline/route_batches.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/simt_host.hpp"
#include "dte/sim/simt_host_senders.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "engine_world.hpp"

namespace dte {
namespace {

// Ranks on the host twin: the receivers' tensors in its memory behind BasicDeviceTensors, the
// trainer read where it is (the twin's memory is the host's).
struct TwinBackend {
  using Exec = sim::SimtHost;
  struct Rank {
    Rank(const sim::SyntheticTrainer& trainer, int, bool, std::uint64_t scratch)
        : exec(3, scratch), trainer_access{&trainer} {}
    sim::SimtHost exec;
    sim::AdamWAccess trainer_access;
    std::vector<pipeline::device::Array<sim::SimtHost, std::uint16_t>> held;

    std::shared_ptr<TensorSink> tensors(const layout::HfModel& hf,
                                        const layout::ServingLayout& recv, std::int64_t d) {
      std::vector<std::uint16_t*> pointers;
      for (std::int64_t k = 0; k < recv.size(); ++k) {
        held.push_back(pipeline::device::Array<sim::SimtHost, std::uint16_t>::zeros(
            exec, static_cast<std::size_t>(recv[k].numel)));
        pointers.push_back(held.back().data());
      }
      return std::make_shared<sim::SimtHostTensors>(hf, recv, d, pointers, exec);
    }
    [[nodiscard]] const sim::AdamWAccess* access() const { return &trainer_access; }
    void after_step() {}
    [[nodiscard]] std::vector<std::vector<std::uint16_t>> to_host() const {
      std::vector<std::vector<std::uint16_t>> out;
      for (const auto& x : held)
        out.push_back(x.to_host());
      return out;
    }
    void flip(std::size_t k, std::size_t i) {
      std::uint16_t* p = held[k].data();
      p[i] = static_cast<std::uint16_t>(~p[i]);
    }
  };
};

TEST_CASE("device-on-host: DeltaEngine on the host twin == the host engine, byte for byte") {
  // In one routing batch, and in many (a scratch limit of a batch's fixed part and 64 KiB).
  const std::uint64_t small = pipeline::route_bytes_per_batch + (1u << 16);
  for (const dte_test::Pair& p : dte_test::kGoldenPairs) {
    for (const std::int64_t K : {1, 3}) {
      for (const std::uint64_t scratch : {std::uint64_t{256} << 20, small})
        dte_test::same_publications<TwinBackend>(p, K, scratch);
    }
  }
}

TEST_CASE("device-on-host: golden suite over DeltaEngine on the host twin (device receivers)") {
  dte_test::golden_suite<TwinBackend>();
}

// The trainer's state in the twin's memory.
struct Twin {
  using E = sim::SimtHost;
  static E executor() { return E{}; }
  static void to_device(const E&, void* device, const void* host, std::size_t bytes) {
    std::memcpy(device, host, bytes);
  }
};

namespace cases = dte_test::device_publisher;

TEST_CASE("device-on-host: publisher on the twin: one writer's messages are the host's") {
  cases::one_writer_cases<Twin>();
}

TEST_CASE("device-on-host: publisher on the twin: every writer's part is the host's") {
  cases::writer_cases<Twin>();
}

TEST_CASE("device-on-host: publisher on the twin: batches do not depend on their size") {
  cases::batches<Twin>();
}

}  // namespace
}  // namespace dte
