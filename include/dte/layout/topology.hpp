// SPDX-License-Identifier: Apache-2.0
// Trainer (Megatron-Core) and receiver (SGLang/vLLM) topologies: parsing of the `--train` and
// `--infer` syntax, derived sizes, and the divisibility rules that decide whether a topology can
// hold a model at all. Every refusal names the field and the values; every value is bounded
// (dte/bounds.hpp) and the world sizes are computed checked.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "dte/bounds.hpp"
#include "dte/error.hpp"
#include "dte/layout/model.hpp"

namespace dte::layout {

// The defaults of a member left as constructed are Megatron-Core's / Megatron-LM's (etp = tp,
// the vocabulary padded to a multiple of 128 * tp, a uniform pipeline split, one bucket);
// layout/stack.hpp fills them from another stack's defaults and lists what was assumed.
struct TrainTopology {
  std::int64_t tp = 1;   // Tm
  std::int64_t pp = 1;   // PP
  std::int64_t ep = 1;   // EPm (experts)
  std::int64_t etp = 0;  // Te (expert tensor parallel); 0: as tp (Megatron-Core's default)
  std::int64_t dp = 1;   // dense data parallel (the distributed optimizer shards over it)
  std::vector<std::int64_t> layer_split;  // layers per pipeline stage; empty: uniform L/PP
  std::int64_t bucket_size = 0;           // elements per DDP bucket; 0: one bucket per buffer
  std::int64_t vocab_divisible_by = 128;  // Megatron --make-vocab-size-divisible-by
  bool pad_vocab = true;  // false: the vocabulary as it is (mbridge, Megatron-Bridge)
  // The keys parse_train_topology() saw (the rest were assumed); empty for one built in code.
  std::vector<std::string> given;

  [[nodiscard]] std::int64_t expert_tp() const noexcept { return etp > 0 ? etp : tp; }
  // Expert data parallel size: the world is tp*dp*pp for dense and etp*ep*edp*pp for experts.
  [[nodiscard]] std::int64_t edp() const noexcept { return tp * dp / (expert_tp() * ep); }
  [[nodiscard]] std::int64_t world() const noexcept { return tp * dp * pp; }
  [[nodiscard]] bool was_given(std::string_view key) const {
    return std::find(given.begin(), given.end(), key) != given.end();
  }

  // Megatron's padded vocabulary: ceil(V / (divisible_by * Tm)) * divisible_by * Tm; V itself
  // without padding (validate() then needs V divisible by Tm).
  [[nodiscard]] std::int64_t padded_vocab(std::int64_t vocab) const noexcept {
    if (!pad_vocab) return vocab;
    const std::int64_t m = vocab_divisible_by * tp;
    return (vocab + m - 1) / m * m;
  }

  [[nodiscard]] std::int64_t stage_layers(std::int64_t stage, std::int64_t layers) const {
    return layer_split.empty() ? layers / pp : layer_split.at(static_cast<std::size_t>(stage));
  }
  [[nodiscard]] std::int64_t stage_offset(std::int64_t stage, std::int64_t layers) const {
    std::int64_t offset = 0;
    for (std::int64_t s = 0; s < stage; ++s)
      offset += stage_layers(s, layers);
    return offset;
  }
};

struct InferTopology {
  std::int64_t tp = 1;        // Ts
  std::int64_t ep = 1;        // EPs (SGLang --ep-size)
  std::int64_t replicas = 1;  // inference data-parallel copies

  [[nodiscard]] std::int64_t moe_tp() const noexcept { return tp / ep; }  // Ms
  [[nodiscard]] std::int64_t ranks() const noexcept { return tp * replicas; }
  // One replica of this topology (what a receiver of one TP rank, or a sender that serves one
  // replica's ranks, lays out).
  [[nodiscard]] InferTopology one_replica() const noexcept { return {tp, ep, 1}; }
  // SGLang/vLLM pad the vocabulary to a multiple of 64 and split that evenly.
  [[nodiscard]] static std::int64_t padded_vocab(std::int64_t vocab) noexcept {
    return (vocab + 63) / 64 * 64;
  }
};

namespace detail {

// An integer in [1, hi] as written on the command line; the text is quoted back as given.
inline std::int64_t parse_positive(std::string_view flag, std::string_view key,
                                   std::string_view text, std::int64_t hi) {
  const DecimalInteger d = parse_decimal(text);
  if (!d.integer) {
    throw invalid_argument(std::string(flag) + ": " + std::string(key) + "=" + std::string(text) +
                               " is not a positive integer",
                           about(std::string(flag), std::string(key)));
  }
  if (!d.fits || d.value < 1 || d.value > hi) {
    throw bounds_error(std::string(flag) + ": " + std::string(key) + "=" + std::string(text) +
                           " is out of range; " + std::string(key) + " must be an integer in [1, " +
                           std::to_string(hi) + "]",
                       about(std::string(flag), std::string(key)));
  }
  return d.value;
}

// "a=1,b=2" -> calls set(key, value) for each pair.
template <class Set>
void parse_pairs(std::string_view flag, std::string_view spec, Set&& set) {
  if (spec.empty()) throw invalid_argument(std::string(flag) + ": empty topology");
  std::vector<std::string_view> seen;
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string_view item = spec.substr(pos, comma - pos);
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      throw invalid_argument(std::string(flag) + ": '" + std::string(item) +
                             "' is not key=value (example: tp=4,pp=2,dp=2)");
    }
    const std::string_view key = item.substr(0, eq);
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      throw invalid_argument(
          std::string(flag) + ": " + std::string(key) + " is given twice; give each key once",
          about(std::string(flag), std::string(key)));
    }
    seen.push_back(key);
    set(key, item.substr(eq + 1));
    pos = comma + 1;
  }
}

inline void require_divides(std::string_view side, std::string_view what, std::int64_t value,
                            std::string_view by_what, std::int64_t by) {
  if (by > 0 && value % by == 0) return;
  throw invalid_argument(std::string(side) + ": " + std::string(what) + " (" +
                         std::to_string(value) + ") is not divisible by " + std::string(by_what) +
                         " (" + std::to_string(by) + ")");
}

// Every value of a topology in its range and the world sizes below limits::world: parsed
// topologies and those built in code alike.
inline void check_bounds(const TrainTopology& t) {
  const std::string_view side = "--train";
  require_range(side, "tp", t.tp, 1, limits::tp);
  require_range(side, "pp", t.pp, 1, limits::pp);
  require_range(side, "ep", t.ep, 1, limits::ep);
  require_range(side, "etp", t.etp, 0, limits::tp);
  require_range(side, "dp", t.dp, 1, limits::dp);
  require_range(side, "bucket", t.bucket_size, 0, limits::buffer_elements);
  require_range(side, "vocab_div", t.vocab_divisible_by, 1, limits::vocab_divisible_by);
  checked_mul(checked_mul(t.tp, t.dp, "--train: tp * dp", limits::world), t.pp,
              "--train: the world (tp * dp) * pp", limits::world);
  checked_mul(t.vocab_divisible_by, t.tp, "--train: vocab_div * tp", limits::vocab);
  if (t.layer_split.size() > static_cast<std::size_t>(limits::pp)) {
    throw bounds_error("--train: split lists " + std::to_string(t.layer_split.size()) +
                       " stages; pp is at most " + std::to_string(limits::pp));
  }
  for (std::int64_t n : t.layer_split)
    require_range(side, "split", n, 1, limits::layers);
}

inline void check_bounds(const InferTopology& t) {
  const std::string_view side = "--infer";
  require_range(side, "tp", t.tp, 1, limits::tp);
  require_range(side, "ep", t.ep, 1, limits::ep);
  require_range(side, "replicas", t.replicas, 1, limits::replicas);
  checked_mul(t.tp, t.replicas, "--infer: the receiver ranks tp * replicas", limits::world);
}

}  // namespace detail

// --train tp=4,pp=2,ep=8,etp=1,dp=4[,split=10:8][,bucket=N][,vocab_div=128|none]
// Keys not given keep Megatron-LM's defaults; layout/stack.hpp applies another stack's.
inline TrainTopology parse_train_topology(std::string_view spec) {
  TrainTopology t;
  detail::parse_pairs("--train", spec, [&](std::string_view key, std::string_view value) {
    t.given.emplace_back(key);
    if (key == "tp") {
      t.tp = detail::parse_positive("--train", key, value, limits::tp);
    } else if (key == "pp") {
      t.pp = detail::parse_positive("--train", key, value, limits::pp);
    } else if (key == "ep") {
      t.ep = detail::parse_positive("--train", key, value, limits::ep);
    } else if (key == "etp") {
      t.etp = detail::parse_positive("--train", key, value, limits::tp);
    } else if (key == "dp") {
      t.dp = detail::parse_positive("--train", key, value, limits::dp);
    } else if (key == "bucket") {
      t.bucket_size = detail::parse_positive("--train", key, value, limits::buffer_elements);
    } else if (key == "vocab_div" && value == "none") {
      t.pad_vocab = false;
    } else if (key == "vocab_div") {
      t.pad_vocab = true;
      t.vocab_divisible_by =
          detail::parse_positive("--train", key, value, limits::vocab_divisible_by);
    } else if (key == "split") {
      t.layer_split.clear();
      std::size_t pos = 0;
      while (pos <= value.size()) {
        const std::size_t colon = std::min(value.find(':', pos), value.size());
        t.layer_split.push_back(detail::parse_positive(
            "--train", "split", value.substr(pos, colon - pos), limits::layers));
        if (t.layer_split.size() > static_cast<std::size_t>(limits::pp)) {
          throw bounds_error(
              "--train: split lists more than " + std::to_string(limits::pp) + " stages",
              about("--train", "split"));
        }
        pos = colon + 1;
      }
    } else {
      throw invalid_argument("--train: unknown key '" + std::string(key) +
                             "'; keys: tp, pp, ep, etp, dp, split, bucket, vocab_div");
    }
  });
  detail::check_bounds(t);
  return t;
}

// --infer tp=8,ep=8,replicas=2
inline InferTopology parse_infer_topology(std::string_view spec) {
  InferTopology t;
  detail::parse_pairs("--infer", spec, [&](std::string_view key, std::string_view value) {
    if (key == "tp") {
      t.tp = detail::parse_positive("--infer", key, value, limits::tp);
    } else if (key == "ep") {
      t.ep = detail::parse_positive("--infer", key, value, limits::ep);
    } else if (key == "replicas" || key == "dp") {
      t.replicas = detail::parse_positive("--infer", key, value, limits::replicas);
    } else {
      throw invalid_argument("--infer: unknown key '" + std::string(key) +
                             "'; keys: tp, ep, replicas");
    }
  });
  detail::check_bounds(t);
  return t;
}

// Can this trainer topology hold this model? (Megatron-Core's own constraints.) A topology built
// in code rather than parsed gets the same bounds.
inline void validate(const ModelSpec& m, const TrainTopology& t) {
  using detail::require_divides;
  const std::string_view side = "--train";
  detail::check_bounds(t);
  require_divides(side, "num_attention_heads", m.heads, "tp", t.tp);
  require_divides(side, "QKV rows (heads + 2*kv_heads)*head_dim",
                  (m.heads + 2 * m.kv_heads) * m.head_dim, "tp", t.tp);
  if (m.kv_heads >= t.tp) {
    require_divides(side, "num_key_value_heads", m.kv_heads, "tp", t.tp);
  } else {
    require_divides(side, "tp", t.tp, "num_key_value_heads", m.kv_heads);
  }
  if (!m.moe()) require_divides(side, "intermediate_size", m.intermediate, "tp", t.tp);
  if (!t.pad_vocab) {
    require_divides(side, "vocab_size (not padded: vocab_div=none)", m.vocab, "tp", t.tp);
  }
  if (t.layer_split.empty()) {
    require_divides(side, "num_hidden_layers", m.layers, "pp", t.pp);
  } else {
    std::int64_t sum = 0;
    for (std::int64_t n : t.layer_split)
      sum += n;
    if (static_cast<std::int64_t>(t.layer_split.size()) != t.pp || sum != m.layers) {
      throw invalid_argument(
          "--train: split has " + std::to_string(t.layer_split.size()) + " stages summing to " +
          std::to_string(sum) + " layers; it needs pp (" + std::to_string(t.pp) +
          ") stages summing to num_hidden_layers (" + std::to_string(m.layers) + ")");
    }
  }
  if (m.moe()) {
    require_divides(side, "num_experts", m.experts, "ep", t.ep);
    const std::string etp = t.etp > 0 ? "etp" : "etp (unset: = tp, Megatron-Core's default)";
    require_divides(side, "moe_intermediate_size", m.moe_intermediate, etp, t.expert_tp());
    require_divides(side, "tp*dp", t.tp * t.dp, etp + "*ep", t.expert_tp() * t.ep);
  } else if (t.ep != 1 || t.etp > 1) {
    throw invalid_argument("--train: ep=" + std::to_string(t.ep) +
                           ", etp=" + std::to_string(t.etp) + " given for the dense model '" +
                           m.name + "', which has no experts; drop them");
  }
}

// Can this receiver topology hold this model? (SGLang's loaders' constraints.)
inline void validate(const ModelSpec& m, const InferTopology& t) {
  using detail::require_divides;
  const std::string_view side = "--infer";
  detail::check_bounds(t);
  require_divides(side, "num_attention_heads", m.heads, "tp", t.tp);
  if (t.tp > m.kv_heads) {
    require_divides(side, "tp", t.tp, "num_key_value_heads", m.kv_heads);
  } else {
    require_divides(side, "num_key_value_heads", m.kv_heads, "tp", t.tp);
  }
  require_divides(side, "padded vocabulary (vocab_size rounded up to 64)",
                  InferTopology::padded_vocab(m.vocab), "tp", t.tp);
  if (m.moe()) {
    require_divides(side, "tp", t.tp, "ep", t.ep);
    require_divides(side, "num_experts", m.experts, "ep", t.ep);
    require_divides(side, "moe_intermediate_size", m.moe_intermediate, "moe tp (tp/ep)",
                    t.moe_tp());
  } else {
    require_divides(side, "intermediate_size", m.intermediate, "tp", t.tp);
    if (t.ep != 1) {
      throw invalid_argument("--infer: ep=" + std::to_string(t.ep) +
                             " given for the dense model '" + m.name +
                             "', which has no experts; drop it");
    }
  }
}

}  // namespace dte::layout
