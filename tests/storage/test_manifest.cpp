// SPDX-License-Identifier: Apache-2.0
// The version manifest (storage/manifest.hpp): an exact round trip, and the refusals a reader of
// untrusted storage needs (RELIABILITY.md 6.2: M13 path traversal, absolute paths and huge
// counts; duplicate slots and files; a base at or after the version; a digest for another
// model; F11/F13 duplicate and unknown keys).
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/storage/manifest.hpp"

using namespace dte;
using storage::Manifest;

namespace {

const layout::HfModel& model() {
  static const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
  return hf;
}

Manifest sample() {
  Manifest m;
  m.model = model().spec().name;
  m.version = 12;
  m.base = 11;
  m.writers = 2;
  m.changed = 4242;
  m.chunks = {{"c0-w0.zst", 1000, 0x0123456789abcdefull, 0, 0},
              {"c0-w1.zst", 77, 0xfedcba9876543210ull, 0, 1},
              {"c1-w1.zst", 5, 0, 1, 1}};
  for (std::int64_t t = 0; t < model().size(); ++t)
    m.digest.push_back(static_cast<Digest>(0x9E3779B1u * static_cast<std::uint32_t>(t + 1)));
  return m;
}

// The manifest's JSON with one edit applied to the parsed object.
std::string edited(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(storage::manifest_json(sample()));
  edit(j);
  return j.dump();
}

template <class E>
void refuses(const std::string& text, const std::string& why) {
  try {
    (void)storage::parse_manifest(text, "v12/manifest.json", model());
    FAIL("accepted; expected a refusal saying: " << why);
  } catch (const E& e) {
    CHECK_MESSAGE(std::string(e.what()).find(why) != std::string::npos, e.what());
  }
}

}  // namespace

TEST_CASE("a manifest round trips exactly; an anchor has no base") {
  const Manifest m = sample();
  CHECK(storage::parse_manifest(storage::manifest_json(m), "m", model()) == m);
  Manifest a = m;
  a.base = no_version;
  a.chunks.clear();
  const std::string text = storage::manifest_json(a);
  CHECK(text.find("\"base\": null") != std::string::npos);
  const Manifest back = storage::parse_manifest(text, "m", model());
  CHECK(back.anchor());
  CHECK(back == a);
}

TEST_CASE("chunk files are plain names inside the version directory (M13)") {
  for (const char* bad : {"../v11/c0.zst", "/etc/passwd", "a/b.zst", ".hidden", "", "c0.zst\n",
                          "c 0.zst", "c0\\x.zst"}) {
    INFO(bad);
    CHECK_FALSE(storage::plain_file_name(bad));
    refuses<bounds_error>(edited([&](nlohmann::json& j) { j["chunks"][1]["file"] = bad; }),
                          "is not a plain file name");
  }
  CHECK_FALSE(storage::plain_file_name(std::string(129, 'a')));
  CHECK(storage::plain_file_name(std::string(128, 'a')));
  CHECK(storage::plain_file_name("c12-w3.zst"));
}

TEST_CASE("the manifest's integers, slots and digest are checked") {
  refuses<bounds_error>(edited([](nlohmann::json& j) { j["version"] = -1; }), "must be an integer");
  refuses<format_error>(edited([](nlohmann::json& j) { j["version"] = "12"; }), "not an integer");
  refuses<protocol_error>(edited([](nlohmann::json& j) { j["base"] = 12; }),
                          "a delta's base comes before it");
  refuses<bounds_error>(edited([](nlohmann::json& j) { j["chunks"][0]["writer"] = 2; }),
                        "chunks[0].writer");
  refuses<bounds_error>(edited([](nlohmann::json& j) { j["chunks"][0]["bytes"] = 0; }),
                        "chunks[0].bytes");
  refuses<protocol_error>(edited([](nlohmann::json& j) { j["chunks"][2]["chunk"] = 0; }),
                          "repeats writer 1 chunk 0");
  refuses<protocol_error>(edited([](nlohmann::json& j) { j["chunks"][2]["file"] = "c0-w0.zst"; }),
                          "a second time");
  refuses<format_error>(edited([](nlohmann::json& j) { j["chunks"][0]["xxh3"] = "0123"; }),
                        "16 lowercase hex digits");
  refuses<format_error>(
      edited([](nlohmann::json& j) { j["chunks"][0]["xxh3"] = "0123456789ABCDEF"; }),
      "16 lowercase hex digits");
  refuses<protocol_error>(edited([](nlohmann::json& j) { j["digest"].erase(0); }), "the model has");
  refuses<format_error>(edited([](nlohmann::json& j) { j["digest"][3] = 7; }),
                        "8 lowercase hex digits");
  refuses<protocol_error>(edited([](nlohmann::json& j) { j["model"] = "qwen3-8b"; }),
                          "this reader holds 'tiny-qwen3'");
  refuses<format_error>(edited([](nlohmann::json& j) { j["format"] = "dte-manifest-v2"; }),
                        "a newer or foreign writer");
}

TEST_CASE("unknown, missing and duplicate keys are refused (F11, F13)") {
  refuses<format_error>(edited([](nlohmann::json& j) { j["extra"] = 1; }),
                        "field 'extra' is not a field");
  refuses<format_error>(edited([](nlohmann::json& j) { j["chunks"][0]["path"] = "x"; }),
                        "field 'chunks[0].path' is not a field");
  refuses<format_error>(edited([](nlohmann::json& j) { j.erase("changed"); }), "is missing");
  std::string dup = storage::manifest_json(sample());
  dup.insert(dup.find('{') + 1, "\"version\": 3,");
  refuses<format_error>(dup, "duplicate key");
  refuses<format_error>("[1, 2]", "is not a JSON object");
}
