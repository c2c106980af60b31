// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpus of fuzz_receiver (valid publications, a repair, a no-op, a replay), of
// fuzz_optimizer_dump (small AdamW and SGD dumps), of fuzz_chunk (chunks as stored, and their
// containers uncompressed) and of fuzz_manifest (a delta's and an anchor's manifest). Run once; the
// files are in the repo:
//   make_seeds <fuzz/corpus>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <zstd.h>

#include "chunk_base.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/manifest.hpp"
#include "receiver_fixture.hpp"

namespace {

void put(std::vector<std::uint8_t>& out, const dte::Inbox& inbox, std::uint8_t step) {
  out.push_back(step);
  out.push_back(static_cast<std::uint8_t>(inbox.size()));
  for (const auto& [src, bytes] : inbox) {
    out.push_back(static_cast<std::uint8_t>(src));
    out.push_back(static_cast<std::uint8_t>(bytes.size() & 0xFF));
    out.push_back(static_cast<std::uint8_t>(bytes.size() >> 8));
    for (std::byte b : bytes)
      out.push_back(static_cast<std::uint8_t>(b));
  }
}

void write(const std::filesystem::path& p, const std::vector<std::uint8_t>& b) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds <corpus dir>\n");
    return 2;
  }
  const std::filesystem::path root = argv[1];
  std::filesystem::create_directories(root / "receiver");
  std::filesystem::create_directories(root / "optimizer_dump");
  using namespace dte;
  for (std::uint8_t rank : {0, 1}) {
    test::ReceiverFixture f(rank, 2, test::ReceiverFixture::micro_model());
    // step 3: version held + 1. Delta 1 (sparse + a dense run), no-op 2, repair within 2.
    std::vector<std::uint8_t> seed{rank};
    put(seed, f.delta_publication(1, 0, {{1, 3, 0x4000}, {2, 5, 0x3F00}, {0, 100, 0x1234}}), 3);
    // (tensor 0 is embed_tokens: 64 rows x 16 on rank 0, 36 live rows on rank 1)
    put(seed, f.noop_publication(2, 1), 3);
    wire::Message repair;
    repair.kind = MessageKind::repair;
    repair.version = 2;
    repair.runs.push_back({1, 0, std::vector<std::uint16_t>(16, 0x4242)});
    put(seed, {{0, wire::encode(repair)}}, 2);
    put(seed, f.delta_publication(1, 0, {{1, 4, 0x4000}}), 2);  // a replay of version 1
    write(root / "receiver" / ("publications_rank" + std::to_string(rank)), seed);
    std::vector<std::uint8_t> one{rank};
    std::vector<DeltaEntry> many;
    for (std::uint32_t i = 0; i < 300; ++i)  // tensor 0 (embed_tokens), 2 or 3 blocks
      many.push_back({0, i * (rank == 0 ? 3u : 1u), static_cast<std::uint16_t>(0x3F00 + i)});
    put(one, f.delta_publication(1, 0, many), 3);
    write(root / "receiver" / ("blocks_rank" + std::to_string(rank)), one);
  }
  for (const char* kind : {"adamw", "sgd"}) {
    const std::size_t n = 32;
    std::vector<float> p0(n), p(n), m(n), v(n);
    for (std::size_t i = 0; i < n; ++i) {
      p0[i] = 0.01f * static_cast<float>(i + 1);
      m[i] = 1e-4f * static_cast<float>(i % 5);
      v[i] = 1e-8f * static_cast<float>(i % 3);
      p[i] = p0[i] * (1.0f - 1e-6f) - 1e-4f * static_cast<float>(i % 2);
    }
    io::SafetensorsWriter w;
    w.add<float>("theta_prev", {n}, p0);
    w.add<float>("theta", {n}, p);
    if (std::string(kind) == "sgd") {
      w.add<float>("momentum_buffer", {n}, m);
      w.set_metadata("momentum", "0.9");
    } else {
      w.add<float>("exp_avg", {n}, m);
      w.add<float>("exp_avg_sq", {n}, v);
      w.set_metadata("step", "3");
      w.set_metadata("eps", "1e-08");
    }
    w.set_metadata("optimizer", kind);
    w.set_metadata("lr", "1e-05");
    w.set_metadata("weight_decay", "0.1");
    w.write(root / "optimizer_dump" / (std::string(kind) + ".safetensors"));
  }
  // fuzz_chunk: first byte even = the stored chunk, odd = the container before zstd.
  std::filesystem::create_directories(root / "chunk");
  const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
  // (a stored chunk as "stored_<name>", its container as "container_<name>")
  const auto chunk_seeds = [&](const std::vector<std::byte>& stored, const std::string& name) {
    std::vector<std::uint8_t> a{0};
    for (std::byte b : stored)
      a.push_back(static_cast<std::uint8_t>(b));
    write(root / "chunk" / ("stored_" + name), a);
    std::vector<std::uint8_t> plain{1};
    for (std::byte b : storage::decompress_frames(stored, "seed"))
      plain.push_back(static_cast<std::uint8_t>(b));
    write(root / "chunk" / ("container_" + name), plain);
  };
  for (std::uint32_t seed = 0; seed < 3; ++seed) {
    storage::Chunk c;
    c.header = {5 + seed, 4 + seed, seed, seed};
    for (std::int64_t t = seed; t < hf.size(); t += 7) {
      storage::TensorDelta d;
      d.tensor = t;
      const auto n = static_cast<std::uint32_t>(hf[t].numel());
      for (std::uint32_t i = seed; i < n; i += 37 + 300 * (t % 3))  // gaps above 254 escape
        d.index.push_back(i), d.bits.push_back(static_cast<std::uint16_t>(0x3C00 + i % 512));
      c.tensors.push_back(std::move(d));
    }
    const auto stored = storage::encode_chunk(hf, c, 1);
    chunk_seeds(stored, std::to_string(seed));
  }
  {
    // A diff chunk with a class index against the fuzzer's base (chunk_base.hpp).
    storage::Chunk c;
    c.header = {9, 8, 0, 1};
    c.encoding = storage::Encoding::diff;
    c.index = storage::IndexCode::classes;
    for (std::int64_t t = 1; t < hf.size(); t += 5) {
      storage::TensorDelta d;
      d.tensor = t;
      const auto n = static_cast<std::uint32_t>(hf[t].numel());
      d.domain = {{0, n / 8, n / 4, 4}};  // four runs of an eighth
      for (std::uint32_t j = 0; j < 4; ++j) {
        // (changes among the class-127 positions only, and a few exceptions, so the class
        // index is the smaller code and the writer picks it)
        for (std::uint32_t i = j * (n / 4); i < j * (n / 4) + n / 8; ++i) {
          const std::uint8_t cls = storage::value_class(fuzz::pattern_bits(t, i));
          if (i % 3 != 0 || (cls != 127 && i % 301 != 0)) continue;
          d.index.push_back(i), d.bits.push_back(static_cast<std::uint16_t>(5 + i % 2));
          d.cls.push_back(i % 301 == 0 ? storage::unknown_class : cls);
        }
      }
      c.tensors.push_back(std::move(d));
    }
    const fuzz::PatternBase base;
    const auto stored = storage::encode_chunk(hf, c, 1, &base);
    chunk_seeds(stored, "classes");
  }
  std::filesystem::create_directories(root / "manifest");
  for (const bool anchor : {false, true}) {
    storage::Manifest m;
    m.model = hf.spec().name;
    m.version = 9;
    m.base = anchor ? no_version : 8;
    m.writers = 2;
    m.changed = anchor ? static_cast<std::uint64_t>(hf.total()) : 321;
    m.chunks = {{"c0-w0.zst", 900, 0x1234abcd5678ef90ull, 0, 0}, {"c0-w1.zst", 512, 42, 0, 1}};
    for (std::int64_t t = 0; t < hf.size(); ++t)
      m.digest.push_back(static_cast<Digest>(0x85EBCA77u * static_cast<std::uint32_t>(t)));
    const std::string text = storage::manifest_json(m);
    write(root / "manifest" / (anchor ? "anchor.json" : "delta.json"),
          std::vector<std::uint8_t>(text.begin(), text.end()));
  }
  return 0;
}
