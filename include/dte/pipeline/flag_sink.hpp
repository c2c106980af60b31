// SPDX-License-Identifier: Apache-2.0
// FlagSink: a sender frame's sink (pipeline/frame.hpp) in front of another, for a stage that
// writes some tensors itself: FP8 receivers' quantized tensors, which the engine's FP8 stage
// (engine/fp8_stage.hpp) and a publication's (publication/fp8_sender.hpp) code from whole blocks.
// Every call goes to the inner sink, which leaves those tensors out itself (RoutingSink::skip,
// storage::ChunkSink::skip); each changed element of a tensor the stage takes also goes to the
// stage, with what its previous bits can be.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dte/layout/segment.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/reconstruction.hpp"

namespace dte::pipeline {

// Stage: takes(canonical tensor), and changed(buffer, run, shard offset, previous bits) for each
// changed element of a tensor it takes, in shard order.
template <class Inner, class Stage>
class FlagSink {
 public:
  // with_previous: the scan is one optimizer step's detect pass, whose reconstruction says what
  // each element's previous bits can be (otherwise they are not known).
  FlagSink(Inner& inner, Stage& stage, bool with_previous)
      : inner_(&inner), stage_(&stage), previous_(with_previous) {}

  template <class Frame>
  void begin(const Frame& f, ScanMode mode) {
    inner_->begin(f, mode);
  }
  template <class Frame>
  void prepare(const Frame& f, layout::BufferKind b, std::size_t t, typename Frame::Tile& s) {
    inner_->prepare(f, b, t, s);
  }
  template <class Frame>
  void changed(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    inner_->changed(f, b, t, s);
    f.for_each_changed(b, t, s, [&](const Run& run, std::int64_t o, std::uint16_t) {
      if (stage_->takes(run.tensor)) {
        stage_->changed(b, run, o, previous_ ? f.previous(b, run, o) : PreviousBits{});
      }
    });
  }
  // (a full pass: the stage writes its tensors whole itself)
  template <class Frame>
  void all(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    inner_->all(f, b, t, s);
  }
  template <class Frame, class Access>
  void end(const Frame& f, const Access& a, ScanMode mode) {
    inner_->end(f, a, mode);
  }
  [[nodiscard]] std::uint64_t entries() const noexcept { return inner_->entries(); }

 private:
  Inner* inner_;
  Stage* stage_;
  bool previous_;
};

}  // namespace dte::pipeline
