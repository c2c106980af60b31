// SPDX-License-Identifier: Apache-2.0
// LoopbackWorld: sender and receiver ranks as threads of one process, each holding a
// LoopbackTwoRound endpoint and running the same protocol the MPI and NCCL transports run.
// Round 1: every sender posts its byte count for every receiver, zeros included, so every pair
// takes part; round 2: each receiver allocates exactly what was announced and copies the
// payloads (what a network would deliver into its memory). sum() and checkpoint() are the
// world's collectives. Every wait has a deadline: a rank that does not arrive becomes a
// deadline_error naming it and the phase (and the world is then broken: later waits fail at
// once), never a hang.
//
// For tests the world can inject faults a real network or a buggy sender could cause into the
// next exchange: a message lost without trace (drop), the previous exchange's message delivered
// again (duplicate), or one flipped bit (bitflip).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/payload.hpp"
#include "dte/error.hpp"

namespace dte {

struct TransportFault {
  enum class Kind { drop, duplicate, bitflip } kind = Kind::drop;
  std::int64_t src = 0;  // sender index
  std::int64_t dst = 0;  // receiver index
  std::size_t byte = 0;  // bitflip: which byte of the payload
  int bit = 0;           // bitflip: which bit of it
  // bitflip: when set, the byte is where(payload) instead (e.g. wire::first_value_offset).
  std::function<std::size_t(std::span<const std::byte>)> where = {};
};

struct ExchangeStats {
  std::uint64_t bytes = 0;              // payload bytes moved
  std::uint64_t messages = 0;           // non-empty payloads
  std::vector<std::uint64_t> bytes_to;  // per receiver
};

class LoopbackTwoRound;

class LoopbackWorld {
 public:
  LoopbackWorld(int senders, int receivers,
                std::chrono::milliseconds deadline = std::chrono::minutes(2));
  LoopbackWorld(const LoopbackWorld&) = delete;
  LoopbackWorld& operator=(const LoopbackWorld&) = delete;

  [[nodiscard]] int senders() const noexcept { return senders_; }
  [[nodiscard]] int receivers() const noexcept { return receivers_; }
  [[nodiscard]] int size() const noexcept { return senders_ + receivers_; }
  // The endpoint of rank r (senders [0, S), receivers [S, S + R)); one thread per rank.
  [[nodiscard]] LoopbackTwoRound& endpoint(int rank);

  // The next exchange suffers this fault (once); faults injected together queue up, one per
  // exchange in order (e.g. a publication's delivery, then its repair). A duplicate needs the
  // previous exchange's payloads: call keep_history(true) first (off by default: it doubles the
  // payload memory).
  void inject(const TransportFault& f) {
    std::lock_guard lock(mutex_);
    faults_.push_back(f);
  }
  void keep_history(bool on) {
    std::lock_guard lock(mutex_);
    keep_history_ = on;
    if (!on) history_.clear();
  }
  // What sender s delivered to receiver d (0-based among the receivers) in the last exchange,
  // as one buffer; kept only with keep_history(true), empty otherwise. For tests that audit
  // the messages themselves.
  [[nodiscard]] Bytes last_payload(int s, int d) const {
    std::lock_guard lock(mutex_);
    if (static_cast<std::size_t>(s) >= history_.size()) return {};
    return history_[static_cast<std::size_t>(s)].at(static_cast<std::size_t>(d));
  }

  // The last exchange (complete once every rank returned from it).
  [[nodiscard]] ExchangeStats last_stats() const {
    std::lock_guard lock(mutex_);
    ExchangeStats s;
    s.bytes_to = bytes_to_;
    for (std::uint64_t b : bytes_to_)
      s.bytes += b;
    for (std::uint64_t m : messages_to_)
      s.messages += m;
    return s;
  }

 private:
  friend class LoopbackTwoRound;

  // Every rank arrives; returns when all did, or throws naming the missing ranks.
  void rendezvous(int rank, const char* phase) {
    std::unique_lock lock(mutex_);
    if (broken_) throw_broken(rank, phase);
    const std::uint64_t gen = generation_;
    present_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == size()) {
      arrived_ = 0;
      std::fill(present_.begin(), present_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, deadline_, [&] { return generation_ != gen || broken_; })) {
      std::string who;
      for (int r = 0; r < size(); ++r) {
        if (!present_[static_cast<std::size_t>(r)])
          who += (who.empty() ? "" : ", ") + std::to_string(r);
      }
      broken_ = true;
      cv_.notify_all();
      throw deadline_error("LoopbackTwoRound: rank " + std::to_string(rank) + " waited " +
                           std::to_string(deadline_.count()) + " ms in " + phase + " for rank(s) " +
                           who + " (stalled or failed); this version is not committed");
    }
    if (generation_ == gen) throw_broken(rank, phase);
  }

  [[noreturn]] void throw_broken(int rank, const char* phase) const {
    throw deadline_error("LoopbackTwoRound: rank " + std::to_string(rank) + " reached " + phase +
                         " after another rank gave up waiting; the world is broken, start a "
                         "new one");
  }

  int senders_, receivers_;
  std::chrono::milliseconds deadline_;
  std::vector<std::unique_ptr<LoopbackTwoRound>> endpoints_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<bool> present_;
  bool broken_ = false;

  // The exchange in flight: what every sender posted (round 1), valid until the last rendezvous.
  std::vector<const std::vector<Payload>*> posted_;
  std::vector<std::vector<std::uint64_t>*> sums_;  // sum(): every rank's vector
  std::deque<TransportFault> faults_;              // the front one hits the next exchange
  bool keep_history_ = false;
  std::vector<std::vector<Bytes>> history_;            // [sender][receiver]: the previous exchange
  std::vector<std::uint64_t> bytes_to_, messages_to_;  // per receiver, the last exchange
};

class LoopbackTwoRound {
 public:
  using transport_tag = void;
  using inbox_type = Inbox;

  LoopbackTwoRound(LoopbackWorld& world, int rank) : world_(&world), rank_(rank) {}

  [[nodiscard]] int senders() const noexcept { return world_->senders_; }
  [[nodiscard]] int receivers() const noexcept { return world_->receivers_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_sender() const noexcept { return rank_ < world_->senders_; }
  [[nodiscard]] bool is_receiver() const noexcept { return rank_ >= world_->senders_; }
  [[nodiscard]] LoopbackWorld& world() noexcept { return *world_; }

  // A sender passes one payload per receiver (empty: nothing for it); a receiver passes nothing
  // and gets (sender, bytes) for every sender with a non-empty payload.
  Inbox exchange(const std::vector<Payload>& out) {
    LoopbackWorld& w = *world_;
    if (is_sender() && static_cast<int>(out.size()) != w.receivers_) {
      throw invalid_argument("LoopbackTwoRound: sender " + std::to_string(rank_) + " addressed " +
                             std::to_string(out.size()) + " receivers, the world has " +
                             std::to_string(w.receivers_));
    }
    if (is_sender()) {
      std::lock_guard lock(w.mutex_);
      w.posted_[static_cast<std::size_t>(rank_)] = &out;
    }
    w.rendezvous(rank_, "round 1 (counts)");
    Inbox inbox;
    if (is_receiver()) inbox = receive();
    w.rendezvous(rank_, "round 2 (payloads)");
    if (rank_ == 0) {
      // Every receiver has copied: the fault (once) is spent.
      std::lock_guard lock(w.mutex_);
      if (!w.faults_.empty()) w.faults_.pop_front();
    }
    w.rendezvous(rank_, "the end of the exchange");
    return inbox;
  }

  // Element-wise sum over every rank; the result replaces v on every rank.
  void sum(std::span<std::uint64_t> v, const char* phase) {
    reduce(v, phase, [](std::uint64_t a, std::uint64_t b) { return a + b; });
  }
  // Element-wise maximum over every rank (FP8 receivers' block scales: engine/fp8_stage.hpp).
  void max(std::span<std::uint64_t> v, const char* phase) {
    reduce(v, phase, [](std::uint64_t a, std::uint64_t b) { return a > b ? a : b; });
  }

  void checkpoint(const char* phase) { world_->rendezvous(rank_, phase); }

 private:
  template <class Op>
  void reduce(std::span<std::uint64_t> v, const char* phase, Op op) {
    LoopbackWorld& w = *world_;
    std::vector<std::uint64_t> mine(v.begin(), v.end());
    {
      std::lock_guard lock(w.mutex_);
      w.sums_[static_cast<std::size_t>(rank_)] = &mine;
    }
    w.rendezvous(rank_, phase);
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::uint64_t total = 0;
      for (const std::vector<std::uint64_t>* other : w.sums_) {
        if (other->size() != v.size()) {
          throw invalid_argument(std::string("LoopbackTwoRound: ranks disagree on the length of "
                                             "the reduction in ") +
                                 phase);
        }
        total = op(total, (*other)[i]);
      }
      v[i] = total;
    }
    w.rendezvous(rank_, phase);  // every rank has read every vector
  }

  Inbox receive() {
    LoopbackWorld& w = *world_;
    const int d = rank_ - w.senders_;
    std::optional<TransportFault> fault;
    bool history = false;
    {
      std::lock_guard lock(w.mutex_);
      if (!w.faults_.empty()) fault = w.faults_.front();
      history = w.keep_history_;
    }
    const auto hits = [&](TransportFault::Kind k, int s) {
      return fault && fault->kind == k && fault->src == s && fault->dst == d;
    };
    Inbox inbox;
    std::uint64_t bytes = 0;
    std::vector<Bytes> previous;
    for (int s = 0; s < w.senders_; ++s) {
      const Payload& p = (*w.posted_[static_cast<std::size_t>(s)])[static_cast<std::size_t>(d)];
      const std::size_t n = hits(TransportFault::Kind::drop, s) ? 0 : payload_size(p);
      if (n == 0) continue;  // announced as 0 bytes in round 1: nothing moves
      Bytes slot(n);
      std::size_t at = 0;
      for (const auto& part : p) {
        std::copy(part.begin(), part.end(), slot.begin() + static_cast<std::ptrdiff_t>(at));
        at += part.size();
      }
      if (hits(TransportFault::Kind::bitflip, s)) {
        const std::size_t at_byte = fault->where ? fault->where(slot) : fault->byte;
        if (at_byte < slot.size()) slot[at_byte] ^= static_cast<std::byte>(1u << fault->bit);
      }
      bytes += slot.size();
      inbox.emplace_back(s, std::move(slot));
    }
    {
      std::lock_guard lock(w.mutex_);
      if (fault && fault->kind == TransportFault::Kind::duplicate && fault->dst == d &&
          static_cast<std::size_t>(fault->src) < w.history_.size() &&
          !w.history_[static_cast<std::size_t>(fault->src)][static_cast<std::size_t>(d)].empty()) {
        inbox.emplace_back(
            fault->src,
            w.history_[static_cast<std::size_t>(fault->src)][static_cast<std::size_t>(d)]);
        bytes += inbox.back().second.size();
      }
      if (history) {
        w.history_.resize(static_cast<std::size_t>(w.senders_),
                          std::vector<Bytes>(static_cast<std::size_t>(w.receivers_)));
        for (int s = 0; s < w.senders_; ++s) {
          const Payload& p = (*w.posted_[static_cast<std::size_t>(s)])[static_cast<std::size_t>(d)];
          Bytes& h = w.history_[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)];
          h.clear();
          for (const auto& part : p)
            h.insert(h.end(), part.begin(), part.end());
        }
      }
      w.bytes_to_[static_cast<std::size_t>(d)] = bytes;
      w.messages_to_[static_cast<std::size_t>(d)] = inbox.size();
    }
    return inbox;
  }

  LoopbackWorld* world_;
  int rank_;
};

inline LoopbackWorld::LoopbackWorld(int senders, int receivers, std::chrono::milliseconds deadline)
    : senders_(senders), receivers_(receivers), deadline_(deadline) {
  // (no receivers: the writers of a storage publication, which only sum)
  if (senders < 1 || receivers < 0) {
    throw invalid_argument("LoopbackWorld: needs at least one sender and no negative count (got " +
                           std::to_string(senders) + " and " + std::to_string(receivers) + ")");
  }
  for (int r = 0; r < size(); ++r)
    endpoints_.push_back(std::make_unique<LoopbackTwoRound>(*this, r));
  present_.assign(static_cast<std::size_t>(size()), false);
  posted_.assign(static_cast<std::size_t>(senders), nullptr);
  sums_.assign(static_cast<std::size_t>(size()), nullptr);
  bytes_to_.assign(static_cast<std::size_t>(receivers), 0);
  messages_to_.assign(static_cast<std::size_t>(receivers), 0);
}

inline LoopbackTwoRound& LoopbackWorld::endpoint(int rank) {
  if (rank < 0 || rank >= size()) {
    throw invalid_argument("LoopbackWorld: rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(size()) + ")");
  }
  return *endpoints_[static_cast<std::size_t>(rank)];
}

static_assert(transport<LoopbackTwoRound>);

}  // namespace dte
