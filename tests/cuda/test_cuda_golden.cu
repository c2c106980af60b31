// SPDX-License-Identifier: Apache-2.0
// The golden suite (tests/golden/golden.hpp) over the engine on CUDA: one
// DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, ..., exec::Cuda> per rank of a loopback
// world (tests/device_on_host/engine_world.hpp, the harness the host twin's suite runs), every
// rank on its own thread and its own stream; each trainer rank reads its optimizer state from
// device memory (sim/device_access.cuh, uploaded after every step), each receiver rank commits
// into its own device tensors (engine/device_receiver.cuh; engine_backend.cuh). After every
// publication each receiver's tensors are copied to the host and compared with the dense
// reference (sim/dense_check.hpp: the trainer's canonical FP32 weights through the layout's
// inverse map, never the plan, the routing or the receiver core), and every report must be
// verified without a repair or resync. 3 topology pairs x K in {1, 3}, a full publication
// forced halfway, the steps left flushed; then one element flipped on the device must be the one
// mismatch the check finds. Runs only on a GPU (exit 77 otherwise).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "../device_on_host/engine_world.hpp"
#include "dte/exec/cuda.cuh"
#include "engine_backend.cuh"

constexpr int kSkipCode = 77;

// Inside namespace dte, not `using namespace dte` at global scope: nvcc's generated stubs name
// ::cuda::std, which dte::cuda would make ambiguous.
namespace dte {
namespace {

TEST_CASE("golden: DeltaEngine on exec::Cuda (device optimizer state, device receivers)") {
  dte_test::golden_suite<dte_test::CudaBackend>();
}

}  // namespace
}  // namespace dte

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  if (dte::cuda::device_count() == 0) {
    std::printf("no CUDA device: skipped (exit %d)\n", kSkipCode);
    return kSkipCode;
  }
  return context.run();
}
