// SPDX-License-Identifier: Apache-2.0
// The golden suite (tests/golden/golden.hpp) over the engine on CUDA: one
// DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound, exec::Cuda> per rank of a
// loopback world, every rank on its own thread and its own stream; each trainer rank reads its
// optimizer state from device memory (sim/device_access.cuh, uploaded after every step), each
// receiver rank commits into its own device tensors (engine/device_receiver.cuh). After every
// publication each receiver's tensors are copied to the host and compared with the dense
// reference (sim/dense_check.hpp: the trainer's canonical FP32 weights through the layout's
// inverse map, never the plan, the routing or the receiver core), and every report must be
// verified without a repair or resync. 3 topology pairs x K in {1, 3}, a full publication
// forced halfway, the steps left flushed; then one element flipped on the device must be the one
// mismatch the check finds. Runs only on a GPU (exit 77 otherwise).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../golden/golden.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/device_receiver.cuh"
#include "dte/engine/engine.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/sim/threads.hpp"
#include "dte/transport/loopback.hpp"

constexpr int kSkipCode = 77;

// Inside namespace dte, not `using namespace dte` at global scope: nvcc's generated stubs name
// ::cuda::std, which dte::cuda would make ambiguous.
namespace dte {
namespace {

class CudaEnginePath final : public golden::Path {
 public:
  using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound, exec::Cuda>;

  CudaEnginePath(const char* model, const char* train, const char* infer, std::int64_t every)
      : hf_(layout::model_preset(model)),
        train_(layout::parse_train_topology(train)),
        recv_(hf_, layout::parse_infer_topology(infer)),
        trainer_(hf_, train_, golden::lively()),
        world_(static_cast<int>(train_.world()), static_cast<int>(recv_.topology().ranks())) {
    const EngineConfig config{.publish_every = every};
    for (int r = 0; r < world_.size(); ++r)
      ranks_.push_back(std::make_unique<Rank>());
    for (int r = 0; r < world_.size(); ++r) {
      Rank& me = *ranks_[static_cast<std::size_t>(r)];
      LoopbackTwoRound& t = world_.endpoint(r);
      std::shared_ptr<TensorSink> sink;  // null on a trainer rank
      if (t.is_receiver()) {
        std::vector<std::uint16_t*> pointers;
        for (std::int64_t k = 0; k < recv_.size(); ++k) {
          me.tensors.push_back(exec::DeviceArray<std::uint16_t>::zeros(
              me.exec, static_cast<std::size_t>(recv_[k].numel)));
          pointers.push_back(me.tensors.back().data());
        }
        sink = std::make_shared<DeviceTensors>(hf_, recv_, r - world_.senders(), pointers, me.exec);
      } else {
        me.access.emplace(trainer_, r, me.exec);
      }
      me.engine = std::make_unique<Engine>(hf_, train_, recv_, config, t, sink, me.exec);
    }
  }

  void full() override {
    note(run([](Engine& e, const sim::DeviceAdamWAccess& a, SyncReport& rep) {
      rep = e.publish_full(a);
      return true;
    }));
  }
  bool step() override {
    trainer_.step();
    for (auto& r : ranks_) {
      if (r->access) r->access->upload();  // (synchronises)
    }
    return note(run([](Engine& e, const sim::DeviceAdamWAccess& a, SyncReport& rep) {
      return e.step(a, rep);
    }));
  }
  bool flush() override {
    return note(run([](Engine& e, const sim::DeviceAdamWAccess& a, SyncReport& rep) {
      return e.flush(a, rep);
    }));
  }

  // Over every receiver rank: its device tensors, copied to the host, against the dense
  // reference of the trainer's current weights.
  std::int64_t mismatches() override {
    const std::vector<float> canonical = trainer_.canonical_weights();
    std::int64_t bad = 0;
    for (int d = 0; d < world_.receivers(); ++d) {
      const std::vector<std::vector<std::uint16_t>> held = download(d);
      const std::vector<std::span<const std::uint16_t>> views(held.begin(), held.end());
      bad += sim::dense_mismatches(hf_, recv_, canonical, d, views);
    }
    return bad;
  }
  bool confirmed() override { return std::exchange(confirmed_, true); }

  // Receiver d's tensors, copied to the host.
  [[nodiscard]] std::vector<std::vector<std::uint16_t>> download(int d) const {
    std::vector<std::vector<std::uint16_t>> out;
    for (const auto& x : receiver_rank(d).tensors)
      out.push_back(x.to_host());  // (synchronises the rank's stream)
    return out;
  }
  // Flips every bit of element i of receiver d's tensor k, on the device.
  void flip(int d, std::int64_t k, std::size_t i) {
    const Rank& r = receiver_rank(d);
    const auto& x = r.tensors[static_cast<std::size_t>(k)];
    REQUIRE(i < x.size());
    std::vector<std::uint16_t> host = x.to_host();
    host[i] = static_cast<std::uint16_t>(~host[i]);
    DTE_CUDA_TRY(cudaMemcpyAsync(x.data() + i, host.data() + i, sizeof(std::uint16_t),
                                 cudaMemcpyHostToDevice, r.exec.stream()));
    r.exec.synchronize();
  }

 private:
  // One rank: its stream, its state in device memory (a trainer rank's optimizer state, a
  // receiver rank's tensors), its engine. Destroyed in reverse: the engine (and the sink it
  // holds, which points into the tensors) first, the stream the arrays are freed on last.
  struct Rank {
    exec::Stream stream;
    exec::Cuda exec{stream};
    std::optional<sim::DeviceAdamWAccess> access;           // trainer ranks
    std::vector<exec::DeviceArray<std::uint16_t>> tensors;  // receiver ranks
    std::unique_ptr<Engine> engine;
  };

  [[nodiscard]] const Rank& receiver_rank(int d) const {
    return *ranks_[static_cast<std::size_t>(world_.senders() + d)];
  }

  // f(engine, access, report) on every rank, each on its own thread; rank 0's report and flag
  // (every rank returns the same). Receiver ranks never read the access: they get trainer rank
  // 0's. When ranks throw, the refusing trainer rank's exception (it says why), else the lowest
  // rank's.
  template <class F>
  std::optional<SyncReport> run(F&& f) {
    std::vector<SyncReport> reports(ranks_.size());
    std::vector<char> published(ranks_.size(), 0);
    const sim::DeviceAdamWAccess& any = *ranks_[0]->access;
    const std::vector<std::exception_ptr> errors =
        sim::detail::on_threads(ranks_.size(), [&](std::size_t r) {
          Rank& me = *ranks_[r];
          published[r] = f(*me.engine, me.access ? *me.access : any, reports[r]) ? 1 : 0;
        });
    sim::detail::rethrow_first(errors, ranks_[0]->engine->refused_by());
    if (published[0] == 0) return std::nullopt;
    return reports[0];
  }

  // Verified without a repair or resync; every receiver committed the published version.
  bool note(const std::optional<SyncReport>& rep) {
    if (!rep) return false;
    bool ok = rep->verified && rep->repaired.empty() && rep->resynced.empty() &&
              rep->repair_refused.empty() && rep->version == ranks_[0]->engine->version();
    for (int d = 0; d < world_.receivers(); ++d) {
      const Engine& e = *receiver_rank(d).engine;
      ok = ok && e.receiver().has_sink() && e.receiver().version() == rep->version;
    }
    confirmed_ = confirmed_ && ok;
    return true;
  }

  layout::HfModel hf_;
  layout::TrainTopology train_;
  layout::ServingLayout recv_;
  sim::SyntheticTrainer trainer_;
  LoopbackWorld world_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool confirmed_ = true;
};

struct Pair {
  const char* model;
  const char* train;
  const char* infer;
};

TEST_CASE("golden: DeltaEngine on exec::Cuda (device optimizer state, device receivers)") {
  const Pair pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=2"},                 // data parallel trainer
      {"tiny-qwen3-moe", "tp=2,ep=2,etp=1", "tp=2,ep=2"},  // MoE, EP on both sides
      {"tiny-qwen3", "tp=2,pp=2", "tp=1,replicas=2"},      // pipeline stages, two replicas
  };
  for (const Pair& p : pairs) {
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
      CudaEnginePath path(p.model, p.train, p.infer, K);
      const golden::Outcome out = golden::run(path, s);
      CHECK(out.publications == golden::expected_publications(s));
      CHECK(out.failures == 0);
      // The check reads the device: one element flipped there is the one mismatch it finds.
      path.flip(0, 0, 0);
      CHECK(path.mismatches() == 1);
    }
  }
}

}  // namespace
}  // namespace dte

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipped (exit %d)\n", kSkipCode);
    return kSkipCode;
  }
  return context.run();
}
