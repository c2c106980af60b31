// SPDX-License-Identifier: Apache-2.0
// A full message that writes every live element of some of one receiver's tensors with one
// value: how benchmarks and tests bring receivers they own to a first version without a
// trainer (a receiver commits a full publication only when it writes every live element).
#pragma once

#include <cstdint>
#include <vector>

#include "dte/core/message.hpp"
#include "dte/engine/wire.hpp"
#include "dte/layout/serving.hpp"

namespace dte::sim {

// Tensors `tensors` of receiver TP rank ts, every live element = bits (no tensors: a bare
// full header).
inline wire::Message full_message(const layout::ServingLayout& layout, std::int64_t ts, Version v,
                                  std::uint16_t bits, const std::vector<std::int64_t>& tensors) {
  wire::Message m;
  m.kind = MessageKind::full;
  m.version = v;
  for (std::int64_t k : tensors) {
    const std::int64_t n = layout.live_end(ts, k);
    if (n > 0) {
      m.runs.push_back({static_cast<std::uint32_t>(k), 0,
                        std::vector<std::uint16_t>(static_cast<std::size_t>(n), bits)});
    }
  }
  return m;
}

// Every tensor of receiver TP rank ts.
inline wire::Message full_message(const layout::ServingLayout& layout, std::int64_t ts, Version v,
                                  std::uint16_t bits) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(layout.size()));
  for (std::int64_t k = 0; k < layout.size(); ++k)
    all[static_cast<std::size_t>(k)] = k;
  return full_message(layout, ts, v, bits, all);
}

}  // namespace dte::sim
