// SPDX-License-Identifier: Apache-2.0
// The FP8 receiver core: what every receiver of an online-FP8 engine's TP rank does with the
// FP8 parts of one publication (receive/fp8_part.hpp), through the engine's receiver rank
// (engine/receiver.hpp: one part per trainer rank), which the publication's FP8 ShardReceiver
// (publication/receiver.hpp: one part per message) applies through. The rules exist here once:
//   - check(): every part's writes lie in its tensors (decode_fp8_part checked that); a full
//     publication writes every code and every scale of every quantized tensor exactly once over
//     all its parts;
//   - commit(): codes and scales written in place, each overwritten value kept, the digest of
//     each quantized tensor moved by what was overwritten and written (a full publication
//     rebuilds it); with an expected digest, the publication is refused and every write undone
//     unless every tensor's digest equals it. O(written).
// The digest of a quantized tensor of N elements: the sum of element_digest(o, code) over its
// offsets o, and of element_digest(N + 2b, low half) + element_digest(N + 2b + 1, high half) of
// each block b's scale bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/numeric/round.hpp"
#include "dte/receive/fp8_part.hpp"

namespace dte::receive {

inline Digest fp8_code_digest(std::int64_t o, std::uint8_t c) noexcept {
  return element_digest(o, c);
}
inline Digest fp8_scale_digest(std::int64_t numel, std::int64_t b, float scale) noexcept {
  const std::uint32_t u = float_bits(scale);
  return element_digest(numel + 2 * b, static_cast<std::uint16_t>(u)) +
         element_digest(numel + 2 * b + 1, static_cast<std::uint16_t>(u >> 16));
}

// One quantized tensor of a rank, as the engine holds it.
struct Fp8Tensor {
  std::span<std::uint8_t> code;  // [rows, cols] E4M3FN codes
  std::span<float> scale;        // [grid_rows, grid_cols] block scales
};

class Fp8Core {
 public:
  // tensors: per quantized tensor of `grid`, in quantized_ids() order.
  Fp8Core(const layout::Fp8Grid& grid, std::string who, std::vector<Fp8Tensor> tensors)
      : grid_(&grid), who_(std::move(who)), tensors_(std::move(tensors)) {
    const std::vector<std::int64_t>& ids = grid.quantized_ids();
    if (tensors_.size() != ids.size()) {
      throw invalid_argument(who_ + ": given " + std::to_string(tensors_.size()) +
                             " FP8 tensors, the layout quantizes " + std::to_string(ids.size()));
    }
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const layout::BlockGrid& g = grid.grid(ids[k]);
      if (tensors_[k].code.size() != static_cast<std::size_t>(g.numel()) ||
          tensors_[k].scale.size() != static_cast<std::size_t>(g.blocks())) {
        throw invalid_argument(who_ + ": " + grid.layout().name(ids[k]) + " has " +
                               std::to_string(tensors_[k].code.size()) + " codes and " +
                               std::to_string(tensors_[k].scale.size()) + " scales, the layout " +
                               std::to_string(g.numel()) + " and " + std::to_string(g.blocks()));
      }
    }
    digest_.assign(ids.size(), 0);
  }

  [[nodiscard]] const layout::Fp8Grid& grid() const noexcept { return *grid_; }
  // Per quantized tensor, of its codes and scales as dte wrote them.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }

  // The first quantized tensor whose codes or scales differ from what dte wrote ("" if none):
  // the digest recomputed from every element.
  [[nodiscard]] std::string verify() const {
    const std::vector<std::int64_t>& ids = grid_->quantized_ids();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (held_digest(k) != digest_[k]) return grid_->layout().name(ids[k]);
    }
    return {};
  }

  void check(std::span<const Fp8Part> parts, bool full) const {
    if (!full) return;
    const std::vector<std::int64_t>& ids = grid_->quantized_ids();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const layout::BlockGrid& g = grid_->grid(ids[k]);
      std::vector<bool> code(static_cast<std::size_t>(g.numel()), false);
      std::vector<bool> scale(static_cast<std::size_t>(g.blocks()), false);
      std::uint64_t codes = 0, scales = 0;
      for (const Fp8Part& p : parts) {
        for (const Fp8Writes& t : p.tensors) {
          if (t.tensor != ids[k]) continue;
          for (std::uint32_t o : t.index)
            codes += code[o] ? 0 : (code[o] = true, 1);
          for (std::uint32_t b : t.block)
            scales += scale[b] ? 0 : (scale[b] = true, 1);
        }
      }
      if (codes != code.size() || scales != scale.size()) {
        throw protocol_error(who_ + ": a full publication writes " + std::to_string(codes) +
                             " distinct codes and " + std::to_string(scales) +
                             " distinct scales of " + grid_->layout().name(ids[k]) +
                             ", which has " + std::to_string(code.size()) + " and " +
                             std::to_string(scale.size()) + "; every one is written exactly once");
      }
    }
  }

  // Writes the parts; refuses (every write undone) unless each tensor's digest is then
  // expected's (when given). Returns the writes.
  std::uint64_t commit(std::span<const Fp8Part> parts, bool full,
                       std::span<const Digest> expected = {}) {
    std::vector<Digest> digest = digest_;
    if (full) std::fill(digest.begin(), digest.end(), 0);
    old_code_.clear();
    old_scale_.clear();
    std::uint64_t n = 0;
    for (const Fp8Part& p : parts) {
      for (const Fp8Writes& t : p.tensors) {
        const std::size_t k = slot(t.tensor);
        const std::int64_t numel = grid_->grid(t.tensor).numel();
        Fp8Tensor& x = tensors_[k];
        Digest& d = digest[k];
        for (std::size_t i = 0; i < t.index.size(); ++i) {
          std::uint8_t& c = x.code[t.index[i]];
          old_code_.push_back(c);
          if (!full) d -= fp8_code_digest(t.index[i], c);
          c = t.code[i];
          d += fp8_code_digest(t.index[i], c);
        }
        for (std::size_t i = 0; i < t.block.size(); ++i) {
          float& s = x.scale[t.block[i]];
          old_scale_.push_back(s);
          if (!full) d -= fp8_scale_digest(numel, t.block[i], s);
          s = t.scale[i];
          d += fp8_scale_digest(numel, t.block[i], s);
        }
        n += t.index.size() + t.block.size();
      }
    }
    if (!expected.empty()) {
      for (std::size_t k = 0; k < digest.size(); ++k) {
        if (digest[k] == expected[k]) continue;
        undo(parts);
        throw protocol_error(
            who_ + ": after the publication, " + grid_->layout().name(grid_->quantized_ids()[k]) +
            " would not hold the sender's quantization of the trainer's weights: its codes or "
            "scales were changed behind dte's back, or writes were lost; nothing was applied. "
            "Resynchronise with a full publication");
      }
    }
    digest_ = std::move(digest);
    return n;
  }

 private:
  [[nodiscard]] std::size_t slot(std::int64_t id) const {
    const std::vector<std::int64_t>& ids = grid_->quantized_ids();
    return static_cast<std::size_t>(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin());
  }

  [[nodiscard]] Digest held_digest(std::size_t k) const {
    const std::int64_t numel = static_cast<std::int64_t>(tensors_[k].code.size());
    Digest d = 0;
    for (std::size_t o = 0; o < tensors_[k].code.size(); ++o)
      d += fp8_code_digest(static_cast<std::int64_t>(o), tensors_[k].code[o]);
    for (std::size_t b = 0; b < tensors_[k].scale.size(); ++b)
      d += fp8_scale_digest(numel, static_cast<std::int64_t>(b), tensors_[k].scale[b]);
    return d;
  }

  // (backwards, so that an element written twice gets its first old value back)
  void undo(std::span<const Fp8Part> parts) noexcept {
    std::size_t c = old_code_.size(), s = old_scale_.size();
    for (std::size_t p = parts.size(); p-- > 0;) {
      for (std::size_t k = parts[p].tensors.size(); k-- > 0;) {
        const Fp8Writes& t = parts[p].tensors[k];
        Fp8Tensor& x = tensors_[slot(t.tensor)];
        for (std::size_t i = t.block.size(); i-- > 0;)
          x.scale[t.block[i]] = old_scale_[--s];
        for (std::size_t i = t.index.size(); i-- > 0;)
          x.code[t.index[i]] = old_code_[--c];
      }
    }
  }

  const layout::Fp8Grid* grid_;
  std::string who_;
  std::vector<Fp8Tensor> tensors_;
  std::vector<Digest> digest_;          // per quantized tensor
  std::vector<std::uint8_t> old_code_;  // what the last commit overwrote (undo)
  std::vector<float> old_scale_;
};

}  // namespace dte::receive
