// SPDX-License-Identifier: Apache-2.0
#pragma once

// DTE_HOST_DEVICE marks per-element logic shared by the host and CUDA backends.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define DTE_HOST_DEVICE __host__ __device__
#define DTE_HAS_CUDA_COMPILER 1
#else
#define DTE_HOST_DEVICE
#define DTE_HAS_CUDA_COMPILER 0
#endif

// A parallel loop on the host backend when OpenMP is enabled, a plain loop otherwise.
#if defined(_OPENMP)
#define DTE_PRAGMA(x) _Pragma(#x)
#define DTE_OMP(x) DTE_PRAGMA(omp x)
#else
#define DTE_OMP(x)
#endif

#define DTE_VERSION_MAJOR 0
#define DTE_VERSION_MINOR 1
#define DTE_VERSION_PATCH 0

namespace dte {
inline constexpr const char* version_string = "0.1.0";
}  // namespace dte
