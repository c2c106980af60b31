// SPDX-License-Identifier: Apache-2.0
// The forward steps real fused kernels run, emulated element by element in FP32 on >= 10M
// elements: FMA or separate multiply and add, decay before or after the update, TE/Apex's
// `update = mhat/(sqrt(vhat)+eps) + wd*p; p -= lr*update`, hyperparameters and bias corrections
// held in FP32. dte's inverse + guard band must miss no BF16 (or FP16) change in any of them.
// (The target is built with -ffp-contract=off, so only the std::fma calls below fuse.)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dte/audit.hpp"
#include "dte/detect/detect.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"

namespace {

constexpr std::size_t kElements = 10'000'019;  // >= 10M, not a multiple of any tile
constexpr int kSteps = 3;

// Cheap counter-based randomness so that data generation parallelises and is reproducible.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
double uniform(std::uint64_t key) {
  return (mix(key) >> 11) * 0x1.0p-53;
}
double normal(std::uint64_t key) {
  const double u1 = uniform(key * 2 + 1) + 0x1.0p-54, u2 = uniform(key * 2 + 2);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Weight-like data: N(0, 0.02) matrices, norm weights near 1, exact zeros, tiny magnitudes,
// and values placed within a few ulps of a BF16 rounding boundary (the adversarial case).
std::vector<float> make_weights(std::uint64_t seed) {
  std::vector<float> w(kElements);
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < kElements; ++i) {
    const std::uint64_t key = seed * 0x1000000000ull + i;
    const double kind = uniform(key ^ 0xABCDEFull);
    const double z = normal(key);
    float x;
    if (kind < 0.80) {
      x = static_cast<float>(0.02 * z);
    } else if (kind < 0.90) {
      x = static_cast<float>(1.0 + 0.05 * z);
    } else if (kind < 0.93) {
      x = 0.0f;
    } else if (kind < 0.96) {
      x = static_cast<float>(1e-30 * z);
    } else {
      // A BF16 midpoint of a weight-sized value, moved by -4..+4 FP32 ulps.
      const float base = static_cast<float>(0.02 * z);
      const std::uint32_t mid = (dte::float_bits(base) & 0xFFFF0000u) | 0x8000u;
      const int shift = static_cast<int>(mix(key ^ 0x55ull) % 9) - 4;
      x = dte::bits_float(mid + static_cast<std::uint32_t>(shift));
    }
    w[i] = x;
  }
  return w;
}

// Heavy-tailed gradients with per-element scale classes; 3% exactly zero (unused rows).
std::vector<float> make_grads(std::uint64_t seed, int step) {
  std::vector<float> g(kElements);
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < kElements; ++i) {
    const std::uint64_t key = (seed * 131 + static_cast<std::uint64_t>(step)) * 0x1000000000ull + i;
    const double zero = uniform(key ^ 0x77ull);
    if (zero < 0.03) {
      g[i] = 0.0f;
      continue;
    }
    const double scale = std::pow(10.0, -5.0 + 3.0 * uniform(mix(i) ^ seed));  // per element
    const double cauchy_like = normal(key) / (std::fabs(normal(key ^ 0x1234ull)) + 0.05);
    g[i] = static_cast<float>(scale * cauchy_like);
  }
  return g;
}

enum class Variant {
  torch_decay_first,      // torch.optim.AdamW: p *= (1-lr*wd); p.addcdiv_(m, denom, -step_size)
  torch_decay_first_fma,  // same, the final multiply-add fused
  te_fused,               // TE/Apex ADAM_MODE_1: update = mhat/denom + wd*p; p -= lr*update
  te_fused_fma,           // same, p = fma(-lr, update, p)
  decay_after,            // HF transformers' old AdamW: update first, then p -= lr*wd*p
  fp32_hyper,             // everything in FP32, bias corrections with powf
  adam_l2_torch,          // torch.optim.Adam(weight_decay): g += wd*p, then the Adam step
  adam_l2_te_fma,         // TE ADAM_MODE_0 with a fused final update
  sgd_torch,              // torch.optim.SGD(momentum, dampening): p.add_(buf, alpha=-lr)
  sgd_fma,
};

const char* name_of(Variant v) {
  switch (v) {
    case Variant::torch_decay_first:
      return "torch_decay_first";
    case Variant::torch_decay_first_fma:
      return "torch_decay_first_fma";
    case Variant::te_fused:
      return "te_fused";
    case Variant::te_fused_fma:
      return "te_fused_fma";
    case Variant::decay_after:
      return "decay_after";
    case Variant::fp32_hyper:
      return "fp32_hyper";
    case Variant::adam_l2_torch:
      return "adam_l2_torch";
    case Variant::adam_l2_te_fma:
      return "adam_l2_te_fma";
    case Variant::sgd_torch:
      return "sgd_torch";
    case Variant::sgd_fma:
      return "sgd_fma";
  }
  return "?";
}

bool is_sgd(Variant v) {
  return v == Variant::sgd_torch || v == Variant::sgd_fma;
}
bool is_l2(Variant v) {
  return v == Variant::adam_l2_torch || v == Variant::adam_l2_te_fma;
}

struct Setting {
  double lr;
  double wd;
  double eps;
};

// One optimizer step, in place, the way `variant` computes it.
void forward(Variant variant, const Setting& s, int t, const std::vector<float>& grad,
             std::vector<float>& p, std::vector<float>& m, std::vector<float>& v) {
  const double b1 = 0.9, b2 = 0.999;
  const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
  const float lr_f = static_cast<float>(s.lr), wd_f = static_cast<float>(s.wd);
  const float eps_f = static_cast<float>(s.eps);
  const float decay_f = static_cast<float>(1.0 - s.lr * s.wd);
  const float step_size_f = static_cast<float>(s.lr / bc1);
  const float bc2_sqrt_f = static_cast<float>(std::sqrt(bc2));
  const float b1_f = static_cast<float>(b1), b2_f = static_cast<float>(b2);
  const float one_minus_b1_f = static_cast<float>(1.0 - b1),
              one_minus_b2_f = static_cast<float>(1.0 - b2);
  // FP32 bias corrections as a kernel that receives float betas would compute them.
  const float bc1_f32 = 1.0f - std::pow(b1_f, static_cast<float>(t));
  const float bc2_f32 = 1.0f - std::pow(b2_f, static_cast<float>(t));
  const float bc1_te = static_cast<float>(1.0 - std::pow(static_cast<double>(b1_f), t));
  const float bc2_te = static_cast<float>(1.0 - std::pow(static_cast<double>(b2_f), t));
  const float momentum_f = 0.9f, dampening_f = 0.1f;
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < p.size(); ++i) {
    float pi = p[i], mi = m[i], vi = v[i], g = grad[i];
    switch (variant) {
      case Variant::torch_decay_first:
      case Variant::torch_decay_first_fma: {
        pi = pi * decay_f;
        mi = mi + one_minus_b1_f * (g - mi);  // lerp
        vi = vi * b2_f + one_minus_b2_f * (g * g);
        const float denom = std::sqrt(vi) / bc2_sqrt_f + eps_f;
        const float q = mi / denom;
        pi = variant == Variant::torch_decay_first ? pi - step_size_f * q
                                                   : std::fma(-step_size_f, q, pi);
        break;
      }
      case Variant::te_fused:
      case Variant::te_fused_fma: {
        mi = b1_f * mi + one_minus_b1_f * g;
        vi = b2_f * vi + one_minus_b2_f * g * g;
        const float mhat = mi / bc1_te, vhat = vi / bc2_te;
        const float denom = std::sqrt(vhat) + eps_f;
        const float update = mhat / denom + wd_f * pi;
        pi = variant == Variant::te_fused ? pi - lr_f * update : std::fma(-lr_f, update, pi);
        break;
      }
      case Variant::decay_after: {
        mi = mi * b1_f + one_minus_b1_f * g;
        vi = vi * b2_f + one_minus_b2_f * (g * g);
        const float denom = std::sqrt(vi) / bc2_sqrt_f + eps_f;
        pi = pi - step_size_f * (mi / denom);
        pi = pi + (-lr_f * wd_f) * pi;
        break;
      }
      case Variant::fp32_hyper: {
        pi = pi * (1.0f - lr_f * wd_f);
        mi = std::fma(one_minus_b1_f, g - mi, mi);
        vi = std::fma(one_minus_b2_f, g * g, vi * b2_f);
        const float denom = std::sqrt(vi / bc2_f32) + eps_f;
        pi = std::fma(-(lr_f / bc1_f32), mi / denom, pi);
        break;
      }
      case Variant::adam_l2_torch:
      case Variant::adam_l2_te_fma: {
        g = g + wd_f * pi;
        mi = mi * b1_f + one_minus_b1_f * g;
        vi = vi * b2_f + one_minus_b2_f * (g * g);
        if (variant == Variant::adam_l2_torch) {
          const float denom = std::sqrt(vi) / bc2_sqrt_f + eps_f;
          pi = pi - step_size_f * (mi / denom);
        } else {
          const float denom = std::sqrt(vi / bc2_te) + eps_f;
          pi = std::fma(-lr_f, (mi / bc1_te) / denom, pi);
        }
        break;
      }
      case Variant::sgd_torch:
      case Variant::sgd_fma: {
        g = g + wd_f * pi;
        mi = t == 1 ? g : momentum_f * mi + (1.0f - dampening_f) * g;  // m holds the buffer
        pi = variant == Variant::sgd_torch ? pi + (-lr_f) * mi : std::fma(-lr_f, mi, pi);
        break;
      }
    }
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

template <class Detect>
dte::AuditCounts audit_step(Variant variant, const Setting& s, int t,
                            const std::vector<float>& prev, const std::vector<float>& p,
                            const std::vector<float>& m, const std::vector<float>& v) {
  if (is_sgd(variant)) {
    const dte::SgdHyperparameters h{
        .lr = s.lr, .momentum = 0.9, .dampening = 0.1, .weight_decay = s.wd};
    return dte::audit_reconstruction<Detect>(dte::SgdMomentumInverse::bind(h, p, {m}), prev);
  }
  const dte::AdamHyperparameters h{.lr = s.lr, .weight_decay = s.wd, .eps = s.eps, .step = t};
  if (is_l2(variant)) {
    return dte::audit_reconstruction<Detect>(dte::AdamInverse::bind(h, p, {m, v}), prev);
  }
  return dte::audit_reconstruction<Detect>(dte::AdamWInverse::bind(h, p, {m, v}), prev);
}

}  // namespace

TEST_CASE("every forward variant: zero missed BF16 and FP16 changes on 10M elements") {
  const std::vector<float> weights = make_weights(1);
  std::vector<std::vector<float>> grads;
  for (int t = 1; t <= kSteps; ++t)
    grads.push_back(make_grads(2, t));

  const Setting settings[] = {{1e-6, 0.1, 1e-8}, {1e-4, 0.0, 1e-8}, {1e-5, 0.1, 1e-6}};
  const Variant variants[] = {Variant::torch_decay_first, Variant::torch_decay_first_fma,
                              Variant::te_fused,          Variant::te_fused_fma,
                              Variant::decay_after,       Variant::fp32_hyper,
                              Variant::adam_l2_torch,     Variant::adam_l2_te_fma,
                              Variant::sgd_torch,         Variant::sgd_fma};
  for (const Variant variant : variants) {
    for (const Setting& s : settings) {
      // SGD takes larger steps than Adam's lr suggests, so scale its lr up.
      const Setting run = is_sgd(variant) ? Setting{s.lr * 100, s.wd, s.eps} : s;
      std::vector<float> p = weights, m(kElements, 0.0f), v(kElements, 0.0f), prev;
      dte::AuditCounts bf16, fp16;
      for (int t = 1; t <= kSteps; ++t) {
        prev = p;
        forward(variant, run, t, grads[t - 1], p, m, v);
        bf16 += audit_step<dte::BF16Detect>(variant, run, t, prev, p, m, v);
        fp16 += audit_step<dte::FP16Detect>(variant, run, t, prev, p, m, v);
      }
      std::printf(
          "%-22s lr=%-6g wd=%-4g eps=%-6g  bf16: changed %.4f%% missed %llu guard_extra "
          "%.4f%%  fp16: changed %.4f%% missed %llu guard_extra %.4f%%\n",
          name_of(variant), run.lr, run.wd, run.eps, 100.0 * bf16.true_changed / bf16.elements,
          static_cast<unsigned long long>(bf16.missed), 100.0 * bf16.guard_extra_fraction(),
          100.0 * fp16.true_changed / fp16.elements, static_cast<unsigned long long>(fp16.missed),
          100.0 * fp16.guard_extra_fraction());
      CAPTURE(name_of(variant));
      CAPTURE(run.lr);
      CAPTURE(bf16.first_missed);
      CHECK(bf16.elements == kElements * kSteps);
      CHECK(bf16.missed == 0);
      CHECK(fp16.missed == 0);
      // 4% of the data sits within 4 ulps of a boundary on purpose; beyond those the guard
      // band must stay far below a percent.
      CHECK(bf16.guard_extra_fraction() < 0.045);
    }
  }
}

TEST_CASE("without the guard band the same data does miss changes (the test has teeth)") {
  const std::vector<float> weights = make_weights(3);
  const std::vector<float> grad = make_grads(4, 1);
  std::vector<float> p = weights, m(kElements, 0.0f), v(kElements, 0.0f);
  const Setting s{1e-5, 0.1, 1e-8};
  forward(Variant::te_fused, s, 1, grad, p, m, v);
  const auto k = dte::AdamWInverse::bind({.lr = s.lr, .weight_decay = s.wd, .step = 1}, p, {m, v});
  struct NoGuard {
    dte::AdamWInverse::kernel k;
    std::size_t size() const { return k.size(); }
    float current(std::size_t i) const { return k.current(i); }
    dte::Reconstruction operator()(std::size_t i) const { return {k(i).value, 0.0f}; }
  };
  const auto with = dte::audit_reconstruction<dte::BF16Detect>(k, weights);
  const auto without = dte::audit_reconstruction<dte::BF16Detect>(NoGuard{k}, weights);
  std::printf("te_fused without guard band: missed %llu of %llu changes\n",
              static_cast<unsigned long long>(without.missed),
              static_cast<unsigned long long>(without.true_changed));
  CHECK(with.missed == 0);
  CHECK(without.missed > 0);
}
