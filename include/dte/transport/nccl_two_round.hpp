// SPDX-License-Identifier: Apache-2.0
// BasicNcclTwoRound<Runtime>: the transport concept over NCCL's point-to-point calls, one
// endpoint per rank, the world [0, S) senders then [S, S + R) receivers in NCCL rank order. The
// protocol is written once over a runtime (the NCCL and CUDA calls it makes, concept
// nccl_runtime below): NcclTwoRound (transport/nccl.cuh) is it over the real ones, and
// tests/transport/test_nccl_protocol.cpp runs it on the host over a fake runtime whose
// communicator is non-blocking (every call "in progress" first), whose streams run lazily and
// whose peers can stall or fail, through the same transport suite as every transport.
//   exchange: round one, every sender sends every receiver its byte count (zeros included) and
//     every receiver receives one count from every sender, inside one group; round two, the
//     payloads, with the chunk schedule both sides derive from the counts
//     (transport/two_round_plan.hpp). The engine's messages are host memory: a sender stages its
//     payloads into one device buffer, a receiver copies its inbox back to the host.
//   sum / max / checkpoint: an all-reduce over ncclUint64 (a sum wraps mod 2^64 like every
//     transport's).
// The communicator is non-blocking: no NCCL call blocks the host, and every wait goes through
// the Watchdog (transport/watchdog.hpp), which polls the communicator's asynchronous state and
// the phase's CUDA event against the deadline and aborts the communicator on an error or a
// stall, so a dead or stalled peer becomes an error naming the phase and the peers, never a
// hang (the scheme of PyTorch's ProcessGroupNCCL watchdog). The order of each phase is what
// makes that true:
//   1. the host-to-device copies (the stream is idle: the phase before has completed);
//   2. the NCCL calls; a non-blocking communicator may return "in progress" and enqueue them
//      later from its own thread, so the phase first waits until they are issued (settle):
//      anything enqueued on the stream before that would run before them;
//   3. an event after them, waited for by the watchdog (complete);
//   4. only then the device-to-host copies. A copy into pageable memory blocks the host until
//      it is done; enqueued behind NCCL work it would block inside CUDA on a dead peer, where no
//      deadline runs. After step 3 the stream holds nothing that waits on a peer.
// Any failure inside a phase (an NCCL error, a CUDA error, a deadline) aborts the communicator
// before the error leaves the transport: the peers' next waits then fail at their deadlines, and
// the destructor does not wait out a finalize that cannot complete. An aborted transport
// refuses every later call: make a new one.
#pragma once

#include <nccl.h>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/payload.hpp"
#include "dte/error.hpp"
#include "dte/transport/two_round_plan.hpp"
#include "dte/transport/watchdog.hpp"

namespace dte {

// An NCCL call returned an error. code() is its ncclResult_t.
class nccl_error : public error {
 public:
  explicit nccl_error(ncclResult_t code, const std::string& message,
                      source_location where = source_location::current())
      : error(message, where), code_(code) {}
  [[nodiscard]] ncclResult_t code() const noexcept { return code_; }

 private:
  ncclResult_t code_;
};

// What BasicNcclTwoRound needs of NCCL and CUDA. NCCL calls return their ncclResult_t (the
// transport checks them); the stream, event and memory calls throw on failure themselves.
// copy_async copies n bytes between host and device memory in either direction, in stream order.
template <class R>
concept nccl_runtime = std::copy_constructible<R> && requires {
  typename R::comm_type;
  typename R::stream_type;
  typename R::event_type;
  typename R::unique_id;
} && requires(R& r, typename R::comm_type& comm_out, typename R::comm_type comm,
              typename R::stream_type s, typename R::event_type e, const typename R::unique_id& id,
              ncclResult_t* state, void* p, const void* cp, std::size_t n, int peer,
              ncclDataType_t type, ncclRedOp_t op) {
  { r.init(comm_out, peer, id, peer) } -> std::same_as<ncclResult_t>;
  { r.async_error(comm, state) } -> std::same_as<ncclResult_t>;
  { r.last_error(comm) } -> std::convertible_to<std::string>;
  { r.error_string(ncclSuccess) } -> std::convertible_to<std::string>;
  { r.finalize(comm) } -> std::same_as<ncclResult_t>;
  { r.destroy(comm) } -> std::same_as<ncclResult_t>;
  { r.abort(comm) } -> std::same_as<ncclResult_t>;
  { r.group_start() } -> std::same_as<ncclResult_t>;
  { r.group_end() } -> std::same_as<ncclResult_t>;
  { r.send(cp, n, type, peer, comm, s) } -> std::same_as<ncclResult_t>;
  { r.recv(p, n, type, peer, comm, s) } -> std::same_as<ncclResult_t>;
  { r.all_reduce(cp, p, n, type, op, comm, s) } -> std::same_as<ncclResult_t>;
  { r.create_stream() } -> std::same_as<typename R::stream_type>;
  r.destroy_stream(s);
  { r.create_event() } -> std::same_as<typename R::event_type>;
  r.destroy_event(e);
  r.record(e, s);
  { r.query(e) } -> std::same_as<bool>;
  r.synchronize(s);
  { r.device_alloc(n) } -> std::same_as<void*>;
  r.device_free(p);
  r.copy_async(p, cp, n, s);
  r.memset_async(p, peer, n, s);
};

struct NcclTwoRoundConfig {
  // Longest wait for one phase (a round of an exchange, a sum, a checkpoint, creation).
  std::chrono::milliseconds deadline = std::chrono::minutes(2);
  // Largest single ncclSend/ncclRecv; bigger messages go as consecutive chunks.
  std::uint64_t chunk_bytes = std::uint64_t{1} << 30;
  // Pause between two polls of the communicator's state.
  std::chrono::microseconds poll = std::chrono::microseconds(50);
};

template <nccl_runtime Runtime>
class BasicNcclTwoRound {
 public:
  using transport_tag = void;
  using inbox_type = Inbox;
  using comm_type = typename Runtime::comm_type;
  using stream_type = typename Runtime::stream_type;

  // Joins the world of senders + receivers ranks as `rank` (on the current CUDA device for the
  // real runtime: call cudaSetDevice first; one device per rank). Blocks until every rank has
  // joined or the deadline passes.
  BasicNcclTwoRound(Runtime runtime, const typename Runtime::unique_id& id, int rank, int senders,
                    int receivers, NcclTwoRoundConfig config = {})
      : rt_(std::move(runtime)),
        senders_(senders),
        receivers_(receivers),
        rank_(rank),
        config_(config),
        watchdog_(config.deadline, config.poll) {
    if (senders < 1 || receivers < 1) {
      throw invalid_argument(
          "NcclTwoRound: a world needs at least one sender and one receiver (got " +
          std::to_string(senders) + " and " + std::to_string(receivers) + ")");
    }
    if (rank < 0 || rank >= senders + receivers) {
      throw invalid_argument("NcclTwoRound: rank " + std::to_string(rank) +
                             " is outside the world of " + std::to_string(senders + receivers) +
                             " ranks");
    }
    (void)two_round::chunks(0, config.chunk_bytes);  // validates the chunk size
    stream_ = rt_.create_stream();
    try {
      event_ = rt_.create_event();
      has_event_ = true;
      phase("creating the NCCL communicator", [&] {
        check(rt_.init(comm_, senders + receivers, id, rank), "ncclCommInitRankConfig");
        settle("creating the NCCL communicator", world());
      });
    } catch (...) {
      release_stream_and_event();
      throw;
    }
  }

  BasicNcclTwoRound(const BasicNcclTwoRound&) = delete;
  BasicNcclTwoRound& operator=(const BasicNcclTwoRound&) = delete;

  // Finalizes and destroys the communicator (aborts it if that fails or does not complete
  // within the deadline); an aborted one is already gone.
  ~BasicNcclTwoRound() {
    if (comm_ != comm_type{}) {
      try {
        check(rt_.finalize(comm_), "ncclCommFinalize");
        settle("finalizing the NCCL communicator", "this rank");
        if (comm_ != comm_type{}) (void)rt_.destroy(comm_);
      } catch (...) {
        abort();
      }
    }
    for (auto* b : {&counts_, &payload_, &sums_})
      b->release(rt_);
    release_stream_and_event();
  }

  [[nodiscard]] int senders() const noexcept { return senders_; }
  [[nodiscard]] int receivers() const noexcept { return receivers_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_sender() const noexcept { return rank_ < senders_; }
  [[nodiscard]] bool is_receiver() const noexcept { return rank_ >= senders_; }
  [[nodiscard]] bool aborted() const noexcept {
    return watchdog_.aborted() || comm_ == comm_type{};
  }
  [[nodiscard]] stream_type stream() const noexcept { return stream_; }

  // Aborts the communicator now (a rank that gives up); every later call on it refuses.
  void abort() noexcept {
    if (comm_ != comm_type{}) {
      (void)rt_.abort(comm_);
      comm_ = comm_type{};
    }
  }

  Inbox exchange(const std::vector<Payload>& out) {
    require_usable("an exchange");
    if (is_sender() && static_cast<int>(out.size()) != receivers_) {
      throw invalid_argument("NcclTwoRound: sender " + std::to_string(rank_) + " addressed " +
                             std::to_string(out.size()) + " receivers, the world has " +
                             std::to_string(receivers_));
    }
    if (is_receiver() && !out.empty()) {
      throw invalid_argument("NcclTwoRound: receiver " + std::to_string(rank_) +
                             " passed payloads; receivers send nothing");
    }
    const int peers = is_sender() ? receivers_ : senders_;
    const int first_peer = is_sender() ? senders_ : 0;
    const std::string who = two_round::peer_range(first_peer, peers);
    const auto n_peers = static_cast<std::size_t>(peers);

    // Round one: the counts.
    std::vector<std::uint64_t> counts(n_peers, 0);
    phase("round 1 (counts) of the exchange", [&] {
      if (is_sender()) {
        for (std::size_t d = 0; d < n_peers; ++d)
          counts[d] = payload_size(out[d]);
      }
      auto* d_counts = reinterpret_cast<std::uint64_t*>(counts_.reserve(rt_, 8 * n_peers));
      if (is_sender()) rt_.copy_async(d_counts, counts.data(), 8 * n_peers, stream_);
      check(rt_.group_start(), "ncclGroupStart");
      for (int p = 0; p < peers; ++p) {
        if (is_sender()) {
          check(rt_.send(d_counts + p, 1, ncclUint64, first_peer + p, comm_, stream_), "ncclSend");
        } else {
          check(rt_.recv(d_counts + p, 1, ncclUint64, first_peer + p, comm_, stream_), "ncclRecv");
        }
      }
      check(rt_.group_end(), "ncclGroupEnd");
      complete("round 1 (counts) of the exchange", who);
      if (is_receiver()) to_host(counts.data(), d_counts, 8 * n_peers);
    });

    // Round two: the payloads, chunked, through one staging buffer.
    Inbox inbox;
    const two_round::StagingLayout staging = two_round::staging_layout(counts);
    if (staging.total == 0) return inbox;
    phase("round 2 (payloads) of the exchange", [&] {
      std::byte* d_data = payload_.reserve(rt_, staging.total);
      if (is_sender()) {
        for (std::size_t d = 0; d < n_peers; ++d) {
          std::uint64_t at = staging.offsets[d];
          for (const auto& part : out[d]) {
            if (part.empty()) continue;
            rt_.copy_async(d_data + at, part.data(), part.size(), stream_);
            at += part.size();
          }
        }
      }
      check(rt_.group_start(), "ncclGroupStart");
      for (int p = 0; p < peers; ++p) {
        std::byte* base = d_data + staging.offsets[static_cast<std::size_t>(p)];
        for (const two_round::Chunk& c :
             two_round::chunks(counts[static_cast<std::size_t>(p)], config_.chunk_bytes)) {
          if (is_sender()) {
            check(rt_.send(base + c.offset, c.bytes, ncclUint8, first_peer + p, comm_, stream_),
                  "ncclSend");
          } else {
            check(rt_.recv(base + c.offset, c.bytes, ncclUint8, first_peer + p, comm_, stream_),
                  "ncclRecv");
          }
        }
      }
      check(rt_.group_end(), "ncclGroupEnd");
      complete("round 2 (payloads) of the exchange", who);
      if (is_receiver()) {
        for (std::size_t s = 0; s < n_peers; ++s) {
          const std::uint64_t n = counts[s];
          if (n == 0) continue;
          inbox.emplace_back(static_cast<int>(s), Bytes(n));
          rt_.copy_async(inbox.back().second.data(), d_data + staging.offsets[s], n, stream_);
        }
        rt_.synchronize(stream_);  // (copies only: nothing on the stream waits on a peer)
      }
    });
    return inbox;
  }

  // Element-wise sum over every rank of the world; the result replaces v on every rank.
  void sum(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, ncclSum); }
  // Element-wise maximum (FP8 receivers' block scales: engine/fp8_stage.hpp), the same way.
  void max(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, ncclMax); }

  void reduce(std::span<std::uint64_t> v, const char* name, ncclRedOp_t op) {
    require_usable(name);
    if (v.empty()) {
      checkpoint(name);
      return;
    }
    phase(name, [&] {
      auto* d = reinterpret_cast<std::uint64_t*>(sums_.reserve(rt_, v.size_bytes()));
      rt_.copy_async(d, v.data(), v.size_bytes(), stream_);
      check(rt_.all_reduce(d, d, v.size(), ncclUint64, op, comm_, stream_), "ncclAllReduce");
      complete(name, world());
      to_host(v.data(), d, v.size_bytes());
    });
  }

  void checkpoint(const char* name) {
    require_usable(name);
    phase(name, [&] {
      auto* d = reinterpret_cast<std::uint64_t*>(sums_.reserve(rt_, 8));
      rt_.memset_async(d, 0, 8, stream_);
      check(rt_.all_reduce(d, d, 1, ncclUint64, ncclSum, comm_, stream_), "ncclAllReduce");
      complete(name, world());
    });
  }

 private:
  // The Watchdog's view of one phase: the communicator's asynchronous state, the phase's event.
  struct Phase {
    BasicNcclTwoRound* t;
    bool with_event;

    CommState comm_state(std::string& reason) const {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t got = t->rt_.async_error(t->comm_, &async);
      if (got != ncclSuccess) async = got;
      if (async == ncclSuccess) return CommState::ok;
      if (async == ncclInProgress) return CommState::pending;
      reason = t->rt_.error_string(async) + ": " + std::string(t->rt_.last_error(t->comm_));
      return CommState::failed;
    }
    bool done() const { return !with_event || t->rt_.query(t->event_); }
    void abort() const noexcept { t->abort(); }
  };

  // A grow-only device buffer.
  class DeviceBytes {
   public:
    std::byte* reserve(Runtime& rt, std::uint64_t n) {
      if (n > size_) {
        release(rt);
        ptr_ = static_cast<std::byte*>(rt.device_alloc(n));
        size_ = n;
      }
      return ptr_;
    }
    void release(Runtime& rt) noexcept {
      if (ptr_ != nullptr) rt.device_free(ptr_);
      ptr_ = nullptr;
      size_ = 0;
    }

   private:
    std::byte* ptr_ = nullptr;
    std::uint64_t size_ = 0;
  };

  [[nodiscard]] std::string world() const {
    return two_round::peer_range(0, senders_ + receivers_);
  }

  void require_usable(const char* what) const {
    if (comm_ == comm_type{}) {
      throw error(std::string("NcclTwoRound: rank ") + std::to_string(rank_) +
                  ": the communicator was aborted; it cannot be used for " + what +
                  ": create a new transport");
    }
  }

  // Runs one phase; whatever fails in it aborts the communicator before the error leaves.
  template <class F>
  void phase(const char*, F&& f) {
    try {
      f();
    } catch (...) {
      abort();
      throw;
    }
  }

  void check(ncclResult_t status, const char* call) const {
    if (status == ncclSuccess || status == ncclInProgress) return;
    std::string message = std::string("NCCL error ") + rt_.error_string(status) + " from " + call +
                          " on rank " + std::to_string(rank_);
    if (status == ncclSystemError || status == ncclRemoteError) {
      message += "; a peer or the network failed: check every rank's log (NCCL_DEBUG=WARN)";
    } else if (status == ncclInvalidUsage) {
      message += "; NCCL was called wrongly (NCCL_DEBUG=WARN names the rule)";
    }
    message += "; the communicator was aborted: create a new transport";
    throw nccl_error(status, message);
  }

  // Waits until the calls in progress on the non-blocking communicator have been issued.
  void settle(const std::string& name, const std::string& peers) {
    Phase p{this, false};
    watchdog_.wait(p, name, peers);
  }

  // Waits until the phase's NCCL work on the stream has completed (and the communicator is
  // healthy): issued first (settle), then the event recorded after it.
  void complete(const std::string& name, const std::string& peers) {
    settle(name, peers);
    rt_.record(event_, stream_);
    Phase p{this, true};
    watchdog_.wait(p, name, peers);
  }

  // A device-to-host copy, after complete(): the stream then holds no peer's work.
  void to_host(void* dst, const void* src, std::size_t n) {
    rt_.copy_async(dst, src, n, stream_);
    rt_.synchronize(stream_);
  }

  void release_stream_and_event() noexcept {
    if (has_event_) rt_.destroy_event(event_);
    has_event_ = false;
    rt_.destroy_stream(stream_);
  }

  mutable Runtime rt_;
  int senders_, receivers_, rank_;
  NcclTwoRoundConfig config_;
  Watchdog watchdog_;
  stream_type stream_{};
  typename Runtime::event_type event_{};
  bool has_event_ = false;
  comm_type comm_{};
  DeviceBytes counts_, payload_, sums_;
};

}  // namespace dte
