// SPDX-License-Identifier: Apache-2.0
// dte simulate: the synthetic trainer and every trainer and receiver rank in one process,
// publishing deltas through the host DeltaEngine, checked against a dense sync.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/io/model_config.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "simulate.hpp"

namespace dte::tool {

namespace {

using namespace dte::layout;
using Engine = DeltaEngine<AdamWInverse, BF16Detect>;

constexpr std::int64_t kDenseCheckLimit = 200'000'000;  // receiver elements

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4)
    b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, unit[u]);
  return buf;
}

void dump(const std::filesystem::path& dir, const HfModel& hf, const SglangLayout& recv,
          const std::vector<float>& canonical, const std::vector<Receiver>& receivers) {
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
  for (const Receiver& r : receivers) {
    io::SafetensorsWriter w;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      const auto& shape = recv[k].shape;
      w.add<std::uint16_t>(recv.name(k), {shape.begin(), shape.end()}, r.tensor(k),
                           io::DType::BF16);
    }
    w.set_metadata("format", "pt");
    w.set_metadata("receiver_rank", std::to_string(r.rank()));
    w.set_metadata("tp_rank", std::to_string(r.rank() % recv.topology().tp));
    w.set_metadata("version", std::to_string(r.version()));
    w.write(dir / ("receiver-" + std::to_string(r.rank()) + ".safetensors"));
  }
}

}  // namespace

void register_simulate(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "simulate", "Train a synthetic Qwen3 in-process and sync every receiver by deltas");
  auto o = std::make_shared<SimulateOptions>();
  cmd->add_option("--model", o->model, "preset or config.json")->capture_default_str();
  cmd->add_option("--train", o->train, "trainer topology (as dte plan)")->capture_default_str();
  cmd->add_option("--infer", o->infer, "receiver topology (as dte plan)")->capture_default_str();
  cmd->add_option("--steps", o->steps, "optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--publish-every", o->publish_every, "publish every K optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--lr", o->lr, "peak learning rate (warmup then cosine)")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "warmup steps (default: steps/10)");
  cmd->add_option("--seed", o->seed, "seed of weights and gradients")->capture_default_str();
  cmd->add_flag("--json", o->json, "one JSON line per publication, then a summary object");
  cmd->add_option(
      "--dump", o->dump,
      "write DIR/trainer.safetensors (F32, HF names) and DIR/receiver-<rank>.safetensors "
      "(BF16, SGLang names) at the end");
  cmd->add_option("--transport", o->transport,
                  "loopback: every rank a thread of this process; mpi: one rank per process of "
                  "an MPI job (mpirun -np trainer ranks + receiver ranks)")
      ->check(CLI::IsMember({"loopback", "mpi"}))
      ->capture_default_str();
  cmd->add_option("--deadline-ms", o->deadline_ms, "MPI: deadline of every wait")
      ->capture_default_str();
  cmd->add_option("--fault", o->fault,
                  "MPI fault test: kill-receiver:R:V (receiver R SIGKILLs itself in version V's "
                  "payload round) or stall-trainer:G:V (trainer G stalls there past the deadline)");
  cmd->callback([o, &status] {
    if (o->transport == "mpi") {
      status = simulate_mpi(*o);
      return;
    }
    if (!(o->lr >= 0.0))
      throw invalid_argument("--lr must be >= 0 (got " + std::to_string(o->lr) + ")");
    const ModelSpec m = io::load_model(o->model);
    const TrainTopology train = parse_train_topology(o->train);
    const InferTopology infer = parse_infer_topology(o->infer);
    validate(m, train);
    validate(m, infer);
    const HfModel hf(m);
    const SglangLayout recv(hf, infer);
    sim::SyntheticConfig cfg;
    cfg.seed = o->seed;
    cfg.lr = o->lr;
    cfg.min_lr = o->lr / 10;
    cfg.warmup_steps = o->warmup >= 0 ? o->warmup : o->steps / 10;
    cfg.total_steps = std::max<std::int64_t>(o->steps, cfg.warmup_steps + 1);
    sim::SyntheticTrainer trainer(hf, train, recv, cfg);
    const sim::AdamWAccess access{&trainer};
    LoopbackTwoRound transport;
    Engine engine(hf, train, recv, {.publish_every = o->publish_every}, transport);
    const bool dense_check = infer.ranks() * recv.live_elements(0) <= kDenseCheckLimit;

    if (!o->json) {
      std::printf(
          "dte simulate: %s (%lld parameters), train %s (%lld ranks) -> infer %s (%lld ranks), "
          "%lld steps, publish every %lld, lr %g\n",
          m.name.c_str(), static_cast<long long>(hf.total()), o->train.c_str(),
          static_cast<long long>(train.world()), o->infer.c_str(),
          static_cast<long long>(infer.ranks()), static_cast<long long>(o->steps),
          static_cast<long long>(o->publish_every), o->lr);
    }
    struct Totals {
      std::int64_t publications = 0, deltas = 0;
      double changed = 0, detect = 0, route = 0, exchange = 0, apply = 0, verify = 0;
      std::uint64_t bytes = 0, dense = 0, repairs = 0;
      bool verified = true, identical = true;
    } tot;
    auto record = [&](const SyncReport& rep) {
      bool identical = true;
      if (dense_check) {
        identical =
            sim::dense_mismatches(hf, recv, trainer.canonical_weights(), engine.receivers()) == 0;
      }
      ++tot.publications;
      tot.verified = tot.verified && rep.verified;
      tot.identical = tot.identical && identical;
      tot.repairs += rep.repaired.size() + rep.resynced.size();
      if (rep.kind != "full") {
        ++tot.deltas;
        tot.changed += rep.changed_fraction();
        tot.bytes += rep.bytes;
        tot.dense += rep.dense_bytes;
      }
      tot.detect += rep.detect_s, tot.route += rep.route_s, tot.exchange += rep.exchange_s;
      tot.apply += rep.apply_s, tot.verify += rep.verify_s;
      if (o->json) {
        std::printf("%s\n", rep.json().c_str());
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
            dense_check ? (identical ? ", bit-identical" : ", DIFFERS FROM DENSE") : "");
      }
    };
    record(engine.publish_full(access));
    for (std::int64_t s = 1; s <= o->steps; ++s) {
      trainer.step();
      SyncReport rep;
      if (engine.step(access, rep)) record(rep);
    }
    if (SyncReport rep; engine.flush(access, rep)) record(rep);

    const std::vector<float> canonical = trainer.canonical_weights();
    if (!o->dump.empty()) dump(o->dump, hf, recv, canonical, engine.receivers());
    const bool ok = tot.verified && tot.identical;
    status = ok ? exit_ok : exit_check_failed;
    const double mean_changed = tot.deltas ? tot.changed / tot.deltas : 0.0;
    if (o->json) {
      nlohmann::ordered_json j;
      j["steps"] = o->steps;
      j["publications"] = tot.publications;
      j["publish_every"] = o->publish_every;
      j["all_bit_identical"] =
          dense_check ? nlohmann::json(tot.identical) : nlohmann::json(nullptr);
      j["all_verified"] = tot.verified;
      j["mean_changed_fraction"] = mean_changed;
      j["bytes_sent"] = tot.bytes;
      j["dense_bytes"] = tot.dense;
      j["repairs"] = tot.repairs;
      j["seconds"] = {{"detect", tot.detect},
                      {"route", tot.route},
                      {"exchange", tot.exchange},
                      {"apply", tot.apply},
                      {"verify", tot.verify}};
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf(
        "summary: %lld publications (%lld deltas), mean changed %.3f%%, sent %s vs %s dense "
        "(%.2f%%), detect %.2fs route %.2fs exchange %.2fs apply %.2fs verify %.2fs\n",
        static_cast<long long>(tot.publications), static_cast<long long>(tot.deltas),
        100.0 * mean_changed, human_bytes(static_cast<double>(tot.bytes)).c_str(),
        human_bytes(static_cast<double>(tot.dense)).c_str(),
        tot.dense ? 100.0 * static_cast<double>(tot.bytes) / static_cast<double>(tot.dense) : 0.0,
        tot.detect, tot.route, tot.exchange, tot.apply, tot.verify);
    std::printf("%s: every receiver %s after every publication (digest-verified%s)\n",
                ok ? "VERIFIED" : "FAILED",
                ok ? "held the trainer's BF16 policy" : "did NOT hold the trainer's policy",
                dense_check ? ", and bit-identical to a dense sync" : "");
  });
}

}  // namespace dte::tool
