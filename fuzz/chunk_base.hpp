// SPDX-License-Identifier: Apache-2.0
// The base the chunk fuzzer resolves class indices against (storage/class_index.hpp), and the
// seed generator codes its class-index seed for: a fixed pattern of bits per position over 16
// classes, so mutated class indices reach every check of the resolution.
#pragma once

#include <cstdint>

#include "dte/storage/chunk.hpp"

namespace dte::fuzz {

// A quarter of the positions in class 127 (values in [1, 2)), the rest spread over 112 .. 126.
inline std::uint16_t pattern_bits(std::int64_t tensor, std::uint64_t i) {
  std::uint64_t h = (i + 7 * static_cast<std::uint64_t>(tensor)) * 0x9E3779B97F4A7C15ull;
  h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9ull;  // (splitmix64's mixing: no pattern in the bits)
  h ^= h >> 29;
  const auto low = static_cast<std::uint16_t>((h >> 32) & 0x7F);
  if (((h >> 60) & 3u) == 0) return static_cast<std::uint16_t>(0x3F80 | low);
  return static_cast<std::uint16_t>(0x3800 + (((h >> 40) % 15) << 7) + low);
}

class PatternBase final : public storage::ClassBase {
 public:
  void bits(std::int64_t tensor, std::uint64_t start, std::uint64_t count,
            std::uint16_t* out) const override {
    for (std::uint64_t i = 0; i < count; ++i)
      out[i] = pattern_bits(tensor, start + i);
  }
};

}  // namespace dte::fuzz
