// SPDX-License-Identifier: Apache-2.0
// The host-built tables of the CUDA pipeline (pipeline/device_tables.hpp), checked on the host:
// the work items cover every shard element exactly once without crossing a run, carry the
// kernel index and canonical base the detect kernel uses, and the binary search the route
// kernel runs finds every offset's item; a receiver's source table maps every live element to
// the canonical element ServingLayout::source names and nothing else (padding finds no run).
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/pipeline/device_tables.hpp"
#include "dte/pipeline/runs.hpp"

using namespace dte;
using layout::BufferKind;

namespace {
struct Case {
  const char* model;
  const char* train;
  const char* infer;
};
constexpr Case kCases[] = {
    {"tiny-qwen3", "tp=2,dp=2", "tp=2"},
    {"tiny-qwen3", "tp=4,pp=2,dp=2,split=1:3,bucket=3000", "tp=4,replicas=2"},
    {"tiny-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2"}};
}  // namespace

TEST_CASE("work items cover each shard exactly once, inside one run, with resolved indices") {
  for (const Case& c : kCases) {
    INFO(c.model << " " << c.train);
    const layout::HfModel hf(layout::model_preset(c.model));
    const auto train = layout::parse_train_topology(c.train);
    const layout::ServingLayout recv(hf, layout::parse_infer_topology(c.infer));
    for (std::int64_t rank = 0; rank < train.world(); ++rank) {
      const layout::TransferPlan plan(hf, train, rank);
      const pipeline::RunTable table(plan, hf, &recv);
      for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
        for (const std::uint32_t max : {1u, 37u, 4096u}) {
          const auto runs = table.runs(b);
          const pipeline::WorkTable work(runs, plan.segments(b), max);
          const auto items = work.items();
          // The runs cover the shard but its alignment padding between buckets; the items cover
          // the runs, in order, without overlap.
          std::int64_t covered = 0, sent = 0, last_end = 0;
          std::size_t r = 0, at = 0;
          for (const pipeline::WorkItem& it : items) {
            if (at == static_cast<std::size_t>(runs[r].length)) ++r, at = 0;
            REQUIRE(it.run == r);
            REQUIRE(it.shard_begin == runs[r].shard_begin + static_cast<std::int64_t>(at));
            REQUIRE(it.shard_begin >= last_end);
            last_end = it.shard_begin + it.length;
            at += it.length;
            REQUIRE(it.length >= 1);
            REQUIRE(it.length <= max);
            const pipeline::Run& run = runs[it.run];
            REQUIRE(it.shard_begin >= run.shard_begin);
            REQUIRE(it.shard_begin + it.length <= run.shard_begin + run.length);
            const auto& seg = plan.segments(b)[static_cast<std::size_t>(it.segment)];
            CHECK(it.segment == run.segment);
            CHECK(it.first == it.shard_begin - seg.shard_begin);
            const bool send = run.sender && run.tensor >= 0;
            CHECK(it.canonical == (send ? run.canonical + (it.shard_begin - run.shard_begin) : -1));
            CHECK(it.tensor == (send ? run.tensor : -1));
            if (send) sent += it.length;
            covered += it.length;
          }
          std::int64_t in_runs = 0;
          for (const pipeline::Run& run : runs)
            in_runs += run.length;
          CHECK(covered == in_runs);
          CHECK(work.elements() == in_runs);
          CHECK(last_end <= plan.shard_size(b));
          CHECK(work.sent() == sent);
          // The route kernel's search, at every item's first, last and a middle element.
          const auto n = static_cast<std::uint32_t>(items.size());
          for (std::uint32_t k = 0; k < n; ++k) {
            const std::int64_t lo = items[k].shard_begin, hi = lo + items[k].length - 1;
            CHECK(pipeline::find_item(items.data(), n, lo) == k);
            CHECK(pipeline::find_item(items.data(), n, hi) == k);
            CHECK(pipeline::find_item(items.data(), n, (lo + hi) / 2) == k);
          }
        }
      }
    }
  }
}

TEST_CASE("spread32 places a warp's 32 bits at any alignment, as bit-by-bit setting would") {
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  for (int trial = 0; trial < 20000; ++trial) {
    // Offsets near word boundaries and beyond 2^32 bits.
    const std::int64_t o =
        static_cast<std::int64_t>(next() % 256) + (trial % 2 == 0 ? 0 : (std::int64_t{1} << 33));
    const auto bits = static_cast<std::uint32_t>(trial % 3 == 0 ? 0xFFFFFFFFu : next());
    const pipeline::WordSpread s = pipeline::spread32(o, bits);
    std::uint64_t want[2] = {0, 0};
    const std::uint64_t base = (static_cast<std::uint64_t>(o) >> 6) << 6;
    for (int j = 0; j < 32; ++j) {
      if (((bits >> j) & 1u) == 0) continue;
      const std::uint64_t bit =
          static_cast<std::uint64_t>(o) + static_cast<std::uint64_t>(j) - base;
      want[bit / 64] |= std::uint64_t{1} << (bit % 64);
    }
    REQUIRE(s.word == static_cast<std::uint64_t>(o) >> 6);
    REQUIRE(s.low == want[0]);
    REQUIRE(s.high == want[1]);
  }
}

TEST_CASE("a zero item length is refused") {
  CHECK_THROWS_AS(pipeline::WorkTable({}, {}, 0), invalid_argument);
}

TEST_CASE("receiver source table == ServingLayout::source for every element of every receiver") {
  for (const Case& c : kCases) {
    INFO(c.model << " " << c.infer);
    const layout::HfModel hf(layout::model_preset(c.model));
    const layout::ServingLayout recv(hf, layout::parse_infer_topology(c.infer));
    const std::int64_t tp = recv.topology().tp;
    for (std::int64_t rank = 0; rank < recv.topology().ranks(); ++rank) {
      INFO("receiver " << rank);
      const pipeline::ReceiverSourceTable table(hf, recv, rank);
      const auto runs = table.runs();
      const auto n = static_cast<std::uint32_t>(runs.size());
      std::int64_t live = 0, found = 0, wrong = 0, padding_hit = 0;
      for (std::int64_t k = 0; k < recv.size(); ++k) {
        for (std::int64_t i = 0; i < recv[k].numel; ++i) {
          const layout::Canonical want = recv.source({rank % tp, k, i});
          const std::uint32_t s = pipeline::find_source(
              runs.data(), n, static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(i));
          if (want.tensor < 0) {
            padding_hit += s != n;
            continue;
          }
          ++live;
          if (s == n) continue;
          ++found;
          const pipeline::SourceRun& r = runs[s];
          wrong += r.tensor != want.tensor ||
                   r.canonical + (i - r.index) != hf[want.tensor].base + want.index;
        }
        // One past the tensor's end finds nothing.
        CHECK(pipeline::find_source(runs.data(), n, static_cast<std::uint32_t>(k),
                                    static_cast<std::uint32_t>(recv[k].numel)) == n);
      }
      CHECK(live == recv.live_elements(rank % tp));
      CHECK(found == live);
      CHECK(wrong == 0);
      CHECK(padding_hit == 0);
      CHECK(pipeline::find_source(runs.data(), n, static_cast<std::uint32_t>(recv.size()), 0) == n);
    }
  }
}
