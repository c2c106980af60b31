// SPDX-License-Identifier: Apache-2.0
// JSON in, strictly: every JSON document dte reads (config.json, buffer layouts, safetensors
// headers) goes through parse_strict, which refuses duplicate keys at any level (readers would
// disagree on which value wins) and nesting deeper than the format needs; fields are then read
// with the typed readers below, which refuse a missing field, a wrong type, a float or a bool
// where an integer belongs, and an integer outside its documented range (dte/bounds.hpp),
// naming the file, the field's path and the allowed range. The value is shown as written, never
// as a wrapped or truncated number.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/error.hpp"

namespace dte::io {

namespace detail {

// 'name', cut to 200 characters (a hostile key can be megabytes long).
inline std::string quote_name(std::string_view s) {
  constexpr std::size_t max = 200;
  std::string out = "'";
  if (s.size() > max) {
    out.append(s.substr(0, max));
    out += "...";
  } else {
    out.append(s);
  }
  out += "'";
  return out;
}

// A JSON value as written, cut for messages.
inline std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 80) + "...";
  return s;
}

}  // namespace detail

// Parses `text` (`what` names it in messages: "header", "model config"), refusing duplicate
// keys and nesting deeper than max_depth. Throws format_error naming `source`.
inline nlohmann::json parse_strict(std::string_view text, const std::string& source,
                                   std::string_view what, int max_depth) {
  std::vector<std::set<std::string, std::less<>>> open_objects;
  auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        if (depth >= max_depth) {
          throw format_error(source + ": " + std::string(what) + " JSON is nested more than " +
                                 std::to_string(max_depth) + " levels deep",
                             about(source));
        }
        if (event == Event::object_start) open_objects.emplace_back();
        break;
      case Event::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case Event::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_objects.empty() && !open_objects.back().insert(key).second) {
          throw format_error(source + ": duplicate key " + detail::quote_name(key) +
                                 (open_objects.size() == 1 ? " in the " : " inside a ") +
                                 std::string(what) + (open_objects.size() == 1 ? "" : " object") +
                                 "; each key must appear once (readers would disagree on which "
                                 "value wins)",
                             about(source, key));
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    throw format_error(source + ": " + std::string(what) + " is not valid JSON (" + e.what() + ")",
                       about(source));
  }
}

// Reads a whole JSON file of at most max_bytes and parses it strictly.
inline nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view what,
                                     int max_depth, std::uintmax_t max_bytes) {
  const std::string name = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io_error("cannot open " + std::string(what) + " '" + name + "'", about(name));
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec)
    throw io_error("cannot read the size of " + std::string(what) + " '" + name + "'", about(name));
  if (size > max_bytes) {
    throw bounds_error(name + ": " + std::to_string(size) + " bytes; a " + std::string(what) +
                           " is at most " + std::to_string(max_bytes) + " bytes",
                       about(name));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
    throw io_error("reading " + std::string(what) + " '" + name + "' failed", about(name));
  }
  return parse_strict(text, name, what, max_depth);
}

// The typed readers. `path` is where the value sits ("ranks[3].buffers.dense.size"); messages
// read "<source>: field '<path>' is ...".
class JsonReader {
 public:
  explicit JsonReader(std::string source) : source_(std::move(source)) {}

  [[nodiscard]] const std::string& source() const noexcept { return source_; }

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw format_error(source_ + ": field '" + path + "' " + what, about(source_, path));
  }

  // obj[key]: present, or a format_error naming it.
  const nlohmann::json& member(const nlohmann::json& obj, std::string_view key,
                               const std::string& path) const {
    if (!obj.is_object()) fail(path, "is " + detail::shown(obj) + ", not an object");
    const auto it = obj.find(key);
    if (it == obj.end()) fail(join(path, key), "is missing");
    return *it;
  }

  const nlohmann::json& object(const nlohmann::json& obj, std::string_view key,
                               const std::string& path) const {
    const nlohmann::json& v = member(obj, key, path);
    if (!v.is_object()) fail(join(path, key), "is " + detail::shown(v) + ", not an object");
    return v;
  }

  const nlohmann::json& array(const nlohmann::json& obj, std::string_view key,
                              const std::string& path, std::size_t max_size) const {
    const nlohmann::json& v = member(obj, key, path);
    check_array(v, join(path, key), max_size);
    return v;
  }

  void check_array(const nlohmann::json& v, const std::string& path, std::size_t max_size) const {
    if (!v.is_array()) fail(path, "is " + detail::shown(v) + ", not a list");
    if (v.size() > max_size) {
      throw bounds_error(source_ + ": field '" + path + "' has " + std::to_string(v.size()) +
                             " entries; at most " + std::to_string(max_size) + " are allowed",
                         about(source_, path));
    }
  }

  std::string string(const nlohmann::json& obj, std::string_view key,
                     const std::string& path) const {
    const nlohmann::json& v = member(obj, key, path);
    if (!v.is_string()) fail(join(path, key), "is " + detail::shown(v) + ", not a string");
    return v.get<std::string>();
  }

  bool boolean(const nlohmann::json& v, const std::string& path) const {
    if (!v.is_boolean()) fail(path, "is " + detail::shown(v) + ", not true or false");
    return v.get<bool>();
  }

  // An integer in [lo, hi], written as a JSON integer: 3, not 3.0, "3" or true.
  std::int64_t integer(const nlohmann::json& v, const std::string& path, std::int64_t lo,
                       std::int64_t hi) const {
    const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    if (!v.is_number_integer()) {
      fail(path, "is " + detail::shown(v) + ", not an integer; it must be an integer in " + range);
    }
    // An unsigned value above INT64_MAX is above every hi; anything else fits an int64.
    const bool huge =
        v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX);
    const std::int64_t x = huge ? 0 : v.get<std::int64_t>();
    if (huge || x < lo || x > hi) {
      throw bounds_error(
          source_ + ": field '" + path + "' is " + v.dump() + "; it must be an integer in " + range,
          about(source_, path));
    }
    return x;
  }

  std::int64_t integer(const nlohmann::json& obj, std::string_view key, const std::string& path,
                       std::int64_t lo, std::int64_t hi) const {
    return integer(member(obj, key, path), join(path, key), lo, hi);
  }

  static std::string join(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
  }

 private:
  std::string source_;
};

}  // namespace dte::io
