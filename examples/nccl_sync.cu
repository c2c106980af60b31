// SPDX-License-Identifier: Apache-2.0
// One idea: the composition the product is named for, over NCCL, one process per GPU:
//   mpirun -np 4 ./example_nccl_sync          (2 trainer ranks, 2 receiver ranks, 4 GPUs)
// The trainer's weights and AdamW state are device memory (here a synthetic trainer copied to
// the GPU after each step; a real trainer passes its own tensors), and so are the receivers'
// BF16 weights: the engine runs on the CUDA executor, NcclTwoRound's default. MPI only starts
// the processes and passes the NCCL unique id; every byte of every publication, every sum and
// every barrier goes through NcclTwoRound, whose watchdog turns a dead or stalled peer into an
// error naming the phase instead of a hang.
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/device_access.cuh"
#include "dte/sim/synthetic_trainer.hpp"
#include "dte/transport/nccl.cuh"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int world = 0, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  int status = 0;
  try {
    // One GPU per process: the processes on this node take its devices in turn.
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &node);
    int local = 0, local_size = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    const int devices = dte::cuda::device_count();
    int enough = world >= 2 && devices >= local_size ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &enough, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (enough == 0) {
      if (me == 0) {
        std::printf(
            "example_nccl_sync needs at least 2 processes and a GPU for each (rank 0's "
            "node runs %d processes on %d GPUs): skipped\n",
            local_size, devices);
      }
      MPI_Finalize();
      return 77;
    }
    DTE_CUDA_TRY(cudaSetDevice(local));
    ncclUniqueId id{};
    if (me == 0) id = dte::NcclTwoRound::unique_id();
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);

    using namespace dte;
    const int senders = world / 2, receivers_n = world - senders;
    const layout::HfModel model(layout::model_preset("tiny-qwen3"));
    const layout::TrainTopology train =
        layout::parse_train_topology("tp=1,dp=" + std::to_string(senders));
    const layout::ServingLayout receivers(
        model, layout::parse_infer_topology("tp=" + std::to_string(receivers_n)));
    // Every process builds the trainer here for simplicity; only trainer ranks read it.
    sim::SyntheticTrainer trainer(model, train, {.lr = 1e-5, .warmup_steps = 2});
    // This rank's shards in device memory (receivers never read them).
    sim::DeviceAdamWAccess access(trainer, me < senders ? me : 0);
    NcclTwoRoundConfig config;
    config.deadline = std::chrono::seconds(60);
    NcclTwoRound transport(id, me, senders, receivers_n, config);
    // A receiver process owns its device tensors (here zero-filled; an inference engine's own
    // weights) and hands the engine their sink.
    const exec::Cuda on_device;
    std::vector<exec::DeviceArray<std::uint16_t>> tensors;
    std::shared_ptr<TensorSink> sink;
    if (transport.is_receiver()) {
      std::vector<std::uint16_t*> pointers;
      for (std::int64_t k = 0; k < receivers.size(); ++k) {
        tensors.push_back(exec::DeviceArray<std::uint16_t>::zeros(
            on_device, static_cast<std::size_t>(receivers[k].numel)));
        pointers.push_back(tensors.back().data());
      }
      sink = std::make_shared<DeviceTensors>(model, receivers, me - senders, pointers);
    }
    dte::DeltaEngine<dte::AdamWInverse, dte::BF16Detect, dte::MegatronToHF, dte::NcclTwoRound>
        engine(model, train, receivers, {}, transport, sink);
    bool verified = engine.publish_full(access).verified;
    for (int step = 1; step <= 10; ++step) {
      trainer.step();
      access.upload();
      SyncReport report;
      engine.step(access, report);
      verified = verified && report.verified;
    }
    if (!engine.is_sender()) {
      std::printf("receiver process %d holds version %llu, %s\n", engine.rank(),
                  static_cast<unsigned long long>(engine.receiver().version()),
                  verified ? "verified after every publication" : "NOT VERIFIED");
    }
    status = verified ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return status;
}
