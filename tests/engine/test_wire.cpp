// SPDX-License-Identifier: Apache-2.0
// Wire format v2 (dte/engine/wire.hpp):
//   * Differential: the chunked MessageWriter produces exactly the bytes of a naive reference
//     encoder written from docs/wire.md (bit by bit, every width tried), for random messages of
//     many groups (densities 0.01% to 100%, indices up to 2^32 - 1, dense runs mixed in) and
//     for the edge cases (empty, one entry, w = 0, exceptions, 128/129/255/256 entries, groups
//     split by a repeated or decreasing index); MessageView decodes them back to the input.
//   * The writer's chunks: size() is the bytes of spans(); group headers and blocks that
//     straddle a 64 KiB chunk boundary are patched and read correctly.
//   * Size: bytes per entry for uniformly random indices, printed per density, bounded at 1%.
//   * Hostile input: every truncation of small valid messages is refused; every single bit flip
//     is refused or decodes to a self-consistent message, and only flips in values, version,
//     base, tensor ids and the kind pass (the blocks' checks catch every index flip); the test
//     runs clean under ASan/UBSan. Each kind of malformed field is refused with a message that
//     says what is wrong.
//   * The worked example of docs/wire.md, byte for byte.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "dte/engine/wire.hpp"

using namespace dte;

namespace {

using Bytes = std::vector<std::byte>;
constexpr std::uint32_t u32_max = 0xFFFFFFFFu;

// Little-endian byte builder for reference and hand-made messages.
struct Raw {
  Bytes b;
  Raw& u8(unsigned v) {
    b.push_back(static_cast<std::byte>(v & 0xFF));
    return *this;
  }
  Raw& u16(unsigned v) { return u8(v).u8(v >> 8); }
  Raw& u32(std::uint32_t v) { return u16(v & 0xFFFF).u16(v >> 16); }
  Raw& u64(std::uint64_t v) { return u32(static_cast<std::uint32_t>(v)).u32(v >> 32); }
};

void put32(Bytes& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}
std::uint32_t get32(const Bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= std::to_integer<std::uint32_t>(b[at + i]) << (8 * i);
  return v;
}

// ---- the reference encoder: docs/wire.md, as plainly as possible
// ---------------------------------

struct Reference {
  Bytes bytes;
  std::vector<std::size_t> group_at, block_at;  // offsets of every group and block header
  std::vector<unsigned> widths;                 // every block's width
};

// A sparse group as the writer's rule forms it.
struct RefGroup {
  std::uint32_t tensor;
  std::vector<std::uint32_t> index;
  std::vector<std::uint16_t> bits;
};

std::vector<RefGroup> reference_groups(const std::vector<DeltaEntry>& entries) {
  std::vector<RefGroup> groups;
  for (const DeltaEntry& e : entries) {
    if (groups.empty() || groups.back().tensor != e.tensor || e.index <= groups.back().index.back())
      groups.push_back({e.tensor, {}, {}});
    groups.back().index.push_back(e.index);
    groups.back().bits.push_back(e.bits);
  }
  return groups;
}

Reference reference_encode(const wire::Message& m) {
  const std::vector<RefGroup> groups = reference_groups(m.entries);
  std::size_t n_groups = groups.size();
  for (const DenseRun& r : m.runs)
    n_groups += !r.bits.empty();
  Reference out;
  Raw w;
  w.u32(0x32657464).u8(static_cast<unsigned>(m.kind)).u8(0).u8(0).u8(0);
  w.u64(m.version).u64(m.base).u32(static_cast<std::uint32_t>(n_groups)).u32(0);
  for (const RefGroup& g : groups) {
    out.group_at.push_back(w.b.size());
    const auto count = static_cast<std::uint32_t>(g.index.size());
    w.u32(g.tensor).u8(1).u8(0).u8(0).u8(0).u32(g.index.front()).u32(g.index.back()).u32(count);
    for (std::size_t s = 0; s < g.index.size(); s += 128) {
      const std::size_t n = std::min<std::size_t>(128, g.index.size() - s);
      std::vector<std::uint64_t> gaps;
      for (std::size_t k = s + 1; k < s + n; ++k)
        gaps.push_back(g.index[k] - g.index[k - 1] - 1);
      // Width: 0 when every gap is 0; else the fewest bytes, then the fewest exceptions, then
      // the narrowest.
      unsigned best_w = 0;
      std::size_t best_bytes = 0, best_exc = 0;
      if (std::any_of(gaps.begin(), gaps.end(), [](std::uint64_t x) { return x != 0; })) {
        best_bytes = ~std::size_t{0};
        for (unsigned wd = 1; wd <= 31; ++wd) {
          const std::uint64_t esc = (std::uint64_t{1} << wd) - 1;
          const auto exc = static_cast<std::size_t>(
              std::count_if(gaps.begin(), gaps.end(), [&](std::uint64_t x) { return x >= esc; }));
          const std::size_t bytes = (gaps.size() * wd + 7) / 8 + 4 * exc;
          if (bytes < best_bytes || (bytes == best_bytes && exc < best_exc)) {
            best_w = wd, best_bytes = bytes, best_exc = exc;
          }
        }
      }
      out.block_at.push_back(w.b.size());
      out.widths.push_back(best_w);
      w.u32(g.index[s]).u8(best_w).u8(static_cast<unsigned>(best_exc));
      w.u16(g.index[s + n - 1] % 65521);  // the check
      std::vector<bool> bitstream;
      std::vector<std::uint64_t> exceptions;
      const std::uint64_t esc = (std::uint64_t{1} << best_w) - 1;
      if (best_w > 0) {
        for (std::uint64_t x : gaps) {
          const std::uint64_t code = x >= esc ? esc : x;
          if (x >= esc) exceptions.push_back(x);
          for (unsigned bit = 0; bit < best_w; ++bit)
            bitstream.push_back((code >> bit) & 1);
        }
      }
      for (std::size_t byte = 0; byte < (bitstream.size() + 7) / 8; ++byte) {
        unsigned v = 0;
        for (unsigned bit = 0; bit < 8 && 8 * byte + bit < bitstream.size(); ++bit)
          v |= unsigned{bitstream[8 * byte + bit]} << bit;
        w.u8(v);
      }
      for (std::uint64_t x : exceptions)
        w.u32(static_cast<std::uint32_t>(x));
      for (std::size_t k = s; k < s + n; ++k)
        w.u16(g.bits[k]);
    }
  }
  for (const DenseRun& r : m.runs) {
    if (r.bits.empty()) continue;
    out.group_at.push_back(w.b.size());
    const auto count = static_cast<std::uint32_t>(r.bits.size());
    w.u32(r.tensor).u8(2).u8(0).u8(0).u8(0).u32(r.index).u32(r.index + count - 1).u32(count);
    for (std::uint16_t v : r.bits)
      w.u16(v);
  }
  out.bytes = std::move(w.b);
  return out;
}

// ---- decoding and checking
// -----------------------------------------------------------------------

wire::Message decode(const wire::MessageView& v) {
  wire::Message m;
  m.kind = v.kind();
  m.version = v.version();
  m.base = v.base();
  v.for_each_entry([&](const DeltaEntry& e) { m.entries.push_back(e); });
  v.for_each_run(
      [&](std::uint32_t tensor, std::uint32_t first, std::uint32_t length, const std::byte* bits) {
        DenseRun r{tensor, first, std::vector<std::uint16_t>(length)};
        std::memcpy(r.bits.data(), bits, 2 * std::size_t{length});
        m.runs.push_back(std::move(r));
      });
  return m;
}

bool same_entries(const std::vector<DeltaEntry>& a, const std::vector<DeltaEntry>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const auto& x, const auto& y) {
    return x.tensor == y.tensor && x.index == y.index && x.bits == y.bits;
  });
}

// Everything a decoded view reports agrees with itself: groups, entries and runs, counts, and
// every sparse group's indices strictly increasing from its first to exactly its last.
void check_consistent(const wire::MessageView& v) {
  std::vector<wire::Group> groups;
  v.for_each_group([&](const wire::Group& g) { groups.push_back(g); });
  REQUIRE(groups.size() == v.group_count());
  std::uint64_t sparse = 0, runs = 0, elements = 0;
  for (const wire::Group& g : groups) {
    CHECK(g.count > 0);
    CHECK(g.first <= g.last);
    if (g.dense) {
      CHECK(std::uint64_t{g.first} + g.count - 1 == g.last);
      ++runs, elements += g.count;
    } else {
      sparse += g.count;
    }
  }
  CHECK(sparse == v.entry_count());
  CHECK(runs == v.run_count());
  CHECK(elements == v.run_elements());
  std::vector<DeltaEntry> entries;
  v.for_each_entry([&](const DeltaEntry& e) { entries.push_back(e); });
  REQUIRE(entries.size() == sparse);
  std::size_t at = 0;
  for (const wire::Group& g : groups) {
    if (g.dense) continue;
    CHECK(entries[at].index == g.first);
    for (std::uint32_t k = 0; k < g.count; ++k) {
      CHECK(entries[at + k].tensor == g.tensor);
      if (k > 0) CHECK(entries[at + k].index > entries[at + k - 1].index);
    }
    CHECK(entries[at + g.count - 1].index == g.last);
    at += g.count;
  }
  std::size_t r = 0;
  v.for_each_run(
      [&](std::uint32_t tensor, std::uint32_t first, std::uint32_t length, const std::byte*) {
        while (r < groups.size() && !groups[r].dense)
          ++r;
        REQUIRE(r < groups.size());
        CHECK(tensor == groups[r].tensor);
        CHECK(first == groups[r].first);
        CHECK(length == groups[r].count);
        ++r;
      });
}

// The writer's bytes equal the reference's, and decode back to the input (empty runs dropped).
Reference round_trip(const wire::Message& m) {
  const Reference ref = reference_encode(m);
  const Bytes bytes = wire::encode(m);
  REQUIRE(bytes.size() == ref.bytes.size());
  CHECK(bytes == ref.bytes);
  const wire::MessageView v(bytes, "test");
  CHECK(v.kind() == m.kind);
  CHECK(v.version() == m.version);
  CHECK(v.base() == m.base);
  CHECK(v.entry_count() == m.entries.size());
  CHECK(v.group_count() == ref.group_at.size());
  const wire::Message back = decode(v);
  CHECK(same_entries(back.entries, m.entries));
  std::vector<const DenseRun*> runs;
  for (const DenseRun& r : m.runs)
    if (!r.bits.empty()) runs.push_back(&r);
  REQUIRE(back.runs.size() == runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i) {
    CHECK(back.runs[i].tensor == runs[i]->tensor);
    CHECK(back.runs[i].index == runs[i]->index);
    CHECK(back.runs[i].bits == runs[i]->bits);
  }
  check_consistent(v);
  return ref;
}

// Sorted distinct indices from `start` with geometric gaps at density p, at most `n` of them.
std::vector<std::uint32_t> random_indices(std::mt19937_64& rng, std::uint64_t start, double p,
                                          std::size_t n) {
  std::vector<std::uint32_t> out;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uint64_t at = start;
  while (out.size() < n && at <= u32_max) {
    out.push_back(static_cast<std::uint32_t>(at));
    const double gap = p >= 1.0 ? 0.0 : std::floor(std::log1p(-u(rng)) / std::log1p(-p));
    at += 1 + static_cast<std::uint64_t>(std::min(gap, 1e10));
  }
  return out;
}

wire::Message random_message(std::mt19937_64& rng, std::size_t max_segments,
                             std::size_t max_entries) {
  wire::Message m;
  m.version = rng();
  m.base = rng() % 4 == 0 ? no_version : rng();
  m.kind = static_cast<MessageKind>(1 + rng() % 4);
  const std::size_t segments = rng() % (max_segments + 1);
  for (std::size_t s = 0; s < segments; ++s) {
    const auto tensor = static_cast<std::uint32_t>(rng() % 3 == 0 ? rng() : rng() % 4);
    const double p = std::pow(10.0, -4.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    const std::uint64_t start = rng() % 3 == 0 ? rng() % (std::uint64_t{1} << 32) : rng() % 1000;
    const std::size_t n = 1 + rng() % max_entries;
    for (std::uint32_t i : random_indices(rng, start, p, n))
      m.entries.push_back({tensor, i, static_cast<std::uint16_t>(rng())});
    if (rng() % 4 == 0) {  // an index that repeats or goes back: the group is split
      const std::uint32_t last = m.entries.back().index;
      m.entries.push_back({tensor, static_cast<std::uint32_t>(rng() % (std::uint64_t{last} + 1)),
                           static_cast<std::uint16_t>(rng())});
    }
  }
  if (rng() % 4 == 0) m.entries.push_back({7, u32_max, 1});  // the last index there is
  const std::size_t runs = rng() % 4;
  for (std::size_t r = 0; r < runs; ++r) {
    const std::size_t len = rng() % 5 == 0 ? 0 : 1 + rng() % 300;
    const auto first =
        static_cast<std::uint32_t>(rng() % 2 ? rng() % 10000 : u32_max - (rng() % 1000 + len));
    DenseRun run{static_cast<std::uint32_t>(rng() % 8), first, std::vector<std::uint16_t>(len)};
    for (auto& v : run.bits)
      v = static_cast<std::uint16_t>(rng());
    m.runs.push_back(std::move(run));
  }
  return m;
}

wire::Message with_entries(std::uint32_t tensor, const std::vector<std::uint32_t>& indices) {
  wire::Message m;
  m.version = 5;
  m.base = 4;
  for (std::size_t k = 0; k < indices.size(); ++k)
    m.entries.push_back({tensor, indices[k], static_cast<std::uint16_t>(0x3f80 + k)});
  return m;
}

// The refusal of `bytes`, which must be refused.
std::string refusal(const Bytes& bytes) {
  try {
    const wire::MessageView v(bytes, "rank 3");
  } catch (const format_error& e) {
    return e.what();
  }
  FAIL("accepted a malformed message");
  return {};
}

// The worked example of docs/wire.md: three entries of tensor 3 (one gap of 0, one of 3, one
// exception) and a dense run of two values in tensor 5.
wire::Message doc_example() {
  wire::Message m;
  m.kind = MessageKind::delta;
  m.version = 7;
  m.base = 6;
  m.entries = {{3, 10, 0x3f80}, {3, 11, 0x4000}, {3, 15, 0xbf80}, {3, 70000, 0x0001}};
  m.runs = {{5, 100, {0x1234, 0xabcd}}};
  return m;
}

std::string hex(const Bytes& b) {
  std::string s;
  char buf[4];
  for (std::byte x : b) {
    std::snprintf(buf, sizeof buf, "%02x", std::to_integer<unsigned>(x));
    s += buf;
  }
  return s;
}

}  // namespace

TEST_CASE("wire: the worked example of docs/wire.md, byte for byte") {
  const Bytes b = wire::encode(doc_example());
  // clang-format off
  CHECK(hex(b) ==
        "64746532" "01" "000000" "0700000000000000" "0600000000000000" "02000000" "00000000"
        "03000000" "01" "000000" "0a000000" "70110100" "04000000"       // sparse group, tensor 3
        "0a000000" "03" "01" "7f11" "d801" "60110100"                  // block: base, w, e, check
        "803f" "0040" "80bf" "0100"                                      //   values
        "05000000" "02" "000000" "64000000" "65000000" "02000000"       // dense group, tensor 5
        "3412" "cdab");                                                   //   values
  // clang-format on
  round_trip(doc_example());
  CHECK(wire::first_value_offset(b) == 66);
}

TEST_CASE("wire: edge cases round trip byte for byte") {
  SUBCASE("empty message") {
    wire::Message m;
    const Bytes b = wire::encode(m);
    CHECK(b.size() == wire::header_bytes);
    round_trip(m);
    CHECK(wire::first_value_offset(b) == wire::npos);
    m.runs.push_back({1, 5, {}});  // an empty run adds nothing
    CHECK(wire::encode(m).size() == wire::header_bytes);
  }
  SUBCASE("a single entry") {
    for (std::uint32_t i : {0u, 1u, 123456u, u32_max}) {
      const Reference r = round_trip(with_entries(9, {i}));
      CHECK(r.bytes.size() == 32 + 20 + 8 + 2);
      CHECK(r.widths == std::vector<unsigned>{0});
    }
  }
  SUBCASE("consecutive indices: width 0, 8 + 2 bytes per entry") {
    std::vector<std::uint32_t> idx(1000);
    for (std::uint32_t k = 0; k < 1000; ++k)
      idx[k] = 5000 + k;
    const Reference r = round_trip(with_entries(2, idx));
    CHECK(r.widths == std::vector<unsigned>(8, 0));
    CHECK(r.bytes.size() == 32 + 20 + 8 * 8 + 2 * 1000);
    for (std::uint32_t k = 0; k < 200; ++k)
      idx[k] = u32_max - 199 + k;  // ends at 2^32 - 1
    idx.resize(200);
    round_trip(with_entries(2, idx));
  }
  SUBCASE("huge gaps: exceptions") {
    const Reference r = round_trip(with_entries(1, {0, u32_max}));  // gap 2^32 - 2
    CHECK(r.widths == std::vector<unsigned>{1});
    CHECK(r.bytes.size() == 32 + 20 + 8 + 1 + 4 + 4);
    std::mt19937_64 rng(3);
    std::vector<std::uint32_t> idx;
    for (int k = 0; k < 600; ++k)
      idx.push_back(static_cast<std::uint32_t>(rng()));
    std::sort(idx.begin(), idx.end());
    idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
    round_trip(with_entries(1, idx));
    // Mostly small gaps with a few huge ones: a narrow width plus exceptions.
    idx.clear();
    for (std::uint32_t k = 0; k < 128; ++k)
      idx.push_back(k * 3 + (k >= 64 ? 3000000000u : 0));
    const Reference e = round_trip(with_entries(1, idx));
    CHECK(e.widths == std::vector<unsigned>{2});
    const Bytes b = wire::encode(with_entries(1, idx));
    CHECK(std::to_integer<unsigned>(b[e.block_at[0] + 5]) == 1);  // one exception
  }
  SUBCASE("block boundaries: 127, 128, 129, 255, 256, 257 entries") {
    std::mt19937_64 rng(5);
    for (std::size_t n : {127, 128, 129, 255, 256, 257}) {
      CAPTURE(n);
      const Reference r = round_trip(with_entries(4, random_indices(rng, 17, 0.05, n)));
      CHECK(r.block_at.size() == (n + 127) / 128);
    }
  }
  SUBCASE("every width from 0 to 31 occurs") {
    std::vector<bool> seen(32);
    for (unsigned w = 0; w <= 31; ++w) {
      std::vector<std::uint32_t> idx{0};
      const std::uint64_t gap = w == 0 ? 0 : (std::uint64_t{1} << w) - 2;  // the widest code
      for (int k = 0; k < 2; ++k)
        idx.push_back(static_cast<std::uint32_t>(idx.back() + gap + 1));
      const Reference r = round_trip(with_entries(0, idx));
      for (unsigned x : r.widths)
        seen[x] = true;
    }
    seen[round_trip(with_entries(0, {0, u32_max})).widths.at(0)] = true;  // w = 1
    CHECK(std::count(seen.begin(), seen.end(), true) == 32);
  }
}

TEST_CASE("wire: the writer's group rule") {
  auto groups = [](const wire::Message& m) {
    const Bytes b = wire::encode(m);
    const wire::MessageView v(b, "test");
    std::vector<wire::Group> out;
    v.for_each_group([&](const wire::Group& g) { out.push_back(g); });
    return out;
  };
  wire::Message m;
  m.entries = {{5, 10, 1}, {5, 20, 2}, {5, 15, 3}, {5, 15, 4}, {5, 16, 5}, {6, 17, 6}, {5, 18, 7}};
  const auto g = groups(m);
  REQUIRE(g.size() == 5);  // a decrease, a repeat, a new tensor, and back
  CHECK((g[0].tensor == 5 && g[0].first == 10 && g[0].last == 20 && g[0].count == 2));
  CHECK((g[1].first == 15 && g[1].last == 15 && g[1].count == 1));
  CHECK((g[2].first == 15 && g[2].last == 16 && g[2].count == 2));
  CHECK((g[3].tensor == 6 && g[3].count == 1));
  CHECK((g[4].tensor == 5 && g[4].first == 18));
  for (const auto& x : g)
    CHECK(!x.dense);

  // A dense run closes the open sparse group; the next entry opens a new one even when it
  // continues the same tensor's indices.
  wire::MessageWriter w;
  w.begin();
  w.add_entry(1, 1, 0);
  w.add_entry(1, 2, 0);
  const std::uint16_t vals[] = {1, 2, 3};
  w.add_dense_group(1, 100, vals);
  w.add_entry(1, 3, 0);
  w.add_dense_group(2, 0,
                    std::span<const std::uint16_t>{});  // empty: nothing, but closes the group
  w.add_entry(1, 4, 0);
  w.finish(MessageKind::full, 1, no_version);
  CHECK(w.entries() == 4);
  CHECK(w.run_elements() == 3);
  Bytes b;
  for (auto s : w.spans())
    b.insert(b.end(), s.begin(), s.end());
  const wire::MessageView v(b, "test");
  CHECK(v.group_count() == 4);
  CHECK(v.run_count() == 1);
  CHECK(v.run_elements() == 3);
  CHECK(v.entry_count() == 4);
  CHECK(v.kind() == MessageKind::full);
  CHECK(v.base() == no_version);

  // An attachment (an FP8 part) follows the last group; the header's offset 28 gives its length.
  {
    wire::MessageWriter a;
    a.begin();
    a.add_entry(3, 7, 0x1234);
    a.attach({std::byte{1}, std::byte{2}, std::byte{3}});
    a.finish(MessageKind::delta, 5, 4);
    Bytes m;
    for (auto s : a.spans())
      m.insert(m.end(), s.begin(), s.end());
    const wire::MessageView va(m, "test");
    CHECK(va.entry_count() == 1);
    REQUIRE(va.attachment().size() == 3);
    CHECK(va.attachment()[2] == std::byte{3});
    CHECK(v.attachment().empty());
  }

  // Misuse is refused.
  wire::MessageWriter bad;
  CHECK_THROWS_AS(bad.add(0, 0, 0), invalid_argument);
  CHECK_THROWS_AS(bad.add_entry(0, 0, 0), invalid_argument);
  CHECK_THROWS_AS(bad.finish(MessageKind::delta, 1, 0), invalid_argument);
  bad.begin();
  const std::vector<std::uint16_t> two(2);
  CHECK_THROWS_AS(bad.add_dense_group(0, u32_max, two), invalid_argument);  // passes 2^32 - 1
  bad.add_dense_group(0, u32_max - 1, two);                                 // ends at 2^32 - 1
  CHECK_THROWS_AS(bad.finish(static_cast<MessageKind>(9), 1, 0), invalid_argument);
}

TEST_CASE("wire: random messages round trip byte for byte") {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    round_trip(random_message(rng, 12, trial % 10 == 0 ? 3000 : 300));
  }
}

TEST_CASE("wire: chunks, and headers and blocks across chunk boundaries") {
  constexpr std::size_t chunk = wire::MessageWriter::chunk_bytes;
  auto straddles = [&](std::size_t at, std::size_t n) {
    return at / chunk != (at + n - 1) / chunk;
  };
  auto gather = [](const wire::MessageWriter& w) {
    Bytes b;
    std::size_t total = 0;
    const auto spans = w.spans();
    for (std::size_t s = 0; s < spans.size(); ++s) {
      if (s + 1 < spans.size()) CHECK(spans[s].size() == wire::MessageWriter::chunk_bytes);
      total += spans[s].size();
      b.insert(b.end(), spans[s].begin(), spans[s].end());
    }
    CHECK(total == w.size());
    CHECK(w.capacity() == spans.size() * wire::MessageWriter::chunk_bytes);
    return b;
  };

  SUBCASE("a sparse group header straddling a boundary, patched across it") {
    // 32 + 20 + 2 * 32737 = 65526: the sparse group's header covers bytes 65526..65545.
    std::mt19937_64 rng(1);
    const std::vector<std::uint16_t> run(32737, 0x1111);
    const wire::Message sparse = with_entries(3, random_indices(rng, 0, 0.3, 20000));
    wire::MessageWriter w;
    w.begin();
    w.add_dense_group(0, 0, run);
    for (const DeltaEntry& e : sparse.entries)
      w.add_entry(e.tensor, e.index, e.bits);
    w.finish(MessageKind::delta, 2, 1);
    const Bytes b = gather(w);
    CHECK(w.size() > chunk);
    CHECK(straddles(65526, wire::group_header_bytes));
    CHECK(get32(b, 65526) == 3);                                 // the sparse group's tensor
    CHECK(get32(b, 65526 + 12) == sparse.entries.back().index);  // last, patched
    CHECK(get32(b, 65526 + 16) == 20000);  // count, patched across the boundary
    const wire::MessageView v(b, "test");
    CHECK(v.entry_count() == 20000);
    CHECK(v.run_elements() == run.size());
    CHECK(same_entries(decode(v).entries, sparse.entries));
    CHECK(decode(v).runs.at(0).bits == run);
    check_consistent(v);
  }

  SUBCASE("random messages of several chunks") {
    std::mt19937_64 rng(77);
    std::size_t header_straddles = 0, block_straddles = 0;
    for (int trial = 0; trial < 12; ++trial) {
      CAPTURE(trial);
      const wire::Message m = random_message(rng, 400, 400);
      const Reference ref = round_trip(m);
      for (std::size_t at : ref.group_at)
        header_straddles += straddles(at, 20);
      for (std::size_t k = 0; k < ref.block_at.size(); ++k) {
        const std::size_t end =
            k + 1 < ref.block_at.size() ? ref.block_at[k + 1] : ref.bytes.size();
        block_straddles +=
            straddles(ref.block_at[k], std::min<std::size_t>(end - ref.block_at[k], 300));
      }
      wire::MessageWriter w;
      w.begin();
      for (const DeltaEntry& e : m.entries)
        w.add_entry(e.tensor, e.index, e.bits);
      for (const DenseRun& r : m.runs)
        w.add_dense_group(r.tensor, r.index, r.bits);
      w.finish(m.kind, m.version, m.base);
      CHECK(gather(w) == ref.bytes);
      w.clear();
      CHECK(w.size() == 0);
      CHECK(w.capacity() == 0);
      CHECK(w.spans().empty());
    }
    MESSAGE("chunk boundaries inside group headers: " << header_straddles
                                                      << ", inside blocks: " << block_straddles);
    CHECK(header_straddles > 0);
    CHECK(block_straddles > 0);
  }
}

TEST_CASE("wire: bytes per entry, uniformly random indices") {
  const std::uint32_t n = 1u << 20;  // a 1M-element tensor
  std::mt19937_64 rng(2024);
  for (const double p : {0.001, 0.01, 0.02, 0.1, 0.5}) {
    wire::Message m;
    std::bernoulli_distribution pick(p);
    for (std::uint32_t i = 0; i < n; ++i)
      if (pick(rng)) m.entries.push_back({0, i, static_cast<std::uint16_t>(rng())});
    const Bytes b = wire::encode(m);
    const wire::MessageView v(b, "test");
    REQUIRE(same_entries(decode(v).entries, m.entries));
    const double per_entry = double(b.size()) / double(m.entries.size());
    MESSAGE("density " << p * 100 << "%: " << m.entries.size() << " entries, " << b.size()
                       << " bytes, " << per_entry << " bytes per entry (v1: 10; dense: " << 2 / p
                       << " per changed element)");
    if (p == 0.01) CHECK(per_entry <= 3.3);
  }
}

TEST_CASE("wire: every truncation and every single bit flip is refused or self-consistent") {
  std::mt19937_64 rng(9);
  std::vector<Bytes> samples{wire::encode(doc_example())};
  {
    wire::Message m = with_entries(2, random_indices(rng, 100, 0.2, 300));  // 3 blocks
    m.entries.push_back({2, 7, 1});                                         // a second group
    m.runs.push_back({4, 9, {1, 2, 3}});
    samples.push_back(wire::encode(m));
    samples.push_back(wire::encode(with_entries(0, {0, 1, 2, 3, u32_max})));
  }
  for (const Bytes& good : samples) {
    CAPTURE(good.size());
    for (std::size_t len = 0; len < good.size(); ++len) {
      const Bytes cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len));
      CHECK_THROWS_AS(wire::MessageView(cut, "test"), format_error);
    }
    std::size_t refused = 0, accepted = 0;
    for (std::size_t bit = 0; bit < 8 * good.size(); ++bit) {
      Bytes b = good;
      b[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
      try {
        const wire::MessageView v(b, "test");
        ++accepted;
        check_consistent(v);
      } catch (const format_error& e) {
        ++refused;
        CHECK(std::string(e.what()).find("the version is refused") != std::string::npos);
      }
    }
    // Only the fields that carry no structure can change undetected: every value, the version,
    // the base, each group's tensor id, and the kind (delta 1 -> full 3).
    const wire::MessageView v(good, "test");
    CHECK(accepted ==
          8 * 2 * (v.entry_count() + v.run_elements()) + 128 + 32 * v.group_count() + 1);
    MESSAGE(good.size() << "-byte message: " << refused << " of " << 8 * good.size()
                        << " single bit flips refused, " << accepted
                        << " decode to a consistent message (values, version, tensor ids, ...)");
  }
}

TEST_CASE("wire: malformed messages are refused with what is wrong") {
  // The docs example: header 0..31; sparse group header 32..51 (tensor 3, first 10, last 70000,
  // count 4); its block at 52 (base 52..55, width 56, exceptions 57, reserved 58..59, packed
  // gaps 60..61, the exception 62..65, values 66..73); dense group header 74..93; values 94..97.
  const Bytes good = wire::encode(doc_example());
  REQUIRE(good.size() == 98);
  auto with = [&](std::size_t at, unsigned value) {
    Bytes b = good;
    b[at] = static_cast<std::byte>(value);
    return b;
  };
  auto says = [](const Bytes& b, const std::string& what) {
    const std::string e = refusal(b);
    INFO(e);
    CHECK(e.rfind("message from rank 3: ", 0) == 0);
    CHECK(e.find(what) != std::string::npos);
    CHECK(e.find("; the version is refused") != std::string::npos);
  };
  says(Bytes(good.begin(), good.begin() + 10), "only 10 bytes, shorter than the 32-byte header");
  says(with(0, 0x65), "bad magic 0x32657465 (not a dte v2 message)");
  says(with(4, 0), "unknown kind 0");
  says(with(4, 5), "unknown kind 5");
  says(with(6, 1), "nonzero reserved bytes in the message header");
  says(with(29, 1), "an attachment of 256 bytes in a message of 98");
  says(with(28, 4), "the groups run into the 4-byte attachment");
  says(with(24, 3), "group 2 (at byte 98): truncated group header (0 of 20 bytes; 3 groups");
  says(with(24, 1), "24 trailing bytes");
  {
    Bytes b = good;
    b.push_back(std::byte{0});
    says(b, "1 trailing bytes");
  }
  says(with(36, 3), "group 0 (at byte 32): unknown group type 3");
  says(with(39, 1), "group 0 (at byte 32): nonzero reserved bytes in the group header");
  {
    Bytes b = good;
    put32(b, 48, 0);
    says(b, "group 0 (at byte 32): empty group (count 0)");
  }
  says(with(59, 1),
       "group 0 (at byte 32), block 0 (at byte 52): check 383 does not match the decoded last "
       "index 70000 (the block's indices are corrupt)");
  says(with(56, 32), "block 0 (at byte 52): width 32 exceeds 31");
  says(with(56, 0), "block 0 (at byte 52): width 0 with 1 exceptions");
  {
    Bytes one = wire::encode(with_entries(1, {5}));
    REQUIRE(one.size() == 62);
    one[56] = std::byte{5};
    says(one, "block 0 (at byte 52): width 5 in a block of one entry (must be 0)");
  }
  says(with(57, 0), "block 0 (at byte 52): 0 exceptions announced, 1 escape codes found");
  says(with(57, 2), "block 0 (at byte 52): 2 exceptions announced, 1 escape codes found");
  says(with(57, 9), "block 0 (at byte 52): truncated block (54 bytes needed, 46 left)");
  says(with(61, 0x03), "nonzero padding bits after the packed gaps");
  {
    Bytes b = good;
    put32(b, 62, 6);
    says(b, "exception 6 is below the escape code 7");
    put32(b, 62, 69985);
    says(b, "check 4479 does not match the decoded last index 70001 (the block's indices are");
    put32(b, 62, u32_max - 5);
    says(b, "indices pass the last 32-bit index (the block would end at 4294967306)");
  }
  {
    Bytes b = good;
    put32(b, 44, 70001);
    says(b, "decoded last index 70000 differs from the group's last index 70001");
    b = good;
    put32(b, 52, 11);
    says(b, "first index 11 differs from the group's first index 10");
  }
  {
    Bytes b = good;
    put32(b, 86, 102);
    says(
        b,
        "group 1 (at byte 74): dense group of 2 values from index 100 has last index 102, not 101");
    put32(b, 82, u32_max);
    put32(b, 86, 0);
    says(b, "dense group of 2 values from index 4294967295 has last index 0, not 4294967296");
    b = good;
    put32(b, 90, 3);
    put32(b, 86, 102);
    says(b, "dense group of 3 values truncated (4 bytes left)");
  }
  {  // Two blocks: the second's first index must be above the first's last.
    std::vector<std::uint32_t> idx(129);
    for (std::uint32_t k = 0; k < 129; ++k)
      idx[k] = 2 * k;  // block 0 ends at 254
    const Bytes two = wire::encode(with_entries(1, idx));
    const Reference r = reference_encode(with_entries(1, idx));
    REQUIRE(r.block_at.size() == 2);
    Bytes b = two;
    put32(b, r.block_at[1], 254);
    says(b, "block 1 (at byte " + std::to_string(r.block_at[1]) +
                "): first index 254 is not above the previous block's last index 254");
    b = two;
    b[r.block_at[1] - 1] = std::byte{0};  // a value: still valid
    CHECK_NOTHROW(wire::MessageView(b, "test"));
  }
  {  // Indices that run past 2^32 - 1 within a block of consecutive indices.
    Raw r;
    r.u32(0x32657464).u8(1).u8(0).u16(0).u64(1).u64(0).u32(1).u32(0);
    r.u32(0).u8(1).u8(0).u16(0).u32(u32_max).u32(0).u32(2);
    r.u32(u32_max).u8(0).u8(0).u16(0).u16(1).u16(2);  // check: unused, the indices overflow
    says(r.b, "indices pass the last 32-bit index (the block would end at 4294967296)");
    put32(r.b, 52, u32_max - 1);
    says(r.b, "first index 4294967294 differs from the group's first index 4294967295");
    put32(r.b, 40, u32_max - 1);
    put32(r.b, 44, u32_max);
    says(r.b, "check 0 does not match the decoded last index 4294967295");
    r.b[58] = static_cast<std::byte>((u32_max % 65521) & 0xFF);
    r.b[59] = static_cast<std::byte>((u32_max % 65521) >> 8);
    CHECK_NOTHROW(wire::MessageView(r.b, "test"));  // now valid: ..., 2^32 - 2, 2^32 - 1
  }
}

TEST_CASE("wire: first_value_offset") {
  const Bytes b = wire::encode(doc_example());
  CHECK(wire::first_value_offset(b) == 66);
  wire::Message dense_only;
  dense_only.runs = {{1, 0, {7, 8}}};
  CHECK(wire::first_value_offset(wire::encode(dense_only)) == 52);
  wire::Message m = doc_example();  // a dense group before the sparse one: the sparse value
  wire::MessageWriter w;
  w.begin();
  w.add_dense_group(5, 100, m.runs[0].bits);
  for (const DeltaEntry& e : m.entries)
    w.add_entry(e.tensor, e.index, e.bits);
  w.finish(m.kind, m.version, m.base);
  Bytes c;
  for (auto s : w.spans())
    c.insert(c.end(), s.begin(), s.end());
  CHECK(wire::first_value_offset(c) == 24 + 66);
  CHECK_THROWS_AS(wire::first_value_offset(Bytes(b.begin(), b.end() - 1)), format_error);
}

namespace {

// One element of a receiver's stream.
struct Element {
  std::uint32_t tensor, index;
  std::uint16_t bits;
};

Bytes gather_message(const wire::MessageWriter& w) {
  Bytes flat;
  for (const std::span<const std::byte> s : w.spans())
    flat.insert(flat.end(), s.begin(), s.end());
  return flat;
}

// The sending policy written from its statement (wire.hpp), outside the writer's streaming code:
// every maximal stretch of consecutive indices of one tensor at least dense_min_run long as dense
// groups of at most dense_run_piece values from the stretch's start, the rest as entries.
Bytes policy_reference(const std::vector<Element>& s, std::size_t min_run) {
  wire::MessageWriter w;
  w.begin(min_run);
  for (std::size_t k = 0; k < s.size();) {
    std::size_t j = k + 1;
    while (j < s.size() && s[j].tensor == s[k].tensor && s[j - 1].index != u32_max &&
           s[j].index == s[j - 1].index + 1)
      ++j;
    if (j - k >= min_run) {
      for (std::size_t at = k; at < j; at += wire::dense_run_piece) {
        std::vector<std::uint16_t> bits;
        for (std::size_t x = at; x < std::min(j, at + wire::dense_run_piece); ++x)
          bits.push_back(s[x].bits);
        w.add_dense_group(s[at].tensor, s[at].index, bits);
      }
    } else {
      for (std::size_t x = k; x < j; ++x)
        w.add_entry(s[x].tensor, s[x].index, s[x].bits);
    }
    k = j;
  }
  w.finish(MessageKind::delta, 2, 1);
  return gather_message(w);
}

// A stream as senders make them: isolated entries, stretches just below, at and above
// dense_min_run and dense_run_piece, tensor switches, repeats and decreases, the last index.
std::vector<Element> random_stream(std::mt19937_64& rng) {
  std::vector<Element> s;
  const std::size_t lengths[] = {1,
                                 2,
                                 wire::dense_min_run - 1,
                                 wire::dense_min_run,
                                 wire::dense_min_run + 1,
                                 wire::dense_run_piece - 1,
                                 wire::dense_run_piece,
                                 wire::dense_run_piece + 1,
                                 2 * wire::dense_run_piece + 300};
  for (int piece = 0; piece < 60; ++piece) {
    const auto tensor = static_cast<std::uint32_t>(rng() % 3);
    const std::size_t n = rng() % 3 == 0 ? lengths[rng() % 9] : 1 + rng() % 40;
    std::uint32_t at = static_cast<std::uint32_t>(rng() % 5000000);
    if (rng() % 10 == 0)
      at = u32_max - static_cast<std::uint32_t>(std::min<std::size_t>(n, 1000)) + 1;
    for (std::size_t k = 0; k < n && std::uint64_t{at} + k <= u32_max; ++k) {
      const std::uint32_t index = at + static_cast<std::uint32_t>(k);
      s.push_back({tensor, index, static_cast<std::uint16_t>(rng())});
    }
    if (rng() % 4 == 0 && !s.empty()) {  // the next stretch continues this one's tensor and end
      const Element last = s.back();
      if (last.index != u32_max) s.push_back({last.tensor, last.index + 1, 7});
    }
    if (rng() % 8 == 0 && !s.empty() && s.back().index != u32_max) {
      s.push_back({s.back().tensor, 0, 9});  // wraps: index 0 after the last index, not consecutive
    }
  }
  return s;
}

// The stream into w, cut at random into add() calls and add_run() pieces of consecutive elements.
void feed_cut(wire::MessageWriter& w, const std::vector<Element>& s, std::mt19937_64& rng) {
  std::size_t k = 0;
  while (k < s.size()) {
    if (rng() % 2 == 0) {
      w.add(s[k].tensor, s[k].index, s[k].bits);
      ++k;
      continue;
    }
    const std::size_t want = 1 + rng() % (rng() % 2 ? 300 : 70000);
    std::size_t j = k + 1;
    std::vector<std::uint16_t> bits{s[k].bits};
    while (j < s.size() && j - k < want && s[j].tensor == s[k].tensor &&
           s[j - 1].index != u32_max && s[j].index == s[j - 1].index + 1)
      bits.push_back(s[j++].bits);
    w.add_run(s[k].tensor, s[k].index, bits);
    k = j;
  }
}

}  // namespace

TEST_CASE("wire: the sending policy: a message depends on the stream only, not on how it is cut") {
  std::mt19937_64 rng(2026);
  std::uint64_t dense_groups = 0, sparse_entries = 0;
  for (int trial = 0; trial < 10; ++trial) {
    CAPTURE(trial);
    // (every other trial: a message that writes whole runs, every stretch dense)
    const std::size_t min_run = trial % 2 == 0 ? wire::dense_min_run : 1;
    const std::vector<Element> s = random_stream(rng);
    const Bytes want = policy_reference(s, min_run);

    wire::MessageWriter one;  // element by element, as the CUDA sender's buckets are read
    one.begin(min_run);
    for (const Element& e : s)
      one.add(e.tensor, e.index, e.bits);
    one.flush();  // ending the stream early changes nothing when nothing follows
    one.finish(MessageKind::delta, 2, 1);
    CHECK(gather_message(one) == want);

    wire::MessageWriter cut;  // in pieces, as the host sender's tiles and runs cut it
    cut.begin(min_run);
    feed_cut(cut, s, rng);
    cut.finish(MessageKind::delta, 2, 1);
    CHECK(gather_message(cut) == want);
    CHECK(cut.entries() == one.entries());
    CHECK(cut.run_elements() == one.run_elements());
    CHECK(cut.entries() + cut.run_elements() == s.size());

    // The message holds the stream, in order.
    const wire::MessageView v(want, "test");
    v.for_each_group([&](const wire::Group& g) {
      dense_groups += g.dense;
      CHECK(g.count <= wire::dense_run_piece);
      if (g.dense) CHECK(g.count >= 1);
    });
    sparse_entries += v.entry_count();
    CHECK(v.entry_count() + v.run_elements() == s.size());
    if (min_run == 1) CHECK(v.entry_count() == 0);
  }
  CHECK(dense_groups > 10);  // the streams exercise both encodings
  CHECK(sparse_entries > 1000);

  // Stretches after P indexed entries of the same group, P around the block size: the writer
  // codes whole blocks before the stretch while it grows, then takes the stretch back out.
  for (const std::size_t p : {0, 1, 127, 128, 129, 255, 256, 257, 300}) {
    for (const std::size_t len : {wire::dense_min_run - 1, wire::dense_min_run, std::size_t{700}}) {
      CAPTURE(p);
      CAPTURE(len);
      std::vector<Element> st;
      for (std::size_t k = 0; k < p; ++k)
        st.push_back({1, static_cast<std::uint32_t>(3 * k), static_cast<std::uint16_t>(k)});
      for (std::size_t k = 0; k < len; ++k)
        st.push_back(
            {1, static_cast<std::uint32_t>(3 * p + 10 + k), static_cast<std::uint16_t>(k)});
      for (std::size_t k = 0; k < 5; ++k)  // and entries after it, in the same tensor
        st.push_back({1, static_cast<std::uint32_t>(3 * p + 20 + len + 2 * k), 9});
      const Bytes want = policy_reference(st, wire::dense_min_run);
      wire::MessageWriter w;
      w.begin();
      for (const Element& e : st)
        w.add(e.tensor, e.index, e.bits);
      w.finish(MessageKind::delta, 2, 1);
      CHECK(gather_message(w) == want);
      wire::MessageWriter c;
      c.begin();
      feed_cut(c, st, rng);
      c.finish(MessageKind::delta, 2, 1);
      CHECK(gather_message(c) == want);
      CHECK_NOTHROW(wire::MessageView(want, "test"));
    }
  }

  // A sparse group taken back whose header had opened a new 64 KiB chunk (or straddled into
  // one): the writer continues in the chunk before. Leading dense groups place the header.
  for (const std::size_t lead : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{9},
                                 std::size_t{10}, std::size_t{11}}) {
    CAPTURE(lead);
    // 32 (message header) + 20 + 2 * v: the next header starts at 65536 - 2 * lead
    const std::size_t v = (wire::MessageWriter::chunk_bytes - 52) / 2 - lead;
    std::vector<Element> st;
    for (std::size_t k = 0; k < v; ++k)
      st.push_back({0, static_cast<std::uint32_t>(k), 5});
    for (std::size_t k = 0; k < 600; ++k)
      st.push_back({2, static_cast<std::uint32_t>(100 + k), static_cast<std::uint16_t>(k)});
    st.push_back({2, 5000, 1});
    wire::MessageWriter w;
    w.begin();
    for (const Element& e : st)
      w.add(e.tensor, e.index, e.bits);
    w.finish(MessageKind::delta, 2, 1);
    const Bytes got = gather_message(w);
    CHECK(got == policy_reference(st, wire::dense_min_run));
    CHECK_NOTHROW(wire::MessageView(got, "test"));
  }

  CHECK_THROWS_AS(wire::MessageWriter().begin(0), invalid_argument);
  CHECK_THROWS_AS(wire::MessageWriter().begin(wire::dense_min_run + 1), invalid_argument);

  // A stretch of dense_min_run - 1 is entries, one more is a dense group.
  for (const std::size_t n : {wire::dense_min_run - 1, wire::dense_min_run}) {
    wire::MessageWriter w;
    w.begin();
    for (std::size_t k = 0; k < n; ++k)
      w.add(4, 10 + static_cast<std::uint32_t>(k), 1);
    w.add(4, 5000, 2);
    w.finish(MessageKind::delta, 2, 1);
    CHECK(w.run_elements() == (n == wire::dense_min_run ? n : 0));
    CHECK(w.entries() == (n == wire::dense_min_run ? 1 : n + 1));
  }
}

TEST_CASE("wire: the sending policy's stream comes back in order") {
  std::mt19937_64 rng(7);
  const std::vector<Element> s = random_stream(rng);
  wire::MessageWriter w;
  w.begin();
  feed_cut(w, s, rng);
  w.finish(MessageKind::delta, 2, 1);
  const Bytes b = gather_message(w);
  const wire::MessageView v(b, "test");
  // Groups in message order; each group's elements in index order: the stream itself.
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint16_t>> got;
  std::vector<wire::Group> groups;
  v.for_each_group([&](const wire::Group& g) { groups.push_back(g); });
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint16_t>> entries, runs;
  v.for_each_entry([&](const DeltaEntry& e) { entries.emplace_back(e.tensor, e.index, e.bits); });
  v.for_each_run([&](std::uint32_t t, std::uint32_t first, std::uint32_t len, const std::byte* p) {
    for (std::uint32_t k = 0; k < len; ++k) {
      std::uint16_t x;
      std::memcpy(&x, p + 2 * static_cast<std::size_t>(k), 2);
      runs.emplace_back(t, first + k, x);
    }
  });
  std::size_t e = 0, r = 0;
  for (const wire::Group& g : groups) {
    auto& from = g.dense ? runs : entries;
    std::size_t& at = g.dense ? r : e;
    for (std::uint32_t k = 0; k < g.count; ++k)
      got.push_back(from.at(at++));
  }
  REQUIRE(got.size() == s.size());
  for (std::size_t k = 0; k < s.size(); ++k) {
    CAPTURE(k);
    CHECK(got[k] == std::make_tuple(s[k].tensor, s[k].index, s[k].bits));
  }
}
