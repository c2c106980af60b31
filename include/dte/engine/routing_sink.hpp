// SPDX-License-Identifier: Apache-2.0
// RoutingSink: the engine's sink for a sender frame (pipeline/frame.hpp). Each changed element
// goes to every receiver copy through the run table (route, in parallel per tile), then into one
// wire v2 message per receiver (encode, in tile order): the messages are the buckets.
//
// What each message holds is the sending policy of engine/wire.hpp applied to that receiver's
// stream of elements in shard order (indexed entries, long stretches of consecutive indices as
// dense groups), the stream the CUDA sender reads from its buckets (engine/device_sender.cuh): the
// same delta gives the same bytes whichever backend ran. A full publication and a repair write
// whole runs: every stretch dense.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/message.hpp"
#include "dte/core/payload.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/route.hpp"
#include "dte/pipeline/runs.hpp"

namespace dte {

namespace detail {

// One run's current values (theta: its buffer, host memory) to one copy's stream, converted a
// dense_run_piece at a time.
template <change_detector Detect>
void emit_run(wire::MessageWriter& w, std::span<const float> theta, const pipeline::Run& run,
              const pipeline::RunTarget& t, std::vector<std::uint16_t>& bits) {
  constexpr auto chunk = static_cast<std::int64_t>(wire::dense_run_piece);
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
// (theta_of(buffer): host memory), streams of whole runs (so dense groups by the sending
// policy). Kind repair, or full for a resyncing
// receiver; an empty repair is an empty payload.
template <change_detector Detect, class ThetaOf>
std::vector<Payload> repair_messages(const pipeline::RunTable& table, wire::Outbox& outbox,
                                     ThetaOf&& theta_of, const std::vector<bool>& bad,
                                     const std::vector<bool>& resync, Version version) {
  outbox.begin(true);
  std::vector<std::uint16_t> bits;
  for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
    if (table.runs(b).empty()) continue;
    const std::span<const float> theta = theta_of(b);
    for (const pipeline::Run& run : table.runs(b)) {
      if (!run.sender || run.tensor < 0) continue;
      const bool tensor_bad = bad[static_cast<std::size_t>(run.tensor)];
      for (const pipeline::RunTarget& t : table.targets(run)) {
        if (tensor_bad || resync[t.rank]) emit_run<Detect>(outbox[t.rank], theta, run, t, bits);
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
      : outbox_(static_cast<std::size_t>(receivers.topology().ranks())) {
    // One stream per receiver in shard order needs each element at most once per receiver (a
    // full publication appends a run piece per copy, the CUDA sender element by element).
    std::vector<std::uint8_t> seen(outbox_.size(), 0);
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const pipeline::Run& run : table.runs(b)) {
        for (const pipeline::RunTarget& t : table.targets(run)) {
          if (seen[t.rank]++ != 0) {
            throw error("dte::RoutingSink: a run of canonical tensor " +
                        std::to_string(run.tensor) + " has two copies in receiver " +
                        std::to_string(t.rank) +
                        " (the sending policy needs at most one); report this to the dte "
                        "developers");
          }
        }
        for (const pipeline::RunTarget& t : table.targets(run))
          seen[t.rank] = 0;
      }
    }
  }

  // Receiver tensors this sink leaves out (skip[id]: FP8 receivers' quantized tensors, which
  // engine/fp8_stage.hpp writes).
  void skip(std::vector<bool> skip) { skip_ = std::move(skip); }

  [[nodiscard]] wire::Outbox& outbox() noexcept { return outbox_; }
  [[nodiscard]] const wire::Outbox& outbox() const noexcept { return outbox_; }

  // ---- What the frame calls ----

  template <class Frame>
  void begin(const Frame&, pipeline::ScanMode mode) {
    outbox_.begin(mode == pipeline::ScanMode::all);
  }

  // In parallel, per tile: every receiver copy of the compacted elements.
  template <class Frame>
  void prepare(const Frame& f, layout::BufferKind b, std::size_t t, typename Frame::Tile& s) {
    f.route_tile(b, t, s);
  }

  // In tile order: each routed entry appended to its receiver's stream.
  template <class Frame>
  void changed(const Frame&, layout::BufferKind, std::size_t, const typename Frame::Tile& s) {
    const pipeline::RoutedEntries& e = s.routed;
    for (std::size_t i = 0; i < e.size(); ++i) {
      if (!skip_.empty() && skip_[e.tensor[i]]) continue;
      outbox_[e.rank[i]].add(e.tensor[i], e.index[i], e.bits[i]);
    }
  }

  // A full publication, in tile order: the tile's piece of every run to every copy.
  template <class Frame>
  void all(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          for (const pipeline::RunTarget& target : f.runs().targets(run)) {
            if (!skip_.empty() && skip_[target.tensor]) continue;
            outbox_[target.rank].add_run(target.tensor,
                                         target.index + static_cast<std::uint32_t>(at), bits);
          }
        });
  }

  // After the last tile: every stream ends.
  template <class Frame, class Access>
  void end(const Frame&, const Access&, pipeline::ScanMode) {
    outbox_.flush();
  }

  // Elements written as indexed entries (not in dense groups), after end().
  [[nodiscard]] std::uint64_t entries() const noexcept { return outbox_.entries(); }

  // Bounded by the plan: a partly filled chunk per receiver.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept { return outbox_.fixed_bytes(); }

 private:
  wire::Outbox outbox_;  // one message per receiver
  std::vector<bool> skip_;
};

}  // namespace dte
