// SPDX-License-Identifier: Apache-2.0
// The class index (storage/class_index.hpp): the class of every bit pattern and of every short
// range of patterns, domain groups, streams that round trip exactly against the base they were
// coded for, chunks that carry one (decoded only with the base at hand), and every refusal a
// reader of untrusted storage needs (RELIABILITY.md 6.1 F17: malformed or out-of-range indices).
#include <doctest/doctest.h>

#include <zstd.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/numeric/round.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/class_index.hpp"
#include "dte/storage/value_code.hpp"

using namespace dte;
using storage::DomainGroup;

namespace {

// A base of weights like a trained tensor's (normal, a spread of exponents, a few zeros).
std::vector<std::uint16_t> base_bits(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> w(0.0f, 0.02f);
  std::vector<std::uint16_t> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = i % 97 == 0 ? 0 : Bf16Format::round(w(rng));
  return out;
}

struct Case {
  std::vector<std::uint16_t> base;
  std::vector<DomainGroup> domain;
  std::vector<std::uint32_t> index, skip;
  std::vector<std::int16_t> cls;
};

// Every domain position changes with a probability that falls with its magnitude, a few are
// exceptions (class unknown) and a few are skipped.
Case random_case(std::uint64_t seed, std::vector<DomainGroup> domain) {
  std::mt19937_64 rng(seed);
  Case c;
  c.base = base_bits(20000, rng);
  c.domain = std::move(domain);
  std::uniform_real_distribution<double> u(0, 1);
  for (const DomainGroup& g : c.domain) {
    for (std::uint64_t j = 0; j < g.count; ++j) {
      for (std::uint64_t p = g.start + j * g.stride; p < g.start + j * g.stride + g.length; ++p) {
        const float v = std::fabs(Bf16Format::widen(c.base[p]));
        const double pr = std::min(0.5, 1e-4 / std::max(v, 1e-6f));
        const double r = u(rng);
        if (r < 0.01) {
          c.skip.push_back(static_cast<std::uint32_t>(p));
        } else if (r < pr + 0.01) {
          c.index.push_back(static_cast<std::uint32_t>(p));
          c.cls.push_back(u(rng) < 0.03 ? storage::unknown_class : storage::value_class(c.base[p]));
        }
      }
    }
  }
  return c;
}

auto base_of(const std::vector<std::uint16_t>& b) {
  return [&b](std::uint64_t start, std::uint64_t count, std::uint16_t* out) {
    std::copy_n(b.begin() + static_cast<std::ptrdiff_t>(start), count, out);
  };
}

std::vector<std::uint8_t> encode(const Case& c) {
  std::vector<std::uint8_t> out;
  storage::put_class_index({c.index, c.cls, c.domain, c.skip}, base_of(c.base), out);
  return out;
}

std::vector<std::uint32_t> decode(const std::vector<std::uint8_t>& s,
                                  const std::vector<std::uint16_t>& base) {
  const storage::ClassIndex x = storage::get_class_index(s, base.size(), "t");
  return storage::resolve_class_index(x, base_of(base), "t");
}

}  // namespace

TEST_CASE("value_class and class_between: every pattern, every range of up to 8 patterns") {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    CHECK(storage::value_class(bits) == ((b & 0x7FFF) >> 7));
  }
  // class_between names a class exactly when every pattern between the two ends has it.
  for (std::uint32_t o = 0; o < 0x10000; ++o) {
    for (std::uint32_t w = 0; w < 8 && o + w < 0x10000; ++w) {
      const auto lo = storage::unordered16(static_cast<std::uint16_t>(o));
      const auto hi = storage::unordered16(static_cast<std::uint16_t>(o + w));
      std::set<int> seen;
      for (std::uint32_t k = o; k <= o + w; ++k)
        seen.insert(storage::value_class(storage::unordered16(static_cast<std::uint16_t>(k))));
      const int want = seen.size() == 1 ? *seen.begin() : storage::unknown_class;
      if (storage::class_between(lo, hi) != want) {
        FAIL("class_between(" << lo << ", " << hi << ") = " << storage::class_between(lo, hi)
                              << ", expected " << want);
      }
    }
  }
}

TEST_CASE("group_runs: equal runs at one stride share a group") {
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> runs = {
      {5, 3}, {10, 8}, {30, 8}, {50, 8}, {70, 8}, {78, 2}, {100, 1}};
  const auto g = storage::group_runs(runs);
  REQUIRE(g.size() == 4);
  CHECK(g[0] == DomainGroup{5, 3, 3, 1});
  CHECK(g[1] == DomainGroup{10, 8, 20, 4});
  CHECK(g[2] == DomainGroup{78, 2, 2, 1});  // (78, 2) and (100, 1) differ in length
  CHECK(g[3] == DomainGroup{100, 1, 1, 1});
  CHECK(storage::group_runs(std::vector<std::pair<std::uint64_t, std::uint64_t>>{}).empty());
}

TEST_CASE("class index streams round trip against their base, and only it") {
  const std::vector<std::vector<DomainGroup>> domains = {
      {{0, 20000, 20000, 1}},                                   // a whole tensor
      {{3, 7, 7, 1}, {100, 50, 128, 100}, {12900, 11, 11, 1}},  // a TP column slice
      {{19999, 1, 1, 1}},                                       // one position
  };
  for (std::size_t d = 0; d < domains.size(); ++d) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      CAPTURE(d);
      CAPTURE(seed);
      const Case c = random_case(seed * 31 + d, domains[d]);
      const auto s = encode(c);
      const storage::ClassIndex x = storage::get_class_index(s, c.base.size(), "t");
      CHECK(x.domain == c.domain);
      CHECK(x.skip.size() == c.skip.size());
      CHECK(x.values == c.index.size());
      CHECK(decode(s, c.base) == c.index);
    }
  }
  // Plenty of changes, and the stream is well below one byte per change at this density.
  const Case c = random_case(99, domains[0]);
  REQUIRE(c.index.size() > 100);
  MESSAGE(c.index.size() << " changes in " << encode(c).size() << " bytes");
  // A base that is not the one coded for: a changed class count is refused or decodes other
  // positions (the version chain is what guarantees the base; this is the failure it prevents).
  std::vector<std::uint16_t> other = c.base;
  for (std::size_t i = 0; i < other.size(); i += 3)
    other[i] = static_cast<std::uint16_t>(other[i] ^ 0x0100);  // move the exponent
  const auto s = encode(c);
  bool differs = true;
  try {
    differs = decode(s, other) != c.index;
  } catch (const format_error&) {
  }
  CHECK(differs);
}

TEST_CASE("class index: every malformed stream is refused before anything is returned") {
  const Case c = random_case(7, {{10, 50, 100, 20}});
  REQUIRE(!c.index.empty());
  const auto good = encode(c);
  const auto refused = [](const std::vector<std::uint8_t>& s,
                          const std::vector<std::uint16_t>& base) {
    try {
      (void)decode(s, base);
    } catch (const format_error& e) {
      return std::string(e.what()).find("class index") != std::string::npos;
    }
    return false;
  };
  CHECK_FALSE(refused(good, c.base));
  for (std::size_t cut = 0; cut < good.size(); ++cut) {  // truncated anywhere
    CHECK(refused(std::vector<std::uint8_t>(good.begin(), good.begin() + static_cast<long>(cut)),
                  c.base));
  }
  auto longer = good;
  longer.push_back(0);
  CHECK(refused(longer, c.base));  // trailing bytes
  CHECK(refused(good, std::vector<std::uint16_t>(c.base.begin(), c.base.begin() + 1000)));
  // Hand-made streams over a base of ones (class 127): G, groups (start, length, stride,
  // count), X, exceptions, S, skips, K, (class, count, Rice parameter)..., Rice-coded ranks
  // (parameter 0 here: a gap g is g 1-bits and a 0, from the lowest bit of each byte).
  const std::vector<std::uint16_t> ones(64, 0x3F80);
  using V = std::vector<std::uint8_t>;
  CHECK(decode(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 1, 0, 0b011}, ones) ==
        std::vector<std::uint32_t>{7});  // rank 2 of [5, 15)
  // runs [5,7) [15,17) [25,27); exception 15; class ranks 0 and 2 (of 5, 6, 16, 25, 26)
  CHECK(decode(V{1, 5, 2, 10, 3, 1, 15, 0, 1, 127, 2, 0, 0b010}, ones) ==
        std::vector<std::uint32_t>{5, 15, 16});
  CHECK(refused(V{1, 5, 0, 0, 1, 0, 0, 0}, ones));                // an empty group
  CHECK(refused(V{1, 5, 10, 4, 2, 0, 0, 0}, ones));               // runs that overlap
  CHECK(refused(V{1, 60, 10, 0, 1, 0, 0, 0}, ones));              // past the tensor
  CHECK(refused(V{2, 5, 10, 0, 1, 50, 1, 0, 1, 0, 0, 0}, ones));  // a group past it
  CHECK(refused(V{1, 5, 10, 0, 1, 1, 20, 0, 0}, ones));           // exception off the domain
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 1, 2, 0}, ones));            // skip before the domain
  CHECK(refused(V{1, 5, 10, 0, 1, 1, 6, 1, 6, 0}, ones));         // exception and skip at 6
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 2, 127, 1, 0, 127, 1, 0, 0, 0}, ones));  // class twice
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 1, 0, 0xFF, 0x03}, ones));       // rank 10 of 10
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 120, 1, 0, 0x07}, ones));   // a class the base lacks
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 0}, ones));            // a class with no entries
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 11, 0, 0, 0}, ones));  // more than the domain
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 1, 32, 0}, ones));     // Rice parameter 32
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 1, 0, 0x80}, ones));   // padding bits not 0
  CHECK(refused(V{1, 5, 10, 0, 1, 0, 0, 1, 127, 1, 0, 0xFF}, ones));   // unary without its end
  CHECK(refused(V{0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F}, ones));  // varint
  CHECK(refused(V{}, ones));
}

TEST_CASE("chunks with a class index: decoded only against a base, checked without one") {
  // (small-qwen3: tensors of up to a million elements, where the class table is cheap beside
  // what it saves; tiny ones go plain, see below)
  static const layout::HfModel hf(layout::model_preset("small-qwen3"));
  std::mt19937_64 rng(5);
  std::vector<std::vector<std::uint16_t>> held(static_cast<std::size_t>(hf.size()));
  storage::Chunk c;
  c.header = {9, 8, 0, 1};
  c.encoding = storage::Encoding::diff;
  c.index = storage::IndexCode::classes;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    if (t % 5 != 0) continue;
    auto& b = held[static_cast<std::size_t>(t)];
    b = base_bits(static_cast<std::size_t>(hf[t].numel()), rng);
    storage::TensorDelta d;
    d.tensor = t;
    const auto n = static_cast<std::uint64_t>(hf[t].numel());
    d.domain = {{n / 4, n / 2, n / 2, 1}};
    std::uniform_real_distribution<double> u(0, 1);
    for (std::uint64_t i = n / 4; i < n / 4 + n / 2; ++i) {
      // (small weights change more often, as under a small learning rate)
      if (u(rng) >= std::min(0.5, 2e-4 / std::max(1e-6f, std::fabs(Bf16Format::widen(b[i])))))
        continue;
      d.index.push_back(static_cast<std::uint32_t>(i));
      d.bits.push_back(static_cast<std::uint16_t>(5 + rng() % 2));
      d.cls.push_back(rng() % 20 == 0 ? storage::unknown_class : storage::value_class(b[i]));
    }
    c.tensors.push_back(std::move(d));
  }
  const storage::TensorsBase base(held);
  const auto bytes = storage::encode_chunk(hf, c, 1, &base);
  const storage::Chunk back =
      storage::decode_chunk(hf, bytes, "c.zst", &c.header, storage::max_decoded_bytes, &base);
  CHECK(back.index == storage::IndexCode::classes);
  CHECK(back.encoding == storage::Encoding::diff);
  CHECK(back.tensors == c.tensors);
  // Each entry starts with its mode (these are large and dense enough for the class index);
  // a mode other than 0 or 1 is refused.
  {
    std::vector<std::byte> plain_bytes = storage::decompress_frames(bytes, "c.zst");
    std::size_t mode_at = 0, classed = 0;
    {
      const io::SafetensorsFile file = io::SafetensorsFile::parse(plain_bytes, "c.zst");
      std::uint64_t header = 0;  // (the data start after the 8-byte length and the header)
      for (int b = 0; b < 8; ++b)
        header |= std::to_integer<std::uint64_t>(plain_bytes[static_cast<std::size_t>(b)])
                  << (8 * b);
      for (const storage::TensorDelta& d : c.tensors) {
        const io::TensorInfo& info = file.at(hf.name(d.tensor) + ":index");
        const int mode = std::to_integer<int>(file.bytes(info)[0]);
        // (a norm vector is cheaper plain; a matrix of this density is not)
        CAPTURE(hf.name(d.tensor));
        if (hf[d.tensor].numel() <= 4096) CHECK(mode == 0);
        if (hf[d.tensor].numel() >= 65536) CHECK(mode == 1);
        classed += mode == 1;
        mode_at = static_cast<std::size_t>(8 + header + info.begin);
      }
    }
    CHECK(classed > 0);
    plain_bytes[mode_at] = std::byte{2};
    std::vector<std::byte> z(ZSTD_compressBound(plain_bytes.size()));
    z.resize(ZSTD_compress(z.data(), z.size(), plain_bytes.data(), plain_bytes.size(), 1));
    CHECK_THROWS_WITH_AS(
        (void)storage::decode_chunk(hf, z, "m.zst", nullptr, storage::max_decoded_bytes, &base),
        doctest::Contains("starts with its mode"), format_error);
  }
  // Without the base: refused, naming the option; checked in every other respect.
  CHECK_THROWS_AS((void)storage::decode_chunk(hf, bytes, "c.zst"), unsupported);
  CHECK_NOTHROW(storage::check_chunk(hf, bytes, "c.zst", &c.header));
  // A class index needs the diff encoding and a base to code against.
  storage::Chunk v = c;
  v.encoding = storage::Encoding::value;
  CHECK_THROWS_AS((void)storage::encode_chunk(hf, v, 1, &base), invalid_argument);
  CHECK_THROWS_AS((void)storage::encode_chunk(hf, c, 1, nullptr), invalid_argument);
  // A plain chunk decodes as before, base or not.
  storage::Chunk plain = c;
  plain.index = storage::IndexCode::plain;
  CHECK(storage::decode_chunk(hf, storage::encode_chunk(hf, plain, 1), "p.zst").tensors ==
        c.tensors);
}
