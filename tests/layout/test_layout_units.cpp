// SPDX-License-Identifier: Apache-2.0
// Worked examples from shared/LAYOUTS.md §9 at real Qwen3 shapes, and the refusals of topologies
// and models that cannot work.
#include <doctest/doctest.h>

#include <set>
#include <string>
#include <vector>

#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"

using namespace dte::layout;
using doctest::Contains;

TEST_CASE("Qwen3-8B, Megatron TP=4 -> SGLang TP=2 (LAYOUTS.md §9)") {
  const HfModel hf(model_preset("qwen3-8b"));
  const TrainTopology t = parse_train_topology("tp=4");
  const InferTopology inf = parse_infer_topology("tp=2");
  const ServingLayout recv(hf, inf);
  const std::int64_t H = 4096, d = 128;
  // Megatron rank 1's linear_qkv [1536, 4096] holds groups 2 and 3: q heads 8-15, k/v heads 2-3.
  const MegatronToHF rank1(hf, t, train_rank(t, 1));
  const MegatronParam qkv{MegatronKind::qkv, 0, 0, -1, -1, 1536, H};
  std::set<std::int64_t> q_heads, k_heads, v_heads;
  for (std::int64_t row = 0; row < 1536; ++row) {
    const Canonical c = rank1(qkv, row * H);
    const HfKind k = hf[c.tensor].kind;
    const std::int64_t head = c.index / H / d;
    (k == HfKind::q ? q_heads : k == HfKind::k ? k_heads : v_heads).insert(head);
  }
  CHECK(q_heads == std::set<std::int64_t>{8, 9, 10, 11, 12, 13, 14, 15});
  CHECK(k_heads == std::set<std::int64_t>{2, 3});
  CHECK(v_heads == std::set<std::int64_t>{2, 3});
  // SGLang rank 0 qkv_proj [3072, 4096] = [q heads 0-15 ; k 0-3 ; v 0-3].
  const std::int64_t qkv_id = recv.id(ReceiverKind::qkv, 0);
  CHECK(recv[qkv_id].shape == std::vector<std::int64_t>{3072, H});
  auto src = [&](std::int64_t ts, std::int64_t row) { return recv.source({ts, qkv_id, row * H}); };
  CHECK(hf[src(0, 2047).tensor].kind == HfKind::q);
  CHECK(src(0, 2047).index / H / d == 15);
  CHECK(hf[src(0, 2048).tensor].kind == HfKind::k);
  CHECK(src(0, 2048).index / H / d == 0);
  CHECK(hf[src(0, 3071).tensor].kind == HfKind::v);
  CHECK(src(0, 3071).index / H / d == 3);
  // embed_tokens: Megatron Vp = 152064; Megatron rank 1 rows 37952-38015 are HF rows
  // 75968-76031, which belong to SGLang rank 1.
  CHECK(t.padded_vocab(151936) == 152064);
  const MegatronParam emb{MegatronKind::embedding, -1, -1, -1, -1, 38016, H};
  const Canonical row37952 = rank1(emb, 37952 * H);
  CHECK(row37952.index / H == 75968);
  std::int64_t ts = -1;
  recv.targets(row37952, [&](const ReceiverElement& e) { ts = e.ts; });
  CHECK(ts == 1);
}

TEST_CASE("Qwen3-30B-A3B, Megatron TP=4 ETP=1 EP=8 -> SGLang TP=8 EP=8 (LAYOUTS.md §9)") {
  const HfModel hf(model_preset("qwen3-30b-a3b"));
  const TrainTopology t = parse_train_topology("tp=4,ep=8,etp=1,dp=2");
  CHECK(t.edp() == 1);
  const InferTopology inf = parse_infer_topology("tp=8,ep=8");
  validate(hf.spec(), t);
  validate(hf.spec(), inf);
  const ServingLayout recv(hf, inf);
  const std::int64_t H = 2048;
  // SGLang rank t takes k/v head t//2 (KV replicated twice) drawn from Megatron TP rank t//2.
  const std::int64_t qkv_id = recv.id(ReceiverKind::qkv, 5);
  CHECK(recv[qkv_id].shape == std::vector<std::int64_t>{768, H});
  for (std::int64_t ts = 0; ts < 8; ++ts) {
    const Canonical k = recv.source({ts, qkv_id, 512 * H});
    CHECK(hf[k.tensor].kind == HfKind::k);
    CHECK(k.index / H / 128 == ts / 2);
    CHECK(megatron_source(hf, t, k).tm == ts / 2);
  }
  // Experts: EP rank em holds experts 16em..16em+15; w13_weight[j] == fc1.weight{j}.
  const std::int64_t w13 = recv.id(ReceiverKind::w13, 0);
  CHECK(recv[w13].shape == std::vector<std::int64_t>{16, 1536, H});
  const Canonical c = recv.source({3, w13, (5 * 1536 + 800) * H + 7});
  const MegatronSource s = megatron_source(hf, t, c);
  CHECK(s.kind == MegatronKind::expert_fc1);
  CHECK(s.em == 3);
  CHECK(s.local_expert == 5);
  CHECK(s.index == 800 * H + 7);
}

TEST_CASE("topologies that cannot work are refused, naming the field and the values") {
  const ModelSpec dense = model_preset("tiny-qwen3");
  const ModelSpec moe = model_preset("tiny-qwen3-moe");
  CHECK_THROWS_WITH_AS(validate(dense, parse_train_topology("tp=16")),
                       Contains("num_attention_heads (8) is not divisible by tp (16)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(dense, parse_train_topology("pp=3")),
                       Contains("num_hidden_layers (4) is not divisible by pp (3)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(dense, parse_train_topology("pp=2,split=1:2")),
                       Contains("summing to 3 layers"), dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(moe, parse_train_topology("ep=3")),
                       Contains("num_experts (8) is not divisible by ep (3)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(moe, parse_train_topology("etp=32")),
                       Contains("moe_intermediate_size (16) is not divisible by etp (32)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(moe, parse_train_topology("tp=1,dp=2,ep=4")),
                       Contains("tp*dp (2) is not divisible by etp (unset: = tp, Megatron-Core's "
                                "default)*ep (4)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(dense, parse_train_topology("ep=2")), Contains("has no experts"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(dense, parse_infer_topology("tp=3")),
                       Contains("num_attention_heads (8) is not divisible by tp (3)"),
                       dte::invalid_argument);
  ModelSpec odd_kv = dense;
  odd_kv.heads = 12, odd_kv.kv_heads = 3;
  CHECK_THROWS_WITH_AS(validate(odd_kv, parse_infer_topology("tp=5")),
                       Contains("num_attention_heads (12) is not divisible by tp (5)"),
                       dte::invalid_argument);
  odd_kv.heads = 24;
  CHECK_THROWS_WITH_AS(validate(odd_kv, parse_infer_topology("tp=4")),
                       Contains("tp (4) is not divisible by num_key_value_heads (3)"),
                       dte::invalid_argument);
  ModelSpec ffn = dense;
  ffn.intermediate = 50;
  CHECK_THROWS_WITH_AS(validate(ffn, parse_infer_topology("tp=4")),
                       Contains("intermediate_size (50) is not divisible by tp (4)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(validate(moe, parse_infer_topology("tp=4,ep=8")),
                       Contains("tp (4) is not divisible by ep (8)"), dte::invalid_argument);
  ModelSpec moe12 = moe;
  moe12.moe_intermediate = 12;
  CHECK_THROWS_WITH_AS(
      validate(moe12, parse_infer_topology("tp=8,ep=1")),
      Contains("moe_intermediate_size (12) is not divisible by moe tp (tp/ep) (8)"),
      dte::invalid_argument);
}

TEST_CASE("topology syntax errors and bad models are refused") {
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=4,zz=2"), Contains("unknown key 'zz'"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_train_topology("tp=four"), Contains("tp=four is not a positive"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_infer_topology("tp"), Contains("'tp' is not key=value"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(model_preset("llama-7b"), Contains("unknown model preset 'llama-7b'"),
                       dte::invalid_argument);
  ModelSpec m = model_preset("tiny-qwen3");
  m.architecture = "GPT2LMHeadModel";
  CHECK_THROWS_WITH_AS(m.validate(), Contains("unknown architecture 'GPT2LMHeadModel'"),
                       dte::invalid_argument);
  m = model_preset("tiny-qwen3");
  m.kv_heads = 3;
  CHECK_THROWS_WITH_AS(m.validate(),
                       Contains("num_attention_heads (8) must be a multiple of "
                                "num_key_value_heads (3)"),
                       dte::invalid_argument);
}

TEST_CASE("buffer layout: reverse order, 64-element alignment, bucket padding, DP slices") {
  // Three params of 100, 10 and 70 elements in named_parameters() order, DP = 3.
  const BufferLayout b = megatron_buffer_layout({0, 1, 2}, {100, 10, 70}, 3, 0);
  REQUIRE(b.params.size() == 3);
  CHECK(b.params[0].param == 2);
  CHECK(b.params[0].start == 0);
  CHECK(b.params[1].param == 1);
  CHECK(b.params[1].start == 128);  // 70 rounded up to 64
  CHECK(b.params[2].start == 192);  // 138 rounded up
  CHECK(b.size() == 384);           // 292 padded to lcm(3, 128) = 384
  CHECK(b.owned(2)[0].start == 256);
  CHECK(b.shard_size() == 128);
  const BufferLayout two = megatron_buffer_layout({0, 1, 2}, {100, 10, 70}, 2, 100);
  CHECK(two.buckets.size() == 2);     // 70 + 10 reach the 100-element bucket size at 138
  CHECK(two.buckets[0].end == 256);   // 138 padded to lcm(2, 128)
  CHECK(two.params[2].start == 256);  // the next bucket starts at the padded end
}
