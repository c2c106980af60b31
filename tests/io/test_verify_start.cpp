// SPDX-License-Identifier: Apache-2.0
// The first-publication check (io/verify_start.hpp) on hand-made checkpoints: BF16 and F32
// checkpoints, one file or an index over shards; a differing element named with its tensor and
// coordinates; a missing tensor, an extra lm_head.weight on a tied model (a config that
// disagrees with the checkpoint), a wrong shape and an unsupported dtype are problems; file
// names in the index must stay inside the directory.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dte/io/safetensors.hpp"
#include "dte/io/verify_start.hpp"
#include "dte/layout/hf.hpp"
#include "dte/numeric/round.hpp"

using namespace dte;
using doctest::Contains;

namespace {

const layout::HfModel hf(layout::model_preset("tiny-qwen3-tied"));

// The value "published" for element i of tensor t (exactly representable in BF16).
float value(std::int64_t t, std::int64_t i) {
  return bf16_to_float(round_bf16(static_cast<float>((t * 131 + i) % 251) / 64.0f - 1.0f));
}

void published(std::int64_t t, std::span<std::uint16_t> out) {
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = round_bf16(value(t, static_cast<std::int64_t>(i)));
}

struct Edit {
  std::int64_t tensor = -1, index = 0;  // flip this element
  bool f32 = false, extra_lm_head = false, drop_last = false, bad_shape = false, sharded = false;
};

std::filesystem::path make(const std::string& name, const Edit& e) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("dte_vs_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  io::SafetensorsWriter a, b;
  nlohmann::json index;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    if (e.drop_last && t == hf.size() - 1) continue;
    std::vector<float> v(static_cast<std::size_t>(hf[t].numel()));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = value(t, static_cast<std::int64_t>(i));
    if (t == e.tensor) v[static_cast<std::size_t>(e.index)] += 0.5f;
    auto shape = hf.shape(t);
    std::vector<std::uint64_t> s(shape.begin(), shape.end());
    if (e.bad_shape && t == 0) std::swap(s[0], s[1]);
    io::SafetensorsWriter& w = e.sharded && t % 2 ? b : a;
    if (e.f32) {
      w.add<float>(hf.name(t), s, v);
    } else {
      std::vector<std::uint16_t> bits(v.size());
      for (std::size_t i = 0; i < v.size(); ++i)
        bits[i] = round_bf16(v[i]);
      w.add<std::uint16_t>(hf.name(t), s, bits, io::DType::BF16);
    }
    index["weight_map"][hf.name(t)] = e.sharded && t % 2 ? "b.safetensors" : "a.safetensors";
  }
  if (e.extra_lm_head) {
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(hf[0].numel()), 0);
    a.add<std::uint16_t>("lm_head.weight", {300, 32}, bits, io::DType::BF16);
    index["weight_map"]["lm_head.weight"] = "a.safetensors";
  }
  if (e.sharded) {
    a.write(dir / "a.safetensors");
    b.write(dir / "b.safetensors");
    std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  } else {
    a.write(dir / "model.safetensors");
  }
  return dir;
}

}  // namespace

TEST_CASE("a matching checkpoint passes, BF16 or F32, one file or sharded") {
  for (const Edit& e : {Edit{}, Edit{.f32 = true}, Edit{.sharded = true}}) {
    const io::StartReport r = io::verify_start(hf, make("ok", e), published);
    CHECK(r.ok());
    CHECK(r.tensors == hf.size());
    CHECK(r.elements == hf.total());
    CHECK(r.describe().find("bit for bit") != std::string::npos);
  }
}

TEST_CASE("a differing element is named with its tensor and coordinates") {
  const std::int64_t q = hf.id(layout::HfKind::q, 2);
  const io::StartReport r = io::verify_start(
      hf, make("one", {.tensor = q, .index = 5 * 32 + 7, .sharded = true}), published);
  CHECK_FALSE(r.ok());
  CHECK(r.mismatched_elements == 1);
  CHECK(r.first_tensor == "model.layers.2.self_attn.q_proj.weight");
  REQUIRE(r.examples.size() == 1);
  CHECK(r.examples[0].coords == std::vector<std::int64_t>{5, 7});
  CHECK(r.describe().find("model.layers.2.self_attn.q_proj.weight") != std::string::npos);
}

TEST_CASE("missing, extra, misshapen and foreign-dtype tensors are problems") {
  const io::StartReport extra =
      io::verify_start(hf, make("extra", {.extra_lm_head = true}), published);
  CHECK_FALSE(extra.ok());
  REQUIRE(extra.problems.size() == 1);
  CHECK(extra.problems[0].find("lm_head.weight") != std::string::npos);
  CHECK(extra.problems[0].find("tie_word_embeddings") != std::string::npos);
  const io::StartReport missing =
      io::verify_start(hf, make("missing", {.drop_last = true}), published);
  CHECK_FALSE(missing.ok());
  CHECK(missing.problems.at(0).find("has no tensor " + hf.name(hf.size() - 1)) !=
        std::string::npos);
  const io::StartReport shape = io::verify_start(hf, make("shape", {.bad_shape = true}), published);
  CHECK_FALSE(shape.ok());
  CHECK(shape.problems.at(0).find("model.embed_tokens.weight has shape [32, 300]") !=
        std::string::npos);
  // An index that points outside the directory is refused before anything is read.
  const auto dir = make("escape", {.sharded = true});
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}})";
  CHECK_THROWS_WITH_AS(io::verify_start(hf, dir, published),
                       Contains("not a plain file name inside the checkpoint directory"),
                       dte::format_error);
  CHECK_THROWS_AS(
      io::verify_start(hf, std::filesystem::temp_directory_path() / "dte_vs_none", published),
      dte::io_error);
}
