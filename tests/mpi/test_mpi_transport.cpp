// SPDX-License-Identifier: Apache-2.0
// MpiTwoRound across real processes (run under mpirun): the first half of the ranks send, the
// rest receive. Modes:
//   (none)                 3 exchanges of payloads of every size class (0 bytes, small, several
//                          chunks of max_message, several spans) checked byte for byte
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

#include "dte/transport/mpi.hpp"

namespace {

std::byte pattern(int s, int d, std::size_t i, int round) {
  return static_cast<std::byte>((s * 131 + d * 31 + static_cast<int>(i) * 7 + round * 13) & 0xFF);
}

std::size_t size_for(int s, int d, int round) {
  switch ((s + d + round) % 4) {
    case 0:
      return 0;
    case 1:
      return 17;
    case 2:
      return 2500;  // three chunks of max_message = 1000
    default:
      return 1000;
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
  try {
    dte::MpiTwoRound t(MPI_COMM_WORLD, senders, receivers, cfg);
    for (int round = 0; round < 3; ++round) {
      std::vector<dte::Bytes> storage;
      std::vector<dte::Payload> out;
      if (t.is_sender()) {
        if (rank == stall) std::this_thread::sleep_for(std::chrono::seconds(6));
        for (int d = 0; d < receivers; ++d) {
          dte::Bytes b(size_for(rank, d, round));
          for (std::size_t i = 0; i < b.size(); ++i)
            b[i] = pattern(rank, d, i, round);
          storage.push_back(std::move(b));
        }
        for (const dte::Bytes& b : storage) {
          // Two spans when there is something to split: the transport must join them.
          const std::size_t half = b.size() / 2;
          out.push_back(b.empty() ? dte::Payload{}
                                  : dte::Payload{std::span<const std::byte>(b.data(), half),
                                                 std::span<const std::byte>(b.data() + half,
                                                                            b.size() - half)});
        }
      }
      if (rank == kill && round == 1) {
        // Die between round 1 and round 2 of this exchange: round 1 runs inside exchange, so
        // kill from a helper thread shortly after entering it.
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          std::raise(SIGKILL);
        }).detach();
      }
      const dte::Inbox inbox = t.exchange(out);
      if (t.is_receiver()) {
        const int d = t.receiver_index();
        std::size_t expected_messages = 0;
        for (int s = 0; s < senders; ++s)
          expected_messages += size_for(s, d, round) > 0;
        if (inbox.size() != expected_messages) {
          std::fprintf(stderr, "rank %d: %zu messages, expected %zu\n", rank, inbox.size(),
                       expected_messages);
          MPI_Abort(MPI_COMM_WORLD, 2);
        }
        for (const auto& [s, bytes] : inbox) {
          bool ok = bytes.size() == size_for(static_cast<int>(s), d, round);
          for (std::size_t i = 0; ok && i < bytes.size(); ++i) {
            ok = bytes[i] == pattern(static_cast<int>(s), d, i, round);
          }
          if (!ok) {
            std::fprintf(stderr, "rank %d: payload from %lld wrong in exchange %d\n", rank,
                         static_cast<long long>(s), round);
            MPI_Abort(MPI_COMM_WORLD, 2);
          }
        }
      }
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
  std::printf("rank %d of %d: 3 exchanges verified\n", rank, size);
  MPI_Finalize();
  return 0;
}
