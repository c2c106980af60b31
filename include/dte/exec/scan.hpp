// SPDX-License-Identifier: Apache-2.0
// The executors' exclusive_scan over small host arrays (per-tile, per-receiver counts): one
// sequential loop, shared by exec::Host and exec::Cuda.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace dte::exec::detail {

// out[i] = in[0] + ... + in[i - 1]; returns the total.
inline std::uint64_t exclusive_scan(std::span<const std::uint64_t> in,
                                    std::span<std::uint64_t> out) noexcept {
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    out[i] = sum;
    sum += in[i];
  }
  return sum;
}

}  // namespace dte::exec::detail
