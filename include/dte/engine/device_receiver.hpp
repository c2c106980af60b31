// SPDX-License-Identifier: Apache-2.0
// BasicDeviceTensors<E>: a receiver rank's tensors in the memory of device executor E (the
// inference engine's own BF16 weights, caller-owned), as the TensorSink a Receiver commits to
// (engine/receiver.hpp). DeviceTensors is the one on exec::Cuda (engine/device_receiver.cuh);
// CI runs the same class on the host twin (dte/sim/simt_host.hpp). The
// Receiver checks every publication on the host exactly as for host tensors; a committed one's
// writes are copied to the device once and applied by the device stage
// (pipeline::device::apply_entries: check, scatter, digest by what is overwritten and written),
// and the digest the engine verifies is read back from the device.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/engine/receiver.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/pipeline/device_stages.hpp"
#include "dte/pipeline/device_tables.hpp"

namespace dte {

template <device_executor E>
class BasicDeviceTensors : public TensorSink {
 public:
  using Ops = exec::device_ops<E>;

  // tensors[k]: receiver tensor k of `layout` on receiver rank `rank` (layout[k].numel 16-bit
  // elements of device memory, in ServingLayout order).
  BasicDeviceTensors(const layout::HfModel& hf, const layout::ServingLayout& layout,
                     std::int64_t rank, std::vector<std::uint16_t*> tensors, E e = {})
      : exec_(e) {
    if (static_cast<std::int64_t>(tensors.size()) != layout.size()) {
      throw invalid_argument(
          "DeviceTensors: given " + std::to_string(tensors.size()) + " tensors, the layout has " +
          std::to_string(layout.size()) +
          "; pass one device pointer per receiver tensor, in ServingLayout order");
    }
    std::vector<std::uint64_t> live;
    const std::int64_t ts = rank % layout.topology().tp;
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      if (layout[k].numel > 0) {
        Ops::check_readable("dte::DeviceTensors", layout.name(k).c_str(),
                            tensors[static_cast<std::size_t>(k)]);
      }
      live.push_back(static_cast<std::uint64_t>(layout.live_end(ts, k)));
    }
    rx_ = pipeline::device::DeviceReceiver<E>(exec_, tensors, live,
                                              pipeline::ReceiverSourceTable(hf, layout, rank),
                                              static_cast<std::size_t>(hf.size()));
    exec_.synchronize();
  }

  void commit(const receive::StagedWrites& w) override {
    if (w.full() && rx_.digest.size() != 0) {
      exec_.fill(rx_.digest.data(), 0, rx_.digest.bytes());
    }
    // (tensor, index, bits) per write
    std::vector<std::uint32_t> tensors, indices;
    std::vector<std::uint16_t> values;
    tensors.reserve(w.size());
    indices.reserve(w.size());
    values.reserve(w.size());
    w.for_each([&](std::uint32_t t, std::uint32_t i, std::uint16_t b) {
      tensors.push_back(t);
      indices.push_back(i);
      values.push_back(b);
    });
    const auto tensor = pipeline::device::Array<E, std::uint32_t>::copy_of(exec_, tensors);
    const auto index = pipeline::device::Array<E, std::uint32_t>::copy_of(exec_, indices);
    const auto bits = pipeline::device::Array<E, std::uint16_t>::copy_of(exec_, values);
    pipeline::device::apply_entries(exec_, rx_, tensor.data(), index.data(), bits.data(), w.size(),
                                    w.full());
    exec_.synchronize();  // the tensors hold the version once commit returns
  }

  [[nodiscard]] std::vector<Digest> digest() const override { return rx_.digest.to_host(); }

 private:
  E exec_;
  pipeline::device::DeviceReceiver<E> rx_;
};

}  // namespace dte
