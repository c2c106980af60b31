// SPDX-License-Identifier: Apache-2.0
// Retention (docs/storage.md): what may leave a storage root. A reader that follows LATEST never
// needs a version below the newest anchor at or below LATEST (its chain walk stops at that
// anchor and reseeds from it), so only registered readers hold older versions: a reader may
// register the version it holds (ROOT/readers/<name>, written atomically), and collect()
// removes every complete version below the newest anchor at or below both LATEST and every
// registered version. It removes a version's manifest first (a reader then sees it as
// incomplete, never half-deleted), and the temporaries a crashed writer left in complete
// versions; it never removes a directory without a manifest (an unfinished publication, or one
// copied by hand): those are reported.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/inspect.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"

namespace dte::storage {

inline constexpr std::string_view readers_dir_name = "readers";

// Records that reader `name` (a plain file name) holds version v.
inline void register_reader(const std::filesystem::path& root, const std::string& name, Version v) {
  if (!plain_file_name(name)) {
    throw invalid_argument("storage reader name \"" + name +
                           "\" is not a plain file name (letters, digits, '.', '_', '-')");
  }
  const std::filesystem::path dir = root / readers_dir_name;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw io_error("cannot create '" + dir.string() + "': " + ec.message());
  const std::string text = latest_text(v);
  io::write_file_atomic(dir / name, std::as_bytes(std::span(text)), "reader registration");
}

// Removes reader `name`'s registration (it no longer holds anything back).
inline void unregister_reader(const std::filesystem::path& root, const std::string& name) {
  std::error_code ec;
  std::filesystem::remove(root / readers_dir_name / name, ec);
}

// Every registered reader and its version; a registration that does not parse is refused
// (format_error naming it): collect() must not guess what a reader holds.
inline std::map<std::string, Version> registered_readers(const std::filesystem::path& root) {
  std::map<std::string, Version> out;
  const std::filesystem::path dir = root / readers_dir_name;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (io::temporary_suffix(name) != std::string::npos) continue;  // one being written
    // (the same strict form as LATEST: "v<20 digits>\n")
    const std::optional<Version> v = [&] {
      try {
        return read_latest_file(e.path());
      } catch (const std::exception& ex) {
        throw format_error("reader registration '" + e.path().string() + "': " + ex.what());
      }
    }();
    if (v) out.emplace(name, *v);
  }
  return out;
}

struct CollectReport {
  Version keep_from = 0;  // every complete version below it was removed (0: none)
  std::vector<Version> removed;
  std::vector<Version> incomplete;       // directories without a manifest, left in place
  std::vector<std::string> temporaries;  // removed from complete versions
};

inline CollectReport collect(const layout::HfModel& hf, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  CollectReport rep;
  const RootInfo info = inspect_root(hf, root);
  if (!info.latest) return rep;
  Version floor = *info.latest;
  for (const auto& [name, v] : registered_readers(root))
    floor = std::min(floor, v);
  for (const VersionInfo& v : info.versions) {
    if (v.complete && v.anchor() && v.version <= floor) rep.keep_from = v.version;
  }
  for (const VersionInfo& v : info.versions) {
    const fs::path dir = version_dir(root, v.version);
    if (!v.complete) {
      if (v.version <= *info.latest) rep.incomplete.push_back(v.version);
      continue;
    }
    if (v.version < rep.keep_from) {
      fs::remove(dir / manifest_name);
      io::detail::fsync_directory(dir, "version directory '" + dir.string() + "'");
      fs::remove_all(dir);
      rep.removed.push_back(v.version);
      continue;
    }
    for (const std::string& name : v.unlisted) {
      if (io::temporary_suffix(name) != std::string::npos) {
        fs::remove(dir / name);
        rep.temporaries.push_back((dir / name).string());
      }
    }
  }
  if (!rep.removed.empty())
    io::detail::fsync_directory(root, "storage root '" + root.string() + "'");
  return rep;
}

}  // namespace dte::storage
