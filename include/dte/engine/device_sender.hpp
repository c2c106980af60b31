// SPDX-License-Identifier: Apache-2.0
// DeviceSenderRank: what one trainer rank does for a publication when its weights and optimizer
// state are in device memory (the engine's executor is a device executor: exec::Cuda on a GPU,
// the host twin dte/sim/simt_host.hpp in CI). The stages run on the device
// (pipeline/device_stages.hpp: detect, with the publication's one synchronisation for the counts,
// then compact, route and bucket batch by batch within the executor's scratch limit); each batch's
// per-receiver buckets come to the host (pinned memory: 10 bytes per routed entry, not the 12
// bytes per element a host scan would need) and are read into the wire messages there, each
// receiver's bucket as its stream (engine/wire.hpp's sending policy, as the host sender's
// RoutingSink does), before the next batch starts.
// The interface is HostSenderRank's (engine/sender.hpp): DeltaEngine picks this class for
// exec::Cuda through detail::sender_rank (engine/device_sender.cuh).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/wire.hpp"
#include "dte/pipeline/device_stages.hpp"

namespace dte {

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, device_executor E>
class DeviceSenderRank {
 public:
  DeviceSenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
                   const layout::ServingLayout& receivers, std::int64_t rank, bool keep_mask, E e)
      : hf_(&hf), pipeline_(hf, train, receivers, rank, keep_mask, e) {
    outbox_ = wire::Outbox(static_cast<std::size_t>(receivers.topology().ranks()));
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return pipeline_.rank(); }
  [[nodiscard]] const Plan& plan() const noexcept { return pipeline_.plan(); }
  [[nodiscard]] const pipeline::RunTable& runs() const noexcept { return pipeline_.runs(); }

  // The device stages, then the encoding of the buckets. Throws invalid_argument when the
  // optimizer state is refused (nothing is then complete).
  template <class Access>
  ScanResult scan(const Access& access, pipeline::ScanMode mode) {
    const auto t0 = std::chrono::steady_clock::now();
    ScanResult out;
    if (mode != pipeline::ScanMode::mark) {
      out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
      outbox_.begin(mode == pipeline::ScanMode::all);
    }
    // (each batch of routed entries into the messages as it arrives: per receiver, in shard
    // order, the dense buffer's batches before the expert buffer's)
    const auto found = pipeline_.scan(
        access, mode, [&](layout::BufferKind, const pipeline::device::BucketBatch& batch) {
          for (std::size_t d = 0; d < outbox_.size(); ++d) {
            wire::MessageWriter& w = outbox_[d];
            for (std::uint64_t k = batch.offset[d]; k < batch.offset[d] + batch.count[d]; ++k)
              w.add(batch.tensor[k], batch.index[k], batch.bits[k]);
          }
        });
    for (const pipeline::device::DetectResult& d : found) {
      out.scanned += d.scanned;
      out.changed += d.flagged;
      out.guard += d.guard;
      if (mode == pipeline::ScanMode::mark) continue;  // no digest, nothing to send
      for (std::size_t t = 0; t < d.digest.size(); ++t)
        out.digest[t] += d.digest[t];
    }
    if (mode != pipeline::ScanMode::mark) {
      outbox_.flush();
      out.entries = outbox_.entries();
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  void begin_messages() { outbox_.begin(); }
  void clear_masks() { pipeline_.clear_masks(); }

  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    return outbox_.finish(kind, version, base);
  }
  void release() { outbox_.release(); }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept { return outbox_.payload_bytes(); }
  // Host memory held beyond the payload plus the device mask and tables (the device memory a
  // publication holds beyond them is one routing batch's scratch, at most the executor's
  // scratch_limit(), freed when scan() returns).
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    return mask_bytes() + fixed_bytes() + pipeline_.host_bytes() + outbox_.capacity_bytes();
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept { return pipeline_.mask_bytes(); }
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return outbox_.fixed_bytes() + pipeline_.table_bytes();
  }

  // Repair messages (detail::repair_messages) from the device weights, copied to the host
  // buffer by buffer (a repair is rare; its messages are dense anyway).
  template <class Access>
  std::vector<Payload> repair(const Access& access, const std::vector<bool>& bad,
                              const std::vector<bool>& resync, Version version) {
    std::vector<float> host;
    auto theta_of = [&](layout::BufferKind b) {
      const std::span<const float> d = access.theta(rank(), b);
      host.resize(d.size());
      if (!d.empty()) {
        exec::read(pipeline_.executor(), host.data(), d.data(), d.size_bytes());
      }
      return std::span<const float>(host);
    };
    return detail::repair_messages<Detect>(runs(), outbox_, theta_of, bad, resync, version);
  }

 private:
  const layout::HfModel* hf_;
  pipeline::device::SenderPipeline<Inverse, Detect, Plan, E> pipeline_;
  wire::Outbox outbox_;  // one message per receiver
};

}  // namespace dte
