// SPDX-License-Identifier: Apache-2.0
// A receiver rank (one SGLang TP rank of one replica) keeps tensors it does not own current: it
// is given views of the inference engine's own 16-bit tensors (in ServingLayout order), the
// version they hold, and its part of the verified-sync digest, kept per canonical tensor and
// updated from the values it overwrites (O(changed)). dte allocates nothing model-sized for it.
// Tensors in device memory are reached through a TensorSink (engine/device_receiver.cuh): the
// receiver checks a publication exactly as for host tensors, then hands the sink its writes.
//
// A Receiver is the receiver core (receive/core.hpp: the version chain, bounds, coverage of a
// full publication, the digest, the commit) with the wire v2 decoder in front of it. Other
// decoders hand it their StagedWrites directly (apply(StagedWrites&), with an FP8 rank's FP8
// parts: the publication receivers and the storage reader, which route canonical chunk entries
// through receive/route.hpp). Every door ends in one commit step (commit()).
//
// apply() is transactional: every message of the publication is decoded and checked first
// (framing, the commit rules below, tensor ids, index ranges); only then are values scattered in
// place and the version committed. A refused publication leaves tensors, version and digest
// untouched, and says why as a structured refusal (format, bounds or protocol).
//
// What the wire adds to the core's rules (docs/engine.md, "What a receiver commits"). Every
// trainer rank sends every receiver one message per publication, a bare header when it has
// nothing for it, so:
//   - version V commits only when exactly one message of version V has arrived from every
//     sender, all of one kind; a sender's message missing or doubled refuses the publication;
//   - messages of older versions (replays) are counted and ignored, and never count for V.
//
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/core/payload.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/fp8_core.hpp"
#include "dte/receive/fp8_part.hpp"
#include "dte/receive/staged.hpp"

namespace dte {

// Which class of refusal: what a caller can do about it (dte/error.hpp).
enum class RefusalKind {
  none,
  format,    // a message's bytes are corrupt: resync
  bounds,    // a message addresses an element it may not write: resync, report the sender
  protocol,  // wrong or older version, wrong base, a sender missing or doubled: retry/resync
};

struct ApplyResult {
  ApplyOutcome outcome = ApplyOutcome::refused;
  RefusalKind kind = RefusalKind::none;
  std::string refusal;        // why the publication was refused (empty otherwise)
  ErrorContext context;       // the receiver, the sender, the versions concerned
  std::uint64_t written = 0;  // element writes
  std::uint64_t stale = 0;    // messages of older versions ignored (replays)
  std::uint64_t bytes = 0;    // received

  [[nodiscard]] bool committed() const noexcept { return outcome == ApplyOutcome::committed; }
};

class Receiver {
 public:
  // `senders`: the trainer ranks of the world (ids 0 .. senders-1), every one of which sends
  // this receiver a message in every publication. tensors[k]: receiver tensor k of the layout
  // (layout[k].numel elements), owned by the caller.
  Receiver(const layout::HfModel& hf, const layout::ServingLayout& layout, std::int64_t rank,
           std::int64_t senders, ReceiverTensors tensors)
      : Receiver(hf, layout, rank, senders) {
    core_.hold(std::move(tensors));
  }

  // Tensors behind a sink (device memory): the sink holds them and their digest.
  Receiver(const layout::HfModel& hf, const layout::ServingLayout& layout, std::int64_t rank,
           std::int64_t senders, std::shared_ptr<TensorSink> sink)
      : Receiver(hf, layout, rank, senders) {
    core_.hold(std::move(sink));
  }

  // A rank that serves online FP8 (VllmBlockFp8; docs/fp8.md): bf16 as above with an empty view
  // for each quantized tensor, fp8 its codes and scales (layout::Fp8Grid::quantized_ids order).
  // Each message's attachment is that sender's FP8 part (engine/fp8_stage.hpp).
  Receiver(const layout::HfModel& hf, const layout::ServingLayout& layout, std::int64_t rank,
           std::int64_t senders, ReceiverTensors bf16, std::vector<receive::Fp8Tensor> fp8)
      : Receiver(hf, layout, rank, senders,
                 std::make_unique<layout::Fp8Grid>(layout, VllmBlockFp8::block_rows,
                                                   VllmBlockFp8::block_cols)) {
    core_.hold(std::move(bf16));
    fp8_.emplace(*grid_, "receiver " + std::to_string(rank), std::move(fp8));
  }

  [[nodiscard]] bool serves_fp8() const noexcept { return fp8_.has_value(); }
  // Per quantized tensor (FP8 ranks): the digest of its codes and scales.
  [[nodiscard]] const std::vector<Digest>& fp8_digest() const { return fp8_.value().digest(); }
  [[nodiscard]] std::string fp8_verify() const { return fp8_.value().verify(); }
  [[nodiscard]] const layout::Fp8Grid& fp8_grid() const { return fp8_.value().grid(); }

  [[nodiscard]] std::int64_t rank() const noexcept { return core_.rank(); }
  [[nodiscard]] Version version() const noexcept { return core_.version(); }
  // Host tensors only (a sink's tensors are device memory: read them there).
  [[nodiscard]] std::span<const std::uint16_t> tensor(std::int64_t id) const {
    return core_.tensor(id);
  }
  [[nodiscard]] bool has_sink() const noexcept { return core_.has_sink(); }
  // Per canonical tensor: the sum of h(canonical, bits) over this rank's copies of it.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return core_.digest(); }
  // Memory this receiver holds beyond the caller's tensors.
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return sizeof(*this) + core_.held_bytes();
  }
  [[nodiscard]] const receive::Core& core() const noexcept { return core_; }

  // Applies one publication (or repair) of `version`: all messages addressed to this rank, in
  // any sender order, decoded into this rank's staged writes and committed by the core.
  // fp8_expected (FP8 ranks): per quantized tensor, the digest the senders say it holds after
  // this publication (their shares summed); the publication is refused unless it does.
  ApplyResult apply(Version version, const Inbox& inbox,
                    std::span<const Digest> fp8_expected = {}) {
    ApplyResult res;
    res.context.rank = rank();
    res.context.version = version;
    res.context.held = core_.version();
    receive::StagedWrites w;
    std::vector<receive::Fp8Part> parts;
    try {
      if (!decode(version, inbox, res, w, parts)) {
        res.outcome = ApplyOutcome::current;
        return res;
      }
    } catch (const error& e) {
      refused(e, res);
      return res;  // nothing touched
    }
    const std::optional<std::uint64_t> written =
        commit(w, parts, fp8_expected, {}, [&](const error& e) { refused(e, res); });
    if (!written) return res;  // nothing touched
    res.written = *written;
    res.outcome = ApplyOutcome::committed;
    return res;
  }

  // Applies writes another decoder staged in this rank's coordinates (a chunk-v1 publication
  // routed through the layout): the chain, the checks and the commit of the core. Throws
  // (format_error, bounds_error, protocol_error) and leaves everything untouched on refusal;
  // `expected`: the digest this rank's tensors must hold afterwards. Returns current for a
  // re-delivery of the version held.
  ApplyOutcome apply(receive::StagedWrites& w, std::span<const Digest> expected = {}) {
    return staged(w, {}, {}, expected);
  }

  // The same on an FP8 rank, with the FP8 parts of the publication (decoded for this rank) and
  // fp8_expected: per quantized tensor, the digest it holds afterwards, else the publication is
  // refused.
  ApplyOutcome apply(receive::StagedWrites& w, std::span<const receive::Fp8Part> parts,
                     std::span<const Digest> fp8_expected) {
    if (!fp8_) {
      throw invalid_argument(core_.who() + ": FP8 parts given, but this receiver holds no FP8 " +
                             "tensors");
    }
    return staged(w, parts, fp8_expected, {});
  }

 private:
  // What both public constructors share: the layout's sizes, the checks on the arguments.
  Receiver(const layout::HfModel& hf, const layout::ServingLayout& layout, std::int64_t rank,
           std::int64_t senders, std::unique_ptr<layout::Fp8Grid> grid = nullptr)
      : hf_(&hf),
        layout_(&layout),
        ts_(rank % layout.topology().tp),
        senders_(senders),
        grid_(std::move(grid)),
        core_(make_core(hf, layout, rank, grid_.get())) {
    if (senders < 1) {
      throw invalid_argument("Receiver " + std::to_string(rank) + ": needs at least one sender");
    }
  }

  // (grid: FP8 ranks hold no BF16 element of a quantized tensor: numel 0 there)
  static receive::Core make_core(const layout::HfModel& hf, const layout::ServingLayout& layout,
                                 std::int64_t rank, const layout::Fp8Grid* grid = nullptr) {
    const std::int64_t ts = rank % layout.topology().tp;
    std::vector<std::uint64_t> numel, live;
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      const bool q = grid != nullptr && grid->quantized(k);
      numel.push_back(q ? 0 : static_cast<std::uint64_t>(layout[k].numel));
      live.push_back(q ? 0 : static_cast<std::uint64_t>(layout.live_end(ts, k)));
    }
    return receive::Core(
        "receiver " + std::to_string(rank), rank, std::move(numel), std::move(live),
        static_cast<std::size_t>(hf.size()), [&layout](std::int64_t k) { return layout.name(k); },
        [&hf](std::int64_t t) { return hf.name(t); });
  }

  // Staged writes and FP8 parts: the chain, then the commit step.
  ApplyOutcome staged(receive::StagedWrites& w, std::span<const receive::Fp8Part> parts,
                      std::span<const Digest> fp8_expected, std::span<const Digest> expected) {
    if (core_.chain(w.kind, w.version, w.base)) return ApplyOutcome::current;
    (void)commit(w, parts, fp8_expected, expected, [](const error&) { throw; });
    return ApplyOutcome::committed;
  }

  // The commit step of every door, after the version chain: the core's checks and the FP8
  // parts' (nothing is written before both pass); the FP8 writes, undone unless each quantized
  // tensor's digest is then fp8_expected's (when given); the BF16 writes and the version,
  // undone unless the digest is then `expected`'s (when given; a door gives it without FP8
  // parts, whose writes it could not undo). A refusal before the BF16 commit goes to
  // on_refusal(e), called while e is handled: it rethrows or returns, and then this returns
  // nothing, everything untouched. Returns the element writes.
  template <class Refused>
  std::optional<std::uint64_t> commit(receive::StagedWrites& w,
                                      std::span<const receive::Fp8Part> parts,
                                      std::span<const Digest> fp8_expected,
                                      std::span<const Digest> expected, Refused&& on_refusal) {
    std::uint64_t n = 0;
    try {
      core_.check(w);
      if (fp8_) {
        fp8_->check(parts, w.full());
        n = fp8_->commit(parts, w.full(), fp8_expected);
      }
    } catch (const error& e) {
      on_refusal(e);
      return std::nullopt;
    }
    core_.commit(w, expected);
    return n + w.size();
  }

  static void refused(const error& e, ApplyResult& res) {
    res.refusal = e.what();
    res.kind = dynamic_cast<const protocol_error*>(&e) != nullptr ? RefusalKind::protocol
               : dynamic_cast<const bounds_error*>(&e) != nullptr ? RefusalKind::bounds
                                                                  : RefusalKind::format;
    const ErrorContext& c = e.context();
    if (c.peer >= 0) res.context.peer = c.peer;
    res.context.source = c.source;
    res.context.field = c.field;
  }

  [[noreturn]] void refuse(const std::string& what, std::int64_t sender, Version version) const {
    throw protocol_error(what, core_.context(sender, version));
  }

  // The wire's rules (one message from every sender, one kind, replays ignored), the core's
  // version chain, then every accepted message's writes into w. False: a re-delivery of the
  // version held.
  bool decode(Version version, const Inbox& inbox, ApplyResult& res, receive::StagedWrites& w,
              std::vector<receive::Fp8Part>& parts) {
    const std::string me = "receiver " + std::to_string(rank());
    if (version == no_version) (void)core_.chain(MessageKind::full, version, no_version);
    std::vector<std::pair<std::int64_t, wire::MessageView>> accepted;  // (sender, message)
    std::vector<std::uint8_t> from(static_cast<std::size_t>(senders_), 0);
    std::optional<MessageKind> kind;
    for (const auto& [src, bytes] : inbox) {
      res.bytes += bytes.size();
      const std::string who = me + ", message from sender " + std::to_string(src);
      if (src < 0 || src >= senders_) {
        refuse(who + ": there is no such sender (the world has " + std::to_string(senders_) + ")",
               src, version);
      }
      wire::MessageView m(
          bytes, "sender " + std::to_string(src) + " to receiver " + std::to_string(rank()));
      if (m.version() < version) {
        ++res.stale;  // a replay of an older publication: ignored, it changes nothing
        continue;
      }
      if (m.version() > version) {
        refuse(who + ": version " + std::to_string(m.version()) + " arrived while " +
                   std::to_string(version) + " is being applied",
               src, m.version());
      }
      if (kind && m.kind() != *kind) {
        refuse(who + ": a " + receive::kind_name(m.kind()) + " message in a publication whose " +
                   "other messages are " + receive::kind_name(*kind),
               src, version);
      }
      kind = m.kind();
      if (from[static_cast<std::size_t>(src)]++ != 0) {
        refuse(who + ": a second message of version " + std::to_string(version) +
                   " from the same sender",
               src, version);
      }
      accepted.emplace_back(src, m);
    }
    if (kind != MessageKind::repair) {
      // Never backwards; the version held again is a no-op; then every sender must be there.
      const Version held = core_.version();
      if (held != no_version && version <= held &&
          core_.chain(kind.value_or(MessageKind::delta), version, held)) {
        return false;
      }
      for (std::int64_t s = 0; s < senders_; ++s) {
        if (from[static_cast<std::size_t>(s)] == 0) {
          refuse(me + ": no message of version " + std::to_string(version) + " from sender " +
                     std::to_string(s) +
                     " (every trainer rank sends every receiver one per publication); "
                     "nothing applied, a resync is needed",
                 s, version);
        }
      }
    }
    for (const auto& [src, m] : accepted)
      (void)core_.chain(m.kind(), version, m.base(), src);
    w.kind = kind.value_or(MessageKind::delta);
    w.version = version;
    w.base = accepted.empty() ? no_version : accepted.front().second.base();
    std::size_t n = 0;
    for (const auto& [src, m] : accepted)
      n += m.entry_count();
    w.index.reserve(n);
    w.key.reserve(n);
    for (const auto& message : accepted) {
      const std::int64_t src = message.first;  // (clang < 16 cannot capture a binding)
      const wire::MessageView& m = message.second;
      if (!m.attachment().empty()) {
        const std::string from = me + ", FP8 part from sender " + std::to_string(src);
        if (!fp8_) refuse(from + ": this receiver holds no FP8 tensors", src, version);
        parts.push_back(
            receive::decode_fp8_part(*grid_, VllmBlockFp8::name, m.attachment(), from,
                                     {version, m.base(), static_cast<std::uint32_t>(ts_)}));
      }
      m.for_each_entry([&](const DeltaEntry& e) {
        const Source c = source(e.tensor, e.index);
        w.push(e.tensor, c.tensor, e.index, e.bits, detail::digest_key(c.global), src);
      });
      m.for_each_run([&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len,
                         const std::byte* bits) {
        for (std::uint32_t j = 0; j < len;) {
          const Source c = source(tensor, index + j);
          const auto run = static_cast<std::uint32_t>(
              std::min<std::uint64_t>(len - j, c.end - (std::uint64_t{index} + j)));
          w.push_run(tensor, c.tensor, index + j, c.global, bits + 2 * std::size_t{j}, run, src);
          j += run;
        }
      });
    }
    return true;
  }

  // The canonical element receiver element (tensor, index) of this rank holds: its canonical
  // tensor (an id past the model's for the vocabulary padding or an element that does not
  // exist: the core refuses those) and global index, and where the run of receiver elements
  // holding consecutive canonical elements ends. One layout lookup per such run.
  struct Source {
    std::uint32_t tensor;
    std::int64_t global;
    std::uint64_t end;
  };
  Source source(std::uint32_t tensor, std::uint32_t index) {
    if (tensor != run_tensor_ || index < run_start_ || index >= run_end_) {
      run_tensor_ = tensor;
      run_start_ = index;
      const auto none = static_cast<std::uint32_t>(hf_->size());
      if (tensor >= static_cast<std::uint64_t>(layout_->size()) ||
          index >= static_cast<std::uint64_t>((*layout_)[tensor].numel)) {
        run_canonical_ = {none, 0};
        run_end_ = std::uint64_t{index} + 1;
      } else {
        const layout::Canonical c = layout_->source({ts_, tensor, index});
        if (c.tensor < 0) {
          run_canonical_ = {none, 0};
          run_end_ = static_cast<std::uint64_t>((*layout_)[tensor].numel);
        } else {
          run_canonical_ = {static_cast<std::uint32_t>(c.tensor), (*hf_)[c.tensor].base + c.index};
          run_end_ = std::uint64_t{index} +
                     static_cast<std::uint64_t>(std::max<std::int64_t>(1, layout_->contiguous(c)));
        }
      }
    }
    return {run_canonical_.first,
            run_canonical_.second + static_cast<std::int64_t>(index - run_start_), run_end_};
  }

  const layout::HfModel* hf_;
  const layout::ServingLayout* layout_;
  std::int64_t ts_;
  std::int64_t senders_;
  std::unique_ptr<layout::Fp8Grid> grid_;  // FP8 ranks
  receive::Core core_;
  std::optional<receive::Fp8Core> fp8_;
  // The run source() found last.
  std::uint32_t run_tensor_ = ~std::uint32_t{0};
  std::uint64_t run_start_ = 0, run_end_ = 0;
  std::pair<std::uint32_t, std::int64_t> run_canonical_{0, 0};
};

}  // namespace dte
