// SPDX-License-Identifier: Apache-2.0
// The named collectives (dte/transport/collective.hpp) over a real loopback world, one thread per
// rank: sum_fields sums structs member by member, vectors of structs row by row, and digests mod
// 2^32, every part in its own place whatever the order; agree() returns when nobody failed and
// otherwise throws on every rank, naming the first failed slot, also on ranks that cannot fail.
#include <doctest/doctest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dte/transport/collective.hpp"
#include "dte/transport/loopback.hpp"

namespace {

struct Counts {
  std::uint64_t a, b, c;
};
struct Row {
  std::uint64_t bytes, check;
};

template <class F>
void on_ranks(dte::LoopbackWorld& world, F&& f) {
  std::vector<std::jthread> threads;
  for (int r = 0; r < world.size(); ++r)
    threads.emplace_back([&, r] { f(world.endpoint(r), r); });
}

}  // namespace

TEST_CASE("sum_fields: each part summed in its own place, digests mod 2^32") {
  dte::LoopbackWorld world(2, 1);
  std::vector<Counts> counts(3);
  std::vector<std::vector<Row>> rows(3);
  std::vector<std::vector<std::uint32_t>> digests(3);
  std::vector<std::vector<std::uint64_t>> slots(3);
  on_ranks(world, [&](dte::LoopbackTwoRound& t, int r) {
    const auto k = static_cast<std::size_t>(r);
    Counts mine{1, std::uint64_t(10) * (k + 1), std::uint64_t(1) << (40 + k)};
    std::vector<Row> table(3, Row{0, 0});
    table[k] = {100 + k, 7 * k};  // each rank fills its own row
    std::vector<std::uint32_t> digest{0xFFFFFFF0u + static_cast<std::uint32_t>(r), 5u};
    std::vector<std::uint64_t> slot(3, 0);
    slot[k] = 1;
    dte::sum_fields(t, "the test", mine, table, digest, slot);
    counts[k] = mine;
    rows[k] = table;
    digests[k] = digest;
    slots[k] = slot;
  });
  for (std::size_t k = 0; k < 3; ++k) {
    INFO("rank " << k);
    CHECK(counts[k].a == 3);
    CHECK(counts[k].b == 60);
    CHECK(counts[k].c ==
          (std::uint64_t(1) << 40) + (std::uint64_t(1) << 41) + (std::uint64_t(1) << 42));
    for (std::size_t j = 0; j < 3; ++j) {
      CHECK(rows[k][j].bytes == 100 + j);
      CHECK(rows[k][j].check == 7 * j);
    }
    // 3 * 0xFFFFFFF0 + 0 + 1 + 2 = 0x2FFFFFFD3 -> mod 2^32
    CHECK(digests[k][0] == 0xFFFFFFD3u);
    CHECK(digests[k][1] == 15u);
    CHECK(slots[k] == std::vector<std::uint64_t>{1, 1, 1});
  }
}

TEST_CASE("agree: silent when nobody failed; else the same verdict on every rank") {
  SUBCASE("nobody failed") {
    dte::LoopbackWorld world(2, 1);
    std::vector<int> returned(3, 0);
    on_ranks(world, [&](dte::LoopbackTwoRound& t, int r) {
      dte::agree(t, 2, r < 2 ? r : -1, "", "the test", [](std::int64_t) {
        throw std::runtime_error("no rank failed, fail() must not be called");
      });
      returned[static_cast<std::size_t>(r)] = 1;
    });
    CHECK(returned == std::vector<int>{1, 1, 1});
  }
  SUBCASE("slot 1 failed: every rank, the receiver too, is told slot 1") {
    dte::LoopbackWorld world(2, 1);
    std::vector<std::string> told(3);
    on_ranks(world, [&](dte::LoopbackTwoRound& t, int r) {
      const std::string mine = r == 1 ? "negative second moment" : "";
      try {
        dte::agree(t, 2, r < 2 ? r : -1, mine, "the test", [&](std::int64_t who) {
          throw std::runtime_error("slot " + std::to_string(who) + (mine.empty() ? "" : ": ") +
                                   mine);
        });
      } catch (const std::runtime_error& e) {
        told[static_cast<std::size_t>(r)] = e.what();
      }
    });
    CHECK(told[0] == "slot 1");
    CHECK(told[1] == "slot 1: negative second moment");
    CHECK(told[2] == "slot 1");
  }
  SUBCASE("a fail() that returns is a bug, not a silent pass") {
    dte::LoopbackWorld world(1, 0);
    CHECK_THROWS_AS(dte::agree(world.endpoint(0), 1, 0, "broken", "the test", [](std::int64_t) {}),
                    dte::error);
  }
}
