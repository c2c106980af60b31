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
// When to publish (every K optimizer steps) and what (full after a refusal, else the dirty mask
// or this step's changes) is the schedule's (engine/schedule.hpp); explicit no-op versions are
// publish_noop().
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/message.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/fp8_stage.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/report.hpp"
#include "dte/engine/schedule.hpp"
#include "dte/engine/sender.hpp"
#include "dte/engine/verify.hpp"
#include "dte/exec/host.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/megatron.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/transport/collective.hpp"
#include "dte/transport/loopback.hpp"

// Under nvcc, the engine's CUDA backend too: an engine over exec::Cuda (NcclTwoRound's default
// executor) runs the device sender (detail::sender_rank) and device receivers.
#if defined(__CUDACC__)
#include "dte/engine/device_receiver.cuh"
#include "dte/engine/device_sender.cuh"
#endif

namespace dte {

using MegatronToHF = layout::MegatronToHF;

struct EngineConfig {
  std::int64_t publish_every = 1;  // K
  bool verify = true;              // compare every replica's digest with the trainer's
  // The receivers serve online FP8 by this recipe ("": BF16; "fp8-block": VllmBlockFp8,
  // docs/fp8.md). Every rank of the world passes the same. Host executor, and a transport with
  // max() (LoopbackTwoRound, MpiTwoRound, NcclTwoRound).
  std::string fp8{};
};

// An FP8 receiver rank's tensors: the BF16 ones in ServingLayout order (an empty view for each
// quantized tensor) and each quantized tensor's codes and scales (Fp8Grid::quantized_ids order).
struct Fp8ReceiverTensors {
  ReceiverTensors bf16;
  std::vector<receive::Fp8Tensor> fp8;
};

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
class DeltaEngine {
 public:
  // HostSenderRank on the host executor; DeviceSenderRank on exec::Cuda (engine/device_sender.cuh).
  using Sender =
      typename detail::sender_rank<Inverse, Detect, typename Layout::plan_type, Exec>::type;

  // A trainer rank (transport.is_sender()) or a receiver rank, which passes views of its own
  // tensors (ReceiverTensors, in ServingLayout order for its TP rank).
  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout& receivers, EngineConfig config, Transport& transport,
              ReceiverTensors tensors = {}, Exec exec = {})
      : DeltaEngine(common{}, hf, train, receivers, config, transport, exec) {
    if (!transport.is_sender()) {
      if (fp8_) {
        throw invalid_argument(
            "DeltaEngine: config.fp8 is set, so a receiver rank passes its FP8 tensors "
            "(Fp8ReceiverTensors: codes and scales of the quantized tensors, BF16 for the rest)");
      }
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
      if (fp8_) {
        throw unsupported(
            "DeltaEngine: FP8 receivers in device memory are not covered yet "
            "(docs/fp8.md); pass host tensors (Fp8ReceiverTensors)");
      }
      receiver_.emplace(hf, receivers, transport.rank() - transport.senders(), transport.senders(),
                        std::move(device_tensors));
    }
  }

  // A receiver rank that serves online FP8 (config.fp8): its BF16 and FP8 tensors.
  DeltaEngine(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout& receivers, EngineConfig config, Transport& transport,
              Fp8ReceiverTensors tensors, Exec exec = {})
      : DeltaEngine(common{}, hf, train, receivers, config, transport, exec) {
    if (!fp8_) {
      throw invalid_argument("DeltaEngine: FP8 tensors given, but config.fp8 names no recipe");
    }
    if (!transport.is_sender()) {
      receiver_.emplace(hf, receivers, transport.rank() - transport.senders(), transport.senders(),
                        std::move(tensors.bf16), std::move(tensors.fp8));
    }
  }

  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] std::int64_t pending_steps() const noexcept { return schedule_.pending(); }

  // A full publication: every element, current values. The first one is version 0; a later
  // one (a resync the caller asks for) is the next version, which every receiver accepts
  // whatever it holds.
  template <class Access>
  SyncReport publish_full(Access&& access) {
    return publish(access, schedule_.next(true), version_ == no_version ? 0 : version_ + 1);
  }

  // Call after every optimizer step. Publishes (and returns true) on every K-th step; the
  // other steps' changes are ORed into the dirty mask.
  template <class Access>
  bool step(Access&& access, SyncReport& report) {
    if (!schedule_.step()) {
      SyncReport ignored;
      scan(access, pipeline::ScanMode::mark, ignored);
      schedule_.marked();
      return false;
    }
    report = publish(access, schedule_.next(), version_ + 1);
    return true;
  }

  // Publishes the steps taken since the last publication, if any.
  template <class Access>
  bool flush(Access&& access, SyncReport& report) {
    if (schedule_.pending() == 0) return false;
    report = publish(access, schedule_.next(), version_ + 1);
    return true;
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
      : config_(config),
        schedule_(config.publish_every),
        hf_(&hf),
        recv_layout_(&receivers),
        transport_(&transport) {
    if (transport.senders() != train.world() ||
        transport.receivers() != receivers.topology().ranks()) {
      throw invalid_argument(
          "DeltaEngine: the transport's world has " + std::to_string(transport.senders()) +
          " senders and " + std::to_string(transport.receivers()) +
          " receivers, the topologies need " + std::to_string(train.world()) +
          " trainer ranks and " + std::to_string(receivers.topology().ranks()) + " receiver ranks");
    }
    if (transport.is_sender()) {
      sender_.emplace(hf, train, receivers, transport.rank(), schedule_.keeps_mask(), exec);
    }
    if (!config.fp8.empty()) serve_fp8(hf, train, receivers, config.fp8);
    for (std::int64_t r = 0; r < receivers.topology().ranks(); ++r) {
      dense_bytes_ +=
          2 * static_cast<std::uint64_t>(receivers.live_elements(r % receivers.topology().tp));
    }
  }

  // FP8 receivers: the sizes every rank's reductions share, and the trainer ranks' FP8 stage.
  struct Fp8World {
    std::size_t blocks = 0, tensors = 0;  // per replica: blocks; quantized tensors per TP rank
    std::vector<bool> quantized_hf;       // per canonical tensor: lands in quantized tensors
    std::vector<std::string> names;       // per (TP rank, quantized tensor)
  };
  void serve_fp8(const layout::HfModel& hf, const layout::TrainTopology& train,
                 const layout::ServingLayout& receivers, const std::string& recipe) {
    if (recipe != VllmBlockFp8::name) {
      throw unsupported("DeltaEngine: no FP8 recipe \"" + recipe + "\"; dte covers \"" +
                        std::string(VllmBlockFp8::name) + "\" (docs/fp8.md)");
    }
    if constexpr (
        !requires(Transport & t, std::span<std::uint64_t> v) { t.max(v, ""); } ||
        !requires(Sender & s) { s.serve_fp8(hf, receivers, std::int64_t{}); }) {
      throw unsupported(
          "DeltaEngine: FP8 receivers need the host executor and a transport with max() "
          "(LoopbackTwoRound, MpiTwoRound); the CUDA sender does not serve them yet");
    } else {
      const layout::Fp8Grid grid(receivers, VllmBlockFp8::block_rows, VllmBlockFp8::block_cols);
      Fp8World w;
      w.blocks = fp8_blocks(grid);
      w.tensors = grid.quantized_ids().size();
      for (std::int64_t t = 0; t < hf.size(); ++t)
        w.quantized_hf.push_back(layout::Fp8Grid::quantized_hf(hf[t].kind));
      for (std::int64_t ts = 0; ts < receivers.topology().tp; ++ts) {
        for (std::int64_t id : grid.quantized_ids())
          w.names.push_back(receivers.name(id) + " (TP rank " + std::to_string(ts) + ")");
      }
      fp8_ = std::move(w);
      if (sender_) sender_->serve_fp8(hf, receivers, train.world());
    }
  }

  // FP8: the block scales' reduction and each trainer rank's parts for version v on `base`; the
  // trainer ranks' digest shares are summed with the BF16 digest.
  template <class Access>
  void scan_fp8(Access& access, Version v, Version base) {
    std::vector<std::uint64_t> red(3 * fp8_->blocks, 0);
    fp8_digest_.assign(static_cast<std::size_t>(recv_layout_->topology().tp) * fp8_->tensors, 0);
    if constexpr (
        requires(Transport & t, std::span<std::uint64_t> x) { t.max(x, ""); } &&
        requires(Sender & s) { s.fp8(); }) {
      const auto theta_of = [&](layout::BufferKind b) { return access.theta(sender_->rank(), b); };
      if (sender_) red = sender_->fp8()->local(theta_of);
      transport_->max(std::span<std::uint64_t>(red), "the FP8 block scales");
      if (sender_) {
        sender_->attach(sender_->fp8()->finish(red, theta_of, v, base, fp8_digest_));
        std::tie(fp8_sent_[0], fp8_sent_[1]) = sender_->fp8()->sent();
      }
    }
  }

  // One publication of version v: the pass, then delivery (throws, with nothing sent, when a
  // trainer rank refuses; the next publication is then full).
  template <class Access>
  SyncReport publish(Access& access, PublicationSchedule::Pass pass, Version v) {
    SyncReport rep;
    rep.version = v;
    rep.steps = pass.steps;
    scan(access, pass.mode, rep, v, pass.full() ? no_version : version_);
    version_ = v;
    schedule_.published();
    if (pass.clears_masks() && sender_) sender_->clear_masks();
    const MessageKind kind = pass.full()        ? MessageKind::full
                             : rep.changed == 0 ? MessageKind::noop
                                                : MessageKind::delta;
    rep.kind = pass.full() ? "full" : rep.changed == 0 ? "noop" : "delta";
    deliver(kind, rep, access);
    return rep;
  }

  static double since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // 1. The staged pass on trainer ranks, then agreement and the trainer's digest.
  template <class Access>
  void scan(Access& access, pipeline::ScanMode mode, SyncReport& rep, Version v = 0,
            Version base = no_version) {
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
    agree(*transport_, static_cast<std::size_t>(transport_->senders()),
          sender_ ? transport_->rank() : -1, error, "the agreement after the detect pass",
          [&](std::int64_t who) {
            schedule_.require_full();
            refused_by_ = who;
            const std::string what = "publication refused on trainer rank " + std::to_string(who);
            throw invalid_argument(error.empty()
                                       ? what + " (that rank's error says why); nothing was sent"
                                       : what + ": " + error);
          });
    refused_by_ = -1;
    if (mode == pipeline::ScanMode::mark) return;
    fp8_sent_[0] = fp8_sent_[1] = 0;
    if (fp8_) scan_fp8(access, v, base);
    struct Counts {
      std::uint64_t scanned, changed, guard, entries, fp8_codes, fp8_scales;
    } counts{res.scanned, res.changed, res.guard, res.entries, fp8_sent_[0], fp8_sent_[1]};
    trainer_digest_.assign(static_cast<std::size_t>(hf_->size()), 0);
    if (sender_) trainer_digest_ = res.digest;
    sum_fields(*transport_, "the digest sum", trainer_digest_, fp8_digest_, counts);
    rep.fp8_codes = counts.fp8_codes;
    rep.fp8_scales = counts.fp8_scales;
    rep.elements_scanned = counts.scanned;
    rep.changed = counts.changed;
    rep.guard = counts.guard;
    rep.entries = counts.entries;
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
      std::span<const Digest> expected;
      if (fp8_) {
        const auto ts = static_cast<std::size_t>(receiver_->rank() % recv_layout_->topology().tp);
        expected = std::span<const Digest>(fp8_digest_).subspan(ts * fp8_->tensors, fp8_->tensors);
      }
      applied = receiver_->apply(version_, inbox, expected);
      for (const auto& [src, bytes] : inbox)
        received += bytes.capacity();
      received_held = received + inbox.size() * sizeof(wire::MessageView);
    }
    inbox.clear();
    const double apply_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    if (config_.verify) verify_and_repair(rep, access);
    const double verify_s = since(t0);

    // 4. The report: totals, bytes per receiver, and per-rank figures whose maximum is reported.
    const auto world = static_cast<std::size_t>(transport_->senders() + transport_->receivers());
    const auto me = static_cast<std::size_t>(transport_->rank());
    struct Totals {
      std::uint64_t payload, received, stale, written;
    } totals{payload, received, applied.stale, applied.written};
    std::vector<std::uint64_t> bytes_to(static_cast<std::size_t>(transport_->receivers()), 0);
    if (receiver_) bytes_to[static_cast<std::size_t>(receiver_->rank())] = received;
    struct RankFigures {
      std::uint64_t held, payload, received_held, received, mask, fixed;
      std::uint64_t micros[5];  // detect, route, exchange, apply, verify
    };
    std::vector<RankFigures> ranks(world, RankFigures{});
    const auto micros = [](double s) { return static_cast<std::uint64_t>(s * 1e6); };
    ranks[me] = {held,
                 payload,
                 received_held,
                 received,
                 mask,
                 fixed,
                 {micros(detect_s_), micros(route_s), micros(exchange_s), micros(apply_s),
                  micros(verify_s)}};
    sum_fields(*transport_, "the report", totals, bytes_to, ranks);
    rep.bytes = totals.payload;
    rep.payload_total_bytes = totals.payload;
    rep.received_total_bytes = totals.received;
    rep.stale_messages = totals.stale;
    rep.routed_writes = totals.written;
    rep.bytes_to = std::move(bytes_to);
    double* seconds[] = {&rep.detect_s, &rep.route_s, &rep.exchange_s, &rep.apply_s, &rep.verify_s};
    for (double* s : seconds)
      *s = 0;
    for (const RankFigures& r : ranks) {
      // The rank whose extra memory is largest relative to its payload.
      if (r.payload > 0 && (rep.sender_payload_bytes == 0 ||
                            static_cast<double>(r.held) * rep.sender_payload_bytes >
                                static_cast<double>(rep.sender_extra_bytes) * r.payload)) {
        rep.sender_extra_bytes = r.held;
        rep.sender_payload_bytes = r.payload;
      }
      if (r.received_held > rep.receiver_extra_bytes) {
        rep.receiver_extra_bytes = r.received_held;
        rep.receiver_payload_bytes = r.received;
      }
      rep.sender_mask_bytes = std::max(rep.sender_mask_bytes, r.mask);
      rep.sender_fixed_bytes = std::max(rep.sender_fixed_bytes, r.fixed);
      for (std::size_t k = 0; k < 5; ++k)
        *seconds[k] = std::max(*seconds[k], static_cast<double>(r.micros[k]) * 1e-6);
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
      std::vector<Digest> digests(replicas * tensors, 0);  // per replica and canonical tensor
      std::vector<std::uint64_t> behind(receivers, 0), refused(receivers, 0);  // per receiver
      if (receiver_) {
        const auto r = static_cast<std::size_t>(receiver_->rank());
        const std::size_t replica = r / static_cast<std::size_t>(it.tp);
        std::copy(receiver_->digest().begin(), receiver_->digest().end(),
                  digests.begin() + static_cast<std::ptrdiff_t>(replica * tensors));
        behind[r] = receiver_->version() == version_ ? 0 : 1;
        refused[r] = repair_refused ? 1 : 0;
      }
      sum_fields(*transport_, "the digest verification", digests, behind, refused);
      bad = detail::mismatched_tensors(*hf_, *recv_layout_, trainer_digest_, digests);
      resync.assign(receivers, false);
      for (std::size_t d = 0; d < receivers; ++d) {
        resync[d] = behind[d] != 0;
        refused_repair[d] = refused[d] != 0;
      }
    };
    std::vector<bool> bad, resync;
    gather(bad, resync);
    if (fp8_) {
      verify_fp8(rep, bad, resync);
      return;
    }
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

  // FP8 receivers: BF16 as above for the tensors that stay BF16; per replica, every quantized
  // tensor's digest (codes and scales) must be the trainer ranks' summed share. No repair: a
  // receiver that refused or a replica that differs is reported, and the next publication is
  // full (the trainer ranks forget what the receivers hold).
  void verify_fp8(SyncReport& rep, std::vector<bool>& bad, const std::vector<bool>& resync) {
    const auto& it = recv_layout_->topology();
    const std::size_t per_replica = fp8_digest_.size();
    std::vector<Digest> held(static_cast<std::size_t>(it.replicas) * per_replica, 0);
    if (receiver_) {
      const auto r = static_cast<std::size_t>(receiver_->rank());
      const std::size_t replica = r / static_cast<std::size_t>(it.tp);
      const std::size_t ts = r % static_cast<std::size_t>(it.tp);
      const std::vector<Digest>& d = receiver_->fp8_digest();
      std::copy(
          d.begin(), d.end(),
          held.begin() + static_cast<std::ptrdiff_t>(replica * per_replica + ts * fp8_->tensors));
    }
    sum_fields(*transport_, "the FP8 digest verification", held);
    for (std::size_t t = 0; t < bad.size(); ++t) {
      if (fp8_->quantized_hf[t]) bad[t] = false;  // (held as FP8: checked below)
    }
    for (std::size_t r = 0; r < static_cast<std::size_t>(it.replicas); ++r) {
      for (std::size_t k = 0; k < per_replica; ++k) {
        if (held[r * per_replica + k] != fp8_digest_[k]) {
          rep.fp8_mismatched.push_back(fp8_->names[k] + " (replica " + std::to_string(r) + ")");
        }
      }
    }
    for (std::size_t t = 0; t < bad.size(); ++t) {
      if (bad[t]) rep.fp8_mismatched.push_back(hf_->name(static_cast<std::int64_t>(t)));
    }
    for (std::size_t d = 0; d < resync.size(); ++d) {
      if (resync[d]) rep.resynced.push_back(static_cast<std::int64_t>(d));
    }
    rep.verified = rep.fp8_mismatched.empty() && rep.resynced.empty();
    if (!rep.verified) {
      schedule_.require_full();
      if constexpr (requires(Sender & s) { s.fp8(); }) {
        if (sender_) sender_->fp8()->forget();
      }
    }
  }

  EngineConfig config_;
  PublicationSchedule schedule_;
  Version version_ = no_version;
  const layout::HfModel* hf_;
  const layout::ServingLayout* recv_layout_;
  Transport* transport_;
  std::optional<Sender> sender_;
  std::optional<Receiver> receiver_;
  std::vector<Digest> trainer_digest_;
  std::optional<Fp8World> fp8_;
  std::vector<Digest> fp8_digest_;  // per (TP rank, quantized tensor): summed over trainer ranks
  std::uint64_t fp8_sent_[2] = {0, 0};
  std::uint64_t dense_bytes_ = 0;
  double detect_s_ = 0;
  std::int64_t refused_by_ = -1;
  std::function<void(int, Version)> hook_;
};

}  // namespace dte
