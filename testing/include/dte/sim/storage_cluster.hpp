// SPDX-License-Identifier: Apache-2.0
// StorageCluster: cross-cluster sync in one process, for `dte simulate --transport storage`,
// the example and the tests: S writer ranks (storage::Publisher, each on its own thread of a
// writers-only LoopbackWorld) publish to a storage root, and readers (storage::Reader, each
// over whole replicas whose zero-filled tensors are owned here, as an inference engine owns
// its own) poll it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/engine/engine.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/optim/adam.hpp"
#include "dte/sim/threads.hpp"
#include "dte/storage/publisher.hpp"
#include "dte/storage/reader.hpp"
#include "dte/transport/loopback.hpp"

namespace dte::sim {

class StorageCluster {
 public:
  using Publisher = storage::Publisher<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;

  // threads: cores shared among the writers' executors (0: all).
  StorageCluster(const layout::HfModel& hf, const layout::TrainTopology& train,
                 std::filesystem::path root, storage::PublisherConfig cfg, int threads = 0)
      : hf_(&hf), root_(std::move(root)), world_(static_cast<int>(train.world()), 0) {
    const int cores = HostExecutor(threads).threads();
    const int per = std::max(1, cores / world_.senders());
    for (int r = 0; r < world_.senders(); ++r) {
      publishers_.push_back(std::make_unique<Publisher>(hf, train, root_, cfg, world_.endpoint(r),
                                                        HostExecutor(per)));
    }
  }

  // Every writer's step(); the report when this step published.
  template <class Access>
  std::optional<storage::PublishReport> step(const Access& access) {
    std::vector<std::optional<storage::PublishReport>> out(publishers_.size());
    each([&](Publisher& p, std::size_t r) { out[r] = p.step(access); });
    return out[0];
  }
  template <class Access>
  storage::PublishReport publish(const Access& access) {
    std::vector<storage::PublishReport> out(publishers_.size());
    each([&](Publisher& p, std::size_t r) { out[r] = p.publish(access); });
    return out[0];
  }
  template <class Access>
  storage::PublishReport publish_anchor(const Access& access) {
    std::vector<storage::PublishReport> out(publishers_.size());
    each([&](Publisher& p, std::size_t r) { out[r] = p.publish_anchor(access); });
    return out[0];
  }

  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }

 private:
  template <class F>
  void each(F&& f) {
    run_ranks(publishers_.size(), [&](std::size_t r) { f(*publishers_[r], r); });
  }

  const layout::HfModel* hf_;
  std::filesystem::path root_;
  LoopbackWorld world_;
  std::vector<std::unique_ptr<Publisher>> publishers_;
};

// A storage reader with its own tensors (zero-filled), over whole replicas.
class OwnedReader {
 public:
  OwnedReader(const layout::HfModel& hf, const layout::ServingLayout& layout,
              std::filesystem::path root, std::vector<std::int64_t> replicas,
              storage::ReaderConfig cfg = {}) {
    std::vector<ReceiverTensors> views;
    const std::int64_t tp = layout.topology().tp;
    tensors_.resize(replicas.size() * static_cast<std::size_t>(tp));
    for (auto& rank : tensors_) {
      ReceiverTensors v;
      for (std::int64_t k = 0; k < layout.size(); ++k) {
        rank.emplace_back(static_cast<std::size_t>(layout[k].numel), std::uint16_t{0});
        v.emplace_back(rank.back());
      }
      views.push_back(std::move(v));
    }
    reader_ = std::make_unique<storage::Reader>(hf, layout, std::move(root), std::move(replicas),
                                                std::move(views), std::move(cfg));
  }
  storage::Reader& operator*() noexcept { return *reader_; }
  storage::Reader* operator->() noexcept { return reader_.get(); }
  const storage::Reader* operator->() const noexcept { return reader_.get(); }

 private:
  std::vector<std::vector<std::vector<std::uint16_t>>> tensors_;  // [rank][tensor]
  std::unique_ptr<storage::Reader> reader_;
};

}  // namespace dte::sim
