// SPDX-License-Identifier: Apache-2.0
// The CUDA executor and its memory, host code over the CUDA runtime API (no kernels, so any C++
// compiler builds it; exec/cuda.cuh adds the kernels): status checking (dte::cuda_error,
// DTE_CUDA_TRY), device discovery (cuda::device_count), where scratch comes from (CudaAllocator:
// dte's stream-ordered pool per device, plain cudaMalloc where the device has no pools, or the
// caller's), the executor (exec::Cuda: a stream, an allocator, a scratch limit), its RAII device
// arrays and pinned host buffers. tests/exec/test_cuda_executor.cpp runs it over a fake CUDA
// runtime on the host (the pool, its release threshold, the fallback without pools).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/exec/device_array.hpp"
#include "dte/exec/serial_host_work.hpp"

namespace dte {

// A CUDA runtime call failed. code() is the status it returned; what() names it, the call and
// the place in dte or in the caller that checked it.
class cuda_error : public error {
 public:
  explicit cuda_error(cudaError_t code, const std::string& message,
                      source_location where = source_location::current())
      : error(message, where), code_(code) {}

  [[nodiscard]] cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* expression,
                                          source_location where) {
  // A non-sticky error stays recorded until read; read it here so that the next check does not
  // report this failure a second time. A sticky one (the context is lost) cannot be cleared.
  (void)cudaGetLastError();
  std::string message = std::string("CUDA error ") + cudaGetErrorName(status) + " (" +
                        cudaGetErrorString(status) + ") from `" + expression + "` at " +
                        where.file_name() + ":" + std::to_string(where.line());
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    message += "; no usable GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES";
  } else if (status == cudaErrorIllegalAddress || status == cudaErrorLaunchFailure) {
    message +=
        "; a kernel read or wrote memory it may not (a host pointer passed as a device pointer?) "
        "and the CUDA context is lost: restart the process";
  }
  throw cuda_error(status, message, where);
}

}  // namespace detail
}  // namespace dte

// Evaluates a CUDA runtime call once and throws dte::cuda_error unless it returned cudaSuccess.
#define DTE_CUDA_TRY(expr)                                                \
  do {                                                                    \
    const ::cudaError_t dte_cuda_try_status_ = (expr);                    \
    if (dte_cuda_try_status_ != ::cudaSuccess) {                          \
      ::dte::detail::throw_cuda_error(dte_cuda_try_status_, #expr,        \
                                      ::dte::source_location::current()); \
    }                                                                     \
  } while (false)

namespace dte::exec {

// Where the CUDA executor takes temporary device memory from. The default (null functions) is
// dte's stream-ordered pool of the current device (detail::device_pool: cudaMallocFromPoolAsync
// and cudaFreeAsync on the executor's stream), or plain() on a device without memory pools. A
// trainer with its own caching allocator (PyTorch's) passes functions that allocate from it.
struct CudaAllocator {
  void* (*allocate)(std::size_t bytes, cudaStream_t stream, void* context) = nullptr;
  void (*deallocate)(void* p, std::size_t bytes, cudaStream_t stream, void* context) = nullptr;
  void* context = nullptr;

  // cudaMalloc, and cudaFree once the stream has passed every use (it synchronises the stream
  // first): what a device without stream-ordered memory pools gets.
  static CudaAllocator plain() noexcept { return {plain_allocate, plain_deallocate, nullptr}; }

 private:
  static void* plain_allocate(std::size_t bytes, cudaStream_t, void*) {
    void* p = nullptr;
    DTE_CUDA_TRY(cudaMalloc(&p, bytes));
    return p;
  }
  static void plain_deallocate(void* p, std::size_t, cudaStream_t stream, void*) {
    (void)cudaStreamSynchronize(stream);
    (void)cudaFree(p);
  }
};

// How much freed memory dte's pool keeps reserved for the next publication instead of returning
// it to the driver (its release threshold): the scratch of a publication is then reused, not
// re-allocated from the driver each time; above it, memory goes back at the next
// synchronisation (cudaMemPoolTrimTo on detail::device_pool().pool returns all of it).
inline constexpr std::uint64_t pool_keep_bytes = std::uint64_t{1} << 30;

namespace detail {

// dte's stream-ordered memory pool on the current device, made at the first use: null where the
// device has no memory pools (cudaDevAttrMemoryPoolsSupported; some virtualised and older
// devices), which then allocate with CudaAllocator::plain(). Its own pool, not the device's
// default one, so the release threshold set here changes nothing for other users of the device.
inline cudaMemPool_t device_pool() {
  static std::mutex guard;
  static std::vector<std::pair<bool, cudaMemPool_t>> pools;  // per device: (made, pool)
  int device = 0;
  DTE_CUDA_TRY(cudaGetDevice(&device));
  const std::lock_guard lock(guard);
  if (pools.size() <= static_cast<std::size_t>(device)) {
    pools.resize(static_cast<std::size_t>(device) + 1, {false, nullptr});
  }
  auto& [made, pool] = pools[static_cast<std::size_t>(device)];
  if (!made) {
    int supported = 0;
    DTE_CUDA_TRY(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    if (supported != 0) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      DTE_CUDA_TRY(cudaMemPoolCreate(&pool, &props));
      std::uint64_t keep = pool_keep_bytes;
      DTE_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
    made = true;
  }
  return pool;
}

}  // namespace detail

// A non-blocking CUDA stream owned for its lifetime; converts to cudaStream_t.
class Stream {
 public:
  Stream() { DTE_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const noexcept { return stream_; }  // NOLINT: a handle

 private:
  cudaStream_t stream_{};
};

// The bound on the scratch a publication's routing holds at once, by default: 256 MiB.
inline constexpr std::uint64_t default_scratch_limit = 256ull << 20;

// The CUDA executor: the pipeline's device stages (pipeline/device_stages.hpp) run on its stream,
// in order, and take their scratch from its allocator. The executor concept's host primitives
// (for_each, for_each_ordered, exclusive_scan) run on the calling thread (SerialHostWork): on this
// backend they carry only per-tensor and per-receiver bookkeeping, never per-element work.
class Cuda : public detail::SerialHostWork {
 public:
  using executor_tag = void;

  // The legacy default stream and the stream-ordered pool.
  Cuda() noexcept = default;
  explicit Cuda(cudaStream_t stream, CudaAllocator allocator = {}) noexcept
      : stream_(stream), allocator_(allocator) {}

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  // The device memory a sender's routing may hold at once (pipeline/route_batches.hpp: a shard
  // is routed in batches that fit it). Read when the sender is built.
  [[nodiscard]] std::uint64_t scratch_limit() const noexcept { return scratch_limit_; }
  [[nodiscard]] Cuda with_scratch_limit(std::uint64_t bytes) const noexcept {
    Cuda c = *this;
    c.scratch_limit_ = bytes;
    return c;
  }

  // Temporary device memory, ordered on the stream (usable by work enqueued after this call).
  [[nodiscard]] void* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    if (allocator_.allocate != nullptr) {
      void* p = allocator_.allocate(bytes, stream_, allocator_.context);
      if (p == nullptr) {
        throw error("dte::exec::Cuda: the caller's allocator returned null for " +
                    std::to_string(bytes) + " bytes");
      }
      return p;
    }
    const cudaMemPool_t pool = detail::device_pool();
    if (pool == nullptr) return CudaAllocator::plain().allocate(bytes, stream_, nullptr);
    void* p = nullptr;
    DTE_CUDA_TRY(cudaMallocFromPoolAsync(&p, bytes, pool, stream_));
    return p;
  }
  void deallocate(void* p, std::size_t bytes) const noexcept {
    if (p == nullptr) return;
    if (allocator_.deallocate != nullptr) {
      allocator_.deallocate(p, bytes, stream_, allocator_.context);
      return;
    }
    cudaMemPool_t pool = nullptr;
    try {
      pool = detail::device_pool();  // (made by the allocation that returned p)
    } catch (...) {
    }
    if (pool == nullptr) {
      CudaAllocator::plain().deallocate(p, bytes, stream_, nullptr);
    } else {
      (void)cudaFreeAsync(p, stream_);
    }
  }
  void synchronize() const { DTE_CUDA_TRY(cudaStreamSynchronize(stream_)); }

  // Copies and fills, enqueued on the stream. A copy into or out of pageable host memory
  // completes before it returns (CUDA's rule); into pinned memory it is truly asynchronous: read
  // it after synchronize().
  void upload(void* device, const void* host, std::size_t bytes) const {
    DTE_CUDA_TRY(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void download(void* host, const void* device, std::size_t bytes) const {
    DTE_CUDA_TRY(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  void fill(void* device, int byte, std::size_t bytes) const {
    DTE_CUDA_TRY(cudaMemsetAsync(device, byte, bytes, stream_));
  }

 private:
  cudaStream_t stream_ = nullptr;
  CudaAllocator allocator_{};
  std::uint64_t scratch_limit_ = default_scratch_limit;
};

static_assert(executor<Cuda>);

// n elements of T in device memory from an executor's allocator, freed on its stream (also when
// an exception unwinds). Move-only (exec/device_array.hpp).
template <class T>
using DeviceArray = BasicDeviceArray<Cuda, T>;

// Grow-only page-locked host memory: device-to-host copies into it are truly asynchronous, so
// several can be enqueued and waited for with one synchronisation.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~PinnedBuffer() { release(); }

  // At least `bytes` of pinned memory (the old contents are not kept).
  std::byte* reserve(std::size_t bytes) {
    if (bytes > size_) {
      release();
      DTE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&ptr_), bytes));
      size_ = bytes;
    }
    return ptr_;
  }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }
  std::byte* ptr_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace dte::exec

namespace dte::cuda {

// The number of CUDA devices this process can use; 0 when there is none or no driver. Never
// throws. It reads the error the failed query recorded; without a driver the runtime keeps
// reporting cudaErrorInsufficientDriver to every later call regardless.
inline int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace dte::cuda
