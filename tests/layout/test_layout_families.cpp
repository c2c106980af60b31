// SPDX-License-Identifier: Apache-2.0
// The model families beyond Qwen3: tied embeddings (Qwen3-0.6B/1.7B/4B, Qwen2.5-0.5B..3B,
// Llama-3.2), q/k/v biases (Qwen2/Qwen2.5), no q/k norm and a derived head_dim (Qwen2, Llama,
// Mistral). Grid properties (grid.hpp) over the tiny variants, the structure of each difference
// (tied output copy, bias rows = weight rows, buckets of their own), and the real config.json
// files of the public checkpoints (tests/layout/configs/) read into exactly the presets.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dte/io/model_config.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "grid.hpp"

using namespace dte::layout;
using doctest::Contains;

namespace {

const std::filesystem::path configs = DTE_LAYOUT_CONFIGS;

// The bias tensor of a q/k/v weight tensor.
HfKind bias_of(HfKind weight) {
  return weight == HfKind::q   ? HfKind::q_bias
         : weight == HfKind::k ? HfKind::k_bias
                               : HfKind::v_bias;
}

std::int64_t count_kind(const std::vector<MegatronParam>& ps, MegatronKind k) {
  std::int64_t n = 0;
  for (const MegatronParam& p : ps)
    n += p.kind == k;
  return n;
}

}  // namespace

TEST_CASE("tiny-qwen3-tied: exact coverage over the topology grid (pp 1 and 2)") {
  const GridResult r = run_grid(model_preset("tiny-qwen3-tied"), {1}, {1}, {1});
  std::printf("tiny-qwen3-tied: %d topology pairs checked, %d failed\n", r.combos, r.failures);
  CHECK(r.combos >= 150);
  CHECK(r.failures == 0);
}

TEST_CASE("tiny-qwen2 (q/k/v biases, TP > KV heads on both sides): exact coverage, tied or not") {
  ModelSpec m = model_preset("tiny-qwen2");
  for (bool tied : {false, true}) {
    m.tie_word_embeddings = tied;
    const GridResult r = run_grid(m, {1}, {1}, {1});
    std::printf("tiny-qwen2 (tied=%d): %d topology pairs checked, %d failed\n", tied ? 1 : 0,
                r.combos, r.failures);
    CHECK(r.combos >= 150);
    CHECK(r.failures == 0);
  }
}

TEST_CASE("tiny-llama (tied, no q/k norm, head_dim = hidden/heads): exact coverage") {
  const GridResult r = run_grid(model_preset("tiny-llama"), {1}, {1}, {1});
  std::printf("tiny-llama: %d topology pairs checked, %d failed\n", r.combos, r.failures);
  CHECK(r.combos >= 150);
  CHECK(r.failures == 0);
}

TEST_CASE(
    "tied embeddings: one HF and one SGLang tensor; Megatron's output copy only with pp > 1") {
  const ModelSpec m = model_preset("tiny-qwen3-tied");
  const HfModel hf(m);
  CHECK_FALSE(hf.has(HfKind::lm_head));
  for (std::int64_t t = 0; t < hf.size(); ++t)
    CHECK(hf.name(t) != "lm_head.weight");
  CHECK(hf.total() == HfModel(model_preset("tiny-qwen3")).total() - m.vocab * m.hidden);
  const ServingLayout recv(hf, parse_infer_topology("tp=2"));
  for (std::int64_t t = 0; t < recv.size(); ++t)
    CHECK(recv[t].kind != ReceiverKind::lm_head);

  // pp = 1: no output_layer.weight at all (the logits use the embedding).
  const TrainTopology one = parse_train_topology("tp=2,dp=2");
  const auto p1 = megatron_params(m, one, train_rank(one, 0));
  CHECK(count_kind(p1, MegatronKind::embedding) == 1);
  CHECK(count_kind(p1, MegatronKind::output) == 0);
  for (const MegatronParam& p : p1)
    CHECK_FALSE(p.shared_embedding);

  // pp = 2: the last stage holds output_layer.weight, a copy of the embedding that never sends;
  // element for element it maps onto the embedding's canonical element (padding included).
  const TrainTopology two = parse_train_topology("tp=2,pp=2");
  for (std::int64_t tm = 0; tm < 2; ++tm) {
    const TrainRank first = train_rank(two, tm), last = train_rank(two, 2 + tm);
    REQUIRE(first.pp == 0);
    REQUIRE(last.pp == 1);
    const auto pf = megatron_params(m, two, first), pl = megatron_params(m, two, last);
    CHECK(count_kind(pf, MegatronKind::output) == 0);
    CHECK(count_kind(pl, MegatronKind::embedding) == 0);
    REQUIRE(count_kind(pl, MegatronKind::output) == 1);
    const MegatronParam& emb = pf.front();
    const MegatronParam& out = pl.back();
    REQUIRE(emb.kind == MegatronKind::embedding);
    REQUIRE(out.kind == MegatronKind::output);
    CHECK(emb.shared_embedding);
    CHECK(out.shared_embedding);
    CHECK(out.shape() == emb.shape());
    const MegatronToHF mf(hf, two, first), ml(hf, two, last);
    CHECK(mf.is_sender(emb));
    CHECK_FALSE(ml.is_sender(out));
    std::int64_t padding = 0;
    for (std::int64_t i = 0; i < emb.numel(); ++i) {
      const Canonical a = mf(emb, i), b = ml(out, i);
      CHECK(a == b);
      if (a.tensor >= 0) CHECK(hf[a.tensor].kind == HfKind::embed);
      padding += a.tensor < 0;
    }
    // Megatron pads 300 rows to 512 (a multiple of 128 x tp 2), 256 per rank: rank 1 holds the
    // 212 padding rows, in the copy exactly as in the embedding.
    CHECK(two.padded_vocab(m.vocab) == 512);
    CHECK(padding == (tm == 1 ? (512 - 300) * m.hidden : 0));
    // The inverse names the sender: the first stage's embedding.
    const MegatronSource s = megatron_source(hf, two, {hf.id(HfKind::embed), 299 * m.hidden});
    CHECK(s.kind == MegatronKind::embedding);
    CHECK(s.pp == 0);
    CHECK(s.tm == 1);
  }
}

TEST_CASE("tied embeddings with pp > 1: the shared embedding gets a bucket of its own") {
  const ModelSpec m = model_preset("tiny-qwen3-tied");
  const TrainTopology t = parse_train_topology("tp=1,pp=2,dp=2,bucket=100000000");
  for (std::int64_t g : {std::int64_t{0}, std::int64_t{2}}) {
    const TrainRank r = train_rank(t, g);
    const auto params = megatron_params(m, t, r);
    const RankBuffers b = megatron_rank_buffers(params, t, r);
    const BufferLayout& dense = b.layout[0];
    // The shared parameter is first (output, last stage) or last (embedding, first stage) in
    // buffer order and alone in its bucket; every other parameter shares the other bucket.
    REQUIRE(dense.buckets.size() == 2);
    const std::size_t shared_at = r.pp == 0 ? dense.params.size() - 1 : 0;
    const BufferParam& sp = dense.params[shared_at];
    CHECK(params[static_cast<std::size_t>(sp.param)].shared_embedding);
    const Bucket own = r.pp == 0 ? dense.buckets[1] : dense.buckets[0];
    CHECK(sp.start == own.start);
    CHECK(own.end == (sp.start + sp.numel + 127) / 128 * 128);
    for (const BufferParam& bp : dense.params) {
      if (&bp == &sp) continue;
      CHECK_FALSE(params[static_cast<std::size_t>(bp.param)].shared_embedding);
      CHECK((bp.start + bp.numel <= own.start || bp.start >= own.end));
    }
  }
  // Untied, or tied with pp = 1: one bucket (this bucket size is never reached).
  for (const char* spec : {"tp=1,pp=1,dp=2,bucket=100000000"}) {
    const TrainTopology u = parse_train_topology(spec);
    const auto params = megatron_params(m, u, train_rank(u, 0));
    CHECK(megatron_rank_buffers(params, u, train_rank(u, 0)).layout[0].buckets.size() == 1);
  }
}

TEST_CASE("q/k/v biases: every bias row goes where its weight row goes, on both sides") {
  const ModelSpec m = model_preset("tiny-qwen2");
  const HfModel hf(m);
  REQUIRE(hf.has(HfKind::q_bias));
  CHECK_FALSE(hf.has(HfKind::q_norm));
  const std::int64_t H = m.hidden;
  // Megatron TP 4 and SGLang TP 4 and 8, all above the 2 KV heads (groups split across ranks,
  // KV rows replicated on the receivers).
  for (const char* train : {"tp=1", "tp=2", "tp=4", "tp=8"}) {
    const TrainTopology t = parse_train_topology(train);
    validate(m, t);
    for (std::int64_t g = 0; g < t.world(); ++g) {
      const TrainRank r = train_rank(t, g);
      const MegatronToHF map(hf, t, r);
      const auto params = megatron_params(m, t, r);
      for (std::size_t k = 0; k < params.size(); ++k) {
        if (params[k].kind != MegatronKind::qkv_bias) continue;
        const MegatronParam& bias = params[k];
        const MegatronParam& weight = params[k - 1];  // TE order: layer_norm_weight, weight, bias
        REQUIRE(weight.kind == MegatronKind::qkv);
        CHECK(bias.rows == weight.rows);
        CHECK(bias.layer == weight.layer);
        CHECK(bias.name() == weight.name().substr(0, weight.name().size() - 6) + "bias");
        for (std::int64_t row = 0; row < bias.rows; ++row) {
          const Canonical b = map(bias, row), w = map(weight, row * H);
          CHECK(hf[b.tensor].kind == bias_of(hf[w.tensor].kind));
          CHECK(hf[b.tensor].layer == hf[w.tensor].layer);
          CHECK(b.index == w.index / H);
          const MegatronSource s = megatron_source(hf, t, b);
          CHECK(s.kind == MegatronKind::qkv_bias);
          CHECK(s.tm == r.tm);
          CHECK(s.index == row);
        }
      }
    }
  }
  for (const char* infer : {"tp=1", "tp=2", "tp=4", "tp=8"}) {
    const InferTopology it = parse_infer_topology(infer);
    validate(m, it);
    const ServingLayout recv(hf, it);
    for (std::int64_t L = 0; L < m.layers; ++L) {
      const std::int64_t wid = recv.id(ReceiverKind::qkv, L);
      const std::int64_t bid = recv.id(ReceiverKind::qkv_bias, L);
      CHECK(recv.name(bid) == "model.layers." + std::to_string(L) + ".self_attn.qkv_proj.bias");
      CHECK(recv[bid].shape == std::vector<std::int64_t>{recv[wid].shape[0]});
      for (std::int64_t ts = 0; ts < it.tp; ++ts) {
        for (std::int64_t row = 0; row < recv[bid].numel; ++row) {
          const Canonical b = recv.source({ts, bid, row});
          const Canonical w = recv.source({ts, wid, row * H});
          CHECK(hf[b.tensor].kind == bias_of(hf[w.tensor].kind));
          CHECK(b.index == w.index / H);
        }
      }
    }
  }
}

TEST_CASE("real config.json files read into exactly the presets") {
  struct Case {
    const char* file;
    const char* preset;
  };
  for (const Case& c :
       {Case{"Qwen3-8B.json", "qwen3-8b"}, Case{"Qwen3-0.6B.json", "qwen3-0.6b"},
        Case{"Qwen3-4B.json", "qwen3-4b"}, Case{"Qwen2.5-7B.json", "qwen2.5-7b"},
        Case{"Llama-3.1-8B.json", "llama-3.1-8b"}, Case{"Qwen3-30B-A3B.json", "qwen3-30b-a3b"}}) {
    CAPTURE(c.file);
    const ModelSpec got = dte::io::model_from_config_file(configs / c.file);
    const ModelSpec want = model_preset(c.preset);
    CHECK(got.architecture == want.architecture);
    CHECK(got.hidden == want.hidden);
    CHECK(got.layers == want.layers);
    CHECK(got.heads == want.heads);
    CHECK(got.kv_heads == want.kv_heads);
    CHECK(got.head_dim == want.head_dim);
    CHECK(got.intermediate == want.intermediate);
    CHECK(got.moe_intermediate == want.moe_intermediate);
    CHECK(got.experts == want.experts);
    CHECK(got.experts_per_token == want.experts_per_token);
    CHECK(got.vocab == want.vocab);
    CHECK(got.tie_word_embeddings == want.tie_word_embeddings);
    CHECK(HfModel(got).total() == HfModel(want).total());
  }
  // The published parameter counts (embedding counted once when tied).
  const auto params = [&](const char* f) {
    return HfModel(dte::io::model_from_config_file(configs / f)).total();
  };
  CHECK(params("Qwen3-0.6B.json") == 596049920);
  CHECK(params("Qwen3-1.7B.json") == 1720574976);
  CHECK(params("Qwen3-4B.json") == 4022468096);
  CHECK(params("Qwen3-8B.json") == 8190735360);
  CHECK(params("Qwen2.5-0.5B.json") == 494032768);
  CHECK(params("Qwen2.5-7B.json") == 7615616512);
  CHECK(params("Llama-3.2-1B.json") == 1235814400);
  CHECK(params("Llama-3.1-8B.json") == 8030261248);
  CHECK(params("Mistral-7B-v0.1.json") == 7241732096);
  // Derived head_dim: hidden / heads where the file has none.
  CHECK(dte::io::model_from_config_file(configs / "Qwen2.5-7B.json").head_dim == 128);
  CHECK(dte::io::model_from_config_file(configs / "Mistral-7B-v0.1.json").head_dim == 128);
  CHECK(dte::io::model_from_config_file(configs / "Qwen2.5-0.5B.json").head_dim == 64);
}

namespace {

ModelSpec from_text(const std::string& text) {
  return dte::io::model_from_config_json(nlohmann::json::parse(text), "config.json");
}

const std::string llama_1b =
    R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
        "vocab_size": 128256, "tie_word_embeddings": true)";

}  // namespace

TEST_CASE("config.json: fields that would change a layout dte does not map are refused by name") {
  CHECK(from_text(llama_1b + "}").head_dim == 64);
  CHECK(from_text(llama_1b + R"(, "head_dim": null})").head_dim == 64);
  CHECK(from_text(llama_1b + R"(, "attention_bias": false, "mlp_bias": false})").tied());
  CHECK_THROWS_WITH_AS(from_text(llama_1b + R"(, "attention_bias": true})"),
                       Contains("field 'attention_bias' is true"), dte::format_error);
  CHECK_THROWS_WITH_AS(from_text(llama_1b + R"(, "mlp_bias": true})"),
                       Contains("field 'mlp_bias' is true"), dte::format_error);
  CHECK_THROWS_WITH_AS(from_text(llama_1b + R"(, "attention_bias": 1})"),
                       Contains("'attention_bias' is 1, not true or false"), dte::format_error);
  std::string odd = llama_1b;
  odd.replace(odd.find("\"num_attention_heads\": 32"), 25, "\"num_attention_heads\": 24");
  CHECK_THROWS_WITH_AS(from_text(odd + "}"),
                       Contains("'head_dim' is absent and hidden_size (2048) is not a multiple of "
                                "num_attention_heads (24)"),
                       dte::format_error);
  std::string qwen2 = llama_1b;
  qwen2.replace(qwen2.find("LlamaForCausalLM"), 16, "Qwen2ForCausalLM");
  CHECK(from_text(qwen2 + "}").qkv_bias());
  CHECK_THROWS_WITH_AS(from_text(qwen2 + R"(, "attention_bias": false})"),
                       Contains("Qwen2ForCausalLM always has q/k/v biases"), dte::format_error);
  CHECK_THROWS_WITH_AS(from_text(qwen2 + R"(, "original_num_attention_heads": 16})"),
                       Contains("'original_num_attention_heads'"), dte::format_error);
  // Qwen3 keeps its own head_dim field, required.
  std::string qwen3 = llama_1b;
  qwen3.replace(qwen3.find("LlamaForCausalLM"), 16, "Qwen3ForCausalLM");
  CHECK_THROWS_WITH_AS(from_text(qwen3 + "}"), Contains("field 'head_dim' is missing"),
                       dte::format_error);
  CHECK(from_text(qwen3 + R"(, "head_dim": 128})").qk_norm());
  CHECK_THROWS_WITH_AS(from_text(qwen3 + R"(, "head_dim": 128, "attention_bias": true})"),
                       Contains("o_proj biases"), dte::format_error);
  // A tied MoE model: SGLang's Qwen3-MoE always has its own lm_head.
  std::ifstream moe_file(configs / "Qwen3-30B-A3B.json");
  nlohmann::json moe = nlohmann::json::parse(moe_file);
  moe["tie_word_embeddings"] = true;
  CHECK_THROWS_WITH_AS(dte::io::model_from_config_json(moe, "moe.json"),
                       Contains("tie_word_embeddings=true with Qwen3MoeForCausalLM"),
                       dte::invalid_argument);
}
