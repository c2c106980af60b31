// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's kernels: the per-element passes on the device, classify (one Verdict per
// element) and audit (the counts of dte::audit_reconstruction), and the grid sizing every
// launch uses (the occupancy API). The executor, its memory and the status checks are host code
// in exec/cuda_executor.hpp; the pipeline stages on the executor are pipeline/device_stages.hpp
// over exec/cuda_device_ops.cuh (pipeline/device.cuh includes both). All
// run the same DTE_HOST_DEVICE functors as the host backend, so a rule tested on the CPU is the
// rule the GPU applies.
//
// Bit-identical results to the host: the inverses round every FP32 operation once through
// detail::mul_rn/add_rn/div_rn (__fmul_rn, __fadd_rn, __fdiv_rn on the device), which nvcc never
// contracts into an FMA, so the default -fmad=true gives the host's verdicts element for element.
//
// Pointers: every pointer a kernel functor holds, d_out and d_theta_prev must be readable (or
// writable) by the current device. The optimizer inverses' bind() validates its spans on the
// host, so bind on host views and point the returned functor at the device copies.
#pragma once

#if !defined(__CUDACC__)
#error "dte/exec/cuda.cuh is the CUDA backend: compile it with nvcc and link dte::cuda"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dte/audit.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/exec/cuda_executor.hpp"
#include "dte/exec/element_kernels.hpp"
#include "dte/exec/simt.cuh"
#include "dte/numeric/fp32.hpp"
#include "dte/reconstruction.hpp"

namespace dte::cuda {

// What classify and audit need of an optimizer inverse's per-element functor (P::kernel).
template <class K>
concept inverse_kernel = std::is_trivially_copyable_v<K> && requires(const K& k, std::size_t i) {
  { k(i) } -> std::same_as<Reconstruction>;
  { k.current(i) } -> std::same_as<float>;
  { k.size() } -> std::same_as<std::size_t>;
};

// Launch shape of the per-element passes: 256-thread blocks, as many as are resident on every SM
// at once (detail::grid_blocks), then a grid-stride loop, so any size (beyond 2^31 included)
// runs with one launch, in one wave.
struct ElementwiseLaunch {
  static constexpr int block_threads = 256;
};

namespace detail {

// The grid of a grid-stride kernel over `threads` threads' worth of work: the blocks of
// block_threads that every SM of the current device holds at once for this kernel (the occupancy
// API: its registers and shared memory decide, e.g. 6 blocks of 256 at 40 registers on sm_90),
// never more than the work needs, at least one.
template <class KernelFunction>
unsigned grid_blocks(KernelFunction kernel, std::size_t threads,
                     int block_threads = ElementwiseLaunch::block_threads,
                     std::size_t shared_bytes = 0) {
  int device = 0;
  DTE_CUDA_TRY(cudaGetDevice(&device));
  int sms = 0;
  DTE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 0;
  DTE_CUDA_TRY(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, shared_bytes));
  const auto block = static_cast<std::size_t>(block_threads);
  const std::size_t needed = (threads + block - 1) / block;
  const std::size_t resident =
      static_cast<std::size_t>(std::max(sms, 1)) * static_cast<std::size_t>(std::max(per_sm, 1));
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(needed, resident)));
}

// Refuses a pointer the current device cannot dereference (plain pageable host memory on a
// device without pageable memory access) before a kernel faults on it and loses the context.
inline void require_device_accessible(const char* who, const char* name, const void* p) {
  if (p == nullptr) {
    throw invalid_argument(std::string(who) + ": " + name +
                           " is null; pass device memory for every element of the shard");
  }
  cudaPointerAttributes attributes{};
  DTE_CUDA_TRY(cudaPointerGetAttributes(&attributes, p));
  if (attributes.type != cudaMemoryTypeUnregistered) return;
  int device = 0;
  DTE_CUDA_TRY(cudaGetDevice(&device));
  int pageable = 0;
  DTE_CUDA_TRY(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device));
  if (pageable != 0) return;
  throw invalid_argument(std::string(who) + ": " + name +
                         " points to ordinary host memory, which this GPU cannot read; copy the "
                         "data to device memory (cudaMalloc) or pin it (cudaHostRegister) first");
}

}  // namespace detail

// Writes Detect's verdict for every element of the shard k covers to d_out[0, k.size()).
// Asynchronous: enqueued on stream, nothing waits for it. An empty shard launches nothing.
template <change_detector Detect, inverse_kernel Kernel>
void classify(const Kernel& k, Verdict* d_out, cudaStream_t stream) {
  const std::size_t n = k.size();
  if (n == 0) return;
  detail::require_device_accessible("dte::cuda::classify", "d_out", d_out);
  using Body = detail::ClassifyElements<Detect, Kernel>;
  auto* const kernel = &simt::device::each_thread<ElementwiseLaunch::block_threads, Body>;
  kernel<<<detail::grid_blocks(kernel, n), ElementwiseLaunch::block_threads, 0, stream>>>(
      Body{k, d_out}, n);
  DTE_CUDA_TRY(cudaGetLastError());
}

// dte::audit_reconstruction on the device: d_theta_prev holds the k.size() true previous
// weights. Synchronises stream (the counts come back to the host).
template <change_detector Detect, inverse_kernel Kernel>
AuditCounts audit(const Kernel& k, const float* d_theta_prev, cudaStream_t stream) {
  const std::size_t n = k.size();
  if (n == 0) return {};
  detail::require_device_accessible("dte::cuda::audit", "d_theta_prev", d_theta_prev);

  using Body = detail::AuditElements<Detect, Kernel>;
  const detail::AuditTally identity = Body::identity();
  const exec::DeviceArray<detail::AuditTally> d_total =
      exec::DeviceArray<detail::AuditTally>::copy_of(exec::Cuda(stream), std::span(&identity, 1));
  auto* const kernel = &simt::device::each_reduce<ElementwiseLaunch::block_threads, Body>;
  kernel<<<detail::grid_blocks(kernel, n), ElementwiseLaunch::block_threads, 0, stream>>>(
      Body{k, d_theta_prev, d_total.data()}, n);
  DTE_CUDA_TRY(cudaGetLastError());
  detail::AuditTally total{};
  DTE_CUDA_TRY(
      cudaMemcpyAsync(&total, d_total.data(), sizeof total, cudaMemcpyDeviceToHost, stream));
  DTE_CUDA_TRY(cudaStreamSynchronize(stream));
  return detail::audit_counts(total, n);
}

}  // namespace dte::cuda

namespace dte {
using CudaExecutor = exec::Cuda;
}  // namespace dte
