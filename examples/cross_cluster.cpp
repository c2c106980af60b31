// SPDX-License-Identifier: Apache-2.0
// One idea: trainer and inference in different clusters, joined only by shared storage. The
// trainer side (one writer: a tp=1 synthetic small-qwen3 with AdamW) publishes every optimizer
// step to a storage root as canonical sparse chunks, with an HF checkpoint directory as an
// anchor every 5 versions; the inference side (one SGLang replica, tp=2, its own BF16 tensors)
// polls LATEST and applies each complete version transactionally. A second reader starts late
// and reseeds from the newest anchor.
//   example_cross_cluster [ROOT]     (default: a fresh directory under /tmp)
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/publisher.hpp"
#include "dte/storage/reader.hpp"
#include "dte/transport/loopback.hpp"

int main(int argc, char** argv) {
  using namespace dte;
  namespace fs = std::filesystem;
  const fs::path root =
      argc > 1 ? fs::path(argv[1])
               : fs::temp_directory_path() / ("dte-cross-cluster-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const layout::HfModel model(layout::model_preset("small-qwen3"));

  // ---- The trainer cluster: its writer ranks (here one) form a world that only agrees.
  const layout::TrainTopology train = layout::parse_train_topology("tp=1");
  const layout::ServingLayout infer(model, layout::parse_infer_topology("tp=2"));
  sim::SyntheticTrainer trainer(model, train, {.lr = 1e-6, .warmup_steps = 0});
  const sim::AdamWAccess access{&trainer};
  LoopbackWorld writers(1, 0);
  storage::Publisher<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound> publisher(
      model, train, root, {.anchor_every = 5}, writers.endpoint(0));

  // ---- The inference cluster: the engine's tensors (here plain vectors), one view each.
  using Tensors = std::vector<std::vector<std::vector<std::uint16_t>>>;  // [tp rank][tensor]
  const auto allocate = [&](Tensors& tensors) {
    tensors.resize(2);
    std::vector<ReceiverTensors> views(2);
    for (std::size_t ts = 0; ts < 2; ++ts) {
      for (std::int64_t k = 0; k < infer.size(); ++k)
        tensors[ts].emplace_back(static_cast<std::size_t>(infer[k].numel));
      for (auto& t : tensors[ts])
        views[ts].emplace_back(t);
    }
    return views;
  };
  Tensors tensors;
  storage::Reader reader(model, infer, root, {0}, allocate(tensors), {.name = "replica-0"});

  publisher.publish(access);  // version 1: an anchor (the first publication always is)
  for (int step = 1; step <= 12; ++step) {
    trainer.step();
    const auto pub = publisher.step(access);
    const storage::ReadReport got = reader.poll();  // on the inference side, in practice
    if (!got.ok()) {
      std::printf("reader: %s (still serving version %llu)\n", got.error.c_str(),
                  static_cast<unsigned long long>(reader.version()));
      return 1;
    }
    std::printf(
        "v%-3llu %-6s %9llu changed, %9llu bytes on storage (%.2f per changed), reader "
        "holds v%llu\n",
        static_cast<unsigned long long>(pub->version), pub->anchor() ? "anchor" : "delta",
        static_cast<unsigned long long>(pub->changed), static_cast<unsigned long long>(pub->bytes),
        static_cast<double>(pub->bytes) / static_cast<double>(pub->changed),
        static_cast<unsigned long long>(reader.version()));
  }
  const auto differ =
      sim::dense_mismatches(model, infer, trainer.canonical_weights(), reader.receivers());

  // A reader that starts now replays from the newest anchor (version 10) to LATEST.
  Tensors late_tensors;
  storage::Reader late(model, infer, root, {0}, allocate(late_tensors));
  const storage::ReadReport rep = late.poll();
  const auto late_differ =
      sim::dense_mismatches(model, infer, trainer.canonical_weights(), late.receivers());
  std::printf("a late reader replayed %zu versions from anchor v%llu\n", rep.applied.size(),
              rep.applied.empty() ? 0ull : static_cast<unsigned long long>(rep.applied.front()));
  std::printf("receiver elements that differ from a dense sync: %lld\n",
              static_cast<long long>(differ + late_differ));
  fs::remove_all(root);
  return differ + late_differ == 0 && rep.ok() ? 0 : 1;
}
