// SPDX-License-Identifier: Apache-2.0
// The contract the guard band rests on, tested where it is fragile: for every shipped inverse and
// every kernel order it claims to cover, on >= 10M adversarial elements each, the true previous
// weight lies within the reconstruction's error bound: |theta_prev - value| <= error, decided
// exactly (dte::breaks_bound), with the relative margin the detector's comparisons need.
//
// The elements are concentrated where FP32 loses accuracy: subnormal and near-subnormal weights,
// moments whose products and quotients underflow (step_size*m, m/bc1, v/bc2), v = 0, eps
// dominating or vanishing, lr*wd near its limit, huge m/denom, updates that cancel the weight,
// zero weights, weights on 16-bit rounding boundaries, and raw random bit patterns. Each element
// is stepped forward by the kernel order under test (kernel_orders.hpp), so theta_prev is known
// exactly.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "counter_random.hpp"
#include "dte/audit.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "kernel_orders.hpp"

namespace {

using dte::test::AdamOrder;
using dte::test::AdamStepSpec;
using dte::test::Draws;
using dte::test::SgdOrder;

constexpr std::size_t kElements = 10'000'019;  // per (inverse, kernel order)
constexpr std::size_t kBlock = 1 << 16;        // one hyperparameter setting per block
// The detector compares fl(hi - value) with error; where that difference is inexact (FP16's zero
// intervals) it needs error >= (1 + 2^-23) |theta_prev - value|. Asserted with room to spare.
constexpr double kMargin = 1.0 + 0x1p-22;

// Adversarial hyperparameters: ordinary RL settings, lr*wd at 0.5 / 0.9 / 0.999, eps from 0 to
// 1e-6, huge and tiny step sizes, lr = 0, betas 0, late steps, no bias correction.
const AdamStepSpec kAdamSettings[] = {
    {1e-6, 0.1, 0.9, 0.999, 1e-8, 1, true, true},
    {1e-6, 0.0, 0.9, 0.999, 1e-8, 1000, true, true},
    {3e-5, 0.01, 0.9, 0.95, 1e-6, 7, true, true},
    {1e-3, 0.1, 0.9, 0.999, 1e-8, 2, true, true},
    {0.1, 5.0, 0.9, 0.999, 1e-8, 10, true, true},
    {0.01, 90.0, 0.5, 0.9999, 1e-12, 3, true, true},
    {1e-4, 9990.0, 0.9, 0.999, 1e-8, 100, true, true},
    {1e-6, 0.1, 0.9, 0.999, 1e-20, 50, true, true},
    {1e-6, 0.1, 0.9, 0.999, 0.0, 5, true, true},
    {1.0, 0.1, 0.99, 0.9999, 1e-8, 1, true, true},
    {1e-10, 0.1, 0.9, 0.999, 1e-8, 100000, true, true},
    {1e-6, 0.1, 0.0, 0.0, 1e-8, 3, true, true},
    {1e-5, 0.01, 0.9, 0.999, 1e-8, 4, false, true},
    {4.7e-38, 0.1, 0.9, 0.999, 1e-8, 20, true, true},
    {2e-6, 0.05, 0.9, 0.999, 1e-6, 123456, true, true},
    {0.0, 0.1, 0.9, 0.999, 1e-8, 8, true, true},  // lr = 0 (warmup start): the exact branch
};

const double kSgdLr[] = {1e-3, 1e-2, 0.1, 1.0, 10.0, 1e-8, 4.7e-38, 0.0};

float to_float(double x) {
  return static_cast<float>(x);
}

// A magnitude anywhere from the smallest subnormal to `hi`, log-uniform, with a random sign.
float wide(Draws& d, double lo = 1e-45, double hi = 1e2) {
  return to_float(d.sign() * d.log_uniform(lo, hi));
}

// A finite float from raw random bits with a bounded exponent (|x| < 2^(e_max - 127)).
float random_bits(Draws& d, unsigned e_max) {
  const auto u = static_cast<std::uint32_t>(d.bits());
  const std::uint32_t exponent = (u >> 23 & 0xFFu) % (e_max + 1);
  return dte::bits_float((u & 0x807FFFFFu) | exponent << 23);
}

// A 16-bit rounding boundary (BF16 or FP16 midpoint) near `base`, moved by -8..+8 FP32 ulps.
float on_boundary(Draws& d, float base) {
  std::uint32_t mid;
  if (d.chance(0.5)) {
    mid = (dte::float_bits(base) & 0xFFFF0000u) | 0x8000u;
  } else {
    mid = (dte::float_bits(base) & 0xFFFFE000u) | 0x1000u;
  }
  const int shift = static_cast<int>(d.below(17)) - 8;
  return dte::bits_float(mid + static_cast<std::uint32_t>(shift));
}

struct Element {
  float p0, m, v;
};

// One adversarial (theta_prev, m, v) for an Adam setting.
Element adam_element(Draws& d, const AdamStepSpec& s) {
  const double t = static_cast<double>(s.step);
  const double bc1 = s.bias_correction ? 1.0 - std::pow(s.beta1, t) : 1.0;
  const double bc2 = s.bias_correction ? 1.0 - std::pow(s.beta2, t) : 1.0;
  const double step_size = s.lr / bc1;
  const double lw = s.decoupled ? s.lr * s.weight_decay : 0.0;
  const auto tiny_v = [&] { return d.chance(0.5) ? 0.0f : to_float(d.log_uniform(1e-45, 1e-10)); };
  Element e{};
  switch (d.below(12)) {
    case 0: {  // weight-like
      e.p0 = to_float(0.02 * d.gauss());
      e.m = wide(d, 1e-10, 1e-2);
      e.v = to_float(static_cast<double>(e.m) * e.m * d.log_uniform(1.0, 1e3));
      break;
    }
    case 1: {  // dead units: tiny weights whose gradients underflow v to zero
      e.p0 = wide(d, 1e-38, 1e-30);
      e.m = wide(d, 1e-45, 1e-36);
      e.v = d.chance(0.5) ? 0.0f : to_float(d.log_uniform(1e-45, 1e-38));
      break;
    }
    case 2: {  // step_size * m in the subnormal range (torch's first product)
      e.m = to_float(d.sign() * 0x1p-126 / std::max(step_size, 1e-30) * d.between(0.0, 4.0));
      e.p0 = wide(d, 1e-45, 1e-25);
      e.v = tiny_v();
      break;
    }
    case 3: {  // m / bc1 in the subnormal range (TE's first quotient)
      e.m = to_float(d.sign() * 0x1p-126 * bc1 * d.between(0.0, 3.0));
      e.p0 = wide(d, 1e-45, 1e-25);
      e.v = tiny_v();
      break;
    }
    case 4: {  // v / bc2 in the subnormal range (TE's sqrt of an underflowed value)
      e.v = to_float(0x1p-126 * bc2 * d.between(0.0, 3.0));
      e.m = wide(d, 1e-45, 1e-20);
      e.p0 = wide(d, 1e-45, 1e-20);
      break;
    }
    case 5: {  // sqrt(vhat) comparable to eps
      const double root = s.eps > 0.0 ? s.eps * std::sqrt(bc2) : 1e-20;
      e.v = to_float(root * root * d.log_uniform(0.25, 4.0));
      e.m = wide(d, 1e-40, 1.0);
      e.p0 = wide(d, 1e-40, 1.0);
      break;
    }
    case 6: {  // huge m / denom
      e.m = wide(d, 1e-4, 1e3);
      e.v = tiny_v();
      e.p0 = wide(d, 1e-30, 1e3);
      break;
    }
    case 7: {  // subnormal and near-subnormal weights
      const auto k = static_cast<std::uint32_t>(d.bits() % ((1u << 23) + (1u << 12)));
      e.p0 = dte::bits_float((d.chance(0.5) ? 0x80000000u : 0u) | k);
      e.m = wide(d);
      e.v = d.chance(0.3) ? 0.0f : std::fabs(wide(d));
      break;
    }
    case 8: {  // the update cancels the weight: theta lands on or near zero
      e.m = d.chance(0.5) ? wide(d, 1e-10, 1e-2) : wide(d, 1e-45, 1e-36);
      e.v = d.chance(0.5) ? to_float(static_cast<double>(e.m) * e.m * d.log_uniform(1.0, 1e3))
                          : tiny_v();
      const double denom = std::sqrt(static_cast<double>(e.v) / bc2) + s.eps;
      const double update = denom > 0.0 ? step_size * e.m / denom : 0.0;
      e.p0 = to_float(update / (1.0 - lw) * (1.0 + 1e-6 * d.gauss()));
      break;
    }
    case 9: {  // zero weights
      e.p0 = d.chance(0.5) ? -0.0f : 0.0f;
      e.m = d.chance(0.5) ? (d.chance(0.5) ? -0.0f : 0.0f) : wide(d, 1e-45, 1e-3);
      e.v = tiny_v();
      break;
    }
    case 10: {  // on a BF16 or FP16 rounding boundary, of any magnitude
      e.p0 = on_boundary(d, wide(d, 1e-40, 1e3));
      e.m = to_float(e.p0 * d.log_uniform(1e-8, 1e-1) * d.sign());
      e.v = to_float(static_cast<double>(e.m) * e.m * d.log_uniform(1.0, 1e3));
      break;
    }
    default: {  // raw bit patterns
      e.p0 = random_bits(d, 140);
      e.m = random_bits(d, 130);
      e.v = std::fabs(random_bits(d, 140));
      break;
    }
  }
  return e;
}

struct Element2 {
  float p0, buf;
};

Element2 sgd_element(Draws& d, double lr) {
  Element2 e{};
  switch (d.below(8)) {
    case 0:
      e.p0 = to_float(0.02 * d.gauss());
      e.buf = wide(d, 1e-8, 1e-1);
      break;
    case 1:
      e.p0 = wide(d, 1e-38, 1e-30);
      e.buf = wide(d, 1e-45, 1e-36);
      break;
    case 2:  // lr * buf in the subnormal range
      e.buf = to_float(d.sign() * 0x1p-126 / std::max(lr, 1e-30) * d.between(0.0, 4.0));
      e.p0 = wide(d, 1e-45, 1e-25);
      break;
    case 3:  // the update cancels the weight
      e.buf = d.chance(0.5) ? wide(d, 1e-8, 1e-1) : wide(d, 1e-45, 1e-36);
      e.p0 = to_float(lr * e.buf * (1.0 + 1e-6 * d.gauss()));
      break;
    case 4:
      e.p0 = d.chance(0.5) ? -0.0f : 0.0f;
      e.buf = d.chance(0.5) ? (d.chance(0.5) ? -0.0f : 0.0f) : wide(d);
      break;
    case 5:
      e.p0 = on_boundary(d, wide(d, 1e-40, 1e3));
      e.buf = to_float(e.p0 * d.log_uniform(1e-8, 1e-1) * d.sign());
      break;
    case 6: {
      const auto k = static_cast<std::uint32_t>(d.bits() % ((1u << 23) + (1u << 12)));
      e.p0 = dte::bits_float((d.chance(0.5) ? 0x80000000u : 0u) | k);
      e.buf = wide(d);
      break;
    }
    default:
      e.p0 = random_bits(d, 140);
      e.buf = random_bits(d, 130);
      break;
  }
  return e;
}

struct Tally {
  std::uint64_t elements = 0, replaced = 0, violations = 0, short_margin = 0;
  double worst = 0.0;
  float worst_p0 = 0.0f, worst_value = 0.0f, worst_error = 0.0f;

  void add(float p0, const dte::Reconstruction& r) {
    ++elements;
    violations += dte::breaks_bound(p0, r) ? 1 : 0;
    const double ratio = dte::bound_ratio(p0, r);
    short_margin += ratio * kMargin > 1.0 ? 1 : 0;
    if (ratio > worst) {
      worst = ratio;
      worst_p0 = p0;
      worst_value = r.value;
      worst_error = r.error;
    }
  }
  void merge(const Tally& o) {
    elements += o.elements;
    replaced += o.replaced;
    violations += o.violations;
    short_margin += o.short_margin;
    if (o.worst > worst) {
      worst = o.worst;
      worst_p0 = o.worst_p0;
      worst_value = o.worst_value;
      worst_error = o.worst_error;
    }
  }
};

void report(const char* inverse, const char* order, const Tally& t) {
  std::printf(
      "%-18s %-19s elements %llu (replaced %llu non-finite) violations %llu short-margin %llu "
      "worst |p0-value|/error %.3g (p0 %.9g value %.9g error %.3g)\n",
      inverse, order, static_cast<unsigned long long>(t.elements),
      static_cast<unsigned long long>(t.replaced), static_cast<unsigned long long>(t.violations),
      static_cast<unsigned long long>(t.short_margin), t.worst, static_cast<double>(t.worst_p0),
      static_cast<double>(t.worst_value), static_cast<double>(t.worst_error));
}

// Returns the tallies with the default DecayForm::unknown and with the order's own form.
template <class Inverse>
std::pair<Tally, Tally> check_adam(AdamOrder order, std::uint64_t seed) {
  constexpr bool decoupled = std::is_same_v<Inverse, dte::AdamWInverse>;
  const std::size_t blocks = (kElements + kBlock - 1) / kBlock;
  constexpr std::size_t settings = std::size(kAdamSettings);
  Tally total, total_declared;
#pragma omp parallel
  {
    Tally mine, mine_declared;
    std::vector<float> p0(kBlock), theta(kBlock), m(kBlock), v(kBlock);
#pragma omp for schedule(dynamic)
    for (std::size_t b = 0; b < blocks; ++b) {
      AdamStepSpec spec = kAdamSettings[b % settings];
      spec.decoupled = decoupled;
      const dte::test::AdamScalars scalars = dte::test::prepare(order, spec);
      const std::size_t n = std::min(kBlock, kElements - b * kBlock);
      for (std::size_t i = 0; i < n; ++i) {
        Draws d(seed * 0x100000000ull + (b * kBlock + i) * 64);
        Element e{};
        float p = 0.0f;
        for (int attempt = 0;; ++attempt) {
          e = adam_element(d, spec);
          p = dte::test::adam_weight_step(scalars, e.p0, e.m, e.v);
          if (std::isfinite(p)) break;
          if (attempt == 0) ++mine.replaced;
        }
        p0[i] = e.p0;
        theta[i] = p;
        m[i] = e.m;
        v[i] = e.v;
      }
      const dte::AdamHyperparameters h{.lr = spec.lr,
                                       .weight_decay = spec.weight_decay,
                                       .beta1 = spec.beta1,
                                       .beta2 = spec.beta2,
                                       .eps = spec.eps,
                                       .step = spec.step,
                                       .bias_correction = spec.bias_correction};
      const std::span<const float> ts(theta.data(), n), ms(m.data(), n), vs(v.data(), n);
      const auto k = Inverse::bind(h, ts, {ms, vs});
      // The same data once more with the decay form this order has declared (DecayForm).
      dte::AdamHyperparameters declared = h;
      declared.decay_form =
          dte::test::subtracts_decay(order) ? dte::DecayForm::subtract : dte::DecayForm::multiply;
      const auto kd = Inverse::bind(declared, ts, {ms, vs});
      for (std::size_t i = 0; i < n; ++i) {
        mine.add(p0[i], k(i));
        mine_declared.add(p0[i], kd(i));
      }
    }
#pragma omp critical
    {
      total.merge(mine);
      total_declared.merge(mine_declared);
    }
  }
  return {total, total_declared};
}

Tally check_sgd(SgdOrder order, std::uint64_t seed) {
  const std::size_t blocks = (kElements + kBlock - 1) / kBlock;
  constexpr std::size_t settings = std::size(kSgdLr);
  Tally total;
#pragma omp parallel
  {
    Tally mine;
    std::vector<float> p0(kBlock), theta(kBlock), buf(kBlock);
#pragma omp for schedule(dynamic)
    for (std::size_t b = 0; b < blocks; ++b) {
      const double lr = kSgdLr[b % settings];
      const std::size_t n = std::min(kBlock, kElements - b * kBlock);
      for (std::size_t i = 0; i < n; ++i) {
        Draws d(seed * 0x100000000ull + (b * kBlock + i) * 64);
        Element2 e{};
        float p = 0.0f;
        for (int attempt = 0;; ++attempt) {
          e = sgd_element(d, lr);
          p = dte::test::sgd_weight_step(order, static_cast<float>(lr), e.p0, e.buf);
          if (std::isfinite(p)) break;
          if (attempt == 0) ++mine.replaced;
        }
        p0[i] = e.p0;
        theta[i] = p;
        buf[i] = e.buf;
      }
      const dte::SgdHyperparameters h{.lr = lr, .momentum = 0.9, .dampening = 0.1};
      const std::span<const float> ts(theta.data(), n), bs(buf.data(), n);
      const auto k = dte::SgdMomentumInverse::bind(h, ts, {bs});
      for (std::size_t i = 0; i < n; ++i)
        mine.add(p0[i], k(i));
    }
#pragma omp critical
    total.merge(mine);
  }
  return total;
}

}  // namespace

TEST_CASE("AdamWInverse: the bound holds for every kernel order on 10M adversarial elements") {
  std::uint64_t seed = 1;
  for (const AdamOrder order : dte::test::all_adam_orders) {
    const auto [t, declared] = check_adam<dte::AdamWInverse>(order, seed++);
    report("AdamWInverse", dte::test::name_of(order), t);
    report(dte::test::subtracts_decay(order) ? "  decay=subtract" : "  decay=multiply",
           dte::test::name_of(order), declared);
    CAPTURE(dte::test::name_of(order));
    CHECK(t.elements == kElements);
    CHECK(t.violations == 0);
    CHECK(t.short_margin == 0);
    CHECK(declared.violations == 0);
    CHECK(declared.short_margin == 0);
  }
}

TEST_CASE("AdamInverse (L2): the bound holds for every kernel order on 10M adversarial elements") {
  std::uint64_t seed = 101;
  for (const AdamOrder order : dte::test::all_adam_orders) {
    if (order == AdamOrder::decay_after) continue;  // no decay step to put after the update
    const Tally t = check_adam<dte::AdamInverse>(order, seed++).first;
    report("AdamInverse", dte::test::name_of(order), t);
    CAPTURE(dte::test::name_of(order));
    CHECK(t.elements == kElements);
    CHECK(t.violations == 0);
    CHECK(t.short_margin == 0);
  }
}

TEST_CASE("SgdMomentumInverse: the bound holds for both orders on 10M adversarial elements") {
  std::uint64_t seed = 201;
  for (const SgdOrder order : dte::test::all_sgd_orders) {
    const Tally t = check_sgd(order, seed++);
    report("SgdMomentumInverse", dte::test::name_of(order), t);
    CAPTURE(dte::test::name_of(order));
    CHECK(t.elements == kElements);
    CHECK(t.violations == 0);
    CHECK(t.short_margin == 0);
  }
}
