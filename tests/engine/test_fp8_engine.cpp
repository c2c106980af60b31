// SPDX-License-Identifier: Apache-2.0
// The engine with FP8 receivers (docs/fp8.md, "The engine"): a Megatron trainer (tp=2, pp=2,
// dp=2, distributed optimizer: receiver blocks span trainer ranks) publishes over loopback to two
// replicas of tp=2 receivers that serve vLLM's online per-block FP8. After each of 30
// publications (K = 1 and K = 4), every receiver's codes, scales and BF16 tensors equal the dense
// requantization of the trainer's canonical weights, and the engine verified them. The MPI test
// (tests/mpi) runs the same over processes.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/engine.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/fp8_dense.hpp"
#include "dte/sim/synthetic_trainer.hpp"

using namespace dte;

namespace {

using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;
using Cluster = sim::LoopbackCluster<Engine>;

// The first receiver tensor that differs from the dense result ("" if none).
std::string differs(const layout::ServingLayout& recv, const layout::Fp8Grid& grid,
                    const Cluster& c, const std::vector<float>& canonical,
                    const layout::HfModel& hf) {
  const auto weights = [&](std::int64_t t) {
    return std::span<const float>(canonical).subspan(static_cast<std::size_t>(hf[t].base),
                                                     static_cast<std::size_t>(hf[t].numel()));
  };
  const std::vector<std::int64_t>& ids = grid.quantized_ids();
  for (std::int64_t d = 0; d < recv.topology().ranks(); ++d) {
    const std::int64_t ts = d % recv.topology().tp;
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const sim::DenseFp8 want = sim::dense_fp8(grid, ts, ids[k], weights);
      if (want.code != c.fp8_codes(d, k))
        return recv.name(ids[k]) + " codes, receiver " + std::to_string(d);
      for (std::size_t b = 0; b < want.scale.size(); ++b) {
        if (float_bits(want.scale[b]) != float_bits(c.fp8_scales(d, k)[b]))
          return recv.name(ids[k]) + " scales, receiver " + std::to_string(d);
      }
    }
    for (std::int64_t id = 0; id < recv.size(); ++id) {
      if (grid.quantized(id)) continue;
      for (std::int64_t o = 0; o < recv.live_end(ts, id); ++o) {
        const layout::Canonical x = recv.source({ts, id, o});
        if (c.bf16(d, id)[static_cast<std::size_t>(o)] !=
            Bf16Format::round(weights(x.tensor)[static_cast<std::size_t>(x.index)]))
          return recv.name(id) + ", receiver " + std::to_string(d);
      }
    }
  }
  return {};
}

}  // namespace

TEST_CASE("engine: FP8 receivers hold the dense requantization after every publication") {
  const layout::ModelSpec spec = sim::fp8_test_model();
  const layout::HfModel hf(spec);
  const layout::TrainTopology train = layout::parse_train_topology("tp=2,pp=2,dp=2");
  const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=2,replicas=2"));
  const layout::Fp8Grid grid(recv, 128, 128);
  for (const std::int64_t K : {1, 4}) {
    CAPTURE(K);
    sim::SyntheticConfig cfg;
    cfg.seed = 3;
    cfg.lr = 3e-6;
    sim::SyntheticTrainer trainer(hf, train, cfg);
    EngineConfig ec;
    ec.publish_every = K;
    ec.fp8 = VllmBlockFp8::name;
    Cluster cluster(hf, train, recv, ec);
    const sim::AdamWAccess access{&trainer};
    SyncReport rep = cluster.publish_full(access);
    CHECK(rep.verified);
    CHECK(rep.fp8_scales > 0);
    CHECK(differs(recv, grid, cluster, trainer.canonical_weights(), hf) == "");
    int published = 0;
    std::uint64_t codes = 0, changed = 0;
    while (published < 30) {
      trainer.step();
      if (!cluster.step(access, rep)) continue;
      ++published;
      CAPTURE(published);
      CHECK(rep.verified);
      CHECK(rep.fp8_mismatched.empty());
      REQUIRE(differs(recv, grid, cluster, trainer.canonical_weights(), hf) == "");
      codes += rep.fp8_codes;
      changed += rep.changed;
    }
    MESSAGE("K " << K << ": BF16 changed " << changed << ", FP8 codes sent " << codes);
    CHECK(codes > 0);
    CHECK(codes < changed);
  }
}

TEST_CASE("engine: a corrupted FP8 code is refused when a publication overwrites it") {
  const layout::ModelSpec spec = sim::fp8_test_model();
  const layout::HfModel hf(spec);
  const layout::TrainTopology train = layout::parse_train_topology("tp=2,dp=2");
  const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=2"));
  const layout::Fp8Grid grid(recv, 128, 128);
  sim::SyntheticConfig cfg;
  cfg.seed = 4;
  cfg.lr = 1e-4;
  sim::SyntheticTrainer trainer(hf, train, cfg);
  EngineConfig ec;
  ec.fp8 = VllmBlockFp8::name;
  Cluster cluster(hf, train, recv, ec);
  const sim::AdamWAccess access{&trainer};
  REQUIRE(cluster.publish_full(access).verified);
  // corrupt every code of receiver 0's first quantized tensor: the next delta overwrites some
  for (std::uint8_t& c : cluster.fp8_codes(0, 0))
    c ^= 0x01;
  CHECK(cluster.receiver(0).fp8_verify() != "");
  trainer.step();
  SyncReport rep;
  REQUIRE(cluster.step(access, rep));
  CHECK(!rep.verified);
  CHECK(rep.resynced == std::vector<std::int64_t>{0});  // refused: it stays on the version held
  CHECK(cluster.receiver(0).version() == 0);
  CHECK(cluster.receiver(1).version() == 1);
  // the next publication is full: it rewrites every code, and every receiver holds the dense
  // result again
  trainer.step();
  REQUIRE(cluster.step(access, rep));
  CHECK(rep.kind == "full");
  CHECK(rep.verified);
  CHECK(differs(recv, grid, cluster, trainer.canonical_weights(), hf) == "");
}

TEST_CASE(
    "engine: an FP8 world refuses a receiver without FP8 tensors, and FP8 tensors without it") {
  const layout::ModelSpec spec = sim::fp8_test_model();
  const layout::HfModel hf(spec);
  const layout::TrainTopology train = layout::parse_train_topology("tp=1");
  const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=1"));
  LoopbackWorld world(1, 1);
  EngineConfig fp8;
  fp8.fp8 = VllmBlockFp8::name;
  CHECK_THROWS_AS(Engine(hf, train, recv, fp8, world.endpoint(1), ReceiverTensors{}),
                  invalid_argument);
  CHECK_THROWS_AS(Engine(hf, train, recv, EngineConfig{}, world.endpoint(1), Fp8ReceiverTensors{}),
                  invalid_argument);
  EngineConfig other;
  other.fp8 = "fp8-per-tensor";
  CHECK_THROWS_AS(Engine(hf, train, recv, other, world.endpoint(0), ReceiverTensors{}),
                  unsupported);
}
