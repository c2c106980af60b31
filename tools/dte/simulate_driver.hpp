// SPDX-License-Identifier: Apache-2.0
// The one driver of `dte simulate`, for every transport: the synthetic trainer takes its
// steps, the engine publishes, each publication is checked against a dense sync and printed,
// then a summary. A Runner says how the ranks run (all in this process, or one per MPI
// process):
//   bool lead()                                    prints (one process of a job)
//   SyncReport publish_full(access)                every rank's DeltaEngine call
//   bool step(access, SyncReport&), bool flush(access, SyncReport&)
//   long long mismatches(canonical)                receiver elements that differ from a dense
//                                                  sync, over the whole world (-1: not checked)
//   void dump(dir)                                 write this process's receivers
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/report.hpp"
#include "dte/engine/report_json.hpp"
#include "dte/io/model_config.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "layout_settings.hpp"
#include "simulate.hpp"

namespace dte::tool {

// Everything both runs build from the options.
struct Simulation {
  layout::ModelSpec spec;
  layout::TrainTopology train;
  layout::InferTopology infer;
  layout::HfModel hf;
  layout::ServingLayout recv;
  sim::SyntheticTrainer trainer;
  sim::AdamWAccess access{&trainer};

  explicit Simulation(const SimulateOptions& o)
      : spec(checked_spec(o)),
        train(train_topology(o.train, o.stack)),
        infer(layout::parse_infer_topology(o.infer)),
        hf((check(spec, train, infer), spec)),
        recv(hf, infer),
        trainer(hf, train, config(o)) {}

 private:
  static layout::ModelSpec checked_spec(const SimulateOptions& o) {
    if (!(o.lr >= 0.0))
      throw invalid_argument("--lr must be >= 0 (got " + std::to_string(o.lr) + ")");
    return io::load_model(o.model);
  }
  static bool check(const layout::ModelSpec& m, const layout::TrainTopology& t,
                    const layout::InferTopology& i) {
    layout::validate(m, t);
    layout::validate(m, i);
    return true;
  }
  static sim::SyntheticConfig config(const SimulateOptions& o) {
    sim::SyntheticConfig cfg;
    cfg.seed = o.seed;
    cfg.lr = o.lr;
    cfg.min_lr = o.lr / 10;
    cfg.warmup_steps = o.warmup >= 0 ? o.warmup : o.steps / 10;
    cfg.total_steps = std::max<std::int64_t>(o.steps, cfg.warmup_steps + 1);
    return cfg;
  }
};

inline std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4)
    b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, unit[u]);
  return buf;
}

// One receiver's tensors as DIR/receiver-<rank>.safetensors (BF16, SGLang names).
inline void dump_receiver(const std::filesystem::path& dir, const layout::ServingLayout& recv,
                          const Receiver& r) {
  std::filesystem::create_directories(dir);
  io::SafetensorsWriter w;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    const auto& shape = recv[k].shape;
    w.add<std::uint16_t>(recv.name(k), {shape.begin(), shape.end()}, r.tensor(k), io::DType::BF16);
  }
  w.set_metadata("format", "pt");
  w.set_metadata("receiver_rank", std::to_string(r.rank()));
  w.set_metadata("tp_rank", std::to_string(r.rank() % recv.topology().tp));
  w.set_metadata("version", std::to_string(r.version()));
  w.write(dir / ("receiver-" + std::to_string(r.rank()) + ".safetensors"));
}

// The trainer's canonical FP32 weights as DIR/trainer.safetensors (HF names).
inline void dump_trainer(const std::filesystem::path& dir, const layout::HfModel& hf,
                         const std::vector<float>& canonical) {
  std::filesystem::create_directories(dir);
  io::SafetensorsWriter trainer;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const auto shape = hf.shape(t);
    trainer.add<float>(
        hf.name(t), {shape.begin(), shape.end()},
        std::span<const float>(canonical).subspan(static_cast<std::size_t>(hf[t].base),
                                                  static_cast<std::size_t>(hf[t].numel())));
  }
  trainer.set_metadata("format", "pt");
  trainer.set_metadata("producer",
                       "dte simulate: the trainer's final FP32 master weights (HF names)");
  trainer.write(dir / "trainer.safetensors");
}

template <class Runner>
int run_simulation(const SimulateOptions& o, Simulation& s, Runner& runner) {
  const bool lead = runner.lead();
  if (lead && !o.json) {
    std::printf(
        "dte simulate: %s (%lld parameters), train %s (%lld ranks) -> infer %s (%lld ranks), "
        "%s transport, %lld steps, publish every %lld, lr %g\n",
        s.spec.name.c_str(), static_cast<long long>(s.hf.total()), o.train.c_str(),
        static_cast<long long>(s.train.world()), o.infer.c_str(),
        static_cast<long long>(s.infer.ranks()), o.transport.c_str(),
        static_cast<long long>(o.steps), static_cast<long long>(o.publish_every), o.lr);
    print_layout_settings(s.spec, s.train, o.stack);
  }
  struct Totals {
    std::int64_t publications = 0, deltas = 0;
    double changed = 0, detect = 0, route = 0, exchange = 0, apply = 0, verify = 0;
    std::uint64_t bytes = 0, dense = 0, repairs = 0, entries = 0;
    bool verified = true, identical = true, checked = true;
  } tot;
  auto record = [&](const SyncReport& rep) {
    const long long bad = runner.mismatches(s.trainer.canonical_weights());
    ++tot.publications;
    tot.verified = tot.verified && rep.verified;
    tot.checked = tot.checked && bad >= 0;
    tot.identical = tot.identical && bad <= 0;
    tot.repairs += rep.repaired.size() + rep.resynced.size();
    if (rep.kind != "full") {
      ++tot.deltas;
      tot.changed += rep.changed_fraction();
      tot.bytes += rep.bytes;
      tot.dense += rep.dense_bytes;
      tot.entries += rep.routed_writes;
    }
    tot.detect += rep.detect_s, tot.route += rep.route_s, tot.exchange += rep.exchange_s;
    tot.apply += rep.apply_s, tot.verify += rep.verify_s;
    if (!lead) return;
    if (o.json) {
      std::printf("%s\n", json(rep).c_str());
    } else {
      std::printf(
          "v%-4llu %-5s steps %-2lld changed %7.3f%%  sent %10s (dense %10s)  "
          "%6.1f ms  %s%s\n",
          static_cast<unsigned long long>(rep.version), rep.kind.c_str(),
          static_cast<long long>(rep.steps), 100.0 * rep.changed_fraction(),
          human_bytes(static_cast<double>(rep.bytes)).c_str(),
          human_bytes(static_cast<double>(rep.dense_bytes)).c_str(),
          1e3 * (rep.detect_s + rep.route_s + rep.exchange_s + rep.apply_s + rep.verify_s),
          rep.verified ? "verified" : "NOT VERIFIED",
          bad < 0 ? "" : (bad == 0 ? ", bit-identical" : ", DIFFERS FROM DENSE"));
    }
    std::fflush(stdout);
  };
  record(runner.publish_full(s.access));
  for (std::int64_t step = 1; step <= o.steps; ++step) {
    s.trainer.step();
    SyncReport rep;
    if (runner.step(s.access, rep)) record(rep);
  }
  if (SyncReport rep; runner.flush(s.access, rep)) record(rep);

  if (!o.dump.empty()) {
    runner.dump(o.dump);
    if (lead) dump_trainer(o.dump, s.hf, s.trainer.canonical_weights());
  }
  const bool ok = tot.verified && tot.identical;
  if (!lead) return ok ? exit_ok : exit_check_failed;
  const double mean_changed = tot.deltas ? tot.changed / tot.deltas : 0.0;
  if (o.json) {
    nlohmann::ordered_json j;
    j["transport"] = o.transport;
    j["layout_settings"] = layout_settings_json(s.spec, s.train, o.stack);
    j["steps"] = o.steps;
    j["publications"] = tot.publications;
    j["publish_every"] = o.publish_every;
    j["all_bit_identical"] = tot.checked ? nlohmann::json(tot.identical) : nlohmann::json(nullptr);
    j["all_verified"] = tot.verified;
    j["mean_changed_fraction"] = mean_changed;
    j["bytes_sent"] = tot.bytes;
    j["dense_bytes"] = tot.dense;
    j["bytes_per_receiver_write"] =
        tot.entries ? static_cast<double>(tot.bytes) / static_cast<double>(tot.entries) : 0.0;
    j["repairs"] = tot.repairs;
    j["seconds"] = {{"detect", tot.detect},
                    {"route", tot.route},
                    {"exchange", tot.exchange},
                    {"apply", tot.apply},
                    {"verify", tot.verify}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "summary: %lld publications (%lld deltas), mean changed %.3f%%, sent %s vs %s dense "
        "(%.2f%%, %.2f bytes per receiver write), detect %.2fs route %.2fs exchange %.2fs "
        "apply %.2fs verify %.2fs\n",
        static_cast<long long>(tot.publications), static_cast<long long>(tot.deltas),
        100.0 * mean_changed, human_bytes(static_cast<double>(tot.bytes)).c_str(),
        human_bytes(static_cast<double>(tot.dense)).c_str(),
        tot.dense ? 100.0 * static_cast<double>(tot.bytes) / static_cast<double>(tot.dense) : 0.0,
        tot.entries ? static_cast<double>(tot.bytes) / static_cast<double>(tot.entries) : 0.0,
        tot.detect, tot.route, tot.exchange, tot.apply, tot.verify);
    std::printf("%s: every receiver %s after every publication (digest-verified%s)\n",
                ok ? "VERIFIED" : "FAILED",
                ok ? "held the trainer's BF16 policy" : "did NOT hold the trainer's policy",
                tot.checked ? ", and bit-identical to a dense sync" : "");
  }
  std::fflush(stdout);
  return ok ? exit_ok : exit_check_failed;
}

}  // namespace dte::tool
