// SPDX-License-Identifier: Apache-2.0
// Options shared by the in-process and the MPI runs of `dte simulate`.
#pragma once

#include <cstdint>
#include <string>

namespace dte::tool {

struct SimulateOptions {
  std::string model = "small-qwen3", train = "tp=2,dp=2", infer = "tp=4,replicas=2", dump;
  std::string stack = "megatron-lm";
  // the checkpoint the run "started from", as a converter assuming this topology wrote it
  std::string start_checkpoint, checkpoint_train, checkpoint_stack;
  std::int64_t steps = 50, publish_every = 1, warmup = -1;
  double lr = 1e-6;
  std::uint64_t seed = 0;
  bool json = false;
  std::string transport = "loopback";
  std::int64_t deadline_ms = 30000;
  std::string fault;  // MPI fault injection: kill-receiver:R:V or stall-trainer:G:V
  // --transport storage
  std::string dir, encoding = "value", index = "plain";
  std::int64_t anchor_every = 0, reader_lag = 0;
  int zstd_level = 3;
};

// The MPI run (simulate_mpi.cpp); returns the exit status. Only in builds with MPI.
int simulate_mpi(const SimulateOptions& o);
// The storage run (storage.cpp); returns the exit status. Only in builds with zstd and xxHash.
int simulate_storage(const SimulateOptions& o);

}  // namespace dte::tool
