// SPDX-License-Identifier: Apache-2.0
// The golden suite (golden.hpp) over every in-process delivery path:
//   engine       DeltaEngine over loopback ranks (the Megatron-sharded synthetic trainer, the
//                routing sink, wire v2, receiver ranks of the serving layout), 3 topology pairs
//                x K in {1, 2, 4, 8}, and the other families (tied, q/k/v biases, Llama);
//                and templated over the inverses (AdamWInverse, AdamInverse, SgdMomentumInverse,
//                the trainer running the optimizer each undoes), 2 topology pairs x K in {1, 3};
//   storage      storage::Publisher writers and storage::Reader: a reader that keeps up, and one
//                that lags 3 versions, over anchors every 5 versions;
//   hf           publication messages (a flat FP32 trainer, what dte.TorchPublisher makes of a
//                PyTorch model) into HF tensors, every tiny family, K in {1, 3};
//   shard        the same messages into every TP rank of tp 2 and 4 (KV rows replicated), each
//                replica's digests against the trainer's.
// Over MPI processes the same suite runs on the engine with MpiTwoRound, one rank per process
// (tests/mpi/golden_mpi.cpp, CTest mpi_golden), as does `dte simulate` (mpi_simulate_golden_*);
// on a GPU the suite runs on the engine over exec::Cuda, device optimizer state and device
// receivers (tests/cuda/test_cuda_golden.cu).
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../publication/flat_adamw.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/stack.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "golden.hpp"

using namespace dte;

namespace {

// ---- engine over loopback ranks
// ------------------------------------------------------------------

// The engine of one optimizer inverse, reading the synthetic trainer (running the optimizer the
// inverse undoes, cfg.optimizer) through Access.
template <class Inverse, class Access>
class EnginePath final : public golden::Path {
 public:
  using Engine = DeltaEngine<Inverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;

  EnginePath(const char* model, const char* train, const char* infer, std::int64_t every,
             const sim::SyntheticConfig& cfg = golden::lively())
      : hf_(layout::model_preset(model)),
        train_(layout::parse_train_topology(train)),
        recv_(hf_, layout::parse_infer_topology(infer)),
        trainer_(hf_, train_, cfg),
        engine_(hf_, train_, recv_, {.publish_every = every}) {}

  void full() override { note(engine_.publish_full(access_)); }
  bool step() override {
    trainer_.step();
    SyncReport rep;
    if (!engine_.step(access_, rep)) return false;
    note_delta(rep);
    return true;
  }
  bool flush() override {
    SyncReport rep;
    if (!engine_.flush(access_, rep)) return false;
    note_delta(rep);
    return true;
  }
  std::int64_t mismatches() override {
    return sim::dense_mismatches(hf_, recv_, trainer_.canonical_weights(), engine_.receivers());
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

  // Over the scheduled publications (deltas): sender elements whose BF16 value changed (sent, not
  // only for the guard band), and elements scanned.
  [[nodiscard]] std::uint64_t changed() const noexcept { return changed_; }
  [[nodiscard]] std::uint64_t scanned() const noexcept { return scanned_; }

 private:
  void note(const SyncReport& rep) {
    confirmed_ = confirmed_ && rep.verified && rep.repaired.empty();
  }
  void note_delta(const SyncReport& rep) {
    note(rep);
    changed_ += rep.changed - rep.guard;
    scanned_ += rep.elements_scanned;
  }

  layout::HfModel hf_;
  layout::TrainTopology train_;
  layout::ServingLayout recv_;
  sim::SyntheticTrainer trainer_;
  Access access_{&trainer_};
  sim::LoopbackCluster<Engine> engine_;
  bool confirmed_ = true;
  std::uint64_t changed_ = 0, scanned_ = 0;
};

using AdamWEnginePath = EnginePath<AdamWInverse, sim::AdamWAccess>;

// Per inverse: the synthetic trainer's optimizer (the forward step the inverse undoes) and the
// accessor that reads it.
template <class Inverse>
struct Optimizer;
template <>
struct Optimizer<AdamWInverse> {
  using Access = sim::AdamWAccess;
  static sim::SyntheticConfig config() { return golden::lively(); }
};
template <>
struct Optimizer<AdamInverse> {
  using Access = sim::AdamAccess;
  static sim::SyntheticConfig config() {
    sim::SyntheticConfig cfg = golden::lively();
    cfg.optimizer = sim::SyntheticOptimizer::adam;  // L2: g += 0.1 * theta on 2-D parameters
    return cfg;
  }
};
template <>
struct Optimizer<SgdMomentumInverse> {
  using Access = sim::SgdMomentumAccess;
  static sim::SyntheticConfig config() {
    sim::SyntheticConfig cfg = golden::lively();
    cfg.optimizer = sim::SyntheticOptimizer::sgd_momentum;
    cfg.momentum = 0.9;
    cfg.lr = 2e-3;  // SGD's steps are lr * buf, buf ~ 10 * (g + 0.1 * theta): BF16 moves
    return cfg;
  }
};

// ---- storage: a reader that keeps up, one that lags
// ----------------------------------------------

class StoragePath final : public golden::Path {
 public:
  static constexpr Version lag = 3;

  StoragePath(const char* model, const char* train, const char* infer)
      : hf_(layout::model_preset(model)),
        train_(layout::parse_train_topology(train)),
        recv_(hf_, layout::parse_infer_topology(infer)),
        trainer_(hf_, train_, {.lr = 3e-5, .warmup_steps = 0}),
        root_(fresh_root()),
        writers_(hf_, train_, root_, {.anchor_every = 5}, 2),
        live_(hf_, recv_, root_, all_replicas(recv_)),
        lagging_(hf_, recv_, root_, {0}, {.name = "lagging"}) {
    weights_.emplace_back();  // versions count from 1
  }
  ~StoragePath() override { std::filesystem::remove_all(root_); }

  void full() override {
    const storage::PublishReport rep =
        weights_.size() == 1 ? writers_.publish(access_) : writers_.publish_anchor(access_);
    confirmed_ = confirmed_ && rep.anchor();
    deliver(rep.version);
  }
  bool step() override {
    trainer_.step();
    const std::optional<storage::PublishReport> rep = writers_.step(access_);
    if (!rep) return false;
    deliver(rep->version);
    return true;
  }
  std::int64_t mismatches() override {
    return sim::dense_mismatches(hf_, recv_, weights_[live_->version()], live_->receivers()) +
           (lagging_->version() == no_version
                ? 0
                : sim::dense_mismatches(hf_, recv_, weights_[lagging_->version()],
                                        lagging_->receivers()));
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

 private:
  static std::filesystem::path fresh_root() {
    const auto root = std::filesystem::temp_directory_path() /
                      ("dte-golden-" + std::to_string(::getpid()) + "-" + std::to_string(made_++));
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root);
    return root;
  }
  static std::vector<std::int64_t> all_replicas(const layout::ServingLayout& l) {
    std::vector<std::int64_t> r;
    for (std::int64_t k = 0; k < l.topology().replicas; ++k)
      r.push_back(k);
    return r;
  }
  void deliver(Version v) {
    weights_.push_back(trainer_.canonical_weights());
    confirmed_ = confirmed_ && v == weights_.size() - 1;
    const storage::ReadReport got = live_->poll();
    confirmed_ = confirmed_ && got.ok() && live_->version() == v;
    if (v > lag) {
      const storage::ReadReport behind = lagging_->advance(v - lag);
      confirmed_ = confirmed_ && behind.ok() && lagging_->version() == v - lag;
    }
  }

  static inline int made_ = 0;
  layout::HfModel hf_;
  layout::TrainTopology train_;
  layout::ServingLayout recv_;
  sim::SyntheticTrainer trainer_;
  sim::AdamWAccess access_{&trainer_};
  std::filesystem::path root_;
  sim::StorageCluster writers_;
  sim::OwnedReader live_, lagging_;
  std::vector<std::vector<float>> weights_;  // by version
  bool confirmed_ = true;
};

// ---- publication messages into HF tensors and TP shards
// ------------------------------------------

class PublicationPath final : public golden::Path {
 public:
  using Pub = publication::Publisher<AdamWInverse, BF16Detect>;

  // Receivers: one over HF tensors, or (tps non-empty) every rank of each TP size in tps.
  PublicationPath(const char* model, std::int64_t every, std::vector<std::int64_t> tps)
      : spec_(layout::model_preset(model)), pub_(spec_, {.publish_every = every}) {
    const layout::HfModel& hf = pub_.model();
    if (tps.empty()) {
      hf_tensors_ = std::make_unique<Owned>();
      for (std::int64_t t = 0; t < hf.size(); ++t)
        hf_tensors_->add(static_cast<std::size_t>(hf[t].numel()), 0x7FC0);  // NaN: never served
      hf_rx_ = std::make_unique<publication::HfReceiver>(spec_, hf_tensors_->views);
    }
    for (const std::int64_t tp : tps) {
      const layout::InferTopology topo{.tp = tp};
      const layout::ServingLayout l(hf, topo);
      std::vector<const publication::ShardReceiver*> replica;
      for (std::int64_t ts = 0; ts < tp; ++ts) {
        auto& owned = shard_tensors_.emplace_back(std::make_unique<Owned>());
        for (std::int64_t k = 0; k < l.size(); ++k)
          owned->add(static_cast<std::size_t>(l[k].numel), 0);
        shards_.push_back(
            std::make_unique<publication::ShardReceiver>(spec_, topo, ts, owned->views));
        replica.push_back(shards_.back().get());
      }
      replicas_.push_back(std::move(replica));
    }
  }

  void full() override { deliver(publish(true)); }
  bool step() override {
    tr_.step();
    const auto f = tr_.flat();
    std::optional<publication::Bytes> msg = pub_.step(publication::FlatAccess<AdamWInverse>{&f});
    if (!msg) return false;
    deliver(*msg);
    return true;
  }
  std::int64_t mismatches() override {
    std::int64_t bad = 0;
    if (hf_rx_) bad += sim::hf_mismatches(pub_.model(), tr_.theta, hf_tensors_->views);
    for (const auto& s : shards_)
      bad += sim::dense_mismatches(pub_.model(), s->layout(), tr_.theta, s->receiver());
    return bad;
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

 private:
  struct Owned {
    std::vector<std::vector<std::uint16_t>> data;
    ReceiverTensors views;
    void add(std::size_t n, std::uint16_t fill) {
      data.emplace_back(n, fill);
      views.clear();
      for (auto& d : data)
        views.emplace_back(d);
    }
  };

  publication::Bytes publish(bool full) {
    const auto f = tr_.flat();
    return pub_.publish(publication::FlatAccess<AdamWInverse>{&f}, full);
  }
  void deliver(const publication::Bytes& msg) {
    if (hf_rx_) {
      confirmed_ =
          confirmed_ && hf_rx_->apply(msg).committed() && hf_rx_->digest() == pub_.digest();
    }
    for (auto& s : shards_)
      confirmed_ = confirmed_ && s->apply(msg).committed();
    for (const auto& replica : replicas_)
      confirmed_ = confirmed_ && publication::check_replica(replica, pub_.digest()).empty();
  }

  layout::ModelSpec spec_;
  testing::FlatAdamW tr_{spec_};
  Pub pub_;
  std::unique_ptr<Owned> hf_tensors_;
  std::unique_ptr<publication::HfReceiver> hf_rx_;
  std::vector<std::unique_ptr<Owned>> shard_tensors_;
  std::vector<std::unique_ptr<publication::ShardReceiver>> shards_;
  std::vector<std::vector<const publication::ShardReceiver*>> replicas_;
  bool confirmed_ = true;
};

// The scenario over one path: every publication delivered and golden, as many as scheduled.
void check_path(golden::Path& path, int steps, std::int64_t every, bool flush = false) {
  golden::Scenario s;
  s.steps = steps;
  s.every = every;
  s.flush = flush;
  s.full_at = static_cast<int>(every * ((steps / 2) / every));  // after a scheduled publication
  const golden::Outcome out = golden::run(path, s);
  CHECK(out.publications == golden::expected_publications(s));
  CHECK(out.failures == 0);
}

struct Pair {
  const char* model;
  const char* train;
  const char* infer;
};

}  // namespace

TEST_CASE("golden: the engine over loopback ranks") {
  const Pair pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=4,replicas=2"},          // infer TP 4 > 2 KV heads
      {"tiny-qwen3-moe", "tp=2,pp=2,ep=2,dp=2", "tp=4,ep=2"},  // MoE, EP on both sides
      {"tiny-qwen3", "tp=4,pp=2", "tp=1,replicas=2"},          // different TP both sides
  };
  for (const Pair& p : pairs) {
    for (const std::int64_t K : {1, 2, 4, 8}) {
      CAPTURE(std::string(p.model));
      CAPTURE(std::string(p.train));
      CAPTURE(std::string(p.infer));
      CAPTURE(K);
      AdamWEnginePath path(p.model, p.train, p.infer, K);
      check_path(path, 42, K, true);  // (42: K = 4 and 8 leave steps to flush)
    }
  }
}

TEST_CASE("golden: the engine, other families (tied, q/k/v biases, Llama)") {
  const Pair pairs[] = {
      {"tiny-qwen3-tied", "tp=2,pp=2,dp=2", "tp=4,replicas=2"},  // the output copy on stage 1
      {"tiny-qwen2", "tp=4,pp=2", "tp=8"},                       // biases, TP > KV heads
      {"tiny-llama", "tp=2,pp=2", "tp=2,replicas=2"},            // tied, no q/k norm
  };
  for (const Pair& p : pairs) {
    for (const std::int64_t K : {1, 3}) {
      CAPTURE(std::string(p.model));
      CAPTURE(K);
      AdamWEnginePath path(p.model, p.train, p.infer, K);
      check_path(path, 24, K);
    }
  }
}

TEST_CASE_TEMPLATE("golden: the engine under each optimizer inverse", Inverse, AdamWInverse,
                   AdamInverse, SgdMomentumInverse) {
  using Opt = Optimizer<Inverse>;
  const Pair pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=4,replicas=2"},          // dense, DP
      {"tiny-qwen3-moe", "tp=2,pp=2,ep=2,dp=2", "tp=4,ep=2"},  // MoE, EP on both sides
  };
  for (const Pair& p : pairs) {
    for (const std::int64_t K : {1, 3}) {
      const std::string model = p.model;
      CAPTURE(model);
      CAPTURE(K);
      EnginePath<Inverse, typename Opt::Access> path(p.model, p.train, p.infer, K, Opt::config());
      check_path(path, 20, K, true);  // (K = 3 leaves 2 steps to flush)
      // Not vacuous: the receivers moved (a learning rate too small for BF16 would pass), at
      // least 1% of the elements scanned per delta.
      CAPTURE(path.scanned());
      CHECK(path.changed() * 100 > path.scanned());
    }
  }
}

TEST_CASE("golden: storage, a reader that keeps up and one that lags 3 versions") {
  const Pair pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=2,replicas=2"},
      {"tiny-qwen3-moe", "tp=2,ep=2,etp=1", "tp=2,ep=2"},
  };
  for (const Pair& p : pairs) {
    CAPTURE(p.model);
    StoragePath path(p.model, p.train, p.infer);
    check_path(path, 13, 1);
  }
}

TEST_CASE("golden: publication messages into HF tensors and into TP shards") {
  for (const char* model :
       {"tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-qwen3-tied", "tiny-qwen3-moe"}) {
    for (const std::int64_t K : {1, 3}) {
      CAPTURE(model);
      CAPTURE(K);
      PublicationPath hf(model, K, {});
      check_path(hf, 9, K);
      PublicationPath shards(model, K, {2, 4});
      check_path(shards, 9, K);
    }
  }
}
