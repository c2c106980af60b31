// SPDX-License-Identifier: Apache-2.0
// Cross-cluster sync end to end (storage/publisher.hpp, storage/reader.hpp): writers of a
// sharded synthetic trainer publish to a storage root, readers of another topology follow it.
//   * The golden invariant for readers that keep up or lag is tests/golden (the suite over every
//     delivery path); here: a reader starting late replays from the newest anchor, and anchors
//     every N versions are HF checkpoint directories.
//   * RELIABILITY.md 6.2: M1 a missing chunk, M2 a short one, M3 regression, M4 re-delivery,
//     M5 a gap in the chain, M6 an anchor resetting the chain, M7 chunks without a manifest,
//     M8 a writer dead between manifest and LATEST, M9 a dirty reader reseeding, M11 a dead
//     writer's leftovers, M12 a chunk of another version in place, M14 one publisher group per
//     root; O1 an unchanged step as an empty delta.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/publisher.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/verify.hpp"

using namespace dte;
namespace fs = std::filesystem;

namespace {

struct Dir {
  static inline int made = 0;
  fs::path path = fs::temp_directory_path() /
                  ("dte-publish-" + std::to_string(::getpid()) + "-" + std::to_string(made++));
  Dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
};

// A trainer, its writers and the receiver layout readers use.
struct Setup {
  layout::HfModel hf;
  layout::TrainTopology train;
  layout::ServingLayout recv;
  sim::SyntheticTrainer trainer;
  sim::AdamWAccess access{&trainer};
  Dir dir;
  sim::StorageCluster writers;

  explicit Setup(storage::PublisherConfig cfg = {}, const char* model = "tiny-qwen3",
                 const char* train_spec = "tp=2,dp=2", const char* infer_spec = "tp=2,replicas=2",
                 double lr = 3e-5)
      : hf(layout::model_preset(model)),
        train(layout::parse_train_topology(train_spec)),
        recv(hf, layout::parse_infer_topology(infer_spec)),
        trainer(hf, train, {.lr = lr, .warmup_steps = 0}),
        writers(hf, train, dir.path, cfg, 2) {}

  sim::OwnedReader reader(std::vector<std::int64_t> replicas = {0},
                          storage::ReaderConfig cfg = {}) {
    return sim::OwnedReader(hf, recv, dir.path, std::move(replicas), std::move(cfg));
  }
  std::int64_t mismatches(const sim::OwnedReader& r, const std::vector<float>& canonical) const {
    return sim::dense_mismatches(hf, recv, canonical, r->receivers());
  }
};

fs::path first_chunk(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".zst") return e.path();
  }
  FAIL("no chunk in " << dir);
  return {};
}

}  // namespace

TEST_CASE("anchors every 5 versions; a reader starting late replays from the newest one") {
  // (readers that keep up or lag, after every version: the golden suite, tests/golden)
  Setup s({.anchor_every = 5});
  const auto first = s.writers.publish(s.access);
  CHECK(first.version == 1);
  CHECK(first.anchor());
  for (int step = 0; step < 12; ++step) {
    s.trainer.step();
    const auto rep = s.writers.step(s.access);
    REQUIRE(rep.has_value());
    CHECK(rep->version == static_cast<Version>(step + 2));
    CHECK(rep->anchor() == (rep->version % 5 == 0));
    if (!rep->anchor()) {
      CHECK(rep->base == rep->version - 1);
      CHECK(rep->changed > 0);
      CHECK(rep->bytes < rep->dense_bytes);
    }
  }
  const std::vector<float> weights = s.trainer.canonical_weights();
  // A reader starting now replays from the newest anchor (10).
  auto late = s.reader({0});
  const auto rep = late->poll();
  REQUIRE_MESSAGE(rep.ok(), rep.error);
  CHECK(rep.reseeded);
  CHECK(rep.applied == std::vector<Version>{10, 11, 12, 13});
  CHECK(s.mismatches(late, weights) == 0);
  // M4: polling again, and advancing to the version held, change nothing.
  const auto again = late->poll();
  CHECK(again.ok());
  CHECK(again.applied.empty());
  // M3: a version older than the one held is refused; the reader keeps what it holds.
  const auto back = late->advance(12);
  CHECK_FALSE(back.ok());
  CHECK(back.error.find("never moves backwards") != std::string::npos);
  CHECK(late->version() == 13);
}

TEST_CASE("an anchor is a Hugging Face checkpoint directory equal to the trainer's BF16 weights") {
  Setup s({.anchor_file_bytes = 50'000});
  const auto rep = s.writers.publish(s.access);
  REQUIRE(rep.anchor());
  const fs::path dir = storage::version_dir(s.dir.path, 1);
  const storage::Manifest m = storage::read_manifest(s.hf, s.dir.path, 1);
  CHECK(m.anchor());
  CHECK(m.chunks.size() > 1);  // sharded at 50 kB
  CHECK(fs::exists(dir / "model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(dir))
    CHECK(e.path().filename().string().find("anchor-part") == std::string::npos);
  const auto w = s.trainer.canonical_weights();
  std::int64_t seen = 0;
  storage::read_anchor(s.hf, dir, m, [&](std::int64_t t, const std::vector<std::uint16_t>& bits) {
    ++seen;
    for (std::size_t i = 0; i < bits.size(); ++i)
      REQUIRE(bits[i] == BF16Detect::store(w[static_cast<std::size_t>(s.hf[t].base) + i]));
  });
  CHECK(seen == s.hf.size());
}

TEST_CASE("M1, M2, M12: a missing, short or foreign chunk is never applied") {
  Setup s;
  auto r = s.reader();
  s.writers.publish(s.access);
  REQUIRE(r->poll().ok());
  const auto v1 = s.trainer.canonical_weights();
  s.trainer.step();
  s.writers.publish(s.access);
  const fs::path dir = storage::version_dir(s.dir.path, 2);
  const fs::path chunk = first_chunk(dir);
  const fs::path saved = s.dir.path / "saved.zst";
  fs::copy_file(chunk, saved);

  SUBCASE("M1 missing") {
    fs::remove(chunk);
  }
  SUBCASE("M2 short") {
    fs::resize_file(chunk, fs::file_size(chunk) - 1);
  }
  SUBCASE("F16 a flipped bit") {
    std::fstream f(chunk, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(chunk) / 2));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(fs::file_size(chunk) / 2));
    f.write(&c, 1);
  }
  SUBCASE("M12 another version's chunk of the same slot") {
    s.trainer.step();
    s.writers.publish(s.access);
    fs::copy_file(first_chunk(storage::version_dir(s.dir.path, 3)), chunk,
                  fs::copy_options::overwrite_existing);
    REQUIRE(r->advance(2).ok() == false);
    CHECK(r->version() == 1);
    CHECK(s.mismatches(r, v1) == 0);
    return;
  }
  const auto bad = r->poll();
  CHECK_FALSE(bad.ok());
  CHECK(bad.error.find(chunk.filename().string()) != std::string::npos);
  CHECK(r->version() == 1);
  CHECK_FALSE(r->dirty());
  CHECK(s.mismatches(r, v1) == 0);
  // The bytes arrive (eventual consistency): the next poll applies the version.
  fs::copy_file(saved, chunk, fs::copy_options::overwrite_existing);
  const auto good = r->poll();
  REQUIRE_MESSAGE(good.ok(), good.error);
  CHECK(r->version() == 2);
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
}

TEST_CASE("M5: a gap in the chain is refused; M6: a later anchor resets it") {
  Setup s;
  auto r = s.reader();
  s.writers.publish(s.access);
  REQUIRE(r->poll().ok());
  for (int i = 0; i < 3; ++i) {
    s.trainer.step();
    s.writers.publish(s.access);
  }
  fs::remove(storage::version_dir(s.dir.path, 3) / storage::manifest_name);
  const auto gap = r->poll();
  CHECK_FALSE(gap.ok());
  CHECK(gap.error.find("version 3") != std::string::npos);
  CHECK(r->version() == 1);
  // M6: an anchor; the reader reseeds from it and follows the deltas based on it.
  s.trainer.step();
  CHECK(s.writers.publish_anchor(s.access).anchor());
  s.trainer.step();
  const auto delta = s.writers.publish(s.access);
  CHECK(delta.base == 5);
  const auto rep = r->poll();
  REQUIRE_MESSAGE(rep.ok(), rep.error);
  CHECK(rep.applied == std::vector<Version>{5, 6});
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
}

TEST_CASE("M7: chunks without a manifest are invisible and the next publication succeeds") {
  Setup s;
  auto r = s.reader();
  s.writers.publish(s.access);
  s.trainer.step();
  s.writers.publish(s.access);
  REQUIRE(r->poll().ok());
  // A crashed publication of version 3: chunk files and a temporary, no manifest.
  const fs::path v3 = storage::version_dir(s.dir.path, 3);
  fs::create_directories(v3);
  std::ofstream(v3 / "c0-w0.zst") << "half written";
  std::ofstream(v3 / "manifest.json.tmp-1") << "{";
  CHECK(r->poll().applied.empty());
  CHECK(r->version() == 2);
  s.trainer.step();
  const auto rep = s.writers.publish(s.access);
  CHECK(rep.version == 3);
  REQUIRE(r->poll().ok());
  CHECK(r->version() == 3);
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
}

TEST_CASE("M14: one publisher group per root; a race for one version has one winner") {
  Setup s;
  s.writers.publish(s.access);
  // A second group on the same root is refused before it writes anything.
  CHECK_THROWS_WITH_AS(sim::StorageCluster(s.hf, s.train, s.dir.path, {}, 1),
                       doctest::Contains("another publisher holds"), protocol_error);
  // Of two writers of one manifest name, exactly one wins.
  const fs::path v9 = storage::version_dir(s.dir.path, 9);
  fs::create_directories(v9);
  const std::string text = "{}";
  CHECK(io::write_file_exclusive(v9 / storage::manifest_name, std::as_bytes(std::span(text)),
                                 "manifest"));
  CHECK_FALSE(io::write_file_exclusive(v9 / storage::manifest_name, std::as_bytes(std::span(text)),
                                       "manifest"));
  fs::remove_all(v9);
}

TEST_CASE("M8: a writer that died between its manifest and LATEST; M11: its leftovers") {
  Setup s;
  auto r = s.reader();
  s.writers.publish(s.access);
  REQUIRE(r->poll().ok());
  // Version 2 complete but never named by LATEST; version 3 half written by the dead writer.
  s.trainer.step();
  s.writers.publish(s.access);
  storage::write_latest(s.dir.path, 1);
  const fs::path v3 = storage::version_dir(s.dir.path, 3);
  fs::create_directories(v3);
  std::ofstream(v3 / "c0-w1.zst") << "half";
  std::ofstream(v3 / "c0-w0.zst.tmp-77") << "half";
  CHECK(r->poll().applied.empty());  // LATEST still names 1
  // The next publication goes above both; the dead writer's files are gone.
  s.trainer.step();
  const auto rep = s.writers.publish(s.access);
  CHECK(rep.version == 3);
  CHECK(rep.base == 2);  // this publisher wrote version 2: a delta on it is sound
  CHECK_FALSE(fs::exists(v3 / "c0-w0.zst.tmp-77"));
  const auto got = r->poll();
  REQUIRE(got.ok());
  CHECK(got.applied == std::vector<Version>{2, 3});
  CHECK(r->version() == 3);
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
  // A file the publisher did not write, in the next version's directory, stops it untouched.
  const fs::path v4 = storage::version_dir(s.dir.path, 4);
  fs::create_directories(v4);
  std::ofstream(v4 / "notes.txt") << "mine";
  s.trainer.step();
  CHECK_THROWS_WITH_AS(s.writers.publish(s.access), doctest::Contains("notes.txt"), io_error);
  CHECK(fs::exists(v4 / "notes.txt"));
  CHECK(storage::read_latest(s.dir.path) == Version{3});
}

TEST_CASE("M9: a dirty reader reseeds from the anchor") {
  Setup s({.anchor_every = 3});
  auto r = s.reader();
  s.writers.publish(s.access);
  for (int i = 0; i < 4; ++i) {
    s.trainer.step();
    s.writers.publish(s.access);
  }
  REQUIRE(r->advance(4).ok());
  // A manifest whose digest disagrees with its chunks (a writer bug): applied, caught, dirty.
  storage::Manifest m = storage::read_manifest(s.hf, s.dir.path, 5);
  m.digest[0] += 1;
  const std::string text = storage::manifest_json(m);
  io::write_file_atomic(storage::version_dir(s.dir.path, 5) / storage::manifest_name,
                        std::as_bytes(std::span(text)), "manifest");
  const auto bad = r->poll();
  CHECK_FALSE(bad.ok());
  CHECK(bad.error.find("digest") != std::string::npos);
  CHECK(r->dirty());
  // dte verify's replay names the manifest at fault, and only that one.
  const storage::VerifyReport v = storage::verify_root(s.hf, s.dir.path);
  REQUIRE(v.problems.size() == 1);
  CHECK(v.problems[0].path ==
        (storage::version_dir(s.dir.path, 5) / storage::manifest_name).string());
  CHECK(v.problems[0].what.find("disagrees with the manifest's digest of " + s.hf.name(0)) !=
        std::string::npos);
  CHECK(v.digests == v.versions);  // (each checked; the last one failed)
  m.digest[0] -= 1;
  const std::string fixed = storage::manifest_json(m);
  io::write_file_atomic(storage::version_dir(s.dir.path, 5) / storage::manifest_name,
                        std::as_bytes(std::span(fixed)), "manifest");
  const auto rep = r->poll();
  REQUIRE_MESSAGE(rep.ok(), rep.error);
  CHECK(rep.reseeded);
  CHECK(rep.applied == std::vector<Version>{3, 4, 5});
  CHECK_FALSE(r->dirty());
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
}

TEST_CASE("O1: an unchanged step is an empty delta with the same digest") {
  Setup s({}, "tiny-qwen3", "tp=1", "tp=1", 0.0);
  auto r = s.reader();
  const auto a = s.writers.publish(s.access);
  s.trainer.step();  // lr 0
  const auto d = s.writers.publish(s.access);
  CHECK(d.changed == 0);
  CHECK(d.files == 0);
  CHECK(d.digest == a.digest);
  REQUIRE(r->poll().ok());
  CHECK(r->version() == 2);
}

TEST_CASE("publication every K steps, MoE, experts and a dist-optimizer trainer") {
  Setup s({.publish_every = 3}, "tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,ep=2");
  auto r = s.reader();
  s.writers.publish(s.access);
  for (int i = 1; i <= 9; ++i) {
    s.trainer.step();
    const auto rep = s.writers.step(s.access);
    CHECK(rep.has_value() == (i % 3 == 0));
    if (!rep) continue;
    CHECK_FALSE(rep->anchor());
    REQUIRE(r->poll().ok());
    CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
  }
}

TEST_CASE("a mark refused on one writer: the next publication is an anchor on every writer") {
  // (what the refused step changed on that writer is in no dirty mask: a delta would miss it)
  Setup s({.publish_every = 2});
  auto r = s.reader();
  s.writers.publish(s.access);
  s.trainer.step();
  auto v = s.trainer.exp_avg_sq(1, layout::BufferKind::dense);
  const float kept = v[v.size() / 2];
  v[v.size() / 2] = -1.0f;  // writer 1's state is refused for this step's mark
  CHECK_THROWS_AS(s.writers.step(s.access), invalid_argument);
  v[v.size() / 2] = kept;
  s.trainer.step();
  const auto rep = s.writers.step(s.access);
  REQUIRE(rep.has_value());
  CHECK(rep->anchor());
  REQUIRE(r->poll().ok());
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
  // then deltas again, every second step
  s.trainer.step();
  CHECK_FALSE(s.writers.step(s.access).has_value());
  s.trainer.step();
  const auto next = s.writers.step(s.access);
  REQUIRE(next.has_value());
  CHECK_FALSE(next->anchor());
  REQUIRE(r->poll().ok());
  CHECK(s.mismatches(r, s.trainer.canonical_weights()) == 0);
}

TEST_CASE("diff encoding: smaller, and every reader ends bit-identical; verify replays it") {
  Setup values({.anchor_every = 6});
  Setup diffed({.anchor_every = 6, .encoding = storage::Encoding::diff});
  auto live = diffed.reader({0, 1});
  auto lagging = diffed.reader({1}, {.name = "lagging"});
  std::vector<std::vector<float>> weights{{}};
  values.writers.publish(values.access);
  diffed.writers.publish(diffed.access);
  weights.push_back(diffed.trainer.canonical_weights());
  std::uint64_t value_bytes = 0, diff_bytes = 0;
  for (int step = 0; step < 9; ++step) {
    values.trainer.step();
    diffed.trainer.step();
    const auto v = values.writers.step(values.access);
    const auto x = diffed.writers.step(diffed.access);
    REQUIRE(x.has_value());
    weights.push_back(diffed.trainer.canonical_weights());
    CHECK(x->changed == v->changed);
    CHECK(x->digest == v->digest);
    if (!x->anchor()) value_bytes += v->bytes, diff_bytes += x->bytes;
    const auto got = live->poll();
    REQUIRE_MESSAGE(got.ok(), got.error);
    CHECK(diffed.mismatches(live, weights.back()) == 0);
    if (x->version > 3) {
      REQUIRE(lagging->advance(x->version - 3).ok());
      CHECK(diffed.mismatches(lagging, weights[x->version - 3]) == 0);
    }
  }
  MESSAGE("value " << value_bytes << " bytes, diff " << diff_bytes);
  CHECK(diff_bytes * 10 < value_bytes * 8);  // at least 20% smaller
  REQUIRE(lagging->poll().ok());
  CHECK(diffed.mismatches(lagging, weights.back()) == 0);
  // A diff chunk says so; most of the guard band's elements are in it as near codes, so little
  // is left for a value chunk; verify replays the chain through it.
  const storage::Manifest m = storage::read_manifest(diffed.hf, diffed.dir.path, 9);
  std::uint64_t steps = 0, near = 0, valued = 0;
  for (const auto& e : m.chunks) {
    const storage::Chunk c =
        storage::read_chunk(diffed.hf, storage::version_dir(diffed.dir.path, 9), m, e);
    for (const storage::TensorDelta& d : c.tensors) {
      for (const std::uint16_t code : d.bits) {
        if (c.encoding == storage::Encoding::value) {
          ++valued;
        } else {
          ++(code < storage::near_codes ? near : steps);
        }
      }
    }
  }
  MESSAGE("version 9: " << steps << " steps, " << near << " near codes, " << valued << " values");
  CHECK(steps > 0);
  CHECK(near > 0);
  CHECK(valued < near);  // (the rest: bounds wider than a near code reaches)
  const auto report = storage::verify_root(diffed.hf, diffed.dir.path);
  CHECK(report.ok());
  CHECK(report.digests == report.versions);  // every version left (retention removed those below 6)
  CHECK(report.versions == 5);
  // diff needs one optimizer step per publication.
  CHECK_THROWS_AS(sim::StorageCluster(diffed.hf, diffed.train, diffed.dir.path / "k",
                                      {.publish_every = 2, .encoding = storage::Encoding::diff}),
                  invalid_argument);
}

TEST_CASE("classes index: bit-identical readers over flushes mid-pass, value chunks and MoE") {
  // (chunk_entries small: diff chunks close mid-pass, beside value chunks, so skips and several
  // entries per tensor occur)
  const storage::PublisherConfig plain{
      .anchor_every = 6, .chunk_entries = 4000, .encoding = storage::Encoding::diff};
  storage::PublisherConfig classed = plain;
  classed.index = storage::IndexCode::classes;
  for (const auto& [model, train, infer, replicas] :
       {std::tuple{"tiny-qwen3", "tp=2,dp=2", "tp=2,replicas=2", 2},
        std::tuple{"tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,ep=2", 1}}) {
    const std::string name = model;
    CAPTURE(name);
    Setup a(plain, model, train, infer, 3e-6);
    Setup b(classed, model, train, infer, 3e-6);
    auto live =
        b.reader(replicas == 2 ? std::vector<std::int64_t>{0, 1} : std::vector<std::int64_t>{0});
    auto lagging = b.reader({replicas - 1}, {.name = "lagging"});
    std::vector<std::vector<float>> weights{{}};
    a.writers.publish(a.access);
    b.writers.publish(b.access);
    weights.push_back(b.trainer.canonical_weights());
    std::uint64_t plain_bytes = 0, class_bytes = 0;
    for (int step = 0; step < 9; ++step) {
      a.trainer.step();
      b.trainer.step();
      const auto x = a.writers.step(a.access);
      const auto y = b.writers.step(b.access);
      REQUIRE(y.has_value());
      weights.push_back(b.trainer.canonical_weights());
      CHECK(y->changed == x->changed);
      CHECK(y->digest == x->digest);
      if (!y->anchor()) plain_bytes += x->bytes, class_bytes += y->bytes;
      const auto got = live->poll();
      REQUIRE_MESSAGE(got.ok(), got.error);
      CHECK(b.mismatches(live, weights.back()) == 0);
      if (y->version > 3) {
        REQUIRE(lagging->advance(y->version - 3).ok());
        CHECK(b.mismatches(lagging, weights[y->version - 3]) == 0);
      }
    }
    // (tensors of a few thousand elements: most entries are cheaper plain, which the writer
    // picks per entry, so the two stay within a mode byte per entry)
    MESSAGE(std::string(model) << ": plain " << plain_bytes << " bytes, classes " << class_bytes);
    CHECK(class_bytes < plain_bytes * 103 / 100);
    REQUIRE(lagging->poll().ok());
    CHECK(b.mismatches(lagging, weights.back()) == 0);
    const auto report = storage::verify_root(b.hf, b.dir.path);
    CHECK_MESSAGE(report.ok(), (report.problems.empty() ? "" : report.problems.front().what));
    CHECK(report.digests == report.versions);
  }
  // classes needs diff.
  CHECK_THROWS_AS(sim::StorageCluster(layout::HfModel(layout::model_preset("tiny-qwen3")),
                                      layout::parse_train_topology("tp=2"), Dir().path,
                                      {.index = storage::IndexCode::classes}),
                  invalid_argument);
}

TEST_CASE("classes index at 0.5 % density: a fifth smaller than plain diff; needs the base") {
  const storage::PublisherConfig plain{.encoding = storage::Encoding::diff};
  storage::PublisherConfig classed = plain;
  classed.index = storage::IndexCode::classes;
  Setup a(plain, "small-qwen3", "tp=2", "tp=1", 1e-7);
  Setup b(classed, "small-qwen3", "tp=2", "tp=1", 1e-7);
  auto r = b.reader();
  a.writers.publish(a.access);
  b.writers.publish(b.access);
  REQUIRE(r->poll().ok());
  a.trainer.step();
  b.trainer.step();
  const auto x = a.writers.step(a.access);
  const auto y = b.writers.step(b.access);
  REQUIRE(y.has_value());
  CHECK(y->changed == x->changed);
  const double density = static_cast<double>(y->changed) / static_cast<double>(b.hf.total());
  MESSAGE("density " << 100 * density << " %: plain " << x->bytes << " bytes, classes "
                     << y->bytes);
  CHECK(density < 0.01);
  CHECK(y->bytes * 10 < x->bytes * 8);  // at least 20 % smaller
  const auto got = r->poll();
  REQUIRE_MESSAGE(got.ok(), got.error);
  CHECK(b.mismatches(r, b.trainer.canonical_weights()) == 0);
  CHECK(storage::verify_root(b.hf, b.dir.path).ok());
  // Without the base its class-coded chunks are refused, naming the option.
  const storage::Manifest m = storage::read_manifest(b.hf, b.dir.path, y->version);
  std::size_t refused = 0;
  for (const auto& e : m.chunks) {
    const auto bytes = storage::read_chunk_bytes(storage::version_dir(b.dir.path, y->version), e);
    try {
      (void)storage::decode_chunk(b.hf, bytes, e.file);
    } catch (const unsupported& u) {
      CHECK(std::string(u.what()).find("plain index") != std::string::npos);
      ++refused;
    }
  }
  CHECK(refused == 2);  // each writer's diff chunk
}

TEST_CASE("retention: only what no registered reader can need goes; M10 incomplete stays") {
  Setup s({.anchor_every = 3});
  auto slow = s.reader({0}, {.name = "slow"});
  s.writers.publish(s.access);
  REQUIRE(slow->poll().ok());  // registered at 1
  // A version directory without a manifest, below LATEST (copied by hand).
  for (int i = 0; i < 8; ++i) {
    s.trainer.step();
    const auto rep = s.writers.step(s.access);
    CHECK(rep->collect_problem.empty());
    if (rep->version == 2) fs::remove(storage::version_dir(s.dir.path, 2) / storage::manifest_name);
  }
  // LATEST 9; anchors 1, 3, 6, 9. The slow reader holds 1: nothing below 1 exists, so all stays.
  for (Version v = 1; v <= 9; ++v)
    CHECK(fs::exists(storage::version_dir(s.dir.path, v)));
  // The reader catches up to 9: the next publication removes everything below anchor 9 except
  // the manifest-less directory, which is reported and kept.
  REQUIRE(slow->poll().ok());
  CHECK(storage::registered_readers(s.dir.path).at("slow") == 9);
  s.trainer.step();
  const auto rep = s.writers.step(s.access);
  CHECK(rep->collected == std::vector<Version>{1, 3, 4, 5, 6, 7, 8});
  CHECK(fs::exists(storage::version_dir(s.dir.path, 2)));
  const auto c = storage::collect(s.hf, s.dir.path);
  CHECK(c.keep_from == 9);
  CHECK(c.incomplete == std::vector<Version>{2});
  // An unregistered reader starting now still finds its way (the newest anchor is kept).
  auto fresh = s.reader();
  REQUIRE(fresh->poll().ok());
  CHECK(s.mismatches(fresh, s.trainer.canonical_weights()) == 0);
  CHECK(storage::verify_root(s.hf, s.dir.path).ok());
  // A registration that does not parse stops retention rather than guessing.
  std::ofstream(s.dir.path / "readers" / "broken") << "v12";
  CHECK_THROWS_AS((void)storage::collect(s.hf, s.dir.path), format_error);
}

TEST_CASE("inspect: kinds, sizes, the chain, and every frame's content counted") {
  Setup s({.anchor_every = 3});
  s.writers.publish(s.access);
  for (int i = 0; i < 3; ++i) {
    s.trainer.step();
    s.writers.step(s.access);
  }
  const storage::RootInfo info = storage::inspect_root(s.hf, s.dir.path);
  CHECK(info.latest == Version{4});
  CHECK(info.chain == std::vector<Version>{4, 3});
  REQUIRE(info.versions.size() == 2);  // retention removed 1 and 2 (below anchor 3)
  const storage::VersionInfo& delta = info.versions[1];
  CHECK_FALSE(delta.anchor());
  CHECK(delta.files == 4);  // four writers (tp=2, dp=2), one value chunk each
  std::uint64_t listed = fs::file_size(storage::version_dir(s.dir.path, 4) / "manifest.json");
  for (const auto& e : storage::read_manifest(s.hf, s.dir.path, 4).chunks)
    listed += e.bytes;
  CHECK(delta.bytes == listed);
  // The decompressed size sums all four frames of every chunk: the plain files' sizes.
  std::uint64_t plain = 0;
  for (const auto& e : storage::read_manifest(s.hf, s.dir.path, 4).chunks)
    plain += storage::decompress_frames(
                 storage::read_chunk_bytes(storage::version_dir(s.dir.path, 4), e), "c")
                 .size();
  CHECK(delta.content_bytes == plain);
  CHECK(delta.content_bytes > delta.bytes - 2000);
}

TEST_CASE("an anchor's parts: every element exactly once and the world's digest, or refused") {
  const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
  Dir dir;
  const Version v = 7;
  // The model's values: element i of tensor t holds a BF16 pattern of its global index.
  const auto value = [&](std::int64_t t, std::uint32_t i) {
    return static_cast<std::uint16_t>(0x3C00 + ((hf[t].base + i) * 2654435761u >> 20) % 0x300);
  };
  std::vector<Digest> digest(static_cast<std::size_t>(hf.size()), 0);
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    for (std::int64_t i = 0; i < hf[t].numel(); ++i)
      digest[static_cast<std::size_t>(t)] +=
          element_digest(hf[t].base + i, value(t, static_cast<std::uint32_t>(i)));
  }
  // Writer w's part: every tensor's elements [lo, hi) of its numel scaled to [0, 1], with
  // `shift` added to the cut between the two writers (> 0: overlap, < 0: a gap).
  const auto part = [&](std::uint32_t writer, std::int64_t shift) {
    storage::Chunk c;
    c.header = {v, no_version, 0, writer};
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const std::int64_t cut = hf[t].numel() / 2;
      const std::int64_t lo = writer == 0 ? 0 : cut - std::min<std::int64_t>(shift, 0);
      const std::int64_t hi = writer == 0 ? cut + std::max<std::int64_t>(shift, 0) : hf[t].numel();
      storage::TensorDelta d;
      d.tensor = t;
      for (std::int64_t i = lo; i < hi; ++i) {
        d.index.push_back(static_cast<std::uint32_t>(i));
        d.bits.push_back(value(t, static_cast<std::uint32_t>(i)));
      }
      c.tensors.push_back(std::move(d));
    }
    const std::vector<std::byte> bytes = storage::encode_chunk(hf, c);
    const std::string name = "part-" + std::to_string(writer) + ".zst";
    io::write_file_atomic(dir.path / name, bytes, "test part");
    return storage::ChunkEntry{name, bytes.size(), storage::checksum(bytes), 0, writer};
  };
  const auto write = [&](std::int64_t shift, const std::vector<Digest>& d) {
    return storage::write_anchor_shards(hf, dir.path, v, {part(0, shift), part(1, shift)}, d,
                                        std::uint64_t{1} << 30);
  };
  SUBCASE("two parts that cover the model: an HF checkpoint of its values") {
    const std::vector<storage::ChunkEntry> files = write(0, digest);
    REQUIRE(files.size() == 1);
    const io::SafetensorsFile f = io::SafetensorsFile::read(dir.path / files[0].file);
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const auto bytes = f.bytes(f.at(hf.name(t)));
      REQUIRE(bytes.size() == 2 * static_cast<std::size_t>(hf[t].numel()));
      std::uint16_t first = 0, last = 0;
      std::memcpy(&first, bytes.data(), 2);
      std::memcpy(&last, bytes.data() + bytes.size() - 2, 2);
      CHECK(first == value(t, 0));
      CHECK(last == value(t, static_cast<std::uint32_t>(hf[t].numel() - 1)));
    }
  }
  SUBCASE("an element in both parts") {
    CHECK_THROWS_WITH_AS(write(1, digest), doctest::Contains("twice"), error);
  }
  SUBCASE("an element in neither") {
    CHECK_THROWS_WITH_AS(write(-1, digest), doctest::Contains("live elements"), error);
  }
  SUBCASE("a digest other than the world's") {
    std::vector<Digest> other = digest;
    other.back() += 1;
    CHECK_THROWS_WITH_AS(write(0, other), doctest::Contains("digest mismatch"), error);
  }
}
