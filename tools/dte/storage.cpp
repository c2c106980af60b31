// SPDX-License-Identifier: Apache-2.0
// The storage commands (docs/storage.md):
//   dte simulate --transport storage --dir DIR [--anchor-every N] [--reader-lag L]
//       writers of the synthetic trainer publish to DIR, a reader of every replica keeps up and
//       one lags L versions (catching up at the end); every reader state is checked against a
//       dense sync of the trainer's weights of the version it holds;
//   dte inspect DIR [--json]   versions, chain, anchors, sizes, densities, compression;
//   dte verify DIR [--json]    every checksum, the chain, the digests; exit 1 naming the fault.
#include <cstdio>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dte/error.hpp"
#include "dte/io/model_config.hpp"
#include "simulate.hpp"

#if DTE_WITH_STORAGE
#include "dte/sim/dense_check.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/storage/inspect.hpp"
#include "dte/storage/verify.hpp"
#include "simulate_driver.hpp"
#endif

namespace dte::tool {

#if DTE_WITH_STORAGE

namespace {

constexpr std::int64_t kDenseCheckLimit = 200'000'000;  // receiver elements

// The model a root was written for: --model, else the name in its newest manifest.
layout::HfModel root_model(const std::filesystem::path& root, const std::string& model) {
  if (!model.empty()) return layout::HfModel(io::load_model(model));
  std::string name;
  std::vector<std::filesystem::path> dirs;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    if (storage::parse_version_dir(e.path().filename().string())) dirs.push_back(e.path());
  }
  if (ec) throw io_error("cannot list '" + root.string() + "': " + ec.message());
  std::sort(dirs.rbegin(), dirs.rend());
  for (const auto& d : dirs) {
    try {
      const auto j = nlohmann::json::parse(std::ifstream(d / storage::manifest_name));
      name = j.at("model").get<std::string>();
      break;
    } catch (const std::exception&) {
      continue;
    }
  }
  if (name.empty()) {
    throw invalid_argument("'" + root.string() +
                           "' holds no readable manifest to name its model; pass --model");
  }
  return layout::HfModel(io::load_model(name));
}

double ratio(std::uint64_t a, std::uint64_t b) {
  return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
}

int inspect(const std::string& root, const std::string& model, bool as_json) {
  const layout::HfModel hf = root_model(root, model);
  const storage::RootInfo info = storage::inspect_root(hf, root);
  const auto dense = 2 * static_cast<std::uint64_t>(hf.total());
  std::uint64_t delta_bytes = 0, delta_changed = 0, delta_content = 0;
  nlohmann::ordered_json versions = nlohmann::ordered_json::array();
  for (const auto& v : info.versions) {
    nlohmann::ordered_json j;
    j["version"] = v.version;
    j["complete"] = v.complete;
    if (!v.complete) {
      j["problem"] = v.problem;
      versions.push_back(j);
      continue;
    }
    j["kind"] = v.anchor() ? "anchor" : "delta";
    j["base"] = v.anchor() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v.base);
    j["writers"] = v.writers;
    j["files"] = v.files;
    j["bytes"] = v.bytes;
    j["changed"] = v.changed;
    j["density"] = ratio(v.changed, static_cast<std::uint64_t>(hf.total()));
    j["bytes_per_changed_element"] = ratio(v.bytes, v.changed);
    j["dense_ratio"] = ratio(dense, v.bytes);
    j["compression"] = ratio(v.content_bytes, v.bytes);
    j["unlisted"] = v.unlisted;
    if (!v.anchor()) {
      delta_bytes += v.bytes;
      delta_changed += v.changed;
      delta_content += v.content_bytes;
    }
    versions.push_back(j);
  }
  nlohmann::ordered_json out;
  out["root"] = root;
  out["model"] = hf.spec().name;
  out["latest"] =
      info.latest ? nlohmann::ordered_json(*info.latest) : nlohmann::ordered_json(nullptr);
  if (!info.latest_problem.empty()) out["latest_problem"] = info.latest_problem;
  out["chain"] = info.chain;
  if (!info.chain_problem.empty()) out["chain_problem"] = info.chain_problem;
  out["versions"] = versions;
  out["deltas"] = {{"bytes", delta_bytes},
                   {"changed", delta_changed},
                   {"bytes_per_changed_element", ratio(delta_bytes, delta_changed)},
                   {"compression", ratio(delta_content, delta_bytes)}};
  if (as_json) {
    std::printf("%s\n", out.dump().c_str());
    return exit_ok;
  }
  std::printf("%s: model %s, LATEST %s, chain %s\n", root.c_str(), hf.spec().name.c_str(),
              info.latest ? ("v" + std::to_string(*info.latest)).c_str()
                          : (info.latest_problem.empty() ? "none" : "UNREADABLE"),
              info.chain.empty() ? "-"
                                 : ("v" + std::to_string(info.chain.front()) + " .. v" +
                                    std::to_string(info.chain.back()) + " (" +
                                    std::to_string(info.chain.size()) + " versions)")
                                       .c_str());
  std::printf("%-8s %-7s %-6s %5s %12s %10s %8s %9s %9s %6s\n", "version", "kind", "base", "files",
              "bytes", "changed", "density", "B/changed", "dense/x", "zstd");
  for (const auto& v : info.versions) {
    if (!v.complete) {
      std::printf("v%-7llu INCOMPLETE: %s\n", static_cast<unsigned long long>(v.version),
                  v.problem.c_str());
      continue;
    }
    std::printf("v%-7llu %-7s %-6s %5llu %12llu %10llu %7.3f%% %9.3f %9.1f %6.2f%s\n",
                static_cast<unsigned long long>(v.version), v.anchor() ? "anchor" : "delta",
                v.anchor() ? "-" : std::to_string(v.base).c_str(),
                static_cast<unsigned long long>(v.files), static_cast<unsigned long long>(v.bytes),
                static_cast<unsigned long long>(v.changed),
                100.0 * ratio(v.changed, static_cast<std::uint64_t>(hf.total())),
                ratio(v.bytes, v.changed), ratio(dense, v.bytes), ratio(v.content_bytes, v.bytes),
                v.unlisted.empty() ? "" : "  (+unlisted files)");
  }
  std::printf("deltas: %llu bytes for %llu changed elements: %.3f bytes per changed element\n",
              static_cast<unsigned long long>(delta_bytes),
              static_cast<unsigned long long>(delta_changed), ratio(delta_bytes, delta_changed));
  return exit_ok;
}

int verify(const std::string& root, const std::string& model, bool as_json) {
  const layout::HfModel hf = root_model(root, model);
  const storage::VerifyReport rep = storage::verify_root(hf, root);
  if (as_json) {
    nlohmann::ordered_json j;
    j["root"] = root;
    j["ok"] = rep.ok();
    j["versions"] = rep.versions;
    j["files"] = rep.files;
    j["bytes"] = rep.bytes;
    j["digests_checked"] = rep.digests;
    j["problems"] = nlohmann::ordered_json::array();
    for (const auto& p : rep.problems)
      j["problems"].push_back({{"path", p.path}, {"what", p.what}});
    std::printf("%s\n", j.dump().c_str());
  } else {
    for (const auto& p : rep.problems)
      std::printf("FAULT %s: %s\n", p.path.c_str(), p.what.c_str());
    std::printf(
        "%s: %llu versions, %llu files (%llu bytes) checked, %llu state digests "
        "replayed: %s\n",
        root.c_str(), static_cast<unsigned long long>(rep.versions),
        static_cast<unsigned long long>(rep.files), static_cast<unsigned long long>(rep.bytes),
        static_cast<unsigned long long>(rep.digests),
        rep.ok() ? "OK" : (std::to_string(rep.problems.size()) + " fault(s)").c_str());
  }
  return rep.ok() ? exit_ok : exit_check_failed;
}

}  // namespace

int simulate_storage(const SimulateOptions& o) {
  if (o.dir.empty())
    throw invalid_argument("--transport storage needs --dir DIR (the storage root)");
  if (o.reader_lag < 0) throw invalid_argument("--reader-lag must be >= 0");
  // The simulation checks every reader against its own trainer's history from version 1: an
  // earlier run's versions would be continued (as a restarted trainer does) and compared with
  // the wrong weights.
  if (std::error_code ec;
      std::filesystem::exists(std::filesystem::path(o.dir) / storage::latest_name, ec)) {
    throw invalid_argument("--dir " + o.dir +
                           " already holds published versions (an earlier run); dte simulate "
                           "checks its readers from version 1 on: give it an empty or new "
                           "directory");
  }
  Simulation s(o);
  storage::PublisherConfig cfg;
  cfg.anchor_every = o.anchor_every;
  cfg.publish_every = o.publish_every;
  cfg.zstd_level = o.zstd_level;
  cfg.encoding = o.encoding == "diff" ? storage::Encoding::diff : storage::Encoding::value;
  cfg.index = o.index == "classes" ? storage::IndexCode::classes : storage::IndexCode::plain;
  if (cfg.index == storage::IndexCode::classes && cfg.encoding != storage::Encoding::diff) {
    throw invalid_argument(
        "--index classes needs --encoding diff (its indices are coded against "
        "the base version, which only a diff chunk relies on)");
  }
  sim::StorageCluster writers(s.hf, s.train, o.dir, cfg);
  std::vector<std::int64_t> all(static_cast<std::size_t>(s.infer.replicas));
  for (std::size_t r = 0; r < all.size(); ++r)
    all[r] = static_cast<std::int64_t>(r);
  sim::OwnedReader live(s.hf, s.recv, o.dir, all);
  // (registered: retention keeps the versions it still has to replay)
  std::unique_ptr<sim::OwnedReader> lagging;
  if (o.reader_lag > 0) {
    lagging = std::make_unique<sim::OwnedReader>(s.hf, s.recv, o.dir, all,
                                                 storage::ReaderConfig{.name = "lagging"});
    // It holds nothing yet but will start at version 1, L versions behind the writers:
    // registered there up front, so retention keeps the chain from the first anchor until it
    // has read (with anchors more often than every L + 1 versions its first target would
    // otherwise be collected before it asks for it).
    storage::register_reader(o.dir, "lagging", 1);
  }
  const bool check = s.infer.ranks() * s.recv.live_elements(0) <= kDenseCheckLimit;
  std::deque<std::pair<Version, std::vector<float>>> history;  // the lagging reader's targets
  bool identical = true, all_ok = true;
  std::uint64_t delta_bytes = 0, delta_changed = 0, dense = 0, publications = 0;
  auto mismatches = [&](const sim::OwnedReader& r, const std::vector<float>& w) -> long long {
    return check ? sim::dense_mismatches(s.hf, s.recv, w, r->receivers()) : -1;
  };
  if (!o.json) {
    std::printf(
        "dte simulate: %s (%lld parameters), train %s (%lld writers) -> storage %s -> "
        "infer %s (%lld ranks), %lld steps, anchor every %lld, reader lag %lld, %s encoding, "
        "%s index, lr %g\n",
        s.spec.name.c_str(), static_cast<long long>(s.hf.total()), o.train.c_str(),
        static_cast<long long>(s.train.world()), o.dir.c_str(), o.infer.c_str(),
        static_cast<long long>(s.infer.ranks()), static_cast<long long>(o.steps),
        static_cast<long long>(o.anchor_every), static_cast<long long>(o.reader_lag),
        o.encoding.c_str(), o.index.c_str(), o.lr);
    print_layout_settings(s.spec, s.train, o.stack);
  }
  auto record = [&](const storage::PublishReport& rep) {
    ++publications;
    const auto weights = s.trainer.canonical_weights();
    const storage::ReadReport got = live->poll();
    const long long bad = got.ok() ? mismatches(live, weights) : -2;
    all_ok = all_ok && got.ok() && live->version() == rep.version;
    identical = identical && bad <= 0 && got.ok();
    long long lag_bad = -1;
    Version lag_at = 0;
    if (lagging) {
      history.emplace_back(rep.version, weights);
      if (rep.version > static_cast<Version>(o.reader_lag)) {
        const Version target = rep.version - static_cast<Version>(o.reader_lag);
        const storage::ReadReport lr = (*lagging)->advance(target);
        all_ok = all_ok && lr.ok();
        while (!history.empty() && history.front().first < target)
          history.pop_front();
        lag_at = (*lagging)->version();
        lag_bad = lr.ok() ? mismatches(*lagging, history.front().second) : -2;
        identical = identical && lag_bad <= 0 && lr.ok();
        if (!lr.ok()) std::fprintf(stderr, "lagging reader: %s\n", lr.error.c_str());
      }
    }
    if (!rep.anchor()) {
      delta_bytes += rep.bytes;
      delta_changed += rep.changed;
      dense += rep.dense_bytes;
    }
    if (!got.ok()) std::fprintf(stderr, "reader: %s\n", got.error.c_str());
    if (o.json) {
      nlohmann::ordered_json j;
      j["version"] = rep.version;
      j["kind"] = rep.anchor() ? "anchor" : "delta";
      j["changed"] = rep.changed;
      j["changed_fraction"] = ratio(rep.changed, static_cast<std::uint64_t>(s.hf.total()));
      j["bytes"] = rep.bytes;
      j["dense_bytes"] = rep.dense_bytes;
      j["bytes_per_changed_element"] = ratio(rep.bytes, rep.changed);
      j["seconds"] = rep.seconds;
      j["reader_version"] = live->version();
      j["reader_bit_identical"] =
          bad < 0 && bad != -2 ? nlohmann::json(nullptr) : nlohmann::json(bad == 0);
      if (lagging) j["lagging_reader_version"] = lag_at;
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf(
          "v%-4llu %-6s changed %7.3f%%  stored %10s (dense %10s, %6.3f B/changed)  "
          "%6.1f ms  reader v%llu %s%s\n",
          static_cast<unsigned long long>(rep.version), rep.anchor() ? "anchor" : "delta",
          100.0 * ratio(rep.changed, static_cast<std::uint64_t>(s.hf.total())),
          human_bytes(static_cast<double>(rep.bytes)).c_str(),
          human_bytes(static_cast<double>(rep.dense_bytes)).c_str(), ratio(rep.bytes, rep.changed),
          1e3 * rep.seconds, static_cast<unsigned long long>(live->version()),
          bad == 0    ? "bit-identical"
          : bad == -1 ? ""
                      : "DIFFERS",
          lagging && lag_at > 0 ? (", lagging reader v" + std::to_string(lag_at) +
                                   (lag_bad == 0    ? " bit-identical"
                                    : lag_bad == -1 ? ""
                                                    : " DIFFERS"))
                                      .c_str()
                                : "");
    }
    std::fflush(stdout);
  };
  record(writers.publish(s.access));
  for (std::int64_t step = 1; step <= o.steps; ++step) {
    s.trainer.step();
    if (auto rep = writers.step(s.access)) record(*rep);
  }
  long long final_lag = -1;
  if (lagging) {
    const storage::ReadReport lr = (*lagging)->poll();
    all_ok = all_ok && lr.ok();
    final_lag = lr.ok() ? mismatches(*lagging, s.trainer.canonical_weights()) : -2;
    identical = identical && final_lag <= 0 && lr.ok();
  }
  if (!o.dump.empty()) {
    for (const Receiver* r : live->receivers())
      dump_receiver(o.dump, s.recv, *r);
    dump_trainer(o.dump, s.hf, s.trainer.canonical_weights());
  }
  const bool ok = all_ok && identical;
  if (o.json) {
    nlohmann::ordered_json j;
    j["transport"] = "storage";
    j["layout_settings"] = layout_settings_json(s.spec, s.train, o.stack);
    j["dir"] = o.dir;
    j["steps"] = o.steps;
    j["publications"] = publications;
    j["all_bit_identical"] = check ? nlohmann::json(identical) : nlohmann::json(nullptr);
    j["all_applied"] = all_ok;
    j["delta_bytes"] = delta_bytes;
    j["delta_changed"] = delta_changed;
    j["bytes_per_changed_element"] = ratio(delta_bytes, delta_changed);
    j["dense_ratio"] = ratio(dense, delta_bytes);
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "summary: %llu publications, deltas %s for %llu changed elements (%.3f bytes per "
        "changed element, %.1fx smaller than dense)%s\n",
        static_cast<unsigned long long>(publications),
        human_bytes(static_cast<double>(delta_bytes)).c_str(),
        static_cast<unsigned long long>(delta_changed), ratio(delta_bytes, delta_changed),
        ratio(dense, delta_bytes),
        lagging ? (final_lag == 0 ? "; the lagging reader caught up bit-identical"
                                  : "; the lagging reader did NOT catch up")
                : "");
    std::printf(
        "%s: every reader %s%s\n", ok ? "VERIFIED" : "FAILED",
        ok ? "applied only complete, verified versions" : "did NOT hold the trainer's policy",
        check ? " and was bit-identical to a dense sync" : "");
  }
  return ok ? exit_ok : exit_check_failed;
}

#else

int simulate_storage(const SimulateOptions&) {
  throw unsupported(
      "this dte was built without zstd and xxHash, which storage needs; run "
      "tools/install-deps.sh and rebuild");
}

#endif

void register_storage(CLI::App& app, int& status) {
  for (const char* name : {"inspect", "verify"}) {
    const bool is_verify = std::string(name) == "verify";
    auto* cmd = app.add_subcommand(
        name, is_verify ? "Check every checksum, the chain and the digests of a storage root"
                        : "Versions, chain, anchors, sizes and compression of a storage root");
    auto root = std::make_shared<std::string>();
    auto model = std::make_shared<std::string>();
    auto as_json = std::make_shared<bool>(false);
    cmd->add_option("DIR", *root, "the storage root (holds LATEST and v<version> directories)")
        ->required();
    cmd->add_option("--model", *model,
                    "preset or config.json (default: the model its newest manifest names)");
    cmd->add_flag("--json", *as_json, "one JSON object");
    cmd->callback([=, &status] {
#if DTE_WITH_STORAGE
      status = is_verify ? verify(*root, *model, *as_json) : inspect(*root, *model, *as_json);
#else
      (void)status;
      throw unsupported(
          "this dte was built without zstd and xxHash, which storage needs; run "
          "tools/install-deps.sh and rebuild");
#endif
    });
  }
}

}  // namespace dte::tool
