// SPDX-License-Identifier: Apache-2.0
// The publication schedule: version numbers, publication every K optimizer steps (step() marks,
// the K-th step publishes, flush() publishes what is pending), explicit no-op versions, and a
// full publication after a refused one (its changes were never recorded).
#pragma once

#include <cstdint>
#include <string>

#include "dte/engine/message.hpp"
#include "dte/engine/report.hpp"
#include "dte/error.hpp"
#include "dte/pipeline/detect.hpp"

namespace dte {

struct EngineConfig {
  std::int64_t publish_every = 1;  // K
  bool verify = true;              // compare every replica's digest with the trainer's
};

namespace detail {

// The publication schedule every engine shares: version numbers, publication every K steps,
// and a full publication after a refused one. Derived provides scan(access, mode, report)
// (throws, calling refused(), when a trainer rank refuses), deliver(kind, report, access) and
// clear_masks().
template <class Derived>
class PublicationSchedule {
 public:
  explicit PublicationSchedule(EngineConfig config) : config_(config) {
    if (config.publish_every < 1) {
      throw invalid_argument("publish_every must be >= 1 (got " +
                             std::to_string(config.publish_every) + ")");
    }
  }

  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] std::int64_t pending_steps() const noexcept { return pending_; }

  // The first publication (version 0): every element, current values.
  template <class Access>
  SyncReport publish_full(Access&& access) {
    SyncReport rep;
    rep.kind = "full";
    rep.version = 0;
    self().scan(access, pipeline::ScanMode::all, rep);
    version_ = 0;
    needs_full_ = false;
    self().deliver(MessageKind::full, rep, access);
    return rep;
  }

  // Call after every optimizer step. Publishes (and returns true) on every K-th step.
  template <class Access>
  bool step(Access&& access, SyncReport& report) {
    ++pending_;
    if (config_.publish_every == 1) {
      report = publish_now(access, pipeline::ScanMode::detect);
      return true;
    }
    SyncReport ignored;
    self().scan(access, pipeline::ScanMode::mark, ignored);  // OR this step's changes into the mask
    if (pending_ < config_.publish_every) return false;
    report = publish_now(access, pipeline::ScanMode::mask);
    return true;
  }

  // Publishes the steps taken since the last publication, if any.
  template <class Access>
  bool flush(Access&& access, SyncReport& report) {
    if (pending_ == 0) return false;
    report = publish_now(access, pipeline::ScanMode::mask);
    return true;
  }

 protected:
  // A trainer rank refused: the changes of this step were not recorded, so the next
  // publication sends everything.
  void refused() noexcept { needs_full_ = true; }

  EngineConfig config_;
  Version version_ = no_version;

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }

  template <class Access>
  SyncReport publish_now(Access& access, pipeline::ScanMode mode) {
    SyncReport rep;
    rep.version = version_ + 1;
    rep.steps = pending_;
    const bool full = needs_full_;
    self().scan(access, full ? pipeline::ScanMode::all : mode,
                rep);  // throws before anything is sent
    version_ = rep.version;
    pending_ = 0;
    needs_full_ = false;
    if (full) self().clear_masks();
    const MessageKind kind = full               ? MessageKind::full
                             : rep.changed == 0 ? MessageKind::noop
                                                : MessageKind::delta;
    rep.kind = full ? "full" : rep.changed == 0 ? "noop" : "delta";
    self().deliver(kind, rep, access);
    return rep;
  }

  std::int64_t pending_ = 0;
  bool needs_full_ = false;
};

}  // namespace detail
}  // namespace dte
