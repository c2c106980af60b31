// SPDX-License-Identifier: Apache-2.0
// A publisher's sender on a GPU: publication::Publisher over exec::Cuda runs DeviceChunkSender
// (publication/device_sender.hpp) over exec::Cuda's device ops (pipeline/device.cuh).
#pragma once

#if !defined(__CUDACC__)
#error \
    "dte/publication/device_sender.cuh is the CUDA publication sender: compile it with nvcc and link dte::cuda"
#endif

#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"
#include "dte/publication/device_sender.hpp"
#include "dte/publication/publisher.hpp"

namespace dte::publication::detail {
// Publisher over exec::Cuda: the device sender.
template <class Inverse, class Detect, class Plan>
struct publication_sender<Inverse, Detect, Plan, exec::Cuda> {
  using type = DeviceChunkSender<Inverse, Detect, Plan, exec::Cuda>;
};
}  // namespace dte::publication::detail
