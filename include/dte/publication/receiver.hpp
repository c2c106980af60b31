// SPDX-License-Identifier: Apache-2.0
// Receivers of publication messages (publication/message.hpp), over the caller's own tensors:
//   HfReceiver     the whole model as HF tensors (a served HF/PyTorch model: one view per HF
//                  tensor, in HfModel order);
//   ShardReceiver  one SGLang TP rank's tensors (ServingLayout order), through the engine's own
//                  Receiver (engine/receiver.hpp); or a TP rank of an engine that serves online
//                  FP8 (docs/fp8.md), its quantized tensors as E4M3FN codes and block scales.
// Both decode the message's chunks into staged writes in their own coordinates (the HF tensors
// as they are, a shard through receive/route.hpp) and commit them through the receiver core
// (receive/core.hpp): the version chain, coverage of a full publication, the digest are its.
// Both are transactional: every chunk is decoded and checked first (framing, checksums, the
// header, the version chain, indices, for a full publication every element exactly once) and
// only then are values written and the version committed; a refusal throws (format_error,
// bounds_error, protocol_error) and leaves tensors, version and digest untouched.
//
// An HfReceiver also checks the result: from the digest it keeps per canonical tensor and the
// values it overwrites, it computes the digest the tensors hold afterwards and refuses the
// publication unless it equals the trainer's (the manifest's) for every tensor, undoing every
// write before apply() throws (receive/core.hpp). An element the publication overwrites that was
// changed behind dte's back, a lost or reordered write, a wrong base: refused, tensors as before.
// verify() recomputes the digest from the whole tensors (O(model)) and finds changes anywhere. A
// ShardReceiver holds a part of each tensor and cannot compare alone; check_replica() compares a
// whole replica's ranks with the trainer's digest.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/publication/message.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/fp8_core.hpp"
#include "dte/receive/fp8_part.hpp"
#include "dte/receive/replica.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"

namespace dte::publication {

// What one apply did.
struct ApplyReport {
  ApplyOutcome outcome = ApplyOutcome::committed;  // committed, or current (a re-delivery)
  Version version = no_version;                    // held after
  Version base = no_version;                       // the message's (no_version: full)
  std::uint64_t written = 0;                       // element writes
  std::vector<std::uint32_t> touched;              // the receiver tensors written, ascending
  std::uint64_t bytes = 0;                         // the message
  double seconds = 0;
  [[nodiscard]] bool full() const noexcept { return base == no_version; }
  [[nodiscard]] bool committed() const noexcept { return outcome == ApplyOutcome::committed; }
};

namespace detail {

// A message read for a receiver holding `held`: decoded and its chunks checked (framing,
// checksums, headers, indices; each tensor's indices increase over the chunks, so no element is
// written twice; a full publication carries values), each tensor entry routed into the
// receiver's staged writes by route(tensor, index, bits, n) as its chunk decodes. Nothing for a
// re-delivery of the version held (rep says current); rep's base and bytes are filled either
// way. Each entry is decoded into room(tensor, n) (storage::visit_chunk_into). The version chain
// and the coverage of a full publication are the receiver core's (receive/core.hpp).
// (v: the message of `bytes` bytes, decoded.)
template <class Room, class Route>
std::optional<storage::Manifest> stage(const layout::HfModel& hf, View& v, std::size_t bytes,
                                       const receive::Core& core, storage::ChunkScratch& scratch,
                                       receive::StagedWrites& w, ApplyReport& rep, Room&& room,
                                       Route&& route) {
  const storage::Manifest& m = v.manifest;
  rep.base = m.base;
  rep.bytes = bytes;
  w.clear();
  w.kind = m.anchor() ? MessageKind::full : MessageKind::delta;
  w.version = m.version;
  w.base = m.base;
  if (core.chain(w.kind, w.version, w.base)) {
    rep.outcome = ApplyOutcome::current;
    rep.version = core.version();
    return std::nullopt;
  }
  // per chunk kind (value, diff) and tensor: the last index seen of this writer (receive::Core::
  // check then refuses an element written by both kinds). Several writers (a sharded trainer's
  // ranks) each send their own elements, which a Shard(1) split interleaves: each writer's
  // indices increase; that no two writers send one element the trainer checked before it
  // published (layout::check_writers), a full publication's coverage checks again here, and an
  // HfReceiver's digest refuses a delta whose result is not the trainer's.
  const auto tensors = static_cast<std::size_t>(hf.size());
  std::vector<std::int64_t> last(2 * tensors, -1);
  for (std::size_t k = 0; k < v.chunks.size(); ++k) {
    const storage::ChunkEntry& entry = m.chunks[k];
    if (k > 0 && entry.writer != m.chunks[k - 1].writer) std::fill(last.begin(), last.end(), -1);
    const storage::ChunkHeader expect{m.version, m.base, entry.chunk, entry.writer};
    (void)storage::visit_chunk_into(
        hf, v.chunks[k],
        "publication v" + std::to_string(m.version) + " chunk " + std::to_string(k), &expect,
        nullptr, scratch, room,
        [&](const storage::Chunk& c, std::int64_t t, std::span<const std::uint32_t> index,
            std::span<const std::uint16_t> bits) {
          if (m.anchor() && c.encoding != storage::Encoding::value) {
            throw format_error(core.who() + ": a full publication's chunk " + std::to_string(k) +
                               " is diff-encoded; a full publication carries values");
          }
          if (index.empty()) return;
          const std::size_t kind = c.encoding == storage::Encoding::diff ? 1 : 0;
          std::int64_t& l = last[kind * tensors + static_cast<std::size_t>(t)];
          if (static_cast<std::int64_t>(index.front()) <= l) {
            throw protocol_error(core.who() + ": tensor " + hf.name(t) + " element " +
                                 std::to_string(index.front()) + " in chunk " + std::to_string(k) +
                                 " comes again or out of order; each element is written once");
          }
          l = index.back();
          w.diff = c.encoding == storage::Encoding::diff;
          route(t, index.data(), bits.data(), index.size());
        });
  }
  return std::move(v.manifest);
}

// A TP rank of topology t, or invalid_argument naming `who`.
inline std::int64_t checked_rank(std::int64_t ts, const layout::InferTopology& t, const char* who) {
  if (ts < 0 || ts >= t.tp) {
    throw invalid_argument(std::string(who) + ": TP rank " + std::to_string(ts) +
                           " is not a rank of tp=" + std::to_string(t.tp));
  }
  return ts;
}

// After a full publication the staging holds the whole model: let it go (a delta's is kept for
// the next one, O(changed)).
inline void release_if_full(storage::ChunkScratch& scratch, receive::StagedWrites& w) {
  if (!w.full()) return;
  w = receive::StagedWrites{};
  scratch.plain = {};
  scratch.index = {};
  scratch.bits = {};
}

}  // namespace detail

class HfReceiver {
 public:
  // tensors[t]: HF tensor t of `model` (HfModel order), hf[t].numel() BF16 values each.
  HfReceiver(const layout::ModelSpec& model, std::vector<std::span<std::uint16_t>> tensors)
      : spec_(named_by_structure(model)), hf_(spec_), core_(receive::hf_core(hf_, "HfReceiver")) {
    core_.hold(std::move(tensors));
  }

  HfReceiver(const HfReceiver&) = delete;
  HfReceiver& operator=(const HfReceiver&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] Version version() const noexcept { return core_.version(); }
  // Per canonical tensor, of the tensors' contents (valid once a full publication committed).
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return core_.digest(); }

  // The first tensor whose contents differ from what dte wrote into it ("" if none, or if
  // nothing is held yet): the digest recomputed from every element.
  [[nodiscard]] std::string verify() const {
    if (core_.version() == no_version) return {};
    for (std::int64_t t = 0; t < hf_.size(); ++t) {
      Digest sum = 0;
      const std::span<const std::uint16_t> x = core_.tensor(t);
      for (std::size_t i = 0; i < x.size(); ++i)
        sum += element_digest(hf_[t].base + static_cast<std::int64_t>(i), x[i]);
      if (sum != core_.digest()[static_cast<std::size_t>(t)]) return hf_.name(t);
    }
    return {};
  }

  ApplyReport apply(std::span<const std::byte> bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    ApplyReport rep;
    receive::StagedWrites& w = staged_;
    // (each entry decoded straight into the staged writes: the HF tensors are the receiver's)
    View v = decode(hf_, bytes, "publication");
    const std::optional<storage::Manifest> m = detail::stage(
        hf_, v, bytes.size(), core_, scratch_, w, rep,
        [&](std::int64_t, std::size_t n) {
          const receive::StagedWrites::Room r = w.room(n);
          return std::pair{r.index, r.bits};
        },
        [&](std::int64_t t, const std::uint32_t*, const std::uint16_t*, std::size_t n) {
          const auto id = static_cast<std::uint32_t>(t);
          w.push_decoded(id, id, n, hf_[t].base);
        });
    if (!m) return rep;
    core_.check(w);
    // The digest the tensors will hold, from the values the writes overwrite, must be the
    // trainer's (the manifest's) before anything is written.
    core_.commit(w, m->digest);
    rep.written = w.size();
    rep.touched = w.tensors();
    detail::release_if_full(scratch_, w);
    rep.version = core_.version();
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

 private:
  layout::ModelSpec spec_;
  layout::HfModel hf_;
  receive::Core core_;
  storage::ChunkScratch scratch_;  // reused from one publication to the next
  receive::StagedWrites staged_;
};

class ShardReceiver {
 public:
  // TP rank `ts` of an inference topology (tp, ep; one replica's ranks) over its tensors in
  // ServingLayout order.
  ShardReceiver(const layout::ModelSpec& model, const layout::InferTopology& topology,
                std::int64_t ts, ReceiverTensors tensors)
      : spec_(named_by_structure(model)),
        hf_(spec_),
        layout_(hf_, topology.one_replica()),
        ts_(ts),
        receiver_(hf_, layout_, detail::checked_rank(ts, topology, "ShardReceiver"), 1,
                  std::move(tensors)) {}

  // The same rank of an engine that serves online-quantized FP8 by `recipe`
  // (VllmBlockFp8::name; docs/fp8.md), applying FP8 publications (message.hpp, fp8_format):
  // bf16 one view per serving tensor with an empty one for each quantized tensor, fp8 per
  // quantized tensor its codes and scales, in Fp8Grid::quantized_ids() order. After the checks
  // of a BF16 publication and of this rank's FP8 part, the codes and scales are written first,
  // and every FP8 write is undone and the publication refused unless each quantized tensor's
  // digest is then the sender's (of the engine's own quantization of the trainer's weights).
  ShardReceiver(const layout::ModelSpec& model, const layout::InferTopology& topology,
                std::int64_t ts, std::string recipe, ReceiverTensors bf16,
                std::vector<receive::Fp8Tensor> fp8)
      : spec_(named_by_structure(model)),
        hf_(spec_),
        layout_(hf_, topology.one_replica()),
        ts_(ts),
        recipe_(known_recipe(std::move(recipe))),
        receiver_(hf_, layout_, detail::checked_rank(ts, topology, "ShardReceiver"), 1,
                  std::move(bf16), std::move(fp8)) {}

  ShardReceiver(const ShardReceiver&) = delete;
  ShardReceiver& operator=(const ShardReceiver&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] const layout::ServingLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::int64_t rank() const noexcept { return ts_; }
  [[nodiscard]] const Receiver& receiver() const noexcept { return receiver_; }
  [[nodiscard]] Version version() const noexcept { return receiver_.version(); }
  // Per canonical tensor, of this rank's part (copies included; an FP8 rank's BF16 part).
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return receiver_.digest(); }

  // FP8 ranks: the quantized tensors, and per quantized tensor the digest of its codes and
  // scales.
  [[nodiscard]] bool serves_fp8() const noexcept { return receiver_.serves_fp8(); }
  [[nodiscard]] const layout::Fp8Grid& fp8_grid() const { return receiver_.fp8_grid(); }
  [[nodiscard]] const std::vector<Digest>& fp8_digest() const { return receiver_.fp8_digest(); }
  // FP8 ranks: the first quantized tensor whose codes or scales differ from what dte wrote (""
  // if none, or if nothing is held yet): the digest recomputed from every element.
  [[nodiscard]] std::string fp8_verify() const {
    if (receiver_.version() == no_version) return {};
    return receiver_.fp8_verify();
  }

  ApplyReport apply(std::span<const std::byte> bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    ApplyReport rep;
    receive::StagedWrites& w = staged_;
    std::vector<receive::StagedWrites*> out(static_cast<std::size_t>(layout_.topology().tp),
                                            nullptr);
    out[static_cast<std::size_t>(ts_)] = &w;
    receive::Router router(layout_, out);
    View v = decode(hf_, bytes, "publication", serves_fp8() ? fp8_format : format);
    const Fp8Section::Part* section = serves_fp8() ? &check_section(*v.fp8) : nullptr;
    const std::optional<storage::Manifest> m =
        detail::stage(hf_, v, bytes.size(), receiver_.core(), scratch_, w, rep,
                      storage::detail::ScratchRoom{&scratch_},
                      [&](std::int64_t t, const std::uint32_t* index, const std::uint16_t* bits,
                          std::size_t n) { router.route(t, index, bits, n); });
    if (!m) return rep;
    rep.written = w.size();
    if (section == nullptr) {
      rep.outcome = receiver_.apply(w);
      if (rep.committed()) rep.touched = w.tensors();
    } else {
      const receive::Fp8Part part = receive::decode_fp8_part(
          receiver_.fp8_grid(), recipe_, v.fp8_parts[static_cast<std::size_t>(ts_)],
          "publication v" + std::to_string(m->version) + " FP8 part " + std::to_string(ts_),
          {m->version, m->base, static_cast<std::uint32_t>(ts_)});
      rep.outcome = receiver_.apply(w, std::span(&part, 1), section->digest);
      if (rep.committed()) {
        rep.touched = w.tensors();
        for (const receive::Fp8Writes& t : part.tensors) {
          rep.written += t.index.size() + t.block.size();
          rep.touched.push_back(static_cast<std::uint32_t>(t.tensor));
        }
        std::sort(rep.touched.begin(), rep.touched.end());
      }
    }
    detail::release_if_full(scratch_, w);
    rep.version = receiver_.version();
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

 private:
  static std::string known_recipe(std::string recipe) {
    if (recipe == VllmBlockFp8::name) return recipe;
    throw unsupported("ShardReceiver: no recipe \"" + recipe + "\"; dte covers \"" +
                      std::string(VllmBlockFp8::name) + "\" (docs/fp8.md)");
  }

  [[nodiscard]] std::string who() const { return "FP8 receiver " + std::to_string(ts_); }

  // An FP8 publication's section: for this recipe and topology; this rank's part.
  const Fp8Section::Part& check_section(const Fp8Section& s) const {
    const layout::InferTopology& t = layout_.topology();
    if (s.recipe != recipe_ || s.tp != t.tp || s.ep != t.ep) {
      throw format_error(
          who() + ": the publication is quantized by \"" + s.recipe + "\" for tp=" +
          std::to_string(s.tp) + " ep=" + std::to_string(s.ep) + "; this receiver serves \"" +
          recipe_ + "\" at tp=" + std::to_string(t.tp) + " ep=" + std::to_string(t.ep) +
          ": publish for this topology (TorchPublisher(..., quantization=..., infer=...))");
    }
    if (s.parts.size() != static_cast<std::size_t>(t.tp)) {
      throw format_error(who() + ": the publication has " + std::to_string(s.parts.size()) +
                         " FP8 parts for " + std::to_string(t.tp) + " ranks");
    }
    const Fp8Section::Part& p = s.parts[static_cast<std::size_t>(ts_)];
    if (p.digest.size() != fp8_digest().size()) {
      throw format_error(who() + ": the publication's FP8 part has " +
                         std::to_string(p.digest.size()) + " digests, this rank quantizes " +
                         std::to_string(fp8_digest().size()) + " tensors");
    }
    return p;
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  layout::ServingLayout layout_;
  std::int64_t ts_;
  std::string recipe_;  // FP8 ranks
  Receiver receiver_;
  storage::ChunkScratch scratch_;  // reused from one publication to the next
  receive::StagedWrites staged_;
};

// Whether the TP ranks of one replica hold exactly the trainer's state `trainer`
// (Publisher::digest()): per canonical tensor, the ranks' digests (rank_digest[ts], each rank's
// ShardReceiver::digest(), gathered from wherever the ranks run) sum to the copies a replica
// holds times the trainer's. Returns the first tensor that differs ("" if none).
inline std::string check_replica(const layout::ServingLayout& layout,
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
    if (!receive::replica_holds(hf, layout, static_cast<std::int64_t>(t), sum, trainer[t]))
      return hf.name(static_cast<std::int64_t>(t));
  }
  return {};
}

// The same over the ShardReceivers of one replica, in one process (any order, each rank once).
inline std::string check_replica(std::span<const ShardReceiver* const> ranks,
                                 std::span<const Digest> trainer) {
  if (ranks.empty()) throw invalid_argument("check_replica: no ranks given");
  const layout::ServingLayout& l = ranks.front()->layout();
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
