// SPDX-License-Identifier: Apache-2.0
// Crash consistency of the storage path (issue 12, done-when 1; RELIABILITY.md M7, M8, M9):
//   * a writer process (crash_worker write) is SIGKILLed at a random time in each of 50
//     trials, while a reader in this process polls the root; the reader only ever applies
//     complete versions (every apply digest-checked, never dirty), after the kill it reaches
//     LATEST and is bit-identical to the trainer's weights of that version (recomputed here from
//     the deterministic trainer), and the next publication (the next trial's writer, and one
//     from this process at the end) succeeds; `verify_root` passes on what is left;
//   * a reader process (crash_worker read) SIGKILLed mid-apply leaves storage untouched, and a
//     restarted reader reseeds from the anchor and ends bit-identical.
#include <doctest/doctest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dte/io/file.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/dense_check.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/storage/inspect.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/verify.hpp"

extern char** environ;

using namespace dte;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct World {
  layout::HfModel hf{layout::model_preset("small-qwen3")};
  layout::TrainTopology train = layout::parse_train_topology("tp=2");
  layout::ServingLayout recv{hf, layout::parse_infer_topology("tp=2")};

  // The weights the crash worker's trainer has after `steps` steps.
  std::vector<float> weights(std::int64_t steps) const {
    sim::SyntheticTrainer t(hf, train, {.lr = 3e-6, .warmup_steps = 0});
    for (std::int64_t s = 0; s < steps; ++s)
      t.step();
    return t.canonical_weights();
  }
};

pid_t spawn(const char* mode, const fs::path& root) {
  std::string worker = DTE_CRASH_WORKER, m = mode, r = root.string();
  char* argv[] = {worker.data(), m.data(), r.data(), nullptr};
  pid_t pid = -1;
  REQUIRE(::posix_spawn(&pid, worker.c_str(), nullptr, nullptr, argv, environ) == 0);
  return pid;
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

// A publication was interrupted: a version directory above LATEST, or a temporary file.
bool interrupted(const fs::path& root, Version latest) {
  if (!fs::exists(root)) return false;  // killed before it made the root
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (io::temporary_suffix(name) != std::string::npos) return true;
    if (const auto v = storage::parse_version_dir(name); v && *v > latest) return true;
  }
  return false;
}

struct TempRoot {
  fs::path path = fs::temp_directory_path() / ("dte-crash-" + std::to_string(::getpid()));
  TempRoot() { fs::remove_all(path); }
  ~TempRoot() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("a writer SIGKILLed at random points of publication, 50 trials") {
  const World w;
  TempRoot root;
  sim::OwnedReader reader(w.hf, w.recv, root.path, {0});
  std::mt19937 rng(20261201);
  std::uniform_int_distribution<int> kill_ms(30, 700);
  int cut = 0, applied = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const Version start = storage::read_latest(root.path).value_or(0) + 1;  // this writer's anchor
    const pid_t pid = spawn("write", root.path);
    const auto deadline = Clock::now() + std::chrono::milliseconds(kill_ms(rng));
    while (Clock::now() < deadline) {
      const storage::ReadReport rep = reader->poll();
      applied += static_cast<int>(rep.applied.size());
      // A poll may fail (a version not yet complete is never named by LATEST; a chunk can be
      // replaced by the next writer's attempt under a reader's feet), but it never leaves the
      // tensors between versions.
      REQUIRE_FALSE(reader->dirty());
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
    kill_and_reap(pid);
    const Version latest = storage::read_latest(root.path).value_or(0);
    cut += interrupted(root.path, latest) ? 1 : 0;
    const storage::ReadReport rep = reader->poll();
    REQUIRE_MESSAGE(rep.ok(), "trial " << trial << ": " << rep.error);
    CHECK(reader->version() == (latest == 0 ? no_version : latest));
    if (latest >= start) {
      CHECK_MESSAGE(
          sim::dense_mismatches(w.hf, w.recv, w.weights(static_cast<std::int64_t>(latest - start)),
                                reader->receivers()) == 0,
          "trial " << trial << ", version " << latest);
    }
  }
  MESSAGE(cut << " of 50 kills interrupted a publication; the reader applied " << applied
              << " versions while writers ran");
  CHECK(cut >= 5);  // (about a third do; the rest land between publications or before the first)
  // The next publication succeeds, and the reader follows it.
  sim::SyntheticTrainer trainer(w.hf, w.train, {.lr = 3e-6, .warmup_steps = 0});
  const sim::AdamWAccess access{&trainer};
  sim::StorageCluster writers(w.hf, w.train, root.path, {}, 2);
  const Version before = storage::read_latest(root.path).value_or(0);
  CHECK(writers.publish(access).version == before + 1);
  trainer.step();
  CHECK(writers.publish(access).base == before + 1);
  REQUIRE(reader->poll().ok());
  CHECK(sim::dense_mismatches(w.hf, w.recv, trainer.canonical_weights(), reader->receivers()) == 0);
  const storage::VerifyReport v = storage::verify_root(w.hf, root.path);
  for (const auto& p : v.problems)
    MESSAGE(p.path << ": " << p.what);
  CHECK(v.ok());
}

TEST_CASE("a reader SIGKILLed mid-apply recovers on restart, bit-identical") {
  const World w;
  TempRoot root;
  sim::SyntheticTrainer trainer(w.hf, w.train, {.lr = 3e-6, .warmup_steps = 0});
  const sim::AdamWAccess access{&trainer};
  {
    sim::StorageCluster writers(w.hf, w.train, root.path, {}, 2);
    writers.publish(access);
    for (int s = 0; s < 6; ++s) {
      trainer.step();
      writers.publish(access);
    }
  }
  const auto listing = [&] {
    std::vector<std::pair<std::string, std::uintmax_t>> out;
    for (const auto& e : fs::recursive_directory_iterator(root.path))
      out.emplace_back(e.path().string(), e.is_regular_file() ? e.file_size() : 0);
    std::sort(out.begin(), out.end());
    return out;
  };
  const auto files = listing();
  // How long a whole read takes, then kills at random points of it.
  auto t0 = Clock::now();
  const pid_t first = spawn("read", root.path);
  int status = 0;
  ::waitpid(first, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const auto full = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  std::mt19937 rng(7);
  std::uniform_int_distribution<long> at(1, std::max<long>(2, full.count()));
  for (int trial = 0; trial < 10; ++trial) {
    const pid_t pid = spawn("read", root.path);
    std::this_thread::sleep_for(std::chrono::milliseconds(at(rng)));
    kill_and_reap(pid);
    CHECK(listing() == files);  // a reader writes nothing to storage
    sim::OwnedReader restarted(w.hf, w.recv, root.path, {0});
    const storage::ReadReport rep = restarted->poll();
    REQUIRE_MESSAGE(rep.ok(), rep.error);
    CHECK(rep.reseeded);
    CHECK(restarted->version() == 7);
    CHECK(sim::dense_mismatches(w.hf, w.recv, trainer.canonical_weights(),
                                restarted->receivers()) == 0);
  }
}
