// SPDX-License-Identifier: Apache-2.0
// ModelSpec: the shape facts of a Qwen3 / Qwen3-MoE model that every layout map needs, from a
// HuggingFace config.json (dte/io/model_config.hpp) or a named preset.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dte/bounds.hpp"
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

  // Refuses a spec the maps cannot handle, naming the field, its value and the allowed range
  // (dte/bounds.hpp): every field bounded, every size derived from them checked.
  void validate() const {
    auto fail = [&](const std::string& what) {
      throw invalid_argument("model '" + name + "': " + what, about(name));
    };
    if (architecture != "Qwen3ForCausalLM" && architecture != "Qwen3MoeForCausalLM") {
      fail("unknown architecture '" + architecture +
           "'; dte maps Qwen3ForCausalLM and Qwen3MoeForCausalLM");
    }
    const bool moe_arch = architecture == "Qwen3MoeForCausalLM";
    const std::string src = "model '" + name + "'";
    require_range(src, "hidden_size", hidden, 1, limits::hidden);
    require_range(src, "num_hidden_layers", layers, 1, limits::layers);
    require_range(src, "num_attention_heads", heads, 1, limits::heads);
    require_range(src, "num_key_value_heads", kv_heads, 1, heads,
                  "a KV head serves one or more query heads");
    require_range(src, "head_dim", head_dim, 1, limits::head_dim);
    require_range(src, "vocab_size", vocab, 1, limits::vocab);
    if (heads % kv_heads != 0) {
      fail("num_attention_heads (" + std::to_string(heads) +
           ") must be a multiple of num_key_value_heads (" + std::to_string(kv_heads) + ")");
    }
    if (moe_arch) {
      require_range(src, "num_experts", experts, 1, limits::experts);
      require_range(src, "moe_intermediate_size", moe_intermediate, 1, limits::intermediate);
      require_range(src, "num_experts_per_tok", experts_per_token, 1, experts,
                    "a token is routed to at least one and at most num_experts experts");
      require_range(src, "intermediate_size", intermediate, 0, limits::intermediate);
    } else {
      require_range(src, "intermediate_size", intermediate, 1, limits::intermediate);
      require_range(src, "num_experts", experts, 0, 0, "a dense model has no experts");
    }
    // Every tensor must be addressable by 32-bit indices, the whole model by canonical indices
    // below limits::model_elements, and the tensor count must stay plannable. The fields are
    // bounded above, so these products cannot overflow; they are checked anyway.
    const std::int64_t ffn = moe_arch ? moe_intermediate : intermediate;
    const std::pair<const char*, std::int64_t> matrices[] = {
        {"embed_tokens (vocab_size * hidden_size)",
         checked_mul(vocab, hidden, "vocab_size * hidden_size")},
        {"q_proj (num_attention_heads * head_dim * hidden_size)",
         checked_mul(checked_mul(heads, head_dim, "q rows"), hidden, "q_proj elements")},
        {"mlp (intermediate * hidden_size)", checked_mul(ffn, hidden, "mlp elements")},
        {"router (num_experts * hidden_size)", checked_mul(experts, hidden, "router elements")}};
    for (const auto& [what, n] : matrices) {
      if (n > limits::tensor_elements) {
        fail(std::string(what) + " has " + std::to_string(n) +
             " elements; dte addresses at most 2^32 - 1 elements per tensor");
      }
    }
    const std::int64_t attn =
        2 * hidden + 2 * head_dim +
        checked_mul(checked_mul(heads + 2 * kv_heads, head_dim, "qkv rows"), hidden, "qkv") +
        checked_mul(checked_mul(heads, head_dim, "o cols"), hidden, "o_proj");
    const std::int64_t mlp =
        moe_arch ? checked_add(checked_mul(experts, hidden, "router"),
                               checked_mul(checked_mul(experts, 3, "expert matrices"),
                                           checked_mul(ffn, hidden, "expert"), "experts"),
                               "moe layer")
                 : checked_mul(3, checked_mul(ffn, hidden, "mlp"), "mlp layer");
    const std::int64_t layer = checked_add(attn, mlp, "layer elements");
    const std::int64_t total =
        checked_add(checked_mul(layer, layers, "layer elements * num_hidden_layers"),
                    checked_add(checked_mul(2 * vocab, hidden, "embeddings"), hidden, "embeddings"),
                    "model elements");
    if (total > limits::model_elements) {
      fail("the model has " + std::to_string(total) + " parameters; dte's limit is 2^44 (" +
           std::to_string(limits::model_elements) + ")");
    }
    const std::int64_t per_layer_tensors = moe_arch ? 9 + 3 * experts : 11;
    const std::int64_t tensors =
        checked_add(checked_mul(per_layer_tensors, layers, "tensors"), 3, "tensors");
    if (tensors > limits::model_tensors) {
      fail("the model has " + std::to_string(tensors) + " tensors (num_hidden_layers " +
           std::to_string(layers) + (moe_arch ? " x (9 + 3 x num_experts " : " x (11") +
           (moe_arch ? std::to_string(experts) : std::string()) + ")); dte's limit is " +
           std::to_string(limits::model_tensors));
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
