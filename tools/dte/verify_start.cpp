// SPDX-License-Identifier: Apache-2.0
// dte verify-start: the first publication against the checkpoint the run started from
// (io/verify_start.hpp). Either side of the comparison:
//   --published DIR     an HF checkpoint directory of the first full publication (a storage
//                       root's first anchor, ROOT/v00000000000000000001, is one);
//   --train T [--stack S] [--seed N]   the synthetic trainer of `dte simulate` with that seed,
//                       read through dte's plans for T (what its first publication sends).
// Exit status 0: equal bit for bit; 1: they differ (the first differing tensor is named, with
// examples); 2: bad input.
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/io/model_config.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/io/verify_start.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "layout_settings.hpp"

namespace dte::tool {

void register_verify_start(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "verify-start",
      "Compare the first publication's canonical BF16 values with the HF checkpoint the run "
      "started from, tensor by tensor");
  struct Options {
    std::string model, checkpoint, published, train, stack = "megatron-lm";
    std::uint64_t seed = 0;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "preset or config.json")->required();
  cmd->add_option("--hf-checkpoint", o->checkpoint,
                  "the checkpoint directory the run started from (model.safetensors.index.json "
                  "and its shards, or model.safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* published =
      cmd->add_option("--published", o->published,
                      "the first full publication as an HF checkpoint directory (e.g. a storage "
                      "root's first anchor)")
          ->check(CLI::ExistingDirectory);
  auto* train = cmd->add_option("--train", o->train,
                                "the synthetic trainer's topology (as dte simulate) instead of "
                                "--published");
  cmd->add_option("--stack", o->stack, stack_help)->capture_default_str();
  cmd->add_option("--seed", o->seed, "the synthetic trainer's seed (as dte simulate)")
      ->capture_default_str();
  published->excludes(train);
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o, &status] {
    if (o->published.empty() == o->train.empty()) {
      throw invalid_argument("dte verify-start: give either --published DIR or --train T");
    }
    const layout::ModelSpec m = io::load_model(o->model);
    const layout::HfModel hf(m);
    io::StartReport rep;
    if (!o->published.empty()) {
      // The publication's shards are read as the checkpoint's tensors come, keeping the last.
      const std::map<std::string, std::string> files = io::hf_checkpoint_files(o->published);
      std::string open_name;
      std::optional<io::SafetensorsFile> open;
      rep = io::verify_start(hf, o->checkpoint, [&](std::int64_t t, std::span<std::uint16_t> out) {
        const auto it = files.find(hf.name(t));
        if (it == files.end()) {
          throw format_error(o->published + ": the publication has no tensor " + hf.name(t));
        }
        if (!open || open_name != it->second) {
          open.reset();
          open = io::SafetensorsFile::read(std::filesystem::path(o->published) / it->second);
          open_name = it->second;
        }
        const std::vector<std::uint16_t> bits =
            open->read_as<std::uint16_t>(hf.name(t), io::DType::BF16);
        if (bits.size() != out.size()) {
          throw format_error(o->published + ": " + hf.name(t) + " has " +
                             std::to_string(bits.size()) + " elements, the model " +
                             std::to_string(out.size()));
        }
        std::copy(bits.begin(), bits.end(), out.begin());
      });
    } else {
      const layout::TrainTopology t = train_topology(o->train, o->stack);
      layout::validate(m, t);
      const layout::ServingLayout recv(hf, layout::InferTopology{});
      sim::SyntheticConfig cfg;
      cfg.seed = o->seed;
      const sim::SyntheticTrainer trainer(hf, t, cfg);
      const std::vector<float> canonical = trainer.canonical_weights();
      rep = io::verify_start(hf, o->checkpoint, [&](std::int64_t id, std::span<std::uint16_t> out) {
        const auto base = static_cast<std::size_t>(hf[id].base);
        for (std::size_t i = 0; i < out.size(); ++i)
          out[i] = round_bf16(canonical[base + i]);
      });
    }
    status = rep.ok() ? exit_ok : exit_check_failed;
    if (o->json) {
      nlohmann::ordered_json j;
      j["ok"] = rep.ok();
      j["tensors"] = rep.tensors;
      j["elements"] = rep.elements;
      j["mismatched_elements"] = rep.mismatched_elements;
      j["first_tensor"] = rep.first_tensor;
      j["first_tensor_mismatches"] = rep.first_tensor_mismatches;
      nlohmann::ordered_json ex = nlohmann::ordered_json::array();
      for (const io::StartMismatch& e : rep.examples) {
        ex.push_back({{"index", e.index},
                      {"coords", e.coords},
                      {"checkpoint", bf16_to_float(e.checkpoint)},
                      {"published", bf16_to_float(e.published)}});
      }
      j["examples"] = ex;
      j["problems"] = rep.problems;
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("dte verify-start %s: %s: %s\n", o->checkpoint.c_str(),
                rep.ok() ? "OK" : "MISMATCH", rep.describe().c_str());
  });
}

}  // namespace dte::tool
