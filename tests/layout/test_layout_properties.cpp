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
#include "dte/layout/sglang.hpp"
#include "dte/layout/topology.hpp"

using namespace dte::layout;

namespace {

struct GridResult {
  int combos = 0;
  int failures = 0;
};

std::string describe(const TrainTopology& t, const InferTopology& i) {
  return "train tp=" + std::to_string(t.tp) + ",pp=" + std::to_string(t.pp) +
         ",ep=" + std::to_string(t.ep) + ",etp=" + std::to_string(t.etp) +
         ",dp=" + std::to_string(t.dp) + " infer tp=" + std::to_string(i.tp) +
         ",ep=" + std::to_string(i.ep) + ",replicas=" + std::to_string(i.replicas);
}

bool valid(const ModelSpec& m, const TrainTopology& t, const InferTopology& i) {
  try {
    validate(m, t);
    validate(m, i);
    return true;
  } catch (const dte::invalid_argument&) {
    return false;
  }
}

// Returns false (and reports) on the first violated property.
bool check_combo(const ModelSpec& m, const TrainTopology& t, const InferTopology& inf) {
  const HfModel hf(m);
  const SglangLayout recv(hf, inf);
  std::vector<std::uint8_t> sent(static_cast<std::size_t>(hf.total()), 0);
  // Per receiver rank, per tensor: how often each element was written.
  std::vector<std::vector<std::vector<std::uint8_t>>> written(
      static_cast<std::size_t>(inf.ranks()));
  for (auto& rank : written) {
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      rank.emplace_back(static_cast<std::size_t>(recv[k].numel), 0);
    }
  }
  bool ok = true;
  auto fail = [&](const std::string& what) {
    if (ok) MESSAGE(m.name << " " << describe(t, inf) << ": " << what);
    ok = false;
  };
  for (std::int64_t g = 0; g < t.world() && ok; ++g) {
    const TransferPlan plan(hf, t, recv, g);
    for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
      for (std::int64_t o = 0; o < plan.shard_size(b) && ok; ++o) {
        const Canonical c = plan.canonical(b, o);
        if (c.tensor < 0) continue;
        if (++sent[static_cast<std::size_t>(hf[c.tensor].base + c.index)] != 1) {
          fail("canonical " + hf.name(c.tensor) + "[" + std::to_string(c.index) +
               "] sent twice (rank " + std::to_string(g) + ")");
        }
        // The inverse names this rank's coordinates and parameter index.
        const MegatronSource s = megatron_source(hf, t, c);
        const PlanSegment* seg = plan.locate(b, o);
        const MegatronParam& p = plan.params()[static_cast<std::size_t>(seg->param)];
        const TrainRank& r = plan.rank();
        const bool expert = p.is_expert();
        if (s.kind != p.kind || s.pp != r.pp ||
            s.index != seg->param_begin + (o - seg->shard_begin) ||
            (expert ? (s.te != r.te || s.em != r.em || s.local_expert != p.local_expert)
                    : s.tm != r.tm) ||
            (p.local_layer >= 0 && s.local_layer != p.local_layer)) {
          fail("megatron_source disagrees for " + hf.name(c.tensor) + "[" +
               std::to_string(c.index) + "] from " + p.name());
        }
        plan.route(b, o, [&](const RouteTarget& rt) {
          auto& cell =
              written[static_cast<std::size_t>(rt.rank)][static_cast<std::size_t>(rt.tensor)]
                     [static_cast<std::size_t>(rt.index)];
          if (++cell != 1) fail("receiver " + recv.name(rt.tensor) + " written twice");
          const Canonical back = recv.source({rt.rank % inf.tp, rt.tensor, rt.index});
          if (!(back == c))
            fail("receiver source() is not the inverse for " + recv.name(rt.tensor));
        });
      }
    }
  }
  for (std::size_t i = 0; i < sent.size() && ok; ++i) {
    if (sent[i] != 1) fail("canonical element " + std::to_string(i) + " never sent");
  }
  for (std::int64_t rr = 0; rr < inf.ranks() && ok; ++rr) {
    for (std::int64_t k = 0; k < recv.size() && ok; ++k) {
      const auto& cells = written[static_cast<std::size_t>(rr)][static_cast<std::size_t>(k)];
      for (std::size_t i = 0; i < cells.size(); ++i) {
        const bool live = recv.source({rr % inf.tp, k, static_cast<std::int64_t>(i)}).tensor >= 0;
        if (cells[i] != (live ? 1 : 0)) {
          fail("receiver rank " + std::to_string(rr) + " " + recv.name(k) + "[" +
               std::to_string(i) + "] written " + std::to_string(cells[i]) + " times");
          break;
        }
      }
    }
  }
  return ok;
}

GridResult run_grid(const ModelSpec& m, const std::vector<std::int64_t>& eps,
                    const std::vector<std::int64_t>& etps,
                    const std::vector<std::int64_t>& infer_eps) {
  GridResult res;
  for (std::int64_t tp : {1, 2, 4, 8})
    for (std::int64_t pp : {1, 2})
      for (std::int64_t ep : eps)
        for (std::int64_t etp : etps)
          for (std::int64_t dp : {1, 2, 3})
            for (std::int64_t itp : {1, 2, 4, 8})
              for (std::int64_t iep : infer_eps)
                for (std::int64_t rep : {1, 2}) {
                  TrainTopology t;
                  t.tp = tp, t.pp = pp, t.ep = ep, t.etp = etp, t.dp = dp;
                  InferTopology inf{itp, iep, rep};
                  if (!valid(m, t, inf)) continue;
                  ++res.combos;
                  if (!check_combo(m, t, inf)) ++res.failures;
                }
  return res;
}

}  // namespace

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
  TrainTopology t = parse_train_topology("tp=2,pp=2,ep=2,dp=3,split=3:1,bucket=5000");
  CHECK(t.layer_split == std::vector<std::int64_t>{3, 1});
  CHECK(check_combo(m, t, parse_infer_topology("tp=4,ep=2,replicas=2")));
  const ModelSpec d = model_preset("tiny-qwen3");
  CHECK(check_combo(d, parse_train_topology("tp=4,pp=2,dp=2,split=1:3,bucket=3000"),
                    parse_infer_topology("tp=8")));
}
