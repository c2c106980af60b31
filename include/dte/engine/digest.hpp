// SPDX-License-Identifier: Apache-2.0
// The verified-sync digest (shared/DESIGN.md §5): D = sum over elements of h(canonical, bits)
// mod 2^64. Position-aware (h mixes the canonical index with the stored bits), order-independent
// and additive, so it splits across any sharding: trainer ranks add their parts, a receiver
// updates its own by subtracting what it overwrites and adding what it writes.
#pragma once

#include <cstdint>

#include "dte/config.hpp"

namespace dte {

namespace detail {
DTE_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace detail

// h(canonical, bits), shifted so that h(c, +0) = 0: a zero-filled tensor has digest 0, which
// lets a receiver start from zeros without a pass over its memory. Canonical indices < 2^48.
DTE_HOST_DEVICE inline std::uint64_t element_digest(std::int64_t canonical,
                                                    std::uint16_t bits) noexcept {
  const std::uint64_t key = static_cast<std::uint64_t>(canonical) << 16;
  return detail::mix64(key | bits) - detail::mix64(key);
}

}  // namespace dte
