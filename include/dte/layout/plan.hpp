// SPDX-License-Identifier: Apache-2.0
// TransferPlan: built once per trainer rank, it says for every element of that rank's optimizer
// shard (dense and expert buffers) which canonical (HF) element it is and whether this rank sends
// it. It stores only the runs where a parameter overlaps the shard (a few hundred per rank);
// everything else is closed form: locate the run (binary search), then MegatronToHF, O(1). The
// receivers that hold a canonical element are the serving layout's business (route_canonical).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dte/layout/dist_optimizer.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/segment.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

// The two distributed-optimizer buffers of one rank ([0] dense, [1] expert) and the slices of
// each that this rank owns, in shard order.
struct RankBuffers {
  BufferLayout layout[2];
  std::vector<Bucket> owned[2];
};

// Megatron's own layout for a rank (what _ParamAndGradBuffer computes).
inline RankBuffers megatron_rank_buffers(const std::vector<MegatronParam>& params,
                                         const TrainTopology& t, const TrainRank& r) {
  RankBuffers out;
  for (BufferKind kind : {BufferKind::dense, BufferKind::expert}) {
    const bool expert = kind == BufferKind::expert;
    std::vector<std::int64_t> ids, numels;
    std::vector<bool> own_bucket;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_expert() == expert) {
        ids.push_back(static_cast<std::int64_t>(i));
        numels.push_back(params[i].numel());
        own_bucket.push_back(params[i].shared_embedding);
      }
    }
    // Megatron uses a single bucket on every pipeline stage but the first.
    const int k = static_cast<int>(kind);
    out.layout[k] = megatron_buffer_layout(ids, numels, expert ? t.edp() : t.dp,
                                           r.pp > 0 ? 0 : t.bucket_size, own_bucket);
    out.owned[k] = out.layout[k].owned(expert ? r.edp : r.dp);
  }
  return out;
}

// Where one trainer element goes: receiver rank (replica * inference TP + TP rank), receiver
// tensor id (ServingLayout), flat index in the receiver-local tensor.
struct RouteTarget {
  std::int64_t rank;
  std::int64_t tensor;
  std::int64_t index;
};

// The segment of `segs` (sorted by shard_begin) holding shard offset o, or nullptr.
inline const PlanSegment* find_segment(const std::vector<PlanSegment>& segs,
                                       std::int64_t o) noexcept {
  auto it = std::upper_bound(segs.begin(), segs.end(), o, [](std::int64_t x, const PlanSegment& s) {
    return x < s.shard_begin;
  });
  if (it == segs.begin()) return nullptr;
  --it;
  return o < it->shard_begin + it->length ? &*it : nullptr;
}

// emit(RouteTarget) for every receiver element, in every replica, holding canonical element c.
template <class Emit>
void route_canonical(const ServingLayout& receivers, Canonical c, Emit&& emit) {
  if (c.tensor < 0) return;
  const InferTopology& it = receivers.topology();
  receivers.targets(c, [&](const ReceiverElement& e) {
    for (std::int64_t replica = 0; replica < it.replicas; ++replica) {
      emit(RouteTarget{replica * it.tp + e.ts, e.tensor, e.index});
    }
  });
}

class TransferPlan {
 public:
  // The plan for Megatron's own buffer layout (computed from the topology).
  TransferPlan(const HfModel& hf, const TrainTopology& t, std::int64_t global_rank)
      : TransferPlan(hf, t, global_rank, nullptr) {}

  // The plan for a buffer layout the trainer dumped (dte/io/buffer_layout.hpp reads it).
  TransferPlan(const HfModel& hf, const TrainTopology& t, std::int64_t global_rank,
               const RankBuffers& dumped)
      : TransferPlan(hf, t, global_rank, &dumped) {}

  [[nodiscard]] const TrainRank& rank() const noexcept { return map_.rank(); }
  [[nodiscard]] const std::vector<MegatronParam>& params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<PlanSegment>& segments(BufferKind b) const noexcept {
    return segments_[static_cast<int>(b)];
  }
  [[nodiscard]] std::int64_t shard_size(BufferKind b) const noexcept {
    return shard_size_[static_cast<int>(b)];
  }
  [[nodiscard]] const MegatronToHF& mapping() const noexcept { return map_; }

  // The segment holding shard offset `o`, or nullptr (alignment or bucket padding).
  [[nodiscard]] const PlanSegment* locate(BufferKind b, std::int64_t o) const noexcept {
    return find_segment(segments(b), o);
  }

  // The canonical element this rank SENDS for shard offset o (tensor -1: nothing to send).
  [[nodiscard]] Canonical canonical(BufferKind b, std::int64_t o) const noexcept {
    const PlanSegment* s = locate(b, o);
    if (s == nullptr || !s->sender) return {};
    return map_(params_[static_cast<std::size_t>(s->param)], s->param_begin + (o - s->shard_begin));
  }

  // Memory this plan holds (its own tables; the model and receiver catalogues are shared).
  [[nodiscard]] std::int64_t bytes() const noexcept {
    std::int64_t n = static_cast<std::int64_t>(sizeof(*this));
    n += static_cast<std::int64_t>(params_.capacity() * sizeof(MegatronParam));
    for (const auto& s : segments_) {
      n += static_cast<std::int64_t>(s.capacity() * sizeof(PlanSegment));
    }
    return n;
  }

 private:
  TransferPlan(const HfModel& hf, const TrainTopology& t, std::int64_t global_rank,
               const RankBuffers* dumped)
      : map_(hf, t, train_rank(t, global_rank)),
        params_(megatron_params(hf.spec(), t, map_.rank())) {
    const RankBuffers buffers =
        dumped != nullptr ? *dumped : megatron_rank_buffers(params_, t, map_.rank());
    for (BufferKind kind : {BufferKind::dense, BufferKind::expert}) {
      const int k = static_cast<int>(kind);
      const BufferLayout& layout = buffers.layout[k];
      auto& segs = segments_[k];
      std::int64_t shard_pos = 0;
      for (const Bucket& slice : buffers.owned[k]) {
        for (const BufferParam& bp : layout.params) {
          const std::int64_t lo = std::max(slice.start, bp.start);
          const std::int64_t hi = std::min(slice.end, bp.start + bp.numel);
          if (lo >= hi) continue;
          const MegatronParam& p = params_[static_cast<std::size_t>(bp.param)];
          segs.push_back({shard_pos + (lo - slice.start), hi - lo, lo - bp.start,
                          static_cast<std::int32_t>(bp.param), map_.is_sender(p)});
        }
        shard_pos += slice.end - slice.start;
      }
      std::sort(segs.begin(), segs.end(), [](const PlanSegment& a, const PlanSegment& b) {
        return a.shard_begin < b.shard_begin;
      });
      shard_size_[k] = shard_pos;
    }
  }

  MegatronToHF map_;
  std::vector<MegatronParam> params_;
  std::vector<PlanSegment> segments_[2];
  std::int64_t shard_size_[2] = {0, 0};
};

}  // namespace dte::layout
