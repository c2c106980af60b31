// SPDX-License-Identifier: Apache-2.0
// One test per validation rule: bad optimizer input is refused, with a message that says what is
// wrong, where, and what to do, before any kernel exists to publish from.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/optim/snapshot.hpp"

using doctest::Contains;

namespace {

struct AdamFixture {
  std::vector<float> theta = std::vector<float>(8, 0.5f);
  std::vector<float> m = std::vector<float>(8, 1e-3f);
  std::vector<float> v = std::vector<float>(8, 1e-6f);
  dte::AdamHyperparameters h{.lr = 1e-5, .weight_decay = 0.1, .step = 3};

  dte::AdamWInverse::kernel bind() const {
    return dte::AdamWInverse::bind(h, theta, {m, v}, "layers.0.mlp.weight");
  }
};

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("valid input binds") {
  AdamFixture f;
  const auto k = f.bind();
  CHECK(k.size() == 8);
  CHECK(k.current(3) == 0.5f);
}

TEST_CASE("step < 1 is refused") {
  AdamFixture f;
  f.h.step = 0;
  CHECK_THROWS_WITH_AS(
      f.bind(), Contains("step must be in [1, 2^53] for tensor 'layers.0.mlp.weight' (got 0)"),
      dte::numeric_error);
  f.h.step = -4;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("publish after the first optimizer step"),
                       dte::invalid_argument);
}

TEST_CASE("lr * weight_decay >= 1 is refused") {
  AdamFixture f;
  f.h.lr = 0.5;
  f.h.weight_decay = 2.0;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("lr * weight_decay must be < 1"), dte::invalid_argument);
  CHECK_THROWS_WITH_AS(f.bind(), Contains("product 1)"), dte::invalid_argument);
  f.h.weight_decay = 3.0;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("cannot be inverted"), dte::invalid_argument);
  // Adam with L2 decay has no decay factor: the same values are fine there.
  CHECK_NOTHROW(dte::AdamInverse::bind(f.h, f.theta, {f.m, f.v}));
}

TEST_CASE("negative, NaN and absurdly large lr are refused as numeric errors") {
  AdamFixture f;
  f.h.lr = -1e-5;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("lr must be in [0, 10]"), dte::numeric_error);
  CHECK_THROWS_WITH_AS(f.bind(), Contains("got -1e-05"), dte::invalid_argument);
  f.h.lr = std::nan("");
  CHECK_THROWS_WITH_AS(f.bind(), Contains("(got nan)"), dte::numeric_error);
  f.h.lr = 1e300;  // Inf in FP32: every verdict would be meaningless
  CHECK_THROWS_WITH_AS(
      f.bind(), Contains("lr must be in [0, 10] for tensor 'layers.0.mlp.weight' (got 1e+300)"),
      dte::numeric_error);
  f.h.lr = 10.0;  // the limit itself is accepted
  f.h.weight_decay = 0.01;
  CHECK_NOTHROW(f.bind());
  f.h.lr = 1e-5;
  f.h.step = (std::int64_t{1} << 53) + 1;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("step must be in [1, 2^53]"), dte::numeric_error);
  std::vector<float> theta(4, 0.5f), buf(4, 1e-3f);
  CHECK_THROWS_WITH_AS(dte::SgdMomentumInverse::bind({.lr = 1e300, .momentum = 0.9}, theta, {buf}),
                       Contains("lr must be in [0, 10]"), dte::numeric_error);
  CHECK_THROWS_WITH_AS(dte::SgdMomentumInverse::bind({.lr = 1e-3, .momentum = 1.5}, theta, {buf}),
                       Contains("momentum must be in (0, 1]"), dte::numeric_error);
}

TEST_CASE("negative and absurdly large eps are refused") {
  AdamFixture f;
  f.h.eps = -1e-8;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("eps must be in [0, 1]"), dte::numeric_error);
  f.h.eps = 1e300;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("eps must be in [0, 1]"), dte::numeric_error);
  f.h.eps = 1.0;
  CHECK_NOTHROW(f.bind());
}

TEST_CASE("lr and eps below FP32's normal range are refused, zero is not") {
  AdamFixture f;
  f.h.lr = 1e-40;
  CHECK_THROWS_WITH_AS(f.bind(),
                       Contains("lr for tensor 'layers.0.mlp.weight' is 1e-40, below FP32's "
                                "normal range"),
                       dte::invalid_argument);
  f.h.lr = 1e-5;
  f.h.eps = 1e-39;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("eps for tensor 'layers.0.mlp.weight' is 1e-39"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(f.bind(), Contains("pass 0 or a value of at least 1.17549435e-38"),
                       dte::invalid_argument);
  f.h.eps = 0.0;
  CHECK_NOTHROW(f.bind());
  f.h.lr = 0.0;
  CHECK_NOTHROW(f.bind());
  std::vector<float> theta(4, 0.5f), buf(4, 1e-3f);
  CHECK_THROWS_WITH_AS(dte::SgdMomentumInverse::bind({.lr = 1e-41, .momentum = 0.9}, theta, {buf}),
                       Contains("lr for the shard is 1e-41, below FP32's normal range"),
                       dte::invalid_argument);
}

TEST_CASE("negative weight decay and betas outside [0, 1) are refused") {
  AdamFixture f;
  f.h.weight_decay = -0.1;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("weight_decay must be in [0, 10000]"),
                       dte::numeric_error);
  f.h.weight_decay = 0.1;
  f.h.beta2 = 1.0;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("beta2 must be in [0, 1)"), dte::invalid_argument);
  f.h.beta2 = 0.999;
  f.h.beta1 = -0.1;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("beta1 must be in [0, 1)"), dte::invalid_argument);
}

TEST_CASE("negative exp_avg_sq is refused with the count and the first index") {
  AdamFixture f;
  f.v[3] = -1e-9f;
  f.v[6] = -2.0f;
  CHECK_THROWS_WITH_AS(f.bind(),
                       Contains("exp_avg_sq of tensor 'layers.0.mlp.weight' has 2 "
                                "negative value(s), the first at index 3"),
                       dte::invalid_argument);
}

TEST_CASE("NaN or Inf in theta, exp_avg or exp_avg_sq is refused with the count and first index") {
  SUBCASE("theta") {
    AdamFixture f;
    f.theta[1] = kNaN;
    f.theta[5] = -kInf;
    CHECK_THROWS_WITH_AS(f.bind(),
                         Contains("theta of tensor 'layers.0.mlp.weight' has 2 "
                                  "non-finite value(s) (NaN or Inf), the first at index 1"),
                         dte::invalid_argument);
  }
  SUBCASE("exp_avg") {
    AdamFixture f;
    f.m[7] = kInf;
    CHECK_THROWS_WITH_AS(f.bind(),
                         Contains("exp_avg of tensor 'layers.0.mlp.weight' has 1 "
                                  "non-finite value(s) (NaN or Inf), the first at index 7"),
                         dte::invalid_argument);
  }
  SUBCASE("exp_avg_sq") {
    AdamFixture f;
    f.v[0] = kNaN;
    CHECK_THROWS_WITH_AS(f.bind(), Contains("exp_avg_sq of tensor 'layers.0.mlp.weight' has 1"),
                         dte::invalid_argument);
    CHECK_THROWS_WITH_AS(f.bind(), Contains("refusing to publish this step"),
                         dte::invalid_argument);
  }
  SUBCASE("momentum buffer") {
    std::vector<float> theta(4, 1.0f), buf(4, 0.0f);
    buf[2] = kNaN;
    CHECK_THROWS_WITH_AS(dte::SgdMomentumInverse::bind({.lr = 0.1, .momentum = 0.9}, theta, {buf}),
                         Contains("momentum_buffer of the shard has 1 non-finite value(s)"),
                         dte::invalid_argument);
  }
}

TEST_CASE("mismatched lengths are refused") {
  AdamFixture f;
  f.v.pop_back();
  CHECK_THROWS_WITH_AS(f.bind(),
                       Contains("length mismatch for tensor 'layers.0.mlp.weight': theta "
                                "has 8 elements but exp_avg_sq has 7"),
                       dte::invalid_argument);
  std::vector<float> theta(4, 1.0f);
  std::vector<std::uint16_t> shadow(5);
  CHECK_THROWS_WITH_AS(dte::SnapshotBase::bind({}, theta, {shadow}),
                       Contains("theta has 4 elements but published has 5"), dte::invalid_argument);
}

TEST_CASE("unsupported Adam variants are refused") {
  AdamFixture f;
  f.h.amsgrad = true;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("amsgrad is not supported"), dte::unsupported);
  f.h.amsgrad = false;
  f.h.maximize = true;
  CHECK_THROWS_WITH_AS(f.bind(), Contains("maximize=True is not supported"), dte::unsupported);
}

TEST_CASE("SGD: Nesterov and momentum-free SGD are refused") {
  std::vector<float> theta(4, 1.0f), buf(4, 0.1f);
  CHECK_THROWS_WITH_AS(
      dte::SgdMomentumInverse::bind({.lr = 0.1, .momentum = 0.9, .nesterov = true}, theta, {buf}),
      Contains("Nesterov momentum cannot be inverted"), dte::unsupported);
  CHECK_THROWS_WITH_AS(dte::SgdMomentumInverse::bind({.lr = 0.1, .momentum = 0.0}, theta, {buf}),
                       Contains("plain SGD keeps no state to invert"), dte::invalid_argument);
  CHECK_THROWS_WITH_AS(
      dte::SgdMomentumInverse::bind({.lr = 0.1, .momentum = 0.9, .dampening = 1.5}, theta, {buf}),
      Contains("dampening must be in [0, 1]"), dte::invalid_argument);
  CHECK_NOTHROW(dte::SgdMomentumInverse::bind({.lr = 0.1, .momentum = 0.9}, theta, {buf}));
}
