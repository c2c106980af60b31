// SPDX-License-Identifier: Apache-2.0
// Checks shared by the optimizer inverses. Every one runs before anything is computed or
// published, and throws with what is wrong, where (tensor, index, value) and what to do.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

#include "dte/config.hpp"
#include "dte/error.hpp"

namespace dte::limits {

// Hyperparameter ranges (docs/limits.md): far beyond any real step (lr <= 1e-2, eps <= 1e-5,
// weight_decay <= 1 in practice) and within the ranges the bound property test covers; a
// value outside them (lr = 1e300 turns to Inf in FP32) makes every verdict meaningless.
inline constexpr double max_lr = 10.0;
inline constexpr double max_eps = 1.0;
inline constexpr double max_weight_decay = 1e4;
inline constexpr std::int64_t max_step = std::int64_t{1} << 53;  // exact in a double

}  // namespace dte::limits

namespace dte::detail {

inline std::string tensor_label(std::string_view tensor) {
  return tensor.empty() ? std::string("the shard") : "tensor '" + std::string(tensor) + "'";
}

inline std::string format_value(double x) {
  std::ostringstream os;
  os.precision(9);
  os << x;
  return os.str();
}

// A hyperparameter that must lie in [0, max] (lr, eps, weight_decay): a numeric_error otherwise.
// `hint` says what to pass.
inline void require_non_negative_scalar(std::string_view policy, std::string_view tensor,
                                        std::string_view name, double value, double max,
                                        std::string_view hint = {}) {
  if (std::isfinite(value) && value >= 0.0 && value <= max) return;
  throw numeric_error(std::string(policy) + ": " + std::string(name) + " must be in [0, " +
                          format_value(max) + "] for " + tensor_label(tensor) + " (got " +
                          format_value(value) + ")" + (hint.empty() ? "" : "; ") +
                          std::string(hint),
                      about(std::string(policy), std::string(name)));
}

// A scalar the FP32 kernels use as a factor (lr, eps): zero, or at least FP32's smallest normal
// number, so that its FP32 copy carries a relative rounding error only (the error bounds of the
// inverses assume it).
inline void require_zero_or_normal(std::string_view policy, std::string_view tensor,
                                   std::string_view name, double value) {
  if (value == 0.0 || value >= 0x1p-126) return;
  throw invalid_argument(std::string(policy) + ": " + std::string(name) + " for " +
                         tensor_label(tensor) + " is " + format_value(value) +
                         ", below FP32's normal range (1.17549435e-38); pass 0 or a value of at "
                         "least 1.17549435e-38");
}

// theta, exp_avg, ... must have the same number of elements as the parameter shard.
inline void require_same_length(std::string_view policy, std::string_view tensor,
                                std::string_view ref_name, std::size_t ref_size,
                                std::string_view name, std::size_t size) {
  if (size == ref_size) return;
  throw invalid_argument(std::string(policy) + ": length mismatch for " + tensor_label(tensor) +
                         ": " + std::string(ref_name) + " has " + std::to_string(ref_size) +
                         " elements but " + std::string(name) + " has " + std::to_string(size) +
                         "; pass the optimizer state of the same parameter shard, element for "
                         "element");
}

// Refuses NaN and +-Inf, reporting how many there are and the first one.
inline void require_finite(std::string_view policy, std::string_view tensor, std::string_view name,
                           std::span<const float> values) {
  std::size_t count = 0;
  DTE_OMP(parallel for reduction(+ : count) schedule(static))
  for (std::size_t i = 0; i < values.size(); ++i)
    count += std::isfinite(values[i]) ? 0 : 1;
  if (count == 0) return;
  std::size_t first = 0;
  while (std::isfinite(values[first]))
    ++first;
  throw numeric_error(std::string(policy) + ": " + std::string(name) + " of " +
                          tensor_label(tensor) + " has " + std::to_string(count) +
                          " non-finite value(s) (NaN or Inf), the first at index " +
                          std::to_string(first) + " (" + format_value(values[first]) +
                          "); refusing to publish this step: fix the training step (loss scaling, "
                          "gradient clipping) or skip this publication",
                      about(std::string(policy), std::string(tensor)));
}

// Adam's second moment is an average of squares: a negative entry means corrupted state.
inline void require_non_negative(std::string_view policy, std::string_view tensor,
                                 std::string_view name, std::span<const float> values) {
  std::size_t count = 0;
  DTE_OMP(parallel for reduction(+ : count) schedule(static))
  for (std::size_t i = 0; i < values.size(); ++i)
    count += values[i] < 0.0f ? 1 : 0;
  if (count == 0) return;
  std::size_t first = 0;
  while (!(values[first] < 0.0f))
    ++first;
  throw invalid_argument(std::string(policy) + ": " + std::string(name) + " of " +
                         tensor_label(tensor) + " has " + std::to_string(count) +
                         " negative value(s), the first at index " + std::to_string(first) + " (" +
                         format_value(values[first]) +
                         "); a second moment is an average of squares and cannot be negative: "
                         "pass the optimizer's state unchanged");
}

}  // namespace dte::detail
