// SPDX-License-Identifier: Apache-2.0
// Bytes per changed element of canonical chunks (storage/chunk.hpp) on synthetic-trainer deltas:
// small-qwen3, two warm-up steps, then one step; changed = the BF16 bits differ; one chunk per
// delta, value encoding, at several learning rates (densities) and zstd levels.
//   build/bench/bench_storage
#include <cstdint>
#include <cstdio>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/chunk.hpp"

int main() {
  using namespace dte;
  const layout::HfModel hf(layout::model_preset("small-qwen3"));
  const auto train = layout::parse_train_topology("tp=1");
  const layout::SglangLayout recv(hf, layout::parse_infer_topology("tp=1"));
  std::printf("%-8s %-9s %s\n", "lr", "density", "bytes per changed element (zstd-1, -3, -9)");
  for (const double lr : {3e-7, 1e-6, 3e-6}) {
    sim::SyntheticTrainer t(hf, train, recv, {.lr = lr});
    t.step();
    t.step();
    const std::vector<float> before = t.canonical_weights();
    t.step();
    const std::vector<float> after = t.canonical_weights();
    storage::Chunk c;
    c.header = {3, 2, 0, 0};
    std::uint64_t changed = 0;
    for (std::int64_t k = 0; k < hf.size(); ++k) {
      storage::TensorDelta d;
      d.tensor = k;
      for (std::int64_t i = 0; i < hf[k].numel(); ++i) {
        const auto g = static_cast<std::size_t>(hf[k].base + i);
        const std::uint16_t now = BF16Detect::store(after[g]);
        if (now == BF16Detect::store(before[g])) continue;
        d.index.push_back(static_cast<std::uint32_t>(i));
        d.bits.push_back(now);
      }
      changed += d.index.size();
      c.tensors.push_back(std::move(d));
    }
    std::printf("%-8.0e %7.3f%% ", lr,
                100.0 * static_cast<double>(changed) / static_cast<double>(hf.total()));
    for (const int level : {1, 3, 9}) {
      const auto bytes = storage::encode_chunk(hf, c, level);
      std::printf(" %.3f", static_cast<double>(bytes.size()) / static_cast<double>(changed));
    }
    std::printf("\n");
  }
  return 0;
}
