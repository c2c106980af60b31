// SPDX-License-Identifier: Apache-2.0
// The checkpoint a synthetic run "started from", for testing the first-publication check
// (io/verify_start.hpp) end to end: the SyntheticTrainer's initial weights as a Hugging Face
// checkpoint directory (model-00001-of-00001.safetensors, BF16, and its
// model.safetensors.index.json), exported by a converter that assumes topology `assumed` while
// the trainer really has topology `real`. With assumed == real it is the true checkpoint; with
// another vocabulary padding or expert split it is exactly what such a converter writes: each
// canonical element read from the trainer memory where `assumed` says it lives.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/io/file.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/topology.hpp"
#include "dte/numeric/round.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::sim {

namespace detail {

// The trainer of topology `real`, rank by rank (parameters and map, built once), read at the
// Megatron coordinates that topology `assumed` gives a canonical element.
class Exporter {
 public:
  Exporter(const SyntheticTrainer& tr, const layout::HfModel& hf, const layout::TrainTopology& real,
           const layout::TrainTopology& assumed)
      : tr_(&tr), hf_(&hf), assumed_(assumed) {
    for (std::int64_t g = 0; g < real.world(); ++g) {
      const layout::TrainRank r = layout::train_rank(real, g);
      ranks_.push_back(
          {r, layout::MegatronToHF(hf, real, r), layout::megatron_params(hf.spec(), real, r)});
    }
  }

  // The initial value the trainer holds where `assumed` says c lives (0 where it holds nothing).
  [[nodiscard]] float value(layout::Canonical c) const {
    const layout::MegatronSource s = layout::megatron_source(*hf_, assumed_, c);
    const bool expert =
        s.kind == layout::MegatronKind::expert_fc1 || s.kind == layout::MegatronKind::expert_fc2;
    for (const Rank& k : ranks_) {
      const layout::TrainRank& r = k.rank;
      if (r.pp != s.pp ||
          (expert ? (r.te != s.te || r.em != s.em || r.edp != 0) : (r.tm != s.tm || r.dp != 0))) {
        continue;
      }
      for (const layout::MegatronParam& p : k.params) {
        if (p.kind != s.kind || (s.local_layer >= 0 && p.local_layer != s.local_layer) ||
            (expert && p.local_expert != s.local_expert)) {
          continue;
        }
        if (s.index >= p.numel()) return 0.0f;
        const layout::Canonical held = k.map(p, s.index);
        return held.tensor < 0 ? 0.0f : tr_->initial_value(held);
      }
      return 0.0f;
    }
    return 0.0f;
  }

 private:
  struct Rank {
    layout::TrainRank rank;
    layout::MegatronToHF map;
    std::vector<layout::MegatronParam> params;
  };
  const SyntheticTrainer* tr_;
  const layout::HfModel* hf_;
  layout::TrainTopology assumed_;
  std::vector<Rank> ranks_;
};

}  // namespace detail

inline void write_start_checkpoint(const SyntheticTrainer& tr, const layout::HfModel& hf,
                                   const layout::TrainTopology& real,
                                   const layout::TrainTopology& assumed,
                                   const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const std::string file = "model-00001-of-00001.safetensors";
  io::SafetensorsWriter w;
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", 2 * hf.total()}};
  const detail::Exporter exporter(tr, hf, real, assumed);
  std::vector<std::uint16_t> bits;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    bits.resize(static_cast<std::size_t>(hf[t].numel()));
    for (std::int64_t i = 0; i < hf[t].numel(); ++i) {
      bits[static_cast<std::size_t>(i)] = round_bf16(exporter.value({t, i}));
    }
    const auto shape = hf.shape(t);
    w.add(hf.name(t), io::DType::BF16, {shape.begin(), shape.end()},
          std::as_bytes(std::span<const std::uint16_t>(bits)));
    index["weight_map"][hf.name(t)] = file;
  }
  w.set_metadata("format", "pt");
  w.write(dir / file);
  const std::string text = index.dump(2) + "\n";
  io::write_file_atomic(dir / "model.safetensors.index.json", std::as_bytes(std::span(text)),
                        "checkpoint index");
}

}  // namespace dte::sim
