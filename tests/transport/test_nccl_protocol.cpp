// SPDX-License-Identifier: Apache-2.0
// NcclTwoRound's protocol (BasicNcclTwoRound, transport/nccl_two_round.hpp) on the host, over a
// fake non-blocking NCCL (fake_nccl.hpp), one thread per rank:
//   - the transport suite, with every NCCL call "in progress" first and issued only some polls
//     later: every count, payload and sum arrives (a copy enqueued before the calls are issued
//     would read memory NCCL has not written), and no copy to the host waits behind NCCL work;
//   - an ncclSend that fails: the error names the call, the communicator is aborted at once
//     (the destructor does not finalize it), later calls refuse, the peers fail at their
//     deadlines naming the phase;
//   - a peer that never arrives: every other rank fails within the deadline, naming the round,
//     with nothing left that would block the host.
#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dte/error.hpp"
#include "dte/sim/threads.hpp"
#include "fake_nccl.hpp"
#include "transport_suite.hpp"

using doctest::Contains;
using namespace std::chrono_literals;

namespace {

struct Shape {
  int senders, receivers;
  [[nodiscard]] int size() const { return senders + receivers; }
};

// f(rank) on one thread per rank; the lowest rank's exception is rethrown.
void on_every_rank(const Shape& w, const std::function<void(int)>& f) {
  dte::sim::run_ranks(static_cast<std::size_t>(w.size()),
                      [&](std::size_t r) { f(static_cast<int>(r)); });
}

dte::NcclTwoRoundConfig config(std::chrono::milliseconds deadline = 20s) {
  dte::NcclTwoRoundConfig c;
  c.deadline = deadline;
  c.chunk_bytes = 1000;  // the suite's sizes are chosen around it: several chunks per message
  c.poll = 20us;
  return c;
}

}  // namespace

TEST_CASE("the transport suite over a non-blocking NCCL: every call in progress first") {
  namespace suite = dte::transport_suite;
  for (const int polls : {0, 1, 5}) {
    for (const Shape w : {Shape{1, 1}, Shape{2, 3}}) {
      CAPTURE(polls);
      CAPTURE(w.senders);
      CAPTURE(w.receivers);
      fake_nccl::World world(w.size(), polls);
      std::vector<suite::Results> results(static_cast<std::size_t>(w.size()));
      on_every_rank(w, [&](int rank) {
        fake_nccl::Transport t(fake_nccl::Runtime(world, rank), 0, rank, w.senders, w.receivers,
                               config());
        results[static_cast<std::size_t>(rank)] =
            suite::run_rank(t, rank, w.senders, w.receivers, suite::Options{1000});
      });
      for (const suite::Results& r : results) {
        CHECK(r.exchanges == suite::kRounds);
        for (const std::string& f : r.failures)
          FAIL_CHECK(f);
      }
      for (const std::string& v : world.violations())
        FAIL_CHECK(v);
      for (int r = 0; r < w.size(); ++r) {
        CHECK(world.aborts(r) == 0);
        CHECK(world.finalizes(r) == 1);
        CHECK(world.device_bytes(r) == 0);
      }
    }
  }
}

TEST_CASE("an NCCL call that fails aborts the communicator before the error leaves") {
  const Shape w{1, 2};
  fake_nccl::World world(w.size(), 2);
  world.fail_send(0, 2);  // the sender's second ncclSend: round one, to receiver 2
  std::vector<std::string> errors(static_cast<std::size_t>(w.size()));
  std::vector<double> seconds(static_cast<std::size_t>(w.size()), 0);
  std::mutex checks;
  on_every_rank(w, [&](int rank) {
    fake_nccl::Transport t(fake_nccl::Runtime(world, rank), 0, rank, w.senders, w.receivers,
                           config(300ms));
    std::vector<dte::Bytes> storage(2, dte::Bytes(50, std::byte{7}));
    std::vector<dte::Payload> out;
    if (t.is_sender()) {
      for (const dte::Bytes& b : storage)
        out.push_back({std::span<const std::byte>(b)});
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)t.exchange(out);
    } catch (const dte::error& e) {
      std::lock_guard lock(checks);
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    seconds[static_cast<std::size_t>(rank)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard lock(checks);
    CHECK(t.aborted());  // as the error left, before anything else is called
    CHECK(world.aborts(rank) == 1);
    CHECK_THROWS_WITH(t.checkpoint("after the failure"), Contains("cannot be used"));
  });
  CHECK_MESSAGE(errors[0].find("ncclSend") != std::string::npos, errors[0]);
  CHECK_MESSAGE(errors[0].find("aborted") != std::string::npos, errors[0]);
  for (int r = 0; r < w.size(); ++r) {
    CAPTURE(r);
    CHECK(world.aborts(r) == 1);     // exactly once each
    CHECK(world.finalizes(r) == 0);  // aborted: the destructor did not wait on a finalize
    CHECK(seconds[static_cast<std::size_t>(r)] < 10.0);
  }
  for (int r = 1; r < w.size(); ++r)  // the receivers: at their deadline, naming the phase
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].find("round 1 (counts)") != std::string::npos,
                  errors[static_cast<std::size_t>(r)]);
  for (const std::string& v : world.violations())
    FAIL_CHECK(v);
}

TEST_CASE("a peer that never arrives: the others fail within the deadline, nothing blocks") {
  const Shape w{2, 2};
  const int absent = 3;
  fake_nccl::World world(w.size(), 3);
  std::vector<std::string> errors(static_cast<std::size_t>(w.size()));
  std::mutex checks;
  on_every_rank(w, [&](int rank) {
    fake_nccl::Transport t(fake_nccl::Runtime(world, rank), 0, rank, w.senders, w.receivers,
                           config(300ms));
    if (rank == absent) {
      std::this_thread::sleep_for(1s);
      t.abort();
      return;
    }
    std::vector<dte::Bytes> storage(2, dte::Bytes(3000, std::byte{1}));
    std::vector<dte::Payload> out;
    if (t.is_sender()) {
      for (const dte::Bytes& b : storage)
        out.push_back({std::span<const std::byte>(b)});
    }
    try {
      (void)t.exchange(out);
      (void)t.exchange(out);
    } catch (const dte::deadline_error& e) {
      std::lock_guard lock(checks);
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    std::lock_guard lock(checks);
    CHECK(t.aborted());
  });
  for (int r = 0; r < w.size(); ++r) {
    if (r == absent) continue;
    CAPTURE(r);
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].find("of the exchange did not complete") !=
                      std::string::npos,
                  errors[static_cast<std::size_t>(r)]);
    CHECK(world.aborts(r) == 1);
    CHECK(world.finalizes(r) == 0);
  }
  for (const std::string& v : world.violations())
    FAIL_CHECK(v);
}
