// SPDX-License-Identifier: Apache-2.0
// Stage 2, compact: the elements the detect stage flagged, as their offsets and the 16-bit
// bits the receivers will store (on the host one pass per tile into tile-sized buffers; CUB's
// DeviceSelect on the CUDA backend).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "dte/concepts.hpp"

namespace dte::pipeline {

// For every set bit j of words[0, ceil(n / 64)) (bits at and beyond n must be clear): offsets[k]
// = j and bits[k] = Detect::store(theta[j]), in increasing j. Returns the number written; the
// caller sizes offsets and bits for every bit that can be set.
template <change_detector Detect>
std::size_t compact(const std::uint64_t* words, std::size_t n, const float* theta,
                    std::uint32_t* offsets, std::uint16_t* bits) noexcept {
  std::size_t k = 0;
  const std::size_t n_words = (n + 63) / 64;
  for (std::size_t w = 0; w < n_words; ++w) {
    std::uint64_t m = words[w];
    while (m != 0) {
      const auto j =
          static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(m)));
      offsets[k] = j;
      bits[k] = Detect::store(theta[j]);
      ++k;
      m &= m - 1;
    }
  }
  return k;
}

// The same, the offsets only (the caller reads each bit's value where it lives).
inline std::size_t compact_offsets(const std::uint64_t* words, std::size_t n,
                                   std::uint32_t* offsets) noexcept {
  std::size_t k = 0;
  const std::size_t n_words = (n + 63) / 64;
  for (std::size_t w = 0; w < n_words; ++w) {
    for (std::uint64_t m = words[w]; m != 0; m &= m - 1)
      offsets[k++] =
          static_cast<std::uint32_t>(w * 64 + static_cast<std::size_t>(std::countr_zero(m)));
  }
  return k;
}

}  // namespace dte::pipeline
