// SPDX-License-Identifier: Apache-2.0
// A receiver rank (one SGLang TP rank of one replica) keeps tensors it does not own current: it
// is given views of the inference engine's own 16-bit tensors (in SglangLayout order), the
// version they hold, and its part of the verified-sync digest, kept per canonical tensor and
// updated from the values it overwrites (O(changed)). dte allocates nothing model-sized for it.
// Tensors in device memory are reached through a TensorSink (engine/device_receiver.cuh): the
// receiver checks a publication exactly as for host tensors, then hands the sink its writes.
//
// apply() is transactional: every message of the publication is decoded and checked first
// (framing, the commit rules below, tensor ids, index ranges); only then are values scattered in
// place and the version committed. A refused publication leaves tensors, version and digest
// untouched, and says why as a structured refusal (format, bounds or protocol).
//
// The commit rules (docs/engine.md, "What a receiver commits"). Every trainer rank sends every
// receiver one message per publication, a bare header when it has nothing for it, so:
//   - version V commits only when exactly one message of version V has arrived from every
//     sender, all of one kind; a sender's message missing or doubled refuses the publication;
//   - messages of older versions (replays) are counted and ignored, and never count for V;
//   - a receiver never moves backwards: V older than the version held is refused; V equal to
//     it is a re-delivery, an idempotent no-op reported as ApplyOutcome::current;
//   - a delta (or no-op) needs base == the version held, which must be a real version: a
//     fresh receiver accepts only a full publication;
//   - a full publication writes every live element exactly once (the digest is rebuilt from
//     it); a repair rewrites elements within the version held (from the senders holding them);
//   - no message may write the vocabulary padding (elements beyond vocab_size), which the
//     digest does not cover.
//
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/engine/digest.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/transport/payload.hpp"

namespace dte {

enum class ApplyOutcome {
  committed,  // the publication was applied and its version is now held
  current,    // a re-delivery of the version already held: nothing changed
  refused,    // nothing changed; `refusal` says why
};

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

// One receiver rank's tensors: views[k] is receiver tensor k of the layout (layout[k].numel
// elements), owned by the caller.
using ReceiverTensors = std::vector<std::span<std::uint16_t>>;

// Every write of one committed publication, in message order.
struct WriteBatch {
  std::vector<std::uint32_t> tensor, index;
  std::vector<std::uint16_t> bits;
  bool full = false;  // a full publication: the digest is rebuilt from these writes alone

  void push(std::uint32_t t, std::uint32_t i, std::uint16_t b) {
    tensor.push_back(t);
    index.push_back(i);
    bits.push_back(b);
  }
};

// Receiver tensors the host cannot write (device memory). commit() writes a batch the receiver
// has checked in full and moves the sink's digest (per canonical tensor, of the tensors'
// contents) by what it overwrote and wrote; digest() reads it.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  virtual void commit(const WriteBatch& batch) = 0;
  [[nodiscard]] virtual std::vector<Digest> digest() const = 0;
};

class Receiver {
 public:
  // `senders`: the trainer ranks of the world (ids 0 .. senders-1), every one of which sends
  // this receiver a message in every publication.
  Receiver(const layout::HfModel& hf, const layout::SglangLayout& layout, std::int64_t rank,
           std::int64_t senders, ReceiverTensors tensors)
      : Receiver(hf, layout, rank, senders) {
    tensors_ = std::move(tensors);
    if (static_cast<std::int64_t>(tensors_.size()) != layout.size()) {
      throw invalid_argument("Receiver " + std::to_string(rank) + ": given " +
                             std::to_string(tensors_.size()) + " tensors, the layout has " +
                             std::to_string(layout.size()) +
                             "; pass one view per receiver tensor, in SglangLayout order");
    }
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      const auto n = static_cast<std::size_t>(layout[k].numel);
      if (tensors_[static_cast<std::size_t>(k)].size() != n) {
        throw invalid_argument("Receiver " + std::to_string(rank) + ": tensor " + layout.name(k) +
                               " has " +
                               std::to_string(tensors_[static_cast<std::size_t>(k)].size()) +
                               " elements, the layout says " + std::to_string(n) +
                               " (receiver TP rank " + std::to_string(ts_) + ")");
      }
    }
  }

  // Tensors behind a sink (device memory): the sink holds them and their digest.
  Receiver(const layout::HfModel& hf, const layout::SglangLayout& layout, std::int64_t rank,
           std::int64_t senders, std::shared_ptr<TensorSink> sink)
      : Receiver(hf, layout, rank, senders) {
    if (!sink) {
      throw invalid_argument("Receiver " + std::to_string(rank) +
                             ": the tensor sink is null; pass the device tensors' sink");
    }
    sink_ = std::move(sink);
    digest_ = sink_->digest();
    if (digest_.size() != static_cast<std::size_t>(hf.size())) {
      throw invalid_argument("Receiver " + std::to_string(rank) + ": the tensor sink keeps " +
                             std::to_string(digest_.size()) + " digests, the model has " +
                             std::to_string(hf.size()) + " canonical tensors");
    }
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  // Host tensors only (a sink's tensors are device memory: read them there).
  [[nodiscard]] std::span<const std::uint16_t> tensor(std::int64_t id) const {
    if (sink_) {
      throw invalid_argument("Receiver " + std::to_string(rank_) +
                             ": its tensors are behind a sink (device memory); read them there");
    }
    return tensors_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] bool has_sink() const noexcept { return sink_ != nullptr; }
  // Per canonical tensor: the sum of h(canonical, bits) over this rank's copies of it.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }
  // Memory this receiver holds beyond the caller's tensors.
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return sizeof(*this) + digest_.capacity() * sizeof(Digest) +
           (live_end_.capacity() + numel_.capacity()) * sizeof(std::uint64_t) +
           tensors_.capacity() * sizeof(tensors_[0]);
  }

  // Applies one publication (or repair) of `version`: all messages addressed to this rank, in
  // any sender order, read in place: no memory beyond what was received and one view per
  // message.
  ApplyResult apply(Version version, const Inbox& inbox) {
    ApplyResult res;
    res.context.rank = rank_;
    res.context.version = version;
    res.context.held = version_;
    std::vector<std::pair<std::int64_t, wire::MessageView>> accepted;  // (sender, message)
    bool full = false;
    try {
      if (version == no_version) {
        refuse("receiver " + std::to_string(rank_) +
                   ": version 2^64 - 1 is reserved (no_version: a receiver that holds nothing)",
               -1, version);
      }
      std::vector<std::uint8_t> from(static_cast<std::size_t>(senders_), 0);
      std::optional<MessageKind> kind;
      for (const auto& [src, bytes] : inbox) {
        res.bytes += bytes.size();
        const std::string who =
            "receiver " + std::to_string(rank_) + ", message from sender " + std::to_string(src);
        if (src < 0 || src >= senders_) {
          refuse(who + ": there is no such sender (the world has " + std::to_string(senders_) + ")",
                 src, version);
        }
        wire::MessageView m(
            bytes, "sender " + std::to_string(src) + " to receiver " + std::to_string(rank_));
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
          refuse(who + ": a " + kind_name(m.kind()) + " message in a publication whose other " +
                     "messages are " + kind_name(*kind),
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
      if (kind == MessageKind::repair) {
        if (version_ != version) {
          refuse("receiver " + std::to_string(rank_) + ": a repair of version " +
                     std::to_string(version) + " but this receiver holds " + held_name(),
                 -1, version);
        }
      } else {
        // A publication. Never backwards; the version held again is a no-op.
        if (version_ != no_version && version < version_) {
          refuse("receiver " + std::to_string(rank_) + ": version " + std::to_string(version) +
                     " is older than the version " + std::to_string(version_) +
                     " this receiver holds; a receiver never moves backwards",
                 -1, version);
        }
        if (version_ != no_version && version == version_) {
          res.outcome = ApplyOutcome::current;
          return res;
        }
        for (std::int64_t s = 0; s < senders_; ++s) {
          if (from[static_cast<std::size_t>(s)] == 0) {
            refuse("receiver " + std::to_string(rank_) + ": no message of version " +
                       std::to_string(version) + " from sender " + std::to_string(s) +
                       " (every trainer rank sends every receiver one per publication); "
                       "nothing applied, a resync is needed",
                   s, version);
          }
        }
      }
      for (const auto& [src, m] : accepted)
        check(m, src, version);
      full = kind == MessageKind::full;
      if (full) check_cover(accepted, version);
    } catch (const error& e) {
      res.refusal = e.what();
      res.kind = dynamic_cast<const protocol_error*>(&e) != nullptr ? RefusalKind::protocol
                 : dynamic_cast<const bounds_error*>(&e) != nullptr ? RefusalKind::bounds
                                                                    : RefusalKind::format;
      const ErrorContext& c = e.context();
      if (c.peer >= 0) res.context.peer = c.peer;
      res.context.source = c.source;
      res.context.field = c.field;
      return res;  // nothing touched
    }
    // The digest is the digest of the tensors' contents: a full publication (checked above to
    // write every live element exactly once) rebuilds it from the values written; every other
    // write updates it, subtracting the term of the value it overwrites.
    // Every write of the accepted messages, in message order: to the host tensors in place, or
    // collected for the sink, which writes them all at once.
    auto each_write = [&](auto&& put) {
      for (const auto& [src, m] : accepted) {
        m.for_each_entry([&](const DeltaEntry& e) { put(e.tensor, e.index, e.bits); });
        m.for_each_run([&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len,
                           const std::byte* bits) {
          for (std::uint32_t i = 0; i < len; ++i) {
            std::uint16_t b;
            std::memcpy(&b, bits + 2 * static_cast<std::size_t>(i), 2);
            put(tensor, index + i, b);
          }
        });
        res.written += m.entry_count() + m.run_elements();
      }
    };
    if (sink_) {
      WriteBatch batch;  // the publication's staging, not held between publications
      batch.full = full;
      each_write([&](std::uint32_t t, std::uint32_t i, std::uint16_t b) { batch.push(t, i, b); });
      sink_->commit(batch);
      digest_ = sink_->digest();
    } else {
      if (full) std::fill(digest_.begin(), digest_.end(), Digest{0});
      each_write([&](std::uint32_t t, std::uint32_t i, std::uint16_t b) { write(t, i, b, full); });
    }
    version_ = version;
    res.outcome = ApplyOutcome::committed;
    return res;
  }

 private:
  // What both public constructors share: the layout's sizes, the checks on the arguments.
  Receiver(const layout::HfModel& hf, const layout::SglangLayout& layout, std::int64_t rank,
           std::int64_t senders)
      : hf_(&hf),
        layout_(&layout),
        rank_(rank),
        ts_(rank % layout.topology().tp),
        senders_(senders) {
    if (senders < 1) {
      throw invalid_argument("Receiver " + std::to_string(rank) + ": needs at least one sender");
    }
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      numel_.push_back(static_cast<std::uint64_t>(layout[k].numel));
      live_end_.push_back(static_cast<std::uint64_t>(layout.live_end(ts_, k)));
    }
    digest_.assign(static_cast<std::size_t>(hf.size()), 0);
  }

  static std::string kind_name(MessageKind k) {
    switch (k) {
      case MessageKind::delta:
        return "delta";
      case MessageKind::noop:
        return "no-op";
      case MessageKind::full:
        return "full";
      case MessageKind::repair:
        return "repair";
    }
    return "?";
  }

  [[nodiscard]] std::string held_name() const {
    return version_ == no_version ? std::string("nothing yet") : std::to_string(version_);
  }

  // What a refusal of this receiver is about (`field`: the tensor, when there is one).
  [[nodiscard]] ErrorContext context(std::int64_t sender, Version version,
                                     std::string field = {}) const {
    ErrorContext c;
    c.field = std::move(field);
    c.rank = rank_;
    c.peer = sender;
    c.version = version;
    c.held = version_;
    return c;
  }

  [[noreturn]] void refuse(const std::string& what, std::int64_t sender, Version version) const {
    throw protocol_error(what, context(sender, version));
  }

  // The per-message rules once the publication is complete: base, no-op emptiness, and every
  // group inside the live part of an existing tensor.
  void check(const wire::MessageView& m, std::int64_t src, Version version) const {
    const std::string who =
        "receiver " + std::to_string(rank_) + ", message from sender " + std::to_string(src);
    const auto base = [&] {
      return m.base() == no_version ? std::string("none") : std::to_string(m.base());
    };
    if (m.kind() == MessageKind::delta || m.kind() == MessageKind::noop) {
      if (version_ == no_version) {
        refuse(who + ": a " + kind_name(m.kind()) + " on base version " + base() +
                   " but this receiver holds nothing yet; it needs a full publication first",
               src, version);
      }
      if (m.base() != version_) {
        refuse(who + ": delta on base version " + base() + " but this receiver holds " +
                   held_name() + "; refused, a full resync is needed",
               src, version);
      }
    }
    if (m.kind() == MessageKind::noop && (m.entry_count() != 0 || m.run_count() != 0)) {
      refuse(who + ": a no-op version carries elements", src, version);
    }
    m.for_each_group([&](const wire::Group& g) {
      if (g.tensor >= numel_.size()) {
        throw bounds_error(who + ": tensor id " + std::to_string(g.tensor) + " does not exist (" +
                               std::to_string(numel_.size()) + " tensors)",
                           context(src, version));
      }
      if (g.last >= numel_[g.tensor]) {
        throw bounds_error(who + ": index " + std::to_string(g.last) + " is outside " +
                               layout_->name(g.tensor) + " (" + std::to_string(numel_[g.tensor]) +
                               " elements)",
                           context(src, version, layout_->name(g.tensor)));
      }
      if (g.last >= live_end_[g.tensor]) {
        throw bounds_error(
            who + ": index " + std::to_string(g.last) + " of " + layout_->name(g.tensor) +
                " lies in the vocabulary padding (elements " + std::to_string(live_end_[g.tensor]) +
                " to " + std::to_string(numel_[g.tensor]) + "), which no message may write",
            context(src, version, layout_->name(g.tensor)));
      }
    });
  }

  // A full publication must write every live element of this receiver exactly once: its groups
  // (all messages together) pairwise disjoint and their counts summing to the live elements.
  // Then its digest is exact; the check needs memory per group, nothing per element.
  void check_cover(const std::vector<std::pair<std::int64_t, wire::MessageView>>& accepted,
                   Version version) const {
    struct Span {
      std::uint32_t tensor, first, last;
      std::int64_t src;
    };
    std::vector<Span> spans;
    std::uint64_t written = 0;
    for (const auto& message : accepted) {
      const std::int64_t src = message.first;  // (clang < 16 cannot capture a binding)
      message.second.for_each_group([&](const wire::Group& g) {
        spans.push_back({g.tensor, g.first, g.last, src});
        written += g.count;
      });
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.tensor != b.tensor ? a.tensor < b.tensor : a.first < b.first;
    });
    for (std::size_t i = 1; i < spans.size(); ++i) {
      const Span& a = spans[i - 1];
      const Span& b = spans[i];
      if (a.tensor == b.tensor && b.first <= a.last) {
        refuse("receiver " + std::to_string(rank_) + ": the full publication of version " +
                   std::to_string(version) + " writes elements " + std::to_string(b.first) +
                   " to " + std::to_string(std::min(a.last, b.last)) + " of " +
                   layout_->name(a.tensor) + " twice (senders " + std::to_string(a.src) + " and " +
                   std::to_string(b.src) + ")",
               b.src, version);
      }
    }
    std::uint64_t live = 0;
    for (std::uint64_t n : live_end_)
      live += n;
    if (written != live) {
      refuse("receiver " + std::to_string(rank_) + ": the full publication of version " +
                 std::to_string(version) + " writes " + std::to_string(written) + " of the " +
                 std::to_string(live) + " live elements this receiver holds; refused",
             -1, version);
    }
  }

  void write(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits, bool fresh) {
    std::uint16_t& cell = tensors_[tensor][index];
    // Every element a message may write holds a canonical element (check() refuses the
    // padding), so the digest covers every write.
    const layout::Canonical c = layout_->source({ts_, tensor, index});
    if (c.tensor >= 0) {
      const std::int64_t g = (*hf_)[c.tensor].base + c.index;
      const auto t = static_cast<std::size_t>(c.tensor);
      digest_[t] += element_digest(g, bits) - (fresh ? 0 : element_digest(g, cell));
    }
    cell = bits;
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* layout_;
  std::int64_t rank_;
  std::int64_t ts_;
  std::int64_t senders_;
  Version version_ = no_version;
  ReceiverTensors tensors_;              // host tensors, or
  std::shared_ptr<TensorSink> sink_;     // device tensors
  std::vector<std::uint64_t> numel_;     // per tensor
  std::vector<std::uint64_t> live_end_;  // per tensor: elements beyond it are padding
  std::vector<Digest> digest_;
};

}  // namespace dte
