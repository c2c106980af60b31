// SPDX-License-Identifier: Apache-2.0
// DeltaEngine on the host backend: per trainer rank, one fused pass over each optimizer-shard
// segment (reconstruct, round, compare with the guard band, compact), routing through the
// transfer plan, bucketing per receiver, the two-round exchange, transactional apply on the
// receivers, and verification of every replica against the trainer's digest with a dense
// repair of any tensor that disagrees (shared/DESIGN.md §2-§5).
//
// Publication every K optimizer steps: step() ORs each step's changes into a one-bit-per-
// element dirty mask and publishes the marked elements' current values on the K-th step;
// flush() publishes whatever is pending. K = 1 keeps no mask.
//
// The trainer's state reaches the engine through an accessor `a` with
//   a.theta(rank, buffer)           -> std::span<const float>, the rank's FP32 shard of that buffer
//   a.kernel(rank, buffer, segment) -> Inverse::kernel over that segment (hyperparameters differ
//                                      per parameter group), built with Inverse::bind, which
//                                      validates the state first.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/engine/digest.hpp"
#include "dte/engine/message.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/sender.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/transport/loopback.hpp"

namespace dte {

struct EngineConfig {
  std::int64_t publish_every = 1;  // K
  bool verify = true;              // compare every replica's digest with the trainer's
};

struct SyncReport {
  Version version = 0;
  std::string kind;                     // full | delta | noop
  std::int64_t steps = 0;               // optimizer steps this publication covers
  std::uint64_t elements_scanned = 0;   // sender elements read by the detect pass
  std::uint64_t changed = 0;            // elements sent (changed or guard band)
  std::uint64_t guard = 0;              // of which only flagged by the guard band
  std::uint64_t routed_writes = 0;      // receiver element writes, all replicas
  std::uint64_t bytes = 0;              // on the wire, all receivers
  std::vector<std::uint64_t> bytes_to;  // per receiver rank
  std::uint64_t dense_bytes = 0;        // what a dense BF16 sync would move: 2 per live element
  std::uint64_t digest = 0;             // trainer total: sum over canonical tensors
  bool verified = false;                // every replica matched (after repair, if any)
  std::vector<std::string> repaired;    // canonical tensors resent densely
  std::vector<std::int64_t> resynced;   // receivers that refused and got a full resync
  std::uint64_t stale_messages = 0;     // replays of older versions, ignored by the receivers
  // Memory beyond the model (bytes), for the rank with the largest ratio to its payload: the
  // sender's chunked messages (+ its dirty masks when K > 1), the receiver's received messages.
  std::uint64_t sender_extra_bytes = 0, sender_payload_bytes = 0;
  std::uint64_t receiver_extra_bytes = 0, receiver_payload_bytes = 0;
  std::uint64_t sender_mask_bytes = 0;     // K > 1: one bit per shard element, per rank
  std::uint64_t sender_fixed_bytes = 0;    // a partly filled chunk per receiver + per-tensor tables
  std::uint64_t payload_total_bytes = 0;   // all senders' messages
  std::uint64_t received_total_bytes = 0;  // all receivers' messages
  // detect: the fused pass (reconstruct, round, compare, compact, route into per-receiver
  // messages); route: closing the messages; then exchange, apply, verify (and repair).
  double detect_s = 0, route_s = 0, exchange_s = 0, apply_s = 0, verify_s = 0;

  [[nodiscard]] double changed_fraction() const noexcept {
    return elements_scanned == 0 ? 0.0 : static_cast<double>(changed) / elements_scanned;
  }

  [[nodiscard]] std::string json() const {
    char buf[1024];
    std::string repaired_list;
    for (const auto& r : repaired)
      repaired_list += (repaired_list.empty() ? "\"" : ",\"") + r + "\"";
    std::snprintf(buf, sizeof buf,
                  "{\"version\":%llu,\"kind\":\"%s\",\"steps\":%lld,\"elements_scanned\":%llu,"
                  "\"changed\":%llu,\"guard_extra\":%llu,\"changed_fraction\":%.6g,"
                  "\"receiver_writes\":%llu,\"bytes\":%llu,\"dense_bytes\":%llu,"
                  "\"digest\":\"%016llx\",\"verified\":%s,\"resynced_receivers\":%zu,"
                  "\"stale_messages\":%llu,"
                  "\"seconds\":{\"detect\":%.6f,\"route\":%.6f,\"exchange\":%.6f,\"apply\":%.6f,"
                  "\"verify\":%.6f},\"repaired\":[",
                  static_cast<unsigned long long>(version), kind.c_str(),
                  static_cast<long long>(steps), static_cast<unsigned long long>(elements_scanned),
                  static_cast<unsigned long long>(changed), static_cast<unsigned long long>(guard),
                  changed_fraction(), static_cast<unsigned long long>(routed_writes),
                  static_cast<unsigned long long>(bytes),
                  static_cast<unsigned long long>(dense_bytes),
                  static_cast<unsigned long long>(digest), verified ? "true" : "false",
                  resynced.size(), static_cast<unsigned long long>(stale_messages), detect_s,
                  route_s, exchange_s, apply_s, verify_s);
    std::string out = buf;
    out += repaired_list + "],\"bytes_to\":[";
    for (std::size_t i = 0; i < bytes_to.size(); ++i) {
      out += (i ? "," : "") + std::to_string(bytes_to[i]);
    }
    return out + "]}";
  }
};

using MegatronToHF = layout::MegatronToHF;

namespace detail {

// The verification verdict: canonical tensor t disagrees when, in some replica, the sum of the
// receivers' digests (replica_sums[replica * tensors + t]) differs from the trainer's digest
// times the copies of t a replica holds.
inline std::vector<bool> mismatched_tensors(const layout::HfModel& hf,
                                            const layout::SglangLayout& receivers,
                                            const std::vector<std::uint64_t>& trainer,
                                            const std::uint64_t* replica_sums) {
  const std::size_t tensors = trainer.size();
  std::vector<bool> bad(tensors, false);
  for (std::int64_t replica = 0; replica < receivers.topology().replicas; ++replica) {
    for (std::size_t t = 0; t < tensors; ++t) {
      const auto copies =
          static_cast<std::uint64_t>(receivers.copies(hf[static_cast<std::int64_t>(t)].kind));
      if (replica_sums[static_cast<std::size_t>(replica) * tensors + t] != copies * trainer[t]) {
        bad[t] = true;
      }
    }
  }
  return bad;
}

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
    self().scan(access, ScanMode::all, rep);
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
      report = publish_now(access, ScanMode::detect);
      return true;
    }
    SyncReport ignored;
    self().scan(access, ScanMode::mark, ignored);  // OR this step's changes into the mask
    if (pending_ < config_.publish_every) return false;
    report = publish_now(access, ScanMode::mask);
    return true;
  }

  // Publishes the steps taken since the last publication, if any.
  template <class Access>
  bool flush(Access&& access, SyncReport& report) {
    if (pending_ == 0) return false;
    report = publish_now(access, ScanMode::mask);
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
  SyncReport publish_now(Access& access, ScanMode mode) {
    SyncReport rep;
    rep.version = version_ + 1;
    rep.steps = pending_;
    const bool full = needs_full_;
    self().scan(access, full ? ScanMode::all : mode, rep);  // throws before anything is sent
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

template <optimizer_inverse Inverse, change_detector Detect, class Layout = MegatronToHF,
          class Transport = LoopbackTwoRound>
requires layout_mapping<Layout>
class DeltaEngine
    : public detail::PublicationSchedule<DeltaEngine<Inverse, Detect, Layout, Transport>> {
  using Schedule = detail::PublicationSchedule<DeltaEngine>;
  friend Schedule;
  using Schedule::config_;
  using Schedule::version_;

 public:
  using Sender = SenderRank<Inverse, Detect, Layout>;
  using Plan = typename Sender::Plan;

  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::SglangLayout& receivers, EngineConfig config, Transport& transport)
      : Schedule(config), hf_(&hf), recv_layout_(&receivers), transport_(&transport) {
    for (std::int64_t g = 0; g < train.world(); ++g) {
      senders_.emplace_back(hf, train, receivers, g, config.publish_every > 1);
    }
    for (std::int64_t r = 0; r < receivers.topology().ranks(); ++r) {
      receivers_.emplace_back(hf, receivers, r);
      dense_bytes_ +=
          2 * static_cast<std::uint64_t>(receivers.live_elements(r % receivers.topology().tp));
    }
  }

  [[nodiscard]] const std::vector<Sender>& senders() const noexcept { return senders_; }
  [[nodiscard]] const std::vector<Receiver>& receivers() const noexcept { return receivers_; }

  // An explicit no-op version (a skipped step, lr = 0): every receiver moves to the next
  // version without a change, through the same version chain.
  template <class Access>
  SyncReport publish_noop(Access&& access) {
    SyncReport rep;
    rep.kind = "noop";
    rep.version = ++version_;
    for (Sender& s : senders_)
      s.begin_messages();  // headers only
    deliver(MessageKind::noop, rep, access);
    return rep;
  }

  // For fault tests: the transport the engine sends through.
  Transport& transport() noexcept { return *transport_; }

 private:
  void clear_masks() {
    for (Sender& s : senders_)
      s.clear_masks();
  }

  // Every sender's fused pass (in parallel), then the trainer's digest per canonical tensor.
  template <class Access>
  void scan(Access& access, ScanMode mode, SyncReport& rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t ranks = senders_.size();
    std::vector<ScanResult> results(ranks);
    std::vector<std::string> errors(ranks);
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::size_t r = 0; r < ranks; ++r) {
      try {
        results[r] = senders_[r].scan(access, mode);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    }
    for (std::size_t r = 0; r < ranks; ++r) {
      if (!errors[r].empty()) {
        // Refused before anything was sent: the receivers keep the version they hold.
        this->refused();
        throw invalid_argument("publication refused on trainer rank " + std::to_string(r) + ": " +
                               errors[r]);
      }
    }
    if (mode == ScanMode::mark) return;
    trainer_digest_.assign(static_cast<std::size_t>(hf_->size()), 0);
    for (const ScanResult& res : results) {
      for (std::size_t t = 0; t < trainer_digest_.size(); ++t)
        trainer_digest_[t] += res.digest[t];
      rep.elements_scanned += res.scanned;
      rep.changed += res.changed;
      rep.guard += res.guard;
    }
    rep.digest = 0;
    for (std::uint64_t d : trainer_digest_)
      rep.digest += d;
    rep.detect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Exchange the messages, apply on every receiver, verify, repair.
  template <class Access>
  void deliver(MessageKind kind, SyncReport& rep, Access& access) {
    rep.dense_bytes = dense_bytes_;
    auto t0 = std::chrono::steady_clock::now();
    const Version base = kind == MessageKind::full ? no_version : version_ - 1;
    std::vector<std::vector<Payload>> wire;
    rep.sender_extra_bytes = rep.sender_payload_bytes = 0;
    for (Sender& s : senders_) {
      wire.push_back(s.finish(kind, version_, base));
      const std::uint64_t payload = s.payload_bytes(), held = s.held_bytes();
      rep.payload_total_bytes += payload;
      rep.sender_mask_bytes = std::max(rep.sender_mask_bytes, s.mask_bytes());
      rep.sender_fixed_bytes = s.fixed_bytes();
      // The rank whose extra memory is largest relative to its payload.
      if (rep.sender_payload_bytes == 0 ||
          held * static_cast<double>(rep.sender_payload_bytes) >
              rep.sender_extra_bytes * static_cast<double>(payload)) {
        rep.sender_extra_bytes = held;
        rep.sender_payload_bytes = payload;
      }
    }
    std::vector<Inbox> inbox = transport_->exchange(wire);
    wire.clear();
    for (Sender& s : senders_)
      s.release();
    rep.bytes = transport_->last_stats().bytes;
    rep.bytes_to = transport_->last_stats().bytes_to;
    auto t1 = std::chrono::steady_clock::now();
    rep.exchange_s = std::chrono::duration<double>(t1 - t0).count();

    std::vector<ApplyResult> results(receivers_.size());
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
      results[d] = receivers_[d].apply(version_, inbox[d]);
    }
    // Receiver memory beyond its live tensors: the received messages (read in place) and one
    // small view per message.
    rep.receiver_extra_bytes = rep.receiver_payload_bytes = 0;
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
      rep.stale_messages += results[d].stale;
      rep.routed_writes += results[d].written;
      std::uint64_t received = 0;
      for (const auto& [src, bytes] : inbox[d])
        received += bytes.capacity();
      rep.received_total_bytes += received;
      const std::uint64_t held = received + inbox[d].size() * sizeof(MessageView);
      if (held > rep.receiver_extra_bytes) {
        rep.receiver_extra_bytes = held;
        rep.receiver_payload_bytes = received;
      }
    }
    auto t2 = std::chrono::steady_clock::now();
    rep.apply_s = std::chrono::duration<double>(t2 - t1).count();
    if (config_.verify) verify_and_repair(results, rep, access);
    rep.verify_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
  }

  // Each replica's per-tensor digest (summed over its TP ranks) must equal the trainer's times
  // the number of copies a replica holds. A receiver that refused the publication gets a full
  // resync; a tensor that disagrees is resent densely to every receiver holding it.
  template <class Access>
  void verify_and_repair(const std::vector<ApplyResult>& results, SyncReport& rep, Access& access) {
    std::vector<bool> resync(receivers_.size(), false);
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
      if (!results[d].committed) {
        resync[d] = true;
        rep.resynced.push_back(static_cast<std::int64_t>(d));
      }
    }
    std::vector<bool> bad = mismatched_tensors();
    const bool any_bad = std::find(bad.begin(), bad.end(), true) != bad.end();
    if (any_bad || !rep.resynced.empty()) {
      for (std::size_t t = 0; t < bad.size(); ++t) {
        if (bad[t]) rep.repaired.push_back(hf_->name(static_cast<std::int64_t>(t)));
      }
      std::vector<std::vector<Payload>> wire;
      for (Sender& s : senders_)
        wire.push_back(s.repair(access, bad, resync, version_));
      std::vector<Inbox> inbox = transport_->exchange(wire);
      for (Sender& s : senders_)
        s.release();
      for (std::size_t d = 0; d < receivers_.size(); ++d) {
        if (!inbox[d].empty()) receivers_[d].apply(version_, inbox[d]);
      }
      bad = mismatched_tensors();
    }
    rep.verified = std::find(bad.begin(), bad.end(), true) == bad.end();
    for (const Receiver& r : receivers_)
      rep.verified = rep.verified && r.version() == version_;
  }

  [[nodiscard]] std::vector<bool> mismatched_tensors() const {
    const auto& it = recv_layout_->topology();
    const std::size_t tensors = trainer_digest_.size();
    std::vector<std::uint64_t> sums(static_cast<std::size_t>(it.replicas) * tensors, 0);
    for (const Receiver& r : receivers_) {
      const auto replica = static_cast<std::size_t>(r.rank() / it.tp);
      for (std::size_t t = 0; t < tensors; ++t)
        sums[replica * tensors + t] += r.digest()[t];
    }
    return detail::mismatched_tensors(*hf_, *recv_layout_, trainer_digest_, sums.data());
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* recv_layout_;
  Transport* transport_;
  std::vector<Sender> senders_;
  std::vector<Receiver> receivers_;
  std::vector<std::uint64_t> trainer_digest_;
  std::uint64_t dense_bytes_ = 0;
};

}  // namespace dte
