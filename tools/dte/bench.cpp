// SPDX-License-Identifier: Apache-2.0
// dte bench pipeline: every stage of one trainer rank's publication timed on a real shard shape
// at chosen changed fractions, next to a STREAM-style read of the same bytes measured in the
// same run: detect (validate, reconstruct, classify, digest: 12 bytes read per element),
// compact, route, encode (bucket + wire v2), the whole staged publish as the engine runs it,
// and the receivers' apply. Best of --repeat runs of each.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/bounds.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/sender.hpp"
#include "dte/exec/host.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/plan.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/detect_vector.hpp"
#include "dte/sim/controlled_shard.hpp"
#include "dte/sim/full_message.hpp"

namespace dte::tool {

namespace {

using Sender = HostSenderRank<AdamWInverse, BF16Detect, layout::TransferPlan, HostExecutor>;
using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string model = "qwen3-8b", train = "tp=4", infer = "tp=2,replicas=2";
  std::int64_t layers = 1, vocab = 4096, rank = 0;
  int threads = 0, repeat = 3;
  std::vector<double> fractions = {0.0, 0.001, 0.01, 0.02, 0.1, 1.0};
  bool json = false;
};

template <class F>
double best_seconds(int repeat, F&& f) {
  double best = 1e300;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

struct StageFigures {
  double fraction = 0, changed_fraction = 0;
  double detect_s = 0, compact_s = 0, route_s = 0, encode_s = 0, publish_s = 0, apply_s = 0;
  std::uint64_t elements = 0, flagged = 0, entries = 0, payload = 0;
};

StageFigures measure(const BenchOptions& o, const HostExecutor& exec, Sender& sender,
                     double fraction, std::vector<Receiver>& receivers, Version& version) {
  using layout::BufferKind;
  const layout::TransferPlan& plan = sender.plan();
  const sim::ControlledShard shard(plan.shard_size(BufferKind::dense),
                                   plan.shard_size(BufferKind::expert), fraction, 7);
  StageFigures f;
  f.fraction = fraction;
  // Stage by stage, as the sender runs them, over tiles in parallel, keeping each tile's buffers
  // for the next stage.
  for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
    if (plan.shard_size(b) == 0) continue;
    const auto theta = shard.theta(o.rank, b);
    sender.frame().bind(shard, b);
    std::vector<Sender::Frame::Tile> out(sender.frame().tiles(b));
    auto each_tile = [&](auto&& stage) {
      exec.for_each(out.size(), [&](std::size_t t, int) { stage(t, out[t]); });
    };
    f.detect_s += best_seconds(o.repeat, [&] {
      each_tile([&](std::size_t t, Sender::Frame::Tile& x) {
        if (!sender.frame().detect_tile(theta, b, t, pipeline::ScanMode::detect, x)) {
          throw error("dte bench: the controlled shard was refused");
        }
      });
    });
    f.compact_s += best_seconds(o.repeat, [&] {
      each_tile([&](std::size_t t, Sender::Frame::Tile& x) {
        sender.frame().compact_tile(theta, b, t, x);
      });
    });
    f.route_s += best_seconds(o.repeat, [&] {
      each_tile([&](std::size_t t, Sender::Frame::Tile& x) { sender.frame().route_tile(b, t, x); });
    });
    f.encode_s += best_seconds(o.repeat, [&] {
      sender.sink().begin(sender.frame(), pipeline::ScanMode::detect);
      for (std::size_t t = 0; t < out.size(); ++t)
        sender.sink().changed(sender.frame(), b, t, out[t]);
      (void)sender.finish(MessageKind::delta, 1, 0);
    });
    sender.release();
    for (const Sender::Frame::Tile& x : out) {
      f.flagged += x.counts.flagged;
      f.elements += x.scanned;
    }
  }
  // The whole publication as the engine runs it (tiles in parallel, encode in order), then
  // every receiver applies its message.
  std::vector<Payload> payloads;
  f.publish_s = best_seconds(o.repeat, [&] {
    ScanResult r = sender.scan(shard, pipeline::ScanMode::detect);
    f.entries = r.entries;
    payloads = sender.finish(MessageKind::delta, version + 1, version);
  });
  f.payload = sender.payload_bytes();
  std::vector<Inbox> inbox(receivers.size());
  for (std::size_t d = 0; d < receivers.size(); ++d) {
    Bytes bytes;
    for (const auto& part : payloads[d])
      bytes.insert(bytes.end(), part.begin(), part.end());
    inbox[d].emplace_back(0, std::move(bytes));
  }
  sender.release();
  ++version;
  const auto t0 = Clock::now();
  exec.for_each(receivers.size(), [&](std::size_t d, int) {
    const ApplyResult a = receivers[d].apply(version, inbox[d]);
    if (!a.committed()) throw error("dte bench: receiver refused the publication: " + a.refusal);
  });
  f.apply_s = std::chrono::duration<double>(Clock::now() - t0).count();
  f.changed_fraction =
      f.elements ? static_cast<double>(f.flagged) / static_cast<double>(f.elements) : 0;
  return f;
}

int run_pipeline(const BenchOptions& o) {
  layout::ModelSpec spec = io::load_model(o.model);
  if (o.layers > 0) spec.layers = o.layers;
  if (o.vocab > 0) spec.vocab = o.vocab;
  spec.validate();  // the overrides too
  const layout::TrainTopology train = layout::parse_train_topology(o.train);
  const layout::InferTopology infer = layout::parse_infer_topology(o.infer);
  layout::validate(spec, train);
  layout::validate(spec, infer);
  const layout::HfModel hf(spec);
  const layout::ServingLayout recv(hf, infer);
  if (o.rank < 0 || o.rank >= train.world()) {
    throw invalid_argument("--rank " + std::to_string(o.rank) + " is not a rank of --train " +
                           o.train);
  }
  const HostExecutor exec(o.threads);
  Sender sender(hf, train, recv, o.rank, false, exec);
  const layout::TransferPlan& plan = sender.plan();
  const std::int64_t shard =
      plan.shard_size(layout::BufferKind::dense) + plan.shard_size(layout::BufferKind::expert);

  // The receivers, owning their tensors here, brought to version 0 by a full publication.
  std::vector<std::vector<std::vector<std::uint16_t>>> storage(
      static_cast<std::size_t>(infer.ranks()));
  std::vector<Receiver> receivers;
  for (std::int64_t d = 0; d < infer.ranks(); ++d) {
    ReceiverTensors views;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      storage[static_cast<std::size_t>(d)].emplace_back(static_cast<std::size_t>(recv[k].numel),
                                                        std::uint16_t{0});
      views.emplace_back(storage[static_cast<std::size_t>(d)].back());
    }
    // Each receiver takes this one trainer rank's messages as a whole publication.
    receivers.emplace_back(hf, recv, d, 1, std::move(views));
  }
  Version version = 0;
  for (std::size_t d = 0; d < receivers.size(); ++d) {
    // Version 0 without a trainer: every live element written (zeros).
    const std::int64_t ts = static_cast<std::int64_t>(d) % infer.tp;
    const ApplyResult a =
        receivers[d].apply(0, {{0, wire::encode(sim::full_message(recv, ts, 0, 0))}});
    if (!a.committed()) throw error("dte bench: a receiver refused version 0: " + a.refusal);
  }

  // The memory read, measured before, between and after the stages (the machine is shared):
  // the best of all is the reference every stage is compared with.
  std::uint32_t sink = 0;
  const sim::ControlledShard data(plan.shard_size(layout::BufferKind::dense),
                                  plan.shard_size(layout::BufferKind::expert), 0.01, 3);
  double read_s = 1e300;
  auto read = [&](int repeat) {
    read_s = std::min(read_s, best_seconds(repeat, [&] {
                        sink |= data.read_once(exec, layout::BufferKind::dense);
                      }));
  };
  read(std::max(5, o.repeat));
  std::vector<StageFigures> figures;
  for (double fraction : o.fractions) {
    figures.push_back(measure(o, exec, sender, fraction, receivers, version));
    read(2);
  }
  const double dense_elements = static_cast<double>(plan.shard_size(layout::BufferKind::dense));
  const double memory_gbs = 12.0 * dense_elements / read_s / 1e9;

  auto gbs = [](double elements, double s) { return s > 0 ? 12.0 * elements / s / 1e9 : 0.0; };
  auto per_s = [](double items, double s) { return s > 0 ? items / s : 0.0; };
  const StageFigures* at1 = nullptr;
  for (const StageFigures& f : figures) {
    if (f.fraction == 0.01) at1 = &f;
  }
  nlohmann::ordered_json j;
  j["model"] = spec.name;
  j["layers"] = spec.layers;
  j["vocab"] = spec.vocab;
  j["train"] = o.train;
  j["rank"] = o.rank;
  j["infer"] = o.infer;
  j["shard_elements"] = shard;
  j["threads"] = exec.threads();
  j["simd"] = simd::name(simd::level());
  j["repeat"] = o.repeat;
  j["memory_read_gbs"] = memory_gbs;
  if (at1 != nullptr) {
    const double e = static_cast<double>(at1->elements);
    j["detect_fraction"] = gbs(e, at1->detect_s) / memory_gbs;
    j["publish_fraction"] = gbs(e, at1->publish_s) / memory_gbs;
    j["apply_entries_per_s"] = per_s(static_cast<double>(at1->entries), at1->apply_s);
    j["wire_bytes_per_entry"] =
        at1->entries ? static_cast<double>(at1->payload) / static_cast<double>(at1->entries) : 0.0;
  }
  nlohmann::ordered_json stages = nlohmann::json::array();
  for (const StageFigures& f : figures) {
    const double e = static_cast<double>(f.elements);
    stages.push_back({
        {"fraction", f.fraction},
        {"changed_fraction", f.changed_fraction},
        {"entries", f.entries},
        {"detect_gbs", gbs(e, f.detect_s)},
        {"detect_elements_per_s", per_s(e, f.detect_s)},
        {"compact_elements_per_s", per_s(e, f.compact_s)},
        {"route_entries_per_s", per_s(static_cast<double>(f.entries), f.route_s)},
        {"encode_entries_per_s", per_s(static_cast<double>(f.entries), f.encode_s)},
        {"publish_gbs", gbs(e, f.publish_s)},
        {"publish_fraction", gbs(e, f.publish_s) / memory_gbs},
        {"apply_entries_per_s", per_s(static_cast<double>(f.entries), f.apply_s)},
        {"wire_bytes_per_entry",
         f.entries ? static_cast<double>(f.payload) / static_cast<double>(f.entries) : 0.0},
        {"seconds",
         {{"detect", f.detect_s},
          {"compact", f.compact_s},
          {"route", f.route_s},
          {"encode", f.encode_s},
          {"publish", f.publish_s},
          {"apply", f.apply_s}}},
    });
  }
  j["stages"] = stages;
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
    return sink == 0xFFFFFFFFu ? exit_check_failed : exit_ok;  // (keeps the read alive)
  }
  std::printf(
      "dte bench pipeline: %s (%lld layers, vocab %lld), trainer rank %lld of %s (%lld shard "
      "elements) -> %s; %d threads, SIMD %s, best of %d\n",
      spec.name.c_str(), static_cast<long long>(spec.layers), static_cast<long long>(spec.vocab),
      static_cast<long long>(o.rank), o.train.c_str(), static_cast<long long>(shard),
      o.infer.c_str(), exec.threads(), simd::name(simd::level()), o.repeat);
  std::printf("memory read (3 float arrays, the detect stage's bytes): %.1f GB/s\n", memory_gbs);
  std::printf("%9s %9s %12s %7s %13s %12s %12s %10s %7s %12s %8s\n", "target", "changed",
              "detect GB/s", "of mem", "compact el/s", "route ent/s", "encode ent/s", "publish",
              "of mem", "apply ent/s", "B/entry");
  for (const StageFigures& f : figures) {
    const double e = static_cast<double>(f.elements), n = static_cast<double>(f.entries);
    std::printf("%8.2f%% %8.3f%% %12.2f %6.0f%% %13.3g", 100 * f.fraction, 100 * f.changed_fraction,
                gbs(e, f.detect_s), 100 * gbs(e, f.detect_s) / memory_gbs, per_s(e, f.compact_s));
    if (f.entries == 0 && f.changed_fraction > 0) {
      // every element changed: after one publication the sender sends dense runs, no entries
      std::printf(" %12s %12s %10.2f %6.0f%% %12s %8s\n", "-", "-", gbs(e, f.publish_s),
                  100 * gbs(e, f.publish_s) / memory_gbs, "-", "dense");
      continue;
    }
    std::printf(" %12.3g %12.3g %10.2f %6.0f%% %12.3g %8.2f\n", per_s(n, f.route_s),
                per_s(n, f.encode_s), gbs(e, f.publish_s), 100 * gbs(e, f.publish_s) / memory_gbs,
                per_s(n, f.apply_s), f.entries ? static_cast<double>(f.payload) / n : 0.0);
  }
  return sink == 0xFFFFFFFFu ? exit_check_failed : exit_ok;
}

}  // namespace

void register_bench(CLI::App& app, int& status) {
  auto* bench = app.add_subcommand("bench", "Benchmarks measured in one process, as ratios");
  bench->require_subcommand(1);
  auto* cmd = bench->add_subcommand(
      "pipeline",
      "Time every pipeline stage of one trainer rank against the machine's memory read");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("--model", o->model, "preset or config.json")->capture_default_str();
  cmd->add_option("--layers", o->layers, "decoder layers (real per-layer shapes)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, limits::layers));
  cmd->add_option("--vocab", o->vocab, "vocabulary (0: the model's)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, limits::vocab));
  cmd->add_option("--train", o->train, "trainer topology")->capture_default_str();
  cmd->add_option("--rank", o->rank, "the trainer rank timed")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, limits::world - 1));
  cmd->add_option("--infer", o->infer, "receiver topology")->capture_default_str();
  cmd->add_option("--threads", o->threads, "executor threads (0: every core)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--repeat", o->repeat, "runs of each stage (the best is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--fractions", o->fractions, "changed fractions to time")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_flag("--json", o->json, "one JSON object");
  cmd->callback([o, &status] { status = run_pipeline(*o); });
#ifdef DTE_WITH_STORAGE
  register_bench_compare(*bench, status);
#endif
}

}  // namespace dte::tool
