// SPDX-License-Identifier: Apache-2.0
// publication::Publisher on exec::Cuda (publication/device_sender.cuh) against the host
// publisher, byte for byte: the cases of tests/publication/device_publisher_cases.hpp (the host
// twin runs the same in CI) with the trainer's state copied to GPU memory. Runs only on a GPU
// (exit 77 otherwise).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>

#include "device_publisher_cases.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/pipeline/device.cuh"
#include "dte/publication/device_sender.cuh"

namespace {

constexpr int kSkipCode = 77;

namespace cases = dte_test::device_publisher;

// The trainer's state in GPU memory.
struct Cuda {
  using E = dte::exec::Cuda;
  static E executor() { return E{}; }
  static void to_device(const E&, void* device, const void* host, std::size_t bytes) {
    DTE_CUDA_TRY(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  }
};

}  // namespace

TEST_CASE("device publisher: one writer's messages are the host's, byte for byte") {
  cases::one_writer_cases<Cuda>();
}

TEST_CASE("device publisher: every writer's part is the host's, pieces read where they live") {
  cases::writer_cases<Cuda>();
}

TEST_CASE("device publisher: the batches of changed elements do not depend on their size") {
  cases::batches<Cuda>();
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipped (exit %d)\n", kSkipCode);
    return kSkipCode;
  }
  return context.run();
}
