// SPDX-License-Identifier: Apache-2.0
// ModelSpec from a HuggingFace config.json (Qwen3ForCausalLM, Qwen3MoeForCausalLM,
// Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM), or from a preset name. Every field the
// maps depend on must be present: a missing or mistyped field is refused with its name rather
// than defaulted, because a wrong default silently misroutes. The two exceptions are HF's own
// semantics, not dte's guesses: `head_dim` absent (or null) for Qwen2/Llama/Mistral is
// hidden_size / num_attention_heads, as their modeling code derives it, and
// `tie_word_embeddings` absent is false, every supported config class's default. A field that
// would change a layout in a way dte does not map (an o_proj or MLP bias, dense layers in an MoE
// model, ...) is refused by name; everything else (rope, sliding window, dtype, token ids) does
// not move an element: the fields among them that change the forward are kept, normalised, as
// ModelSpec::forward (io/forward_config.hpp), for receivers to compare with a publication's. Every
// integer is read as an integer within the limits of dte/bounds.hpp; duplicate keys are refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/error.hpp"
#include "dte/io/forward_config.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/model.hpp"

namespace dte::io {

inline layout::ModelSpec model_from_config_json(const nlohmann::json& j,
                                                const std::string& source) {
  using layout::Family;
  const JsonReader r(source);
  auto fail = [&](const std::string& what) -> void {
    throw format_error(source + ": " + what, about(source));
  };
  if (!j.is_object()) fail("not a JSON object");
  auto integer = [&](const char* field, std::int64_t hi) -> std::int64_t {
    const auto it = j.find(field);
    if (it == j.end()) {
      r.fail(field, "is missing; dte needs it to map the layout");
    }
    return r.integer(*it, field, 1, hi);
  };
  auto present = [&](const char* field) {
    const auto it = j.find(field);
    return it != j.end() && !it->is_null();
  };
  auto flag = [&](const char* field) {
    const auto it = j.find(field);
    return it != j.end() && !it->is_null() && r.boolean(*it, field);
  };
  layout::ModelSpec m;
  m.name = source;
  const auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    fail("field 'architectures' is missing or not a list of names");
  }
  m.architecture = (*arch)[0].get<std::string>();
  const std::optional<Family> family = layout::family_of(m.architecture);
  if (!family) {
    fail("unknown architecture " + detail::quote_name(m.architecture) + "; dte maps " +
         std::string(layout::supported_architectures));
  }
  m.hidden = integer("hidden_size", limits::hidden);
  m.layers = integer("num_hidden_layers", limits::layers);
  m.heads = integer("num_attention_heads", limits::heads);
  m.kv_heads = integer("num_key_value_heads", limits::heads);
  m.vocab = integer("vocab_size", limits::vocab);
  if (*family == Family::qwen3 || *family == Family::qwen3_moe) {
    // Qwen3's head_dim is its own field (128 in the real models, != hidden / heads for some).
    m.head_dim = integer("head_dim", limits::head_dim);
  } else if (present("head_dim")) {
    m.head_dim = integer("head_dim", limits::head_dim);
  } else {
    if (m.hidden % m.heads != 0) {
      fail("field 'head_dim' is absent and hidden_size (" + std::to_string(m.hidden) +
           ") is not a multiple of num_attention_heads (" + std::to_string(m.heads) +
           "); give head_dim");
    }
    m.head_dim = m.hidden / m.heads;
  }
  if (*family == Family::qwen3_moe) {
    // transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute map
    // keeps num_experts as the Python name); Qwen's own config.json files say num_experts.
    m.experts =
        integer(!present("num_experts") && present("num_local_experts") ? "num_local_experts"
                                                                        : "num_experts",
                limits::experts);
    m.moe_intermediate = integer("moe_intermediate_size", limits::intermediate);
    m.experts_per_token = integer("num_experts_per_tok", m.experts);
    if (j.contains("intermediate_size")) {
      m.intermediate = integer("intermediate_size", limits::intermediate);
    }
    if (const auto it = j.find("mlp_only_layers");
        it != j.end() && !(it->is_array() && it->empty())) {
      fail("field 'mlp_only_layers' lists dense layers inside an MoE model; not supported yet");
    }
    if (j.contains("decoder_sparse_step") && integer("decoder_sparse_step", limits::layers) != 1) {
      fail("field 'decoder_sparse_step' is not 1 (some layers dense); not supported yet");
    }
  } else {
    m.intermediate = integer("intermediate_size", limits::intermediate);
  }
  // Biases. Qwen2 has q/k/v biases whatever the config says (its modeling code hard-codes
  // them); for the others attention_bias would add them to o_proj as well, and mlp_bias to the
  // MLP: layouts dte does not map.
  if (*family == Family::qwen2) {
    if (const auto it = j.find("attention_bias");
        it != j.end() && !it->is_null() && !r.boolean(*it, "attention_bias")) {
      fail(
          "field 'attention_bias' is false, but Qwen2ForCausalLM always has q/k/v biases "
          "(transformers and SGLang ignore the field); remove it or set it to true");
    }
  } else if (flag("attention_bias")) {
    fail("field 'attention_bias' is true: " + m.architecture +
         " would then have q/k/v and o_proj biases; dte maps biases only as Qwen2 has them "
         "(q/k/v, no o_proj bias)");
  }
  for (const char* field : {"mlp_bias", "bias"}) {
    if (flag(field)) {
      fail("field '" + std::string(field) + "' is true: biases on the " +
           (std::string(field) == "mlp_bias" ? "MLP" : "attention projections") +
           " are not supported");
    }
  }
  if (present("original_num_attention_heads")) {
    fail(
        "field 'original_num_attention_heads' is set (SGLang then derives head_dim from it); not "
        "supported");
  }
  if (const auto it = j.find("tie_word_embeddings"); it != j.end()) {
    m.tie_word_embeddings = r.boolean(*it, "tie_word_embeddings");
  }
  m.validate();
  m.forward = forward_fields(j, *family, m.layers, source);
  return m;
}

// The config.json fields dte reads, for `m` (model_from_config_json of it gives m back, but for
// the name): what a publication carries so that a receiver can learn the model from it.
inline nlohmann::ordered_json config_json(const layout::ModelSpec& m) {
  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::ordered_json::array({m.architecture});
  j["hidden_size"] = m.hidden;
  j["num_hidden_layers"] = m.layers;
  j["num_attention_heads"] = m.heads;
  j["num_key_value_heads"] = m.kv_heads;
  j["head_dim"] = m.head_dim;
  if (m.moe()) {
    j["num_experts"] = m.experts;
    j["moe_intermediate_size"] = m.moe_intermediate;
    j["num_experts_per_tok"] = m.experts_per_token;
  }
  if (!m.moe() || m.intermediate > 0) j["intermediate_size"] = m.intermediate;
  j["vocab_size"] = m.vocab;
  j["tie_word_embeddings"] = m.tie_word_embeddings;
  return j;
}

// config.json files are a few kilobytes; 16 MiB leaves room for any tokenizer-sized extras.
inline constexpr std::uintmax_t max_config_bytes = std::uintmax_t{16} << 20;

inline layout::ModelSpec model_from_config_file(const std::filesystem::path& path) {
  return model_from_config_json(read_json_file(path, "model config", 64, max_config_bytes),
                                path.string());
}

// `--model` as the dte command takes it: a preset name, or a path to a config.json.
inline layout::ModelSpec load_model(std::string_view preset_or_path) {
  for (const std::string& p : layout::model_preset_names()) {
    if (p == preset_or_path) {
      layout::ModelSpec m = layout::model_preset(p);
      m.validate();
      return m;
    }
  }
  if (std::filesystem::exists(preset_or_path)) return model_from_config_file(preset_or_path);
  return layout::model_preset(preset_or_path);  // throws the "unknown preset" message
}

}  // namespace dte::io
