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
// The error bound covers every evaluation order real kernels use (torch single-tensor, foreach and
// fused on CPU and CUDA, TE/Apex FusedAdam; FMA or not; decay before or after the update;
// hyperparameters held in FP32 or FP64), with every operation's underflow error (2^-150) carried
// through the divisions that amplify it; docs/math.md section 3 derives each term, and
// tests/optim/test_bound_property.cpp checks it on adversarial elements for every order.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/numeric/fp32.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/validate.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

// How the trainer's kernel applies decoupled weight decay. Every other rounding of every kernel is
// covered whatever this says; it decides one thing only: whether a +0 weight can have been -0
// before the step, because theta - (lr*wd)*theta turns -0 into +0 (even with lr = 0).
enum class DecayForm : std::uint8_t {
  unknown,   // any of the two (the default): a +0 weight that did not move is flagged
  multiply,  // theta *= 1 - lr*wd, or theta - lr*(update + wd*theta): torch.optim.AdamW
             // single-tensor, foreach and fused=True on the CPU; TE / Apex FusedAdam
  subtract,  // theta -= lr*wd*theta: torch.optim.AdamW fused=True on CUDA; HF's old AdamW
};

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
  bool amsgrad = false;                       // refused: the denominator would use max_exp_avg_sq
  bool maximize = false;                      // refused: not covered by the oracle tests
  DecayForm decay_form = DecayForm::unknown;  // AdamW only; see DecayForm
};

// The optimizer state after the step: exp_avg (m) and exp_avg_sq (v), FP32, one per element.
struct AdamState {
  std::span<const float> exp_avg;
  std::span<const float> exp_avg_sq;
  // Where the state lives, for a device backend's check that it can read it.
  std::array<const void*, 2> buffers() const noexcept {
    return {exp_avg.data(), exp_avg_sq.data()};
  }
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
// which validate everything first and fold every per-step constant of the error bound (including
// the division by the decay factor) into the fields below. docs/math.md derives each of them.
struct AdamFamilyKernel {
  const float* theta;
  const float* exp_avg;
  const float* exp_avg_sq;
  std::size_t n;
  float step_size;     // lr / (1 - beta1^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
  float inv_decay;  // 1 / (1 - lr * weight_decay) (exactly 1 for Adam with L2)
  // error = rel_p*|theta| + rel_u*|update| + abs_err
  //       + (amp_m [m tiny] + sqrt_err*|update| [v tiny]) / denom
  float rel_p;     // per unit of |theta|
  float rel_u;     // per unit of |update|
  float abs_err;   // underflowing operations whose error is not amplified
  float amp_m;     // an underflowing step_size*m or m/bc1 in the trainer, amplified by 1/denom
  float m_tiny;    // |m| below which that first product or quotient may underflow
  float sqrt_err;  // sqrt of an underflowing v/bc2 in the trainer (TE/Apex), relative to denom
  float v_tiny;    // v below which v/bc2 may underflow
  float zero_err;  // theta == m == 0: how far from zero theta_prev can be
  bool zero_sign_exact;       // ... and whether it is then exactly a zero of theta's sign (m = +0)
  bool plus_zero_from_minus;  // the decay may have turned a -0 weight into +0 (DecayForm)
  bool identity;              // lr == 0: the step changed nothing but possibly the sign of a zero

  DTE_HOST_DEVICE std::size_t size() const noexcept { return n; }
  DTE_HOST_DEVICE float current(std::size_t i) const noexcept { return theta[i]; }
  DTE_HOST_DEVICE Reconstruction operator()(std::size_t i) const noexcept {
    return reconstruct(theta[i], exp_avg[i], exp_avg_sq[i]);
  }
  // What bind checks per element: theta, m, v finite and v >= 0 (-0 included).
  DTE_HOST_DEVICE bool valid(std::size_t i) const noexcept {
    const std::uint32_t v = float_bits(exp_avg_sq[i]);
    return (float_bits(theta[i]) & 0x7FFFFFFFu) < 0x7F800000u &&
           (float_bits(exp_avg[i]) & 0x7FFFFFFFu) < 0x7F800000u &&
           (v < 0x7F800000u || v == 0x80000000u);
  }

  DTE_HOST_DEVICE Reconstruction reconstruct(float p, float m, float v) const noexcept {
    if (identity) {
      // theta = theta_prev * 1 - 0 * (...) exactly, but for the sign of a zero.
      if (p == 0.0f) return {p, static_cast<float>(min_subnormal), zero_sign_kept(p, m)};
      return {p, 0.0f, true};
    }
    if (m == 0.0f && p == 0.0f) {
      // No update and a zero weight: theta_prev is a zero, or (only when the decay factor is
      // below about 1/2) a remainder the decay or TE's lr*(wd*p) rounded away.
      return {p, zero_err, zero_sign_exact && zero_sign_kept(p, m)};
    }
    const float denom = add_rn(mul_rn(std::sqrt(v), inv_bc2_sqrt), eps);
    const float inv_denom = div_rn(1.0f, denom);
    const float update = mul_rn(step_size, mul_rn(m, inv_denom));
    const float value = mul_rn(add_rn(p, update), inv_decay);
    const float abs_u = abs_bits(update);
    float error = add_rn(add_rn(mul_rn(rel_p, abs_bits(p)), mul_rn(rel_u, abs_u)), abs_err);
    // Absolute errors the trainer's kernel made below FP32's normal range and then divided by
    // denom: torch's (step_size*m)/denom, TE's (m/bc1)/denom and TE's sqrt(v/bc2). Branch-free
    // (selects; bits - 1 makes the zero case fail the unsigned compare): this is the hot pass.
    const bool m_small =
        float_bits(abs_bits(m)) - 1u < float_bits(m_tiny) - 1u;         // 0 < |m| < m_tiny
    const bool v_small = float_bits(v) - 1u < float_bits(v_tiny) - 1u;  // 0 < v < v_tiny
    const float amplified =
        add_rn(m_small ? amp_m : 0.0f, v_small ? mul_rn(sqrt_err, abs_u) : 0.0f);
    error = add_rn(error, mul_rn(amplified, inv_denom));
    // The sqrt term is first-order in 2^-75/denom: beyond 1/4 nothing useful can be said.
    error = (v_small & (denom < 0x1p-73f)) ? bits_float(0x7F800000u) : error;
    return {value, error, false};
  }

  // A zero weight keeps its sign through the step unless something subtracted a zero of its
  // own sign: x - (-0) after an update of sign m, or -0 - (lr*wd)*(-0) in a subtracting decay.
  DTE_HOST_DEVICE bool zero_sign_kept(float p, float m) const noexcept {
    return !sign_bit(m) && !(plus_zero_from_minus && !sign_bit(p));
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

// check_elements = false leaves the per-element checks (NaN/Inf, negative exp_avg_sq) to the
// caller's pass over the data (AdamFamilyKernel::valid), as the engine's detect pass does.
inline AdamFamilyKernel make_adam_kernel(std::string_view policy, bool decoupled,
                                         const AdamHyperparameters& h, std::span<const float> theta,
                                         const AdamState& state, std::string_view tensor,
                                         bool check_elements = true) {
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
  if (h.step < 1 || h.step > limits::max_step) {
    throw numeric_error(who + ": step must be in [1, 2^53] for " + where + " (got " +
                        std::to_string(h.step) +
                        "); the optimizer has not stepped yet, so there is no previous value "
                        "to reconstruct: publish after the first optimizer step");
  }
  require_non_negative_scalar(who, tensor, "lr", h.lr, limits::max_lr,
                              "pass the learning rate the step used");
  require_non_negative_scalar(who, tensor, "eps", h.eps, limits::max_eps,
                              "pass the optimizer's eps (1e-8 by default)");
  require_non_negative_scalar(who, tensor, "weight_decay", h.weight_decay,
                              limits::max_weight_decay);
  require_zero_or_normal(who, tensor, "lr", h.lr);
  require_zero_or_normal(who, tensor, "eps", h.eps);
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
  if (check_elements) {
    require_finite(who, tensor, "theta", theta);
    require_finite(who, tensor, "exp_avg", state.exp_avg);
    require_finite(who, tensor, "exp_avg_sq", state.exp_avg_sq);
    require_non_negative(who, tensor, "exp_avg_sq", state.exp_avg_sq);
  }

  const double u = unit_roundoff;
  const double eta = 0.5 * min_subnormal;  // largest absolute error of an underflowing op
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(h.step)) : 1.0;
  const double lw = decoupled ? h.lr * h.weight_decay : 0.0;
  const double c = 1.0 - lw;
  const double amp = lw > 0.0 ? lw / c : 0.0;  // how much the decay amplifies its own roundings
  const double step_size = h.lr / bc1;
  // docs/math.md section 3 derives each term with the roundings of every kernel order dte
  // covers; the constants carry at least 1.4x the derived value, so that rounding the bound
  // itself to FP32 and the detector's comparisons cannot eat the margin.
  const double rel_p = lw > 0.0 ? 12.0 * u + 12.0 * u * amp : 3.0 * u;
  // (lw: the gap between decaying before and after the update, exact to first order.)
  double rel_u = 32.0 * u + 12.0 * u * amp + lw * (1.0 + 0x1p-16);
  if (h.bias_correction) {
    rel_u +=
        bias_correction_spread(h.beta1, h.step) + 0.5 * bias_correction_spread(h.beta2, h.step);
  }
  // Each underflowing multiply or divide whose error is not amplified afterwards is off by at
  // most 2^-150, scaled by at most step_size; there are fewer than 8 of them, allow 128.
  const double abs_err = 128.0 * eta * std::max(1.0, step_size);
  // An underflowing first product (torch: step_size*m; TE: m/bc1, then times lr) is divided by
  // denom afterwards: 2^-150 * max(1, lr) / denom, times at most 4/3 where TE's denom is short by
  // up to sqrt(2^-150) = 2^-75 because v/bc2 underflowed (the 2*2^-75/denom term below, valid
  // while 2^-75/denom <= 1/4: beyond that the error is infinite).
  const double amp_m = 2.0 * eta * std::max(1.0, h.lr);
  const double m_tiny = 2.0 * 0x1p-126 * std::max(1.0 / step_size, bc1);
  const double sqrt_err = 4.0 * 0x1p-75;
  const double v_tiny = 2.0 * 0x1p-126;
  // theta == m == 0: theta_prev*c (torch) or theta_prev - lr*(wd*theta_prev) (TE) rounded to
  // zero, so |theta_prev| <= 2^-150 * (1 + lr) / c; below 2^-149 that means an exact zero.
  const double zero_bound = lw > 0.0 ? eta * (1.0 + h.lr) * (1.0 + 0x1p-20) / c : 0.0;

  AdamFamilyKernel k{};
  k.theta = theta.data();
  k.exp_avg = state.exp_avg.data();
  k.exp_avg_sq = state.exp_avg_sq.data();
  k.n = theta.size();
  k.step_size = static_cast<float>(step_size);
  k.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(h.eps);
  k.inv_decay = static_cast<float>(1.0 / c);
  k.rel_p = float_up(rel_p / c);
  k.rel_u = float_up(rel_u / c);
  k.abs_err = float_up(abs_err / c);
  k.amp_m = float_up(amp_m / c);
  k.m_tiny = float_up(m_tiny);
  k.sqrt_err = float_up(sqrt_err / c);
  k.v_tiny = float_up(v_tiny);
  k.zero_err = float_up(std::max(min_subnormal, 2.0 * zero_bound));
  k.zero_sign_exact = zero_bound < min_subnormal;
  k.plus_zero_from_minus =
      decoupled && h.weight_decay != 0.0 && h.decay_form != DecayForm::multiply;
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
  // bind without the pass over the elements: the caller checks kernel.valid(i) for every
  // element it reads (the engine's detect pass does) and calls bind() to report a refusal.
  static kernel bind_unchecked(const hyperparameters& h, std::span<const float> theta,
                               const state& s, std::string_view tensor = {}) {
    return detail::make_adam_kernel(name, true, h, theta, s, tensor, false);
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
  // bind without the pass over the elements: the caller checks kernel.valid(i) for every
  // element it reads (the engine's detect pass does) and calls bind() to report a refusal.
  static kernel bind_unchecked(const hyperparameters& h, std::span<const float> theta,
                               const state& s, std::string_view tensor = {}) {
    return detail::make_adam_kernel(name, false, h, theta, s, tensor, false);
  }
};

static_assert(optimizer_inverse<AdamWInverse>);
static_assert(optimizer_inverse<AdamInverse>);

}  // namespace dte
