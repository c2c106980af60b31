// SPDX-License-Identifier: Apache-2.0
// The encode step of the CUDA sender, as host code (tested in tests/engine/test_wire.cpp): one
// receiver's bucket of routed entries (tensor, index, bits; in shard order) appended to its
// message, each maximal sequence of consecutive indices of one tensor at least `min_run` long as
// dense runs (2 bytes per element, in pieces of at most 2^16), the rest as indexed entries.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "dte/engine/wire.hpp"

namespace dte::wire {

// The longest dense run the CUDA sender writes in one piece (the host sender's tile).
inline constexpr std::size_t dense_run_piece = std::size_t{1} << 16;

// Appends entries [first, first + count) of the arrays to w; returns how many went as indexed
// entries (the rest went in dense runs).
inline std::uint64_t encode_bucket(MessageWriter& w, std::span<const std::uint32_t> tensor,
                                   std::span<const std::uint32_t> index,
                                   std::span<const std::uint16_t> bits, std::size_t first,
                                   std::size_t count, std::size_t min_run) {
  std::uint64_t entries = 0;
  const std::size_t end = first + count;
  for (std::size_t k = first; k < end;) {
    std::size_t j = k + 1;
    while (j < end && tensor[j] == tensor[k] && index[j] == index[j - 1] + 1)
      ++j;
    if (j - k >= min_run) {
      for (std::size_t at = k; at < j; at += dense_run_piece)
        w.add_run(tensor[at], index[at], bits.subspan(at, std::min(j - at, dense_run_piece)));
    } else {
      for (std::size_t x = k; x < j; ++x)
        w.add(tensor[x], index[x], bits[x]);
      entries += j - k;
    }
    k = j;
  }
  return entries;
}

}  // namespace dte::wire
