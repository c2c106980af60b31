// SPDX-License-Identifier: Apache-2.0
// The detect stage as the sender frame runs it (pipeline::detect, at the end): vectorised where
// this build and CPU have a kernel for (Kernel, Detect), element by element (detect_scalar,
// pipeline/detect.hpp) otherwise; the same verdicts either way.
//
// The vectorised stages for x86-64, whatever flags the user compiles with: each instruction
// set's code lives in a region compiled for it (GCC/clang target pragmas), and the CPU is asked
// at run time which one it may run (AVX-512F, AVX2, or none: the element-by-element stage).
// Set DTE_SIMD=none|avx2|avx512 in the environment to cap the level (tests and benchmarks
// compare them). FP contraction is off inside the regions: every FP32 operation is rounded once,
// as the scalar rules are. Under nvcc, or on other CPUs, nothing here is compiled and
// simd::supported() is false.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dte/detect/detect.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/detect.hpp"

#if defined(__x86_64__) && !defined(__CUDACC__) && (defined(__GNUC__) || defined(__clang__))
#define DTE_SIMD_X86 1
// GCC 12 reports its own _mm512_undefined_* as maybe-uninitialized once inlined (they are
// undefined on purpose): silenced for the intrinsics and the regions that use them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define DTE_SIMD_X86 0
#endif

namespace dte::simd {

enum class Level : int { none = 0, avx2 = 1, avx512 = 2 };

inline const char* name(Level l) noexcept {
  return l == Level::avx512 ? "avx512" : l == Level::avx2 ? "avx2" : "none";
}

// What this CPU runs (capped by DTE_SIMD), asked once.
inline Level level() noexcept {
  static const Level l = [] {
#if DTE_SIMD_X86
    Level best = Level::none;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) best = Level::avx2;
    if (__builtin_cpu_supports("avx512f")) best = Level::avx512;
    if (const char* cap = std::getenv("DTE_SIMD")) {
      const Level want = std::strcmp(cap, "none") == 0   ? Level::none
                         : std::strcmp(cap, "avx2") == 0 ? Level::avx2
                                                         : Level::avx512;
      if (static_cast<int>(want) < static_cast<int>(best)) best = want;
    }
    return best;
#else
    return Level::none;
#endif
  }();
  return l;
}

}  // namespace dte::simd

#if DTE_SIMD_X86

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// ---- AVX2: 8 lanes, masks as all-ones lanes
// -------------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#pragma GCC optimize("fp-contract=off")
#endif

namespace dte::simd::avx2 {

struct V {
  static constexpr int lanes = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;
  using Acc = __m256i;  // digest terms, summed per lane mod 2^32

  static F loadf(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static I bits(F x) noexcept { return _mm256_castps_si256(x); }
  static F fl(I x) noexcept { return _mm256_castsi256_ps(x); }
  static F setf(float x) noexcept { return _mm256_set1_ps(x); }
  static I seti(std::uint32_t x) noexcept { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota() noexcept { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static F add(F a, F b) noexcept { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) noexcept { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) noexcept { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) noexcept { return _mm256_div_ps(a, b); }
  static F sqrt(F a) noexcept { return _mm256_sqrt_ps(a); }
  static I iadd(I a, I b) noexcept { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) noexcept { return _mm256_sub_epi32(a, b); }
  static I imul(I a, I b) noexcept { return _mm256_mullo_epi32(a, b); }
  static I iand(I a, I b) noexcept { return _mm256_and_si256(a, b); }
  static I ior(I a, I b) noexcept { return _mm256_or_si256(a, b); }
  static I ixor(I a, I b) noexcept { return _mm256_xor_si256(a, b); }
  template <int N>
  static I srl(I a) noexcept {
    return _mm256_srli_epi32(a, N);
  }
  template <int N>
  static I sll(I a) noexcept {
    return _mm256_slli_epi32(a, N);
  }
  static I umax(I a, I b) noexcept { return _mm256_max_epu32(a, b); }
  static I umin(I a, I b) noexcept { return _mm256_min_epu32(a, b); }
  static I smax(I a, I b) noexcept { return _mm256_max_epi32(a, b); }
  static I smin(I a, I b) noexcept { return _mm256_min_epi32(a, b); }
  static I iabs(I a) noexcept { return _mm256_abs_epi32(a); }
  static F tofloat(I a) noexcept { return _mm256_cvtepi32_ps(a); }  // signed integer to float
  static M eqi(I a, I b) noexcept { return _mm256_cmpeq_epi32(a, b); }
  static M gti(I a, I b) noexcept { return _mm256_cmpgt_epi32(a, b); }  // signed
  static M gtu(I a, I b) noexcept { return ltu(b, a); }
  static M testi(I a, I b) noexcept { return mnot(eqi(iand(a, b), _mm256_setzero_si256())); }
  static I add_where(I a, M m, I b) noexcept { return iadd(a, iand(m, b)); }  // a + (m ? b : 0)
  static I sub_where(I a, M m, I b) noexcept { return isub(a, iand(m, b)); }
  static M ltu(I a, I b) noexcept {
    const I s = seti(0x80000000u);
    return _mm256_cmpgt_epi32(ixor(b, s), ixor(a, s));
  }
  static M eqf(F a, F b) noexcept { return bits(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static M gtf(F a, F b) noexcept { return bits(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static M ltf(F a, F b) noexcept { return bits(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static M mand(M a, M b) noexcept { return _mm256_and_si256(a, b); }
  static M mor(M a, M b) noexcept { return _mm256_or_si256(a, b); }
  static M mandnot(M a, M b) noexcept { return _mm256_andnot_si256(b, a); }  // a & ~b
  static M mnot(M a) noexcept { return _mm256_xor_si256(a, _mm256_set1_epi32(-1)); }
  static M none() noexcept { return _mm256_setzero_si256(); }
  static F selectf(M m, F a, F b) noexcept { return _mm256_blendv_ps(b, a, fl(m)); }
  static I selecti(M m, I a, I b) noexcept { return _mm256_blendv_epi8(b, a, m); }
  static unsigned tobits(M m) noexcept { return static_cast<unsigned>(_mm256_movemask_ps(fl(m))); }
  static bool all(M m) noexcept { return tobits(m) == 0xFFu; }
  static bool any(M m) noexcept { return !_mm256_testz_si256(m, m); }
  static Acc acc_zero() noexcept { return _mm256_setzero_si256(); }
  static void acc_add(Acc& acc, I h) noexcept { acc = _mm256_add_epi32(acc, h); }
  static std::uint32_t acc_sum(const Acc& acc) noexcept {
    alignas(32) std::uint32_t x[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(x), acc);
    std::uint32_t s = 0;
    for (std::uint32_t e : x)
      s += e;
    return s;
  }
  // The lane bits of m, V::lanes / 8 bytes at out.
  static void store_mask(unsigned char* out, M m) noexcept {
    *out = static_cast<unsigned char>(tobits(m));
  }
};

#include "dte/pipeline/detail/detect_adam_bf16.inc"

}  // namespace dte::simd::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---- AVX-512F: 16 lanes, masks as mask registers
// --------------------------------------------------
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC optimize("fp-contract=off")
#endif

namespace dte::simd::avx512 {

struct V {
  static constexpr int lanes = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  using Acc = __m512i;  // digest terms, summed per lane mod 2^32
  static constexpr M all_lanes = 0xFFFF;

  static F loadf(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static I bits(F x) noexcept { return _mm512_castps_si512(x); }
  static F fl(I x) noexcept { return _mm512_castsi512_ps(x); }
  static F setf(float x) noexcept { return _mm512_set1_ps(x); }
  static I seti(std::uint32_t x) noexcept { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota() noexcept {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static F add(F a, F b) noexcept { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) noexcept { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) noexcept { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) noexcept { return _mm512_div_ps(a, b); }
  // (the maskz forms here and below: GCC 12 warns about _mm512_undefined_* inside the unmasked
  // ones)
  static F sqrt(F a) noexcept { return _mm512_maskz_sqrt_ps(all_lanes, a); }
  static I iadd(I a, I b) noexcept { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) noexcept { return _mm512_sub_epi32(a, b); }
  static I imul(I a, I b) noexcept { return _mm512_mullo_epi32(a, b); }
  static I iand(I a, I b) noexcept { return _mm512_and_si512(a, b); }
  static I ior(I a, I b) noexcept { return _mm512_or_si512(a, b); }
  static I ixor(I a, I b) noexcept { return _mm512_xor_si512(a, b); }
  template <int N>
  static I srl(I a) noexcept {
    return _mm512_maskz_srli_epi32(all_lanes, a, N);
  }
  template <int N>
  static I sll(I a) noexcept {
    return _mm512_maskz_slli_epi32(all_lanes, a, N);
  }
  static I umax(I a, I b) noexcept { return _mm512_max_epu32(a, b); }
  static I umin(I a, I b) noexcept { return _mm512_min_epu32(a, b); }
  static I smax(I a, I b) noexcept { return _mm512_max_epi32(a, b); }
  static I smin(I a, I b) noexcept { return _mm512_maskz_min_epi32(all_lanes, a, b); }
  static I iabs(I a) noexcept { return _mm512_maskz_abs_epi32(all_lanes, a); }
  static F tofloat(I a) noexcept {  // signed integer to float
    return _mm512_maskz_cvtepi32_ps(all_lanes, a);
  }
  static M eqi(I a, I b) noexcept { return _mm512_cmpeq_epi32_mask(a, b); }
  static M gti(I a, I b) noexcept { return _mm512_cmpgt_epi32_mask(a, b); }
  static M ltu(I a, I b) noexcept { return _mm512_cmplt_epu32_mask(a, b); }
  static M gtu(I a, I b) noexcept { return _mm512_cmpgt_epu32_mask(a, b); }
  static M testi(I a, I b) noexcept { return _mm512_test_epi32_mask(a, b); }
  static I add_where(I a, M m, I b) noexcept { return _mm512_mask_add_epi32(a, m, a, b); }
  static I sub_where(I a, M m, I b) noexcept { return _mm512_mask_sub_epi32(a, m, a, b); }
  static M eqf(F a, F b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M gtf(F a, F b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M ltf(F a, F b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M mand(M a, M b) noexcept { return static_cast<M>(a & b); }
  static M mor(M a, M b) noexcept { return static_cast<M>(a | b); }
  static M mandnot(M a, M b) noexcept { return static_cast<M>(a & ~b); }
  static M mnot(M a) noexcept { return static_cast<M>(~a); }
  static M none() noexcept { return 0; }
  static F selectf(M m, F a, F b) noexcept { return _mm512_mask_blend_ps(m, b, a); }
  static I selecti(M m, I a, I b) noexcept { return _mm512_mask_blend_epi32(m, b, a); }
  static unsigned tobits(M m) noexcept { return static_cast<unsigned>(m); }
  static bool all(M m) noexcept { return m == 0xFFFFu; }
  static bool any(M m) noexcept { return m != 0; }
  static Acc acc_zero() noexcept { return _mm512_setzero_si512(); }
  static void acc_add(Acc& acc, I h) noexcept { acc = _mm512_add_epi32(acc, h); }
  static std::uint32_t acc_sum(const Acc& acc) noexcept {
    return static_cast<std::uint32_t>(_mm512_reduce_add_epi32(acc));
  }
  static void store_mask(unsigned char* out, M m) noexcept { std::memcpy(out, &m, 2); }
};

#include "dte/pipeline/detail/detect_adam_bf16.inc"

}  // namespace dte::simd::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#pragma GCC diagnostic pop

#endif  // DTE_SIMD_X86

namespace dte::simd {

// The vectorised detect stage for (Kernel, Detect), if this build and CPU have one: returns
// true and sets `out` when it ran.
template <class Detect, class Kernel>
bool detect(const Kernel& k, const pipeline::Piece& piece, pipeline::ScanMode mode,
            std::uint64_t* mask, std::uint64_t mask_bit, std::uint64_t* bits, std::uint64_t bits_at,
            pipeline::DetectCounts& out) noexcept {
#if DTE_SIMD_X86
  if constexpr (std::is_same_v<Kernel, dte::detail::AdamFamilyKernel> &&
                std::is_same_v<Detect, BF16Detect>) {
    if (k.identity) return false;  // lr = 0: exact, rare
    switch (level()) {
      case Level::avx512:
        out = avx512::detect_adam_bf16(k, piece, mode, mask, mask_bit, bits, bits_at);
        return true;
      case Level::avx2:
        out = avx2::detect_adam_bf16(k, piece, mode, mask, mask_bit, bits, bits_at);
        return true;
      case Level::none:
        return false;
    }
  }
#endif
  (void)k, (void)piece, (void)mode, (void)mask, (void)mask_bit, (void)bits, (void)bits_at,
      (void)out;
  return false;
}

}  // namespace dte::simd

namespace dte::pipeline {

// One piece through the detect stage (the arguments are detect_scalar's).
template <change_detector Detect, class Kernel>
DetectCounts detect(const Kernel& k, const Piece& piece, ScanMode mode, std::uint64_t* mask,
                    std::uint64_t mask_bit, std::uint64_t* out, std::uint64_t out_bit) noexcept {
  DetectCounts c;
  if (simd::detect<Detect>(k, piece, mode, mask, mask_bit, out, out_bit, c)) return c;
  return detect_scalar<Detect>(k, piece, mode, mask, mask_bit, out, out_bit);
}

}  // namespace dte::pipeline
