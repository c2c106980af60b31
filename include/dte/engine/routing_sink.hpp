// SPDX-License-Identifier: Apache-2.0
// RoutingSink: the engine's sink for a sender frame (pipeline/frame.hpp). Each changed element
// goes to every receiver copy through the run table (route, in parallel per tile), then into one
// wire v2 message per receiver (encode, in tile order): the messages are the buckets.
//
// Per (receiver, receiver tensor) the elements go as indexed entries or, where the previous
// publication made a run of all values cheaper, as dense runs (a prediction: a wrong guess costs
// bytes, never correctness); full publications and repairs are dense.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/message.hpp"
#include "dte/core/payload.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/wire.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/route.hpp"
#include "dte/pipeline/runs.hpp"

namespace dte {

namespace detail {

// One run's current values (theta: its buffer, host memory) to one copy, as dense runs of at
// most `chunk` elements.
template <change_detector Detect>
void emit_run(wire::MessageWriter& w, std::span<const float> theta, const pipeline::Run& run,
              const pipeline::RunTarget& t, std::int64_t chunk, std::vector<std::uint16_t>& bits) {
  for (std::int64_t at = 0; at < run.length; at += chunk) {
    const std::int64_t n = std::min(chunk, run.length - at);
    bits.resize(static_cast<std::size_t>(n));
    const float* x = theta.data() + run.shard_begin + at;
    for (std::int64_t j = 0; j < n; ++j)
      bits[static_cast<std::size_t>(j)] = Detect::store(x[j]);
    w.add_run(t.tensor, t.index + static_cast<std::uint32_t>(at), bits);
  }
}

// Repair messages, one per receiver (outbox[d]): every element of the bad canonical tensors to
// every receiver holding it, and everything to the receivers that must resync; current values
// (theta_of(buffer): host memory), as dense runs. Kind repair, or full for a resyncing
// receiver; an empty repair is an empty payload.
template <change_detector Detect, class ThetaOf>
std::vector<Payload> repair_messages(const pipeline::RunTable& table, wire::Outbox& outbox,
                                     ThetaOf&& theta_of, const std::vector<bool>& bad,
                                     const std::vector<bool>& resync, Version version,
                                     std::int64_t chunk) {
  outbox.begin();
  std::vector<std::uint16_t> bits;
  for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
    if (table.runs(b).empty()) continue;
    const std::span<const float> theta = theta_of(b);
    for (const pipeline::Run& run : table.runs(b)) {
      if (!run.sender || run.tensor < 0) continue;
      const bool tensor_bad = bad[static_cast<std::size_t>(run.tensor)];
      for (const pipeline::RunTarget& t : table.targets(run)) {
        if (tensor_bad || resync[t.rank])
          emit_run<Detect>(outbox[t.rank], theta, run, t, chunk, bits);
      }
    }
  }
  std::vector<Payload> out;
  for (std::size_t d = 0; d < outbox.size(); ++d) {
    wire::MessageWriter& w = outbox[d];
    w.finish(resync[d] ? MessageKind::full : MessageKind::repair, version, no_version);
    const bool empty = w.entries() == 0 && w.run_elements() == 0 && !resync[d];
    out.push_back(empty ? Payload{} : w.spans());
  }
  return out;
}

}  // namespace detail

class RoutingSink {
 public:
  RoutingSink() = default;

  // table: the run table of the frame this sink is written by (built with `receivers`).
  RoutingSink(const pipeline::RunTable& table, const layout::ServingLayout& receivers)
      : tensors_(static_cast<std::size_t>(receivers.size())),
        outbox_(static_cast<std::size_t>(receivers.topology().ranks())) {
    // How many elements this rank contributes to each (receiver, tensor), in how many runs.
    const std::size_t cells = outbox_.size() * tensors_;
    contributed_.assign(cells, 0);
    run_count_.assign(cells, 0);
    dense_.assign(cells, 0);
    flagged_.assign(cells, 0);
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const pipeline::Run& run : table.runs(b)) {
        for (const pipeline::RunTarget& t : table.targets(run)) {
          contributed_[cell(t.rank, t.tensor)] += static_cast<std::uint64_t>(run.length);
          ++run_count_[cell(t.rank, t.tensor)];
        }
      }
    }
  }

  [[nodiscard]] wire::Outbox& outbox() noexcept { return outbox_; }
  [[nodiscard]] const wire::Outbox& outbox() const noexcept { return outbox_; }

  // ---- What the frame calls ----

  template <class Frame>
  void begin(const Frame&, pipeline::ScanMode mode) {
    outbox_.begin();
    std::fill(flagged_.begin(), flagged_.end(), 0);
    if (mode == pipeline::ScanMode::all) {
      for (std::size_t x = 0; x < dense_.size(); ++x)
        dense_[x] = contributed_[x] > 0;
    }
  }

  // In parallel, per tile: every receiver copy of the compacted elements.
  template <class Frame>
  void prepare(const Frame& f, layout::BufferKind b, std::size_t t, typename Frame::Tile& s) {
    f.route_tile(b, t, s);
  }

  // In tile order: each routed entry appended to its receiver's message, except for (receiver,
  // tensor) pairs sent dense this time; counts the entries per pair for the next publication's
  // dense prediction. Returns the indexed entries written.
  template <class Frame>
  std::uint64_t changed(const Frame&, layout::BufferKind, std::size_t,
                        const typename Frame::Tile& s) {
    std::uint64_t entries = 0;
    const pipeline::RoutedEntries& e = s.routed;
    for (std::size_t i = 0; i < e.size(); ++i) {
      const std::size_t x = cell(e.rank[i], e.tensor[i]);
      ++flagged_[x];
      if (dense_[x]) continue;
      outbox_[e.rank[i]].add(e.tensor[i], e.index[i], e.bits[i]);
      ++entries;
    }
    return entries;
  }

  // A full publication, in tile order: the tile's piece of every run as dense runs to every copy.
  template <class Frame>
  void all(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          for (const pipeline::RunTarget& target : f.runs().targets(run)) {
            outbox_[target.rank].add_run(target.tensor,
                                         target.index + static_cast<std::uint32_t>(at), bits);
          }
        });
  }

  // After the last tile: the dense part of a delta (every element of each dense pair), and the
  // prediction for the next one. Bytes (docs/wire.md): an indexed entry costs 2.1 to 3.6 (2.3
  // near 90% density), a dense element 2, a group header 20; dense pays only above ~87% of the
  // elements. A full publication says nothing about the next delta: start sparse after it.
  template <class Frame, class Access>
  void end(const Frame& f, const Access& access, pipeline::ScanMode mode) {
    const bool delta = mode != pipeline::ScanMode::all;
    if (delta) emit_dense_runs(f, access);
    for (std::size_t x = 0; x < dense_.size(); ++x)
      dense_[x] = delta && flagged_[x] * 23 > contributed_[x] * 20 + run_count_[x] * 200;
  }

  // Bounded by the plan: a partly filled chunk per receiver and the per-pair counters.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return outbox_.fixed_bytes() + 33 * contributed_.size();
  }

 private:
  [[nodiscard]] std::size_t cell(std::uint32_t rank, std::uint32_t tensor) const noexcept {
    return static_cast<std::size_t>(rank) * tensors_ + tensor;
  }

  template <class Frame, class Access>
  void emit_dense_runs(const Frame& f, const Access& access) {
    if (std::find(dense_.begin(), dense_.end(), std::uint8_t{1}) == dense_.end()) return;
    std::vector<std::uint16_t> bits;
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      const auto runs = f.runs().runs(b);
      if (runs.empty()) continue;
      const std::span<const float> theta = access.theta(f.rank(), b);
      for (const pipeline::Run& run : runs) {
        for (const pipeline::RunTarget& t : f.runs().targets(run)) {
          if (dense_[cell(t.rank, t.tensor)]) {
            detail::emit_run<typename Frame::detector>(outbox_[t.rank], theta, run, t, Frame::tile,
                                                       bits);
          }
        }
      }
    }
  }

  std::size_t tensors_ = 0;                                       // receiver tensors per receiver
  wire::Outbox outbox_;                                           // one message per receiver
  std::vector<std::uint64_t> contributed_, run_count_, flagged_;  // per receiver * tensor
  std::vector<std::uint8_t> dense_;
};

}  // namespace dte
