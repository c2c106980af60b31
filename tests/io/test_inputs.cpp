// SPDX-License-Identifier: Apache-2.0
// Hostile inputs to the readers, one test per defect class: config.json and topology values
// bounded and their products checked (no SIGFPE, no spin, no runaway memory, no wrapped
// number in a message), duplicate keys refused, integers read as integers (a float, a bool or a
// string is refused with the file, the field and the range), buffer-layout offsets checked
// without overflow, optimizer dumps with absurd hyperparameters or a non-finite truth refused.
// Each refusal is a structured dte::error subclass and says what, where and what to do.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/io/buffer_layout.hpp"
#include "dte/io/json.hpp"
#include "dte/io/model_config.hpp"
#include "dte/io/optimizer_dump.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"

using doctest::Contains;
using namespace dte;

namespace {

// `j` as JSON text with the value of `field` replaced by the raw JSON text `value`.
std::string with_field(const nlohmann::ordered_json& j, const std::string& field,
                       const std::string& value) {
  std::string text = j.dump();
  if (!field.empty()) {
    const std::string key = "\"" + field + "\":";
    const auto at = text.find(key);
    REQUIRE(at != std::string::npos);
    const auto end = text.find_first_of(",}", at);
    text.replace(at + key.size(), end - at - key.size(), value);
  }
  return text;
}

// tiny-qwen3 as a config.json, with `field` replaced by the raw JSON text `value`.
std::string config_text(const std::string& field = {}, const std::string& value = {}) {
  return with_field({{"architectures", {"Qwen3ForCausalLM"}},
                     {"hidden_size", 32},
                     {"num_hidden_layers", 4},
                     {"num_attention_heads", 8},
                     {"num_key_value_heads", 2},
                     {"head_dim", 16},
                     {"intermediate_size", 48},
                     {"vocab_size", 300}},
                    field, value);
}

std::string moe_config_text(const std::string& field = {}, const std::string& value = {}) {
  return with_field({{"architectures", {"Qwen3MoeForCausalLM"}},
                     {"hidden_size", 32},
                     {"num_hidden_layers", 4},
                     {"num_attention_heads", 8},
                     {"num_key_value_heads", 2},
                     {"head_dim", 16},
                     {"moe_intermediate_size", 16},
                     {"num_experts", 8},
                     {"num_experts_per_tok", 2},
                     {"vocab_size", 300}},
                    field, value);
}

layout::ModelSpec load(const std::string& text) {
  return io::model_from_config_json(io::parse_strict(text, "config.json", "model config", 64),
                                    "config.json");
}

double seconds_of(auto&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const std::exception&) {
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("config.json: the valid file loads") {
  const layout::ModelSpec m = load(config_text());
  CHECK(m.hidden == 32);
  CHECK(load(moe_config_text()).experts == 8);
}

TEST_CASE("config.json: transformers 5's num_local_experts names Qwen3-MoE's expert count") {
  std::string text = moe_config_text();
  text.replace(text.find("\"num_experts\":8"), 15, "\"num_local_experts\":8");
  CHECK(load(text).experts == 8);
  // Both given: num_experts, Qwen's own field, is read (and checked).
  text = moe_config_text();
  text.replace(text.find("\"num_experts\":8"), 15, "\"num_experts\":8,\"num_local_experts\":4");
  CHECK(load(text).experts == 8);
  text.replace(text.find("\"num_experts\":8"), 15, "\"num_experts\":0");
  CHECK_THROWS_WITH_AS(load(text), Contains("field 'num_experts' is 0"), bounds_error);
}

TEST_CASE("config.json: an oversized head_dim ends in a clear error, not SIGFPE") {
  const std::string text = config_text("head_dim", "4611686018427387904");
  CHECK_THROWS_WITH_AS(load(text),
                       "config.json: field 'head_dim' is 4611686018427387904; it must be an "
                       "integer in [1, 4096]",
                       bounds_error);
  // Within the field's range but its products past one tensor's 2^32 - 1 elements.
  std::string wide = config_text("head_dim", "4096");
  wide.replace(wide.find("\"hidden_size\":32"), 16, "\"hidden_size\":131072");
  CHECK_THROWS_WITH_AS(load(wide),
                       Contains("q_proj (num_attention_heads * head_dim * hidden_size) has"),
                       invalid_argument);
  // Either way fast: the plan is never built.
  CHECK(seconds_of([&] { (void)load(text); }) < 1.0);
}

TEST_CASE("config.json: oversized hidden_size and vocab_size end in a clear error, not a spin") {
  std::string text = config_text("hidden_size", "9223372036854775807");
  const auto at = text.find("\"vocab_size\":300");
  text.replace(at, 16, "\"vocab_size\":9223372036854775807");
  CHECK_THROWS_WITH_AS(load(text), Contains("field 'hidden_size' is 9223372036854775807"),
                       bounds_error);
  CHECK(seconds_of([&] { (void)load(text); }) < 1.0);
  // Each within range, their product too large for one tensor.
  std::string big = config_text("hidden_size", "131072");
  big.replace(big.find("\"vocab_size\":300"), 16, "\"vocab_size\":16777216");
  CHECK_THROWS_WITH_AS(load(big), Contains("embed_tokens (vocab_size * hidden_size) has"),
                       invalid_argument);
  CHECK(seconds_of([&] { (void)load(big); }) < 1.0);
}

TEST_CASE("config.json: layer and expert counts in the billions are refused before any memory") {
  CHECK_THROWS_WITH_AS(load(config_text("num_hidden_layers", "2000000000")),
                       Contains("field 'num_hidden_layers' is 2000000000; it must be an integer "
                                "in [1, 4096]"),
                       bounds_error);
  CHECK_THROWS_WITH_AS(load(moe_config_text("num_experts", "3000000000")),
                       Contains("field 'num_experts' is 3000000000"), bounds_error);
  // Each within its range, together too many tensors to plan.
  std::string many = moe_config_text("num_experts", "16384");
  many.replace(many.find("\"num_hidden_layers\":4"), 21, "\"num_hidden_layers\":4096");
  CHECK_THROWS_WITH_AS(load(many), Contains("tensors"), invalid_argument);
}

TEST_CASE("config.json: a number too large for 64 bits is quoted as written, never wrapped") {
  CHECK_THROWS_WITH_AS(load(config_text("hidden_size", "18446744073709551615")),
                       Contains("field 'hidden_size' is 18446744073709551615; it must be"),
                       bounds_error);
  CHECK_THROWS_WITH_AS(load(config_text("hidden_size", "-5")),
                       Contains("field 'hidden_size' is -5; it must be an integer in [1, 131072]"),
                       bounds_error);
  // Past 2^64 JSON carries it as a float: not an integer.
  CHECK_THROWS_WITH_AS(load(config_text("hidden_size", "1e300")),
                       Contains("field 'hidden_size' is 1e+300, not an integer"), format_error);
}

TEST_CASE("config.json: floats, bools and strings where integers belong are refused") {
  CHECK_THROWS_WITH_AS(load(config_text("hidden_size", "32.0")),
                       Contains("config.json: field 'hidden_size' is 32.0, not an integer"),
                       format_error);
  CHECK_THROWS_WITH_AS(load(config_text("num_hidden_layers", "0.9")),
                       Contains("field 'num_hidden_layers' is 0.9, not an integer"), format_error);
  CHECK_THROWS_WITH_AS(load(config_text("head_dim", "true")),
                       Contains("field 'head_dim' is true, not an integer"), format_error);
  CHECK_THROWS_WITH_AS(load(config_text("vocab_size", "\"300\"")),
                       Contains("field 'vocab_size' is \"300\", not an integer"), format_error);
  const format_error e = [&] {
    try {
      (void)load(config_text("head_dim", "null"));
    } catch (const format_error& x) {
      return x;
    }
    FAIL("not refused");
    return format_error("");
  }();
  CHECK(e.context().source == "config.json");
  CHECK(e.context().field == "head_dim");
}

TEST_CASE("config.json: duplicate keys are refused") {
  std::string text = config_text();
  text.insert(text.size() - 1, ",\"head_dim\":128");
  CHECK_THROWS_WITH_AS(load(text), Contains("duplicate key 'head_dim' in the model config"),
                       format_error);
}

TEST_CASE("config.json: num_experts_per_tok outside [1, num_experts] is refused") {
  CHECK_THROWS_WITH_AS(
      load(moe_config_text("num_experts_per_tok", "9")),
      Contains("field 'num_experts_per_tok' is 9; it must be an integer in [1, 8]"), bounds_error);
  CHECK_THROWS_WITH_AS(load(moe_config_text("num_experts_per_tok", "0")),
                       Contains("field 'num_experts_per_tok' is 0"), bounds_error);
  // A spec built in code gets the same rule.
  layout::ModelSpec m = layout::model_preset("tiny-qwen3-moe");
  m.experts_per_token = 100;
  CHECK_THROWS_WITH_AS(m.validate(), Contains("num_experts_per_tok is 100"), bounds_error);
}

TEST_CASE("topologies: every value bounded, quoted as given, the world computed checked") {
  using layout::parse_infer_topology;
  using layout::parse_train_topology;
  CHECK_THROWS_WITH_AS(parse_infer_topology("tp=1,replicas=18446744073709551617"),
                       "--infer: replicas=18446744073709551617 is out of range; replicas must be "
                       "an integer in [1, 65536]",
                       bounds_error);
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=99999999999999999999"),
                       Contains("tp=99999999999999999999 is out of range"), bounds_error);
  CHECK_THROWS_WITH_AS(
      parse_train_topology("tp=1024,dp=1048576"),
      Contains("--train: tp * dp = 1024 * 1048576 = 1073741824, more than dte's limit"),
      bounds_error);
  CHECK_THROWS_WITH_AS(parse_infer_topology("tp=1024,replicas=65536"),
                       Contains("the receiver ranks tp * replicas"), bounds_error);
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=2,tp=4"), Contains("tp is given twice"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=0.5"), Contains("tp=0.5 is not a positive integer"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=-1"), Contains("tp=-1 is out of range"),
                       bounds_error);
  // A topology built in code is bounded too.
  layout::TrainTopology t;
  t.dp = std::int64_t{1} << 40;
  CHECK_THROWS_AS(layout::validate(layout::model_preset("tiny-qwen3"), t), bounds_error);
  layout::InferTopology it;
  it.replicas = std::int64_t{1} << 62;
  CHECK_THROWS_AS(layout::validate(layout::model_preset("tiny-qwen3"), it), bounds_error);
}

TEST_CASE("a receiver tensor too large for 32-bit indices is refused when the layout is built") {
  layout::ModelSpec m = layout::model_preset("qwen3-8b");
  m.vocab = 1 << 20;  // 2^20 * 4096 = 2^32: one element too many for an HF tensor
  CHECK_THROWS_WITH_AS(m.validate(), Contains("dte addresses at most 2^32 - 1 elements"),
                       invalid_argument);
  m.vocab = (1 << 20) - 1;
  const layout::HfModel hf(m);
  // SGLang pads the vocabulary to 64 rows: (2^20 - 1 -> 2^20) * 4096 on one rank is 2^32.
  CHECK_THROWS_WITH_AS(layout::ServingLayout(hf, layout::parse_infer_topology("tp=1")),
                       Contains("receiver tensor model.embed_tokens.weight has 4294967296"),
                       bounds_error);
  CHECK_NOTHROW(layout::ServingLayout(hf, layout::parse_infer_topology("tp=2")));
}

namespace {

struct LayoutFixture {
  layout::HfModel hf{layout::model_preset("tiny-qwen3")};
  layout::TrainTopology train = layout::parse_train_topology("tp=2");
  nlohmann::json good = io::write_buffer_layout(hf, train);

  void read(const nlohmann::json& j) const { (void)io::read_buffer_layout(j, hf, train, "l.json"); }
  void read_text(const std::string& text) const {
    read(io::parse_strict(text, "l.json", "buffer layout", 16));
  }
};

}  // namespace

TEST_CASE("buffer layout: the written layout reads back") {
  LayoutFixture f;
  CHECK_NOTHROW(f.read(f.good));
}

TEST_CASE("buffer layout: a start near 2^63 does not overflow the bounds check") {
  LayoutFixture f;
  nlohmann::json j = f.good;
  j["ranks"][0]["buffers"]["dense"]["params"][0]["start"] = 9223372036854775000LL;
  CHECK_THROWS_WITH_AS(f.read(j),
                       Contains("l.json: field 'ranks[0].buffers.dense.params[0].start' is "
                                "9223372036854775000; it must be an integer in [0, "),
                       bounds_error);
  // Within the limit but past the buffer's end: the check is written as start > size - numel.
  const std::int64_t size = j["ranks"][0]["buffers"]["dense"]["size"].get<std::int64_t>();
  j["ranks"][0]["buffers"]["dense"]["params"][0]["start"] = size;
  CHECK_THROWS_WITH_AS(f.read(j), Contains("lies outside the dense buffer"), invalid_argument);
}

TEST_CASE("buffer layout: floats, bools and strings where integers belong are refused") {
  LayoutFixture f;
  nlohmann::json j = f.good;
  j["ranks"][0]["rank"] = 0.9;
  CHECK_THROWS_WITH_AS(f.read(j), Contains("field 'ranks[0].rank' is 0.9, not an integer"),
                       format_error);
  j = f.good;
  j["ranks"][1]["buffers"]["dense"]["size"] = "4096";
  CHECK_THROWS_WITH_AS(f.read(j),
                       Contains("field 'ranks[1].buffers.dense.size' is \"4096\", not an integer"),
                       format_error);
  j = f.good;
  j["ranks"][0]["buffers"]["dense"]["params"][2]["shape"][0] = true;
  CHECK_THROWS_WITH_AS(f.read(j), Contains("params[2].shape[0]' is true, not an integer"),
                       format_error);
  j = f.good;
  j["ranks"][0]["buffers"]["dense"]["owned"][0][1] = 1e30;
  CHECK_THROWS_WITH_AS(f.read(j), Contains("owned[0][1]' is 1e+30, not an integer"), format_error);
  j = f.good;
  j["ranks"][0]["buffers"]["dense"].erase("size");
  CHECK_THROWS_WITH_AS(f.read(j), Contains("field 'ranks[0].buffers.dense.size' is missing"),
                       format_error);
  j = f.good;
  j["ranks"][0]["buffers"] = nlohmann::json::array();
  CHECK_THROWS_WITH_AS(f.read(j), Contains("field 'ranks[0].buffers' is [], not an object"),
                       format_error);
}

TEST_CASE("buffer layout: duplicate keys are refused") {
  LayoutFixture f;
  std::string text = f.good.dump();
  const auto at = text.find("\"rank\":0");
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"rank\":1,");
  CHECK_THROWS_WITH_AS(f.read_text(text), Contains("duplicate key 'rank' inside a buffer layout"),
                       format_error);
}

namespace {

// A small valid optimizer dump in memory (one AdamW step), metadata overridable.
io::SafetensorsFile dump(std::map<std::string, std::string> md, float theta_prev0 = 0.5f) {
  const std::size_t n = 64;
  std::vector<float> p0(n), p(n), m(n, 1e-4f), v(n, 1e-8f);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = 0.01f * static_cast<float>(i + 1);
    p[i] = p0[i];
  }
  p0[0] = theta_prev0;
  io::SafetensorsWriter w;
  w.add<float>("theta_prev", {n}, p0);
  w.add<float>("theta", {n}, p);
  w.add<float>("exp_avg", {n}, m);
  w.add<float>("exp_avg_sq", {n}, v);
  w.add<float>("momentum_buffer", {n}, m);
  std::map<std::string, std::string> meta{{"optimizer", "adamw"},
                                          {"lr", "1e-05"},
                                          {"weight_decay", "0.1"},
                                          {"eps", "1e-08"},
                                          {"step", "3"}};
  for (const auto& [k, val] : md)
    meta[k] = val;
  for (const auto& [k, val] : meta)
    w.set_metadata(k, val);
  return io::SafetensorsFile::parse(w.serialize(), "dump.safetensors");
}

}  // namespace

TEST_CASE("optimizer dumps: absurd hyperparameters are refused, not audited") {
  CHECK_NOTHROW(io::audit_inverse_file<BF16Detect>(dump({})));
  CHECK_THROWS_WITH_AS(io::audit_inverse_file<BF16Detect>(dump({{"lr", "1e300"}})),
                       Contains("lr must be in [0, 10]"), numeric_error);
  CHECK_THROWS_WITH_AS(io::audit_inverse_file<BF16Detect>(dump({{"eps", "1e300"}})),
                       Contains("eps must be in [0, 1]"), numeric_error);
  CHECK_THROWS_WITH_AS(io::audit_inverse_file<BF16Detect>(dump({{"step", "1e300"}})),
                       Contains("metadata key 'step' is '1e300', not an integer"), format_error);
  CHECK_THROWS_WITH_AS(io::audit_inverse_file<BF16Detect>(dump({{"step", "99999999999999999999"}})),
                       Contains("'step' is '99999999999999999999'; it must be an integer in [1, "),
                       bounds_error);
  CHECK_THROWS_WITH_AS(
      io::audit_inverse_file<BF16Detect>(dump({{"optimizer", "sgd"}, {"momentum", "1e300"}})),
      Contains("momentum must be in (0, 1]"), numeric_error);
}

TEST_CASE("optimizer dumps: a NaN in theta_prev is refused, not reported as a miss") {
  CHECK_THROWS_WITH_AS(io::audit_inverse_file<BF16Detect>(dump({}, std::nanf(""))),
                       Contains("dump.safetensors: theta_prev[0] is nan"), numeric_error);
  CHECK_THROWS_AS(
      io::audit_inverse_file<BF16Detect>(dump({}, std::numeric_limits<float>::infinity())),
      numeric_error);
}

TEST_CASE("checked arithmetic names what it computes") {
  CHECK(checked_mul(3, 4, "x") == 12);
  CHECK_THROWS_WITH_AS(checked_mul(INT64_MAX, 2, "rows * cols"),
                       Contains("rows * cols = 9223372036854775807 * 2 overflows 64 bits"),
                       bounds_error);
  CHECK_THROWS_WITH_AS(checked_add(INT64_MAX, 1, "end"), Contains("overflows 64 bits"),
                       bounds_error);
  CHECK_THROWS_WITH_AS(checked_mul(1 << 20, 1 << 20, "n", 1 << 30),
                       Contains("= 1099511627776, more than dte's limit of 1073741824"),
                       bounds_error);
}
