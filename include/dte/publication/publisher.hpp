// SPDX-License-Identifier: Apache-2.0
// publication::Publisher: a trainer publishes self-contained messages
// (publication/message.hpp) instead of sending to receivers it knows. Either one trainer that
// holds the whole model in HF layout (a PyTorch model, a user's own loop: the Identity layout),
// or one writer of several: each rank of a sharded trainer holds pieces of HF tensors
// (layout/identity.hpp) and publishes its part; merge() (publication/message.hpp) makes the
// parts of one version one message. The sender frame is the engine's (pipeline/frame.hpp:
// validate, reconstruct, detect with the guard band, compact, the K-step dirty mask); its sink is
// storage's chunk sink, in memory. Exec: where the trainer's tensors live: exec::Host, or
// exec::Cuda with publication/device_sender.cuh included (the stages run on the device and only
// the changed elements come to the host for the chunks; the messages are byte for byte the
// host's).
//
// One publication, top to bottom:
//   1. the kind: full for the first one, after any refusal or failure (nothing is known about
//      what the refused step changed), and on request; else a delta on the version last returned;
//   2. the staged pass over this rank's weights (all: every element; detect: this step's changes;
//      mask: everything the dirty mask gathered over the last publish_every steps);
//   3. the chunks (zstd; at most chunk_entries elements each), the manifest with the digest per
//      canonical tensor of what this rank sends, the message (a part, with several writers). A
//      refusal throws before any of it and returns nothing; the version number is not used up;
//   4. with several writers, the caller learns whether every writer got this far and then calls
//      commit() (the version is published) or abort() (it is not; the next one is full), on
//      every writer alike. With one writer, publish() and step() commit themselves.
// Between publications, step() ORs each optimizer step's changes into the dirty mask.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/digest.hpp"
#include "dte/engine/schedule.hpp"
#include "dte/error.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/identity.hpp"
#include "dte/pipeline/flag_sink.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/publication/fp8_sender.hpp"
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
// hf: the model, for FP8 receivers (hf_weights: an HF tensor's weights whole).
template <optimizer_inverse Inverse>
struct FlatAccess {
  const FlatTrainer<Inverse>* t;
  const layout::HfModel* hf = nullptr;
  [[nodiscard]] std::span<const float> theta(std::int64_t, layout::BufferKind b) const {
    return b == layout::BufferKind::dense ? t->theta : std::span<const float>{};
  }
  [[nodiscard]] std::span<const float> hf_weights(std::int64_t tensor) const {
    if (hf == nullptr) {
      throw invalid_argument("publication::FlatAccess: FP8 receivers need the model (hf)");
    }
    return t->theta.subspan(static_cast<std::size_t>((*hf)[tensor].base),
                            static_cast<std::size_t>((*hf)[tensor].numel()));
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
  std::uint64_t fp8_codes = 0;   // FP8 publications: codes sent, over every rank
  std::uint64_t fp8_scales = 0;  // ... and block scales
  Digest digest = 0;             // the trainer's state, summed over tensors
  double seconds = 0;            // inside the publisher
  [[nodiscard]] bool full() const noexcept { return base == no_version; }
};

// Which writer of a publication this publisher is: rank `rank` of `count`.
struct Writer {
  std::uint32_t rank = 0;
  std::uint32_t count = 1;
};

namespace detail {
// The sender of a publisher over executor Exec: the host's sender frame, or (exec::Cuda,
// publication/device_sender.cuh) the device stages. Either has check_trainer(access),
// scan(access, mode, chunk sink), mark(access), clear_masks() and plan().
template <class Inverse, class Detect, class Plan, class Exec>
struct publication_sender {
  using type = SenderFrame<Inverse, Detect, Plan, Exec>;
};
}  // namespace detail

template <optimizer_inverse Inverse, change_detector Detect, class Plan = layout::IdentityPlan,
          class Exec = HostExecutor>
class Publisher {
 public:
  using Sender = typename detail::publication_sender<Inverse, Detect, Plan, Exec>::type;

  // One trainer holding the whole model (the flat buffer of FlatTrainer).
  Publisher(const layout::ModelSpec& model, PublisherConfig cfg = {},
            Exec exec = {}) requires std::same_as<Plan, layout::IdentityPlan>
      : spec_(named_by_structure(model)),
        hf_(spec_),
        cfg_(checked(cfg)),
        schedule_(cfg_.publish_every),
        sender_(hf_, layout::IdentityPlan(hf_, layout::TrainTopology{}, 0), 0,
                schedule_.keeps_mask(), exec) {}

  // Writer `writer` of a sharded trainer, holding `pieces` (every writer's pieces together hold
  // each element once: layout::check_writers).
  Publisher(const layout::ModelSpec& model, const std::vector<layout::LocalPiece>& pieces,
            Writer writer, PublisherConfig cfg = {},
            Exec exec = {}) requires std::same_as<Plan, layout::LocalShardPlan>
      : spec_(named_by_structure(model)),
        hf_(spec_),
        cfg_(checked(cfg)),
        writer_(checked(writer)),
        schedule_(cfg_.publish_every),
        sender_(hf_, layout::LocalShardPlan(hf_, pieces, writer.rank), writer.rank,
                schedule_.keeps_mask(), exec) {}

  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] const Plan& plan() const noexcept { return sender_.plan(); }
  [[nodiscard]] Writer writer() const noexcept { return writer_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  // Per canonical tensor: the digest of the trainer's BF16 state as of the last publication
  // (with several writers, of the elements this one sends: the writers' digests sum to it).
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }
  [[nodiscard]] const PublishReport& last() const noexcept { return last_; }
  // Whether a part awaits commit() or abort().
  [[nodiscard]] bool pending() const noexcept { return pending_.has_value(); }
  [[nodiscard]] bool serves_fp8() const noexcept { return fp8_ != nullptr; }

  // From the next publication on (a full one), publish for receivers that serve online FP8
  // (docs/fp8.md): target's recipe and one replica of its topology. The access passed to step()
  // and publish() must then give each HF tensor's weights whole (hf_weights(t)). One writer on
  // the host only.
  void serve_fp8(const Fp8Target& target) {
    if (writer_.count != 1 || !std::same_as<Exec, HostExecutor>) {
      throw unsupported(
          "publication::Publisher::serve_fp8: FP8 receivers are served by one writer holding "
          "the whole model on the host; sharded trainers and CUDA tensors are not covered yet "
          "(docs/fp8.md)");
    }
    if (pending_) throw protocol_error("publication::Publisher::serve_fp8: a version is pending");
    fp8_ = make_fp8_stage<Detect>(hf_, target);
    schedule_.require_full();
  }

  // After every optimizer step: a message every publish_every steps, else nothing (this step's
  // changes ORed into the dirty mask). A refusal throws; the next publication is then full.
  // With several writers the message is this writer's part, pending until commit() / abort().
  template <class Access>
  std::optional<Bytes> step(const Access& access) {
    if (!schedule_.step()) {
      try {
        schedule_.mark([&] { (void)sender_.mark(access); });
      } catch (...) {
        schedule_.require_full();
        throw;
      }
      return std::nullopt;
    }
    return publish(access, false);
  }

  // Now: a delta of everything changed since the last publication (a full one when one is due),
  // or, want_full, every element.
  template <class Access>
  Bytes publish(const Access& access, bool want_full) {
    if (pending_) {
      throw protocol_error(
          "publication::Publisher: version " + std::to_string(pending_->version) +
          " awaits commit() or abort(); every writer decides on one version before the next");
    }
    const auto t0 = std::chrono::steady_clock::now();
    const PublicationSchedule::Pass pass = schedule_.next(want_full);
    const bool full = pass.full();
    const Version v = version_ + 1;
    const Version base = full ? no_version : version_;
    std::vector<Bytes> blobs;
    ScanResult scan;
    storage::Manifest m;
    std::optional<Fp8Section> fp8;
    std::vector<Bytes> fp8_parts;
    try {
      sender_.check_trainer(access);
      // (the previous bits are known when the base is the previous optimizer step)
      const bool one_step = !full && pass.steps == 1;
      const auto write_chunks = [&](auto& sink) {
        if constexpr (std::same_as<Exec, HostExecutor>) {
          if (fp8_) {
            fp8_->begin(full);
            std::vector<bool> skip(static_cast<std::size_t>(hf_.size()));
            for (std::int64_t t = 0; t < hf_.size(); ++t)
              skip[static_cast<std::size_t>(t)] = fp8_->takes(t);
            sink.skip(std::move(skip));
            pipeline::FlagSink<std::remove_reference_t<decltype(sink)>, Fp8Stage> split(sink, *fp8_,
                                                                                        one_step);
            scan = sender_.scan(access, pass.mode, split);
            m.chunks = sink.written();
            fp8 = fp8_->finish(whole_tensors(access), v, base, fp8_parts);
            return;
          }
        }
        scan = sender_.scan(access, pass.mode, sink);
        m.chunks = sink.written();
      };
      const storage::ChunkHeader header{v, base, 0, writer_.rank};
      if (cfg_.encoding == storage::Encoding::diff && one_step) {
        storage::ChunkSink<true, storage::ChunkMemory> sink(hf_, header, cfg_.zstd_level,
                                                            cfg_.chunk_entries, {&blobs, full});
        write_chunks(sink);
      } else {
        storage::ChunkSink<false, storage::ChunkMemory> sink(hf_, header, cfg_.zstd_level,
                                                             cfg_.chunk_entries, {&blobs, full});
        write_chunks(sink);
      }
    } catch (...) {
      if (fp8_) fp8_->abort();
      schedule_.require_full();
      throw;
    }
    m.model = spec_.name;
    m.version = v;
    m.base = base;
    m.writers = writer_.count;
    m.changed = scan.changed;
    m.digest = scan.digest;
    Bytes out = fp8 ? encode(spec_, m, blobs, fp8_format, &*fp8, fp8_parts)
                    : encode(spec_, m, blobs, writer_.count == 1 ? format : part_format);
    PublishReport rep;
    rep.version = v;
    rep.base = base;
    rep.changed = scan.changed;
    rep.scanned = scan.scanned;
    rep.guard = scan.guard;
    rep.bytes = out.size();
    rep.dense_bytes = 2 * static_cast<std::uint64_t>(hf_.total());
    for (Digest d : scan.digest)
      rep.digest += d;
    if (fp8) std::tie(rep.fp8_codes, rep.fp8_scales) = fp8_->sent();
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    pending_ = Pending{v, pass.clears_masks(), std::move(scan.digest), rep};
    if (writer_.count == 1) commit();
    return out;
  }

  // Every writer produced its part of the pending version: it is published.
  void commit() {
    if (!pending_) throw protocol_error("publication::Publisher::commit: no version is pending");
    if (pending_->clears_masks) sender_.clear_masks();
    if (fp8_) fp8_->commit();
    schedule_.published();
    version_ = pending_->version;
    digest_ = std::move(pending_->digest);
    last_ = pending_->report;
    pending_.reset();
  }

  // Some writer failed: the pending version (if any) is not published, and the next
  // publication is full (nothing is known about what the failed step changed).
  void abort() noexcept {
    pending_.reset();
    if (fp8_) fp8_->abort();
    schedule_.require_full();
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
  static Writer checked(Writer w) {
    if (w.count < 1 || w.rank >= w.count) {
      throw invalid_argument("publication::Publisher: writer " + std::to_string(w.rank) + " of " +
                             std::to_string(w.count) + " does not exist");
    }
    return w;
  }

  static PublisherConfig checked(const PublisherConfig& c) {
    if (c.publish_every < 1 || c.zstd_level < 1 || c.zstd_level > 19 || c.chunk_entries < 1) {
      throw invalid_argument(
          "publication::PublisherConfig: publish_every must be >= 1, zstd_level in 1..19 and "
          "chunk_entries >= 1");
    }
    return c;
  }

  // Each HF tensor's weights, whole: what the FP8 stage reads its touched blocks from.
  template <class Access>
  static HfWeights whole_tensors(const Access& access) {
    if constexpr (requires { access.hf_weights(std::int64_t{}); }) {
      return [&access](std::int64_t t) { return access.hf_weights(t); };
    } else {
      throw unsupported(
          "publication::Publisher: FP8 receivers need the trainer's access to give each HF "
          "tensor's weights whole (hf_weights(t))");
    }
  }

  struct Pending {
    Version version;
    bool clears_masks;
    std::vector<Digest> digest;
    PublishReport report;
  };

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  PublisherConfig cfg_;
  Writer writer_;
  PublicationSchedule schedule_;
  Sender sender_;
  Version version_ = 0;
  std::vector<Digest> digest_;
  PublishReport last_;
  std::optional<Pending> pending_;
  std::unique_ptr<Fp8Stage> fp8_;
};

}  // namespace dte::publication
