// SPDX-License-Identifier: Apache-2.0
// LocalShards: a trainer rank that holds pieces of HF tensors as separate local tensors, each
// piece a range of consecutive canonical elements of one HF tensor (a sharded PyTorch trainer:
// FSDP2 and DTensor Shard(0) rows, an FSDP1 flat-parameter shard's part of one parameter,
// ZeRO's whole parameters, a Shard(1) column block row by row). The rank's "buffer" is virtual:
// the pieces are laid end to end in canonical order (tensor, then index), so a delta's elements
// reach the chunk sink in index order, and each segment's weights and optimizer state are read
// where they live (the frame's segmented access, pipeline/frame.hpp). Piece k of the caller's
// list keeps its number as source(segment), so the caller finds its memory again.
//
// The writers of one publication must hold every element of the model exactly once between
// them (replicas send nothing: sender = false); check_writers() checks that from every writer's
// pieces before anything is published.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/plan.hpp"

namespace dte::layout {

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

  LocalShardPlan(const HfModel& hf, const std::vector<LocalPiece>& pieces, std::int64_t rank)
      : rank_(rank) {
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
  [[nodiscard]] std::int64_t rank_index() const noexcept { return rank_; }
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

 private:
  std::int64_t rank_;
  Identity map_;
  std::vector<HfParam> params_;
  std::vector<PlanSegment> segments_[2];
  std::vector<std::int64_t> source_;  // per dense segment: its piece in the caller's list
  std::int64_t size_ = 0;
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
