// SPDX-License-Identifier: Apache-2.0
// The receiver core: what every receiver of dte does with one publication once a decoder has
// turned it into StagedWrites (receive/staged.hpp) — the engine's receiver ranks (wire v2), the
// publication receivers over HF tensors or one TP rank's shard, the storage reader (chunk-v1).
// The rules exist here once:
//   - the version chain (chain()): a receiver never moves backwards; the version held again is
//     a re-delivery, an idempotent no-op; a delta or no-op needs base == the version held, which
//     must be a real version (a fresh receiver accepts only a full publication); a repair
//     rewrites elements within the version held;
//   - bounds and coverage (check()): every piece inside the live part of an existing tensor (no
//     write into the vocabulary padding, which the digest does not cover); a full publication
//     writes every live element exactly once (pieces pairwise disjoint, counts summing to the
//     live elements), so the digest rebuilt from its writes is exact;
//   - the commit (commit()): values scattered in place and the digest moved by what each write
//     overwrites and writes (a full publication rebuilds it), O(written); or the writes handed
//     to a TensorSink (device memory). With an expected digest (a receiver that holds whole
//     tensors), the publication is refused unless the digest the tensors hold afterwards equals
//     the trainer's; the pass that writes keeps what it overwrote, and a refusal undoes every
//     write before it returns (one pass over the targets, not a read pass and a write pass).
//
// Speed: the targets of a sparse publication are scattered over tensors far larger than the
// caches, so each write is a cache miss. The commit walks the writes with software prefetches a
// fixed distance ahead, across pieces, so the misses overlap instead of arriving one at a time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/core/message.hpp"
#include "dte/error.hpp"
#include "dte/receive/staged.hpp"
#include "dte/storage/value_code.hpp"

namespace dte {

enum class ApplyOutcome {
  committed,  // the publication was applied and its version is now held
  current,    // a re-delivery of the version already held: nothing changed
  refused,    // nothing changed; the refusal says why
};

// One receiver rank's tensors: views[k] is receiver tensor k (caller-owned).
using ReceiverTensors = std::vector<std::span<std::uint16_t>>;

// Receiver tensors the host cannot write (device memory). commit() writes staged writes the
// core has checked in full (values, never diff codes) and moves the sink's digest (per canonical
// tensor, of the tensors' contents) by what they overwrote and wrote; digest() reads it.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  virtual void commit(const receive::StagedWrites& writes) = 0;
  [[nodiscard]] virtual std::vector<Digest> digest() const = 0;
};

namespace receive {

inline std::string kind_name(MessageKind k) {
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

// Writes ahead of the one being applied whose target is prefetched, and how: a read prefetch
// into L2 (prefetcht1 on x86), not a write prefetch or one into L1. A core has far more
// outstanding misses to L2 than to L1, and the write then finds its line in L2. Measured with
// bench/bench_apply.cpp at 0.87 % changed into HF tensors (docs/benchmarks.md): the whole apply
// 12.0–15.2 ns per changed element, against 17.5–19.7 with prefetcht0 32 ahead (the default
// x86-64 code of a write prefetch); 32, 64 and 128 ahead within noise of each other.
inline constexpr std::size_t prefetch_distance = 64;
inline constexpr int prefetch_locality = 2;  // __builtin_prefetch's: 2 = L2 and outward

class Core {
 public:
  // Receiver tensor k has numel[k] elements, of which [0, live_end[k]) hold data; the digest is
  // kept per canonical tensor (`canonical` of them); name(k) names tensor k in refusals; `rank`
  // is the receiver's in error contexts; `who` starts every refusal's text; canonical_name(t)
  // names canonical tensor t.
  Core(std::string who, std::int64_t rank, std::vector<std::uint64_t> numel,
       std::vector<std::uint64_t> live_end, std::size_t canonical,
       std::function<std::string(std::int64_t)> name,
       std::function<std::string(std::int64_t)> canonical_name)
      : who_(std::move(who)),
        rank_(rank),
        numel_(std::move(numel)),
        live_end_(std::move(live_end)),
        name_(std::move(name)),
        canonical_name_(std::move(canonical_name)),
        digest_(canonical, 0) {}

  // Host tensors, one view per receiver tensor, of numel[k] elements each.
  void hold(ReceiverTensors tensors) {
    if (tensors.size() != numel_.size()) {
      throw invalid_argument(who_ + ": given " + std::to_string(tensors.size()) +
                             " tensors, the layout has " + std::to_string(numel_.size()) +
                             "; pass one view per receiver tensor, in layout order");
    }
    for (std::size_t k = 0; k < numel_.size(); ++k) {
      if (tensors[k].size() != numel_[k]) {
        throw invalid_argument(who_ + ": tensor " + name_(static_cast<std::int64_t>(k)) + " has " +
                               std::to_string(tensors[k].size()) + " elements, the layout says " +
                               std::to_string(numel_[k]));
      }
    }
    tensors_ = std::move(tensors);
  }

  // Tensors behind a sink (device memory): the sink holds them and their digest.
  void hold(std::shared_ptr<TensorSink> sink) {
    if (!sink) throw invalid_argument(who_ + ": the tensor sink is null; pass the tensors' sink");
    std::vector<Digest> d = sink->digest();
    if (d.size() != digest_.size()) {
      throw invalid_argument(who_ + ": the tensor sink keeps " + std::to_string(d.size()) +
                             " digests, the model has " + std::to_string(digest_.size()) +
                             " canonical tensors");
    }
    sink_ = std::move(sink);
    digest_ = std::move(d);
  }

  [[nodiscard]] const std::string& who() const noexcept { return who_; }
  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }
  [[nodiscard]] bool has_sink() const noexcept { return sink_ != nullptr; }
  [[nodiscard]] std::span<const std::uint16_t> tensor(std::int64_t id) const {
    if (sink_) {
      throw invalid_argument(who_ +
                             ": its tensors are behind a sink (device memory); read them "
                             "there");
    }
    return tensors_[static_cast<std::size_t>(id)];
  }
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return sizeof(*this) + digest_.capacity() * sizeof(Digest) +
           (live_end_.capacity() + numel_.capacity()) * sizeof(std::uint64_t) +
           tensors_.capacity() * sizeof(tensors_[0]);
  }
  [[nodiscard]] std::string held_name() const {
    return version_ == no_version ? std::string("nothing yet") : std::to_string(version_);
  }

  // What a refusal of this receiver is about.
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

  // What a trainer that restarted does about it (docs/python.md, "Restarts").
  static std::string restarted_hint(Version held) {
    return "A restarted trainer continues the numbering: TorchPublisher(..., continue_after=" +
           std::to_string(held) +
           ") (publication::Publisher::continue_after in C++); the "
           "version an engine holds: rx.version, dte.vllm.version(llm or url), "
           "dte.sglang.version(engine or url)";
  }

  // The version chain, for a publication (or repair) of `kind` and `version` on `base`: true
  // when it is a re-delivery of the version held (nothing to do); throws protocol_error when it
  // may not be applied to what this receiver holds.
  [[nodiscard]] bool chain(MessageKind kind, Version version, Version base,
                           std::int64_t sender = -1) const {
    const auto refuse = [&](const std::string& what) {
      throw protocol_error(who_ + ": " + what, context(sender, version));
    };
    if (version == no_version) {
      refuse("version 2^64 - 1 is reserved (no_version: a receiver that holds nothing)");
    }
    if (kind == MessageKind::repair) {
      if (version_ != version) {
        refuse("a repair of version " + std::to_string(version) + " but this receiver holds " +
               held_name());
      }
      return false;
    }
    if (version_ != no_version && version < version_) {
      refuse("version " + std::to_string(version) + " is older than the version " +
             std::to_string(version_) + " this receiver holds; a receiver never moves backwards. " +
             restarted_hint(version_));
    }
    if (version_ != no_version && version == version_) return true;
    if (kind == MessageKind::delta || kind == MessageKind::noop) {
      const std::string b = base == no_version ? std::string("none") : std::to_string(base);
      if (version_ == no_version) {
        refuse("a " + kind_name(kind) + " on base version " + b +
               " but this receiver holds nothing yet; it needs a full publication first");
      }
      if (base != version_) {
        refuse("a " + kind_name(kind) + " on base version " + b + " but this receiver holds " +
               held_name() + "; version " + std::to_string(version) +
               " is refused: apply the versions in between in order, or a full publication");
      }
    }
    return false;
  }

  // Every piece inside the live part of an existing tensor; a no-op carries nothing; a full
  // publication writes every live element exactly once; no element is written both by a value
  // piece and a diff piece. Memory per piece, nothing per write.
  void check(const StagedWrites& w) const {
    check_bounds(w);
    if (w.full()) check_cover(w);
    check_encodings_disjoint(w);
  }

 private:
  // check() but the coverage of a full publication.
  void check_bounds(const StagedWrites& w) const {
    if (w.kind == MessageKind::noop && w.size() != 0) {
      throw protocol_error(who_ + ": a no-op version carries elements",
                           context(w.pieces.front().source, w.version));
    }
    for (const Piece& p : w.pieces) {
      if (p.count() == 0) continue;
      const std::string from =
          p.source >= 0 ? ", message from sender " + std::to_string(p.source) : std::string();
      if (p.tensor >= numel_.size()) {
        throw bounds_error(who_ + from + ": tensor id " + std::to_string(p.tensor) +
                               " does not exist (" + std::to_string(numel_.size()) + " tensors)",
                           context(p.source, w.version));
      }
      const std::uint64_t last = w.last(p);
      if (last >= numel_[p.tensor]) {
        throw bounds_error(who_ + from + ": index " + std::to_string(last) + " is outside " +
                               name_(p.tensor) + " (" + std::to_string(numel_[p.tensor]) +
                               " elements)",
                           context(p.source, w.version, name_(p.tensor)));
      }
      if (last >= live_end_[p.tensor]) {
        throw bounds_error(who_ + from + ": index " + std::to_string(last) + " of " +
                               name_(p.tensor) + " lies in the vocabulary padding (elements " +
                               std::to_string(live_end_[p.tensor]) + " to " +
                               std::to_string(numel_[p.tensor]) + "), which no message may write",
                           context(p.source, w.version, name_(p.tensor)));
      }
      if (p.canonical >= digest_.size()) {
        throw bounds_error(who_ + from + ": element " + std::to_string(w.first(p)) + " of " +
                               name_(p.tensor) + " holds no canonical element",
                           context(p.source, w.version));
      }
    }
  }

 public:
  // A full publication applied part by part, for tensors nothing serves yet (a storage anchor
  // being assembled from its writers' chunks): begin_full, then commit_part per part (checked as
  // check() checks, coverage excepted, and written at once: no staging of the whole
  // publication), then finish_full, which checks the coverage over every part and the digest
  // against `expected`, and commits the version. A refusal at any point leaves the version and
  // the digest as they were, and the tensors partly written.
  void begin_full(Version version) {
    (void)chain(MessageKind::full, version, no_version);
    parts_ = Parts{};
    parts_->version = version;
    parts_->digest = digest_;
    std::fill(digest_.begin(), digest_.end(), Digest{0});
  }
  void commit_part(StagedWrites& w) {
    if (!parts_ || sink_ || !w.full() || w.version != parts_->version || w.any_diff()) {
      throw invalid_argument(who_ +
                             ": commit_part takes the value-encoded parts of the full "
                             "publication begin_full opened, into host tensors");
    }
    try {
      check_bounds(w);
      add_spans(w, parts_->spans);
      parts_->written += w.size();
      apply_pass<false>(w);
    } catch (...) {
      abandon_parts();
      throw;
    }
  }
  void finish_full(std::span<const Digest> expected) {
    if (!parts_) throw invalid_argument(who_ + ": finish_full without begin_full");
    try {
      check_cover(std::move(parts_->spans), parts_->written, parts_->version);
      for (std::size_t t = 0; t < digest_.size(); ++t) {
        if (t < expected.size() && digest_[t] == expected[t]) continue;
        throw protocol_error(who_ + ": after version " + std::to_string(parts_->version) +
                                 " tensor " + canonical_name_(static_cast<std::int64_t>(t)) +
                                 " differs from the trainer's (digest mismatch)",
                             context(-1, parts_->version));
      }
    } catch (...) {
      abandon_parts();
      throw;
    }
    version_ = parts_->version;
    parts_.reset();
  }

  // Applies checked writes of a publication the chain accepted (or a repair) and commits its
  // version. `expected`: the digest the tensors must hold afterwards (host tensors only), else
  // refused with protocol_error, every write undone. Consumes w (its bits).
  void commit(StagedWrites& w, std::span<const Digest> expected = {}) {
    if (sink_) {
      if (w.any_diff()) {
        throw unsupported(who_ +
                          ": diff-encoded values need the values held, and these tensors "
                          "are device memory; publish with the value encoding");
      }
      sink_->commit(w);
      digest_ = sink_->digest();
      version_ = w.version;
      return;
    }
    const std::vector<Digest> before = expected.empty() ? std::vector<Digest>{} : digest_;
    if (w.full()) std::fill(digest_.begin(), digest_.end(), Digest{0});
    if (expected.empty()) {
      apply_pass<false>(w);
    } else {
      // One pass over the targets (each a cache miss at low density), keeping what each write
      // overwrote; a digest that is not the trainer's undoes every write before refusing.
      apply_pass<true>(w);
      for (std::size_t t = 0; t < digest_.size(); ++t) {
        if (digest_[t] != expected[t]) {
          undo_pass(w);
          digest_ = before;
          throw protocol_error(
              who_ + ": after version " + std::to_string(w.version) + " tensor " +
                  canonical_name_(static_cast<std::int64_t>(t)) +
                  " would differ from the trainer's (digest mismatch): these tensors do not " +
                  "hold version " + held_name() +
                  " as dte wrote it (written outside dte?). Every write was undone; apply a " +
                  "full publication",
              context(-1, w.version));
        }
      }
    }
    version_ = w.version;
  }

 private:
  // The software prefetch: a cursor prefetch_distance sparse writes ahead of the one being
  // applied, across pieces (a shard's pieces can be a few writes each: a cursor within one
  // piece would start every piece cold). Dense pieces are sequential: the hardware fetches
  // those.
  class Ahead {
   public:
    Ahead(const StagedWrites& w, const ReceiverTensors& tensors)
        : w_(&w), tensors_(&tensors), q_(w.pieces.data()), end_(q_ + w.pieces.size()) {}
    void step() noexcept {
      while (i_ == i_end_) {
        if (q_ == end_) return;
        const Piece& p = *q_++;
        if (p.dense) continue;
        base_ = (*tensors_)[p.tensor].data();
        i_ = w_->index.data() + p.at;
        i_end_ = i_ + p.count();
      }
      __builtin_prefetch(base_ + *i_++, 0, prefetch_locality);
    }

   private:
    const StagedWrites* w_;
    const ReceiverTensors* tensors_;
    const Piece* q_;
    const Piece* end_;
    const std::uint32_t* i_ = nullptr;
    const std::uint32_t* i_end_ = nullptr;
    const std::uint16_t* base_ = nullptr;
  };

  // Every write applied in write order with the digest moved (an element written twice is
  // overwritten in turn, its digest term with it). keep_old: what each write overwrote is left
  // in its place in w.bits, for undo_pass; values read in place (wire runs) have nowhere to keep
  // it, so a caller that passes an expected digest stages its values.
  template <bool keep_old>
  void apply_pass(StagedWrites& w) {
    const bool full = w.full();
    Ahead ahead(w, tensors_);
    for (std::size_t k = 0; k < prefetch_distance; ++k)
      ahead.step();
    for (const Piece& p : w.pieces) {
      if (keep_old && p.values != nullptr) {
        throw invalid_argument(who_ + ": writes read in place cannot be undone (report this)");
      }
      Digest& d = digest_[p.canonical];
      // (the encoding and the kind fixed per piece, so the loop over its writes has no branch on
      // them: this loop is most of a sparse apply)
      if (p.diff) {
        if (full) {
          apply_piece<keep_old, true, true>(w, p, ahead, d);
        } else {
          apply_piece<keep_old, true, false>(w, p, ahead, d);
        }
      } else if (full) {
        apply_piece<keep_old, false, true>(w, p, ahead, d);
      } else {
        apply_piece<keep_old, false, false>(w, p, ahead, d);
      }
    }
  }

  template <bool keep_old, bool diff, bool full>
  void apply_piece(StagedWrites& w, const Piece& p, Ahead& ahead, Digest& digest) {
    std::uint16_t* x = tensors_[p.tensor].data();
    std::uint16_t* bits = w.bits.data() + p.begin;
    const std::size_t n = p.count();
    Digest d = digest;
    const auto write = [&](std::uint16_t& cell, std::uint32_t key, std::uint16_t code,
                           std::size_t k) {
      const std::uint16_t old = cell;
      const std::uint16_t now = diff ? storage::diff_apply(old, code) : code;
      if constexpr (full) {
        d += detail::digest_mix(key, now);
      } else {
        d += detail::digest_mix(key, now) - detail::digest_mix(key, old);
      }
      cell = now;
      if constexpr (keep_old) bits[k] = old;
    };
    if (p.dense) {
      std::uint16_t* cell = x + p.first;
      for (std::size_t k = 0; k < n; ++k) {
        write(cell[k], detail::digest_key(p.global + static_cast<std::int64_t>(k)),
              p.value(w.bits.data(), k), k);
      }
    } else {
      const std::uint32_t* idx = w.index.data() + p.at;
      const std::uint32_t* key = w.key.data() + p.at;
      for (std::size_t k = 0; k < n; ++k) {
        ahead.step();
        write(x[idx[k]], key[k], bits[k], k);
      }
    }
    digest = d;
  }

  // After apply_pass<true>: every element back to what it held, last write first (an element
  // written twice ends with its first old value).
  void undo_pass(const StagedWrites& w) noexcept {
    for (std::size_t q = w.pieces.size(); q-- > 0;) {
      const Piece& p = w.pieces[q];
      std::uint16_t* x = tensors_[p.tensor].data();
      const std::uint16_t* bits = w.bits.data() + p.begin;
      for (std::size_t k = p.count(); k-- > 0;)
        x[p.dense ? p.first + k : w.index[p.at + k]] = bits[k];
    }
  }

  // What a full publication's coverage check needs of its writes: per non-empty piece the
  // receiver elements it writes. Memory per piece, nothing per write.
  struct Span {
    std::uint32_t tensor, first, last;
    std::int64_t src;
  };
  static void add_spans(const StagedWrites& w, std::vector<Span>& spans) {
    for (const Piece& p : w.pieces) {
      if (p.count() != 0) spans.push_back({p.tensor, w.first(p), w.last(p), p.source});
    }
  }

  void check_cover(const StagedWrites& w) const {
    std::vector<Span> spans;
    spans.reserve(w.pieces.size());
    add_spans(w, spans);
    check_cover(std::move(spans), w.size(), w.version);
  }

  // A delta may carry diff chunks beside value chunks (storage/chunk_sink.hpp: the few elements
  // a diff code cannot hold go into a value chunk); each chunk kind's indices increase per
  // tensor (the decoder checks that), so an element written twice would be one each. The value
  // writes are few: each diff piece is searched for the value writes inside its range,
  // O(pieces log values).
  void check_encodings_disjoint(const StagedWrites& w) const {
    if (!w.any_diff()) return;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> values;  // (tensor, index)
    for (const Piece& p : w.pieces) {
      if (p.diff || p.count() == 0) continue;
      for (std::size_t k = 0; k < p.count(); ++k)
        values.emplace_back(p.tensor,
                            p.dense ? p.first + static_cast<std::uint32_t>(k) : w.index[p.at + k]);
    }
    if (values.empty()) return;
    std::sort(values.begin(), values.end());
    for (const Piece& p : w.pieces) {
      if (!p.diff || p.count() == 0) continue;
      auto it = std::lower_bound(values.begin(), values.end(), std::pair{p.tensor, w.first(p)});
      for (; it != values.end() && it->first == p.tensor && it->second <= w.last(p); ++it) {
        const bool hit =
            p.dense || std::binary_search(w.index.data() + p.at, w.index.data() + p.at + p.count(),
                                          it->second);
        if (hit) {
          throw protocol_error(who_ + ": version " + std::to_string(w.version) +
                                   " writes element " + std::to_string(it->second) + " of " +
                                   name_(p.tensor) +
                                   " twice (a value and a diff code); each element is written once",
                               context(p.source, w.version));
        }
      }
    }
  }

  // Pairwise disjoint, and `written` (their writes) equal to the live elements.
  void check_cover(std::vector<Span> spans, std::uint64_t written, Version version) const {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.tensor != b.tensor ? a.tensor < b.tensor : a.first < b.first;
    });
    for (std::size_t i = 1; i < spans.size(); ++i) {
      const Span& a = spans[i - 1];
      const Span& b = spans[i];
      if (a.tensor == b.tensor && b.first <= a.last) {
        throw protocol_error(
            who_ + ": the full publication of version " + std::to_string(version) +
                " writes elements " + std::to_string(b.first) + " to " +
                std::to_string(std::min(a.last, b.last)) + " of " + name_(a.tensor) + " twice" +
                (a.src >= 0
                     ? " (senders " + std::to_string(a.src) + " and " + std::to_string(b.src) + ")"
                     : std::string()),
            context(b.src, version));
      }
    }
    std::uint64_t live = 0;
    for (std::uint64_t n : live_end_)
      live += n;
    if (written != live) {
      throw protocol_error(who_ + ": the full publication of version " + std::to_string(version) +
                               " writes " + std::to_string(written) + " of the " +
                               std::to_string(live) + " live elements this receiver holds; refused",
                           context(-1, version));
    }
  }

  std::string who_;
  std::int64_t rank_;
  std::vector<std::uint64_t> numel_;     // per tensor
  std::vector<std::uint64_t> live_end_;  // per tensor: elements beyond it are padding
  std::function<std::string(std::int64_t)> name_, canonical_name_;
  Version version_ = no_version;
  ReceiverTensors tensors_;           // host tensors, or
  std::shared_ptr<TensorSink> sink_;  // device tensors
  std::vector<Digest> digest_;        // per canonical tensor
  // A full publication being committed part by part (begin_full .. finish_full).
  struct Parts {
    Version version = no_version;
    std::vector<Digest> digest;  // held before it began
    std::vector<Span> spans;
    std::uint64_t written = 0;
  };
  std::optional<Parts> parts_;

  void abandon_parts() noexcept {
    digest_ = std::move(parts_->digest);
    parts_.reset();
  }
};

}  // namespace receive
}  // namespace dte
