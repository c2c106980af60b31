// SPDX-License-Identifier: Apache-2.0
// The pipeline's device stages on a GPU: pipeline/device_stages.hpp (detect, compact, route,
// bucket, apply, gather; host code written once for every device executor) over exec::Cuda's
// ops (exec/cuda_device_ops.cuh: the kernel launches, CUB, the stream's copies). Include this
// from a .cu file; the same stages run on the host in CI over dte/sim/simt_host.hpp.
#pragma once

#if !defined(__CUDACC__)
#error "dte/pipeline/device.cuh is the CUDA pipeline: compile it with nvcc and link dte::cuda"
#endif

#include "dte/exec/cuda_device_ops.cuh"
#include "dte/pipeline/device_stages.hpp"
