// SPDX-License-Identifier: Apache-2.0
// Where a published version lives on storage: one directory per version under the root,
// `v<20-digit zero-padded version>` (sorts as the versions do), holding its chunks and its
// manifest (written last); and the root's `LATEST` pointer, the newest complete version, replaced
// atomically (io::write_file_atomic) only after the version's manifest is durable. A reader
// trusts nothing it reads: LATEST is a bounded, exactly formatted file.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/storage/manifest.hpp"

namespace dte::storage {

inline constexpr std::string_view latest_name = "LATEST";
inline constexpr std::string_view manifest_name = "manifest.json";

// The chunk and shard file names of a version directory.
inline std::string chunk_file_name(std::uint32_t chunk, std::uint32_t writer) {
  return "c" + std::to_string(chunk) + "-w" + std::to_string(writer) + ".zst";
}
inline std::string anchor_part_name(std::uint32_t chunk, std::uint32_t writer) {
  return "anchor-part-c" + std::to_string(chunk) + "-w" + std::to_string(writer) + ".zst";
}
inline std::string shard_file_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}
inline constexpr std::string_view hf_index_name = "model.safetensors.index.json";

// "v00000000000000000012" for version 12.
inline std::string version_dir_name(Version v) {
  std::string digits = std::to_string(v);
  return "v" + std::string(20 - digits.size(), '0') + digits;
}

// Parses a version directory's name ("v" and 20 digits); nullopt for anything else.
inline std::optional<Version> parse_version_dir(const std::string& name) {
  if (name.size() != 21 || name[0] != 'v') return std::nullopt;
  Version v = 0;
  for (std::size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    if (c < '0' || c > '9' || v > (UINT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + static_cast<Version>(c - '0');
  }
  return v;
}

inline std::filesystem::path version_dir(const std::filesystem::path& root, Version v) {
  return root / version_dir_name(v);
}

// The text of LATEST for version v: "v<20 digits>\n".
inline std::string latest_text(Version v) {
  return version_dir_name(v) + "\n";
}

// Points LATEST at version v (atomic replace; the caller made v's manifest durable first).
inline void write_latest(const std::filesystem::path& root, Version v) {
  const std::string text = latest_text(v);
  io::write_file_atomic(root / latest_name, std::as_bytes(std::span(text)), "LATEST pointer");
}

// The version LATEST names (read_latest_file: any pointer file of that form, e.g. a reader's
// registration), or nullopt when there is none yet (nothing published). format_error when it is
// anything but exactly "v<20 digits>\n" naming a version within the limits.
inline std::optional<Version> read_latest_file(const std::filesystem::path& file) {
  const std::string name = file.string();
  io::detail::FdGuard fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) return std::nullopt;
    throw io_error("cannot open '" + name + "': " + io::detail::errno_text(err));
  }
  constexpr std::size_t limit = 64;  // a torn or foreign file is refused after this much
  const std::vector<std::byte> read =
      io::detail::read_up_to(fd.get(), limit, "LATEST pointer", name);
  const std::size_t n = read.size();
  const std::string_view text(reinterpret_cast<const char*>(read.data()), n);
  const auto refuse = [&] {
    throw format_error(name + ": is not \"v<20 digits>\\n\" (" + std::to_string(n) +
                       (n == limit ? "+" : "") + " bytes); not written by dte, or torn");
  };
  if (n != 22 || text[21] != '\n') refuse();
  const std::optional<Version> parsed = parse_version_dir(std::string(text.substr(0, 21)));
  if (!parsed) refuse();
  const Version v = *parsed;
  if (v > static_cast<Version>(max_version)) {
    throw bounds_error(name + ": version " + std::to_string(v) + " is above the limit of " +
                       std::to_string(max_version));
  }
  return v;
}

inline std::optional<Version> read_latest(const std::filesystem::path& root) {
  return read_latest_file(root / latest_name);
}

}  // namespace dte::storage
