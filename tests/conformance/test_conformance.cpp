// SPDX-License-Identifier: Apache-2.0
// One conformance suite per concept of concepts.hpp, run over every shipped policy:
//   optimizer_inverse: AdamWInverse, AdamInverse, SgdMomentumInverse, SnapshotBase(Fp16)
//   change_detector:   BF16Detect, FP16Detect
//   layout_mapping:    MegatronToHF, Identity (with the plans they bring)
//   transport:         LoopbackTwoRound, by tests/transport/transport_suite.hpp (which also runs
//                      over MpiTwoRound in tests/mpi and NcclTwoRound in tests/cuda)
//   executor:          HostExecutor with one and with several threads, by executor_suite.hpp
//                      (which also runs over exec::Cuda in tests/cuda/test_cuda_backend.cu)
// What a policy must do for the engine to be correct with it, checked the same way for each.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../transport/transport_suite.hpp"
#include "dte/audit.hpp"
#include "dte/concepts.hpp"
#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/plan.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/optim/snapshot.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/transport/loopback.hpp"
#include "executor_suite.hpp"

namespace {

// Per policy: hyperparameters, a forward step from theta_prev to theta (writing the state the
// inverse reads), and the state view.
template <class P>
struct Fixture;

template <>
struct Fixture<dte::AdamWInverse> {
  using detect = dte::BF16Detect;
  // What the contract |truth - value| <= error is about: the weight before the step.
  static std::vector<float> truth(const std::vector<float>& p0) { return p0; }
  dte::AdamHyperparameters h{.lr = 1e-4, .weight_decay = 0.1, .step = 3};
  std::vector<float> m, v;
  void step(const std::vector<float>& p0, std::vector<float>& p, std::mt19937& rng) {
    std::normal_distribution<float> g(0.0f, 1e-3f);
    m.resize(p0.size());
    v.resize(p0.size());
    for (std::size_t i = 0; i < p0.size(); ++i) {
      const float gi = g(rng);
      m[i] = 0.1f * gi;
      v[i] = 0.001f * gi * gi;
      const float denom =
          std::sqrt(v[i]) / static_cast<float>(std::sqrt(1 - std::pow(0.999, 3))) + 1e-8f;
      p[i] = p0[i] * static_cast<float>(1 - 1e-5) +
             (static_cast<float>(-1e-4 / (1 - std::pow(0.9, 3))) * m[i]) / denom;
    }
  }
  dte::AdamState state() const { return {m, v}; }
};

template <>
struct Fixture<dte::AdamInverse> : Fixture<dte::AdamWInverse> {
  Fixture() { h.weight_decay = 0.0; }
  void step(const std::vector<float>& p0, std::vector<float>& p, std::mt19937& rng) {
    Fixture<dte::AdamWInverse>::step(p0, p, rng);
    for (std::size_t i = 0; i < p0.size(); ++i) {  // no decay factor in Adam-L2's weight update
      const float denom =
          std::sqrt(v[i]) / static_cast<float>(std::sqrt(1 - std::pow(0.999, 3))) + 1e-8f;
      p[i] = p0[i] + (static_cast<float>(-1e-4 / (1 - std::pow(0.9, 3))) * m[i]) / denom;
    }
  }
};

template <>
struct Fixture<dte::SgdMomentumInverse> {
  using detect = dte::BF16Detect;
  static std::vector<float> truth(const std::vector<float>& p0) { return p0; }
  dte::SgdHyperparameters h{.lr = 1e-2, .momentum = 0.9};
  std::vector<float> buf;
  void step(const std::vector<float>& p0, std::vector<float>& p, std::mt19937& rng) {
    std::normal_distribution<float> g(0.0f, 1e-3f);
    buf.resize(p0.size());
    for (std::size_t i = 0; i < p0.size(); ++i) {
      buf[i] = g(rng);
      p[i] = p0[i] + (-0.01f) * buf[i];
    }
  }
  dte::SgdState state() const { return {buf}; }
};

template <class F>
struct Fixture<dte::BasicSnapshotBase<F>> {
  using detect = dte::BasicDetect<F>;
  // The snapshot's previous value is the 16-bit value published, exactly.
  static std::vector<float> truth(const std::vector<float>& p0) {
    std::vector<float> t(p0.size());
    for (std::size_t i = 0; i < p0.size(); ++i)
      t[i] = F::widen(F::round(p0[i]));
    return t;
  }
  dte::SnapshotHyperparameters h{};
  typename dte::BasicSnapshotBase<F>::Shadow shadow;
  void step(const std::vector<float>& p0, std::vector<float>& p, std::mt19937& rng) {
    shadow.record(p0);
    std::normal_distribution<float> g(0.0f, 1e-4f);
    for (std::size_t i = 0; i < p0.size(); ++i)
      p[i] = p0[i] + g(rng);
  }
  dte::SnapshotState state() const { return shadow.view(); }
};

}  // namespace

TEST_CASE_TEMPLATE("optimizer_inverse conformance", P, dte::AdamWInverse, dte::AdamInverse,
                   dte::SgdMomentumInverse, dte::SnapshotBase, dte::SnapshotBaseFp16) {
  static_assert(dte::optimizer_inverse<P>);
  static_assert(std::is_trivially_copyable_v<typename P::kernel>);
  constexpr std::size_t n = 50'000;
  std::mt19937 rng(1);
  std::normal_distribution<float> w(0.0f, 0.02f);
  std::vector<float> p0(n), p(n);
  for (float& x : p0)
    x = w(rng);
  Fixture<P> f;
  f.step(p0, p, rng);

  SUBCASE("bind and bind_unchecked give the same kernel; size and current are the shard's") {
    const auto k = P::bind(f.h, p, f.state(), "t");
    const auto u = P::bind_unchecked(f.h, p, f.state(), "t");
    CHECK(k.size() == n);
    CHECK(u.size() == n);
    for (std::size_t i = 0; i < n; i += 997) {
      CHECK(k.current(i) == p[i]);
      CHECK(k.valid(i));
      CHECK(k(i).value == u(i).value);
      CHECK(k(i).error == u(i).error);
    }
  }
  SUBCASE("the contract: |theta_prev - value| <= error for every element; nothing missed") {
    const auto k = P::bind(f.h, p, f.state(), "t");
    const dte::AuditCounts c =
        dte::audit_reconstruction<typename Fixture<P>::detect>(k, Fixture<P>::truth(p0));
    CHECK(c.bound_violations == 0);
    CHECK(c.missed == 0);
    CHECK(c.true_changed > 0);
  }
  SUBCASE("a NaN in theta: bind refuses it, valid() names the element") {
    p[123] = std::nanf("");
    CHECK_THROWS_AS((void)P::bind(f.h, p, f.state(), "t"), dte::invalid_argument);
    const auto u = P::bind_unchecked(f.h, p, f.state(), "t");
    CHECK_FALSE(u.valid(123));
    CHECK(u.valid(122));
  }
  SUBCASE("a length mismatch is refused by both binds") {
    const std::span<const float> shorter(p.data(), n - 1);
    CHECK_THROWS_AS((void)P::bind(f.h, shorter, f.state(), "t"), dte::invalid_argument);
    CHECK_THROWS_AS((void)P::bind_unchecked(f.h, shorter, f.state(), "t"), dte::invalid_argument);
  }
}

TEST_CASE_TEMPLATE("change_detector conformance", D, dte::BF16Detect, dte::FP16Detect) {
  static_assert(dte::change_detector<D>);
  std::mt19937 rng(2);
  for (int i = 0; i < 100000; ++i) {
    const float x = dte::bits_float(static_cast<std::uint32_t>(rng()) & 0xBFFFFFFFu);  // finite
    // An exact previous value decides by bit pattern; changed() agrees with classify().
    const float y = dte::bits_float(dte::float_bits(x) + (rng() % 3) - 1);
    const dte::Reconstruction exact{y, 0.0f, true};
    const bool differ = D::store(x) != D::store(y);
    CHECK((D::classify(x, exact) == dte::Verdict::changed) == differ);
    CHECK(D::changed(x, exact) == differ);
    // Any error: never unchanged when the bits differ; guard at most when they agree.
    const dte::Reconstruction fuzzy{y, std::fabs(y) * 1e-6f + 1e-38f, false};
    if (differ) CHECK(D::classify(x, fuzzy) == dte::Verdict::changed);
  }
}

namespace {

template <class Plan>
void check_plan(const Plan& plan, const dte::layout::HfModel& hf,
                const dte::layout::ServingLayout& recv) {
  static_assert(dte::transfer_plan<Plan>);
  for (dte::layout::BufferKind b :
       {dte::layout::BufferKind::dense, dte::layout::BufferKind::expert}) {
    // Segments tile part of the shard, in order, without overlap, inside it.
    std::int64_t end = 0;
    for (const dte::layout::PlanSegment& s : plan.segments(b)) {
      CHECK(s.shard_begin >= end);
      CHECK(s.length > 0);
      end = s.shard_begin + s.length;
      const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
      CHECK(s.param_begin + s.length <= p.numel());
    }
    CHECK(end <= plan.shard_size(b));
  }
  // Every canonical element has exactly one sending shard offset across the plans (checked by
  // the caller over every rank) — here: a sending offset maps inside its canonical tensor.
  const dte::pipeline::RunTable runs(plan, hf, &recv);
  for (dte::layout::BufferKind b :
       {dte::layout::BufferKind::dense, dte::layout::BufferKind::expert}) {
    for (const dte::pipeline::Run& r : runs.runs(b)) {
      if (r.tensor < 0 || !r.sender) continue;
      const auto& x = hf[r.tensor];
      CHECK(r.canonical >= x.base);
      CHECK(r.canonical + r.length <= x.base + x.numel());
    }
  }
}

}  // namespace

TEST_CASE(
    "layout_mapping conformance: MegatronToHF and Identity cover every canonical element once") {
  using namespace dte::layout;
  static_assert(dte::layout_mapping<MegatronToHF>);
  static_assert(dte::layout_mapping<Identity>);
  for (const char* model : {"tiny-qwen3", "tiny-qwen3-moe"}) {
    const HfModel hf(model_preset(model));
    const ServingLayout recv(hf, parse_infer_topology("tp=2"));
    const TrainTopology train = parse_train_topology(
        std::string(model) == "tiny-qwen3" ? "tp=2,pp=2,dp=2" : "tp=2,ep=2,dp=2");
    std::vector<int> sent(static_cast<std::size_t>(hf.total()), 0);
    for (std::int64_t rank = 0; rank < train.world(); ++rank) {
      const TransferPlan plan(hf, train, rank);
      check_plan(plan, hf, recv);
      const dte::pipeline::RunTable runs(plan, hf, &recv);
      for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
        for (const dte::pipeline::Run& r : runs.runs(b)) {
          if (r.tensor < 0 || !r.sender) continue;
          for (std::int64_t j = 0; j < r.length; ++j)
            ++sent[static_cast<std::size_t>(r.canonical + j)];
        }
      }
    }
    CAPTURE(model);
    CHECK(std::count(sent.begin(), sent.end(), 1) == hf.total());
  }
  const HfModel hf(model_preset("tiny-qwen3"));
  const ServingLayout recv(hf, parse_infer_topology("tp=2"));
  check_plan(IdentityPlan(hf, TrainTopology{}, 0), hf, recv);
}

namespace {

// The transport suite over a loopback world, one thread per rank; each rank's results.
std::vector<dte::transport_suite::Results> run_suite(dte::LoopbackWorld& world, int senders,
                                                     int receivers) {
  std::vector<dte::transport_suite::Results> results(static_cast<std::size_t>(senders + receivers));
  std::vector<std::jthread> ranks;
  for (int r = 0; r < senders + receivers; ++r) {
    ranks.emplace_back([&, r] {
      results[static_cast<std::size_t>(r)] =
          dte::transport_suite::run_rank(world.endpoint(r), r, senders, receivers);
    });
  }
  ranks.clear();  // (joins)
  return results;
}

}  // namespace

TEST_CASE("transport conformance: LoopbackTwoRound") {
  namespace suite = dte::transport_suite;
  static_assert(dte::transport<dte::LoopbackTwoRound>);
  for (const auto& [senders, receivers] : {std::pair{3, 2}, std::pair{1, 1}, std::pair{2, 4}}) {
    CAPTURE(senders);
    CAPTURE(receivers);
    dte::LoopbackWorld world(senders, receivers, std::chrono::milliseconds(2000));
    const std::vector<suite::Results> results = run_suite(world, senders, receivers);
    for (const suite::Results& r : results) {
      for (const std::string& f : r.failures)
        FAIL_CHECK(f);
      CHECK(r.exchanges == suite::kRounds);
    }
    // The world's own account of the last exchange.
    const dte::ExchangeStats stats = world.last_stats();
    CHECK(stats.messages == suite::messages(senders, receivers, suite::kRounds - 1));
    CHECK(stats.bytes == suite::bytes(senders, receivers, suite::kRounds - 1));
  }
}

TEST_CASE("the transport suite fails a transport that loses a message or flips a bit") {
  namespace suite = dte::transport_suite;
  constexpr int senders = 3, receivers = 2;
  // The first exchange (round 0): sender 0 sends receiver 1 17 bytes, sender 1 receiver 0 too.
  REQUIRE(suite::message_size(0, 1, 0, {}) == 17);
  REQUIRE(suite::message_size(1, 0, 0, {}) == 17);
  for (const dte::TransportFault& fault :
       {dte::TransportFault{.kind = dte::TransportFault::Kind::drop, .src = 0, .dst = 1},
        dte::TransportFault{
            .kind = dte::TransportFault::Kind::bitflip, .src = 1, .dst = 0, .byte = 9, .bit = 3}}) {
    dte::LoopbackWorld world(senders, receivers, std::chrono::milliseconds(2000));
    world.inject(fault);
    const std::vector<suite::Results> results = run_suite(world, senders, receivers);
    const std::string victim = "rank " + std::to_string(senders + fault.dst) + ": exchange 0: ";
    const std::string what = fault.kind == dte::TransportFault::Kind::drop
                                 ? victim + "nothing from sender 0 (17 bytes sent)"
                                 : victim + "byte 9 of 17 from sender 1 differs";
    CAPTURE(what);
    bool named = false;
    std::size_t failures = 0;
    for (const suite::Results& r : results) {
      CHECK(r.exchanges == suite::kRounds);  // the ranks went on in step
      for (const std::string& f : r.failures) {
        CAPTURE(f);
        named = named || f.find(what) == 0;
        // Only the exchange the fault hit fails.
        CHECK(f.find("rank " + std::to_string(r.rank) + ": exchange 0: ") == 0);
        ++failures;
      }
    }
    CHECK(named);
    if (fault.kind == dte::TransportFault::Kind::drop) {
      // A lost message also shows in the world's count of bytes and messages, on every rank.
      for (const suite::Results& r : results)
        CHECK_FALSE(r.ok());
    } else {
      CHECK(failures == 1);  // a flipped bit: same sizes, only the receiver can tell
    }
  }
}

TEST_CASE("LoopbackTwoRound: a rank that never arrives is named within the deadline") {
  dte::LoopbackWorld small(1, 1, std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    small.endpoint(0).checkpoint("the test phase");  // rank 1 never comes
  } catch (const dte::deadline_error& e) {
    what = e.what();
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK(what.find("rank 0 waited 200 ms in the test phase for rank(s) 1") != std::string::npos);
  // The world is broken: later waits fail at once.
  CHECK_THROWS_AS(small.endpoint(1).checkpoint("later"), dte::deadline_error);
}

TEST_CASE_TEMPLATE("executor conformance", E, dte::HostExecutor) {
  for (const int threads : {1, 2, 4}) {
    CAPTURE(threads);
    const E exec(threads);
    CHECK(exec.threads() == threads);  // exec::Host's own: it runs as many as it is given
    dte::executor_suite::run(exec);
  }
}
