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
dampening (SGD); optional bias_correction, amsgrad, maximize, nesterov = true|false, and
decay_form = unknown|multiply|subtract (AdamW: theta *= 1 - lr*wd as torch on the CPU, foreach
and TE/Apex do, or theta -= lr*wd*theta as torch fused=True on CUDA does; default unknown).
Bound violations: elements whose true theta_prev lies outside dte's error bound around its
reconstruction. The guard band rests on that bound, so a violation is a miss waiting to happen.
Exit status: 0 nothing missed and no bound violation, 1 a change was missed or the bound was
violated, 2 the input was refused.)";

}  // namespace

void register_audit_inverse(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "audit-inverse",
      "Check that dte's reconstruction finds every 16-bit change of one real step, and that its "
      "error bound holds for every element");
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
    const bool safe = c.missed == 0 && c.bound_violations == 0;
    status = safe ? exit_ok : exit_check_failed;
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
      j["bound_violations"] = c.bound_violations;
      j["first_bound_violation"] = c.first_violation;
      j["worst_bound_ratio"] = c.worst_bound_ratio;
      j["safe"] = safe;
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
    std::printf("  bound violations  %llu", static_cast<unsigned long long>(c.bound_violations));
    if (c.bound_violations != 0) {
      std::printf(" (the first at index %lld)", static_cast<long long>(c.first_violation));
    }
    std::printf("; worst |theta_prev - value| / error %.3g\n", c.worst_bound_ratio);
    if (safe) {
      std::printf("safe: every %s change of this step is detected and the error bound holds\n",
                  format->c_str());
    } else if (c.missed != 0) {
      std::printf(
          "UNSAFE: %llu change(s) missed, the first at index %lld; use SnapshotBase for "
          "this optimizer and report the file to the dte developers\n",
          static_cast<unsigned long long>(c.missed), static_cast<long long>(c.first_missed));
    } else {
      std::printf(
          "UNSAFE: nothing was missed in this step, but the error bound failed for %llu "
          "element(s), the first at index %lld: dte's model of your optimizer kernel is wrong "
          "and a later step can miss a change; use SnapshotBase for this optimizer and report "
          "the file to the dte developers\n",
          static_cast<unsigned long long>(c.bound_violations),
          static_cast<long long>(c.first_violation));
    }
  });
}

}  // namespace dte::tool
