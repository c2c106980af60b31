// SPDX-License-Identifier: Apache-2.0
// dte simulate: the synthetic trainer publishing through DeltaEngine to every receiver, checked
// against a dense sync. --transport loopback (default): every trainer and receiver rank a thread
// of this process; --transport mpi: one rank per process of an MPI job (simulate_mpi.cpp);
// --transport storage: writers and readers through a storage root (storage.cpp). One driver for
// both (simulate_driver.hpp).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/validate.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/start_checkpoint.hpp"
#include "layout_settings.hpp"
#include "simulate.hpp"
#include "simulate_driver.hpp"

namespace dte::tool {

namespace {

using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;

constexpr std::int64_t kDenseCheckLimit = 200'000'000;  // receiver elements

// Every rank in this process.
class LoopbackRunner {
 public:
  explicit LoopbackRunner(const SimulateOptions& o, Simulation& s)
      : s_(&s),
        cluster_(s.hf, s.train, s.recv, {.publish_every = o.publish_every}),
        dense_check_(s.infer.ranks() * s.recv.live_elements(0) <= kDenseCheckLimit) {}

  [[nodiscard]] bool lead() const noexcept { return true; }
  SyncReport publish_full(const sim::AdamWAccess& a) { return cluster_.publish_full(a); }
  bool step(const sim::AdamWAccess& a, SyncReport& r) { return cluster_.step(a, r); }
  bool flush(const sim::AdamWAccess& a, SyncReport& r) { return cluster_.flush(a, r); }
  long long mismatches(const std::vector<float>& canonical) const {
    if (!dense_check_) return -1;
    return sim::dense_mismatches(s_->hf, s_->recv, canonical, cluster_.receivers());
  }
  void dump(const std::string& dir) const {
    for (const Receiver* r : cluster_.receivers())
      dump_receiver(dir, s_->recv, *r);
  }

 private:
  Simulation* s_;
  sim::LoopbackCluster<Engine> cluster_;
  bool dense_check_;
};

}  // namespace

void register_simulate(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "simulate", "Train a synthetic Qwen3 in-process and sync every receiver by deltas");
  auto o = std::make_shared<SimulateOptions>();
  cmd->add_option("--model", o->model, "preset or config.json")->capture_default_str();
  cmd->add_option("--train", o->train, "trainer topology (as dte plan)")->capture_default_str();
  cmd->add_option("--stack", o->stack, stack_help)->capture_default_str();
  cmd->add_option(
      "--write-start-checkpoint", o->start_checkpoint,
      "write the synthetic model's initial weights as an HF checkpoint directory (BF16, "
      "with model.safetensors.index.json), for dte verify-start");
  cmd->add_option(
      "--checkpoint-train", o->checkpoint_train,
      "write it as a converter assuming this trainer topology would (default: --train)");
  cmd->add_option("--checkpoint-stack", o->checkpoint_stack,
                  "... and this stack's defaults (default: --stack)");
  cmd->add_option("--infer", o->infer, "receiver topology (as dte plan)")->capture_default_str();
  cmd->add_option("--steps", o->steps, "optimizer steps")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{10'000'000}));
  cmd->add_option("--publish-every", o->publish_every, "publish every K optimizer steps")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{10'000'000}));
  cmd->add_option("--lr", o->lr, "peak learning rate (warmup then cosine)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, limits::max_lr));
  cmd->add_option("--warmup", o->warmup, "warmup steps (default: steps/10)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{10'000'000}));
  cmd->add_option("--seed", o->seed, "seed of weights and gradients")->capture_default_str();
  cmd->add_flag("--json", o->json, "one JSON line per publication, then a summary object");
  cmd->add_option(
      "--dump", o->dump,
      "write DIR/trainer.safetensors (F32, HF names) and DIR/receiver-<rank>.safetensors "
      "(BF16, SGLang names) at the end");
  cmd->add_option("--transport", o->transport,
                  "loopback: every rank a thread of this process; mpi: one rank per process of "
                  "an MPI job (mpirun -np trainer ranks + receiver ranks); storage: writers "
                  "publish to --dir, readers follow it (cross-cluster)")
      ->check(CLI::IsMember({"loopback", "mpi", "storage"}))
      ->capture_default_str();
  cmd->add_option("--deadline-ms", o->deadline_ms, "MPI: deadline of every wait")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{3'600'000}));
  cmd->add_option("--fault", o->fault,
                  "MPI fault test: kill-receiver:R:V (receiver R SIGKILLs itself in version V's "
                  "payload round) or stall-trainer:G:V (trainer G stalls there past the deadline)");
  cmd->add_option("--dir", o->dir, "storage: the storage root (created if absent)");
  cmd->add_option(
         "--anchor-every", o->anchor_every,
         "storage: an anchor (HF checkpoint directory) every N versions; 0: only the first")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1'000'000}));
  cmd->add_option("--reader-lag", o->reader_lag,
                  "storage: a second reader stays L versions behind, then catches up")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1'000'000}));
  cmd->add_option("--encoding", o->encoding,
                  "storage: value (deltas carry the new bits) or diff (each new value as its "
                  "step from the previous one; needs --publish-every 1)")
      ->check(CLI::IsMember({"value", "diff"}))
      ->capture_default_str();
  cmd->add_option("--index", o->index,
                  "storage: plain (sorted index gaps) or classes (gaps among the positions of "
                  "one base value class: smaller; needs --encoding diff)")
      ->check(CLI::IsMember({"plain", "classes"}))
      ->capture_default_str();
  cmd->add_option("--zstd-level", o->zstd_level, "storage: zstd level of the chunks")
      ->capture_default_str()
      ->check(CLI::Range(1, 19));
  cmd->callback([o, &status] {
    if (!o->start_checkpoint.empty() && o->transport != "loopback") {
      throw invalid_argument("--write-start-checkpoint is for --transport loopback");
    }
    if (o->transport == "storage") {
      status = simulate_storage(*o);
      return;
    }
    if (o->transport == "mpi") {
      status = simulate_mpi(*o);
      return;
    }
    Simulation s(*o);
    if (!o->start_checkpoint.empty()) {
      const layout::TrainTopology assumed =
          train_topology(o->checkpoint_train.empty() ? o->train : o->checkpoint_train,
                         o->checkpoint_stack.empty() ? o->stack : o->checkpoint_stack);
      layout::validate(s.spec, assumed);
      sim::write_start_checkpoint(s.trainer, s.hf, s.train, assumed, o->start_checkpoint);
    }
    LoopbackRunner runner(*o, s);
    status = run_simulation(*o, s, runner);
  });
}

}  // namespace dte::tool
