// SPDX-License-Identifier: Apache-2.0
// Does the trainer really hold what the plan says? Compares the plan's parameters (names and
// local shapes) or its optimizer-shard sizes with what a trainer rank actually holds, and on a
// mismatch names the parameter, the rank, both shapes and the likely cause: the layout settings
// (vocabulary padding, expert tensor parallelism) under which the plan would have matched. A
// mismatch found here is a misrouting that the digest could never catch (sender and receivers
// would share the same wrong map), so it is refused before anything is sent.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/topology.hpp"

namespace dte::layout {

// One trainer parameter as the trainer holds it (Megatron local name, local shape).
struct ParamShape {
  std::string name;
  std::vector<std::int64_t> shape;
};

namespace detail {

inline bool same_params(const std::vector<MegatronParam>& plan,
                        const std::vector<ParamShape>& held) {
  if (plan.size() != held.size()) return false;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].name() != held[i].name || plan[i].shape() != held[i].shape) return false;
  }
  return true;
}

// What differs between topologies a and b in the settings likely_cause() varies.
inline std::string difference(const TrainTopology& given, const TrainTopology& alt) {
  std::string out;
  auto add = [&](const std::string& s) { out += (out.empty() ? "" : " and ") + s; };
  if (given.pad_vocab != alt.pad_vocab || given.vocab_divisible_by != alt.vocab_divisible_by) {
    add(alt.pad_vocab
            ? "the vocabulary padded to a multiple of " + std::to_string(alt.vocab_divisible_by) +
                  " x tp (Megatron-LM, slime: --stack megatron-lm, or vocab_div=" +
                  std::to_string(alt.vocab_divisible_by) + ")"
            : "the vocabulary not padded (mbridge, verl, Megatron-Bridge, NeMo-RL, AReaL: "
              "--stack mbridge, or vocab_div=none)");
  }
  if (given.expert_tp() != alt.expert_tp()) {
    add("etp=" + std::to_string(alt.expert_tp()) +
        (alt.expert_tp() == alt.tp
             ? " (= tp, Megatron-Core's default)"
             : " (--expert-tensor-parallel-size " + std::to_string(alt.expert_tp()) +
                   "; AReaL's default is 1)"));
  }
  return out;
}

}  // namespace detail

// The settings under which `matches` holds, as a sentence ("" if none does): vocabulary padding
// (none, or to 64/128/256 x tp) crossed with etp (tp, 1, 2, 4, 8).
inline std::string likely_cause(const ModelSpec& m, const TrainTopology& t,
                                const std::function<bool(const TrainTopology&)>& matches) {
  std::vector<std::string> causes;
  for (bool pad : {false, true}) {
    for (std::int64_t div : {std::int64_t{128}, std::int64_t{64}, std::int64_t{256}}) {
      if (!pad && div != 128) continue;
      for (std::int64_t etp :
           {std::int64_t{0}, std::int64_t{1}, std::int64_t{2}, std::int64_t{4}, std::int64_t{8}}) {
        if (!m.moe() && etp != 0) continue;
        TrainTopology alt = t;
        alt.pad_vocab = pad;
        alt.vocab_divisible_by = div;
        alt.etp = etp == t.tp ? 0 : etp;
        if (alt.pad_vocab == t.pad_vocab && (!pad || div == t.vocab_divisible_by) &&
            alt.expert_tp() == t.expert_tp()) {
          continue;  // the topology given
        }
        try {
          validate(m, alt);
        } catch (const dte::error&) {
          continue;
        }
        if (!matches(alt)) continue;
        const std::string d = detail::difference(t, alt);
        if (std::find(causes.begin(), causes.end(), d) == causes.end()) causes.push_back(d);
      }
    }
  }
  if (causes.empty()) return "";
  std::string out = "the trainer's shapes match " + causes.front();
  for (std::size_t i = 1; i < causes.size() && i < 3; ++i)
    out += ", or " + causes[i];
  return out;
}

// Refuses (invalid_argument) when trainer rank `rank` does not hold exactly the parameters the
// plan for topology t expects, in named_parameters() order; names the first differing
// parameter, both shapes and the likely cause.
inline void check_parameters(const ModelSpec& m, const TrainTopology& t, std::int64_t rank,
                             const std::vector<ParamShape>& held) {
  const std::vector<MegatronParam> plan = megatron_params(m, t, train_rank(t, rank));
  if (detail::same_params(plan, held)) return;
  std::string what;
  for (std::size_t i = 0; i < std::max(plan.size(), held.size()); ++i) {
    if (i >= plan.size()) {
      what = "holds " + held[i].name + " " + shape_text(held[i].shape) +
             ", which dte's plan does not have";
    } else if (i >= held.size()) {
      what = "does not hold " + plan[i].name() + " " + shape_text(plan[i].shape()) +
             ", which dte's plan expects";
    } else if (plan[i].name() != held[i].name) {
      what = "holds " + held[i].name + " where dte's plan expects " + plan[i].name();
    } else if (plan[i].shape() != held[i].shape) {
      what = "holds " + held[i].name + " as " + shape_text(held[i].shape) +
             " where dte's plan expects " + shape_text(plan[i].shape());
    } else {
      continue;
    }
    break;
  }
  const std::string cause = likely_cause(m, t, [&](const TrainTopology& alt) {
    return detail::same_params(megatron_params(m, alt, train_rank(alt, rank)), held);
  });
  throw invalid_argument(
      "trainer rank " + std::to_string(rank) + " " + what + ": the trainer's layout is not the " +
          "one dte was given; likely cause: " +
          (cause.empty() ? "the topology (tp, pp, split, ep) or the model differs" : cause) +
          ". Nothing was sent.",
      about("--train"));
}

// Refuses when trainer rank `rank`'s optimizer shards (dense, expert) hold `held` elements
// where its plan for topology t has `want`; the likely cause is searched with Megatron's own
// buffer layout.
inline void check_shard_sizes(const ModelSpec& m, const TrainTopology& t, std::int64_t rank,
                              const std::int64_t (&want)[2], const std::int64_t (&held)[2]) {
  if (want[0] == held[0] && want[1] == held[1]) return;
  auto sizes = [&](const TrainTopology& alt, std::int64_t(&out)[2]) {
    const TrainRank r = train_rank(alt, rank);
    const RankBuffers b = megatron_rank_buffers(megatron_params(m, alt, r), alt, r);
    for (int k = 0; k < 2; ++k)
      out[k] = b.layout[k].shard_size();
  };
  const int k = want[0] != held[0] ? 0 : 1;
  const std::string cause = likely_cause(m, t, [&](const TrainTopology& alt) {
    std::int64_t got[2];
    sizes(alt, got);
    return got[0] == held[0] && got[1] == held[1];
  });
  throw invalid_argument("trainer rank " + std::to_string(rank) + "'s " +
                             (k == 0 ? "dense" : "expert") + " optimizer shard has " +
                             std::to_string(held[k]) + " elements where dte's plan expects " +
                             std::to_string(want[k]) +
                             ": the trainer's layout is not the one dte was given; likely cause: " +
                             (cause.empty() ? "the topology (tp, pp, split, ep, dp, bucket) or "
                                              "the model differs"
                                            : cause) +
                             ". Nothing was sent.",
                         about("--train"));
}

}  // namespace dte::layout
