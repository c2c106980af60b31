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

template <optimizer_inverse Inverse, change_detector Detect, class Layout = MegatronToHF,
          class Transport = LoopbackTwoRound>
requires layout_mapping<Layout>
class DeltaEngine {
 public:
  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::SglangLayout& receivers, EngineConfig config, Transport& transport)
      : hf_(&hf), recv_layout_(&receivers), config_(config), transport_(&transport) {
    if (config.publish_every < 1) {
      throw invalid_argument("DeltaEngine: publish_every must be >= 1 (got " +
                             std::to_string(config.publish_every) + ")");
    }
    for (std::int64_t g = 0; g < train.world(); ++g)
      plans_.emplace_back(hf, train, receivers, g);
    for (std::int64_t r = 0; r < receivers.topology().ranks(); ++r) {
      receivers_.emplace_back(hf, receivers, r);
      dense_bytes_ +=
          2 * static_cast<std::uint64_t>(receivers.live_elements(r % receivers.topology().tp));
    }
    for (const auto& plan : plans_) {
      for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
        if (config.publish_every > 1) {
          masks_.emplace_back((static_cast<std::size_t>(plan.shard_size(b)) + 63) / 64, 0);
        }
      }
    }
    // Per (trainer rank, receiver, receiver tensor): how many elements this rank contributes
    // and in how many contiguous runs, so each publication can pick the cheaper encoding.
    const std::size_t cells = receivers_.size() * static_cast<std::size_t>(receivers.size());
    contributed_.assign(plans_.size(), std::vector<std::uint64_t>(cells, 0));
    runs_.assign(plans_.size(), std::vector<std::uint64_t>(cells, 0));
    dense_.assign(plans_.size(), std::vector<std::uint8_t>(cells, 0));
    for (std::size_t r = 0; r < plans_.size(); ++r) {
      walk_runs(
          r, [&](layout::BufferKind, std::int64_t, std::int64_t len, const layout::RouteTarget& t) {
            contributed_[r][cell(t)] += static_cast<std::uint64_t>(len);
            ++runs_[r][cell(t)];
          });
    }
  }

  using Plan = typename layout::plan_for<Layout>::type;

  [[nodiscard]] const std::vector<Plan>& plans() const noexcept { return plans_; }
  [[nodiscard]] const std::vector<Receiver>& receivers() const noexcept { return receivers_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] std::int64_t pending_steps() const noexcept { return pending_; }

  // The first publication (version 0): every element, current values.
  template <class Access>
  SyncReport publish_full(Access&& access) {
    SyncReport rep;
    rep.kind = "full";
    rep.version = 0;
    scan(access, Scan::all, rep);
    version_ = 0;
    needs_full_ = false;
    deliver(MessageKind::full, rep, access);
    return rep;
  }

  // Call after every optimizer step. Publishes (and returns true) on every K-th step.
  template <class Access>
  bool step(Access&& access, SyncReport& report) {
    ++pending_;
    if (config_.publish_every == 1) {
      report = publish_now(access, Scan::detect);
      return true;
    }
    SyncReport ignored;
    scan(access, Scan::mark, ignored);  // OR this step's changes into the mask
    if (pending_ < config_.publish_every) return false;
    report = publish_now(access, Scan::mask);
    return true;
  }

  // Publishes the steps taken since the last publication, if any.
  template <class Access>
  bool flush(Access&& access, SyncReport& report) {
    if (pending_ == 0) return false;
    report = publish_now(access, Scan::mask);
    return true;
  }

  // An explicit no-op version (a skipped step, lr = 0): every receiver moves to the next
  // version without a change, through the same version chain.
  template <class Access>
  SyncReport publish_noop(Access&& access) {
    SyncReport rep;
    rep.kind = "noop";
    rep.version = ++version_;
    begin_messages();
    deliver(MessageKind::noop, rep, access);
    return rep;
  }

  // For fault tests: the transport the engine sends through.
  Transport& transport() noexcept { return *transport_; }

 private:
  enum class Scan { all, detect, mark, mask };

  template <class Access>
  SyncReport publish_now(Access& access, Scan mode) {
    SyncReport rep;
    rep.version = version_ + 1;
    rep.steps = pending_;
    const bool full = needs_full_;
    scan(access, full ? Scan::all : mode, rep);  // throws before anything is sent
    version_ = rep.version;
    pending_ = 0;
    needs_full_ = false;
    if (full && !masks_.empty()) {
      for (auto& m : masks_)
        std::fill(m.begin(), m.end(), 0);
    }
    const MessageKind kind = full               ? MessageKind::full
                             : rep.changed == 0 ? MessageKind::noop
                                                : MessageKind::delta;
    rep.kind = full ? "full" : rep.changed == 0 ? "noop" : "delta";
    deliver(kind, rep, access);
    return rep;
  }

  std::vector<std::uint64_t>& mask(std::size_t rank, layout::BufferKind b) {
    return masks_[2 * rank + static_cast<std::size_t>(b)];
  }

  // The fused pass. `all`: every sender element is sent (full publication). `detect`: K = 1,
  // send what this step changed. `mark`: OR this step's changes into the mask, send nothing.
  // `mask`: OR the last step in, then send everything marked and clear the mask. Every mode but
  // `mark` also computes the trainer's digest per canonical tensor.
  template <class Access>
  void scan(Access& access, Scan mode, SyncReport& rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t ranks = plans_.size();
    if (mode != Scan::mark) begin_messages();
    // Which (receiver, tensor) pairs each rank sends densely this time: everything for a full
    // publication; otherwise where the last publication's changes made runs of all values
    // cheaper than indexed entries (a prediction: it only ever costs bytes, never correctness).
    std::vector<std::vector<std::uint64_t>> flagged(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      flagged[r].assign(contributed_[r].size(), 0);
      if (mode == Scan::all) {
        for (std::size_t x = 0; x < dense_[r].size(); ++x)
          dense_[r][x] = contributed_[r][x] > 0;
      }
    }
    std::vector<std::vector<std::uint64_t>> digests(ranks,
                                                    std::vector<std::uint64_t>(hf_->size(), 0));
    std::vector<std::uint64_t> scanned(ranks, 0), changed(ranks, 0), guard(ranks, 0);
    std::vector<std::string> errors(ranks);
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::size_t r = 0; r < ranks; ++r) {
      try {
        const Plan& plan = plans_[r];
        for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
          for (const layout::PlanSegment& s : plan.segments(b)) {
            if (!s.sender) {
              // TP replicas of replicated tensors are never sent, but their state is still
              // validated: a NaN anywhere in the optimizer state refuses the publication.
              if (mode != Scan::all) (void)access.kernel(static_cast<std::int64_t>(r), b, s);
              continue;
            }
            const std::span<const float> theta = access.theta(static_cast<std::int64_t>(r), b);
            using Kernel = typename Inverse::kernel;
            std::optional<Kernel> k;
            if (mode != Scan::all) k.emplace(access.kernel(static_cast<std::int64_t>(r), b, s));
            const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
            const std::vector<std::uint8_t>& dense = dense_[r];
            for (std::int64_t i = 0; i < s.length; ++i) {
              const layout::Canonical c = plan.mapping()(p, s.param_begin + i);
              if (c.tensor < 0) continue;  // vocabulary padding
              const std::int64_t offset = s.shard_begin + i;
              const float now = theta[static_cast<std::size_t>(offset)];
              bool send = mode == Scan::all;
              if (mode != Scan::all) {
                const Verdict v = Detect::classify(now, (*k)(static_cast<std::size_t>(i)));
                const bool flagged = v != Verdict::unchanged;
                if (mode == Scan::detect) {
                  send = flagged;
                  guard[r] += v == Verdict::guard;
                } else {
                  auto& m = mask(r, b);
                  const std::size_t w = static_cast<std::size_t>(offset) / 64;
                  const std::uint64_t bit = 1ull << (offset % 64);
                  if (flagged) m[w] |= bit;
                  guard[r] += v == Verdict::guard;
                  if (mode == Scan::mask) {
                    send = (m[w] & bit) != 0;
                    m[w] &= ~bit;
                  }
                }
              }
              if (mode == Scan::mark) continue;
              ++scanned[r];
              const std::uint16_t bits = Detect::store(now);
              digests[r][static_cast<std::size_t>(c.tensor)] +=
                  element_digest((*hf_)[c.tensor].base + c.index, bits);
              if (send) {
                ++changed[r];
                plan.route(b, offset, [&](const layout::RouteTarget& t) {
                  const std::size_t x = cell(t);
                  ++flagged[r][x];
                  if (!dense[x]) {
                    writers_[r][static_cast<std::size_t>(t.rank)].add(
                        static_cast<std::uint32_t>(t.tensor), static_cast<std::uint32_t>(t.index),
                        bits);
                  }
                });
              }
            }
          }
        }
        if (mode != Scan::mark) emit_dense_runs(r, dense_[r], access);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    }
    for (std::size_t r = 0; r < ranks; ++r) {
      if (!errors[r].empty()) {
        // Refused before anything was sent: the receivers keep the version they hold. The
        // changes of this step were not recorded, so the next publication sends everything.
        needs_full_ = true;
        throw invalid_argument("publication refused on trainer rank " + std::to_string(r) + ": " +
                               errors[r]);
      }
    }
    if (mode == Scan::mark) return;
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t x = 0; x < dense_[r].size(); ++x) {
        // A full publication says nothing about the next delta: start sparse after it.
        dense_[r][x] =
            mode != Scan::all && flagged[r][x] * 10 > contributed_[r][x] * 2 + runs_[r][x] * 12;
      }
    }
    trainer_digest_.assign(static_cast<std::size_t>(hf_->size()), 0);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t t = 0; t < trainer_digest_.size(); ++t)
        trainer_digest_[t] += digests[r][t];
      rep.elements_scanned += scanned[r];
      rep.changed += changed[r];
      rep.guard += guard[r];
    }
    rep.digest = 0;
    for (std::uint64_t d : trainer_digest_)
      rep.digest += d;
    const auto t1 = std::chrono::steady_clock::now();
    rep.detect_s = std::chrono::duration<double>(t1 - t0).count();

    for (const auto& row : writers_) {
      for (const MessageWriter& w : row)
        rep.routed_writes += w.entries();
    }
  }

  [[nodiscard]] std::size_t cell(const layout::RouteTarget& t) const noexcept {
    return static_cast<std::size_t>(t.rank) * static_cast<std::size_t>(recv_layout_->size()) +
           static_cast<std::size_t>(t.tensor);
  }

  // Calls f(buffer, shard offset, length, first target) for every maximal run of this rank's
  // sender elements that lands contiguously in one receiver tensor (every replica's copy);
  // pieces that continue the previous run of the same receiver are merged into it.
  template <class F>
  void walk_runs(std::size_t r, F&& f) const {
    struct Pending {
      layout::BufferKind b;
      std::int64_t offset = 0, len = 0;
      layout::RouteTarget t{};
    };
    const Plan& plan = plans_[r];
    std::vector<Pending> pending(receivers_.size());
    auto piece = [&](layout::BufferKind b, std::int64_t offset, std::int64_t len,
                     const layout::RouteTarget& t) {
      Pending& p = pending[static_cast<std::size_t>(t.rank)];
      if (p.len > 0 && p.b == b && p.t.tensor == t.tensor && p.offset + p.len == offset &&
          p.t.index + p.len == t.index) {
        p.len += len;
        return;
      }
      if (p.len > 0) f(p.b, p.offset, p.len, p.t);
      p = {b, offset, len, t};
    };
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      for (const layout::PlanSegment& s : plan.segments(b)) {
        if (!s.sender) continue;
        const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t pos = 0; pos < s.length;) {
          const std::int64_t local = s.param_begin + pos;
          const std::int64_t row_left = p.cols == 0 ? p.numel() - local : p.cols - local % p.cols;
          std::int64_t n = std::min(s.length - pos, row_left);
          const layout::Canonical c = plan.mapping()(p, local);
          if (c.tensor >= 0) {
            n = std::min({n, (*hf_)[c.tensor].numel() - c.index, recv_layout_->contiguous(c)});
            layout::route_canonical(*recv_layout_, c, [&](const layout::RouteTarget& t) {
              piece(b, s.shard_begin + pos, n, t);
            });
          }
          pos += n;
        }
      }
    }
    for (const Pending& p : pending) {
      if (p.len > 0) f(p.b, p.offset, p.len, p.t);
    }
  }

  // The dense part of rank r's messages: every element of each dense (receiver, tensor) pair
  // as runs of current values.
  template <class Access>
  void emit_dense_runs(std::size_t r, const std::vector<std::uint8_t>& dense, Access& access) {
    if (std::find(dense.begin(), dense.end(), std::uint8_t{1}) == dense.end()) return;
    std::vector<std::uint16_t> bits;
    walk_runs(r, [&](layout::BufferKind b, std::int64_t offset, std::int64_t len,
                     const layout::RouteTarget& t) {
      if (!dense[cell(t)]) return;
      const std::span<const float> theta = access.theta(static_cast<std::int64_t>(r), b);
      bits.resize(static_cast<std::size_t>(len));
      for (std::int64_t i = 0; i < len; ++i) {
        bits[static_cast<std::size_t>(i)] =
            Detect::store(theta[static_cast<std::size_t>(offset + i)]);
      }
      writers_[r][static_cast<std::size_t>(t.rank)].add_run(
          static_cast<std::uint32_t>(t.tensor), static_cast<std::uint32_t>(t.index), bits);
    });
  }

  // One chunked message per (trainer rank, receiver), filled by the scan as it routes.
  void begin_messages() {
    writers_.resize(plans_.size());
    for (auto& row : writers_) {
      row.resize(receivers_.size());
      for (MessageWriter& w : row)
        w.begin();
    }
  }

  // Exchange the outbox, apply on every receiver, verify, repair.
  template <class Access>
  void deliver(MessageKind kind, SyncReport& rep, Access& access) {
    rep.dense_bytes = dense_bytes_;
    auto t0 = std::chrono::steady_clock::now();
    // Every pair gets at least a header, so every receiver checks the version chain against
    // every sender.
    std::vector<std::vector<Payload>> wire(writers_.size());
    rep.sender_extra_bytes = rep.sender_payload_bytes = 0;
    for (std::size_t s = 0; s < writers_.size(); ++s) {
      std::uint64_t payload = 0, held = 0;
      for (MessageWriter& w : writers_[s]) {
        w.finish(kind, version_, kind == MessageKind::full ? no_version : version_ - 1);
        wire[s].push_back(w.spans());
        payload += w.size();
        held += w.capacity();
      }
      std::uint64_t mask_bytes = 0;
      for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
        if (!masks_.empty()) mask_bytes += 8 * mask(s, b).size();
      }
      held += mask_bytes;
      rep.payload_total_bytes += payload;
      rep.sender_mask_bytes = std::max<std::uint64_t>(rep.sender_mask_bytes, mask_bytes);
      // The rank whose extra memory is largest relative to its payload.
      if (rep.sender_payload_bytes == 0 ||
          held * static_cast<double>(rep.sender_payload_bytes) >
              rep.sender_extra_bytes * static_cast<double>(payload)) {
        rep.sender_extra_bytes = held;
        rep.sender_payload_bytes = payload;
      }
    }
    rep.sender_fixed_bytes =
        MessageWriter::chunk_bytes * receivers_.size() +
        8 * static_cast<std::uint64_t>(hf_->size()) +             // the rank's digest per tensor
        25 * static_cast<std::uint64_t>(contributed_[0].size());  // encoding choice tables
    std::vector<Inbox> inbox = transport_->exchange(wire);
    wire.clear();
    for (auto& row : writers_) {
      for (MessageWriter& w : row)
        w.clear();
    }
    rep.bytes = transport_->last_stats().bytes;
    rep.bytes_to = transport_->last_stats().bytes_to;
    auto t1 = std::chrono::steady_clock::now();
    rep.exchange_s = std::chrono::duration<double>(t1 - t0).count();

    std::vector<ApplyResult> results(receivers_.size());
    DTE_OMP(parallel for schedule(dynamic, 1))
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
      results[d] = receivers_[d].apply(version_, inbox[d]);
    }
    for (const ApplyResult& a : results)
      rep.stale_messages += a.stale;
    // Receiver memory beyond its live tensors: the received messages (read in place) and one
    // small view per message.
    rep.receiver_extra_bytes = rep.receiver_payload_bytes = 0;
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
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
      repair(bad, resync, access);
      bad = mismatched_tensors();
    }
    rep.verified = std::find(bad.begin(), bad.end(), true) == bad.end();
    for (const Receiver& r : receivers_)
      rep.verified = rep.verified && r.version() == version_;
  }

  [[nodiscard]] std::vector<bool> mismatched_tensors() const {
    const auto& it = recv_layout_->topology();
    std::vector<bool> bad(trainer_digest_.size(), false);
    for (std::int64_t replica = 0; replica < it.replicas; ++replica) {
      for (std::size_t t = 0; t < trainer_digest_.size(); ++t) {
        std::uint64_t sum = 0;
        for (std::int64_t ts = 0; ts < it.tp; ++ts) {
          sum += receivers_[static_cast<std::size_t>(replica * it.tp + ts)].digest()[t];
        }
        const auto copies = static_cast<std::uint64_t>(
            recv_layout_->copies((*hf_)[static_cast<std::int64_t>(t)].kind));
        if (sum != copies * trainer_digest_[t]) bad[t] = true;
      }
    }
    return bad;
  }

  // Resend every element of the bad tensors (to every receiver), and everything to receivers
  // that must resync, current values.
  template <class Access>
  void repair(const std::vector<bool>& bad, const std::vector<bool>& resync, Access& access) {
    const std::size_t ranks = plans_.size();
    std::vector<std::vector<MessageWriter>> out(ranks);
    for (auto& row : out) {
      row.resize(receivers_.size());
      for (MessageWriter& w : row)
        w.begin();
    }
    for (std::size_t r = 0; r < ranks; ++r) {
      const Plan& plan = plans_[r];
      for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
        const std::span<const float> theta = access.theta(static_cast<std::int64_t>(r), b);
        for (const layout::PlanSegment& s : plan.segments(b)) {
          if (!s.sender) continue;
          const auto& p = plan.params()[static_cast<std::size_t>(s.param)];
          for (std::int64_t i = 0; i < s.length; ++i) {
            const layout::Canonical c = plan.mapping()(p, s.param_begin + i);
            if (c.tensor < 0) continue;
            const bool tensor_bad = bad[static_cast<std::size_t>(c.tensor)];
            const std::uint16_t bits =
                Detect::store(theta[static_cast<std::size_t>(s.shard_begin + i)]);
            plan.route(b, s.shard_begin + i, [&](const layout::RouteTarget& t) {
              if (tensor_bad || resync[static_cast<std::size_t>(t.rank)]) {
                out[r][static_cast<std::size_t>(t.rank)].add(static_cast<std::uint32_t>(t.tensor),
                                                             static_cast<std::uint32_t>(t.index),
                                                             bits);
              }
            });
          }
        }
      }
    }
    std::vector<std::vector<Payload>> wire(ranks);
    for (std::size_t s = 0; s < ranks; ++s) {
      for (std::size_t d = 0; d < receivers_.size(); ++d) {
        MessageWriter& w = out[s][d];
        w.finish(resync[d] ? MessageKind::full : MessageKind::repair, version_, no_version);
        wire[s].push_back(w.entries() == 0 && !resync[d] ? Payload{} : w.spans());
      }
    }
    std::vector<Inbox> inbox = transport_->exchange(wire);
    for (std::size_t d = 0; d < receivers_.size(); ++d) {
      if (!inbox[d].empty()) receivers_[d].apply(version_, inbox[d]);
    }
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* recv_layout_;
  EngineConfig config_;
  Transport* transport_;
  std::vector<Plan> plans_;
  std::vector<Receiver> receivers_;
  std::vector<std::vector<std::uint64_t>> masks_;
  std::vector<std::vector<MessageWriter>> writers_;  // [trainer rank][receiver]
  // [trainer rank][receiver * receiver tensors + tensor]
  std::vector<std::vector<std::uint64_t>> contributed_, runs_;
  std::vector<std::vector<std::uint8_t>> dense_;
  std::vector<std::uint64_t> trainer_digest_;
  std::uint64_t dense_bytes_ = 0;
  std::int64_t pending_ = 0;
  bool needs_full_ = false;  // a refused scan lost track of changes: resend everything
  Version version_ = no_version;
};

}  // namespace dte
