// SPDX-License-Identifier: Apache-2.0
// Receivers of publication messages (publication/message.hpp), over the caller's BF16 tensors:
//   HfReceiver     the whole model as HF tensors (a served HF/PyTorch model: one view per HF
//                  tensor, in HfModel order);
//   ShardReceiver  one SGLang TP rank's tensors (SglangLayout order), through the engine's own
//                  Receiver (engine/receiver.hpp): the same commit rules and checks.
// Both are transactional: every chunk is decoded and checked first (framing, checksums, the
// header, the version chain, indices, for a full publication every element exactly once) and
// only then are values written and the version committed; a refusal throws (format_error,
// bounds_error, protocol_error) and leaves tensors, version and digest untouched.
//
// The version chain, as for the engine's receivers: a fresh receiver accepts only a full
// publication; a delta needs base == the version held; the version held again is an idempotent
// re-delivery (outcome current); an older version is refused (a receiver never moves back).
//
// An HfReceiver also checks the result before writing: from the digest it keeps per canonical
// tensor and the values it is about to overwrite, it computes the digest the tensors will have
// and refuses the publication unless it equals the trainer's (the manifest's) for every tensor.
// An element the publication overwrites that was changed behind dte's back, a lost or reordered
// write, a wrong base: refused, nothing written. verify() recomputes the digest from the whole
// tensors (O(model)) and finds changes anywhere. A ShardReceiver holds a part of each tensor and
// cannot compare alone; check_replica() compares a whole replica's ranks with the trainer's digest.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dte/engine/digest.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/publication/message.hpp"

namespace dte::publication {

// What one apply did.
struct ApplyReport {
  ApplyOutcome outcome = ApplyOutcome::committed;  // committed, or current (a re-delivery)
  Version version = no_version;                    // held after
  Version base = no_version;                       // the message's (no_version: full)
  std::uint64_t written = 0;                       // element writes
  std::uint64_t bytes = 0;                         // the message
  double seconds = 0;
  [[nodiscard]] bool full() const noexcept { return base == no_version; }
  [[nodiscard]] bool committed() const noexcept { return outcome == ApplyOutcome::committed; }
};

namespace detail {

// The version chain check common to both receivers; true: a re-delivery of the version held.
inline bool redelivery(const storage::Manifest& m, Version held, const std::string& who) {
  if (held != no_version && m.version == held) return true;
  if (held != no_version && m.version < held) {
    throw protocol_error(who + ": version " + std::to_string(m.version) +
                         " is older than the version " + std::to_string(held) +
                         " held; a receiver never moves backwards");
  }
  if (!m.anchor()) {
    if (held == no_version) {
      throw protocol_error(who + ": version " + std::to_string(m.version) +
                           " is a delta and this receiver holds nothing yet; apply a full "
                           "publication first (TorchPublisher.publish_full())");
    }
    if (m.base != held) {
      throw protocol_error(who + ": version " + std::to_string(m.version) + " applies to version " +
                           std::to_string(m.base) + ", this receiver holds " +
                           std::to_string(held) +
                           "; apply the versions in between in order, or a full publication");
    }
  }
  return false;
}

// Each tensor's indices increase over the publication's chunks (the publisher writes them in
// order), so no element is written twice; a full publication covers every element.
inline void check_coverage(const layout::HfModel& hf, const storage::Manifest& m,
                           const std::vector<storage::Chunk>& chunks, const std::string& who) {
  const auto n = static_cast<std::size_t>(hf.size());
  std::vector<std::int64_t> last(n, -1);
  std::vector<std::uint64_t> count(n, 0);
  for (const storage::Chunk& c : chunks) {
    if (m.anchor() && c.encoding != storage::Encoding::value) {
      throw format_error(who + ": a full publication's chunk " + std::to_string(c.header.chunk) +
                         " is diff-encoded; a full publication carries values");
    }
    for (const storage::TensorDelta& d : c.tensors) {
      const auto t = static_cast<std::size_t>(d.tensor);
      if (d.index.empty()) continue;
      if (static_cast<std::int64_t>(d.index.front()) <= last[t]) {
        throw protocol_error(who + ": tensor " + hf.name(d.tensor) + " element " +
                             std::to_string(d.index.front()) + " in chunk " +
                             std::to_string(c.header.chunk) +
                             " comes again or out of order; each element is written once");
      }
      last[t] = d.index.back();
      count[t] += d.index.size();
    }
  }
  if (!m.anchor()) return;
  for (std::size_t t = 0; t < n; ++t) {
    const auto numel = static_cast<std::uint64_t>(hf[static_cast<std::int64_t>(t)].numel());
    if (count[t] != numel) {
      throw protocol_error(who + ": the full publication v" + std::to_string(m.version) +
                           " writes " + std::to_string(count[t]) + " of the " +
                           std::to_string(numel) + " elements of " +
                           hf.name(static_cast<std::int64_t>(t)) + "; it must write every one");
    }
  }
}

// A message read for a receiver holding `held`: decoded, on the version chain, every chunk
// decoded and covering what it must. Nothing for a re-delivery of the version held (rep says
// current); rep's base and bytes are filled either way.
struct Staged {
  storage::Manifest manifest;
  std::vector<storage::Chunk> chunks;
};

inline std::optional<Staged> stage(const layout::HfModel& hf, std::span<const std::byte> bytes,
                                   Version held, const std::string& who, ApplyReport& rep) {
  View v = decode(hf, bytes, "publication");
  rep.base = v.manifest.base;
  rep.bytes = bytes.size();
  if (redelivery(v.manifest, held, who)) {
    rep.outcome = ApplyOutcome::current;
    rep.version = held;
    return std::nullopt;
  }
  std::vector<storage::Chunk> cs =
      chunks(hf, v, "publication v" + std::to_string(v.manifest.version));
  check_coverage(hf, v.manifest, cs, who);
  return Staged{std::move(v.manifest), std::move(cs)};
}

}  // namespace detail

class HfReceiver {
 public:
  // tensors[t]: HF tensor t of `model` (HfModel order), hf[t].numel() BF16 values each.
  HfReceiver(const layout::ModelSpec& model, std::vector<std::span<std::uint16_t>> tensors)
      : spec_(named_by_structure(model)), hf_(spec_), tensors_(std::move(tensors)) {
    if (static_cast<std::int64_t>(tensors_.size()) != hf_.size()) {
      throw invalid_argument("HfReceiver: given " + std::to_string(tensors_.size()) +
                             " tensors, the model has " + std::to_string(hf_.size()) +
                             "; pass one view per HF tensor, in model order");
    }
    for (std::int64_t t = 0; t < hf_.size(); ++t) {
      const auto n = static_cast<std::size_t>(hf_[t].numel());
      if (tensors_[static_cast<std::size_t>(t)].size() != n) {
        throw invalid_argument("HfReceiver: tensor " + hf_.name(t) + " has " +
                               std::to_string(tensors_[static_cast<std::size_t>(t)].size()) +
                               " elements, the model " + std::to_string(n));
      }
    }
    digest_.assign(static_cast<std::size_t>(hf_.size()), 0);
  }

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  // Per canonical tensor, of the tensors' contents (valid once a full publication committed).
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }

  // The first tensor whose contents differ from what dte wrote into it ("" if none, or if
  // nothing is held yet): the digest recomputed from every element.
  [[nodiscard]] std::string verify() const {
    if (version_ == no_version) return {};
    for (std::int64_t t = 0; t < hf_.size(); ++t) {
      Digest sum = 0;
      const std::span<const std::uint16_t> x = tensors_[static_cast<std::size_t>(t)];
      for (std::size_t i = 0; i < x.size(); ++i)
        sum += element_digest(hf_[t].base + static_cast<std::int64_t>(i), x[i]);
      if (sum != digest_[static_cast<std::size_t>(t)]) return hf_.name(t);
    }
    return {};
  }

  ApplyReport apply(std::span<const std::byte> bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string who = "HfReceiver (holding " + held_text() + ")";
    ApplyReport rep;
    const std::optional<detail::Staged> staged = detail::stage(hf_, bytes, version_, who, rep);
    if (!staged) return rep;
    const storage::Manifest& m = staged->manifest;
    const std::vector<storage::Chunk>& cs = staged->chunks;
    // The digest after the writes, from the values they overwrite; the diff encoding's values
    // are decoded against them.
    std::vector<Digest> after = m.anchor() ? std::vector<Digest>(digest_.size(), 0) : digest_;
    for (const storage::Chunk& c : cs) {
      for (const storage::TensorDelta& d : c.tensors) {
        const auto t = static_cast<std::size_t>(d.tensor);
        const std::int64_t base = hf_[d.tensor].base;
        const std::span<std::uint16_t> x = tensors_[t];
        Digest& sum = after[t];
        for (std::size_t k = 0; k < d.index.size(); ++k) {
          const std::uint32_t i = d.index[k];
          const std::uint16_t old = x[i];
          const std::uint16_t bits = storage::decode_value(c.encoding, old, d.bits[k]);
          if (!m.anchor()) sum -= element_digest(base + i, old);
          sum += element_digest(base + i, bits);
        }
      }
    }
    for (std::size_t t = 0; t < after.size(); ++t) {
      if (after[t] != m.digest[t]) {
        throw protocol_error(
            who + ": after version " + std::to_string(m.version) + " tensor " +
            hf_.name(static_cast<std::int64_t>(t)) +
            " would differ from the trainer's (digest mismatch): these tensors are not version " +
            std::to_string(m.base) +
            " as dte wrote it (written outside dte?). Nothing was written; apply a full "
            "publication (TorchPublisher.publish_full())");
      }
    }
    for (const storage::Chunk& c : cs) {
      for (const storage::TensorDelta& d : c.tensors) {
        const std::span<std::uint16_t> x = tensors_[static_cast<std::size_t>(d.tensor)];
        for (std::size_t k = 0; k < d.index.size(); ++k) {
          std::uint16_t& e = x[d.index[k]];
          e = storage::decode_value(c.encoding, e, d.bits[k]);
        }
        rep.written += d.index.size();
      }
    }
    digest_ = std::move(after);
    version_ = m.version;
    rep.version = version_;
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

 private:
  [[nodiscard]] std::string held_text() const {
    return version_ == no_version ? std::string("nothing") : "v" + std::to_string(version_);
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  std::vector<std::span<std::uint16_t>> tensors_;
  std::vector<Digest> digest_;
  Version version_ = no_version;
};

class ShardReceiver {
 public:
  // TP rank `ts` of an inference topology (tp, ep; one replica's ranks) over its tensors in
  // SglangLayout order.
  ShardReceiver(const layout::ModelSpec& model, const layout::InferTopology& topology,
                std::int64_t ts, ReceiverTensors tensors)
      : spec_(named_by_structure(model)),
        hf_(spec_),
        layout_(hf_, replica_of(topology)),
        ts_(ts),
        receiver_(hf_, layout_, checked_rank(ts, topology), 1, std::move(tensors)) {}

  ShardReceiver(const ShardReceiver&) = delete;
  ShardReceiver& operator=(const ShardReceiver&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] const layout::SglangLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::int64_t rank() const noexcept { return ts_; }
  [[nodiscard]] const Receiver& receiver() const noexcept { return receiver_; }
  [[nodiscard]] Version version() const noexcept { return receiver_.version(); }
  // Per canonical tensor, of this rank's part (copies included).
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return receiver_.digest(); }

  ApplyReport apply(std::span<const std::byte> bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string who = "ShardReceiver (TP rank " + std::to_string(ts_) + ")";
    ApplyReport rep;
    const std::optional<detail::Staged> staged =
        detail::stage(hf_, bytes, receiver_.version(), who, rep);
    if (!staged) return rep;
    const storage::Manifest& m = staged->manifest;
    const std::vector<storage::Chunk>& cs = staged->chunks;
    // This rank's copies of every element, as the engine's message to it.
    wire::MessageWriter w;
    w.begin();
    for (const storage::Chunk& c : cs) {
      for (const storage::TensorDelta& d : c.tensors) {
        for (std::size_t k = 0; k < d.index.size(); ++k) {
          layout_.targets(
              layout::Canonical{d.tensor, d.index[k]}, [&](const layout::ReceiverElement& e) {
                if (e.ts != ts_) return;
                const std::uint16_t held =
                    receiver_.tensor(e.tensor)[static_cast<std::size_t>(e.index)];
                w.add(static_cast<std::uint32_t>(e.tensor), static_cast<std::uint32_t>(e.index),
                      storage::decode_value(c.encoding, held, d.bits[k]));
              });
        }
      }
    }
    w.finish(m.anchor() ? MessageKind::full : MessageKind::delta, m.version, m.base);
    Bytes message;
    message.reserve(w.size());
    for (const auto& part : w.spans())
      message.insert(message.end(), part.begin(), part.end());
    Inbox inbox;
    inbox.emplace_back(0, std::move(message));
    const ApplyResult r = receiver_.apply(m.version, inbox);
    if (r.outcome == ApplyOutcome::refused) {
      const std::string text = who + ": " + r.refusal;
      switch (r.kind) {
        case RefusalKind::format:
          throw format_error(text);
        case RefusalKind::bounds:
          throw bounds_error(text);
        default:
          throw protocol_error(text);
      }
    }
    rep.outcome = r.outcome;
    rep.written = r.written;
    rep.version = receiver_.version();
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

 private:
  static layout::InferTopology replica_of(layout::InferTopology t) {
    t.replicas = 1;
    return t;
  }
  static std::int64_t checked_rank(std::int64_t ts, const layout::InferTopology& t) {
    if (ts < 0 || ts >= t.tp) {
      throw invalid_argument("ShardReceiver: TP rank " + std::to_string(ts) +
                             " is not a rank of tp=" + std::to_string(t.tp));
    }
    return ts;
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  layout::SglangLayout layout_;
  std::int64_t ts_;
  Receiver receiver_;
};

// Whether the TP ranks of one replica hold exactly the trainer's state `trainer`
// (Publisher::digest()): per canonical tensor, the ranks' digests (rank_digest[ts], each rank's
// ShardReceiver::digest(), gathered from wherever the ranks run) sum to the copies a replica
// holds times the trainer's. Returns the first tensor that differs ("" if none).
inline std::string check_replica(const layout::SglangLayout& layout,
                                 std::span<const std::vector<Digest>> rank_digest,
                                 std::span<const Digest> trainer) {
  const layout::HfModel& hf = layout.model();
  const auto tensors = static_cast<std::size_t>(hf.size());
  if (static_cast<std::int64_t>(rank_digest.size()) != layout.topology().tp ||
      trainer.size() != tensors) {
    throw invalid_argument("check_replica: pass the digests of every one of the " +
                           std::to_string(layout.topology().tp) +
                           " TP ranks of one replica, in rank order, and the " +
                           std::to_string(tensors) + " digests of the trainer");
  }
  for (const auto& d : rank_digest) {
    if (d.size() != tensors) {
      throw invalid_argument("check_replica: a rank's digest has " + std::to_string(d.size()) +
                             " tensors, the model " + std::to_string(tensors));
    }
  }
  for (std::size_t t = 0; t < tensors; ++t) {
    Digest sum = 0;
    for (const auto& d : rank_digest)
      sum += d[t];
    const auto copies = static_cast<Digest>(layout.copies(hf[static_cast<std::int64_t>(t)].kind));
    if (sum != static_cast<Digest>(copies * trainer[t]))
      return hf.name(static_cast<std::int64_t>(t));
  }
  return {};
}

// The same over the ShardReceivers of one replica, in one process (any order, each rank once).
inline std::string check_replica(std::span<const ShardReceiver* const> ranks,
                                 std::span<const Digest> trainer) {
  if (ranks.empty()) throw invalid_argument("check_replica: no ranks given");
  const layout::SglangLayout& l = ranks.front()->layout();
  std::vector<std::vector<Digest>> digests(ranks.size());
  std::vector<bool> seen(ranks.size(), false);
  for (const ShardReceiver* r : ranks) {
    const auto ts = static_cast<std::size_t>(r->rank());
    if (r->model().spec().name != l.model().spec().name ||
        r->layout().topology().tp != l.topology().tp || ts >= ranks.size() || seen[ts]) {
      throw invalid_argument(
          "check_replica: the ranks are not the TP ranks of one replica of one model, each once");
    }
    seen[ts] = true;
    digests[ts] = r->digest();
  }
  return check_replica(l, digests, trainer);
}

}  // namespace dte::publication
