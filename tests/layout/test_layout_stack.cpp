// SPDX-License-Identifier: Apache-2.0
// Stacks and the layout settings they assume (layout/stack.hpp), and the check that the trainer
// holds what the plan says (layout/shape_check.hpp): each stack's vocabulary padding and expert
// split against a trainer of that stack's shapes, and every mismatch refused naming the
// parameter, the rank, both shapes and the cause.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dte/layout/megatron.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/shape_check.hpp"
#include "dte/layout/stack.hpp"
#include "dte/layout/topology.hpp"

using namespace dte::layout;
using doctest::Contains;

namespace {

TrainTopology train(const std::string& spec, const char* stack) {
  TrainTopology t = parse_train_topology(spec);
  apply_stack(t, parse_stack(stack));
  return t;
}

// What a trainer of topology t holds on `rank` (a real trainer reports named_parameters()).
std::vector<ParamShape> held(const ModelSpec& m, const TrainTopology& t, std::int64_t rank) {
  std::vector<ParamShape> out;
  for (const MegatronParam& p : megatron_params(m, t, train_rank(t, rank)))
    out.push_back({p.name(), p.shape()});
  return out;
}

const LayoutSetting& setting(const std::vector<LayoutSetting>& all, const std::string& name) {
  for (const LayoutSetting& s : all)
    if (s.setting == name) return s;
  FAIL("no setting " << name);
  return all.front();
}

}  // namespace

TEST_CASE("each stack's vocabulary padding and expert split") {
  const ModelSpec qwen = model_preset("qwen3-8b");  // V = 151936
  // Megatron-LM (and slime): a multiple of 128 * tp.
  CHECK(train("tp=1", "megatron-lm").padded_vocab(qwen.vocab) == 151936);
  CHECK(train("tp=2", "megatron-lm").padded_vocab(qwen.vocab) == 152064);
  CHECK(train("tp=8", "slime").padded_vocab(qwen.vocab) == 152576);
  // mbridge / verl, Megatron-Bridge / NeMo-RL, AReaL: the HF vocabulary as it is.
  for (const char* s : {"mbridge", "verl", "megatron-bridge", "nemo-rl", "areal"}) {
    CAPTURE(s);
    CHECK(train("tp=8", s).padded_vocab(qwen.vocab) == 151936);
    CHECK_FALSE(train("tp=8", s).pad_vocab);
  }
  // What the command line gives wins over the stack.
  CHECK(train("tp=2,vocab_div=256", "mbridge").padded_vocab(qwen.vocab) == 152064);
  CHECK(train("tp=2,vocab_div=none", "megatron-lm").padded_vocab(qwen.vocab) == 151936);
  // Expert TP: Megatron-Core's default is tp (also for a topology built in code); AReaL's is 1.
  const ModelSpec moe = model_preset("tiny-qwen3-moe");
  CHECK(train("tp=2,ep=2,dp=2", "megatron-lm").expert_tp() == 2);
  CHECK(train("tp=2,ep=2,dp=2", "mbridge").expert_tp() == 2);
  CHECK(train("tp=2,ep=2,dp=2", "areal").expert_tp() == 1);
  CHECK(train("tp=2,ep=2,etp=1,dp=2", "megatron-lm").expert_tp() == 1);
  TrainTopology code;
  code.tp = 4;
  CHECK(code.expert_tp() == 4);
  // Expert shapes follow: fc1 of one expert is [2 Fm / etp, H].
  const auto fc1_rows = [&](const TrainTopology& t) {
    for (const MegatronParam& p : megatron_params(moe, t, train_rank(t, 0)))
      if (p.kind == MegatronKind::expert_fc1) return p.rows;
    return std::int64_t{-1};
  };
  CHECK(fc1_rows(train("tp=2,ep=2,dp=2", "megatron-lm")) == 16);
  CHECK(fc1_rows(train("tp=2,ep=2,dp=2", "areal")) == 32);
  // Refusals: an unpadded vocabulary must divide by tp; AReaL's balanced split must be given.
  CHECK_THROWS_WITH_AS(validate(model_preset("tiny-qwen3"), train("tp=8", "mbridge")),
                       Contains("vocab_size (not padded: vocab_div=none) (300) is not divisible by "
                                "tp (8)"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(train("tp=2,pp=2", "areal"), Contains("give the layers per stage"),
                       dte::invalid_argument);
  CHECK_NOTHROW(train("tp=2,pp=2,split=3:1", "areal"));
  CHECK_THROWS_WITH_AS(parse_stack("deepspeed"), Contains("unknown stack"), dte::invalid_argument);
}

TEST_CASE("every assumed layout setting is listed with its source") {
  const ModelSpec moe = model_preset("tiny-qwen3-moe");
  const auto lm = assumed_settings(moe, train("tp=2,ep=2,dp=2", "megatron-lm"), Stack::megatron_lm);
  CHECK(setting(lm, "vocabulary padding").assumed);
  CHECK(setting(lm, "vocabulary padding").value ==
        "to a multiple of 128 x tp 2: 300 -> 512 rows, 256 per rank");
  CHECK(setting(lm, "vocabulary padding").source.find("Megatron-LM") != std::string::npos);
  CHECK(setting(lm, "expert tensor parallel (etp)").value == "2");
  CHECK(setting(lm, "expert tensor parallel (etp)").source.find("Megatron-Core") !=
        std::string::npos);
  CHECK(setting(lm, "pipeline split").assumed);
  CHECK(setting(lm, "DDP buckets").assumed);
  const auto mb = assumed_settings(moe, train("tp=2,ep=2,etp=1,dp=2,vocab_div=none", "mbridge"),
                                   Stack::mbridge);
  CHECK_FALSE(setting(mb, "vocabulary padding").assumed);
  CHECK(setting(mb, "vocabulary padding").value == "none: 300 rows, 150 per rank");
  CHECK_FALSE(setting(mb, "expert tensor parallel (etp)").assumed);
  CHECK(setting(mb, "expert tensor parallel (etp)").value == "1");
  // A dense model has no expert setting.
  for (const LayoutSetting& s : assumed_settings(
           model_preset("tiny-qwen3"), train("tp=2", "megatron-lm"), Stack::megatron_lm)) {
    CHECK(s.setting != "expert tensor parallel (etp)");
  }
}

TEST_CASE("a trainer with mbridge's shapes against dte's Megatron-LM topology is refused") {
  const ModelSpec m = model_preset("tiny-qwen3");
  const TrainTopology real = train("tp=2,dp=2", "mbridge");     // 150 vocabulary rows per rank
  const TrainTopology dte = train("tp=2,dp=2", "megatron-lm");  // 256 per rank (padded)
  CHECK_NOTHROW(check_parameters(m, real, 1, held(m, real, 1)));
  CHECK_THROWS_WITH_AS(
      check_parameters(m, dte, 1, held(m, real, 1)),
      Contains("trainer rank 1 holds embedding.word_embeddings.weight as [150, 32] where dte's "
               "plan expects [256, 32]"),
      dte::invalid_argument);
  CHECK_THROWS_WITH_AS(check_parameters(m, dte, 1, held(m, real, 1)),
                       Contains("likely cause: the trainer's shapes match the vocabulary not "
                                "padded (mbridge, verl"),
                       dte::invalid_argument);
  // And the other way round: a Megatron-LM trainer read with mbridge's defaults.
  CHECK_THROWS_WITH_AS(check_parameters(m, real, 0, held(m, dte, 0)),
                       Contains("the vocabulary padded to a multiple of 128 x tp"),
                       dte::invalid_argument);
  // With only the optimizer-shard sizes known (no parameter list), the same cause is found.
  const auto shard = [&](const TrainTopology& t, std::int64_t rank, std::int64_t(&out)[2]) {
    const TrainRank r = train_rank(t, rank);
    const RankBuffers b = megatron_rank_buffers(megatron_params(m, t, r), t, r);
    for (int k = 0; k < 2; ++k)
      out[k] = b.layout[k].shard_size();
  };
  std::int64_t want[2], got[2];
  shard(dte, 0, want);
  shard(real, 0, got);
  REQUIRE(want[0] != got[0]);
  CHECK_THROWS_WITH_AS(check_shard_sizes(m, dte, 0, want, got),
                       Contains(("dense optimizer shard has " + std::to_string(got[0]) +
                                 " elements where dte's plan expects " + std::to_string(want[0]))
                                    .c_str()),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(check_shard_sizes(m, dte, 0, want, got),
                       Contains("the vocabulary not padded"), dte::invalid_argument);
  CHECK_NOTHROW(check_shard_sizes(m, dte, 0, want, want));
}

TEST_CASE("an expert split that differs is refused naming the expert parameter and etp") {
  const ModelSpec m = model_preset("tiny-qwen3-moe");
  const TrainTopology real = train("tp=2,ep=2,dp=2", "areal");   // etp = 1, vocabulary as is
  const TrainTopology dte = train("tp=2,ep=2,dp=2", "mbridge");  // etp = tp = 2, as is
  for (std::int64_t rank = 0; rank < dte.world(); ++rank) {
    CAPTURE(rank);
    CHECK_THROWS_WITH_AS(check_parameters(m, dte, rank, held(m, real, rank)),
                         Contains("mlp.experts.linear_fc1.weight0 as [32, 32] where dte's plan "
                                  "expects [16, 32]"),
                         dte::invalid_argument);
    CHECK_THROWS_WITH_AS(check_parameters(m, dte, rank, held(m, real, rank)), Contains("etp=1"),
                         dte::invalid_argument);
  }
  // Vocabulary and expert split both wrong: both named.
  const TrainTopology mb1 = train("tp=2,ep=2,etp=1,dp=2", "mbridge");
  const TrainTopology lm = train("tp=2,ep=2,dp=2", "megatron-lm");
  CHECK_THROWS_WITH_AS(check_parameters(m, lm, 0, held(m, mb1, 0)),
                       Contains("the vocabulary not padded (mbridge, verl, Megatron-Bridge, "
                                "NeMo-RL, AReaL: --stack mbridge, or vocab_div=none) and etp=1"),
                       dte::invalid_argument);
}
