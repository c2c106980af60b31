// SPDX-License-Identifier: Apache-2.0
// A fake CUDA runtime for exec/cuda_executor.hpp's host code: the runtime API calls it makes,
// defined here (test_cuda_executor links this instead of libcudart), over host memory, with
// two devices: device 0 has stream-ordered memory pools, device 1 has none (as on some
// virtualised and older GPUs). Every call is logged, so a test sees which allocation path the
// executor took, on which stream, and in which order. fail_next makes the next call of a name
// return an error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace fake_cuda {

struct Call {
  std::string name;
  const void* pointer = nullptr;  // the memory, pool or stream it concerns
  std::size_t bytes = 0;
  const void* stream = nullptr;
  std::uint64_t value = 0;  // cudaMemPoolSetAttribute's value
};

struct State {
  int device = 0;                             // cudaGetDevice's answer
  std::vector<int> pools_supported = {1, 0};  // per device
  std::vector<Call> calls;                    // every call, in order
  std::map<const void*, std::size_t> device_memory, host_memory;
  int pools_made = 0;
  std::string fail_next;  // the next call of this name fails
  cudaError_t fail_with = cudaErrorMemoryAllocation;
  cudaError_t last_error = cudaSuccess;

  // The calls named `name`, in order.
  [[nodiscard]] std::vector<Call> of(const std::string& name) const {
    std::vector<Call> out;
    for (const Call& c : calls) {
      if (c.name == name) out.push_back(c);
    }
    return out;
  }
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const Call& c : calls)
      out.push_back(c.name);
    return out;
  }
};

// The one state (reset() between cases; dte's pool cache is per process, so each case that needs
// a fresh pool uses a device it has not used yet: see add_device).
State& state();
void reset();
// A new device (returned: its ordinal) with or without memory pools, made current.
int add_device(bool pools);

}  // namespace fake_cuda
