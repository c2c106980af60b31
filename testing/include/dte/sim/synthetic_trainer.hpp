// SPDX-License-Identifier: Apache-2.0
// SyntheticTrainer: a Megatron-style trainer without a model forward pass, for tests, examples and
// benchmarks. It runs AdamW (torch.optim.AdamW order, FP32; the default), Adam with L2 weight
// decay (torch.optim.Adam) or SGD with momentum (torch.optim.SGD, dampening 0, no Nesterov), each
// the forward step its inverse in include/dte/optim assumes, with a warmup + cosine schedule and
// global-norm clipping on a decoder model (any family dte maps) sharded as a TrainTopology says,
// and every rank owns exactly the distributed-optimizer shards its TransferPlan describes.
//
// Weights at initialisation and gradients are pure functions of (seed, canonical element, step),
// from a counter-based hash (splitmix64), never of the topology: two trainers of the same model
// with different topologies hold bit-identical canonical weights after every step. The one
// global quantity, the gradient norm, is summed exactly (fixed point, order-independent), so the
// clip coefficient is the same bits under every sharding too.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dte/config.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"

namespace dte::sim {

// The optimizer SyntheticTrainer::step() runs (each in torch's operation order, FP32):
//   adamw         torch.optim.AdamW: theta *= 1 - lr*wd, then the Adam update (AdamWInverse)
//   adam          torch.optim.Adam, weight_decay as L2: g += wd*theta before the moments
//                 (AdamInverse)
//   sgd_momentum  torch.optim.SGD(momentum, dampening=0, nesterov=False): g += wd*theta;
//                 buf = g on the first step, buf*momentum + g after; theta += -lr*buf
//                 (SgdMomentumInverse)
// Weight decay applies to 2-D parameters only, whichever the optimizer.
enum class SyntheticOptimizer : std::uint8_t { adamw, adam, sgd_momentum };

struct SyntheticConfig {
  std::uint64_t seed = 0;
  double lr = 1e-6;                 // peak learning rate
  double min_lr = 0.0;              // end of the cosine decay
  std::int64_t warmup_steps = 0;    // linear from 0 (as Megatron: the first step has lr 0)
  std::int64_t total_steps = 1000;  // warmup + decay; past it lr stays min_lr
  double weight_decay = 0.1;        // on 2-D parameters only (Megatron's wd_mult 0 for 1-D)
  double clip = 1.0;                // global gradient-norm clip; <= 0 disables clipping
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  SyntheticOptimizer optimizer = SyntheticOptimizer::adamw;
  double momentum = 0.9;  // sgd_momentum only
};

namespace detail {

inline constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Streams of the counter-based generator: one per purpose, so no two purposes share draws.
enum class Stream : std::uint64_t { init = 1, grad = 2, tensor_scale = 3, step_factor = 4 };

inline constexpr std::uint64_t stream_key(std::uint64_t seed, Stream s, std::uint64_t a,
                                          std::uint64_t b) noexcept {
  return splitmix64(splitmix64(splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(s))) ^ a) ^
                    b);
}

// Draw k of a key, uniform in the open interval (0, 1).
inline double unit_open(std::uint64_t key, std::uint64_t k) noexcept {
  return (static_cast<double>(splitmix64(key + k * 0xD1B54A32D192ED03ull) >> 11) + 0.5) * 0x1p-53;
}

inline double normal(std::uint64_t key) noexcept {
  const double r = std::sqrt(-2.0 * std::log(unit_open(key, 0)));
  return r * std::cos(2.0 * std::numbers::pi * unit_open(key, 1));
}

// Student's t with 2 degrees of freedom, Z / sqrt(chi2_2 / 2), clamped to +-1e4 so that the
// fixed-point gradient-norm accumulator cannot overflow (P(|t| > 1e4) = 1e-8).
inline double student_t2(std::uint64_t key) noexcept {
  const double z = std::sqrt(-2.0 * std::log(unit_open(key, 0))) *
                   std::cos(2.0 * std::numbers::pi * unit_open(key, 1));
  const double half_chi2 = -std::log(unit_open(key, 2));
  return std::clamp(z / std::sqrt(half_chi2), -1e4, 1e4);
}

// Sum of g^2 in 128-bit fixed point with 72 fraction bits: integer addition is exact, so the
// global norm is the same bits whatever the order or the sharding of the terms. (Two 64-bit
// limbs rather than __int128, which not every compiler front end accepts.)
class NormAccumulator {
 public:
  static constexpr int fraction_bits = 72;

  void add(float g) noexcept {
    // g^2 is exact in double; |g| <= 400 (scale 1e-2, step factor 4, |t| 1e4) keeps the scaled
    // term below 2^90, so 2^38 terms fit.
    const double term = std::ldexp(static_cast<double>(g) * static_cast<double>(g), fraction_bits);
    const double high = std::floor(std::ldexp(term, -64));
    const double low = term - std::ldexp(high, 64);  // exact: a multiple of ulp(term), < 2^64
    add(static_cast<std::uint64_t>(high), static_cast<std::uint64_t>(low));
  }
  void add(const NormAccumulator& o) noexcept { add(o.hi_, o.lo_); }

  // The square root of the sum: a function of the exact sum only, never of the order.
  [[nodiscard]] double norm() const noexcept {
    const double sum = std::ldexp(static_cast<double>(hi_), 64) + static_cast<double>(lo_);
    return std::sqrt(std::ldexp(sum, -fraction_bits));
  }

 private:
  void add(std::uint64_t hi, std::uint64_t lo) noexcept {
    lo_ += lo;
    hi_ += hi + (lo_ < lo ? 1u : 0u);
  }
  std::uint64_t hi_ = 0, lo_ = 0;
};

}  // namespace detail

class SyntheticTrainer {
 public:
  // hf must outlive the trainer (its plans refer to it).
  SyntheticTrainer(const layout::HfModel& hf, const layout::TrainTopology& topology,
                   SyntheticConfig cfg = {})
      : hf_(&hf), topology_(topology), cfg_(cfg) {
    validate_config();
    layout::validate(hf.spec(), topology);
    const std::int64_t world = topology.world();
    plans_.reserve(static_cast<std::size_t>(world));
    shards_.resize(static_cast<std::size_t>(world));
    for (std::int64_t g = 0; g < world; ++g) {
      plans_.emplace_back(hf, topology, g);
      for (layout::BufferKind b : kinds) {
        const auto n = static_cast<std::size_t>(plans_.back().shard_size(b));
        Shard& s = shards_[static_cast<std::size_t>(g)][static_cast<int>(b)];
        s.theta.assign(n, 0.0f);
        if (sgd()) {
          s.momentum_buffer.assign(n, 0.0f);
        } else {
          s.exp_avg.assign(n, 0.0f);
          s.exp_avg_sq.assign(n, 0.0f);
        }
        const auto& segs = plans_.back().segments(b);
        for (std::size_t i = 0; i < segs.size(); ++i) {
          for (std::int64_t lo = 0; lo < segs[i].length; lo += chunk_elements) {
            chunks_.push_back(
                {g, static_cast<std::int32_t>(i), b, segs[i].shard_begin + lo,
                 segs[i].shard_begin + std::min(segs[i].length, lo + chunk_elements)});
          }
        }
      }
    }
    tensor_scale_.resize(static_cast<std::size_t>(hf.size()));
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      // Log-uniform in [1e-4, 1e-2].
      const std::uint64_t key = detail::stream_key(cfg_.seed, detail::Stream::tensor_scale,
                                                   static_cast<std::uint64_t>(t), 0);
      tensor_scale_[static_cast<std::size_t>(t)] =
          1e-4 * std::pow(100.0, detail::unit_open(key, 0));
    }
    initialise();
  }

  [[nodiscard]] const layout::HfModel& hf() const noexcept { return *hf_; }
  [[nodiscard]] const layout::TrainTopology& topology() const noexcept { return topology_; }
  [[nodiscard]] const SyntheticConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] std::int64_t world() const noexcept { return topology_.world(); }
  // Optimizer steps taken so far (on a non-const trainer, step() runs one: use steps_taken()).
  [[nodiscard]] std::int64_t step() const noexcept { return step_; }
  [[nodiscard]] std::int64_t steps_taken() const noexcept { return step_; }

  [[nodiscard]] const layout::TransferPlan& plan(std::int64_t rank) const {
    return plans_[checked(rank)];
  }

  [[nodiscard]] std::span<float> theta(std::int64_t rank, layout::BufferKind b) {
    return shard(rank, b).theta;
  }
  [[nodiscard]] std::span<const float> theta(std::int64_t rank, layout::BufferKind b) const {
    return shard(rank, b).theta;
  }
  // The Adam moments (empty under sgd_momentum) and SGD's momentum buffer (empty under adamw and
  // adam; zero before the first step, which sets it to the gradient).
  [[nodiscard]] std::span<float> exp_avg(std::int64_t rank, layout::BufferKind b) {
    return shard(rank, b).exp_avg;
  }
  [[nodiscard]] std::span<const float> exp_avg(std::int64_t rank, layout::BufferKind b) const {
    return shard(rank, b).exp_avg;
  }
  [[nodiscard]] std::span<float> exp_avg_sq(std::int64_t rank, layout::BufferKind b) {
    return shard(rank, b).exp_avg_sq;
  }
  [[nodiscard]] std::span<const float> exp_avg_sq(std::int64_t rank, layout::BufferKind b) const {
    return shard(rank, b).exp_avg_sq;
  }
  [[nodiscard]] std::span<float> momentum_buffer(std::int64_t rank, layout::BufferKind b) {
    return shard(rank, b).momentum_buffer;
  }
  [[nodiscard]] std::span<const float> momentum_buffer(std::int64_t rank,
                                                       layout::BufferKind b) const {
    return shard(rank, b).momentum_buffer;
  }

  // Forces the learning rate of the following steps (nullopt: back to the schedule).
  void set_lr_override(std::optional<double> lr) {
    if (lr && !(*lr >= 0.0 && std::isfinite(*lr))) {
      throw invalid_argument("SyntheticTrainer: lr override must be finite and >= 0 (got " +
                             std::to_string(*lr) + ")");
    }
    lr_override_ = lr;
  }

  // The scheduled learning rate of optimizer step `step` (1-based), Megatron's
  // OptimizerParamScheduler evaluated at the steps completed before it (step - 1).
  [[nodiscard]] double scheduled_lr(std::int64_t step) const noexcept {
    const double n = static_cast<double>(step - 1);
    const double warmup = static_cast<double>(cfg_.warmup_steps);
    if (cfg_.warmup_steps > 0 && n <= warmup) return cfg_.lr * n / warmup;
    if (step - 1 > cfg_.total_steps) return cfg_.min_lr;
    const double ratio = (n - warmup) / static_cast<double>(cfg_.total_steps - cfg_.warmup_steps);
    const double coeff = 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0);
    return cfg_.min_lr + coeff * (cfg_.lr - cfg_.min_lr);
  }

  // What the last step used: learning rate, gradient norm before clipping, clip coefficient
  // applied (1 when the norm was below the threshold).
  [[nodiscard]] double last_lr() const noexcept { return last_lr_; }
  [[nodiscard]] double last_grad_norm() const noexcept { return last_grad_norm_; }
  [[nodiscard]] double last_clip_coeff() const noexcept { return last_clip_coeff_; }

  // The hyperparameters the last step used for the parameter of `seg` (a segment of
  // plan(rank).segments(b)), ready for AdamWInverse::bind (adamw) or AdamInverse::bind (adam) on
  // that segment's sub-spans. Throws dte::invalid_argument under sgd_momentum (see sgd_hyper).
  [[nodiscard]] AdamHyperparameters hyper(std::int64_t rank, layout::BufferKind b,
                                          const layout::PlanSegment& seg) const {
    if (sgd()) {
      throw invalid_argument(
          "SyntheticTrainer::hyper: the trainer runs SGD with momentum, which has no Adam "
          "hyperparameters; use sgd_hyper");
    }
    const layout::MegatronParam& param = segment_param("hyper", rank, b, seg);
    AdamHyperparameters h;
    h.lr = last_lr_;
    h.weight_decay = decayed(param) ? cfg_.weight_decay : 0.0;
    h.beta1 = cfg_.beta1;
    h.beta2 = cfg_.beta2;
    h.eps = cfg_.eps;
    h.step = step_;
    if (cfg_.optimizer == SyntheticOptimizer::adamw) {
      h.decay_form = DecayForm::multiply;  // step() multiplies by 1 - lr*wd, as torch on the CPU
    }
    return h;
  }

  // The same for SgdMomentumInverse::bind. Throws dte::invalid_argument unless sgd_momentum.
  [[nodiscard]] SgdHyperparameters sgd_hyper(std::int64_t rank, layout::BufferKind b,
                                             const layout::PlanSegment& seg) const {
    if (!sgd()) {
      throw invalid_argument(
          "SyntheticTrainer::sgd_hyper: the trainer runs Adam, not SGD with momentum; use hyper");
    }
    const layout::MegatronParam& param = segment_param("sgd_hyper", rank, b, seg);
    SgdHyperparameters h;
    h.lr = last_lr_;
    h.momentum = cfg_.momentum;
    h.dampening = 0.0;
    h.weight_decay = decayed(param) ? cfg_.weight_decay : 0.0;
    return h;
  }

  // One optimizer step on every rank: gradients, global-norm clipping, the optimizer's update.
  void step() {
    const std::int64_t t = step_ + 1;
    const double lr = lr_override_ ? *lr_override_ : scheduled_lr(t);
    const double factor = std::clamp(
        std::exp(0.25 * detail::normal(detail::stream_key(cfg_.seed, detail::Stream::step_factor,
                                                          static_cast<std::uint64_t>(t), 0))),
        0.25, 4.0);

    // Pass 1: the global norm over the canonical gradient (senders only, exact sum).
    const auto nchunks = static_cast<std::int64_t>(chunks_.size());
    std::vector<detail::NormAccumulator> partial(chunks_.size());
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::int64_t c = 0; c < nchunks; ++c) {
      const Chunk& ch = chunks_[static_cast<std::size_t>(c)];
      const layout::TransferPlan& p = plans_[static_cast<std::size_t>(ch.rank)];
      const layout::PlanSegment& seg = p.segments(ch.buffer)[static_cast<std::size_t>(ch.segment)];
      if (!seg.sender) continue;
      const layout::MegatronParam& param = p.params()[static_cast<std::size_t>(seg.param)];
      detail::NormAccumulator sum;
      for (std::int64_t o = ch.begin; o < ch.end; ++o) {
        const layout::Canonical e = p.mapping()(param, seg.param_begin + (o - seg.shard_begin));
        if (e.tensor < 0) continue;
        sum.add(gradient(e, t, factor));
      }
      partial[static_cast<std::size_t>(c)] = sum;
    }
    detail::NormAccumulator total;
    for (const detail::NormAccumulator& x : partial)
      total.add(x);
    const double norm = total.norm();
    const double coeff = cfg_.clip > 0.0 ? cfg_.clip / (norm + 1e-6) : 1.0;
    const bool clipping = coeff < 1.0;
    const float coeff_f = static_cast<float>(coeff);

    // Pass 2: the update, in torch's order and FP32 arithmetic.
    const Pass2 pass{t, factor, clipping, coeff_f};
    switch (cfg_.optimizer) {
      case SyntheticOptimizer::adamw:
        adam_update<true>(pass, lr);
        break;
      case SyntheticOptimizer::adam:
        adam_update<false>(pass, lr);
        break;
      case SyntheticOptimizer::sgd_momentum:
        sgd_update(pass, lr);
        break;
    }
    step_ = t;
    last_lr_ = lr;
    last_grad_norm_ = norm;
    last_clip_coeff_ = clipping ? static_cast<double>(coeff_f) : 1.0;
  }

  // The full FP32 HF model (index hf[t].base + flat index), each element from its sender.
  // Throws dte::error if an element has no sender or more than one (a plan bug).
  [[nodiscard]] std::vector<float> canonical_weights() const {
    const auto total = static_cast<std::size_t>(hf_->total());
    std::vector<float> out(total, 0.0f);
    std::vector<std::uint8_t> filled(total, 0);
    for (std::int64_t g = 0; g < world(); ++g) {
      const layout::TransferPlan& p = plans_[static_cast<std::size_t>(g)];
      for (layout::BufferKind b : kinds) {
        const Shard& s = shards_[static_cast<std::size_t>(g)][static_cast<int>(b)];
        for (const layout::PlanSegment& seg : p.segments(b)) {
          if (!seg.sender) continue;
          const layout::MegatronParam& param = p.params()[static_cast<std::size_t>(seg.param)];
          for (std::int64_t k = 0; k < seg.length; ++k) {
            const layout::Canonical e = p.mapping()(param, seg.param_begin + k);
            if (e.tensor < 0) continue;
            const auto at = static_cast<std::size_t>((*hf_)[e.tensor].base + e.index);
            if (filled[at]++ != 0) {
              throw error("SyntheticTrainer: canonical element " + std::to_string(at) + " of '" +
                          hf_->name(e.tensor) + "' has more than one sender (rank " +
                          std::to_string(g) + ")");
            }
            out[at] = s.theta[static_cast<std::size_t>(seg.shard_begin + k)];
          }
        }
      }
    }
    for (std::int64_t t = 0; t < hf_->size(); ++t) {
      const layout::HfTensor& x = (*hf_)[t];
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        if (filled[static_cast<std::size_t>(x.base + i)] != 1) {
          throw error("SyntheticTrainer: canonical element " + std::to_string(i) + " of '" +
                      hf_->name(t) + "' has no sender");
        }
      }
    }
    return out;
  }

  // The weight at initialisation and the gradient of step t (1-based) of a canonical element:
  // pure functions of the seed and the element, exposed for tests.
  [[nodiscard]] float initial_value(layout::Canonical e) const noexcept {
    const layout::HfTensor& x = (*hf_)[e.tensor];
    const double z = detail::normal(detail::stream_key(
        cfg_.seed, detail::Stream::init, static_cast<std::uint64_t>(x.base + e.index), 0));
    // Norms start near 1, matrices and biases near 0.
    const bool bias = x.kind == layout::HfKind::q_bias || x.kind == layout::HfKind::k_bias ||
                      x.kind == layout::HfKind::v_bias;
    return static_cast<float>((x.cols == 0 && !bias ? 1.0 : 0.0) + 0.02 * z);
  }
  [[nodiscard]] float gradient(layout::Canonical e, std::int64_t t, double step_factor) const {
    const layout::HfTensor& x = (*hf_)[e.tensor];
    const double v = detail::student_t2(detail::stream_key(
        cfg_.seed, detail::Stream::grad, static_cast<std::uint64_t>(x.base + e.index),
        static_cast<std::uint64_t>(t)));
    return static_cast<float>(tensor_scale_[static_cast<std::size_t>(e.tensor)] * step_factor * v);
  }

 private:
  static constexpr layout::BufferKind kinds[2] = {layout::BufferKind::dense,
                                                  layout::BufferKind::expert};
  static constexpr std::int64_t chunk_elements = std::int64_t{1} << 14;

  struct Shard {
    std::vector<float> theta, exp_avg, exp_avg_sq;  // the moments: adamw and adam only
    std::vector<float> momentum_buffer;             // sgd_momentum only
  };
  // A piece of one segment: the unit of parallel work.
  struct Chunk {
    std::int64_t rank;
    std::int32_t segment;
    layout::BufferKind buffer;
    std::int64_t begin, end;  // shard offsets
  };

  // What pass 2 of step() shares between the optimizers: the step, the gradient's factor, the
  // clip coefficient.
  struct Pass2 {
    std::int64_t t;
    double factor;
    bool clipping;
    float coeff;
  };

  // Calls update(shard, i, g, decayed) for every live element of every rank's shards, g the
  // clipped gradient of step pass.t (vocabulary padding stays zero: zero weight, zero gradient).
  template <class Update>
  void for_each_element(const Pass2& pass, Update&& update) {
    const auto nchunks = static_cast<std::int64_t>(chunks_.size());
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::int64_t c = 0; c < nchunks; ++c) {
      const Chunk& ch = chunks_[static_cast<std::size_t>(c)];
      const layout::TransferPlan& p = plans_[static_cast<std::size_t>(ch.rank)];
      const layout::PlanSegment& seg = p.segments(ch.buffer)[static_cast<std::size_t>(ch.segment)];
      const layout::MegatronParam& param = p.params()[static_cast<std::size_t>(seg.param)];
      const bool decay = decayed(param);
      Shard& s = shards_[static_cast<std::size_t>(ch.rank)][static_cast<int>(ch.buffer)];
      for (std::int64_t o = ch.begin; o < ch.end; ++o) {
        const layout::Canonical e = p.mapping()(param, seg.param_begin + (o - seg.shard_begin));
        if (e.tensor < 0) continue;
        float g = gradient(e, pass.t, pass.factor);
        if (pass.clipping) g = g * pass.coeff;
        update(s, static_cast<std::size_t>(o), g, decay);
      }
    }
  }

  // torch.optim.AdamW (Decoupled) or torch.optim.Adam with weight_decay (L2: grad.add(param,
  // alpha=wd) before the moments), single-tensor order: lerp, mul/addcmul, sqrt / bc2_sqrt + eps,
  // addcdiv(-step_size).
  template <bool Decoupled>
  void adam_update(const Pass2& pass, double lr) {
    const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(pass.t));
    const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(pass.t));
    const float step_size = static_cast<float>(lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float b2 = static_cast<float>(cfg_.beta2);
    const float one_minus_b1 = static_cast<float>(1.0 - cfg_.beta1);
    const float one_minus_b2 = static_cast<float>(1.0 - cfg_.beta2);
    const float eps = static_cast<float>(cfg_.eps);
    const float decay_matrix = static_cast<float>(1.0 - lr * cfg_.weight_decay);
    const float wd = static_cast<float>(cfg_.weight_decay);
    const bool l2 = cfg_.weight_decay != 0.0;  // torch skips the add when weight_decay is 0
    for_each_element(pass, [&](Shard& s, std::size_t i, float g, bool decayed_param) {
      float pi = s.theta[i];
      if constexpr (Decoupled) {
        if (decayed_param) pi = pi * decay_matrix;
      } else {
        if (decayed_param && l2) g = g + wd * pi;
      }
      const float mi = s.exp_avg[i] + one_minus_b1 * (g - s.exp_avg[i]);  // lerp
      const float vi = s.exp_avg_sq[i] * b2 + one_minus_b2 * (g * g);
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      pi = pi - step_size * (mi / denom);
      s.theta[i] = pi;
      s.exp_avg[i] = mi;
      s.exp_avg_sq[i] = vi;
    });
  }

  // torch.optim.SGD(momentum, dampening=0, nesterov=False, maximize=False), single-tensor order:
  // grad.add(param, alpha=wd); buf = clone(grad) on the first step, buf.mul_(momentum)
  // .add_(grad) after; param.add_(buf, alpha=-lr).
  void sgd_update(const Pass2& pass, double lr) {
    const bool first = pass.t == 1;
    const float momentum = static_cast<float>(cfg_.momentum);
    const float wd = static_cast<float>(cfg_.weight_decay);
    const bool l2 = cfg_.weight_decay != 0.0;
    const float neg_lr = static_cast<float>(-lr);
    for_each_element(pass, [&](Shard& s, std::size_t i, float g, bool decayed_param) {
      const float pi = s.theta[i];
      if (decayed_param && l2) g = g + wd * pi;
      const float buf = first ? g : s.momentum_buffer[i] * momentum + g;
      s.momentum_buffer[i] = buf;
      s.theta[i] = pi + neg_lr * buf;
    });
  }

  [[nodiscard]] bool sgd() const noexcept {
    return cfg_.optimizer == SyntheticOptimizer::sgd_momentum;
  }

  // The parameter of `seg`, checked to be one of plan(rank).segments(b).
  [[nodiscard]] const layout::MegatronParam& segment_param(const char* who, std::int64_t rank,
                                                           layout::BufferKind b,
                                                           const layout::PlanSegment& seg) const {
    const layout::TransferPlan& p = plan(rank);
    const bool expert = b == layout::BufferKind::expert;
    if (seg.param < 0 || static_cast<std::size_t>(seg.param) >= p.params().size() ||
        p.params()[static_cast<std::size_t>(seg.param)].is_expert() != expert) {
      throw invalid_argument(std::string("SyntheticTrainer::") + who + ": the segment (param " +
                             std::to_string(seg.param) + ") is not one of rank " +
                             std::to_string(rank) + "'s " + (expert ? "expert" : "dense") +
                             " buffer; pass a segment of plan(rank).segments(b)");
    }
    return p.params()[static_cast<std::size_t>(seg.param)];
  }

  // Megatron decays 2-D parameters only (no decay on norms: wd_mult 0).
  static bool decayed(const layout::MegatronParam& p) noexcept { return p.cols != 0; }

  void validate_config() const {
    auto fail = [](const std::string& what) {
      throw invalid_argument("SyntheticTrainer: " + what);
    };
    if (!(cfg_.lr >= 0.0) || !(cfg_.min_lr >= 0.0) || cfg_.min_lr > cfg_.lr) {
      fail("need 0 <= min_lr <= lr (got lr=" + std::to_string(cfg_.lr) +
           ", min_lr=" + std::to_string(cfg_.min_lr) + ")");
    }
    if (cfg_.warmup_steps < 0 || cfg_.total_steps <= cfg_.warmup_steps) {
      fail("need 0 <= warmup_steps < total_steps (got " + std::to_string(cfg_.warmup_steps) + ", " +
           std::to_string(cfg_.total_steps) + ")");
    }
    if (!(cfg_.weight_decay >= 0.0) ||
        (cfg_.optimizer == SyntheticOptimizer::adamw && cfg_.lr * cfg_.weight_decay >= 1.0)) {
      fail("need weight_decay >= 0 and (AdamW) lr * weight_decay < 1");
    }
    if (cfg_.optimizer != SyntheticOptimizer::adamw && cfg_.optimizer != SyntheticOptimizer::adam &&
        cfg_.optimizer != SyntheticOptimizer::sgd_momentum) {
      fail("unknown optimizer");
    }
    if (sgd() && !(cfg_.momentum > 0.0 && cfg_.momentum <= 1.0)) {
      fail("need momentum in (0, 1] for SGD with momentum (got " + std::to_string(cfg_.momentum) +
           ")");
    }
    if (!(cfg_.beta1 >= 0.0 && cfg_.beta1 < 1.0) || !(cfg_.beta2 >= 0.0 && cfg_.beta2 < 1.0) ||
        !(cfg_.eps > 0.0)) {
      fail("need betas in [0, 1) and eps > 0");
    }
  }

  [[nodiscard]] std::size_t checked(std::int64_t rank) const {
    if (rank < 0 || rank >= world()) {
      throw invalid_argument("SyntheticTrainer: rank " + std::to_string(rank) +
                             " is outside the world of " + std::to_string(world()) + " ranks");
    }
    return static_cast<std::size_t>(rank);
  }
  [[nodiscard]] Shard& shard(std::int64_t rank, layout::BufferKind b) {
    return shards_[checked(rank)][static_cast<int>(b)];
  }
  [[nodiscard]] const Shard& shard(std::int64_t rank, layout::BufferKind b) const {
    return shards_[checked(rank)][static_cast<int>(b)];
  }

  void initialise() {
    const auto nchunks = static_cast<std::int64_t>(chunks_.size());
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::int64_t c = 0; c < nchunks; ++c) {
      const Chunk& ch = chunks_[static_cast<std::size_t>(c)];
      const layout::TransferPlan& p = plans_[static_cast<std::size_t>(ch.rank)];
      const layout::PlanSegment& seg = p.segments(ch.buffer)[static_cast<std::size_t>(ch.segment)];
      const layout::MegatronParam& param = p.params()[static_cast<std::size_t>(seg.param)];
      Shard& s = shards_[static_cast<std::size_t>(ch.rank)][static_cast<int>(ch.buffer)];
      for (std::int64_t o = ch.begin; o < ch.end; ++o) {
        // The mapping names the canonical element on non-sending replicas too, so replicas
        // start (and, with the same gradients, stay) identical to their sender.
        const layout::Canonical e = p.mapping()(param, seg.param_begin + (o - seg.shard_begin));
        if (e.tensor >= 0) s.theta[static_cast<std::size_t>(o)] = initial_value(e);
      }
    }
  }

  const layout::HfModel* hf_;
  layout::TrainTopology topology_;
  SyntheticConfig cfg_;
  std::vector<layout::TransferPlan> plans_;
  std::vector<std::array<Shard, 2>> shards_;
  std::vector<Chunk> chunks_;
  std::vector<double> tensor_scale_;
  std::optional<double> lr_override_;
  std::int64_t step_ = 0;
  double last_lr_ = 0.0;
  double last_grad_norm_ = 0.0;
  double last_clip_coeff_ = 1.0;
};

}  // namespace dte::sim
