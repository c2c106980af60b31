// SPDX-License-Identifier: Apache-2.0
// Bounded integers: every count, size and offset dte reads from a file, a command line or a
// message has an explicit range, and every product or sum of them is computed checked. The
// limits are far above what real models and clusters need (docs/limits.md lists both) and far
// below what would overflow a 64-bit product or make a plan run away in memory; a value outside
// its range is refused with a bounds_error that names the source, the field, the value as
// given and the allowed range.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

#include "dte/error.hpp"

namespace dte {

namespace limits {

// Model shape (config.json). The largest open models today: hidden 18432, 126 layers, 128
// query heads, head_dim 256, intermediate 73728, 512 experts, vocabulary 262144.
inline constexpr std::int64_t hidden = 1 << 17;
inline constexpr std::int64_t layers = 1 << 12;
inline constexpr std::int64_t heads = 1 << 12;
inline constexpr std::int64_t head_dim = 1 << 12;
inline constexpr std::int64_t intermediate = 1 << 20;
inline constexpr std::int64_t experts = 1 << 14;
inline constexpr std::int64_t vocab = 1 << 24;
// Derived: one tensor is addressed by 32-bit indices on the wire; a model's canonical index
// must stay below 2^48 (the digest key); the plan holds a few hundred bytes per tensor.
inline constexpr std::int64_t tensor_elements = (std::int64_t{1} << 32) - 1;
inline constexpr std::int64_t model_elements = std::int64_t{1} << 44;
inline constexpr std::int64_t model_tensors = std::int64_t{1} << 20;

// Topologies (--train, --infer, buffer layouts).
inline constexpr std::int64_t tp = 1 << 10;
inline constexpr std::int64_t pp = 1 << 10;
inline constexpr std::int64_t ep = 1 << 14;
inline constexpr std::int64_t dp = 1 << 20;
inline constexpr std::int64_t world = 1 << 20;  // trainer ranks (tp*dp*pp), receiver ranks
inline constexpr std::int64_t replicas = 1 << 16;
inline constexpr std::int64_t vocab_divisible_by = 1 << 16;
inline constexpr std::int64_t buffer_elements = std::int64_t{1} << 44;  // a flat DDP buffer

}  // namespace limits

// "source: field" for messages (either part may be empty).
inline std::string quoted_field(std::string_view source, std::string_view field) {
  std::string s(source);
  if (!s.empty() && !field.empty()) s += ": ";
  s += field;
  return s;
}

// Decimal digits (an optional '-', nothing else) as an int64: `integer` false when the text is
// not one, `fits` false when it is one too large for 64 bits (refuse it quoting the text).
struct DecimalInteger {
  bool integer = false, fits = false;
  std::int64_t value = 0;
};

inline DecimalInteger parse_decimal(std::string_view text) noexcept {
  DecimalInteger d;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, d.value);
  d.integer =
      !text.empty() && ptr == end && (ec == std::errc{} || ec == std::errc::result_out_of_range);
  d.fits = d.integer && ec == std::errc{};
  return d;
}

// Refuses v outside [lo, hi]. `field` is the name as the user wrote it.
inline std::int64_t require_range(std::string_view source, std::string_view field, std::int64_t v,
                                  std::int64_t lo, std::int64_t hi, std::string_view hint = {}) {
  if (v >= lo && v <= hi) return v;
  throw bounds_error(quoted_field(source, field) + " is " + std::to_string(v) +
                         "; it must be an integer in [" + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]" + (hint.empty() ? "" : "; ") + std::string(hint),
                     about(std::string(source), std::string(field)));
}

namespace detail {

[[noreturn]] inline void refuse_arithmetic(std::string_view what, std::int64_t a, char op,
                                           std::int64_t b, bool overflow, std::int64_t r,
                                           std::int64_t limit) {
  throw bounds_error(std::string(what) + " = " + std::to_string(a) + " " + op + " " +
                         std::to_string(b) +
                         (overflow ? " overflows 64 bits" : " = " + std::to_string(r)) +
                         ", more than dte's limit of " + std::to_string(limit),
                     about({}, std::string(what)));
}

}  // namespace detail

// a*b and a+b for non-negative operands, refused (naming what is computed) past `limit`.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what,
                                std::int64_t limit = INT64_MAX) {
  std::int64_t r = 0;
  const bool overflow = a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r);
  if (overflow || r > limit) detail::refuse_arithmetic(what, a, '*', b, overflow, r, limit);
  return r;
}

inline std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what,
                                std::int64_t limit = INT64_MAX) {
  std::int64_t r = 0;
  const bool overflow = a < 0 || b < 0 || __builtin_add_overflow(a, b, &r);
  if (overflow || r > limit) detail::refuse_arithmetic(what, a, '+', b, overflow, r, limit);
  return r;
}

}  // namespace dte
