// SPDX-License-Identifier: Apache-2.0
// ModelSpec: the shape facts of a decoder model (Qwen3, Qwen3-MoE, Qwen2/Qwen2.5, Llama/Mistral)
// that every layout map needs, from a HuggingFace config.json (dte/io/model_config.hpp) or a
// named preset.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dte/bounds.hpp"
#include "dte/error.hpp"

namespace dte::layout {

// The decoder families dte maps. They share one structure (embedding, L x [norm, attention,
// norm, MLP or MoE], final norm, LM head) and differ only in what changes a layout: q/k norms
// (Qwen3), q/k/v biases (Qwen2), experts (Qwen3-MoE) and tied embeddings (any dense family).
enum class Family : std::uint8_t { qwen3, qwen3_moe, qwen2, llama };

// The family of a HuggingFace `architectures[0]`; nullopt if dte does not map it. Mistral is
// Llama's structure (no biases, no q/k norm, optional head_dim).
inline std::optional<Family> family_of(std::string_view architecture) noexcept {
  if (architecture == "Qwen3ForCausalLM") return Family::qwen3;
  if (architecture == "Qwen3MoeForCausalLM") return Family::qwen3_moe;
  if (architecture == "Qwen2ForCausalLM") return Family::qwen2;
  if (architecture == "LlamaForCausalLM" || architecture == "MistralForCausalLM") {
    return Family::llama;
  }
  return std::nullopt;
}

inline constexpr std::string_view supported_architectures =
    "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM and "
    "MistralForCausalLM";

// A config's forward-relevant fields, normalised (io/forward_config.hpp): field -> JSON text.
using ForwardFields = std::map<std::string, std::string>;

struct ModelSpec {
  std::string name;                   // preset name or config path, for messages
  std::string architecture;           // HF architectures[0]; see family_of
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
  // lm_head is embed_tokens: one HF tensor, one SGLang tensor, and on the Megatron side the
  // embedding (plus, with pp > 1, a copy as the last stage's output layer that never sends).
  bool tie_word_embeddings = false;
  // The forward-relevant fields of the config.json this spec was read from (nullopt for a
  // preset: not known). They move no element; receivers compare them with a publication's.
  std::optional<ForwardFields> forward;

  [[nodiscard]] Family family() const {
    const std::optional<Family> f = family_of(architecture);
    if (!f) {
      throw invalid_argument("model '" + name + "': unknown architecture '" + architecture +
                                 "'; dte maps " + std::string(supported_architectures),
                             about(name));
    }
    return *f;
  }
  [[nodiscard]] bool moe() const noexcept { return experts > 0; }
  // Qwen3 and Qwen3-MoE normalise q and k per head (q_norm/k_norm, Megatron's qk_layernorm).
  [[nodiscard]] bool qk_norm() const {
    const Family f = family();
    return f == Family::qwen3 || f == Family::qwen3_moe;
  }
  // Qwen2 has q/k/v biases (o_proj, the MLP and the norms have none): Megatron's add_qkv_bias.
  [[nodiscard]] bool qkv_bias() const { return family() == Family::qwen2; }
  [[nodiscard]] bool tied() const noexcept { return tie_word_embeddings; }
  [[nodiscard]] std::int64_t q_rows() const noexcept { return heads * head_dim; }
  [[nodiscard]] std::int64_t kv_rows() const noexcept { return kv_heads * head_dim; }
  [[nodiscard]] std::int64_t heads_per_group() const noexcept { return heads / kv_heads; }
  // HF tensors per decoder layer: 2 norms, q/k/v/o, q/k norms, q/k/v biases, and the MLP (3) or
  // the router and 3 per expert.
  [[nodiscard]] std::int64_t layer_tensors() const {
    return 6 + (qk_norm() ? 2 : 0) + (qkv_bias() ? 3 : 0) + (moe() ? 1 + 3 * experts : 3);
  }

  // The structure that decides the layouts, in one line (dte plan prints it).
  [[nodiscard]] std::string structure() const {
    std::string s = architecture + ": " + std::to_string(layers) + " layers, hidden " +
                    std::to_string(hidden) + ", " + std::to_string(heads) + " q / " +
                    std::to_string(kv_heads) + " KV heads x head_dim " + std::to_string(head_dim);
    if (moe()) {
      s += ", " + std::to_string(experts) + " experts x moe_intermediate " +
           std::to_string(moe_intermediate);
    } else {
      s += ", intermediate " + std::to_string(intermediate);
    }
    s += ", vocab " + std::to_string(vocab) + "; ";
    s += qkv_bias() ? "q/k/v biases" : "no biases";
    s += qk_norm() ? ", q/k norm" : ", no q/k norm";
    s += tied() ? ", tied embeddings" : ", untied embeddings";
    return s;
  }

  // Refuses a spec the maps cannot handle, naming the field, its value and the allowed range
  // (dte/bounds.hpp): every field bounded, every size derived from them checked.
  void validate() const {
    auto fail = [&](const std::string& what) {
      throw invalid_argument("model '" + name + "': " + what, about(name));
    };
    const Family family = this->family();
    const bool moe_arch = family == Family::qwen3_moe;
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
      if (tie_word_embeddings) {
        fail("tie_word_embeddings=true with " + architecture +
             " is not supported: SGLang's Qwen3-MoE model always builds its own lm_head, so a "
             "tied checkpoint would leave it unloaded");
      }
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
    const std::int64_t qkv_rows = checked_mul(heads + 2 * kv_heads, head_dim, "qkv rows");
    const std::int64_t attn = 2 * hidden + (qk_norm() ? 2 * head_dim : 0) +
                              (qkv_bias() ? qkv_rows : 0) + checked_mul(qkv_rows, hidden, "qkv") +
                              checked_mul(checked_mul(heads, head_dim, "o cols"), hidden, "o_proj");
    const std::int64_t mlp =
        moe_arch ? checked_add(checked_mul(experts, hidden, "router"),
                               checked_mul(checked_mul(experts, 3, "expert matrices"),
                                           checked_mul(ffn, hidden, "expert"), "experts"),
                               "moe layer")
                 : checked_mul(3, checked_mul(ffn, hidden, "mlp"), "mlp layer");
    const std::int64_t layer = checked_add(attn, mlp, "layer elements");
    const std::int64_t embeddings = checked_mul(tied() ? vocab : 2 * vocab, hidden, "embeddings");
    const std::int64_t total =
        checked_add(checked_mul(layer, layers, "layer elements * num_hidden_layers"),
                    checked_add(embeddings, hidden, "embeddings"), "model elements");
    if (total > limits::model_elements) {
      fail("the model has " + std::to_string(total) + " parameters; dte's limit is 2^44 (" +
           std::to_string(limits::model_elements) + ")");
    }
    const std::int64_t tensors =
        checked_add(checked_mul(layer_tensors(), layers, "tensors"), tied() ? 2 : 3, "tensors");
    if (tensors > limits::model_tensors) {
      fail("the model has " + std::to_string(tensors) + " tensors (num_hidden_layers " +
           std::to_string(layers) + " x " + std::to_string(layer_tensors()) +
           " per layer); dte's limit is " + std::to_string(limits::model_tensors));
    }
  }
};

// The preset names model_preset() accepts.
inline std::vector<std::string> model_preset_names() {
  return {"qwen3-8b",        "qwen3-0.6b",    "qwen3-4b",    "qwen2.5-7b",
          "llama-3.1-8b",    "qwen3-30b-a3b", "small-qwen3", "tiny-qwen3",
          "tiny-qwen3-tied", "tiny-qwen2",    "tiny-llama",  "tiny-qwen3-moe"};
}

// Named presets: real shapes of the models RL runs start from (the published config.json
// values; tests/layout/configs/ holds those files), and tiny models that keep every structural
// trap (several query heads per KV group, head_dim != hidden/heads, a vocabulary Megatron must
// pad, fewer KV heads than the largest TP tested, experts, tied embeddings, q/k/v biases, no q/k
// norm, head_dim derived from hidden/heads).
inline ModelSpec model_preset(std::string_view name) {
  ModelSpec m;
  m.name = std::string(name);
  auto dense = [&](const char* arch, std::int64_t hidden, std::int64_t layers, std::int64_t heads,
                   std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate,
                   std::int64_t vocab, bool tied) {
    m.architecture = arch;
    m.hidden = hidden, m.layers = layers, m.heads = heads, m.kv_heads = kv_heads;
    m.head_dim = head_dim, m.intermediate = intermediate, m.vocab = vocab;
    m.tie_word_embeddings = tied;
  };
  if (name == "qwen3-8b") {
    dense("Qwen3ForCausalLM", 4096, 36, 32, 8, 128, 12288, 151936, false);
  } else if (name == "qwen3-0.6b") {
    dense("Qwen3ForCausalLM", 1024, 28, 16, 8, 128, 3072, 151936, true);
  } else if (name == "qwen3-4b") {
    dense("Qwen3ForCausalLM", 2560, 36, 32, 8, 128, 9728, 151936, true);
  } else if (name == "qwen2.5-7b") {
    dense("Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064, false);
  } else if (name == "llama-3.1-8b") {
    dense("LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256, false);
  } else if (name == "qwen3-30b-a3b") {
    m.architecture = "Qwen3MoeForCausalLM";
    m.hidden = 2048, m.layers = 48, m.heads = 32, m.kv_heads = 4, m.head_dim = 128;
    m.intermediate = 6144, m.moe_intermediate = 768, m.experts = 128, m.experts_per_token = 8;
    m.vocab = 151936;
  } else if (name == "tiny-qwen3") {
    dense("Qwen3ForCausalLM", 32, 4, 8, 2, 16, 48, 300, false);
  } else if (name == "tiny-qwen3-tied") {
    dense("Qwen3ForCausalLM", 32, 4, 8, 2, 16, 48, 300, true);
  } else if (name == "tiny-qwen2") {
    // Qwen2.5-7B's traps: q/k/v biases, no q/k norm, head_dim = hidden / heads, untied.
    dense("Qwen2ForCausalLM", 64, 4, 8, 2, 8, 96, 300, false);
  } else if (name == "tiny-llama") {
    // Llama-3.2-1B's traps: tied, no q/k norm, no biases, head_dim = hidden / heads.
    dense("LlamaForCausalLM", 64, 4, 8, 2, 8, 96, 300, true);
  } else if (name == "tiny-qwen3-moe") {
    m.architecture = "Qwen3MoeForCausalLM";
    m.hidden = 32, m.layers = 4, m.heads = 8, m.kv_heads = 2, m.head_dim = 16;
    m.intermediate = 48, m.moe_intermediate = 16, m.experts = 8, m.experts_per_token = 2;
    m.vocab = 300;
  } else if (name == "small-qwen3") {
    // The demo model: Qwen3's structure at ~6M parameters (head_dim 64 != 256/8).
    dense("Qwen3ForCausalLM", 256, 4, 8, 2, 64, 768, 8000, false);
  } else {
    std::string names;
    for (const std::string& n : model_preset_names())
      names += (names.empty() ? "" : ", ") + n;
    throw invalid_argument("unknown model preset '" + std::string(name) + "'; presets: " + names +
                           ", or pass a HuggingFace config.json path");
  }
  return m;
}

}  // namespace dte::layout
