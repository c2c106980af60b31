// SPDX-License-Identifier: Apache-2.0
// Differential test: a random model converted through dte's transfer plans equals the
// independent tensor-level reference (reference_convert.py: torch reshape/split/cat written from
// shared/LAYOUTS.md, sharing no code with the index maps), bit for bit, for every tensor kind,
// experts and the padded vocabulary included. Also the HF canonical values per sent element, and
// per element of every copy that does not send (TP replicas of norms, a tied model's output
// layer on the last stage), which must hold its canonical element's value too.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "dte/io/safetensors.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"

using namespace dte::layout;
using dte::io::SafetensorsFile;

namespace {

std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

}  // namespace

TEST_CASE("transfer plans reproduce the tensor-level reference bit for bit") {
  const char* dir_env = std::getenv("DTE_REFERENCE_DIR");
  REQUIRE_MESSAGE(dir_env != nullptr, "set DTE_REFERENCE_DIR to a reference_convert.py --out dir");
  const std::string dir = dir_env;
  const SafetensorsFile meg = SafetensorsFile::read(dir + "/megatron.safetensors");
  const SafetensorsFile rec = SafetensorsFile::read(dir + "/receivers.safetensors");
  const SafetensorsFile hfile = SafetensorsFile::read(dir + "/hf.safetensors");
  const auto& mm = meg.metadata();
  const auto& rm = rec.metadata();

  const ModelSpec m = model_preset(mm.at("model"));
  TrainTopology t;
  t.tp = std::stoll(mm.at("tp")), t.pp = std::stoll(mm.at("pp")), t.ep = std::stoll(mm.at("ep"));
  t.etp = std::stoll(mm.at("etp")), t.dp = std::stoll(mm.at("dp"));
  if (!m.moe()) t.ep = t.etp = 1;
  const InferTopology inf{std::stoll(rm.at("tp")), m.moe() ? std::stoll(rm.at("ep")) : 1,
                          std::stoll(rm.at("replicas"))};
  validate(m, t);
  validate(m, inf);
  CHECK(std::stoll(mm.at("Vp")) == t.padded_vocab(m.vocab));
  const HfModel hf(m);
  const ServingLayout recv(hf, inf);

  // Receiver tensors as dte fills them, NaN-poisoned so unwritten elements show.
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(inf.ranks()));
  for (auto& rank : out) {
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      rank.emplace_back(static_cast<std::size_t>(recv[k].numel), std::nanf(""));
    }
  }
  std::map<std::string, std::vector<float>> cache;
  auto tensor = [&](const SafetensorsFile& f,
                    const std::string& name) -> const std::vector<float>& {
    auto it = cache.find(name);
    if (it == cache.end()) it = cache.emplace(name, f.read_as<float>(name)).first;
    return it->second;
  };

  std::int64_t sent = 0, canonical_mismatch = 0, copies = 0, copy_mismatch = 0;
  for (std::int64_t g = 0; g < t.world(); ++g) {
    const TransferPlan plan(hf, t, g);
    const TrainRank& r = plan.rank();
    for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
      for (const PlanSegment& s : plan.segments(b)) {
        const MegatronParam& p = plan.params()[static_cast<std::size_t>(s.param)];
        const std::string name =
            p.is_expert()
                ? "expert.pp" + std::to_string(r.pp) + ".ep" + std::to_string(r.em) + ".etp" +
                      std::to_string(r.te) + "." + p.name()
                : "dense.tp" + std::to_string(r.tm) + ".pp" + std::to_string(r.pp) + "." + p.name();
        const std::vector<float>& src = tensor(meg, name);
        REQUIRE(static_cast<std::int64_t>(src.size()) == p.numel());
        if (!s.sender) {
          for (std::int64_t i = 0; i < s.length; ++i) {
            const Canonical c = plan.mapping()(p, s.param_begin + i);
            if (c.tensor < 0) continue;
            ++copies;
            const std::vector<float>& hv = tensor(hfile, hf.name(c.tensor));
            copy_mismatch += bits(hv[static_cast<std::size_t>(c.index)]) !=
                             bits(src[static_cast<std::size_t>(s.param_begin + i)]);
          }
          continue;
        }
        for (std::int64_t i = 0; i < s.length; ++i) {
          const std::int64_t o = s.shard_begin + i;
          const float value = src[static_cast<std::size_t>(s.param_begin + i)];
          const Canonical c = plan.canonical(b, o);
          if (c.tensor < 0) continue;  // vocab padding
          ++sent;
          const std::vector<float>& hv = tensor(hfile, hf.name(c.tensor));
          canonical_mismatch += bits(hv[static_cast<std::size_t>(c.index)]) != bits(value);
          route_canonical(recv, plan.canonical(b, o), [&](const RouteTarget& rt) {
            out[static_cast<std::size_t>(rt.rank)][static_cast<std::size_t>(rt.tensor)]
               [static_cast<std::size_t>(rt.index)] = value;
          });
        }
      }
    }
  }
  CHECK(sent == hf.total());
  CHECK(canonical_mismatch == 0);
  CHECK(copy_mismatch == 0);
  // A tied model with pp > 1 holds a second copy of every embedding element.
  if (m.tied() && t.pp > 1) CHECK(copies >= m.vocab * m.hidden);

  std::int64_t compared = 0, mismatched = 0, tensors = 0;
  for (std::int64_t rr = 0; rr < inf.ranks(); ++rr) {
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      const std::string name = "r" + std::to_string(rr) + "." + recv.name(k);
      const std::vector<float> want = rec.read_as<float>(name);
      const auto& got = out[static_cast<std::size_t>(rr)][static_cast<std::size_t>(k)];
      REQUIRE_MESSAGE(want.size() == got.size(), name);
      ++tensors;
      std::int64_t bad = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const bool live = recv.source({rr % inf.tp, k, static_cast<std::int64_t>(i)}).tensor >= 0;
        // The vocabulary tail is zero-filled by SGLang's loader and never written by dte.
        const bool ok =
            live ? bits(got[i]) == bits(want[i]) : (std::isnan(got[i]) && want[i] == 0.0f);
        bad += !ok;
      }
      if (bad != 0) MESSAGE(name << ": " << bad << " elements differ from the reference");
      compared += static_cast<std::int64_t>(got.size());
      mismatched += bad;
    }
  }
  MESSAGE(dir << ": " << tensors << " receiver tensors, " << compared << " elements compared, "
              << mismatched << " differ; " << sent << " canonical elements sent, " << copies
              << " non-sending copies checked");
  CHECK(tensors == recv.size() * inf.ranks());
  CHECK(mismatched == 0);
}
