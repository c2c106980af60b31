// SPDX-License-Identifier: Apache-2.0
// Real shapes: plans for Qwen3-8B and Qwen3-30B-A3B are built without allocating any weight,
// cover exactly, and hold at most 1% of their rank's weight bytes. (Build time is reported here
// and measured by bench/bench_plan.cpp; it is not asserted.)
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "dte/layout/coverage.hpp"
#include "dte/layout/plan.hpp"

using namespace dte::layout;

namespace {

void check_real(const char* model, const char* train_spec, const char* infer_spec) {
  const ModelSpec m = model_preset(model);
  const TrainTopology t = parse_train_topology(train_spec);
  const InferTopology inf = parse_infer_topology(infer_spec);
  validate(m, t);
  validate(m, inf);
  const HfModel hf(m);
  const ServingLayout recv(hf, inf);
  std::vector<TransferPlan> plans;
  double worst_seconds = 0.0, worst_fraction = 0.0;
  for (std::int64_t g = 0; g < t.world(); ++g) {
    const auto t0 = std::chrono::steady_clock::now();
    plans.emplace_back(hf, t, g);
    worst_seconds =
        std::max(worst_seconds,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::int64_t weight_bytes = 0;
    for (const MegatronParam& p : plans.back().params())
      weight_bytes += 2 * p.numel();
    const double fraction = static_cast<double>(plans.back().bytes()) / weight_bytes;
    worst_fraction = std::max(worst_fraction, fraction);
    CHECK(fraction <= 0.01);
  }
  const CoverageReport cov = check_coverage(hf, recv, plans);
  std::printf(
      "%s train %s -> infer %s: %lld ranks, coverage %s, plan <= %.6f%% of rank weights, "
      "slowest rank build %.6f s\n",
      model, train_spec, infer_spec, static_cast<long long>(t.world()),
      cov.exact ? "exact" : cov.problem.c_str(), 100.0 * worst_fraction, worst_seconds);
  CHECK(cov.exact);
  CHECK(cov.canonical_elements == cov.sender_elements);
  CHECK(cov.receiver_elements == cov.receiver_writes);
}

}  // namespace

TEST_CASE("Qwen3-8B: train tp=4,pp=2,dp=4 -> infer tp=2,replicas=4") {
  check_real("qwen3-8b", "tp=4,pp=2,dp=4", "tp=2,replicas=4");
}

TEST_CASE("Qwen3-8B: bucketed buffers, train tp=8,dp=2 -> infer tp=8") {
  check_real("qwen3-8b", "tp=8,dp=2,bucket=40000000", "tp=8");
}

TEST_CASE("Qwen3-30B-A3B: train tp=4,ep=8,etp=1,dp=2 -> infer tp=8,ep=8") {
  check_real("qwen3-30b-a3b", "tp=4,ep=8,etp=1,dp=2", "tp=8,ep=8");
}

TEST_CASE("Qwen3-30B-A3B: train tp=4,pp=2,ep=8,etp=1,dp=4 -> infer tp=8,ep=8,replicas=2") {
  check_real("qwen3-30b-a3b", "tp=4,pp=2,ep=8,etp=1,dp=4", "tp=8,ep=8,replicas=2");
}
