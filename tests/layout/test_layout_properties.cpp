// SPDX-License-Identifier: Apache-2.0
// Property tests of the transfer plan over a grid of topologies on the tiny models:
//   * every canonical (HF) element is sent by exactly one trainer element (DP owners and TP/PP
//     replicas deduplicated);
//   * every receiver element that holds data is written exactly once per replica, and nothing
//     is written to the zero-filled vocabulary tail;
//   * the maps are consistent with their inverses (receiver -> canonical -> Megatron source).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "grid.hpp"

using namespace dte::layout;

TEST_CASE("tiny-qwen3: exact coverage over the topology grid") {
  const GridResult r = run_grid(model_preset("tiny-qwen3"), {1}, {1}, {1});
  std::printf("tiny-qwen3: %d topology pairs checked, %d failed\n", r.combos, r.failures);
  CHECK(r.combos >= 150);
  CHECK(r.failures == 0);
}

TEST_CASE("tiny-qwen3-moe: exact coverage over the topology grid") {
  const GridResult r = run_grid(model_preset("tiny-qwen3-moe"), {1, 2, 4}, {1, 2}, {1, 2});
  std::printf("tiny-qwen3-moe: %d topology pairs checked, %d failed\n", r.combos, r.failures);
  CHECK(r.combos >= 500);
  CHECK(r.failures == 0);
}

TEST_CASE("bucketed buffers and an explicit pipeline split keep coverage exact") {
  const ModelSpec m = model_preset("tiny-qwen3-moe");
  TrainTopology t = parse_train_topology("tp=2,pp=2,ep=2,etp=1,dp=3,split=3:1,bucket=5000");
  CHECK(t.layer_split == std::vector<std::int64_t>{3, 1});
  CHECK(check_combo(m, t, parse_infer_topology("tp=4,ep=2,replicas=2")));
  const ModelSpec d = model_preset("tiny-qwen3");
  CHECK(check_combo(d, parse_train_topology("tp=4,pp=2,dp=2,split=1:3,bucket=3000"),
                    parse_infer_topology("tp=8")));
}
