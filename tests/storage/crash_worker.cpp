// SPDX-License-Identifier: Apache-2.0
// The process test_storage_crash kills: a writer group (the synthetic small-qwen3 trainer,
// tp=2 writers as threads) publishing to ROOT forever, or a reader applying ROOT up to LATEST.
//   crash_worker write ROOT     anchor at step 0, then one delta per optimizer step, forever
//   crash_worker read ROOT      a fresh reader (tp=2) polls to LATEST, then exits 0
// The trainer is deterministic (seed 0, lr 3e-6), so the test recomputes the weights of any
// version from its step.
#include <cstdio>
#include <exception>
#include <string>

#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"

int main(int argc, char** argv) {
  using namespace dte;
  if (argc != 3) {
    std::fprintf(stderr, "usage: crash_worker write|read ROOT\n");
    return 2;
  }
  const std::string mode = argv[1];
  try {
    const layout::HfModel hf(layout::model_preset("small-qwen3"));
    const auto train = layout::parse_train_topology("tp=2");
    const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=2"));
    if (mode == "write") {
      sim::SyntheticTrainer trainer(hf, train, {.lr = 3e-6, .warmup_steps = 0});
      const sim::AdamWAccess access{&trainer};
      sim::StorageCluster writers(hf, train, argv[2], {}, 2);
      writers.publish(access);
      for (;;) {
        trainer.step();
        writers.publish(access);
      }
    }
    if (mode == "read") {
      sim::OwnedReader reader(hf, recv, argv[2], {0});
      const auto rep = reader->poll();
      if (!rep.ok()) {
        std::fprintf(stderr, "crash_worker read: %s\n", rep.error.c_str());
        return 1;
      }
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crash_worker: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "crash_worker: unknown mode '%s'\n", mode.c_str());
  return 2;
}
