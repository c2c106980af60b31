// SPDX-License-Identifier: Apache-2.0
// The whole device path on the host twin (dte/sim/simt_host.hpp; ctest -L device-on-host): the
// engine's device sender (engine/device_sender.hpp), the device receiver (engine/
// device_receiver.hpp) and the publication's device sender (publication/device_sender.hpp),
// each over the device stages (pipeline/device_stages.hpp), the code a GPU runs but for the
// launches and CUB's algorithms. Against the host frame, over the golden suite's delivery paths:
//   - DeltaEngine on the twin == the host engine: every message each trainer rank sends each
//     receiver, byte for byte, every report's counts and digest, K = 1 and K = 3, in one routing
//     batch and in many;
//   - the golden suite (tests/golden/golden.hpp) over DeltaEngine on the twin: device receivers
//     checked against the dense reference after every publication, verified without a repair;
//   - publication::Publisher on the twin == the host publisher, byte for byte
//     (tests/publication/device_publisher_cases.hpp, the cases test_cuda_publication runs on a
//     GPU).
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../golden/golden.hpp"
#include "device_publisher_cases.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/simt_host.hpp"
#include "dte/sim/simt_host_senders.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/sim/threads.hpp"
#include "dte/transport/loopback.hpp"
#include "recording_transport.hpp"

namespace dte {
namespace {

using Recorded = dte_test::Recording<LoopbackTwoRound>;

// One loopback world of DeltaEngine over executor Exec (exec::Host, or the twin sim::SimtHost
// with its receivers' tensors in the twin's memory, BasicDeviceTensors), every message a trainer
// rank sends recorded; the golden suite's path over it.
template <class Exec>
class EngineWorld final : public golden::Path {
 public:
  static constexpr bool twin = std::is_same_v<Exec, sim::SimtHost>;
  using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, Recorded, Exec>;

  EngineWorld(const char* model, const char* train, const char* infer, std::int64_t every,
              sim::SyntheticConfig trainer, std::uint64_t scratch = 256ull << 20)
      : hf_(layout::model_preset(model)),
        train_(layout::parse_train_topology(train)),
        recv_(hf_, layout::parse_infer_topology(infer)),
        trainer_(hf_, train_, trainer),
        access_{&trainer_},
        world_(static_cast<int>(train_.world()), static_cast<int>(recv_.topology().ranks()),
               std::chrono::seconds(60)) {
    const EngineConfig config{.publish_every = every};
    const auto n = static_cast<std::size_t>(world_.size());
    ranks_.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      Rank& me = ranks_[r];
      me.loopback = std::make_unique<LoopbackTwoRound>(world_, static_cast<int>(r));
      me.transport = std::make_unique<Recorded>(*me.loopback, me.sent);
      if constexpr (twin) {
        const sim::SimtHost e(3, scratch);
        std::shared_ptr<TensorSink> sink;  // (null on a trainer rank)
        if (me.transport->is_receiver()) {
          std::vector<std::uint16_t*> pointers;
          for (std::int64_t k = 0; k < recv_.size(); ++k) {
            me.device.push_back(pipeline::device::Array<sim::SimtHost, std::uint16_t>::zeros(
                e, static_cast<std::size_t>(recv_[k].numel)));
            pointers.push_back(me.device.back().data());
          }
          sink = std::make_shared<sim::SimtHostTensors>(
              hf_, recv_, static_cast<std::int64_t>(r) - world_.senders(), pointers, e);
        }
        me.engine = std::make_unique<Engine>(hf_, train_, recv_, config, *me.transport, sink, e);
      } else {
        ReceiverTensors views;
        if (me.transport->is_receiver()) {
          for (std::int64_t k = 0; k < recv_.size(); ++k) {
            me.host.emplace_back(static_cast<std::size_t>(recv_[k].numel), std::uint16_t{0});
            views.emplace_back(me.host.back());
          }
        }
        me.engine = std::make_unique<Engine>(hf_, train_, recv_, config, *me.transport, views,
                                             exec::Host(1));
      }
    }
  }

  void full() override {
    note(run([&](Engine& e, SyncReport& rep) {
      rep = e.publish_full(access_);
      return true;
    }));
  }
  bool step() override {
    trainer_.step();
    return note(run([&](Engine& e, SyncReport& rep) { return e.step(access_, rep); }));
  }
  bool flush() override {
    return note(run([&](Engine& e, SyncReport& rep) { return e.flush(access_, rep); }));
  }
  std::int64_t mismatches() override {
    const std::vector<float> canonical = trainer_.canonical_weights();
    std::int64_t bad = 0;
    for (int d = 0; d < world_.receivers(); ++d) {
      const std::vector<std::vector<std::uint16_t>> held = tensors(d);
      const std::vector<std::span<const std::uint16_t>> views(held.begin(), held.end());
      bad += sim::dense_mismatches(hf_, recv_, canonical, d, views);
    }
    return bad;
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

  // Receiver d's tensors, as the host sees them.
  [[nodiscard]] std::vector<std::vector<std::uint16_t>> tensors(int d) const {
    const Rank& r = ranks_[static_cast<std::size_t>(world_.senders() + d)];
    if constexpr (twin) {
      std::vector<std::vector<std::uint16_t>> out;
      for (const auto& x : r.device)
        out.push_back(x.to_host());
      return out;
    } else {
      return r.host;
    }
  }
  // Flips every bit of element i of receiver d's tensor k, where the receiver holds it.
  void flip(int d, std::int64_t k, std::size_t i) {
    Rank& r = ranks_[static_cast<std::size_t>(world_.senders() + d)];
    std::uint16_t* p = nullptr;
    if constexpr (twin) {
      p = r.device[static_cast<std::size_t>(k)].data();
    } else {
      p = r.host[static_cast<std::size_t>(k)].data();
    }
    p[i] = static_cast<std::uint16_t>(~p[i]);
  }

  [[nodiscard]] const std::vector<SyncReport>& reports() const noexcept { return reports_; }
  [[nodiscard]] const Recorded::Log& sent(int rank) const {
    return ranks_[static_cast<std::size_t>(rank)].sent;
  }
  [[nodiscard]] int senders() const noexcept { return world_.senders(); }
  [[nodiscard]] int receivers() const noexcept { return world_.receivers(); }
  [[nodiscard]] sim::SyntheticTrainer& trainer() noexcept { return trainer_; }

 private:
  struct Rank {
    Recorded::Log sent;
    std::unique_ptr<LoopbackTwoRound> loopback;
    std::unique_ptr<Recorded> transport;
    std::vector<std::vector<std::uint16_t>> host;                               // exec::Host
    std::vector<pipeline::device::Array<sim::SimtHost, std::uint16_t>> device;  // the twin
    std::unique_ptr<Engine> engine;
  };

  // f(engine, report) on every rank, each on its own thread; rank 0's report if it published.
  template <class F>
  std::optional<SyncReport> run(F&& f) {
    std::vector<SyncReport> reports(ranks_.size());
    std::vector<char> published(ranks_.size(), 0);
    const std::vector<std::exception_ptr> errors = sim::detail::on_threads(
        ranks_.size(),
        [&](std::size_t r) { published[r] = f(*ranks_[r].engine, reports[r]) ? 1 : 0; });
    sim::detail::rethrow_first(errors, ranks_[0].engine->refused_by());
    if (published[0] == 0) return std::nullopt;
    return reports[0];
  }

  // Verified without a repair or resync; every receiver committed the published version.
  bool note(const std::optional<SyncReport>& rep) {
    if (!rep) return false;
    reports_.push_back(*rep);
    bool ok = rep->verified && rep->repaired.empty() && rep->resynced.empty() &&
              rep->repair_refused.empty() && rep->version == ranks_[0].engine->version();
    for (int d = 0; d < world_.receivers(); ++d) {
      const Engine& e = *ranks_[static_cast<std::size_t>(world_.senders() + d)].engine;
      ok = ok && e.receiver().version() == rep->version;
    }
    confirmed_ = confirmed_ && ok;
    return true;
  }

  layout::HfModel hf_;
  layout::TrainTopology train_;
  layout::ServingLayout recv_;
  sim::SyntheticTrainer trainer_;
  sim::AdamWAccess access_;
  LoopbackWorld world_;
  std::vector<Rank> ranks_;
  std::vector<SyncReport> reports_;
  bool confirmed_ = true;
};

struct Pair {
  const char* model;
  const char* train;
  const char* infer;
};

// The golden suite's topology pairs (tests/cuda/test_cuda_golden.cu runs the same on a GPU).
constexpr Pair kPairs[] = {
    {"tiny-qwen3", "tp=2,dp=2", "tp=2"},                 // data parallel trainer
    {"tiny-qwen3-moe", "tp=2,ep=2,etp=1", "tp=2,ep=2"},  // MoE, EP on both sides
    {"tiny-qwen3", "tp=2,pp=2", "tp=1,replicas=2"},      // pipeline stages, two replicas
};

TEST_CASE("device-on-host: DeltaEngine on the host twin == the host engine, byte for byte") {
  // The same trainer (same seed) published by a host engine and by a device engine on the twin;
  // every trainer rank must send every receiver the same bytes from both (one encoding policy:
  // the v2 header has no timing and no backend tag, so no field is left out), both must report
  // the same counts and digest, and the twin's receivers must stay dense-equal and verified.
  const std::uint64_t small = pipeline::route_bytes_per_batch + (1u << 16);
  for (const Pair& p : kPairs) {
    for (const std::int64_t K : {1, 3}) {
      for (const std::uint64_t scratch : {std::uint64_t{256} << 20, small}) {
        CAPTURE(p.model);
        CAPTURE(p.train);
        CAPTURE(p.infer);
        CAPTURE(K);
        CAPTURE(scratch);
        const sim::SyntheticConfig trainer{.seed = 11, .lr = 2e-4};
        EngineWorld<exec::Host> host(p.model, p.train, p.infer, K, trainer);
        EngineWorld<sim::SimtHost> device(p.model, p.train, p.infer, K, trainer, scratch);
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
          const SyncReport& h = host.reports()[x];
          const SyncReport& d = device.reports()[x];
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
            REQUIRE(d[x].size() == h[x].size());
            for (std::size_t r = 0; r < h[x].size(); ++r) {
              INFO("receiver " << r);
              INFO("host: " << dte_test::describe(h[x][r]));
              INFO("device: " << dte_test::describe(d[x][r]));
              INFO("first difference: " << dte_test::first_difference(h[x][r], d[x][r]));
              CHECK(d[x][r] == h[x][r]);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("device-on-host: golden suite over DeltaEngine on the host twin (device receivers)") {
  for (const Pair& p : kPairs) {
    for (const std::int64_t K : {1, 3}) {
      CAPTURE(p.model);
      CAPTURE(p.train);
      CAPTURE(p.infer);
      CAPTURE(K);
      // As the loopback suite's check_path: a full publication forced halfway (after a scheduled
      // one), the steps left flushed (14 % 3 != 0: K = 3 leaves some).
      golden::Scenario s;
      s.steps = 14;
      s.every = K;
      s.flush = true;
      s.full_at = static_cast<int>(K * ((s.steps / 2) / K));
      EngineWorld<sim::SimtHost> path(p.model, p.train, p.infer, K, golden::lively());
      const golden::Outcome out = golden::run(path, s);
      CHECK(out.publications == golden::expected_publications(s));
      CHECK(out.failures == 0);
      // The check reads the twin's memory: one element flipped there is the one mismatch.
      path.flip(0, 0, 0);
      CHECK(path.mismatches() == 1);
    }
  }
}

// The trainer's state in the twin's memory.
struct Twin {
  using E = sim::SimtHost;
  static E executor() { return E{}; }
  static void to_device(const E&, void* device, const void* host, std::size_t bytes) {
    std::memcpy(device, host, bytes);
  }
};

namespace cases = dte_test::device_publisher;

TEST_CASE("device-on-host: publisher on the twin: one writer's messages are the host's") {
  cases::one_writer_cases<Twin>();
}

TEST_CASE("device-on-host: publisher on the twin: every writer's part is the host's") {
  cases::writer_cases<Twin>();
}

TEST_CASE("device-on-host: publisher on the twin: batches do not depend on their size") {
  cases::batches<Twin>();
}

}  // namespace
}  // namespace dte
