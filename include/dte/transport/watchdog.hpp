// SPDX-License-Identifier: Apache-2.0
// The watchdog of a collective transport (NcclTwoRound, issue 11): waits for one phase of an
// exchange against a deadline, polling the communicator's asynchronous error state, and turns a
// dead or stalled peer into an error naming the phase and the peers instead of a hang. It
// aborts the communicator exactly once (ncclCommAbort on NCCL); after that every wait refuses
// at once, since an aborted communicator cannot be used again.
//
// The state machine is ordinary host code over a status source, so it is tested on the host
// with a fake one (tests/transport/test_watchdog.cpp); the NCCL source is a thin adapter:
//   comm_state(reason): ncclCommGetAsyncError -> ok (ncclSuccess), pending (ncclInProgress,
//                       a non-blocking communicator still working) or failed (+ its text);
//   done():             the phase's work has completed (cudaEventQuery == cudaSuccess);
//   abort():            ncclCommAbort.
#pragma once

#include <chrono>
#include <concepts>
#include <functional>
#include <string>
#include <string_view>
#include <thread>

#include "dte/error.hpp"

namespace dte {

enum class CommState {
  ok,       // no asynchronous error
  pending,  // a non-blocking communicator is still completing an operation
  failed,   // an asynchronous error: the communicator must be aborted
};

template <class S>
concept watchdog_source = requires(S& s, std::string& reason) {
  { s.comm_state(reason) } -> std::same_as<CommState>;
  { s.done() } -> std::convertible_to<bool>;
  s.abort();
};

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // `now` and `sleep` are the clock and the pause between polls (tests pass fake ones).
  explicit Watchdog(
      std::chrono::milliseconds deadline,
      std::chrono::microseconds poll = std::chrono::microseconds(200),
      std::function<Clock::time_point()> now = Clock::now,
      std::function<void(std::chrono::microseconds)> sleep =
          [](std::chrono::microseconds d) { std::this_thread::sleep_for(d); })
      : deadline_(deadline), poll_(poll), now_(std::move(now)), sleep_(std::move(sleep)) {
    if (deadline.count() <= 0) {
      throw invalid_argument("Watchdog: the deadline must be positive (got " +
                             std::to_string(deadline.count()) + " ms)");
    }
  }

  [[nodiscard]] bool aborted() const noexcept { return aborted_; }
  [[nodiscard]] std::chrono::milliseconds deadline() const noexcept { return deadline_; }

  // Waits until `source` reports the phase done with no error. Throws a deadline_error when the
  // deadline passes first, an error when the communicator reports an asynchronous error; both
  // abort the communicator first. `peers` names whom the phase waits on, for the message.
  template <watchdog_source Source>
  void wait(Source& source, std::string_view phase, std::string_view peers) {
    if (aborted_) {
      throw error(std::string("NCCL communicator was aborted during ") + aborted_in_ +
                  "; it cannot be used for " + std::string(phase) +
                  ": create a new communicator (a new transport)");
    }
    const Clock::time_point start = now_();
    for (;;) {
      std::string reason;
      const CommState state = source.comm_state(reason);
      if (state == CommState::failed) {
        abort(source, phase);
        throw error("NCCL asynchronous error during " + std::string(phase) + " (peers " +
                    std::string(peers) + "): " + reason + "; the communicator was aborted");
      }
      if (state == CommState::ok && source.done()) return;
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now_() - start);
      if (waited >= deadline_) {
        abort(source, phase);
        throw deadline_error(std::string(phase) + " did not complete within " +
                             std::to_string(deadline_.count()) + " ms (waiting on peers " +
                             std::string(peers) +
                             ": stalled or dead); the communicator was aborted");
      }
      sleep_(poll_);
    }
  }

 private:
  template <class Source>
  void abort(Source& source, std::string_view phase) {
    aborted_ = true;
    aborted_in_ = std::string(phase);
    source.abort();
  }

  std::chrono::milliseconds deadline_;
  std::chrono::microseconds poll_;
  std::function<Clock::time_point()> now_;
  std::function<void(std::chrono::microseconds)> sleep_;
  bool aborted_ = false;
  std::string aborted_in_;
};

}  // namespace dte
