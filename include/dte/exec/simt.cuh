// SPDX-License-Identifier: Apache-2.0
// The device side of exec/simt.hpp: the warp context of a per-warp kernel body (one lane per
// CUDA thread; Lanes<T> is that thread's own value) and the __global__ wrappers that run a body
// over a CUDA grid. simt::host runs the same bodies on the host.
#pragma once

#if !defined(__CUDACC__)
#error "dte/exec/simt.cuh is the device side of the SIMT bodies: compile it with nvcc"
#endif

#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "dte/exec/simt.hpp"

namespace dte::simt::device {

// One warp, seen from one of its threads.
class Warp {
 public:
  template <class T>
  struct Lanes {
    T own{};
    __device__ T& operator[](unsigned) noexcept { return own; }
    __device__ const T& operator[](unsigned) const noexcept { return own; }
  };

  __device__ Warp() noexcept : lane_(threadIdx.x & (warp_size - 1)) {}

  [[nodiscard]] __device__ unsigned block() const noexcept { return blockIdx.x; }
  [[nodiscard]] __device__ unsigned blocks() const noexcept { return gridDim.x; }
  [[nodiscard]] __device__ unsigned thread(unsigned lane) const noexcept {
    return (threadIdx.x & ~(warp_size - 1)) + lane;
  }

  template <class F>
  __device__ void each(F&& f) const {
    f(lane_);
  }
  template <class F>
  __device__ void lane0(F&& f) const {
    if (lane_ == 0) f();
  }
  [[nodiscard]] __device__ unsigned ballot(const Lanes<bool>& x) const noexcept {
    return __ballot_sync(0xFFFFFFFFu, x.own);
  }
  [[nodiscard]] __device__ unsigned sum(const Lanes<unsigned>& x) const noexcept {
    return __reduce_add_sync(0xFFFFFFFFu, x.own);
  }

 private:
  unsigned lane_;
};

// A per-thread body over k < n, grid-stride (simt::host::each_thread's indexing).
template <int BlockThreads, class Body>
__global__ void __launch_bounds__(BlockThreads) each_thread(Body body, std::uint64_t n) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t k = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < n; k += stride)
    body(k);
}

// A per-warp body, once per warp of the grid.
template <int BlockThreads, class Body>
__global__ void __launch_bounds__(BlockThreads) each_warp(Body body) {
  Warp w;
  body(w);
}

// A reduction body: per thread over its grid-stride elements, cub::BlockReduce per block, then
// the block's tally published once (thread 0).
template <int BlockThreads, class Body>
__global__ void __launch_bounds__(BlockThreads) each_reduce(Body body, std::uint64_t n) {
  using Tally = typename Body::tally;
  Tally mine = body.identity();
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t k = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < n; k += stride)
    body.accumulate(mine, k);
  using Reduce = cub::BlockReduce<Tally, BlockThreads>;
  __shared__ typename Reduce::TempStorage scratch;
  const Tally block = Reduce(scratch).Reduce(
      mine, [](const Tally& a, const Tally& b) { return Body::combine(a, b); });
  if (threadIdx.x == 0) body.publish(block);
}

}  // namespace dte::simt::device
