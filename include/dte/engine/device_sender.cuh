// SPDX-License-Identifier: Apache-2.0
// DeviceSenderRank: what one trainer rank does for a publication when its weights and optimizer
// state are in device memory (the engine's executor is exec::Cuda). The stages run on the device
// (pipeline/device.cuh: detect, compact, route, bucket, with the publication's one
// synchronisation for the counts); the per-receiver buckets then come to the host (one copy per
// array: ~10 bytes per changed element and copy, not the 12 bytes per element a host scan
// would need) and are encoded into the wire messages there, consecutive indices as dense runs.
// The interface is SenderRank's (engine/sender.hpp): DeltaEngine picks this class for
// exec::Cuda through detail::sender_rank.
#pragma once

#if !defined(__CUDACC__)
#error "dte/engine/device_sender.cuh is the CUDA sender: compile it with nvcc and link dte::cuda"
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/wire.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"

namespace dte {

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
class DeviceSenderRank {
 public:
  // Consecutive indices of one tensor in a bucket at least this long go as one dense run (2
  // bytes per element) rather than as indexed entries.
  static constexpr std::size_t min_run = 32;

  DeviceSenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
                   const layout::SglangLayout& receivers, std::int64_t rank, bool keep_mask,
                   exec::Cuda e)
      : hf_(&hf), pipeline_(hf, train, receivers, rank, keep_mask, e) {
    writers_.resize(static_cast<std::size_t>(receivers.topology().ranks()));
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
      begin_messages();
    }
    const auto buffers = pipeline_.scan(access, mode);
    for (const pipeline::device::BufferOutput& o : buffers) {
      out.scanned += o.detect.scanned;
      out.changed += o.detect.flagged;
      out.guard += o.detect.guard;
      for (std::size_t t = 0; t < o.detect.digest.size(); ++t)
        out.digest[t] += o.detect.digest[t];
      if (mode != pipeline::ScanMode::mark) out.entries += encode(o.buckets);
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  void begin_messages() {
    for (wire::MessageWriter& w : writers_)
      w.begin();
  }
  void clear_masks() { pipeline_.clear_masks(); }

  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    std::vector<Payload> out;
    for (wire::MessageWriter& w : writers_) {
      w.finish(kind, version, base);
      out.push_back(w.spans());
    }
    return out;
  }
  void release() {
    for (wire::MessageWriter& w : writers_)
      w.clear();
  }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const wire::MessageWriter& w : writers_)
      n += w.size();
    return n;
  }
  // Host memory held beyond the payload plus the device mask and tables (the device memory a
  // publication holds beyond them is its buckets, freed when scan() returns).
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    std::uint64_t n = mask_bytes() + fixed_bytes();
    for (const wire::MessageWriter& w : writers_)
      n += w.capacity();
    return n;
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept { return pipeline_.mask_bytes(); }
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return wire::MessageWriter::chunk_bytes * writers_.size() + pipeline_.table_bytes();
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
    return detail::repair_messages<Detect>(runs(), writers_, theta_of, bad, resync, version,
                                           std::int64_t{1} << 16);
  }

 private:
  // One buffer's buckets into the messages: per receiver, in bucket order (shard order).
  // Returns the indexed entries written.
  std::uint64_t encode(const pipeline::device::Buckets& b) {
    if (b.size() == 0) return 0;
    const std::vector<std::uint32_t> tensor = b.tensor.to_host();
    const std::vector<std::uint32_t> index = b.index.to_host();
    const std::vector<std::uint16_t> bits = b.bits.to_host();
    std::uint64_t entries = 0;
    for (std::size_t d = 0; d < writers_.size(); ++d) {
      wire::MessageWriter& w = writers_[d];
      const std::size_t end = b.offset[d] + b.count[d];
      for (std::size_t k = b.offset[d]; k < end;) {
        std::size_t j = k + 1;
        while (j < end && tensor[j] == tensor[k] && index[j] == index[j - 1] + 1)
          ++j;
        if (j - k >= min_run) {
          // In pieces of at most 2^16, as the host sender's dense runs.
          for (std::size_t at = k; at < j; at += std::size_t{1} << 16) {
            const std::size_t n = std::min(j - at, std::size_t{1} << 16);
            w.add_run(tensor[at], index[at], std::span<const std::uint16_t>(bits.data() + at, n));
          }
        } else {
          for (std::size_t x = k; x < j; ++x)
            w.add(tensor[x], index[x], bits[x]);
          entries += j - k;
        }
        k = j;
      }
    }
    return entries;
  }

  const layout::HfModel* hf_;
  pipeline::device::SenderPipeline<Inverse, Detect, Plan> pipeline_;
  std::vector<wire::MessageWriter> writers_;  // one per receiver
};

namespace detail {
// DeltaEngine over exec::Cuda: the device sender.
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
struct sender_rank<Inverse, Detect, Plan, exec::Cuda> {
  using type = DeviceSenderRank<Inverse, Detect, Plan>;
};
}  // namespace detail

}  // namespace dte
