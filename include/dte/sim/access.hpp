// SPDX-License-Identifier: Apache-2.0
// The accessor DeltaEngine reads a SyntheticTrainer through: the FP32 shards, and an
// AdamWInverse functor per segment with that parameter group's hyperparameters.
#pragma once

#include <string>
#include <utility>

#include "dte/optim/adam.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::sim {

struct AdamWAccess {
  const SyntheticTrainer* trainer;

  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    return trainer->theta(rank, b);
  }

  [[nodiscard]] AdamWInverse::kernel kernel(std::int64_t rank, layout::BufferKind b,
                                            const layout::PlanSegment& s) const {
    auto part = [&](std::span<const float> x) {
      return x.subspan(static_cast<std::size_t>(s.shard_begin), static_cast<std::size_t>(s.length));
    };
    const layout::TransferPlan& plan = trainer->plan(rank);
    const std::string name = "trainer rank " + std::to_string(rank) + " " +
                             plan.params()[static_cast<std::size_t>(s.param)].name();
    return AdamWInverse::bind(trainer->hyper(rank, b, s), part(trainer->theta(rank, b)),
                              {part(trainer->exp_avg(rank, b)), part(trainer->exp_avg_sq(rank, b))},
                              name);
  }
};

}  // namespace dte::sim
