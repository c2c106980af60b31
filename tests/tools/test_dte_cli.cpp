// SPDX-License-Identifier: Apache-2.0
// `dte audit-inverse` as a user runs it: exit status, table, JSON, and clear refusals.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dte/io/safetensors.hpp"
#include "dte/numeric/round.hpp"

namespace {

struct Run {
  int status;
  std::string output;  // stdout and stderr
};

Run run_dte(const std::string& args) {
  const std::string cmd = std::string(DTE_TOOL_PATH) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (std::size_t n = std::fread(buf.data(), 1, buf.size(), pipe))
    out.append(buf.data(), n);
  const int rc = pclose(pipe);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / "dte_cli_test";
  std::filesystem::create_directories(dir);
  return dir;
}

// One real AdamW step in FP32 (torch order: decay, moments, update) on small weight-like data.
struct Dump {
  std::vector<float> theta_prev, theta, m, v;
  std::map<std::string, std::string> metadata{
      {"optimizer", "adamw"}, {"lr", "1e-05"},    {"weight_decay", "0.1"},
      {"beta1", "0.9"},       {"beta2", "0.999"}, {"eps", "1e-08"},
      {"step", "1"}};

  explicit Dump(std::size_t n = 4096) {
    for (std::size_t i = 0; i < n; ++i) {
      const float p0 = 0.02f * std::sin(0.37f * static_cast<float>(i)) + (i % 7 == 0 ? 1.0f : 0.0f);
      const float g = (i % 5 == 0) ? 0.0f : 1e-3f * std::cos(1.3f * static_cast<float>(i));
      const float mi = 0.1f * g, vi = 0.001f * g * g;
      const float denom = std::sqrt(vi) / std::sqrt(0.001f) + 1e-8f;
      const float p =
          p0 * static_cast<float>(1.0 - 1e-6) - static_cast<float>(1e-5 / 0.1) * (mi / denom);
      theta_prev.push_back(p0);
      theta.push_back(p);
      m.push_back(mi);
      v.push_back(vi);
    }
  }

  std::string write(const std::string& name) const {
    dte::io::SafetensorsWriter w;
    const std::uint64_t n = theta.size();
    w.add<float>("theta_prev", {n}, theta_prev);
    w.add<float>("theta", {n}, theta);
    w.add<float>("exp_avg", {n}, m);
    w.add<float>("exp_avg_sq", {n}, v);
    for (const auto& [k, val] : metadata)
      w.set_metadata(k, val);
    const auto path = temp_dir() / name;
    w.write(path);
    return path.string();
  }
};

}  // namespace

TEST_CASE("a correct dump: exit 0, table and JSON") {
  const std::string f = Dump().write("ok.safetensors");
  const Run table = run_dte("audit-inverse " + f);
  CHECK(table.status == 0);
  CHECK_MESSAGE(table.output.find("missed            0") != std::string::npos, table.output);
  CHECK_MESSAGE(
      table.output.find("safe: every bf16 change of this step is detected") != std::string::npos,
      table.output);
  const Run json = run_dte("audit-inverse " + f + " --json");
  CHECK(json.status == 0);
  const auto j = nlohmann::json::parse(json.output);
  CHECK(j.at("elements") == 4096);
  CHECK(j.at("missed") == 0);
  CHECK(j.at("true_changed").get<int>() > 0);
  CHECK(j.at("detected").get<int>() >= j.at("true_changed").get<int>());
  CHECK(j.at("guard_extra") == j.at("detected").get<int>() - j.at("true_changed").get<int>());
  const Run fp16 = run_dte("audit-inverse " + f + " --json --format fp16");
  CHECK(fp16.status == 0);
  CHECK(nlohmann::json::parse(fp16.output).at("format") == "fp16");
}

TEST_CASE("a dump whose theta_prev disagrees with the state: a miss, exit 1") {
  Dump d;
  // Element 5 has a zero gradient: no update, so dte reconstructs theta_prev ~ theta. Claim it
  // was something else: a change dte cannot see from the state, which the audit must report.
  REQUIRE(d.m[5] == 0.0f);
  d.theta_prev[5] = d.theta[5] + 0.5f;
  const std::string f = d.write("miss.safetensors");
  const Run r = run_dte("audit-inverse " + f);
  CHECK(r.status == 1);
  CHECK_MESSAGE(
      r.output.find("UNSAFE: 1 change(s) missed, the first at index 5") != std::string::npos,
      r.output);
  const Run j = run_dte("audit-inverse " + f + " --json");
  CHECK(j.status == 1);
  CHECK(nlohmann::json::parse(j.output).at("missed") == 1);
}

TEST_CASE("a dump whose theta_prev is off by more than the bound but changes nothing: exit 1") {
  Dump d;
  // Move one theta_prev 200 FP32 ulps toward the middle of its BF16 interval: its BF16 value, and
  // so every verdict, stays the same (no miss), but it is now far outside dte's error bound
  // (about a dozen ulps): the guarantee failed, which the audit must say before it costs a miss.
  std::size_t i = 1;
  while (d.m[i] == 0.0f || std::fabs(d.theta_prev[i]) < 1e-3f)
    ++i;
  const float mid = dte::bf16_to_float(dte::round_bf16(d.theta_prev[i]));
  const float prev_bits = d.theta_prev[i];
  for (int k = 0; k < 200 && d.theta_prev[i] != mid; ++k)
    d.theta_prev[i] = std::nextafter(d.theta_prev[i], mid);
  REQUIRE(dte::round_bf16(d.theta_prev[i]) == dte::round_bf16(prev_bits));
  REQUIRE(d.theta_prev[i] != prev_bits);
  const std::string f = d.write("violation.safetensors");
  const Run r = run_dte("audit-inverse " + f);
  CHECK(r.status == 1);
  CHECK_MESSAGE(r.output.find("missed            0") != std::string::npos, r.output);
  CHECK_MESSAGE(r.output.find("bound violations  1 (the first at index " + std::to_string(i) +
                              ")") != std::string::npos,
                r.output);
  CHECK_MESSAGE(r.output.find("UNSAFE: nothing was missed in this step, but the error bound "
                              "failed for 1 element(s)") != std::string::npos,
                r.output);
  const Run j = run_dte("audit-inverse " + f + " --json");
  CHECK(j.status == 1);
  const auto json = nlohmann::json::parse(j.output);
  CHECK(json.at("missed") == 0);
  CHECK(json.at("bound_violations") == 1);
  CHECK(json.at("first_bound_violation") == i);
  CHECK(json.at("worst_bound_ratio").get<double>() > 1.0);
  CHECK(json.at("safe") == false);
  // The untouched dump: no violation, and the ratio says how much room the bound had.
  const Run ok = run_dte("audit-inverse " + Dump().write("no_violation.safetensors") + " --json");
  const auto okj = nlohmann::json::parse(ok.output);
  CHECK(okj.at("bound_violations") == 0);
  CHECK(okj.at("first_bound_violation") == -1);
  CHECK(okj.at("worst_bound_ratio").get<double>() <= 1.0);
}

TEST_CASE("bad input is refused with exit 2 and a clear message") {
  SUBCASE("an unknown decay_form") {
    Dump d;
    d.metadata["decay_form"] = "sometimes";
    const Run r = run_dte("audit-inverse " + d.write("decayform.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("metadata key 'decay_form' is 'sometimes'; write multiply") !=
                      std::string::npos,
                  r.output);
  }
  SUBCASE("missing metadata") {
    Dump d;
    d.metadata.erase("lr");
    const Run r = run_dte("audit-inverse " + d.write("nolr.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("metadata key 'lr' is missing") != std::string::npos, r.output);
  }
  SUBCASE("not a number") {
    Dump d;
    d.metadata["lr"] = "fast";
    const Run r = run_dte("audit-inverse " + d.write("badlr.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("metadata key 'lr' is 'fast', not a number") != std::string::npos,
                  r.output);
  }
  SUBCASE("NaN in theta") {
    Dump d;
    d.theta[17] = std::nanf("");
    const Run r = run_dte("audit-inverse " + d.write("nan.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("theta of tensor") != std::string::npos, r.output);
    CHECK_MESSAGE(r.output.find("1 non-finite value(s) (NaN or Inf), the first at index 17") !=
                      std::string::npos,
                  r.output);
  }
  SUBCASE("unknown optimizer") {
    Dump d;
    d.metadata["optimizer"] = "lion";
    const Run r = run_dte("audit-inverse " + d.write("lion.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("metadata optimizer is 'lion'") != std::string::npos, r.output);
  }
  SUBCASE("amsgrad") {
    Dump d;
    d.metadata["amsgrad"] = "true";
    const Run r = run_dte("audit-inverse " + d.write("ams.safetensors"));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("amsgrad is not supported") != std::string::npos, r.output);
  }
  SUBCASE("missing tensor") {
    dte::io::SafetensorsWriter w;
    const std::vector<float> x{1.0f};
    w.add<float>("theta", {1}, x);
    w.set_metadata("optimizer", "sgd");
    w.set_metadata("lr", "0.1");
    w.set_metadata("momentum", "0.9");
    const auto path = temp_dir() / "notensor.safetensors";
    w.write(path);
    const Run r = run_dte("audit-inverse " + path.string());
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("theta_prev") != std::string::npos, r.output);
  }
  SUBCASE("no such file") {
    const Run r = run_dte("audit-inverse /nonexistent/dump.safetensors");
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("/nonexistent/dump.safetensors") != std::string::npos, r.output);
  }
  SUBCASE("not a safetensors file") {
    const auto path = temp_dir() / "garbage.safetensors";
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fputs("this is not a safetensors file at all", f);
    std::fclose(f);
    const Run r = run_dte("audit-inverse " + path.string());
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("dte: error:") != std::string::npos, r.output);
  }
}

namespace {

std::string write_text(const std::string& name, const std::string& text) {
  const auto path = temp_dir() / name;
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path.string();
}

const char* kTinyMoeConfig = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
  "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 8,
  "num_experts_per_tok": 2, "vocab_size": 300, "tie_word_embeddings": false})";

}  // namespace

TEST_CASE("dte plan: JSON report with exact coverage") {
  const Run r = run_dte(
      "plan --model tiny-qwen3-moe --train tp=2,pp=2,ep=2,etp=2,dp=2 --infer tp=4,ep=2,replicas=2 "
      "--json");
  REQUIRE(r.status == 0);
  const auto j = nlohmann::json::parse(r.output);
  CHECK(j.at("coverage_exact") == true);
  CHECK(j.at("canonical_elements") == j.at("sender_elements"));
  CHECK(j.at("receiver_elements") == j.at("receiver_writes"));
  CHECK(j.at("source_elements").get<std::int64_t>() >=
        j.at("canonical_elements").get<std::int64_t>());
  CHECK(j.at("plan_bytes_max_rank").get<std::int64_t>() > 0);
  CHECK(j.contains("build_seconds"));
  const Run table = run_dte("plan --model tiny-qwen3 --train tp=2,dp=2 --infer tp=4");
  CHECK(table.status == 0);
  CHECK_MESSAGE(table.output.find("coverage            exact") != std::string::npos, table.output);
}

TEST_CASE("dte plan: a config.json gives the same plan as the preset") {
  const std::string cfg = write_text("tiny-moe-config.json", kTinyMoeConfig);
  const std::string args = " --train tp=4,ep=4,etp=1 --infer tp=8,ep=2 --json";
  auto a = nlohmann::json::parse(run_dte("plan --model " + cfg + args).output);
  auto b = nlohmann::json::parse(run_dte("plan --model tiny-qwen3-moe" + args).output);
  for (const char* k : {"coverage_exact", "source_elements", "canonical_elements",
                        "receiver_elements", "plan_bytes_max_rank"}) {
    CHECK(a.at(k) == b.at(k));
  }
}

TEST_CASE("dte plan: topologies and configs that cannot work are refused (exit 2)") {
  auto refused = [](const std::string& args, const std::string& text) {
    const Run r = run_dte("plan " + args);
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find(text) != std::string::npos, r.output);
  };
  refused("--model tiny-qwen3 --train tp=3", "num_attention_heads (8) is not divisible by tp (3)");
  refused("--model tiny-qwen3-moe --train tp=2,ep=3", "num_experts (8) is not divisible by ep (3)");
  refused("--model tiny-qwen3 --train tp=1 --infer tp=16",
          "num_attention_heads (8) is not divisible by tp (16)");
  refused("--model qwen3-30b-a3b --train tp=4,ep=8,etp=1,dp=2 --infer tp=8,ep=3",
          "tp (8) is not divisible by ep (3)");
  refused("--model mistral --train tp=1", "unknown model preset 'mistral'");
  std::string no_kv = kTinyMoeConfig;
  no_kv.replace(no_kv.find("\"num_key_value_heads\": 2, "), 26, "");
  refused("--model " + write_text("no-kv.json", no_kv) + " --train tp=1",
          "field 'num_key_value_heads' is missing");
  std::string deepseek = kTinyMoeConfig;
  deepseek.replace(deepseek.find("Qwen3MoeForCausalLM"), 19, "DeepseekV3ForCausalLM");
  refused("--model " + write_text("deepseek.json", deepseek) + " --train tp=1",
          "unknown architecture 'DeepseekV3ForCausalLM'");
}

TEST_CASE("dte plan: counts that overflow never print coverage exact; reproducers end fast") {
  auto refused = [](const std::string& args, const std::string& text) {
    const auto t0 = std::chrono::steady_clock::now();
    const Run r = run_dte("plan " + args);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find(text) != std::string::npos, r.output);
    CHECK(r.output.find("coverage exact") == std::string::npos);
    CHECK_MESSAGE(s < 1.0, s);  // a hang guard: these used to crash or spin
  };
  refused("--model small-qwen3 --train tp=1 --infer tp=1,replicas=18446744073709551617",
          "replicas=18446744073709551617 is out of range");
  refused("--model small-qwen3 --train tp=1,dp=1048576,pp=4096", "pp=4096 is out of range");
  std::string head = kTinyMoeConfig;
  head.replace(head.find("\"head_dim\": 16"), 14, "\"head_dim\": 4611686018427387904");
  refused("--model " + write_text("head.json", head) + " --train tp=1",
          "field 'head_dim' is 4611686018427387904");
  std::string wide = kTinyMoeConfig;
  wide.replace(wide.find("\"hidden_size\": 32"), 17, "\"hidden_size\": 9223372036854775807");
  wide.replace(wide.find("\"vocab_size\": 300"), 17, "\"vocab_size\": 9223372036854775807");
  refused("--model " + write_text("wide.json", wide) + " --train tp=1",
          "field 'hidden_size' is 9223372036854775807");
}

TEST_CASE("dte plan: a dumped buffer layout is read back, checked and used") {
  const std::string topo = " --model tiny-qwen3-moe --train tp=2,pp=2,ep=2,dp=2 --infer tp=4,ep=2";
  const std::string file = (temp_dir() / "layout.json").string();
  REQUIRE(run_dte("plan" + topo + " --write-buffer-layout " + file).status == 0);
  const Run same = run_dte("plan" + topo + " --buffer-layout " + file + " --json");
  CHECK(same.status == 0);
  CHECK(nlohmann::json::parse(same.output).at("coverage_exact") == true);

  std::ifstream in(file);
  const nlohmann::json layout = nlohmann::json::parse(in);
  SUBCASE("a slice moved by one element: coverage is not exact, exit 1") {
    nlohmann::json j = layout;
    j["ranks"][0]["buffers"]["dense"]["owned"][0][0] =
        j["ranks"][0]["buffers"]["dense"]["owned"][0][0].get<int>() + 1;
    const Run r = run_dte("plan" + topo + " --buffer-layout " + write_text("moved.json", j.dump()));
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.output.find("NOT EXACT") != std::string::npos, r.output);
  }
  SUBCASE("a wrong shape is refused, exit 2") {
    nlohmann::json j = layout;
    j["ranks"][0]["buffers"]["dense"]["params"][0]["shape"] = {1, 1};
    const Run r = run_dte("plan" + topo + " --buffer-layout " + write_text("shape.json", j.dump()));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("but dte's plan for --train says") != std::string::npos, r.output);
  }
  SUBCASE("a layout dumped by an mbridge trainer, read with Megatron-LM's defaults: the cause") {
    const std::string mb = (temp_dir() / "layout-mbridge.json").string();
    REQUIRE(run_dte("plan" + topo + " --stack mbridge --write-buffer-layout " + mb).status == 0);
    const Run r = run_dte("plan" + topo + " --buffer-layout " + mb);
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("has shape [150,32] but dte's plan for --train says [256,32]; "
                                "likely cause: the trainer's shapes match the vocabulary not "
                                "padded") != std::string::npos,
                  r.output);
    CHECK(run_dte("plan" + topo + " --stack mbridge --buffer-layout " + mb).status == 0);
  }
  SUBCASE("overlapping parameters are refused, exit 2") {
    nlohmann::json j = layout;
    j["ranks"][0]["buffers"]["dense"]["params"][1]["start"] =
        j["ranks"][0]["buffers"]["dense"]["params"][0]["start"];
    const Run r =
        run_dte("plan" + topo + " --buffer-layout " + write_text("overlap.json", j.dump()));
    CHECK(r.status == 2);
    CHECK_MESSAGE(r.output.find("overlap") != std::string::npos, r.output);
  }
  SUBCASE("a module. prefix is accepted") {
    nlohmann::json j = layout;
    for (auto& rank : j["ranks"]) {
      for (auto& p : rank["buffers"]["dense"]["params"])
        p["name"] = "module.module." + p["name"].get<std::string>();
    }
    const Run r = run_dte("plan" + topo + " --buffer-layout " +
                          write_text("prefixed.json", j.dump()) + " --json");
    CHECK(r.status == 0);
  }
}

TEST_CASE("dte plan --dump-map: one CSV line per route") {
  const std::string csv = (temp_dir() / "map.csv").string();
  const Run r = run_dte(
      "plan --model tiny-qwen3-moe --train tp=2,ep=2,dp=2 --infer tp=2,replicas=2 --json "
      "--dump-map " +
      csv);
  REQUIRE(r.status == 0);
  const auto j = nlohmann::json::parse(r.output);
  std::ifstream in(csv);
  std::string header, line;
  std::getline(in, header);
  CHECK(header == "src_tp,src_pp,src_ep,src_dp,src_param,src_index,dst_rank,dst_tensor,dst_index");
  std::int64_t lines = 0;
  bool expert_seen = false;
  while (std::getline(in, line)) {
    ++lines;
    expert_seen = expert_seen || line.find("mlp.experts.w13_weight") != std::string::npos;
  }
  CHECK(lines == j.at("receiver_writes").get<std::int64_t>());
  CHECK(expert_seen);
  const Run big = run_dte("plan --model qwen3-8b --train tp=8 --dump-map " + csv);
  CHECK(big.status == 2);
  CHECK_MESSAGE(big.output.find("use a tiny model") != std::string::npos, big.output);
}

TEST_CASE("dte simulate: verified, bit-identical, JSON summary as the last line, --dump") {
  const std::string dir = (temp_dir() / "sim-dump").string();
  std::filesystem::remove_all(dir);
  const Run r = run_dte(
      "simulate --model tiny-qwen3-moe --train tp=2,ep=2,dp=2 --infer tp=4,ep=2,replicas=2 "
      "--steps 12 --publish-every 5 --lr 1e-5 --json --dump " +
      dir);
  REQUIRE(r.status == 0);
  std::vector<std::string> lines;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  REQUIRE(lines.size() == 1 + 4);  // full, v1 (5 steps), v2 (10), v3 (flush: 2), summary
  const auto last = nlohmann::json::parse(lines.back());
  CHECK(last.at("steps") == 12);
  CHECK(last.at("publications") == 4);
  CHECK(last.at("all_bit_identical") == true);
  CHECK(last.at("all_verified") == true);
  CHECK(last.at("mean_changed_fraction").get<double>() > 0.0);
  CHECK(last.at("bytes_sent").get<std::int64_t>() > 0);
  CHECK(last.at("dense_bytes").get<std::int64_t>() > 0);
  const auto flush = nlohmann::json::parse(lines[3]);
  CHECK(flush.at("steps") == 2);
  CHECK(flush.at("verified") == true);

  const auto trainer = dte::io::SafetensorsFile::read(dir + "/trainer.safetensors");
  CHECK(trainer.at("model.layers.1.mlp.experts.7.down_proj.weight").dtype == dte::io::DType::F32);
  for (int rank = 0; rank < 8; ++rank) {
    const auto recv =
        dte::io::SafetensorsFile::read(dir + "/receiver-" + std::to_string(rank) + ".safetensors");
    const auto& w13 = recv.at("model.layers.0.mlp.experts.w13_weight");
    CHECK(w13.dtype == dte::io::DType::BF16);
    CHECK(w13.shape == std::vector<std::uint64_t>{4, 16, 32});  // E/ep=4, 2*Fm/(tp/ep)=16, H
  }
  // An independent check of one element: lm_head row 0 on receiver 0 is the rounded trainer value.
  const auto head = trainer.read_as<float>("lm_head.weight");
  const auto r0 = dte::io::SafetensorsFile::read(dir + "/receiver-0.safetensors");
  const auto bits = r0.read_as<std::uint16_t>("lm_head.weight", dte::io::DType::BF16);
  std::uint32_t u;
  std::memcpy(&u, &head[5], 4);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  CHECK(bits[5] == rounded);
}

TEST_CASE("dte simulate: bad arguments are refused") {
  const Run r = run_dte("simulate --model tiny-qwen3 --train tp=3 --steps 2");
  CHECK(r.status == 2);
  CHECK_MESSAGE(
      r.output.find("num_attention_heads (8) is not divisible by tp (3)") != std::string::npos,
      r.output);
  const Run k = run_dte("simulate --model tiny-qwen3 --steps 2 --publish-every 0");
  CHECK(k.status == 2);
  // Numbers on the command line are bounded like those in files.
  for (const char* args : {"simulate --model tiny-qwen3 --steps 1e300",
                           "simulate --model tiny-qwen3 --steps 99999999999999999999",
                           "simulate --model tiny-qwen3 --steps 2 --lr 1e300",
                           "simulate --model tiny-qwen3 --steps 2 --deadline-ms 0",
                           "bench pipeline --model tiny-qwen3 --layers 99999999",
                           "bench pipeline --model tiny-qwen3 --fractions 2"}) {
    const Run b = run_dte(args);
    CHECK_MESSAGE(b.status != 0, args);
    CHECK_MESSAGE(b.output.find("VERIFIED") == std::string::npos, b.output);
  }
}

TEST_CASE("dte bench pipeline --json: every stage against the memory read, one object") {
  const Run r = run_dte(
      "bench pipeline --model small-qwen3 --layers 2 --train tp=2 --infer tp=2 --fractions 0.01 "
      "--fractions 0.1 --repeat 1 --json");
  REQUIRE_MESSAGE(r.status == 0, r.output);
  const auto j = nlohmann::json::parse(r.output);
  CHECK(j.at("memory_read_gbs").get<double>() > 0.0);
  CHECK(j.at("detect_fraction").get<double>() > 0.0);
  CHECK(j.at("publish_fraction").get<double>() > 0.0);
  CHECK(j.at("apply_entries_per_s").get<double>() > 0.0);
  CHECK(j.at("wire_bytes_per_entry").get<double>() > 1.0);
  CHECK(j.at("wire_bytes_per_entry").get<double>() < 6.0);
  REQUIRE(j.at("stages").size() == 2);
  // The changed fraction the shard was built for is what the detect stage found (plus the
  // guard band's few).
  const double at1 = j.at("stages")[0].at("changed_fraction").get<double>();
  CHECK(at1 > 0.0095);
  CHECK(at1 < 0.0125);
  CHECK(j.at("stages")[1].at("changed_fraction").get<double>() > 0.095);
}
