// SPDX-License-Identifier: Apache-2.0
// SyntheticTrainer: topology-independent weights, identical TP replicas, no missed BF16 change
// under AdamWInverse + BF16Detect, an exact no-op at lr 0, realistic change densities and
// weight statistics.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dte/audit.hpp"
#include "dte/detect/detect.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/synthetic_trainer.hpp"

using namespace dte::layout;
using dte::sim::SyntheticConfig;
using dte::sim::SyntheticTrainer;

namespace {

constexpr BufferKind kinds[] = {BufferKind::dense, BufferKind::expert};

// A model with its receivers, kept alive for the trainers that refer to them.
struct Fixture {
  HfModel hf;
  ServingLayout recv;
  explicit Fixture(const char* model)
      : hf(model_preset(model)), recv(hf, parse_infer_topology("tp=1")) {}
  SyntheticTrainer trainer(const char* train, SyntheticConfig cfg = {}) const {
    return SyntheticTrainer(hf, parse_train_topology(train), cfg);
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::int64_t bf16_changes(const std::vector<float>& before, const std::vector<float>& after) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < before.size(); ++i)
    n += dte::round_bf16(before[i]) != dte::round_bf16(after[i]);
  return n;
}

// Every rank's theta, dense and expert, in one list (for bitwise before/after comparisons).
std::vector<std::vector<float>> all_theta(const SyntheticTrainer& tr) {
  std::vector<std::vector<float>> out;
  for (std::int64_t g = 0; g < tr.world(); ++g)
    for (BufferKind b : kinds) {
      const auto s = tr.theta(g, b);
      out.emplace_back(s.begin(), s.end());
    }
  return out;
}

// The canonical-space copy of a per-element array (exp_avg, exp_avg_sq), from the senders.
template <class Get>
std::vector<float> gather(const SyntheticTrainer& tr, Get get) {
  std::vector<float> out(static_cast<std::size_t>(tr.hf().total()), 0.0f);
  for (std::int64_t g = 0; g < tr.world(); ++g) {
    const TransferPlan& p = tr.plan(g);
    for (BufferKind b : kinds) {
      const std::span<const float> s = get(g, b);
      for (const PlanSegment& seg : p.segments(b)) {
        if (!seg.sender) continue;
        for (std::int64_t k = 0; k < seg.length; ++k) {
          const Canonical e =
              p.mapping()(p.params()[static_cast<std::size_t>(seg.param)], seg.param_begin + k);
          if (e.tensor < 0) continue;
          out[static_cast<std::size_t>(tr.hf()[e.tensor].base + e.index)] =
              s[static_cast<std::size_t>(seg.shard_begin + k)];
        }
      }
    }
  }
  return out;
}

struct Moments {
  double mean = 0, std = 0;
  std::int64_t n = 0;
};

Moments moments(const HfModel& hf, const std::vector<float>& w, bool one_d) {
  double s = 0, s2 = 0;
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const HfTensor& x = hf[t];
    if ((x.cols == 0) != one_d) continue;
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const double v = w[static_cast<std::size_t>(x.base + i)];
      s += v, s2 += v * v, ++n;
    }
  }
  const double mean = s / static_cast<double>(n);
  return {mean, std::sqrt(s2 / static_cast<double>(n) - mean * mean), n};
}

}  // namespace

TEST_CASE("canonical weights are bit-identical across trainer topologies") {
  struct Case {
    const char* model;
    const char* reference;
    std::vector<const char*> others;
  };
  const Case cases[] = {
      {"tiny-qwen3-moe",
       "tp=1",
       {"tp=2,pp=2,ep=2,etp=1,dp=2", "tp=2,pp=2,ep=2,etp=2,dp=2", "tp=4,ep=4,etp=1,bucket=1000"}},
      {"tiny-qwen3", "tp=1", {"tp=2,pp=2,dp=2", "tp=1,dp=3", "tp=4,pp=2,bucket=500"}},
  };
  SyntheticConfig cfg;
  cfg.seed = 11;
  cfg.warmup_steps = 2;
  cfg.total_steps = 8;
  cfg.lr = 1e-4;  // large enough that every step moves many BF16 values
  for (const Case& c : cases) {
    const Fixture fx(c.model);
    SyntheticTrainer ref = fx.trainer(c.reference, cfg);
    const std::vector<float> initial = ref.canonical_weights();
    std::vector<SyntheticTrainer> others;
    for (const char* t : c.others)
      others.push_back(fx.trainer(t, cfg));
    for (int s = 1; s <= 5; ++s) {
      ref.step();
      const std::vector<float> want = ref.canonical_weights();
      for (std::size_t k = 0; k < others.size(); ++k) {
        others[k].step();
        CAPTURE(c.model);
        CAPTURE(c.others[k]);
        CAPTURE(s);
        CHECK(same_bits(others[k].canonical_weights(), want));
        CHECK(same_bits(gather(others[k],
                               [&](std::int64_t g, BufferKind b) {
                                 return std::as_const(others[k]).exp_avg_sq(g, b);
                               }),
                        gather(ref, [&](std::int64_t g, BufferKind b) {
                          return std::as_const(ref).exp_avg_sq(g, b);
                        })));
        CHECK(others[k].last_grad_norm() == ref.last_grad_norm());
      }
    }
    const std::vector<float> final_weights = ref.canonical_weights();
    const std::int64_t changed = bf16_changes(initial, final_weights);
    std::printf("[topologies] %s: %zu topologies == %s after 5 steps; %lld of %zu BF16 changed\n",
                c.model, c.others.size(), c.reference, static_cast<long long>(changed),
                initial.size());
    CHECK(changed > 0);
    CHECK(std::as_const(ref).step() == 5);
  }
}

TEST_CASE("TP replicas of replicated tensors stay identical; padding stays zero") {
  const Fixture fx("tiny-qwen3-moe");
  SyntheticConfig cfg;
  cfg.lr = 1e-4;
  SyntheticTrainer tr = fx.trainer("tp=2,pp=2,ep=2,dp=2,bucket=700", cfg);
  for (int s = 0; s < 4; ++s)
    tr.step();
  const std::vector<float> w = tr.canonical_weights();
  const std::vector<float> m =
      gather(tr, [&](std::int64_t g, BufferKind b) { return std::as_const(tr).exp_avg(g, b); });
  const std::vector<float> v =
      gather(tr, [&](std::int64_t g, BufferKind b) { return std::as_const(tr).exp_avg_sq(g, b); });
  std::int64_t replicas = 0, mismatches = 0, padding = 0, nonzero_padding = 0;
  for (std::int64_t g = 0; g < tr.world(); ++g) {
    const TransferPlan& p = tr.plan(g);
    for (BufferKind b : kinds) {
      const auto th = std::as_const(tr).theta(g, b);
      const auto ea = std::as_const(tr).exp_avg(g, b);
      const auto es = std::as_const(tr).exp_avg_sq(g, b);
      for (const PlanSegment& seg : p.segments(b)) {
        if (seg.sender) continue;
        const MegatronParam& param = p.params()[static_cast<std::size_t>(seg.param)];
        CHECK(MegatronToHF::replicated(param.kind));
        for (std::int64_t k = 0; k < seg.length; ++k) {
          const Canonical e = p.mapping()(param, seg.param_begin + k);
          REQUIRE(e.tensor >= 0);
          const auto at = static_cast<std::size_t>(fx.hf[e.tensor].base + e.index);
          const auto o = static_cast<std::size_t>(seg.shard_begin + k);
          ++replicas;
          mismatches += dte::float_bits(th[o]) != dte::float_bits(w[at]) ||
                        dte::float_bits(ea[o]) != dte::float_bits(m[at]) ||
                        dte::float_bits(es[o]) != dte::float_bits(v[at]);
        }
      }
      for (std::int64_t o = 0; o < p.shard_size(b); ++o) {
        if (p.locate(b, o) != nullptr) continue;
        const auto i = static_cast<std::size_t>(o);
        ++padding;
        nonzero_padding += dte::float_bits(th[i]) != 0 || dte::float_bits(ea[i]) != 0 ||
                           dte::float_bits(es[i]) != 0;
      }
    }
  }
  std::printf(
      "[replicas] %lld replica elements, %lld mismatches; %lld padding elements, %lld "
      "nonzero\n",
      static_cast<long long>(replicas), static_cast<long long>(mismatches),
      static_cast<long long>(padding), static_cast<long long>(nonzero_padding));
  CHECK(replicas > 0);
  CHECK(mismatches == 0);
  CHECK(padding > 0);
  CHECK(nonzero_padding == 0);
}

TEST_CASE("AdamWInverse + BF16Detect miss no BF16 change on any segment") {
  const Fixture fx("tiny-qwen3-moe");
  struct Run {
    const char* name;
    double lr;
    std::int64_t warmup;
  };
  for (const Run& run : {Run{"lr 1e-6, warmup 3", 1e-6, 3}, Run{"lr 1e-4, warmup 0", 1e-4, 0}}) {
    SyntheticConfig cfg;
    cfg.seed = 5;
    cfg.lr = run.lr;
    cfg.warmup_steps = run.warmup;
    cfg.total_steps = 12;
    SyntheticTrainer tr = fx.trainer("tp=2,pp=2,ep=2,dp=2", cfg);
    dte::AuditCounts all;
    for (int s = 1; s <= 10; ++s) {
      const std::vector<std::vector<float>> before = all_theta(tr);
      tr.step();
      dte::AuditCounts counts;
      std::size_t k = 0;
      for (std::int64_t g = 0; g < tr.world(); ++g) {
        for (BufferKind b : kinds) {
          const std::vector<float>& prev = before[k++];
          const auto th = std::as_const(tr).theta(g, b);
          const auto ea = std::as_const(tr).exp_avg(g, b);
          const auto es = std::as_const(tr).exp_avg_sq(g, b);
          for (const PlanSegment& seg : tr.plan(g).segments(b)) {
            const auto o = static_cast<std::size_t>(seg.shard_begin);
            const auto n = static_cast<std::size_t>(seg.length);
            const auto kernel = dte::AdamWInverse::bind(tr.hyper(g, b, seg), th.subspan(o, n),
                                                        {ea.subspan(o, n), es.subspan(o, n)});
            counts += dte::audit_reconstruction<dte::BF16Detect>(
                kernel, std::span<const float>(prev).subspan(o, n));
          }
        }
      }
      CAPTURE(run.name);
      CAPTURE(s);
      CHECK(counts.missed == 0);
      all += counts;
    }
    std::printf(
        "[audit] %s, 10 steps: %llu element-steps, %llu changed, %llu detected, %llu "
        "missed, guard extra %.4f%%\n",
        run.name, static_cast<unsigned long long>(all.elements),
        static_cast<unsigned long long>(all.true_changed),
        static_cast<unsigned long long>(all.detected), static_cast<unsigned long long>(all.missed),
        100.0 * all.guard_extra_fraction());
    CHECK(all.missed == 0);
    CHECK(all.true_changed > 0);
  }
}

TEST_CASE("lr override 0 is a bit-exact no-op on the weights") {
  const Fixture fx("tiny-qwen3-moe");
  SyntheticTrainer tr = fx.trainer("tp=2,pp=2,ep=2,dp=2");
  tr.step();
  tr.step();
  const auto before = all_theta(tr);
  const auto m_before = tr.exp_avg(0, BufferKind::dense);
  const std::vector<float> m0(m_before.begin(), m_before.end());
  tr.set_lr_override(0.0);
  tr.step();
  CHECK(tr.last_lr() == 0.0);
  CHECK(all_theta(tr) == before);
  std::size_t k = 0;
  bool bits_equal = true;
  for (const auto& shard : all_theta(tr))
    bits_equal = bits_equal && same_bits(shard, before[k++]);
  CHECK(bits_equal);
  const auto m1 = tr.exp_avg(0, BufferKind::dense);
  CHECK_FALSE(std::equal(m1.begin(), m1.end(), m0.begin()));  // the moments did advance
  CHECK(std::as_const(tr).step() == 3);
  tr.set_lr_override(std::nullopt);
  tr.step();
  CHECK(tr.last_lr() > 0.0);
  CHECK_FALSE(all_theta(tr) == before);
  CHECK_THROWS_AS(tr.set_lr_override(-1.0), dte::invalid_argument);
}

TEST_CASE("BF16 change density per step at lr 1e-6 is realistic") {
  const Fixture fx("tiny-qwen3-moe");
  SyntheticConfig cfg;
  cfg.warmup_steps = 2;
  cfg.total_steps = 100;
  SyntheticTrainer tr = fx.trainer("tp=1", cfg);
  tr.step();
  tr.step();
  for (int s = 3; s <= 7; ++s) {
    const std::vector<float> before = tr.canonical_weights();
    tr.step();
    const std::vector<float> after = tr.canonical_weights();
    const double fraction =
        static_cast<double>(bf16_changes(before, after)) / static_cast<double>(before.size());
    std::printf(
        "[density] step %d: lr %.3g, grad norm %.4g, clip coeff %.4g, BF16 changed "
        "%.4f%%\n",
        s, tr.last_lr(), tr.last_grad_norm(), tr.last_clip_coeff(), 100.0 * fraction);
    CAPTURE(s);
    CHECK(fraction > 1e-4);
    CHECK(fraction < 0.2);
  }
}

TEST_CASE("weight statistics: norms near 1, matrices ~N(0, 0.02); hyperparameters per group") {
  const Fixture fx("tiny-qwen3-moe");
  SyntheticTrainer tr = fx.trainer("tp=2,pp=2,ep=2,dp=2");
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<float> w = tr.canonical_weights();
    const Moments norms = moments(fx.hf, w, true), matrices = moments(fx.hf, w, false);
    std::printf(
        "[stats] after %lld steps: norms mean %.5f std %.5f (n=%lld); matrices mean "
        "%.6f std %.5f (n=%lld)\n",
        static_cast<long long>(std::as_const(tr).step()), norms.mean, norms.std,
        static_cast<long long>(norms.n), matrices.mean, matrices.std,
        static_cast<long long>(matrices.n));
    CHECK(std::abs(norms.mean - 1.0) < 0.005);
    CHECK(norms.std > 0.015);
    CHECK(norms.std < 0.025);
    CHECK(std::abs(matrices.mean) < 0.001);
    CHECK(matrices.std > 0.019);
    CHECK(matrices.std < 0.021);
    if (pass == 0) {
      for (int s = 0; s < 10; ++s)
        tr.step();
    }
  }
  // No decay on 1-D parameters; the step count and lr of the last step.
  const TransferPlan& p = tr.plan(0);
  for (const PlanSegment& seg : p.segments(BufferKind::dense)) {
    const dte::AdamHyperparameters h = tr.hyper(0, BufferKind::dense, seg);
    const bool one_d = p.params()[static_cast<std::size_t>(seg.param)].cols == 0;
    CHECK(h.weight_decay == (one_d ? 0.0 : 0.1));
    CHECK(h.step == 10);
    CHECK(h.lr == tr.last_lr());
  }
  CHECK_THROWS_AS((void)tr.plan(tr.world()), dte::invalid_argument);
  CHECK_THROWS_AS((void)tr.hyper(0, BufferKind::expert, p.segments(BufferKind::dense).front()),
                  dte::invalid_argument);
}

TEST_CASE("seeds: same seed reproduces, another seed differs") {
  const Fixture fx("tiny-qwen3");
  SyntheticConfig a, b;
  a.seed = 1, b.seed = 2;
  SyntheticTrainer x = fx.trainer("tp=2", a), y = fx.trainer("tp=2", a), z = fx.trainer("tp=2", b);
  x.step(), y.step(), z.step();
  CHECK(same_bits(x.canonical_weights(), y.canonical_weights()));
  CHECK_FALSE(same_bits(x.canonical_weights(), z.canonical_weights()));
}

TEST_CASE("the gradient-norm accumulator is exact and order-independent") {
  std::vector<float> g;
  double naive = 0;
  std::uint64_t x = 3;
  for (int i = 0; i < 100000; ++i) {
    x = dte::sim::detail::splitmix64(x);
    const float v = static_cast<float>(std::ldexp(static_cast<double>(x >> 40), -30 + (i % 20)));
    g.push_back(i % 2 != 0 ? -v : v);
    naive += static_cast<double>(v) * v;
  }
  g.push_back(400.0f);
  naive += 400.0 * 400.0;
  dte::sim::detail::NormAccumulator forward, backward, split_a, split_b;
  for (float v : g)
    forward.add(v);
  for (auto it = g.rbegin(); it != g.rend(); ++it)
    backward.add(*it);
  for (std::size_t i = 0; i < g.size(); ++i)
    (i % 3 == 0 ? split_a : split_b).add(g[i]);
  split_b.add(split_a);
  CHECK(forward.norm() == backward.norm());
  CHECK(forward.norm() == split_b.norm());
  CHECK(forward.norm() == doctest::Approx(std::sqrt(naive)).epsilon(1e-12));
}
