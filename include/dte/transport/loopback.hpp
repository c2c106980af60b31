// SPDX-License-Identifier: Apache-2.0
// LoopbackTwoRound: sender and receiver ranks as threads of one process, running the two-round
// protocol the NCCL and MPI transports run. Round 1: every sender posts its byte count for every
// receiver, zeros included, so every pair has a matching operation. Round 2: each receiver
// allocates exactly what was announced and the payloads move. A receiver that gets a different
// number of bytes than announced raises an error naming the pair and the round.
//
// For tests it can inject faults a real network or a buggy sender could cause: a message lost
// without trace (drop), the previous publication's message delivered again (duplicate), or one
// flipped bit (bitflip).
#pragma once

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dte/error.hpp"

namespace dte {

using Bytes = std::vector<std::byte>;
// What a sender hands the transport for one receiver: consecutive spans (a chunked message).
using Payload = std::vector<std::span<const std::byte>>;

inline std::size_t payload_size(const Payload& p) noexcept {
  std::size_t n = 0;
  for (const auto& part : p)
    n += part.size();
  return n;
}

struct TransportFault {
  enum class Kind { drop, duplicate, bitflip } kind = Kind::drop;
  std::int64_t src = 0;
  std::int64_t dst = 0;
  std::size_t byte = 0;  // bitflip: which byte of the payload
  int bit = 0;           // bitflip: which bit of it
};

// What receiver `dst` got in one exchange: (sender, payload) in sender order.
using Inbox = std::vector<std::pair<std::int64_t, Bytes>>;

struct ExchangeStats {
  std::uint64_t bytes = 0;              // payload bytes moved
  std::uint64_t messages = 0;           // non-empty payloads
  std::vector<std::uint64_t> bytes_to;  // per receiver
};

class LoopbackTwoRound {
 public:
  using transport_tag = void;

  // outbox[src][dst] -> inbox[dst]. Every (src, dst) pair takes part in both rounds; an empty
  // payload is announced as 0 bytes and delivers nothing.
  std::vector<Inbox> exchange(const std::vector<std::vector<Payload>>& outbox) {
    const std::size_t senders = outbox.size();
    const std::size_t receivers = senders == 0 ? 0 : outbox[0].size();
    for (const auto& row : outbox) {
      if (row.size() != receivers) {
        throw invalid_argument("LoopbackTwoRound: every sender must address every receiver");
      }
    }
    std::vector<std::vector<std::uint64_t>> counts(senders, std::vector<std::uint64_t>(receivers));
    std::vector<std::vector<Bytes>> slots(receivers, std::vector<Bytes>(senders));
    std::vector<Inbox> inbox(receivers);
    std::vector<std::string> errors(receivers);
    std::barrier sync(static_cast<std::ptrdiff_t>(senders + receivers));

    const Payload lost;  // a dropped message: lost without trace, not even announced
    auto payload = [&](std::size_t s, std::size_t d) -> const Payload& {
      const bool dropped = fault_ && fault_->kind == TransportFault::Kind::drop &&
                           static_cast<std::size_t>(fault_->src) == s &&
                           static_cast<std::size_t>(fault_->dst) == d;
      return dropped ? lost : outbox[s][d];
    };
    auto sender = [&](std::size_t s) {
      for (std::size_t d = 0; d < receivers; ++d) {
        counts[s][d] = payload_size(payload(s, d));  // round 1: every count, zeros included
      }
      sync.arrive_and_wait();                        // counts posted
      sync.arrive_and_wait();                        // receivers allocated
      for (std::size_t d = 0; d < receivers; ++d) {  // round 2
        const Payload& p = payload(s, d);
        Bytes& slot = slots[d][s];
        if (slot.size() != payload_size(p)) continue;
        std::size_t at = 0;
        for (const auto& part : p) {
          std::copy(part.begin(), part.end(), slot.begin() + static_cast<std::ptrdiff_t>(at));
          at += part.size();
        }
      }
      sync.arrive_and_wait();  // payloads delivered
    };
    auto receiver = [&](std::size_t d) {
      sync.arrive_and_wait();
      for (std::size_t s = 0; s < senders; ++s)
        slots[d][s].resize(counts[s][d]);
      sync.arrive_and_wait();
      sync.arrive_and_wait();
      for (std::size_t s = 0; s < senders; ++s) {
        if (slots[d][s].size() != counts[s][d]) {
          errors[d] = "receiver " + std::to_string(d) + ": round 2 from sender " +
                      std::to_string(s) + " delivered " + std::to_string(slots[d][s].size()) +
                      " bytes, " + std::to_string(counts[s][d]) + " announced in round 1";
        }
        if (!slots[d][s].empty()) {
          inbox[d].emplace_back(static_cast<std::int64_t>(s), std::move(slots[d][s]));
        }
      }
    };
    std::vector<std::thread> threads;
    for (std::size_t s = 0; s < senders; ++s)
      threads.emplace_back(sender, s);
    for (std::size_t d = 0; d < receivers; ++d)
      threads.emplace_back(receiver, d);
    for (auto& t : threads)
      t.join();
    for (const std::string& e : errors) {
      if (!e.empty()) throw error("LoopbackTwoRound: " + e);
    }

    if (fault_) apply_after_delivery(inbox);
    fault_.reset();
    stats_ = {};
    stats_.bytes_to.assign(receivers, 0);
    for (std::size_t d = 0; d < receivers; ++d) {
      for (const auto& [s, bytes] : inbox[d]) {
        stats_.bytes += bytes.size();
        stats_.bytes_to[d] += bytes.size();
        ++stats_.messages;
      }
    }
    if (keep_history_) {
      previous_.assign(senders, std::vector<Bytes>(receivers));
      for (std::size_t s = 0; s < senders; ++s) {
        for (std::size_t d = 0; d < receivers; ++d) {
          for (const auto& part : outbox[s][d]) {
            previous_[s][d].insert(previous_[s][d].end(), part.begin(), part.end());
          }
        }
      }
    }
    return inbox;
  }

  // The next exchange suffers this fault (once). A duplicate needs the previous exchange's
  // payloads: call keep_history(true) first (off by default: it doubles the payload memory).
  void inject(const TransportFault& f) { fault_ = f; }
  void keep_history(bool on) {
    keep_history_ = on;
    if (!on) previous_.clear();
  }
  [[nodiscard]] const ExchangeStats& last_stats() const noexcept { return stats_; }

 private:
  void apply_after_delivery(std::vector<Inbox>& inbox) {
    const TransportFault& f = *fault_;
    if (f.dst < 0 || static_cast<std::size_t>(f.dst) >= inbox.size()) return;
    Inbox& box = inbox[static_cast<std::size_t>(f.dst)];
    if (f.kind == TransportFault::Kind::duplicate) {
      if (static_cast<std::size_t>(f.src) < previous_.size() &&
          !previous_[static_cast<std::size_t>(f.src)][static_cast<std::size_t>(f.dst)].empty()) {
        box.emplace_back(
            f.src, previous_[static_cast<std::size_t>(f.src)][static_cast<std::size_t>(f.dst)]);
      }
    } else if (f.kind == TransportFault::Kind::bitflip) {
      for (auto& [s, bytes] : box) {
        if (s == f.src && f.byte < bytes.size()) {
          bytes[f.byte] ^= static_cast<std::byte>(1u << f.bit);
        }
      }
    }
  }

  std::optional<TransportFault> fault_;
  bool keep_history_ = false;
  std::vector<std::vector<Bytes>> previous_;
  ExchangeStats stats_;
};

}  // namespace dte
