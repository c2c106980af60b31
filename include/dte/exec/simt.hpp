// SPDX-License-Identifier: Apache-2.0
// The SIMT context that every hand-written kernel body is written against, and its host twin.
//
// A kernel body is a DTE_HOST_DEVICE functor, written once:
//   - a per-thread body, `void operator()(std::uint64_t k) const`, is run for every k < n by a
//     grid-stride loop (thread t of block b starts at b * block_threads + t and steps by the
//     grid's threads);
//   - a per-warp body, `template <class Warp> void operator()(Warp& w) const`, runs the 32 lanes
//     of one warp together: w.each(f) runs f(lane) for each lane, w.ballot / w.sum combine a
//     Lanes<T> (one value per lane) as __ballot_sync / __reduce_add_sync do, w.lane0(f) runs f
//     once for the warp; w.block(), w.blocks() and w.thread(lane) give its place in the grid;
//   - a reduction body (identity(), accumulate(tally, k), static combine(a, b), publish(tally))
//     accumulates per thread over the same grid-stride loop, combines per block and publishes
//     each block's tally once (its atomics).
// Atomics on memory the body writes go through simt::atomic_* (CUDA's atomics on the device,
// std::atomic_ref on the host).
//
// On the device (exec/simt.cuh) thin __global__ wrappers run a body over a CUDA grid; the code
// users get is the same as a kernel written by hand. On the host, simt::host::each_thread and
// simt::host::each_warp run the same body block by block, warp by warp, over the same
// grid-stride indexing (ctest -L device-on-host), so every kernel body is tested in CI without a
// GPU, on the bytes a GPU would see. Bodies must not depend on the order of warps or blocks
// (none synchronises a block): what they share goes through the atomics.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#include "dte/config.hpp"

namespace dte::simt {

inline constexpr unsigned warp_size = 32;

namespace detail {
template <class T>
concept atomic_word = std::is_unsigned_v<T> &&(sizeof(T) == 4 || sizeof(T) == 8);

#if defined(__CUDA_ARCH__)
template <class T>
__device__ inline auto* device_word(T* p) {
  if constexpr (sizeof(T) == 8) {
    return reinterpret_cast<unsigned long long*>(p);
  } else {
    return reinterpret_cast<unsigned*>(p);
  }
}
#else
// The host's minimum and maximum: compare and swap until this value is not an improvement.
template <class T, class Better>
inline void host_fetch_extreme(T* p, T v, Better better) {
  std::atomic_ref<T> a(*p);
  T seen = a.load(std::memory_order_relaxed);
  while (better(v, seen) && !a.compare_exchange_weak(seen, v, std::memory_order_relaxed)) {
  }
}
#endif
}  // namespace detail

// *p += v, *p = min(*p, v), *p = max(*p, v), *p |= v, *p &= v; atomically, relaxed.
template <detail::atomic_word T>
DTE_HOST_DEVICE inline void atomic_add(T* p, T v) {
#if defined(__CUDA_ARCH__)
  using W = std::remove_pointer_t<decltype(detail::device_word(p))>;
  atomicAdd(detail::device_word(p), static_cast<W>(v));
#else
  std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
#endif
}
template <detail::atomic_word T>
DTE_HOST_DEVICE inline void atomic_min(T* p, T v) {
#if defined(__CUDA_ARCH__)
  using W = std::remove_pointer_t<decltype(detail::device_word(p))>;
  atomicMin(detail::device_word(p), static_cast<W>(v));
#else
  detail::host_fetch_extreme(p, v, [](T a, T b) { return a < b; });
#endif
}
template <detail::atomic_word T>
DTE_HOST_DEVICE inline void atomic_max(T* p, T v) {
#if defined(__CUDA_ARCH__)
  using W = std::remove_pointer_t<decltype(detail::device_word(p))>;
  atomicMax(detail::device_word(p), static_cast<W>(v));
#else
  detail::host_fetch_extreme(p, v, [](T a, T b) { return a > b; });
#endif
}
template <detail::atomic_word T>
DTE_HOST_DEVICE inline void atomic_or(T* p, T v) {
#if defined(__CUDA_ARCH__)
  using W = std::remove_pointer_t<decltype(detail::device_word(p))>;
  atomicOr(detail::device_word(p), static_cast<W>(v));
#else
  std::atomic_ref<T>(*p).fetch_or(v, std::memory_order_relaxed);
#endif
}
template <detail::atomic_word T>
DTE_HOST_DEVICE inline void atomic_and(T* p, T v) {
#if defined(__CUDA_ARCH__)
  using W = std::remove_pointer_t<decltype(detail::device_word(p))>;
  atomicAnd(detail::device_word(p), static_cast<W>(v));
#else
  std::atomic_ref<T>(*p).fetch_and(v, std::memory_order_relaxed);
#endif
}

// The bits of a double as an unsigned integer (non-negative doubles order as their bits).
DTE_HOST_DEVICE inline unsigned long long bits_of(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<unsigned long long>(__double_as_longlong(x));
#else
  return std::bit_cast<unsigned long long>(x);
#endif
}

namespace host {

// One warp of the host twin: its 32 lanes run one after another, in lock step between the
// collective calls (each per-lane value is a Lanes<T>).
class Warp {
 public:
  template <class T>
  using Lanes = std::array<T, warp_size>;

  Warp(unsigned block, unsigned blocks, unsigned warp) noexcept
      : block_(block), blocks_(blocks), first_(warp * warp_size) {}

  [[nodiscard]] unsigned block() const noexcept { return block_; }
  [[nodiscard]] unsigned blocks() const noexcept { return blocks_; }
  // The thread index in the block of lane `lane`.
  [[nodiscard]] unsigned thread(unsigned lane) const noexcept { return first_ + lane; }

  template <class F>
  void each(F&& f) const {
    for (unsigned lane = 0; lane < warp_size; ++lane)
      f(lane);
  }
  template <class F>
  void lane0(F&& f) const {
    f();
  }
  [[nodiscard]] unsigned ballot(const Lanes<bool>& x) const noexcept {
    unsigned bits = 0;
    for (unsigned lane = 0; lane < warp_size; ++lane)
      bits |= static_cast<unsigned>(x[lane]) << lane;
    return bits;
  }
  [[nodiscard]] unsigned sum(const Lanes<unsigned>& x) const noexcept {
    unsigned s = 0;
    for (unsigned v : x)
      s += v;
    return s;
  }

 private:
  unsigned block_, blocks_, first_;
};

// Runs a per-thread body for every k < n as a grid of `blocks` blocks of `block_threads` threads
// would: thread t of block b takes k = b * block_threads + t, then every grid's width further.
template <class Body>
void each_thread(unsigned blocks, unsigned block_threads, std::uint64_t n, const Body& body) {
  const std::uint64_t stride = std::uint64_t{blocks} * block_threads;
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned t = 0; t < block_threads; ++t) {
      for (std::uint64_t k = std::uint64_t{b} * block_threads + t; k < n; k += stride)
        body(k);
    }
  }
}

// Runs a per-warp body for every warp of a grid of `blocks` blocks of `block_threads` threads.
template <class Body>
void each_warp(unsigned blocks, unsigned block_threads, const Body& body) {
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned w = 0; w < block_threads / warp_size; ++w) {
      Warp warp(b, blocks, w);
      body(warp);
    }
  }
}

// Runs a reduction body (body.identity(), body.accumulate(tally, k), Body::combine(a, b),
// body.publish(tally)) as simt::device::each_reduce does: each thread accumulates its
// grid-stride elements, each block combines its threads' tallies and publishes the result once.
template <class Body>
void each_reduce(unsigned blocks, unsigned block_threads, std::uint64_t n, const Body& body) {
  const std::uint64_t stride = std::uint64_t{blocks} * block_threads;
  for (unsigned b = 0; b < blocks; ++b) {
    auto block = body.identity();
    for (unsigned t = 0; t < block_threads; ++t) {
      auto mine = body.identity();
      for (std::uint64_t k = std::uint64_t{b} * block_threads + t; k < n; k += stride)
        body.accumulate(mine, k);
      block = Body::combine(block, mine);
    }
    body.publish(block);
  }
}

// The host twins of the CUB device algorithms the pipeline calls, same results:
// cub::DeviceSelect::Flagged over a counting iterator (the indices i < n with flag(i), in order),
template <class Index, class Flag>
[[nodiscard]] std::vector<Index> select_flagged(Index n, const Flag& flag) {
  std::vector<Index> out;
  for (Index i = 0; i < n; ++i) {
    if (flag(i)) out.push_back(i);
  }
  return out;
}
// cub::DeviceScan::ExclusiveSum,
template <class T>
void exclusive_sum(std::span<const T> in, std::span<T> out) {
  std::exclusive_scan(in.begin(), in.end(), out.begin(), T{0});
}
// cub::DeviceRadixSort::SortPairs over key bits [0, end_bit): stable, so equal keys keep the
// order of their values.
template <class Key, class Value>
void sort_pairs(std::span<const Key> keys, std::span<const Value> values, int end_bit,
                std::span<Key> keys_out, std::span<Value> values_out) {
  const Key used = end_bit >= static_cast<int>(8 * sizeof(Key))
                       ? static_cast<Key>(~Key{0})
                       : static_cast<Key>((Key{1} << end_bit) - 1);
  std::vector<std::size_t> order(keys.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return (keys[a] & used) < (keys[b] & used);
  });
  for (std::size_t k = 0; k < order.size(); ++k) {
    keys_out[k] = keys[order[k]];
    values_out[k] = values[order[k]];
  }
}

}  // namespace host
}  // namespace dte::simt
