// SPDX-License-Identifier: Apache-2.0
// Online FP8 recipes: how an inference engine that loads BF16 weights quantizes them to FP8
// E4M3FN blocks, to the bit, so that a sender can compute what every receiver holds (docs/fp8.md).
// A recipe is the per-element rule shared by the sender (the new code and scale of every element
// of a touched block) and by tests (a dense requantization). Each recipe is a policy (concept
// fp8_recipe, concepts.hpp) that names its engine, version and file.
//
// An element's code is a function of its BF16 bits and its block's scale alone, and the scale a
// function of the block's BF16 values alone. So a block none of whose BF16 values changed keeps
// its scale and its codes, and within a block whose scale did not change only elements whose BF16
// value changed can change their code.
#pragma once

#include <cstdint>

#include "dte/config.hpp"
#include "dte/numeric/fp8.hpp"
#include "dte/numeric/round.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

// vLLM 0.32's online per-block FP8 (quantization="fp8_per_block"): Fp8PerBlockOnlineLinearMethod
// (vllm/model_executor/layers/quantization/online/fp8.py) calls per_block_cast_to_fp8(weight,
// [128, 128], use_ue8m0=False) (vllm/utils/deep_gemm.py) on each worker's own weight: the local
// fused tensor ([out, in], TP-sharded), zero-padded to whole 128 x 128 blocks; per block
//   amax  = max |x| in FP32, clamped to at least 1e-4 (FP32)
//   sf    = amax / 448                      (FP32 division; kept as weight_scale_inv, FP32)
//   code  = e4m3fn(x * (1 / sf))            (FP32 reciprocal, FP32 product, torch's conversion)
// The padding's zeros never raise amax. No reduction across TP ranks.
struct VllmBlockFp8 {
  using fp8_recipe_tag = void;
  static constexpr const char* name = "fp8-block";
  static constexpr const char* source =
      "vLLM 0.32 per_block_cast_to_fp8 (vllm/utils/deep_gemm.py), use_ue8m0=False";
  static constexpr std::int64_t block_rows = 128;
  static constexpr std::int64_t block_cols = 128;

  // The magnitude the block's scale comes from (FP32 of a BF16 value).
  DTE_HOST_DEVICE static float magnitude(std::uint16_t bf16) noexcept {
    return bits_float(static_cast<std::uint32_t>(bf16 & 0x7FFFu) << 16);
  }
  // The block's scale (weight_scale_inv) from its largest magnitude.
  DTE_HOST_DEVICE static float scale(float amax) noexcept {
    const float a = amax < 1e-4f ? 1e-4f : amax;  // (torch's clamp: a NaN stays NaN)
    return a / e4m3fn_max;
  }
  // What each value is multiplied by: 1 / scale, as torch computes it.
  DTE_HOST_DEVICE static float multiplier(float scale) noexcept { return 1.0f / scale; }
  DTE_HOST_DEVICE static std::uint8_t code(std::uint16_t bf16, float multiplier) noexcept {
    return e4m3fn_from_float(bits_float(static_cast<std::uint32_t>(bf16) << 16) * multiplier);
  }

  // The code an element had under `multiplier` when its previous BF16 bits can be those of
  // `prev` (PreviousBits: exact, or a range [lo, hi] of values): true with the code when every
  // candidate gives the same one. The rule is monotone in the value for a positive multiplier,
  // so the two ends decide, unless the range reaches zero, where -0 and +0 have codes of their
  // own.
  DTE_HOST_DEVICE static bool previous_code(const PreviousBits& prev, float multiplier,
                                            std::uint8_t& out) noexcept {
    if (prev.certain) {
      out = code(prev.bits, multiplier);
      return true;
    }
    if (!prev.bounded) return false;
    const bool same_sign = ((prev.lo ^ prev.hi) & 0x8000u) == 0;
    const bool nonzero = (prev.lo & 0x7FFFu) != 0 && (prev.hi & 0x7FFFu) != 0;
    if (!same_sign || !nonzero) return false;
    const std::uint8_t a = code(prev.lo, multiplier), b = code(prev.hi, multiplier);
    if (a != b) return false;
    out = a;
    return true;
  }
};

// The largest |x| of x[0, n) and `top`, as FP32 bits (for numbers, |x|'s bits order as |x|
// does): a block's amax before rounding. Rounding is monotone and symmetric, so the largest
// magnitude of the block's BF16 values is Recipe::magnitude(Detect::store(bits_float(top))),
// one rounding per block. (The frame validated the weights: no NaN.)
inline std::uint32_t abs_max_bits(const float* x, std::int64_t n, std::uint32_t top = 0) noexcept {
  DTE_OMP(simd reduction(max : top))
  for (std::int64_t j = 0; j < n; ++j) {
    const std::uint32_t a = float_bits(x[j]) & 0x7FFFFFFFu;
    top = a > top ? a : top;
  }
  return top;
}

// What a receiver holds of one element of a touched block, where that is known.
struct Fp8HeldCode {
  bool known = false;
  std::uint8_t code = 0;
  // The send rule: the element's new code is sent unless the code held is known and equal.
  [[nodiscard]] DTE_HOST_DEVICE constexpr bool sends(std::uint8_t new_code) const noexcept {
    return !known || code != new_code;
  }
};

// The code a receiver holds of an element of a touched block whose new code is `code`, shared by
// the senders (publication/fp8_sender.hpp, engine/fp8_stage.hpp): the code under the old scale
// (old_multiplier) of its previous bits where the scan flagged the element (prev: what they can
// be; known when every candidate gives one code), else of its bits (unchanged), which is `code`
// itself unless the block was rescaled (the new scale's bits differ from the old one's).
template <class Recipe>
DTE_HOST_DEVICE Fp8HeldCode fp8_held_code(std::uint16_t bits, std::uint8_t code,
                                          const PreviousBits* prev, float old_multiplier,
                                          bool rescaled) noexcept {
  Fp8HeldCode h;
  if (prev != nullptr) {
    h.known = Recipe::previous_code(*prev, old_multiplier, h.code);
  } else {
    h.known = true;
    h.code = rescaled ? Recipe::code(bits, old_multiplier) : code;
  }
  return h;
}

}  // namespace dte
