// SPDX-License-Identifier: Apache-2.0
// SnapshotBase: the previous value is the 16-bit value last published, kept in a shadow copy
// (2 bytes per element). For optimizers that cannot be inverted, and as the baseline every
// benchmark compares against. Exact by construction: its error is 0.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/validate.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

struct SnapshotHyperparameters {};

// The shadow: the 16-bit bits of every element as last published.
struct SnapshotState {
  std::span<const std::uint16_t> published;
  // Where the state lives, for a device backend's check that it can read it.
  std::array<const void*, 1> buffers() const noexcept { return {published.data()}; }
};

namespace detail {

template <storage_format F>
struct SnapshotKernel {
  const float* theta;
  const std::uint16_t* published;
  std::size_t n;

  DTE_HOST_DEVICE std::size_t size() const noexcept { return n; }
  DTE_HOST_DEVICE float current(std::size_t i) const noexcept { return theta[i]; }
  DTE_HOST_DEVICE Reconstruction operator()(std::size_t i) const noexcept {
    return {F::widen(published[i]), 0.0f, true};
  }
  DTE_HOST_DEVICE bool valid(std::size_t i) const noexcept {
    return (float_bits(theta[i]) & 0x7FFFFFFFu) < 0x7F800000u;
  }
};

}  // namespace detail

template <storage_format F>
struct BasicSnapshotBase {
  using optimizer_inverse_tag = void;
  using hyperparameters = SnapshotHyperparameters;
  using state = SnapshotState;
  using kernel = detail::SnapshotKernel<F>;
  using format = F;
  static constexpr std::string_view name = "SnapshotBase";

  static kernel bind(const hyperparameters&, std::span<const float> theta, const state& s,
                     std::string_view tensor = {}) {
    const std::string who(name);
    detail::require_same_length(who, tensor, "theta", theta.size(), "published",
                                s.published.size());
    detail::require_finite(who, tensor, "theta", theta);
    return kernel{theta.data(), s.published.data(), theta.size()};
  }
  static kernel bind_unchecked(const hyperparameters&, std::span<const float> theta, const state& s,
                               std::string_view tensor = {}) {
    detail::require_same_length(name, tensor, "theta", theta.size(), "published",
                                s.published.size());
    return kernel{theta.data(), s.published.data(), theta.size()};
  }

  // Owns the shadow copy. record() stores what was just published.
  class Shadow {
   public:
    Shadow() = default;
    explicit Shadow(std::span<const float> theta) { record(theta); }

    void record(std::span<const float> theta) {
      bits_.resize(theta.size());
      std::uint16_t* out = bits_.data();
      const float* in = theta.data();
      DTE_OMP(parallel for schedule(static))
      for (std::size_t i = 0; i < theta.size(); ++i)
        out[i] = F::round(in[i]);
    }

    [[nodiscard]] state view() const noexcept { return state{bits_}; }
    [[nodiscard]] std::size_t bytes() const noexcept {
      return bits_.size() * sizeof(std::uint16_t);
    }

   private:
    std::vector<std::uint16_t> bits_;
  };
};

using SnapshotBase = BasicSnapshotBase<Bf16Format>;
using SnapshotBaseFp16 = BasicSnapshotBase<Fp16Format>;

static_assert(optimizer_inverse<SnapshotBase>);
static_assert(optimizer_inverse<SnapshotBaseFp16>);

}  // namespace dte
