// SPDX-License-Identifier: Apache-2.0
// dte audit-inverse FILE.safetensors [--json] [--format bf16|fp16]
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/io/optimizer_dump.hpp"

namespace dte::tool {

namespace {

const char* kFooter = R"(
The file holds one optimizer step dumped from your trainer: F32 tensors theta_prev, theta and
exp_avg + exp_avg_sq (adamw, adam) or momentum_buffer (sgd), all of one shape, and __metadata__
keys optimizer = adamw|adam|sgd, lr, weight_decay, beta1, beta2, eps, step (Adam), momentum,
dampening (SGD); optional bias_correction, amsgrad, maximize, nesterov = true|false.
Exit status: 0 nothing missed, 1 a change was missed, 2 the input was refused.)";

}  // namespace

void register_audit_inverse(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "audit-inverse",
      "Check that dte's reconstruction finds every 16-bit change of one real step");
  cmd->footer(kFooter);
  auto file = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("bf16");
  cmd->add_option("file", *file, "optimizer step dump (.safetensors)")->required();
  cmd->add_flag("--json", *json, "print one JSON object instead of the table");
  cmd->add_option("--format", *format, "receivers' storage format")
      ->check(CLI::IsMember({"bf16", "fp16"}))
      ->capture_default_str();
  cmd->callback([file, json, format, &status] {
    const io::SafetensorsFile dump = io::SafetensorsFile::read(*file);
    io::OptimizerStep step;
    const AuditCounts c = *format == "fp16" ? io::audit_inverse_file<FP16Detect>(dump, &step)
                                            : io::audit_inverse_file<BF16Detect>(dump, &step);
    status = c.missed == 0 ? exit_ok : exit_check_failed;
    if (*json) {
      nlohmann::ordered_json j;
      j["file"] = *file;
      j["optimizer"] = io::optimizer_name(step.kind);
      j["format"] = *format;
      j["elements"] = c.elements;
      j["true_changed"] = c.true_changed;
      j["detected"] = c.detected;
      j["missed"] = c.missed;
      j["guard_extra"] = c.guard_extra;
      j["guard_extra_fraction"] = c.guard_extra_fraction();
      j["safe"] = c.missed == 0;
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    const double n = c.elements == 0 ? 1.0 : static_cast<double>(c.elements);
    std::printf("dte audit-inverse %s (%s, %s)\n", file->c_str(),
                std::string(io::optimizer_name(step.kind)).c_str(), format->c_str());
    std::printf("  elements          %llu\n", static_cast<unsigned long long>(c.elements));
    std::printf("  true changes      %llu (%.4f%%)\n",
                static_cast<unsigned long long>(c.true_changed), 100.0 * c.true_changed / n);
    std::printf("  detected          %llu\n", static_cast<unsigned long long>(c.detected));
    std::printf("  missed            %llu\n", static_cast<unsigned long long>(c.missed));
    std::printf("  guard extra       %llu (%.4f%% of elements)\n",
                static_cast<unsigned long long>(c.guard_extra), 100.0 * c.guard_extra / n);
    if (c.missed == 0) {
      std::printf("safe: every %s change of this step is detected\n", format->c_str());
    } else {
      std::printf(
          "UNSAFE: %llu change(s) missed, the first at index %lld; use SnapshotBase for "
          "this optimizer and report the file to the dte developers\n",
          static_cast<unsigned long long>(c.missed), static_cast<long long>(c.first_missed));
    }
  });
}

}  // namespace dte::tool
