// SPDX-License-Identifier: Apache-2.0
// One trainer rank's optimizer shard just after an AdamW step (torch's order) in which a chosen
// fraction of the elements moved by a few BF16 ulps and the rest by far less than one: the
// input of the pipeline benchmarks (`dte bench pipeline`, bench/bench_pipeline.cpp), so every
// stage can be timed at a known changed fraction on real shard shapes. An accessor for the
// engine's stages (concept trainer_access) over it.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/layout/segment.hpp"
#include "dte/optim/adam.hpp"

namespace dte::sim {

class ControlledShard {
 public:
  // sizes: elements of the dense and expert buffers. fraction: share of elements given an
  // update of ~4 BF16 ulps (they change); the others move by ~2^-20 of their value.
  ControlledShard(std::int64_t dense, std::int64_t expert, double fraction, std::uint64_t seed) {
    h_.lr = 1e-6;
    h_.weight_decay = 0.0;
    h_.step = 100;
    h_.decay_form = DecayForm::multiply;
    const double bc1 = 1.0 - std::pow(h_.beta1, 100.0), bc2 = 1.0 - std::pow(h_.beta2, 100.0);
    const auto step_size = static_cast<float>(h_.lr / bc1);
    const auto bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const auto eps = static_cast<float>(h_.eps);
    const std::uint64_t threshold =
        fraction >= 1.0 ? ~std::uint64_t{0}
                        : static_cast<std::uint64_t>(fraction * 18446744073709551616.0);
    const std::int64_t sizes[2] = {dense, expert};
    for (int b = 0; b < 2; ++b) {
      const auto n = static_cast<std::size_t>(sizes[b]);
      theta_[b].resize(n);
      m_[b].resize(n);
      v_[b].resize(n);
      float* p = theta_[b].data();
      float* m = m_[b].data();
      float* v = v_[b].data();
      DTE_OMP(parallel for schedule(static))
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t r =
            mix(seed * 0x9E3779B97F4A7C15ull + (i << 1) + static_cast<std::uint64_t>(b));
        const std::uint64_t r2 = mix(r);
        // theta_prev ~ uniform magnitude in [2^-9, 2^-5) with a random sign (weight-like)
        const float p0 = std::ldexp(1.0f + static_cast<float>(r2 >> 40) * 0x1p-24f,
                                    -9 + static_cast<int>((r2 >> 8) % 4)) *
                         ((r2 & 1) ? -1.0f : 1.0f);
        const float vi = 1e-10f;
        const float denom = std::sqrt(vi) / bc2_sqrt + eps;
        const bool moves = r < threshold;
        const float u =
            std::fabs(p0) * (moves ? 0x1p-6f : 0x1p-20f) * ((r >> 3 & 1) ? 1.0f : -1.0f);
        const float mi = u * denom / step_size;
        p[i] = p0 + (-step_size * mi) / denom;  // torch CPU: p += (-step_size * m) / denom
        m[i] = mi;
        v[i] = vi;
      }
    }
  }

  [[nodiscard]] std::span<const float> theta(std::int64_t, layout::BufferKind b) const {
    return theta_[static_cast<int>(b)];
  }
  [[nodiscard]] AdamHyperparameters hyperparameters(std::int64_t, layout::BufferKind,
                                                    const layout::PlanSegment&) const {
    return h_;
  }
  [[nodiscard]] AdamState state(std::int64_t, layout::BufferKind b,
                                const layout::PlanSegment& s) const {
    const auto part = [&](const std::vector<float>& x) {
      return std::span<const float>(x).subspan(static_cast<std::size_t>(s.shard_begin),
                                               static_cast<std::size_t>(s.length));
    };
    return {part(m_[static_cast<int>(b)]), part(v_[static_cast<int>(b)])};
  }

  // The benchmarks' STREAM-style reference: buffer b's theta, exp_avg and exp_avg_sq (the
  // detect stage's 12 bytes per element) read once on the executor's threads, in blocks of 64K
  // elements (integer ORs of their bits, so the compiler vectorises it without reassociating
  // floats). Returns the OR, which the caller keeps alive.
  template <executor Exec>
  std::uint32_t read_once(const Exec& exec, layout::BufferKind b) const {
    const int k = static_cast<int>(b);
    const float *a = theta_[k].data(), *m = m_[k].data(), *v = v_[k].data();
    const std::size_t n = theta_[k].size(), blocks = (n + 65535) / 65536;
    std::vector<std::uint32_t> partial(static_cast<std::size_t>(exec.threads()), 0);
    exec.for_each(blocks, [&](std::size_t blk, int w) {
      const std::size_t lo = blk * 65536, hi = std::min(n, lo + 65536);
      std::uint32_t acc = 0;
      for (std::size_t i = lo; i < hi; ++i)
        acc |= std::bit_cast<std::uint32_t>(a[i]) ^ std::bit_cast<std::uint32_t>(m[i]) ^
               std::bit_cast<std::uint32_t>(v[i]);
      partial[static_cast<std::size_t>(w)] |= acc;
    });
    std::uint32_t all = 0;
    for (std::uint32_t x : partial)
      all |= x;
    return all;
  }

 private:
  static std::uint64_t mix(std::uint64_t x) noexcept {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  AdamHyperparameters h_;
  std::vector<float> theta_[2], m_[2], v_[2];
};

static_assert(trainer_access<ControlledShard, AdamWInverse>);

}  // namespace dte::sim
