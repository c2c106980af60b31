// SPDX-License-Identifier: Apache-2.0
// Counter-based randomness for the optimizer tests: element i's values depend on (seed, i) only,
// so data generation parallelises and every run sees the same elements.
#pragma once

#include <cmath>
#include <cstdint>

namespace dte::test {

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline double uniform(std::uint64_t key) {
  return static_cast<double>(mix(key) >> 11) * 0x1.0p-53;
}
inline double normal(std::uint64_t key) {
  const double u1 = uniform(key * 2 + 1) + 0x1.0p-54, u2 = uniform(key * 2 + 2);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// A stream of draws from one key.
class Draws {
 public:
  explicit Draws(std::uint64_t key) : state_(mix(key)) {}
  std::uint64_t bits() { return mix(state_++); }
  double unit() { return static_cast<double>(bits() >> 11) * 0x1.0p-53; }  // [0, 1)
  double between(double lo, double hi) { return lo + (hi - lo) * unit(); }
  // Log-uniform magnitude in [lo, hi] (lo > 0).
  double log_uniform(double lo, double hi) {
    return std::exp(std::log(lo) + (std::log(hi) - std::log(lo)) * unit());
  }
  double sign() { return (bits() & 1) ? -1.0 : 1.0; }
  double gauss() {
    const double u1 = unit() + 0x1.0p-54, u2 = unit();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  bool chance(double p) { return unit() < p; }
  unsigned below(unsigned n) { return static_cast<unsigned>(bits() % n); }

 private:
  std::uint64_t state_;
};

}  // namespace dte::test
