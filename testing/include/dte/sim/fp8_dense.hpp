// SPDX-License-Identifier: Apache-2.0
// The dense reference for FP8 receivers (docs/fp8.md): every quantized tensor of a TP rank
// requantized from the trainer's weights, block by block (detect/fp8.hpp's recipe over
// layout/fp8_grid.hpp's grid), and one rank's tensors as an FP8 receiver holds them. (The recipe
// itself is checked against vLLM's own function in tests/python/on_vllm/test_fp8.py.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "dte/detect/fp8.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/fp8_core.hpp"

namespace dte::sim {

// The tests' model: Qwen3-shaped, with tensors of several 128 x 128 blocks that the tensor's
// edge cuts (qkv 384 x 160 at tp 1, gate_up 544 x 160, down 160 x 272).
inline layout::ModelSpec fp8_test_model() {
  layout::ModelSpec m = layout::model_preset("tiny-qwen3");
  m.name = "fp8-test";
  m.hidden = 160;
  m.layers = 2;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 48;
  m.intermediate = 272;
  m.vocab = 200;
  m.validate();
  return m;
}

struct DenseFp8 {
  std::vector<std::uint8_t> code;
  std::vector<float> scale;
};

// weights(t): HF tensor t's FP32 weights, whole.
template <class Recipe = VllmBlockFp8>
DenseFp8 dense_fp8(const layout::Fp8Grid& grid, std::int64_t ts, std::int64_t id,
                   const std::function<std::span<const float>(std::int64_t)>& weights) {
  const layout::ServingLayout& l = grid.layout();
  const layout::BlockGrid& g = grid.grid(id);
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(g.numel()));
  for (std::int64_t o = 0; o < g.numel(); ++o) {
    const layout::Canonical c = l.source({ts, id, o});
    bits[static_cast<std::size_t>(o)] =
        Bf16Format::round(weights(c.tensor)[static_cast<std::size_t>(c.index)]);
  }
  DenseFp8 d;
  d.code.resize(bits.size());
  d.scale.resize(static_cast<std::size_t>(g.blocks()));
  for (std::int64_t b = 0; b < g.blocks(); ++b) {
    float amax = 0.0f;
    for (std::int64_t r = g.row0(b); r < g.row0(b) + g.rows_of(b); ++r)
      for (std::int64_t c = g.col0(b); c < g.col0(b) + g.cols_of(b); ++c)
        amax = std::max(amax, Recipe::magnitude(bits[static_cast<std::size_t>(r * g.cols + c)]));
    const float s = Recipe::scale(amax);
    d.scale[static_cast<std::size_t>(b)] = s;
    for (std::int64_t r = g.row0(b); r < g.row0(b) + g.rows_of(b); ++r)
      for (std::int64_t c = g.col0(b); c < g.col0(b) + g.cols_of(b); ++c) {
        const auto k = static_cast<std::size_t>(r * g.cols + c);
        d.code[k] = Recipe::code(bits[k], Recipe::multiplier(s));
      }
  }
  return d;
}

// One rank's tensors, owned here: the BF16 ones (empty where quantized) and the FP8 ones.
struct Fp8RankTensors {
  std::vector<std::vector<std::uint16_t>> bf16;
  std::vector<std::vector<std::uint8_t>> code;
  std::vector<std::vector<float>> scale;
  explicit Fp8RankTensors(const layout::Fp8Grid& grid) {
    const layout::ServingLayout& l = grid.layout();
    for (std::int64_t k = 0; k < l.size(); ++k)
      bf16.emplace_back(grid.quantized(k) ? 0 : static_cast<std::size_t>(l[k].numel), 0);
    for (std::int64_t id : grid.quantized_ids()) {
      code.emplace_back(static_cast<std::size_t>(grid.grid(id).numel()), 0x7F);  // NaN
      scale.emplace_back(static_cast<std::size_t>(grid.grid(id).blocks()), -1.0f);
    }
  }
  [[nodiscard]] ReceiverTensors bf16_views() {
    ReceiverTensors v;
    for (auto& x : bf16)
      v.emplace_back(x);
    return v;
  }
  [[nodiscard]] std::vector<receive::Fp8Tensor> fp8_views() {
    std::vector<receive::Fp8Tensor> v;
    for (std::size_t k = 0; k < code.size(); ++k)
      v.push_back({code[k], scale[k]});
    return v;
  }
};

// Whether rank ts's tensors hold exactly the dense result: every code and scale of every
// quantized tensor, every live BF16 element. Returns the first tensor that differs ("").
inline std::string fp8_rank_differs(
    const layout::Fp8Grid& grid, std::int64_t ts, const Fp8RankTensors& x,
    const std::function<std::span<const float>(std::int64_t)>& weights) {
  const layout::ServingLayout& l = grid.layout();
  const std::vector<std::int64_t>& ids = grid.quantized_ids();
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const DenseFp8 d = dense_fp8(grid, ts, ids[k], weights);
    if (d.code != x.code[k]) return l.name(ids[k]) + " (codes)";
    for (std::size_t b = 0; b < d.scale.size(); ++b)
      if (float_bits(d.scale[b]) != float_bits(x.scale[k][b])) return l.name(ids[k]) + " (scales)";
  }
  for (std::int64_t k = 0; k < l.size(); ++k) {
    if (grid.quantized(k)) continue;
    for (std::int64_t o = 0; o < l.live_end(ts, k); ++o) {
      const layout::Canonical c = l.source({ts, k, o});
      if (x.bf16[static_cast<std::size_t>(k)][static_cast<std::size_t>(o)] !=
          Bf16Format::round(weights(c.tensor)[static_cast<std::size_t>(c.index)]))
        return l.name(k);
    }
  }
  return {};
}

}  // namespace dte::sim
