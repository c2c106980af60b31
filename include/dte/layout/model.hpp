// SPDX-License-Identifier: Apache-2.0
// ModelSpec: the shape facts of a Qwen3 / Qwen3-MoE model that every layout map needs, from a
// HuggingFace config.json (dte/io/model_config.hpp) or a named preset.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dte/error.hpp"

namespace dte::layout {

struct ModelSpec {
  std::string name;                   // preset name or config path, for messages
  std::string architecture;           // Qwen3ForCausalLM | Qwen3MoeForCausalLM
  std::int64_t hidden = 0;            // H
  std::int64_t layers = 0;            // L
  std::int64_t heads = 0;             // nq
  std::int64_t kv_heads = 0;          // ng
  std::int64_t head_dim = 0;          // d (not H / nq in general)
  std::int64_t intermediate = 0;      // F (dense MLP)
  std::int64_t moe_intermediate = 0;  // Fm
  std::int64_t experts = 0;           // E (0: dense)
  std::int64_t experts_per_token = 0;
  std::int64_t vocab = 0;  // V
  bool tie_word_embeddings = false;

  [[nodiscard]] bool moe() const noexcept { return experts > 0; }
  [[nodiscard]] std::int64_t q_rows() const noexcept { return heads * head_dim; }
  [[nodiscard]] std::int64_t kv_rows() const noexcept { return kv_heads * head_dim; }
  [[nodiscard]] std::int64_t heads_per_group() const noexcept { return heads / kv_heads; }

  // Refuses a spec the maps cannot handle, naming the field and its value.
  void validate() const {
    auto fail = [&](const std::string& what) {
      throw invalid_argument("model '" + name + "': " + what);
    };
    if (architecture != "Qwen3ForCausalLM" && architecture != "Qwen3MoeForCausalLM") {
      fail("unknown architecture '" + architecture +
           "'; dte maps Qwen3ForCausalLM and Qwen3MoeForCausalLM");
    }
    const std::pair<const char*, std::int64_t> positive[] = {
        {"hidden_size", hidden},        {"num_hidden_layers", layers},
        {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads},
        {"head_dim", head_dim},         {"vocab_size", vocab}};
    for (const auto& [field, value] : positive) {
      if (value <= 0) fail(std::string(field) + " must be > 0 (got " + std::to_string(value) + ")");
    }
    if (heads % kv_heads != 0) {
      fail("num_attention_heads (" + std::to_string(heads) +
           ") must be a multiple of num_key_value_heads (" + std::to_string(kv_heads) + ")");
    }
    if (architecture == "Qwen3MoeForCausalLM") {
      if (experts <= 0) fail("num_experts must be > 0 for Qwen3MoeForCausalLM");
      if (moe_intermediate <= 0) fail("moe_intermediate_size must be > 0 for Qwen3MoeForCausalLM");
    } else if (intermediate <= 0) {
      fail("intermediate_size must be > 0 (got " + std::to_string(intermediate) + ")");
    }
    if (tie_word_embeddings) {
      fail("tie_word_embeddings=true is not supported yet: lm_head would alias embed_tokens");
    }
  }
};

// Named presets: the real Qwen3 shapes, and tiny models that keep every structural trap
// (several query heads per KV group, head_dim != hidden/heads, a vocabulary Megatron must pad,
// fewer KV heads than the largest TP tested, experts).
inline ModelSpec model_preset(std::string_view name) {
  ModelSpec m;
  m.name = std::string(name);
  if (name == "qwen3-8b") {
    m.architecture = "Qwen3ForCausalLM";
    m.hidden = 4096, m.layers = 36, m.heads = 32, m.kv_heads = 8, m.head_dim = 128;
    m.intermediate = 12288, m.vocab = 151936;
  } else if (name == "qwen3-30b-a3b") {
    m.architecture = "Qwen3MoeForCausalLM";
    m.hidden = 2048, m.layers = 48, m.heads = 32, m.kv_heads = 4, m.head_dim = 128;
    m.intermediate = 6144, m.moe_intermediate = 768, m.experts = 128, m.experts_per_token = 8;
    m.vocab = 151936;
  } else if (name == "tiny-qwen3") {
    m.architecture = "Qwen3ForCausalLM";
    m.hidden = 32, m.layers = 4, m.heads = 8, m.kv_heads = 2, m.head_dim = 16;
    m.intermediate = 48, m.vocab = 300;
  } else if (name == "tiny-qwen3-moe") {
    m.architecture = "Qwen3MoeForCausalLM";
    m.hidden = 32, m.layers = 4, m.heads = 8, m.kv_heads = 2, m.head_dim = 16;
    m.intermediate = 48, m.moe_intermediate = 16, m.experts = 8, m.experts_per_token = 2;
    m.vocab = 300;
  } else if (name == "small-qwen3") {
    // The demo model: Qwen3's structure at ~6M parameters (head_dim 64 != 256/8).
    m.architecture = "Qwen3ForCausalLM";
    m.hidden = 256, m.layers = 4, m.heads = 8, m.kv_heads = 2, m.head_dim = 64;
    m.intermediate = 768, m.vocab = 8000;
  } else {
    throw invalid_argument("unknown model preset '" + std::string(name) +
                           "'; presets: qwen3-8b, qwen3-30b-a3b, small-qwen3, tiny-qwen3, "
                           "tiny-qwen3-moe, or pass a HuggingFace config.json path");
  }
  return m;
}

inline std::vector<std::string> model_preset_names() {
  return {"qwen3-8b", "qwen3-30b-a3b", "small-qwen3", "tiny-qwen3", "tiny-qwen3-moe"};
}

}  // namespace dte::layout
