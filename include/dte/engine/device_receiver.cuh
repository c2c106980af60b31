// SPDX-License-Identifier: Apache-2.0
// DeviceTensors: a receiver rank's tensors in GPU memory, as the TensorSink a Receiver commits to
// (engine/device_receiver.hpp over exec::Cuda's device ops, pipeline/device.cuh).
#pragma once

#if !defined(__CUDACC__)
#error "dte/engine/device_receiver.cuh is CUDA code: compile it with nvcc and link dte::cuda"
#endif

#include "dte/engine/device_receiver.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"

namespace dte {
using DeviceTensors = BasicDeviceTensors<exec::Cuda>;
}  // namespace dte
