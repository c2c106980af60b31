// SPDX-License-Identifier: Apache-2.0
// DeltaEngine end to end on the host backend with in-process ranks.
//   * The golden invariant over the engine is tests/golden (the suite over every delivery path);
//     here: a tied model's embedding reaches each receiver once, a trainer whose real layout is
//     not dte's topology is refused.
//   * The host sender's messages are the sending policy (engine/wire.hpp) over each receiver's
//     stream in shard order, the stream the CUDA sender reads from its buckets.
//   * Faults: a dropped payload is noticed by the receiver (a sender missing) and resynced;
//     duplicated and bit-flipped payloads are caught and repaired or resynced (the receiver's
//     own commit rules are tested alone in test_receiver.cpp); NaN in optimizer
//     state refuses the publication and names the tensor; an unchanged step is an explicit
//     no-op version.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/routing_sink.hpp"
#include "dte/engine/wire.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/stack.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/synthetic_trainer.hpp"
// (the engine tests' synthetic trainer is the golden suite's: golden::lively)
#include "../golden/golden.hpp"

using namespace dte;
using namespace dte::layout;
using doctest::Contains;

namespace {

using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;
using Cluster = sim::LoopbackCluster<Engine>;

// Receiver elements that differ from the dense conversion of the trainer's weights.
std::int64_t golden_mismatches(const HfModel& hf, const ServingLayout& recv,
                               const sim::SyntheticTrainer& trainer, const Cluster& engine) {
  return sim::dense_mismatches(hf, recv, trainer.canonical_weights(), engine.receivers());
}

// The routing sink, and beside it each receiver's stream as the CUDA sender's buckets hold it,
// built from the frame's compacted elements (or a full pass's values) and the run table alone:
// per buffer, in shard order, every element to each of its copies (device.cuh's route and
// stable bucket by receiver).
template <class Frame>
struct StreamCapture {
  struct Element {
    std::uint32_t tensor, index;
    std::uint16_t bits;
  };
  RoutingSink* inner;
  std::vector<std::vector<Element>> streams;  // per receiver

  void begin(const Frame& f, pipeline::ScanMode mode) {
    for (auto& s : streams)
      s.clear();
    inner->begin(f, mode);
  }
  void prepare(const Frame& f, BufferKind b, std::size_t t, typename Frame::Tile& s) {
    inner->prepare(f, b, t, s);
  }
  void changed(const Frame& f, BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_changed(b, t, s, [&](const pipeline::Run& run, std::int64_t o, std::uint16_t bits) {
      for (const pipeline::RunTarget& x : f.runs().targets(run))
        streams[x.rank].push_back(
            {x.tensor, x.index + static_cast<std::uint32_t>(o - run.shard_begin), bits});
    });
    inner->changed(f, b, t, s);
  }
  void all(const Frame& f, BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          for (std::size_t j = 0; j < bits.size(); ++j) {
            for (const pipeline::RunTarget& x : f.runs().targets(run))
              streams[x.rank].push_back(
                  {x.tensor, x.index + static_cast<std::uint32_t>(at + std::int64_t(j)), bits[j]});
          }
        });
    inner->all(f, b, t, s);
  }
  template <class Access>
  void end(const Frame& f, const Access& a, pipeline::ScanMode mode) {
    inner->end(f, a, mode);
  }
  [[nodiscard]] std::uint64_t entries() const { return inner->entries(); }
};

std::vector<std::byte> flat(const Payload& p) {
  std::vector<std::byte> out;
  for (const std::span<const std::byte> s : p)
    out.insert(out.end(), s.begin(), s.end());
  return out;
}

}  // namespace

TEST_CASE("the host sender's messages are the sending policy over each receiver's stream") {
  // What makes the host and CUDA senders' bytes equal: both append each receiver's elements in
  // shard order, and the writer's policy depends on nothing else. Here the host frame writes
  // through the routing sink (deltas entry by entry, full passes as run pieces cut at tiles),
  // and the same streams are written again element by element, as the CUDA sender reads its
  // buckets; every message must be byte-identical. small-qwen3's shards span many tiles, so
  // stretches cross tile boundaries; a large learning rate makes deltas with long stretches.
  using Frame = SenderFrame<AdamWInverse, BF16Detect, TransferPlan, exec::Host>;
  struct Case {
    const char *model, *train, *infer;
    double lr;
  };
  const Case cases[] = {{"small-qwen3", "tp=2,pp=2", "tp=4,replicas=2", 3e-3},
                        {"tiny-qwen3", "tp=4,pp=2", "tp=1,replicas=2", 2e-5},  // short runs
                        {"tiny-qwen3-moe", "tp=2,pp=2,ep=2,dp=2", "tp=4,ep=2", 2e-5},
                        {"tiny-qwen3-tied", "tp=2,pp=2,dp=2", "tp=4,replicas=2", 3e-2}};
  for (const Case& c : cases) {
    CAPTURE(std::string(c.model));
    const HfModel hf(model_preset(c.model));
    const TrainTopology train = parse_train_topology(c.train);
    const ServingLayout recv(hf, parse_infer_topology(c.infer));
    sim::SyntheticConfig cfg = golden::lively();
    cfg.lr = c.lr;
    sim::SyntheticTrainer trainer(hf, train, cfg);
    const sim::AdamWAccess access{&trainer};
    std::uint64_t dense_elements = 0, entries = 0, messages = 0;
    for (int step = 0; step <= 3; ++step) {
      if (step > 0) trainer.step();
      const auto mode = step == 0 ? pipeline::ScanMode::all : pipeline::ScanMode::detect;
      for (std::int64_t rank = 0; rank < train.world(); ++rank) {
        Frame f(hf, train, &recv, rank, false, exec::Host(2));
        RoutingSink sink(f.runs(), recv);
        StreamCapture<Frame> capture{&sink, {}};
        capture.streams.resize(sink.outbox().size());
        const ScanResult res = f.scan(access, mode, capture);
        const std::vector<Payload> host = sink.outbox().finish(
            step == 0 ? MessageKind::full : MessageKind::delta, Version(step + 1), Version(step));
        wire::Outbox replay(sink.outbox().size());
        replay.begin(mode == pipeline::ScanMode::all);
        for (std::size_t d = 0; d < replay.size(); ++d) {
          for (const auto& e : capture.streams[d])
            replay[d].add(e.tensor, e.index, e.bits);
        }
        replay.flush();
        CHECK(replay.entries() == res.entries);
        const std::vector<Payload> device = replay.finish(
            step == 0 ? MessageKind::full : MessageKind::delta, Version(step + 1), Version(step));
        REQUIRE(device.size() == host.size());
        for (std::size_t d = 0; d < host.size(); ++d) {
          CAPTURE(step);
          CAPTURE(rank);
          CAPTURE(d);
          CHECK(flat(device[d]) == flat(host[d]));
          dense_elements += sink.outbox()[d].run_elements();
          entries += sink.outbox()[d].entries();
          ++messages;
        }
      }
    }
    MESSAGE(std::string(c.model) << ": " << messages << " messages, " << dense_elements
                                 << " elements in dense groups, " << entries << " indexed entries");
    CHECK(dense_elements > 0);
    CHECK(entries > 0);
  }
}

TEST_CASE("a tied model: each embedding change reaches a receiver once, not twice") {
  // Trainer pp = 2: the embedding (stage 0) sends, its copy as output layer (stage 1) only
  // validates. Every message delivered is decoded: no receiver element of embed_tokens is written
  // twice in a publication, and every element whose value changed was written.
  const HfModel hf(model_preset("tiny-qwen3-tied"));
  const TrainTopology train = parse_train_topology("tp=2,pp=2,dp=2");
  const ServingLayout recv(hf, parse_infer_topology("tp=2,replicas=2"));
  sim::SyntheticTrainer trainer(hf, train, golden::lively());
  const sim::AdamWAccess access{&trainer};
  Cluster engine(hf, train, recv, {.publish_every = 1});
  engine.world().keep_history(true);
  CHECK(engine.publish_full(access).verified);
  const std::int64_t embed = recv.id(ReceiverKind::embed);
  for (std::int64_t k = 0; k < recv.size(); ++k)
    CHECK(recv[k].kind != ReceiverKind::lm_head);
  std::int64_t changed_total = 0;
  for (int step = 1; step <= 12; ++step) {
    std::vector<std::vector<std::uint16_t>> before;
    for (const Receiver* r : engine.receivers()) {
      const auto t = r->tensor(embed);
      before.emplace_back(t.begin(), t.end());
    }
    trainer.step();
    SyncReport rep;
    REQUIRE(engine.step(access, rep));
    REQUIRE(rep.verified);
    REQUIRE(rep.repaired.empty());
    for (std::size_t d = 0; d < before.size(); ++d) {
      std::vector<std::uint8_t> writes(before[d].size(), 0);
      for (int s = 0; s < engine.world().senders(); ++s) {
        const auto bytes = engine.world().last_payload(s, static_cast<int>(d));
        if (bytes.empty()) continue;
        const wire::MessageView view(bytes, "sender " + std::to_string(s));
        view.for_each_entry([&](const DeltaEntry& e) {
          if (e.tensor == embed) ++writes.at(e.index);
        });
        view.for_each_run(
            [&](std::uint32_t tensor, std::uint32_t first, std::uint32_t count, const std::byte*) {
              if (tensor != embed) return;
              for (std::uint32_t i = 0; i < count; ++i)
                ++writes.at(first + i);
            });
      }
      const auto now = engine.receivers()[d]->tensor(embed);
      std::int64_t twice = 0, missed = 0, changed = 0;
      for (std::size_t i = 0; i < writes.size(); ++i) {
        twice += writes[i] > 1;
        const bool differs = now[i] != before[d][i];
        changed += differs;
        missed += differs && writes[i] != 1;
      }
      CHECK(twice == 0);
      CHECK(missed == 0);
      changed_total += changed;
    }
    CHECK(golden_mismatches(hf, recv, trainer, engine) == 0);
  }
  CHECK(changed_total > 0);  // the embedding did change: the check above saw real writes
}

TEST_CASE("a trainer whose real layout is not dte's topology is refused before anything is sent") {
  // The trainer follows mbridge's defaults (vocabulary not padded), dte is given Megatron-LM's
  // (padded to a multiple of 128 x tp), and the other way round, and an expert split (etp)
  // that differs: the first publication is refused on every rank, naming the parameter, the
  // rank, both shapes and the cause; the receivers are untouched.
  struct Case {
    const char* model;
    const char* trainer_stack;
    const char* dte_stack;
    const char* train;
    const char* expect;
    const char* cause;
  };
  for (const Case& c :
       {Case{"tiny-qwen3", "mbridge", "megatron-lm", "tp=2,dp=2",
             "embedding.word_embeddings.weight as [150, 32] where dte's plan expects [256, 32]",
             "the vocabulary not padded"},
        Case{"tiny-qwen3-tied", "megatron-lm", "mbridge", "tp=2,pp=2",
             "embedding.word_embeddings.weight as [256, 32] where dte's plan expects [150, 32]",
             "the vocabulary padded to a multiple of 128 x tp"},
        Case{"tiny-qwen3-moe", "areal", "mbridge", "tp=2,ep=2,dp=2",
             "mlp.experts.linear_fc1.weight0 as [32, 32] where dte's plan expects [16, 32]",
             "etp=1"}}) {
    CAPTURE(std::string(c.model));
    const HfModel hf(model_preset(c.model));
    TrainTopology real = parse_train_topology(c.train), assumed = real;
    apply_stack(real, parse_stack(c.trainer_stack));
    apply_stack(assumed, parse_stack(c.dte_stack));
    const ServingLayout recv(hf, parse_infer_topology("tp=2"));
    sim::SyntheticTrainer trainer(hf, real, golden::lively());
    const sim::AdamWAccess access{&trainer};
    Cluster engine(hf, assumed, recv, {.publish_every = 1});
    const Version before = engine.receivers().front()->version();
    CHECK_THROWS_WITH_AS(engine.publish_full(access), Contains(c.expect), dte::invalid_argument);
    CHECK_THROWS_WITH_AS(engine.publish_full(access), Contains(c.cause), dte::invalid_argument);
    for (const Receiver* r : engine.receivers()) {
      CHECK(r->version() == before);
      for (std::int64_t k = 0; k < recv.size(); ++k)
        for (std::uint16_t x : r->tensor(k))
          REQUIRE(x == 0);
    }
    // With the trainer's own topology it publishes.
    Cluster right(hf, real, recv, {.publish_every = 1});
    CHECK(right.publish_full(access).verified);
  }
}

namespace {

struct Fixture {
  HfModel hf{model_preset("tiny-qwen3-moe")};
  TrainTopology train = parse_train_topology("tp=2,ep=2,dp=2");
  ServingLayout recv{hf, parse_infer_topology("tp=2,replicas=2")};
  sim::SyntheticTrainer trainer{hf, train, golden::lively()};
  sim::AdamWAccess access{&trainer};
  Cluster engine{hf, train, recv, {.publish_every = 1}};

  Fixture() {
    engine.publish_full(access);
    for (int i = 0; i < 6; ++i)
      step();  // past warmup: real changes
  }
  SyncReport step() {
    trainer.step();
    SyncReport rep;
    REQUIRE(engine.step(access, rep));
    return rep;
  }
};

}  // namespace

TEST_CASE("a dropped payload: the receiver notices the missing sender, refuses, is resynced") {
  Fixture f;
  f.engine.world().inject({.kind = TransportFault::Kind::drop, .src = 1, .dst = 0});
  const SyncReport rep = f.step();
  CHECK(rep.resynced == std::vector<std::int64_t>{0});
  CHECK(rep.repair_refused.empty());
  CHECK(rep.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("a duplicated (replayed) payload is detected and changes nothing; the digest confirms") {
  Fixture f;
  f.engine.world().keep_history(true);
  f.step();
  f.engine.world().inject({.kind = TransportFault::Kind::duplicate, .src = 0, .dst = 1});
  const SyncReport rep = f.step();
  CHECK(rep.stale_messages == 1);  // the replay of the previous version, recognised and ignored
  CHECK(rep.verified);
  CHECK(rep.repaired.empty());
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("a bit flipped in a value is caught by the digest and repaired") {
  Fixture f;
  // A bit of the first 16-bit value of the message.
  f.engine.world().inject(
      {.kind = TransportFault::Kind::bitflip,
       .src = 0,
       .dst = 0,
       .bit = 3,
       .where = [](std::span<const std::byte> b) { return wire::first_value_offset(b); }});
  const SyncReport rep = f.step();
  CHECK(rep.repaired.size() >= 1);
  CHECK(rep.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("a refused repair is reported, the publication is not verified; the next one repairs") {
  Fixture f;
  // Delivery: a value to receiver 0 flipped (its digest disagrees); repair: the repair message
  // to receiver 0 gets a version 256 ahead (byte 9, bit 0), so receiver 0 refuses it.
  f.engine.world().inject(
      {.kind = TransportFault::Kind::bitflip,
       .src = 0,
       .dst = 0,
       .bit = 3,
       .where = [](std::span<const std::byte> b) { return wire::first_value_offset(b); }});
  f.engine.world().inject(
      {.kind = TransportFault::Kind::bitflip, .src = 0, .dst = 0, .byte = 9, .bit = 0});
  const SyncReport rep = f.step();
  CHECK_FALSE(rep.repaired.empty());
  CHECK(rep.repair_refused == std::vector<std::int64_t>{0});
  CHECK_FALSE(rep.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) > 0);  // receiver 0 is still wrong
  const SyncReport next = f.step();
  CHECK(next.repair_refused.empty());
  CHECK(next.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("a bit flipped in the header makes the receiver refuse; it is fully resynced") {
  Fixture f;
  // Byte 9 is inside the version (32-byte header: magic, kind, reserved, version, ...).
  f.engine.world().inject(
      {.kind = TransportFault::Kind::bitflip, .src = 0, .dst = 2, .byte = 9, .bit = 0});
  const SyncReport rep = f.step();
  CHECK(rep.resynced == std::vector<std::int64_t>{2});
  CHECK(rep.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("NaN in optimizer state refuses the publication and names the tensor") {
  Fixture f;
  const Version held = f.engine.version();
  f.trainer.step();
  float& cell = f.trainer.exp_avg_sq(1, BufferKind::dense)[100];
  const float saved = cell;
  cell = std::nanf("");
  SyncReport rep;
  try {
    f.engine.step(f.access, rep);
    FAIL("the publication was not refused");
  } catch (const dte::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("publication refused on trainer rank 1") != std::string::npos);
    CHECK(what.find("exp_avg_sq of tensor 'trainer rank 1 ") != std::string::npos);
    CHECK(what.find("non-finite") != std::string::npos);
  }
  CHECK(f.engine.version() == held);
  for (const Receiver* r : f.engine.receivers())
    CHECK(r->version() == held);
  // Once the state is sound again, the next publication resends everything (the refused
  // step's changes were never recorded) and the receivers are exact again.
  cell = saved;
  const SyncReport next = f.step();
  CHECK(next.kind == "full");
  CHECK(next.version == held + 1);
  CHECK(next.verified);
  CHECK(golden_mismatches(f.hf, f.recv, f.trainer, f.engine) == 0);
}

TEST_CASE("an unchanged step publishes an explicit no-op version") {
  Fixture f;
  f.trainer.set_lr_override(0.0);
  const SyncReport rep = f.step();
  CHECK(rep.kind == "noop");
  CHECK(rep.changed == 0);
  CHECK(rep.verified);
  for (const Receiver* r : f.engine.receivers())
    CHECK(r->version() == rep.version);
  const SyncReport skipped = f.engine.publish_noop(f.access);  // a skipped step
  CHECK(skipped.kind == "noop");
  CHECK(skipped.version == rep.version + 1);
  CHECK(skipped.verified);
}
