// SPDX-License-Identifier: Apache-2.0
// Storage publication across processes: every process of the MPI job is one writer rank of a
// tp=2, dp=2 trainer (tiny-qwen3), agreeing through MpiTwoRound (no receivers); rank 0 also
// runs a reader of another topology (tp=2) after each version and checks it bit-identical to a
// dense conversion of the trainer's weights. The root is ARGV[1].
//   mpirun -np 4 storage_mpi ROOT
#include <mpi.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/publisher.hpp"
#include "dte/storage/verify.hpp"
#include "dte/transport/mpi.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  using namespace dte;
  int status = 0;
  try {
    if (argc != 2) throw invalid_argument("usage: storage_mpi ROOT");
    const std::filesystem::path root = argv[1];
    const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
    const layout::TrainTopology train = layout::parse_train_topology("tp=2,dp=2");
    const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=2"));
    sim::SyntheticTrainer trainer(hf, train, {.lr = 1e-5, .warmup_steps = 0});
    const sim::AdamWAccess access{&trainer};
    MpiTwoRoundConfig config;
    config.deadline = std::chrono::seconds(30);
    MpiTwoRound world(MPI_COMM_WORLD, static_cast<int>(train.world()), 0, config);
    if (world.rank() == 0) std::filesystem::remove_all(root);
    MPI_Barrier(MPI_COMM_WORLD);
    storage::Publisher<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound> pub(
        hf, train, root, {.anchor_every = 4, .encoding = storage::Encoding::diff}, world);
    std::unique_ptr<sim::OwnedReader> reader;
    if (world.rank() == 0)
      reader = std::make_unique<sim::OwnedReader>(hf, recv, root, std::vector<std::int64_t>{0});
    long long bad = 0;
    auto check = [&](const storage::PublishReport& rep) {
      if (world.rank() != 0) return;
      const storage::ReadReport got = (*reader)->poll();
      const long long differ =
          got.ok()
              ? sim::dense_mismatches(hf, recv, trainer.canonical_weights(), (*reader)->receivers())
              : -1;
      if (!got.ok() || differ != 0 || (*reader)->version() != rep.version) ++bad;
      std::printf("v%llu %s: %llu changed, %llu bytes; reader v%llu %s\n",
                  static_cast<unsigned long long>(rep.version), rep.anchor() ? "anchor" : "delta",
                  static_cast<unsigned long long>(rep.changed),
                  static_cast<unsigned long long>(rep.bytes),
                  static_cast<unsigned long long>((*reader)->version()),
                  got.ok() ? (differ == 0 ? "bit-identical" : "DIFFERS") : got.error.c_str());
    };
    check(pub.publish(access));
    for (int step = 0; step < 8; ++step) {
      trainer.step();
      check(*pub.step(access));
    }
    if (world.rank() == 0) {
      const storage::VerifyReport v = storage::verify_root(hf, root);
      for (const auto& p : v.problems)
        std::printf("FAULT %s: %s\n", p.path.c_str(), p.what.c_str());
      if (!v.ok()) ++bad;
      std::printf("storage over MPI: %s\n",
                  bad == 0 ? "every version bit-identical, verified" : "FAILED");
      status = bad == 0 ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "storage_mpi: %s\n", e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
