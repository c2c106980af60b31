// SPDX-License-Identifier: Apache-2.0
// One idea: the whole pipeline in one process. A synthetic Megatron trainer (small-qwen3,
// tp=2, dp=2) takes AdamW steps; after each one DeltaEngine reconstructs the previous weights
// from the optimizer state, sends only the BF16 elements that changed to 8 SGLang receivers
// (tp=4, 2 replicas) and verifies every replica against the trainer's digest.
#include <cstdio>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/engine/report_json.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"

int main() {
  using namespace dte;
  const layout::HfModel model(layout::model_preset("small-qwen3"));
  const layout::TrainTopology train = layout::parse_train_topology("tp=2,dp=2");
  const layout::ServingLayout receivers(model, layout::parse_infer_topology("tp=4,replicas=2"));

  sim::SyntheticTrainer trainer(model, train, {.lr = 1e-6, .warmup_steps = 2});
  const sim::AdamWAccess access{&trainer};  // the FP32 shards and an AdamWInverse per segment
  // One DeltaEngine per rank: 4 trainer ranks and 8 receiver ranks, each a thread of this
  // process talking through a LoopbackWorld; the cluster owns the receivers' BF16 tensors.
  using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;
  sim::LoopbackCluster<Engine> engine(model, train, receivers, {.publish_every = 1});

  engine.publish_full(access);  // version 0: every receiver gets the initial weights
  for (int step = 1; step <= 20; ++step) {
    trainer.step();
    SyncReport report;
    if (engine.step(access, report)) std::printf("%s\n", json(report).c_str());
  }
  const auto differ =
      sim::dense_mismatches(model, receivers, trainer.canonical_weights(), engine.receivers());
  std::printf("receiver elements that differ from a dense sync: %lld\n",
              static_cast<long long>(differ));
  return differ == 0 ? 0 : 1;
}
