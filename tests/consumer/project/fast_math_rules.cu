// SPDX-License-Identifier: Apache-2.0
// Every per-element rule dte's kernels run (the optimizer inverses, BF16/FP16 detection, the FP8
// recipe), in one file that the consumer builds with --use_fast_math (CMakeLists.txt): its PTX
// shows what those flags did to them.
#include <dte/detect/detect.hpp>
#include <dte/detect/fp8.hpp>
#include <dte/optim/adam.hpp>
#include <dte/optim/sgd.hpp>

__global__ void adam_rules(dte::detail::AdamFamilyKernel k, float* out, bool* changed,
                           std::size_t n) {
  const std::size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const dte::Reconstruction r = k(i);
  out[i] = r.value;
  out[n + i] = r.error;
  changed[i] =
      dte::BF16Detect::changed(k.current(i), r) || dte::FP16Detect::changed(k.current(i), r);
}

__global__ void sgd_rules(dte::detail::SgdMomentumKernel k, float* out, std::size_t n) {
  const std::size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const dte::Reconstruction r = k(i);
  out[i] = r.value;
  out[n + i] = r.error;
}

__global__ void fp8_rules(const std::uint16_t* x, float amax, std::uint8_t* out, std::size_t n) {
  const std::size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  const float m = dte::VllmBlockFp8::multiplier(dte::VllmBlockFp8::scale(amax));
  if (i < n) out[i] = dte::VllmBlockFp8::code(x[i], m);
}
