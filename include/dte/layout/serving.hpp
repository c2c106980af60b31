// SPDX-License-Identifier: Apache-2.0
// ServingLayout: the receiver layout SGLang and vLLM both use, at every TP size (the same
// parameter names, shapes and fusions in either engine): per-TP-rank tensors (fused qkv_proj and
// its bias with KV replication when TP > KV heads, gate_up_proj, row-parallel o_proj/down_proj,
// vocab-parallel embed_tokens and lm_head without Megatron's padding, one tensor for both when
// tied, FusedMoE w13/w2 under EP and MoE-TP), the map from an HF canonical element to every (TP
// rank, tensor, local index) holding it, and its inverse. Formulas: shared/LAYOUTS.md §5, §6 and
// §11; tables in docs/layouts.md.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dte/bounds.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

enum class ReceiverKind : std::uint8_t {
  embed,
  input_norm,
  qkv,
  qkv_bias,
  o,
  q_norm,
  k_norm,
  post_norm,
  gate_up,
  down,
  router,
  w13,
  w2,
  final_norm,
  lm_head,
};

inline constexpr std::size_t receiver_kinds = static_cast<std::size_t>(ReceiverKind::lm_head) + 1;

struct ReceiverTensor {
  ReceiverKind kind;
  std::int32_t layer;               // global layer, -1 outside the decoder
  std::vector<std::int64_t> shape;  // receiver-local
  std::int64_t numel;
};

// One receiver element: TP rank within a replica, tensor id, flat index in the local tensor.
struct ReceiverElement {
  std::int64_t ts;
  std::int64_t tensor;
  std::int64_t index;
};

class ServingLayout {
 public:
  ServingLayout(const HfModel& hf, const InferTopology& t) : hf_(&hf), t_(t) {
    const ModelSpec& m = hf.spec();
    const std::int64_t H = m.hidden, Ts = t.tp;
    vs_ = InferTopology::padded_vocab(m.vocab);
    nkl_ = std::max<std::int64_t>(1, m.kv_heads / Ts);
    rep_ = std::max<std::int64_t>(1, Ts / m.kv_heads);
    slot_.fill(-1);
    auto add = [&](ReceiverKind k, std::int64_t layer, std::vector<std::int64_t> shape) {
      if (layer <= 0) slot_[static_cast<std::size_t>(k)] = static_cast<std::int32_t>(size());
      std::int64_t n = 1;
      for (std::int64_t s : shape)
        n = checked_mul(n, s, "receiver tensor elements");
      tensors_.push_back({k, static_cast<std::int32_t>(layer), std::move(shape), n});
      if (n > limits::tensor_elements) {
        throw bounds_error("--infer tp=" + std::to_string(t.tp) + ": receiver tensor " +
                               name(size() - 1) + " has " + std::to_string(n) +
                               " elements; dte addresses at most 2^32 - 1 per tensor (use a "
                               "larger tp)",
                           about("--infer", name(size() - 1)));
      }
    };
    add(ReceiverKind::embed, -1, {vs_ / Ts, H});
    for (std::int64_t L = 0; L < m.layers; ++L) {
      add(ReceiverKind::input_norm, L, {H});
      add(ReceiverKind::qkv, L, {(m.heads / Ts + 2 * nkl_) * m.head_dim, H});
      if (m.qkv_bias()) add(ReceiverKind::qkv_bias, L, {(m.heads / Ts + 2 * nkl_) * m.head_dim});
      add(ReceiverKind::o, L, {H, m.q_rows() / Ts});
      if (m.qk_norm()) {
        add(ReceiverKind::q_norm, L, {m.head_dim});
        add(ReceiverKind::k_norm, L, {m.head_dim});
      }
      add(ReceiverKind::post_norm, L, {H});
      if (m.moe()) {
        const std::int64_t Ms = t.moe_tp(), El = m.experts / t.ep;
        add(ReceiverKind::router, L, {m.experts, H});
        add(ReceiverKind::w13, L, {El, 2 * m.moe_intermediate / Ms, H});
        add(ReceiverKind::w2, L, {El, H, m.moe_intermediate / Ms});
      } else {
        add(ReceiverKind::gate_up, L, {2 * m.intermediate / Ts, H});
        add(ReceiverKind::down, L, {H, m.intermediate / Ts});
      }
    }
    add(ReceiverKind::final_norm, -1, {H});
    if (!m.tied()) add(ReceiverKind::lm_head, -1, {vs_ / Ts, H});  // tied: lm_head = embed_tokens
    per_layer_ = (size() - (m.tied() ? 2 : 3)) / m.layers;
  }

  [[nodiscard]] const InferTopology& topology() const noexcept { return t_; }
  [[nodiscard]] const HfModel& model() const noexcept { return *hf_; }
  [[nodiscard]] std::int64_t size() const noexcept {
    return static_cast<std::int64_t>(tensors_.size());
  }
  [[nodiscard]] const ReceiverTensor& operator[](std::int64_t id) const {
    return tensors_[static_cast<std::size_t>(id)];
  }

  // O(1): the id of a tensor from its kind and layer. The kind must exist in this model.
  [[nodiscard]] std::int64_t id(ReceiverKind k, std::int64_t layer = -1) const noexcept {
    const std::int64_t slot = slot_[static_cast<std::size_t>(k)];
    return layer < 0 ? slot : slot + layer * per_layer_;
  }

  // SGLang parameter name (global layer index), as load_format="direct" expects it.
  [[nodiscard]] std::string name(std::int64_t id) const {
    const ReceiverTensor& x = (*this)[id];
    const std::string l = "model.layers." + std::to_string(x.layer) + ".";
    switch (x.kind) {
      case ReceiverKind::embed:
        return "model.embed_tokens.weight";
      case ReceiverKind::input_norm:
        return l + "input_layernorm.weight";
      case ReceiverKind::qkv:
        return l + "self_attn.qkv_proj.weight";
      case ReceiverKind::qkv_bias:
        return l + "self_attn.qkv_proj.bias";
      case ReceiverKind::o:
        return l + "self_attn.o_proj.weight";
      case ReceiverKind::q_norm:
        return l + "self_attn.q_norm.weight";
      case ReceiverKind::k_norm:
        return l + "self_attn.k_norm.weight";
      case ReceiverKind::post_norm:
        return l + "post_attention_layernorm.weight";
      case ReceiverKind::gate_up:
        return l + "mlp.gate_up_proj.weight";
      case ReceiverKind::down:
        return l + "mlp.down_proj.weight";
      case ReceiverKind::router:
        return l + "mlp.gate.weight";
      case ReceiverKind::w13:
        return l + "mlp.experts.w13_weight";
      case ReceiverKind::w2:
        return l + "mlp.experts.w2_weight";
      case ReceiverKind::final_norm:
        return "model.norm.weight";
      case ReceiverKind::lm_head:
        return "lm_head.weight";
    }
    return "?";
  }

  // Every (TP rank, tensor, index) of one replica that holds canonical element c: one for
  // sharded tensors, Ts/ng for replicated KV rows, Ts for norms and the router.
  template <class Emit>
  void targets(Canonical c, Emit&& emit) const {
    const ModelSpec& m = hf_->spec();
    const HfTensor& x = (*hf_)[c.tensor];
    const std::int64_t H = m.hidden, d = m.head_dim, Ts = t_.tp;
    const std::int64_t row = x.cols == 0 ? c.index : c.index / x.cols;
    const std::int64_t col = x.cols == 0 ? 0 : c.index % x.cols;
    const std::int64_t L = x.layer;
    switch (x.kind) {
      case HfKind::embed:
      case HfKind::lm_head: {
        const std::int64_t per = vs_ / Ts;
        emit(ReceiverElement{
            row / per, id(x.kind == HfKind::embed ? ReceiverKind::embed : ReceiverKind::lm_head),
            (row % per) * H + col});
        return;
      }
      case HfKind::q:
      case HfKind::q_bias: {
        // The bias is the weight with one column: same rows, same shards.
        const std::int64_t per = m.q_rows() / Ts, cols = x.cols == 0 ? 1 : H;
        const ReceiverKind k = x.cols == 0 ? ReceiverKind::qkv_bias : ReceiverKind::qkv;
        emit(ReceiverElement{row / per, id(k, L), (row % per) * cols + col});
        return;
      }
      case HfKind::k:
      case HfKind::v:
      case HfKind::k_bias:
      case HfKind::v_bias: {
        const std::int64_t block = nkl_ * d, cols = x.cols == 0 ? 1 : H;
        const bool v = x.kind == HfKind::v || x.kind == HfKind::v_bias;
        const ReceiverKind k = x.cols == 0 ? ReceiverKind::qkv_bias : ReceiverKind::qkv;
        const std::int64_t first = (row / block) * rep_;
        const std::int64_t local_row = m.q_rows() / Ts + (v ? block : 0) + row % block;
        for (std::int64_t ts = first; ts < first + rep_; ++ts) {
          emit(ReceiverElement{ts, id(k, L), local_row * cols + col});
        }
        return;
      }
      case HfKind::o: {
        const std::int64_t w = m.q_rows() / Ts;
        emit(ReceiverElement{col / w, id(ReceiverKind::o, L), row * w + col % w});
        return;
      }
      case HfKind::gate:
      case HfKind::up: {
        const std::int64_t per = m.intermediate / Ts;
        const std::int64_t local_row = (x.kind == HfKind::up ? per : 0) + row % per;
        emit(ReceiverElement{row / per, id(ReceiverKind::gate_up, L), local_row * H + col});
        return;
      }
      case HfKind::down: {
        const std::int64_t w = m.intermediate / Ts;
        emit(ReceiverElement{col / w, id(ReceiverKind::down, L), row * w + col % w});
        return;
      }
      case HfKind::expert_gate:
      case HfKind::expert_up:
      case HfKind::expert_down: {
        const std::int64_t Ms = t_.moe_tp(), El = m.experts / t_.ep;
        const std::int64_t w = m.moe_intermediate / Ms;
        const std::int64_t ep_rank = x.expert / El, j = x.expert % El;
        if (x.kind == HfKind::expert_down) {
          const std::int64_t ts = ep_rank * Ms + col / w;
          emit(ReceiverElement{ts, id(ReceiverKind::w2, L), (j * H + row) * w + col % w});
        } else {
          const std::int64_t ts = ep_rank * Ms + row / w;
          const std::int64_t local_row = (x.kind == HfKind::expert_up ? w : 0) + row % w;
          emit(ReceiverElement{ts, id(ReceiverKind::w13, L), (j * 2 * w + local_row) * H + col});
        }
        return;
      }
      case HfKind::input_norm:
      case HfKind::q_norm:
      case HfKind::k_norm:
      case HfKind::post_norm:
      case HfKind::router:
      case HfKind::final_norm: {
        const ReceiverKind k = x.kind == HfKind::input_norm  ? ReceiverKind::input_norm
                               : x.kind == HfKind::q_norm    ? ReceiverKind::q_norm
                               : x.kind == HfKind::k_norm    ? ReceiverKind::k_norm
                               : x.kind == HfKind::post_norm ? ReceiverKind::post_norm
                               : x.kind == HfKind::router    ? ReceiverKind::router
                                                             : ReceiverKind::final_norm;
        for (std::int64_t ts = 0; ts < Ts; ++ts)
          emit(ReceiverElement{ts, id(k, L), c.index});
        return;
      }
    }
  }

  // How many copies of each element of HF tensor kind k one replica holds: rep for K/V,
  // every TP rank for norms and the router, one otherwise.
  [[nodiscard]] std::int64_t copies(HfKind k) const noexcept {
    switch (k) {
      case HfKind::k:
      case HfKind::v:
      case HfKind::k_bias:
      case HfKind::v_bias:
        return rep_;
      case HfKind::input_norm:
      case HfKind::q_norm:
      case HfKind::k_norm:
      case HfKind::post_norm:
      case HfKind::router:
      case HfKind::final_norm:
        return t_.tp;
      default:
        return 1;
    }
  }

  // How many elements from c onwards (within its HF tensor) keep every target index-contiguous:
  // the run ends where a receiver rank's row block or column chunk ends.
  [[nodiscard]] std::int64_t contiguous(Canonical c) const {
    const ModelSpec& m = hf_->spec();
    const HfTensor& x = (*hf_)[c.tensor];
    const std::int64_t H = m.hidden, Ts = t_.tp;
    auto to_block_end = [&](std::int64_t block) { return block - c.index % block; };
    switch (x.kind) {
      case HfKind::embed:
      case HfKind::lm_head:
        return to_block_end((vs_ / Ts) * H);
      case HfKind::q:
        return to_block_end((m.q_rows() / Ts) * H);
      case HfKind::k:
      case HfKind::v:
        return to_block_end(nkl_ * m.head_dim * H);
      case HfKind::q_bias:
        return to_block_end(m.q_rows() / Ts);
      case HfKind::k_bias:
      case HfKind::v_bias:
        return to_block_end(nkl_ * m.head_dim);
      case HfKind::gate:
      case HfKind::up:
        return to_block_end((m.intermediate / Ts) * H);
      case HfKind::o:
        return to_block_end(m.q_rows() / Ts);
      case HfKind::down:
        return to_block_end(m.intermediate / Ts);
      case HfKind::expert_gate:
      case HfKind::expert_up:
        return to_block_end((m.moe_intermediate / t_.moe_tp()) * H);
      case HfKind::expert_down:
        return to_block_end(m.moe_intermediate / t_.moe_tp());
      default:
        return x.numel() - c.index;  // replicated: identity
    }
  }

  // The inverse: which canonical element a receiver element holds (tensor -1: the zero-filled
  // vocabulary tail beyond vocab_size, which nothing writes).
  [[nodiscard]] Canonical source(const ReceiverElement& e) const {
    const ModelSpec& m = hf_->spec();
    const ReceiverTensor& x = (*this)[e.tensor];
    const std::int64_t H = m.hidden, d = m.head_dim, Ts = t_.tp, ts = e.ts, L = x.layer;
    const std::int64_t cols = x.shape.back();
    switch (x.kind) {
      case ReceiverKind::embed:
      case ReceiverKind::lm_head: {
        const std::int64_t r = ts * (vs_ / Ts) + e.index / H;
        if (r >= m.vocab) return {};
        return {hf_->id(x.kind == ReceiverKind::embed ? HfKind::embed : HfKind::lm_head),
                r * H + e.index % H};
      }
      case ReceiverKind::qkv:
      case ReceiverKind::qkv_bias: {
        const bool bias = x.kind == ReceiverKind::qkv_bias;
        const std::int64_t w = bias ? 1 : H, row = e.index / w, col = e.index % w;
        const std::int64_t q_local = m.q_rows() / Ts, block = nkl_ * d;
        if (row < q_local) {
          return {hf_->id(bias ? HfKind::q_bias : HfKind::q, L), (ts * q_local + row) * w + col};
        }
        const std::int64_t kv = row - q_local;
        const HfKind k =
            kv < block ? (bias ? HfKind::k_bias : HfKind::k) : (bias ? HfKind::v_bias : HfKind::v);
        return {hf_->id(k, L), ((ts / rep_) * block + kv % block) * w + col};
      }
      case ReceiverKind::o:
      case ReceiverKind::down: {
        const std::int64_t row = e.index / cols, col = e.index % cols;
        const std::int64_t full = x.kind == ReceiverKind::o ? m.q_rows() : m.intermediate;
        return {hf_->id(x.kind == ReceiverKind::o ? HfKind::o : HfKind::down, L),
                row * full + ts * cols + col};
      }
      case ReceiverKind::gate_up: {
        const std::int64_t row = e.index / H, col = e.index % H, per = m.intermediate / Ts;
        const HfKind k = row < per ? HfKind::gate : HfKind::up;
        return {hf_->id(k, L), (ts * per + row % per) * H + col};
      }
      case ReceiverKind::w13:
      case ReceiverKind::w2: {
        const std::int64_t Ms = t_.moe_tp(), El = m.experts / t_.ep;
        const std::int64_t w = m.moe_intermediate / Ms;
        const std::int64_t ep_rank = ts / Ms, tp_rank = ts % Ms;
        if (x.kind == ReceiverKind::w2) {
          const std::int64_t j = e.index / (H * w), rest = e.index % (H * w);
          const std::int64_t row = rest / w, col = rest % w;
          return {hf_->id(HfKind::expert_down, L, ep_rank * El + j),
                  row * m.moe_intermediate + tp_rank * w + col};
        }
        const std::int64_t j = e.index / (2 * w * H), rest = e.index % (2 * w * H);
        const std::int64_t row = rest / H, col = rest % H;
        const HfKind k = row < w ? HfKind::expert_gate : HfKind::expert_up;
        return {hf_->id(k, L, ep_rank * El + j), (tp_rank * w + row % w) * H + col};
      }
      case ReceiverKind::input_norm:
        return {hf_->id(HfKind::input_norm, L), e.index};
      case ReceiverKind::q_norm:
        return {hf_->id(HfKind::q_norm, L), e.index};
      case ReceiverKind::k_norm:
        return {hf_->id(HfKind::k_norm, L), e.index};
      case ReceiverKind::post_norm:
        return {hf_->id(HfKind::post_norm, L), e.index};
      case ReceiverKind::router:
        return {hf_->id(HfKind::router, L), e.index};
      case ReceiverKind::final_norm:
        return {hf_->id(HfKind::final_norm), e.index};
    }
    return {};
  }

  // The elements of tensor `id` on TP rank ts that hold data: [0, live_end). Beyond it lies the
  // zero-filled vocabulary tail (embed_tokens and lm_head only), which nothing may write.
  [[nodiscard]] std::int64_t live_end(std::int64_t ts, std::int64_t id) const {
    const ReceiverTensor& x = (*this)[id];
    if (x.kind != ReceiverKind::embed && x.kind != ReceiverKind::lm_head) return x.numel;
    const std::int64_t per = vs_ / t_.tp;
    return std::clamp<std::int64_t>(hf_->spec().vocab - ts * per, 0, per) * hf_->spec().hidden;
  }

  // Receiver elements per TP rank that hold data (the vocabulary tail excluded).
  [[nodiscard]] std::int64_t live_elements(std::int64_t ts) const {
    std::int64_t n = 0;
    for (std::int64_t id = 0; id < size(); ++id)
      n += live_end(ts, id);
    return n;
  }

 private:
  const HfModel* hf_;
  InferTopology t_;
  std::int64_t vs_ = 0, nkl_ = 1, rep_ = 1, per_layer_ = 0;
  std::vector<ReceiverTensor> tensors_;
  std::array<std::int32_t, receiver_kinds> slot_{};  // id of the kind's first tensor (layer 0)
};

}  // namespace dte::layout
