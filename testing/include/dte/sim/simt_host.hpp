// SPDX-License-Identifier: Apache-2.0
// sim::SimtHost: the host twin of exec::Cuda, a device executor whose "device" is this process's
// memory. Its device ops (exec::device_ops<sim::SimtHost>) run every kernel body through
// simt::host (block by block, warp by warp, over the same grid-stride indexing as on a GPU) and
// the host twins of CUB's select, scan and radix sort (exec/simt.hpp). Everything above the seam
// is the code a GPU runs: the device stages (pipeline/device_stages.hpp), DeviceSenderRank,
// BasicDeviceTensors and DeviceChunkSender, with their batches, counts, copies and checks. So
// DeltaEngine<..., sim::SimtHost> and Publisher<..., sim::SimtHost> run the whole device path in
// CI without a GPU (ctest -L device-on-host; dte/sim/simt_host_senders.hpp picks the senders).
//   - Grids are small (max_blocks, 3 by default) so that every grid-stride loop takes turns.
//   - Its arrays start as 0xA5 bytes, as device memory is not zeroed: a stage that reads memory
//     it did not fill reads garbage here too.
//   - It counts the bytes its arrays hold, and their peak (stats()), so a stated device-memory
//     bound is checked on the allocations themselves.
//   - Work runs when it is enqueued; synchronize() has nothing to wait for.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/exec/device_array.hpp"
#include "dte/exec/serial_host_work.hpp"
#include "dte/exec/simt.hpp"

namespace dte::sim {

// What a SimtHost's arrays hold, now and at most (shared by the copies of one executor).
struct SimtHostStats {
  std::uint64_t held = 0, peak = 0, allocations = 0;
};

class SimtHost : public exec::detail::SerialHostWork {
 public:
  using executor_tag = void;

  SimtHost() : SimtHost(3) {}
  explicit SimtHost(unsigned max_blocks, std::uint64_t scratch_limit = 256ull << 20)
      : max_blocks_(max_blocks),
        scratch_limit_(scratch_limit),
        stats_(std::make_shared<SimtHostStats>()) {}

  [[nodiscard]] unsigned max_blocks() const noexcept { return max_blocks_; }
  [[nodiscard]] std::uint64_t scratch_limit() const noexcept { return scratch_limit_; }
  [[nodiscard]] SimtHost with_scratch_limit(std::uint64_t bytes) const {
    SimtHost c = *this;
    c.scratch_limit_ = bytes;
    return c;
  }
  [[nodiscard]] const SimtHostStats& stats() const noexcept { return *stats_; }
  void reset_peak() const noexcept { stats_->peak = stats_->held; }

  void synchronize() const noexcept {}

  // The "device" memory of an array: `bytes` of 0xA5.
  [[nodiscard]] void* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    auto* p = new std::byte[bytes];
    std::memset(p, 0xA5, bytes);
    stats_->held += bytes;
    stats_->peak = std::max(stats_->peak, stats_->held);
    ++stats_->allocations;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) const noexcept {
    if (p == nullptr) return;
    stats_->held -= bytes;
    delete[] static_cast<std::byte*>(p);
  }
  // Copies and fills happen when they are enqueued.
  void upload(void* device, const void* host, std::size_t bytes) const noexcept {
    std::memcpy(device, host, bytes);
  }
  void download(void* host, const void* device, std::size_t bytes) const noexcept {
    std::memcpy(host, device, bytes);
  }
  void fill(void* device, int byte, std::size_t bytes) const noexcept {
    std::memset(device, byte, bytes);
  }

 private:
  unsigned max_blocks_;
  std::uint64_t scratch_limit_;
  std::shared_ptr<SimtHostStats> stats_;
};

// Grow-only host memory standing for exec::PinnedBuffer (old contents not kept: 0x5A).
class SimtHostPinned {
 public:
  std::byte* reserve(std::size_t bytes) {
    if (bytes > bytes_.size()) bytes_.assign(bytes, std::byte{0x5A});
    return bytes_.data();
  }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }

 private:
  std::vector<std::byte> bytes_;
};

}  // namespace dte::sim

namespace dte::exec {

template <>
struct device_ops<sim::SimtHost> {
  using pinned = sim::SimtHostPinned;

  // Every pointer is readable here; a null one is refused as on a GPU.
  static void check_readable(const char* who, const char* name, const void* p) {
    if (p == nullptr) {
      throw invalid_argument(std::string(who) + ": " + name +
                             " is null; pass device memory for every element of the shard");
    }
  }

  // The grid a GPU would launch, capped at the executor's max_blocks.
  template <int BlockThreads, class Body>
  static void each_thread(const sim::SimtHost& e, const Body& body, std::uint64_t n) {
    if (n == 0) return;
    simt::host::each_thread(blocks(e, n, BlockThreads), BlockThreads, n, body);
  }
  template <int BlockThreads, class Body>
  static void each_warp(const sim::SimtHost& e, const Body& body, std::uint64_t threads) {
    if (threads == 0) return;
    simt::host::each_warp(blocks(e, threads, BlockThreads), BlockThreads, body);
  }

  template <class Index, class Flag, class Count>
  static std::size_t select_flagged(const sim::SimtHost&, Index first, std::int64_t n, Flag flag,
                                    Index* out, Count* count) {
    std::uint64_t k = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto v = static_cast<Index>(first + static_cast<Index>(i));
      if (flag(v)) out[k++] = v;
    }
    *count = static_cast<Count>(k);
    return 1;
  }
  template <class T>
  static std::size_t exclusive_sum(const sim::SimtHost&, const T* in, T* out, std::size_t n) {
    simt::host::exclusive_sum<T>(std::span<const T>(in, n), std::span<T>(out, n));
    return 1;
  }
  // As CUB's DoubleBuffer sort, the result lands in the alternate buffers.
  template <class K, class V>
  static SortedPairs<K, V> sort_pairs(const sim::SimtHost&, K* keys, K* keys_alt, V* values,
                                      V* values_alt, std::size_t n, int end_bit) {
    simt::host::sort_pairs<K, V>(std::span<const K>(keys, n), std::span<const V>(values, n),
                                 end_bit, std::span<K>(keys_alt, n), std::span<V>(values_alt, n));
    return {keys_alt, values_alt, 1};
  }

 private:
  static unsigned blocks(const sim::SimtHost& e, std::uint64_t threads, int block_threads) {
    const auto block = static_cast<std::uint64_t>(block_threads);
    const std::uint64_t needed = (threads + block - 1) / block;
    return static_cast<unsigned>(
        std::max<std::uint64_t>(1, std::min<std::uint64_t>(needed, e.max_blocks())));
  }
};

static_assert(device_executor<sim::SimtHost>);

}  // namespace dte::exec
