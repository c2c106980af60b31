// SPDX-License-Identifier: Apache-2.0
// The CUDA backend against the host backend and against the hardware:
//   - dte's rounding equals the device's own __float2bfloat16_rn / __float2half_rn on all 2^32
//     FP32 inputs (the host test compares with CUDA's host emulation; this one with the GPU);
//   - dte::cuda::classify and dte::cuda::audit give the host backend's verdicts, element for
//     element, and its audit counts, for every shipped inverse and detector;
//   - empty shards, sizes that are not a multiple of the block, more than 2^31 elements;
//   - the executor suite (tests/conformance/executor_suite.hpp) over exec::Cuda: on the default
//     stream without a device, on a stream of its own with device work in flight on one.
// Built with -fmad=false, as the host side is built with -ffp-contract=off: see exec/cuda.cuh.
// Without a device only the "no_device" suite runs, then the program exits with kSkipCode, which
// CTest reports as Skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "../conformance/executor_suite.hpp"
#include "dte/dte.hpp"
#include "dte/exec/cuda.cuh"

namespace {

constexpr int kSkipCode = 77;  // SKIP_RETURN_CODE in tests/cuda/CMakeLists.txt

// ---- device memory and streams ------------------------------------------------------------------

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ != 0) DTE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&ptr_), n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (n_ != 0) {
      DTE_CUDA_TRY(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  ~DeviceBuffer() { (void)cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  [[nodiscard]] T* get() const noexcept { return ptr_; }

  [[nodiscard]] std::vector<T> download(std::size_t first, std::size_t count) const {
    std::vector<T> host(count);
    if (count != 0) {
      DTE_CUDA_TRY(
          cudaMemcpy(host.data(), ptr_ + first, count * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return host;
  }
  [[nodiscard]] std::vector<T> download() const { return download(0, n_); }

 private:
  std::size_t n_;
  T* ptr_ = nullptr;
};

using Stream = dte::exec::Stream;

unsigned resident_blocks() {
  int device = 0;
  DTE_CUDA_TRY(cudaGetDevice(&device));
  int sms = 0;
  DTE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<unsigned>(sms) * 8u;
}

// ---- reproducible data (counter-based, as in tests/optim/test_forward_variants.cpp) ------------

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
double uniform(std::uint64_t key) {
  return static_cast<double>(mix(key) >> 11) * 0x1.0p-53;
}
double normal(std::uint64_t key) {
  const double u1 = uniform(key * 2 + 1) + 0x1.0p-54, u2 = uniform(key * 2 + 2);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}
float shifted(float x, int ulps) {
  return dte::bits_float(dte::float_bits(x) + static_cast<std::uint32_t>(ulps));
}

// Weights as trainers hold them, plus the cases that break careless code: zeros of both signs,
// FP32 subnormals, magnitudes around FP16's subnormal range, and values within 4 ulps of a BF16
// or an FP16 rounding boundary.
float weight(std::uint64_t key) {
  const double kind = uniform(key ^ 0xABCDEFull);
  const double z = normal(key);
  const int ulps = static_cast<int>(mix(key ^ 0x55ull) % 9) - 4;
  if (kind < 0.55) return static_cast<float>(0.02 * z);
  if (kind < 0.62) return static_cast<float>(1.0 + 0.05 * z);
  if (kind < 0.66) return (mix(key ^ 0x11ull) & 1u) != 0 ? 0.0f : -0.0f;
  if (kind < 0.69) return static_cast<float>(1e-30 * z);
  if (kind < 0.72) {
    const std::uint32_t sign = (mix(key ^ 0x33ull) & 1u) << 31;
    return dte::bits_float(sign | static_cast<std::uint32_t>(mix(key ^ 0x22ull) % 0x00800000u));
  }
  if (kind < 0.76) return static_cast<float>(std::ldexp(z, -24));
  if (kind < 0.88) {
    const float base = static_cast<float>(0.02 * z);
    return shifted(dte::bits_float((dte::float_bits(base) & 0xFFFF0000u) | 0x8000u), ulps);
  }
  // FP16: halfway between a value and the next one away from zero (exact in FP32).
  const std::uint16_t h = dte::round_fp16(static_cast<float>(0.02 * z));
  const float mid =
      0.5f * (dte::fp16_to_float(h) + dte::fp16_to_float(static_cast<std::uint16_t>(h + 1u)));
  return shifted(mid, ulps);
}

// Optimizer state after the step: heavy-tailed first moments, with exact zeros of both signs
// and FP32 subnormals; second moments consistent with them, zero where the first is.
float first_moment(std::uint64_t key) {
  const double kind = uniform(key ^ 0x77ull);
  if (kind < 0.04) return (mix(key ^ 0x99ull) & 1u) != 0 ? 0.0f : -0.0f;
  if (kind < 0.05) return static_cast<float>(1e-40 * normal(key));
  const double scale = std::pow(10.0, -6.0 + 3.0 * uniform(key ^ 0x5EEDull));
  return static_cast<float>(scale * normal(key ^ 0x1234ull) /
                            (std::fabs(normal(key ^ 0x4321ull)) + 0.05));
}
float second_moment(float m, std::uint64_t key) {
  if (m == 0.0f) return 0.0f;
  const double mm = static_cast<double>(m);
  return static_cast<float>(mm * mm * (0.5 + 4.0 * uniform(key ^ 0xF00Dull)));
}

struct Shard {
  std::vector<float> prev;   // the truth before the step (dte never needs it in production)
  std::vector<float> theta;  // after the step
  std::vector<float> m;      // exp_avg, or SGD's momentum buffer
  std::vector<float> v;      // exp_avg_sq
};

constexpr dte::AdamHyperparameters kAdam{.lr = 3e-5, .weight_decay = 0.1, .step = 7};
constexpr dte::SgdHyperparameters kSgd{.lr = 1e-3, .momentum = 0.9};

enum class Forward { adamw, adam_l2, sgd };

// One optimizer step in FP32, the way torch.optim runs it (decay first, then addcdiv).
Shard make_shard(std::size_t n, std::uint64_t seed, Forward forward) {
  Shard s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n),
          std::vector<float>(n)};
  const double bc1 = 1.0 - std::pow(kAdam.beta1, static_cast<double>(kAdam.step));
  const double bc2 = 1.0 - std::pow(kAdam.beta2, static_cast<double>(kAdam.step));
  const float decay = static_cast<float>(1.0 - kAdam.lr * kAdam.weight_decay);
  const float step_size = static_cast<float>(kAdam.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(kAdam.eps);
  const float sgd_lr = static_cast<float>(kSgd.lr);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t key = seed * 0x1000000000ull + i;
    const float p = weight(key);
    const float m = first_moment(key ^ 0xC0FFEEull);
    const float v = second_moment(m, key);
    s.prev[i] = p;
    s.m[i] = m;
    s.v[i] = v;
    switch (forward) {
      case Forward::adamw:
      case Forward::adam_l2: {
        const float decayed = forward == Forward::adamw ? p * decay : p;
        const float denom = std::sqrt(v) / bc2_sqrt + eps;
        s.theta[i] = decayed - step_size * (m / denom);
        break;
      }
      case Forward::sgd:
        s.theta[i] = p + (-sgd_lr) * m;
        break;
    }
  }
  return s;
}

struct DeviceShard {
  explicit DeviceShard(const Shard& s) : prev(s.prev), theta(s.theta), m(s.m), v(s.v) {}
  DeviceBuffer<float> prev, theta, m, v;
};

// bind() validates its spans on the host; the device runs a copy pointed at device memory.
dte::detail::AdamFamilyKernel on_device(dte::detail::AdamFamilyKernel k, const DeviceShard& d) {
  k.theta = d.theta.get();
  k.exp_avg = d.m.get();
  k.exp_avg_sq = d.v.get();
  return k;
}
dte::detail::SgdMomentumKernel on_device(dte::detail::SgdMomentumKernel k, const DeviceShard& d) {
  k.theta = d.theta.get();
  k.buffer = d.m.get();
  return k;
}
template <class F>
dte::detail::SnapshotKernel<F> on_device(dte::detail::SnapshotKernel<F> k, const DeviceShard& d,
                                         const std::uint16_t* d_published) {
  k.theta = d.theta.get();
  k.published = d_published;
  return k;
}

// The reconstruction without its error bound: it misses changes, so it exercises the missed
// count and first_missed.
template <class Kernel>
struct WithoutGuardBand {
  Kernel k;
  DTE_HOST_DEVICE std::size_t size() const noexcept { return k.size(); }
  DTE_HOST_DEVICE float current(std::size_t i) const noexcept { return k.current(i); }
  DTE_HOST_DEVICE dte::Reconstruction operator()(std::size_t i) const noexcept {
    return {k(i).value, 0.0f, false};
  }
};

// ---- comparison with the host backend ---------------------------------------------------------

void check_same_counts(const dte::AuditCounts& host, const dte::AuditCounts& device) {
  CHECK(device.elements == host.elements);
  CHECK(device.true_changed == host.true_changed);
  CHECK(device.detected == host.detected);
  CHECK(device.missed == host.missed);
  CHECK(device.guard_extra == host.guard_extra);
  CHECK(device.first_missed == host.first_missed);
  CHECK(device.bound_violations == host.bound_violations);
  CHECK(device.first_violation == host.first_violation);
  CHECK(device.worst_bound_ratio == host.worst_bound_ratio);
}

template <class Detect, class Kernel>
void check_verdicts(const Kernel& host_k, const std::vector<dte::Verdict>& device,
                    std::size_t first, std::array<std::uint64_t, 3>* seen = nullptr) {
  std::uint64_t mismatches = 0;
  std::size_t first_mismatch = 0;
  for (std::size_t j = 0; j < device.size(); ++j) {
    const std::size_t i = first + j;
    const dte::Verdict host = Detect::classify(host_k.current(i), host_k(i));
    if (seen != nullptr) ++(*seen)[static_cast<std::size_t>(host)];
    if (device[j] != host) {
      if (mismatches++ == 0) first_mismatch = i;
    }
  }
  INFO("first element whose device verdict differs: " << first_mismatch);
  CHECK(mismatches == 0);
}

// classify and audit on the device == the host loop and dte::audit_reconstruction.
// Returns the host's audit counts, for the caller's own expectations.
template <class Detect, class Kernel>
dte::AuditCounts check_against_host(const char* what, const Kernel& host_k, const Kernel& device_k,
                                    std::span<const float> prev, const float* d_prev,
                                    cudaStream_t stream, bool expect_guard) {
  CAPTURE(what);
  const std::size_t n = host_k.size();
  DeviceBuffer<dte::Verdict> d_verdicts(n);
  dte::cuda::classify<Detect>(device_k, d_verdicts.get(), stream);
  DTE_CUDA_TRY(cudaStreamSynchronize(stream));
  std::array<std::uint64_t, 3> seen{};
  check_verdicts<Detect>(host_k, d_verdicts.download(), 0, &seen);
  // The data must reach every branch of the detector to mean anything.
  CHECK(seen[static_cast<std::size_t>(dte::Verdict::changed)] > 0);
  CHECK(seen[static_cast<std::size_t>(dte::Verdict::unchanged)] > 0);
  if (expect_guard) CHECK(seen[static_cast<std::size_t>(dte::Verdict::guard)] > 0);

  const dte::AuditCounts host = dte::audit_reconstruction<Detect>(host_k, prev);
  const dte::AuditCounts device = dte::cuda::audit<Detect>(device_k, d_prev, stream);
  std::printf("%-28s %-4s n=%zu changed %llu guard-only %llu missed %llu\n", what,
              Detect::format::name, n, static_cast<unsigned long long>(host.true_changed),
              static_cast<unsigned long long>(host.guard_extra),
              static_cast<unsigned long long>(host.missed));
  check_same_counts(host, device);
  return host;
}

// ---- device-side checks against the hardware ----------------------------------------------------

struct RoundingMismatches {
  unsigned long long bf16_count;
  unsigned long long bf16_first;
  unsigned long long fp16_count;
  unsigned long long fp16_first;
};

__global__ void compare_rounding_with_hardware(RoundingMismatches* d_out) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i <= 0xFFFFFFFFull; i += stride) {
    const float x = __uint_as_float(static_cast<unsigned>(i));
    if (dte::round_bf16(x) != __bfloat16_as_ushort(__float2bfloat16_rn(x))) {
      atomicAdd(&d_out->bf16_count, 1ull);
      atomicMin(&d_out->bf16_first, static_cast<unsigned long long>(i));
    }
    if (dte::round_fp16(x) != __half_as_ushort(__float2half_rn(x))) {
      atomicAdd(&d_out->fp16_count, 1ull);
      atomicMin(&d_out->fp16_first, static_cast<unsigned long long>(i));
    }
  }
}

DTE_HOST_DEVICE bool is_nan(float x) noexcept {
  return (dte::float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u;
}

// Widening every 16-bit pattern; NaNs only need to stay NaNs.
__global__ void compare_widening_with_hardware(unsigned long long* d_bad) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > 0xFFFFu) return;
  const auto b = static_cast<std::uint16_t>(i);
  const float ours_bf16 = dte::bf16_to_float(b);
  const float hw_bf16 = __bfloat162float(__ushort_as_bfloat16(b));
  const bool bf16_ok = dte::Bf16Format::is_nan(b)
                           ? (is_nan(ours_bf16) && is_nan(hw_bf16))
                           : __float_as_uint(ours_bf16) == __float_as_uint(hw_bf16);
  const float ours_fp16 = dte::fp16_to_float(b);
  const float hw_fp16 = __half2float(__ushort_as_half(b));
  const bool fp16_ok = dte::Fp16Format::is_nan(b)
                           ? (is_nan(ours_fp16) && is_nan(hw_fp16))
                           : __float_as_uint(ours_fp16) == __float_as_uint(hw_fp16);
  if (!bf16_ok) atomicAdd(&d_bad[0], 1ull);
  if (!fp16_ok) atomicAdd(&d_bad[1], 1ull);
}

// A shard whose element i is a function of i alone, so that any size fits in memory: by i % 3 a
// change, a guard-band-only flag, or no change; two planted misses beyond 2^31.
struct IndexedShard {
  std::size_t n;
  std::size_t miss_a;
  std::size_t miss_b;

  DTE_HOST_DEVICE int kind(std::size_t i) const noexcept {
    return i == miss_a || i == miss_b ? 3 : static_cast<int>(i % 3);
  }
  DTE_HOST_DEVICE std::size_t size() const noexcept { return n; }
  DTE_HOST_DEVICE float current(std::size_t) const noexcept { return 1.0f; }
  DTE_HOST_DEVICE dte::Reconstruction operator()(std::size_t i) const noexcept {
    switch (kind(i)) {
      case 0:
        return {2.0f, 0.0f, false};  // rounds elsewhere: changed
      case 1:
        // One FP32 ulp below the BF16 midpoint above 1.0, known to 2^-20: guard band.
        return {dte::bits_float(0x3F807FFFu), 0x1p-20f, false};
      default:
        return {1.0f, 0.0f, false};  // exactly the current value
    }
  }
  // What the element really held: the planted misses changed although the inverse says not.
  DTE_HOST_DEVICE float truth(std::size_t i) const noexcept {
    const int k = kind(i);
    return k == 0 ? 2.0f : (k == 3 ? 3.0f : 1.0f);
  }
};

__global__ void fill_truth(IndexedShard shard, float* d_prev) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < shard.n;
       i += stride) {
    d_prev[i] = shard.truth(i);
  }
}

}  // namespace

// ---- checks that need no device
// ------------------------------------------------------------------

TEST_SUITE("no_device") {
  TEST_CASE("DTE_CUDA_TRY throws dte::cuda_error naming the status, the call and the place") {
    const int line = __LINE__ + 2;
    try {
      DTE_CUDA_TRY(cudaErrorInvalidValue);
      FAIL("DTE_CUDA_TRY did not throw");
    } catch (const dte::cuda_error& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(e.code() == cudaErrorInvalidValue);
      CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);
      CHECK(what.find("test_cuda_backend.cu:" + std::to_string(line)) != std::string::npos);
      CHECK(e.where().line() == static_cast<unsigned>(line));
    }
    CHECK_NOTHROW([] { DTE_CUDA_TRY(cudaSuccess); }());
    // A dte::cuda_error is a dte::error like every other failure of the host API.
    CHECK_THROWS_AS([] { DTE_CUDA_TRY(cudaErrorMemoryAllocation); }(), dte::error);
  }

  TEST_CASE("device_count never throws") {
    int count = -1;
    CHECK_NOTHROW(count = dte::cuda::device_count());
    CHECK(count >= 0);
  }

  // The executor concept's primitives take host callables and run them on the calling thread
  // (exec/cuda.cuh): the suite needs no device for them, and the default stream is only a handle.
  TEST_CASE("executor conformance: exec::Cuda on the default stream") {
    const dte::exec::Cuda exec;
    CHECK(exec.threads() == 1);
    dte::executor_suite::run(exec);
  }
}

// ---- checks on the device -----------------------------------------------------------------------

TEST_SUITE("device") {
  TEST_CASE("exhaustive: dte rounding == __float2bfloat16_rn / __float2half_rn on the device") {
    DeviceBuffer<RoundingMismatches> d_result(1);
    DTE_CUDA_TRY(cudaMemset(d_result.get(), 0, sizeof(RoundingMismatches)));
    DTE_CUDA_TRY(cudaMemset(&d_result.get()->bf16_first, 0xFF, sizeof(unsigned long long)));
    DTE_CUDA_TRY(cudaMemset(&d_result.get()->fp16_first, 0xFF, sizeof(unsigned long long)));
    compare_rounding_with_hardware<<<resident_blocks(), 256>>>(d_result.get());
    DTE_CUDA_TRY(cudaGetLastError());
    DTE_CUDA_TRY(cudaDeviceSynchronize());
    const RoundingMismatches r = d_result.download()[0];
    INFO("first bf16 mismatch at input bits 0x" << std::hex << r.bf16_first);
    INFO("first fp16 mismatch at input bits 0x" << std::hex << r.fp16_first);
    CHECK(r.bf16_count == 0);
    CHECK(r.fp16_count == 0);
  }

  TEST_CASE("widening all 2^16 patterns == __bfloat162float / __half2float on the device") {
    DeviceBuffer<unsigned long long> d_bad(2);
    DTE_CUDA_TRY(cudaMemset(d_bad.get(), 0, 2 * sizeof(unsigned long long)));
    compare_widening_with_hardware<<<65536 / 256, 256>>>(d_bad.get());
    DTE_CUDA_TRY(cudaGetLastError());
    const std::vector<unsigned long long> bad = d_bad.download();
    CHECK(bad[0] == 0);
    CHECK(bad[1] == 0);
  }

  TEST_CASE("differential: classify and audit on the device == the host backend") {
    constexpr std::size_t n = 3'000'017;  // a few million, not a multiple of the block
    const Stream stream;

    // Guarded inverses and the snapshot must miss nothing; without the guard band the inverses
    // do miss changes, so the missed count and first_missed are compared on real misses too.
    SUBCASE("AdamW") {
      const Shard s = make_shard(n, 1, Forward::adamw);
      const DeviceShard d(s);
      const auto k = dte::AdamWInverse::bind(kAdam, s.theta, {s.m, s.v});
      const auto dk = on_device(k, d);
      const float* d_prev = d.prev.get();
      CHECK(check_against_host<dte::BF16Detect>("AdamWInverse", k, dk, s.prev, d_prev, stream, true)
                .missed == 0);
      CHECK(check_against_host<dte::FP16Detect>("AdamWInverse", k, dk, s.prev, d_prev, stream, true)
                .missed == 0);
      const WithoutGuardBand<decltype(k)> bare{k}, bare_device{dk};
      CHECK(check_against_host<dte::BF16Detect>("AdamWInverse, no guard band", bare, bare_device,
                                                s.prev, d_prev, stream, false)
                .missed > 0);
      CHECK(check_against_host<dte::FP16Detect>("AdamWInverse, no guard band", bare, bare_device,
                                                s.prev, d_prev, stream, false)
                .missed > 0);
    }
    SUBCASE("Adam with L2 decay") {
      const Shard s = make_shard(n, 2, Forward::adam_l2);
      const DeviceShard d(s);
      const auto k = dte::AdamInverse::bind(kAdam, s.theta, {s.m, s.v});
      const auto dk = on_device(k, d);
      const float* d_prev = d.prev.get();
      CHECK(check_against_host<dte::BF16Detect>("AdamInverse", k, dk, s.prev, d_prev, stream, true)
                .missed == 0);
      CHECK(check_against_host<dte::FP16Detect>("AdamInverse", k, dk, s.prev, d_prev, stream, true)
                .missed == 0);
    }
    SUBCASE("SGD with momentum") {
      const Shard s = make_shard(n, 3, Forward::sgd);
      const DeviceShard d(s);
      const auto k = dte::SgdMomentumInverse::bind(kSgd, s.theta, {s.m});
      const auto dk = on_device(k, d);
      const float* d_prev = d.prev.get();
      CHECK(check_against_host<dte::BF16Detect>("SgdMomentumInverse", k, dk, s.prev, d_prev, stream,
                                                true)
                .missed == 0);
      CHECK(check_against_host<dte::FP16Detect>("SgdMomentumInverse", k, dk, s.prev, d_prev, stream,
                                                true)
                .missed == 0);
      const WithoutGuardBand<decltype(k)> bare{k}, bare_device{dk};
      CHECK(check_against_host<dte::BF16Detect>("SgdMomentumInverse, no guard", bare, bare_device,
                                                s.prev, d_prev, stream, false)
                .missed > 0);
    }
    SUBCASE("SnapshotBase") {
      const Shard s = make_shard(n, 4, Forward::adamw);
      const DeviceShard d(s);
      const float* d_prev = d.prev.get();
      const dte::SnapshotBase::Shadow bf16_shadow(s.prev);
      const dte::SnapshotBaseFp16::Shadow fp16_shadow(s.prev);
      const auto bf16_bits = bf16_shadow.view().published;
      const auto fp16_bits = fp16_shadow.view().published;
      const DeviceBuffer<std::uint16_t> d_bf16(
          std::vector<std::uint16_t>(bf16_bits.begin(), bf16_bits.end()));
      const DeviceBuffer<std::uint16_t> d_fp16(
          std::vector<std::uint16_t>(fp16_bits.begin(), fp16_bits.end()));
      const auto kb = dte::SnapshotBase::bind({}, s.theta, bf16_shadow.view());
      const auto kf = dte::SnapshotBaseFp16::bind({}, s.theta, fp16_shadow.view());
      CHECK(check_against_host<dte::BF16Detect>("SnapshotBase", kb, on_device(kb, d, d_bf16.get()),
                                                s.prev, d_prev, stream, false)
                .missed == 0);
      CHECK(check_against_host<dte::FP16Detect>("SnapshotBaseFp16", kf,
                                                on_device(kf, d, d_fp16.get()), s.prev, d_prev,
                                                stream, false)
                .missed == 0);
    }
  }

  TEST_CASE("edge: an empty shard, and sizes that are not a multiple of the block") {
    const Shard s = make_shard(1'000'003, 5, Forward::adamw);
    const DeviceShard d(s);
    const Stream stream;
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256},
                                std::size_t{257}, std::size_t{65'537}, std::size_t{1'000'003}}) {
      CAPTURE(n);
      const std::span<const float> theta(s.theta.data(), n), m(s.m.data(), n), v(s.v.data(), n);
      const std::span<const float> prev(s.prev.data(), n);
      const auto k = dte::AdamWInverse::bind(kAdam, theta, {m, v});
      const auto dk = on_device(k, d);

      // Verdicts land in [0, n) and nowhere else.
      constexpr std::size_t kTail = 64;
      DeviceBuffer<dte::Verdict> d_out(n + kTail);
      DTE_CUDA_TRY(cudaMemset(d_out.get(), 0xAB, n + kTail));
      dte::cuda::classify<dte::BF16Detect>(dk, n == 0 ? nullptr : d_out.get(), stream);
      DTE_CUDA_TRY(cudaStreamSynchronize(stream));
      const std::vector<dte::Verdict> out = d_out.download();
      check_verdicts<dte::BF16Detect>(
          k, std::vector<dte::Verdict>(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n)),
          0);
      std::size_t tail_written = 0;
      for (std::size_t i = n; i < n + kTail; ++i)
        tail_written += static_cast<std::uint8_t>(out[i]) != 0xAB;
      CHECK(tail_written == 0);

      const dte::AuditCounts host = dte::audit_reconstruction<dte::BF16Detect>(k, prev);
      const dte::AuditCounts device = dte::cuda::audit<dte::BF16Detect>(dk, d.prev.get(), stream);
      check_same_counts(host, device);
      if (n == 0) {
        CHECK(device.elements == 0);
        CHECK(device.first_missed == -1);
      }
    }
  }

  TEST_CASE("more than 2^31 elements: 64-bit indices in classify and audit") {
    const std::size_t n = (std::size_t{1} << 31) + 1001;
    const IndexedShard shard{n, (std::size_t{1} << 31) + 7, n - 1};
    std::size_t free_bytes = 0, total_bytes = 0;
    DTE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (free_bytes < n * (sizeof(float) + sizeof(dte::Verdict)) + (std::size_t{1} << 30)) {
      MESSAGE("skipped: needs " << n * 5 / (1 << 20) << " MiB of free device memory");
      return;
    }
    const Stream stream;
    {
      DeviceBuffer<dte::Verdict> d_out(n);
      dte::cuda::classify<dte::BF16Detect>(shard, d_out.get(), stream);
      DTE_CUDA_TRY(cudaStreamSynchronize(stream));
      check_verdicts<dte::BF16Detect>(shard, d_out.download(0, 4096), 0);
      const std::size_t tail = (std::size_t{1} << 31) - 2048;
      check_verdicts<dte::BF16Detect>(shard, d_out.download(tail, n - tail), tail);
    }
    DeviceBuffer<float> d_prev(n);
    fill_truth<<<resident_blocks(), 256, 0, stream>>>(shard, d_prev.get());
    DTE_CUDA_TRY(cudaGetLastError());
    const dte::AuditCounts c = dte::cuda::audit<dte::BF16Detect>(shard, d_prev.get(), stream);

    // i % 3 == k occurs n / 3 times, once more for the k < n % 3; the misses replace two.
    std::array<std::uint64_t, 4> of_kind{};
    for (std::size_t k = 0; k < 3; ++k)
      of_kind[k] = n / 3 + (k < n % 3 ? 1 : 0);
    --of_kind[shard.miss_a % 3];
    --of_kind[shard.miss_b % 3];
    of_kind[3] = 2;
    CHECK(c.elements == n);
    CHECK(c.true_changed == of_kind[0] + of_kind[3]);
    CHECK(c.detected == of_kind[0] + of_kind[1]);
    CHECK(c.guard_extra == of_kind[1]);
    CHECK(c.missed == 2);
    CHECK(c.first_missed == static_cast<std::int64_t>(shard.miss_a));
  }

  TEST_CASE("executor conformance: exec::Cuda on a stream of its own, with work in flight") {
    const dte::exec::Stream stream;
    const dte::exec::Cuda exec(stream);
    CHECK(exec.threads() == 1);
    // Device work enqueued on the executor's stream and its memory, around the host primitives.
    std::vector<std::uint32_t> host(1 << 20);
    for (std::size_t i = 0; i < host.size(); ++i)
      host[i] = static_cast<std::uint32_t>(i * 2654435761u);
    const auto copy = dte::exec::DeviceArray<std::uint32_t>::copy_of(exec, host);
    const auto zeros = dte::exec::DeviceArray<std::uint32_t>::zeros(exec, 1000);
    dte::executor_suite::run(exec);
    CHECK(copy.to_host() == host);
    CHECK(zeros.to_host() == std::vector<std::uint32_t>(1000, 0));
    CHECK(cudaGetLastError() == cudaSuccess);
  }

  TEST_CASE("bad pointers are refused before anything is launched") {
    const Shard s = make_shard(1000, 6, Forward::adamw);
    const DeviceShard d(s);
    const auto dk = on_device(dte::AdamWInverse::bind(kAdam, s.theta, {s.m, s.v}), d);
    const Stream stream;
    CHECK_THROWS_AS(dte::cuda::classify<dte::BF16Detect>(dk, nullptr, stream),
                    dte::invalid_argument);
    CHECK_THROWS_AS((void)dte::cuda::audit<dte::BF16Detect>(dk, nullptr, stream),
                    dte::invalid_argument);
    int device = 0;
    DTE_CUDA_TRY(cudaGetDevice(&device));
    int pageable = 0;
    DTE_CUDA_TRY(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device));
    if (pageable == 0) {
      std::vector<dte::Verdict> host(1000);
      CHECK_THROWS_AS(dte::cuda::classify<dte::BF16Detect>(dk, host.data(), stream),
                      dte::invalid_argument);
      CHECK_THROWS_AS((void)dte::cuda::audit<dte::BF16Detect>(dk, s.prev.data(), stream),
                      dte::invalid_argument);
    }
    DTE_CUDA_TRY(cudaStreamSynchronize(stream));
    CHECK(cudaGetLastError() == cudaSuccess);
  }
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() == 0) {
    std::printf("no CUDA device: running the no_device suite only, then skipping (exit %d)\n",
                kSkipCode);
    context.addFilter("test-suite", "no_device");
    const int rc = context.run();
    if (rc != 0 || context.shouldExit()) return rc;
    return kSkipCode;
  }
  return context.run();
}
