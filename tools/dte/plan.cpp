// SPDX-License-Identifier: Apache-2.0
// dte plan --model M --train ... --infer ... [--json] [--dump-map FILE]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/io/buffer_layout.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/coverage.hpp"
#include "dte/layout/plan.hpp"
#include "layout_settings.hpp"

namespace dte::tool {

namespace {

using namespace dte::layout;

constexpr std::int64_t kDumpLimit = 50'000'000;  // canonical elements

void dump_map(const std::string& path, const HfModel& hf, const ServingLayout& recv,
              const std::vector<TransferPlan>& plans, bool to_hf) {
  if (hf.total() > kDumpLimit) {
    throw invalid_argument("--dump-map writes one line per route; the model has " +
                           std::to_string(hf.total()) + " elements (limit " +
                           std::to_string(kDumpLimit) + "): use a tiny model such as tiny-qwen3");
  }
  std::ofstream out(path);
  if (!out) throw io_error("cannot write '" + path + "'");
  out << "src_tp,src_pp,src_ep,src_dp,src_param,src_index,dst_rank,dst_tensor,dst_index\n";
  for (const TransferPlan& plan : plans) {
    const TrainRank& r = plan.rank();
    for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
      const bool expert = b == BufferKind::expert;
      for (const PlanSegment& s : plan.segments(b)) {
        const MegatronParam& p = plan.params()[static_cast<std::size_t>(s.param)];
        const std::string prefix = std::to_string(expert ? r.te : r.tm) + "," +
                                   std::to_string(r.pp) + "," + std::to_string(expert ? r.em : 0) +
                                   "," + std::to_string(expert ? r.edp : r.dp) + "," + p.name() +
                                   ",";
        for (std::int64_t i = 0; i < s.length; ++i) {
          const std::int64_t index = s.param_begin + i;
          if (to_hf) {
            const Canonical c = plan.canonical(b, s.shard_begin + i);
            if (c.tensor >= 0)
              out << prefix << index << ",0," << hf.name(c.tensor) << ',' << c.index << '\n';
            continue;
          }
          route_canonical(recv, plan.canonical(b, s.shard_begin + i), [&](const RouteTarget& t) {
            out << prefix << index << ',' << t.rank << ',' << recv.name(t.tensor) << ',' << t.index
                << '\n';
          });
        }
      }
    }
  }
  if (!out.flush()) throw io_error("writing '" + path + "' failed");
}

}  // namespace

void register_plan(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Build and validate the transfer plans from Megatron trainer ranks to SGLang receivers");
  struct Options {
    std::string model, train, infer = "tp=1", dump, layout_in, layout_out, stack = "megatron-lm";
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model,
                  "a preset (qwen3-8b, qwen2.5-7b, llama-3.1-8b, ...) or config.json")
      ->required();
  cmd->add_option("--train", o->train,
                  "trainer topology: tp=,pp=,ep=,etp=,dp=[,split=a:b:...][,bucket=N]"
                  "[,vocab_div=128|none]")
      ->required();
  cmd->add_option("--stack", o->stack, stack_help)->capture_default_str();
  cmd->add_option("--infer", o->infer,
                  "receiver topology: tp=,ep=,replicas= (SGLang), or hf for the plain unsharded HF "
                  "layout (storage)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->add_option("--dump-map", o->dump, "write every element's route as CSV (small models only)");
  cmd->add_option(
         "--buffer-layout", o->layout_in,
         "distributed-optimizer buffers as the trainer dumped them (JSON, see docs/layouts.md)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--write-buffer-layout", o->layout_out,
                  "write the buffer layout dte assumes for this topology (same JSON format)");
  cmd->callback([o, &status] {
    const ModelSpec m = io::load_model(o->model);
    const TrainTopology train = train_topology(o->train, o->stack);
    const bool to_hf = o->infer == "hf";
    const InferTopology infer = to_hf ? InferTopology{} : parse_infer_topology(o->infer);
    validate(m, train);
    validate(m, infer);
    const HfModel hf(m);
    const ServingLayout recv(hf, infer);
    if (!o->layout_out.empty()) {
      std::ofstream out(o->layout_out);
      out << io::write_buffer_layout(hf, train).dump(1) << '\n';
      if (!out.flush()) throw io_error("writing '" + o->layout_out + "' failed");
    }
    std::vector<RankBuffers> dumped;
    if (!o->layout_in.empty()) {
      dumped = io::read_buffer_layout_file(o->layout_in, hf, train);
    }

    std::vector<TransferPlan> plans;
    plans.reserve(static_cast<std::size_t>(train.world()));
    double build_max = 0.0, build_total = 0.0, fraction_max = 0.0;
    std::int64_t bytes_max = 0, bytes_total = 0;
    for (std::int64_t g = 0; g < train.world(); ++g) {
      const auto t0 = std::chrono::steady_clock::now();
      if (dumped.empty()) {
        plans.emplace_back(hf, train, g);
      } else {
        plans.emplace_back(hf, train, g, dumped[static_cast<std::size_t>(g)]);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      build_max = std::max(build_max, s);
      build_total += s;
      const std::int64_t bytes = plans.back().bytes();
      bytes_max = std::max(bytes_max, bytes);
      bytes_total += bytes;
      std::int64_t weight_bytes = 0;  // the rank's BF16 parameters
      for (const MegatronParam& p : plans.back().params())
        weight_bytes += 2 * p.numel();
      fraction_max = std::max(fraction_max, static_cast<double>(bytes) / weight_bytes);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const CoverageReport cov = check_coverage(hf, recv, plans, !to_hf);
    const double coverage_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!o->dump.empty()) dump_map(o->dump, hf, recv, plans, to_hf);
    status = cov.exact ? exit_ok : exit_check_failed;

    if (o->json) {
      nlohmann::ordered_json j;
      j["model"] = m.name;
      j["architecture"] = m.architecture;
      j["structure"] = m.structure();
      j["layout_settings"] = layout_settings_json(m, train, o->stack);
      j["train"] = o->train;
      j["infer"] = o->infer;
      j["trainer_ranks"] = train.world();
      j["receiver_ranks"] = infer.ranks();
      j["coverage_exact"] = cov.exact;
      if (!cov.exact) j["coverage_problem"] = cov.problem;
      j["source_elements"] = cov.source_elements;
      j["sender_elements"] = cov.sender_elements;
      j["canonical_elements"] = cov.canonical_elements;
      j["receiver_elements"] = cov.receiver_elements;
      j["receiver_writes"] = cov.receiver_writes;
      j["plan_bytes_max_rank"] = bytes_max;
      j["plan_bytes_total"] = bytes_total;
      j["plan_fraction_of_rank_weights_max"] = fraction_max;
      j["build_seconds"] = build_total;
      j["build_seconds_max_rank"] = build_max;
      j["coverage_seconds"] = coverage_s;
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("dte plan %s  train %s (%lld ranks)  infer %s (%lld ranks)\n", m.name.c_str(),
                o->train.c_str(), static_cast<long long>(train.world()), o->infer.c_str(),
                static_cast<long long>(infer.ranks()));
    std::printf("  model               %s\n", m.structure().c_str());
    print_layout_settings(m, train, o->stack);
    std::printf("  source elements     %lld (optimizer shards, %lld carry a canonical element)\n",
                static_cast<long long>(cov.source_elements),
                static_cast<long long>(cov.sender_elements));
    std::printf("  canonical elements  %lld\n", static_cast<long long>(cov.canonical_elements));
    std::printf("  receiver elements   %lld (%lld written)\n",
                static_cast<long long>(cov.receiver_elements),
                static_cast<long long>(cov.receiver_writes));
    std::printf("  coverage            %s%s%s\n",
                cov.exact ? "exact" : "NOT EXACT: ", cov.problem.c_str(), "");
    std::printf(
        "  plan bytes          max %lld per rank, %lld total (max %.6f%% of a rank's weights)\n",
        static_cast<long long>(bytes_max), static_cast<long long>(bytes_total),
        100.0 * fraction_max);
    std::printf("  build seconds       %.4f total, %.4f max per rank; coverage check %.3f\n",
                build_total, build_max, coverage_s);
  });
}

}  // namespace dte::tool
