// SPDX-License-Identifier: Apache-2.0
// Every HF tensor of a model as BF16 bits in host memory, as an HfReceiver holds them (NaN until
// the first publication): test_writers' and tests/cuda/test_cuda_publication's receivers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dte/layout/hf.hpp"

namespace dte::testing {

struct HfTensors {
  std::vector<std::vector<std::uint16_t>> data;
  std::vector<std::span<std::uint16_t>> views;
  explicit HfTensors(const layout::HfModel& hf) {
    for (std::int64_t t = 0; t < hf.size(); ++t)
      data.emplace_back(static_cast<std::size_t>(hf[t].numel()), 0x7FC0);
    for (auto& d : data)
      views.emplace_back(d);
  }
};

}  // namespace dte::testing
