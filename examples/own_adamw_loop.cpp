// SPDX-License-Identifier: Apache-2.0
// One idea: a training loop that owns plain AdamW buffers finds the BF16 elements each step
// changed from the optimizer state alone, with no copy of the previous weights.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "dte/dte.hpp"

int main() {
  constexpr std::size_t n = 1 << 20;
  std::mt19937 rng(1);
  std::normal_distribution<float> init(0.0f, 0.02f), noise(0.0f, 1.0f);
  std::vector<float> theta(n), m(n, 0.0f), v(n, 0.0f), grad(n);
  for (float& x : theta)
    x = init(rng);

  const double lr = 1e-6, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (int step = 1; step <= 5; ++step) {
    for (float& g : grad)
      g = 1e-3f * noise(rng);
    // The user's own optimizer step (torch.optim.AdamW order).
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (std::size_t i = 0; i < n; ++i) {
      theta[i] *= static_cast<float>(1 - lr * wd);
      m[i] = static_cast<float>(b1) * m[i] + static_cast<float>(1 - b1) * grad[i];
      v[i] = static_cast<float>(b2) * v[i] + static_cast<float>(1 - b2) * grad[i] * grad[i];
      const float denom =
          std::sqrt(v[i]) / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(eps);
      theta[i] -= static_cast<float>(lr / bc1) * (m[i] / denom);
    }
    // dte: which BF16 values changed in this step?
    const auto k = dte::AdamWInverse::bind(
        {.lr = lr,
         .weight_decay = wd,
         .beta1 = b1,
         .beta2 = b2,
         .eps = eps,
         .step = step,
         .decay_form = dte::DecayForm::multiply},  // theta *= 1 - lr*wd above
        theta, {m, v}, "example.weight");
    std::size_t changed = 0;
    for (std::size_t i = 0; i < k.size(); ++i)
      changed += dte::BF16Detect::changed(k.current(i), k(i));
    std::printf("step %d: %zu of %zu BF16 elements to send (%.3f%%)\n", step, changed, n,
                100.0 * static_cast<double>(changed) / n);
  }
  return 0;
}
