// SPDX-License-Identifier: Apache-2.0
// ModelSpec from a HuggingFace config.json (Qwen3ForCausalLM, Qwen3MoeForCausalLM), or from a
// preset name. Every field the maps depend on must be present: a missing or mistyped field is
// refused with its name rather than defaulted, because a wrong default silently misroutes.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dte/error.hpp"
#include "dte/layout/model.hpp"

namespace dte::io {

inline layout::ModelSpec model_from_config_json(const nlohmann::json& j,
                                                const std::string& source) {
  auto fail = [&](const std::string& what) -> void {
    throw invalid_argument(source + ": " + what);
  };
  if (!j.is_object()) fail("not a JSON object");
  auto integer = [&](const char* field) -> std::int64_t {
    const auto it = j.find(field);
    if (it == j.end()) {
      fail(std::string("field '") + field + "' is missing; dte needs it to map the layout");
    }
    if (!it->is_number_integer()) fail(std::string("field '") + field + "' is not an integer");
    return it->get<std::int64_t>();
  };
  layout::ModelSpec m;
  m.name = source;
  const auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    fail("field 'architectures' is missing or not a list of names");
  }
  m.architecture = (*arch)[0].get<std::string>();
  if (m.architecture != "Qwen3ForCausalLM" && m.architecture != "Qwen3MoeForCausalLM") {
    fail("unknown architecture '" + m.architecture +
         "'; dte maps Qwen3ForCausalLM and Qwen3MoeForCausalLM");
  }
  m.hidden = integer("hidden_size");
  m.layers = integer("num_hidden_layers");
  m.heads = integer("num_attention_heads");
  m.kv_heads = integer("num_key_value_heads");
  m.head_dim = integer("head_dim");
  m.vocab = integer("vocab_size");
  if (m.architecture == "Qwen3MoeForCausalLM") {
    m.experts = integer("num_experts");
    m.moe_intermediate = integer("moe_intermediate_size");
    m.experts_per_token = integer("num_experts_per_tok");
    if (j.contains("intermediate_size")) m.intermediate = integer("intermediate_size");
    if (const auto it = j.find("mlp_only_layers");
        it != j.end() && !(it->is_array() && it->empty())) {
      fail("field 'mlp_only_layers' lists dense layers inside an MoE model; not supported yet");
    }
    if (j.contains("decoder_sparse_step") && integer("decoder_sparse_step") != 1) {
      fail("field 'decoder_sparse_step' is not 1 (some layers dense); not supported yet");
    }
  } else {
    m.intermediate = integer("intermediate_size");
  }
  if (const auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) fail("field 'tie_word_embeddings' is not true/false");
    m.tie_word_embeddings = it->get<bool>();
  }
  m.validate();
  return m;
}

inline layout::ModelSpec model_from_config_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw io_error("cannot open model config '" + path.string() + "'");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    throw format_error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  return model_from_config_json(j, path.string());
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
