// SPDX-License-Identifier: Apache-2.0
// dte simulate --transport mpi: one trainer or receiver rank per process of an MPI job. Every
// process runs the (deterministic) synthetic trainer: trainer ranks publish from their own
// shard; receiver ranks use it only to check their tensors against a dense sync.
#include "simulate.hpp"

#if DTE_WITH_MPI

#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/mpi_engine.hpp"
#include "dte/io/model_config.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::tool {

namespace {

struct Fault {
  std::string kind;
  int rank = -1;
  Version version = 0;
};

Fault parse_fault(const std::string& text) {
  Fault f;
  if (text.empty()) return f;
  const auto a = text.find(':'), b = text.rfind(':');
  if (a == std::string::npos || a == b) {
    throw invalid_argument("--fault " + text + ": expected kill-receiver:R:V or stall-trainer:G:V");
  }
  f.kind = text.substr(0, a);
  if (f.kind != "kill-receiver" && f.kind != "stall-trainer") {
    throw invalid_argument("--fault " + text + ": unknown fault '" + f.kind + "'");
  }
  f.rank = std::stoi(text.substr(a + 1, b - a - 1));
  f.version = std::stoull(text.substr(b + 1));
  return f;
}

}  // namespace

int simulate_mpi(const SimulateOptions& o) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const bool lead = rank == 0;
  int status = exit_ok;
  std::string role = "rank " + std::to_string(rank);
  try {
    const layout::ModelSpec m = io::load_model(o.model);
    const layout::TrainTopology train = layout::parse_train_topology(o.train);
    const layout::InferTopology infer = layout::parse_infer_topology(o.infer);
    layout::validate(m, train);
    layout::validate(m, infer);
    const layout::HfModel hf(m);
    const layout::SglangLayout recv(hf, infer);
    sim::SyntheticConfig cfg;
    cfg.seed = o.seed;
    cfg.lr = o.lr;
    cfg.min_lr = o.lr / 10;
    cfg.warmup_steps = o.warmup >= 0 ? o.warmup : o.steps / 10;
    cfg.total_steps = std::max<std::int64_t>(o.steps, cfg.warmup_steps + 1);
    sim::SyntheticTrainer trainer(hf, train, recv, cfg);
    const sim::AdamWAccess access{&trainer};
    MpiTwoRoundConfig tc;
    tc.deadline = std::chrono::milliseconds(o.deadline_ms);
    MpiDeltaEngine<AdamWInverse, BF16Detect> engine(
        hf, train, recv, {.publish_every = o.publish_every}, MPI_COMM_WORLD, tc);
    role = engine.is_sender() ? "trainer rank " + std::to_string(rank)
                              : "receiver rank " + std::to_string(rank - train.world());
    const Fault fault = parse_fault(o.fault);
    if (!fault.kind.empty()) {
      engine.between_rounds([&](int r, Version v) {
        if (v != fault.version) return;
        const bool me = fault.kind == "kill-receiver"
                            ? !engine.is_sender() && r - train.world() == fault.rank
                            : engine.is_sender() && r == fault.rank;
        if (!me) return;
        if (fault.kind == "kill-receiver") std::raise(SIGKILL);
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * o.deadline_ms));
      });
    }
    if (lead && !o.json) {
      std::printf(
          "dte simulate --transport mpi: %s, train %s (%lld processes) -> infer %s (%lld "
          "processes), %lld steps, publish every %lld\n",
          m.name.c_str(), o.train.c_str(), static_cast<long long>(train.world()), o.infer.c_str(),
          static_cast<long long>(infer.ranks()), static_cast<long long>(o.steps),
          static_cast<long long>(o.publish_every));
    }
    std::int64_t publications = 0, deltas = 0;
    double changed = 0;
    std::uint64_t bytes = 0, dense = 0;
    bool verified = true, identical = true;
    auto record = [&](const SyncReport& rep) {
      long long bad =
          engine.is_sender()
              ? 0
              : sim::dense_mismatches(hf, recv, trainer.canonical_weights(), engine.receiver());
      MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
      ++publications;
      verified = verified && rep.verified;
      identical = identical && bad == 0;
      if (rep.kind != "full") {
        ++deltas;
        changed += rep.changed_fraction();
        bytes += rep.bytes;
        dense += rep.dense_bytes;
      }
      if (!lead) return;
      if (o.json) {
        std::printf("%s\n", rep.json().c_str());
      } else {
        std::printf("v%-4llu %-5s changed %7.3f%%  sent %llu bytes (dense %llu)  %s, %s\n",
                    static_cast<unsigned long long>(rep.version), rep.kind.c_str(),
                    100.0 * rep.changed_fraction(), static_cast<unsigned long long>(rep.bytes),
                    static_cast<unsigned long long>(rep.dense_bytes),
                    rep.verified ? "verified" : "NOT VERIFIED",
                    bad == 0 ? "bit-identical" : "DIFFERS FROM DENSE");
      }
      std::fflush(stdout);
    };
    try {
      record(engine.publish_full(access));
      for (std::int64_t s = 1; s <= o.steps; ++s) {
        trainer.step();
        SyncReport rep;
        if (engine.step(access, rep)) record(rep);
      }
      if (SyncReport rep; engine.flush(access, rep)) record(rep);
    } catch (const std::exception& e) {
      // Say what this process holds: a receiver interrupted mid-exchange never commits.
      std::string held;
      if (!engine.is_sender()) {
        const Version v = engine.receiver().version();
        held = "; it still holds version " +
               (v == no_version ? std::string("none") : std::to_string(v)) +
               " (publishing version " + std::to_string(engine.version()) + ")";
      }
      std::fprintf(stderr, "dte: error on %s: %s%s\n", role.c_str(), e.what(), held.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, exit_bad_input);
      return exit_bad_input;
    }
    if (!o.dump.empty() && !engine.is_sender()) {
      std::filesystem::create_directories(o.dump);
      io::SafetensorsWriter w;
      for (std::int64_t k = 0; k < recv.size(); ++k) {
        const auto& shape = recv[k].shape;
        w.add<std::uint16_t>(recv.name(k), {shape.begin(), shape.end()},
                             engine.receiver().tensor(k), io::DType::BF16);
      }
      w.write(std::filesystem::path(o.dump) /
              ("receiver-" + std::to_string(engine.receiver().rank()) + ".safetensors"));
    }
    if (!o.dump.empty() && lead) {
      const std::vector<float> canonical = trainer.canonical_weights();
      io::SafetensorsWriter w;
      for (std::int64_t t = 0; t < hf.size(); ++t) {
        const auto shape = hf.shape(t);
        w.add<float>(
            hf.name(t), {shape.begin(), shape.end()},
            std::span<const float>(canonical).subspan(static_cast<std::size_t>(hf[t].base),
                                                      static_cast<std::size_t>(hf[t].numel())));
      }
      std::filesystem::create_directories(o.dump);
      w.write(std::filesystem::path(o.dump) / "trainer.safetensors");
    }
    status = verified && identical ? exit_ok : exit_check_failed;
    if (lead) {
      const double mean = deltas ? changed / deltas : 0.0;
      if (o.json) {
        nlohmann::ordered_json j;
        j["transport"] = "mpi";
        j["steps"] = o.steps;
        j["publications"] = publications;
        j["publish_every"] = o.publish_every;
        j["all_bit_identical"] = identical;
        j["all_verified"] = verified;
        j["mean_changed_fraction"] = mean;
        j["bytes_sent"] = bytes;
        j["dense_bytes"] = dense;
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf(
            "summary: %lld publications, mean changed %.3f%%, sent %llu bytes vs %llu dense\n"
            "%s: every receiver process %s after every publication\n",
            static_cast<long long>(publications), 100.0 * mean,
            static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(dense),
            status == exit_ok ? "VERIFIED" : "FAILED",
            status == exit_ok ? "held the trainer's BF16 policy (digest-verified, "
                                "bit-identical to a dense sync)"
                              : "did NOT hold the trainer's policy");
      }
    }
    MPI_Finalize();
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dte: error on %s: %s\n", role.c_str(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, exit_bad_input);
    return exit_bad_input;
  }
}

}  // namespace dte::tool

#else

#include "dte/error.hpp"

namespace dte::tool {
int simulate_mpi(const SimulateOptions&) {
  throw invalid_argument(
      "--transport mpi: this dte was built without MPI; install Open MPI "
      "(libopenmpi-dev) and rebuild");
}
}  // namespace dte::tool

#endif
