// SPDX-License-Identifier: Apache-2.0
// ModelSpec from a HuggingFace config.json (Qwen3ForCausalLM, Qwen3MoeForCausalLM), or from a
// preset name. Every field the maps depend on must be present: a missing or mistyped field is
// refused with its name rather than defaulted, because a wrong default silently misroutes. Every
// integer is read as an integer within the limits of dte/bounds.hpp; duplicate keys are refused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/error.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/model.hpp"

namespace dte::io {

inline layout::ModelSpec model_from_config_json(const nlohmann::json& j,
                                                const std::string& source) {
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
  layout::ModelSpec m;
  m.name = source;
  const auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    fail("field 'architectures' is missing or not a list of names");
  }
  m.architecture = (*arch)[0].get<std::string>();
  if (m.architecture != "Qwen3ForCausalLM" && m.architecture != "Qwen3MoeForCausalLM") {
    fail("unknown architecture " + detail::quote_name(m.architecture) +
         "; dte maps Qwen3ForCausalLM and Qwen3MoeForCausalLM");
  }
  m.hidden = integer("hidden_size", limits::hidden);
  m.layers = integer("num_hidden_layers", limits::layers);
  m.heads = integer("num_attention_heads", limits::heads);
  m.kv_heads = integer("num_key_value_heads", limits::heads);
  m.head_dim = integer("head_dim", limits::head_dim);
  m.vocab = integer("vocab_size", limits::vocab);
  if (m.architecture == "Qwen3MoeForCausalLM") {
    m.experts = integer("num_experts", limits::experts);
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
  if (const auto it = j.find("tie_word_embeddings"); it != j.end()) {
    m.tie_word_embeddings = r.boolean(*it, "tie_word_embeddings");
  }
  m.validate();
  return m;
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
