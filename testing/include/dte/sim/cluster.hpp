// SPDX-License-Identifier: Apache-2.0
// LoopbackCluster: every rank of a publication in one process, for the demo, `dte simulate`,
// the examples and the tests. A LoopbackWorld of S trainer ranks and R receiver ranks, one
// DeltaEngine per rank, and the receivers' tensors, owned here as an inference engine would own
// its own (zero-filled; with config.fp8, each quantized tensor's codes and scales instead of its
// BF16 values: docs/fp8.md). Every call runs the same engine method on every rank, each on its
// own thread, and returns the report (the same on every rank).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "dte/detect/fp8.hpp"
#include "dte/engine/engine.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/threads.hpp"
#include "dte/transport/loopback.hpp"

namespace dte::sim {

template <class Engine>
class LoopbackCluster {
 public:
  // threads: cores to share among the trainer ranks' executors (0: all of them).
  LoopbackCluster(const layout::HfModel& hf, const layout::TrainTopology& train,
                  const layout::ServingLayout& receivers, EngineConfig config, int threads = 0)
      : world_(static_cast<int>(train.world()), static_cast<int>(receivers.topology().ranks())) {
    const int cores = HostExecutor(threads).threads();
    const int per_sender = std::max(1, cores / world_.senders());
    storage_.resize(static_cast<std::size_t>(world_.receivers()));
    codes_.resize(storage_.size());
    scales_.resize(storage_.size());
    std::optional<layout::Fp8Grid> grid;
    if (!config.fp8.empty())
      grid.emplace(receivers, VllmBlockFp8::block_rows, VllmBlockFp8::block_cols);
    for (int r = 0; r < world_.size(); ++r) {
      ReceiverTensors views;
      std::vector<receive::Fp8Tensor> fp8;
      if (r >= world_.senders()) {
        const auto d = static_cast<std::size_t>(r - world_.senders());
        auto& mine = storage_[d];
        for (std::int64_t k = 0; k < receivers.size(); ++k) {
          const bool q = grid && grid->quantized(k);
          mine.emplace_back(q ? 0 : static_cast<std::size_t>(receivers[k].numel), std::uint16_t{0});
          views.emplace_back(mine.back());
        }
        if (grid) {
          for (std::int64_t id : grid->quantized_ids()) {
            codes_[d].emplace_back(static_cast<std::size_t>(grid->grid(id).numel()), 0);
            scales_[d].emplace_back(static_cast<std::size_t>(grid->grid(id).blocks()), 0.0f);
            fp8.push_back({codes_[d].back(), scales_[d].back()});
          }
        }
      }
      if (grid) {
        engines_.push_back(std::make_unique<Engine>(
            hf, train, receivers, config, world_.endpoint(r),
            Fp8ReceiverTensors{std::move(views), std::move(fp8)}, HostExecutor(per_sender)));
      } else {
        engines_.push_back(std::make_unique<Engine>(hf, train, receivers, config,
                                                    world_.endpoint(r), std::move(views),
                                                    HostExecutor(per_sender)));
      }
    }
  }

  // FP8 receivers: receiver d's codes and scales of quantized tensor k (Fp8Grid order), and its
  // BF16 tensor `id` (serving layout order; empty where quantized).
  [[nodiscard]] const std::vector<std::uint8_t>& fp8_codes(std::int64_t d, std::size_t k) const {
    return codes_[static_cast<std::size_t>(d)][k];
  }
  [[nodiscard]] const std::vector<float>& fp8_scales(std::int64_t d, std::size_t k) const {
    return scales_[static_cast<std::size_t>(d)][k];
  }
  [[nodiscard]] std::vector<std::uint8_t>& fp8_codes(std::int64_t d, std::size_t k) {
    return codes_[static_cast<std::size_t>(d)][k];
  }
  [[nodiscard]] const std::vector<std::uint16_t>& bf16(std::int64_t d, std::int64_t id) const {
    return storage_[static_cast<std::size_t>(d)][static_cast<std::size_t>(id)];
  }

  template <class Access>
  SyncReport publish_full(const Access& access) {
    return run([&](Engine& e) { return e.publish_full(access); });
  }
  template <class Access>
  bool step(const Access& access, SyncReport& report) {
    return run_flag([&](Engine& e, SyncReport& rep) { return e.step(access, rep); }, report);
  }
  template <class Access>
  bool flush(const Access& access, SyncReport& report) {
    return run_flag([&](Engine& e, SyncReport& rep) { return e.flush(access, rep); }, report);
  }
  template <class Access>
  SyncReport publish_noop(const Access& access) {
    return run([&](Engine& e) { return e.publish_noop(access); });
  }

  [[nodiscard]] Version version() const noexcept { return engines_[0]->version(); }
  [[nodiscard]] LoopbackWorld& world() noexcept { return world_; }
  [[nodiscard]] const Engine& engine(int rank) const {
    return *engines_[static_cast<std::size_t>(rank)];
  }
  [[nodiscard]] const Receiver& receiver(std::int64_t d) const {
    return engines_[static_cast<std::size_t>(world_.senders() + d)]->receiver();
  }
  [[nodiscard]] std::vector<const Receiver*> receivers() const {
    std::vector<const Receiver*> out;
    for (int d = 0; d < world_.receivers(); ++d)
      out.push_back(&receiver(d));
    return out;
  }

 private:
  // f(engine) on every rank, each on its own thread. When ranks throw, the exception of the
  // trainer rank that refused the publication (it says why) or else the lowest rank's.
  template <class F>
  void each(F&& f) {
    const std::vector<std::exception_ptr> errors =
        detail::on_threads(engines_.size(), [&](std::size_t r) { f(*engines_[r], r); });
    detail::rethrow_first(errors, engines_[0]->refused_by());
  }

  template <class F>
  SyncReport run(F&& f) {
    std::vector<SyncReport> reports(engines_.size());
    each([&](Engine& e, std::size_t r) { reports[r] = f(e); });
    return reports[0];
  }

  template <class F>
  bool run_flag(F&& f, SyncReport& report) {
    std::vector<SyncReport> reports(engines_.size());
    std::vector<char> published(engines_.size(), 0);
    each([&](Engine& e, std::size_t r) { published[r] = f(e, reports[r]) ? 1 : 0; });
    if (published[0]) report = reports[0];
    return published[0] != 0;
  }

  LoopbackWorld world_;
  std::vector<std::vector<std::vector<std::uint16_t>>> storage_;  // [receiver][tensor]
  std::vector<std::vector<std::vector<std::uint8_t>>> codes_;     // [receiver][quantized tensor]
  std::vector<std::vector<std::vector<float>>> scales_;
  std::vector<std::unique_ptr<Engine>> engines_;
};

}  // namespace dte::sim
