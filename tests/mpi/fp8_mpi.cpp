// SPDX-License-Identifier: Apache-2.0
// The engine with FP8 receivers over real MPI processes (docs/fp8.md, "The engine"): each process
// of the job is one rank of a DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>
// with config.fp8 = "fp8-block": four trainer ranks (tp=2, dp=2, distributed optimizer: blocks of
// the receivers' weights span trainer ranks, so their scales are a max-reduction over the
// processes) and two receiver ranks (tp=2) that hold vLLM's online per-block FP8 codes and
// scales. Every process runs the (deterministic) synthetic trainer; a receiver uses it only for
// the dense reference (sim/fp8_dense.hpp). After each of 30 publications, for K = 1 and K = 4,
// the receivers' differences from the dense requantization are summed over the job, and every
// rank's report must say verified.
//   mpirun -np 6 fp8_mpi
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/fp8_dense.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/transport/mpi.hpp"

using namespace dte;

namespace {

using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>;

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int publications = 0, failures = 0;
  try {
    const layout::ModelSpec spec = sim::fp8_test_model();
    const layout::HfModel hf(spec);
    const layout::TrainTopology train = layout::parse_train_topology("tp=2,dp=2");
    const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=2"));
    for (const std::int64_t K : {1, 4}) {
      sim::SyntheticConfig cfg;
      cfg.seed = 5;
      cfg.lr = 3e-6;
      sim::SyntheticTrainer trainer(hf, train, cfg);
      const sim::AdamWAccess access{&trainer};
      MpiTwoRound transport(MPI_COMM_WORLD, static_cast<int>(train.world()),
                            static_cast<int>(recv.topology().ranks()));
      // a receiver process owns its tensors: sim::Fp8RankTensors (BF16 ones, codes, scales)
      const layout::Fp8Grid grid(recv, VllmBlockFp8::block_rows, VllmBlockFp8::block_cols);
      sim::Fp8RankTensors mine(grid);
      EngineConfig ec;
      ec.publish_every = K;
      ec.fp8 = VllmBlockFp8::name;
      Engine engine(hf, train, recv, ec, transport,
                    Fp8ReceiverTensors{mine.bf16_views(), mine.fp8_views()});
      const auto check = [&](const SyncReport& rep) {
        int bad = rep.verified ? 0 : 1;
        if (engine.is_receiver()) {
          const std::vector<float> w = trainer.canonical_weights();
          const auto weights = [&](std::int64_t t) {
            return std::span<const float>(w).subspan(static_cast<std::size_t>(hf[t].base),
                                                     static_cast<std::size_t>(hf[t].numel()));
          };
          const std::int64_t ts = engine.receiver().rank() % recv.topology().tp;
          const std::string d = sim::fp8_rank_differs(grid, ts, mine, weights);
          if (!d.empty()) {
            std::printf("rank %d: %s differs after version %llu\n", rank, d.c_str(),
                        static_cast<unsigned long long>(rep.version));
            bad = 1;
          }
        }
        DTE_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
        failures += bad;
      };
      check(engine.publish_full(access));
      int n = 0;
      std::uint64_t codes = 0;
      while (n < 30) {
        trainer.step();
        SyncReport rep;
        if (!engine.step(access, rep)) continue;
        check(rep);
        codes += rep.fp8_codes;
        ++n;
      }
      publications += n + 1;
      if (rank == 0) {
        std::printf("K=%lld: 31 publications, %llu FP8 codes sent\n", static_cast<long long>(K),
                    static_cast<unsigned long long>(codes));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) {
    std::printf("FP8 over MPI: %d publications, %d failures\n", publications, failures);
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
