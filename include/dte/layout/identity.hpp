// SPDX-License-Identifier: Apache-2.0
// Identity: for a trainer that already holds its weights in the HF canonical layout (no
// Megatron: a user's own training loop with plain AdamW buffers). One trainer rank holds the
// whole model as one flat FP32 buffer, HF tensors in canonical order (element i of the buffer
// is canonical element i), and IdentityPlan describes that buffer as TransferPlan describes
// Megatron shards.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

// One HF tensor as a trainer parameter.
struct HfParam {
  std::int64_t tensor = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;  // 0 for 1-D
  std::string label;

  [[nodiscard]] std::int64_t numel() const noexcept { return cols == 0 ? rows : rows * cols; }
  [[nodiscard]] bool is_expert() const noexcept { return false; }
  [[nodiscard]] const std::string& name() const noexcept { return label; }
};

class IdentityPlan;

class Identity {
 public:
  using layout_mapping_tag = void;
  using plan_type = IdentityPlan;
  using param_type = HfParam;
  using canonical_type = Canonical;

  [[nodiscard]] Canonical operator()(const HfParam& p, std::int64_t i) const noexcept {
    return {p.tensor, i};
  }
  [[nodiscard]] bool is_sender(const HfParam&) const noexcept { return true; }
  [[nodiscard]] std::int64_t contiguous(const HfParam& p, std::int64_t i) const noexcept {
    return p.numel() - i;
  }
};

class IdentityPlan {
 public:
  using param_type = HfParam;

  // The trainer topology must be a single rank: an Identity trainer is not sharded.
  IdentityPlan(const HfModel& hf, const TrainTopology& t, std::int64_t rank) {
    if (t.world() != 1 || rank != 0) {
      throw invalid_argument(
          "Identity layout: the trainer holds the whole model in HF layout on "
          "one rank; got a topology of " +
          std::to_string(t.world()) + " ranks (use MegatronToHF for sharded trainers)");
    }
    for (std::int64_t k = 0; k < hf.size(); ++k) {
      params_.push_back({k, hf[k].rows, hf[k].cols, hf.name(k)});
      segments_[0].push_back({hf[k].base, hf[k].numel(), 0, static_cast<std::int32_t>(k), true});
    }
    size_ = hf.total();
  }

  [[nodiscard]] TrainRank rank() const noexcept { return {}; }
  [[nodiscard]] const std::vector<HfParam>& params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<PlanSegment>& segments(BufferKind b) const noexcept {
    return segments_[static_cast<int>(b)];
  }
  [[nodiscard]] std::int64_t shard_size(BufferKind b) const noexcept {
    return b == BufferKind::dense ? size_ : 0;
  }
  [[nodiscard]] const Identity& mapping() const noexcept { return map_; }

  [[nodiscard]] Canonical canonical(BufferKind b, std::int64_t o) const noexcept {
    const PlanSegment* s = find_segment(segments(b), o);
    return s == nullptr ? Canonical{} : Canonical{s->param, o - s->shard_begin};
  }

 private:
  Identity map_;
  std::vector<HfParam> params_;
  std::vector<PlanSegment> segments_[2];
  std::int64_t size_ = 0;
};

}  // namespace dte::layout

namespace dte {
using Identity = layout::Identity;
}  // namespace dte
