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
#include "dte/receive/core.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"
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
  // The state replayed in canonical coordinates through the receiver core (receive/core.hpp)
  // over HF tensors held here: its digest, its coverage of a full publication and its version
  // chain are every receiver's.
  const auto tensors = static_cast<std::size_t>(hf.size());
  std::vector<std::vector<std::uint16_t>> state(tensors);
  for (std::size_t t = 0; t < tensors; ++t)
    state[t].resize(static_cast<std::size_t>(hf[static_cast<std::int64_t>(t)].numel()));
  receive::Core core = receive::hf_core(hf, "dte verify");
  {
    ReceiverTensors views;
    for (auto& x : state)
      views.emplace_back(x);
    core.hold(std::move(views));
  }
  receive::StagedWrites w;
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
    w.clear();
    w.diff = false;
    w.kind = m.anchor() ? MessageKind::full : MessageKind::delta;
    w.version = m.version;
    w.base = m.base;
    std::vector<std::vector<std::uint16_t>> fresh;  // an anchor's tensors (staged in place)
    if (m.anchor()) {
      fresh.resize(tensors);
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
      for (std::size_t t = 0; t < tensors && files_ok; ++t) {
        w.push_run(static_cast<std::uint32_t>(t), static_cast<std::uint32_t>(t), 0,
                   hf[static_cast<std::int64_t>(t)].base,
                   reinterpret_cast<const std::byte*>(fresh[t].data()), fresh[t].size(), -1);
      }
    } else {
      // (a class index resolves against the state before the version, known when it is the
      // base; else every check but that one)
      const TensorsBase held(state);
      for (const ChunkEntry& e : m.chunks) {
        try {
          if (at == m.base) {
            const Chunk c = read_chunk(hf, dir, m, e, &held);
            w.diff = c.encoding == Encoding::diff;
            for (const TensorDelta& d : c.tensors) {
              receive::route_hf(hf, d.tensor, d.index.data(), d.bits.data(), d.index.size(), w);
            }
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
    }
    if (!files_ok || (!m.anchor() && at != m.base)) {
      at = no_version;  // the state of this version is not known: later deltas go unreplayed
      continue;
    }
    try {
      (void)core.chain(w.kind, w.version, w.base);
      core.check(w);
      core.commit(w);
    } catch (const std::exception& e) {
      problem(manifest_path, e.what());
      at = no_version;
      continue;
    }
    at = m.version;
    ++rep.digests;
    for (std::size_t t = 0; t < tensors; ++t) {
      if (core.digest()[t] != m.digest[t]) {
        problem(manifest_path, "the state after version " + std::to_string(m.version) +
                                   " disagrees with the manifest's digest of " +
                                   hf.name(static_cast<std::int64_t>(t)) +
                                   " (a writer fault, or the manifest was altered)");
        at = no_version;
        break;
      }
    }
  }
  return rep;
}

}  // namespace dte::storage
