// SPDX-License-Identifier: Apache-2.0
// FP8 receivers (docs/fp8.md): publication/fp8_sender.hpp, receive/fp8_part.hpp,
// receive/fp8_core.hpp, publication/receiver.hpp (an FP8 ShardReceiver).
//   * End to end: a trainer running AdamW publishes for the TP ranks of an online-FP8 engine
//     (tp 1 and 2, K = 1 and 4, 30 publications); after every publication every rank's codes,
//     scales and BF16 tensors equal the dense requantization of the trainer's weights.
//   * The sender's rule on adversarial blocks, element by element: an amax that moves by one
//     BF16 ulp, a largest element that changes sign, all-zero blocks (the 1e-4 clamp), values at
//     E4M3 rounding midpoints, blocks cut by the tensor's edge, and guard-band elements whose
//     previous bits straddle an FP8 boundary; against the dense result every time.
//   * Refusals leave the rank untouched.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/model.hpp"
#include "dte/numeric/fp8.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/fp8_sender.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/sim/fp8_dense.hpp"
#include "flat_adamw.hpp"

using namespace dte;
using publication::Bytes;

namespace {

using Pub = publication::Publisher<AdamWInverse, BF16Detect>;

struct Ranks {
  layout::ServingLayout layout;
  layout::Fp8Grid grid;
  std::vector<std::unique_ptr<sim::Fp8RankTensors>> tensors;
  std::vector<std::unique_ptr<publication::ShardReceiver>> rx;
  Ranks(const layout::HfModel& hf, const layout::ModelSpec& spec, std::int64_t tp)
      : layout(hf, layout::InferTopology{tp, 1, 1}), grid(layout, 128, 128) {
    for (std::int64_t ts = 0; ts < tp; ++ts) {
      tensors.push_back(std::make_unique<sim::Fp8RankTensors>(grid));
      rx.push_back(std::make_unique<publication::ShardReceiver>(
          spec, layout::InferTopology{tp, 1, 1}, ts, VllmBlockFp8::name,
          tensors.back()->bf16_views(), tensors.back()->fp8_views()));
    }
  }
};

std::function<std::span<const float>(std::int64_t)> weights_of(const testing::FlatAdamW& tr) {
  return [&tr](std::int64_t t) {
    return std::span<const float>(tr.theta).subspan(static_cast<std::size_t>(tr.hf[t].base),
                                                    static_cast<std::size_t>(tr.hf[t].numel()));
  };
}

}  // namespace

TEST_CASE("fp8: every publication leaves each rank with the dense requantization") {
  const layout::ModelSpec spec = sim::fp8_test_model();
  for (const std::int64_t tp : {1, 2}) {
    for (const std::int64_t K : {1, 4}) {
      CAPTURE(tp);
      CAPTURE(K);
      testing::FlatAdamW tr(spec);
      tr.lr = 2e-5;  // a few percent of BF16 elements change per step
      Pub pub(spec, {.publish_every = K});
      pub.serve_fp8({VllmBlockFp8::name, layout::InferTopology{tp, 1, 1}});
      Ranks ranks(pub.model(), spec, tp);
      const auto apply = [&](const Bytes& msg) {
        for (std::int64_t ts = 0; ts < tp; ++ts) {
          CAPTURE(ts);
          REQUIRE(ranks.rx[static_cast<std::size_t>(ts)]->apply(msg).committed());
          CHECK(sim::fp8_rank_differs(ranks.grid, ts, *ranks.tensors[static_cast<std::size_t>(ts)],
                                      weights_of(tr)) == "");
          CHECK(ranks.rx[static_cast<std::size_t>(ts)]->fp8_verify() == "");
        }
      };
      {
        const auto f = tr.flat();
        apply(pub.publish(publication::FlatAccess<AdamWInverse>{&f, &pub.model()}, true));
      }
      std::uint64_t codes = 0, scales = 0, changed = 0, elements = 0;
      int publications = 0;
      while (publications < 30) {
        tr.step();
        const auto f = tr.flat();
        const std::optional<Bytes> msg =
            pub.step(publication::FlatAccess<AdamWInverse>{&f, &pub.model()});
        if (!msg) continue;
        apply(*msg);
        ++publications;
        codes += pub.last().fp8_codes;
        scales += pub.last().fp8_scales;
        changed += pub.last().changed;
        elements += static_cast<std::uint64_t>(pub.model().total());
      }
      MESSAGE("tp " << tp << " K " << K << ": BF16 changed " << changed << " of " << elements
                    << ", FP8 codes sent " << codes << ", scales " << scales);
      CHECK(codes < changed);  // the FP8-visible changes are fewer than the BF16 ones
    }
  }
}

namespace {

// The FP8 sender alone over weights set by hand, its parts applied to one rank's arrays: the
// rule element by element.
struct Bench {
  layout::ModelSpec spec = sim::fp8_test_model();
  layout::HfModel hf{spec};
  publication::Fp8Sender<VllmBlockFp8, BF16Detect> sender{hf, layout::InferTopology{1, 1, 1}};
  std::vector<std::vector<float>> w;  // per HF tensor
  std::vector<std::vector<std::uint8_t>> code;
  std::vector<std::vector<float>> scale;
  Version version = 0;
  std::uint64_t codes_sent = 0, scales_sent = 0;
  std::mt19937 rng{11};

  Bench() {
    std::normal_distribution<float> init(0.0f, 0.05f);
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      w.emplace_back(static_cast<std::size_t>(hf[t].numel()));
      for (float& x : w.back())
        x = Bf16Format::widen(Bf16Format::round(init(rng)));
    }
    for (std::int64_t id : sender.grid().quantized_ids()) {
      code.emplace_back(static_cast<std::size_t>(sender.grid().grid(id).numel()), 0x7F);
      scale.emplace_back(static_cast<std::size_t>(sender.grid().grid(id).blocks()), -1.0f);
    }
    publish(true, {});
  }

  struct Change {
    std::int64_t tensor;
    std::uint32_t index;
    PreviousBits prev;
  };

  // Flags `changes` (the frame's changed elements, each with what its previous bits can be),
  // publishes, applies rank 0's part and checks it against the dense result.
  void publish(bool full, const std::vector<Change>& changes) {
    sender.begin(full);
    for (const Change& c : changes)
      sender.changed(c.tensor, c.index, c.prev);
    std::vector<Bytes> parts;
    const auto weights = [&](std::int64_t t) {
      return std::span<const float>(w[static_cast<std::size_t>(t)]);
    };
    const publication::Fp8Section s =
        sender.finish(weights, version + 1, full ? no_version : version, parts);
    REQUIRE(parts.size() == 1);
    const receive::Fp8Part p =
        receive::decode_fp8_part(sender.grid(), VllmBlockFp8::name, parts[0], "test",
                                 {version + 1, full ? no_version : version, 0});
    sender.commit();
    ++version;
    codes_sent = scales_sent = 0;
    const std::vector<std::int64_t>& ids = sender.grid().quantized_ids();
    for (const receive::Fp8Writes& t : p.tensors) {
      const auto k =
          static_cast<std::size_t>(std::find(ids.begin(), ids.end(), t.tensor) - ids.begin());
      for (std::size_t i = 0; i < t.index.size(); ++i)
        code[k][t.index[i]] = t.code[i];
      for (std::size_t i = 0; i < t.block.size(); ++i)
        scale[k][t.block[i]] = t.scale[i];
      codes_sent += t.index.size();
      scales_sent += t.block.size();
    }
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const sim::DenseFp8 d = sim::dense_fp8(sender.grid(), 0, ids[k], weights);
      CAPTURE(sender.layout().name(ids[k]));
      REQUIRE(d.code == code[k]);
      for (std::size_t b = 0; b < d.scale.size(); ++b)
        REQUIRE(float_bits(d.scale[b]) == float_bits(scale[k][b]));
      Digest digest = 0;
      for (std::size_t o = 0; o < d.code.size(); ++o)
        digest += publication::fp8_code_digest(static_cast<std::int64_t>(o), d.code[o]);
      for (std::size_t b = 0; b < d.scale.size(); ++b)
        digest += publication::fp8_scale_digest(sender.grid().grid(ids[k]).numel(),
                                                static_cast<std::int64_t>(b), d.scale[b]);
      REQUIRE(digest == s.parts[0].digest[k]);
    }
  }

  // Sets element `index` of HF tensor t to the BF16 value `bits`; returns the change with its
  // previous bits known exactly.
  Change set(std::int64_t t, std::uint32_t index, std::uint16_t bits) {
    float& x = w[static_cast<std::size_t>(t)][index];
    PreviousBits p;
    p.bits = Bf16Format::round(x);
    p.certain = p.bounded = true;
    p.lo = p.hi = p.bits;
    x = Bf16Format::widen(bits);
    return {t, index, p};
  }
  [[nodiscard]] std::uint16_t bits(std::int64_t t, std::uint32_t index) const {
    return Bf16Format::round(w[static_cast<std::size_t>(t)][index]);
  }
  // The block (0, 0) of layer 0's gate_up_proj is gate rows 0..127, columns 0..127.
  [[nodiscard]] std::int64_t gate() const { return hf.id(layout::HfKind::gate, 0); }
  // gate_up_proj's place among the quantized tensors.
  [[nodiscard]] std::size_t gate_up() const {
    const auto& ids = sender.grid().quantized_ids();
    return static_cast<std::size_t>(
        std::find(ids.begin(), ids.end(), sender.layout().id(layout::ReceiverKind::gate_up, 0)) -
        ids.begin());
  }
  [[nodiscard]] std::uint32_t at(std::int64_t row, std::int64_t col) const {
    return static_cast<std::uint32_t>(row * spec.hidden + col);
  }
  // The element of largest magnitude in gate's block (0, 0).
  [[nodiscard]] std::uint32_t block_max() const {
    std::uint32_t best = 0;
    float m = -1;
    for (std::int64_t r = 0; r < 128; ++r)
      for (std::int64_t c = 0; c < 128; ++c) {
        const float v = std::fabs(w[static_cast<std::size_t>(gate())][at(r, c)]);
        if (v > m) {
          m = v;
          best = at(r, c);
        }
      }
    return best;
  }
};

}  // namespace

TEST_CASE_FIXTURE(Bench, "fp8: the sender's rule on adversarial blocks") {
  const std::int64_t g = gate();
  SUBCASE("a change within an FP8 code sends nothing; one across a boundary sends one code") {
    // a small element: its code has room for a one-ulp step
    const std::uint32_t i = at(3, 5);
    const std::uint16_t b = bits(g, i);
    publish(false, {set(g, i, static_cast<std::uint16_t>(b ^ 1u))});
    CHECK(scales_sent == 0);
    CHECK(codes_sent <= 1);
  }
  SUBCASE("the amax moves by one BF16 ulp, up and down") {
    const std::uint32_t m = block_max();
    publish(false, {set(g, m, static_cast<std::uint16_t>(bits(g, m) + 1))});
    CHECK(scales_sent == 1);
    publish(false, {set(g, m, static_cast<std::uint16_t>(bits(g, m) - 2))});
    CHECK(scales_sent == 1);
  }
  SUBCASE("the largest element changes sign: same scale, one code") {
    const std::uint32_t m = block_max();
    publish(false, {set(g, m, static_cast<std::uint16_t>(bits(g, m) ^ 0x8000u))});
    CHECK(scales_sent == 0);
    CHECK(codes_sent == 1);
  }
  SUBCASE("an all-zero block (the 1e-4 clamp), then values below and above 1e-4") {
    std::vector<Change> c;
    for (std::int64_t r = 0; r < 128; ++r)
      for (std::int64_t col = 0; col < 128; ++col)
        c.push_back(set(g, at(r, col), (r + col) % 2 == 0 ? 0x0000 : 0x8000));  // +0 and -0
    publish(false, c);
    CHECK(scale[gate_up()][0] == VllmBlockFp8::scale(0.0f));
    const std::uint16_t tiny = Bf16Format::round(3e-5f), big = Bf16Format::round(2e-4f);
    publish(false, {set(g, at(7, 7), tiny)});
    CHECK(scales_sent == 0);
    publish(false, {set(g, at(9, 9), big)});
    CHECK(scales_sent == 1);
    publish(false, {set(g, at(9, 9), 0x0000)});
  }
  SUBCASE("values at E4M3 rounding midpoints, ties to even") {
    // amax 448 * 2^-10: the scale is 2^-10 exactly, so x * (1 / scale) is exact
    const std::uint32_t m = block_max();
    std::vector<Change> c{set(g, m, Bf16Format::round(448.0f / 1024.0f))};
    publish(false, c);
    CHECK(float_bits(scale[gate_up()][0]) == float_bits(1.0f / 1024.0f));
    // 1.0625 lies between 1.0 and 1.125 (ties to 1.0); 1.1875 between 1.125 and 1.25 (to 1.25);
    // 1.03125 and 1.09375 move just around the first midpoint
    const float mids[] = {1.0625f, 1.1875f, 1.03125f, 1.09375f, 1.0625f, -1.0625f, 0.013671875f};
    for (const float x : mids) {
      publish(false, {set(g, at(2, 2), Bf16Format::round(x / 1024.0f))});
      CHECK(codes_sent <= 1);
    }
    CHECK(code[gate_up()][static_cast<std::size_t>(2 * 160 + 2)] ==
          e4m3fn_from_float(0.013671875f));
  }
  SUBCASE("blocks cut by the tensor's edge") {
    // down_proj is 160 x 272: its last block row has 32 rows, its last block column 16 columns
    const std::int64_t d = hf.id(layout::HfKind::down, 1);
    std::vector<Change> c;
    for (const auto& [r, col] : {std::pair{159, 271}, {130, 260}, {159, 256}, {0, 271}}) {
      const auto i = static_cast<std::uint32_t>(r * 272 + col);
      c.push_back(set(d, i, Bf16Format::round(r % 2 == 0 ? 0.75f : -0.5f)));
    }
    publish(false, c);
    CHECK(scales_sent >= 1);
  }
  SUBCASE("guard band: previous bits known only to a range") {
    const std::uint32_t i = at(4, 4);
    const std::uint16_t b = bits(g, i);
    // unchanged in BF16, flagged by the guard band with a range around its value
    Change c{g, i, {}};
    c.prev.bounded = true;
    c.prev.lo = static_cast<std::uint16_t>(b - 1);
    c.prev.hi = static_cast<std::uint16_t>(b + 1);
    publish(false, {c});
    // every candidate in one code: nothing to send; candidates in two codes: the code is sent
    const float mult = VllmBlockFp8::multiplier(scale[gate_up()][0]);
    const bool one_code =
        VllmBlockFp8::code(c.prev.lo, mult) == VllmBlockFp8::code(c.prev.hi, mult);
    CHECK(codes_sent == (one_code ? 0u : 1u));
    // a range straddling an FP8 boundary: find one, element by element up from b
    std::uint16_t lo = b;
    while (VllmBlockFp8::code(lo, mult) ==
           VllmBlockFp8::code(static_cast<std::uint16_t>(lo + 1), mult))
      ++lo;
    w[static_cast<std::size_t>(g)][i] = Bf16Format::widen(lo);  // the value before
    publish(false, {Change{g, i, PreviousBits{lo, true, true, lo, lo}}});
    Change s{g, i, {}};
    s.prev.bounded = true;
    s.prev.lo = lo;
    s.prev.hi = static_cast<std::uint16_t>(lo + 1);
    publish(false, {s});     // the value stays lo: the receiver already has its code, but the
    CHECK(codes_sent == 1);  // sender cannot know, so it sends it
    // no bound at all (a reconstruction without one): always sent
    publish(false, {Change{g, i, PreviousBits{}}});
    CHECK(codes_sent == 1);
    // a range through zero: -0 and +0 have codes of their own
    publish(false, {set(g, i, 0x0001)});
    Change z{g, i, {}};
    z.prev.bounded = true;
    z.prev.lo = 0x8001;
    z.prev.hi = 0x0001;
    publish(false, {z});
    CHECK(codes_sent == 1);
  }
  SUBCASE("random steps of a few ulps on random elements, several blocks and tensors") {
    std::uniform_int_distribution<std::int64_t> tensor(0, hf.size() - 1);
    std::uniform_int_distribution<int> step(-3, 3);
    for (int round = 0; round < 60; ++round) {
      std::vector<Change> c;
      std::vector<std::pair<std::int64_t, std::uint32_t>> seen;
      for (int k = 0; k < 200; ++k) {
        const std::int64_t t = tensor(rng);
        if (!sender.takes(t)) continue;
        std::uniform_int_distribution<std::uint32_t> idx(
            0, static_cast<std::uint32_t>(hf[t].numel() - 1));
        const std::uint32_t i = idx(rng);
        if (std::find(seen.begin(), seen.end(), std::pair{t, i}) != seen.end()) continue;
        seen.emplace_back(t, i);
        const std::uint16_t b = bits(t, i);
        c.push_back(set(t, i, static_cast<std::uint16_t>(b + step(rng))));
        if (round % 3 == 1) c.back().prev.certain = false;  // a guard-band range of +-1 ulp
        if (round % 3 == 1) {
          c.back().prev.lo = static_cast<std::uint16_t>(c.back().prev.bits - 1);
          c.back().prev.hi = static_cast<std::uint16_t>(c.back().prev.bits + 1);
        }
      }
      publish(false, c);
    }
  }
}

TEST_CASE("fp8: refusals leave the rank untouched") {
  const layout::ModelSpec spec = sim::fp8_test_model();
  testing::FlatAdamW tr(spec);
  tr.lr = 2e-5;
  Pub pub(spec);
  pub.serve_fp8({VllmBlockFp8::name, layout::InferTopology{2, 1, 1}});
  Ranks ranks(pub.model(), spec, 2);
  const auto publish = [&](bool full) {
    const auto f = tr.flat();
    return pub.publish(publication::FlatAccess<AdamWInverse>{&f, &pub.model()}, full);
  };
  const Bytes v1 = publish(true);
  tr.step();
  const Bytes v2 = publish(false);
  publication::ShardReceiver& rx = *ranks.rx[1];
  sim::Fp8RankTensors& x = *ranks.tensors[1];
  const auto untouched = [&](auto&& f, const char* what) {
    CAPTURE(what);
    const auto code = x.code;
    const auto scale = x.scale;
    const auto bf16 = x.bf16;
    const Version held = rx.version();
    const auto digest = rx.fp8_digest();
    CHECK_THROWS_AS(f(), dte::error);
    CHECK(x.code == code);
    CHECK(x.scale == scale);
    CHECK(x.bf16 == bf16);
    CHECK(rx.version() == held);
    CHECK(rx.fp8_digest() == digest);
  };
  untouched([&] { rx.apply(v2); }, "a delta before any full publication");
  REQUIRE(rx.apply(v1).committed());
  {
    Bytes bad = v2;
    bad[bad.size() - 3] ^= std::byte{0x10};
    untouched([&] { rx.apply(bad); }, "a flipped bit in an FP8 part");
    bad = v2;
    bad.resize(bad.size() - 2);
    untouched([&] { rx.apply(bad); }, "a truncated message");
  }
  {
    publication::Publisher<AdamWInverse, BF16Detect> bf16(spec);
    const auto f = tr.flat();
    const Bytes plain = bf16.publish(publication::FlatAccess<AdamWInverse>{&f}, true);
    untouched([&] { rx.apply(plain); }, "a BF16 publication");
    Ranks tp1(pub.model(), spec, 1);
    CHECK_THROWS_AS(tp1.rx[0]->apply(v1), dte::format_error);  // for tp=2, not tp=1
  }
  {
    // a code the delta overwrites, changed behind dte's back: the digest the rank would hold
    // is not the sender's, so the delta is refused and undone
    const publication::View v = publication::decode(pub.model(), v2, "v2", publication::fp8_format);
    const receive::Fp8Part p =
        receive::decode_fp8_part(ranks.grid, VllmBlockFp8::name, v.fp8_parts[1], "v2", {2, 1, 1});
    REQUIRE(!p.tensors.empty());
    REQUIRE(!p.tensors[0].index.empty());
    const auto& ids = ranks.grid.quantized_ids();
    const auto k = static_cast<std::size_t>(std::find(ids.begin(), ids.end(), p.tensors[0].tensor) -
                                            ids.begin());
    std::uint8_t& c = x.code[k][p.tensors[0].index[0]];
    c ^= 0x01;
    untouched([&] { rx.apply(v2); }, "codes changed behind dte's back");
    CHECK(rx.fp8_verify() != "");
    c ^= 0x01;
    CHECK(rx.fp8_verify() == "");
  }
  REQUIRE(rx.apply(v2).committed());
  CHECK(rx.apply(v2).outcome == ApplyOutcome::current);
  CHECK(sim::fp8_rank_differs(ranks.grid, 1, x, weights_of(tr)) == "");
  // the sender refuses what it does not cover
  CHECK_THROWS_AS(pub.serve_fp8({"fp8-per-tensor", layout::InferTopology{1, 1, 1}}),
                  dte::unsupported);
  Pub moe(layout::model_preset("tiny-qwen3-moe"));
  CHECK_THROWS_AS(moe.serve_fp8({VllmBlockFp8::name, layout::InferTopology{1, 1, 1}}),
                  dte::unsupported);
}
