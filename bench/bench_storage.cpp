// SPDX-License-Identifier: Apache-2.0
// Bytes on storage per changed element (docs/storage.md, "Sizes"), measured on the same deltas
// for dte's chunks and for the encodings the other tools publish:
//   dte        what storage::Publisher writes for the version: every chunk and the manifest
//              (value and xor encodings, zstd level 1 and 3), over its changed elements;
//   AReaL-DTE  per tensor int32 indices then BF16 values, the whole version through zstd -1;
//   PULSE      per tensor sorted index gaps narrowed to u8, escaping to u16 and then u32, then
//              BF16 values, the whole version through zstd -1.
// The deltas: small-qwen3 (tp=2 writers), the synthetic trainer after 3 warm-up steps, one
// optimizer step per version, at learning rates giving densities between about 0.5% and 3%.
//   build/bench/bench_storage [--json]
#include <zstd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/read.hpp"

namespace {

using namespace dte;

std::size_t zstd1(const std::vector<std::uint8_t>& plain) {
  std::vector<std::uint8_t> out(ZSTD_compressBound(plain.size()));
  const std::size_t n = ZSTD_compress(out.data(), out.size(), plain.data(), plain.size(), 1);
  if (ZSTD_isError(n)) throw std::runtime_error("zstd failed");
  return n;
}

void put16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v));
  out.push_back(static_cast<std::uint8_t>(v >> 8));
}
void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int b = 0; b < 4; ++b)
    out.push_back(static_cast<std::uint8_t>(v >> (8 * b)));
}

std::size_t areal(const std::vector<storage::TensorDelta>& d) {
  std::vector<std::uint8_t> plain;
  for (const auto& t : d) {
    for (std::uint32_t i : t.index)
      put32(plain, i);
    for (std::uint16_t b : t.bits)
      put16(plain, b);
  }
  return zstd1(plain);
}

std::size_t pulse(const std::vector<storage::TensorDelta>& d) {
  std::vector<std::uint8_t> plain;
  for (const auto& t : d) {
    std::uint64_t next = 0;
    for (std::uint32_t i : t.index) {
      const std::uint64_t gap = i - next;
      if (gap < 255) {
        plain.push_back(static_cast<std::uint8_t>(gap));
      } else if (gap < 65535) {
        plain.push_back(255);
        put16(plain, static_cast<std::uint16_t>(gap));
      } else {
        plain.push_back(255);
        put16(plain, 65535);
        put32(plain, static_cast<std::uint32_t>(gap));
      }
      next = std::uint64_t{i} + 1;
    }
    for (std::uint16_t b : t.bits)
      put16(plain, b);
  }
  return zstd1(plain);
}

// The changed elements of version v, from its chunks.
std::vector<storage::TensorDelta> deltas(const layout::HfModel& hf,
                                         const std::filesystem::path& root, Version v) {
  const storage::Manifest m = storage::read_manifest(hf, root, v);
  std::vector<storage::TensorDelta> out;
  for (const auto& e : m.chunks) {
    storage::Chunk c = storage::read_chunk(hf, storage::version_dir(root, v), m, e);
    for (auto& t : c.tensors)
      out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool as_json = argc > 1 && std::strcmp(argv[1], "--json") == 0;
  const layout::HfModel hf(layout::model_preset("small-qwen3"));
  const auto train = layout::parse_train_topology("tp=2");
  const layout::SglangLayout recv(hf, layout::parse_infer_topology("tp=1"));
  const std::filesystem::path base =
      std::filesystem::temp_directory_path() / ("dte-bench-storage-" + std::to_string(::getpid()));
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  if (!as_json) {
    std::printf("bytes per changed element, small-qwen3, one optimizer step per version\n");
    std::printf("%-7s %8s %9s | %-15s | %-15s | %9s %7s\n", "lr", "density", "changed",
                "dte value z1/z3", "dte xor z1/z3", "AReaL-DTE", "PULSE");
  }
  struct Config {
    const char* name;
    storage::Encoding encoding;
    int level;
  };
  const Config configs[] = {{"value_zstd1", storage::Encoding::value, 1},
                            {"value_zstd3", storage::Encoding::value, 3},
                            {"xor_zstd1", storage::Encoding::xor_base, 1},
                            {"xor_zstd3", storage::Encoding::xor_base, 3}};
  for (const double lr : {2e-7, 3e-7, 5e-7, 1e-6, 2e-6, 3e-6}) {
    nlohmann::ordered_json row;
    std::uint64_t changed = 0;
    std::vector<storage::TensorDelta> d;
    for (const Config& cfg_row : configs) {
      const std::filesystem::path root = base / (std::to_string(lr) + "-" + cfg_row.name);
      std::filesystem::remove_all(root);
      sim::SyntheticTrainer t(hf, train, recv, {.lr = lr, .warmup_steps = 0});
      const sim::AdamWAccess access{&t};
      storage::PublisherConfig cfg;
      cfg.zstd_level = cfg_row.level;
      cfg.encoding = cfg_row.encoding;
      sim::StorageCluster writers(hf, train, root, cfg);
      for (int s = 0; s < 3; ++s)
        t.step();
      writers.publish(access);  // the anchor
      t.step();
      const storage::PublishReport rep = *writers.step(access);
      changed = rep.changed;
      row[cfg_row.name] = static_cast<double>(rep.bytes) / static_cast<double>(rep.changed);
      if (cfg_row.encoding == storage::Encoding::value && d.empty())
        d = deltas(hf, root, rep.version);
      std::filesystem::remove_all(root);
    }
    const double density = static_cast<double>(changed) / static_cast<double>(hf.total());
    row["areal_dte"] = static_cast<double>(areal(d)) / static_cast<double>(changed);
    row["pulse"] = static_cast<double>(pulse(d)) / static_cast<double>(changed);
    row["lr"] = lr;
    row["density"] = density;
    row["changed"] = changed;
    if (!as_json) {
      std::printf("%-7.0e %7.3f%% %9llu | %7.3f %7.3f | %7.3f %7.3f | %9.3f %7.3f\n", lr,
                  100 * density, static_cast<unsigned long long>(changed),
                  row["value_zstd1"].get<double>(), row["value_zstd3"].get<double>(),
                  row["xor_zstd1"].get<double>(), row["xor_zstd3"].get<double>(),
                  row["areal_dte"].get<double>(), row["pulse"].get<double>());
    }
    rows.push_back(row);
  }
  std::filesystem::remove_all(base);
  if (as_json) std::printf("%s\n", rows.dump().c_str());
  return 0;
}
