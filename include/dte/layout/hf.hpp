// SPDX-License-Identifier: Apache-2.0
// The HF canonical index space: every tensor of the on-disk HuggingFace checkpoint (per-expert
// names for MoE; q/k/v biases and q/k norms where the family has them; no lm_head when the
// embeddings are tied), numbered in a fixed order, each element addressed as (tensor, flat index)
// and globally as base(tensor) + flat index.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dte/layout/model.hpp"

namespace dte::layout {

enum class HfKind : std::uint8_t {
  embed,
  input_norm,
  q,
  k,
  v,
  q_bias,
  k_bias,
  v_bias,
  q_norm,
  k_norm,
  o,
  post_norm,
  gate,
  up,
  down,
  router,
  expert_gate,
  expert_up,
  expert_down,
  final_norm,
  lm_head,
};

// An element of the canonical space; tensor < 0 means "no canonical element" (Megatron's vocab
// padding rows, or a replica that is not the designated sender).
struct Canonical {
  std::int64_t tensor = -1;
  std::int64_t index = 0;
  friend bool operator==(const Canonical&, const Canonical&) = default;
};

struct HfTensor {
  HfKind kind;
  std::int32_t layer;   // -1 outside the decoder layers
  std::int32_t expert;  // -1 unless an expert tensor
  std::int64_t rows;    // dim 0
  std::int64_t cols;    // dim 1; 0 for a 1-D tensor
  std::int64_t base;    // global canonical index of element 0

  [[nodiscard]] std::int64_t numel() const noexcept { return cols == 0 ? rows : rows * cols; }
};

// "[rows, cols]": a tensor shape as messages print it.
inline std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline constexpr std::size_t hf_kinds = static_cast<std::size_t>(HfKind::lm_head) + 1;

class HfModel {
 public:
  explicit HfModel(const ModelSpec& m) : spec_(m) {
    per_layer_ = m.layer_tensors();
    slot_.fill(-1);
    auto add = [&](HfKind kind, std::int64_t layer, std::int64_t expert, std::int64_t rows,
                   std::int64_t cols) {
      if (layer <= 0 && expert <= 0) {
        slot_[static_cast<std::size_t>(kind)] = static_cast<std::int32_t>(size());
      }
      tensors_.push_back({kind, static_cast<std::int32_t>(layer), static_cast<std::int32_t>(expert),
                          rows, cols, total_});
      total_ += tensors_.back().numel();
    };
    const std::int64_t H = m.hidden;
    add(HfKind::embed, -1, -1, m.vocab, H);
    for (std::int64_t L = 0; L < m.layers; ++L) {
      add(HfKind::input_norm, L, -1, H, 0);
      add(HfKind::q, L, -1, m.q_rows(), H);
      add(HfKind::k, L, -1, m.kv_rows(), H);
      add(HfKind::v, L, -1, m.kv_rows(), H);
      if (m.qkv_bias()) {
        add(HfKind::q_bias, L, -1, m.q_rows(), 0);
        add(HfKind::k_bias, L, -1, m.kv_rows(), 0);
        add(HfKind::v_bias, L, -1, m.kv_rows(), 0);
      }
      if (m.qk_norm()) {
        add(HfKind::q_norm, L, -1, m.head_dim, 0);
        add(HfKind::k_norm, L, -1, m.head_dim, 0);
      }
      add(HfKind::o, L, -1, H, m.q_rows());
      add(HfKind::post_norm, L, -1, H, 0);
      if (m.moe()) {
        add(HfKind::router, L, -1, m.experts, H);
        for (std::int64_t e = 0; e < m.experts; ++e) {
          add(HfKind::expert_gate, L, e, m.moe_intermediate, H);
          add(HfKind::expert_up, L, e, m.moe_intermediate, H);
          add(HfKind::expert_down, L, e, H, m.moe_intermediate);
        }
      } else {
        add(HfKind::gate, L, -1, m.intermediate, H);
        add(HfKind::up, L, -1, m.intermediate, H);
        add(HfKind::down, L, -1, H, m.intermediate);
      }
    }
    add(HfKind::final_norm, -1, -1, H, 0);
    if (!m.tied()) add(HfKind::lm_head, -1, -1, m.vocab, H);
  }

  [[nodiscard]] const ModelSpec& spec() const noexcept { return spec_; }
  [[nodiscard]] std::int64_t size() const noexcept {
    return static_cast<std::int64_t>(tensors_.size());
  }
  [[nodiscard]] const HfTensor& operator[](std::int64_t id) const {
    return tensors_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] std::int64_t total() const noexcept { return total_; }

  // Whether the model has tensors of this kind (q/k/v biases, q/k norms, lm_head, experts...).
  [[nodiscard]] bool has(HfKind kind) const noexcept {
    return slot_[static_cast<std::size_t>(kind)] >= 0;
  }

  // O(1): the id of a tensor from its kind, layer and expert. The kind must exist (has()); for
  // tied embeddings lm_head does not, and its elements are embed's.
  [[nodiscard]] std::int64_t id(HfKind kind, std::int64_t layer = -1,
                                std::int64_t expert = -1) const noexcept {
    const std::int64_t slot = slot_[static_cast<std::size_t>(kind)];
    switch (kind) {
      case HfKind::embed:
      case HfKind::final_norm:
      case HfKind::lm_head:
        return slot;
      case HfKind::expert_gate:
      case HfKind::expert_up:
      case HfKind::expert_down:
        return slot + layer * per_layer_ + 3 * expert;
      default:
        return slot + layer * per_layer_;
    }
  }

  [[nodiscard]] std::string name(std::int64_t id) const {
    const HfTensor& t = (*this)[id];
    const std::string layer = "model.layers." + std::to_string(t.layer) + ".";
    switch (t.kind) {
      case HfKind::embed:
        return "model.embed_tokens.weight";
      case HfKind::input_norm:
        return layer + "input_layernorm.weight";
      case HfKind::q:
        return layer + "self_attn.q_proj.weight";
      case HfKind::k:
        return layer + "self_attn.k_proj.weight";
      case HfKind::v:
        return layer + "self_attn.v_proj.weight";
      case HfKind::q_bias:
        return layer + "self_attn.q_proj.bias";
      case HfKind::k_bias:
        return layer + "self_attn.k_proj.bias";
      case HfKind::v_bias:
        return layer + "self_attn.v_proj.bias";
      case HfKind::q_norm:
        return layer + "self_attn.q_norm.weight";
      case HfKind::k_norm:
        return layer + "self_attn.k_norm.weight";
      case HfKind::o:
        return layer + "self_attn.o_proj.weight";
      case HfKind::post_norm:
        return layer + "post_attention_layernorm.weight";
      case HfKind::gate:
        return layer + "mlp.gate_proj.weight";
      case HfKind::up:
        return layer + "mlp.up_proj.weight";
      case HfKind::down:
        return layer + "mlp.down_proj.weight";
      case HfKind::router:
        return layer + "mlp.gate.weight";
      case HfKind::expert_gate:
        return layer + "mlp.experts." + std::to_string(t.expert) + ".gate_proj.weight";
      case HfKind::expert_up:
        return layer + "mlp.experts." + std::to_string(t.expert) + ".up_proj.weight";
      case HfKind::expert_down:
        return layer + "mlp.experts." + std::to_string(t.expert) + ".down_proj.weight";
      case HfKind::final_norm:
        return "model.norm.weight";
      case HfKind::lm_head:
        return "lm_head.weight";
    }
    return "?";
  }

  // The id of the tensor called `name` (as name() spells it), or -1. The index of names is
  // built on the first call (once, thread-safe) and shared by copies of this model.
  [[nodiscard]] std::int64_t find(std::string_view name) const {
    std::call_once(names_->once, [&] {
      names_->sorted.reserve(tensors_.size());
      for (std::int64_t t = 0; t < size(); ++t)
        names_->sorted.emplace_back(this->name(t), t);
      std::sort(names_->sorted.begin(), names_->sorted.end());
    });
    const auto& v = names_->sorted;
    const auto it = std::lower_bound(
        v.begin(), v.end(), name,
        [](const auto& e, std::string_view n) { return std::string_view(e.first) < n; });
    return it != v.end() && it->first == name ? it->second : -1;
  }

  [[nodiscard]] std::vector<std::int64_t> shape(std::int64_t id) const {
    const HfTensor& t = (*this)[id];
    if (t.cols == 0) return {t.rows};
    return {t.rows, t.cols};
  }

 private:
  ModelSpec spec_;
  std::vector<HfTensor> tensors_;
  std::array<std::int32_t, hf_kinds> slot_{};  // id of the kind's first tensor (layer 0, expert 0)
  std::int64_t per_layer_ = 0;
  std::int64_t total_ = 0;
  struct Names {
    std::once_flag once;
    std::vector<std::pair<std::string, std::int64_t>> sorted;
  };
  std::shared_ptr<Names> names_ = std::make_shared<Names>();
};

}  // namespace dte::layout
