// SPDX-License-Identifier: Apache-2.0
// The publisher of dte.TorchPublisher over CUDA tensors (python/src/publisher.hpp over
// exec::Cuda: publication/device_sender.cuh). Compiled by nvcc into dte._native when the package
// is built where nvcc is found (python/CMakeLists.txt); native.cpp calls only the functions of
// cuda_publisher.hpp, so the rest of the binding never sees CUDA.
//
// Streams: the publisher works on its own non-blocking stream on the tensors' device, and each
// call first makes that stream wait for the caller's (the stream torch ran the optimizer step
// on: an event, no host synchronisation); it has synchronised its own stream before it returns,
// so the next optimizer step may write the tensors as soon as the call is back. Temporary device
// memory comes from CUDA's stream-ordered pool, apart from torch's caching allocator.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda_publisher.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/publication/device_sender.cuh"
#include "publisher.hpp"

namespace dte::python {
namespace {

// Selects a device for its lifetime, then the one that was current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    DTE_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device) DTE_CUDA_TRY(cudaSetDevice(device));
  }
  ~DeviceScope() { (void)cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// A publisher's place on one device: its stream (created there), an event to wait for the
// caller's stream, and zeros for slots without optimizer state.
class DeviceMemory {
 public:
  using executor = exec::Cuda;
  using Scope = DeviceScope;

  explicit DeviceMemory(int device) : device_(device) {
    const DeviceScope scope(device);
    stream_ = std::make_unique<exec::Stream>();
    DTE_CUDA_TRY(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  }
  ~DeviceMemory() {
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  [[nodiscard]] executor exec() const { return exec::Cuda(*stream_); }

  // (guaranteed elision: the scope is built in place in the caller)
  [[nodiscard]] DeviceScope enter() const { return DeviceScope(device_); }

  void wait_for(std::uintptr_t caller) {
    DTE_CUDA_TRY(cudaEventRecord(ready_, reinterpret_cast<cudaStream_t>(caller)));
    DTE_CUDA_TRY(cudaStreamWaitEvent(*stream_, ready_, 0));
  }

  // n zeros on the device; the same n every call (the largest slot's).
  const float* zeros(std::size_t n) {
    if (zero_.size() < n) zero_ = exec::DeviceArray<float>::zeros(exec(), n);
    return zero_.data();
  }

 private:
  int device_;
  std::unique_ptr<exec::Stream> stream_;
  cudaEvent_t ready_ = nullptr;
  exec::DeviceArray<float> zero_;  // (freed on the stream, before it is destroyed)
};

}  // namespace

std::unique_ptr<AnyPublisher> make_cuda_publisher(const std::string& kind,
                                                  const PublisherArgs& args, int device) {
  const int devices = dte::cuda::device_count();
  if (device < 0 || device >= devices) {
    throw unsupported("dte: the tensors are on CUDA device " + std::to_string(device) +
                      " but this process sees " + std::to_string(devices) +
                      " CUDA device(s) (check CUDA_VISIBLE_DEVICES and the driver)");
  }
  const DeviceScope scope(device);  // the tables and masks are allocated there
  return make_publisher<DeviceMemory>(kind, args, device);
}

int cuda_devices() noexcept {
  return dte::cuda::device_count();
}

}  // namespace dte::python
