// SPDX-License-Identifier: Apache-2.0
// MegatronToHF: Megatron-Core's per-rank parameters (TE spec, TEGroupedMLP experts) and the map
// from (parameter, flat index in the TP/EP-local tensor) to the HF canonical element, with its
// inverse. Formulas: shared/LAYOUTS.md §3, §5 and §11 (biases, tied embeddings); docs/layouts.md
// has the tables.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

enum class MegatronKind : std::uint8_t {
  embedding,     // embedding.word_embeddings.weight        [Vp/Tm, H]
  qkv_norm,      // self_attention.linear_qkv.layer_norm_weight [H]
  qkv,           // self_attention.linear_qkv.weight         [(nq+2ng)d/Tm, H]
  qkv_bias,      // self_attention.linear_qkv.bias           [(nq+2ng)d/Tm] (add_qkv_bias)
  q_layernorm,   // self_attention.q_layernorm.weight        [d]
  k_layernorm,   // self_attention.k_layernorm.weight        [d]
  proj,          // self_attention.linear_proj.weight        [H, nq d/Tm]
  fc1_norm,      // mlp.linear_fc1.layer_norm_weight         [H]
  fc1,           // mlp.linear_fc1.weight                    [2F/Tm, H]
  fc2,           // mlp.linear_fc2.weight                    [H, F/Tm]
  pre_mlp_norm,  // pre_mlp_layernorm.weight (MoE layers)   [H]
  router,        // mlp.router.weight                        [E, H]
  expert_fc1,    // mlp.experts.linear_fc1.weight{j}         [2Fm/Te, H]
  expert_fc2,    // mlp.experts.linear_fc2.weight{j}         [H, Fm/Te]
  final_norm,    // decoder.final_layernorm.weight           [H]
  output,        // output_layer.weight                      [Vp/Tm, H] (tied: pp > 1 only)
};

// The coordinates of one trainer process (Megatron order tp-cp-ep-dp-pp, cp = 1).
struct TrainRank {
  std::int64_t global = 0;
  std::int64_t tm = 0, dp = 0, pp = 0;   // dense: global = tm + Tm*(dp + DP*pp)
  std::int64_t te = 0, em = 0, edp = 0;  // experts: global = te + Te*(em + EP*(edp + EDP*pp))
};

inline TrainRank train_rank(const TrainTopology& t, std::int64_t global) {
  if (global < 0 || global >= t.world()) {
    throw invalid_argument("trainer rank " + std::to_string(global) + " is outside the world of " +
                           std::to_string(t.world()) + " ranks (tp*dp*pp)");
  }
  TrainRank r;
  r.global = global;
  r.tm = global % t.tp;
  r.dp = (global / t.tp) % t.dp;
  r.pp = global / (t.tp * t.dp);
  const std::int64_t in_stage = global % (t.tp * t.dp);
  r.te = in_stage % t.expert_tp();
  r.em = (in_stage / t.expert_tp()) % t.ep;
  r.edp = in_stage / (t.expert_tp() * t.ep);
  return r;
}

struct MegatronParam {
  MegatronKind kind;
  std::int32_t layer = -1;         // global layer (-1 outside the decoder)
  std::int32_t local_layer = -1;   // index inside this pipeline stage
  std::int32_t expert = -1;        // global expert
  std::int32_t local_expert = -1;  // j in weight{j}
  std::int64_t rows = 0;
  std::int64_t cols = 0;  // 0 for 1-D
  // Megatron's `shared_embedding` (tied embeddings with pp > 1: the first stage's embedding and
  // the last stage's output layer): the distributed optimizer gives it a bucket of its own.
  bool shared_embedding = false;

  [[nodiscard]] std::int64_t numel() const noexcept { return cols == 0 ? rows : rows * cols; }
  [[nodiscard]] bool is_expert() const noexcept {
    return kind == MegatronKind::expert_fc1 || kind == MegatronKind::expert_fc2;
  }
  [[nodiscard]] std::vector<std::int64_t> shape() const {
    if (cols == 0) return {rows};
    return {rows, cols};
  }

  // The local name, as named_parameters() yields it without the DDP/Float16Module prefix.
  [[nodiscard]] std::string name() const {
    const std::string l = "decoder.layers." + std::to_string(local_layer) + ".";
    switch (kind) {
      case MegatronKind::embedding:
        return "embedding.word_embeddings.weight";
      case MegatronKind::qkv_norm:
        return l + "self_attention.linear_qkv.layer_norm_weight";
      case MegatronKind::qkv:
        return l + "self_attention.linear_qkv.weight";
      case MegatronKind::qkv_bias:
        return l + "self_attention.linear_qkv.bias";
      case MegatronKind::q_layernorm:
        return l + "self_attention.q_layernorm.weight";
      case MegatronKind::k_layernorm:
        return l + "self_attention.k_layernorm.weight";
      case MegatronKind::proj:
        return l + "self_attention.linear_proj.weight";
      case MegatronKind::fc1_norm:
        return l + "mlp.linear_fc1.layer_norm_weight";
      case MegatronKind::fc1:
        return l + "mlp.linear_fc1.weight";
      case MegatronKind::fc2:
        return l + "mlp.linear_fc2.weight";
      case MegatronKind::pre_mlp_norm:
        return l + "pre_mlp_layernorm.weight";
      case MegatronKind::router:
        return l + "mlp.router.weight";
      case MegatronKind::expert_fc1:
        return l + "mlp.experts.linear_fc1.weight" + std::to_string(local_expert);
      case MegatronKind::expert_fc2:
        return l + "mlp.experts.linear_fc2.weight" + std::to_string(local_expert);
      case MegatronKind::final_norm:
        return "decoder.final_layernorm.weight";
      case MegatronKind::output:
        return "output_layer.weight";
    }
    return "?";
  }
};

// Parameters of one rank in named_parameters() order (the distributed optimizer lays its
// buffers out in the reverse of this order). TE's LayerNormLinear registers layer_norm_weight,
// weight, bias in that order. Tied embeddings: with pp = 1 there is no output_layer.weight (the
// logits use the embedding); with pp > 1 the last stage holds a copy (shared_embedding).
inline std::vector<MegatronParam> megatron_params(const ModelSpec& m, const TrainTopology& t,
                                                  const TrainRank& r) {
  std::vector<MegatronParam> out;
  const std::int64_t H = m.hidden, Tm = t.tp, Te = t.expert_tp();
  const std::int64_t Vp = t.padded_vocab(m.vocab);
  const bool shared = m.tied() && t.pp > 1;
  auto add = [&](MegatronKind kind, std::int64_t layer, std::int64_t local_layer, std::int64_t rows,
                 std::int64_t cols, std::int64_t expert = -1, std::int64_t local_expert = -1) {
    out.push_back({kind, static_cast<std::int32_t>(layer), static_cast<std::int32_t>(local_layer),
                   static_cast<std::int32_t>(expert), static_cast<std::int32_t>(local_expert), rows,
                   cols,
                   shared && (kind == MegatronKind::embedding || kind == MegatronKind::output)});
  };
  if (r.pp == 0) add(MegatronKind::embedding, -1, -1, Vp / Tm, H);
  const std::int64_t offset = t.stage_offset(r.pp, m.layers);
  const std::int64_t count = t.stage_layers(r.pp, m.layers);
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t L = offset + i;
    add(MegatronKind::proj, L, i, H, m.q_rows() / Tm);
    add(MegatronKind::qkv_norm, L, i, H, 0);
    add(MegatronKind::qkv, L, i, (m.q_rows() + 2 * m.kv_rows()) / Tm, H);
    if (m.qkv_bias()) add(MegatronKind::qkv_bias, L, i, (m.q_rows() + 2 * m.kv_rows()) / Tm, 0);
    if (m.qk_norm()) {
      add(MegatronKind::q_layernorm, L, i, m.head_dim, 0);
      add(MegatronKind::k_layernorm, L, i, m.head_dim, 0);
    }
    if (m.moe()) {
      add(MegatronKind::pre_mlp_norm, L, i, H, 0);
      add(MegatronKind::router, L, i, m.experts, H);
      const std::int64_t local = m.experts / t.ep;
      for (std::int64_t j = 0; j < local; ++j) {
        add(MegatronKind::expert_fc1, L, i, 2 * m.moe_intermediate / Te, H, r.em * local + j, j);
      }
      for (std::int64_t j = 0; j < local; ++j) {
        add(MegatronKind::expert_fc2, L, i, H, m.moe_intermediate / Te, r.em * local + j, j);
      }
    } else {
      add(MegatronKind::fc1_norm, L, i, H, 0);
      add(MegatronKind::fc1, L, i, 2 * m.intermediate / Tm, H);
      add(MegatronKind::fc2, L, i, H, m.intermediate / Tm);
    }
  }
  if (r.pp == t.pp - 1) {
    add(MegatronKind::final_norm, -1, -1, H, 0);
    if (!m.tied() || t.pp > 1) add(MegatronKind::output, -1, -1, Vp / Tm, H);
  }
  return out;
}

// Megatron (TP/EP-local parameter, flat index) <-> HF canonical element, for one rank.
// Replicated parameters (norms, router) map on every TP rank; is_sender() picks TP rank 0 so
// that each canonical element has exactly one source. A tied model's output layer (pp > 1) maps
// onto embed_tokens and never sends: the first stage's embedding does, and the copy, which
// Megatron's optimizer keeps identical, is validated like a TP replica.
class TransferPlan;

class MegatronToHF {
 public:
  using layout_mapping_tag = void;
  using plan_type = TransferPlan;  // layout/plan.hpp
  using param_type = MegatronParam;
  using canonical_type = Canonical;

  MegatronToHF(const HfModel& hf, const TrainTopology& t, const TrainRank& r)
      : hf_(&hf), t_(t), r_(r), vp_(t.padded_vocab(hf.spec().vocab)), tied_(hf.spec().tied()) {}

  [[nodiscard]] const TrainRank& rank() const noexcept { return r_; }

  [[nodiscard]] bool is_sender(const MegatronParam& p) const noexcept {
    if (p.kind == MegatronKind::output && tied_) return false;
    return replicated(p.kind) ? r_.tm == 0 : true;
  }

  // Elements from flat index i on whose canonical indices are consecutive: the rest of the
  // local row of a matrix (each maps onto one HF row); the rest of a head's d entries of the
  // QKV bias (its rows interleave q, k and v per group); the rest of any other 1-D parameter.
  [[nodiscard]] std::int64_t contiguous(const MegatronParam& p, std::int64_t i) const noexcept {
    if (p.cols != 0) return p.cols - i % p.cols;
    if (p.kind == MegatronKind::qkv_bias) {
      const std::int64_t d = hf_->spec().head_dim;
      return d - (r_.tm * p.rows + i) % d;
    }
    return p.numel() - i;
  }

  static bool replicated(MegatronKind k) noexcept {
    return k == MegatronKind::qkv_norm || k == MegatronKind::q_layernorm ||
           k == MegatronKind::k_layernorm || k == MegatronKind::fc1_norm ||
           k == MegatronKind::pre_mlp_norm || k == MegatronKind::router ||
           k == MegatronKind::final_norm;
  }

  // The canonical element held at flat index i of parameter p (tensor -1 for vocab padding).
  [[nodiscard]] Canonical operator()(const MegatronParam& p, std::int64_t i) const noexcept {
    const ModelSpec& m = hf_->spec();
    const std::int64_t H = m.hidden, d = m.head_dim, Tm = t_.tp, tm = r_.tm;
    const std::int64_t row = p.cols == 0 ? i : i / p.cols;
    const std::int64_t col = p.cols == 0 ? 0 : i % p.cols;
    auto at = [&](HfKind k, std::int64_t hf_row, std::int64_t hf_cols, std::int64_t hf_col,
                  std::int64_t layer = -1, std::int64_t expert = -1) {
      return Canonical{hf_->id(k, layer, expert), hf_row * hf_cols + hf_col};
    };
    // Row R of the unsharded, group-interleaved QKV (weight or bias): per group qpg q heads,
    // then k, then v.
    auto qkv_at = [&](bool bias, std::int64_t cols) {
      const std::int64_t R = tm * ((m.q_rows() + 2 * m.kv_rows()) / Tm) + row;
      const std::int64_t qpg = m.heads_per_group();
      const std::int64_t G = (qpg + 2) * d;
      const std::int64_t g = R / G, o = R % G, s = o / d, j = o % d;
      if (s < qpg)
        return at(bias ? HfKind::q_bias : HfKind::q, (g * qpg + s) * d + j, cols, col, p.layer);
      const HfKind k =
          s == qpg ? (bias ? HfKind::k_bias : HfKind::k) : (bias ? HfKind::v_bias : HfKind::v);
      return at(k, g * d + j, cols, col, p.layer);
    };
    switch (p.kind) {
      case MegatronKind::embedding:
      case MegatronKind::output: {
        const std::int64_t R = tm * (vp_ / Tm) + row;  // padded global row
        if (R >= m.vocab) return {};
        const bool embed = p.kind == MegatronKind::embedding || tied_;
        return at(embed ? HfKind::embed : HfKind::lm_head, R, H, col);
      }
      case MegatronKind::qkv:
        return qkv_at(false, H);
      case MegatronKind::qkv_bias:
        return qkv_at(true, 1);
      case MegatronKind::proj: {
        const std::int64_t w = m.q_rows() / Tm;
        return at(HfKind::o, row, m.q_rows(), tm * w + col, p.layer);
      }
      case MegatronKind::fc1: {
        const std::int64_t half = m.intermediate / Tm;
        const bool gate = row < half;
        return at(gate ? HfKind::gate : HfKind::up, tm * half + (gate ? row : row - half), H, col,
                  p.layer);
      }
      case MegatronKind::fc2: {
        const std::int64_t w = m.intermediate / Tm;
        return at(HfKind::down, row, m.intermediate, tm * w + col, p.layer);
      }
      case MegatronKind::expert_fc1: {
        const std::int64_t half = m.moe_intermediate / t_.expert_tp();
        const bool gate = row < half;
        return at(gate ? HfKind::expert_gate : HfKind::expert_up,
                  r_.te * half + (gate ? row : row - half), H, col, p.layer, p.expert);
      }
      case MegatronKind::expert_fc2: {
        const std::int64_t w = m.moe_intermediate / t_.expert_tp();
        return at(HfKind::expert_down, row, m.moe_intermediate, r_.te * w + col, p.layer, p.expert);
      }
      case MegatronKind::qkv_norm:
        return {hf_->id(HfKind::input_norm, p.layer), i};
      case MegatronKind::q_layernorm:
        return {hf_->id(HfKind::q_norm, p.layer), i};
      case MegatronKind::k_layernorm:
        return {hf_->id(HfKind::k_norm, p.layer), i};
      case MegatronKind::fc1_norm:
      case MegatronKind::pre_mlp_norm:
        return {hf_->id(HfKind::post_norm, p.layer), i};
      case MegatronKind::router:
        return {hf_->id(HfKind::router, p.layer), i};
      case MegatronKind::final_norm:
        return {hf_->id(HfKind::final_norm), i};
    }
    return {};
  }

 private:
  const HfModel* hf_;
  TrainTopology t_;
  TrainRank r_;
  std::int64_t vp_;
  bool tied_;
};

static_assert(layout_mapping<MegatronToHF>);

// The inverse: where a canonical element lives in Megatron. For TP-replicated tensors it names
// the sender (TP rank 0); experts are named by (te, em).
struct MegatronSource {
  MegatronKind kind;
  std::int64_t tm = 0, pp = 0, te = 0, em = 0;
  std::int64_t local_layer = -1, local_expert = -1;
  std::int64_t index = 0;  // flat index in the TP/EP-local parameter
};

inline MegatronSource megatron_source(const HfModel& hf, const TrainTopology& t, Canonical c) {
  const ModelSpec& m = hf.spec();
  const HfTensor& x = hf[c.tensor];
  const std::int64_t H = m.hidden, d = m.head_dim, Tm = t.tp;
  const std::int64_t row = x.cols == 0 ? c.index : c.index / x.cols;
  const std::int64_t col = x.cols == 0 ? 0 : c.index % x.cols;
  MegatronSource s{};
  auto stage_of = [&](std::int64_t layer) {
    std::int64_t stage = 0;
    while (layer >= t.stage_offset(stage, m.layers) + t.stage_layers(stage, m.layers))
      ++stage;
    s.pp = stage;
    s.local_layer = layer - t.stage_offset(stage, m.layers);
  };
  if (x.layer >= 0) stage_of(x.layer);
  switch (x.kind) {
    case HfKind::embed:
    case HfKind::lm_head: {
      const std::int64_t per = t.padded_vocab(m.vocab) / Tm;
      s.kind = x.kind == HfKind::embed ? MegatronKind::embedding : MegatronKind::output;
      s.pp = x.kind == HfKind::embed ? 0 : t.pp - 1;
      s.tm = row / per;
      s.index = (row % per) * H + col;
      return s;
    }
    case HfKind::q:
    case HfKind::k:
    case HfKind::v:
    case HfKind::q_bias:
    case HfKind::k_bias:
    case HfKind::v_bias: {
      const bool bias = x.cols == 0;
      const std::int64_t qpg = m.heads_per_group(), G = (qpg + 2) * d;
      std::int64_t R;
      if (x.kind == HfKind::q || x.kind == HfKind::q_bias) {
        const std::int64_t h = row / d, j = row % d;
        R = (h / qpg) * G + (h % qpg) * d + j;
      } else {
        const bool k = x.kind == HfKind::k || x.kind == HfKind::k_bias;
        R = (row / d) * G + (k ? qpg : qpg + 1) * d + row % d;
      }
      const std::int64_t per = (m.q_rows() + 2 * m.kv_rows()) / Tm;
      s.kind = bias ? MegatronKind::qkv_bias : MegatronKind::qkv;
      s.tm = R / per;
      s.index = bias ? R % per : (R % per) * H + col;
      return s;
    }
    case HfKind::o: {
      const std::int64_t w = m.q_rows() / Tm;
      s.kind = MegatronKind::proj;
      s.tm = col / w;
      s.index = row * w + col % w;
      return s;
    }
    case HfKind::gate:
    case HfKind::up: {
      const std::int64_t half = m.intermediate / Tm;
      s.kind = MegatronKind::fc1;
      s.tm = row / half;
      s.index = ((x.kind == HfKind::up ? half : 0) + row % half) * H + col;
      return s;
    }
    case HfKind::down: {
      const std::int64_t w = m.intermediate / Tm;
      s.kind = MegatronKind::fc2;
      s.tm = col / w;
      s.index = row * w + col % w;
      return s;
    }
    case HfKind::expert_gate:
    case HfKind::expert_up:
    case HfKind::expert_down: {
      const std::int64_t local = m.experts / t.ep;
      s.em = x.expert / local;
      s.local_expert = x.expert % local;
      if (x.kind == HfKind::expert_down) {
        const std::int64_t w = m.moe_intermediate / t.expert_tp();
        s.kind = MegatronKind::expert_fc2;
        s.te = col / w;
        s.index = row * w + col % w;
      } else {
        const std::int64_t half = m.moe_intermediate / t.expert_tp();
        s.kind = MegatronKind::expert_fc1;
        s.te = row / half;
        s.index = ((x.kind == HfKind::expert_up ? half : 0) + row % half) * H + col;
      }
      return s;
    }
    case HfKind::input_norm:
      s.kind = MegatronKind::qkv_norm;
      break;
    case HfKind::q_norm:
      s.kind = MegatronKind::q_layernorm;
      break;
    case HfKind::k_norm:
      s.kind = MegatronKind::k_layernorm;
      break;
    case HfKind::post_norm:
      s.kind = m.moe() ? MegatronKind::pre_mlp_norm : MegatronKind::fc1_norm;
      break;
    case HfKind::router:
      s.kind = MegatronKind::router;
      break;
    case HfKind::final_norm:
      s.kind = MegatronKind::final_norm;
      s.pp = t.pp - 1;
      break;
  }
  s.index = c.index;  // replicated tensors: identity, sent by TP rank 0
  return s;
}

}  // namespace dte::layout
