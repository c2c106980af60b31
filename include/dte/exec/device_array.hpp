// SPDX-License-Identifier: Apache-2.0
// exec::BasicDeviceArray<E, T>: n elements of T in a device executor's memory (concepts.hpp:
// device_memory), taken from E's allocator and given back to it when the array goes (also when an
// exception unwinds). Move-only. exec::DeviceArray<T> is the one of exec::Cuda (its memory on the
// executor's stream, exec/cuda_executor.hpp); the host twin's (dte/sim/simt_host.hpp) is the
// same class over the process's own memory. exec::read: a synchronous device-to-host copy.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"

namespace dte::exec {

// bytes from device memory into host memory, once E has passed everything enqueued before.
template <device_memory E>
void read(const E& e, void* host, const void* device, std::size_t bytes) {
  e.download(host, device, bytes);
  e.synchronize();
}

template <device_memory E, class T>
class BasicDeviceArray {
  static_assert(std::is_trivially_copyable_v<T>, "device arrays hold trivially copyable values");

 public:
  BasicDeviceArray() = default;
  // Uninitialised (device memory is not zeroed).
  BasicDeviceArray(const E& exec, std::size_t n)
      : exec_(exec),
        n_(n),
        ptr_(static_cast<T*>(static_cast<void*>(exec.allocate(n * sizeof(T))))) {}
  BasicDeviceArray(BasicDeviceArray&& o) noexcept
      : exec_(o.exec_), n_(std::exchange(o.n_, 0)), ptr_(std::exchange(o.ptr_, nullptr)) {}
  BasicDeviceArray& operator=(BasicDeviceArray&& o) noexcept {
    if (this != &o) {
      reset();
      exec_ = o.exec_;
      n_ = std::exchange(o.n_, 0);
      ptr_ = std::exchange(o.ptr_, nullptr);
    }
    return *this;
  }
  ~BasicDeviceArray() { reset(); }

  // A device copy of host data, enqueued (on exec::Cuda: `host` must stay alive until the stream
  // passes the copy, or be pinned; a copy from pageable memory completes before it returns).
  static BasicDeviceArray copy_of(const E& exec, std::span<const T> host) {
    BasicDeviceArray a(exec, host.size());
    if (!host.empty()) exec.upload(a.ptr_, host.data(), host.size_bytes());
    return a;
  }
  // Zero-filled (enqueued).
  static BasicDeviceArray zeros(const E& exec, std::size_t n) {
    BasicDeviceArray a(exec, n);
    if (n != 0) exec.fill(a.ptr_, 0, n * sizeof(T));
    return a;
  }

  [[nodiscard]] T* data() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return n_ * sizeof(T); }

  // Its contents, copied to the host (synchronises the executor).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(n_);
    if (n_ != 0) read(exec_, out.data(), ptr_, bytes());
    return out;
  }

 private:
  void reset() noexcept {
    if (ptr_ != nullptr) exec_.deallocate(ptr_, bytes());
    ptr_ = nullptr;
    n_ = 0;
  }
  E exec_{};
  std::size_t n_ = 0;
  T* ptr_ = nullptr;
};

}  // namespace dte::exec
