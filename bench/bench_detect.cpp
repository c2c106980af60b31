// SPDX-License-Identifier: Apache-2.0
// The detect pass on the host backend: reconstruct + round + compare + guard band, per element,
// for each optimizer inverse, against the snapshot baseline that reads a 2-byte shadow instead.
// Reports items and bytes processed (the bytes each policy must read per element).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "dte/dte.hpp"

namespace {

struct Data {
  std::vector<float> theta, m, v;
  explicit Data(std::size_t n) : theta(n), m(n), v(n) {
    std::mt19937 rng(1);
    std::normal_distribution<float> w(0.0f, 0.02f), g(0.0f, 1e-3f);
    for (std::size_t i = 0; i < n; ++i) {
      theta[i] = w(rng);
      const float gi = g(rng);
      m[i] = 0.1f * gi;
      v[i] = 0.001f * gi * gi;
    }
  }
};

template <class Kernel>
std::size_t count_changed(const Kernel& k) {
  std::size_t changed = 0;
  const std::size_t n = k.size();
  DTE_OMP(parallel for reduction(+ : changed) schedule(static))
  for (std::size_t i = 0; i < n; ++i)
    changed += dte::BF16Detect::changed(k.current(i), k(i));
  return changed;
}

void set_counters(benchmark::State& state, std::size_t n, std::size_t bytes_per_element) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * bytes_per_element));
}

void BM_detect_adamw(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const Data d(n);
  const auto k =
      dte::AdamWInverse::bind({.lr = 1e-6, .weight_decay = 0.01, .step = 10}, d.theta, {d.m, d.v});
  for (auto _ : state)
    benchmark::DoNotOptimize(count_changed(k));
  set_counters(state, n, 12);  // theta, m, v
}

void BM_detect_sgd_momentum(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const Data d(n);
  const auto k = dte::SgdMomentumInverse::bind({.lr = 1e-3, .momentum = 0.9}, d.theta, {d.m});
  for (auto _ : state)
    benchmark::DoNotOptimize(count_changed(k));
  set_counters(state, n, 8);  // theta, buffer
}

void BM_detect_snapshot(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const Data d(n);
  const dte::SnapshotBase::Shadow shadow(d.m);  // any other values: a dense diff
  const auto k = dte::SnapshotBase::bind({}, d.theta, shadow.view());
  for (auto _ : state)
    benchmark::DoNotOptimize(count_changed(k));
  set_counters(state, n, 6);  // theta, 2-byte shadow
}

}  // namespace

BENCHMARK(BM_detect_adamw)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime();
BENCHMARK(BM_detect_sgd_momentum)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime();
BENCHMARK(BM_detect_snapshot)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime();
BENCHMARK_MAIN();
