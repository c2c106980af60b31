// SPDX-License-Identifier: Apache-2.0
// The topology-grid property check shared by the layout tests: for one (model, trainer, receiver)
// triple, every canonical element is sent exactly once, every live receiver element is written
// exactly once per replica, and the maps agree with their inverses.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/pipeline/runs.hpp"

namespace grid {

using namespace dte::layout;

struct GridResult {
  int combos = 0;
  int failures = 0;
};

inline std::string describe(const TrainTopology& t, const InferTopology& i) {
  return "train tp=" + std::to_string(t.tp) + ",pp=" + std::to_string(t.pp) +
         ",ep=" + std::to_string(t.ep) + ",etp=" + std::to_string(t.etp) +
         ",dp=" + std::to_string(t.dp) + " infer tp=" + std::to_string(i.tp) +
         ",ep=" + std::to_string(i.ep) + ",replicas=" + std::to_string(i.replicas);
}

inline bool valid(const ModelSpec& m, const TrainTopology& t, const InferTopology& i) {
  try {
    validate(m, t);
    validate(m, i);
    return true;
  } catch (const dte::invalid_argument&) {
    return false;
  }
}

// Returns false (and reports) on the first violated property.
// The pipeline's affine runs (what the engine detects, routes and applies with) agree with the
// plan element by element: canonical index and every receiver index advance by one per element.
template <class Fail>
void check_runs(const HfModel& hf, const TransferPlan& plan, const ServingLayout& recv,
                Fail&& fail) {
  const dte::pipeline::RunTable runs(plan, hf, &recv);
  std::vector<RouteTarget> want;
  for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
    for (const dte::pipeline::Run& run : runs.runs(b)) {
      const PlanSegment& seg = plan.segments(b)[static_cast<std::size_t>(run.segment)];
      const MegatronParam& p = plan.params()[static_cast<std::size_t>(seg.param)];
      const auto targets = runs.targets(run);
      for (std::int64_t k = 0; k < run.length; ++k) {
        const std::int64_t o = run.shard_begin + k;
        const Canonical c = plan.mapping()(p, seg.param_begin + (o - seg.shard_begin));
        const std::int64_t g = c.tensor < 0 ? -1 : hf[c.tensor].base + c.index;
        if ((c.tensor < 0) != (run.tensor < 0) || (c.tensor >= 0 && g != run.canonical + k)) {
          fail("run of " + p.name() + " at shard offset " + std::to_string(o) +
               " disagrees with the plan's canonical element");
          return;
        }
        want.clear();
        route_canonical(recv, plan.canonical(b, o),
                        [&](const RouteTarget& rt) { want.push_back(rt); });
        bool same = want.size() == targets.size();
        for (std::size_t j = 0; same && j < want.size(); ++j) {
          same = want[j].rank == targets[j].rank && want[j].tensor == targets[j].tensor &&
                 want[j].index == targets[j].index + k;
        }
        if (!same) {
          fail("run of " + p.name() + " at shard offset " + std::to_string(o) +
               " routes elsewhere than the plan");
          return;
        }
      }
    }
  }
}

inline bool check_combo(const ModelSpec& m, const TrainTopology& t, const InferTopology& inf) {
  const HfModel hf(m);
  const ServingLayout recv(hf, inf);
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
    const TransferPlan plan(hf, t, g);
    check_runs(hf, plan, recv, fail);
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
        route_canonical(recv, plan.canonical(b, o), [&](const RouteTarget& rt) {
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

inline GridResult run_grid(const ModelSpec& m, const std::vector<std::int64_t>& eps,
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

}  // namespace grid

using grid::check_combo;
using grid::GridResult;
using grid::run_grid;
