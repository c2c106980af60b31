// SPDX-License-Identifier: Apache-2.0
// Bytes on storage per changed element (docs/storage.md, "Sizes"), measured on the same deltas
// for dte's chunks and for the encodings the other tools publish:
//   dte        what storage::Publisher writes for the version: every chunk and the manifest
//              (value and diff encodings, zstd level 1 and 3), over its changed elements;
//   AReaL-DTE  per tensor int32 indices then BF16 values, the whole version through zstd -1;
//   PULSE      per tensor sorted index gaps narrowed to u8, escaping to u16 and then u32, then
//              BF16 values, the whole version through zstd -1.
//   order-0    what no per-tensor memoryless code of the same data can go below: the changed set
//              as independent elements of each tensor's density (N h(k/N) bits) plus the new
//              values' sign, exponent and mantissa, each at its order-0 entropy within the tensor;
//              an overwrite encoding (one that does not know the base) codes exactly these;
//   classes    dte's diff encoding with the class index (storage/class_index.hpp): the changed
//              set coded per class of the base value; its order-0 floor ("order-0 class index")
//              is each tensor's sum over base classes c of N_c h(k_c/N_c);
//   planes     the diff run's values alone, as byte planes through zstd -1: their diff codes
//              (what dte writes) beside the XOR of the new and the base bits of the same
//              elements (what an XOR encoding would write).
// The deltas: small-qwen3 (tp=2 writers), the synthetic trainer after 3 warm-up steps, one
// optimizer step per version, at learning rates giving densities between about 0.5% and 3%.
//   build/bench/bench_storage [--json]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"
#include "dte/numeric/round.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/baselines.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/class_index.hpp"
#include "dte/storage/read.hpp"

namespace {

using namespace dte;

// One tensor's part of a chunk, with the chunk's encoding.
using Piece = std::pair<storage::Encoding, storage::TensorDelta>;

std::size_t areal(const std::vector<Piece>& d) {
  std::vector<std::uint8_t> plain;
  for (const auto& [encoding, t] : d)
    sim::baselines::areal_append(plain, t.index, t.bits);
  return sim::baselines::zstd1(plain).size();
}

std::size_t pulse(const std::vector<Piece>& d) {
  std::vector<std::uint8_t> plain;
  for (const auto& [encoding, t] : d)
    sim::baselines::pulse_append(plain, t.index, t.bits);
  return sim::baselines::zstd1(plain).size();
}

// zstd -1 of the high bytes, then of the low bytes, of `codes`.
std::size_t planes(const std::vector<std::uint16_t>& codes) {
  std::vector<std::uint8_t> hi, lo;
  for (const std::uint16_t c : codes) {
    hi.push_back(static_cast<std::uint8_t>(c >> 8));
    lo.push_back(static_cast<std::uint8_t>(c));
  }
  return sim::baselines::zstd1(hi).size() + sim::baselines::zstd1(lo).size();
}

// The diff run's values as stored (diff codes) and as XOR values, over its diff chunks.
struct Planes {
  std::size_t diff = 0, xor_bits = 0;
};
Planes value_planes(const layout::HfModel& hf, const std::vector<Piece>& d,
                    const std::vector<std::uint16_t>& before) {
  std::vector<std::uint16_t> diff, xored;
  for (const auto& [encoding, t] : d) {
    if (encoding != storage::Encoding::diff) continue;
    for (std::size_t k = 0; k < t.index.size(); ++k) {
      const std::uint16_t base = before[static_cast<std::size_t>(hf[t.tensor].base + t.index[k])];
      diff.push_back(t.bits[k]);
      xored.push_back(static_cast<std::uint16_t>(base ^ storage::diff_apply(base, t.bits[k])));
    }
  }
  return {planes(diff), planes(xored)};
}

double entropy_bits(const std::map<std::uint32_t, std::uint64_t>& counts, std::uint64_t n) {
  double bits = 0;
  for (const auto& [symbol, c] : counts) {
    const double q = static_cast<double>(c) / static_cast<double>(n);
    bits -= static_cast<double>(c) * std::log2(q);
  }
  return bits;
}

// Order-0 bytes of the changed set and of the new values (see the top of the file).
struct Order0 {
  double index = 0;
  double values = 0;
};
Order0 order0(const layout::HfModel& hf, const std::vector<Piece>& d) {
  std::map<std::int64_t, std::uint64_t> changed;
  std::map<std::pair<std::int64_t, storage::Encoding>, std::vector<std::uint16_t>> values;
  for (const auto& [encoding, t] : d) {
    changed[t.tensor] += t.bits.size();
    auto& v = values[{t.tensor, encoding}];
    v.insert(v.end(), t.bits.begin(), t.bits.end());
  }
  Order0 out;
  for (const auto& [tensor, k] : changed) {
    const double n = static_cast<double>(hf[tensor].numel());
    const double q = static_cast<double>(k) / n;
    if (q < 1) out.index += n * -(q * std::log2(q) + (1 - q) * std::log2(1 - q)) / 8;
  }
  for (const auto& [key, bits] : values) {
    std::map<std::uint32_t, std::uint64_t> sign, exponent, mantissa;
    for (const std::uint16_t b : bits) {
      ++sign[b >> 15];
      ++exponent[(b >> 7) & 0xFFu];
      ++mantissa[b & 0x7Fu];
    }
    out.values += (entropy_bits(sign, bits.size()) + entropy_bits(exponent, bits.size()) +
                   entropy_bits(mantissa, bits.size())) /
                  8;
  }
  return out;
}

// Order-0 bytes of the changed set given each element's base class: per tensor and class c of
// the base bits, N_c h(k_c / N_c).
double order0_classes(const layout::HfModel& hf, const std::vector<Piece>& d,
                      const std::vector<std::uint16_t>& before) {
  std::map<std::int64_t, std::vector<std::uint64_t>> changed;
  for (const auto& [encoding, t] : d) {
    auto& k = changed[t.tensor];
    k.resize(256);
    for (const std::uint32_t i : t.index)
      ++k[storage::value_class(before[static_cast<std::size_t>(hf[t.tensor].base + i)])];
  }
  double bytes = 0;
  for (const auto& [tensor, k] : changed) {
    std::vector<std::uint64_t> n(256, 0);
    for (std::int64_t i = 0; i < hf[tensor].numel(); ++i)
      ++n[storage::value_class(before[static_cast<std::size_t>(hf[tensor].base + i)])];
    for (std::size_t c = 0; c < 256; ++c) {
      if (k[c] == 0 || k[c] == n[c]) continue;
      const double q = static_cast<double>(k[c]) / static_cast<double>(n[c]);
      bytes += static_cast<double>(n[c]) * -(q * std::log2(q) + (1 - q) * std::log2(1 - q)) / 8;
    }
  }
  return bytes;
}

// The changed elements of version v, from its chunks.
std::vector<Piece> deltas(const layout::HfModel& hf, const std::filesystem::path& root, Version v) {
  const storage::Manifest m = storage::read_manifest(hf, root, v);
  std::vector<Piece> out;
  for (const auto& e : m.chunks) {
    storage::Chunk c = storage::read_chunk(hf, storage::version_dir(root, v), m, e);
    for (auto& t : c.tensors)
      out.emplace_back(c.encoding, std::move(t));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool as_json = argc > 1 && std::strcmp(argv[1], "--json") == 0;
  const layout::HfModel hf(layout::model_preset("small-qwen3"));
  const auto train = layout::parse_train_topology("tp=2");
  const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=1"));
  const std::filesystem::path base =
      std::filesystem::temp_directory_path() / ("dte-bench-storage-" + std::to_string(::getpid()));
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  if (!as_json) {
    std::printf("bytes per changed element, small-qwen3, one optimizer step per version\n");
    std::printf("%-7s %8s %9s | %-15s | %-15s | %-17s | %9s %7s | %-24s | %-7s | %s\n", "lr",
                "density", "changed", "dte value z1/z3", "dte diff z1/z3", "dte classes z1/z3",
                "AReaL-DTE", "PULSE", "order-0 index+value/diff", "o0 cls", "planes diff/xor");
  }
  struct Config {
    const char* name;
    storage::Encoding encoding;
    int level;
    storage::IndexCode index = storage::IndexCode::plain;
  };
  const Config configs[] = {
      {"value_zstd1", storage::Encoding::value, 1},
      {"value_zstd3", storage::Encoding::value, 3},
      {"diff_zstd1", storage::Encoding::diff, 1},
      {"diff_zstd3", storage::Encoding::diff, 3},
      {"classes_zstd1", storage::Encoding::diff, 1, storage::IndexCode::classes},
      {"classes_zstd3", storage::Encoding::diff, 3, storage::IndexCode::classes}};
  for (const double lr : {2e-7, 3e-7, 5e-7, 1e-6, 2e-6, 3e-6}) {
    nlohmann::ordered_json row;
    std::uint64_t changed = 0;
    std::vector<Piece> d;               // the value run's delta (AReaL-DTE, PULSE, order-0 value)
    std::vector<Piece> d_diff;          // the diff run's (order-0 diff, planes)
    std::vector<std::uint16_t> before;  // the BF16 weights the deltas apply to
    for (const Config& cfg_row : configs) {
      const std::filesystem::path root = base / (std::to_string(lr) + "-" + cfg_row.name);
      std::filesystem::remove_all(root);
      sim::SyntheticTrainer t(hf, train, {.lr = lr, .warmup_steps = 0});
      const sim::AdamWAccess access{&t};
      storage::PublisherConfig cfg;
      cfg.zstd_level = cfg_row.level;
      cfg.encoding = cfg_row.encoding;
      cfg.index = cfg_row.index;
      sim::StorageCluster writers(hf, train, root, cfg);
      for (int s = 0; s < 3; ++s)
        t.step();
      writers.publish(access);  // the anchor
      if (before.empty()) {
        const std::vector<float> w = t.canonical_weights();
        before.resize(w.size());
        for (std::size_t i = 0; i < w.size(); ++i)
          before[i] = round_bf16(w[i]);
      }
      t.step();
      const storage::PublishReport rep = *writers.step(access);
      changed = rep.changed;
      row[cfg_row.name] = static_cast<double>(rep.bytes) / static_cast<double>(rep.changed);
      if (cfg_row.level == 1 && cfg_row.index == storage::IndexCode::plain)
        (cfg_row.encoding == storage::Encoding::value ? d : d_diff) = deltas(hf, root, rep.version);
      std::filesystem::remove_all(root);
    }
    const double density = static_cast<double>(changed) / static_cast<double>(hf.total());
    row["areal_dte"] = static_cast<double>(areal(d)) / static_cast<double>(changed);
    row["pulse"] = static_cast<double>(pulse(d)) / static_cast<double>(changed);
    const Order0 bound = order0(hf, d);
    const Order0 bound_diff = order0(hf, d_diff);
    const Planes p = value_planes(hf, d_diff, before);
    row["order0_index"] = bound.index / static_cast<double>(changed);
    row["order0_values"] = bound.values / static_cast<double>(changed);
    row["order0_diff_values"] = bound_diff.values / static_cast<double>(changed);
    row["order0_class_index"] = order0_classes(hf, d, before) / static_cast<double>(changed);
    row["planes_diff"] = static_cast<double>(p.diff) / static_cast<double>(changed);
    row["planes_xor"] = static_cast<double>(p.xor_bits) / static_cast<double>(changed);
    row["lr"] = lr;
    row["density"] = density;
    row["changed"] = changed;
    if (!as_json) {
      std::printf(
          "%-7.0e %7.3f%% %9llu | %7.3f %7.3f | %7.3f %7.3f | %8.3f %8.3f | %9.3f %7.3f | "
          "%.3f+%.3f/%.3f | %7.3f | %.3f/%.3f\n",
          lr, 100 * density, static_cast<unsigned long long>(changed),
          row["value_zstd1"].get<double>(), row["value_zstd3"].get<double>(),
          row["diff_zstd1"].get<double>(), row["diff_zstd3"].get<double>(),
          row["classes_zstd1"].get<double>(), row["classes_zstd3"].get<double>(),
          row["areal_dte"].get<double>(), row["pulse"].get<double>(),
          row["order0_index"].get<double>(), row["order0_values"].get<double>(),
          row["order0_diff_values"].get<double>(), row["order0_class_index"].get<double>(),
          row["planes_diff"].get<double>(), row["planes_xor"].get<double>());
    }
    rows.push_back(row);
  }
  std::filesystem::remove_all(base);
  if (as_json) std::printf("%s\n", rows.dump().c_str());
  return 0;
}
