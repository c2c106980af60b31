// SPDX-License-Identifier: Apache-2.0
// The transport watchdog's state machine with a fake status source and a fake clock (no NCCL,
// no sleeping): completion, a stall past the deadline, an asynchronous error, a non-blocking
// communicator that stays pending, the abort called exactly once, and an aborted communicator
// refusing every later phase.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/transport/watchdog.hpp"

using doctest::Contains;
using namespace std::chrono_literals;

namespace {

// Scripted NCCL state: poll k returns states[min(k, size-1)]; done() after `done_after` polls.
struct FakeSource {
  std::vector<dte::CommState> states{dte::CommState::ok};
  int done_after = 0;  // -1: never
  std::string error_text = "unhandled system error (remote process exited)";
  int polls = 0, aborts = 0;

  dte::CommState comm_state(std::string& reason) {
    const auto k = static_cast<std::size_t>(polls);
    const dte::CommState s = states[k < states.size() ? k : states.size() - 1];
    ++polls;
    if (s == dte::CommState::failed) reason = error_text;
    return s;
  }
  bool done() const { return done_after >= 0 && polls > done_after; }
  void abort() { ++aborts; }
};
static_assert(dte::watchdog_source<FakeSource>);

// A clock that advances only when the watchdog sleeps.
struct FakeTime {
  dte::Watchdog::Clock::time_point t{};
  std::chrono::microseconds slept{0};
  dte::Watchdog make(std::chrono::milliseconds deadline) {
    return dte::Watchdog(
        deadline, 500us, [this] { return t; },
        [this](std::chrono::microseconds d) {
          t += d;
          slept += d;
        });
  }
};

}  // namespace

TEST_CASE("a phase that completes returns without aborting") {
  FakeTime time;
  dte::Watchdog w = time.make(1000ms);
  FakeSource s;
  s.done_after = 3;
  CHECK_NOTHROW(w.wait(s, "round 2 (payloads)", "1, 2"));
  CHECK(s.polls == 4);
  CHECK(s.aborts == 0);
  CHECK_FALSE(w.aborted());
  // The same communicator serves the next phase.
  FakeSource next;
  CHECK_NOTHROW(w.wait(next, "the digest sum", "all"));
}

TEST_CASE("a stalled peer: deadline_error naming the phase and the peers, one abort") {
  FakeTime time;
  dte::Watchdog w = time.make(50ms);
  FakeSource s;
  s.done_after = -1;  // never completes
  CHECK_THROWS_WITH_AS(w.wait(s, "round 1 (counts)", "3"),
                       Contains("round 1 (counts) did not complete within 50 ms (waiting on peers "
                                "3: stalled or dead); the communicator was aborted"),
                       dte::deadline_error);
  CHECK(s.aborts == 1);
  CHECK(w.aborted());
  CHECK(time.slept >= 50ms);
  CHECK(time.slept < 51ms);  // it gave up at the deadline, not later
}

TEST_CASE("an asynchronous error aborts at once, naming the error") {
  FakeTime time;
  dte::Watchdog w = time.make(1000ms);
  FakeSource s;
  s.states = {dte::CommState::ok, dte::CommState::ok, dte::CommState::failed};
  s.done_after = -1;
  CHECK_THROWS_WITH_AS(w.wait(s, "round 2 (payloads)", "0, 5"),
                       Contains("NCCL asynchronous error during round 2 (payloads) (peers 0, 5): "
                                "unhandled system error (remote process exited)"),
                       dte::error);
  CHECK(s.aborts == 1);
  CHECK(s.polls == 3);
  CHECK(time.slept == 1000us);  // two polls apart, well before the deadline
}

TEST_CASE("a non-blocking communicator that stays pending is a stall, even if the work is done") {
  FakeTime time;
  dte::Watchdog w = time.make(10ms);
  FakeSource s;
  s.states = {dte::CommState::pending};
  s.done_after = 0;
  CHECK_THROWS_AS(w.wait(s, "communicator init", "all"), dte::deadline_error);
  CHECK(s.aborts == 1);
  // Pending, then ok: completes.
  FakeTime t2;
  dte::Watchdog w2 = t2.make(10ms);
  FakeSource p;
  p.states = {dte::CommState::pending, dte::CommState::pending, dte::CommState::ok};
  p.done_after = 0;
  CHECK_NOTHROW(w2.wait(p, "communicator init", "all"));
  CHECK(p.aborts == 0);
}

TEST_CASE("an aborted communicator refuses every later phase without touching it") {
  FakeTime time;
  dte::Watchdog w = time.make(5ms);
  FakeSource s;
  s.done_after = -1;
  CHECK_THROWS_AS(w.wait(s, "round 1 (counts)", "2"), dte::deadline_error);
  FakeSource later;
  CHECK_THROWS_WITH_AS(w.wait(later, "round 2 (payloads)", "2"),
                       Contains("aborted during round 1 (counts); it cannot be used for round 2 "
                                "(payloads): create a new communicator"),
                       dte::error);
  CHECK(later.polls == 0);
  CHECK(later.aborts == 0);
  CHECK(s.aborts == 1);
}

TEST_CASE("a non-positive deadline is refused") {
  CHECK_THROWS_AS(dte::Watchdog(0ms), dte::invalid_argument);
}
