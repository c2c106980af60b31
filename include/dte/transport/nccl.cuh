// SPDX-License-Identifier: Apache-2.0
// NcclTwoRound: the transport concept over NCCL, one endpoint per rank (one process or thread
// per GPU), the world [0, S) senders then [S, S + R) receivers in NCCL rank order.
//   exchange: round one, every sender sends every receiver its byte count (zeros included) and
//     every receiver receives one count from every sender, inside one ncclGroupStart/End;
//     round two, the payloads, with the chunk schedule both sides derive from the counts
//     (transport/two_round_plan.hpp). The engine's messages are host memory: a sender stages its
//     payloads into one device buffer, a receiver copies its inbox back to the host.
//   sum / checkpoint: ncclAllReduce (ncclUint64, ncclSum: wraps mod 2^64 like every transport).
// The communicator is created non-blocking (ncclCommInitRankConfig, blocking = 0): no NCCL call
// blocks the host, and every wait goes through the Watchdog (transport/watchdog.hpp), which polls
// ncclCommGetAsyncError and the phase's CUDA event against the deadline and calls ncclCommAbort
// on an asynchronous error or a stall, so a dead or stalled peer becomes an error naming the
// phase and the peers, never a hang (the scheme of PyTorch's ProcessGroupNCCL watchdog). An
// aborted transport refuses every later call: make a new one.
// One host synchronisation per round (its completion); MPI or anything else only to pass the
// ncclUniqueId (examples/nccl_sync.cu). An engine over this transport runs on exec::Cuda by
// default (default_executor): DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound>
// reads device-resident optimizer state and writes device-resident receiver tensors.
#pragma once

#if !defined(__CUDACC__)
#error "dte/transport/nccl.cuh needs nvcc: link dte::nccl"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/core/payload.hpp"
#include "dte/error.hpp"
#include "dte/exec/cuda.cuh"
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

namespace detail {
[[noreturn]] inline void throw_nccl_error(ncclResult_t status, const char* expression,
                                          source_location where) {
  std::string message = std::string("NCCL error ") + ncclGetErrorString(status) + " from `" +
                        expression + "` at " + where.file_name() + ":" +
                        std::to_string(where.line());
  if (status == ncclSystemError || status == ncclRemoteError) {
    message += "; a peer or the network failed: check every rank's log (NCCL_DEBUG=WARN)";
  } else if (status == ncclInvalidUsage) {
    message += "; NCCL was called wrongly (NCCL_DEBUG=WARN names the rule)";
  }
  throw nccl_error(status, message, where);
}
}  // namespace detail
}  // namespace dte

// Evaluates an NCCL call once; throws dte::nccl_error unless it returned ncclSuccess or (for a
// non-blocking communicator, whose calls complete asynchronously) ncclInProgress.
#define DTE_NCCL_TRY(expr)                                                                   \
  do {                                                                                       \
    const ::ncclResult_t dte_nccl_try_status_ = (expr);                                      \
    if (dte_nccl_try_status_ != ::ncclSuccess && dte_nccl_try_status_ != ::ncclInProgress) { \
      ::dte::detail::throw_nccl_error(dte_nccl_try_status_, #expr,                           \
                                      ::dte::source_location::current());                    \
    }                                                                                        \
  } while (false)

namespace dte {

struct NcclTwoRoundConfig {
  // Longest wait for one phase (a round of an exchange, a sum, a checkpoint, creation).
  std::chrono::milliseconds deadline = std::chrono::minutes(2);
  // Largest single ncclSend/ncclRecv; bigger messages go as consecutive chunks.
  std::uint64_t chunk_bytes = std::uint64_t{1} << 30;
  // Pause between two polls of the communicator's state.
  std::chrono::microseconds poll = std::chrono::microseconds(50);
};

namespace detail {

// The Watchdog's view of one phase: the communicator's asynchronous state, the phase's event.
struct NcclPhase {
  ncclComm_t* comm;
  cudaEvent_t event;  // null: only the communicator's state (a call in progress)

  CommState comm_state(std::string& reason) const {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(*comm, &async);
    if (got != ncclSuccess) async = got;
    if (async == ncclSuccess) return CommState::ok;
    if (async == ncclInProgress) return CommState::pending;
    reason = std::string(ncclGetErrorString(async)) + ": " + ncclGetLastError(*comm);
    return CommState::failed;
  }
  bool done() const {
    if (event == nullptr) return true;
    const cudaError_t s = cudaEventQuery(event);
    if (s == cudaSuccess) return true;
    if (s == cudaErrorNotReady) return false;
    DTE_CUDA_TRY(s);
    return false;
  }
  void abort() const noexcept {
    (void)ncclCommAbort(*comm);
    *comm = nullptr;
  }
};

// An event that frees itself (also when a constructor throws half-way).
struct OwnedEvent {
  cudaEvent_t e = nullptr;
  OwnedEvent() { DTE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~OwnedEvent() { (void)cudaEventDestroy(e); }
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
};

// A grow-only device buffer.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  std::byte* reserve(std::uint64_t n) {
    if (n > size_) {
      if (ptr_ != nullptr) DTE_CUDA_TRY(cudaFree(ptr_));
      ptr_ = nullptr;
      size_ = 0;
      DTE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&ptr_), n));
      size_ = n;
    }
    return ptr_;
  }

 private:
  std::byte* ptr_ = nullptr;
  std::uint64_t size_ = 0;
};

}  // namespace detail

class NcclTwoRound {
 public:
  using transport_tag = void;
  using inbox_type = Inbox;
  // DeltaEngine<..., NcclTwoRound> runs on the CUDA executor unless told otherwise: the
  // trainer's state and the receivers' tensors are device memory (DeviceTensors).
  using default_executor = exec::Cuda;

  // A unique id for a new world: made by one rank, passed to all (MPI_Bcast, a file, a store).
  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    DTE_NCCL_TRY(ncclGetUniqueId(&id));
    return id;
  }

  // Joins the world of senders + receivers ranks as `rank`, on the current CUDA device (call
  // cudaSetDevice first; one device per rank). Blocks until every rank has joined or the
  // deadline passes.
  NcclTwoRound(const ncclUniqueId& id, int rank, int senders, int receivers,
               NcclTwoRoundConfig config = {})
      : senders_(senders),
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
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclUniqueId copy = id;
    DTE_NCCL_TRY(ncclCommInitRankConfig(&comm_, senders + receivers, copy, rank, &cfg));
    settle("creating the NCCL communicator", two_round::peer_range(0, senders + receivers));
  }

  NcclTwoRound(const NcclTwoRound&) = delete;
  NcclTwoRound& operator=(const NcclTwoRound&) = delete;

  // Finalizes and destroys the communicator (aborts it if that does not complete within the
  // deadline); an aborted one is already gone.
  ~NcclTwoRound() {
    if (comm_ != nullptr) {
      try {
        DTE_NCCL_TRY(ncclCommFinalize(comm_));
        settle("finalizing the NCCL communicator", "this rank");
        if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
      } catch (...) {
        if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      }
    }
  }

  [[nodiscard]] int senders() const noexcept { return senders_; }
  [[nodiscard]] int receivers() const noexcept { return receivers_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_sender() const noexcept { return rank_ < senders_; }
  [[nodiscard]] bool is_receiver() const noexcept { return rank_ >= senders_; }
  [[nodiscard]] bool aborted() const noexcept { return watchdog_.aborted() || comm_ == nullptr; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  // Aborts the communicator now (a rank that gives up); every later call on it refuses.
  void abort() noexcept {
    if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
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

    // Round one: the counts.
    std::vector<std::uint64_t> counts(static_cast<std::size_t>(peers), 0);
    if (is_sender()) {
      for (int d = 0; d < receivers_; ++d)
        counts[static_cast<std::size_t>(d)] = payload_size(out[static_cast<std::size_t>(d)]);
    }
    auto* d_counts = reinterpret_cast<std::uint64_t*>(
        counts_.reserve(sizeof(std::uint64_t) * static_cast<std::size_t>(peers)));
    if (is_sender()) {
      DTE_CUDA_TRY(cudaMemcpyAsync(d_counts, counts.data(), counts.size() * 8,
                                   cudaMemcpyHostToDevice, stream_));
    }
    DTE_NCCL_TRY(ncclGroupStart());
    for (int p = 0; p < peers; ++p) {
      if (is_sender()) {
        DTE_NCCL_TRY(ncclSend(d_counts + p, 1, ncclUint64, first_peer + p, comm_, stream_));
      } else {
        DTE_NCCL_TRY(ncclRecv(d_counts + p, 1, ncclUint64, first_peer + p, comm_, stream_));
      }
    }
    DTE_NCCL_TRY(ncclGroupEnd());
    if (is_receiver()) {
      DTE_CUDA_TRY(cudaMemcpyAsync(counts.data(), d_counts, counts.size() * 8,
                                   cudaMemcpyDeviceToHost, stream_));
    }
    complete("round 1 (counts) of the exchange", who);

    // Round two: the payloads, chunked, through one staging buffer.
    const two_round::StagingLayout staging = two_round::staging_layout(counts);
    std::byte* d_data = payload_.reserve(staging.total);
    if (is_sender()) {
      for (int d = 0; d < receivers_; ++d) {
        std::uint64_t at = staging.offsets[static_cast<std::size_t>(d)];
        for (const auto& part : out[static_cast<std::size_t>(d)]) {
          if (part.empty()) continue;
          DTE_CUDA_TRY(cudaMemcpyAsync(d_data + at, part.data(), part.size(),
                                       cudaMemcpyHostToDevice, stream_));
          at += part.size();
        }
      }
    }
    Inbox inbox;
    if (staging.total > 0) {
      DTE_NCCL_TRY(ncclGroupStart());
      for (int p = 0; p < peers; ++p) {
        std::byte* base = d_data + staging.offsets[static_cast<std::size_t>(p)];
        for (const two_round::Chunk& c :
             two_round::chunks(counts[static_cast<std::size_t>(p)], config_.chunk_bytes)) {
          if (is_sender()) {
            DTE_NCCL_TRY(
                ncclSend(base + c.offset, c.bytes, ncclUint8, first_peer + p, comm_, stream_));
          } else {
            DTE_NCCL_TRY(
                ncclRecv(base + c.offset, c.bytes, ncclUint8, first_peer + p, comm_, stream_));
          }
        }
      }
      DTE_NCCL_TRY(ncclGroupEnd());
      if (is_receiver()) {
        for (int s = 0; s < senders_; ++s) {
          const std::uint64_t n = counts[static_cast<std::size_t>(s)];
          if (n == 0) continue;
          inbox.emplace_back(s, Bytes(n));
          DTE_CUDA_TRY(cudaMemcpyAsync(inbox.back().second.data(),
                                       d_data + staging.offsets[static_cast<std::size_t>(s)], n,
                                       cudaMemcpyDeviceToHost, stream_));
        }
      }
      complete("round 2 (payloads) of the exchange", who);
    }
    return inbox;
  }

  // Element-wise sum over every rank of the world; the result replaces v on every rank.
  void sum(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, ncclSum); }
  // Element-wise maximum (FP8 receivers' block scales: engine/fp8_stage.hpp), the same way.
  void max(std::span<std::uint64_t> v, const char* phase) { reduce(v, phase, ncclMax); }

  void reduce(std::span<std::uint64_t> v, const char* phase, ncclRedOp_t op) {
    require_usable(phase);
    if (v.empty()) {
      checkpoint(phase);
      return;
    }
    auto* d = reinterpret_cast<std::uint64_t*>(sums_.reserve(v.size_bytes()));
    DTE_CUDA_TRY(cudaMemcpyAsync(d, v.data(), v.size_bytes(), cudaMemcpyHostToDevice, stream_));
    DTE_NCCL_TRY(ncclAllReduce(d, d, v.size(), ncclUint64, op, comm_, stream_));
    DTE_CUDA_TRY(cudaMemcpyAsync(v.data(), d, v.size_bytes(), cudaMemcpyDeviceToHost, stream_));
    complete(phase, two_round::peer_range(0, senders_ + receivers_));
  }

  void checkpoint(const char* phase) {
    require_usable(phase);
    auto* d = reinterpret_cast<std::uint64_t*>(sums_.reserve(8));
    DTE_CUDA_TRY(cudaMemsetAsync(d, 0, 8, stream_));
    DTE_NCCL_TRY(ncclAllReduce(d, d, 1, ncclUint64, ncclSum, comm_, stream_));
    complete(phase, two_round::peer_range(0, senders_ + receivers_));
  }

 private:
  void require_usable(const char* phase) const {
    if (comm_ == nullptr) {
      throw error(std::string("NcclTwoRound: rank ") + std::to_string(rank_) +
                  ": the communicator was aborted; it cannot be used for " + phase +
                  ": create a new transport");
    }
  }

  // Waits until a call in progress on the non-blocking communicator has been issued.
  void settle(const std::string& phase, const std::string& peers) {
    detail::NcclPhase p{&comm_, nullptr};
    watchdog_.wait(p, phase, peers);
  }

  // Waits until the phase's work on the stream has completed (and the communicator is healthy).
  void complete(const std::string& phase, const std::string& peers) {
    settle(phase, peers);
    DTE_CUDA_TRY(cudaEventRecord(event_.e, stream_));
    detail::NcclPhase p{&comm_, event_.e};
    watchdog_.wait(p, phase, peers);
  }

  int senders_, receivers_, rank_;
  NcclTwoRoundConfig config_;
  Watchdog watchdog_;
  exec::Stream stream_;
  detail::OwnedEvent event_;
  ncclComm_t comm_ = nullptr;
  detail::DeviceBytes counts_, payload_, sums_;
};

static_assert(transport<NcclTwoRound>);

}  // namespace dte
