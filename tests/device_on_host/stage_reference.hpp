// SPDX-License-Identifier: Apache-2.0
// The host pipeline's stages as the reference of the device pipeline: what SenderFrame::scan
// runs with the routing sink, tile by tile, without the encoder, as per-receiver entry lists;
// the comparison of such lists; and the golden invariant of a receiver rank's tensors. Used by
// tests/device_on_host/ (the kernel bodies on the host) and tests/cuda/test_cuda_pipeline.cu (the
// same comparison on a GPU).
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/sender.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/serving.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/device_stages.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/sim/access.hpp"

namespace dte_test {

using dte::layout::BufferKind;
using dte::pipeline::ScanMode;

inline constexpr BufferKind kBuffers[2] = {BufferKind::dense, BufferKind::expert};

using Entry = std::tuple<std::uint32_t, std::uint32_t, std::uint16_t>;  // tensor, index, bits

struct StageResult {
  std::uint64_t flagged = 0, guard = 0, scanned = 0;
  std::vector<dte::Digest> digest;
  std::vector<std::vector<Entry>> to;  // per receiver, in order
};

using HostSender = dte::SenderFrame<dte::AdamWInverse, dte::BF16Detect, dte::layout::TransferPlan,
                                    dte::exec::Host>;

// The host stages, tile by tile in order (what SenderFrame::scan runs with the routing sink,
// without the encoder).
inline StageResult host_stages(HostSender& s, const dte::sim::AdamWAccess& a, ScanMode mode,
                               std::size_t tensors, std::size_t receivers) {
  StageResult r;
  r.digest.assign(tensors, 0);
  r.to.resize(receivers);
  for (BufferKind b : kBuffers) {
    if (s.plan().shard_size(b) == 0) continue;
    if (mode != ScanMode::all) s.bind(a, b);
    const auto theta = a.theta(s.rank(), b);
    HostSender::Tile tile;
    for (std::size_t t = 0; t < s.tiles(b); ++t) {
      REQUIRE(s.detect_tile(theta, b, t, mode, tile));
      r.flagged += tile.counts.flagged;
      r.guard += tile.counts.guard;
      r.scanned += tile.scanned;
      for (const auto& [tensor, d] : tile.digest)
        r.digest[static_cast<std::size_t>(tensor)] += d;
      if (mode == ScanMode::mark || mode == ScanMode::all) continue;
      s.compact_tile(theta, b, t, tile);
      s.route_tile(b, t, tile);
      const auto& e = tile.routed;
      for (std::size_t i = 0; i < e.size(); ++i)
        r.to[e.rank[i]].emplace_back(e.tensor[i], e.index[i], e.bits[i]);
    }
    if (mode == ScanMode::all) {
      // The naive reference of a full publication: every sent element of every run, per copy.
      for (const dte::pipeline::Run& run : s.runs().runs(b)) {
        if (!run.sender || run.tensor < 0) continue;
        r.flagged += static_cast<std::uint64_t>(run.length);
        for (std::int64_t j = 0; j < run.length; ++j) {
          const std::uint16_t bits = dte::BF16Detect::store(theta[run.shard_begin + j]);
          for (const auto& target : s.runs().targets(run))
            r.to[target.rank].emplace_back(target.tensor,
                                           target.index + static_cast<std::uint32_t>(j), bits);
        }
      }
    }
  }
  return r;
}

// SenderPipeline::scan (pipeline/device_stages.hpp, on any device executor), its batches of
// routed entries collected per receiver in arrival order.
template <class Pipeline, class Access>
StageResult device_scan(Pipeline& p, const Access& a, ScanMode mode, std::size_t tensors,
                        std::size_t receivers) {
  StageResult r;
  r.digest.assign(tensors, 0);
  r.to.resize(receivers);
  const auto found = p.scan(a, mode, [&](BufferKind, const dte::pipeline::device::BucketBatch& k) {
    for (std::size_t d = 0; d < receivers; ++d) {
      for (std::uint64_t j = 0; j < k.count[d]; ++j) {
        const std::uint64_t at = k.offset[d] + j;
        r.to[d].emplace_back(k.tensor[at], k.index[at], k.bits[at]);
      }
    }
  });
  for (const dte::pipeline::device::DetectResult& o : found) {
    r.flagged += o.flagged;
    r.guard += o.guard;
    r.scanned += o.scanned;
    for (std::size_t t = 0; t < o.digest.size(); ++t)
      r.digest[t] += o.digest[t];
  }
  return r;
}

inline void check_same(const StageResult& host, const StageResult& device) {
  CHECK(device.flagged == host.flagged);
  CHECK(device.guard == host.guard);
  CHECK(device.scanned == host.scanned);
  CHECK(device.digest == host.digest);
  REQUIRE(device.to.size() == host.to.size());
  for (std::size_t d = 0; d < host.to.size(); ++d) {
    INFO("receiver " << d);
    CHECK(device.to[d].size() == host.to[d].size());
    CHECK(device.to[d] == host.to[d]);
  }
}

struct Case {
  const char* model;
  const char* train;
  const char* infer;
};
constexpr Case kCases[] = {
    {"tiny-qwen3", "tp=2,dp=2", "tp=2"},
    {"tiny-qwen3", "tp=4,pp=2,dp=2,split=1:3,bucket=3000", "tp=4,replicas=2"},
    {"tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2"}};

// Elements that differ from the rounded canonical weights, and the digest of the contents.
inline std::int64_t mismatches(const dte::layout::HfModel& hf,
                               const dte::layout::ServingLayout& recv, std::int64_t rank,
                               const std::vector<std::vector<std::uint16_t>>& t,
                               const std::vector<float>& canonical,
                               std::vector<dte::Digest>& digest) {
  std::int64_t bad = 0;
  digest.assign(static_cast<std::size_t>(hf.size()), 0);
  const std::int64_t ts = rank % recv.topology().tp;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    for (std::size_t i = 0; i < t[static_cast<std::size_t>(k)].size(); ++i) {
      const auto c = recv.source({ts, k, static_cast<std::int64_t>(i)});
      const std::uint16_t got = t[static_cast<std::size_t>(k)][i];
      if (c.tensor < 0) {
        bad += got != 0;
        continue;
      }
      const std::int64_t g = hf[c.tensor].base + c.index;
      bad += got != dte::BF16Detect::store(canonical[static_cast<std::size_t>(g)]);
      digest[static_cast<std::size_t>(c.tensor)] += dte::element_digest(g, got);
    }
  }
  return bad;
}

}  // namespace dte_test
