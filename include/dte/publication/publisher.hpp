// SPDX-License-Identifier: Apache-2.0
// publication::Publisher: one trainer that holds the whole model in HF layout (a PyTorch model,
// a user's own loop: the Identity layout) publishes self-contained messages
// (publication/message.hpp) instead of sending to receivers it knows. The sender frame is the
// engine's (pipeline/frame.hpp: validate, reconstruct, detect with the guard band, compact, the
// K-step dirty mask); its sink is storage's chunk sink, in memory.
//
// One publication, top to bottom:
//   1. the kind: full for the first one, after any refusal or failure (nothing is known about
//      what the refused step changed), and on request; else a delta on the version last returned;
//   2. the staged pass over the flat buffer (all: every element; detect: this step's changes;
//      mask: everything the dirty mask gathered over the last publish_every steps);
//   3. the chunks (zstd; at most chunk_entries elements each), the manifest with the trainer's
//      digest per canonical tensor, the message. A refusal throws before any of it and returns
//      nothing; the version number is not used up.
// Between publications, step() ORs each optimizer step's changes into the dirty mask.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/digest.hpp"
#include "dte/engine/schedule.hpp"
#include "dte/error.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/identity.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/publication/message.hpp"
#include "dte/storage/chunk_sink.hpp"
#include "dte/storage/publisher.hpp"

namespace dte::publication {

// What a trainer holding its weights as one flat FP32 buffer in canonical order (HfModel::base
// offsets) and each tensor's optimizer state apart gives the publisher (concept trainer_access):
// PyTorch after dte.TorchPublisher flattened the parameters, or any loop that does the same.
template <optimizer_inverse Inverse>
struct FlatTrainer {
  std::span<const float> theta;                          // hf.total() elements
  std::vector<typename Inverse::hyperparameters> hyper;  // per HF tensor
  std::vector<typename Inverse::state> state;            // per HF tensor, its numel each
};

// The accessor the publisher reads a FlatTrainer through.
template <optimizer_inverse Inverse>
struct FlatAccess {
  const FlatTrainer<Inverse>* t;
  [[nodiscard]] std::span<const float> theta(std::int64_t, layout::BufferKind b) const {
    return b == layout::BufferKind::dense ? t->theta : std::span<const float>{};
  }
  [[nodiscard]] typename Inverse::hyperparameters hyperparameters(
      std::int64_t, layout::BufferKind, const layout::PlanSegment& s) const {
    return t->hyper[static_cast<std::size_t>(s.param)];
  }
  [[nodiscard]] typename Inverse::state state(std::int64_t, layout::BufferKind,
                                              const layout::PlanSegment& s) const {
    return t->state[static_cast<std::size_t>(s.param)];
  }
};

struct PublisherConfig {
  std::int64_t publish_every = 1;  // K: step() returns a message every K optimizer steps
  int zstd_level = 1;              // 1 .. 19 (1: about as small as 3 for sparse deltas, faster)
  std::uint64_t chunk_entries = std::uint64_t{1} << 24;  // elements per chunk at most
  // diff: a delta covering one optimizer step carries each element's diff code against the
  // base's bits where the reconstruction knows them (storage/value_code.hpp: the one-ulp steps
  // of a small learning rate take a few bits), the rare others their values in a value chunk
  // beside it; a receiver holds the base (the version chain and the digest see to it). value:
  // always the new bits. Full publications and deltas over K > 1 steps carry values either way.
  storage::Encoding encoding = storage::Encoding::diff;
};

// What the last publication did.
struct PublishReport {
  Version version = 0;
  Version base = no_version;  // no_version: full
  std::uint64_t changed = 0;  // elements sent
  std::uint64_t scanned = 0;
  std::uint64_t guard = 0;  // of the changed ones, sent because of the guard band only
  std::uint64_t bytes = 0;  // the message
  std::uint64_t dense_bytes = 0;
  Digest digest = 0;   // the trainer's state, summed over tensors
  double seconds = 0;  // inside the publisher
  [[nodiscard]] bool full() const noexcept { return base == no_version; }
};

template <optimizer_inverse Inverse, change_detector Detect>
class Publisher {
 public:
  using Sender = SenderFrame<Inverse, Detect, layout::IdentityPlan, HostExecutor>;

  Publisher(const layout::ModelSpec& model, PublisherConfig cfg = {}, HostExecutor exec = {})
      : spec_(named_by_structure(model)),
        hf_(spec_),
        cfg_(checked(cfg)),
        schedule_(cfg_.publish_every),
        sender_(hf_, layout::TrainTopology{}, nullptr, 0, schedule_.keeps_mask(), exec) {}

  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  // Per canonical tensor: the trainer's BF16 state as of the last publication.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }
  [[nodiscard]] const PublishReport& last() const noexcept { return last_; }

  // After every optimizer step: a message every publish_every steps, else nothing (this step's
  // changes ORed into the dirty mask). A refusal throws; the next publication is then full.
  template <class Access>
  std::optional<Bytes> step(const Access& access) {
    if (!schedule_.step()) {
      schedule_.mark([&] { (void)sender_.mark(access); });
      return std::nullopt;
    }
    return publish(access, false);
  }

  // Now: a delta of everything changed since the last publication (a full one when one is due),
  // or, want_full, every element.
  template <class Access>
  Bytes publish(const Access& access, bool want_full) {
    const auto t0 = std::chrono::steady_clock::now();
    const PublicationSchedule::Pass pass = schedule_.next(want_full);
    const bool full = pass.full();
    const Version v = version_ + 1;
    const Version base = full ? no_version : version_;
    std::vector<Bytes> blobs;
    ScanResult scan;
    storage::Manifest m;
    try {
      sender_.check_trainer(access);
      const auto write_chunks = [&](auto& sink) {
        scan = sender_.scan(access, pass.mode, sink);
        m.chunks = sink.written();
      };
      // (diff needs the base to be the previous optimizer step: one step since the last one)
      if (cfg_.encoding == storage::Encoding::diff && !full && pass.steps == 1) {
        storage::ChunkSink<true, storage::ChunkMemory> sink(hf_, {v, base, 0, 0}, cfg_.zstd_level,
                                                            cfg_.chunk_entries, {&blobs, full});
        write_chunks(sink);
      } else {
        storage::ChunkSink<false, storage::ChunkMemory> sink(hf_, {v, base, 0, 0}, cfg_.zstd_level,
                                                             cfg_.chunk_entries, {&blobs, full});
        write_chunks(sink);
      }
    } catch (...) {
      schedule_.require_full();
      throw;
    }
    if (pass.clears_masks()) sender_.clear_masks();
    schedule_.published();
    m.model = spec_.name;
    m.version = v;
    m.base = base;
    m.writers = 1;
    m.changed = scan.changed;
    m.digest = scan.digest;
    Bytes out = encode(spec_, m, blobs);
    version_ = v;
    digest_ = std::move(scan.digest);
    last_ = {};
    last_.version = v;
    last_.base = base;
    last_.changed = scan.changed;
    last_.scanned = scan.scanned;
    last_.guard = scan.guard;
    last_.bytes = out.size();
    last_.dense_bytes = 2 * static_cast<std::uint64_t>(hf_.total());
    for (Digest d : digest_)
      last_.digest += d;
    last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  // The next publication is full whatever happens (the caller lost track of the steps).
  void require_full() noexcept { schedule_.require_full(); }

  // A trainer that restarted (resumed from a checkpoint) continues the numbering of the run its
  // receivers and storage root follow: the first publication is then v + 1 (full), which they
  // accept as newer than what they hold. Before the first publication only.
  void continue_after(Version v) {
    if (version_ != 0 && v != version_) {
      throw invalid_argument(
          "publication::Publisher::continue_after: this publisher already "
          "published v" +
          std::to_string(version_) + "; continue_after is for a new publisher, before its first");
    }
    if (v >= static_cast<Version>(storage::max_version)) {
      throw bounds_error("publication::Publisher::continue_after: version " + std::to_string(v) +
                         " is at or above the largest a manifest holds (2^62)");
    }
    version_ = v;
    schedule_.require_full();
  }

 private:
  static PublisherConfig checked(const PublisherConfig& c) {
    if (c.publish_every < 1 || c.zstd_level < 1 || c.zstd_level > 19 || c.chunk_entries < 1) {
      throw invalid_argument(
          "publication::PublisherConfig: publish_every must be >= 1, zstd_level in 1..19 and "
          "chunk_entries >= 1");
    }
    return c;
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  PublisherConfig cfg_;
  PublicationSchedule schedule_;
  Sender sender_;
  Version version_ = 0;
  std::vector<Digest> digest_;
  PublishReport last_;
};

}  // namespace dte::publication
