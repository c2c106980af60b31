// SPDX-License-Identifier: Apache-2.0
// The weight update of real optimizer kernels, emulated element by element in the exact FP32
// evaluation order each one uses (read from their sources; docs/math.md lists them), given the
// moments the step has just written. Shared by the forward-variant test (whole optimizer steps)
// and the bound property test (adversarial elements). Built with -ffp-contract=off: only the
// std::fma calls below fuse, as the kernels that fuse do.
#pragma once

#include <cmath>
#include <cstdint>

namespace dte::test {

// How a kernel evaluates theta <- step(theta_prev, m, v). `decoupled` selects AdamW's decay of
// the weight (torch.optim.AdamW, ADAM_MODE_1); without it the decay went into the gradient
// (torch.optim.Adam, ADAM_MODE_0) and the weight update has no decay term.
enum class AdamOrder {
  // torch CPU: single-tensor, foreach (per-tensor addcdiv_ on CPU) and fused=True (FP32):
  //   p *= (1 - lr*wd); denom = sqrt(v) / bc2_sqrt + eps; p += (-step_size * m) / denom
  torch_cpu,
  // torch CUDA single-tensor: division by a CPU scalar becomes a multiply by its reciprocal,
  // addcdiv is a + alpha * (b / c), contracted into an FMA by nvcc.
  torch_cuda,
  // torch CUDA foreach: true division by the scalar list, the same FMA addcdiv.
  torch_cuda_foreach,
  // the same division-first order without FMA: p - step_size * (m / denom).
  torch_cuda_nofma,
  // torch CUDA fused=True: p -= lr*wd*p in double, bias corrections held in FP32 (step is a
  // float tensor), eps added in double, p -= (step_size * m) / denom.
  torch_fused_cuda,
  // TE / Apex FusedAdam: mhat = m/bc1, vhat = v/bc2, denom = sqrt(vhat) + eps,
  //   update = mhat/denom (+ wd*p for ADAM_MODE_1); p -= lr * update.
  te_fused,
  te_fused_fma,  // the same, p = fma(-lr, update, p)
  // HF transformers' old AdamW: the update first, then p -= lr*wd*p.
  decay_after,
  // everything in FP32, bias corrections with powf, an FMA for the final update.
  fp32_hyper,
  // the whole update in double, rounded once to FP32 (more accurate kernels, mixed tails).
  double_update,
};

inline constexpr AdamOrder all_adam_orders[] = {
    AdamOrder::torch_cpu,        AdamOrder::torch_cuda,       AdamOrder::torch_cuda_foreach,
    AdamOrder::torch_cuda_nofma, AdamOrder::torch_fused_cuda, AdamOrder::te_fused,
    AdamOrder::te_fused_fma,     AdamOrder::decay_after,      AdamOrder::fp32_hyper,
    AdamOrder::double_update};

inline const char* name_of(AdamOrder o) {
  switch (o) {
    case AdamOrder::torch_cpu:
      return "torch_cpu";
    case AdamOrder::torch_cuda:
      return "torch_cuda";
    case AdamOrder::torch_cuda_foreach:
      return "torch_cuda_foreach";
    case AdamOrder::torch_cuda_nofma:
      return "torch_cuda_nofma";
    case AdamOrder::torch_fused_cuda:
      return "torch_fused_cuda";
    case AdamOrder::te_fused:
      return "te_fused";
    case AdamOrder::te_fused_fma:
      return "te_fused_fma";
    case AdamOrder::decay_after:
      return "decay_after";
    case AdamOrder::fp32_hyper:
      return "fp32_hyper";
    case AdamOrder::double_update:
      return "double_update";
  }
  return "?";
}

// Whether the order multiplies the weight by 1 - lr*wd (a -0 weight stays -0) or subtracts
// lr*wd*theta (-0 becomes +0): the one property AdamHyperparameters::decay_form declares.
inline bool subtracts_decay(AdamOrder o) {
  return o == AdamOrder::torch_fused_cuda || o == AdamOrder::decay_after;
}

struct AdamStepSpec {
  double lr = 1e-6;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  std::int64_t step = 1;
  bool bias_correction = true;
  bool decoupled = true;
};

// The scalars each kernel derives once per step, in the precision it derives them.
struct AdamScalars {
  AdamOrder order;
  bool decoupled, decay;
  double lr, wd, lw, eps, step_size, bc2_sqrt;  // double, as torch's Python side
  float decay_f, neg_step_size_f, step_size_f, bc2_sqrt_f, inv_bc2_sqrt_f, eps_f;
  float lr_f, wd_f, neg_lw_f;
  float fused_step_size_f, fused_bc2_sqrt_f;  // torch fused CUDA: from FP32 bias corrections
  float te_bc1_f, te_bc2_f;                   // TE: 1 - pow(double(float(beta)), step)
  float f32_bc1, f32_bc2;                     // powf on FP32 betas
};

inline AdamScalars prepare(AdamOrder order, const AdamStepSpec& s) {
  AdamScalars k{};
  const double t = static_cast<double>(s.step);
  const double bc1 = s.bias_correction ? 1.0 - std::pow(s.beta1, t) : 1.0;
  const double bc2 = s.bias_correction ? 1.0 - std::pow(s.beta2, t) : 1.0;
  k.order = order;
  k.decoupled = s.decoupled;
  k.decay = s.decoupled && s.weight_decay != 0.0;
  k.lr = s.lr;
  k.wd = s.weight_decay;
  k.lw = s.lr * s.weight_decay;
  k.eps = s.eps;
  k.step_size = s.lr / bc1;
  k.bc2_sqrt = std::sqrt(bc2);
  k.decay_f = static_cast<float>(1.0 - k.lw);
  k.neg_step_size_f = static_cast<float>(-k.step_size);
  k.step_size_f = static_cast<float>(k.step_size);
  k.bc2_sqrt_f = static_cast<float>(k.bc2_sqrt);
  k.inv_bc2_sqrt_f = 1.0f / k.bc2_sqrt_f;
  k.eps_f = static_cast<float>(s.eps);
  k.lr_f = static_cast<float>(s.lr);
  k.wd_f = static_cast<float>(s.weight_decay);
  k.neg_lw_f = -k.lr_f * k.wd_f;
  const float fbc1 = s.bias_correction ? static_cast<float>(1.0 - std::pow(s.beta1, t)) : 1.0f;
  const float fbc2 = s.bias_correction ? static_cast<float>(1.0 - std::pow(s.beta2, t)) : 1.0f;
  k.fused_step_size_f = static_cast<float>(s.lr / static_cast<double>(fbc1));
  k.fused_bc2_sqrt_f = std::sqrt(fbc2);
  const double b1f = static_cast<float>(s.beta1), b2f = static_cast<float>(s.beta2);
  k.te_bc1_f = s.bias_correction ? static_cast<float>(1.0 - std::pow(b1f, t)) : 1.0f;
  k.te_bc2_f = s.bias_correction ? static_cast<float>(1.0 - std::pow(b2f, t)) : 1.0f;
  const float tf = static_cast<float>(t);
  k.f32_bc1 = s.bias_correction ? 1.0f - std::pow(static_cast<float>(s.beta1), tf) : 1.0f;
  k.f32_bc2 = s.bias_correction ? 1.0f - std::pow(static_cast<float>(s.beta2), tf) : 1.0f;
  return k;
}

// theta after the step, from theta before it and the moments the step wrote.
inline float adam_weight_step(const AdamScalars& k, float p, float m, float v) {
  switch (k.order) {
    case AdamOrder::torch_cpu: {
      if (k.decay) p = p * k.decay_f;
      const float denom = std::sqrt(v) / k.bc2_sqrt_f + k.eps_f;
      return p + (k.neg_step_size_f * m) / denom;
    }
    case AdamOrder::torch_cuda: {
      if (k.decay) p = p * k.decay_f;
      const float denom = std::sqrt(v) * k.inv_bc2_sqrt_f + k.eps_f;
      return std::fma(k.neg_step_size_f, m / denom, p);
    }
    case AdamOrder::torch_cuda_foreach: {
      if (k.decay) p = p * k.decay_f;
      const float denom = std::sqrt(v) / k.bc2_sqrt_f + k.eps_f;
      return std::fma(k.neg_step_size_f, m / denom, p);
    }
    case AdamOrder::torch_cuda_nofma: {
      if (k.decay) p = p * k.decay_f;
      const float denom = std::sqrt(v) / k.bc2_sqrt_f + k.eps_f;
      return p - k.step_size_f * (m / denom);
    }
    case AdamOrder::torch_fused_cuda: {
      if (k.decay) {
        const double pd = p;
        p = static_cast<float>(pd - k.lw * pd);
      }
      const float denom =
          static_cast<float>(static_cast<double>(std::sqrt(v) / k.fused_bc2_sqrt_f) + k.eps);
      return p - (k.fused_step_size_f * m) / denom;
    }
    case AdamOrder::te_fused:
    case AdamOrder::te_fused_fma: {
      const float mhat = m / k.te_bc1_f, vhat = v / k.te_bc2_f;
      const float denom = std::sqrt(vhat) + k.eps_f;
      float update = mhat / denom;
      if (k.decoupled) update = update + k.wd_f * p;
      return k.order == AdamOrder::te_fused ? p - k.lr_f * update : std::fma(-k.lr_f, update, p);
    }
    case AdamOrder::decay_after: {
      const float denom = std::sqrt(v) / k.bc2_sqrt_f + k.eps_f;
      p = p - k.step_size_f * (m / denom);
      return k.decay ? p + k.neg_lw_f * p : p;
    }
    case AdamOrder::fp32_hyper: {
      if (k.decay) p = p * (1.0f - k.lr_f * k.wd_f);
      const float denom = std::sqrt(v / k.f32_bc2) + k.eps_f;
      return std::fma(-(k.lr_f / k.f32_bc1), m / denom, p);
    }
    case AdamOrder::double_update: {
      const double c = k.decay ? 1.0 - k.lw : 1.0;
      const double denom = std::sqrt(static_cast<double>(v)) / k.bc2_sqrt + k.eps;
      return static_cast<float>(static_cast<double>(p) * c -
                                k.step_size * static_cast<double>(m) / denom);
    }
  }
  return p;
}

// SGD with momentum: theta -= lr * buf, as a multiply then an add (torch's scalar loops,
// foreach) or as one FMA (torch's vectorised CPU add, nvcc's contraction on CUDA).
enum class SgdOrder { mul_add, fma };
inline constexpr SgdOrder all_sgd_orders[] = {SgdOrder::mul_add, SgdOrder::fma};

inline const char* name_of(SgdOrder o) {
  return o == SgdOrder::mul_add ? "sgd_mul_add" : "sgd_fma";
}

inline float sgd_weight_step(SgdOrder o, float lr_f, float p, float buf) {
  return o == SgdOrder::mul_add ? p + (-lr_f) * buf : std::fma(-lr_f, buf, p);
}

}  // namespace dte::test
