// SPDX-License-Identifier: Apache-2.0
// Transfer plans at real scale: building one trainer rank's plan, and routing elements of its
// shard (locate + MegatronToHF + receiver targets) — what the sender does per changed element.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "dte/layout/plan.hpp"

namespace {

using namespace dte::layout;

struct Case {
  const char* model;
  const char* train;
  const char* infer;
};

const Case kCases[] = {
    {"qwen3-8b", "tp=4,pp=2,dp=4", "tp=2,replicas=4"},
    {"qwen3-30b-a3b", "tp=4,ep=8,etp=1,dp=2", "tp=8,ep=8"},
};

void BM_plan_build(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const HfModel hf(model_preset(c.model));
  const TrainTopology t = parse_train_topology(c.train);
  const ServingLayout recv(hf, parse_infer_topology(c.infer));
  std::int64_t rank = 0;
  for (auto _ : state) {
    TransferPlan plan(hf, t, rank);
    benchmark::DoNotOptimize(plan.segments(BufferKind::dense).data());
    rank = (rank + 1) % t.world();
  }
  state.SetLabel(std::string(c.model) + " " + c.train);
}

void BM_route(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const HfModel hf(model_preset(c.model));
  const TrainTopology t = parse_train_topology(c.train);
  const ServingLayout recv(hf, parse_infer_topology(c.infer));
  const TransferPlan plan(hf, t, 0);
  const BufferKind b = hf.spec().moe() ? BufferKind::expert : BufferKind::dense;
  std::mt19937_64 rng(1);
  std::vector<std::int64_t> offsets(1 << 16);
  for (auto& o : offsets)
    o = static_cast<std::int64_t>(rng() % plan.shard_size(b));
  std::int64_t sum = 0;
  for (auto _ : state) {
    for (std::int64_t o : offsets) {
      route_canonical(recv, plan.canonical(b, o), [&](const RouteTarget& rt) { sum += rt.index; });
    }
  }
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * offsets.size()));
  state.SetLabel(std::string(c.model) + " " + c.train + " -> " + c.infer);
}

}  // namespace

BENCHMARK(BM_plan_build)->DenseRange(0, 1);
BENCHMARK(BM_route)->DenseRange(0, 1);
BENCHMARK_MAIN();
