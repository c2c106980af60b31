// SPDX-License-Identifier: Apache-2.0
// The device senders on the host twin: DeltaEngine<..., sim::SimtHost> runs DeviceSenderRank and
// publication::Publisher<..., sim::SimtHost> runs DeviceChunkSender, as exec::Cuda does on a GPU
// (engine/device_sender.cuh, publication/device_sender.cuh), so the whole device path runs in CI.
#pragma once

#include "dte/concepts.hpp"
#include "dte/engine/device_receiver.hpp"
#include "dte/engine/device_sender.hpp"
#include "dte/engine/sender.hpp"
#include "dte/publication/device_sender.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/sim/simt_host.hpp"

namespace dte {
namespace detail {
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan>
struct sender_rank<Inverse, Detect, Plan, sim::SimtHost> {
  using type = DeviceSenderRank<Inverse, Detect, Plan, sim::SimtHost>;
};
}  // namespace detail

namespace publication::detail {
template <class Inverse, class Detect, class Plan>
struct publication_sender<Inverse, Detect, Plan, sim::SimtHost> {
  using type = DeviceChunkSender<Inverse, Detect, Plan, sim::SimtHost>;
};
}  // namespace publication::detail

namespace sim {
// A receiver rank's tensors in the host twin's memory.
using SimtHostTensors = BasicDeviceTensors<SimtHost>;
}  // namespace sim
}  // namespace dte
