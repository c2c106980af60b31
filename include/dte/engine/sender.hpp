// SPDX-License-Identifier: Apache-2.0
// SenderRank: everything one trainer rank does for a publication, whatever carries its messages
// (threads of one process, or MPI processes): the fused pass over its optimizer shard
// (reconstruct, round, compare with the guard band, digest, route into one chunked message per
// receiver), the dense-or-indexed choice per (receiver, tensor), the K-step dirty mask, and the
// dense repair of named tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/digest.hpp"
#include "dte/engine/message.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/transport/loopback.hpp"

namespace dte {

// all: send every element (full publication). detect: K = 1, send what this step changed.
// mark: OR this step's changes into the dirty mask, send nothing. mask: OR the last step in,
// send everything marked, clear the mask.
enum class ScanMode { all, detect, mark, mask };

struct ScanResult {
  std::vector<std::uint64_t> digest;  // per canonical tensor, this rank's part (not for mark)
  std::uint64_t scanned = 0, changed = 0, guard = 0;
};

template <optimizer_inverse Inverse, change_detector Detect, class Layout>
class SenderRank {
 public:
  using Plan = typename layout::plan_for<Layout>::type;

  SenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
             const layout::SglangLayout& receivers, std::int64_t rank, bool keep_mask)
      : hf_(&hf), recv_(&receivers), rank_(rank), plan_(hf, train, receivers, rank) {
    const auto n_receivers = static_cast<std::size_t>(receivers.topology().ranks());
    writers_.resize(n_receivers);
    if (keep_mask) {
      for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
        masks_[static_cast<int>(b)].assign(
            (static_cast<std::size_t>(plan_.shard_size(b)) + 63) / 64, 0);
      }
    }
    // How many elements this rank contributes to each (receiver, tensor), in how many runs.
    const std::size_t cells = n_receivers * static_cast<std::size_t>(receivers.size());
    contributed_.assign(cells, 0);
    runs_.assign(cells, 0);
    dense_.assign(cells, 0);
    walk_runs(
        [&](layout::BufferKind, std::int64_t, std::int64_t len, const layout::RouteTarget& t) {
          contributed_[cell(t)] += static_cast<std::uint64_t>(len);
          ++runs_[cell(t)];
        });
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }

  // The fused pass over this rank's shard. Throws (from Inverse::bind) before any message is
  // complete when the optimizer state is refused.
  template <class Access>
  ScanResult scan(Access& access, ScanMode mode) {
    ScanResult out;
    if (mode != ScanMode::mark) {
      out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
      begin_messages();
    }
    // Dense this time: everything for a full publication; otherwise where the last
    // publication's changes made runs of all values cheaper than indexed entries (a prediction:
    // a wrong guess costs bytes, never correctness).
    if (mode == ScanMode::all) {
      for (std::size_t x = 0; x < dense_.size(); ++x)
        dense_[x] = contributed_[x] > 0;
    }
    std::vector<std::uint64_t> flagged(contributed_.size(), 0);
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const layout::PlanSegment& s : plan_.segments(b)) {
        if (!s.sender) {
          // TP replicas of replicated tensors are never sent, but their state is still
          // validated: a NaN anywhere in the optimizer state refuses the publication.
          if (mode != ScanMode::all) (void)access.kernel(rank_, b, s);
          continue;
        }
        const std::span<const float> theta = access.theta(rank_, b);
        std::optional<typename Inverse::kernel> k;
        if (mode != ScanMode::all) k.emplace(access.kernel(rank_, b, s));
        const auto& p = plan_.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t i = 0; i < s.length; ++i) {
          const layout::Canonical c = plan_.mapping()(p, s.param_begin + i);
          if (c.tensor < 0) continue;  // vocabulary padding
          const std::int64_t offset = s.shard_begin + i;
          const float now = theta[static_cast<std::size_t>(offset)];
          bool send = mode == ScanMode::all;
          if (mode != ScanMode::all) {
            const Verdict v = Detect::classify(now, (*k)(static_cast<std::size_t>(i)));
            const bool hit = v != Verdict::unchanged;
            out.guard += v == Verdict::guard;
            if (mode == ScanMode::detect) {
              send = hit;
            } else {
              std::vector<std::uint64_t>& m = masks_[static_cast<int>(b)];
              const std::size_t w = static_cast<std::size_t>(offset) / 64;
              const std::uint64_t bit = 1ull << (offset % 64);
              if (hit) m[w] |= bit;
              if (mode == ScanMode::mask) {
                send = (m[w] & bit) != 0;
                m[w] &= ~bit;
              }
            }
          }
          if (mode == ScanMode::mark) continue;
          ++out.scanned;
          const std::uint16_t bits = Detect::store(now);
          out.digest[static_cast<std::size_t>(c.tensor)] +=
              element_digest((*hf_)[c.tensor].base + c.index, bits);
          if (!send) continue;
          ++out.changed;
          plan_.route(b, offset, [&](const layout::RouteTarget& t) {
            const std::size_t x = cell(t);
            ++flagged[x];
            if (!dense_[x]) {
              writers_[static_cast<std::size_t>(t.rank)].add(
                  static_cast<std::uint32_t>(t.tensor), static_cast<std::uint32_t>(t.index), bits);
            }
          });
        }
      }
    }
    if (mode == ScanMode::mark) return out;
    emit_dense_runs(access);
    for (std::size_t x = 0; x < dense_.size(); ++x) {
      // A full publication says nothing about the next delta: start sparse after it.
      dense_[x] = mode != ScanMode::all && flagged[x] * 10 > contributed_[x] * 2 + runs_[x] * 12;
    }
    return out;
  }

  // Starts empty messages (header only): for a no-op version.
  void begin_messages() {
    for (MessageWriter& w : writers_)
      w.begin();
  }

  void clear_masks() {
    for (auto& m : masks_)
      std::fill(m.begin(), m.end(), 0);
  }

  // Closes this publication's messages and returns them, one per receiver (each at least a
  // header, so every receiver checks the version chain against every sender).
  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    std::vector<Payload> out;
    for (MessageWriter& w : writers_) {
      w.finish(kind, version, base);
      out.push_back(w.spans());
    }
    return out;
  }

  void release() {
    for (MessageWriter& w : writers_)
      w.clear();
  }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const MessageWriter& w : writers_)
      n += w.size();
    return n;
  }
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    std::uint64_t n = mask_bytes();
    for (const MessageWriter& w : writers_)
      n += w.capacity();
    return n;
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept {
    return 8 * (masks_[0].size() + masks_[1].size());
  }
  // A partly filled chunk per receiver, the digest per tensor, the encoding-choice tables.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return MessageWriter::chunk_bytes * writers_.size() +
           8 * static_cast<std::uint64_t>(hf_->size()) +
           25 * static_cast<std::uint64_t>(contributed_.size());
  }

  // Repair messages: every element of the bad canonical tensors to every receiver holding it,
  // and everything to the receivers that must resync; current values. Kind repair, or full for
  // a resyncing receiver; an empty repair is an empty payload.
  template <class Access>
  std::vector<Payload> repair(Access& access, const std::vector<bool>& bad,
                              const std::vector<bool>& resync, Version version) {
    for (MessageWriter& w : writers_)
      w.begin();
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      const std::span<const float> theta = access.theta(rank_, b);
      for (const layout::PlanSegment& s : plan_.segments(b)) {
        if (!s.sender) continue;
        const auto& p = plan_.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t i = 0; i < s.length; ++i) {
          const layout::Canonical c = plan_.mapping()(p, s.param_begin + i);
          if (c.tensor < 0) continue;
          const bool tensor_bad = bad[static_cast<std::size_t>(c.tensor)];
          const std::uint16_t bits =
              Detect::store(theta[static_cast<std::size_t>(s.shard_begin + i)]);
          plan_.route(b, s.shard_begin + i, [&](const layout::RouteTarget& t) {
            if (tensor_bad || resync[static_cast<std::size_t>(t.rank)]) {
              writers_[static_cast<std::size_t>(t.rank)].add(
                  static_cast<std::uint32_t>(t.tensor), static_cast<std::uint32_t>(t.index), bits);
            }
          });
        }
      }
    }
    std::vector<Payload> out;
    for (std::size_t d = 0; d < writers_.size(); ++d) {
      MessageWriter& w = writers_[d];
      w.finish(resync[d] ? MessageKind::full : MessageKind::repair, version, no_version);
      out.push_back(w.entries() == 0 && !resync[d] ? Payload{} : w.spans());
    }
    return out;
  }

 private:
  [[nodiscard]] std::size_t cell(const layout::RouteTarget& t) const noexcept {
    return static_cast<std::size_t>(t.rank) * static_cast<std::size_t>(recv_->size()) +
           static_cast<std::size_t>(t.tensor);
  }

  // Calls f(buffer, shard offset, length, target) for every maximal run of this rank's sender
  // elements that lands contiguously in one receiver tensor (every replica's copy); pieces that
  // continue the previous run of the same receiver are merged into it.
  template <class F>
  void walk_runs(F&& f) const {
    struct Pending {
      layout::BufferKind b;
      std::int64_t offset = 0, len = 0;
      layout::RouteTarget t{};
    };
    std::vector<Pending> pending(writers_.size());
    auto piece = [&](layout::BufferKind b, std::int64_t offset, std::int64_t len,
                     const layout::RouteTarget& t) {
      Pending& p = pending[static_cast<std::size_t>(t.rank)];
      if (p.len > 0 && p.b == b && p.t.tensor == t.tensor && p.offset + p.len == offset &&
          p.t.index + p.len == t.index) {
        p.len += len;
        return;
      }
      if (p.len > 0) f(p.b, p.offset, p.len, p.t);
      p = {b, offset, len, t};
    };
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const layout::PlanSegment& s : plan_.segments(b)) {
        if (!s.sender) continue;
        const auto& p = plan_.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t pos = 0; pos < s.length;) {
          const std::int64_t local = s.param_begin + pos;
          const std::int64_t row_left = p.cols == 0 ? p.numel() - local : p.cols - local % p.cols;
          std::int64_t n = std::min(s.length - pos, row_left);
          const layout::Canonical c = plan_.mapping()(p, local);
          if (c.tensor >= 0) {
            n = std::min({n, (*hf_)[c.tensor].numel() - c.index, recv_->contiguous(c)});
            layout::route_canonical(*recv_, c, [&](const layout::RouteTarget& t) {
              piece(b, s.shard_begin + pos, n, t);
            });
          }
          pos += n;
        }
      }
    }
    for (const Pending& p : pending) {
      if (p.len > 0) f(p.b, p.offset, p.len, p.t);
    }
  }

  // The dense part of the messages: every element of each dense (receiver, tensor) pair as
  // runs of current values.
  template <class Access>
  void emit_dense_runs(Access& access) {
    if (std::find(dense_.begin(), dense_.end(), std::uint8_t{1}) == dense_.end()) return;
    std::vector<std::uint16_t> bits;
    walk_runs([&](layout::BufferKind b, std::int64_t offset, std::int64_t len,
                  const layout::RouteTarget& t) {
      if (!dense_[cell(t)]) return;
      const std::span<const float> theta = access.theta(rank_, b);
      bits.resize(static_cast<std::size_t>(len));
      for (std::int64_t i = 0; i < len; ++i) {
        bits[static_cast<std::size_t>(i)] =
            Detect::store(theta[static_cast<std::size_t>(offset + i)]);
      }
      writers_[static_cast<std::size_t>(t.rank)].add_run(static_cast<std::uint32_t>(t.tensor),
                                                         static_cast<std::uint32_t>(t.index), bits);
    });
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* recv_;
  std::int64_t rank_;
  Plan plan_;
  std::vector<std::uint64_t> masks_[2];            // K > 1: one bit per shard element, per buffer
  std::vector<MessageWriter> writers_;             // one per receiver
  std::vector<std::uint64_t> contributed_, runs_;  // per receiver * receiver tensor
  std::vector<std::uint8_t> dense_;
};

}  // namespace dte
