// SPDX-License-Identifier: Apache-2.0
// The verified-sync digest (shared/DESIGN.md §5): D = sum over elements of h(canonical, bits)
// mod 2^32, per canonical tensor. Position-aware (h mixes the canonical index with the stored
// bits), order-independent and additive, so it splits across any sharding: trainer ranks add
// their parts, a receiver updates its own by subtracting what it overwrites and adding what it
// writes.
//
// h is a 32-bit hash built for the vector units (32-bit multiplies only: it is evaluated for
// every element of every publication in the detect pass): the canonical index is folded to a
// 32-bit key, XORed with the bits, and finished with lowbias32 (two multiplies). (A receiver's
// digest is rebuilt from what a full publication writes, so no value needs a zero term.) For a
// fixed position, distinct bit patterns give distinct pre-mix words and the finisher is a
// bijection, so a single wrong element always changes its term; any set of wrong, lost or
// replayed elements goes unnoticed only when their terms cancel mod 2^32, which for hashed terms
// has probability about 2^-32 per tensor and publication. A mismatch names the tensor and
// triggers its dense repair.
#pragma once

#include <cstdint>

#include "dte/config.hpp"

namespace dte {

namespace detail {

// The position key of a canonical index (< 2^48), additive in the index: over consecutive
// elements of a run it advances by a constant (the vectorised detect stage adds it per lane).
DTE_HOST_DEVICE constexpr std::uint32_t digest_key(std::int64_t canonical) noexcept {
  const auto c = static_cast<std::uint64_t>(canonical);
  return static_cast<std::uint32_t>(c) * 0x9E3779B1u +
         static_cast<std::uint32_t>(c >> 32) * 0x85EBCA77u;
}

// key XOR the bits (in the high half: where BF16 rounding leaves them), then lowbias32 (a
// bijection of 32-bit words with strong avalanche, two multiplies).
DTE_HOST_DEVICE constexpr std::uint32_t digest_mix(std::uint32_t key, std::uint16_t bits) noexcept {
  std::uint32_t x = key ^ (static_cast<std::uint32_t>(bits) << 16);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

}  // namespace detail

// Digests are sums of 32-bit terms modulo 2^32 (unsigned wraparound): as strong as a 64-bit sum
// of them (a wrong set of terms cancels with probability about 2^-32 either way), and the
// vector units add them lane by lane.
using Digest = std::uint32_t;

// h(canonical, bits).
DTE_HOST_DEVICE constexpr Digest element_digest(std::int64_t canonical,
                                                std::uint16_t bits) noexcept {
  return detail::digest_mix(detail::digest_key(canonical), bits);
}

}  // namespace dte
