// SPDX-License-Identifier: Apache-2.0
// The receiver's commit rules, the receiver alone (no engine, no digest verification behind
// it): a version commits only when every sender's message of exactly that version has arrived
// and was checked; replays change nothing; nothing moves a receiver backwards; a delta needs the
// exact base held; a repair is checked like everything else; the padding is not writable. Every
// refusal leaves tensors, version and digest untouched and says why in a structured refusal.
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "receiver_fixture.hpp"

using namespace dte;
using dte::test::ReceiverFixture;

namespace {

// A refusal: nothing changed, and the message says `why`.
void check_refused(ReceiverFixture& f, const ApplyResult& r,
                   const ReceiverFixture::Snapshot& before, const std::string& why,
                   RefusalKind kind) {
  CHECK(r.outcome == ApplyOutcome::refused);
  CHECK_MESSAGE(r.refusal.find(why) != std::string::npos, r.refusal);
  CHECK(r.kind == kind);
  CHECK(r.written == 0);
  CHECK(f.snapshot() == before);
}

// Brings the fixture to version `held` (0: the full publication; then deltas 1 .. held).
void advance(ReceiverFixture& f, Version held) {
  REQUIRE(f.rx.apply(0, f.full_publication(0, 0x3F80)).committed());
  for (Version v = 1; v <= held; ++v) {
    const ApplyResult r =
        f.rx.apply(v, f.delta_publication(v, v - 1, {{1, static_cast<std::uint32_t>(v), 0x4000}}));
    REQUIRE(r.committed());
  }
}

}  // namespace

TEST_CASE("a complete publication commits and keeps the digest equal to the tensors'") {
  ReceiverFixture f(1, 3);
  CHECK(f.rx.version() == no_version);
  const ApplyResult full = f.rx.apply(0, f.full_publication(0, 0x3F80));
  REQUIRE(full.committed());
  CHECK(f.rx.version() == 0);
  CHECK(f.rx.digest() == f.digest_of_tensors());
  const ApplyResult d = f.rx.apply(1, f.delta_publication(1, 0, {{1, 3, 0x4000}, {2, 7, 0x1}}));
  REQUIRE(d.committed());
  CHECK(d.written == 2);
  CHECK(f.storage[1][3] == 0x4000);
  CHECK(f.rx.digest() == f.digest_of_tensors());
  // A no-op version: headers only, from every sender.
  CHECK(f.rx.apply(2, f.noop_publication(2, 1)).committed());
  CHECK(f.rx.version() == 2);
}

TEST_CASE("a replay-only inbox commits nothing") {
  ReceiverFixture f(0, 2);
  advance(f, 0);
  const auto before = f.snapshot();
  // Version 5 announced, but only the replayed version-0 messages arrive.
  const ApplyResult r = f.rx.apply(5, f.full_publication(0, 0x1234));
  check_refused(f, r, before, "no message of version 5 from sender 0", RefusalKind::protocol);
  CHECK(r.stale == 2);
  CHECK(f.rx.version() == 0);
  CHECK(r.context.peer == 0);
  CHECK(r.context.version == 5);
  CHECK(r.context.held == 0);
}

TEST_CASE("an empty inbox commits nothing") {
  ReceiverFixture f(0, 2);
  advance(f, 1);
  const auto before = f.snapshot();
  check_refused(f, f.rx.apply(2, {}), before, "no message of version 2 from sender 0",
                RefusalKind::protocol);
  // A fresh receiver too.
  ReceiverFixture fresh(0, 2);
  const auto empty = fresh.snapshot();
  check_refused(fresh, fresh.rx.apply(0, {}), empty, "from sender 0", RefusalKind::protocol);
  CHECK(fresh.rx.version() == no_version);
}

TEST_CASE("one sender's message missing: the receiver notices and commits nothing") {
  ReceiverFixture f(0, 2);
  advance(f, 1);
  const auto before = f.snapshot();
  Inbox in = f.delta_publication(2, 1, {{1, 5, 0x4040}});
  in.erase(in.begin() + 1);  // sender 1's (empty) message is lost
  const ApplyResult r = f.rx.apply(2, in);
  check_refused(f, r, before, "no message of version 2 from sender 1", RefusalKind::protocol);
  CHECK(r.context.peer == 1);
  // A sender's message twice, or one from a sender that does not exist: refused too.
  Inbox twice = f.delta_publication(2, 1, {{1, 5, 0x4040}});
  twice.push_back(twice.front());
  check_refused(f, f.rx.apply(2, twice), before, "a second message of version 2 from the same",
                RefusalKind::protocol);
  Inbox stranger = f.delta_publication(2, 1, {});
  stranger.emplace_back(7, stranger.front().second);
  check_refused(f, f.rx.apply(2, stranger), before, "there is no such sender",
                RefusalKind::protocol);
  // The complete publication then commits.
  CHECK(f.rx.apply(2, f.delta_publication(2, 1, {{1, 5, 0x4040}})).committed());
}

TEST_CASE("an older full publication does not roll the receiver back") {
  ReceiverFixture f(0, 2);
  advance(f, 3);
  const auto before = f.snapshot();
  check_refused(f, f.rx.apply(1, f.full_publication(1, 0x1111)), before,
                "version 1 is older than the version 3 this receiver holds", RefusalKind::protocol);
  // Nor does an older full message inside the current publication: it is a replay.
  Inbox in = f.delta_publication(4, 3, {{1, 9, 0x4100}});
  in.emplace_back(0, wire::encode(f.full(1, 0x2222, {0, 1, 2})));
  const ApplyResult r = f.rx.apply(4, in);
  CHECK(r.committed());
  CHECK(r.stale == 1);
  CHECK(f.storage[0][0] == 0x3F80);  // the older full's values were not written
  CHECK(f.rx.digest() == f.digest_of_tensors());
}

TEST_CASE("a message of a later version than the one applied is refused") {
  ReceiverFixture f(0, 2);
  advance(f, 1);
  const auto before = f.snapshot();
  Inbox in = f.delta_publication(2, 1, {});
  in.emplace_back(1, f.delta_publication(3, 2, {}).front().second);
  check_refused(f, f.rx.apply(2, in), before, "version 3 arrived while 2 is being applied",
                RefusalKind::protocol);
}

TEST_CASE("a delta on no_version is refused by a fresh receiver") {
  ReceiverFixture f(0, 2);
  const auto before = f.snapshot();
  check_refused(f, f.rx.apply(no_version, f.full_publication(no_version, 0x3F80)), before,
                "version 2^64 - 1 is reserved", RefusalKind::protocol);
  const ApplyResult r = f.rx.apply(0, f.delta_publication(0, no_version, {{1, 3, 0x4000}}));
  check_refused(f, r, before, "holds nothing yet; it needs a full publication first",
                RefusalKind::protocol);
  CHECK(f.rx.version() == no_version);
  // And a delta on a base other than the one held.
  ReceiverFixture g(0, 2);
  advance(g, 1);
  const auto held = g.snapshot();
  check_refused(g, g.rx.apply(3, g.delta_publication(3, 2, {{1, 3, 0x4000}})), held,
                "delta on base version 2 but this receiver holds 1", RefusalKind::protocol);
}

TEST_CASE("a message into the vocabulary padding is refused") {
  // Receiver rank 1 (TP rank 1) holds vocabulary rows 160..319 of embed_tokens; rows 300..319
  // are padding: elements from (300 - 160) * 32 = 4480 on.
  ReceiverFixture f(1, 2);
  advance(f, 0);
  const auto before = f.snapshot();
  CHECK(f.recv.live_end(1, 0) == 4480);
  const ApplyResult r =
      f.rx.apply(1, f.delta_publication(1, 0, {{0, 4479, 0x4000}, {0, 4480, 0x4000}}));
  check_refused(f, r, before, "lies in the vocabulary padding (elements 4480 to 5120)",
                RefusalKind::bounds);
  CHECK(r.context.field == "model.embed_tokens.weight");
  // The last live element is writable.
  CHECK(f.rx.apply(1, f.delta_publication(1, 0, {{0, 4479, 0x4000}})).committed());
  CHECK(f.rx.digest() == f.digest_of_tensors());
}

TEST_CASE("a failed repair leaves tensors, version and digest untouched") {
  ReceiverFixture f(0, 2);
  advance(f, 2);
  const auto before = f.snapshot();
  wire::Message repair;
  repair.kind = MessageKind::repair;
  repair.version = 2;
  repair.runs.push_back({1, 0, std::vector<std::uint16_t>(4, 0x4242)});
  repair.runs.push_back({1, 1u << 20, std::vector<std::uint16_t>(4, 0x4242)});  // outside
  check_refused(f, f.rx.apply(2, {{0, wire::encode(repair)}}), before,
                "is outside model.layers.0.input_layernorm.weight", RefusalKind::bounds);
  // A repair for a version this receiver does not hold.
  repair.runs.pop_back();
  repair.version = 3;
  check_refused(f, f.rx.apply(3, {{0, wire::encode(repair)}}), before,
                "a repair of version 3 but this receiver holds 2", RefusalKind::protocol);
  // A repair mixed with a publication's messages.
  Inbox mixed = f.delta_publication(2, 1, {});
  repair.version = 2;
  mixed.emplace_back(1, wire::encode(repair));
  mixed.erase(mixed.begin() + 1);
  check_refused(f, f.rx.apply(2, mixed), before, "a repair message in a publication",
                RefusalKind::protocol);
  // A valid repair from one sender commits within the version and rebuilds the digest.
  const ApplyResult ok = f.rx.apply(2, {{0, wire::encode(repair)}});
  CHECK(ok.committed());
  CHECK(f.rx.version() == 2);
  CHECK(f.storage[1][0] == 0x4242);
}

TEST_CASE("a re-delivered current version changes nothing and says so") {
  ReceiverFixture f(0, 2);
  advance(f, 2);
  const auto before = f.snapshot();
  const ApplyResult r = f.rx.apply(2, f.delta_publication(2, 1, {{1, 11, 0x4444}}));
  CHECK(r.outcome == ApplyOutcome::current);
  CHECK_FALSE(r.committed());
  CHECK(r.refusal.empty());
  CHECK(r.written == 0);
  CHECK(f.snapshot() == before);
}

TEST_CASE("corrupt bytes are a format refusal naming the sender") {
  ReceiverFixture f(0, 2);
  advance(f, 1);
  const auto before = f.snapshot();
  Inbox in = f.delta_publication(2, 1, {{1, 3, 0x4000}});
  in[1].second[0] ^= std::byte{1};  // the magic
  const ApplyResult r = f.rx.apply(2, in);
  check_refused(f, r, before, "sender 1 to receiver 0", RefusalKind::format);
  CHECK(r.context.rank == 0);
}

TEST_CASE("a full publication must write every live element exactly once") {
  ReceiverFixture f(0, 2);
  const auto fresh = f.snapshot();
  // Sender 1 sends a bare full header: half the tensors are never written.
  Inbox half = f.full_publication(0, 0x3F80);
  half[1].second = wire::encode(f.full(0, 0x3F80, {}));
  check_refused(f, f.rx.apply(0, half), fresh, "live elements this receiver holds; refused",
                RefusalKind::protocol);
  // Both senders write tensor 0.
  Inbox twice = f.full_publication(0, 0x3F80);
  twice[1].second = wire::encode(f.full(0, 0x3F80, {0}));
  check_refused(f, f.rx.apply(0, twice), fresh, "twice (senders 0 and 1)", RefusalKind::protocol);
  CHECK(f.rx.version() == no_version);
  // A partial repair keeps the digest equal to the tensors' (it is updated, not rebuilt).
  REQUIRE(f.rx.apply(0, f.full_publication(0, 0x3F80)).committed());
  wire::Message repair;
  repair.kind = MessageKind::repair;
  repair.version = 0;
  repair.runs.push_back({1, 4, std::vector<std::uint16_t>(3, 0x4242)});
  REQUIRE(f.rx.apply(0, {{1, wire::encode(repair)}}).committed());
  CHECK(f.rx.digest() == f.digest_of_tensors());
}

namespace {

// Host memory behind the sink interface, as DeviceTensors keeps device memory: the writes of a
// commit, the digest moved by what they overwrite and write.
class HostSink : public TensorSink {
 public:
  HostSink(const layout::HfModel& hf, const layout::ServingLayout& recv, std::int64_t rank)
      : hf_(&hf),
        recv_(&recv),
        ts_(rank % recv.topology().tp),
        tensors(ReceiverFixture::make_storage(recv)),
        digest_(static_cast<std::size_t>(hf.size()), 0) {}

  void commit(const receive::StagedWrites& w) override {
    ++commits;
    if (w.full()) std::fill(digest_.begin(), digest_.end(), Digest{0});
    w.for_each([&](std::uint32_t t, std::uint32_t i, std::uint16_t bits) {
      std::uint16_t& cell = tensors[t][i];
      const layout::Canonical c = recv_->source({ts_, t, i});
      const std::int64_t g = (*hf_)[c.tensor].base + c.index;
      digest_[static_cast<std::size_t>(c.tensor)] +=
          element_digest(g, bits) - (w.full() ? 0 : element_digest(g, cell));
      cell = bits;
    });
  }
  [[nodiscard]] std::vector<Digest> digest() const override { return digest_; }

  const layout::HfModel* hf_;
  const layout::ServingLayout* recv_;
  std::int64_t ts_;
  std::vector<std::vector<std::uint16_t>> tensors;
  std::vector<Digest> digest_;
  int commits = 0;
};

}  // namespace

TEST_CASE("tensors behind a sink: the same checks, the same writes, the same digest") {
  ReceiverFixture f(1, 3);
  auto sink = std::make_shared<HostSink>(f.hf, f.recv, 1);
  Receiver behind(f.hf, f.recv, 1, 3, sink);
  CHECK(behind.has_sink());
  CHECK_THROWS_AS((void)behind.tensor(0), invalid_argument);
  auto same = [&] {
    CHECK(sink->tensors == f.storage);
    CHECK(behind.digest() == f.rx.digest());
    CHECK(behind.version() == f.rx.version());
  };
  const Inbox full = f.full_publication(0, 0x3F80);
  REQUIRE(f.rx.apply(0, full).committed());
  REQUIRE(behind.apply(0, full).committed());
  same();
  const Inbox delta = f.delta_publication(1, 0, {{1, 3, 0x4000}, {2, 7, 0x1}, {0, 0, 0x7}});
  CHECK(f.rx.apply(1, delta).written == 3);
  CHECK(behind.apply(1, delta).written == 3);
  same();
  CHECK(sink->commits == 2);
  // A refused publication (a delta on the wrong base) reaches neither the tensors nor the sink.
  const Inbox wrong = f.delta_publication(2, 0, {{1, 4, 0x4000}});  // base 0, 1 is held
  CHECK(f.rx.apply(2, wrong).outcome == ApplyOutcome::refused);
  CHECK(behind.apply(2, wrong).outcome == ApplyOutcome::refused);
  CHECK(sink->commits == 2);
  same();
  // A no-op version commits an empty batch.
  CHECK(behind.apply(2, f.noop_publication(2, 1)).committed());
  CHECK(sink->commits == 3);
  CHECK(behind.version() == 2);
  CHECK_THROWS_AS(Receiver(f.hf, f.recv, 1, 3, std::shared_ptr<TensorSink>{}), invalid_argument);
}
