// SPDX-License-Identifier: Apache-2.0
// Publication messages end to end (publication/publisher.hpp, publication/receiver.hpp): a
// trainer holding its weights as one flat FP32 buffer (what dte.TorchPublisher makes of a
// PyTorch model) runs AdamW; HF receivers and SGLang TP ranks apply the messages.
//   * The golden invariant into HF tensors and TP shards is tests/golden (the suite over every
//     delivery path); here: through storage, a reader that keeps up and one that lags.
//   * Refusals leave the receiver untouched: a delta before any full publication, a wrong
//     base, an older version, a corrupted or truncated message, another model's message,
//     tensors changed behind dte's back (HF receiver: digest), refused optimizer state on the
//     trainer (the next publication is then full).
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/model.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/publication/storage.hpp"
#include "dte/sim/dense_check.hpp"
#include "flat_adamw.hpp"

using namespace dte;
using publication::Bytes;

namespace {

using Trainer = testing::FlatAdamW;

using Pub = publication::Publisher<AdamWInverse, BF16Detect>;

// One receiver's HF tensors, owned here.
struct HfTensors {
  std::vector<std::vector<std::uint16_t>> data;
  std::vector<std::span<std::uint16_t>> views;
  explicit HfTensors(const layout::HfModel& hf) {
    for (std::int64_t t = 0; t < hf.size(); ++t)
      data.emplace_back(static_cast<std::size_t>(hf[t].numel()), 0x7FC0);  // NaN: never served
    for (auto& d : data)
      views.emplace_back(d);
  }
};

struct ShardTensors {
  std::vector<std::vector<std::uint16_t>> data;
  ReceiverTensors views;
  ShardTensors(const layout::ServingLayout& l) {
    for (std::int64_t k = 0; k < l.size(); ++k)
      data.emplace_back(static_cast<std::size_t>(l[k].numel), 0);
    for (auto& d : data)
      views.emplace_back(d);
  }
};

// A trainer, its publisher, and one HF receiver over tensors owned here.
struct Single {
  layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  Trainer tr{spec};
  Pub pub{spec};
  HfTensors tensors{pub.model()};
  publication::HfReceiver rx{spec, tensors.views};
};

Bytes publish(Pub& pub, const Trainer& tr, bool full = false) {
  const auto f = tr.flat();
  return pub.publish(publication::FlatAccess<AdamWInverse>{&f}, full);
}

}  // namespace

TEST_CASE_FIXTURE(Single, "publication: refusals leave the receiver untouched") {
  const Bytes v1 = publish(pub, tr);
  tr.step();
  const Bytes v2 = publish(pub, tr);
  tr.step();
  const Bytes v3 = publish(pub, tr);

  auto untouched = [&](auto&& f, const char* what) {
    CAPTURE(what);
    const auto before = tensors.data;
    const Version held = rx.version();
    const auto digest = rx.digest();
    CHECK_THROWS_AS(f(), dte::error);
    CHECK(tensors.data == before);
    CHECK(rx.version() == held);
    CHECK(rx.digest() == digest);
  };
  untouched([&] { rx.apply(v2); }, "a delta before any full publication");
  REQUIRE(rx.apply(v1).outcome == ApplyOutcome::committed);
  untouched([&] { rx.apply(v3); }, "a delta on another base");
  {
    Bytes bad = v2;
    bad[bad.size() - 5] ^= std::byte{0x10};
    untouched([&] { rx.apply(bad); }, "a flipped bit in a chunk");
    bad = v2;
    bad.resize(bad.size() - 3);
    untouched([&] { rx.apply(bad); }, "a truncated message");
    bad = v2;
    bad[2] = std::byte{'X'};
    untouched([&] { rx.apply(bad); }, "not a publication");
    untouched([&] { rx.apply(std::span<const std::byte>{}); }, "nothing");
  }
  {
    Trainer other(layout::model_preset("tiny-qwen2"));
    Pub other_pub(layout::model_preset("tiny-qwen2"));
    const Bytes foreign = publish(other_pub, other);
    untouched([&] { rx.apply(foreign); }, "another model's publication");
  }
  REQUIRE(rx.apply(v2).outcome == ApplyOutcome::committed);
  CHECK(rx.apply(v2).outcome == ApplyOutcome::current);  // a re-delivery changes nothing
  untouched([&] { rx.apply(v1); }, "an older version");
  // A tensor written behind dte's back: the digest the apply would reach is not the trainer's.
  CHECK(rx.verify().empty());
  tensors.data[3][0] ^= 0x0001;
  CHECK(rx.verify() == pub.model().name(3));
  untouched([&] { rx.apply(v3); }, "tensors changed outside dte");
  tensors.data[3][0] ^= 0x0001;
  CHECK(rx.verify().empty());
  REQUIRE(rx.apply(v3).outcome == ApplyOutcome::committed);
  CHECK(sim::hf_mismatches(pub.model(), tr.theta, tensors.views) == 0);

  SUBCASE("a shard receiver refuses the same way") {
    const layout::InferTopology topo{.tp = 2};
    const layout::ServingLayout l(pub.model(), topo);
    ShardTensors st(l);
    publication::ShardReceiver s(spec, topo, 1, st.views);
    const auto before = st.data;
    CHECK_THROWS_AS(s.apply(v2), protocol_error);
    CHECK(st.data == before);
    CHECK(s.version() == no_version);
    REQUIRE(s.apply(v1).outcome == ApplyOutcome::committed);
    const auto after_v1 = st.data;
    CHECK_THROWS_AS(s.apply(v3), protocol_error);
    CHECK(st.data == after_v1);
    CHECK(s.version() == 1);
  }
}

TEST_CASE_FIXTURE(
    Single, "publication: a refused optimizer state sends nothing and makes the next one full") {
  REQUIRE(rx.apply(publish(pub, tr)).committed());
  tr.step();
  tr.v[5] = -1.0f;  // a negative second moment: no AdamW step wrote this
  CHECK_THROWS_AS(publish(pub, tr), dte::error);
  CHECK(pub.version() == 1);
  tr.v[5] = 0.0f;
  tr.step();
  const Bytes next = publish(pub, tr);
  CHECK(pub.last().full());
  CHECK(pub.version() == 2);
  REQUIRE(rx.apply(next).committed());
  CHECK(sim::hf_mismatches(pub.model(), tr.theta, tensors.views) == 0);
}

TEST_CASE("publication: config_json gives the model back") {
  for (const std::string& name : layout::model_preset_names()) {
    CAPTURE(name);
    const layout::ModelSpec m = layout::model_preset(name);
    const layout::ModelSpec back = io::model_from_config_json(io::config_json(m), "x");
    CHECK(back.structure() == m.structure());
    CHECK(back.experts_per_token == m.experts_per_token);
    CHECK(layout::HfModel(back).total() == layout::HfModel(m).total());
  }
}

TEST_CASE("publication: through storage, a reader that keeps up and one that lags") {
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  const auto root = std::filesystem::temp_directory_path() /
                    ("dte-publication-storage-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  Trainer tr(spec);
  Pub pub(spec);
  publication::StorageWriter writer(spec, root);
  HfTensors near(pub.model()), lagging(pub.model());
  publication::HfReceiver rx_near(spec, near.views), rx_lag(spec, lagging.views);
  const publication::StorageSource source(spec, root, "lagging");
  std::vector<float> lag_theta;
  auto follow = [&](publication::HfReceiver& rx) {
    const auto msgs = source.since(rx.version());
    for (const Bytes& m : msgs)
      REQUIRE(rx.apply(m).committed());
    return msgs.size();
  };
  for (int s = 0; s < 8; ++s) {
    if (s > 0) tr.step();
    // every fourth a full publication: an anchor on storage
    writer.write(publish(pub, tr, s % 4 == 0 && s > 0));
    CHECK(follow(rx_near) == 1);
    CHECK(sim::hf_mismatches(pub.model(), tr.theta, near.views) == 0);
    if (s == 1) {
      CHECK(follow(rx_lag) == 2);  // the anchor v1 as a full publication, then v2
      source.reached(rx_lag.version());
    }
    if (s == 1) lag_theta = tr.theta;
  }
  CHECK(rx_lag.version() == 2);
  CHECK(sim::hf_mismatches(pub.model(), lag_theta, lagging.views) == 0);
  // From v2 to v8: the walk down from v8 stops at the anchor v5 (a full publication), then v6..v8.
  CHECK(follow(rx_lag) == 4);
  CHECK(sim::hf_mismatches(pub.model(), tr.theta, lagging.views) == 0);
  // A second writer on the root is refused; so is a publication out of order.
  CHECK_THROWS_AS(publication::StorageWriter(spec, root), protocol_error);
  tr.step();
  (void)publish(pub, tr);  // v9, never written
  tr.step();
  CHECK_THROWS_AS(writer.write(publish(pub, tr)), protocol_error);
  std::filesystem::remove_all(root);
}

TEST_CASE_FIXTURE(
    Single, "publication: a restarted publisher continues the numbering its receivers follow") {
  REQUIRE(rx.apply(publish(pub, tr)).committed());
  tr.step();
  REQUIRE(rx.apply(publish(pub, tr)).committed());
  Pub again(spec);  // from 1 again: older than what the receiver holds
  CHECK_THROWS_AS(rx.apply(publish(again, tr)), protocol_error);
  Pub resumed(spec);
  resumed.continue_after(rx.version());
  tr.step();
  const Bytes next = publish(resumed, tr);
  CHECK(resumed.last().full());
  CHECK(resumed.version() == 3);
  REQUIRE(rx.apply(next).committed());
  CHECK(sim::hf_mismatches(pub.model(), tr.theta, tensors.views) == 0);
  CHECK_THROWS_AS(resumed.continue_after(7), invalid_argument);
}

TEST_CASE_FIXTURE(Single, "publication: the report names exactly the tensors each apply wrote") {
  // What the vLLM backend re-packs after a commit (python/dte/vllm/engine.py): a tensor left
  // out would keep serving its old packed copy.
  const layout::InferTopology topo{.tp = 2};
  const layout::ServingLayout l(pub.model(), topo);
  ShardTensors st(l);
  publication::ShardReceiver shard(spec, topo, 1, st.views);
  auto changed = [](const auto& before, const auto& after) {
    std::vector<std::uint32_t> out;
    for (std::size_t t = 0; t < after.size(); ++t)
      if (before[t] != after[t]) out.push_back(static_cast<std::uint32_t>(t));
    return out;
  };
  const Bytes v1 = publish(pub, tr);
  const publication::ApplyReport full = rx.apply(v1);
  CHECK(full.touched.size() == static_cast<std::size_t>(pub.model().size()));
  CHECK(shard.apply(v1).touched.size() == static_cast<std::size_t>(l.size()));
  int partial = 0;
  for (int step = 0; step < 12; ++step) {
    // every other step tiny, so that it changes a few tensors only
    tr.lr = step % 2 == 0 ? 2e-4 : 2e-7;
    tr.step();
    const Bytes m = publish(pub, tr);
    const auto hf_before = tensors.data;
    const auto shard_before = st.data;
    const publication::ApplyReport a = rx.apply(m);
    const publication::ApplyReport b = shard.apply(m);
    REQUIRE(a.committed());
    REQUIRE(b.committed());
    CHECK(a.touched == changed(hf_before, tensors.data));
    CHECK(b.touched == changed(shard_before, st.data));
    if (a.touched.size() < static_cast<std::size_t>(pub.model().size())) ++partial;
  }
  CHECK(partial > 0);
}

TEST_CASE("publication: forward fields, normalised as transformers writes them") {
  nlohmann::json base = io::config_json(layout::model_preset("tiny-qwen3"));
  auto fields = [](const nlohmann::json& j) {
    return *io::model_from_config_json(j, "config").forward;
  };
  nlohmann::json a = base, b = base;
  a["rope_theta"] = 1000000;  // an integer in one file, a float in the other
  b["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};  // transformers 5
  b["sliding_window"] = 4096;  // without use_sliding_window: full attention everywhere
  b["use_sliding_window"] = false;
  b["eos_token_id"] = 7;  // not the forward
  CHECK(io::forward_difference(fields(a), fields(b), "a", "b") == std::nullopt);
  b["use_sliding_window"] = true;
  b["max_window_layers"] = 0;
  CHECK(io::forward_difference(fields(a), fields(b), "a", "b")
            .value_or("")
            .starts_with("attention (a: null, b: "));
  nlohmann::json c = a;
  c["some_new_field"] = 2;  // unknown: compared, not ignored
  CHECK(io::forward_difference(fields(a), fields(c), "a", "c") ==
        "some_new_field (a: absent, c: 2.0)");
  nlohmann::json d = a;
  d["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
  CHECK(io::forward_difference(fields(a), fields(d), "a", "d") ==
        R"(rope_scaling (a: null, d: {"factor":2.0,"rope_type":"linear"}))");
  CHECK_FALSE(layout::model_preset("tiny-qwen3").forward);  // a preset: not known
}

TEST_CASE("publication: a receiver refuses a publication whose forward fields differ") {
  nlohmann::json trainer_config = io::config_json(layout::model_preset("tiny-qwen3"));
  trainer_config["rope_theta"] = 1e6;
  trainer_config["rms_norm_eps"] = 1e-6;
  const layout::ModelSpec spec = io::model_from_config_json(trainer_config, "trainer");
  Trainer tr{spec};
  Pub pub{spec};
  const Bytes full = publish(pub, tr, true);
  for (const char* field : {"rope_theta", "rms_norm_eps"}) {
    CAPTURE(field);
    nlohmann::json engine_config = trainer_config;
    engine_config[field] = std::string(field) == "rope_theta" ? 1e4 : 1e-5;
    const layout::ModelSpec engine = io::model_from_config_json(engine_config, "engine");
    HfTensors held{pub.model()};
    publication::HfReceiver rx{engine, held.views};
    try {
      (void)rx.apply(full);
      FAIL("a publication of another forward config was applied");
    } catch (const protocol_error& e) {
      const std::string what = e.what();
      CHECK(what.find(std::string(field) + " (the trainer's config: ") != std::string::npos);
    }
    CHECK(rx.version() == no_version);
    CHECK(held.data[0][0] == 0x7FC0);  // nothing written
  }
  // The same config, and a receiver that knows no forward fields (a preset), apply it.
  HfTensors same{pub.model()}, preset{pub.model()};
  publication::HfReceiver rx_same{spec, same.views};
  publication::HfReceiver rx_preset{layout::model_preset("tiny-qwen3"), preset.views};
  CHECK(rx_same.apply(full).committed());
  CHECK(rx_preset.apply(full).committed());
}
