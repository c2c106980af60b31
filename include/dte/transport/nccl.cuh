// SPDX-License-Identifier: Apache-2.0
// NcclTwoRound: the two-round transport over NCCL on GPUs (transport/nccl_two_round.hpp holds the
// protocol, its phase order and its watchdog; this file gives it the real NCCL and CUDA calls).
// The communicator is created non-blocking (ncclCommInitRankConfig, blocking = 0). MPI or
// anything else only passes the ncclUniqueId (examples/nccl_sync.cu). An engine over this
// transport runs on exec::Cuda by default (default_executor):
// DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, NcclTwoRound> reads device-resident
// optimizer state and writes device-resident receiver tensors.
#pragma once

#if !defined(__CUDACC__)
#error "dte/transport/nccl.cuh needs nvcc: link dte::nccl"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <string>

#include "dte/concepts.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/transport/nccl_two_round.hpp"

namespace dte {
namespace detail {

// The NCCL and CUDA calls of BasicNcclTwoRound (concept nccl_runtime), on the current device.
struct NcclRuntime {
  using comm_type = ncclComm_t;
  using stream_type = cudaStream_t;
  using event_type = cudaEvent_t;
  using unique_id = ncclUniqueId;

  ncclResult_t init(ncclComm_t& comm, int ranks, const ncclUniqueId& id, int rank) const {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclUniqueId copy = id;
    return ncclCommInitRankConfig(&comm, ranks, copy, rank, &cfg);
  }
  ncclResult_t async_error(ncclComm_t comm, ncclResult_t* state) const {
    return ncclCommGetAsyncError(comm, state);
  }
  std::string last_error(ncclComm_t comm) const { return ncclGetLastError(comm); }
  std::string error_string(ncclResult_t r) const { return ncclGetErrorString(r); }
  ncclResult_t finalize(ncclComm_t comm) const { return ncclCommFinalize(comm); }
  ncclResult_t destroy(ncclComm_t comm) const { return ncclCommDestroy(comm); }
  ncclResult_t abort(ncclComm_t comm) const { return ncclCommAbort(comm); }
  ncclResult_t group_start() const { return ncclGroupStart(); }
  ncclResult_t group_end() const { return ncclGroupEnd(); }
  ncclResult_t send(const void* p, std::size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                    cudaStream_t s) const {
    return ncclSend(p, n, t, peer, comm, s);
  }
  ncclResult_t recv(void* p, std::size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                    cudaStream_t s) const {
    return ncclRecv(p, n, t, peer, comm, s);
  }
  ncclResult_t all_reduce(const void* in, void* out, std::size_t n, ncclDataType_t t,
                          ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) const {
    return ncclAllReduce(in, out, n, t, op, comm, s);
  }
  cudaStream_t create_stream() const {
    cudaStream_t s = nullptr;
    DTE_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }
  void destroy_stream(cudaStream_t s) const noexcept { (void)cudaStreamDestroy(s); }
  cudaEvent_t create_event() const {
    cudaEvent_t e = nullptr;
    DTE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void destroy_event(cudaEvent_t e) const noexcept { (void)cudaEventDestroy(e); }
  void record(cudaEvent_t e, cudaStream_t s) const { DTE_CUDA_TRY(cudaEventRecord(e, s)); }
  bool query(cudaEvent_t e) const {
    const cudaError_t status = cudaEventQuery(e);
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) return false;
    DTE_CUDA_TRY(status);
    return false;
  }
  void synchronize(cudaStream_t s) const { DTE_CUDA_TRY(cudaStreamSynchronize(s)); }
  void* device_alloc(std::size_t n) const {
    void* p = nullptr;
    DTE_CUDA_TRY(cudaMalloc(&p, n));
    return p;
  }
  void device_free(void* p) const noexcept { (void)cudaFree(p); }
  void copy_async(void* dst, const void* src, std::size_t n, cudaStream_t s) const {
    DTE_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
  }
  void memset_async(void* p, int value, std::size_t n, cudaStream_t s) const {
    DTE_CUDA_TRY(cudaMemsetAsync(p, value, n, s));
  }
};
static_assert(nccl_runtime<NcclRuntime>);

}  // namespace detail

class NcclTwoRound : public BasicNcclTwoRound<detail::NcclRuntime> {
 public:
  // DeltaEngine<..., NcclTwoRound> runs on the CUDA executor unless told otherwise: the
  // trainer's state and the receivers' tensors are device memory (DeviceTensors).
  using default_executor = exec::Cuda;

  // A unique id for a new world: made by one rank, passed to all (MPI_Bcast, a file, a store).
  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    const ncclResult_t status = ncclGetUniqueId(&id);
    if (status != ncclSuccess) {
      throw nccl_error(status, std::string("NCCL error ") + ncclGetErrorString(status) +
                                   " from ncclGetUniqueId (NCCL_DEBUG=WARN says why)");
    }
    return id;
  }

  // Joins the world of senders + receivers ranks as `rank`, on the current CUDA device (call
  // cudaSetDevice first; one device per rank). Blocks until every rank has joined or the
  // deadline passes.
  NcclTwoRound(const ncclUniqueId& id, int rank, int senders, int receivers,
               NcclTwoRoundConfig config = {})
      : BasicNcclTwoRound(detail::NcclRuntime{}, id, rank, senders, receivers, config) {}
};

static_assert(transport<NcclTwoRound>);

}  // namespace dte
