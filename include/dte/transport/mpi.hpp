// SPDX-License-Identifier: Apache-2.0
// MpiTwoRound: the two-round exchange between trainer (sender) and receiver processes of one MPI
// job. Round 1: every sender sends its byte count to every receiver, zeros included, so every
// pair posts matching operations. Round 2: receivers allocate exactly what was announced and
// the payloads move in chunks of at most `max_message` bytes (MPI counts are ints), with a
// schedule both sides derive from round 1. Every wait is a progress loop over non-blocking
// operations with a deadline: on expiry the error names the peers still pending and the round.
// Needs MPI (target dte::mpi). Host buffers.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/payload.hpp"
#include "dte/error.hpp"

namespace dte {

#define DTE_MPI_TRY(expr)                                                                     \
  do {                                                                                        \
    const int dte_mpi_status_ = (expr);                                                       \
    if (dte_mpi_status_ != MPI_SUCCESS) {                                                     \
      char dte_mpi_text_[MPI_MAX_ERROR_STRING];                                               \
      int dte_mpi_len_ = 0;                                                                   \
      MPI_Error_string(dte_mpi_status_, dte_mpi_text_, &dte_mpi_len_);                        \
      throw ::dte::error(std::string("MPI error from `" #expr "`: ") +                        \
                         std::string(dte_mpi_text_, static_cast<std::size_t>(dte_mpi_len_))); \
    }                                                                                         \
  } while (false)

namespace detail {

// Progress loop over non-blocking operations: tests until every request completed (true) or
// the deadline passed (false).
inline bool mpi_wait_until(std::vector<MPI_Request>& reqs, std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    int done = 0;
    DTE_MPI_TRY(
        MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// The peers (peer[i] for request i; negative: none) whose requests are still pending, "1, 4".
inline std::string mpi_pending_peers(std::vector<MPI_Request>& reqs, const std::vector<int>& peer) {
  std::vector<int> pending;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    int flag = 0;
    MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
    if (!flag && peer[i] >= 0 &&
        std::find(pending.begin(), pending.end(), peer[i]) == pending.end()) {
      pending.push_back(peer[i]);
    }
  }
  std::sort(pending.begin(), pending.end());
  std::string who;
  for (int p : pending)
    who += (who.empty() ? "" : ", ") + std::to_string(p);
  return who;
}

}  // namespace detail

struct MpiTwoRoundConfig {
  std::chrono::milliseconds deadline{30'000};      // per round
  std::size_t max_message = std::size_t{1} << 30;  // bytes per MPI message (< INT_MAX)
  int tag = 0x6474;  // "dt"; round 2 uses tag + 1, checkpoints tag + 2
};

// Received messages are host vectors, which the receiver core decodes in place. (There is no
// device-memory variant: dte's messages are host bytes at both ends. The CUDA sender encodes them
// on the host from its pinned batches, and every receiver decodes on the host, so a CUDA-aware
// MPI would have nothing in device memory to move.)
class MpiTwoRound {
 public:
  using transport_tag = void;
  using inbox_type = std::vector<std::pair<std::int64_t, Bytes>>;

  // Ranks [0, senders) of `comm` send; ranks [senders, senders + receivers) receive.
  MpiTwoRound(MPI_Comm comm, int senders, int receivers, MpiTwoRoundConfig cfg = {})
      : comm_(comm), senders_(senders), receivers_(receivers), cfg_(cfg) {
    DTE_MPI_TRY(MPI_Comm_rank(comm, &rank_));
    int size = 0;
    DTE_MPI_TRY(MPI_Comm_size(comm, &size));
    // (no receivers: the writers of a storage publication, which only sum)
    if (senders < 1 || receivers < 0 || senders + receivers > size) {
      throw invalid_argument(
          "MpiTwoRound: " + std::to_string(senders) + " senders + " + std::to_string(receivers) +
          " receivers do not fit a communicator of " + std::to_string(size) + " processes");
    }
    if (cfg.max_message == 0 || cfg.max_message > static_cast<std::size_t>(INT_MAX)) {
      throw invalid_argument("MpiTwoRound: max_message must be in [1, INT_MAX]");
    }
  }

  [[nodiscard]] int senders() const noexcept { return senders_; }
  [[nodiscard]] int receivers() const noexcept { return receivers_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_sender() const noexcept { return rank_ < senders_; }
  [[nodiscard]] bool is_receiver() const noexcept {
    return rank_ >= senders_ && rank_ < senders_ + receivers_;
  }
  [[nodiscard]] int receiver_index() const noexcept { return rank_ - senders_; }

  // Every rank tells every other that it reached `phase` (point to point, so a deadline names
  // exactly the ranks that did not arrive), returning once all did.
  void checkpoint(const char* phase) {
    int size = 0;
    DTE_MPI_TRY(MPI_Comm_size(comm_, &size));
    const auto n = static_cast<std::size_t>(size);
    std::vector<unsigned char> in(n, 0);
    const unsigned char token = 1;
    std::vector<MPI_Request> reqs;
    std::vector<int> peer;
    for (int r = 0; r < size; ++r) {
      if (r == rank_) continue;
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(r);
      DTE_MPI_TRY(MPI_Irecv(&in[static_cast<std::size_t>(r)], 1, MPI_UNSIGNED_CHAR, r, cfg_.tag + 2,
                            comm_, &reqs.back()));
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(-1);  // our own send: not a peer we wait for
      DTE_MPI_TRY(MPI_Isend(&token, 1, MPI_UNSIGNED_CHAR, r, cfg_.tag + 2, comm_, &reqs.back()));
    }
    if (detail::mpi_wait_until(reqs, cfg_.deadline)) return;
    throw deadline_error("MpiTwoRound: rank " + std::to_string(rank_) + " waited " +
                         std::to_string(cfg_.deadline.count()) + " ms before " + phase +
                         " for rank(s) " + detail::mpi_pending_peers(reqs, peer) +
                         " (stalled, dead, or waiting for one that is); this version is not "
                         "committed");
  }

  // Element-wise sum over every rank, behind a checkpoint (so a deadline names the ranks that
  // did not arrive); a non-blocking allreduce waited on with the deadline.
  void sum(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, MPI_SUM); }
  // Element-wise maximum (FP8 receivers' block scales: engine/fp8_stage.hpp), the same way.
  void max(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, MPI_MAX); }

  void reduce(std::span<std::uint64_t> v, const char* phase, MPI_Op op) {
    checkpoint(phase);
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    DTE_MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_UINT64_T, op,
                               comm_, req.data()));
    if (detail::mpi_wait_until(req, cfg_.deadline)) return;
    throw deadline_error("MpiTwoRound: rank " + std::to_string(rank_) + " waited " +
                         std::to_string(cfg_.deadline.count()) + " ms in " + phase +
                         " for a rank that is stalled or dead; this version is not committed");
  }

  // For fault tests: runs once, on this process, between round 1 and round 2 of the next
  // exchange.
  void between_rounds(std::function<void()> hook) { between_rounds_ = std::move(hook); }

  // A sender passes one payload per receiver (empty: nothing for it) and gets an empty inbox;
  // a receiver passes nothing and gets (sender, bytes) for every sender with a non-empty payload.
  inbox_type exchange(const std::vector<Payload>& to_receivers) {
    if (is_sender() && static_cast<int>(to_receivers.size()) != receivers_) {
      throw invalid_argument("MpiTwoRound: a sender must address all " +
                             std::to_string(receivers_) + " receivers");
    }
    // Round 1: counts.
    std::vector<std::uint64_t> counts(
        static_cast<std::size_t>(is_sender() ? receivers_ : senders_));
    std::vector<MPI_Request> reqs;
    std::vector<int> peer;
    if (is_sender()) {
      for (int d = 0; d < receivers_; ++d) {
        counts[static_cast<std::size_t>(d)] =
            payload_size(to_receivers[static_cast<std::size_t>(d)]);
        reqs.push_back(MPI_REQUEST_NULL);
        peer.push_back(senders_ + d);
        DTE_MPI_TRY(MPI_Isend(&counts[static_cast<std::size_t>(d)], 1, MPI_UINT64_T, senders_ + d,
                              cfg_.tag, comm_, &reqs.back()));
      }
    } else if (is_receiver()) {
      for (int s = 0; s < senders_; ++s) {
        reqs.push_back(MPI_REQUEST_NULL);
        peer.push_back(s);
        DTE_MPI_TRY(MPI_Irecv(&counts[static_cast<std::size_t>(s)], 1, MPI_UINT64_T, s, cfg_.tag,
                              comm_, &reqs.back()));
      }
    }
    wait_all(reqs, peer, "round 1 (counts)");
    if (between_rounds_) {
      auto hook = std::move(between_rounds_);
      between_rounds_ = nullptr;
      hook();
    }

    // Round 2: payloads, chunked; the schedule follows from the counts on both sides.
    inbox_type inbox;
    reqs.clear();
    peer.clear();
    if (is_sender()) {
      for (int d = 0; d < receivers_; ++d) {
        post_sends(to_receivers[static_cast<std::size_t>(d)], senders_ + d, reqs, peer);
      }
    } else if (is_receiver()) {
      inbox.reserve(static_cast<std::size_t>(senders_));
      for (int s = 0; s < senders_; ++s) {
        if (counts[static_cast<std::size_t>(s)] == 0) continue;
        inbox.emplace_back(s, Bytes(static_cast<std::size_t>(counts[static_cast<std::size_t>(s)])));
        post_receives(inbox.back().second.data(), counts[static_cast<std::size_t>(s)], s, reqs,
                      peer);
      }
    }
    wait_all(reqs, peer, "round 2 (payloads)");
    return inbox;
  }

 private:
  // The payload as messages of max_message bytes (the receiver's schedule). A message that
  // covers several spans is sent as one MPI message through an hindexed datatype over the spans
  // (no copy into a contiguous buffer: the sender holds its payload once).
  void post_sends(const Payload& p, int other, std::vector<MPI_Request>& reqs,
                  std::vector<int>& peer) {
    const std::uint64_t total = payload_size(p);
    std::size_t span = 0, in_span = 0;
    for (std::uint64_t at = 0; at < total; at += cfg_.max_message) {
      std::uint64_t left = std::min<std::uint64_t>(cfg_.max_message, total - at);
      std::vector<int> lengths;
      std::vector<MPI_Aint> places;
      const std::byte* first = p.empty() ? nullptr : p[span].data() + in_span;
      while (left > 0) {
        const std::size_t n =
            static_cast<std::size_t>(std::min<std::uint64_t>(left, p[span].size() - in_span));
        MPI_Aint address = 0;
        DTE_MPI_TRY(MPI_Get_address(p[span].data() + in_span, &address));
        lengths.push_back(static_cast<int>(n));
        places.push_back(address);
        left -= n;
        in_span += n;
        if (in_span == p[span].size()) ++span, in_span = 0;
      }
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(other);
      if (lengths.size() == 1) {
        DTE_MPI_TRY(
            MPI_Isend(first, lengths[0], MPI_BYTE, other, cfg_.tag + 1, comm_, &reqs.back()));
      } else {
        MPI_Datatype spans = MPI_DATATYPE_NULL;
        DTE_MPI_TRY(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                             places.data(), MPI_BYTE, &spans));
        DTE_MPI_TRY(MPI_Type_commit(&spans));
        DTE_MPI_TRY(MPI_Isend(MPI_BOTTOM, 1, spans, other, cfg_.tag + 1, comm_, &reqs.back()));
        DTE_MPI_TRY(MPI_Type_free(&spans));  // freed once the send no longer needs it
      }
    }
  }

  void post_receives(std::byte* data, std::uint64_t bytes, int other,
                     std::vector<MPI_Request>& reqs, std::vector<int>& peer) {
    for (std::uint64_t at = 0; at < bytes; at += cfg_.max_message) {
      const int n = static_cast<int>(std::min<std::uint64_t>(cfg_.max_message, bytes - at));
      reqs.push_back(MPI_REQUEST_NULL);
      peer.push_back(other);
      DTE_MPI_TRY(MPI_Irecv(data + at, n, MPI_BYTE, other, cfg_.tag + 1, comm_, &reqs.back()));
    }
  }

  void wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& peer, const char* phase) {
    if (detail::mpi_wait_until(reqs, cfg_.deadline)) return;
    throw deadline_error("MpiTwoRound: rank " + std::to_string(rank_) + " waited " +
                         std::to_string(cfg_.deadline.count()) + " ms in " + phase +
                         " for rank(s) " + detail::mpi_pending_peers(reqs, peer) +
                         " (stalled or dead); this version is not committed");
  }

  MPI_Comm comm_;
  int senders_, receivers_;
  MpiTwoRoundConfig cfg_;
  int rank_ = 0;
  std::function<void()> between_rounds_;
};

static_assert(transport<MpiTwoRound>);

}  // namespace dte
