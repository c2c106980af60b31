// SPDX-License-Identifier: Apache-2.0
// One trainer rank's shards of a SyntheticTrainer copied to device memory: the trainer_access an
// engine on the CUDA executor reads (its spans are device memory). upload() after every
// optimizer step; a real trainer's access returns its own device tensors instead.
#pragma once

#if !defined(__CUDACC__)
#error "dte/sim/device_access.cuh is CUDA code: compile it with nvcc and link dte::cuda"
#endif

#include <cstdint>
#include <span>
#include <string>

#include "dte/exec/cuda.cuh"
#include "dte/layout/segment.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::sim {

class DeviceAdamWAccess {
 public:
  DeviceAdamWAccess(const SyntheticTrainer& trainer, std::int64_t rank, exec::Cuda e = {})
      : trainer_(&trainer), rank_(rank), exec_(e) {
    upload();
  }

  // Copies the rank's current theta, exp_avg and exp_avg_sq to the device (synchronises).
  void upload() {
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      const int x = static_cast<int>(b);
      theta_[x] = exec::DeviceArray<float>::copy_of(exec_, trainer_->theta(rank_, b));
      m_[x] = exec::DeviceArray<float>::copy_of(exec_, trainer_->exp_avg(rank_, b));
      v_[x] = exec::DeviceArray<float>::copy_of(exec_, trainer_->exp_avg_sq(rank_, b));
    }
    exec_.synchronize();
  }

  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    check(rank);
    const int x = static_cast<int>(b);
    return {theta_[x].data(), theta_[x].size()};
  }
  [[nodiscard]] AdamHyperparameters hyperparameters(std::int64_t rank, layout::BufferKind b,
                                                    const layout::PlanSegment& s) const {
    check(rank);
    return trainer_->hyper(rank, b, s);
  }
  [[nodiscard]] AdamState state(std::int64_t rank, layout::BufferKind b,
                                const layout::PlanSegment& s) const {
    check(rank);
    const int x = static_cast<int>(b);
    const auto at = static_cast<std::size_t>(s.shard_begin);
    const auto n = static_cast<std::size_t>(s.length);
    return {{m_[x].data() + at, n}, {v_[x].data() + at, n}};
  }

 private:
  void check(std::int64_t rank) const {
    if (rank != rank_) {
      throw invalid_argument("DeviceAdamWAccess holds trainer rank " + std::to_string(rank_) +
                             "'s shards, not rank " + std::to_string(rank) + "'s");
    }
  }

  const SyntheticTrainer* trainer_;
  std::int64_t rank_;
  exec::Cuda exec_;
  exec::DeviceArray<float> theta_[2], m_[2], v_[2];
};

static_assert(trainer_access<DeviceAdamWAccess, AdamWInverse>);

}  // namespace dte::sim
