// SPDX-License-Identifier: Apache-2.0
// The GPU benchmarks, one JSON report (bench/gpu/run.sh writes it under $OUT):
//   device        name, SMs, peak memory bandwidth from the device attributes, and the
//                 bandwidth of a device-to-device copy measured in the same run (the honest
//                 ceiling: what this GPU actually streams);
//   detect        the fused detect pass (theta, m, v read once; send bits written) over a flat
//                 AdamW shard: seconds, bytes/s, fraction of the copy bandwidth and of the peak;
//   publication   detect + compact + route + bucket (the publication's one synchronisation
//                 included), same shard and fractions;
//   apply         the receiver's check + scatter + digest of the publication's entries into a
//                 device BF16 tensor: entries/s;
//   end_to_end    a single-GPU sync of a Qwen3-shaped model (small-qwen3, trainer tp=1): a full
//                 publication, then deltas after optimizer steps, applied to device receiver
//                 tensors; seconds per delta and whether the receiver's digest equals the
//                 trainer's.
//   bench_gpu [--elements N] [--repeat R] [--out FILE]
// Without a device it writes {"device": null, "skipped": "no CUDA device"} and exits 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/detect/detect.hpp"
#include "dte/exec/cuda.cuh"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/device.cuh"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"

namespace {

using dte::exec::DeviceArray;
namespace dev = dte::pipeline::device;
using Json = nlohmann::json;

class Events {
 public:
  Events() {
    DTE_CUDA_TRY(cudaEventCreate(&a_));
    DTE_CUDA_TRY(cudaEventCreate(&b_));
  }
  ~Events() {
    (void)cudaEventDestroy(a_);
    (void)cudaEventDestroy(b_);
  }
  void start(cudaStream_t s) { DTE_CUDA_TRY(cudaEventRecord(a_, s)); }
  double stop(cudaStream_t s) {
    DTE_CUDA_TRY(cudaEventRecord(b_, s));
    DTE_CUDA_TRY(cudaEventSynchronize(b_));
    float ms = 0;
    DTE_CUDA_TRY(cudaEventElapsedTime(&ms, a_, b_));
    return ms * 1e-3;
  }

 private:
  cudaEvent_t a_{}, b_{};
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__device__ float hash_unit(std::uint64_t i, std::uint64_t salt) {
  std::uint64_t x = i * 0x9E3779B97F4A7C15ull + salt;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
}

// A plausible AdamW shard: weights ~ +-0.02, first moments ~ +-1e-3, second moments near m^2.
__global__ void make_shard(float* theta, float* m, float* v, std::size_t n) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    theta[i] = (hash_unit(i, 1) - 0.5f) * 0.04f;
    const float g = (hash_unit(i, 2) - 0.5f) * 2e-3f;
    m[i] = g;
    v[i] = g * g * (1.0f + 3.0f * hash_unit(i, 3)) + 1e-12f;
  }
}

Json device_info(double& copy_bps) {
  int device = 0;
  DTE_CUDA_TRY(cudaGetDevice(&device));
  cudaDeviceProp p{};
  DTE_CUDA_TRY(cudaGetDeviceProperties(&p, device));
  int clock_khz = 0, bus_bits = 0;
  DTE_CUDA_TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  DTE_CUDA_TRY(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  const double peak = 2.0 * clock_khz * 1e3 * bus_bits / 8.0;  // double data rate

  // A device-to-device copy: bytes read + bytes written per second.
  const std::size_t bytes = std::size_t{1} << 31;
  void *a = nullptr, *b = nullptr;
  DTE_CUDA_TRY(cudaMalloc(&a, bytes));
  DTE_CUDA_TRY(cudaMalloc(&b, bytes));
  DTE_CUDA_TRY(cudaMemset(a, 1, bytes));
  Events ev;
  std::vector<double> t;
  for (int r = 0; r < 6; ++r) {
    ev.start(nullptr);
    DTE_CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr));
    t.push_back(ev.stop(nullptr));
  }
  DTE_CUDA_TRY(cudaFree(a));
  DTE_CUDA_TRY(cudaFree(b));
  copy_bps = 2.0 * static_cast<double>(bytes) / median(t);
  return {{"name", p.name},
          {"compute_capability", std::to_string(p.major) + "." + std::to_string(p.minor)},
          {"sms", p.multiProcessorCount},
          {"memory_bytes", p.totalGlobalMem},
          {"peak_bandwidth_bytes_per_s", peak},
          {"copy_bandwidth_bytes_per_s", copy_bps},
          {"copy_command", "cudaMemcpyAsync device to device, 2 GiB, median of 6"}};
}

Json flat_shard(std::int64_t n, int repeat, double copy_bps, double peak_bps) {
  const dte::exec::Stream stream;
  const dte::exec::Cuda e(stream);
  DeviceArray<float> theta(e, static_cast<std::size_t>(n)), m(e, static_cast<std::size_t>(n)),
      v(e, static_cast<std::size_t>(n));
  make_shard<<<4096, 256, 0, stream>>>(theta.data(), m.data(), v.data(),
                                       static_cast<std::size_t>(n));
  DTE_CUDA_TRY(cudaGetLastError());
  // One segment, one run, one receiver copy.
  const std::vector<dte::layout::PlanSegment> segs = {{0, n, 0, 0, true}};
  const std::vector<dte::pipeline::Run> runs = {{0, n, 0, 0, 0, 0, 1, true}};
  const std::vector<dte::pipeline::RunTarget> targets = {{0, 0, 0}};
  const dte::pipeline::WorkTable work(runs, segs, dev::item_elements);
  const dev::DeviceTables tables(e, work, runs, targets, n);
  const auto weights = dev::buffer_weights(e, theta.data(), segs);
  dte::AdamHyperparameters h;
  h.lr = 1e-6;
  h.weight_decay = 0.1;
  h.step = 100;
  h.decay_form = dte::DecayForm::multiply;
  using Kernel = dte::AdamWInverse::kernel;
  const Kernel k = dte::AdamWInverse::bind_unchecked(
      h, {theta.data(), static_cast<std::size_t>(n)},
      {{m.data(), static_cast<std::size_t>(n)}, {v.data(), static_cast<std::size_t>(n)}}, "bench");
  const auto kernels = DeviceArray<Kernel>::copy_of(e, std::span<const Kernel>(&k, 1));
  DeviceArray<std::uint64_t> send(e, static_cast<std::size_t>((n + 63) / 64));

  Events ev;
  std::vector<double> detect_s, publication_s, apply_s;
  dev::DetectResult d;
  std::uint64_t entries = 0;
  DeviceArray<std::uint16_t> receiver(e, static_cast<std::size_t>(n));
  DTE_CUDA_TRY(cudaMemsetAsync(receiver.data(), 0, receiver.bytes(), stream));
  std::uint16_t* pointer = receiver.data();
  const std::uint64_t live = static_cast<std::uint64_t>(n);
  // The receiver holds the shard as one tensor: one source run over it.
  const std::vector<dte::pipeline::SourceRun> source = {
      {0, 0, static_cast<std::uint32_t>(std::min<std::int64_t>(n, 0xFFFFFFFFll)), 0, 0}};
  dev::DeviceReceiver<dte::exec::Cuda> rx;
  rx.tensors =
      DeviceArray<std::uint16_t*>::copy_of(e, std::span<std::uint16_t* const>(&pointer, 1));
  rx.live_end = DeviceArray<std::uint64_t>::copy_of(e, std::span<const std::uint64_t>(&live, 1));
  rx.sources = DeviceArray<dte::pipeline::SourceRun>::copy_of(e, source);
  rx.digest = DeviceArray<dte::Digest>::zeros(e, 1);
  rx.n_tensors = 1;
  rx.n_sources = 1;
  const auto plan = dte::pipeline::route_batches(runs, n, e.scratch_limit());
  dte::exec::PinnedBuffer staging;
  for (int r = 0; r < repeat + 1; ++r) {  // the first run warms up (module load, pool growth)
    const auto t0 = std::chrono::steady_clock::now();
    ev.start(stream);
    d = dev::detect<dte::BF16Detect>(e, tables, kernels.data(), weights.data(),
                                     dte::pipeline::ScanMode::detect, nullptr, send.data(), 1, 1);
    const double det = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // (routed to the host in the engine's batches, then uploaded as a receiver would get them)
    std::vector<std::uint32_t> tensor, index;
    std::vector<std::uint16_t> bits;
    (void)dev::route_and_bucket<dte::BF16Detect>(
        e, tables, weights.data(), send.data(), d, plan, staging, [&](const dev::BucketBatch& k) {
          tensor.insert(tensor.end(), k.tensor.begin(), k.tensor.end());
          index.insert(index.end(), k.index.begin(), k.index.end());
          bits.insert(bits.end(), k.bits.begin(), k.bits.end());
        });
    const double pub = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (void)ev.stop(stream);
    entries = bits.size();
    const auto dt = DeviceArray<std::uint32_t>::copy_of(e, tensor);
    const auto di = DeviceArray<std::uint32_t>::copy_of(e, index);
    const auto db = DeviceArray<std::uint16_t>::copy_of(e, bits);
    ev.start(stream);
    dev::apply_entries(e, rx, dt.data(), di.data(), db.data(), entries, false);
    const double app = ev.stop(stream);
    if (r == 0) continue;
    detect_s.push_back(det);
    publication_s.push_back(pub);
    apply_s.push_back(app);
  }
  // The kernel alone, without the readback: the bandwidth figure.
  std::vector<double> kernel_s;
  auto totals = DeviceArray<dev::DetectTotals>::zeros(e, 1);
  auto digest = DeviceArray<dte::Digest>::zeros(e, 1);
  auto per_receiver = DeviceArray<unsigned long long>::zeros(e, 1);
  using Body = dev::DetectItems<dte::BF16Detect, Kernel>;
  const Body body{tables.items.data(),
                  tables.n_items,
                  tables.runs.data(),
                  tables.targets.data(),
                  kernels.data(),
                  weights.data(),
                  dte::pipeline::ScanMode::detect,
                  nullptr,
                  send.data(),
                  totals.data(),
                  digest.data(),
                  per_receiver.data()};
  auto* const kernel = &dte::simt::device::each_warp<dev::block_threads, Body>;
  const unsigned grid = dte::cuda::detail::grid_blocks(
      kernel, std::uint64_t{tables.n_items} * dev::block_threads, dev::block_threads);
  for (int r = 0; r < repeat; ++r) {
    ev.start(stream);
    kernel<<<grid, dev::block_threads, 0, stream>>>(body);
    DTE_CUDA_TRY(cudaGetLastError());
    kernel_s.push_back(ev.stop(stream));
  }
  DTE_CUDA_TRY(cudaStreamSynchronize(stream));
  const double bytes = 12.0 * static_cast<double>(n) + static_cast<double>(n) / 8.0;
  const double kd = median(kernel_s), ds = median(detect_s), ps = median(publication_s),
               as = median(apply_s);
  Json out = {{"elements", n},
              {"changed", d.flagged},
              {"changed_fraction", static_cast<double>(d.flagged) / static_cast<double>(n)},
              {"guard", d.guard},
              {"entries", entries},
              {"detect_kernel",
               {{"seconds", kd},
                {"bytes_per_s", bytes / kd},
                {"of_copy_bandwidth", bytes / kd / copy_bps},
                {"of_peak_bandwidth", bytes / kd / peak_bps}}},
              {"detect_with_counts",
               {{"seconds", ds},
                {"bytes_per_s", bytes / ds},
                {"of_copy_bandwidth", bytes / ds / copy_bps}}},
              {"publication",
               {{"seconds", ps},
                {"elements_per_s", static_cast<double>(n) / ps},
                {"of_copy_bandwidth", bytes / ps / copy_bps}}},
              {"apply", {{"seconds", as}, {"entries_per_s", static_cast<double>(entries) / as}}},
              {"repeat", repeat},
              {"note",
               "medians; bytes = 12 per element read + 1 bit per element written; publication: "
               "detect, then compact, route and bucket in the engine's batches, each copied to "
               "pinned host memory; apply: the device scatter of entries already on the device"}};
  return out;
}

Json end_to_end(int deltas) {
  using namespace dte;
  const layout::HfModel hf(layout::model_preset("small-qwen3"));
  const auto train = layout::parse_train_topology("tp=1");
  const layout::ServingLayout recv(hf, layout::parse_infer_topology("tp=1"));
  sim::SyntheticTrainer trainer(hf, train, {.lr = 1e-5});
  const dte::exec::Stream stream;
  const exec::Cuda e(stream);
  dev::SenderPipeline<AdamWInverse, BF16Detect, layout::TransferPlan, exec::Cuda> sender(
      hf, train, recv, 0, false, e);
  sim::DeviceAdamWAccess access(trainer, 0, e);
  std::vector<DeviceArray<std::uint16_t>> tensors;
  std::vector<std::uint16_t*> pointers;
  std::vector<std::uint64_t> live;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    tensors.push_back(
        DeviceArray<std::uint16_t>::zeros(e, static_cast<std::size_t>(recv[k].numel)));
    pointers.push_back(tensors.back().data());
    live.push_back(static_cast<std::uint64_t>(recv.live_end(0, k)));
  }
  dev::DeviceReceiver<exec::Cuda> rx(e, pointers, live, pipeline::ReceiverSourceTable(hf, recv, 0),
                                     static_cast<std::size_t>(hf.size()));
  std::vector<double> seconds;
  bool digest_equal = true;
  std::uint64_t changed = 0;
  for (int p = 0; p <= deltas; ++p) {
    if (p > 0) {
      trainer.step();
      access.upload();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto found = sender.scan(
        access, p == 0 ? pipeline::ScanMode::all : pipeline::ScanMode::detect,
        [&](layout::BufferKind, const dev::BucketBatch& k) {  // (receiver 0's bucket, uploaded)
          if (k.count[0] == 0) return;
          const std::size_t at = k.offset[0], n = k.count[0];
          const auto tensor = DeviceArray<std::uint32_t>::copy_of(e, k.tensor.subspan(at, n));
          const auto index = DeviceArray<std::uint32_t>::copy_of(e, k.index.subspan(at, n));
          const auto bits = DeviceArray<std::uint16_t>::copy_of(e, k.bits.subspan(at, n));
          dev::apply_entries(e, rx, tensor.data(), index.data(), bits.data(), n, p == 0);
        });
    std::vector<Digest> trainer_digest(static_cast<std::size_t>(hf.size()), 0);
    for (const dev::DetectResult& o : found) {
      for (std::size_t t = 0; t < o.digest.size(); ++t)
        trainer_digest[t] += o.digest[t];
      if (p > 0) changed += o.flagged;
    }
    const auto got = rx.digest.to_host();  // synchronises: the sync is complete
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (p > 0) seconds.push_back(s);
    digest_equal = digest_equal && got == trainer_digest;
  }
  return {{"model", "small-qwen3"},
          {"elements", hf.total()},
          {"deltas", deltas},
          {"changed_per_delta", static_cast<double>(changed) / deltas},
          {"seconds_per_delta_median", median(seconds)},
          {"receiver_digest_equals_trainer", digest_equal}};
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t elements = std::int64_t{1} << 28;
  int repeat = 5;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--elements" && i + 1 < argc) {
      elements = std::atoll(argv[++i]);
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_gpu [--elements N] [--repeat R] [--out FILE]\n");
      return 2;
    }
  }
  Json report;
  int rc = 0;
  if (dte::cuda::device_count() == 0) {
    report = {{"device", nullptr}, {"skipped", "no CUDA device"}};
    std::printf("bench_gpu: no CUDA device, nothing measured (exit 77)\n");
    rc = 77;  // (as the gpu tests: skipped)
  } else {
    try {
      double copy_bps = 0;
      report["device"] = device_info(copy_bps);
      const double peak = report["device"]["peak_bandwidth_bytes_per_s"].get<double>();
      report["flat_adamw_shard"] = flat_shard(elements, repeat, copy_bps, peak);
      report["end_to_end"] = end_to_end(5);
    } catch (const std::exception& e) {
      report["error"] = e.what();
      rc = 1;
    }
  }
  const std::string text = report.dump(2);
  std::printf("%s\n", text.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << text << "\n";
  return rc;
}
