// SPDX-License-Identifier: Apache-2.0
// What a storage root holds (`dte inspect`): every version directory, complete (a manifest that
// parses) or not, its kind, base, files, bytes on storage (manifest included), changed elements
// and compression; LATEST and the chain from it down to its anchor. Reads manifests and each
// chunk's zstd frame headers (they state the decompressed sizes), nothing more:
// checksums and digests are `dte verify`'s (storage/verify.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/read.hpp"

namespace dte::storage {

struct VersionInfo {
  Version version = 0;
  bool complete = false;  // its manifest parses
  std::string problem;    // why not (a missing manifest: an unfinished or crashed publication)
  Version base = no_version;
  std::uint64_t files = 0;          // listed
  std::uint64_t bytes = 0;          // listed files + manifest (+ an anchor's index)
  std::uint64_t content_bytes = 0;  // the chunks decompressed (anchors: their size)
  std::uint64_t changed = 0;
  std::uint32_t writers = 0;
  std::vector<std::string> unlisted;  // files in the directory the manifest does not list
  [[nodiscard]] bool anchor() const noexcept { return base == no_version; }
};

struct RootInfo {
  std::optional<Version> latest;
  std::string latest_problem;         // LATEST unreadable
  std::vector<VersionInfo> versions;  // ascending
  std::vector<Version> chain;         // from LATEST down to its anchor (empty: none)
  std::string chain_problem;          // why the chain stops short of an anchor
};

// The decompressed size a chunk's zstd frames state, summed (0 when it cannot be read).
inline std::uint64_t stated_content_size(const std::filesystem::path& p, std::uint64_t bytes) {
  io::detail::FdGuard fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) return 0;
  try {
    const auto data =
        io::detail::read_up_to(fd.get(), static_cast<std::size_t>(bytes), "chunk", p.string());
    return frame_table(data, p.string(), UINT64_MAX).total;
  } catch (const std::exception&) {
    return 0;  // (dte verify says what is wrong with it)
  }
}

inline RootInfo inspect_root(const layout::HfModel& hf, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  RootInfo info;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    throw io_error("'" + root.string() + "' is not a directory; pass the storage root");
  }
  try {
    info.latest = read_latest(root);
  } catch (const std::exception& e) {
    info.latest_problem = e.what();
  }
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const auto v = parse_version_dir(e.path().filename().string());
    if (!v || !e.is_directory()) continue;
    VersionInfo vi;
    vi.version = *v;
    try {
      const Manifest m = read_manifest(hf, root, *v);
      vi.complete = true;
      vi.base = m.base;
      vi.files = m.chunks.size();
      vi.changed = m.changed;
      vi.writers = m.writers;
      vi.bytes = fs::file_size(e.path() / manifest_name);
      std::vector<std::string> listed{std::string(manifest_name)};
      for (const ChunkEntry& c : m.chunks) {
        vi.bytes += c.bytes;
        vi.content_bytes += m.anchor() ? c.bytes : stated_content_size(e.path() / c.file, c.bytes);
        listed.push_back(c.file);
      }
      if (m.anchor()) {
        listed.emplace_back("model.safetensors.index.json");
        if (fs::exists(e.path() / listed.back()))
          vi.bytes += fs::file_size(e.path() / listed.back());
      }
      for (const fs::directory_entry& f : fs::directory_iterator(e.path())) {
        const std::string name = f.path().filename().string();
        if (std::find(listed.begin(), listed.end(), name) == listed.end())
          vi.unlisted.push_back(name);
      }
      std::sort(vi.unlisted.begin(), vi.unlisted.end());
    } catch (const std::exception& ex) {
      vi.problem = ex.what();
    }
    info.versions.push_back(std::move(vi));
  }
  std::sort(info.versions.begin(), info.versions.end(),
            [](const VersionInfo& a, const VersionInfo& b) { return a.version < b.version; });
  if (info.latest) {
    const auto find = [&](Version v) -> const VersionInfo* {
      const auto it =
          std::lower_bound(info.versions.begin(), info.versions.end(), v,
                           [](const VersionInfo& a, Version x) { return a.version < x; });
      return it != info.versions.end() && it->version == v ? &*it : nullptr;
    };
    for (Version at = *info.latest;;) {
      const VersionInfo* vi = find(at);
      if (vi == nullptr || !vi->complete) {
        info.chain_problem =
            "version " + std::to_string(at) +
            (vi == nullptr ? " is not on storage" : " is incomplete: " + vi->problem);
        break;
      }
      info.chain.push_back(at);
      if (vi->anchor()) break;
      at = vi->base;
    }
  }
  return info;
}

}  // namespace dte::storage
