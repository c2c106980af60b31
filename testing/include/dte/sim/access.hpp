// SPDX-License-Identifier: Apache-2.0
// The accessors DeltaEngine reads a SyntheticTrainer through (concept trainer_access), one per
// optimizer the trainer runs: the FP32 shards, and per plan segment its parameter group's
// hyperparameters and optimizer state (AdamWAccess: AdamW's moments, for AdamWInverse;
// AdamAccess: Adam-with-L2's moments, for AdamInverse; SgdMomentumAccess: SGD's momentum
// buffer, for SgdMomentumInverse); and, as a real trainer's accessor should, the parameters each
// rank holds (names and local shapes, in named_parameters() order), which the engine checks
// against its plan before the first read. Each refuses (dte::invalid_argument, from
// hyperparameters) a trainer that runs another optimizer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/layout/shape_check.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::sim {

namespace detail {

// What the accessors share (each stays an aggregate of one pointer, built as Access{&trainer}).
inline std::vector<layout::ParamShape> access_parameters(const SyntheticTrainer& t,
                                                         std::int64_t rank) {
  std::vector<layout::ParamShape> out;
  for (const layout::MegatronParam& p : t.plan(rank).params())
    out.push_back({p.name(), p.shape()});
  return out;
}
inline std::span<const float> segment_part(std::span<const float> x, const layout::PlanSegment& s) {
  return x.subspan(static_cast<std::size_t>(s.shard_begin), static_cast<std::size_t>(s.length));
}
inline void require_optimizer(const SyntheticTrainer& t, SyntheticOptimizer o,
                              const char* accessor) {
  if (t.config().optimizer != o) {
    throw invalid_argument(std::string("sim::") + accessor +
                           ": the trainer runs another optimizer (SyntheticConfig::optimizer); "
                           "use the accessor of the optimizer it runs");
  }
}

}  // namespace detail

// The accessor of the Adam family: AdamW's or Adam-with-L2's moments (the same state; the
// optimizer decides which inverse undoes them). Built as Access{&trainer}.
template <SyntheticOptimizer Optimizer>
struct AdamFamilyAccess {
  const SyntheticTrainer* trainer;

  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    return trainer->theta(rank, b);
  }
  [[nodiscard]] AdamHyperparameters hyperparameters(std::int64_t rank, layout::BufferKind b,
                                                    const layout::PlanSegment& s) const {
    detail::require_optimizer(
        *trainer, Optimizer, Optimizer == SyntheticOptimizer::adamw ? "AdamWAccess" : "AdamAccess");
    return trainer->hyper(rank, b, s);
  }
  [[nodiscard]] std::vector<layout::ParamShape> parameters(std::int64_t rank) const {
    return detail::access_parameters(*trainer, rank);
  }
  [[nodiscard]] AdamState state(std::int64_t rank, layout::BufferKind b,
                                const layout::PlanSegment& s) const {
    return {detail::segment_part(trainer->exp_avg(rank, b), s),
            detail::segment_part(trainer->exp_avg_sq(rank, b), s)};
  }
};

using AdamWAccess = AdamFamilyAccess<SyntheticOptimizer::adamw>;
using AdamAccess = AdamFamilyAccess<SyntheticOptimizer::adam>;

struct SgdMomentumAccess {
  const SyntheticTrainer* trainer;

  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    return trainer->theta(rank, b);
  }
  [[nodiscard]] SgdHyperparameters hyperparameters(std::int64_t rank, layout::BufferKind b,
                                                   const layout::PlanSegment& s) const {
    detail::require_optimizer(*trainer, SyntheticOptimizer::sgd_momentum, "SgdMomentumAccess");
    return trainer->sgd_hyper(rank, b, s);
  }
  [[nodiscard]] std::vector<layout::ParamShape> parameters(std::int64_t rank) const {
    return detail::access_parameters(*trainer, rank);
  }
  [[nodiscard]] SgdState state(std::int64_t rank, layout::BufferKind b,
                               const layout::PlanSegment& s) const {
    return {detail::segment_part(trainer->momentum_buffer(rank, b), s)};
  }
};

static_assert(trainer_access<AdamWAccess, AdamWInverse>);
static_assert(trainer_access<AdamAccess, AdamInverse>);
static_assert(trainer_access<SgdMomentumAccess, SgdMomentumInverse>);

}  // namespace dte::sim
