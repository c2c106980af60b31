// SPDX-License-Identifier: Apache-2.0
// SgdMomentumInverse: SGD with a momentum buffer, as torch.optim.SGD runs it.
//
//   d   = g + weight_decay * theta_prev
//   buf = d                                        (first step)
//   buf = momentum * buf + (1 - dampening) * d     (later steps)
//   theta = theta_prev - lr * buf
//
// so theta_prev = theta + lr * buf exactly in real arithmetic. Nesterov momentum applies
// d + momentum * buf, and d is not stored: it cannot be inverted and is refused.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/numeric/fp32.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/validate.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

struct SgdHyperparameters {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

struct SgdState {
  std::span<const float> momentum_buffer;
  // Where the state lives, for a device backend's check that it can read it.
  std::array<const void*, 1> buffers() const noexcept { return {momentum_buffer.data()}; }
};

namespace detail {

struct SgdMomentumKernel {
  const float* theta;
  const float* buffer;
  std::size_t n;
  float lr;
  float rel_p;
  float rel_u;
  float abs_err;
  bool identity;  // lr == 0

  DTE_HOST_DEVICE std::size_t size() const noexcept { return n; }
  DTE_HOST_DEVICE float current(std::size_t i) const noexcept { return theta[i]; }
  DTE_HOST_DEVICE Reconstruction operator()(std::size_t i) const noexcept {
    return reconstruct(theta[i], buffer[i]);
  }
  DTE_HOST_DEVICE bool valid(std::size_t i) const noexcept {
    return (float_bits(theta[i]) & 0x7FFFFFFFu) < 0x7F800000u &&
           (float_bits(buffer[i]) & 0x7FFFFFFFu) < 0x7F800000u;
  }

  DTE_HOST_DEVICE Reconstruction reconstruct(float p, float buf) const noexcept {
    if (identity) {  // theta = theta_prev - 0 * buf: exact but for the sign of a zero
      if (p == 0.0f) return {p, static_cast<float>(min_subnormal), !sign_bit(buf)};
      return {p, 0.0f, true};
    }
    if (buf == 0.0f && p == 0.0f) {
      // Same reasoning as for Adam: only a -0 buffer can flip the sign of a zero weight.
      return {p, static_cast<float>(min_subnormal), !sign_bit(buf)};
    }
    const float update = mul_rn(lr, buf);
    const float value = add_rn(p, update);
    const float error =
        add_rn(add_rn(mul_rn(rel_p, abs_bits(p)), mul_rn(rel_u, abs_bits(update))), abs_err);
    return {value, error, false};
  }
};

}  // namespace detail

struct SgdMomentumInverse {
  using optimizer_inverse_tag = void;
  using hyperparameters = SgdHyperparameters;
  using state = SgdState;
  using kernel = detail::SgdMomentumKernel;
  static constexpr std::string_view name = "SgdMomentumInverse";

  static kernel bind(const hyperparameters& h, std::span<const float> theta, const state& s,
                     std::string_view tensor = {}) {
    kernel k = bind_unchecked(h, theta, s, tensor);
    detail::require_finite(name, tensor, "theta", theta);
    detail::require_finite(name, tensor, "momentum_buffer", s.momentum_buffer);
    return k;
  }

  // bind without the pass over the elements (see AdamWInverse::bind_unchecked).
  static kernel bind_unchecked(const hyperparameters& h, std::span<const float> theta,
                               const state& s, std::string_view tensor = {}) {
    const std::string who(name);
    const std::string where = detail::tensor_label(tensor);
    if (h.nesterov) {
      throw unsupported(who + ": Nesterov momentum cannot be inverted for " + where +
                        ": the step applied g + momentum*buf and the gradient g is not stored; "
                        "use nesterov=False or SnapshotBase for this optimizer");
    }
    if (h.maximize) {
      throw unsupported(who + ": maximize=True is not supported for " + where +
                        "; minimise the negated objective instead, or use SnapshotBase");
    }
    if (!(std::isfinite(h.momentum) && h.momentum > 0.0 && h.momentum <= 1.0)) {
      throw numeric_error(who + ": momentum must be in (0, 1] for " + where + " (got " +
                          detail::format_value(h.momentum) +
                          "); plain SGD keeps no state to invert: use SnapshotBase for it");
    }
    if (!(std::isfinite(h.dampening) && h.dampening >= 0.0 && h.dampening <= 1.0)) {
      throw invalid_argument(who + ": dampening must be in [0, 1] for " + where + " (got " +
                             detail::format_value(h.dampening) + ")");
    }
    detail::require_non_negative_scalar(who, tensor, "lr", h.lr, limits::max_lr,
                                        "pass the learning rate the step used");
    detail::require_non_negative_scalar(who, tensor, "weight_decay", h.weight_decay,
                                        limits::max_weight_decay);
    detail::require_zero_or_normal(who, tensor, "lr", h.lr);
    detail::require_same_length(who, tensor, "theta", theta.size(), "momentum_buffer",
                                s.momentum_buffer.size());

    // Forward: lr rounded to FP32 (u), the product (u), the sum (u). Inverse: the same three.
    const double u = detail::unit_roundoff;
    kernel k{};
    k.theta = theta.data();
    k.buffer = s.momentum_buffer.data();
    k.n = theta.size();
    k.lr = static_cast<float>(h.lr);
    k.rel_p = static_cast<float>(3.0 * u);
    k.rel_u = static_cast<float>(8.0 * u);
    k.abs_err = static_cast<float>(64.0 * detail::min_subnormal * std::max(1.0, h.lr));
    k.identity = h.lr == 0.0;
    return k;
  }
};

static_assert(optimizer_inverse<SgdMomentumInverse>);

}  // namespace dte
