// SPDX-License-Identifier: Apache-2.0
// bench_apply: how fast receivers apply publication messages (docs/benchmarks.md, "Apply").
// A trainer holding the model as one flat FP32 buffer runs torch.optim.AdamW's arithmetic and
// publishes deltas through publication::Publisher at chosen densities (the learning rate is
// rescaled until the changed fraction is near each target). Every message is applied, on one
// thread, into
//   hf     an HfReceiver over the whole model's HF tensors,
//   shard  a ShardReceiver, TP rank 0 of tp=2 (fused qkv_proj / gate_up_proj, half the rows),
// and each apply's wall time (the fastest of --rounds replays over fresh receivers) is divided by
// the elements it wrote: nanoseconds per changed element, zstd decode, every check and the
// digest included; the median over the publications of each density is reported. The shard's
// time is also given per changed element of the publication (it decodes all of them and writes
// its part: about half at tp=2). The receivers are
// checked against a dense BF16 conversion of the trainer at the end, so a fast wrong apply cannot
// pass.
//
// Only the public API is used, so the same file builds against an older checkout for a
// comparison in the same run (bench/apply_compare.sh).
//   bench_apply [--model small-qwen3] [--layers N] [--densities 0.01,0.025,0.05]
//               [--publications 5] [--rounds 3] [--encoding diff|value] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/layout/model.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
// (relative to this file: apply_compare.sh builds it with only an include/ of another revision)
#include "../tests/publication/flat_adamw.hpp"

using namespace dte;

namespace {

using Pub = publication::Publisher<AdamWInverse, BF16Detect>;

struct Tensors {
  std::vector<std::vector<std::uint16_t>> data;
  std::vector<std::span<std::uint16_t>> views;
  explicit Tensors(const std::vector<std::int64_t>& sizes) {
    for (std::int64_t n : sizes)
      data.emplace_back(static_cast<std::size_t>(n), 0);
    for (auto& d : data)
      views.emplace_back(d);
  }
};

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0 : x[x.size() / 2];
}

struct Row {
  double target = 0, density = 0;
  std::uint64_t changed = 0, bytes = 0;
  double hf_ns = 0, shard_ns = 0;  // per element written, median over the publications
  double shard_pub_ns = 0;         // the shard's, per changed element of the publication
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_apply: %s\nusage: bench_apply [--model NAME] [--layers N] "
               "[--densities D,D,...] [--publications N] [--rounds N] [--encoding diff|value] "
               "[--json FILE]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "small-qwen3", json;
  std::int64_t layers = 0;
  int publications = 5, rounds = 3;
  storage::Encoding encoding = storage::Encoding::diff;  // the publisher's default
  std::vector<double> targets = {0.01, 0.025, 0.05};
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (a + 1 >= argc) usage(("missing a value after " + arg).c_str());
    const std::string val = argv[++a];
    if (arg == "--model") {
      model = val;
    } else if (arg == "--layers") {
      layers = std::stoll(val);
    } else if (arg == "--publications") {
      publications = std::stoi(val);
    } else if (arg == "--rounds") {
      rounds = std::stoi(val);
    } else if (arg == "--json") {
      json = val;
    } else if (arg == "--encoding") {
      if (val != "diff" && val != "value") usage("--encoding is diff or value");
      encoding = val == "diff" ? storage::Encoding::diff : storage::Encoding::value;
    } else if (arg == "--densities") {
      targets.clear();
      std::stringstream ss(val);
      for (std::string d; std::getline(ss, d, ',');)
        targets.push_back(std::stod(d));
    } else {
      usage(("unknown argument " + arg).c_str());
    }
  }
  if (publications < 1 || rounds < 1 || targets.empty()) {
    usage("need at least one publication, round and density");
  }
  layout::ModelSpec spec = layout::model_preset(model);
  if (layers > 0) spec.layers = layers;

  // The publications first (the trainer and publisher are not what is timed): a full one, then
  // per target density a few calibration deltas and `publications` measured ones.
  testing::FlatAdamW tr(spec);
  tr.lr = 2e-6;  // rescaled per density below
  publication::PublisherConfig cfg;
  // (a tree before the publisher had encodings: bench/apply_compare.sh builds this against one)
  [&](auto& c) {
    if constexpr (requires { c.encoding; }) c.encoding = encoding;
  }(cfg);
  Pub pub(spec, cfg);
  const layout::HfModel& hf = pub.model();
  const auto total = static_cast<double>(hf.total());
  struct Message {
    publication::Bytes bytes;
    int row = -1;  // the measured row it belongs to (-1: not measured)
  };
  std::vector<Message> messages;
  {
    const auto f = tr.flat();
    messages.push_back({pub.publish(publication::FlatAccess<AdamWInverse>{&f}, true), -1});
  }
  std::vector<Row> rows;
  // Deltas that rescale the learning rate before each density's measured ones (4 left the
  // lowest row at 0.77 % for a 1 % target: Adam's steps shrink as its moments settle).
  constexpr int calibration = 8;
  for (double target : targets) {
    Row row;
    row.target = target;
    for (int p = 0; p < calibration + publications; ++p) {
      tr.step();
      const auto f = tr.flat();
      auto msg = pub.step(publication::FlatAccess<AdamWInverse>{&f});
      const double d = static_cast<double>(pub.last().changed) / total;
      if (p < calibration) {  // calibrate the learning rate for this density
        if (d > 0) tr.lr *= std::clamp(target / d, 0.25, 4.0);
        messages.push_back({std::move(*msg), -1});
        continue;
      }
      row.changed += pub.last().changed;
      row.bytes += msg->size();
      row.density += d / publications;
      messages.push_back({std::move(*msg), static_cast<int>(rows.size())});
    }
    rows.push_back(row);
  }

  // Then the applies, `rounds` times over fresh receivers; per message the fastest round.
  std::vector<std::int64_t> hf_sizes;
  for (std::int64_t t = 0; t < hf.size(); ++t)
    hf_sizes.push_back(hf[t].numel());
  layout::InferTopology topo;
  topo.tp = 2;
  // (the serving layout's type as ShardReceiver names it: the same source builds on revisions
  // that called it otherwise)
  using Layout =
      std::remove_cvref_t<decltype(std::declval<const publication::ShardReceiver&>().layout())>;
  const Layout shard_layout(hf, topo);
  std::vector<std::int64_t> shard_sizes;
  for (std::int64_t k = 0; k < shard_layout.size(); ++k)
    shard_sizes.push_back(shard_layout[k].numel);
  std::vector<double> hf_best(messages.size(), 1e300), shard_best(messages.size(), 1e300);
  std::vector<std::uint64_t> hf_written(messages.size()), shard_written(messages.size());
  Tensors hf_tensors(hf_sizes);
  Tensors shard_tensors(shard_sizes);
  std::string hf_verify;
  for (int round = 0; round < rounds; ++round) {
    hf_tensors = Tensors(hf_sizes);
    shard_tensors = Tensors(shard_sizes);
    publication::HfReceiver hf_rx(spec, hf_tensors.views);
    publication::ShardReceiver shard_rx(spec, topo, 0, shard_tensors.views);
    for (std::size_t k = 0; k < messages.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto h = hf_rx.apply(messages[k].bytes);
      const auto t1 = std::chrono::steady_clock::now();
      const auto s = shard_rx.apply(messages[k].bytes);
      const auto t2 = std::chrono::steady_clock::now();
      if (!h.committed() || !s.committed()) {
        std::fprintf(stderr, "bench_apply: a receiver did not commit message %zu\n", k);
        return 1;
      }
      hf_best[k] = std::min(hf_best[k], std::chrono::duration<double, std::nano>(t1 - t0).count());
      shard_best[k] =
          std::min(shard_best[k], std::chrono::duration<double, std::nano>(t2 - t1).count());
      hf_written[k] = h.written;
      shard_written[k] = s.written;
    }
    hf_verify = hf_rx.verify();
  }
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::vector<double> hf_ns, shard_ns, shard_pub_ns;
    for (std::size_t k = 0; k < messages.size(); ++k) {
      if (messages[k].row != static_cast<int>(r)) continue;
      hf_ns.push_back(hf_best[k] / static_cast<double>(std::max<std::uint64_t>(1, hf_written[k])));
      shard_ns.push_back(shard_best[k] /
                         static_cast<double>(std::max<std::uint64_t>(1, shard_written[k])));
      shard_pub_ns.push_back(shard_best[k] /
                             static_cast<double>(std::max<std::uint64_t>(1, hf_written[k])));
    }
    rows[r].hf_ns = median(hf_ns);
    rows[r].shard_ns = median(shard_ns);
    rows[r].shard_pub_ns = median(shard_pub_ns);
  }
  // The receivers hold the trainer's BF16 weights, bit for bit.
  std::int64_t bad = 0;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    for (std::int64_t i = 0; i < hf[t].numel(); ++i) {
      bad += hf_tensors.data[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)] !=
             Bf16Format::round(tr.theta[static_cast<std::size_t>(hf[t].base + i)]);
    }
  }
  if (bad != 0 || !hf_verify.empty()) {
    std::fprintf(stderr, "bench_apply: the HF receiver differs from the trainer in %lld elements\n",
                 static_cast<long long>(bad));
    return 1;
  }

  std::printf("model %s, %lld elements, %d publications per density (%s encoding), one thread\n",
              model.c_str(), static_cast<long long>(hf.total()), publications,
              encoding == storage::Encoding::diff ? "diff" : "value");
  std::printf("%8s %9s %12s %12s %14s %14s %14s\n", "target", "density", "changed/pub", "bytes/pub",
              "hf ns/elem", "shard ns/elem", "shard ns/pub");
  for (const Row& r : rows) {
    std::printf(
        "%7.2f%% %8.3f%% %12llu %12llu %14.2f %14.2f %14.2f\n", 100 * r.target, 100 * r.density,
        static_cast<unsigned long long>(r.changed / static_cast<std::uint64_t>(publications)),
        static_cast<unsigned long long>(r.bytes / static_cast<std::uint64_t>(publications)),
        r.hf_ns, r.shard_ns, r.shard_pub_ns);
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"model\": \"" << model << "\", \"elements\": " << hf.total()
        << ", \"publications\": " << publications << ", \"rows\": [";
    for (std::size_t k = 0; k < rows.size(); ++k) {
      const Row& r = rows[k];
      out << (k ? ", " : "") << "{\"target\": " << r.target << ", \"density\": " << r.density
          << ", \"hf_ns_per_element\": " << r.hf_ns << ", \"shard_ns_per_element\": " << r.shard_ns
          << ", \"shard_ns_per_published_element\": " << r.shard_pub_ns << "}";
    }
    out << "]}\n";
  }
  return 0;
}
