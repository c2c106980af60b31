// SPDX-License-Identifier: Apache-2.0
// bench_fp8: what FP8 receivers cost (docs/benchmarks.md, "FP8 receivers"; docs/fp8.md). A
// trainer holding the model as one flat FP32 buffer runs torch.optim.AdamW's arithmetic; after
// each step two publishers publish the same step:
//   fp8   publication::Publisher serving vLLM's online per-block FP8 at tp=1 (serve_fp8): the
//         FP8 codes and scales that change, the tensors that stay BF16 as usual;
//   bf16  the same publisher without FP8: the BF16 delta of the same step.
// Per publication: the bytes of each message, and of a dense FP8 reload (every code, one byte,
// and every scale of the quantized tensors, plus two bytes per element of the tensors that stay
// BF16); the receivers' apply time, one thread: an FP8 ShardReceiver (TP rank 0 of tp=1) for the
// FP8 message, a ShardReceiver for the BF16 delta, and a dense requantization of the rank's
// quantized tensors from their BF16 values in the rank's layout (what an engine does on a dense
// reload: the recipe over every element, block by block in memory order; the copy of the dense
// bytes themselves not counted) as the dense FP8 reload's work.
// The learning rate is rescaled until the BF16 density is near each target. At the end the FP8
// receiver is checked against the dense requantization of the trainer, so a fast wrong apply
// cannot pass.
//   bench_fp8 [--model small-qwen3|qwen3-8b-layer|NAME] [--densities 0.01,0.02]
//             [--publications 3] [--json FILE]
// qwen3-8b-layer: one decoder layer of Qwen3-8B's shape (hidden 4096, 32 heads, 8 KV heads,
// intermediate 12288) with a 2,048-token vocabulary, so the layer's tensors are what is measured.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "../tests/publication/flat_adamw.hpp"
#include "dte/detect/detect.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/sim/fp8_dense.hpp"

using namespace dte;

namespace {

using Pub = publication::Publisher<AdamWInverse, BF16Detect>;
using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Row {
  double target = 0, density = 0;
  std::uint64_t changed = 0, codes = 0, scales = 0;
  std::uint64_t fp8_bytes = 0, bf16_bytes = 0, dense_bytes = 0;
  double fp8_apply = 0, bf16_apply = 0, dense_apply = 0;  // seconds, summed
  double fp8_publish = 0, bf16_publish = 0;               // the publishers' own, summed
  int n = 0;
};

// A dense requantization of one [rows, cols] BF16 tensor by the recipe, block by block, in
// memory order: what an engine runs over every quantized tensor on a dense reload.
void requantize(const layout::BlockGrid& g, const std::uint16_t* w, std::uint8_t* code,
                float* scale) {
  for (std::int64_t b = 0; b < g.blocks(); ++b) {
    const std::int64_t r0 = g.row0(b), c0 = g.col0(b), nr = g.rows_of(b), nc = g.cols_of(b);
    float amax = 0.0f;
    for (std::int64_t r = r0; r < r0 + nr; ++r) {
      const std::uint16_t* x = w + r * g.cols + c0;
      for (std::int64_t j = 0; j < nc; ++j)
        amax = std::max(amax, VllmBlockFp8::magnitude(x[j]));
    }
    scale[b] = VllmBlockFp8::scale(amax);
    const float mult = VllmBlockFp8::multiplier(scale[b]);
    for (std::int64_t r = r0; r < r0 + nr; ++r) {
      const std::uint16_t* x = w + r * g.cols + c0;
      std::uint8_t* out = code + r * g.cols + c0;
      for (std::int64_t j = 0; j < nc; ++j)
        out[j] = VllmBlockFp8::code(x[j], mult);
    }
  }
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_fp8: %s\nusage: bench_fp8 [--model NAME|qwen3-8b-layer] "
               "[--densities D,D,...] [--publications N] [--json FILE]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "small-qwen3", json;
  int publications = 3;
  std::vector<double> targets = {0.01, 0.02};
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (a + 1 >= argc) usage(("missing a value after " + arg).c_str());
    const std::string val = argv[++a];
    if (arg == "--model") {
      model = val;
    } else if (arg == "--publications") {
      publications = std::stoi(val);
    } else if (arg == "--json") {
      json = val;
    } else if (arg == "--densities") {
      targets.clear();
      std::stringstream ss(val);
      for (std::string d; std::getline(ss, d, ',');)
        targets.push_back(std::stod(d));
    } else {
      usage(("unknown argument " + arg).c_str());
    }
  }
  if (publications < 1 || targets.empty()) usage("need a publication and a density");
  layout::ModelSpec spec;
  if (model == "qwen3-8b-layer") {
    spec = layout::model_preset("qwen3-8b");
    spec.name = "qwen3-8b-layer";
    spec.layers = 1;
    spec.vocab = 2048;
    spec.validate();
  } else {
    spec = layout::model_preset(model);
  }

  testing::FlatAdamW tr(spec);
  tr.lr = 2e-6;  // rescaled per density below
  Pub fp8(spec), bf16(spec);
  const layout::InferTopology topo{1, 1, 1};
  fp8.serve_fp8({VllmBlockFp8::name, topo});
  const layout::HfModel& hf = fp8.model();
  const layout::ServingLayout serving(hf, topo);
  const layout::Fp8Grid grid(serving, VllmBlockFp8::block_rows, VllmBlockFp8::block_cols);

  // The receivers: the FP8 rank, and a BF16 rank for the BF16 deltas.
  sim::Fp8RankTensors fx(grid);
  publication::ShardReceiver fp8_rx(spec, topo, 0, VllmBlockFp8::name, fx.bf16_views(),
                                    fx.fp8_views());
  std::vector<std::vector<std::uint16_t>> bx;
  ReceiverTensors bviews;
  for (std::int64_t k = 0; k < serving.size(); ++k)
    bx.emplace_back(static_cast<std::size_t>(serving[k].numel), 0);
  for (auto& x : bx)
    bviews.emplace_back(x);
  publication::ShardReceiver bf16_rx(spec, topo, 0, bviews);

  std::uint64_t dense_bytes = 0, quantized = 0;
  for (std::int64_t k = 0; k < serving.size(); ++k) {
    if (grid.quantized(k)) {
      dense_bytes += static_cast<std::uint64_t>(grid.grid(k).numel() + 4 * grid.grid(k).blocks());
      quantized += static_cast<std::uint64_t>(grid.grid(k).numel());
    } else {
      dense_bytes += 2 * static_cast<std::uint64_t>(serving.live_end(0, k));
    }
  }
  const auto weights = [&](std::int64_t t) {
    return std::span<const float>(tr.theta).subspan(static_cast<std::size_t>(hf[t].base),
                                                    static_cast<std::size_t>(hf[t].numel()));
  };
  // (step(): a publication after each optimizer step, so a delta knows it covers one step)
  const auto publish = [&](bool full) {
    const auto f = tr.flat();
    const publication::FlatAccess<AdamWInverse> access{&f, &hf};
    if (full) return std::pair{fp8.publish(access, true), bf16.publish(access, true)};
    return std::pair{*fp8.step(access), *bf16.step(access)};
  };
  {
    const auto [a, b] = publish(true);
    if (!fp8_rx.apply(a).committed() || !bf16_rx.apply(b).committed()) {
      std::fprintf(stderr, "bench_fp8: the full publication was not applied\n");
      return 1;
    }
  }
  const auto total = static_cast<double>(hf.total());
  std::int64_t largest = 0, most_blocks = 0;
  for (std::int64_t id : grid.quantized_ids()) {
    largest = std::max(largest, grid.grid(id).numel());
    most_blocks = std::max(most_blocks, grid.grid(id).blocks());
  }
  std::vector<std::uint8_t> dense_codes(static_cast<std::size_t>(largest));
  std::vector<float> dense_scales(static_cast<std::size_t>(most_blocks));
  std::vector<Row> rows;
  constexpr int calibration = 4;
  for (const double target : targets) {
    Row row;
    row.target = target;
    for (int p = 0; p < calibration + publications; ++p) {
      tr.step();
      const auto [a, b] = publish(false);
      const double d = static_cast<double>(bf16.last().changed) / total;
      auto t0 = Clock::now();
      const bool ok_a = fp8_rx.apply(a).committed();
      auto t1 = Clock::now();
      const bool ok_b = bf16_rx.apply(b).committed();
      auto t2 = Clock::now();
      if (!ok_a || !ok_b) {
        std::fprintf(stderr, "bench_fp8: a receiver did not commit\n");
        return 1;
      }
      if (p < calibration) {
        if (d > 0) tr.lr *= std::clamp(target / d, 0.25, 4.0);
        continue;
      }
      // the dense reload's receiver work: requantize every quantized tensor from the BF16
      // values of the rank's own layout (the BF16 receiver's tensors)
      const auto t3 = Clock::now();
      for (std::size_t k = 0; k < grid.quantized_ids().size(); ++k) {
        const std::int64_t id = grid.quantized_ids()[k];
        requantize(grid.grid(id), bx[static_cast<std::size_t>(id)].data(), dense_codes.data(),
                   dense_scales.data());
      }
      const auto t4 = Clock::now();
      row.density += d / publications;
      row.changed += bf16.last().changed;
      row.codes += fp8.last().fp8_codes;
      row.scales += fp8.last().fp8_scales;
      row.fp8_bytes += a.size();
      row.bf16_bytes += b.size();
      row.dense_bytes += dense_bytes;
      row.fp8_publish += fp8.last().seconds;
      row.bf16_publish += bf16.last().seconds;
      row.fp8_apply += seconds(t0, t1);
      row.bf16_apply += seconds(t1, t2);
      row.dense_apply += seconds(t3, t4);
      ++row.n;
    }
    rows.push_back(row);
  }
  if (const std::string d = sim::fp8_rank_differs(grid, 0, fx, weights); !d.empty()) {
    std::fprintf(stderr, "bench_fp8: the FP8 receiver differs from the dense result in %s\n",
                 d.c_str());
    return 1;
  }
  std::printf("%s: %.0f elements, %llu quantized; per publication (mean of %d):\n",
              spec.name.c_str(), total, static_cast<unsigned long long>(quantized), publications);
  std::printf(
      "  density  codes sent  scales  | FP8 msg    BF16 delta  dense FP8  | FP8/dense  FP8/BF16 "
      "| apply FP8   BF16 delta  dense requant | publish FP8  BF16\n");
  std::ostringstream js;
  js << "{\"model\": \"" << spec.name << "\", \"elements\": " << hf.total()
     << ", \"quantized\": " << quantized << ", \"rows\": [";
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const Row& x = rows[r];
    const double n = x.n;
    std::printf(
        "  %6.2f%%  %10.0f  %6.0f  | %9.0f  %10.0f  %10.0f | 1/%-7.0f  %7.3f  | %8.2f ms %8.2f ms "
        "%8.2f ms | %8.1f ms %8.1f ms\n",
        100 * x.density, x.codes / n, x.scales / n, x.fp8_bytes / n, x.bf16_bytes / n,
        x.dense_bytes / n, static_cast<double>(x.dense_bytes) / static_cast<double>(x.fp8_bytes),
        static_cast<double>(x.fp8_bytes) / static_cast<double>(x.bf16_bytes), 1e3 * x.fp8_apply / n,
        1e3 * x.bf16_apply / n, 1e3 * x.dense_apply / n, 1e3 * x.fp8_publish / n,
        1e3 * x.bf16_publish / n);
    js << (r ? ", " : "") << "{\"density\": " << x.density << ", \"changed\": " << x.changed / n
       << ", \"fp8_codes\": " << x.codes / n << ", \"fp8_scales\": " << x.scales / n
       << ", \"fp8_bytes\": " << x.fp8_bytes / n << ", \"bf16_bytes\": " << x.bf16_bytes / n
       << ", \"dense_fp8_bytes\": " << x.dense_bytes / n << ", \"fp8_apply_s\": " << x.fp8_apply / n
       << ", \"bf16_apply_s\": " << x.bf16_apply / n
       << ", \"dense_requantize_s\": " << x.dense_apply / n
       << ", \"fp8_publish_s\": " << x.fp8_publish / n
       << ", \"bf16_publish_s\": " << x.bf16_publish / n << "}";
  }
  js << "]}\n";
  if (!json.empty()) std::ofstream(json) << js.str();
  return 0;
}
