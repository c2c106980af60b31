// SPDX-License-Identifier: Apache-2.0
// One idea: trainer and receivers as separate processes. Run it as one MPI job:
//   mpirun -np 6 ./example_mpi_sync
// Ranks 0-3 are the Megatron trainer ranks (tp=2, dp=2), ranks 4-5 the SGLang receivers (tp=2).
// Each process takes part in every publication; a stalled or dead peer becomes an error within
// the deadline instead of a hang.
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/transport/mpi.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  using namespace dte;
  int status = 0;
  try {
    const layout::HfModel model(layout::model_preset("tiny-qwen3"));
    const layout::TrainTopology train = layout::parse_train_topology("tp=2,dp=2");
    const layout::ServingLayout receivers(model, layout::parse_infer_topology("tp=2"));
    // Every process builds the trainer here for simplicity; only trainer ranks read it.
    sim::SyntheticTrainer trainer(model, train, {.lr = 1e-5, .warmup_steps = 2});
    const sim::AdamWAccess access{&trainer};
    MpiTwoRoundConfig config;
    config.deadline = std::chrono::seconds(20);
    MpiTwoRound transport(MPI_COMM_WORLD, static_cast<int>(train.world()),
                          static_cast<int>(receivers.topology().ranks()), config);
    // A receiver process owns its tensors (here zero-filled; an inference engine's own weights).
    std::vector<std::vector<std::uint16_t>> storage;
    ReceiverTensors views;
    if (transport.is_receiver()) {
      for (std::int64_t k = 0; k < receivers.size(); ++k) {
        storage.emplace_back(static_cast<std::size_t>(receivers[k].numel), std::uint16_t{0});
        views.emplace_back(storage.back());
      }
    }
    DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound> engine(model, train, receivers,
                                                                            {}, transport, views);
    bool verified = engine.publish_full(access).verified;
    for (int step = 1; step <= 10; ++step) {
      trainer.step();
      SyncReport report;
      engine.step(access, report);
      verified = verified && report.verified;
    }
    if (!engine.is_sender()) {
      std::printf("receiver process %d holds version %llu, %s\n", engine.rank(),
                  static_cast<unsigned long long>(engine.receiver().version()),
                  verified ? "verified after every publication" : "NOT VERIFIED");
    }
    status = verified ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return status;
}
