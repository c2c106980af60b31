// SPDX-License-Identifier: Apache-2.0
// dte_test::EngineWorld<Backend>: one loopback world of DeltaEngine<AdamWInverse, BF16Detect,
// MegatronToHF, Recording<LoopbackTwoRound>, Backend::Exec>, one engine per rank, each rank on
// its own thread, every message a trainer rank sends recorded; the golden suite's path
// (tests/golden/golden.hpp) over it. The backend says where a rank's state lives:
//   - HostBackend (here): exec::Host, the receivers' tensors in host vectors;
//   - the host twin of the GPU (test_device_path_on_host.cpp): sim::SimtHost, the receivers'
//     tensors in its memory behind BasicDeviceTensors;
//   - exec::Cuda (tests/cuda/engine_backend.cuh): a stream per rank, the trainer ranks'
//     optimizer state and the receivers' tensors in device memory.
// same_publications(host, device) is the differential check of one against another: every
// report's counts and digest, and every message each trainer rank sent each receiver, byte for
// byte (one encoding policy: the v2 header has no timing and no backend tag, so no field is left
// out). Backend::Rank, built for each rank (trainer, rank, is_receiver, scratch limit), has:
//   exec                        the rank's executor;
//   tensors(hf, recv, d)        receiver d's tensors, as the engine takes them (views, a sink);
//   access()                    the trainer access of a trainer rank (null on a receiver rank);
//   after_step()                what follows an optimizer step (a device copy of the state);
//   to_host(), flip(k, i)       the receiver's tensors as the host sees them; every bit of
//                               element i of tensor k flipped where the receiver holds it.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../golden/golden.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/sim/threads.hpp"
#include "dte/transport/loopback.hpp"
#include "recording_transport.hpp"

namespace dte_test {

using Recorded = Recording<dte::LoopbackTwoRound>;

// exec::Host ranks: the receivers' tensors in host vectors, the trainer read where it is.
struct HostBackend {
  using Exec = dte::exec::Host;
  struct Rank {
    Rank(const dte::sim::SyntheticTrainer& trainer, int, bool, std::uint64_t)
        : trainer_access{&trainer} {}
    dte::exec::Host exec{1};
    dte::sim::AdamWAccess trainer_access;
    std::vector<std::vector<std::uint16_t>> held;

    dte::ReceiverTensors tensors(const dte::layout::HfModel&,
                                 const dte::layout::ServingLayout& recv, std::int64_t) {
      dte::ReceiverTensors views;
      for (std::int64_t k = 0; k < recv.size(); ++k) {
        held.emplace_back(static_cast<std::size_t>(recv[k].numel), std::uint16_t{0});
        views.emplace_back(held.back());
      }
      return views;
    }
    [[nodiscard]] const dte::sim::AdamWAccess* access() const { return &trainer_access; }
    void after_step() {}
    [[nodiscard]] std::vector<std::vector<std::uint16_t>> to_host() const { return held; }
    void flip(std::size_t k, std::size_t i) {
      held[k][i] = static_cast<std::uint16_t>(~held[k][i]);
    }
  };
};

template <class Backend>
class EngineWorld final : public dte::golden::Path {
 public:
  using Exec = typename Backend::Exec;
  using Engine =
      dte::DeltaEngine<dte::AdamWInverse, dte::BF16Detect, dte::MegatronToHF, Recorded, Exec>;

  EngineWorld(const char* model, const char* train, const char* infer, std::int64_t every,
              dte::sim::SyntheticConfig trainer, std::uint64_t scratch = 256ull << 20)
      : hf_(dte::layout::model_preset(model)),
        train_(dte::layout::parse_train_topology(train)),
        recv_(hf_, dte::layout::parse_infer_topology(infer)),
        trainer_(hf_, train_, trainer),
        world_(static_cast<int>(train_.world()), static_cast<int>(recv_.topology().ranks()),
               std::chrono::seconds(60)) {
    const dte::EngineConfig config{.publish_every = every};
    for (int r = 0; r < world_.size(); ++r) {
      auto slot = std::make_unique<Slot>(world_, r, trainer_, r >= world_.senders(), scratch);
      auto& state = slot->state;
      if (slot->transport.is_receiver()) {
        slot->engine =
            std::make_unique<Engine>(hf_, train_, recv_, config, slot->transport,
                                     state.tensors(hf_, recv_, r - world_.senders()), state.exec);
      } else {
        slot->engine =
            std::make_unique<Engine>(hf_, train_, recv_, config, slot->transport,
                                     decltype(state.tensors(hf_, recv_, 0)){}, state.exec);
      }
      ranks_.push_back(std::move(slot));
    }
  }

  void full() override {
    note(run([](Engine& e, const auto& access, dte::SyncReport& rep) {
      rep = e.publish_full(access);
      return true;
    }));
  }
  bool step() override {
    trainer_.step();
    for (auto& r : ranks_)
      r->state.after_step();
    return note(run(
        [](Engine& e, const auto& access, dte::SyncReport& rep) { return e.step(access, rep); }));
  }
  bool flush() override {
    return note(run(
        [](Engine& e, const auto& access, dte::SyncReport& rep) { return e.flush(access, rep); }));
  }
  // Over every receiver rank: its tensors, as the host sees them, against the dense reference
  // of the trainer's current weights.
  std::int64_t mismatches() override {
    const std::vector<float> canonical = trainer_.canonical_weights();
    std::int64_t bad = 0;
    for (int d = 0; d < world_.receivers(); ++d) {
      const std::vector<std::vector<std::uint16_t>> held = tensors(d);
      const std::vector<std::span<const std::uint16_t>> views(held.begin(), held.end());
      bad += dte::sim::dense_mismatches(hf_, recv_, canonical, d, views);
    }
    return bad;
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

  // Receiver d's tensors, as the host sees them.
  [[nodiscard]] std::vector<std::vector<std::uint16_t>> tensors(int d) const {
    return receiver_rank(d).state.to_host();
  }
  // Flips every bit of element i of receiver d's tensor k, where the receiver holds it.
  void flip(int d, std::int64_t k, std::size_t i) {
    ranks_[static_cast<std::size_t>(world_.senders() + d)]->state.flip(static_cast<std::size_t>(k),
                                                                       i);
  }

  [[nodiscard]] const std::vector<dte::SyncReport>& reports() const noexcept { return reports_; }
  [[nodiscard]] const Recorded::Log& sent(int rank) const {
    return ranks_[static_cast<std::size_t>(rank)]->sent;
  }
  [[nodiscard]] int senders() const noexcept { return world_.senders(); }
  [[nodiscard]] int receivers() const noexcept { return world_.receivers(); }

 private:
  // One rank. Destroyed in reverse: the engine (and the sink it may hold, which points into the
  // backend's tensors) first, then the backend's state (on exec::Cuda the stream its arrays are
  // freed on goes last), then the transport.
  struct Slot {
    Slot(dte::LoopbackWorld& world, int r, const dte::sim::SyntheticTrainer& trainer, bool receiver,
         std::uint64_t scratch)
        : loopback(world, r), transport(loopback, sent), state(trainer, r, receiver, scratch) {}
    Recorded::Log sent;
    dte::LoopbackTwoRound loopback;
    Recorded transport;
    typename Backend::Rank state;
    std::unique_ptr<Engine> engine;
  };

  [[nodiscard]] const Slot& receiver_rank(int d) const {
    return *ranks_[static_cast<std::size_t>(world_.senders() + d)];
  }

  // f(engine, access, report) on every rank, each on its own thread; rank 0's report if it
  // published (every rank returns the same). Receiver ranks never read the access: they get
  // trainer rank 0's. When ranks throw, the refusing trainer rank's exception (it says why),
  // else the lowest rank's.
  template <class F>
  std::optional<dte::SyncReport> run(F&& f) {
    std::vector<dte::SyncReport> reports(ranks_.size());
    std::vector<char> published(ranks_.size(), 0);
    const auto* any = ranks_[0]->state.access();
    const std::vector<std::exception_ptr> errors =
        dte::sim::detail::on_threads(ranks_.size(), [&](std::size_t r) {
          Slot& me = *ranks_[r];
          const auto* a = me.state.access();
          published[r] = f(*me.engine, a != nullptr ? *a : *any, reports[r]) ? 1 : 0;
        });
    dte::sim::detail::rethrow_first(errors, ranks_[0]->engine->refused_by());
    if (published[0] == 0) return std::nullopt;
    return reports[0];
  }

  // Verified without a repair or resync; every receiver committed the published version.
  bool note(const std::optional<dte::SyncReport>& rep) {
    if (!rep) return false;
    reports_.push_back(*rep);
    bool ok = rep->verified && rep->repaired.empty() && rep->resynced.empty() &&
              rep->repair_refused.empty() && rep->version == ranks_[0]->engine->version();
    for (int d = 0; d < world_.receivers(); ++d) {
      const Engine& e = *receiver_rank(d).engine;
      ok = ok && e.receiver().version() == rep->version;
    }
    confirmed_ = confirmed_ && ok;
    return true;
  }

  dte::layout::HfModel hf_;
  dte::layout::TrainTopology train_;
  dte::layout::ServingLayout recv_;
  dte::sim::SyntheticTrainer trainer_;
  dte::LoopbackWorld world_;
  std::vector<std::unique_ptr<Slot>> ranks_;
  std::vector<dte::SyncReport> reports_;
  bool confirmed_ = true;
};

// The golden suite's topology pairs.
struct Pair {
  const char* model;
  const char* train;
  const char* infer;
};
inline constexpr Pair kGoldenPairs[] = {
    {"tiny-qwen3", "tp=2,dp=2", "tp=2"},                 // data parallel trainer
    {"tiny-qwen3-moe", "tp=2,ep=2,etp=1", "tp=2,ep=2"},  // MoE, EP on both sides
    {"tiny-qwen3", "tp=2,pp=2", "tp=1,replicas=2"},      // pipeline stages, two replicas
};

// The golden suite over EngineWorld<Backend> (built by make(pair, K)) at every pair and K in
// {1, 3}: a full publication forced halfway (after a scheduled one), the steps left flushed
// (14 % 3 != 0: K = 3 leaves some), every receiver dense-equal and verified after every
// publication; then one element flipped where receiver 0 holds it must be the one mismatch the
// check finds (the check reads the backend's memory).
template <class Backend>
void golden_suite(std::uint64_t scratch = 256ull << 20) {
  for (const Pair& p : kGoldenPairs) {
    for (const std::int64_t K : {1, 3}) {
      CAPTURE(p.model);
      CAPTURE(p.train);
      CAPTURE(p.infer);
      CAPTURE(K);
      dte::golden::Scenario s;
      s.steps = 14;
      s.every = K;
      s.flush = true;
      s.full_at = static_cast<int>(K * ((s.steps / 2) / K));
      EngineWorld<Backend> path(p.model, p.train, p.infer, K, dte::golden::lively(), scratch);
      const dte::golden::Outcome out = dte::golden::run(path, s);
      CHECK(out.publications == dte::golden::expected_publications(s));
      CHECK(out.failures == 0);
      path.flip(0, 0, 0);
      CHECK(path.mismatches() == 1);
    }
  }
}

// The same trainer (same seed) published by a host engine and by a Backend engine: 7 steps at
// publish_every K with a full publication asked for after step 4, then a flush. Both must make
// the same publications, with the same counts and digest, and every trainer rank must send
// every receiver the same bytes from both; the Backend's receivers stay dense-equal and
// verified.
template <class Backend>
void same_publications(const Pair& p, std::int64_t K, std::uint64_t scratch = 256ull << 20) {
  CAPTURE(p.model);
  CAPTURE(p.train);
  CAPTURE(p.infer);
  CAPTURE(K);
  CAPTURE(scratch);
  const dte::sim::SyntheticConfig trainer{.seed = 11, .lr = 2e-4};
  EngineWorld<HostBackend> host(p.model, p.train, p.infer, K, trainer);
  EngineWorld<Backend> device(p.model, p.train, p.infer, K, trainer, scratch);
  host.full();
  device.full();
  for (int step = 1; step <= 7; ++step) {
    CHECK(host.step() == device.step());
    if (step == 4) {  // a full publication asked for between steps
      host.full();
      device.full();
    }
  }
  CHECK(host.flush() == device.flush());
  CHECK(host.confirmed());
  CHECK(device.confirmed());
  CHECK(device.mismatches() == 0);
  REQUIRE(host.reports().size() == device.reports().size());
  for (std::size_t x = 0; x < host.reports().size(); ++x) {
    INFO("publication " << x);
    const dte::SyncReport& h = host.reports()[x];
    const dte::SyncReport& d = device.reports()[x];
    CHECK(d.verified);
    CHECK(d.changed == h.changed);
    CHECK(d.elements_scanned == h.elements_scanned);
    CHECK(d.guard == h.guard);
    CHECK(d.digest == h.digest);
    CHECK(d.version == h.version);
  }
  for (int s = 0; s < host.senders(); ++s) {
    INFO("trainer rank " << s);
    const Recorded::Log& h = host.sent(s);
    const Recorded::Log& d = device.sent(s);
    CHECK(h.size() == host.reports().size());
    REQUIRE(d.size() == h.size());
    for (std::size_t x = 0; x < h.size(); ++x) {
      INFO("exchange " << x);
      REQUIRE(h[x].size() == static_cast<std::size_t>(host.receivers()));
      REQUIRE(d[x].size() == h[x].size());
      for (std::size_t r = 0; r < h[x].size(); ++r) {
        INFO("receiver " << r);
        INFO("host: " << describe(h[x][r]));
        INFO("device: " << describe(d[x][r]));
        INFO("first difference: " << first_difference(h[x][r], d[x][r]));
        CHECK(d[x][r] == h[x][r]);
      }
    }
  }
}

}  // namespace dte_test
