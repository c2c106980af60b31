// SPDX-License-Identifier: Apache-2.0
// The pipeline stages one by one, each against an independent reference:
//   * detect: the vectorised kernels (AVX2, and AVX-512 where the CPU has it) against the
//     element-by-element stage, bit for bit (send bits, dirty mask, counts, digest, the first
//     refused element), on adversarial data, in every scan mode, at unaligned bit offsets;
//   * runs: the run table against the transfer plan's own per-offset map (canonical element and
//     every receiver copy), for every shard offset of several topologies;
//   * compact and route against straightforward loops.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/detect/detect.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/plan.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/compact.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/detect_vector.hpp"
#include "dte/pipeline/route.hpp"
#include "dte/pipeline/runs.hpp"

using dte::pipeline::DetectCounts;
using dte::pipeline::Piece;
using dte::pipeline::ScanMode;

namespace {

// Adversarial AdamW state: weights of every magnitude and sign (zeros, subnormals, dead units,
// BF16 boundaries, raw bit patterns), moments from zero to large, v = 0 and subnormal.
struct State {
  std::vector<float> theta, m, v;
};

// ordinary: only weight-like elements and BF16 boundaries (no lane of the rare path), so whole
// vectors take the fast test.
State make_state(std::size_t n, std::uint32_t seed, bool ordinary = false) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto log_uniform = [&](double lo, double hi) {
    return std::exp(std::log(lo) + (std::log(hi) - std::log(lo)) * u(rng));
  };
  auto sign = [&] { return u(rng) < 0.5 ? -1.0 : 1.0; };
  auto raw = [&](unsigned emax) {
    const auto b = static_cast<std::uint32_t>(rng());
    return dte::bits_float((b & 0x807FFFFFu) | (((b >> 23) & 0xFFu) % emax) << 23);
  };
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    const double kind = !ordinary ? u(rng) : u(rng) < 0.8 ? 0.5 * u(rng) : 0.75 + 0.15 * u(rng);
    float p, m, v;
    if (kind < 0.5) {
      p = static_cast<float>(0.02 * sign() * u(rng));
      m = static_cast<float>(sign() * log_uniform(1e-9, 1e-3));
      v = static_cast<float>(static_cast<double>(m) * m * log_uniform(1, 1e3));
    } else if (kind < 0.65) {  // dead units
      p = static_cast<float>(sign() * log_uniform(1e-38, 1e-30));
      m = static_cast<float>(sign() * log_uniform(1e-45, 1e-36));
      v = u(rng) < 0.5 ? 0.0f : static_cast<float>(log_uniform(1e-45, 1e-38));
    } else if (kind < 0.75) {  // zeros of both signs, zero moments of both signs
      p = u(rng) < 0.5 ? -0.0f : 0.0f;
      m = u(rng) < 0.5 ? (u(rng) < 0.5 ? -0.0f : 0.0f) : static_cast<float>(sign() * 1e-6);
      v = u(rng) < 0.5 ? 0.0f : 1e-12f;
    } else if (kind < 0.9) {  // on a BF16 boundary
      const auto base = static_cast<float>(sign() * log_uniform(1e-30, 10));
      const std::uint32_t mid = (dte::float_bits(base) & 0xFFFF0000u) | 0x8000u;
      p = dte::bits_float(mid + static_cast<std::uint32_t>(rng() % 9) - 4u);
      m = static_cast<float>(sign() * log_uniform(1e-12, 1e-2));
      v = static_cast<float>(static_cast<double>(m) * m * log_uniform(1, 1e3));
    } else {
      p = raw(140);
      m = raw(130);
      v = std::fabs(raw(140));
    }
    s.theta[i] = p;
    s.m[i] = m;
    s.v[i] = v;
  }
  return s;
}

struct Outcome {
  DetectCounts counts;
  std::vector<std::uint64_t> bits, mask;
};

using Stage = DetectCounts (*)(const dte::detail::AdamFamilyKernel&, const Piece&, ScanMode,
                               std::uint64_t*, std::uint64_t, std::uint64_t*, std::uint64_t);

DetectCounts scalar_stage(const dte::detail::AdamFamilyKernel& k, const Piece& p, ScanMode mode,
                          std::uint64_t* mask, std::uint64_t mask_bit, std::uint64_t* out,
                          std::uint64_t out_bit) {
  return dte::pipeline::detect_scalar<dte::BF16Detect>(k, p, mode, mask, mask_bit, out, out_bit);
}

Outcome run(Stage stage, const dte::detail::AdamFamilyKernel& k, const Piece& p, ScanMode mode,
            const std::vector<std::uint64_t>& mask0, std::uint64_t mask_bit,
            std::uint64_t out_bit) {
  Outcome o;
  o.mask = mask0;
  o.bits.assign((out_bit + p.length + 64) / 64 + 1, 0);
  o.counts =
      stage(k, p, mode, o.mask.empty() ? nullptr : o.mask.data(), mask_bit, o.bits.data(), out_bit);
  return o;
}

void check_same(const Outcome& a, const Outcome& b) {
  CHECK(a.counts.flagged == b.counts.flagged);
  CHECK(a.counts.guard == b.counts.guard);
  CHECK(a.counts.digest == b.counts.digest);
  CHECK(a.counts.invalid == b.counts.invalid);
  CHECK(a.bits == b.bits);
  CHECK(a.mask == b.mask);
}

}  // namespace

TEST_CASE("detect: the vectorised kernels equal the element-by-element stage bit for bit") {
  std::vector<std::pair<const char*, Stage>> kernels;
#if DTE_SIMD_X86
  if (__builtin_cpu_supports("avx2"))
    kernels.emplace_back("avx2", dte::simd::avx2::detect_adam_bf16);
  if (__builtin_cpu_supports("avx512f")) {
    kernels.emplace_back("avx512", dte::simd::avx512::detect_adam_bf16);
  }
#endif
  std::printf("detect kernels compared with the scalar stage:");
  for (const auto& [name, stage] : kernels)
    std::printf(" %s", name);
  std::printf("%s\n", kernels.empty() ? " none on this CPU (nothing to compare)" : "");
  if (kernels.empty()) return;

  constexpr std::size_t n = 1 << 18;
  const State mixed = make_state(n, 7), ordinary = make_state(n, 8, true);
  const dte::AdamHyperparameters settings[] = {
      {.lr = 1e-6, .weight_decay = 0.1, .step = 1},
      {.lr = 1e-4, .weight_decay = 0.0, .eps = 1e-20, .step = 1000},
      {.lr = 0.1, .weight_decay = 5.0, .eps = 0.0, .step = 3},  // lr*wd = 0.5, eps = 0
      {.lr = 1e-5,
       .weight_decay = 0.01,
       .beta1 = 0.5,
       .beta2 = 0.9999,
       .step = 7,
       .decay_form = dte::DecayForm::multiply},
      {.lr = 3e-5, .weight_decay = 0.1, .step = 2, .decay_form = dte::DecayForm::subtract},
  };
  std::mt19937 rng(3);
  std::uint64_t compared = 0, flagged = 0, guard = 0;
  for (const State* st : {&mixed, &ordinary}) {
    for (const auto& h : settings) {
      const auto k = dte::AdamWInverse::bind_unchecked(h, st->theta, {st->m, st->v});
      for (const ScanMode mode : {ScanMode::detect, ScanMode::mark, ScanMode::mask}) {
        for (int trial = 0; trial < 6; ++trial) {
          // Pieces of every length class, at every bit alignment.
          const std::size_t first = rng() % 1000;
          const std::size_t length = trial == 0 ? 63 : trial == 1 ? 64 : 1000 + rng() % (n - 3000);
          const std::int64_t canonical =
              trial == 2 ? -1 : static_cast<std::int64_t>(rng() % 100000);
          const Piece piece{first, length, canonical, trial != 3};
          const std::uint64_t mask_bit = rng() % 200, out_bit = rng() % 200;
          std::vector<std::uint64_t> mask;
          if (mode != ScanMode::detect) {
            mask.resize((mask_bit + length + 64) / 64 + 1);
            for (auto& w : mask)
              w = (static_cast<std::uint64_t>(rng()) << 32) | rng();
          }
          const Outcome want = run(scalar_stage, k, piece, mode, mask, mask_bit, out_bit);
          for (const auto& [name, stage] : kernels) {
            CAPTURE(name);
            CAPTURE(static_cast<int>(mode));
            CAPTURE(trial);
            check_same(run(stage, k, piece, mode, mask, mask_bit, out_bit), want);
          }
          compared += length;
          flagged += want.counts.flagged;
          guard += want.counts.guard;
        }
      }
    }
  }
  std::printf("  %llu elements compared per kernel, %llu flagged, %llu by the guard band\n",
              static_cast<unsigned long long>(compared), static_cast<unsigned long long>(flagged),
              static_cast<unsigned long long>(guard));
  CHECK(flagged > 0);
  CHECK(guard > 0);

  SUBCASE("an invalid element is reported at the same index, whatever the kernel") {
    for (const std::size_t at : {std::size_t{5}, std::size_t{64}, std::size_t{1000}, n - 7}) {
      for (int kind = 0; kind < 3; ++kind) {
        State bad = mixed;
        if (kind == 0) bad.theta[at] = std::nanf("");
        if (kind == 1) bad.m[at] = INFINITY;
        if (kind == 2) bad.v[at] = -1e-20f;
        const auto k =
            dte::AdamWInverse::bind_unchecked({.lr = 1e-5, .step = 3}, bad.theta, {bad.m, bad.v});
        const Piece piece{0, n, 0, true};
        const Outcome want = run(scalar_stage, k, piece, ScanMode::detect, {}, 0, 0);
        CHECK(want.counts.invalid == static_cast<std::int64_t>(at));
        for (const auto& [name, stage] : kernels) {
          CAPTURE(name);
          CHECK(run(stage, k, piece, ScanMode::detect, {}, 0, 0).counts.invalid ==
                static_cast<std::int64_t>(at));
        }
      }
    }
  }
}

TEST_CASE("detect: the fast test never passes a value the precise rule would guard") {
  // far_from_boundary decides most unchanged lanes without forming the rounding interval; it
  // must imply BasicDetect's "unchanged". Values of every binade (subnormals, the largest
  // finite, Inf, NaN) with their low 16 bits near the midpoint or near the ends, errors at the
  // exact distance to an end, one float either side of it, and spread over 2^-30..2^-5 of it.
  using Fast = unsigned (*)(const float*, const float*);
  std::vector<std::tuple<const char*, Fast, int>> kernels;  // name, test, lanes
#if DTE_SIMD_X86
  if (__builtin_cpu_supports("avx2"))
    kernels.emplace_back("avx2", dte::simd::avx2::far_from_boundary_bits, 8);
  if (__builtin_cpu_supports("avx512f"))
    kernels.emplace_back("avx512", dte::simd::avx512::far_from_boundary_bits, 16);
#endif
  if (kernels.empty()) return;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  constexpr std::size_t n = 1 << 20;
  std::vector<float> value(n), error(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t e = static_cast<std::uint32_t>(rng() % 256);  // every exponent field
    const auto near = static_cast<std::uint32_t>(rng() % 64);
    const std::uint32_t low = rng() % 4 == 0   ? near                   // near the lower end
                              : rng() % 3 == 0 ? 0xFFFFu - near         // near the upper end
                                               : 0x8000u + near - 32u;  // near the midpoint
    const std::uint32_t bits = (rng() & 0x80000000u) | (e << 23) | (rng() & 0x007F0000u) | low;
    const float v = dte::bits_float(bits);
    value[i] = v;
    // the distance to the nearer end of interval(round(v)), when v is finite
    const dte::RoundingInterval iv = dte::Bf16Format::interval(dte::Bf16Format::round(v));
    const float d = std::fmin(std::fabs(v - iv.lo), std::fabs(iv.hi - v));
    const int kind = static_cast<int>(rng() % 4);
    float err = kind == 0   ? d
                : kind == 1 ? std::nextafter(d, 0.0f)
                : kind == 2 ? std::nextafter(d, INFINITY)
                            : static_cast<float>(d * std::exp2(-5.0 - 25.0 * u(rng)));
    if (!(err > 0.0f)) err = 0x1p-149f;
    error[i] = std::isfinite(v) ? err : 1.0f;
  }
  for (const auto& [name, fast, lanes] : kernels) {
    CAPTURE(name);
    std::uint64_t passed = 0, wrong = 0, unchanged = 0;
    for (std::size_t i = 0; i < n; i += static_cast<std::size_t>(lanes)) {
      const unsigned far = fast(&value[i], &error[i]);
      for (int j = 0; j < lanes; ++j) {
        const float v = value[i + static_cast<std::size_t>(j)];
        const bool precise =
            dte::BF16Detect::classify(v, {v, error[i + static_cast<std::size_t>(j)]}) ==
            dte::Verdict::unchanged;
        unchanged += precise;
        if ((far >> j) & 1u) {
          ++passed;
          if (!precise) ++wrong;
        }
      }
    }
    std::printf("fast test (%s): %llu of %llu unchanged lanes decided fast, %llu wrongly\n", name,
                static_cast<unsigned long long>(passed), static_cast<unsigned long long>(unchanged),
                static_cast<unsigned long long>(wrong));
    CHECK(wrong == 0);
    CHECK(passed > unchanged / 4);  // and it does decide most of them
  }
}

TEST_CASE("detect: the digest of a piece is the sum of element_digest over its elements") {
  const State s = make_state(4096, 11);
  const auto k = dte::AdamWInverse::bind_unchecked({.lr = 1e-5, .step = 3}, s.theta, {s.m, s.v});
  std::vector<std::uint64_t> bits(70, 0);
  const std::int64_t base = (std::int64_t{5} << 32) + 17;  // a high part in the key
  const DetectCounts c = dte::pipeline::detect<dte::BF16Detect>(
      k, Piece{0, 4096, base, true}, ScanMode::detect, nullptr, 0, bits.data(), 0);
  dte::Digest want = 0;
  for (std::size_t j = 0; j < 4096; ++j)
    want += dte::element_digest(base + static_cast<std::int64_t>(j), dte::round_bf16(s.theta[j]));
  CHECK(c.digest == want);
  // position- and value-aware: +0 and -0 differ, neighbours differ
  CHECK(dte::element_digest(12, 0) != dte::element_digest(12, 0x8000));
  CHECK(dte::element_digest(12, 0x3F80) != dte::element_digest(13, 0x3F80));
  CHECK(dte::element_digest(12, 0x3F80) != dte::element_digest(12, 0x3F81));
}

namespace {

template <class Plan>
void check_runs(const Plan& plan, const dte::layout::HfModel& hf,
                const dte::layout::ServingLayout& recv) {
  const dte::pipeline::RunTable table(plan, hf, &recv);
  for (dte::layout::BufferKind b :
       {dte::layout::BufferKind::dense, dte::layout::BufferKind::expert}) {
    const auto runs = table.runs(b);
    std::int64_t covered = 0;
    for (std::size_t r = 0; r < runs.size(); ++r) {
      const dte::pipeline::Run& run = runs[r];
      if (r > 0) CHECK(runs[r - 1].shard_begin + runs[r - 1].length <= run.shard_begin);
      covered += run.length;
      for (std::int64_t j = 0; j < run.length; ++j) {
        const std::int64_t o = run.shard_begin + j;
        const dte::layout::Canonical c = plan.canonical(b, o);
        if (!run.sender || run.tensor < 0) {
          if (run.sender) CHECK(c.tensor < 0);
          continue;
        }
        REQUIRE(c.tensor == run.tensor);
        CHECK(hf[c.tensor].base + c.index == run.canonical + j);
        std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> want, got;
        route_canonical(recv, plan.canonical(b, o), [&](const dte::layout::RouteTarget& t) {
          want.emplace_back(t.rank, t.tensor, t.index);
        });
        for (const dte::pipeline::RunTarget& t : table.targets(run))
          got.emplace_back(t.rank, t.tensor, std::int64_t{t.index} + j);
        std::sort(want.begin(), want.end());
        std::sort(got.begin(), got.end());
        CHECK(got == want);
      }
    }
    std::int64_t in_segments = 0;
    for (const auto& s : plan.segments(b))
      in_segments += s.length;
    CHECK(covered == in_segments);
  }
}

}  // namespace

TEST_CASE("runs: every shard offset maps as the transfer plan says (canonical and every copy)") {
  using namespace dte::layout;
  const struct {
    const char* model;
    const char* train;
    const char* infer;
  } pairs[] = {
      {"tiny-qwen3", "tp=2,dp=2", "tp=4,replicas=2"},
      {"tiny-qwen3", "tp=4,pp=2", "tp=1,replicas=2"},
      {"tiny-qwen3-moe", "tp=2,pp=2,ep=2,dp=2", "tp=4,ep=2"},
      {"tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,replicas=2"},
  };
  for (const auto& pair : pairs) {
    CAPTURE(pair.model);
    CAPTURE(pair.train);
    const HfModel hf(model_preset(pair.model));
    const TrainTopology train = parse_train_topology(pair.train);
    const ServingLayout recv(hf, parse_infer_topology(pair.infer));
    for (std::int64_t rank = 0; rank < train.world(); ++rank)
      check_runs(TransferPlan(hf, train, rank), hf, recv);
  }
  const HfModel hf(model_preset("tiny-qwen3"));
  const ServingLayout recv(hf, parse_infer_topology("tp=2"));
  check_runs(IdentityPlan(hf, TrainTopology{}, 0), hf, recv);
}

TEST_CASE("compact and route: the flagged elements, every copy") {
  using namespace dte::layout;
  const HfModel hf(model_preset("tiny-qwen3"));
  const TrainTopology train = parse_train_topology("tp=2,dp=2");
  const ServingLayout recv(hf, parse_infer_topology("tp=4,replicas=2"));
  const TransferPlan plan(hf, train, 1);
  const dte::pipeline::RunTable table(plan, hf, &recv);
  const auto runs = table.runs(BufferKind::dense);
  const std::int64_t begin = runs[2].shard_begin, n = 5000;
  std::vector<float> theta(static_cast<std::size_t>(n));
  std::vector<std::uint64_t> words(static_cast<std::size_t>((n + 63) / 64), 0);
  std::mt19937 rng(5);
  std::vector<std::int64_t> flagged;
  for (std::int64_t j = 0; j < n; ++j) {
    theta[static_cast<std::size_t>(j)] = static_cast<float>(rng()) * 1e-9f;
    const auto run = std::find_if(runs.begin(), runs.end(), [&](const dte::pipeline::Run& r) {
      return begin + j >= r.shard_begin && begin + j < r.shard_begin + r.length;
    });
    const bool sendable = run != runs.end() && run->sender && run->tensor >= 0;
    if (sendable && rng() % 7 == 0) {
      words[static_cast<std::size_t>(j / 64)] |= std::uint64_t{1} << (j % 64);
      flagged.push_back(j);
    }
  }
  std::vector<std::uint32_t> offsets(static_cast<std::size_t>(n));
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(n));
  const std::size_t k = dte::pipeline::compact<dte::BF16Detect>(
      words.data(), static_cast<std::size_t>(n), theta.data(), offsets.data(), bits.data());
  REQUIRE(k == flagged.size());
  for (std::size_t e = 0; e < k; ++e) {
    CHECK(offsets[e] == flagged[e]);
    CHECK(bits[e] == dte::round_bf16(theta[offsets[e]]));
  }
  dte::pipeline::RoutedEntries routed;
  dte::pipeline::route(table, runs.subspan(2), begin, std::span(offsets).first(k),
                       std::span(bits).first(k), routed);
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::uint16_t>> want, got;
  for (std::size_t e = 0; e < k; ++e) {
    route_canonical(recv, plan.canonical(BufferKind::dense, begin + offsets[e]),
                    [&](const RouteTarget& t) {
                      want.emplace_back(static_cast<std::uint32_t>(t.rank),
                                        static_cast<std::uint32_t>(t.tensor),
                                        static_cast<std::uint32_t>(t.index), bits[e]);
                    });
  }
  for (std::size_t e = 0; e < routed.size(); ++e)
    got.emplace_back(routed.rank[e], routed.tensor[e], routed.index[e], routed.bits[e]);
  CHECK(got.size() == want.size());
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  CHECK(got == want);
}
