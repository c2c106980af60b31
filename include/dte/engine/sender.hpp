// SPDX-License-Identifier: Apache-2.0
// HostSenderRank: the engine's trainer rank on the host executor, a sender frame
// (pipeline/frame.hpp: detect, compact) writing into the routing sink (engine/routing_sink.hpp:
// route, encode into one wire message per receiver). DeviceSenderRank (engine/device_sender.cuh)
// is the same for exec::Cuda; DeltaEngine picks one through detail::sender_rank.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/message.hpp"
#include "dte/core/payload.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/fp8_stage.hpp"
#include "dte/engine/routing_sink.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/flag_sink.hpp"
#include "dte/pipeline/frame.hpp"

namespace dte {

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, executor Exec>
class HostSenderRank {
 public:
  using Frame = SenderFrame<Inverse, Detect, Plan, Exec>;

  HostSenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
                 const layout::ServingLayout& receivers, std::int64_t rank, bool keep_mask,
                 Exec exec)
      : frame_(hf, train, &receivers, rank, keep_mask, exec), sink_(frame_.runs(), receivers) {}

  [[nodiscard]] std::int64_t rank() const noexcept { return frame_.rank(); }
  [[nodiscard]] const Plan& plan() const noexcept { return frame_.plan(); }
  [[nodiscard]] const pipeline::RunTable& runs() const noexcept { return frame_.runs(); }
  [[nodiscard]] Frame& frame() noexcept { return frame_; }
  [[nodiscard]] RoutingSink& sink() noexcept { return sink_; }

  // The receivers serve online FP8 (engine/fp8_stage.hpp): from the next publication on, the
  // quantized tensors' elements go to the FP8 stage, not to the messages' groups.
  using Fp8 = EngineFp8Stage<VllmBlockFp8, Detect>;
  void serve_fp8(const layout::HfModel& hf, const layout::ServingLayout& receivers,
                 std::int64_t trainers) {
    fp8_.emplace(hf, receivers, frame_.runs(), frame_.rank(), trainers);
    std::vector<bool> skip(static_cast<std::size_t>(receivers.size()), false);
    for (std::int64_t id : fp8_->grid().quantized_ids())
      skip[static_cast<std::size_t>(id)] = true;
    sink_.skip(std::move(skip));
  }
  [[nodiscard]] Fp8* fp8() noexcept { return fp8_ ? &*fp8_ : nullptr; }

  // The pass over this rank's shard: mark ORs the step's changes into the dirty mask; the other
  // modes write this publication's messages. Throws when the optimizer state is refused.
  template <class Access>
  ScanResult scan(const Access& access, pipeline::ScanMode mode) {
    if (mode == pipeline::ScanMode::mark) return frame_.mark(access);
    if (fp8_) {
      // (the previous bits are known in one optimizer step's detect pass)
      fp8_->begin(mode == pipeline::ScanMode::all);
      pipeline::FlagSink<RoutingSink, Fp8> split(sink_, *fp8_, mode == pipeline::ScanMode::detect);
      return frame_.scan(access, mode, split);
    }
    return frame_.scan(access, mode, sink_);
  }

  // FP8: this publication's parts, one per TP rank, attached to each replica's message.
  void attach(std::vector<std::vector<std::byte>> parts) { parts_ = std::move(parts); }

  // Starts empty messages (header only): for a no-op version.
  void begin_messages() { sink_.outbox().begin(); }
  void clear_masks() { frame_.clear_masks(); }

  // Closes this publication's messages and returns them, one per receiver (each at least a
  // header, so every receiver checks the version chain against every sender).
  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    if (!parts_.empty()) {
      wire::Outbox& o = sink_.outbox();
      for (std::size_t d = 0; d < o.size(); ++d) {
        const std::vector<std::byte>& p = parts_[d % parts_.size()];
        if (!p.empty()) o[d].attach(p);
      }
      parts_.clear();
    }
    return sink_.outbox().finish(kind, version, base);
  }
  void release() { sink_.outbox().release(); }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept {
    return sink_.outbox().payload_bytes();
  }
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    return mask_bytes() + frame_.tile_bytes() + sink_.outbox().capacity_bytes();
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept { return frame_.mask_bytes(); }
  // Bounded by the plan, not by what changed.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return frame_.fixed_bytes() + sink_.fixed_bytes();
  }

  // Repair messages (detail::repair_messages) from the access's current weights.
  template <class Access>
  std::vector<Payload> repair(const Access& access, const std::vector<bool>& bad,
                              const std::vector<bool>& resync, Version version) {
    return detail::repair_messages<Detect>(
        frame_.runs(), sink_.outbox(),
        [&](layout::BufferKind b) { return access.theta(frame_.rank(), b); }, bad, resync, version);
  }

 private:
  Frame frame_;
  RoutingSink sink_;
  std::optional<Fp8> fp8_;
  std::vector<std::vector<std::byte>> parts_;  // per TP rank (FP8)
};

namespace detail {
// The sender an engine over executor Exec runs: HostSenderRank on the host; the CUDA backend
// specialises it for exec::Cuda (engine/device_sender.cuh).
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, executor Exec>
struct sender_rank {
  using type = HostSenderRank<Inverse, Detect, Plan, Exec>;
};
}  // namespace detail

}  // namespace dte
