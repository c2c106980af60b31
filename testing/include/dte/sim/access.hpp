// SPDX-License-Identifier: Apache-2.0
// The accessor DeltaEngine reads a SyntheticTrainer through (concept trainer_access): the FP32
// shards, and per plan segment its parameter group's hyperparameters and AdamW state; and, as
// a real trainer's accessor should, the parameters each rank holds (names and local shapes, in
// named_parameters() order), which the engine checks against its plan before the first read.
#pragma once

#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/layout/shape_check.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::sim {

struct AdamWAccess {
  const SyntheticTrainer* trainer;

  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    return trainer->theta(rank, b);
  }
  [[nodiscard]] AdamHyperparameters hyperparameters(std::int64_t rank, layout::BufferKind b,
                                                    const layout::PlanSegment& s) const {
    return trainer->hyper(rank, b, s);
  }
  [[nodiscard]] std::vector<layout::ParamShape> parameters(std::int64_t rank) const {
    std::vector<layout::ParamShape> out;
    for (const layout::MegatronParam& p : trainer->plan(rank).params())
      out.push_back({p.name(), p.shape()});
    return out;
  }
  [[nodiscard]] AdamState state(std::int64_t rank, layout::BufferKind b,
                                const layout::PlanSegment& s) const {
    auto part = [&](std::span<const float> x) {
      return x.subspan(static_cast<std::size_t>(s.shard_begin), static_cast<std::size_t>(s.length));
    };
    return {part(trainer->exp_avg(rank, b)), part(trainer->exp_avg_sq(rank, b))};
  }
};

static_assert(trainer_access<AdamWAccess, AdamWInverse>);

}  // namespace dte::sim
