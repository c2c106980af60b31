// SPDX-License-Identifier: Apache-2.0
// The change detectors, and the contract every optimizer inverse must honour:
// |theta_prev - value| <= error, error == 0 only when exact.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/optim/snapshot.hpp"
#include "dte/storage/value_code.hpp"

using dte::bits_float;
using dte::Reconstruction;
using dte::Verdict;

TEST_CASE_TEMPLATE("detector conformance", D, dte::BF16Detect, dte::FP16Detect) {
  using F = typename D::format;
  SUBCASE("an exact previous value decides by bit pattern alone") {
    CHECK(D::classify(1.0f, {1.0f, 0.0f}) == Verdict::unchanged);
    CHECK(D::classify(1.5f, {1.0f, 0.0f}) == Verdict::changed);
    CHECK(D::classify(0.0f, {-0.0f, 0.0f}) == Verdict::changed);  // +0 and -0 differ in bits
    CHECK(D::classify(-0.0f, {-0.0f, 0.0f}) == Verdict::unchanged);
  }
  SUBCASE("the guard band flags values within the error of a rounding boundary") {
    const std::uint16_t one = F::round(1.0f);
    const dte::RoundingInterval iv = F::interval(one);
    const float near_hi = std::nextafter(iv.hi, 0.0f);  // one ulp inside the upper boundary
    CHECK(D::classify(1.0f, {near_hi, 1e-6f}) == Verdict::guard);
    CHECK(D::classify(1.0f, {near_hi, 1e-8f}) == Verdict::unchanged);  // one ulp is 1.2e-7
    CHECK(D::classify(1.0f, {1.0f, 1e-9f}) == Verdict::unchanged);
    CHECK(D::classify(1.0f, {iv.lo, 1e-30f}) == Verdict::guard);  // on the lower boundary
    CHECK(D::changed(1.0f, {iv.lo, 1e-30f}));
    CHECK_FALSE(D::changed(1.0f, {1.0f, 1e-9f}));
  }
  SUBCASE("zeros: the sign is uncertain unless the inverse vouches for it") {
    const float tiny = bits_float(1u);  // 2^-149
    CHECK(D::classify(0.0f, {0.0f, tiny, false}) == Verdict::guard);
    CHECK(D::classify(0.0f, {0.0f, tiny, true}) == Verdict::unchanged);
    CHECK(D::classify(-0.0f, {-0.0f, tiny, true}) == Verdict::unchanged);
    CHECK(D::classify(-0.0f, {-0.0f, tiny, false}) == Verdict::guard);
  }
  SUBCASE("non-finite reconstructions are always flagged") {
    const float inf = std::numeric_limits<float>::infinity();
    CHECK(D::classify(1.0f, {1.0f, inf}) == Verdict::guard);
    CHECK(D::classify(1.0f, {1.0f, std::nanf("")}) == Verdict::guard);
  }
}

TEST_CASE_TEMPLATE("previous(): every stored value the error interval holds lies in [lo, hi]", D,
                   dte::BF16Detect, dte::FP16Detect) {
  using F = typename D::format;
  using dte::storage::ordered16;
  std::mt19937_64 rng(5);
  std::size_t checked = 0, uncertain = 0;
  for (int trial = 0; trial < 200000; ++trial) {
    // A finite value of any magnitude (about one in four near a rounding boundary of F), an
    // error from exact to far wider than a 16-bit step.
    float value = bits_float(static_cast<std::uint32_t>(rng()) & 0xBFFFFFFFu);  // |x| < 2
    if (trial % 4 == 0) value = F::interval(F::round(value)).hi;
    const int k = static_cast<int>(rng() % 40);
    const float error = trial % 7 == 0 ? 0.0f : std::ldexp(std::fabs(value), -k) + bits_float(1u);
    const Reconstruction r{value, error, false};
    const dte::PreviousBits p = D::previous(r);
    CHECK(p.bits == F::round(value));
    REQUIRE(p.bounded);
    if (!p.certain) ++uncertain;
    // Previous values inside the interval: its ends (as close as FP32 gets) and points between.
    for (int j = 0; j <= 8; ++j) {
      const double t = j == 0   ? -1.0
                       : j == 8 ? 1.0
                                : std::uniform_real_distribution(-1.0, 1.0)(rng);
      // (value itself when the offset is zero: -0 + 0 would be +0)
      const double offset = t * static_cast<double>(error);
      float p0 = offset == 0 ? value : static_cast<float>(static_cast<double>(value) + offset);
      for (int step = 0; step < 2 && std::fabs(static_cast<double>(p0) - value) > error; ++step)
        p0 = std::nextafter(p0, value);
      if (std::fabs(static_cast<double>(p0) - value) > error) continue;
      const std::uint16_t stored = F::round(p0);
      if (p.certain) {
        REQUIRE(stored == p.bits);
      } else {
        REQUIRE(ordered16(p.lo) <= ordered16(stored));
        REQUIRE(ordered16(stored) <= ordered16(p.hi));
      }
      ++checked;
    }
  }
  CHECK(checked > 1000000);
  CHECK(uncertain > 10000);
  // Without finite ends there are no bounds.
  CHECK_FALSE(D::previous({1.0f, std::numeric_limits<float>::infinity()}).bounded);
  CHECK_FALSE(D::previous({1e38f, 3e38f}).bounded);  // value + error overflows
}

TEST_CASE("Adam inverses: zero weights with zero moments") {
  std::vector<float> theta{0.0f, 0.0f, -0.0f, 0.0f};
  std::vector<float> m{0.0f, -0.0f, 0.0f, 1e-3f};
  std::vector<float> v{0.0f, 0.0f, 0.0f, 1e-6f};
  dte::AdamHyperparameters h{.lr = 1e-5, .weight_decay = 0.1, .step = 1};
  SUBCASE("a multiplying decay (torch on the CPU, TE/Apex) keeps the sign of a zero") {
    h.decay_form = dte::DecayForm::multiply;
    const auto k = dte::AdamWInverse::bind(h, theta, {m, v});
    CHECK(dte::BF16Detect::classify(k.current(0), k(0)) == Verdict::unchanged);
    // m = -0: theta_prev may have been -0, flipped by x - (-0); must be flagged.
    CHECK(dte::BF16Detect::classify(k.current(1), k(1)) == Verdict::guard);
    CHECK(dte::BF16Detect::classify(k.current(2), k(2)) == Verdict::unchanged);
    // A real update on a zero weight: previous was 1e-5-ish, clearly changed.
    CHECK(dte::BF16Detect::classify(k.current(3), k(3)) == Verdict::changed);
  }
  SUBCASE("unknown or subtracting decay: -0 - lr*wd*(-0) = +0, so a +0 may have been -0") {
    for (const auto form : {dte::DecayForm::unknown, dte::DecayForm::subtract}) {
      h.decay_form = form;
      const auto k = dte::AdamWInverse::bind(h, theta, {m, v});
      CHECK(dte::BF16Detect::classify(k.current(0), k(0)) == Verdict::guard);
      CHECK(dte::BF16Detect::classify(k.current(1), k(1)) == Verdict::guard);
      // -0 can only have come from -0 (nothing turns +0 into -0).
      CHECK(dte::BF16Detect::classify(k.current(2), k(2)) == Verdict::unchanged);
    }
  }
  SUBCASE("Adam with L2 decay has no decay step: the sign of a zero is kept") {
    const auto k = dte::AdamInverse::bind(h, theta, {m, v});
    CHECK(dte::BF16Detect::classify(k.current(0), k(0)) == Verdict::unchanged);
    CHECK(dte::BF16Detect::classify(k.current(1), k(1)) == Verdict::guard);
  }
  SUBCASE("lr*wd close to 1: the decay may have rounded a nonzero theta_prev to zero") {
    h.lr = 0.5;
    h.weight_decay = 1.9;  // c = 0.05: theta_prev up to ~2^-150 * 1.5 / 0.05 rounds to zero
    h.decay_form = dte::DecayForm::multiply;
    const auto k = dte::AdamWInverse::bind(h, theta, {m, v});
    CHECK(k(0).error >= 30 * dte::bits_float(1u));
    CHECK_FALSE(k(0).sign_exact);
    CHECK(dte::BF16Detect::classify(k.current(0), k(0)) == Verdict::guard);
  }
}

namespace {

// One forward step in FP64 (then rounded once), the least noisy forward there is, so the test
// checks the inverse's own rounding and the bound, element by element.
void check_bound_contains_truth(auto bind_and_step) {
  std::mt19937 rng(7);
  std::normal_distribution<float> w(0.0f, 0.02f);
  std::student_t_distribution<float> g(2.0f);
  int violations = 0;
  for (int i = 0; i < 200000; ++i) {
    const float p0 = i % 10 == 0 ? 1.0f + w(rng) : w(rng);
    const float grad = 1e-3f * g(rng);
    const auto [prev_true, r] = bind_and_step(p0, grad);
    if (!(std::fabs(static_cast<double>(prev_true) - r.value) <= r.error)) ++violations;
  }
  CHECK(violations == 0);
}

}  // namespace

TEST_CASE("AdamWInverse: the error bound contains the true previous value") {
  check_bound_contains_truth([](float p0, float grad) {
    const dte::AdamHyperparameters h{.lr = 3e-5, .weight_decay = 0.1, .step = 1};
    const double bc1 = 1 - h.beta1, bc2 = 1 - h.beta2;
    const float m = static_cast<float>((1 - h.beta1) * grad);
    const float v = static_cast<float>((1 - h.beta2) * double(grad) * grad);
    const double upd = h.lr * (m / bc1) / (std::sqrt(v / bc2) + h.eps);
    const float p = static_cast<float>(p0 * (1 - h.lr * h.weight_decay) - upd);
    const std::vector<float> th{p}, mm{m}, vv{v};
    const auto k = dte::AdamWInverse::bind(h, th, {mm, vv});
    return std::pair{p0, k(0)};
  });
}

TEST_CASE("SgdMomentumInverse: the error bound contains the true previous value") {
  check_bound_contains_truth([](float p0, float grad) {
    const dte::SgdHyperparameters h{.lr = 0.01, .momentum = 0.9};
    const float buf = grad;
    const float p = static_cast<float>(p0 - h.lr * buf);
    const std::vector<float> th{p}, bb{buf};
    const auto k = dte::SgdMomentumInverse::bind(h, th, {bb});
    return std::pair{p0, k(0)};
  });
}

TEST_CASE("SnapshotBase is exact and flags exactly the changed elements") {
  std::vector<float> before{1.0f, 0.02f, -0.0f, 3.0f};
  dte::SnapshotBase::Shadow shadow(before);
  CHECK(shadow.bytes() == 8);
  std::vector<float> after{1.0f, 0.0201f, 0.0f, 3.0f + 1e-6f};
  const auto k = dte::SnapshotBase::bind({}, after, shadow.view());
  CHECK(k(0).error == 0.0f);
  CHECK_FALSE(dte::BF16Detect::changed(k.current(0), k(0)));
  CHECK(dte::BF16Detect::changed(k.current(1), k(1)));
  CHECK(dte::BF16Detect::changed(k.current(2), k(2)));  // -0 -> +0 is a change in bits
  CHECK_FALSE(dte::BF16Detect::changed(k.current(3), k(3)));
}

TEST_CASE("lr = 0: the reconstruction is exact, except for the sign of a zero") {
  std::vector<float> theta{0.5f, 0.0f, 0.0f, -0.0f};
  std::vector<float> m{1e-3f, 1e-3f, -1e-3f, 1e-3f};
  std::vector<float> v{1e-6f, 1e-6f, 1e-6f, 1e-6f};
  dte::AdamHyperparameters h{.lr = 0.0, .weight_decay = 0.1, .step = 7};
  h.decay_form = dte::DecayForm::multiply;
  const auto k = dte::AdamWInverse::bind(h, theta, {m, v});
  CHECK(k(0).error == 0.0f);
  CHECK(dte::BF16Detect::classify(k.current(0), k(0)) == Verdict::unchanged);
  // +0 with a positive m: x - (+0) keeps the sign, so theta_prev was +0.
  CHECK(dte::BF16Detect::classify(k.current(1), k(1)) == Verdict::unchanged);
  // +0 with a negative m: theta_prev may have been -0 (-0 - (-0) = +0): flagged.
  CHECK(dte::BF16Detect::classify(k.current(2), k(2)) == Verdict::guard);
  CHECK(dte::BF16Detect::classify(k.current(3), k(3)) == Verdict::unchanged);
  // torch's fused CUDA kernel still runs theta -= (0*wd)*theta, and -0 - (-0) = +0.
  h.decay_form = dte::DecayForm::unknown;
  const auto any = dte::AdamWInverse::bind(h, theta, {m, v});
  CHECK(any(0).error == 0.0f);
  CHECK(dte::BF16Detect::classify(any.current(1), any(1)) == Verdict::guard);
  CHECK(dte::BF16Detect::classify(any.current(3), any(3)) == Verdict::unchanged);
}

// The guard band compares value - lo and hi - value with the error. For every rounding interval
// of both formats that does not touch zero or infinity, those differences are exact in FP32:
// every float in [lo, hi] is a multiple of the spacing at the smaller end, and hi - lo is less
// than 2^24 such spacings. (The zero and Inf intervals of FP16 are wider than that; there the
// comparison can round, by at most 2^-24 relatively, which the error bounds' margin covers:
// test_bound_property asserts error >= (1 + 2^-22) |theta_prev - value|.)
TEST_CASE_TEMPLATE("interval differences are exact away from zero and infinity", D, dte::BF16Detect,
                   dte::FP16Detect) {
  using F = typename D::format;
  int checked = 0, wide = 0;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto bits16 = static_cast<std::uint16_t>(b);
    const float x = F::widen(bits16);
    if (!std::isfinite(x)) continue;
    const dte::RoundingInterval iv = F::interval(bits16);
    const float lo = std::fabs(iv.lo) < std::fabs(iv.hi) ? iv.lo : iv.hi;
    const float hi = lo == iv.lo ? iv.hi : iv.lo;
    if (x == 0.0f || !std::isfinite(iv.lo) || !std::isfinite(iv.hi) ||
        std::fabs(iv.hi) >= std::numeric_limits<float>::max()) {
      ++wide;
      continue;
    }
    const float small = std::fabs(lo);
    const double spacing =
        static_cast<double>(std::nextafter(small, std::numeric_limits<float>::infinity())) - small;
    CAPTURE(b);
    CHECK(std::fabs(static_cast<double>(hi) - lo) < 0x1p24 * spacing);
    ++checked;
  }
  CHECK(checked > 60000);
  CHECK(wide < 2100);
}
