// SPDX-License-Identifier: Apache-2.0
// The transport conformance suite (concepts.hpp, `transport`), written once and run by every
// rank of a world over each shipped transport:
//   LoopbackTwoRound  tests/conformance/test_conformance.cpp (one thread per rank)
//   MpiTwoRound       tests/mpi/test_mpi_transport.cpp (one process per rank, under mpirun)
//   NcclTwoRound      tests/cuda/test_nccl_transport.cu (one thread and one GPU per rank)
// Each rank calls run_rank(t, rank, senders, receivers, options) on its own endpoint, all ranks
// at once; it returns what failed on that rank as lines of text (no test framework: MPI ranks
// are plain processes), and the caller reports them its own way. What every transport must do:
//   - the world: rank(), senders(), receivers(), is_sender() ([0, S)), is_receiver() ([S, S+R));
//   - a sender addressing the wrong number of receivers is refused (invalid_argument) on its
//     own, before anything moves, and the world goes on;
//   - exchange(): kRounds exchanges with payloads of every size class (0 bytes, given as no span
//     or as empty spans; small; exactly one chunk; several chunks, the last one partial), given
//     as several spans (some of them empty) whose borders do not meet the chunks'; one exchange
//     where nothing moves at all. A sender gets an empty inbox; a receiver gets exactly one
//     (sender, bytes) per sender with a non-empty payload, in increasing sender order, byte
//     for byte what was sent;
//   - sum(): element-wise over every rank, on every rank, mod 2^64 (a sum that wraps), of an
//     empty vector and of a longer one; after each exchange the bytes and messages sent and
//     received, summed over the world, agree with each other and with what the suite sent;
//   - checkpoint(): returns on every rank, between exchanges and at the end.
// A check that fails records a line and the rank goes on in step with the others; an exception
// from the transport ends this rank's run (recorded) and the others then hit their deadlines.
// Backend-specific faults (deadlines, a killed rank, the watchdog) stay in each backend's tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/payload.hpp"
#include "dte/error.hpp"

namespace dte::transport_suite {

constexpr int kRounds = 6;
constexpr int kEmptyRound = 1;  // the exchange in which nothing moves

struct Options {
  // The transport's chunk size as configured (MpiTwoRoundConfig::max_message,
  // NcclTwoRoundConfig::chunk_bytes): the sizes are chosen around it. Loopback has none; any
  // value tests the same sizes there.
  std::size_t chunk = 1000;
};

struct Results {
  int rank = -1;
  int exchanges = 0;                  // exchanges completed
  std::uint64_t bytes_received = 0;   // by this rank, over every exchange
  std::vector<std::string> failures;  // "rank r: what", in the order found
  [[nodiscard]] bool ok() const noexcept { return failures.empty(); }
};

// What sender s sends receiver d in exchange `round`: every size class over the rounds, for
// every pair (s + d + round decides the class).
inline std::size_t message_size(int s, int d, int round, const Options& o) {
  if (round == kEmptyRound) return 0;
  switch ((s + d + round) % 4) {
    case 0:
      return 0;
    case 1:
      return 17 + static_cast<std::size_t>(round);
    case 2:
      return o.chunk;  // exactly one chunk
    default:
      return 2 * o.chunk + o.chunk / 2 + static_cast<std::size_t>(s);  // three, the last partial
  }
}

// Byte i of that message: a hash of (s, d, round, i), so a byte from another pair, exchange or
// place (a chunk moved by any multiple of 256 bytes included) is caught.
inline std::byte content(int s, int d, int round, std::size_t i) {
  std::uint64_t x = (static_cast<std::uint64_t>(i) << 24) ^ (static_cast<std::uint64_t>(s) << 16) ^
                    (static_cast<std::uint64_t>(d) << 8) ^ static_cast<std::uint64_t>(round);
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<std::byte>(x >> 56);
}

// The message as a payload: several spans, some empty, their borders away from the chunks'.
// A 0-byte message alternates between no span and empty spans.
inline Payload spans_of(std::span<const std::byte> b, int s, int d, int round) {
  if (b.empty()) {
    if ((s + d + round) % 2 == 0) return {};
    return {b, b};  // empty spans: still 0 bytes, nothing moves
  }
  if (b.size() < 3) return {b};
  const std::size_t a = b.size() / 3, c = b.size() / 2 + 1;
  return {b.first(a), b.subspan(a, 0), b.subspan(a, c - a), b.subspan(c)};
}

// Messages (non-empty payloads) and bytes that move in exchange `round` of a world.
inline std::uint64_t messages(int senders, int receivers, int round, const Options& o = {}) {
  std::uint64_t n = 0;
  for (int s = 0; s < senders; ++s)
    for (int d = 0; d < receivers; ++d)
      n += message_size(s, d, round, o) > 0;
  return n;
}
inline std::uint64_t bytes(int senders, int receivers, int round, const Options& o = {}) {
  std::uint64_t n = 0;
  for (int s = 0; s < senders; ++s)
    for (int d = 0; d < receivers; ++d)
      n += message_size(s, d, round, o);
  return n;
}

namespace detail {

inline std::string u(std::uint64_t x) {
  return std::to_string(x);
}

template <class Inbox>
void check_inbox(const Inbox& inbox, int d, int senders, int round, const Options& o, Results& r,
                 const auto& fail) {
  const std::string at = "exchange " + std::to_string(round) + ": ";
  std::vector<int> entries(static_cast<std::size_t>(senders), 0);
  std::int64_t previous = -1;
  bool ordered = true;
  for (const auto& [from, got] : inbox) {
    r.bytes_received += got.size();
    ordered = ordered && from > previous;
    previous = from;
    if (from < 0 || from >= senders) {
      fail(at + "an entry from sender " + std::to_string(from) + ", outside the world");
      continue;
    }
    const int s = static_cast<int>(from);
    const std::size_t n = message_size(s, d, round, o);
    if (++entries[static_cast<std::size_t>(s)] > 1) {
      fail(at + "another entry from sender " + std::to_string(s));
      continue;
    }
    if (n == 0) {
      fail(at + "an entry of " + u(got.size()) + " bytes from sender " + std::to_string(s) +
           ", which sent 0 (a 0-byte payload moves nothing)");
    } else if (got.size() != n) {
      fail(at + u(got.size()) + " bytes from sender " + std::to_string(s) + ", " + u(n) + " sent");
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        if (got[i] != content(s, d, round, i)) {
          fail(at + "byte " + u(i) + " of " + u(n) + " from sender " + std::to_string(s) +
               " differs from what was sent");
          break;
        }
      }
    }
  }
  if (!ordered) fail(at + "the entries are not in increasing sender order");
  for (int s = 0; s < senders; ++s) {
    const std::size_t n = message_size(s, d, round, o);
    if (n > 0 && entries[static_cast<std::size_t>(s)] == 0) {
      fail(at + "nothing from sender " + std::to_string(s) + " (" + u(n) + " bytes sent)");
    }
  }
}

}  // namespace detail

// The suite on one rank; every rank of the world calls it at once.
template <class T>
Results run_rank(T& t, int rank, int senders, int receivers, const Options& o = {}) {
  static_assert(transport<T>);
  Results r;
  r.rank = rank;
  const auto fail = [&](const std::string& what) {
    r.failures.push_back("rank " + std::to_string(rank) + ": " + what);
  };
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) fail(what);
  };

  // The world.
  expect(t.rank() == rank, "rank() is " + std::to_string(t.rank()));
  expect(t.senders() == senders, "senders() is " + std::to_string(t.senders()));
  expect(t.receivers() == receivers, "receivers() is " + std::to_string(t.receivers()));
  expect(t.is_sender() == (rank < senders), "is_sender() is wrong");
  expect(t.is_receiver() == (rank >= senders && rank < senders + receivers),
         "is_receiver() is wrong");
  const std::uint64_t world = static_cast<std::uint64_t>(senders + receivers);
  if (senders < 1 || receivers < 1) {
    fail("the suite needs a world with senders and receivers");
    return r;
  }

  try {
    // A sender that addresses one receiver too few is refused on its own.
    if (t.is_sender()) {
      const std::vector<Payload> too_few(static_cast<std::size_t>(receivers - 1));
      bool refused = false;
      try {
        (void)t.exchange(too_few);
      } catch (const invalid_argument&) {
        refused = true;
      }
      expect(refused, "a sender addressing " + std::to_string(receivers - 1) + " of " +
                          std::to_string(receivers) + " receivers was not refused");
    }
    t.checkpoint("the transport suite's start");

    for (int round = 0; round < kRounds; ++round) {
      std::vector<Bytes> storage;
      std::vector<Payload> out;
      std::uint64_t sent_bytes = 0, sent_messages = 0;
      if (t.is_sender()) {
        storage.resize(static_cast<std::size_t>(receivers));
        for (int d = 0; d < receivers; ++d) {
          Bytes& b = storage[static_cast<std::size_t>(d)];
          b.resize(message_size(rank, d, round, o));
          for (std::size_t i = 0; i < b.size(); ++i)
            b[i] = content(rank, d, round, i);
          sent_bytes += b.size();
          sent_messages += !b.empty();
        }
        for (int d = 0; d < receivers; ++d)
          out.push_back(spans_of(storage[static_cast<std::size_t>(d)], rank, d, round));
      }
      const auto inbox = t.exchange(out);
      ++r.exchanges;
      const std::uint64_t before = r.bytes_received;
      if (t.is_sender()) {
        expect(inbox.empty(), "exchange " + std::to_string(round) + ": a sender got " +
                                  detail::u(inbox.size()) + " entries");
      } else if (t.is_receiver()) {
        detail::check_inbox(inbox, rank - senders, senders, round, o, r, fail);
      }
      // What moved, agreed over the world: sent == received == what the suite sent.
      std::vector<std::uint64_t> moved{sent_bytes, r.bytes_received - before, sent_messages,
                                       t.is_receiver() ? inbox.size() : 0};
      t.sum(moved, "the transport suite's byte count");
      const std::uint64_t want_bytes = bytes(senders, receivers, round, o);
      const std::uint64_t want_messages = messages(senders, receivers, round, o);
      expect(moved[0] == want_bytes && moved[1] == want_bytes,
             "exchange " + std::to_string(round) + ": the world sent " + detail::u(moved[0]) +
                 " bytes and received " + detail::u(moved[1]) + ", expected " +
                 detail::u(want_bytes));
      expect(moved[2] == want_messages && moved[3] == want_messages,
             "exchange " + std::to_string(round) + ": the world sent " + detail::u(moved[2]) +
                 " messages and received " + detail::u(moved[3]) + ", expected " +
                 detail::u(want_messages));
      t.checkpoint("the transport suite's exchange");
    }

    // sum(): every rank, every element, mod 2^64.
    std::vector<std::uint64_t> v{static_cast<std::uint64_t>(rank), 1, std::uint64_t{1} << 63,
                                 ~std::uint64_t{0}};
    t.sum(v, "the transport suite's sum");
    const std::vector<std::uint64_t> want{world * (world - 1) / 2, world,
                                          world % 2 == 0 ? 0 : std::uint64_t{1} << 63,
                                          std::uint64_t{0} - world};
    expect(v == want, "sum() of {rank, 1, 2^63, 2^64 - 1} is {" + detail::u(v[0]) + ", " +
                          detail::u(v[1]) + ", " + detail::u(v[2]) + ", " + detail::u(v[3]) +
                          "}, expected {" + detail::u(want[0]) + ", " + detail::u(want[1]) + ", " +
                          detail::u(want[2]) + ", " + detail::u(want[3]) + "}");
    std::vector<std::uint64_t> none;
    t.sum(none, "the transport suite's empty sum");
    std::vector<std::uint64_t> many(1000);
    for (std::size_t i = 0; i < many.size(); ++i)
      many[i] = static_cast<std::uint64_t>(rank + 1) * i;
    t.sum(many, "the transport suite's long sum");
    for (std::size_t i = 0; i < many.size(); ++i) {
      if (many[i] != world * (world + 1) / 2 * i) {
        fail("sum() of 1000 elements: element " + detail::u(i) + " is " + detail::u(many[i]));
        break;
      }
    }
    t.checkpoint("the transport suite's end");
  } catch (const std::exception& e) {
    fail(std::string("the transport threw: ") + e.what());
  }
  return r;
}

}  // namespace dte::transport_suite
