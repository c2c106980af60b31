// SPDX-License-Identifier: Apache-2.0
// Identity: a trainer that holds its weights in the HF canonical layout (no Megatron), as a
// transfer plan describes them to the sender frame:
//   IdentityPlan    one trainer rank holding the whole model as one flat FP32 buffer, HF tensors
//                   in canonical order (a user's own training loop with plain AdamW buffers);
//   LocalShardPlan  a rank that holds pieces of HF tensors as separate local tensors, each piece
//                   a range of consecutive canonical elements of one HF tensor (a sharded
//                   PyTorch trainer: FSDP2 and DTensor Shard(0) rows, an FSDP1 flat-parameter
//                   shard's part of one parameter, ZeRO's whole parameters, a Shard(1) column
//                   block row by row). Its "buffer" is virtual: the pieces laid end to end in
//                   canonical order (tensor, then index), so a delta's elements reach the chunk
//                   sink in index order, and each segment's weights and optimizer state are read
//                   where they live (the frame's segmented access, pipeline/frame.hpp). Piece k
//                   of the caller's list keeps its number as source(segment), so the caller finds
//                   its memory again.
// IdentityPlan is the LocalShardPlan of whole tensors on one rank. The writers of one
// publication must hold every element of the model exactly once between them (replicas send
// nothing: sender = false); check_writers() checks that from every writer's pieces before
// anything is published.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
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

// One piece a rank holds: elements [index, index + length) of HF tensor `tensor`.
struct LocalPiece {
  std::int64_t tensor = 0;
  std::int64_t index = 0;
  std::int64_t length = 0;
  bool sender = true;  // false: a replica of a piece another rank sends (validated only)
  friend bool operator==(const LocalPiece&, const LocalPiece&) = default;
};

namespace detail {

inline void check_piece(const HfModel& hf, const LocalPiece& p, const std::string& who) {
  if (p.tensor < 0 || p.tensor >= hf.size() || p.index < 0 || p.length < 1 ||
      p.index > hf[p.tensor].numel() - p.length) {
    throw invalid_argument(
        who + ": piece (tensor " + std::to_string(p.tensor) + ", elements " +
        std::to_string(p.index) + " + " + std::to_string(p.length) + ") is not inside " +
        (p.tensor >= 0 && p.tensor < hf.size()
             ? hf.name(p.tensor) + " (" + std::to_string(hf[p.tensor].numel()) + " elements)"
             : "any tensor of the model (" + std::to_string(hf.size()) + " tensors)"));
  }
}

}  // namespace detail

class LocalShardPlan {
 public:
  using param_type = HfParam;

  LocalShardPlan(const HfModel& hf, const std::vector<LocalPiece>& pieces, std::int64_t rank) {
    for (std::int64_t k = 0; k < hf.size(); ++k)
      params_.push_back({k, hf[k].rows, hf[k].cols, hf.name(k)});
    const std::string who = "trainer rank " + std::to_string(rank);
    for (const LocalPiece& p : pieces)
      detail::check_piece(hf, p, who);
    std::vector<std::size_t> order(pieces.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return std::pair(pieces[a].tensor, pieces[a].index) <
             std::pair(pieces[b].tensor, pieces[b].index);
    });
    std::int64_t at = 0;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const LocalPiece& p = pieces[order[k]];
      if (k > 0) {
        const LocalPiece& q = pieces[order[k - 1]];
        if (q.tensor == p.tensor && q.index + q.length > p.index) {
          throw invalid_argument(
              who + " holds elements " + std::to_string(p.index) + " to " +
              std::to_string(std::min(q.index + q.length, p.index + p.length) - 1) + " of " +
              hf.name(p.tensor) + " in two pieces");
        }
      }
      segments_[0].push_back(
          {at, p.length, p.index, static_cast<std::int32_t>(p.tensor), p.sender});
      source_.push_back(static_cast<std::int64_t>(order[k]));
      at += p.length;
    }
    size_ = at;
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
  // The caller's number of the piece segment s of the dense buffer holds.
  [[nodiscard]] std::int64_t source(const PlanSegment& s) const noexcept {
    return source_[static_cast<std::size_t>(&s - segments_[0].data())];
  }
  // The canonical element at offset o of buffer b.
  [[nodiscard]] Canonical canonical(BufferKind b, std::int64_t o) const noexcept {
    const PlanSegment* s = find_segment(segments(b), o);
    return s == nullptr ? Canonical{} : Canonical{s->param, s->param_begin + (o - s->shard_begin)};
  }

 private:
  Identity map_;
  std::vector<HfParam> params_;
  std::vector<PlanSegment> segments_[2];
  std::vector<std::int64_t> source_;  // per dense segment: its piece in the caller's list
  std::int64_t size_ = 0;
};

// Identity's plan: one trainer rank holding the whole model as one flat FP32 buffer, every HF
// tensor whole, in canonical order (element i of the buffer is canonical element i).
class IdentityPlan : public LocalShardPlan {
 public:
  // The trainer topology must be a single rank: an Identity trainer is not sharded.
  IdentityPlan(const HfModel& hf, const TrainTopology& t, std::int64_t rank)
      : LocalShardPlan(hf, whole(hf, t, rank), 0) {}

 private:
  static std::vector<LocalPiece> whole(const HfModel& hf, const TrainTopology& t,
                                       std::int64_t rank) {
    if (t.world() != 1 || rank != 0) {
      throw invalid_argument(
          "Identity layout: the trainer holds the whole model in HF layout on "
          "one rank; got a topology of " +
          std::to_string(t.world()) +
          " ranks (use MegatronToHF for Megatron trainers, LocalShardPlan for a rank that holds "
          "pieces of HF tensors)");
    }
    std::vector<LocalPiece> out;
    for (std::int64_t k = 0; k < hf.size(); ++k)
      out.push_back({k, 0, hf[k].numel(), true});
    return out;
  }
};

// Every writer's pieces: together the senders hold every element of the model exactly once.
// Throws invalid_argument naming the first element two writers send, or the first one nobody
// sends (the sharding was misread, or a replica is marked as a sender).
inline void check_writers(const HfModel& hf, const std::vector<std::vector<LocalPiece>>& writers) {
  struct Span {
    std::int64_t tensor, index, length, writer;
  };
  std::vector<Span> spans;
  for (std::size_t w = 0; w < writers.size(); ++w) {
    for (const LocalPiece& p : writers[w]) {
      detail::check_piece(hf, p, "trainer rank " + std::to_string(w));
      if (p.sender) spans.push_back({p.tensor, p.index, p.length, static_cast<std::int64_t>(w)});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::pair(a.tensor, a.index) < std::pair(b.tensor, b.index);
  });
  std::int64_t t = 0;
  std::int64_t next = 0;  // the next element of tensor t nobody has sent yet
  auto gap = [&](std::int64_t tensor, std::int64_t index) {
    throw invalid_argument("element " + std::to_string(index) + " of " + hf.name(tensor) +
                           " is sent by no trainer rank: the ranks' shards do not cover the model");
  };
  for (const Span& s : spans) {
    while (t < s.tensor) {
      if (next != hf[t].numel()) gap(t, next);
      ++t;
      next = 0;
    }
    if (s.index < next) {
      const auto other = std::find_if(spans.begin(), spans.end(), [&](const Span& o) {
        return o.tensor == s.tensor && o.index <= s.index && s.index < o.index + o.length &&
               &o != &s;
      });
      throw invalid_argument("element " + std::to_string(s.index) + " of " + hf.name(s.tensor) +
                             " is sent by trainer ranks " +
                             std::to_string(std::min(other->writer, s.writer)) + " and " +
                             std::to_string(std::max(other->writer, s.writer)) +
                             "; each element needs exactly one sender (mark replicas)");
    }
    if (s.index > next) gap(s.tensor, next);
    next = s.index + s.length;
  }
  for (; t < hf.size(); ++t, next = 0) {
    if (next != hf[t].numel()) gap(t, next);
  }
}

}  // namespace dte::layout

namespace dte {
using Identity = layout::Identity;
}  // namespace dte
