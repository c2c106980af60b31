// SPDX-License-Identifier: Apache-2.0
// MpiDeltaEngine: the DeltaEngine protocol with one rank per process. MPI ranks [0, S) are the
// trainer ranks (S = the trainer world), ranks [S, S + R) the receiver ranks (R = replicas x
// inference TP). Every process calls the same methods in the same order; senders run their
// SenderRank, receivers their Receiver. Collective steps (agreeing that no trainer rank refused,
// summing digests, exchanging messages) are non-blocking operations waited on with a deadline,
// so a stalled or dead peer becomes an error naming it and the phase, never a hang. A receiver
// commits a version only after its whole publication arrived and was checked.
// Needs MPI (target dte::mpi).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dte/engine/engine.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/sender.hpp"
#include "dte/transport/mpi.hpp"

namespace dte {

template <optimizer_inverse Inverse, change_detector Detect, class Layout = MegatronToHF>
requires layout_mapping<Layout>
class MpiDeltaEngine : public detail::PublicationSchedule<MpiDeltaEngine<Inverse, Detect, Layout>> {
  using Schedule = detail::PublicationSchedule<MpiDeltaEngine>;
  friend Schedule;
  using Schedule::config_;
  using Schedule::version_;

 public:
  using Sender = SenderRank<Inverse, Detect, Layout>;

  MpiDeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
                 const layout::SglangLayout& receivers, EngineConfig config, MPI_Comm comm,
                 MpiTwoRoundConfig transport = {})
      : Schedule(config),
        hf_(&hf),
        recv_layout_(&receivers),
        comm_(comm),
        senders_(static_cast<int>(train.world())),
        receivers_(static_cast<int>(receivers.topology().ranks())),
        transport_(comm, senders_, receivers_, transport),
        deadline_(transport.deadline) {
    int size = 0;
    DTE_MPI_TRY(MPI_Comm_rank(comm, &rank_));
    DTE_MPI_TRY(MPI_Comm_size(comm, &size));
    if (size != senders_ + receivers_) {
      throw invalid_argument("MpiDeltaEngine: the job has " + std::to_string(size) +
                             " processes but the topologies need " + std::to_string(senders_) +
                             " trainer ranks + " + std::to_string(receivers_) +
                             " receiver ranks; start it with mpirun -np " +
                             std::to_string(senders_ + receivers_));
    }
    if (is_sender()) {
      sender_.emplace(hf, train, receivers, rank_, config.publish_every > 1);
    } else {
      receiver_.emplace(hf, receivers, rank_ - senders_);
    }
    for (std::int64_t r = 0; r < receivers.topology().ranks(); ++r) {
      dense_bytes_ +=
          2 * static_cast<std::uint64_t>(receivers.live_elements(r % receivers.topology().tp));
    }
  }

  [[nodiscard]] bool is_sender() const noexcept { return rank_ < senders_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  // The receiver this process is (receivers only).
  [[nodiscard]] const Receiver& receiver() const { return *receiver_; }

  // For fault tests: hook(rank, version) runs on this process between round 1 and round 2 of
  // every publication's exchange.
  void between_rounds(std::function<void(int rank, Version version)> hook) {
    hook_ = std::move(hook);
  }

 private:
  void clear_masks() {
    if (sender_) sender_->clear_masks();
  }

  // Waits for non-blocking collectives with the deadline.
  void wait(std::vector<MPI_Request>& reqs, const char* phase) {
    if (detail::mpi_wait_until(reqs, deadline_)) return;
    throw deadline_error("MpiDeltaEngine: rank " + std::to_string(rank_) + " waited " +
                         std::to_string(deadline_.count()) + " ms in " + phase +
                         " for a rank that is stalled or dead; this version is not committed");
  }

  // Every process tells every other that it reached `phase` (point to point, so a deadline
  // names exactly the ranks that did not arrive), before a collective that cannot name them.
  void checkpoint(const char* phase) {
    int size = 0;
    DTE_MPI_TRY(MPI_Comm_size(comm_, &size));
    const auto n = static_cast<std::size_t>(size);
    std::vector<unsigned char> in(n, 0);
    const unsigned char token = 1;
    std::vector<MPI_Request> reqs;
    std::vector<int> peer;
    constexpr int tag = 0x6476;
    for (int r = 0; r < size; ++r) {
      if (r == rank_) continue;
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(r);
      DTE_MPI_TRY(MPI_Irecv(&in[static_cast<std::size_t>(r)], 1, MPI_UNSIGNED_CHAR, r, tag, comm_,
                            &reqs.back()));
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(-1);  // our own send: not a peer we wait for
      DTE_MPI_TRY(MPI_Isend(&token, 1, MPI_UNSIGNED_CHAR, r, tag, comm_, &reqs.back()));
    }
    if (detail::mpi_wait_until(reqs, deadline_)) return;
    const std::string who = detail::mpi_pending_peers(reqs, peer);
    throw deadline_error("MpiDeltaEngine: rank " + std::to_string(rank_) + " waited " +
                         std::to_string(deadline_.count()) + " ms before " + phase +
                         " for rank(s) " + who +
                         " (stalled, dead, or waiting for one that is); this version is not "
                         "committed");
  }

  void sum(std::vector<std::uint64_t>& v, const char* phase) {
    checkpoint(phase);
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    DTE_MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_UINT64_T,
                               MPI_SUM, comm_, req.data()));
    wait(req, phase);
  }

  // The fused pass on trainer ranks, then agreement (did any rank refuse?) and the trainer's
  // digest per canonical tensor on every process.
  template <class Access>
  void scan(Access& access, ScanMode mode, SyncReport& rep) {
    const auto t0 = std::chrono::steady_clock::now();
    ScanResult res;
    std::string error;
    if (sender_) {
      try {
        res = sender_->scan(access, mode);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    std::vector<std::uint64_t> refused{error.empty() ? 0u : 1u};
    sum(refused, "the agreement after the detect pass");
    if (refused[0] != 0) {
      this->refused();
      throw invalid_argument(
          error.empty()
              ? "publication refused by a trainer rank (" + std::to_string(refused[0]) + " refused)"
              : "publication refused on trainer rank " + std::to_string(rank_) + ": " + error);
    }
    if (mode == ScanMode::mark) return;
    trainer_digest_ = sender_ ? res.digest : std::vector<std::uint64_t>(hf_->size(), 0);
    std::vector<std::uint64_t> counts{res.scanned, res.changed, res.guard};
    trainer_digest_.insert(trainer_digest_.end(), counts.begin(), counts.end());
    sum(trainer_digest_, "the digest sum");
    rep.elements_scanned = trainer_digest_[trainer_digest_.size() - 3];
    rep.changed = trainer_digest_[trainer_digest_.size() - 2];
    rep.guard = trainer_digest_[trainer_digest_.size() - 1];
    trainer_digest_.resize(static_cast<std::size_t>(hf_->size()));
    rep.digest = 0;
    for (std::uint64_t d : trainer_digest_)
      rep.digest += d;
    rep.detect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  template <class Access>
  void deliver(MessageKind kind, SyncReport& rep, Access& access) {
    rep.dense_bytes = dense_bytes_;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Payload> out;
    if (sender_) {
      out = sender_->finish(kind, version_, kind == MessageKind::full ? no_version : version_ - 1);
      rep.payload_total_bytes = sender_->payload_bytes();
    }
    if (hook_) transport_.between_rounds([this] { hook_(rank_, version_); });
    Inbox inbox = transport_.exchange(out);
    if (sender_) sender_->release();
    const auto t1 = std::chrono::steady_clock::now();
    rep.exchange_s = std::chrono::duration<double>(t1 - t0).count();
    ApplyResult applied;
    if (receiver_) {
      applied = receiver_->apply(version_, inbox);
      for (const auto& [src, bytes] : inbox)
        rep.received_total_bytes += bytes.size();
    }
    const auto t2 = std::chrono::steady_clock::now();
    rep.apply_s = std::chrono::duration<double>(t2 - t1).count();
    verify_and_repair(applied, rep, access);
    rep.verify_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
    std::vector<std::uint64_t> totals{rep.payload_total_bytes, rep.stale_messages};
    sum(totals, "the report");
    rep.bytes = totals[0];
    rep.stale_messages = totals[1];
  }

  // Per replica and canonical tensor, the receivers' digests must sum to the trainer's times
  // the copies a replica holds; the sums and the refusals are reduced over all processes, so
  // every process reaches the same verdict and takes part in the same repair.
  template <class Access>
  void verify_and_repair(const ApplyResult& applied, SyncReport& rep, Access& access) {
    rep.stale_messages = applied.stale;
    const auto& it = recv_layout_->topology();
    const auto tensors = static_cast<std::size_t>(hf_->size());
    auto gather = [&](std::vector<bool>& bad, std::vector<bool>& resync) {
      std::vector<std::uint64_t> v(
          static_cast<std::size_t>(it.replicas) * tensors + static_cast<std::size_t>(receivers_),
          0);
      if (receiver_) {
        const std::int64_t r = rank_ - senders_;
        const std::size_t replica = static_cast<std::size_t>(r / it.tp);
        for (std::size_t t = 0; t < tensors; ++t)
          v[replica * tensors + t] = receiver_->digest()[t];
        v[static_cast<std::size_t>(it.replicas) * tensors + static_cast<std::size_t>(r)] =
            receiver_->version() == version_ ? 0 : 1;
      }
      sum(v, "the digest verification");
      bad = detail::mismatched_tensors(*hf_, *recv_layout_, trainer_digest_, v.data());
      resync.assign(static_cast<std::size_t>(receivers_), false);
      for (std::size_t d = 0; d < resync.size(); ++d) {
        resync[d] = v[static_cast<std::size_t>(it.replicas) * tensors + d] != 0;
      }
    };
    std::vector<bool> bad, resync;
    gather(bad, resync);
    const bool any_bad = std::find(bad.begin(), bad.end(), true) != bad.end();
    const bool any_resync = std::find(resync.begin(), resync.end(), true) != resync.end();
    if (any_bad || any_resync) {
      for (std::size_t t = 0; t < bad.size(); ++t) {
        if (bad[t]) rep.repaired.push_back(hf_->name(static_cast<std::int64_t>(t)));
      }
      for (std::size_t d = 0; d < resync.size(); ++d) {
        if (resync[d]) rep.resynced.push_back(static_cast<std::int64_t>(d));
      }
      std::vector<Payload> out;
      if (sender_) out = sender_->repair(access, bad, resync, version_);
      Inbox inbox = transport_.exchange(out);
      if (sender_) sender_->release();
      if (receiver_ && !inbox.empty()) receiver_->apply(version_, inbox);
      gather(bad, resync);
    }
    rep.verified = std::find(bad.begin(), bad.end(), true) == bad.end() &&
                   std::find(resync.begin(), resync.end(), true) == resync.end();
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* recv_layout_;
  MPI_Comm comm_;
  int senders_, receivers_;
  MpiTwoRound transport_;
  std::chrono::milliseconds deadline_;
  int rank_ = 0;
  std::optional<Sender> sender_;
  std::optional<Receiver> receiver_;
  std::vector<std::uint64_t> trainer_digest_;
  std::uint64_t dense_bytes_ = 0;
  std::function<void(int, Version)> hook_;
};

}  // namespace dte
