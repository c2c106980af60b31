// SPDX-License-Identifier: Apache-2.0
// The fake CUDA runtime of fake_cuda_runtime.hpp: the runtime API calls exec/cuda_executor.hpp
// makes, over host memory. Copies and fills run at once (the fake stream is always idle).
#include "fake_cuda_runtime.hpp"

#include <cstdlib>
#include <cstring>

namespace fake_cuda {

State& state() {
  static State s;
  return s;
}

void reset() {
  State& s = state();
  const std::vector<int> devices = s.pools_supported;
  const int device = s.device;
  s = State{};
  s.pools_supported = devices;  // (devices, once made, stay: dte caches its pool per device)
  s.device = device;
}

int add_device(bool pools) {
  State& s = state();
  s.pools_supported.push_back(pools ? 1 : 0);
  s.device = static_cast<int>(s.pools_supported.size()) - 1;
  return s.device;
}

namespace {

cudaError_t call(const char* name, const void* pointer = nullptr, std::size_t bytes = 0,
                 const void* stream = nullptr, std::uint64_t value = 0) {
  State& s = state();
  s.calls.push_back({name, pointer, bytes, stream, value});
  if (s.fail_next == name) {
    s.fail_next.clear();
    s.last_error = s.fail_with;
    return s.fail_with;
  }
  return cudaSuccess;
}

// Host memory standing in for device or pinned memory, held in `in` until released.
void* hold(std::map<const void*, std::size_t>& in, std::size_t size) {
  void* p = std::malloc(size);
  in[p] = size;
  state().calls.back().pointer = p;
  return p;
}
void release(std::map<const void*, std::size_t>& in, void* p) {
  in.erase(p);
  std::free(p);
}

// Pool handles: addresses of these (never dereferenced by the runtime's callers).
int pool_storage[64];

}  // namespace
}  // namespace fake_cuda

using fake_cuda::call;
using fake_cuda::state;

extern "C" {

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  *device = state().device;
  return call("cudaGetDevice");
}

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  *count = static_cast<int>(state().pools_supported.size());
  return call("cudaGetDeviceCount");
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  *value = 0;
  if (attr == cudaDevAttrMemoryPoolsSupported) {
    *value = state().pools_supported.at(static_cast<std::size_t>(device));
  }
  return call("cudaDeviceGetAttribute", nullptr, static_cast<std::size_t>(attr));
}

cudaError_t CUDARTAPI cudaMemPoolCreate(cudaMemPool_t* pool, const struct cudaMemPoolProps* props) {
  fake_cuda::State& s = state();
  const cudaError_t rc =
      call("cudaMemPoolCreate", nullptr, static_cast<std::size_t>(props->location.id), nullptr,
           static_cast<std::uint64_t>(props->allocType));
  if (rc != cudaSuccess) return rc;
  *pool = reinterpret_cast<cudaMemPool_t>(&fake_cuda::pool_storage[s.pools_made++ % 64]);
  s.calls.back().pointer = *pool;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr,
                                              void* value) {
  std::uint64_t v = 0;
  if (attr == cudaMemPoolAttrReleaseThreshold) std::memcpy(&v, value, 8);
  return call("cudaMemPoolSetAttribute", pool, static_cast<std::size_t>(attr), nullptr, v);
}

cudaError_t CUDARTAPI cudaMallocFromPoolAsync(void** p, size_t size, cudaMemPool_t pool,
                                              cudaStream_t stream) {
  const cudaError_t rc = call("cudaMallocFromPoolAsync", pool, size, stream);
  if (rc != cudaSuccess) return rc;
  *p = fake_cuda::hold(state().device_memory, size);
  state().calls.back().pointer = pool;  // (the pool it came from)
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFreeAsync(void* p, cudaStream_t stream) {
  const cudaError_t rc = call("cudaFreeAsync", p, 0, stream);
  fake_cuda::release(state().device_memory, p);
  return rc;
}

cudaError_t CUDARTAPI cudaMalloc(void** p, size_t size) {
  const cudaError_t rc = call("cudaMalloc", nullptr, size);
  if (rc != cudaSuccess) return rc;
  *p = fake_cuda::hold(state().device_memory, size);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFree(void* p) {
  const cudaError_t rc = call("cudaFree", p);
  fake_cuda::release(state().device_memory, p);
  return rc;
}

cudaError_t CUDARTAPI cudaMallocHost(void** p, size_t size) {
  const cudaError_t rc = call("cudaMallocHost", nullptr, size);
  if (rc != cudaSuccess) return rc;
  *p = fake_cuda::hold(state().host_memory, size);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  const cudaError_t rc = call("cudaFreeHost", p);
  fake_cuda::release(state().host_memory, p);
  return rc;
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind,
                                      cudaStream_t stream) {
  if (n != 0) std::memcpy(dst, src, n);
  return call("cudaMemcpyAsync", dst, n, stream);
}

cudaError_t CUDARTAPI cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t stream) {
  if (n != 0) std::memset(p, value, n);
  return call("cudaMemsetAsync", p, n, stream);
}

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  static int streams[64];
  static int made = 0;
  *stream = reinterpret_cast<cudaStream_t>(&streams[made++ % 64]);
  return call("cudaStreamCreateWithFlags", *stream);
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  return call("cudaStreamDestroy", stream);
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  return call("cudaStreamSynchronize", nullptr, 0, stream);
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t e = state().last_error;
  state().last_error = cudaSuccess;
  return e;
}

const char* CUDARTAPI cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation" : "cudaErrorUnknown";
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? "out of memory" : "unknown error";
}

}  // extern "C"
