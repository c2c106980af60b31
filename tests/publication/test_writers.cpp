// SPDX-License-Identifier: Apache-2.0
// A sharded trainer's ranks publish one message per version (publication/publisher.hpp with
// layout::LocalShardPlan, publication::merge): each rank holds pieces of HF tensors where they
// live (rows as FSDP2 and Shard(0) split them, an element range as FSDP1's flat parameter does,
// column blocks as Shard(1) does with the 1-D tensors replicated, whole tensors as ZeRO owns
// them), detects its own changes and writes its part; the merged message equals, element for
// element and digest for digest, what one trainer holding the whole model publishes.
//   * every split, K = 1 (diff codes) and K = 2 (the dirty mask), into HF and TP-rank receivers;
//   * a refusal on one rank: every rank aborts, the next publication is full on all;
//   * check_writers refuses two senders of one element and an element nobody sends;
//   * merge refuses parts that disagree (version, writers, order).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/message.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "flat_adamw.hpp"
#include "hf_tensors.hpp"
#include "local_pieces.hpp"

using namespace dte;
using publication::Bytes;

namespace {

using Trainer = testing::FlatAdamW;
using Ref = publication::Publisher<AdamWInverse, BF16Detect>;
using Part = publication::Publisher<AdamWInverse, BF16Detect, layout::LocalShardPlan>;
using layout::LocalPiece;
using testing::HfTensors;
using testing::PieceAccess;
using testing::pieces_of;
using testing::Split;

struct ShardTensors {
  std::vector<std::vector<std::uint16_t>> data;
  ReceiverTensors views;
  explicit ShardTensors(const layout::ServingLayout& l) {
    for (std::int64_t k = 0; k < l.size(); ++k)
      data.emplace_back(static_cast<std::size_t>(l[k].numel), 0);
    for (auto& d : data)
      views.emplace_back(d);
  }
};

// W ranks of one trainer, each with its publisher; publish() is what every rank does for one
// version: its part, then merge and commit (or abort on all when one refuses).
struct Ranks {
  std::vector<std::unique_ptr<Part>> pubs;
  Ranks(const layout::ModelSpec& spec, const layout::HfModel& hf, Split split, std::int64_t W,
        publication::PublisherConfig cfg) {
    std::vector<std::vector<LocalPiece>> all;
    for (std::int64_t w = 0; w < W; ++w)
      all.push_back(pieces_of(hf, split, w, W));
    layout::check_writers(hf, all);
    for (std::int64_t w = 0; w < W; ++w) {
      pubs.push_back(std::make_unique<Part>(
          spec, all[static_cast<std::size_t>(w)],
          publication::Writer{static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(W)}, cfg));
    }
  }
  // every rank's step(); the merged message when a version is due
  template <class Access>
  std::optional<Bytes> step(const layout::ModelSpec& spec, const Access& a, bool full = false) {
    std::vector<std::optional<Bytes>> parts;
    bool failed = false;
    for (auto& p : pubs) {
      try {
        parts.push_back(full ? std::optional<Bytes>(p->publish(a, true)) : p->step(a));
      } catch (const dte::error&) {
        failed = true;
        parts.emplace_back();
      }
    }
    if (failed) {
      for (auto& p : pubs)
        p->abort();
      throw protocol_error("a rank refused");
    }
    if (!parts.front()) return std::nullopt;
    std::vector<std::span<const std::byte>> views;
    for (const auto& p : parts)
      views.emplace_back(*p);
    Bytes msg = publication::merge(spec, views);
    for (auto& p : pubs)
      p->commit();
    return msg;
  }
};

void same_stream(Split split, std::int64_t W, std::int64_t K, storage::Encoding enc) {
  CAPTURE(static_cast<int>(split));
  CAPTURE(W);
  CAPTURE(K);
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  Trainer tr(spec);
  const publication::PublisherConfig cfg{.publish_every = K, .encoding = enc};
  Ref ref(spec, cfg);
  Ranks ranks(spec, tr.hf, split, W, cfg);
  HfTensors want(ref.model()), got(ref.model());
  publication::HfReceiver rx_want(spec, want.views), rx_got(spec, got.views);
  const layout::InferTopology topo{.tp = 2};
  const layout::ServingLayout l(ref.model(), topo);
  ShardTensors shard_want(l), shard_got(l);
  publication::ShardReceiver sx_want(spec, topo, 1, shard_want.views);
  publication::ShardReceiver sx_got(spec, topo, 1, shard_got.views);

  const auto apply = [&](const Bytes& a, const Bytes& b) {
    REQUIRE(rx_want.apply(a).committed());
    REQUIRE(rx_got.apply(b).committed());
    REQUIRE(sx_want.apply(a).committed());
    REQUIRE(sx_got.apply(b).committed());
    CHECK(got.data == want.data);
    CHECK(shard_got.data == shard_want.data);
    CHECK(rx_got.digest() == rx_want.digest());
    CHECK(rx_got.verify().empty());
  };
  const auto flat = tr.flat();
  apply(ref.publish(publication::FlatAccess<AdamWInverse>{&flat}, true),
        *ranks.step(spec, PieceAccess(tr), true));
  int published = 0;
  for (int s = 0; s < 10; ++s) {
    tr.lr = s % 3 == 0 ? 2e-4 : 2e-6;
    tr.step();
    const auto f = tr.flat();
    const std::optional<Bytes> a = ref.step(publication::FlatAccess<AdamWInverse>{&f});
    const std::optional<Bytes> b = ranks.step(spec, PieceAccess(tr));
    REQUIRE(a.has_value() == b.has_value());
    if (!a) continue;
    apply(*a, *b);
    std::uint64_t changed = 0;
    for (const auto& p : ranks.pubs)
      changed += p->last().changed;
    CHECK(changed == ref.last().changed);
    ++published;
  }
  CHECK(published == 10 / K);
  CHECK(ref.last().changed > 0);
}

}  // namespace

TEST_CASE("writers: a sharded trainer's merged parts equal one trainer's publication") {
  for (Split split : {Split::rows, Split::flat, Split::columns, Split::owner}) {
    same_stream(split, 3, 1, storage::Encoding::diff);
    same_stream(split, 2, 1, storage::Encoding::value);
    same_stream(split, 3, 2, storage::Encoding::diff);
  }
  // more ranks than rows of the norms: empty pieces on some ranks
  same_stream(Split::rows, 7, 1, storage::Encoding::diff);
}

TEST_CASE("writers: a refusal on one rank aborts the version on all; the next is full") {
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  Trainer tr(spec);
  Ranks ranks(spec, tr.hf, Split::rows, 3, {});
  HfTensors got(tr.hf);
  publication::HfReceiver rx(spec, got.views);
  REQUIRE(rx.apply(*ranks.step(spec, PieceAccess(tr), true)).committed());
  tr.step();
  // a state element only rank 2 holds turns invalid (the last row of the last tensor)
  const auto& last = tr.hf[tr.hf.size() - 1];
  const auto k = static_cast<std::size_t>(last.base + last.numel() - 1);
  const float saved = tr.v[k];
  tr.v[k] = -1.0f;
  CHECK_THROWS_AS(ranks.step(spec, PieceAccess(tr)), dte::protocol_error);
  for (const auto& p : ranks.pubs) {
    CHECK(p->version() == 1);
    CHECK_FALSE(p->pending());
  }
  tr.v[k] = saved;
  tr.step();
  const std::optional<Bytes> next = ranks.step(spec, PieceAccess(tr));
  REQUIRE(next.has_value());
  const publication::ApplyReport r = rx.apply(*next);
  CHECK(r.full());
  CHECK(r.version == 2);
  CHECK(rx.verify().empty());
}

TEST_CASE("writers: check_writers refuses two senders of one element and a gap") {
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  const layout::HfModel hf(spec);
  std::vector<std::vector<LocalPiece>> ok = {pieces_of(hf, Split::rows, 0, 2),
                                             pieces_of(hf, Split::rows, 1, 2)};
  CHECK_NOTHROW(layout::check_writers(hf, ok));
  auto twice = ok;
  twice[1].push_back({0, 0, 1, true});  // rank 0 sends the first element already
  CHECK_THROWS_WITH_AS(layout::check_writers(hf, twice),
                       doctest::Contains("is sent by trainer ranks 0 and 1"),
                       dte::invalid_argument);
  auto gap = ok;
  gap[1].erase(gap[1].begin());
  CHECK_THROWS_WITH_AS(layout::check_writers(hf, gap),
                       doctest::Contains("is sent by no trainer rank"), dte::invalid_argument);
  auto replicas = ok;  // a replica that does not send is fine
  replicas[1].push_back({0, 0, 5, false});
  CHECK_NOTHROW(layout::check_writers(hf, replicas));
  CHECK_THROWS_AS(layout::LocalShardPlan(hf, {{0, 0, 4, true}, {0, 3, 2, true}}, 0),
                  dte::invalid_argument);
  CHECK_THROWS_AS(layout::LocalShardPlan(hf, {{0, hf[0].numel() - 1, 2, true}}, 0),
                  dte::invalid_argument);
}

TEST_CASE("writers: merge refuses parts that disagree") {
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  Trainer tr(spec);
  Ranks a(spec, tr.hf, Split::rows, 2, {});
  std::vector<Bytes> v1;
  for (auto& p : a.pubs)
    v1.push_back(p->publish(PieceAccess(tr), true));
  for (auto& p : a.pubs)
    p->commit();
  tr.step();
  std::vector<Bytes> v2;
  for (auto& p : a.pubs)
    v2.push_back(p->publish(PieceAccess(tr), false));
  const auto merge = [&](std::vector<Bytes> parts) {
    std::vector<std::span<const std::byte>> views;
    for (const auto& p : parts)
      views.emplace_back(p);
    return publication::merge(spec, views);
  };
  CHECK_NOTHROW(merge(v1));
  CHECK_THROWS_WITH_AS(merge({v1[0], v2[1]}), doctest::Contains("disagree on the version"),
                       dte::protocol_error);
  CHECK_THROWS_WITH_AS(merge({v1[0]}), doctest::Contains("parts were given"), dte::protocol_error);
  CHECK_THROWS_WITH_AS(merge({v1[1], v1[0]}), doctest::Contains("parts are in writer order"),
                       dte::protocol_error);
  // a part is not a publication: receivers take only the merged message
  HfTensors got(tr.hf);
  publication::HfReceiver rx(spec, got.views);
  CHECK_THROWS_WITH_AS(rx.apply(v1[0]), doctest::Contains("one writer's part"), dte::format_error);
  CHECK(rx.version() == no_version);
  CHECK(rx.apply(merge(v1)).committed());
  CHECK_THROWS_WITH_AS(rx.apply(v2[1]), doctest::Contains("one writer's part"), dte::format_error);
  CHECK_THROWS_AS(merge({merge(v1), v1[1]}), dte::format_error);  // a message is not a part
  CHECK(rx.apply(merge(v2)).committed());
  CHECK(rx.verify().empty());
  // a second publish before commit or abort is refused
  CHECK_THROWS_AS(a.pubs[0]->publish(PieceAccess(tr), false), dte::protocol_error);
}
