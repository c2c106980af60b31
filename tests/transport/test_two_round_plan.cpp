// SPDX-License-Identifier: Apache-2.0
// The schedule of a two-round exchange (transport/two_round_plan.hpp), which NcclTwoRound issues
// call for call: chunks cover a message exactly, in order, none above the limit; the staging
// layout places the messages end to end; corrupt counts that overflow are refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "dte/error.hpp"
#include "dte/transport/two_round_plan.hpp"

using dte::two_round::chunks;

TEST_CASE("chunks cover a message exactly, in order, none above the limit") {
  CHECK(chunks(0, 1024).empty());
  for (const std::uint64_t bytes : {1ull, 1023ull, 1024ull, 1025ull, 4096ull, 1000003ull}) {
    for (const std::uint64_t limit : {1ull, 7ull, 1024ull, 1ull << 20}) {
      const auto c = chunks(bytes, limit);
      CHECK(c.size() == (bytes + limit - 1) / limit);
      std::uint64_t at = 0;
      for (const auto& k : c) {
        CHECK(k.offset == at);
        CHECK(k.bytes >= 1);
        CHECK(k.bytes <= limit);
        at += k.bytes;
      }
      CHECK(at == bytes);
    }
  }
}

TEST_CASE("a message above 2^31 bytes goes as chunks of at most 2^31 bytes") {
  const std::uint64_t five_gib = 5ull << 30;
  const auto c = chunks(five_gib, dte::two_round::max_chunk_bytes);
  REQUIRE(c.size() == 3);
  CHECK(c[0].bytes == 1ull << 31);
  CHECK(c[1].offset == 1ull << 31);
  CHECK(c[2].offset == 1ull << 32);
  CHECK(c[2].bytes == 1ull << 30);
}

TEST_CASE("a chunk size of 0 or above 2^31 is refused") {
  CHECK_THROWS_AS((void)chunks(10, 0), dte::invalid_argument);
  CHECK_THROWS_AS((void)chunks(10, (1ull << 31) + 1), dte::invalid_argument);
}

TEST_CASE("staging layout: messages end to end in peer order; an overflowing total is refused") {
  const std::vector<std::uint64_t> counts = {5, 0, 7, 0, 1};
  const auto s = dte::two_round::staging_layout(counts);
  CHECK(s.offsets == std::vector<std::uint64_t>{0, 5, 5, 12, 12});
  CHECK(s.total == 13);
  CHECK(dte::two_round::staging_layout({}).total == 0);
  const std::vector<std::uint64_t> corrupt = {UINT64_MAX, 2};
  CHECK_THROWS_AS((void)dte::two_round::staging_layout(corrupt), dte::bounds_error);
}

TEST_CASE("peer ranges name whom a phase waits on") {
  CHECK(dte::two_round::peer_range(4, 0) == "no rank");
  CHECK(dte::two_round::peer_range(4, 1) == "rank 4");
  CHECK(dte::two_round::peer_range(0, 6) == "ranks 0..5");
}
