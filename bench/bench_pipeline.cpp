// SPDX-License-Identifier: Apache-2.0
// The pipeline stages one at a time on one trainer rank of Qwen3-8B's real layer shapes (one
// decoder layer, tp=4, a 4096-token vocabulary: 56.6M shard elements), next to a STREAM-style
// read of the same 12 bytes per element, over changed fractions {0, 0.1%, 1%, 2%, 10%, 100%}:
//   BM_memory_read         theta, exp_avg, exp_avg_sq read once (the reference)
//   BM_detect/F            the sender's detect stage over every tile (SIMD where the CPU has it)
//   BM_publish/F           the whole staged publication as the engine runs it (detect,
//                          compact, route, encode in tile order)
//   BM_apply/F             every receiver applying its message
// bytes_per_second is 12 per shard element for the first three; items are entries for apply.
// `dte bench pipeline` prints the same figures as ratios in one JSON object.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/sender.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/plan.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/sim/controlled_shard.hpp"
#include "dte/sim/full_message.hpp"

namespace {

using namespace dte;
using Sender = HostSenderRank<AdamWInverse, BF16Detect, layout::TransferPlan, HostExecutor>;

struct World {
  layout::ModelSpec spec = [] {
    layout::ModelSpec m = layout::model_preset("qwen3-8b");
    m.layers = 1;
    m.vocab = 4096;
    return m;
  }();
  layout::HfModel hf{spec};
  layout::TrainTopology train = layout::parse_train_topology("tp=4");
  layout::ServingLayout recv{hf, layout::parse_infer_topology("tp=2,replicas=2")};
  HostExecutor exec;
  Sender sender{hf, train, recv, 0, false, exec};
  std::int64_t size = sender.plan().shard_size(layout::BufferKind::dense);
};

World& world() {
  static World w;
  return w;
}

const sim::ControlledShard& shard(double fraction) {
  static std::vector<std::pair<double, std::unique_ptr<sim::ControlledShard>>> cache;
  for (auto& [f, s] : cache) {
    if (f == fraction) return *s;
  }
  // One at a time: each shard holds 12 bytes per element.
  cache.clear();
  const World& w = world();
  cache.emplace_back(
      fraction, std::make_unique<sim::ControlledShard>(
                    w.size, w.sender.plan().shard_size(layout::BufferKind::expert), fraction, 7));
  return *cache.back().second;
}

double fraction_of(const benchmark::State& state) {
  return static_cast<double>(state.range(0)) / 10000.0;  // range in units of 0.01%
}

void BM_memory_read(benchmark::State& state) {
  World& w = world();
  const sim::ControlledShard& s = shard(0.01);
  for (auto _ : state)
    benchmark::DoNotOptimize(s.read_once(w.exec, layout::BufferKind::dense));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 12 * w.size);
}

void BM_detect(benchmark::State& state) {
  World& w = world();
  const sim::ControlledShard& s = shard(fraction_of(state));
  const auto dense = layout::BufferKind::dense;
  const auto theta = s.theta(0, dense);
  w.sender.frame().bind(s, dense);
  // The sender's detect stage tile by tile, one tile buffer per thread (as the engine keeps).
  std::vector<Sender::Frame::Tile> tiles(static_cast<std::size_t>(w.exec.threads()));
  std::vector<std::uint64_t> per(w.sender.frame().tiles(dense), 0);
  std::uint64_t flagged = 0;
  std::atomic<bool> refused{false};
  for (auto _ : state) {
    w.exec.for_each(per.size(), [&](std::size_t t, int worker) {
      Sender::Frame::Tile& x = tiles[static_cast<std::size_t>(worker)];
      if (!w.sender.frame().detect_tile(theta, dense, t, pipeline::ScanMode::detect, x))
        refused = true;
      per[t] = x.counts.flagged;
    });
    for (std::uint64_t f : per)
      flagged += f;
  }
  if (refused) state.SkipWithError("the controlled shard was refused");
  state.counters["changed_fraction"] = static_cast<double>(flagged) /
                                       static_cast<double>(state.iterations()) /
                                       static_cast<double>(w.size);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 12 * w.size);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * w.size);
}

void BM_publish(benchmark::State& state) {
  World& w = world();
  const sim::ControlledShard& s = shard(fraction_of(state));
  std::uint64_t entries = 0, payload = 0;
  for (auto _ : state) {
    const ScanResult r = w.sender.scan(s, pipeline::ScanMode::detect);
    benchmark::DoNotOptimize(w.sender.finish(MessageKind::delta, 1, 0));
    entries = r.entries;
    payload = w.sender.payload_bytes();
    w.sender.release();
  }
  state.counters["wire_bytes_per_entry"] =
      entries ? static_cast<double>(payload) / static_cast<double>(entries) : 0.0;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 12 * w.size);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * w.size);
}

void BM_apply(benchmark::State& state) {
  World& w = world();
  const sim::ControlledShard& s = shard(fraction_of(state));
  const ScanResult r = w.sender.scan(s, pipeline::ScanMode::detect);
  const std::vector<Payload> out = w.sender.finish(MessageKind::delta, 1, 0);
  std::vector<Inbox> inbox(out.size());
  for (std::size_t d = 0; d < out.size(); ++d) {
    Bytes bytes;
    for (const auto& part : out[d])
      bytes.insert(bytes.end(), part.begin(), part.end());
    inbox[d].emplace_back(0, std::move(bytes));
  }
  w.sender.release();
  // The receivers' own tensors; a full message brings them to version 0, and a receiver accepts
  // a delta only on its base and never moves backwards, so each iteration applies the delta on
  // version 0 to fresh receivers brought to 0 (without timing). Each takes this one trainer
  // rank's message as a whole publication.
  std::vector<std::vector<std::vector<std::uint16_t>>> storage(out.size());
  std::vector<ReceiverTensors> views(out.size());
  for (std::size_t d = 0; d < out.size(); ++d) {
    for (std::int64_t k = 0; k < w.recv.size(); ++k) {
      storage[d].emplace_back(static_cast<std::size_t>(w.recv[k].numel), std::uint16_t{0});
      views[d].emplace_back(storage[d].back());
    }
  }
  std::vector<std::unique_ptr<Receiver>> receivers(out.size());
  std::vector<Inbox> arm(out.size());
  for (std::size_t d = 0; d < out.size(); ++d) {
    const std::int64_t ts = static_cast<std::int64_t>(d) % w.recv.topology().tp;
    arm[d].emplace_back(0, wire::encode(sim::full_message(w.recv, ts, 0, 0)));
  }
  for (auto _ : state) {
    state.PauseTiming();
    for (std::size_t d = 0; d < out.size(); ++d) {
      receivers[d] =
          std::make_unique<Receiver>(w.hf, w.recv, static_cast<std::int64_t>(d), 1, views[d]);
      if (!receivers[d]->apply(0, arm[d]).committed()) state.SkipWithError("arming refused");
    }
    state.ResumeTiming();
    w.exec.for_each(receivers.size(), [&](std::size_t d, int) {
      benchmark::DoNotOptimize(receivers[d]->apply(1, inbox[d]).written);
    });
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * r.entries));
}

void densities(benchmark::internal::Benchmark* b) {
  for (std::int64_t f : {0, 10, 100, 200, 1000, 10000})
    b->Arg(f);
}

}  // namespace

BENCHMARK(BM_memory_read)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_detect)->Apply(densities)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_publish)->Apply(densities)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_apply)->Apply(densities)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
