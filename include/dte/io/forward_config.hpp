// SPDX-License-Identifier: Apache-2.0
// The forward-relevant fields of a config.json (docs/python.md, "Config drift"): what changes
// the function a model computes from its weights without moving any weight. Two sides whose
// structures agree (ModelSpec::structure()) place every element alike, yet an engine whose
// rope_theta or rms_norm_eps differs from the trainer's samples from a policy the trainer never
// had. So a publication carries its model's forward fields, and a receiver bound to a config
// refuses a publication whose fields differ, naming the field and both values.
//
// Every top-level field of a config.json is one of three kinds:
//   - compared, normalised (absent = the default HF's config classes give it, so a config.json
//     and a transformers config's to_dict() of the same model agree):
//       rope_theta, rope_scaling (both also read from transformers 5's rope_parameters; 'type'
//       read as 'rope_type'; a "default" rope is none), partial_rotary_factor, rms_norm_eps,
//       hidden_act, attention (the layers' attention kinds and the window, from
//       use_sliding_window / sliding_window / max_window_layers / layer_types),
//       max_position_embeddings, num_experts_per_tok and norm_topk_prob (MoE routing);
//   - not compared, each for a reason (ignored_fields below): the structure (compared as the
//     manifest's model already), token ids and generation defaults (the engine's sampling, not
//     the forward), training-only settings, bookkeeping, the dtype (the parameters' own dtype is
//     checked where they are bound);
//   - any other field: dte does not know it, so it is compared as it is (its JSON value, absent
//     on one side differing from present), not ignored.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/error.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/model.hpp"

namespace dte::io {

// Field -> its normalised JSON text (layout::ModelSpec::forward holds them).
using ForwardFields = layout::ForwardFields;

// The config.json fields that do not change the forward, and why (docs/python.md lists them).
inline constexpr auto structure_fields = std::to_array<std::string_view>(
    {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
     "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
     "num_local_experts", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias",
     "decoder_sparse_step"});
inline constexpr auto layer_fields =
    std::to_array<std::string_view>({"mlp_only_layers", "qkv_bias", "bias"});
// Token ids and the generation defaults transformers' PretrainedConfig writes (transformers 4
// writes them all into to_dict()): what the engine samples and when it stops, not the forward.
inline constexpr auto generation_fields =
    std::to_array<std::string_view>({"bos_token_id",
                                     "eos_token_id",
                                     "pad_token_id",
                                     "sep_token_id",
                                     "decoder_start_token_id",
                                     "forced_bos_token_id",
                                     "forced_eos_token_id",
                                     "max_length",
                                     "min_length",
                                     "do_sample",
                                     "early_stopping",
                                     "num_beams",
                                     "num_beam_groups",
                                     "diversity_penalty",
                                     "temperature",
                                     "top_k",
                                     "top_p",
                                     "typical_p",
                                     "repetition_penalty",
                                     "length_penalty",
                                     "no_repeat_ngram_size",
                                     "encoder_no_repeat_ngram_size",
                                     "bad_words_ids",
                                     "num_return_sequences",
                                     "output_scores",
                                     "return_dict_in_generate",
                                     "remove_invalid_values",
                                     "exponential_decay_length_penalty",
                                     "suppress_tokens",
                                     "begin_suppress_tokens",
                                     "use_cache",
                                     "tokenizer_class",
                                     "prefix",
                                     "task_specific_params",
                                     "generation_config"});
// Training-only settings (no effect at inference), bookkeeping and output options of
// transformers' own classes, the dtype, and serving choices dte checks on the parameters.
inline constexpr auto bookkeeping_fields =
    std::to_array<std::string_view>({"_name_or_path",
                                     "transformers_version",
                                     "torch_dtype",
                                     "dtype",
                                     "auto_map",
                                     "quantization_config",
                                     "initializer_range",
                                     "attention_dropout",
                                     "router_aux_loss_coef",
                                     "output_router_logits",
                                     "router_jitter_noise",
                                     "pretraining_tp",
                                     "return_dict",
                                     "output_hidden_states",
                                     "output_attentions",
                                     "torchscript",
                                     "use_bfloat16",
                                     "tf_legacy_loss",
                                     "pruned_heads",
                                     "chunk_size_feed_forward",
                                     "is_encoder_decoder",
                                     "is_decoder",
                                     "cross_attention_hidden_size",
                                     "add_cross_attention",
                                     "tie_encoder_decoder",
                                     "finetuning_task",
                                     "id2label",
                                     "label2id",
                                     "problem_type",
                                     "_attn_implementation",
                                     "_attn_implementation_autoset",
                                     "_commit_hash",
                                     "_attn_implementation_internal",
                                     "attn_implementation",
                                     "_experts_implementation",
                                     "embedding_dropout",
                                     "resid_pdrop",
                                     "output_attentions_implementation"});
// Read by the normalised fields below.
inline constexpr auto normalised_sources = std::to_array<std::string_view>(
    {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rms_norm_eps",
     "hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
     "max_position_embeddings", "num_experts_per_tok", "norm_topk_prob"});

namespace detail {

template <std::size_t N>
bool listed(const std::array<std::string_view, N>& list, std::string_view key) {
  return std::find(list.begin(), list.end(), key) != list.end();
}

inline bool known_field(std::string_view key) {
  return listed(structure_fields, key) || listed(layer_fields, key) ||
         listed(generation_fields, key) || listed(bookkeeping_fields, key) ||
         listed(normalised_sources, key);
}

// Numbers as doubles (1000000 and 1e6 are one rope_theta), objects with sorted keys.
inline nlohmann::json numbers_as_doubles(const nlohmann::json& v) {
  if (v.is_number()) return nlohmann::json(v.get<double>());
  if (v.is_object()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [k, x] : v.items())
      out[k] = numbers_as_doubles(x);
    return out;
  }
  if (v.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& x : v)
      out.push_back(numbers_as_doubles(x));
    return out;
  }
  return v;
}

inline const nlohmann::json* field(const nlohmann::json& j, std::string_view key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace detail

// The forward fields of config.json `j` of a model of `family` (its structure already read):
// see the top of this file. source names the config in errors.
inline ForwardFields forward_fields(const nlohmann::json& j, layout::Family family,
                                    std::int64_t layers, const std::string& source) {
  const JsonReader r(source);
  ForwardFields f;
  auto number = [&](std::string_view key, const nlohmann::json* v, double fallback) {
    if (v != nullptr && !v->is_number()) r.fail(std::string(key), "is not a number");
    f[std::string(key)] = nlohmann::json(v != nullptr ? v->get<double>() : fallback).dump();
  };
  const nlohmann::json* params = detail::field(j, "rope_parameters");
  if (params != nullptr && !params->is_object()) r.fail("rope_parameters", "is not an object");
  // rope_theta: the field, else transformers 5's rope_parameters; HF's default 10000
  const nlohmann::json* theta = detail::field(j, "rope_theta");
  if (theta == nullptr && params != nullptr) theta = detail::field(*params, "rope_theta");
  number("rope_theta", theta, 10000.0);
  const nlohmann::json* partial = detail::field(j, "partial_rotary_factor");
  if (partial == nullptr && params != nullptr) {
    partial = detail::field(*params, "partial_rotary_factor");
  }
  number("partial_rotary_factor", partial, 1.0);
  // rope_scaling: the field, else rope_parameters less what is read above; 'type' is the older
  // name of 'rope_type'; a "default" rope with nothing else is no scaling
  nlohmann::json scaling = nullptr;
  if (const nlohmann::json* s = detail::field(j, "rope_scaling"); s != nullptr) {
    if (!s->is_object()) r.fail("rope_scaling", "is not an object or null");
    scaling = *s;
  } else if (params != nullptr) {
    scaling = *params;
    scaling.erase("rope_theta");
    scaling.erase("partial_rotary_factor");
  }
  if (scaling.is_object()) {
    if (scaling.contains("type") && !scaling.contains("rope_type")) {
      scaling["rope_type"] = scaling["type"];
    }
    scaling.erase("type");
    if (scaling.empty() || (scaling.size() == 1 && scaling["rope_type"] == "default")) {
      scaling = nullptr;
    }
  }
  f["rope_scaling"] = detail::numbers_as_doubles(scaling).dump();
  number("rms_norm_eps", detail::field(j, "rms_norm_eps"), 1e-6);
  const nlohmann::json* act = detail::field(j, "hidden_act");
  if (act != nullptr && !act->is_string()) r.fail("hidden_act", "is not a string");
  f["hidden_act"] = nlohmann::json(act != nullptr ? act->get<std::string>() : "silu").dump();
  // The attention each layer computes: all full (null), or the window and every layer's kind.
  // Qwen2/Qwen3/Qwen3-MoE slide only with use_sliding_window, from layer max_window_layers on
  // (as transformers derives layer_types); Mistral whenever sliding_window is set; Llama never.
  nlohmann::json attention = nullptr;
  const nlohmann::json* window = detail::field(j, "sliding_window");
  const nlohmann::json* types = detail::field(j, "layer_types");
  const bool qwen = family != layout::Family::llama;
  const bool mistral = j.contains("model_type") && j["model_type"] == "mistral";
  const bool slides = qwen ? (detail::field(j, "use_sliding_window") != nullptr &&
                              r.boolean(j["use_sliding_window"], "use_sliding_window"))
                           : mistral;
  nlohmann::json kinds = nlohmann::json::array();
  if (types != nullptr) {
    if (!types->is_array()) r.fail("layer_types", "is not a list");
    kinds = *types;
  } else if (slides && window != nullptr) {
    std::int64_t from = 0;
    if (qwen) {
      const nlohmann::json* m = detail::field(j, "max_window_layers");
      from = m != nullptr ? std::min(r.integer(*m, "max_window_layers", 0, limits::layers), layers)
                          : layers;
    }
    for (std::int64_t l = 0; l < layers; ++l)
      kinds.push_back(l >= from ? "sliding_attention" : "full_attention");
  }
  bool any_sliding = false;
  for (const auto& k : kinds)
    any_sliding = any_sliding || k != "full_attention";
  if (any_sliding) {
    attention = {{"layer_types", kinds}, {"sliding_window", window ? *window : nullptr}};
  }
  f["attention"] = detail::numbers_as_doubles(attention).dump();
  // (absent: the default of the family's config class; Mistral's is 4096 * 32)
  number("max_position_embeddings", detail::field(j, "max_position_embeddings"),
         family == layout::Family::llama ? (mistral ? 131072.0 : 2048.0) : 32768.0);
  if (family == layout::Family::qwen3_moe) {
    const nlohmann::json* k = detail::field(j, "num_experts_per_tok");
    f["num_experts_per_tok"] = detail::numbers_as_doubles(k ? *k : nlohmann::json(nullptr)).dump();
    const nlohmann::json* n = detail::field(j, "norm_topk_prob");
    f["norm_topk_prob"] = nlohmann::json(n != nullptr && r.boolean(*n, "norm_topk_prob")).dump();
  }
  // Fields dte does not know: compared as they are.
  for (const auto& [key, value] : j.items()) {
    if (!detail::known_field(key)) f[key] = detail::numbers_as_doubles(value).dump();
  }
  return f;
}

// The forward fields as a publication header carries them ({"field": JSON value, ...}).
inline nlohmann::ordered_json forward_json(const ForwardFields& f) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [k, v] : f)
    j[k] = nlohmann::ordered_json::parse(v);
  return j;
}

// A publication header's "forward" object, read back (untrusted: an object of at most
// limits-sized JSON values).
inline ForwardFields forward_from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) JsonReader(source).fail("forward", "is not an object");
  ForwardFields f;
  for (const auto& [k, v] : j.items())
    f[k] = detail::numbers_as_doubles(v).dump();
  return f;
}

// The first field on which `a` and `b` differ, as "field (A: X, B: Y)" with a_name and b_name
// for A and B; nullopt when they agree.
inline std::optional<std::string> forward_difference(const ForwardFields& a, const ForwardFields& b,
                                                     std::string_view a_name,
                                                     std::string_view b_name) {
  auto text = [](const ForwardFields& f, const std::string& k) {
    const auto it = f.find(k);
    return it == f.end() ? std::string("absent") : it->second.substr(0, 200);
  };
  std::map<std::string, int> keys;
  for (const auto& [k, v] : a)
    keys[k] = 1;
  for (const auto& [k, v] : b)
    keys[k] = 1;
  for (const auto& [k, one] : keys) {
    const std::string x = text(a, k), y = text(b, k);
    if (x != y) {
      return k + " (" + std::string(a_name) + ": " + x + ", " + std::string(b_name) + ": " + y +
             ")";
    }
  }
  return std::nullopt;
}

}  // namespace dte::io
