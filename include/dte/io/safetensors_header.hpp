// SPDX-License-Identifier: Apache-2.0
// The safetensors header in its plain form, read in one pass without a JSON library.
//
// Every chunk of every publication is a safetensors file whose header names three parts per
// tensor; a general JSON parser spends ~30 ns per header byte on it (nlohmann, measured with
// bench/bench_apply.cpp), more than applying the chunk's writes. Writers, dte's own included,
// produce one plain form: members whose keys hold no escape, tensor entries of exactly "dtype"
// (a string), "shape" and "data_offsets" (arrays of unsigned integers), and "__metadata__" (an
// object of strings). read_plain_header reads that form and nothing else: an escape or control
// character in a string, a number that is not a plain unsigned integer of at most 19 digits, a
// duplicate or unknown key, another type or malformed JSON makes it return false, and the strict
// parser (io/json.hpp's parse_strict, in SafetensorsFile) then reads the header and decides,
// wording any refusal. What it accepts the strict parser accepts with the same entries, so the
// two agree on every header (tests/io/test_safetensors.cpp checks that on mutated headers).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dte::io::detail {

// One tensor entry as written: what SafetensorsFile then checks (dtype, sizes, offsets).
struct HeaderEntry {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::array<std::uint64_t, 2> offsets{};  // data_offsets as written
};

struct PlainHeader {
  std::vector<HeaderEntry> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
};

class PlainHeaderReader {
 public:
  explicit PlainHeaderReader(std::string_view text) : s_(text) {}

  // The header (a JSON object, valid UTF-8) into `out`; false where it is not the plain form.
  bool read(PlainHeader& out) {
    out.tensors.clear();
    out.metadata.clear();
    bool metadata = false;
    if (!eat('{')) return false;
    ws();
    if (!eat('}')) {
      for (;;) {
        std::string_view key;
        if (!string(key) || !colon()) return false;
        if (key == "__metadata__") {
          if (metadata || !read_metadata(out.metadata)) return false;
          metadata = true;
        } else {
          HeaderEntry& e = out.tensors.emplace_back();
          e.name.assign(key);
          if (!entry(e)) return false;
        }
        ws();
        if (eat(',')) {
          ws();
          continue;
        }
        if (eat('}')) break;
        return false;
      }
    }
    ws();
    if (p_ != s_.size()) return false;
    const auto by_name = [](const HeaderEntry& a, const HeaderEntry& b) { return a.name < b.name; };
    // (writers list their entries in name order; sorting is then one pass)
    if (!std::is_sorted(out.tensors.begin(), out.tensors.end(), by_name)) {
      std::sort(out.tensors.begin(), out.tensors.end(), by_name);
    }
    for (std::size_t k = 1; k < out.tensors.size(); ++k) {
      if (out.tensors[k - 1].name == out.tensors[k].name) return false;  // a duplicate key
    }
    return true;
  }

 private:
  bool eat(char c) {
    if (p_ < s_.size() && s_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  void ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\t' || s_[p_] == '\n' || s_[p_] == '\r'))
      ++p_;
  }
  bool colon() {
    ws();
    if (!eat(':')) return false;
    ws();
    return true;
  }

  // A string without escapes or control characters (the text is valid UTF-8 already).
  bool string(std::string_view& out) {
    if (!eat('"')) return false;
    const std::size_t begin = p_;
    const std::size_t end = s_.find('"', begin);
    if (end == std::string_view::npos) return false;
    // (one pass without a branch per character: headers are read per chunk)
    unsigned bad = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const auto c = static_cast<unsigned char>(s_[i]);
      bad |= static_cast<unsigned>(c == '\\') | static_cast<unsigned>(c < 0x20);
    }
    if (bad != 0) return false;
    out = s_.substr(begin, end - begin);
    p_ = end + 1;
    return true;
  }

  // An unsigned integer as JSON writes it (no sign, no leading zero, no fraction or exponent:
  // those are left to the strict parser), of at most 19 digits, so it fits 64 bits.
  bool number(std::uint64_t& out) {
    const std::size_t begin = p_;
    std::uint64_t v = 0;
    while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') {
      v = v * 10 + static_cast<std::uint64_t>(s_[p_] - '0');
      ++p_;
    }
    const std::size_t digits = p_ - begin;
    if (digits == 0 || digits > 19 || (digits > 1 && s_[begin] == '0')) return false;
    if (p_ < s_.size() && (s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E')) return false;
    out = v;
    return true;
  }

  bool numbers(std::vector<std::uint64_t>& out) {
    out.clear();
    if (!eat('[')) return false;
    ws();
    if (eat(']')) return true;
    for (;;) {
      std::uint64_t v = 0;
      if (!number(v)) return false;
      out.push_back(v);
      ws();
      if (eat(']')) return true;
      if (!eat(',')) return false;
      ws();
    }
  }

  bool entry(HeaderEntry& e) {
    if (!eat('{')) return false;
    ws();
    bool dtype = false, shape = false, offsets = false;
    for (;;) {
      std::string_view key;
      if (!string(key) || !colon()) return false;
      if (key == "dtype" && !dtype) {
        std::string_view v;
        if (!string(v)) return false;
        e.dtype.assign(v);
        dtype = true;
      } else if (key == "shape" && !shape) {
        if (!numbers(e.shape)) return false;
        shape = true;
      } else if (key == "data_offsets" && !offsets) {
        if (!numbers(pair_) || pair_.size() != 2) return false;
        e.offsets = {pair_[0], pair_[1]};
        offsets = true;
      } else {
        return false;  // unknown or repeated: the strict parser words it
      }
      ws();
      if (eat('}')) return dtype && shape && offsets;
      if (!eat(',')) return false;
      ws();
    }
  }

  bool read_metadata(std::map<std::string, std::string>& out) {
    if (!eat('{')) return false;
    ws();
    if (eat('}')) return true;
    for (;;) {
      std::string_view key, value;
      if (!string(key) || !colon() || !string(value)) return false;
      if (!out.emplace(std::string(key), std::string(value)).second) return false;
      ws();
      if (eat('}')) return true;
      if (!eat(',')) return false;
      ws();
    }
  }

  std::string_view s_;
  std::size_t p_ = 0;
  std::vector<std::uint64_t> pair_;  // data_offsets as read (reused: no allocation per entry)
};

inline bool read_plain_header(std::string_view text, PlainHeader& out) {
  return PlainHeaderReader(text).read(out);
}

}  // namespace dte::io::detail
