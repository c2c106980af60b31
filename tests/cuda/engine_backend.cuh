// SPDX-License-Identifier: Apache-2.0
// CudaBackend: exec::Cuda ranks for dte_test::EngineWorld (tests/device_on_host/engine_world.hpp).
// Each rank has its own stream; a trainer rank's optimizer state is copied to device memory after
// every step (sim/device_access.cuh), a receiver rank commits into its own device tensors
// (engine/device_receiver.cuh), which the checks copy back to the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dte/engine/device_receiver.cuh"
#include "dte/exec/cuda.cuh"
#include "dte/layout/model.hpp"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte_test {

struct CudaBackend {
  using Exec = dte::exec::Cuda;
  // Destroyed in reverse: the arrays and the access (freed on the stream) before the stream.
  struct Rank {
    Rank(const dte::sim::SyntheticTrainer& trainer, int r, bool receiver, std::uint64_t scratch)
        : exec(dte::exec::Cuda(stream).with_scratch_limit(scratch)) {
      if (!receiver) trainer_access.emplace(trainer, r, exec);
    }
    dte::exec::Stream stream;
    dte::exec::Cuda exec;
    std::optional<dte::sim::DeviceAdamWAccess> trainer_access;  // trainer ranks
    std::vector<dte::exec::DeviceArray<std::uint16_t>> held;    // receiver ranks

    std::shared_ptr<dte::TensorSink> tensors(const dte::layout::HfModel& hf,
                                             const dte::layout::ServingLayout& recv,
                                             std::int64_t d) {
      std::vector<std::uint16_t*> pointers;
      for (std::int64_t k = 0; k < recv.size(); ++k) {
        held.push_back(dte::exec::DeviceArray<std::uint16_t>::zeros(
            exec, static_cast<std::size_t>(recv[k].numel)));
        pointers.push_back(held.back().data());
      }
      return std::make_shared<dte::DeviceTensors>(hf, recv, d, pointers, exec);
    }
    [[nodiscard]] const dte::sim::DeviceAdamWAccess* access() const {
      return trainer_access ? &*trainer_access : nullptr;
    }
    void after_step() {
      if (trainer_access) trainer_access->upload();  // (synchronises)
    }
    [[nodiscard]] std::vector<std::vector<std::uint16_t>> to_host() const {
      std::vector<std::vector<std::uint16_t>> out;
      for (const auto& x : held)
        out.push_back(x.to_host());  // (synchronises the rank's stream)
      return out;
    }
    void flip(std::size_t k, std::size_t i) {
      const auto& x = held[k];
      REQUIRE(i < x.size());
      std::vector<std::uint16_t> host = x.to_host();
      host[i] = static_cast<std::uint16_t>(~host[i]);
      exec.upload(x.data() + i, host.data() + i, sizeof(std::uint16_t));
      exec.synchronize();
    }
  };
};

}  // namespace dte_test
