// SPDX-License-Identifier: Apache-2.0
// The engine's sender on a GPU: DeltaEngine over exec::Cuda runs DeviceSenderRank
// (engine/device_sender.hpp) over exec::Cuda's device ops (pipeline/device.cuh).
#pragma once

#if !defined(__CUDACC__)
#error "dte/engine/device_sender.cuh is the CUDA sender: compile it with nvcc and link dte::cuda"
#endif

#include "dte/concepts.hpp"
#include "dte/engine/device_sender.hpp"
#include "dte/engine/sender.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"

namespace dte::detail {
// DeltaEngine over exec::Cuda: the device sender.
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
struct sender_rank<Inverse, Detect, Plan, exec::Cuda> {
  using type = DeviceSenderRank<Inverse, Detect, Plan, exec::Cuda>;
};
}  // namespace dte::detail
