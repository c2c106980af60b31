// SPDX-License-Identifier: Apache-2.0
// exec::device_ops<exec::Cuda>: what the device stages (pipeline/device_stages.hpp) run on a GPU.
//   - pinned host buffers: PinnedBuffer (exec/cuda_executor.hpp; the executor's own memory,
//     DeviceArray and its copies, is there too);
//   - launches: a kernel body (pipeline/device_kernels.hpp) through exec/simt.cuh's __global__
//     wrappers, over a grid sized by the occupancy API, on the executor's stream;
//   - device-wide algorithms: CUB's DeviceSelect::Flagged over a counting iterator, DeviceScan::
//     ExclusiveSum and DeviceRadixSort::SortPairs, each with its temporary from the executor.
// The host twin of this seam (dte/sim/simt_host.hpp) runs the same bodies and the same results
// of these algorithms on the CPU, so everything above it is tested in CI without a GPU.
#pragma once

#if !defined(__CUDACC__)
#error "dte/exec/cuda_device_ops.cuh is the CUDA backend: compile it with nvcc and link dte::cuda"
#endif

#include <cuda_runtime.h>

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include <cstddef>
#include <cstdint>

#include "dte/concepts.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/exec/cuda_executor.hpp"
#include "dte/exec/simt.cuh"

namespace dte::exec {

namespace detail {
// Runs one CUB device algorithm: call(nullptr, bytes) asks its temporary size, then call(temp,
// bytes) runs it on e's stream. CUB takes a null temporary pointer as a size query, so the
// temporary is at least one byte: a size of 0 must not turn the run into a second query.
// Returns the temporary's size.
template <class Call>
std::size_t with_cub_temp(const Cuda& e, Call call) {
  std::size_t bytes = 0;
  DTE_CUDA_TRY(call(nullptr, bytes));
  DeviceArray<std::byte> temp(e, bytes > 0 ? bytes : 1);
  DTE_CUDA_TRY(call(temp.data(), bytes));
  return temp.size();
}
}  // namespace detail

template <>
struct device_ops<Cuda> {
  using pinned = PinnedBuffer;

  // Throws invalid_argument, naming who and what, unless the GPU can read p.
  static void check_readable(const char* who, const char* name, const void* p) {
    dte::cuda::detail::require_device_accessible(who, name, p);
  }

  // body(k) for every k < n, grid-stride, a grid sized by the occupancy API.
  template <int BlockThreads, class Body>
  static void each_thread(const Cuda& e, const Body& body, std::uint64_t n) {
    if (n == 0) return;
    auto* const kernel = &simt::device::each_thread<BlockThreads, Body>;
    kernel<<<dte::cuda::detail::grid_blocks(kernel, n, BlockThreads), BlockThreads, 0,
             e.stream()>>>(body, n);
    DTE_CUDA_TRY(cudaGetLastError());
  }
  // body(warp) for every warp of a grid of at most `threads` threads (what fits at once).
  template <int BlockThreads, class Body>
  static void each_warp(const Cuda& e, const Body& body, std::uint64_t threads) {
    if (threads == 0) return;
    auto* const kernel = &simt::device::each_warp<BlockThreads, Body>;
    kernel<<<dte::cuda::detail::grid_blocks(kernel, threads, BlockThreads), BlockThreads, 0,
             e.stream()>>>(body);
    DTE_CUDA_TRY(cudaGetLastError());
  }

  // The values v of [first, first + n) with flag(v), in increasing order, into out; their
  // number into *count (device memory). Returns the temporary's size.
  template <class Index, class Flag, class Count>
  static std::size_t select_flagged(const Cuda& e, Index first, std::int64_t n, Flag flag,
                                    Index* out, Count* count) {
    const thrust::counting_iterator<Index> in(first);
    const auto flags = thrust::make_transform_iterator(in, flag);
    return detail::with_cub_temp(e, [&](void* p, std::size_t& bytes) {
      return cub::DeviceSelect::Flagged(p, bytes, in, flags, out, count, n, e.stream());
    });
  }
  // out[i] = in[0] + ... + in[i - 1]. Returns the temporary's size.
  template <class T>
  static std::size_t exclusive_sum(const Cuda& e, const T* in, T* out, std::size_t n) {
    return detail::with_cub_temp(e, [&](void* p, std::size_t& bytes) {
      return cub::DeviceScan::ExclusiveSum(p, bytes, in, out, static_cast<std::int64_t>(n),
                                           e.stream());
    });
  }
  // A stable sort of n (key, value) pairs by key bits [0, end_bit), from keys/values; the
  // *_alt buffers are the sort's other halves, and either pair may hold the result.
  template <class K, class V>
  static SortedPairs<K, V> sort_pairs(const Cuda& e, K* keys, K* keys_alt, V* values, V* values_alt,
                                      std::size_t n, int end_bit) {
    cub::DoubleBuffer<K> k(keys, keys_alt);
    cub::DoubleBuffer<V> v(values, values_alt);
    const std::size_t temp = detail::with_cub_temp(e, [&](void* p, std::size_t& bytes) {
      return cub::DeviceRadixSort::SortPairs(p, bytes, k, v, n, 0, end_bit, e.stream());
    });
    return {k.Current(), v.Current(), temp};
  }
};

static_assert(device_executor<Cuda>);

}  // namespace dte::exec
