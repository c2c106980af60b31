// SPDX-License-Identifier: Apache-2.0
// Tests for dte/io/safetensors.hpp: round trips, and one test per refusal of RELIABILITY.md 6.1
// (F1-F15) plus a property test over random files.
#include "dte/io/safetensors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using dte::io::DType;
using dte::io::SafetensorsFile;
using dte::io::SafetensorsWriter;
using dte::io::TensorInfo;

constexpr const char* kSource = "test.safetensors";

std::vector<std::byte> to_bytes(std::string_view s) {
  std::vector<std::byte> out(s.size());
  if (!s.empty()) std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// 8-byte little-endian length, then `rest`.
std::vector<std::byte> raw(std::uint64_t n, std::string_view rest) {
  std::string out;
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  out.append(rest);
  return to_bytes(out);
}

// A file whose header length is exactly header.size(), followed by `data`.
std::vector<std::byte> file(std::string_view header, std::string_view data = "") {
  std::string rest(header);
  rest.append(data);
  return raw(header.size(), rest);
}

std::string entry(std::string_view name, std::string_view dtype, std::string_view shape,
                  std::uint64_t begin, std::uint64_t end) {
  return "\"" + std::string(name) + "\":{\"dtype\":\"" + std::string(dtype) +
         "\",\"shape\":" + std::string(shape) + ",\"data_offsets\":[" + std::to_string(begin) +
         "," + std::to_string(end) + "]}";
}

SafetensorsFile parse(std::vector<std::byte> bytes) {
  return SafetensorsFile::parse(std::move(bytes), kSource);
}

// The format_error message `f` throws, or a marker that matches no expected word.
template <class F>
std::string format_error_of(F&& f) {
  try {
    f();
  } catch (const dte::format_error& e) {
    return e.what();
  }
  return "<no dte::format_error thrown>";
}

bool contains(const std::string& text, std::string_view word) {
  return text.find(word) != std::string::npos;
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  if (!v.empty()) std::memcpy(s.data(), v.data(), s.size());
  return s;
}

std::filesystem::path fresh_temp_dir() {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             ("dte_test_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("dtype names, sizes and parsing") {
  CHECK(dte::io::dtype_name(DType::BF16) == "BF16");
  CHECK(dte::io::dtype_name(DType::I64) == "I64");
  CHECK(dte::io::dtype_size(DType::F32) == 4);
  CHECK(dte::io::dtype_size(DType::BF16) == 2);
  CHECK(dte::io::dtype_size(DType::F16) == 2);
  CHECK(dte::io::dtype_size(DType::U8) == 1);
  CHECK(dte::io::dtype_size(DType::U16) == 2);
  CHECK(dte::io::dtype_size(DType::U32) == 4);
  CHECK(dte::io::dtype_size(DType::I32) == 4);
  CHECK(dte::io::dtype_size(DType::I64) == 8);
  for (DType d : dte::io::all_dtypes) {
    CHECK(dte::io::parse_dtype(dte::io::dtype_name(d)) == d);
  }
  CHECK_FALSE(dte::io::parse_dtype("f32").has_value());
  CHECK_FALSE(dte::io::parse_dtype("F32 ").has_value());
  CHECK_FALSE(dte::io::parse_dtype("F64").has_value());
  static_assert(dte::io::dtype_of<float>() == DType::F32);
  static_assert(dte::io::dtype_of<std::uint16_t>() == DType::U16);
  static_assert(dte::io::dtype_of<std::uint8_t>() == DType::U8);
  static_assert(dte::io::dtype_of<std::uint32_t>() == DType::U32);
  static_assert(dte::io::dtype_of<std::int32_t>() == DType::I32);
  static_assert(dte::io::dtype_of<std::int64_t>() == DType::I64);
}

TEST_CASE("round trip of every dtype through the writer") {
  const std::vector<float> f32{1.5f, -2.25f, 0.0f, -0.0f, 3.0e38f, 1.0e-40f};
  const std::vector<std::uint16_t> bf16{0x3F80, 0xBF80, 0x7F80, 0x7FC1};
  const std::vector<std::uint16_t> f16{0x3C00, 0xFC00, 0x0001};
  const std::vector<std::uint8_t> u8{0, 1, 255};
  const std::vector<std::uint16_t> u16{0, 65535, 1234};
  const std::vector<std::uint32_t> u32{0, 0xFFFFFFFFu, 42};
  const std::vector<std::int32_t> i32{std::numeric_limits<std::int32_t>::min(), -1, 7};
  const std::vector<std::int64_t> i64{std::numeric_limits<std::int64_t>::min(), -1,
                                      std::numeric_limits<std::int64_t>::max()};

  SafetensorsWriter w;
  w.add<float>("f32", {2, 3}, f32);
  w.add<std::uint16_t>("bf16", {4}, bf16, DType::BF16);
  w.add<std::uint16_t>("f16", {3}, f16, DType::F16);
  w.add<std::uint8_t>("u8", {3}, u8);
  w.add<std::uint16_t>("u16", {3, 1}, u16);
  w.add<std::uint32_t>("u32", {1, 3}, u32);
  w.add<std::int32_t>("i32", {3}, i32);
  w.add<std::int64_t>("i64", {3}, i64);
  const auto bytes = w.serialize();

  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | std::to_integer<std::uint64_t>(bytes[i]);
  CHECK(n % 8 == 0);  // the writer pads the header with spaces
  CHECK(static_cast<char>(bytes[8]) == '{');

  const auto f = parse(bytes);
  REQUIRE(f.tensors().size() == 8);
  // Laid out in insertion order.
  CHECK(f.tensors()[0].name == "f32");
  CHECK(f.tensors()[7].name == "i64");
  CHECK(bytes_of(f.read_as<float>("f32")) == bytes_of(f32));  // bitwise: -0.0 and denormals
  CHECK(f.read_as<std::uint16_t>("bf16", DType::BF16) == bf16);
  CHECK(f.read_as<std::uint16_t>("f16", DType::F16) == f16);
  CHECK(f.read_as<std::uint8_t>("u8") == u8);
  CHECK(f.read_as<std::uint16_t>("u16") == u16);
  CHECK(f.read_as<std::uint32_t>("u32") == u32);
  CHECK(f.read_as<std::int32_t>("i32") == i32);
  CHECK(f.read_as<std::int64_t>("i64") == i64);
  CHECK(f.at("f32").shape == std::vector<std::uint64_t>{2, 3});
  CHECK(f.at("f32").numel() == 6);
  CHECK(f.at("bf16").dtype == DType::BF16);
  CHECK(f.metadata().empty());
  CHECK(f.source() == kSource);
  CHECK(SafetensorsFile::parse(bytes).source() == "<memory>");
}

TEST_CASE("F15: misaligned data (header length not a multiple of 8) is read by copy") {
  const std::vector<float> f32{1.0f, -2.0f, 3.5f};
  const std::vector<std::uint16_t> bf16{0x3F80, 0x4000};
  const std::vector<std::int64_t> i64{-5, std::int64_t{1} << 40};
  const std::vector<std::uint32_t> u32{7};
  const std::vector<std::uint8_t> u8{9};
  const std::vector<std::int32_t> i32{-3, 4};
  const std::vector<std::uint16_t> f16{0x3C00};
  const std::vector<std::uint16_t> u16{0xBEEF};
  const std::string data = bytes_of(f32) + bytes_of(bf16) + bytes_of(i64) + bytes_of(u32) +
                           bytes_of(u8) + bytes_of(i32) + bytes_of(f16) + bytes_of(u16);
  std::string header =
      "{" + entry("f32", "F32", "[3]", 0, 12) + "," + entry("bf16", "BF16", "[2]", 12, 16) + "," +
      entry("i64", "I64", "[2]", 16, 32) + "," + entry("u32", "U32", "[]", 32, 36) + "," +
      entry("u8", "U8", "[1]", 36, 37) + "," + entry("i32", "I32", "[1,2]", 37, 45) + "," +
      entry("f16", "F16", "[1]", 45, 47) + "," + entry("u16", "U16", "[1]", 47, 49) + "}";
  // Pad so the data section starts 1 byte past a multiple of 8: every wide value is misaligned.
  while ((8 + header.size()) % 8 != 1)
    header += " ";
  REQUIRE(header.size() % 8 != 0);

  const auto f = parse(file(header, data));
  auto address = [&](const char* name) {
    return reinterpret_cast<std::uintptr_t>(f.bytes(f.at(name)).data());
  };
  // The buffer comes from operator new (aligned to at least 8), so these are all misaligned:
  // a pointer cast would be undefined behaviour, read_as copies.
  CHECK(address("f32") % alignof(float) != 0);
  CHECK(address("i64") % alignof(std::int64_t) != 0);
  CHECK(address("bf16") % alignof(std::uint16_t) != 0);
  CHECK(address("u32") % alignof(std::uint32_t) != 0);
  CHECK(f.read_as<float>("f32") == f32);
  CHECK(f.read_as<std::uint16_t>("bf16", DType::BF16) == bf16);
  CHECK(f.read_as<std::int64_t>("i64") == i64);
  CHECK(f.read_as<std::uint32_t>("u32") == u32);
  CHECK(f.at("u32").shape.empty());
  CHECK(f.read_as<std::uint8_t>("u8") == u8);
  CHECK(f.read_as<std::int32_t>("i32") == i32);
  CHECK(f.read_as<std::uint16_t>("f16", DType::F16) == f16);
  CHECK(f.read_as<std::uint16_t>("u16") == u16);
}

TEST_CASE("metadata round trip") {
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("version", "42");
  w.set_metadata("unicode \xce\xbb", "caf\xc3\xa9 \"quoted\"\n");
  w.set_metadata("version", "43");  // the last value wins in the writer
  const std::vector<std::int32_t> v{1, 2};
  w.add<std::int32_t>("t", {2}, v);
  const auto f = parse(w.serialize());
  const std::map<std::string, std::string> expected{
      {"format", "pt"}, {"version", "43"}, {"unicode \xce\xbb", "caf\xc3\xa9 \"quoted\"\n"}};
  CHECK(f.metadata() == expected);
  CHECK(f.read_as<std::int32_t>("t") == v);
}

TEST_CASE("write() to a temporary directory, then read()") {
  const auto dir = fresh_temp_dir();
  const auto path = dir / "model.safetensors";
  const std::vector<float> a{1, 2, 3, 4};
  const std::vector<std::uint16_t> b{0x1234};
  {
    SafetensorsWriter w;
    w.add<float>("a", {2, 2}, a);
    w.set_metadata("k", "v");
    w.write(path);
  }
  {
    const auto f = SafetensorsFile::read(path);
    CHECK(f.source() == path.string());
    CHECK(f.read_as<float>("a") == a);
    CHECK(f.metadata().at("k") == "v");
  }
  {  // overwrite in place: the rename replaces the old file
    SafetensorsWriter w;
    w.add<std::uint16_t>("b", {1}, b, DType::BF16);
    w.write(path);
    const auto f = SafetensorsFile::read(path);
    CHECK(f.find("a") == nullptr);
    CHECK(f.read_as<std::uint16_t>("b", DType::BF16) == b);
    CHECK(f.metadata().empty());
  }
  // No temporary file is left behind.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir))
    ++entries;
  CHECK(entries == 1);

  // A directory that does not exist: io_error naming the path.
  SafetensorsWriter w;
  const auto bad = dir / "missing_subdir" / "x.safetensors";
  CHECK_THROWS_WITH_AS(w.write(bad), doctest::Contains(bad.c_str()), dte::io_error);
  CHECK_THROWS_WITH_AS(w.write(bad), doctest::Contains("No such file"), dte::io_error);
  // A rename that fails (the target is a non-empty directory) removes the temporary file.
  const auto occupied = dir / "occupied";
  std::filesystem::create_directories(occupied / "inner");
  CHECK_THROWS_WITH_AS(w.write(occupied), doctest::Contains("rename"), dte::io_error);
  entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir))
    ++entries;
  CHECK(entries == 2);  // model.safetensors and occupied/, no .tmp-<pid>
  std::filesystem::remove_all(dir);
}

TEST_CASE("reading a missing file is an io_error naming the path") {
  const auto dir = fresh_temp_dir();
  const auto path = dir / "does_not_exist.safetensors";
  CHECK_THROWS_WITH_AS(SafetensorsFile::read(path), doctest::Contains(path.c_str()), dte::io_error);
  CHECK_THROWS_WITH_AS(SafetensorsFile::read(path), doctest::Contains("No such file"),
                       dte::io_error);
  CHECK_THROWS_WITH_AS(SafetensorsFile::read(dir), doctest::Contains("not a regular file"),
                       dte::io_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("at() on a missing name names the file and lists the tensors") {
  SafetensorsWriter w;
  const std::vector<std::uint8_t> one{1};
  for (int i = 10; i < 22; ++i) {
    std::string name = "t";  // not "t" + to_string(): GCC 12 -O3 warns falsely (-Wrestrict)
    name += std::to_string(i);
    w.add<std::uint8_t>(name, {1}, one);
  }
  const auto f = parse(w.serialize());
  CHECK(f.find("nope") == nullptr);
  REQUIRE(f.find("t10") != nullptr);
  CHECK(f.find("t10")->name == "t10");
  CHECK(&f.at("t21") == f.find("t21"));
  CHECK_THROWS_WITH_AS((void)f.at("nope"), doctest::Contains("no tensor named 'nope'"),
                       dte::format_error);
  const auto msg = format_error_of([&] { (void)f.at("nope"); });
  CHECK(contains(msg, kSource));
  CHECK(contains(msg, "12 tensor"));
  CHECK(contains(msg, "'t10'"));
  CHECK(contains(msg, "(2 more)"));
  CHECK_FALSE(contains(msg, "'t21'"));  // the list is cut after 10 names
  CHECK_THROWS_WITH_AS((void)f.read_as<std::uint8_t>("nope"), doctest::Contains("'nope'"),
                       dte::format_error);
}

TEST_CASE("F1: files too small to hold the header length") {
  for (std::size_t size = 0; size < 8; ++size) {
    CAPTURE(size);
    CHECK_THROWS_WITH_AS(parse(std::vector<std::byte>(size)), doctest::Contains("too small"),
                         dte::format_error);
  }
  CHECK_THROWS_WITH_AS(parse(raw(5, "")), doctest::Contains("exceeds the file (size 8)"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(raw(0, "")), doctest::Contains("header length is 0"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(raw(0, "{}")), doctest::Contains("header length is 0"),
                       dte::format_error);
  CHECK(contains(format_error_of([] { parse(raw(5, "")); }), kSource));
}

TEST_CASE("F2: huge header lengths are refused before allocating") {
  for (std::uint64_t n :
       {std::numeric_limits<std::uint64_t>::max(), std::uint64_t{1} << 63,
        std::uint64_t{100'000'001}, std::numeric_limits<std::uint64_t>::max() - 7}) {
    CAPTURE(n);
    CHECK_THROWS_WITH_AS(parse(raw(n, "{}")), doctest::Contains("exceeds the limit of 100000000"),
                         dte::format_error);
    CHECK(contains(format_error_of([&] { parse(raw(n, "{}")); }), std::to_string(n)));
  }
  // The limit itself passes the first check and fails against the file size.
  CHECK_THROWS_WITH_AS(parse(raw(100'000'000, "{}")), doctest::Contains("exceeds the file"),
                       dte::format_error);
}

TEST_CASE("F3: header length beyond the file") {
  CHECK_THROWS_WITH_AS(parse(raw(100, "{\"__metadata__\":{}}")),
                       doctest::Contains("header length 100 exceeds the file (size 27)"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(raw(3, "{}")), doctest::Contains("exceeds the file (size 10)"),
                       dte::format_error);
}

TEST_CASE("F4: header must be UTF-8 JSON starting with '{', padded only with spaces") {
  // Not UTF-8: a stray 0xFF, an overlong '/', a surrogate, a truncated sequence.
  for (std::string bad :
       {"{\"\xff\":1}", "{\"\xc0\xaf\":1}", "{\"\xed\xa0\x80\":1}", "{\"\xe2\x82\":1}"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse(file(bad)), doctest::Contains("not valid UTF-8"), dte::format_error);
  }
  CHECK(contains(format_error_of([] { parse(file("{\"\xff\":1}")); }), "0xFF at header offset 2"));
  // After ASCII runs of every length around the 8-byte steps the check takes: the same offset.
  for (std::size_t run = 0; run < 20; ++run) {
    const std::string name(run, 'a');
    const std::string bad = "{\"" + name + "\xff\":1}";
    CAPTURE(run);
    CHECK(contains(format_error_of([&] { parse(file(bad)); }),
                   "0xFF at header offset " + std::to_string(2 + run)));
    // (valid UTF-8 after the run: refused for its schema, past the UTF-8 check)
    CHECK_THROWS_WITH_AS(parse(file("{\"" + name + "\xc3\xa9\":1}")),
                         doctest::Contains("must be an object"), dte::format_error);
  }
  // Not JSON.
  CHECK_THROWS_WITH_AS(parse(file("{")), doctest::Contains("followed only by spaces"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"a\" 1}")), doctest::Contains("not valid JSON"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"a\":}")), doctest::Contains("not valid JSON"),
                       dte::format_error);
  // First byte is not '{'.
  CHECK_THROWS_WITH_AS(parse(file("[1,2]")), doctest::Contains("must start with '{'"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("\"x\"")), doctest::Contains("must start with '{'"),
                       dte::format_error);
  // Leading whitespace.
  CHECK_THROWS_WITH_AS(parse(file(" {}")), doctest::Contains("leading whitespace"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("\n{}")), doctest::Contains("0x0A"), dte::format_error);
  // Trailing spaces are padding.
  CHECK(parse(file("{}")).tensors().empty());
  CHECK(parse(file("{}   ")).tensors().empty());
  CHECK(parse(file("{}      ")).tensors().empty());
  // Trailing NUL, newline, tab or garbage are not.
  CHECK_THROWS_WITH_AS(parse(file(std::string("{}\0", 3))), doctest::Contains("byte 0x00"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file(std::string("{}  \0\0\0", 7))),
                       doctest::Contains("NUL or other padding is not allowed"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{}\n")), doctest::Contains("0x0A"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{}\t ")), doctest::Contains("0x09"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{}x")), doctest::Contains("0x78"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{}{}")), doctest::Contains("not valid JSON"), dte::format_error);
  // Deep nesting is refused long before it could hurt.
  const std::string deep = "{\"__metadata__\":" + std::string(40, '[') + std::string(40, ']') + "}";
  CHECK_THROWS_WITH_AS(parse(file(deep)), doctest::Contains("nested"), dte::format_error);
}

TEST_CASE("F5: truncated data section") {
  const std::string header =
      "{" + entry("a", "U8", "[2]", 0, 2) + "," + entry("b", "F32", "[2]", 2, 10) + "}";
  CHECK(parse(file(header, std::string(10, 'x'))).tensors().size() == 2);
  CHECK_THROWS_WITH_AS(parse(file(header, std::string(9, 'x'))),
                       doctest::Contains("tensor 'b' ends at byte 10 but the data section has "
                                         "only 9 bytes; the file is truncated"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file(header, std::string(8, 'x'))), doctest::Contains("truncated"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file(header)), doctest::Contains("truncated"), dte::format_error);
}

TEST_CASE("F6: trailing bytes after the last tensor (polyglot files)") {
  const std::string header = "{" + entry("a", "U8", "[4]", 0, 4) + "}";
  CHECK(parse(file(header, "abcd")).read_as<std::uint8_t>("a").size() == 4);
  const auto bad = file(header, "abcdextra_bogus_data_for_polyglot_file");
  CHECK_THROWS_WITH_AS(parse(bad), doctest::Contains("34 trailing bytes after the last tensor"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{}", "x")), doctest::Contains("1 trailing bytes"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":\"v\"}}", "junk")),
                       doctest::Contains("trailing bytes"), dte::format_error);
}

TEST_CASE("F7: offsets must tile the data section") {
  const std::string data12(12, '\x01');
  // Overlap.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}",
                 data12)),
      doctest::Contains("tensor 'b' [4, 12) overlaps tensor 'a'"), dte::format_error);
  // Two tensors on the same bytes.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "I32", "[1]", 0, 4) + "}",
                 std::string(4, 'x'))),
      doctest::Contains("overlaps"), dte::format_error);
  // Gap.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) + "}",
                 data12)),
      doctest::Contains("gap of 4 bytes between tensor 'a'"), dte::format_error);
  // Not starting at 0.
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "F32", "[1]", 4, 8) + "}", std::string(8, 'x'))),
                       doctest::Contains("must start with a tensor at offset 0"),
                       dte::format_error);
  // end < begin.
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "F32", "[1]", 8, 4) + "}", data12)),
                       doctest::Contains("end 4 is before begin 8"), dte::format_error);
  // Beyond the file.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 4, 8) + "}",
                 std::string(4, 'x'))),
      doctest::Contains("tensor 'b' ends at byte 8"), dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "U8", "[4]", 18446744073709551611u, 18446744073709551615u) + "}",
                 "abcd")),
      doctest::Contains("offset 0"), dte::format_error);
  // Offsets must be non-negative integers.
  CHECK_THROWS_WITH_AS(
      parse(file("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}")),
      doctest::Contains("non-negative integer"), dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.0]}}", "x")),
      doctest::Contains("data_offsets end must be a non-negative integer"), dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", "x")),
      doctest::Contains("[begin, end]"), dte::format_error);
  // Unsorted in the header but tiling after sorting: valid, and tensors() is sorted by begin.
  const std::vector<float> av{7.0f}, bv{8.0f}, cv{9.0f};
  const auto f =
      parse(file("{" + entry("a", "F32", "[1]", 8, 12) + "," + entry("b", "F32", "[1]", 4, 8) +
                     "," + entry("c", "F32", "[1]", 0, 4) + "}",
                 bytes_of(cv) + bytes_of(bv) + bytes_of(av)));
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.tensors()[0].name == "c");
  CHECK(f.tensors()[1].name == "b");
  CHECK(f.tensors()[2].name == "a");
  CHECK(f.read_as<float>("a") == av);
  CHECK(f.read_as<float>("c") == cv);
}

TEST_CASE("F8: shape product and byte size overflow") {
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[4294967296,4294967296,16]", 0, 4) + "}", "abcd")),
      doctest::Contains("product of its shape overflows"), dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "U8", "[18446744073709551615,2]", 0, 4) + "}", "abcd")),
      doctest::Contains("product of its shape overflows"), dte::format_error);
  // numel fits in 64 bits but numel * 4 bytes does not.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "F32", "[4611686018427387904]", 0, 4) + "}", "abcd")),
      doctest::Contains("size in bytes (numel * dtype size) overflows"), dte::format_error);
  // A dimension past 2^64 is not an integer JSON can carry exactly.
  CHECK_THROWS_WITH_AS(
      parse(file("{" + entry("a", "U8", "[18446744073709551616]", 0, 4) + "}", "abcd")),
      doctest::Contains("shape entry must be a non-negative integer"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "U8", "[-1]", 0, 0) + "}")),
                       doctest::Contains("non-negative integer"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "U8", "3", 0, 3) + "}", "abc")),
                       doctest::Contains("shape must be an array"), dte::format_error);
}

TEST_CASE("F9: size must equal numel * dtype size") {
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "F32", "[3]", 0, 8) + "}", "12345678")),
                       doctest::Contains("data_offsets span 8 bytes but its shape and dtype F32 "
                                         "need 12"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "BF16", "[3]", 0, 3) + "}", "123")),
                       doctest::Contains("need 6"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", "U8", "[0]", 0, 1) + "}", "1")),
                       doctest::Contains("need 0"), dte::format_error);
}

TEST_CASE("F10: unknown dtype, and a dtype other than the one expected") {
  for (const char* dtype : {"F64", "f32", "BOOL", "", "F8_E4M3"}) {
    CAPTURE(dtype);
    CHECK_THROWS_WITH_AS(parse(file("{" + entry("a", dtype, "[1]", 0, 4) + "}", "abcd")),
                         doctest::Contains("unknown or unsupported dtype"), dte::format_error);
  }
  CHECK_THROWS_WITH_AS(
      parse(file("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd")),
      doctest::Contains("dtype must be a string"), dte::format_error);

  const auto f =
      parse(file("{" + entry("w", "BF16", "[2]", 0, 4) + "," + entry("i", "I32", "[1]", 4, 8) + "}",
                 "abcdefgh"));
  CHECK(f.read_as<std::uint16_t>("w", DType::BF16).size() == 2);
  CHECK_THROWS_WITH_AS((void)f.read_as<std::uint16_t>("w", DType::F16),
                       doctest::Contains("tensor 'w' has dtype BF16 but F16 was expected"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS((void)f.read_as<std::uint16_t>("w"),
                       doctest::Contains("has dtype BF16 but U16"), dte::format_error);
  CHECK_THROWS_WITH_AS((void)f.read_as<float>("i"), doctest::Contains("has dtype I32 but F32"),
                       dte::format_error);
  CHECK(contains(format_error_of([&] { (void)f.read_as<float>("i"); }), kSource));
  // An element type whose size cannot hold the dtype is the caller's mistake.
  CHECK_THROWS_AS((void)f.read_as<float>("w", DType::BF16), dte::invalid_argument);
}

TEST_CASE("F11: duplicate keys are refused") {
  const std::string a = entry("a", "U8", "[1]", 0, 1);
  CHECK_THROWS_WITH_AS(parse(file("{" + a + "," + a + "}", "x")),
                       doctest::Contains("duplicate key 'a'"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + a + "," + entry("a", "U8", "[0]", 1, 1) + "}", "x")),
                       doctest::Contains("duplicate key 'a' in the header"), dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{\"__metadata__\":{\"k\":\"1\"},\"__metadata__\":{\"k\":\"2\"}}")),
      doctest::Contains("duplicate key '__metadata__'"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}")),
                       doctest::Contains("duplicate key 'k' inside a header object"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(
      parse(file("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                 "x")),
      doctest::Contains("duplicate key 'dtype'"), dte::format_error);
  // The same key in two different objects is not a duplicate.
  CHECK(parse(file("{\"__metadata__\":{\"dtype\":\"x\"}," + a + "}", "x")).metadata().at("dtype") ==
        "x");
}

TEST_CASE("F12: __metadata__ must map strings to strings") {
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":1}}")),
                       doctest::Contains("__metadata__ value for key 'k' must be a string"),
                       dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}")),
                       doctest::Contains("found object (nested"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":null}}")),
                       doctest::Contains("found null"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":{\"k\":[\"a\"]}}")),
                       doctest::Contains("found array"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"__metadata__\":\"pt\"}")),
                       doctest::Contains("__metadata__ must be an object"), dte::format_error);
  CHECK(parse(file("{\"__metadata__\":{}}")).metadata().empty());
}

TEST_CASE("F13: strict schema for tensor entries (reader refuses, writer cannot produce)") {
  CHECK_THROWS_WITH_AS(
      parse(
          file("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":1}}", "x")),
      doctest::Contains("unknown key 'extra'"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "x")),
                       doctest::Contains("has no \"data_offsets\""), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{\"a\":[0,1]}", "x")),
                       doctest::Contains("must be an object with dtype"), dte::format_error);
  CHECK_THROWS_WITH_AS(parse(file("{" + entry("", "U8", "[1]", 0, 1) + "}", "x")),
                       doctest::Contains("empty name"), dte::format_error);

  // The writer refuses what the reader would refuse, before adding anything.
  SafetensorsWriter w;
  const std::vector<float> two{1, 2};
  w.add<float>("a", {2}, two);
  CHECK_THROWS_WITH_AS(w.add<float>("a", {2}, two), doctest::Contains("already added"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("__metadata__", {2}, two), doctest::Contains("reserved"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("", {2}, two), doctest::Contains("empty"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("b", {3}, two), doctest::Contains("need 12"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("b", {1ULL << 62, 8}, two), doctest::Contains("overflows"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("b", {1ULL << 62}, two), doctest::Contains("more than 2^64"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("b", {2}, two, DType::BF16), doctest::Contains("BF16"),
                       dte::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add<float>("bad\xff", {2}, two), doctest::Contains("UTF-8"),
                       dte::invalid_argument);
  CHECK_THROWS_AS(w.set_metadata("k", "\xc0\xaf"), dte::invalid_argument);
  const auto f = parse(w.serialize());
  CHECK(f.tensors().size() == 1);  // nothing was added by the refused calls
}

TEST_CASE("F14: no tensors, zero-size tensors and rank-0 scalars are valid") {
  {
    const auto f = parse(file("{\"__metadata__\":{\"k\":\"v\"}}"));
    CHECK(f.tensors().empty());
    CHECK(f.metadata().at("k") == "v");
  }
  {
    SafetensorsWriter w;
    w.set_metadata("only", "metadata");
    const auto f = parse(w.serialize());
    CHECK(f.tensors().empty());
    CHECK(f.metadata().size() == 1);
    CHECK(SafetensorsWriter{}.serialize().size() == 16);  // "{}" padded to 8 bytes
    CHECK(parse(SafetensorsWriter{}.serialize()).tensors().empty());
  }
  {
    const auto f = parse(file("{" + entry("empty", "F32", "[0,3]", 4, 4) + "," +
                                  entry("scalar", "I64", "[]", 4, 12) + "," +
                                  entry("first", "F32", "[1]", 0, 4) + "," +
                                  entry("tail", "U8", "[2,0]", 12, 12) + "}",
                              std::string(4, 'a') + std::string(8, '\x02')));
    REQUIRE(f.tensors().size() == 4);
    CHECK(f.at("empty").numel() == 0);
    CHECK(f.read_as<float>("empty").empty());
    CHECK(f.bytes(f.at("empty")).empty());
    CHECK(f.at("scalar").numel() == 1);
    CHECK(f.at("scalar").shape.empty());
    CHECK(f.read_as<std::int64_t>("scalar") == std::vector<std::int64_t>{0x0202020202020202});
    CHECK(f.read_as<std::uint8_t>("tail").empty());
  }
  {
    SafetensorsWriter w;
    const std::vector<std::int32_t> none;
    const std::vector<std::int32_t> scalar{-9};
    w.add<std::int32_t>("z", {5, 0}, none);
    w.add<std::int32_t>("s", {}, scalar);
    const auto f = parse(w.serialize());
    CHECK(f.at("z").shape == std::vector<std::uint64_t>{5, 0});
    CHECK(f.read_as<std::int32_t>("z").empty());
    CHECK(f.read_as<std::int32_t>("s") == scalar);
  }
  // A zero in the shape makes the tensor empty even if the other dimensions are huge.
  CHECK(parse(file("{" + entry("z", "F32", "[0,18446744073709551615]", 0, 0) + "}"))
            .at("z")
            .numel() == 0);
}

TEST_CASE("property: random files survive serialize -> parse -> serialize unchanged") {
  std::mt19937_64 rng(0x5AFE7E45);
  auto uniform = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  const std::vector<std::string> pieces{"a",
                                        "b",
                                        "z",
                                        "0",
                                        "9",
                                        ".",
                                        "_",
                                        "-",
                                        "/",
                                        " ",
                                        "\xc3\xa9",
                                        "\xce\xbb",
                                        "\xe2\x82\xac",
                                        "\xf0\x9f\x98\x80",
                                        "\\",
                                        "\""};
  auto random_text = [&](std::size_t min_len) {
    std::string s;
    const auto len = uniform(min_len, 10);
    for (std::uint64_t i = 0; i < len; ++i)
      s += pieces[uniform(0, pieces.size() - 1)];
    return s;
  };

  struct Tensor {
    DType dtype;
    std::vector<std::uint64_t> shape;
    std::vector<std::byte> data;
  };
  for (int iter = 0; iter < 200; ++iter) {
    CAPTURE(iter);
    SafetensorsWriter w;
    std::vector<std::string> order;
    std::map<std::string, Tensor> expected;
    std::map<std::string, std::string> metadata;
    const auto count = uniform(0, 8);
    for (std::uint64_t t = 0; t < count; ++t) {
      std::string name = random_text(1);
      if (expected.contains(name) || name == "__metadata__") continue;
      Tensor tensor;
      tensor.dtype = dte::io::all_dtypes[uniform(0, 7)];
      const auto rank = uniform(0, 4);
      std::uint64_t numel = 1;
      for (std::uint64_t r = 0; r < rank; ++r) {
        tensor.shape.push_back(uniform(0, 9) == 0 ? 0 : uniform(1, 5));
        numel *= tensor.shape.back();
      }
      tensor.data.resize(numel * dte::io::dtype_size(tensor.dtype));
      for (auto& b : tensor.data)
        b = static_cast<std::byte>(uniform(0, 255));
      w.add(name, tensor.dtype, tensor.shape, tensor.data);
      order.push_back(name);
      expected.emplace(name, std::move(tensor));
    }
    const auto meta_count = uniform(0, 3);
    for (std::uint64_t m = 0; m < meta_count; ++m) {
      auto key = random_text(0);
      auto value = random_text(0);
      metadata[key] = value;
      w.set_metadata(key, value);
    }

    const auto bytes = w.serialize();
    const auto f = parse(bytes);
    CHECK(f.metadata() == metadata);
    REQUIRE(f.tensors().size() == expected.size());
    std::uint64_t previous_begin = 0;
    for (const TensorInfo& info : f.tensors()) {
      CHECK(info.begin >= previous_begin);  // sorted by begin
      previous_begin = info.begin;
      REQUIRE(expected.contains(info.name));
      const Tensor& want = expected.at(info.name);
      CHECK(info.dtype == want.dtype);
      CHECK(info.shape == want.shape);
      const auto got = f.bytes(info);
      CHECK(std::equal(got.begin(), got.end(), want.data.begin(), want.data.end()));
    }

    // Rebuilding from the parsed file in the same insertion order gives the same bytes.
    SafetensorsWriter again;
    for (const auto& name : order) {
      const TensorInfo& info = f.at(name);
      again.add(info.name, info.dtype, info.shape, f.bytes(info));
    }
    for (const auto& [k, v] : f.metadata())
      again.set_metadata(k, v);
    CHECK(again.serialize() == bytes);

    // Cutting or extending the file by one byte is always refused.
    auto shorter = bytes;
    shorter.pop_back();
    CHECK_THROWS_AS(parse(shorter), dte::format_error);
    auto longer = bytes;
    longer.push_back(std::byte{0});
    CHECK_THROWS_AS(parse(longer), dte::format_error);
  }
}

// The plain-form reader (io/safetensors_header.hpp) accepts only headers the strict parser reads
// the same way: over every single-byte mutation of writer-made headers into characters that
// matter to JSON, whatever the plain reader accepts, the strict parser (parse_strict, the schema)
// accepts with the same entries and metadata. Both outcomes occur, so the check is not vacuous.
TEST_CASE("plain header reader: accepts a subset of the strict parser, with the same entries") {
  using dte::io::detail::HeaderEntry;
  using dte::io::detail::PlainHeader;
  // The strict reading of `text` as (entries by name, metadata), or false where it refuses.
  const auto strict = [](std::string_view text, PlainHeader& out) {
    out = {};
    nlohmann::json j;
    try {
      j = dte::io::parse_strict(text, kSource, "header", 16);
    } catch (const dte::format_error&) {
      return false;
    }
    if (!j.is_object()) return false;
    for (const auto& [key, value] : j.items()) {
      if (key == "__metadata__") {
        if (!value.is_object()) return false;
        for (const auto& [k, v] : value.items()) {
          if (!v.is_string()) return false;
          out.metadata.emplace(k, v.get<std::string>());
        }
        continue;
      }
      if (!value.is_object() || value.size() != 3 || !value.contains("dtype") ||
          !value.contains("shape") || !value.contains("data_offsets") ||
          !value["dtype"].is_string() || !value["shape"].is_array() ||
          !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) {
        return false;
      }
      HeaderEntry e;
      e.name = key;
      e.dtype = value["dtype"].get<std::string>();
      for (const auto& d : value["shape"]) {
        if (!d.is_number_unsigned()) return false;
        e.shape.push_back(d.get<std::uint64_t>());
      }
      for (std::size_t k = 0; k < 2; ++k) {
        const auto& d = value["data_offsets"][k];
        if (!d.is_number_unsigned()) return false;
        e.offsets[k] = d.get<std::uint64_t>();
      }
      out.tensors.push_back(std::move(e));
    }
    return true;  // (json objects iterate in key order: the entries are sorted by name)
  };
  SafetensorsWriter w;
  w.set_metadata("dte.format", "chunk-v1");
  w.set_metadata("dte.version", "12");
  const std::vector<std::uint8_t> index{1, 2, 3}, hi(10, 7);
  const std::vector<std::uint16_t> b(6, 1);
  w.add<std::uint8_t>("a.weight:index", {3}, index);
  w.add<std::uint8_t>("a.weight:value_hi", {10}, hi);
  w.add<std::uint16_t>("b", {2, 3}, b, DType::BF16);
  const std::vector<std::byte> file = w.serialize();
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  std::string header(reinterpret_cast<const char*>(file.data()) + 8, n);
  while (header.back() == ' ')
    header.pop_back();
  const std::string spaced =
      "{ \"x\" : {\"shape\" :[ 4 ,5],\t\"dtype\":\"F32\",\n\"data_offsets\""
      ":[0 , 80]} , \"__metadata__\":{}}";
  const std::string alphabet = "\"\\{}[],:0123456789 \t\n-.eEaxu\x01";
  int accepted = 0, refused = 0;
  for (const std::string& base : {header, spaced}) {
    PlainHeader plain, reference;
    REQUIRE(dte::io::detail::read_plain_header(base, plain));
    REQUIRE(strict(base, reference));
    for (std::size_t at = 0; at < base.size(); ++at) {
      for (const char c : alphabet) {
        std::string text = base;
        text[at] = c;
        if (!dte::io::detail::read_plain_header(text, plain)) {
          ++refused;
          continue;
        }
        ++accepted;
        INFO(text);
        REQUIRE(strict(text, reference));
        REQUIRE(plain.metadata == reference.metadata);
        REQUIRE(plain.tensors.size() == reference.tensors.size());
        for (std::size_t k = 0; k < plain.tensors.size(); ++k) {
          CHECK(plain.tensors[k].name == reference.tensors[k].name);
          CHECK(plain.tensors[k].dtype == reference.tensors[k].dtype);
          CHECK(plain.tensors[k].shape == reference.tensors[k].shape);
          CHECK(plain.tensors[k].offsets == reference.tensors[k].offsets);
        }
      }
    }
  }
  CHECK(accepted > 1000);
  CHECK(refused > 1000);
}
