// SPDX-License-Identifier: Apache-2.0
// One optimizer step dumped by a trainer, as a safetensors file, and its audit: does dte's
// reconstruction + guard band find every 16-bit change of that step?
//
// File: F32 tensors theta_prev, theta and either exp_avg + exp_avg_sq (adamw, adam) or
// momentum_buffer (sgd), all of one shape; __metadata__ keys optimizer = adamw|adam|sgd, lr,
// weight_decay, beta1, beta2, eps, step, momentum, dampening (and optionally bias_correction,
// amsgrad, maximize, nesterov = true|false, decay_form = unknown|multiply|subtract). Missing
// optional keys take torch's defaults (decay_form: unknown, which assumes nothing).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dte/audit.hpp"
#include "dte/bounds.hpp"
#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"

namespace dte::io {

enum class OptimizerKind { adamw, adam, sgd };

inline std::string_view optimizer_name(OptimizerKind k) noexcept {
  switch (k) {
    case OptimizerKind::adamw:
      return "adamw";
    case OptimizerKind::adam:
      return "adam";
    case OptimizerKind::sgd:
      return "sgd";
  }
  return "?";
}

// The hyperparameters of one step, read from string metadata.
struct OptimizerStep {
  OptimizerKind kind = OptimizerKind::adamw;
  AdamHyperparameters adam;
  SgdHyperparameters sgd;
};

namespace detail {

class MetadataReader {
 public:
  MetadataReader(const std::map<std::string, std::string>& md, std::string_view source,
                 std::string_view suffix)
      : md_(md), source_(source), suffix_(suffix) {}

  // A per-step key ("lr.7") wins over the plain one ("lr").
  [[nodiscard]] const std::string* find(std::string_view key) const {
    if (!suffix_.empty()) {
      if (auto it = md_.find(std::string(key) + std::string(suffix_)); it != md_.end()) {
        return &it->second;
      }
    }
    auto it = md_.find(std::string(key));
    return it == md_.end() ? nullptr : &it->second;
  }

  [[nodiscard]] const std::string& text(std::string_view key) const {
    if (const std::string* s = find(key)) return *s;
    throw format_error(std::string(source_) + ": metadata key '" + std::string(key) +
                       "' is missing; add it to __metadata__ (see `dte audit-inverse --help`)");
  }

  [[nodiscard]] double number(std::string_view key, std::optional<double> fallback = {}) const {
    const std::string* s = find(key);
    if (s == nullptr) {
      if (fallback) return *fallback;
      (void)text(key);  // throws the missing-key error
    }
    double x = 0.0;
    const char* end = s->data() + s->size();
    const auto [ptr, ec] = std::from_chars(s->data(), end, x);
    if (ec != std::errc{} || ptr != end) {
      throw format_error(std::string(source_) + ": metadata key '" + std::string(key) + "' is '" +
                         *s + "', not a number; write it as a decimal such as 1e-05");
    }
    return x;
  }

  // An integer written as digits ("7", not "7.0" or "1e300"), in [lo, hi].
  [[nodiscard]] std::int64_t integer(std::string_view key, std::int64_t lo, std::int64_t hi) const {
    const std::string& s = text(key);
    const DecimalInteger d = parse_decimal(s);
    if (!d.integer) {
      throw format_error(std::string(source_) + ": metadata key '" + std::string(key) + "' is '" +
                             s + "', not an integer",
                         about(std::string(source_), std::string(key)));
    }
    if (!d.fits || d.value < lo || d.value > hi) {
      throw bounds_error(std::string(source_) + ": metadata key '" + std::string(key) + "' is '" +
                             s + "'; it must be an integer in [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + "]",
                         about(std::string(source_), std::string(key)));
    }
    return d.value;
  }

  [[nodiscard]] bool flag(std::string_view key, bool fallback) const {
    const std::string* s = find(key);
    if (s == nullptr) return fallback;
    if (*s == "true" || *s == "True" || *s == "1") return true;
    if (*s == "false" || *s == "False" || *s == "0") return false;
    throw format_error(std::string(source_) + ": metadata key '" + std::string(key) + "' is '" +
                       *s + "'; write true or false");
  }

 private:
  const std::map<std::string, std::string>& md_;
  std::string_view source_;
  std::string_view suffix_;
};

}  // namespace detail

// decay_form = unknown | multiply | subtract (optional; AdamHyperparameters::decay_form).
inline DecayForm decay_form(const detail::MetadataReader& md, std::string_view source) {
  const std::string* s = md.find("decay_form");
  if (s == nullptr || *s == "unknown") return DecayForm::unknown;
  if (*s == "multiply") return DecayForm::multiply;
  if (*s == "subtract") return DecayForm::subtract;
  throw format_error(std::string(source) + ": metadata key 'decay_form' is '" + *s +
                     "'; write multiply (theta *= 1 - lr*wd: torch.optim.AdamW on the CPU, "
                     "foreach, TE/Apex), subtract (theta -= lr*wd*theta: torch fused=True on "
                     "CUDA) or unknown");
}

// Reads the hyperparameters of one step. `suffix` selects per-step keys such as "lr.7" (pass
// ".7"); keys without it apply to every step.
inline OptimizerStep parse_optimizer_step(const std::map<std::string, std::string>& metadata,
                                          std::string_view source, std::string_view suffix = {}) {
  const detail::MetadataReader md(metadata, source, suffix);
  OptimizerStep s;
  const std::string& opt = md.text("optimizer");
  if (opt == "adamw") {
    s.kind = OptimizerKind::adamw;
  } else if (opt == "adam") {
    s.kind = OptimizerKind::adam;
  } else if (opt == "sgd") {
    s.kind = OptimizerKind::sgd;
  } else {
    throw format_error(std::string(source) + ": metadata optimizer is '" + opt +
                       "'; dte inverts adamw, adam (L2 decay) and sgd (with momentum)");
  }
  if (s.kind == OptimizerKind::sgd) {
    s.sgd.lr = md.number("lr");
    s.sgd.momentum = md.number("momentum");
    s.sgd.dampening = md.number("dampening", 0.0);
    s.sgd.weight_decay = md.number("weight_decay", 0.0);
    s.sgd.nesterov = md.flag("nesterov", false);
    s.sgd.maximize = md.flag("maximize", false);
  } else {
    s.adam.lr = md.number("lr");
    s.adam.weight_decay = md.number("weight_decay", s.kind == OptimizerKind::adamw ? 0.01 : 0.0);
    s.adam.beta1 = md.number("beta1", 0.9);
    s.adam.beta2 = md.number("beta2", 0.999);
    s.adam.eps = md.number("eps", 1e-8);
    s.adam.step = md.integer("step", 1, limits::max_step);
    s.adam.bias_correction = md.flag("bias_correction", true);
    s.adam.amsgrad = md.flag("amsgrad", false);
    s.adam.maximize = md.flag("maximize", false);
    s.adam.decay_form = decay_form(md, source);
  }
  return s;
}

// Audits one step given its tensors. `state_a`/`state_b` are exp_avg/exp_avg_sq for Adam and
// momentum_buffer (and nothing) for SGD.
template <change_detector Detect>
AuditCounts audit_step(const OptimizerStep& step, std::span<const float> theta_prev,
                       std::span<const float> theta, std::span<const float> state_a,
                       std::span<const float> state_b, std::string_view tensor = {}) {
  switch (step.kind) {
    case OptimizerKind::adamw:
      return audit_reconstruction<Detect>(
          AdamWInverse::bind(step.adam, theta, {state_a, state_b}, tensor), theta_prev, tensor);
    case OptimizerKind::adam:
      return audit_reconstruction<Detect>(
          AdamInverse::bind(step.adam, theta, {state_a, state_b}, tensor), theta_prev, tensor);
    case OptimizerKind::sgd:
      return audit_reconstruction<Detect>(
          SgdMomentumInverse::bind(step.sgd, theta, {state_a}, tensor), theta_prev, tensor);
  }
  throw dte::invalid_argument("audit_step: unknown optimizer kind");
}

// Shapes must agree before any element is read.
inline void require_same_shape(const SafetensorsFile& file, std::string_view ref,
                               std::string_view name) {
  const TensorInfo& a = file.at(ref);
  const TensorInfo& b = file.at(name);
  if (a.shape != b.shape) {
    throw format_error(file.source() + ": tensor '" + std::string(name) +
                       "' does not have the shape of '" + std::string(ref) +
                       "'; every tensor of an optimizer dump must have the parameter's shape");
  }
}

// The dump file format of `dte audit-inverse`.
template <change_detector Detect>
AuditCounts audit_inverse_file(const SafetensorsFile& file, OptimizerStep* parsed = nullptr) {
  const OptimizerStep step = parse_optimizer_step(file.metadata(), file.source());
  if (parsed != nullptr) *parsed = step;
  const bool sgd = step.kind == OptimizerKind::sgd;
  const std::vector<std::string_view> names =
      sgd ? std::vector<std::string_view>{"theta_prev", "momentum_buffer"}
          : std::vector<std::string_view>{"theta_prev", "exp_avg", "exp_avg_sq"};
  for (std::string_view n : names)
    require_same_shape(file, "theta", n);
  const std::vector<float> theta_prev = file.read_as<float>("theta_prev");
  // The truth the audit compares with: a non-finite value there is a broken dump, not a miss.
  for (std::size_t i = 0; i < theta_prev.size(); ++i) {
    if (!std::isfinite(theta_prev[i])) {
      throw numeric_error(file.source() + ": theta_prev[" + std::to_string(i) + "] is " +
                              dte::detail::format_value(theta_prev[i]) +
                              "; the weights before the step must be finite: dump them again",
                          about(file.source(), "theta_prev"));
    }
  }
  const std::vector<float> theta = file.read_as<float>("theta");
  const std::vector<float> a = file.read_as<float>(sgd ? "momentum_buffer" : "exp_avg");
  const std::vector<float> b = sgd ? std::vector<float>{} : file.read_as<float>("exp_avg_sq");
  return audit_step<Detect>(step, theta_prev, theta, a, b, file.source());
}

}  // namespace dte::io
