// SPDX-License-Identifier: Apache-2.0
// DeviceChunkSender: a publisher's sender (publication/publisher.hpp) when the trainer's weights
// and optimizer state are in device memory: publication::Publisher<..., exec::Cuda> picks it
// (publication/device_sender.cuh), and CI runs it on the host twin (dte/sim/simt_host.hpp).
// One publication, top to bottom:
//   1. the device stages of pipeline/device_stages.hpp: bind the inverse to the device spans (each
//   plan
//      segment where it lives: a sharded PyTorch trainer's local tensors), detect over both
//      buffers (validate, reconstruct, classify, digest, dirty mask, one send bit per element),
//      one synchronisation for the counts; a refused element throws before anything is written;
//   2. the flagged elements, in batches of shard offsets: compacted by CUB on the device, their
//      bits (and, for a diff encoding, what their previous bits can be) gathered there, and only
//      those (6 bytes per element, 14 with previous bits) copied to the host;
//   3. on the host, each element's HF tensor and index from the run table, into the chunk sink
//      in shard order: the order the host frame writes, so the message is the host's, byte for
//      byte (tests/cuda/test_cuda_publication.cu).
// A full publication takes the same path (every sent element is flagged): 6 bytes per element
// cross to the host, where the host frame reads 4.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <utility>

#include "dte/concepts.hpp"
#include "dte/layout/hf.hpp"
#include "dte/pipeline/device_stages.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/publication/publisher.hpp"

namespace dte::publication {

template <optimizer_inverse Inverse, change_detector Detect, class Plan, device_executor E>
class DeviceChunkSender {
 public:
  // Shard offsets per batch of step 2: the pinned host memory it needs is at most 14 bytes per
  // offset (56 MiB), and only where that many elements changed.
  static constexpr std::int64_t batch = std::int64_t{1} << 22;

  DeviceChunkSender(const layout::HfModel& hf, Plan plan, std::int64_t rank, bool keep_mask, E e)
      : hf_(&hf), pipeline_(hf, std::move(plan), rank, keep_mask, e) {}

  [[nodiscard]] const Plan& plan() const noexcept { return pipeline_.plan(); }

  // The sizes are checked as detect() binds each segment (before anything runs).
  template <class Access>
  void check_trainer(const Access&) const noexcept {}

  void clear_masks() { pipeline_.clear_masks(); }

  // Between publications (publish_every > 1): ORs this step's changes into the dirty mask.
  template <class Access>
  ScanResult mark(const Access& access) {
    const auto t0 = std::chrono::steady_clock::now();
    ScanResult out;
    for (const pipeline::device::DetectResult& d :
         pipeline_.detect(access, pipeline::ScanMode::mark))
      out.guard += d.guard;
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  // A publication's pass (mode all, detect or mask) into a storage::ChunkSink; flushes it.
  template <class Access, class Sink>
  ScanResult scan(const Access& access, pipeline::ScanMode mode, Sink& sink) {
    const auto t0 = std::chrono::steady_clock::now();
    ScanResult out;
    out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
    const auto found = pipeline_.detect(access, mode);
    // (the host frame's diff needs the reconstruction, which mode all does not bind)
    const bool with_previous = Sink::diff && mode != pipeline::ScanMode::all;
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      const pipeline::device::DetectResult& d = found[static_cast<std::size_t>(b)];
      out.scanned += d.scanned;
      out.changed += d.flagged;
      out.guard += d.guard;
      for (std::size_t t = 0; t < d.digest.size(); ++t)
        out.digest[t] += d.digest[t];
      const auto runs = pipeline_.runs().runs(b);
      std::size_t r = 0;
      pipeline_.gather(
          b, d.flagged, with_previous, batch,
          [&](std::int64_t begin, std::span<const std::uint32_t> offset,
              std::span<const std::uint16_t> bits, std::span<const PreviousBits> previous) {
            for (std::size_t k = 0; k < offset.size(); ++k) {
              const std::int64_t o = begin + offset[k];
              while (runs[r].shard_begin + runs[r].length <= o)
                ++r;
              const pipeline::Run& run = runs[r];
              if (!run.sender || run.tensor < 0) continue;  // (detect flags neither)
              const auto tensor = static_cast<std::uint32_t>(run.tensor);
              const std::uint32_t index = pipeline::canonical_index(*hf_, run, o);
              if (with_previous) {
                sink.put(tensor, index, bits[k], previous[k]);
              } else {
                sink.put(tensor, index, bits[k]);
              }
              if (mode != pipeline::ScanMode::all) ++out.entries;
            }
          });
    }
    sink.flush();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

 private:
  const layout::HfModel* hf_;
  pipeline::device::SenderPipeline<Inverse, Detect, Plan, E> pipeline_;
};

}  // namespace dte::publication
