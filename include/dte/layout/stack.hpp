// SPDX-License-Identifier: Apache-2.0
// Training stacks and the layout settings each one assumes when the user does not give them:
// vocabulary padding, expert tensor parallelism, the pipeline layer split, DDP buckets. A wrong
// default misroutes silently (sender and receivers share the wrong map, so the digest agrees),
// so dte never assumes one without saying so: apply_stack() fills only what the topology did not
// give, and assumed_settings() lists every layout-changing value with where it came from, which
// `dte plan`, `dte simulate` and their JSON print. Sources (read in each project's code):
//   Megatron-LM / slime: --make-vocab-size-divisible-by 128, padded to a multiple of 128 * tp
//     (megatron/training/arguments.py, vocab_size_with_padding); expert_tensor_parallel_size
//     None -> tp (megatron/core/model_parallel_config.py); uniform split (transformer_block.py).
//   mbridge (verl's default path, AReaL's default bridge): GPTModel gets hf_config.vocab_size,
//     no padding (core/llm_bridge.py, make_vocab_size_divisible_by None); etp from the process
//     groups, which verl initialises with null -> tp; uniform split.
//   Megatron-Bridge (NeMo-RL): should_pad_vocab = False (models/gpt_provider.py); etp None ->
//     tp (Megatron-Core); uniform split.
//   AReaL: mbridge, and expert_tensor_parallel_size = 1 (areal/api/alloc_mode.py); with pp > 1
//     it balances the pipeline split by parameter count, which dte cannot derive: give split=.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

enum class Stack : std::uint8_t { megatron_lm, mbridge, megatron_bridge, areal };

inline constexpr std::string_view stack_names =
    "megatron-lm (also slime), mbridge (also verl), megatron-bridge (also nemo-rl), areal";

inline Stack parse_stack(std::string_view name) {
  if (name == "megatron-lm" || name == "slime") return Stack::megatron_lm;
  if (name == "mbridge" || name == "verl") return Stack::mbridge;
  if (name == "megatron-bridge" || name == "nemo-rl") return Stack::megatron_bridge;
  if (name == "areal") return Stack::areal;
  throw invalid_argument(
      "--stack " + std::string(name) + ": unknown stack; stacks: " + std::string(stack_names),
      about("--stack"));
}

inline std::string_view stack_name(Stack s) noexcept {
  switch (s) {
    case Stack::megatron_lm:
      return "megatron-lm";
    case Stack::mbridge:
      return "mbridge";
    case Stack::megatron_bridge:
      return "megatron-bridge";
    case Stack::areal:
      return "areal";
  }
  return "?";
}

// Fills what the topology did not give (TrainTopology::given) with the stack's defaults.
// Megatron-LM's are the struct's own, so applying it changes nothing.
inline void apply_stack(TrainTopology& t, Stack s) {
  if (!t.was_given("vocab_div")) {
    t.pad_vocab = s == Stack::megatron_lm;
    t.vocab_divisible_by = 128;
  }
  if (!t.was_given("etp")) t.etp = s == Stack::areal ? 1 : 0;
  if (s == Stack::areal && t.pp > 1 && !t.was_given("split")) {
    throw invalid_argument(
        "--stack areal with pp=" + std::to_string(t.pp) +
            ": AReaL balances its pipeline split by parameter count; give the layers per stage "
            "it uses as split=a:b:... (its log prints pipeline_model_parallel_layout)",
        about("--train", "split"));
  }
}

// One layout-changing setting: its value and whether the user gave it or where the assumed
// value comes from.
struct LayoutSetting {
  std::string setting;
  std::string value;
  bool assumed = false;
  std::string source;  // for an assumed value: whose default it is
};

inline std::vector<LayoutSetting> assumed_settings(const ModelSpec& m, const TrainTopology& t,
                                                   Stack s) {
  std::vector<LayoutSetting> out;
  const std::string stack(stack_name(s));
  auto add = [&](std::string setting, std::string value, const char* key, std::string source) {
    const bool assumed = !t.was_given(key);
    out.push_back({std::move(setting), std::move(value), assumed, assumed ? source : ""});
  };
  const std::int64_t vp = t.padded_vocab(m.vocab);
  add("vocabulary padding",
      t.pad_vocab ? "to a multiple of " + std::to_string(t.vocab_divisible_by) + " x tp " +
                        std::to_string(t.tp) + ": " + std::to_string(m.vocab) + " -> " +
                        std::to_string(vp) + " rows, " + std::to_string(vp / t.tp) + " per rank"
                  : "none: " + std::to_string(m.vocab) + " rows, " +
                        std::to_string(m.vocab / t.tp) + " per rank",
      "vocab_div",
      t.pad_vocab ? "Megatron-LM's --make-vocab-size-divisible-by 128 (--stack megatron-lm)"
                  : "--stack " + stack + ": the HF vocabulary as it is");
  if (m.moe()) {
    add("expert tensor parallel (etp)", std::to_string(t.expert_tp()), "etp",
        t.etp == 0 ? "= tp, Megatron-Core's default (expert_tensor_parallel_size None)"
                   : "--stack " + stack + " sets expert_tensor_parallel_size = 1");
  }
  std::string split;
  if (t.layer_split.empty()) {
    split = "uniform, " + std::to_string(m.layers / t.pp) + " layers per stage";
  } else {
    for (std::int64_t n : t.layer_split)
      split += (split.empty() ? "" : ":") + std::to_string(n);
  }
  add("pipeline split", split, "split",
      "uniform, Megatron-Core's default (no first/last-stage "
      "layer counts, no pipeline layout)");
  add("DDP buckets",
      t.bucket_size > 0 ? std::to_string(t.bucket_size) + " elements (stage 0)" : "one per buffer",
      "bucket", "overlap_grad_reduce off (Megatron's default); give bucket= if it is on");
  return out;
}

}  // namespace dte::layout
