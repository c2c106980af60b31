// SPDX-License-Identifier: Apache-2.0
// Memory, measured: every heap allocation of this process is counted (global operator new), and
// the peak extra memory of a publication is compared with what it moved. Senders hold their
// messages in fixed chunks and receivers read messages in place, so a publication needs at most
// 1.5 x (bytes sent + bytes received) plus a fixed bound (one partly filled chunk per
// (sender, receiver) pair, per-tensor tables, the run table, and every executor thread's tile
// buffers); nothing scales with the model but the K > 1 dirty masks, one bit per element,
// allocated once. And a receiver writing into tensors the caller allocated allocates nothing
// model-sized.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/engine/wire.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace {

std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};

void note(std::int64_t delta) {
  const std::int64_t now = g_current.fetch_add(delta) + delta;
  std::int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

}  // namespace

// Each block carries its size in a 16-byte prefix so that delete can count it back.
void* operator new(std::size_t n) {
  auto* p = static_cast<unsigned char*>(std::malloc(n + 16));
  if (p == nullptr) throw std::bad_alloc();
  *reinterpret_cast<std::size_t*>(p) = n;
  note(static_cast<std::int64_t>(n));
  return p + 16;
}
void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  auto* base = static_cast<unsigned char*>(p) - 16;
  note(-static_cast<std::int64_t>(*reinterpret_cast<std::size_t*>(base)));
  std::free(base);
}
void* operator new[](std::size_t n) {
  return operator new(n);
}
void operator delete[](void* p) noexcept {
  operator delete(p);
}
void operator delete(void* p, std::size_t) noexcept {
  operator delete(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  operator delete(p);
}

using namespace dte;
using namespace dte::layout;

TEST_CASE("memory of a publication: O(changed), within 1.5x of the payload plus a fixed bound") {
  for (const std::int64_t K : {1, 4}) {
    const HfModel hf(model_preset("small-qwen3"));
    const TrainTopology train = parse_train_topology("tp=2,dp=2");
    const ServingLayout recv(hf, parse_infer_topology("tp=4,replicas=2"));
    sim::SyntheticConfig cfg;
    cfg.lr = 1e-6;
    cfg.warmup_steps = 2;
    sim::SyntheticTrainer trainer(hf, train, cfg);
    const sim::AdamWAccess access{&trainer};
    sim::LoopbackCluster<DeltaEngine<AdamWInverse, BF16Detect>> engine(hf, train, recv,
                                                                       {.publish_every = K});
    engine.publish_full(access);
    std::int64_t worst_extra = 0;
    double worst_ratio = 0;
    for (int step = 1; step <= 8; ++step) {
      trainer.step();
      const std::int64_t before = g_current.load();
      g_peak.store(before);
      SyncReport rep;
      const bool published = engine.step(access, rep);
      const std::int64_t extra = g_peak.load() - before;
      if (!published) continue;
      const std::int64_t moved =
          static_cast<std::int64_t>(rep.payload_total_bytes + rep.received_total_bytes);
      const std::int64_t fixed =
          static_cast<std::int64_t>(rep.sender_fixed_bytes) * train.world() + (1 << 20);
      std::printf(
          "K=%lld v%llu: changed %.3f%%, sent %lld + received %lld bytes, peak extra heap "
          "%lld bytes (fixed allowance %lld); worst sender: %llu held for %llu payload + "
          "%llu mask; worst receiver: %llu held for %llu received\n",
          static_cast<long long>(K), static_cast<unsigned long long>(rep.version),
          100 * rep.changed_fraction(), static_cast<long long>(rep.payload_total_bytes),
          static_cast<long long>(rep.received_total_bytes), static_cast<long long>(extra),
          static_cast<long long>(fixed), static_cast<unsigned long long>(rep.sender_extra_bytes),
          static_cast<unsigned long long>(rep.sender_payload_bytes),
          static_cast<unsigned long long>(rep.sender_mask_bytes),
          static_cast<unsigned long long>(rep.receiver_extra_bytes),
          static_cast<unsigned long long>(rep.receiver_payload_bytes));
      CHECK(rep.verified);
      CHECK(extra <= static_cast<std::int64_t>(1.5 * static_cast<double>(moved)) + fixed);
      // Per rank, from the engine's own accounting.
      CHECK(rep.sender_extra_bytes <=
            1.5 * rep.sender_payload_bytes + rep.sender_mask_bytes + rep.sender_fixed_bytes);
      CHECK(rep.receiver_extra_bytes <= 1.5 * rep.receiver_payload_bytes + 4096);
      worst_extra = std::max(worst_extra, extra);
      worst_ratio = std::max(worst_ratio, static_cast<double>(extra) / static_cast<double>(moved));
    }
    std::printf("K=%lld: worst peak extra %lld bytes, %.2f x the bytes moved (sent + received)\n",
                static_cast<long long>(K), static_cast<long long>(worst_extra), worst_ratio);
  }
}

TEST_CASE(
    "a receiver writes into tensors the caller allocated; dte allocates nothing model-sized") {
  const HfModel hf(model_preset("small-qwen3"));
  const ServingLayout recv(hf, parse_infer_topology("tp=2"));
  // The inference engine's own tensors (receiver TP rank 0), allocated and owned by the test.
  std::vector<std::vector<std::uint16_t>> storage;
  ReceiverTensors views;
  std::int64_t model_bytes = 0;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    storage.emplace_back(static_cast<std::size_t>(recv[k].numel), std::uint16_t{0x1234});
    views.emplace_back(storage.back());
    model_bytes += 2 * recv[k].numel;
  }
  // A full publication (every live element as dense runs) and a delta touching 1% of them.
  wire::Message full;
  full.kind = MessageKind::full;
  full.version = 0;
  wire::Message delta;
  delta.version = 1;
  delta.base = 0;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(recv.live_end(0, k)));
    for (std::size_t i = 0; i < bits.size(); ++i) {
      bits[i] = static_cast<std::uint16_t>(0x3C00 + (i * 7 + static_cast<std::size_t>(k)) % 512);
      if (i % 100 == 3) {
        delta.entries.push_back({static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(i),
                                 static_cast<std::uint16_t>(bits[i] + 1)});
      }
    }
    full.runs.push_back({static_cast<std::uint32_t>(k), 0, std::move(bits)});
  }
  const Inbox full_in{{0, wire::encode(full)}}, delta_in{{0, wire::encode(delta)}};
  full = {};
  delta = {};

  const std::int64_t before = g_current.load();
  g_peak.store(before);
  Receiver r(hf, recv, 0, 1, views);
  const ApplyResult a = r.apply(0, full_in);
  const ApplyResult b = r.apply(1, delta_in);
  const std::int64_t extra = g_peak.load() - before;
  std::printf(
      "receiver over caller tensors: %lld model bytes, messages %zu + %zu bytes, peak extra "
      "heap of construction and both applies %lld bytes\n",
      static_cast<long long>(model_bytes), full_in[0].second.size(), delta_in[0].second.size(),
      static_cast<long long>(extra));
  REQUIRE(a.committed());
  REQUIRE(b.committed());
  // Nothing model-sized: the view table, the digest table, and the delta's staged writes
  // (receive/staged.hpp: index, value and digest key per sparse write, O(changed)); the full
  // publication's dense runs are read in place from the message.
  const auto staged = static_cast<std::int64_t>(b.written) * 12;
  CHECK(b.written > 0);
  CHECK(extra < 64 * 1024 + staged);
  CHECK(extra < model_bytes / 10);
  // The caller's memory holds the values (in place: the same buffers).
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    CHECK(r.tensor(k).data() == storage[static_cast<std::size_t>(k)].data());
    const std::uint16_t want = static_cast<std::uint16_t>(0x3C00 + (3 * 7 + k) % 512 + 1);
    CHECK(storage[static_cast<std::size_t>(k)][3] == want);
  }
  // The digest equals one computed from the caller's tensors.
  std::vector<Digest> digest(static_cast<std::size_t>(hf.size()), 0);
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    for (std::size_t i = 0; i < storage[static_cast<std::size_t>(k)].size(); ++i) {
      const Canonical c = recv.source({0, k, static_cast<std::int64_t>(i)});
      if (c.tensor >= 0) {
        digest[static_cast<std::size_t>(c.tensor)] +=
            element_digest(hf[c.tensor].base + c.index, storage[static_cast<std::size_t>(k)][i]);
      }
    }
  }
  CHECK(r.digest() == digest);
}
