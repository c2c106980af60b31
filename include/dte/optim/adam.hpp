// SPDX-License-Identifier: Apache-2.0
// AdamWInverse and AdamInverse: the previous value of each element from the current weight and
// the moments the step just wrote, plus a rigorous bound on the reconstruction error.
//
//   AdamW (decoupled decay, torch.optim.AdamW, TE/Apex FusedAdam ADAM_MODE_1):
//     theta = (1 - lr*wd) * theta_prev - lr * mhat / (sqrt(vhat) + eps)
//   Adam with L2 decay folded into the gradient (torch.optim.Adam, ADAM_MODE_0):
//     theta = theta_prev - lr * mhat / (sqrt(vhat) + eps)
//   with mhat = m / (1 - beta1^step), vhat = v / (1 - beta2^step) (or 1 without bias correction).
//
// The error bound covers every forward variant real kernels use (FMA or not, decay before or after
// the update, hyperparameters held in FP32 or FP64); docs/math.md derives each constant.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/reconstruction.hpp"
#include "dte/optim/validate.hpp"

namespace dte {

// The hyperparameters of one parameter group at the step being inverted (the values the step
// used: lr and weight_decay after the scheduler, step after its increment, so the first step is 1).
struct AdamHyperparameters {
  double lr = 0.0;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  std::int64_t step = 0;
  bool bias_correction = true;
  bool amsgrad = false;   // refused: the denominator would use max_exp_avg_sq
  bool maximize = false;  // refused: not covered by the oracle tests
};

// The optimizer state after the step: exp_avg (m) and exp_avg_sq (v), FP32, one per element.
struct AdamState {
  std::span<const float> exp_avg;
  std::span<const float> exp_avg_sq;
};

namespace detail {

DTE_HOST_DEVICE inline float abs_bits(float x) noexcept {
  return bits_float(float_bits(x) & 0x7FFFFFFFu);
}

DTE_HOST_DEVICE inline bool sign_bit(float x) noexcept {
  return (float_bits(x) >> 31) != 0;
}

// The per-element functor of both Adam inverses. Trivially copyable: it is passed by value into
// CUDA kernels and OpenMP loops alike. Built only by AdamWInverse::bind / AdamInverse::bind,
// which validate everything first.
struct AdamFamilyKernel {
  const float* theta;
  const float* exp_avg;
  const float* exp_avg_sq;
  std::size_t n;
  float step_size;     // lr / (1 - beta1^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
  float decay;     // 1 - lr * weight_decay (1 for Adam with L2)
  float rel_p;     // error per unit of |theta|
  float rel_u;     // error per unit of |update|
  float abs_base;  // underflow allowance, absolute
  bool identity;   // lr == 0: the step changed nothing but possibly the sign of a zero

  DTE_HOST_DEVICE std::size_t size() const noexcept { return n; }
  DTE_HOST_DEVICE float current(std::size_t i) const noexcept { return theta[i]; }
  DTE_HOST_DEVICE Reconstruction operator()(std::size_t i) const noexcept {
    return reconstruct(theta[i], exp_avg[i], exp_avg_sq[i]);
  }

  DTE_HOST_DEVICE Reconstruction reconstruct(float p, float m, float v) const noexcept {
    if (identity) {
      // theta = theta_prev * 1 - 0 * (...) exactly; only x - (-0) can turn -0 into +0, and the
      // zero update carries the sign of m.
      if (p == 0.0f) return {p, static_cast<float>(min_subnormal), !sign_bit(m)};
      return {p, 0.0f, true};
    }
    if (m == 0.0f && p == 0.0f) {
      // No update and a zero weight: theta_prev is a zero (or an FP32 underflow remainder that
      // rounds to zero in every 16-bit format). Its sign is theta's unless m is -0, where
      // x - (-0) may have turned -0 into +0.
      return {p, static_cast<float>(min_subnormal), !sign_bit(m)};
    }
    const float denom = add_rn(mul_rn(std::sqrt(v), inv_bc2_sqrt), eps);
    const float update = mul_rn(step_size, div_rn(m, denom));
    const float value = div_rn(add_rn(p, update), decay);
    const float abs_u = abs_bits(update);
    const float abs_m = abs_bits(m);
    // A subnormal m / bc1 can lose up to 2^-150 before the division by denom, which then
    // amplifies it by step_size / denom = |update| / |m|. A zero m gives an exact zero update.
    const bool m_subnormal = abs_m > 0.0f && abs_m < 1.17549435e-38f;
    const float underflow =
        m_subnormal ? mul_rn(abs_base, add_rn(1.0f, div_rn(abs_u, abs_m))) : abs_base;
    const float error =
        div_rn(add_rn(add_rn(mul_rn(rel_p, abs_bits(p)), mul_rn(rel_u, abs_u)), underflow), decay);
    return {value, error, false};
  }
};

// How far the bias correction 1 - beta^t can be from ours when the trainer holds beta in FP32 or
// evaluates the power in FP32: relative to the correction itself.
inline double bias_correction_spread(double beta, std::int64_t step) {
  const double t = static_cast<double>(step);
  const double exact = 1.0 - std::pow(beta, t);
  const double from_float = 1.0 - std::pow(static_cast<double>(static_cast<float>(beta)), t);
  const double power = std::pow(beta, t);
  return std::abs(from_float - exact) / exact + 4.0 * unit_roundoff * power / exact + unit_roundoff;
}

inline AdamFamilyKernel make_adam_kernel(std::string_view policy, bool decoupled,
                                         const AdamHyperparameters& h, std::span<const float> theta,
                                         const AdamState& state, std::string_view tensor) {
  const std::string who(policy);
  const std::string where = tensor_label(tensor);
  // Hyperparameters first: they are cheap to check and explain most mistakes.
  if (h.amsgrad) {
    throw unsupported(who + ": amsgrad is not supported for " + where +
                      ": its step divides by max_exp_avg_sq, which this inverse does not read; "
                      "use SnapshotBase for this optimizer");
  }
  if (h.maximize) {
    throw unsupported(who + ": maximize=True is not supported for " + where +
                      "; minimise the negated objective instead, or use SnapshotBase");
  }
  if (h.step < 1) {
    throw invalid_argument(who + ": step must be >= 1 for " + where + " (got " +
                           std::to_string(h.step) +
                           "); the optimizer has not stepped yet, so there is no previous value "
                           "to reconstruct: publish after the first optimizer step");
  }
  require_non_negative_scalar(who, tensor, "lr", h.lr, "pass the learning rate the step used");
  require_non_negative_scalar(who, tensor, "eps", h.eps,
                              "pass the optimizer's eps (1e-8 by default)");
  require_non_negative_scalar(who, tensor, "weight_decay", h.weight_decay);
  for (const auto& [name, beta] : {std::pair{"beta1", h.beta1}, std::pair{"beta2", h.beta2}}) {
    if (!(beta >= 0.0 && beta < 1.0)) {
      throw invalid_argument(who + ": " + name + " must be in [0, 1) for " + where + " (got " +
                             format_value(beta) + ")");
    }
  }
  if (decoupled && h.lr * h.weight_decay >= 1.0) {
    throw invalid_argument(
        who + ": lr * weight_decay must be < 1 for " + where + " (got lr=" + format_value(h.lr) +
        ", weight_decay=" + format_value(h.weight_decay) + ", product " +
        format_value(h.lr * h.weight_decay) +
        "); the decay factor 1 - lr*weight_decay would be <= 0, which zeroes or flips every "
        "weight and cannot be inverted: check the learning-rate schedule");
  }
  require_same_length(who, tensor, "theta", theta.size(), "exp_avg", state.exp_avg.size());
  require_same_length(who, tensor, "theta", theta.size(), "exp_avg_sq", state.exp_avg_sq.size());
  require_finite(who, tensor, "theta", theta);
  require_finite(who, tensor, "exp_avg", state.exp_avg);
  require_finite(who, tensor, "exp_avg_sq", state.exp_avg_sq);
  require_non_negative(who, tensor, "exp_avg_sq", state.exp_avg_sq);

  const double u = unit_roundoff;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(h.step)) : 1.0;
  const double lw = decoupled ? h.lr * h.weight_decay : 0.0;
  const double step_size = h.lr / bc1;
  // Forward and inverse together round about 9 times in terms of |theta| when the decay factor
  // is not 1, and twice when it is; about 23 times in terms of |update|, plus the spread of the
  // bias corrections and the lr*wd*|update| gap between decaying before or after the update.
  const double rel_p = (lw > 0.0 ? 12.0 : 3.0) * u;
  double rel_u = 32.0 * u + lw;
  if (h.bias_correction) {
    rel_u +=
        bias_correction_spread(h.beta1, h.step) + 0.5 * bias_correction_spread(h.beta2, h.step);
  }
  // Each underflowing multiply, divide or square root is off by at most 2^-150; allow 32 of
  // them, scaled by step_size when that exceeds one.
  const double abs_base = 64.0 * min_subnormal * std::max(1.0, step_size);

  AdamFamilyKernel k{};
  k.theta = theta.data();
  k.exp_avg = state.exp_avg.data();
  k.exp_avg_sq = state.exp_avg_sq.data();
  k.n = theta.size();
  k.step_size = static_cast<float>(step_size);
  k.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(h.eps);
  k.decay = static_cast<float>(1.0 - lw);
  k.rel_p = static_cast<float>(rel_p);
  k.rel_u = static_cast<float>(rel_u);
  k.abs_base = static_cast<float>(abs_base);
  k.identity = h.lr == 0.0;
  return k;
}

}  // namespace detail

// Inverse of one decoupled-AdamW step.
struct AdamWInverse {
  using optimizer_inverse_tag = void;
  using hyperparameters = AdamHyperparameters;
  using state = AdamState;
  using kernel = detail::AdamFamilyKernel;
  static constexpr std::string_view name = "AdamWInverse";

  // Validates the hyperparameters and the state (lengths, NaN/Inf, negative exp_avg_sq) and
  // returns the per-element functor. Throws dte::invalid_argument or dte::unsupported.
  static kernel bind(const hyperparameters& h, std::span<const float> theta, const state& s,
                     std::string_view tensor = {}) {
    return detail::make_adam_kernel(name, true, h, theta, s, tensor);
  }
};

// Inverse of one Adam step whose weight decay was added to the gradient (L2, ADAM_MODE_0).
struct AdamInverse {
  using optimizer_inverse_tag = void;
  using hyperparameters = AdamHyperparameters;
  using state = AdamState;
  using kernel = detail::AdamFamilyKernel;
  static constexpr std::string_view name = "AdamInverse";

  static kernel bind(const hyperparameters& h, std::span<const float> theta, const state& s,
                     std::string_view tensor = {}) {
    return detail::make_adam_kernel(name, false, h, theta, s, tensor);
  }
};

static_assert(optimizer_inverse<AdamWInverse>);
static_assert(optimizer_inverse<AdamInverse>);

}  // namespace dte
