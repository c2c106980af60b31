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
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/exec/scan.hpp"
#include "dte/exec/simt.hpp"

namespace dte::sim {

// What a SimtHost's arrays hold, now and at most (shared by the copies of one executor).
struct SimtHostStats {
  std::uint64_t held = 0, peak = 0, allocations = 0;
};

class SimtHost {
 public:
  using executor_tag = void;

  SimtHost() : SimtHost(3) {}
  explicit SimtHost(unsigned max_blocks, std::uint64_t scratch_limit = 256ull << 20)
      : max_blocks_(max_blocks),
        scratch_limit_(scratch_limit),
        stats_(std::make_shared<SimtHostStats>()) {}

  [[nodiscard]] int threads() const noexcept { return 1; }
  [[nodiscard]] unsigned max_blocks() const noexcept { return max_blocks_; }
  [[nodiscard]] std::uint64_t scratch_limit() const noexcept { return scratch_limit_; }
  [[nodiscard]] SimtHost with_scratch_limit(std::uint64_t bytes) const {
    SimtHost c = *this;
    c.scratch_limit_ = bytes;
    return c;
  }
  [[nodiscard]] const SimtHostStats& stats() const noexcept { return *stats_; }
  void reset_peak() const noexcept { stats_->peak = stats_->held; }

  template <class F>
  void for_each(std::size_t n, F&& f) const {
    for (std::size_t i = 0; i < n; ++i)
      f(i, 0);
  }
  template <class Par, class Ser>
  void for_each_ordered(std::size_t n, Par&& par, Ser&& ser) const {
    for (std::size_t i = 0; i < n; ++i) {
      par(i, 0);
      ser(i, 0);
    }
  }
  std::uint64_t exclusive_scan(std::span<const std::uint64_t> in,
                               std::span<std::uint64_t> out) const noexcept {
    return exec::detail::exclusive_scan(in, out);
  }
  void synchronize() const noexcept {}

  // The "device" memory of an array: `bytes` of 0xA5.
  [[nodiscard]] std::byte* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    auto* p = new std::byte[bytes];
    std::memset(p, 0xA5, bytes);
    stats_->held += bytes;
    stats_->peak = std::max(stats_->peak, stats_->held);
    ++stats_->allocations;
    return p;
  }
  void deallocate(std::byte* p, std::size_t bytes) const noexcept {
    if (p == nullptr) return;
    stats_->held -= bytes;
    delete[] p;
  }

 private:
  unsigned max_blocks_;
  std::uint64_t scratch_limit_;
  std::shared_ptr<SimtHostStats> stats_;
};

// n elements of T in a SimtHost's memory: exec::DeviceArray's interface. Move-only.
template <class T>
class SimtHostArray {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  SimtHostArray() = default;
  SimtHostArray(const SimtHost& e, std::size_t n)
      : exec_(e), n_(n), ptr_(e.allocate(n * sizeof(T))) {}
  SimtHostArray(SimtHostArray&& o) noexcept
      : exec_(o.exec_), n_(std::exchange(o.n_, 0)), ptr_(std::exchange(o.ptr_, nullptr)) {}
  SimtHostArray& operator=(SimtHostArray&& o) noexcept {
    if (this != &o) {
      reset();
      exec_ = o.exec_;
      n_ = std::exchange(o.n_, 0);
      ptr_ = std::exchange(o.ptr_, nullptr);
    }
    return *this;
  }
  ~SimtHostArray() { reset(); }

  static SimtHostArray copy_of(const SimtHost& e, std::span<const T> host) {
    SimtHostArray a(e, host.size());
    if (!host.empty()) std::memcpy(a.ptr_, host.data(), host.size_bytes());
    return a;
  }
  static SimtHostArray zeros(const SimtHost& e, std::size_t n) {
    SimtHostArray a(e, n);
    if (n != 0) std::memset(a.ptr_, 0, n * sizeof(T));
    return a;
  }

  [[nodiscard]] T* data() const noexcept { return reinterpret_cast<T*>(ptr_); }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return n_ * sizeof(T); }
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(n_);
    if (n_ != 0) std::memcpy(out.data(), ptr_, bytes());
    return out;
  }

 private:
  void reset() noexcept {
    exec_.deallocate(ptr_, bytes());
    ptr_ = nullptr;
    n_ = 0;
  }
  SimtHost exec_{};
  std::size_t n_ = 0;
  std::byte* ptr_ = nullptr;
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
  template <class T>
  using array = sim::SimtHostArray<T>;
  using pinned = sim::SimtHostPinned;

  template <class K, class V>
  struct SortedPairs {
    K* keys;
    V* values;
    std::size_t temp_bytes;
  };

  static void fill(const sim::SimtHost&, void* p, int byte, std::size_t bytes) {
    std::memset(p, byte, bytes);
  }
  static void to_host(const sim::SimtHost&, void* host, const void* device, std::size_t bytes) {
    std::memcpy(host, device, bytes);
  }
  static void read(const sim::SimtHost& e, void* host, const void* device, std::size_t bytes) {
    to_host(e, host, device, bytes);
  }
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
