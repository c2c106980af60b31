// SPDX-License-Identifier: Apache-2.0
// Fp8Grid: which tensors of a serving layout (layout/serving.hpp) an online-FP8 engine holds as
// FP8 blocks, and the block grid of each. vLLM quantizes its linear layers (the fused qkv_proj
// and gate_up_proj, the row-parallel o_proj and down_proj), each worker its own local [out, in]
// weight, in blocks of block_rows x block_cols counted from the tensor's first element (the last
// row and column of blocks cut short where the shape is not a multiple: the engine pads with
// zeros). Every other tensor (embeddings, lm_head, norms, biases) stays BF16. MoE experts and the
// router are not covered yet: a MoE model is refused.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/serving.hpp"

namespace dte::layout {

// One quantized tensor's grid: its local shape and the blocks over it (row-major).
struct BlockGrid {
  std::int64_t rows = 0, cols = 0;              // the local [out, in] weight
  std::int64_t block_rows = 0, block_cols = 0;  // the recipe's block
  std::int64_t grid_rows = 0, grid_cols = 0;    // blocks down and across

  [[nodiscard]] std::int64_t blocks() const noexcept { return grid_rows * grid_cols; }
  [[nodiscard]] std::int64_t numel() const noexcept { return rows * cols; }
  // The block holding local element `offset` (row-major in the [rows, cols] tensor).
  [[nodiscard]] std::int64_t block_of(std::int64_t offset) const noexcept {
    return (offset / cols / block_rows) * grid_cols + (offset % cols) / block_cols;
  }
  // Block b's first row and column, and how many rows and columns it covers.
  [[nodiscard]] std::int64_t row0(std::int64_t b) const noexcept {
    return (b / grid_cols) * block_rows;
  }
  [[nodiscard]] std::int64_t col0(std::int64_t b) const noexcept {
    return (b % grid_cols) * block_cols;
  }
  [[nodiscard]] std::int64_t rows_of(std::int64_t b) const noexcept {
    return std::min(block_rows, rows - row0(b));
  }
  [[nodiscard]] std::int64_t cols_of(std::int64_t b) const noexcept {
    return std::min(block_cols, cols - col0(b));
  }
};

class Fp8Grid {
 public:
  Fp8Grid(const ServingLayout& layout, std::int64_t block_rows, std::int64_t block_cols)
      : layout_(&layout), grids_(static_cast<std::size_t>(layout.size())) {
    if (layout.model().spec().moe()) {
      throw unsupported("FP8 receivers: the MoE experts and router of " +
                        layout.model().spec().name +
                        " are not covered yet (docs/fp8.md); serve it in BF16");
    }
    if (block_rows < 1 || block_cols < 1) {
      throw invalid_argument("Fp8Grid: the block must have at least one row and one column");
    }
    for (std::int64_t id = 0; id < layout.size(); ++id) {
      const ReceiverTensor& x = layout[id];
      if (!quantized_kind(x.kind)) continue;
      BlockGrid& g = grids_[static_cast<std::size_t>(id)];
      g.rows = x.shape[0];
      g.cols = x.shape[1];
      g.block_rows = block_rows;
      g.block_cols = block_cols;
      g.grid_rows = (g.rows + block_rows - 1) / block_rows;
      g.grid_cols = (g.cols + block_cols - 1) / block_cols;
      ids_.push_back(id);
    }
  }

  static bool quantized_kind(ReceiverKind k) noexcept {
    return k == ReceiverKind::qkv || k == ReceiverKind::o || k == ReceiverKind::gate_up ||
           k == ReceiverKind::down;
  }

  [[nodiscard]] const ServingLayout& layout() const noexcept { return *layout_; }
  [[nodiscard]] bool quantized(std::int64_t id) const {
    return grids_[static_cast<std::size_t>(id)].blocks() > 0;
  }
  // The grid of quantized tensor `id` (the same on every TP rank).
  [[nodiscard]] const BlockGrid& grid(std::int64_t id) const {
    return grids_[static_cast<std::size_t>(id)];
  }
  // The quantized tensors' ids, ascending.
  [[nodiscard]] const std::vector<std::int64_t>& quantized_ids() const noexcept { return ids_; }
  // Whether HF tensor kind k lands in a quantized tensor (biases and norms do not).
  [[nodiscard]] static bool quantized_hf(HfKind k) noexcept {
    switch (k) {
      case HfKind::q:
      case HfKind::k:
      case HfKind::v:
      case HfKind::o:
      case HfKind::gate:
      case HfKind::up:
      case HfKind::down:
        return true;
      default:
        return false;
    }
  }

 private:
  const ServingLayout* layout_;
  std::vector<BlockGrid> grids_;  // per serving tensor (empty: stays BF16)
  std::vector<std::int64_t> ids_;
};

}  // namespace dte::layout
