// SPDX-License-Identifier: Apache-2.0
// Everything a storage root claims, checked (`dte verify`): LATEST names a complete version;
// every complete version's files have their listed size and xxh3 and decode (chunks with the
// header their slot implies, indices in range; anchors as BF16 tensors of the model, each once,
// and an index that maps every tensor to a listed file); every delta's base is on storage; and,
// replaying the chain from the oldest anchor in canonical coordinates, the state after every
// version has the digest its manifest records. Each problem names the file or manifest at
// fault. Holds the model as BF16 (2 bytes per parameter).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/core/digest.hpp"
#include "dte/error.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/inspect.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/reader.hpp"

namespace dte::storage {

struct Problem {
  std::string path;  // the file or directory at fault
  std::string what;
};

struct VerifyReport {
  std::uint64_t versions = 0;  // complete versions checked
  std::uint64_t files = 0;     // files read and checked
  std::uint64_t bytes = 0;
  std::uint64_t digests = 0;  // versions whose state digest was checked
  std::vector<Problem> problems;
  [[nodiscard]] bool ok() const noexcept { return problems.empty(); }
};

namespace detail {

// An anchor's model.safetensors.index.json: every tensor, mapped to a file the manifest lists.
inline void check_hf_index(const layout::HfModel& hf, const std::filesystem::path& dir,
                           const Manifest& m) {
  const std::filesystem::path p = dir / "model.safetensors.index.json";
  const std::vector<std::byte> bytes = [&] {
    io::detail::FdGuard fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd.get() < 0) throw io_error("cannot open " + p.string() + ": the anchor has no index");
    return io::detail::read_up_to(fd.get(), max_manifest_bytes, "anchor index", p.string());
  }();
  const nlohmann::json j = nlohmann::json::parse(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), nullptr, false);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw format_error(p.string() + ": not a Hugging Face index (no weight_map object)");
  }
  const auto& map = j["weight_map"];
  if (map.size() != static_cast<std::size_t>(hf.size())) {
    throw format_error(p.string() + ": lists " + std::to_string(map.size()) +
                       " tensors, the model has " + std::to_string(hf.size()));
  }
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const auto it = map.find(hf.name(t));
    if (it == map.end() || !it->is_string()) {
      throw format_error(p.string() + ": does not map tensor '" + hf.name(t) + "'");
    }
    const std::string file = it->get<std::string>();
    bool listed = false;
    for (const ChunkEntry& e : m.chunks)
      listed = listed || e.file == file;
    if (!listed) {
      throw format_error(p.string() + ": maps '" + hf.name(t) + "' to '" + file +
                         "', which the manifest does not list");
    }
  }
}

}  // namespace detail

inline VerifyReport verify_root(const layout::HfModel& hf, const std::filesystem::path& root) {
  VerifyReport rep;
  const RootInfo info = inspect_root(hf, root);
  const auto problem = [&](std::string path, std::string what) {
    rep.problems.push_back({std::move(path), std::move(what)});
  };
  const std::string latest_path = (root / latest_name).string();
  if (!info.latest_problem.empty()) problem(latest_path, info.latest_problem);
  if (info.latest && !info.chain_problem.empty()) problem(latest_path, info.chain_problem);
  // The state replayed in canonical coordinates, and its digest per tensor.
  const auto tensors = static_cast<std::size_t>(hf.size());
  std::vector<std::vector<std::uint16_t>> state;
  std::vector<Digest> digest(tensors, 0);
  Version at = no_version;  // the version `state` holds (no_version: not known)
  for (const VersionInfo& vi : info.versions) {
    const std::filesystem::path dir = version_dir(root, vi.version);
    const std::string manifest_path = (dir / manifest_name).string();
    if (!vi.complete) {
      // (an unfinished publication is no fault unless LATEST or a chain needs it)
      continue;
    }
    ++rep.versions;
    Manifest m;
    try {
      m = read_manifest(hf, root, vi.version);
    } catch (const std::exception& e) {
      problem(manifest_path, e.what());
      continue;
    }
    bool files_ok = true;
    if (m.anchor()) {
      std::vector<std::vector<std::uint16_t>> fresh(tensors);
      try {
        rep.bytes += read_anchor(hf, dir, m, [&](std::int64_t t, std::vector<std::uint16_t> bits) {
          fresh[static_cast<std::size_t>(t)] = std::move(bits);
        });
        rep.files += m.chunks.size();
        detail::check_hf_index(hf, dir, m);
      } catch (const std::exception& e) {
        problem(dir.string(), e.what());
        files_ok = false;
      }
      if (files_ok) {
        state = std::move(fresh);
        for (std::size_t t = 0; t < tensors; ++t) {
          Digest d = 0;
          const std::int64_t base = hf[static_cast<std::int64_t>(t)].base;
          for (std::size_t i = 0; i < state[t].size(); ++i)
            d += element_digest(base + static_cast<std::int64_t>(i), state[t][i]);
          digest[t] = d;
        }
        at = m.version;
      } else {
        at = no_version;
      }
    } else {
      std::vector<Chunk> chunks;
      // (a class index resolves against the state before the version, known when it is the
      // base; else every check but that one)
      const TensorsBase held(state);
      for (const ChunkEntry& e : m.chunks) {
        try {
          if (at == m.base) {
            chunks.push_back(read_chunk(hf, dir, m, e, &held));
          } else {
            check_chunk_file(hf, dir, m, e);
          }
          rep.files += 1;
          rep.bytes += e.bytes;
        } catch (const std::exception& ex) {
          problem((dir / e.file).string(), ex.what());
          files_ok = false;
        }
      }
      const bool base_there =
          std::any_of(info.versions.begin(), info.versions.end(),
                      [&](const VersionInfo& o) { return o.version == m.base && o.complete; });
      if (!base_there) {
        problem(manifest_path, "its base, version " + std::to_string(m.base) +
                                   ", is not on storage: the chain is broken");
      }
      if (files_ok && at == m.base) {
        for (const Chunk& c : chunks) {
          for (const TensorDelta& d : c.tensors) {
            auto& s = state[static_cast<std::size_t>(d.tensor)];
            Digest& sum = digest[static_cast<std::size_t>(d.tensor)];
            const std::int64_t base = hf[d.tensor].base;
            for (std::size_t k = 0; k < d.index.size(); ++k) {
              const std::int64_t g = base + d.index[k];
              const std::uint16_t old = s[d.index[k]];
              const std::uint16_t now = decode_value(c.encoding, old, d.bits[k]);
              sum += element_digest(g, now) - element_digest(g, old);
              s[d.index[k]] = now;
            }
          }
        }
        at = m.version;
      } else {
        at = no_version;  // the state of this version is not known: later deltas go unreplayed
      }
    }
    if (at == m.version) {
      ++rep.digests;
      for (std::size_t t = 0; t < tensors; ++t) {
        if (digest[t] != m.digest[t]) {
          problem(manifest_path, "the state after version " + std::to_string(m.version) +
                                     " disagrees with the manifest's digest of " +
                                     hf.name(static_cast<std::int64_t>(t)) +
                                     " (a writer fault, or the manifest was altered)");
          at = no_version;
          break;
        }
      }
    }
  }
  return rep;
}

}  // namespace dte::storage
