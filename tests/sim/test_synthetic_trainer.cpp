// SPDX-License-Identifier: Apache-2.0
// SyntheticTrainer: topology-independent weights, identical TP replicas, no missed BF16 change
// under AdamWInverse + BF16Detect, an exact no-op at lr 0, realistic change densities and
// weight statistics; Adam with L2 decay and SGD with momentum step as torch does, bit for bit,
// and their inverses miss no BF16 change.
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
#include "dte/optim/sgd.hpp"
#include "dte/sim/access.hpp"
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

namespace {

// One step of torch.optim.AdamW, torch.optim.Adam (L2) or torch.optim.SGD (momentum, dampening 0)
// on every canonical
// element, written out from the torch source, from the trainer's state before the step and its
// gradient (the same pure function of seed, element and step, clipped by the coefficient the
// step reports). Returns the weights and the state after it.
struct Canonical3 {
  std::vector<float> theta, a, b;  // Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer, unused
};

Canonical3 canonical_state(const SyntheticTrainer& tr) {
  Canonical3 c{tr.canonical_weights(), {}, {}};
  if (tr.config().optimizer == dte::sim::SyntheticOptimizer::sgd_momentum) {
    c.a = gather(tr, [&](std::int64_t g, BufferKind b) { return tr.momentum_buffer(g, b); });
  } else {
    c.a = gather(tr, [&](std::int64_t g, BufferKind b) { return tr.exp_avg(g, b); });
    c.b = gather(tr, [&](std::int64_t g, BufferKind b) { return tr.exp_avg_sq(g, b); });
  }
  return c;
}

Canonical3 reference_step(const SyntheticTrainer& tr, const Canonical3& before) {
  namespace d = dte::sim::detail;
  const SyntheticConfig& cfg = tr.config();
  const std::int64_t t = tr.steps_taken();
  const double factor =
      std::clamp(std::exp(0.25 * d::normal(d::stream_key(cfg.seed, d::Stream::step_factor,
                                                         static_cast<std::uint64_t>(t), 0))),
                 0.25, 4.0);
  const auto clip = static_cast<float>(tr.last_clip_coeff());
  const double lr = tr.last_lr();
  Canonical3 out = before;
  const HfModel& hf = tr.hf();
  for (std::int64_t k = 0; k < hf.size(); ++k) {
    const HfTensor& x = hf[k];
    const bool decayed = x.cols != 0;
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const auto at = static_cast<std::size_t>(x.base + i);
      const bool adamw = cfg.optimizer == dte::sim::SyntheticOptimizer::adamw;
      float p = before.theta[at];
      float g = tr.gradient({k, i}, t, factor);
      if (clip != 1.0f) g = g * clip;
      if (decayed && cfg.weight_decay != 0.0) {
        if (adamw) {
          p = p * static_cast<float>(1.0 - lr * cfg.weight_decay);  // param.mul_(1 - lr*wd)
        } else {
          g = g + static_cast<float>(cfg.weight_decay) * p;  // grad.add(param, alpha=wd)
        }
      }
      if (cfg.optimizer == dte::sim::SyntheticOptimizer::sgd_momentum) {
        const float buf =
            t == 1 ? g : before.a[at] * static_cast<float>(cfg.momentum) + g;  // clone / mul_.add_
        out.a[at] = buf;
        out.theta[at] = p + static_cast<float>(-lr) * buf;  // add_(buf, alpha=-lr)
      } else {
        const float m = before.a[at] + static_cast<float>(1.0 - cfg.beta1) * (g - before.a[at]);
        const float v = before.b[at] * static_cast<float>(cfg.beta2) +
                        static_cast<float>(1.0 - cfg.beta2) * (g * g);
        const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(t));
        const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(t));
        const float denom =
            std::sqrt(v) / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(cfg.eps);
        out.a[at] = m;
        out.b[at] = v;
        out.theta[at] = p - static_cast<float>(lr / bc1) * (m / denom);  // addcdiv_(-step_size)
      }
    }
  }
  return out;
}

// Every segment of every rank through the accessor's inverse against the weights before the step.
template <class Inverse, class Access>
dte::AuditCounts audit_step(const SyntheticTrainer& tr, const Access& access,
                            const std::vector<std::vector<float>>& before) {
  dte::AuditCounts counts;
  std::size_t k = 0;
  for (std::int64_t g = 0; g < tr.world(); ++g) {
    for (BufferKind b : kinds) {
      const std::vector<float>& prev = before[k++];
      const auto th = access.theta(g, b);
      for (const PlanSegment& seg : tr.plan(g).segments(b)) {
        const auto o = static_cast<std::size_t>(seg.shard_begin);
        const auto n = static_cast<std::size_t>(seg.length);
        const auto kernel = Inverse::bind(access.hyperparameters(g, b, seg), th.subspan(o, n),
                                          access.state(g, b, seg));
        counts += dte::audit_reconstruction<dte::BF16Detect>(
            kernel, std::span<const float>(prev).subspan(o, n));
      }
    }
  }
  return counts;
}

template <class Inverse, class Access>
void check_optimizer(dte::sim::SyntheticOptimizer optimizer, double lr) {
  const Fixture fx("tiny-qwen3-moe");
  SyntheticConfig cfg;
  cfg.seed = 7;
  cfg.lr = lr;
  cfg.warmup_steps = 1;
  cfg.total_steps = 10;
  cfg.optimizer = optimizer;
  SyntheticTrainer tr = fx.trainer("tp=2,pp=2,ep=2,dp=2", cfg);
  SyntheticTrainer single = fx.trainer("tp=1", cfg);
  const Access access{&tr};
  dte::AuditCounts all;
  std::int64_t state_mismatches = 0, theta_mismatches = 0;
  for (int s = 1; s <= 4; ++s) {
    const Canonical3 before = canonical_state(tr);
    const std::vector<std::vector<float>> shards = all_theta(tr);
    tr.step();
    single.step();
    const Canonical3 want = reference_step(tr, before);
    const Canonical3 got = canonical_state(tr);
    for (std::size_t i = 0; i < want.theta.size(); ++i) {
      theta_mismatches += dte::float_bits(got.theta[i]) != dte::float_bits(want.theta[i]);
      state_mismatches +=
          dte::float_bits(got.a[i]) != dte::float_bits(want.a[i]) ||
          (!want.b.empty() && dte::float_bits(got.b[i]) != dte::float_bits(want.b[i]));
    }
    CAPTURE(s);
    CHECK(same_bits(single.canonical_weights(), got.theta));
    const dte::AuditCounts counts = audit_step<Inverse>(tr, access, shards);
    CHECK(counts.missed == 0);
    all += counts;
  }
  std::printf(
      "[%s] 4 steps: %lld theta and %lld state mismatches against torch's step; "
      "%llu element-steps, %llu changed, %llu missed\n",
      std::string(Inverse::name).c_str(), static_cast<long long>(theta_mismatches),
      static_cast<long long>(state_mismatches), static_cast<unsigned long long>(all.elements),
      static_cast<unsigned long long>(all.true_changed),
      static_cast<unsigned long long>(all.missed));
  CHECK(theta_mismatches == 0);
  CHECK(state_mismatches == 0);
  CHECK(all.true_changed > 0);
  CHECK(all.missed == 0);
}

}  // namespace

TEST_CASE(
    "AdamW, Adam with L2 decay, SGD with momentum: torch's step, bit for bit; no missed change") {
  using dte::sim::SyntheticOptimizer;
  check_optimizer<dte::AdamWInverse, dte::sim::AdamWAccess>(SyntheticOptimizer::adamw, 1e-4);
  check_optimizer<dte::AdamInverse, dte::sim::AdamAccess>(SyntheticOptimizer::adam, 1e-4);
  check_optimizer<dte::SgdMomentumInverse, dte::sim::SgdMomentumAccess>(
      SyntheticOptimizer::sgd_momentum, 1e-2);
}

TEST_CASE("each optimizer keeps only its own state; the accessors refuse another optimizer") {
  using dte::sim::SyntheticOptimizer;
  const Fixture fx("tiny-qwen3");
  SyntheticConfig sgd_cfg;
  sgd_cfg.optimizer = SyntheticOptimizer::sgd_momentum;
  SyntheticConfig adam_cfg;
  adam_cfg.optimizer = SyntheticOptimizer::adam;
  const SyntheticTrainer adamw = fx.trainer("tp=2");
  const SyntheticTrainer adam = fx.trainer("tp=2", adam_cfg);
  const SyntheticTrainer sgd = fx.trainer("tp=2", sgd_cfg);
  const PlanSegment& seg = adamw.plan(0).segments(BufferKind::dense).front();
  CHECK(adamw.momentum_buffer(0, BufferKind::dense).empty());
  CHECK(adamw.exp_avg(0, BufferKind::dense).size() == adamw.theta(0, BufferKind::dense).size());
  CHECK(sgd.exp_avg(0, BufferKind::dense).empty());
  CHECK(sgd.exp_avg_sq(0, BufferKind::dense).empty());
  CHECK(sgd.momentum_buffer(0, BufferKind::dense).size() == sgd.theta(0, BufferKind::dense).size());
  CHECK(adamw.hyper(0, BufferKind::dense, seg).decay_form == dte::DecayForm::multiply);
  CHECK_THROWS_AS((void)sgd.hyper(0, BufferKind::dense, seg), dte::invalid_argument);
  CHECK_THROWS_AS((void)adamw.sgd_hyper(0, BufferKind::dense, seg), dte::invalid_argument);
  CHECK_THROWS_AS((void)dte::sim::AdamWAccess{&adam}.hyperparameters(0, BufferKind::dense, seg),
                  dte::invalid_argument);
  CHECK_THROWS_AS((void)dte::sim::AdamAccess{&adamw}.hyperparameters(0, BufferKind::dense, seg),
                  dte::invalid_argument);
  CHECK_THROWS_AS(
      (void)dte::sim::SgdMomentumAccess{&adam}.hyperparameters(0, BufferKind::dense, seg),
      dte::invalid_argument);
  const dte::SgdHyperparameters h = sgd.sgd_hyper(0, BufferKind::dense, seg);
  CHECK(h.momentum == 0.9);
  CHECK(h.dampening == 0.0);
  CHECK_FALSE(h.nesterov);
  sgd_cfg.momentum = 0.0;
  CHECK_THROWS_AS((void)fx.trainer("tp=2", sgd_cfg), dte::invalid_argument);
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
