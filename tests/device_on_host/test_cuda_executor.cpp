// SPDX-License-Identifier: Apache-2.0
// exec/cuda_executor.hpp on the host, over the fake CUDA runtime of fake_cuda_runtime.hpp (no
// GPU, no libcudart): where the CUDA executor's scratch comes from (ctest -L device-on-host).
//   - a device with memory pools: dte's own pool, made once per device with a 1 GiB release
//     threshold (so a publication's scratch is reused, not re-allocated from the driver), every
//     allocation and free ordered on the executor's stream;
//   - a device without memory pools: plain cudaMalloc, and cudaFree only after the stream has
//     passed every use (a synchronisation first); no pool call at all;
//   - the caller's allocator (PyTorch's caching allocator in the binding): only it is called;
//   - DeviceArray and PinnedBuffer free what they hold, a failed allocation is a cuda_error
//     naming the call, and the scratch limit defaults to 256 MiB.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dte/exec/cuda_executor.hpp"
#include "fake_cuda_runtime.hpp"

namespace {

using Names = std::vector<std::string>;

}  // namespace

TEST_CASE("a device with memory pools: dte's own pool, 1 GiB kept, ordered on the stream") {
  const int device = fake_cuda::add_device(true);
  fake_cuda::reset();
  const dte::exec::Stream stream;
  const dte::exec::Cuda e(stream);
  void* p = e.allocate(1000);
  void* q = e.allocate(24);
  const fake_cuda::State& s = fake_cuda::state();
  // One pool for the device, pinned device memory on it, its release threshold 1 GiB.
  REQUIRE(s.of("cudaMemPoolCreate").size() == 1);
  CHECK(s.of("cudaMemPoolCreate")[0].bytes == static_cast<std::size_t>(device));
  CHECK(s.of("cudaMemPoolCreate")[0].value == cudaMemAllocationTypePinned);
  const void* pool = s.of("cudaMemPoolCreate")[0].pointer;
  REQUIRE(s.of("cudaMemPoolSetAttribute").size() == 1);
  CHECK(s.of("cudaMemPoolSetAttribute")[0].pointer == pool);
  CHECK(s.of("cudaMemPoolSetAttribute")[0].bytes == cudaMemPoolAttrReleaseThreshold);
  CHECK(s.of("cudaMemPoolSetAttribute")[0].value == dte::exec::pool_keep_bytes);
  CHECK(dte::exec::pool_keep_bytes == std::uint64_t{1} << 30);
  // Both allocations from it, on the executor's stream; nothing from cudaMalloc.
  const auto allocs = s.of("cudaMallocFromPoolAsync");
  REQUIRE(allocs.size() == 2);
  for (const fake_cuda::Call& c : allocs) {
    CHECK(c.pointer == pool);
    CHECK(c.stream == static_cast<cudaStream_t>(stream));
  }
  CHECK(allocs[0].bytes == 1000);
  CHECK(allocs[1].bytes == 24);
  CHECK(s.of("cudaMalloc").empty());
  e.deallocate(p, 1000);
  e.deallocate(q, 24);
  REQUIRE(s.of("cudaFreeAsync").size() == 2);
  CHECK(s.of("cudaFreeAsync")[0].pointer == p);
  CHECK(s.of("cudaFreeAsync")[0].stream == static_cast<cudaStream_t>(stream));
  CHECK(s.of("cudaStreamSynchronize").empty());  // (stream-ordered: no wait)
  CHECK(s.device_memory.empty());
  // A second executor on the same device reuses the pool.
  const dte::exec::Cuda other(stream);
  other.deallocate(other.allocate(8), 8);
  CHECK(s.of("cudaMemPoolCreate").size() == 1);
}

TEST_CASE("a device without memory pools: cudaMalloc, and cudaFree after the stream") {
  fake_cuda::add_device(false);
  fake_cuda::reset();
  const dte::exec::Stream stream;
  const dte::exec::Cuda e(stream);
  void* p = e.allocate(4096);
  const fake_cuda::State& s = fake_cuda::state();
  CHECK(s.of("cudaDeviceGetAttribute").size() == 1);  // (asked once, then cached)
  CHECK(s.of("cudaMemPoolCreate").empty());
  CHECK(s.of("cudaMallocFromPoolAsync").empty());
  REQUIRE(s.of("cudaMalloc").size() == 1);
  CHECK(s.of("cudaMalloc")[0].bytes == 4096);
  CHECK(s.of("cudaMalloc")[0].pointer == p);
  fake_cuda::state().calls.clear();
  e.deallocate(p, 4096);
  // The stream first (a kernel enqueued on it may still use p), then the free.
  CHECK(s.names() == Names{"cudaGetDevice", "cudaStreamSynchronize", "cudaFree"});
  CHECK(s.of("cudaStreamSynchronize")[0].stream == static_cast<cudaStream_t>(stream));
  CHECK(s.of("cudaFree")[0].pointer == p);
  CHECK(s.device_memory.empty());
  // DeviceArray takes the same path, and frees when it goes.
  fake_cuda::state().calls.clear();
  {
    const auto a = dte::exec::DeviceArray<std::uint32_t>::zeros(e, 100);
    CHECK(a.bytes() == 400);
    CHECK(s.of("cudaMalloc").size() == 1);
    CHECK(s.of("cudaMemsetAsync").size() == 1);
  }
  CHECK(s.of("cudaFree").size() == 1);
  CHECK(s.device_memory.empty());
  CHECK(s.of("cudaDeviceGetAttribute").empty());
}

TEST_CASE("the caller's allocator is the only one called; zero bytes allocate nothing") {
  fake_cuda::add_device(true);
  fake_cuda::reset();
  struct Counts {
    int allocated = 0, freed = 0;
  } counts;
  static std::byte arena[256];
  const dte::exec::CudaAllocator mine{
      [](std::size_t, cudaStream_t, void* c) -> void* {
        ++static_cast<Counts*>(c)->allocated;
        return arena;
      },
      [](void*, std::size_t, cudaStream_t, void* c) { ++static_cast<Counts*>(c)->freed; }, &counts};
  const dte::exec::Stream stream;
  const dte::exec::Cuda e(stream, mine);
  fake_cuda::state().calls.clear();
  void* p = e.allocate(64);
  CHECK(p == arena);
  e.deallocate(p, 64);
  CHECK(counts.allocated == 1);
  CHECK(counts.freed == 1);
  CHECK(fake_cuda::state().calls.empty());
  CHECK(e.allocate(0) == nullptr);
  e.deallocate(nullptr, 0);
  CHECK(counts.allocated == 1);
  CHECK(counts.freed == 1);
  // One that returns null is refused by name.
  const dte::exec::CudaAllocator none{
      [](std::size_t, cudaStream_t, void*) -> void* { return nullptr; },
      [](void*, std::size_t, cudaStream_t, void*) {}, nullptr};
  CHECK_THROWS_WITH_AS((void)dte::exec::Cuda(stream, none).allocate(8),
                       doctest::Contains("allocator returned null for 8 bytes"), dte::error);
}

TEST_CASE("a failed allocation is a cuda_error naming the call; pinned buffers free") {
  fake_cuda::add_device(true);
  fake_cuda::reset();
  const dte::exec::Stream stream;
  const dte::exec::Cuda e(stream);
  e.deallocate(e.allocate(8), 8);  // (the pool is made)
  fake_cuda::state().fail_next = "cudaMallocFromPoolAsync";
  try {
    (void)dte::exec::DeviceArray<float>(e, 1 << 20);
    FAIL("the failed allocation was not reported");
  } catch (const dte::cuda_error& err) {
    CHECK(err.code() == cudaErrorMemoryAllocation);
    CHECK(std::string(err.what()).find("cudaMallocFromPoolAsync") != std::string::npos);
    CHECK(std::string(err.what()).find("out of memory") != std::string::npos);
  }
  CHECK(fake_cuda::state().device_memory.empty());
  {
    dte::exec::PinnedBuffer b;
    std::byte* h = b.reserve(100);
    CHECK(b.reserve(50) == h);  // (grow-only)
    CHECK(b.reserve(200) != nullptr);
    CHECK(fake_cuda::state().of("cudaMallocHost").size() == 2);
    CHECK(fake_cuda::state().of("cudaFreeHost").size() == 1);
  }
  CHECK(fake_cuda::state().host_memory.empty());
}

TEST_CASE("the scratch limit: 256 MiB by default, set per executor") {
  const dte::exec::Cuda e;
  CHECK(e.scratch_limit() == dte::exec::default_scratch_limit);
  CHECK(dte::exec::default_scratch_limit == std::uint64_t{256} << 20);
  const dte::exec::Cuda small = e.with_scratch_limit(1 << 20);
  CHECK(small.scratch_limit() == 1u << 20);
  CHECK(e.scratch_limit() == dte::exec::default_scratch_limit);
  CHECK(small.stream() == e.stream());
}
