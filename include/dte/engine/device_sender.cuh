// SPDX-License-Identifier: Apache-2.0
// DeviceSenderRank: what one trainer rank does for a publication when its weights and optimizer
// state are in device memory (the engine's executor is exec::Cuda). The stages run on the device
// (pipeline/device.cuh: detect, compact, route, bucket, with the publication's one
// synchronisation for the counts); the per-receiver buckets then come to the host (pinned
// memory, one synchronisation: 10 bytes per changed element and copy, not the 12 bytes per
// element a host scan would need) and are read into the wire messages there, each receiver's
// bucket as its stream (engine/wire.hpp's sending policy, as the host sender's RoutingSink does).
// The interface is HostSenderRank's (engine/sender.hpp): DeltaEngine picks this class for
// exec::Cuda through detail::sender_rank.
#pragma once

#if !defined(__CUDACC__)
#error "dte/engine/device_sender.cuh is the CUDA sender: compile it with nvcc and link dte::cuda"
#endif

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/wire.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"

namespace dte {

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
class DeviceSenderRank {
 public:
  DeviceSenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
                   const layout::ServingLayout& receivers, std::int64_t rank, bool keep_mask,
                   exec::Cuda e)
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
    const auto buffers = pipeline_.scan(access, mode);
    for (const pipeline::device::BufferOutput& o : buffers) {
      out.scanned += o.detect.scanned;
      out.changed += o.detect.flagged;
      out.guard += o.detect.guard;
      if (mode == pipeline::ScanMode::mark) continue;  // no digest, nothing to send
      for (std::size_t t = 0; t < o.detect.digest.size(); ++t)
        out.digest[t] += o.detect.digest[t];
    }
    if (mode != pipeline::ScanMode::mark) out.entries = encode(buffers);
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
  // publication holds beyond them is its buckets, freed when scan() returns).
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    return mask_bytes() + fixed_bytes() + staging_.size() + outbox_.capacity_bytes();
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
        DTE_CUDA_TRY(cudaMemcpyAsync(host.data(), d.data(), d.size_bytes(), cudaMemcpyDeviceToHost,
                                     pipeline_.executor().stream()));
        pipeline_.executor().synchronize();
      }
      return std::span<const float>(host);
    };
    return detail::repair_messages<Detect>(runs(), outbox_, theta_of, bad, resync, version);
  }

 private:
  // Both buffers' buckets come to pinned host memory with one synchronisation, then into the
  // messages: per buffer and receiver, in bucket order (shard order), each receiver's stream
  // ended after the last buffer. Returns the indexed entries written.
  std::uint64_t encode(const std::array<pipeline::device::BufferOutput, 2>& buffers) {
    std::size_t bytes = 0;
    for (const auto& o : buffers)
      bytes += (o.buckets.size() * 10 + 7) / 8 * 8;  // each buffer's arrays 8-byte aligned
    if (bytes == 0) return 0;                        // (nothing added: every stream is empty)
    std::byte* h = staging_.reserve(bytes);
    const cudaStream_t stream = pipeline_.executor().stream();
    std::array<std::byte*, 2> at{};
    std::size_t used = 0;
    for (std::size_t x = 0; x < 2; ++x) {
      const pipeline::device::Buckets& b = buffers[x].buckets;
      at[x] = h + used;
      const std::size_t n = b.size();
      if (n == 0) continue;
      DTE_CUDA_TRY(cudaMemcpyAsync(at[x], b.tensor.data(), 4 * n, cudaMemcpyDeviceToHost, stream));
      DTE_CUDA_TRY(
          cudaMemcpyAsync(at[x] + 4 * n, b.index.data(), 4 * n, cudaMemcpyDeviceToHost, stream));
      DTE_CUDA_TRY(
          cudaMemcpyAsync(at[x] + 8 * n, b.bits.data(), 2 * n, cudaMemcpyDeviceToHost, stream));
      used += (10 * n + 7) / 8 * 8;
    }
    pipeline_.executor().synchronize();
    for (std::size_t x = 0; x < 2; ++x) {
      const pipeline::device::Buckets& b = buffers[x].buckets;
      const std::size_t n = b.size();
      if (n == 0) continue;
      const std::span<const std::uint32_t> tensor(reinterpret_cast<const std::uint32_t*>(at[x]), n);
      const std::span<const std::uint32_t> index(
          reinterpret_cast<const std::uint32_t*>(at[x] + 4 * n), n);
      const std::span<const std::uint16_t> bits(
          reinterpret_cast<const std::uint16_t*>(at[x] + 8 * n), n);
      for (std::size_t d = 0; d < outbox_.size(); ++d) {
        wire::MessageWriter& w = outbox_[d];
        for (std::size_t k = b.offset[d]; k < b.offset[d] + b.count[d]; ++k)
          w.add(tensor[k], index[k], bits[k]);
      }
    }
    outbox_.flush();
    return outbox_.entries();
  }

  const layout::HfModel* hf_;
  pipeline::device::SenderPipeline<Inverse, Detect, Plan> pipeline_;
  wire::Outbox outbox_;         // one message per receiver
  exec::PinnedBuffer staging_;  // the buckets on their way to the encoder
};

namespace detail {
// DeltaEngine over exec::Cuda: the device sender.
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
struct sender_rank<Inverse, Detect, Plan, exec::Cuda> {
  using type = DeviceSenderRank<Inverse, Detect, Plan>;
};
}  // namespace detail

}  // namespace dte
