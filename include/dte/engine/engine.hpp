// SPDX-License-Identifier: Apache-2.0
// DeltaEngine: one instance per rank of a transport's world (a trainer rank or a receiver rank),
// whatever the transport: loopback threads, MPI processes, NCCL ranks.
//
//   using Engine = DeltaEngine<AdamWInverse, BF16Detect, MegatronToHF, LoopbackTwoRound>;
//
// One publication, top to bottom (every rank calls the same method; each does its part):
//   1. scan (trainer ranks): the staged pass over the rank's shard (engine/sender.hpp);
//      then the world agrees that no trainer rank refused (a refusal throws on every rank and
//      nothing is sent) and sums the trainer's digest per canonical tensor.
//   2. deliver: trainer ranks close one message per receiver; the two-round exchange; receiver
//      ranks apply their inbox transactionally into the caller's tensors.
//   3. verify: every replica's digest per canonical tensor is summed over the world and
//      compared with the trainer's; receivers that refused get a full resync and disagreeing
//      tensors a dense repair, then the check runs again.
//   4. report: every rank's part summed over the world, so every rank returns the same report.
// Publication every K optimizer steps, explicit no-op versions and the full publication after
// a refusal are the schedule's (engine/schedule.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/message.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/report.hpp"
#include "dte/engine/schedule.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/verify.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/transport/loopback.hpp"

namespace dte {

using MegatronToHF = layout::MegatronToHF;

namespace detail {
// The executor an engine over Transport runs on unless told otherwise: the transport's
// default_executor (NcclTwoRound: exec::Cuda, the trainer's state and the receivers' tensors in
// device memory), else the host executor.
template <class T>
struct default_executor {
  using type = HostExecutor;
};
template <class T>
requires requires {
  typename T::default_executor;
}
struct default_executor<T> {
  using type = typename T::default_executor;
};
}  // namespace detail

template <optimizer_inverse Inverse, change_detector Detect, layout_mapping Layout = MegatronToHF,
          transport Transport = LoopbackTwoRound,
          executor Exec = typename detail::default_executor<Transport>::type>
requires transfer_plan<typename Layout::plan_type>
class DeltaEngine
    : public detail::PublicationSchedule<DeltaEngine<Inverse, Detect, Layout, Transport, Exec>> {
  using Schedule = detail::PublicationSchedule<DeltaEngine>;
  friend Schedule;
  using Schedule::config_;
  using Schedule::version_;

 public:
  // SenderRank on the host executor; DeviceSenderRank on exec::Cuda (engine/device_sender.cuh).
  using Sender =
      typename detail::sender_rank<Inverse, Detect, typename Layout::plan_type, Exec>::type;

  // A trainer rank (transport.is_sender()) or a receiver rank, which passes views of its own
  // tensors (ReceiverTensors, in ServingLayout order for its TP rank).
  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout& receivers, EngineConfig config, Transport& transport,
              ReceiverTensors tensors = {}, Exec exec = {})
      : DeltaEngine(common{}, hf, train, receivers, config, transport, exec) {
    if (!transport.is_sender()) {
      receiver_.emplace(hf, receivers, transport.rank() - transport.senders(), transport.senders(),
                        std::move(tensors));
    }
  }

  // A receiver rank whose tensors are device memory passes their sink
  // (engine/device_receiver.cuh: DeviceTensors); a trainer rank passes nullptr.
  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout& receivers, EngineConfig config, Transport& transport,
              std::shared_ptr<TensorSink> device_tensors, Exec exec = {})
      : DeltaEngine(common{}, hf, train, receivers, config, transport, exec) {
    if (!transport.is_sender()) {
      receiver_.emplace(hf, receivers, transport.rank() - transport.senders(), transport.senders(),
                        std::move(device_tensors));
    }
  }

  [[nodiscard]] bool is_sender() const noexcept { return sender_.has_value(); }
  [[nodiscard]] bool is_receiver() const noexcept { return receiver_.has_value(); }
  [[nodiscard]] int rank() const noexcept { return transport_->rank(); }
  // The trainer rank this instance is (senders only) / the receiver (receivers only).
  [[nodiscard]] const Sender& sender() const { return *sender_; }
  [[nodiscard]] const Receiver& receiver() const { return *receiver_; }
  [[nodiscard]] Transport& transport() noexcept { return *transport_; }
  // The trainer rank whose state refused the last refused publication (-1: none).
  [[nodiscard]] std::int64_t refused_by() const noexcept { return refused_by_; }

  // An explicit no-op version (a skipped step, lr = 0): every receiver moves to the next
  // version without a change, through the same version chain.
  template <class Access>
  SyncReport publish_noop(Access&& access) {
    SyncReport rep;
    rep.kind = "noop";
    rep.version = ++version_;
    if (sender_) sender_->begin_messages();  // headers only
    deliver(MessageKind::noop, rep, access);
    return rep;
  }

  // For fault tests: hook(rank, version) runs on this rank between round 1 and round 2 of every
  // publication's exchange (transports that support it: MpiTwoRound).
  void between_rounds(std::function<void(int rank, Version version)> hook) {
    hook_ = std::move(hook);
  }

 private:
  // What both public constructors share: the world check, the sender, the dense-sync size.
  struct common {};
  DeltaEngine(common, const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout& receivers, EngineConfig config, Transport& transport,
              Exec exec)
      : Schedule(config), hf_(&hf), recv_layout_(&receivers), transport_(&transport) {
    if (transport.senders() != train.world() ||
        transport.receivers() != receivers.topology().ranks()) {
      throw invalid_argument(
          "DeltaEngine: the transport's world has " + std::to_string(transport.senders()) +
          " senders and " + std::to_string(transport.receivers()) +
          " receivers, the topologies need " + std::to_string(train.world()) +
          " trainer ranks and " + std::to_string(receivers.topology().ranks()) + " receiver ranks");
    }
    if (transport.is_sender()) {
      sender_.emplace(hf, train, receivers, transport.rank(), config.publish_every > 1, exec);
    }
    for (std::int64_t r = 0; r < receivers.topology().ranks(); ++r) {
      dense_bytes_ +=
          2 * static_cast<std::uint64_t>(receivers.live_elements(r % receivers.topology().tp));
    }
  }

  void clear_masks() {
    if (sender_) sender_->clear_masks();
  }

  static double since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // 1. The staged pass on trainer ranks, then agreement and the trainer's digest.
  template <class Access>
  void scan(Access& access, pipeline::ScanMode mode, SyncReport& rep) {
    static_assert(trainer_access<std::remove_cvref_t<Access>, Inverse>,
                  "DeltaEngine: the accessor must provide theta(rank, buffer), "
                  "hyperparameters(rank, buffer, segment) and state(rank, buffer, segment) for "
                  "this Inverse (concept dte::trainer_access)");
    ScanResult res;
    std::string error;
    if (sender_) {
      try {
        res = sender_->scan(access, mode);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    std::vector<std::uint64_t> refused(static_cast<std::size_t>(transport_->senders()), 0);
    if (sender_ && !error.empty()) refused[static_cast<std::size_t>(transport_->rank())] = 1;
    transport_->sum(refused, "the agreement after the detect pass");
    const auto first = std::find(refused.begin(), refused.end(), 1u);
    if (first != refused.end()) {
      this->refused();
      refused_by_ = first - refused.begin();
      const std::string who = "publication refused on trainer rank " + std::to_string(refused_by_);
      throw invalid_argument(error.empty() ? who + " (that rank's error says why); nothing was sent"
                                           : who + ": " + error);
    }
    refused_by_ = -1;
    if (mode == pipeline::ScanMode::mark) return;
    const auto tensors = static_cast<std::size_t>(hf_->size());
    std::vector<std::uint64_t> v(tensors, 0);
    if (sender_) std::copy(res.digest.begin(), res.digest.end(), v.begin());
    v.insert(v.end(), {res.scanned, res.changed, res.guard, res.entries});
    transport_->sum(v, "the digest sum");
    trainer_digest_.resize(tensors);
    for (std::size_t t = 0; t < tensors; ++t)
      trainer_digest_[t] = static_cast<Digest>(v[t]);  // mod 2^32
    rep.elements_scanned = v[tensors];
    rep.changed = v[tensors + 1];
    rep.guard = v[tensors + 2];
    rep.entries = v[tensors + 3];
    Digest total = 0;
    for (Digest d : trainer_digest_)
      total += d;
    rep.digest = total;
    detect_s_ = res.seconds;
  }

  // 2. Exchange, apply; then verify (3) and the report (4).
  template <class Access>
  void deliver(MessageKind kind, SyncReport& rep, Access& access) {
    rep.dense_bytes = dense_bytes_;
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Payload> out;
    std::uint64_t payload = 0, held = 0, mask = 0, fixed = 0;
    if (sender_) {
      out = sender_->finish(kind, version_, kind == MessageKind::full ? no_version : version_ - 1);
      payload = sender_->payload_bytes();
      held = sender_->held_bytes();
      mask = sender_->mask_bytes();
      fixed = sender_->fixed_bytes();
    }
    const double route_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    if constexpr (requires { transport_->between_rounds(std::function<void()>{}); }) {
      if (hook_) transport_->between_rounds([this] { hook_(transport_->rank(), version_); });
    }
    Inbox inbox = transport_->exchange(out);
    if (sender_) sender_->release();
    const double exchange_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    ApplyResult applied;
    std::uint64_t received = 0, received_held = 0;
    if (receiver_) {
      applied = receiver_->apply(version_, inbox);
      for (const auto& [src, bytes] : inbox)
        received += bytes.capacity();
      received_held = received + inbox.size() * sizeof(wire::MessageView);
    }
    inbox.clear();
    const double apply_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    if (config_.verify) verify_and_repair(rep, access);
    const double verify_s = since(t0);

    // 4. The report: sums, per-receiver bytes, and per-rank figures whose maximum is reported.
    const auto world = static_cast<std::size_t>(transport_->senders() + transport_->receivers());
    const auto receivers = static_cast<std::size_t>(transport_->receivers());
    const auto me = static_cast<std::size_t>(transport_->rank());
    enum Field : std::size_t { f_payload, f_received, f_stale, f_written, f_count };
    constexpr std::size_t per_rank = 11;
    std::vector<std::uint64_t> v(f_count + receivers + per_rank * world, 0);
    v[f_payload] = payload;
    v[f_received] = received;
    v[f_stale] = applied.stale;
    v[f_written] = applied.written;
    if (receiver_) v[f_count + me - static_cast<std::size_t>(transport_->senders())] = received;
    auto slot = [&](std::size_t rank, std::size_t k) -> std::uint64_t& {
      return v[f_count + receivers + rank * per_rank + k];
    };
    const auto micros = [](double s) { return static_cast<std::uint64_t>(s * 1e6); };
    const std::uint64_t local[per_rank] = {held,
                                           payload,
                                           received_held,
                                           received,
                                           mask,
                                           fixed,
                                           micros(detect_s_),
                                           micros(route_s),
                                           micros(exchange_s),
                                           micros(apply_s),
                                           micros(verify_s)};
    for (std::size_t k = 0; k < per_rank; ++k)
      slot(me, k) = local[k];
    transport_->sum(v, "the report");
    rep.bytes = v[f_payload];
    rep.payload_total_bytes = v[f_payload];
    rep.received_total_bytes = v[f_received];
    rep.stale_messages = v[f_stale];
    rep.routed_writes = v[f_written];
    rep.bytes_to.assign(v.begin() + f_count,
                        v.begin() + static_cast<std::ptrdiff_t>(f_count + receivers));
    double* seconds[] = {&rep.detect_s, &rep.route_s, &rep.exchange_s, &rep.apply_s, &rep.verify_s};
    for (double* s : seconds)
      *s = 0;
    for (std::size_t r = 0; r < world; ++r) {
      // The rank whose extra memory is largest relative to its payload.
      if (slot(r, 1) > 0 && (rep.sender_payload_bytes == 0 ||
                             static_cast<double>(slot(r, 0)) * rep.sender_payload_bytes >
                                 static_cast<double>(rep.sender_extra_bytes) * slot(r, 1))) {
        rep.sender_extra_bytes = slot(r, 0);
        rep.sender_payload_bytes = slot(r, 1);
      }
      if (slot(r, 2) > rep.receiver_extra_bytes) {
        rep.receiver_extra_bytes = slot(r, 2);
        rep.receiver_payload_bytes = slot(r, 3);
      }
      rep.sender_mask_bytes = std::max(rep.sender_mask_bytes, slot(r, 4));
      rep.sender_fixed_bytes = std::max(rep.sender_fixed_bytes, slot(r, 5));
      for (std::size_t k = 0; k < 5; ++k)
        *seconds[k] = std::max(*seconds[k], static_cast<double>(slot(r, 6 + k)) * 1e-6);
    }
    detect_s_ = 0;
  }

  // 3. Per replica and canonical tensor, the receivers' digests must sum to the trainer's times
  // the copies a replica holds; the sums and the refusals are summed over the world, so every
  // rank reaches the same verdict and takes part in the same repair.
  template <class Access>
  void verify_and_repair(SyncReport& rep, Access& access) {
    const auto& it = recv_layout_->topology();
    const auto tensors = static_cast<std::size_t>(hf_->size());
    const auto receivers = static_cast<std::size_t>(transport_->receivers());
    const auto replicas = static_cast<std::size_t>(it.replicas);
    bool repair_refused = false;  // this receiver refused its repair messages
    std::vector<bool> refused_repair(receivers, false);
    auto gather = [&](std::vector<bool>& bad, std::vector<bool>& resync) {
      std::vector<std::uint64_t> v(replicas * tensors + 2 * receivers, 0);
      if (receiver_) {
        const std::int64_t r = receiver_->rank();
        const auto replica = static_cast<std::size_t>(r / it.tp);
        for (std::size_t t = 0; t < tensors; ++t)
          v[replica * tensors + t] = receiver_->digest()[t];
        v[replicas * tensors + static_cast<std::size_t>(r)] =
            receiver_->version() == version_ ? 0 : 1;
        v[replicas * tensors + receivers + static_cast<std::size_t>(r)] = repair_refused ? 1 : 0;
      }
      transport_->sum(v, "the digest verification");
      bad = detail::mismatched_tensors(*hf_, *recv_layout_, trainer_digest_, v.data());
      resync.assign(receivers, false);
      for (std::size_t d = 0; d < receivers; ++d) {
        resync[d] = v[replicas * tensors + d] != 0;
        refused_repair[d] = v[replicas * tensors + receivers + d] != 0;
      }
    };
    std::vector<bool> bad, resync;
    gather(bad, resync);
    const bool any_bad = std::find(bad.begin(), bad.end(), true) != bad.end();
    const bool any_resync = std::find(resync.begin(), resync.end(), true) != resync.end();
    if (any_bad || any_resync) {
      for (std::size_t t = 0; t < bad.size(); ++t) {
        if (bad[t]) rep.repaired.push_back(hf_->name(static_cast<std::int64_t>(t)));
      }
      for (std::size_t d = 0; d < resync.size(); ++d) {
        if (resync[d]) rep.resynced.push_back(static_cast<std::int64_t>(d));
      }
      std::vector<Payload> out;
      if (sender_) out = sender_->repair(access, bad, resync, version_);
      Inbox inbox = transport_->exchange(out);
      if (sender_) sender_->release();
      // The repair's own result is checked: a refused repair leaves the receiver as it was,
      // and the check below then fails for it; the report names it.
      if (receiver_ && !inbox.empty()) {
        repair_refused = receiver_->apply(version_, inbox).outcome == ApplyOutcome::refused;
      }
      gather(bad, resync);
      for (std::size_t d = 0; d < refused_repair.size(); ++d) {
        if (refused_repair[d]) rep.repair_refused.push_back(static_cast<std::int64_t>(d));
      }
    }
    rep.verified = std::find(bad.begin(), bad.end(), true) == bad.end() &&
                   std::find(resync.begin(), resync.end(), true) == resync.end();
  }

  const layout::HfModel* hf_;
  const layout::ServingLayout* recv_layout_;
  Transport* transport_;
  std::optional<Sender> sender_;
  std::optional<Receiver> receiver_;
  std::vector<Digest> trainer_digest_;
  std::uint64_t dense_bytes_ = 0;
  double detect_s_ = 0;
  std::int64_t refused_by_ = -1;
  std::function<void(int, Version)> hook_;
};

}  // namespace dte
