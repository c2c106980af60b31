// SPDX-License-Identifier: Apache-2.0
// One idea: your own training loop. The trainer owns plain AdamW buffers for an HF-layout model
// (no Megatron: the Identity layout), runs its own optimizer step, and hands dte an accessor;
// dte finds the changed BF16 elements from exp_avg/exp_avg_sq alone and keeps two SGLang TP
// ranks in sync.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/identity.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/dense_check.hpp"

namespace {

struct MyTrainer {
  const dte::layout::HfModel* model;
  std::vector<float> theta, m, v;  // flat, HF tensors in canonical order
  double lr = 1e-5, weight_decay = 0.1;
  std::int64_t steps = 0;

  // torch.optim.AdamW, no decay on 1-D tensors (norms).
  void step(const std::vector<float>& grad) {
    ++steps;
    const double bc1 = 1 - std::pow(0.9, steps), bc2 = 1 - std::pow(0.999, steps);
    for (std::int64_t t = 0; t < model->size(); ++t) {
      const auto& x = (*model)[t];
      const float decay = static_cast<float>(1 - lr * (x.cols == 0 ? 0.0 : weight_decay));
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
};

// What DeltaEngine reads (concept trainer_access): the weights, and per parameter its
// hyperparameters and AdamW state; the engine binds AdamWInverse itself.
struct MyAccess {
  const MyTrainer* t;
  // One rank, every tensor in the dense buffer; there is no expert buffer.
  std::span<const float> theta(std::int64_t, dte::layout::BufferKind b) const {
    if (b == dte::layout::BufferKind::expert) return {};
    return t->theta;
  }
  dte::AdamHyperparameters hyperparameters(std::int64_t, dte::layout::BufferKind,
                                           const dte::layout::PlanSegment& s) const {
    const auto& x = (*t->model)[s.param];
    // decay_form: step() multiplies by 1 - lr*wd (torch's order), so a -0 weight stays -0.
    return {.lr = t->lr,
            .weight_decay = x.cols == 0 ? 0.0 : t->weight_decay,
            .step = t->steps,
            .decay_form = dte::DecayForm::multiply};
  }
  dte::AdamState state(std::int64_t, dte::layout::BufferKind,
                       const dte::layout::PlanSegment& s) const {
    const auto part = [&](const std::vector<float>& a) {
      return std::span<const float>(a).subspan(static_cast<std::size_t>(s.shard_begin),
                                               static_cast<std::size_t>(s.length));
    };
    return {part(t->m), part(t->v)};
  }
};

}  // namespace

int main() {
  using namespace dte;
  const layout::HfModel model(layout::model_preset("tiny-qwen3"));
  const layout::ServingLayout receivers(model, layout::parse_infer_topology("tp=2"));
  const auto n = static_cast<std::size_t>(model.total());
  MyTrainer trainer{&model, std::vector<float>(n), std::vector<float>(n, 0.0f),
                    std::vector<float>(n, 0.0f)};
  std::mt19937 rng(1);
  std::normal_distribution<float> init(0.0f, 0.02f), noise(0.0f, 1e-3f);
  for (float& x : trainer.theta)
    x = init(rng);

  // One trainer rank and two receiver ranks, as threads of this process.
  sim::LoopbackCluster<DeltaEngine<AdamWInverse, BF16Detect, Identity, LoopbackTwoRound>> engine(
      model, layout::TrainTopology{}, receivers, {});
  const MyAccess access{&trainer};
  engine.publish_full(access);
  std::vector<float> grad(n);
  for (int step = 1; step <= 10; ++step) {
    for (float& g : grad)
      g = noise(rng);
    trainer.step(grad);
    SyncReport report;
    engine.step(access, report);
    std::printf("step %d: version %llu, %llu of %llu elements sent, %llu bytes, verified %s\n",
                step, static_cast<unsigned long long>(report.version),
                static_cast<unsigned long long>(report.changed),
                static_cast<unsigned long long>(report.elements_scanned),
                static_cast<unsigned long long>(report.bytes), report.verified ? "yes" : "NO");
  }
  const auto differ = sim::dense_mismatches(model, receivers, trainer.theta, engine.receivers());
  std::printf("receiver elements that differ from a dense sync: %lld\n",
              static_cast<long long>(differ));
  return differ == 0 ? 0 : 1;
}
