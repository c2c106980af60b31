// SPDX-License-Identifier: Apache-2.0
// receive/staged.hpp: writes decoded in place (room, then push_decoded: the chunk decoder into
// HF tensors) are the same staged writes as the same writes copied in (push_writes): the same
// pieces, indices, digest keys and values, whatever the runs, tensors and encodings.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/error.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"

using namespace dte;

namespace {

// Every write of w in order, with what the commit reads of it: (tensor, canonical, index, key,
// value, diff); the key as the commit computes it for dense pieces.
using Write =
    std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, std::uint16_t, bool>;
std::vector<Write> writes(const receive::StagedWrites& w) {
  std::vector<Write> out;
  for (const receive::Piece& p : w.pieces) {
    for (std::size_t k = 0; k < p.count(); ++k) {
      const std::uint32_t i = p.dense ? p.first + static_cast<std::uint32_t>(k) : w.index[p.at + k];
      const std::uint32_t key =
          p.dense ? detail::digest_key(p.global + static_cast<std::int64_t>(k)) : w.key[p.at + k];
      out.emplace_back(p.tensor, p.canonical, i, key, p.value(w.bits.data(), k), p.diff);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("writes decoded in place are staged as the same writes copied in") {
  std::mt19937_64 rng(11);
  int dense = 0, continued = 0;
  for (int trial = 0; trial < 400; ++trial) {
    receive::StagedWrites copied, decoded;
    const int entries = 1 + static_cast<int>(rng() % 6);
    std::uint32_t tensor = static_cast<std::uint32_t>(rng() % 3);
    std::uint32_t next = 0;  // the next index of `tensor` an entry may start at
    for (int e = 0; e < entries; ++e) {
      if (rng() % 3 == 0) {  // another tensor (or the same again: the open piece continues)
        tensor = static_cast<std::uint32_t>(rng() % 3);
        next = 0;
      }
      const bool diff = rng() % 4 == 0;
      copied.diff = decoded.diff = diff;
      // Indices with runs of consecutive ones (some at least min_dense_run long) and gaps.
      std::vector<std::uint32_t> index;
      std::vector<std::uint16_t> bits;
      const std::size_t n = rng() % 40;
      std::uint32_t i = next + static_cast<std::uint32_t>(rng() % 4);
      while (index.size() < n) {
        const std::size_t run = rng() % 2 == 0 ? 1 : 1 + rng() % 12;
        for (std::size_t r = 0; r < run && index.size() < n; ++r) {
          index.push_back(i++);
          bits.push_back(static_cast<std::uint16_t>(rng()));
        }
        i += 1 + static_cast<std::uint32_t>(rng() % 5);
      }
      if (!index.empty()) next = index.back() + 1;
      const std::int64_t base = 1000 * static_cast<std::int64_t>(tensor);
      receive::push_writes(copied, tensor, tensor, index.data(), 0, 0, base, bits.data(), n);
      const receive::StagedWrites::Room room = decoded.room(n);
      std::copy(index.begin(), index.end(), room.index);
      std::copy(bits.begin(), bits.end(), room.bits);
      const std::size_t pieces = decoded.pieces.size();
      decoded.push_decoded(tensor, tensor, n, base);
      continued += n > 0 && decoded.pieces.size() == pieces;
    }
    REQUIRE(decoded.pieces.size() == copied.pieces.size());
    for (std::size_t q = 0; q < copied.pieces.size(); ++q) {
      CHECK(decoded.pieces[q].dense == copied.pieces[q].dense);
      dense += copied.pieces[q].dense;
    }
    CHECK(decoded.size() == copied.size());
    CHECK(writes(decoded) == writes(copied));
  }
  CHECK(dense > 200);     // runs became dense pieces
  CHECK(continued > 50);  // and sparse entries continued the open piece
}

TEST_CASE("the core refuses an element written both by a value and a diff piece") {
  // A delta's diff chunks sit beside a value chunk holding what a diff code cannot: each kind's
  // indices increase per tensor (the decoder), and no element may be in both (receive/core.hpp).
  const receive::Core core(
      "test", 0, {100, 100}, {100, 100}, 2, [](std::int64_t t) { return "t" + std::to_string(t); },
      [](std::int64_t t) { return "t" + std::to_string(t); });
  auto staged = [](std::uint32_t value_index, bool dense_diff) {
    receive::StagedWrites w;
    w.kind = MessageKind::delta;
    w.version = 2;
    w.base = 1;
    w.push(1, 1, value_index, 0x3F80, 0);
    w.push(0, 0, 40, 0x3F80, 0);  // another tensor's value write, at an index the diffs write
    w.diff = true;
    const std::vector<std::uint32_t> at =
        dense_diff ? std::vector<std::uint32_t>{20, 21, 22, 23, 24, 25, 26, 27, 28, 29}
                   : std::vector<std::uint32_t>{3, 10, 40, 77};
    const receive::StagedWrites::Room r = w.room(at.size());
    for (std::size_t k = 0; k < at.size(); ++k) {
      r.index[k] = at[k];
      r.bits[k] = 6;  // one ulp up
    }
    w.push_decoded(1, 1, at.size(), 0);
    REQUIRE(w.pieces.back().dense == dense_diff);
    return w;
  };
  CHECK_NOTHROW(core.check(staged(11, false)));  // between two diff writes
  CHECK_NOTHROW(core.check(staged(99, false)));  // past them
  CHECK_NOTHROW(core.check(staged(0, false)));   // before them
  CHECK_THROWS_AS(core.check(staged(40, false)), protocol_error);
  CHECK_THROWS_AS(core.check(staged(3, false)), protocol_error);
  CHECK_THROWS_AS(core.check(staged(77, false)), protocol_error);
  CHECK_THROWS_AS(core.check(staged(25, true)), protocol_error);  // inside a dense diff piece
  CHECK_THROWS_AS(core.check(staged(29, true)), protocol_error);
  CHECK_NOTHROW(core.check(staged(30, true)));
  CHECK_NOTHROW(core.check(staged(19, true)));
}
