// SPDX-License-Identifier: Apache-2.0
// MpiTwoRound across real processes (run under mpirun): the first half of the ranks send, the
// rest receive. Modes:
//   (none)                 the transport suite (tests/transport/transport_suite.hpp) on every
//                          rank, with max_message = 1000 so that payloads go as several chunks
//   --stall-sender S       sender S sleeps past the deadline before round 1: the others must
//                          raise a deadline error naming S and the round, then abort the job
//   --kill-receiver R      receiver rank R kills itself (SIGKILL) after round 1
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../transport/transport_suite.hpp"
#include "dte/transport/mpi.hpp"

namespace {

// The fault modes: exchanges of a few bytes per pair, in which a sender stalls or a receiver
// dies.
void exchanges_with_a_fault(dte::MpiTwoRound& t, int rank, int stall, int kill) {
  for (int round = 0; round < 3; ++round) {
    const dte::Bytes bytes(100, std::byte{1});
    std::vector<dte::Payload> out;
    if (t.is_sender()) {
      if (rank == stall) std::this_thread::sleep_for(std::chrono::seconds(6));
      out.assign(static_cast<std::size_t>(t.receivers()), dte::Payload{bytes});
    }
    if (rank == kill && round == 1) {
      // Die between round 1 and round 2 of this exchange: round 1 runs inside exchange, so
      // kill from a helper thread shortly after entering it.
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::raise(SIGKILL);
      }).detach();
    }
    (void)t.exchange(out);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int stall = -1, kill = -1;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--stall-sender") == 0) stall = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kill-receiver") == 0) kill = std::atoi(argv[i + 1]);
  }
  const int senders = size / 2, receivers = size - senders;
  dte::MpiTwoRoundConfig cfg;
  cfg.max_message = 1000;
  cfg.deadline = std::chrono::milliseconds(stall >= 0 ? 1500 : 20000);
  bool passed = true;
  try {
    dte::MpiTwoRound t(MPI_COMM_WORLD, senders, receivers, cfg);
    if (stall >= 0 || kill >= 0) {
      exchanges_with_a_fault(t, rank, stall, kill);
    } else {
      const dte::transport_suite::Results r =
          dte::transport_suite::run_rank(t, rank, senders, receivers, {.chunk = cfg.max_message});
      for (const std::string& f : r.failures)
        std::fprintf(stderr, "FAILED: %s\n", f.c_str());
      passed = r.ok();
    }
  } catch (const dte::deadline_error& e) {
    std::fprintf(stderr, "DEADLINE: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 4);
  }
  // Nobody finalizes while a peer may still fail: MPI_Finalize waiting on a stuck peer while
  // another process aborts can leave mpirun hanging. A barrier with a deadline first.
  MPI_Request barrier = MPI_REQUEST_NULL;
  MPI_Ibarrier(MPI_COMM_WORLD, &barrier);
  const auto until = std::chrono::steady_clock::now() + cfg.deadline;
  for (int done = 0; !done;) {
    MPI_Test(&barrier, &done, MPI_STATUS_IGNORE);
    if (!done && std::chrono::steady_clock::now() >= until) {
      std::fprintf(stderr, "DEADLINE: rank %d: the final barrier did not complete\n", rank);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (passed) std::printf("rank %d of %d: transport suite passed\n", rank, size);
  std::fflush(stdout);
  MPI_Finalize();
  return passed ? 0 : 1;
}
