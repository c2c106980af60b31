// SPDX-License-Identifier: Apache-2.0
// dte simulate --transport mpi: one trainer or receiver rank per process of an MPI job, each a
// DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>. Every process runs the
// (deterministic) synthetic trainer: trainer ranks publish from their own shard; receiver
// ranks own their tensors and use the trainer only to check them against a dense sync.
#include "simulate.hpp"

#if DTE_WITH_MPI

#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/error.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/transport/mpi.hpp"
#include "simulate_driver.hpp"

namespace dte::tool {

namespace {

using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, MpiTwoRound>;

struct Fault {
  std::string kind;
  int rank = -1;
  Version version = 0;
};

Fault parse_fault(const std::string& text) {
  Fault f;
  if (text.empty()) return f;
  const auto a = text.find(':'), b = text.rfind(':');
  if (a == std::string::npos || a == b) {
    throw invalid_argument("--fault " + text + ": expected kill-receiver:R:V or stall-trainer:G:V");
  }
  f.kind = text.substr(0, a);
  if (f.kind != "kill-receiver" && f.kind != "stall-trainer") {
    throw invalid_argument("--fault " + text + ": unknown fault '" + f.kind + "'");
  }
  f.rank = std::stoi(text.substr(a + 1, b - a - 1));
  f.version = std::stoull(text.substr(b + 1));
  return f;
}

// This process's rank of the job.
class MpiRunner {
 public:
  MpiRunner(const SimulateOptions& o, Simulation& s)
      : s_(&s),
        transport_(MPI_COMM_WORLD, static_cast<int>(s.train.world()),
                   static_cast<int>(s.infer.ranks()), transport_config(o)),
        engine_(s.hf, s.train, s.recv, {.publish_every = o.publish_every}, transport_,
                own_tensors(s)) {
    const Fault fault = parse_fault(o.fault);
    if (fault.kind.empty()) return;
    const std::int64_t senders = s.train.world();
    const std::int64_t deadline = o.deadline_ms;
    engine_.between_rounds([this, fault, senders, deadline](int r, Version v) {
      if (v != fault.version) return;
      const bool me = fault.kind == "kill-receiver"
                          ? !engine_.is_sender() && r - senders == fault.rank
                          : engine_.is_sender() && r == fault.rank;
      if (!me) return;
      if (fault.kind == "kill-receiver") std::raise(SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * deadline));
    });
  }

  [[nodiscard]] bool lead() const noexcept { return transport_.rank() == 0; }
  [[nodiscard]] const Engine& engine() const noexcept { return engine_; }
  [[nodiscard]] std::string role() const {
    return engine_.is_sender() ? "trainer rank " + std::to_string(transport_.rank())
                               : "receiver rank " + std::to_string(transport_.receiver_index());
  }
  SyncReport publish_full(const sim::AdamWAccess& a) { return engine_.publish_full(a); }
  bool step(const sim::AdamWAccess& a, SyncReport& r) { return engine_.step(a, r); }
  bool flush(const sim::AdamWAccess& a, SyncReport& r) { return engine_.flush(a, r); }
  long long mismatches(const std::vector<float>& canonical) const {
    long long bad = engine_.is_sender()
                        ? 0
                        : sim::dense_mismatches(s_->hf, s_->recv, canonical, engine_.receiver());
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    return bad;
  }
  void dump(const std::string& dir) const {
    if (engine_.is_receiver()) dump_receiver(dir, s_->recv, engine_.receiver());
  }

 private:
  static MpiTwoRoundConfig transport_config(const SimulateOptions& o) {
    MpiTwoRoundConfig tc;
    tc.deadline = std::chrono::milliseconds(o.deadline_ms);
    return tc;
  }
  // A receiver process owns its tensors (an inference engine's own weights; zero-filled here).
  ReceiverTensors own_tensors(const Simulation& s) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    ReceiverTensors views;
    if (rank < s.train.world()) return views;
    for (std::int64_t k = 0; k < s.recv.size(); ++k) {
      storage_.emplace_back(static_cast<std::size_t>(s.recv[k].numel), std::uint16_t{0});
      views.emplace_back(storage_.back());
    }
    return views;
  }

  Simulation* s_;
  std::vector<std::vector<std::uint16_t>> storage_;  // before engine_: it holds views of it
  MpiTwoRound transport_;
  Engine engine_;
};

}  // namespace

int simulate_mpi(const SimulateOptions& o) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string role = "rank " + std::to_string(rank);
  try {
    Simulation s(o);
    MpiRunner runner(o, s);
    role = runner.role();
    int status = exit_ok;
    try {
      status = run_simulation(o, s, runner);
    } catch (const std::exception& e) {
      // Say what this process holds: a receiver interrupted mid-exchange never commits.
      std::string held;
      if (runner.engine().is_receiver()) {
        const Version v = runner.engine().receiver().version();
        held = "; it still holds version " +
               (v == no_version ? std::string("none") : std::to_string(v)) +
               " (publishing version " + std::to_string(runner.engine().version()) + ")";
      }
      std::fprintf(stderr, "dte: error on %s: %s%s\n", role.c_str(), e.what(), held.c_str());
      std::fflush(stderr);
      // A rank that stalled or died is waited for by every other rank, each at its own point
      // and deadline: give them one deadline to say so before the job is torn down (the first
      // to time out would otherwise kill the rest mid-wait, and with them their diagnosis).
      if (dynamic_cast<const deadline_error*>(&e) != nullptr) {
        std::this_thread::sleep_for(std::chrono::milliseconds(o.deadline_ms));
      }
      MPI_Abort(MPI_COMM_WORLD, exit_bad_input);
      return exit_bad_input;
    }
    MPI_Finalize();
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dte: error on %s: %s\n", role.c_str(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, exit_bad_input);
    return exit_bad_input;
  }
}

}  // namespace dte::tool

#else

#include "dte/error.hpp"

namespace dte::tool {
int simulate_mpi(const SimulateOptions&) {
  throw invalid_argument(
      "--transport mpi: this dte was built without MPI; install Open MPI "
      "(libopenmpi-dev) and rebuild");
}
}  // namespace dte::tool

#endif
