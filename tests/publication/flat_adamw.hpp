// SPDX-License-Identifier: Apache-2.0
// A trainer holding its weights as one flat FP32 buffer (what dte.TorchPublisher makes of a
// PyTorch model), stepping with torch.optim.AdamW's arithmetic: test_publication's trainer and
// bench/bench_apply's. Uses only the public API that publication::Publisher has had since the
// Python binding, so bench/apply_compare.sh can build the benchmark against older revisions.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "dte/layout/hf.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/publisher.hpp"

namespace dte::testing {

// torch.optim.AdamW's arithmetic on one flat buffer, no decay on 1-D tensors.
struct FlatAdamW {
  layout::HfModel hf;
  std::vector<float> theta, m, v, grad;
  double lr = 2e-4, wd = 0.1;
  std::int64_t steps = 0;
  std::mt19937 rng{7};

  explicit FlatAdamW(const layout::ModelSpec& spec)
      : hf(spec),
        theta(static_cast<std::size_t>(hf.total())),
        m(theta.size(), 0.0f),
        v(theta.size(), 0.0f),
        grad(theta.size()) {
    std::normal_distribution<float> init(0.0f, 0.05f);
    for (float& x : theta)
      x = init(rng);
  }

  void step() {
    std::normal_distribution<float> noise(0.0f, 1e-2f);
    for (float& g : grad)
      g = noise(rng);
    ++steps;
    const double bc1 = 1 - std::pow(0.9, steps), bc2 = 1 - std::pow(0.999, steps);
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const auto& x = hf[t];
      const auto decay = static_cast<float>(1 - lr * (x.cols == 0 ? 0.0 : wd));
      for (std::int64_t i = x.base; i < x.base + x.numel(); ++i) {
        const auto k = static_cast<std::size_t>(i);
        theta[k] *= decay;
        m[k] = 0.9f * m[k] + 0.1f * grad[k];
        v[k] = 0.999f * v[k] + 0.001f * grad[k] * grad[k];
        const float denom = std::sqrt(v[k]) / static_cast<float>(std::sqrt(bc2)) + 1e-8f;
        theta[k] -= static_cast<float>(lr / bc1) * (m[k] / denom);
      }
    }
  }

  [[nodiscard]] publication::FlatTrainer<AdamWInverse> flat() const {
    publication::FlatTrainer<AdamWInverse> f;
    f.theta = theta;
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const auto& x = hf[t];
      f.hyper.push_back({.lr = lr,
                         .weight_decay = x.cols == 0 ? 0.0 : wd,
                         .step = steps,
                         .decay_form = DecayForm::multiply});
      const auto part = [&](const std::vector<float>& a) {
        return std::span<const float>(a).subspan(static_cast<std::size_t>(x.base),
                                                 static_cast<std::size_t>(x.numel()));
      };
      f.state.push_back({part(m), part(v)});
    }
    return f;
  }
};

}  // namespace dte::testing
