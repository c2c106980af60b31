// SPDX-License-Identifier: Apache-2.0
// The golden invariant as one suite over delivery paths (docs/engine.md, "The golden
// invariant"): after every publication a path delivers, every receiver it feeds holds, element
// for element, the trainer's weights of the version it holds rounded to BF16 and placed through
// its layout — computed by the test from the trainer's canonical FP32 weights and the layout's
// inverse map (sim/dense_check.hpp), never from the transfer plan, the routing or the receiver
// core under test. And the path's own check agrees: the engine verified without a repair, the
// receivers committed with the trainer's digest, the storage reader's polls succeeded.
//
// A path is a factory's object (test_golden.cpp): the engine over loopback ranks, storage with a
// reader that keeps up and one that lags, publication messages into HF tensors and into TP
// shards. One scenario runs over each: a full publication, optimizer steps published by the
// schedule (every K steps), a full publication forced halfway, the steps left flushed at the
// end, and the check after each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dte/sim/synthetic_trainer.hpp"

namespace dte::golden {

// The engine paths' synthetic trainer (loopback, MPI, CUDA): changes every step, warmup included.
inline sim::SyntheticConfig lively() {
  sim::SyntheticConfig cfg;
  cfg.seed = 11;
  cfg.lr = 2e-5;
  cfg.warmup_steps = 5;
  cfg.total_steps = 60;
  return cfg;
}

// A delivery path under test: a trainer, its publisher, the transport or storage, receivers.
class Path {
 public:
  virtual ~Path() = default;
  // A full publication, delivered.
  virtual void full() = 0;
  // One optimizer step; true when the schedule published a version (then delivered).
  virtual bool step() = 0;
  // Publishes the steps taken since the last publication, if any (true then); a path whose
  // publisher has no flush publishes nothing.
  virtual bool flush() { return false; }
  // Receiver elements, over every receiver the path feeds, that differ from the trainer's
  // weights of the version each receiver holds.
  [[nodiscard]] virtual std::int64_t mismatches() = 0;
  // Whether the path's own checks confirmed every delivery since the last call.
  [[nodiscard]] virtual bool confirmed() = 0;
};

struct Scenario {
  int steps = 12;          // optimizer steps after the first full publication
  int full_at = -1;        // a full publication forced after this step (-1: none)
  std::int64_t every = 1;  // the schedule's K (what the path was built with)
  bool flush = false;      // flush the steps left at the end
};

struct Outcome {
  int publications = 0;  // after the first: by the schedule, and the forced one
  int failures = 0;      // publications after which a receiver differed or a check failed
};

// The scenario over one path.
inline Outcome run(Path& path, const Scenario& s) {
  Outcome out;
  const auto check = [&] {
    const std::int64_t bad = path.mismatches();
    const bool confirmed = path.confirmed();  // (called either way: it resets)
    out.failures += !(bad == 0 && confirmed);
  };
  path.full();
  check();
  for (int step = 1; step <= s.steps; ++step) {
    if (path.step()) {
      ++out.publications;
      check();
    }
    if (step == s.full_at) {
      path.full();
      ++out.publications;
      check();
    }
  }
  if (s.flush && path.flush()) {
    ++out.publications;
    check();
  }
  return out;
}

// The publications the scenario makes after the first.
inline int expected_publications(const Scenario& s) {
  return static_cast<int>(s.steps / s.every) + (s.full_at > 0 ? 1 : 0) +
         (s.flush && s.steps % s.every != 0 ? 1 : 0);
}

}  // namespace dte::golden
