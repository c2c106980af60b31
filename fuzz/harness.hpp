// SPDX-License-Identifier: Apache-2.0
// What every harness shares: a property failure aborts with its message (libFuzzer then keeps
// the input as a crash), and the bytes of an input as a string or a byte vector.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define DTE_FUZZ_REQUIRE(cond)                                                         \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

namespace dte::fuzz {

inline std::string text(const std::uint8_t* data, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

inline std::vector<std::byte> bytes(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> b(size);
  for (std::size_t i = 0; i < size; ++i)
    b[i] = static_cast<std::byte>(data[i]);
  return b;
}

}  // namespace dte::fuzz
