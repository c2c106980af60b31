// SPDX-License-Identifier: Apache-2.0
// The compile-time path for CUDA-aware MPI: CudaAwareMpiTwoRound receives messages straight
// into device memory (cudaMalloc'd buffers), and its senders may hand it payload spans in
// device memory; no host staging on either side. Requires an MPI built with CUDA support
// (Open MPI: MPIX_Query_cuda_support()), checked when the transport is constructed.
// Compiled in CI with nvcc; not yet run (no GPU, no CUDA-aware MPI there).
#pragma once

#if !defined(__CUDACC__)
#error "dte/transport/mpi_cuda.cuh needs nvcc: link dte::cuda and dte::mpi"
#endif

#include <cuda_runtime.h>
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <cstddef>
#include <memory>

#include "dte/exec/cuda.cuh"
#include "dte/transport/mpi.hpp"

namespace dte {

struct CudaDeviceMemory {
  struct Free {
    void operator()(std::byte* p) const noexcept { cudaFree(p); }
  };
  struct buffer {
    std::unique_ptr<std::byte, Free> bytes;
    std::size_t length = 0;
    [[nodiscard]] std::size_t size() const noexcept { return length; }
  };
  static buffer allocate(std::size_t n) {
    void* p = nullptr;
    if (n > 0) DTE_CUDA_TRY(cudaMalloc(&p, n));
    return {std::unique_ptr<std::byte, Free>(static_cast<std::byte*>(p)), n};
  }
  static std::byte* data(buffer& b) noexcept { return b.bytes.get(); }
};

// Whether the MPI library can read and write device memory.
inline bool mpi_is_cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

class CudaAwareMpiTwoRound : public BasicMpiTwoRound<CudaDeviceMemory> {
 public:
  CudaAwareMpiTwoRound(MPI_Comm comm, int senders, int receivers, MpiTwoRoundConfig cfg = {})
      : BasicMpiTwoRound<CudaDeviceMemory>(comm, senders, receivers, cfg) {
    if (!mpi_is_cuda_aware()) {
      throw unsupported(
          "CudaAwareMpiTwoRound: this MPI library is not CUDA-aware (it cannot "
          "read or write device memory); use MpiTwoRound with host buffers, or an "
          "MPI built with CUDA support");
    }
  }
};

}  // namespace dte
