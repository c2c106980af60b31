// SPDX-License-Identifier: Apache-2.0
// A sharded trainer's ranks over one FlatAdamW (flat_adamw.hpp): each rank's pieces of the HF
// tensors as the PyTorch shardings split them, and the accessor that reads a rank's pieces where
// the trainer keeps them (its flat buffers, on the host or copied to a device). test_writers'
// and tests/cuda/test_cuda_publication's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/identity.hpp"
#include "dte/optim/adam.hpp"
#include "flat_adamw.hpp"

namespace dte::testing {

// Each plan segment's weights and state where the trainer keeps them: theta, m and v are its
// buffers (hf.total() elements each, canonical order), host or device memory.
struct PieceAccess {
  const FlatAdamW* tr;
  const float *theta, *m, *v;

  explicit PieceAccess(const FlatAdamW& t)
      : tr(&t), theta(t.theta.data()), m(t.m.data()), v(t.v.data()) {}
  PieceAccess(const FlatAdamW& t, const float* theta_at, const float* m_at, const float* v_at)
      : tr(&t), theta(theta_at), m(m_at), v(v_at) {}

  [[nodiscard]] std::span<const float> at(const float* a, const layout::PlanSegment& s) const {
    return {a + tr->hf[s.param].base + s.param_begin, static_cast<std::size_t>(s.length)};
  }
  [[nodiscard]] std::span<const float> segment_theta(std::int64_t, layout::BufferKind,
                                                     const layout::PlanSegment& s) const {
    return at(theta, s);
  }
  [[nodiscard]] AdamWInverse::hyperparameters hyperparameters(std::int64_t, layout::BufferKind,
                                                              const layout::PlanSegment& s) const {
    return {.lr = tr->lr,
            .weight_decay = tr->hf[s.param].cols == 0 ? 0.0 : tr->wd,
            .step = tr->steps,
            .decay_form = DecayForm::multiply};
  }
  [[nodiscard]] AdamWInverse::state state(std::int64_t, layout::BufferKind,
                                          const layout::PlanSegment& s) const {
    return {at(m, s), at(v, s)};
  }
};
static_assert(trainer_access<PieceAccess, AdamWInverse>);

enum class Split { rows, flat, columns, owner };

// Rank w's pieces of every tensor, for W ranks.
inline std::vector<layout::LocalPiece> pieces_of(const layout::HfModel& hf, Split split,
                                                 std::int64_t w, std::int64_t W) {
  std::vector<layout::LocalPiece> out;
  const auto add = [&](std::int64_t t, std::int64_t index, std::int64_t length, bool sender) {
    if (length > 0) out.push_back({t, index, length, sender});
  };
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const auto& x = hf[t];
    const std::int64_t width = x.cols == 0 ? 1 : x.cols;
    switch (split) {
      case Split::rows: {  // FSDP2 / Shard(0): ceil(rows / W) rows each, the last ones short
        const std::int64_t per = (x.rows + W - 1) / W;
        const std::int64_t r0 = std::min(x.rows, w * per), r1 = std::min(x.rows, r0 + per);
        add(t, r0 * width, (r1 - r0) * width, true);
        break;
      }
      case Split::flat: {  // FSDP1: the whole model's elements in W ranges, mid-row
        const std::int64_t per = (hf.total() + W - 1) / W;
        const std::int64_t lo = std::max(x.base, w * per);
        const std::int64_t hi = std::min(x.base + x.numel(), (w + 1) * per);
        add(t, lo - x.base, hi - lo, true);
        break;
      }
      case Split::columns: {  // Shard(1) on 2-D tensors, row by row; 1-D replicated
        if (x.cols == 0) {
          add(t, 0, x.rows, w == 0);
          break;
        }
        const std::int64_t per = (x.cols + W - 1) / W;
        const std::int64_t c0 = std::min(x.cols, w * per), c1 = std::min(x.cols, c0 + per);
        for (std::int64_t r = 0; r < x.rows; ++r)
          add(t, r * x.cols + c0, c1 - c0, true);
        break;
      }
      case Split::owner:  // ZeRO: whole tensors, round robin
        if (t % W == w) add(t, 0, x.numel(), true);
        break;
    }
  }
  // (the caller's order is not canonical order: the plan sorts)
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace dte::testing
