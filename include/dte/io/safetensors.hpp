// SPDX-License-Identifier: Apache-2.0
#pragma once

// Reader and writer for the safetensors format (https://github.com/huggingface/safetensors):
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header][data section]
//
// The header is a JSON object. The optional key "__metadata__" maps to an object of string to
// string; every other key names a tensor and maps to
//   {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with byte offsets relative to the start of the data section.
//
// The reader is strict: the file is untrusted input and everything is validated when it is
// opened, before any tensor is handed out.
//   * N is checked against a 100,000,000-byte limit and against the file size before anything is
//     allocated from it.
//   * The header starts with '{' (no leading whitespace), is valid UTF-8 and valid JSON, and
//     may only be followed by spaces (0x20) as padding.
//   * Duplicate keys are refused at every level (JSON parsers silently keep the last one, so two
//     readers could disagree on which tensor a name means).
//   * Tensor entries have exactly the keys "dtype", "shape" and "data_offsets" (a strict schema:
//     unknown extra keys are refused rather than ignored, unlike the Rust reference reader, so
//     nothing in the header goes unchecked). Only the dtypes in `DType` are accepted.
//   * numel * dtype size is computed with overflow checks and must equal end - begin.
//   * Sorted by begin, the tensors tile the data section exactly: no overlap (two tensors sharing
//     bytes), no gap, no trailing bytes after the last tensor (polyglot files) and no truncation.
//
// Values are little-endian, as the format requires; data may sit at any alignment (the header
// length need not be a multiple of 8), so elements are copied out with memcpy.

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/io/json.hpp"
#include "dte/io/safetensors_header.hpp"

namespace dte::io {

static_assert(std::endian::native == std::endian::little,
              "dte::io reads safetensors values in place and needs a little-endian host");

// Element types dte reads and writes, spelled as in safetensors.
enum class DType : std::uint8_t { F32, BF16, F16, U8, U16, U32, I32, I64 };

inline constexpr DType all_dtypes[] = {DType::F32, DType::BF16, DType::F16, DType::U8,
                                       DType::U16, DType::U32,  DType::I32, DType::I64};

// The header may be at most this long; longer ones are refused before anything is allocated.
inline constexpr std::uint64_t max_header_size = 100'000'000;

inline std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::U8:
      return "U8";
    case DType::U16:
      return "U16";
    case DType::U32:
      return "U32";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  throw invalid_argument("dte::io::dtype_name: DType value " +
                         std::to_string(static_cast<unsigned>(dtype)) + " is not a known dtype");
}

// Bytes per element; 0 for a value outside the enum.
inline std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::U8:
      return 1;
    case DType::BF16:
    case DType::F16:
    case DType::U16:
      return 2;
    case DType::F32:
    case DType::U32:
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
  }
  return 0;
}

// The DType spelled exactly `name` ("F32", "BF16", ...), or nothing.
inline std::optional<DType> parse_dtype(std::string_view name) {
  for (DType dtype : all_dtypes) {
    if (dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

namespace detail {
template <class>
inline constexpr bool dependent_false = false;
}  // namespace detail

// The natural DType of an element type. BF16 and F16 have no C++ type here: pass their bits as
// std::uint16_t together with an explicit DType.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) {
    return DType::F32;
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return DType::U8;
  } else if constexpr (std::is_same_v<T, std::uint16_t>) {
    return DType::U16;
  } else if constexpr (std::is_same_v<T, std::uint32_t>) {
    return DType::U32;
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return DType::I32;
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return DType::I64;
  } else {
    static_assert(detail::dependent_false<T>,
                  "dtype_of<T>: T has no safetensors dtype (use float, uint8_t, uint16_t, "
                  "uint32_t, int32_t or int64_t, and pass BF16/F16 bits as uint16_t)");
    return DType::U8;
  }
}

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte offsets within the data section

  // Product of the shape (1 for a rank-0 scalar). Exact for every tensor a SafetensorsFile holds,
  // since the product was checked for overflow when the file was parsed.
  [[nodiscard]] std::uint64_t numel() const noexcept {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape)
      n *= d;
    return n;
  }

  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

namespace detail {

// Length of the valid UTF-8 prefix of `s` (RFC 3629: no overlong forms, no surrogates, nothing
// above U+10FFFF); s.size() when all of it is valid.
inline std::size_t utf8_valid_prefix(std::string_view s) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    // (ASCII eight bytes at a time: a header is nearly all ASCII, and is read per chunk)
    while (n - i >= 8) {
      std::uint64_t w = 0;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) != 0) break;
      i += 8;
    }
    if (i == n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return n;
}

inline bool is_utf8(std::string_view s) noexcept {
  return utf8_valid_prefix(s) == s.size();
}

// a * b, or nothing when it does not fit in 64 bits.
inline std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return std::nullopt;
  return a * b;
}

inline std::string hex_byte(unsigned char c) {
  constexpr char digits[] = "0123456789ABCDEF";
  return std::string{'0', 'x', digits[c >> 4], digits[c & 0xF]};
}

inline std::uint64_t get_index(const nlohmann::json& v, const std::string& where,
                               const std::string& what) {
  if (!v.is_number_unsigned()) {
    throw format_error(where + ": " + what + " must be a non-negative integer, found " +
                       quote_name(v.dump()));
  }
  return v.get<std::uint64_t>();
}

}  // namespace detail

// A safetensors file held in memory and validated when it was read or parsed; every accessor
// after that is cheap and refers to bytes that were checked.
class SafetensorsFile {
 public:
  // Reads the whole file, then parses it. dte::io_error when the OS refuses; format_error when
  // the bytes are not a valid file.
  static SafetensorsFile read(const std::filesystem::path& path) {
    const std::string name = path.string();
    detail::FdGuard fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      const int err = errno;
      throw io_error("cannot open safetensors file '" + name + "': " + detail::errno_text(err));
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      const int err = errno;
      throw io_error("cannot stat safetensors file '" + name + "': " + detail::errno_text(err));
    }
    if (!S_ISREG(st.st_mode)) {
      throw io_error("cannot read safetensors file '" + name + "': not a regular file");
    }
    // (a file that shrank while we read it: parse what is there)
    return parse(detail::read_up_to(fd.get(), static_cast<std::size_t>(st.st_size),
                                    "safetensors file", name),
                 name);
  }

  // Parses and validates `bytes`; `source` names them in error messages.
  static SafetensorsFile parse(std::vector<std::byte> bytes, std::string source = "<memory>") {
    const std::size_t size = bytes.size();
    return parse(std::move(bytes), size, std::move(source));
  }

  // The file in bytes[0, size); what follows is not part of it (a buffer reused at its largest
  // size, so that it is not filled with zeros again; release() gives it back whole).
  static SafetensorsFile parse(std::vector<std::byte> bytes, std::size_t size, std::string source) {
    if (size > bytes.size()) {
      throw invalid_argument("SafetensorsFile::parse: the file's " + std::to_string(size) +
                             " bytes do not fit the " + std::to_string(bytes.size()) +
                             " bytes given");
    }
    SafetensorsFile file;
    file.bytes_ = std::move(bytes);
    file.size_ = size;
    file.source_ = std::move(source);
    file.validate();
    return file;
  }

  // The file's bytes back (the file is empty afterwards): for a caller that reuses the buffer.
  [[nodiscard]] std::vector<std::byte> release() && noexcept { return std::move(bytes_); }

  // Every tensor, sorted by begin offset.
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }

  [[nodiscard]] const TensorInfo* find(std::string_view name) const noexcept {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }

  // The tensor called `name`; format_error naming the file and the available tensors otherwise.
  [[nodiscard]] const TensorInfo& at(std::string_view name) const {
    if (const TensorInfo* info = find(name)) return *info;
    std::string msg = source_ + ": no tensor named " + detail::quote_name(name) +
                      "; the file has " + std::to_string(tensors_.size()) + " tensor(s)";
    constexpr std::size_t max_listed = 10;
    std::size_t listed = 0;
    for (const auto& [n, i] : index_) {
      if (listed == max_listed) {
        msg += ", ... (" + std::to_string(tensors_.size() - max_listed) + " more)";
        break;
      }
      msg += (listed == 0 ? ": " : ", ") + detail::quote_name(n);
      ++listed;
    }
    throw format_error(msg);
  }

  // The raw little-endian bytes of a tensor of this file. They may be misaligned for the dtype:
  // copy them out (memcpy) rather than casting the pointer.
  [[nodiscard]] std::span<const std::byte> bytes(const TensorInfo& info) const noexcept {
    return std::span<const std::byte>(bytes_).subspan(
        static_cast<std::size_t>(data_start_ + info.begin),
        static_cast<std::size_t>(info.end - info.begin));
  }

  // A copy of the elements of tensor `name`. format_error if it is missing or its dtype is not
  // `expected`; invalid_argument if sizeof(T) does not match `expected`.
  template <class T>
  [[nodiscard]] std::vector<T> read_as(std::string_view name,
                                       DType expected = dtype_of<T>()) const {
    static_assert(std::is_trivially_copyable_v<T>, "read_as<T>: T must be trivially copyable");
    if (sizeof(T) != dtype_size(expected)) {
      throw invalid_argument("read_as: element type of " + std::to_string(sizeof(T)) +
                             " bytes cannot hold dtype " + std::string(dtype_name(expected)) +
                             " (" + std::to_string(dtype_size(expected)) + " bytes)");
    }
    const TensorInfo& info = at(name);
    if (info.dtype != expected) {
      throw format_error(source_ + ": tensor " + detail::quote_name(info.name) + " has dtype " +
                         std::string(dtype_name(info.dtype)) + " but " +
                         std::string(dtype_name(expected)) +
                         " was expected; convert the checkpoint or read it with the matching "
                         "dtype");
    }
    const auto src = bytes(info);
    std::vector<T> out(src.size() / sizeof(T));
    if (!src.empty()) std::memcpy(out.data(), src.data(), src.size());
    return out;
  }

  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept {
    return metadata_;
  }

  // The path the bytes came from, or the name given to parse().
  [[nodiscard]] const std::string& source() const noexcept { return source_; }

 private:
  SafetensorsFile() = default;

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error(source_ + ": " + what);
  }

  void validate() {
    const std::uint64_t size = size_;
    if (size < 8) {
      fail("file is too small to be safetensors (" + std::to_string(size) +
           " bytes; the 8-byte header length alone needs 8)");
    }
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i)
      n = (n << 8) | std::to_integer<std::uint64_t>(bytes_[i]);
    if (n == 0) fail("header length is 0; a safetensors header is at least '{}'");
    if (n > max_header_size) {
      fail("header length " + std::to_string(n) + " exceeds the limit of " +
           std::to_string(max_header_size) + " bytes; the file is corrupt or not safetensors");
    }
    if (n > size - 8) {
      fail("header length " + std::to_string(n) + " exceeds the file (size " +
           std::to_string(size) + "); the file is truncated or not safetensors");
    }
    data_start_ = 8 + n;
    const std::uint64_t data_size = size - data_start_;

    const std::string_view header(reinterpret_cast<const char*>(bytes_.data()) + 8,
                                  static_cast<std::size_t>(n));
    if (header.front() != '{') {
      fail("header must start with '{' but starts with byte " +
           detail::hex_byte(static_cast<unsigned char>(header.front())) +
           " (leading whitespace is not allowed)");
    }
    if (const std::size_t ok = detail::utf8_valid_prefix(header); ok != header.size()) {
      fail("header is not valid UTF-8 (bad byte " +
           detail::hex_byte(static_cast<unsigned char>(header[ok])) + " at header offset " +
           std::to_string(ok) + ")");
    }
    const std::size_t last = header.find_last_not_of(' ');  // not npos: header[0] is '{'
    if (header[last] != '}') {
      fail(
          "header must be a JSON object followed only by spaces (0x20) as padding, but it ends "
          "with byte " +
          detail::hex_byte(static_cast<unsigned char>(header[last])) + " at header offset " +
          std::to_string(last) + " (NUL or other padding is not allowed; incomplete JSON?)");
    }
    // The plain form every writer produces is read without a JSON library; anything else
    // goes through the strict parser, which decides and words the refusal
    // (io/safetensors_header.hpp). Entries are checked in name order either way, so both name the
    // same first bad one.
    const std::string_view text = header.substr(0, last + 1);
    detail::PlainHeader plain;
    if (detail::read_plain_header(text, plain)) {
      metadata_ = std::move(plain.metadata);
      tensors_.reserve(plain.tensors.size());
      for (detail::HeaderEntry& e : plain.tensors)
        tensors_.push_back(check_entry(std::move(e)));
    } else {
      const nlohmann::json json = parse_strict(text, source_, "header", 16);
      if (!json.is_object()) fail("header is not a JSON object");
      for (const auto& [key, value] : json.items()) {
        if (key == "__metadata__") {
          read_metadata(value);
        } else {
          tensors_.push_back(check_entry(read_entry(key, value)));
        }
      }
    }

    std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
    std::uint64_t cursor = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& t : tensors_) {
      if (t.begin < cursor) {
        fail("tensor " + detail::quote_name(t.name) + " [" + std::to_string(t.begin) + ", " +
             std::to_string(t.end) + ") overlaps tensor " + detail::quote_name(previous->name) +
             " which ends at " + std::to_string(cursor) + "; tensors must not share bytes");
      }
      if (t.begin > cursor) {
        if (previous == nullptr) {
          fail("the first tensor " + detail::quote_name(t.name) + " begins at " +
               std::to_string(t.begin) +
               " but the data section must start with a tensor at offset 0");
        }
        fail("gap of " + std::to_string(t.begin - cursor) + " bytes between tensor " +
             detail::quote_name(previous->name) + " (ends at " + std::to_string(cursor) +
             ") and tensor " + detail::quote_name(t.name) + " (begins at " +
             std::to_string(t.begin) + "); tensors must tile the data section");
      }
      if (t.end > data_size) {
        fail("tensor " + detail::quote_name(t.name) + " ends at byte " + std::to_string(t.end) +
             " but the data section has only " + std::to_string(data_size) +
             " bytes; the file is truncated");
      }
      cursor = t.end;
      previous = &t;
    }
    if (cursor != data_size) {
      fail(std::to_string(data_size - cursor) + " trailing bytes after the last tensor (data " +
           "ends at " + std::to_string(cursor) + ", data section is " + std::to_string(data_size) +
           " bytes); refusing a file that carries unaccounted data (polyglot file?)");
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      index_.emplace(tensors_[i].name, i);
  }

  void read_metadata(const nlohmann::json& value) {
    if (!value.is_object()) {
      fail("__metadata__ must be an object of string to string, found " +
           std::string(value.type_name()));
    }
    for (const auto& [k, v] : value.items()) {
      if (!v.is_string()) {
        fail("__metadata__ value for key " + detail::quote_name(k) + " must be a string, found " +
             std::string(v.type_name()) +
             " (nested or non-string metadata is not allowed; encode it as a string)");
      }
      metadata_.emplace(k, v.get<std::string>());
    }
  }

  // A tensor entry of the strict parser's JSON as written, its schema checked.
  detail::HeaderEntry read_entry(const std::string& name, const nlohmann::json& value) const {
    const std::string what = "tensor " + detail::quote_name(name);
    if (name.empty()) fail("a tensor has an empty name");
    if (!value.is_object()) {
      fail(what + " must be an object with dtype, shape and data_offsets, found " +
           std::string(value.type_name()));
    }
    for (const auto& [k, v] : value.items()) {
      if (k != "dtype" && k != "shape" && k != "data_offsets") {
        fail(what + " has unknown key " + detail::quote_name(k) +
             "; only dtype, shape and data_offsets are allowed (strict schema)");
      }
    }
    for (const char* required : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(required)) fail(what + " has no \"" + required + "\"");
    }
    detail::HeaderEntry e;
    e.name = name;
    const auto& dtype = value["dtype"];
    if (!dtype.is_string()) fail(what + ": dtype must be a string");
    e.dtype = dtype.get<std::string>();
    const auto& shape = value["shape"];
    if (!shape.is_array()) fail(what + ": shape must be an array of non-negative integers");
    e.shape.reserve(shape.size());
    for (const auto& d : shape)
      e.shape.push_back(detail::get_index(d, source_, what + ": each shape entry"));
    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2) {
      fail(what + ": data_offsets must be an array [begin, end]");
    }
    e.offsets = {detail::get_index(offsets[0], source_, what + ": data_offsets begin"),
                 detail::get_index(offsets[1], source_, what + ": data_offsets end")};
    return e;
  }

  // A tensor entry as written (schema already checked) as a TensorInfo: its dtype known, its
  // size free of overflow, its offsets spanning exactly its bytes.
  TensorInfo check_entry(detail::HeaderEntry e) const {
    // (the refusal's words are made only for a refusal: this runs per entry of every chunk)
    const auto what = [&] { return "tensor " + detail::quote_name(e.name); };
    if (e.name.empty()) fail("a tensor has an empty name");
    const auto parsed = parse_dtype(e.dtype);
    if (!parsed) {
      std::string known;
      for (DType d : all_dtypes)
        known += (known.empty() ? "" : ", ") + std::string(dtype_name(d));
      fail(what() + " has unknown or unsupported dtype " + detail::quote_name(e.dtype) +
           " (supported: " + known + ")");
    }
    TensorInfo info;
    info.dtype = *parsed;
    info.shape = std::move(e.shape);
    // A tensor with a 0 in its shape is empty however large its other dimensions are.
    std::uint64_t numel = 1;
    if (std::find(info.shape.begin(), info.shape.end(), std::uint64_t{0}) != info.shape.end()) {
      numel = 0;
    } else {
      for (std::uint64_t d : info.shape) {
        const auto next = detail::checked_mul(numel, d);
        if (!next) fail(what() + ": the product of its shape overflows 64 bits");
        numel = *next;
      }
    }
    const auto nbytes = detail::checked_mul(numel, dtype_size(info.dtype));
    if (!nbytes) fail(what() + ": its size in bytes (numel * dtype size) overflows 64 bits");
    info.begin = e.offsets[0];
    info.end = e.offsets[1];
    if (info.end < info.begin) {
      fail(what() + ": data_offsets end " + std::to_string(info.end) + " is before begin " +
           std::to_string(info.begin));
    }
    if (info.end - info.begin != *nbytes) {
      fail(what() + ": data_offsets span " + std::to_string(info.end - info.begin) +
           " bytes but its shape and dtype " + std::string(dtype_name(info.dtype)) + " need " +
           std::to_string(*nbytes) + " (numel " + std::to_string(numel) + " * " +
           std::to_string(dtype_size(info.dtype)) + ")");
    }
    info.name = std::move(e.name);
    return info;
  }

  std::vector<std::byte> bytes_;
  std::size_t size_ = 0;  // the file: bytes_[0, size_)
  std::string source_;
  std::uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file. Tensors are laid out in insertion order; the header is padded with
// spaces so the data section starts at a multiple of 8 bytes. Bad input throws
// dte::invalid_argument before anything is added.
class SafetensorsWriter {
 public:
  void add(std::string name, DType dtype, std::vector<std::uint64_t> shape,
           std::span<const std::byte> data) {
    if (name.empty()) throw invalid_argument("SafetensorsWriter::add: tensor name is empty");
    const std::string what = "SafetensorsWriter::add: tensor " + detail::quote_name(name);
    if (!detail::is_utf8(name)) throw invalid_argument(what + ": name is not valid UTF-8");
    if (name == "__metadata__") {
      throw invalid_argument(what + ": the name is reserved for the metadata; use set_metadata");
    }
    if (names_.contains(name)) throw invalid_argument(what + " was already added");
    if (dtype_size(dtype) == 0) throw invalid_argument(what + ": unknown DType value");
    std::uint64_t numel = 1;
    if (std::find(shape.begin(), shape.end(), std::uint64_t{0}) != shape.end()) {
      numel = 0;
    } else {
      for (std::uint64_t d : shape) {
        const auto next = detail::checked_mul(numel, d);
        if (!next) throw invalid_argument(what + ": the product of its shape overflows 64 bits");
        numel = *next;
      }
    }
    const auto nbytes = detail::checked_mul(numel, dtype_size(dtype));
    if (!nbytes || *nbytes != data.size()) {
      throw invalid_argument(what + ": " + std::to_string(data.size()) +
                             " bytes given but shape and dtype " + std::string(dtype_name(dtype)) +
                             " need " +
                             (nbytes ? std::to_string(*nbytes) : std::string("more than 2^64")));
    }
    names_.insert(name);
    entries_.push_back(Entry{std::move(name), dtype, std::move(shape), {data.begin(), data.end()}});
  }

  template <class T>
  void add(std::string name, std::vector<std::uint64_t> shape, std::span<const T> values,
           DType dtype = dtype_of<T>()) {
    static_assert(std::is_trivially_copyable_v<T>, "add<T>: T must be trivially copyable");
    if (sizeof(T) != dtype_size(dtype)) {
      throw invalid_argument("SafetensorsWriter::add: tensor " + detail::quote_name(name) + ": " +
                             std::to_string(sizeof(T)) + "-byte elements cannot be stored as " +
                             std::string(dtype_name(dtype)));
    }
    add(std::move(name), dtype, std::move(shape), std::as_bytes(values));
  }

  void set_metadata(std::string key, std::string value) {
    if (!detail::is_utf8(key) || !detail::is_utf8(value)) {
      throw invalid_argument("SafetensorsWriter::set_metadata: key " + detail::quote_name(key) +
                             " or its value is not valid UTF-8");
    }
    metadata_.insert_or_assign(std::move(key), std::move(value));
  }

  // The whole file.
  [[nodiscard]] std::vector<std::byte> serialize() const {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::uint64_t offset = 0;
    for (const Entry& e : entries_) {
      const std::uint64_t end = offset + e.data.size();
      header[e.name] = {
          {"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, end}}};
      offset = end;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    if (text.size() > max_header_size) {
      throw invalid_argument("SafetensorsWriter: the header would be " +
                             std::to_string(text.size()) + " bytes, over the limit of " +
                             std::to_string(max_header_size) + "; split the file");
    }
    std::vector<std::byte> out;
    out.reserve(static_cast<std::size_t>(8 + text.size() + offset));
    const std::uint64_t n = text.size();
    for (int i = 0; i < 8; ++i)
      out.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xFF));
    const auto* chars = reinterpret_cast<const std::byte*>(text.data());
    out.insert(out.end(), chars, chars + text.size());
    for (const Entry& e : entries_)
      out.insert(out.end(), e.data.begin(), e.data.end());
    return out;
  }

  // Writes atomically (io/file.hpp): a reader sees the old file or the new one, never a
  // torn one. dte::io_error on failure (the temporary file is removed).
  void write(const std::filesystem::path& path) const {
    write_file_atomic(path, serialize(), "safetensors file");
  }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<std::uint64_t> shape;
    std::vector<std::byte> data;
  };

  std::vector<Entry> entries_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dte::io
