// SPDX-License-Identifier: Apache-2.0
// The encodings other tools publish sparse BF16 deltas in, for side-by-side measurements on the
// same deltas (bench/bench_storage.cpp, `dte bench compare`). One canonical tensor's delta is
// its sorted indices in the unsharded HF tensor and the new BF16 bits.
//   AReaL-DTE: int32 indices, then BF16 values.
//   PULSE:     index gaps (distance from the element after the previous one) in u8, escaping
//              (255) to u16 and (65535) to u32, then BF16 values.
// A whole version is the concatenation of its tensors' encodings; both tools compress it with
// zstd level 1 (zstd1()).
#pragma once

#include <zstd.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

namespace dte::sim::baselines {

inline void put16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v));
  out.push_back(static_cast<std::uint8_t>(v >> 8));
}
inline void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int b = 0; b < 4; ++b)
    out.push_back(static_cast<std::uint8_t>(v >> (8 * b)));
}

inline void areal_append(std::vector<std::uint8_t>& out, std::span<const std::uint32_t> index,
                         std::span<const std::uint16_t> bits) {
  for (std::uint32_t i : index)
    put32(out, i);
  for (std::uint16_t b : bits)
    put16(out, b);
}

inline void pulse_append(std::vector<std::uint8_t>& out, std::span<const std::uint32_t> index,
                         std::span<const std::uint16_t> bits) {
  std::uint64_t next = 0;
  for (std::uint32_t i : index) {
    const std::uint64_t gap = i - next;
    if (gap < 255) {
      out.push_back(static_cast<std::uint8_t>(gap));
    } else if (gap < 65535) {
      out.push_back(255);
      put16(out, static_cast<std::uint16_t>(gap));
    } else {
      out.push_back(255);
      put16(out, 65535);
      put32(out, static_cast<std::uint32_t>(gap));
    }
    next = std::uint64_t{i} + 1;
  }
  for (std::uint16_t b : bits)
    put16(out, b);
}

// Decodes one tensor of `count` entries of a PULSE stream from `at` (advanced past it) into
// index and bits (appended). Throws std::runtime_error on a truncated stream.
inline void pulse_read(std::span<const std::uint8_t> in, std::size_t& at, std::size_t count,
                       std::vector<std::uint32_t>& index, std::vector<std::uint16_t>& bits) {
  auto need = [&](std::size_t n) {
    if (in.size() - at < n) throw std::runtime_error("PULSE stream truncated");
  };
  std::uint64_t next = 0;
  for (std::size_t k = 0; k < count; ++k) {
    need(1);
    std::uint64_t gap = in[at++];
    if (gap == 255) {
      need(2);
      gap = in[at] | (std::uint64_t{in[at + 1]} << 8);
      at += 2;
      if (gap == 65535) {
        need(4);
        gap = 0;
        for (int b = 0; b < 4; ++b)
          gap |= std::uint64_t{in[at + static_cast<std::size_t>(b)]} << (8 * b);
        at += 4;
      }
    }
    next += gap;
    index.push_back(static_cast<std::uint32_t>(next));
    ++next;
  }
  need(2 * count);
  for (std::size_t k = 0; k < count; ++k, at += 2)
    bits.push_back(static_cast<std::uint16_t>(in[at] | (in[at + 1] << 8)));
}

inline std::vector<std::uint8_t> zstd1(std::span<const std::uint8_t> plain) {
  std::vector<std::uint8_t> out(ZSTD_compressBound(plain.size()));
  const std::size_t n = ZSTD_compress(out.data(), out.size(), plain.data(), plain.size(), 1);
  if (ZSTD_isError(n)) throw std::runtime_error(std::string("zstd: ") + ZSTD_getErrorName(n));
  out.resize(n);
  return out;
}

inline std::vector<std::uint8_t> unzstd(std::span<const std::uint8_t> packed) {
  const unsigned long long n = ZSTD_getFrameContentSize(packed.data(), packed.size());
  if (n == ZSTD_CONTENTSIZE_ERROR || n == ZSTD_CONTENTSIZE_UNKNOWN || n > (1ull << 40)) {
    throw std::runtime_error("zstd: no content size in the frame");
  }
  std::vector<std::uint8_t> out(static_cast<std::size_t>(n));
  const std::size_t got = ZSTD_decompress(out.data(), out.size(), packed.data(), packed.size());
  if (ZSTD_isError(got) || got != out.size()) throw std::runtime_error("zstd: corrupt frame");
  return out;
}

}  // namespace dte::sim::baselines
