// SPDX-License-Identifier: Apache-2.0
// The canonical chunk codec (storage/chunk.hpp): the index gap code at its escape boundaries,
// chunks that round trip exactly, and every refusal a reader of untrusted storage needs before
// it may apply anything, and the diff value code over every bit pattern (RELIABILITY.md 6.1: F1-F3
// through the zstd frame, F11/F18 unknown or incomplete tensor triples, F16 a flipped bit, F17
// indices out of range or malformed; 6.2 M12 a chunk of another version or slot).
#include <doctest/doctest.h>

#include <zstd.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/numeric/round.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/value_code.hpp"

using namespace dte;
using storage::Chunk;
using storage::TensorDelta;

namespace {

const layout::HfModel& model() {
  static const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
  return hf;
}

// Random strictly increasing indices of tensor t (density about `p`), with random bits.
TensorDelta random_delta(std::int64_t t, double p, std::mt19937_64& rng) {
  TensorDelta d;
  d.tensor = t;
  const auto n = static_cast<std::uint64_t>(model()[t].numel());
  std::bernoulli_distribution take(p);
  for (std::uint64_t i = 0; i < n; ++i) {
    if (!take(rng)) continue;
    d.index.push_back(static_cast<std::uint32_t>(i));
    d.bits.push_back(static_cast<std::uint16_t>(rng()));
  }
  return d;
}

Chunk sample(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Chunk c;
  c.header = {7, 6, 3, 1};
  for (std::int64_t t = 0; t < model().size(); t += 3)
    c.tensors.push_back(random_delta(t, t % 2 == 0 ? 0.01 : 0.5, rng));
  c.tensors.push_back({1, {}, {}});  // a tensor with nothing changed: zero-size tensors
  return c;
}

std::vector<std::byte> compress(const std::vector<std::byte>& plain) {
  std::vector<std::byte> out(ZSTD_compressBound(plain.size()));
  const std::size_t n = ZSTD_compress(out.data(), out.size(), plain.data(), plain.size(), 1);
  REQUIRE(!ZSTD_isError(n));
  out.resize(n);
  return out;
}

// A hand-built container with the dte metadata and the given tensors, compressed.
std::vector<std::byte> crafted(const std::function<void(io::SafetensorsWriter&)>& add) {
  io::SafetensorsWriter w;
  w.set_metadata("dte.format", "chunk-v1");
  w.set_metadata("dte.version", "7");
  w.set_metadata("dte.base", "6");
  w.set_metadata("dte.chunk", "0");
  w.set_metadata("dte.writer", "0");
  w.set_metadata("dte.encoding", "value");
  add(w);
  return compress(w.serialize());
}

template <class E>
void refuses(std::span<const std::byte> bytes, const std::string& why,
             const storage::ChunkHeader* expect = nullptr) {
  try {
    (void)storage::decode_chunk(model(), bytes, "chunk.zst", expect);
    FAIL("accepted; expected a refusal saying: " << why);
  } catch (const E& e) {
    CHECK_MESSAGE(std::string(e.what()).find(why) != std::string::npos, e.what());
  }
}

}  // namespace

TEST_CASE("gap code: escapes at 255 and 65535, exact round trip, refusals name the fault") {
  const std::vector<std::uint32_t> idx = {0,   1,     255,      256,         511,        767,
                                          768, 66303, 1u << 20, 0xFFFFFFFEu, 0xFFFFFFFFu};
  std::vector<std::uint8_t> code;
  dte::put_gaps(idx, code);
  // gaps: 0, 0, 253, 0, 254, 255 (escaped to u16), 0, 65534 (u16), 982272 (u16 escape, u32)...
  CHECK(code[2] == 253);
  CHECK(code[4] == 254);
  CHECK(code[5] == 255);
  CHECK(code[6] == 255);
  CHECK(code[7] == 0);
  CHECK(code[8] == 0);  // the gap 0 after it
  CHECK(code[9] == 255);
  CHECK(code[10] == 0xFE);
  CHECK(code[11] == 0xFF);  // 65534 fits the u16
  CHECK(code[12] == 255);
  CHECK(code[13] == 0xFF);
  CHECK(code[14] == 0xFF);  // 65535: a u32 follows
  CHECK(dte::get_gaps(code, idx.size(), 1ull << 32, "t") == idx);
  std::vector<std::uint8_t> bad;
  CHECK_THROWS_AS(dte::put_gaps(std::vector<std::uint32_t>{5, 5}, bad), invalid_argument);
  CHECK_THROWS_AS(dte::put_gaps(std::vector<std::uint32_t>{5, 4}, bad), invalid_argument);
  CHECK_THROWS_WITH_AS(dte::get_gaps(code, idx.size(), 0xFFFFFFFFull, "t"),
                       doctest::Contains("outside the tensor"), format_error);
  CHECK_THROWS_WITH_AS(dte::get_gaps(code, idx.size() - 1, 1ull << 32, "t"),
                       doctest::Contains("bytes follow the last"), format_error);
  const std::vector<std::uint8_t> cut(code.begin(), code.begin() + 7);  // inside a u16 escape
  CHECK_THROWS_WITH_AS(dte::get_gaps(cut, 6, 1ull << 32, "t"),
                       doctest::Contains("escaped but the stream ends"), format_error);
  const std::vector<std::uint8_t> cut32(code.begin(), code.begin() + 16);  // inside the u32
  CHECK_THROWS_WITH_AS(dte::get_gaps(cut32, 9, 1ull << 32, "t"),
                       doctest::Contains("inside its 4 bytes"), format_error);
  CHECK_THROWS_WITH_AS(dte::get_gaps(std::vector<std::uint8_t>{0, 0}, 3, 100, "t"),
                       doctest::Contains("only 2 index bytes"), format_error);
}

TEST_CASE("gap code: the eight-at-a-time decode equals one at a time, faults included") {
  // Runs of one-byte gaps (the fast path) broken by escapes at every position of an eight-byte
  // group, and limits that fall inside a group: get_gaps must return what a plain one-at-a-time
  // decode returns, and refuse where it refuses, naming the same entry.
  std::mt19937_64 rng(7);
  const auto reference = [](const std::vector<std::uint8_t>& code, std::uint64_t count,
                            std::uint64_t limit) {
    std::vector<std::uint32_t> out;
    std::size_t at = 0;
    std::uint64_t next = 0;
    for (std::uint64_t k = 0; k < count; ++k) {
      if (at >= code.size()) return std::pair(out, std::string("ends"));
      std::uint64_t gap = code[at++];
      if (gap == 255) {
        if (code.size() - at < 2) return std::pair(out, std::string("escape"));
        gap = code[at] | (std::uint64_t{code[at + 1]} << 8);
        at += 2;
        if (gap == 65535) {
          if (code.size() - at < 4) return std::pair(out, std::string("escape"));
          gap = 0;
          for (int b = 0; b < 4; ++b)
            gap |= std::uint64_t{code[at++]} << (8 * b);
        }
      }
      const std::uint64_t v = next + gap;
      if (v >= limit) return std::pair(out, "past " + std::to_string(k));
      out.push_back(static_cast<std::uint32_t>(v));
      next = v + 1;
    }
    return std::pair(out, at == code.size() ? std::string() : std::string("trailing"));
  };
  int fast_groups = 0, past = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::uint32_t> idx;
    std::uint64_t next = 0;
    const int n = 1 + static_cast<int>(rng() % 60);
    for (int k = 0; k < n; ++k) {
      const std::uint64_t r = rng() % 100;
      const std::uint64_t gap = r < 80 ? rng() % 255 : r < 95 ? 255 + rng() % 70000 : rng() % 3;
      next += gap;
      idx.push_back(static_cast<std::uint32_t>(next));
      ++next;
    }
    std::vector<std::uint8_t> code;
    dte::put_gaps(idx, code);
    // A limit anywhere from below the first index to past the last.
    const std::uint64_t limit = trial % 3 == 0 ? next : 1 + rng() % (next + 8);
    const auto [want, fault] = reference(code, idx.size(), limit);
    fast_groups += idx.size() >= 8;
    if (fault.empty()) {
      CHECK(dte::get_gaps(code, idx.size(), limit, "t") == want);
      CHECK(want == idx);
    } else {
      ++past;
      REQUIRE(fault.starts_with("past"));
      const std::string entry = "(entry " + fault.substr(5) + ")";
      CHECK_THROWS_WITH_AS(dte::get_gaps(code, idx.size(), limit, "t"),
                           doctest::Contains(entry.c_str()), format_error);
    }
  }
  CHECK(fast_groups > 1000);
  CHECK(past > 500);
}

TEST_CASE("a chunk round trips exactly, and says what it is") {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    const Chunk c = sample(seed);
    const auto bytes = storage::encode_chunk(model(), c, 3);
    const Chunk back = storage::decode_chunk(model(), bytes, "chunk.zst", &c.header);
    CHECK(back.header == c.header);
    CHECK(back.encoding == storage::Encoding::value);
    REQUIRE(back.tensors.size() == c.tensors.size());
    for (std::size_t k = 0; k < c.tensors.size(); ++k)
      CHECK(back.tensors[k] == c.tensors[k]);
    // The same bytes give the same checksum; the container opens with a plain safetensors reader.
    CHECK(storage::checksum(bytes) == storage::checksum(storage::encode_chunk(model(), c, 3)));
    // Four frames (header, indices, high bytes, low bytes) that decompress to one file.
    std::size_t frames = 0;
    for (std::size_t at = 0; at < bytes.size(); ++frames)
      at += ZSTD_findFrameCompressedSize(bytes.data() + at, bytes.size() - at);
    CHECK(frames == 4);
    const io::SafetensorsFile f =
        io::SafetensorsFile::parse(storage::decompress_frames(bytes, "chunk"), "plain");
    CHECK(f.metadata().at("dte.format") == "chunk-v1");
    CHECK(f.find(model().name(0) + ":index") != nullptr);
    CHECK(f.find(model().name(0) + ":value_hi") != nullptr);
  }
}

TEST_CASE("the diff value code: exact for every step it codes, one ulp is the code 5 or 6") {
  using storage::diff_apply;
  using storage::diff_code;
  using storage::ordered16;
  // The ordered line is a bijection that follows the values: every finite pattern below the
  // next one up (-0 just below +0), and each pattern decodes back from its code.
  std::vector<bool> seen(65536, false);
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto o = ordered16(static_cast<std::uint16_t>(b));
    REQUIRE(!seen[o]);
    seen[o] = true;
    REQUIRE(storage::unordered16(o) == b);
  }
  CHECK(ordered16(0x8000) + 1 == ordered16(0x0000));
  std::mt19937_64 rng(11);
  std::size_t up = 0, down = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto base = static_cast<std::uint16_t>(b);
    for (int k = 0; k < 8; ++k) {  // arbitrary new values, NaN and infinities included
      const auto now = static_cast<std::uint16_t>(rng());
      if (storage::diff_fits(base, now)) {
        REQUIRE(diff_apply(base, diff_code(base, now)) == now);
      } else {  // the four steps of 32766 ulps and more, which have no code
        const auto step = static_cast<std::uint16_t>(ordered16(now) - ordered16(base));
        REQUIRE((step >= 32766 && step <= 32769));  // +32766, +32767, -32768, -32767
      }
    }
    REQUIRE(diff_code(base, base) == 4);
    const float x = bf16_to_float(base);
    if (!std::isfinite(x) || x == 0) continue;
    // The neighbouring patterns one ulp above and below (magnitudes step the other way for
    // negative values): the codes 6 and 5.
    const auto above = static_cast<std::uint16_t>(x > 0 ? b + 1 : b - 1);
    const auto below = static_cast<std::uint16_t>(x > 0 ? b - 1 : b + 1);
    if (std::isfinite(bf16_to_float(above))) {
      REQUIRE(bf16_to_float(above) > x);
      CHECK(diff_code(base, above) == 6);
      ++up;
    }
    if (std::isfinite(bf16_to_float(below))) {
      REQUIRE(bf16_to_float(below) < x);
      CHECK(diff_code(base, below) == 5);
      ++down;
    }
  }
  CHECK(up > 60000);
  CHECK(down > 60000);
}

TEST_CASE("the near codes: the new value against every base near_fits admits, and only those") {
  using storage::diff_apply;
  using storage::near_code;
  using storage::near_fits;
  using storage::ordered16;
  using storage::unordered16;
  std::size_t admitted = 0, refused = 0;
  for (std::uint32_t n = 0; n < 65536; ++n) {
    const auto now = static_cast<std::uint16_t>(n);
    const std::uint16_t code = near_code(now);
    REQUIRE(code < storage::near_codes);
    // Every candidate range [lo, hi] within 4 patterns of now on the ordered line.
    for (int a = -4; a <= 4; ++a) {
      for (int b = a; b <= 4; ++b) {
        const auto lo = unordered16(static_cast<std::uint16_t>(ordered16(now) + a));
        const auto hi = unordered16(static_cast<std::uint16_t>(ordered16(now) + b));
        bool all = true;  // does the code name `now` against every base in [lo, hi]?
        for (int c = a; c <= b; ++c)
          all = all && diff_apply(unordered16(static_cast<std::uint16_t>(ordered16(now) + c)),
                                  code) == now;
        REQUIRE(near_fits(lo, hi, now) == all);
        (all ? admitted : refused) += 1;
      }
    }
    // A range the wrong way round is never admitted.
    REQUIRE_FALSE(near_fits(unordered16(static_cast<std::uint16_t>(ordered16(now) + 1)), now, now));
  }
  CHECK(admitted == 65536u * 10);  // the 10 ranges inside [now - 1, now + 2]
  CHECK(refused > 0);
  // The steps stop short of the near codes: diff_fits says where.
  CHECK(storage::diff_fits(0x3F80, 0x3F81));
  CHECK(storage::diff_fits(0x0000, 0x7F7F));        // +0 to the largest BF16: 32639 ulps up
  CHECK_FALSE(storage::diff_fits(0x0000, 0x7FFE));  // 32766 up (a NaN pattern): no code
}

TEST_CASE("a diff chunk round trips and says so") {
  Chunk c = sample(5);
  c.encoding = storage::Encoding::diff;
  const Chunk back =
      storage::decode_chunk(model(), storage::encode_chunk(model(), c), "x.zst", &c.header);
  CHECK(back.encoding == storage::Encoding::diff);
  REQUIRE(back.tensors.size() == c.tensors.size());
  for (std::size_t k = 0; k < c.tensors.size(); ++k)
    CHECK(back.tensors[k] == c.tensors[k]);
}

TEST_CASE("encode refuses what it cannot write faithfully") {
  Chunk c;
  c.tensors.push_back({0, {1, 2}, {7}});
  CHECK_THROWS_AS((void)storage::encode_chunk(model(), c), invalid_argument);
  c.tensors = {{model().size(), {}, {}}};
  CHECK_THROWS_AS((void)storage::encode_chunk(model(), c), invalid_argument);
  c.tensors = {{0, {static_cast<std::uint32_t>(model()[0].numel())}, {1}}};
  CHECK_THROWS_AS((void)storage::encode_chunk(model(), c), invalid_argument);
  c.tensors = {};
  CHECK_THROWS_AS((void)storage::encode_chunk(model(), c, 0), invalid_argument);
}

TEST_CASE("decode refuses damaged frames before reading them (F1-F3, F16)") {
  const auto good = storage::encode_chunk(model(), sample(9));
  refuses<format_error>(std::span(good).first(3), "not a zstd frame");
  refuses<format_error>(std::span(good).first(good.size() - 5), "zstd refused");
  for (std::size_t at : {good.size() / 2, good.size() - 2}) {  // a flipped bit in the payload
    auto flipped = good;
    flipped[at] ^= std::byte{0x10};
    CHECK_THROWS_AS((void)storage::decode_chunk(model(), flipped, "chunk.zst"), format_error);
  }
  try {
    (void)storage::decode_chunk(model(), good, "chunk.zst", nullptr, 100);
    FAIL("a chunk over the size limit was accepted");
  } catch (const bounds_error& e) {
    CHECK(std::string(e.what()).find("over the chunk limit of 100") != std::string::npos);
  }
  // A frame that does not state its size (streamed) is refused.
  std::vector<std::byte> streamed(256);
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  ZSTD_outBuffer out{streamed.data(), streamed.size(), 0};
  const char text[] = "hello";
  ZSTD_inBuffer in{text, sizeof text, 0};
  REQUIRE(!ZSTD_isError(ZSTD_compressStream2(cctx, &out, &in, ZSTD_e_end)));
  ZSTD_freeCCtx(cctx);
  streamed.resize(out.pos);
  refuses<format_error>(streamed, "does not state its decompressed size");
}

TEST_CASE("decode refuses a chunk of another version or slot (M12)") {
  const Chunk c = sample(4);
  const auto bytes = storage::encode_chunk(model(), c);
  storage::ChunkHeader other = c.header;
  other.chunk = 4;
  refuses<protocol_error>(bytes, "another version or slot", &other);
  other = c.header;
  other.version = 8;
  refuses<protocol_error>(bytes, "the manifest expects version 8", &other);
}

TEST_CASE("decode refuses foreign, unpaired, unknown and malformed tensors (F10, F17, F18)") {
  const std::string embed = model().name(0);
  const std::vector<std::uint8_t> gaps = {0, 1}, two = {0, 1};
  const auto values = [&](io::SafetensorsWriter& w, const std::string& name,
                          const std::vector<std::uint8_t>& v) {
    w.add<std::uint8_t>(name + ":value_hi", {v.size()}, v, io::DType::U8);
    w.add<std::uint8_t>(name + ":value_lo", {v.size()}, v, io::DType::U8);
  };
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>("model.nothing.weight:index", {2}, gaps,
                                              io::DType::U8);
                          values(w, "model.nothing.weight", two);
                        }),
                        "is not a tensor of tiny-qwen3");
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed + ":index", {2}, gaps, io::DType::U8);
                        }),
                        "without '" + embed + ":value_hi'");
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed + ":index", {2}, gaps, io::DType::U8);
                          w.add<std::uint8_t>(embed + ":value_hi", {2}, two, io::DType::U8);
                        }),
                        "without '" + embed + ":value_lo'");
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed, {2}, gaps, io::DType::U8);
                        }),
                        "is not '<name>:index', '<name>:value_hi' or '<name>:value_lo'");
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed + ":index", {2}, gaps, io::DType::U8);
                          w.add<std::uint16_t>(embed + ":value_hi", {2},
                                               std::vector<std::uint16_t>{1, 2}, io::DType::U16);
                          w.add<std::uint8_t>(embed + ":value_lo", {2}, two, io::DType::U8);
                        }),
                        "must be U8 [k]");
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed + ":index", {2}, gaps, io::DType::U8);
                          w.add<std::uint8_t>(embed + ":value_hi", {2}, two, io::DType::U8);
                          w.add<std::uint8_t>(embed + ":value_lo", {1},
                                              std::vector<std::uint8_t>{0}, io::DType::U8);
                        }),
                        "must be U8 [k]");
  // Three values, two indices: the stream ends early.
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(embed + ":index", {2}, gaps, io::DType::U8);
                          values(w, embed, std::vector<std::uint8_t>(3, 0));
                        }),
                        "only 2 index bytes");
  // An index beyond the tensor (an escaped gap of 2^32 - 1).
  refuses<format_error>(crafted([&](io::SafetensorsWriter& w) {
                          w.add<std::uint8_t>(
                              embed + ":index", {7},
                              std::vector<std::uint8_t>{255, 255, 255, 255, 255, 255, 255},
                              io::DType::U8);
                          values(w, embed, std::vector<std::uint8_t>{0});
                        }),
                        "outside the tensor");
  // Not a dte chunk, a newer format, another encoding.
  io::SafetensorsWriter plain;
  plain.add<std::uint8_t>("x", {1}, std::vector<std::uint8_t>{0}, io::DType::U8);
  refuses<format_error>(compress(plain.serialize()), "lacks 'dte.format'");
  io::SafetensorsWriter newer;
  newer.set_metadata("dte.format", "chunk-v9");
  refuses<format_error>(compress(newer.serialize()), "this reader reads \"chunk-v1\"");
  io::SafetensorsWriter other_encoding;
  other_encoding.set_metadata("dte.format", "chunk-v1");
  other_encoding.set_metadata("dte.encoding", "zip");
  refuses<format_error>(compress(other_encoding.serialize()), "not one this reader applies");
  other_encoding.set_metadata("dte.encoding", "xor");  // (the earlier name of diff's slot)
  refuses<format_error>(compress(other_encoding.serialize()), "(value, diff)");
  // diff needs a base: an anchor cannot be diff-encoded, nor such a chunk be read.
  Chunk anchor_diff;
  anchor_diff.header = {3, no_version, 0, 0};
  anchor_diff.encoding = storage::Encoding::diff;
  CHECK_THROWS_AS((void)storage::encode_chunk(model(), anchor_diff), invalid_argument);
  io::SafetensorsWriter diff_anchor;
  for (const char* k : {"dte.version", "dte.chunk", "dte.writer"})
    diff_anchor.set_metadata(k, "0");
  diff_anchor.set_metadata("dte.base", std::to_string(no_version));
  diff_anchor.set_metadata("dte.format", "chunk-v1");
  diff_anchor.set_metadata("dte.encoding", "diff");
  refuses<format_error>(compress(diff_anchor.serialize()), "diff-encoded chunk without a base");
  io::SafetensorsWriter bad_version;
  for (const char* k : {"dte.base", "dte.chunk", "dte.writer"})
    bad_version.set_metadata(k, "0");
  bad_version.set_metadata("dte.format", "chunk-v1");
  bad_version.set_metadata("dte.encoding", "value");
  bad_version.set_metadata("dte.version", "-1");
  refuses<format_error>(compress(bad_version.serialize()), "not an unsigned 64-bit decimal");
}
