// SPDX-License-Identifier: Apache-2.0
// The golden suite (tests/golden/golden.hpp) over the engine on real MPI processes: each process
// of the job is one rank of a DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>,
// the trainer ranks first, then the receiver ranks, each receiver owning its tensors. Every
// process runs the (deterministic) synthetic trainer: a trainer rank publishes from its shard, a
// receiver rank uses it only for the dense reference (sim/dense_check.hpp), computed without the
// plan, the routing or the receiver core. After each publication the receivers' mismatches are
// summed over the engine's processes and every rank's report (verified, no repair, committed)
// is agreed over them, so every process reaches the same decision. A topology pair needing
// fewer processes than the job runs on the first ones (a communicator of its own).
//   mpirun -np 6 golden_mpi
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "../golden/golden.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/transport/mpi.hpp"

using namespace dte;

namespace {

struct Pair {
  const char* model;
  const char* train;
  const char* infer;
};

// This process's rank of the engine over `comm` (its processes: trainer ranks, then receivers).
class MpiPath final : public golden::Path {
 public:
  using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>;

  MpiPath(MPI_Comm comm, const Pair& p, std::int64_t every)
      : comm_(comm),
        hf_(layout::model_preset(p.model)),
        train_(layout::parse_train_topology(p.train)),
        recv_(hf_, layout::parse_infer_topology(p.infer)),
        trainer_(hf_, train_, golden::lively()),
        transport_(comm, static_cast<int>(train_.world()),
                   static_cast<int>(recv_.topology().ranks())),
        engine_(hf_, train_, recv_, {.publish_every = every}, transport_, own_tensors()) {}

  void full() override { note(engine_.publish_full(access_)); }
  bool step() override {
    trainer_.step();
    SyncReport rep;
    if (!engine_.step(access_, rep)) return false;
    note(rep);
    return true;
  }
  bool flush() override {
    SyncReport rep;
    if (!engine_.flush(access_, rep)) return false;
    note(rep);
    return true;
  }
  // This receiver's elements that differ from the dense reference, summed over the engine.
  std::int64_t mismatches() override {
    long long bad =
        engine_.is_receiver()
            ? sim::dense_mismatches(hf_, recv_, trainer_.canonical_weights(), engine_.receiver())
            : 0;
    DTE_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG_LONG, MPI_SUM, comm_));
    return bad;
  }
  // Every rank's reports since the last call confirmed, agreed over the engine.
  bool confirmed() override {
    int ok = std::exchange(confirmed_, true) ? 1 : 0;
    DTE_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_LAND, comm_));
    return ok != 0;
  }

 private:
  // Verified without a repair or resync; a receiver committed the published version.
  void note(const SyncReport& rep) {
    confirmed_ = confirmed_ && rep.verified && rep.repaired.empty() && rep.resynced.empty() &&
                 rep.repair_refused.empty() && rep.version == engine_.version() &&
                 (!engine_.is_receiver() || engine_.receiver().version() == rep.version);
  }
  // A receiver process owns its tensors (zero-filled; the first full publication fills them).
  ReceiverTensors own_tensors() {
    ReceiverTensors views;
    if (transport_.is_sender()) return views;
    for (std::int64_t k = 0; k < recv_.size(); ++k) {
      storage_.emplace_back(static_cast<std::size_t>(recv_[k].numel), std::uint16_t{0});
      views.emplace_back(storage_.back());
    }
    return views;
  }

  MPI_Comm comm_;
  layout::HfModel hf_;
  layout::TrainTopology train_;
  layout::ServingLayout recv_;
  sim::SyntheticTrainer trainer_;
  sim::AdamWAccess access_{&trainer_};
  MpiTwoRound transport_;
  std::vector<std::vector<std::uint16_t>> storage_;  // before engine_: it holds views of it
  Engine engine_;
  bool confirmed_ = true;
};

// The processes a pair needs: its trainer ranks and its receiver ranks.
int processes(const Pair& p) {
  const layout::HfModel hf(layout::model_preset(p.model));
  const layout::ServingLayout recv(hf, layout::parse_infer_topology(p.infer));
  return static_cast<int>(layout::parse_train_topology(p.train).world() + recv.topology().ranks());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const Pair pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=2"},                 // data parallel trainer
      {"tiny-qwen3-moe", "tp=2,ep=2,etp=1", "tp=2,ep=2"},  // MoE, EP on both sides
      {"tiny-qwen3", "tp=2,pp=2", "tp=1,replicas=2"},      // pipeline stages, two replicas
  };
  int scenarios = 0, publications = 0, failures = 0;
  try {
    for (const Pair& p : pairs) {
      const int need = processes(p);
      if (need > size) {
        throw invalid_argument(std::string(p.model) + " " + p.train + " -> " + p.infer + " needs " +
                               std::to_string(need) + " processes; the job has " +
                               std::to_string(size));
      }
      // The pair's engine runs on processes [0, need); the rest wait for its outcome.
      MPI_Comm comm = MPI_COMM_NULL;
      DTE_MPI_TRY(MPI_Comm_split(MPI_COMM_WORLD, rank < need ? 0 : MPI_UNDEFINED, rank, &comm));
      for (const std::int64_t K : {1, 3}) {
        // As the loopback suite's check_path: a full publication forced halfway (after a
        // scheduled one), the steps left flushed (14 % 3 != 0: K = 3 leaves some).
        golden::Scenario s;
        s.steps = 14;
        s.every = K;
        s.flush = true;
        s.full_at = static_cast<int>(K * ((s.steps / 2) / K));
        int out[2] = {0, 0};  // publications, failures
        if (comm != MPI_COMM_NULL) {
          MpiPath path(comm, p, K);
          const golden::Outcome o = golden::run(path, s);
          out[0] = o.publications, out[1] = o.failures;
        }
        // Every process takes rank 0's outcome; one that ran the engine and saw another
        // counts as a failure (the engine's ranks must agree).
        int lead[2] = {out[0], out[1]};
        DTE_MPI_TRY(MPI_Bcast(lead, 2, MPI_INT, 0, MPI_COMM_WORLD));
        int disagree = comm != MPI_COMM_NULL && (out[0] != lead[0] || out[1] != lead[1]);
        DTE_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, &disagree, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD));
        const int expected = golden::expected_publications(s);
        const int failed = lead[1] + (lead[0] != expected) + disagree;
        ++scenarios;
        publications += lead[0];
        failures += failed;
        if (rank == 0) {
          std::printf(
              "%s train %s -> infer %s, K=%lld, %d processes: %d publications (expected "
              "%d), %d failures%s\n",
              p.model, p.train, p.infer, static_cast<long long>(K), need, lead[0], expected, failed,
              disagree ? " (the ranks disagree)" : "");
          std::fflush(stdout);
        }
      }
      if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "golden_mpi: error on rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  if (rank == 0) {
    std::printf("golden over MPI: %d scenarios, %d publications, %d failures\n", scenarios,
                publications, failures);
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
