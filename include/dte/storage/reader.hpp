// SPDX-License-Identifier: Apache-2.0
// storage::Reader: the inference side of cross-cluster sync (docs/storage.md). One reader keeps
// whole replicas of the receiver layout current from shared storage: the receivers of the
// engine (engine/receiver.hpp, one per TP rank, over the caller's tensors) with storage as
// their one sender, so the commit rules are the engine's: a version commits whole or not at
// all, never backwards, a delta only on its base, a re-delivery is a no-op.
//
// One poll, top to bottom:
//   1. LATEST names the target T (nothing to do when it is the version held);
//   2. the chain: manifests from T down along their bases to the version held, or to the
//      newest anchor at or below T when the version held is not on it (a reader that lagged
//      past a restart, a fresh reader) — at most max_chain manifests;
//   3. oldest first, each version's files are read and verified (listed size, xxh3, the chunk's
//      own header, every index bounded) and routed into the staged writes of every receiver
//      rank (each canonical element to every copy the replicas hold; receive/route.hpp) before
//      any receiver is touched; then every receiver's core commits them, and the replicas'
//      digests are checked against the manifest's.
// Any error leaves the version held served: nothing of a version that failed to read is
// written. Only two things leave the reader dirty (its tensors no longer one version): a
// receiver refusing after another committed, or a digest that disagrees after an apply; the
// next poll then reseeds from the newest anchor (fresh receivers, full write). A reader holds
// nothing on storage, so a restarted one (a crash mid-apply included) reseeds the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/error.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/replica.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/retention.hpp"

namespace dte::storage {

struct ReaderConfig {
  std::size_t max_chain = 4096;  // manifests walked to find the way from the version held
  // non-empty: registered under this name (ROOT/readers/<name>) with every version it reaches,
  // so retention keeps what it needs to follow deltas from there (storage/retention.hpp)
  std::string name;
};

// What one poll did.
struct ReadReport {
  Version from = no_version;  // held before (no_version: nothing)
  Version to = no_version;    // held after
  std::vector<Version> applied;
  bool reseeded = false;         // started from an anchor on fresh receivers
  std::uint64_t bytes_read = 0;  // files read (manifests not counted)
  std::string error;             // empty: no error
  [[nodiscard]] bool ok() const noexcept { return error.empty(); }
};

// Every element of an anchor's checkpoint files, checked: each file by its listed size and
// xxh3, each tensor an HF tensor of the model, BF16, of its exact shape, each exactly once over
// the files, none missing. emit(tensor, bits of the whole tensor) per tensor. Returns bytes read.
template <class Emit>
std::uint64_t read_anchor(const layout::HfModel& hf, const std::filesystem::path& dir,
                          const Manifest& m, Emit&& emit) {
  std::vector<bool> seen(static_cast<std::size_t>(hf.size()), false);
  std::uint64_t bytes = 0;
  for (const ChunkEntry& e : m.chunks) {
    const std::string source = (dir / e.file).string();
    std::vector<std::byte> raw = read_chunk_bytes(dir, e);
    bytes += raw.size();
    const io::SafetensorsFile file = io::SafetensorsFile::parse(std::move(raw), source);
    for (const io::TensorInfo& info : file.tensors()) {
      const std::int64_t t = hf.find(info.name);
      if (t < 0) {
        throw format_error(source + ": tensor '" + info.name + "' is not a tensor of " +
                           hf.spec().name);
      }
      if (seen[static_cast<std::size_t>(t)]) {
        throw format_error(source + ": tensor '" + info.name +
                           "' appears in two files of the anchor");
      }
      seen[static_cast<std::size_t>(t)] = true;
      const auto shape = hf.shape(t);
      if (info.dtype != io::DType::BF16 ||
          !std::equal(
              info.shape.begin(), info.shape.end(), shape.begin(), shape.end(),
              [](std::uint64_t a, std::int64_t b) { return a == static_cast<std::uint64_t>(b); })) {
        throw format_error(source + ": tensor '" + info.name +
                           "' is not BF16 of the model's shape");
      }
      emit(t, file.read_as<std::uint16_t>(info.name, io::DType::BF16));
    }
  }
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    if (!seen[static_cast<std::size_t>(t)]) {
      throw format_error(dir.string() + ": the anchor lacks tensor '" + hf.name(t) + "'");
    }
  }
  return bytes;
}

// The manifests from version `target` down along their bases to the one whose base is `held`,
// or to the newest anchor at or below target when held (no_version: nothing) is not on the
// chain; newest first, at most max_chain of them (step 2 above).
inline std::vector<Manifest> chain_to(const layout::HfModel& hf, const std::filesystem::path& root,
                                      Version target, Version held, std::size_t max_chain) {
  std::vector<Manifest> chain;
  for (Version at = target;;) {
    if (chain.size() == max_chain) {
      throw bounds_error("no anchor within " + std::to_string(max_chain) + " versions below " +
                         std::to_string(target) +
                         " and the version held is not on the chain; anchor more often");
    }
    chain.push_back(read_manifest(hf, root, at));
    const Manifest& m = chain.back();
    if (m.anchor() || (held != no_version && m.base == held)) break;
    at = m.base;
  }
  return chain;
}

class Reader {
 public:
  // Whole replicas `replicas` of `layout`; tensors[k] are the views of receiver rank
  // replicas[k / tp] * tp + k % tp (its tensors in ServingLayout order), owned by the caller.
  Reader(const layout::HfModel& hf, const layout::ServingLayout& layout, std::filesystem::path root,
         std::vector<std::int64_t> replicas, std::vector<ReceiverTensors> tensors,
         ReaderConfig cfg = {})
      : hf_(&hf),
        layout_(&layout),
        root_(std::move(root)),
        replicas_(std::move(replicas)),
        tensors_(std::move(tensors)),
        cfg_(cfg) {
    const std::int64_t tp = layout.topology().tp;
    if (replicas_.empty() || tensors_.size() != replicas_.size() * static_cast<std::size_t>(tp)) {
      throw invalid_argument("storage::Reader: " + std::to_string(replicas_.size()) +
                             " replicas need " + std::to_string(replicas_.size() * tp) +
                             " receiver ranks' tensors, given " + std::to_string(tensors_.size()));
    }
    for (std::int64_t r : replicas_) {
      if (r < 0 || r >= layout.topology().replicas) {
        throw invalid_argument("storage::Reader: replica " + std::to_string(r) +
                               " is not one of the layout's " +
                               std::to_string(layout.topology().replicas));
      }
    }
    fresh_receivers();
  }

  // The version the receivers hold (no_version: nothing yet).
  [[nodiscard]] Version version() const noexcept { return receivers_.front()->version(); }
  // True when the tensors may not all hold one version (see the top): do not serve them.
  [[nodiscard]] bool dirty() const noexcept { return dirty_; }
  [[nodiscard]] std::vector<const Receiver*> receivers() const {
    std::vector<const Receiver*> out;
    for (const auto& r : receivers_)
      out.push_back(r.get());
    return out;
  }

  // To the version LATEST names (nothing when there is none yet).
  ReadReport poll() {
    ReadReport rep;
    rep.from = rep.to = version();
    try {
      const std::optional<Version> latest = read_latest(root_);
      if (!latest) return rep;
      return advance(*latest);
    } catch (const std::exception& e) {
      rep.error = e.what();
    }
    return rep;
  }

  // To version `target` (published, with a manifest). Never throws for what storage holds:
  // the report says what went wrong, and the version held is kept.
  ReadReport advance(Version target) {
    ReadReport rep;
    rep.from = rep.to = version();
    try {
      const Version held = dirty_ ? no_version : version();
      if (held != no_version && target < held) {
        throw protocol_error("version " + std::to_string(target) + " is older than the version " +
                             std::to_string(held) + " held; a reader never moves backwards. " +
                             receive::Core::restarted_hint(held));
      }
      if (held == target) return rep;
      const std::vector<Manifest> chain = chain_to(*hf_, root_, target, held, cfg_.max_chain);
      for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
        apply(*it, rep);
        rep.applied.push_back(it->version);
        rep.to = version();
      }
    } catch (const std::exception& e) {
      rep.error = e.what();
      rep.to = version();
    }
    if (!cfg_.name.empty() && !rep.applied.empty() && !dirty_) {
      try {
        register_reader(root_, cfg_.name, version());
      } catch (const std::exception& e) {
        rep.error += (rep.error.empty() ? "" : "; ") + std::string(e.what());
      }
    }
    return rep;
  }

 private:
  void fresh_receivers() {
    receivers_.clear();
    const std::int64_t tp = layout_->topology().tp;
    for (std::size_t k = 0; k < tensors_.size(); ++k) {
      const std::int64_t rank =
          replicas_[k / static_cast<std::size_t>(tp)] * tp + static_cast<std::int64_t>(k) % tp;
      receivers_.push_back(std::make_unique<Receiver>(*hf_, *layout_, rank, 1, tensors_[k]));
    }
    dirty_ = false;
  }

  // One version: read and checked in full, routed into the staged writes of every served
  // rank; then applied by each rank's receiver core.
  void apply(const Manifest& m, ReadReport& rep) {
    const std::filesystem::path dir = version_dir(root_, m.version);
    const auto tp = static_cast<std::size_t>(layout_->topology().tp);
    std::vector<receive::StagedWrites> staged(receivers_.size());
    for (receive::StagedWrites& w : staged) {
      w.kind = m.anchor() ? MessageKind::full : MessageKind::delta;
      w.version = m.version;
      w.base = m.base;
    }
    // The first served replica's ranks; the others get copies.
    std::vector<receive::StagedWrites*> first(tp);
    for (std::size_t ts = 0; ts < tp; ++ts)
      first[ts] = &staged[ts];
    receive::Router router(*layout_, first);
    if (m.anchor()) {
      rep.bytes_read += read_anchor(*hf_, dir, m, [&](std::int64_t t, const auto& bits) {
        router.route(t, nullptr, bits.data(), bits.size());
      });
    } else {
      std::vector<ChunkEntry> order = m.chunks;
      std::sort(order.begin(), order.end(), [](const ChunkEntry& a, const ChunkEntry& b) {
        return std::pair(a.writer, a.chunk) < std::pair(b.writer, b.chunk);
      });
      const HeldBase held(*this);
      for (const ChunkEntry& e : order) {
        // (device memory is not read back: a class index is then refused, as diff values are)
        const std::vector<std::byte> bytes = read_chunk_bytes(dir, e);
        rep.bytes_read += e.bytes;
        const ChunkHeader expect{m.version, m.base, e.chunk, e.writer};
        const std::string source = (dir / e.file).string();
        (void)visit_chunk(
            *hf_, bytes, source, &expect, receivers_.front()->has_sink() ? nullptr : &held,
            scratch_,
            [&](const Chunk& c, std::int64_t t, std::span<const std::uint32_t> index,
                std::span<const std::uint16_t> bits) {
              const bool diff = c.encoding == Encoding::diff;
              if (diff && receivers_.front()->has_sink()) {
                throw unsupported(source +
                                  ": diff-encoded, and this reader's tensors are device memory it "
                                  "does not read back; publish with the value encoding");
              }
              // diff: each rank's core decodes the codes against the value it holds (the chain
              // holds exactly the base) when it commits; nothing is written until every chunk
              // is decoded.
              for (std::size_t ts = 0; ts < tp; ++ts)
                staged[ts].diff = diff;
              router.route(t, index.data(), bits.data(), index.size());
            });
      }
    }
    for (std::size_t k = tp; k < staged.size(); ++k)
      staged[k] = staged[k % tp];
    // Everything is read and checked: now the receivers.
    if (m.anchor()) {
      fresh_receivers();
      rep.reseeded = true;
    }
    bool committed_any = false;
    for (std::size_t k = 0; k < receivers_.size(); ++k) {
      try {
        committed_any = receivers_[k]->apply(staged[k]) == ApplyOutcome::committed || committed_any;
      } catch (const error& e) {
        if (committed_any) dirty_ = true;
        throw protocol_error(
            "receiver rank " + std::to_string(receivers_[k]->rank()) + " refused version " +
            std::to_string(m.version) + ": " + e.what() +
            (dirty_ ? " (after others committed: reseeding at the next poll)" : ""));
      }
    }
    check_digest(m);
  }

  // What the first served replica holds, as the base of a class index (nothing of the version
  // is applied while its chunks are decoded): one layout lookup per index-contiguous run.
  class HeldBase final : public ClassBase {
   public:
    explicit HeldBase(const Reader& r) : r_(&r) {}
    void bits(std::int64_t tensor, std::uint64_t start, std::uint64_t count,
              std::uint16_t* out) const override {
      while (count > 0) {
        const auto n =
            std::min<std::uint64_t>(count, static_cast<std::uint64_t>(std::max<std::int64_t>(
                                               1, r_->layout_->contiguous(layout::Canonical{
                                                      tensor, static_cast<std::int64_t>(start)}))));
        r_->copy_held(tensor, static_cast<std::int64_t>(start), n, out);
        out += n;
        start += n;
        count -= n;
      }
    }

   private:
    const Reader* r_;
  };

  // The bits the first served replica holds for canonical elements [index, index + n) of
  // `tensor` (n within one index-contiguous run of the layout), into out.
  void copy_held(std::int64_t tensor, std::int64_t index, std::uint64_t n,
                 std::uint16_t* out) const {
    bool first = true;
    layout_->targets(layout::Canonical{tensor, index}, [&](const layout::ReceiverElement& e) {
      if (!first) return;
      first = false;
      const auto held = receivers_[static_cast<std::size_t>(e.ts)]->tensor(e.tensor);
      std::copy_n(held.begin() + static_cast<std::ptrdiff_t>(e.index), n, out);
    });
    if (first) {
      throw error("storage::Reader: element " + std::to_string(index) + " of " + hf_->name(tensor) +
                  " has no receiver copy (report this)");
    }
  }

  // Per served replica and canonical tensor: its ranks' digests hold the manifest's
  // (receive/replica.hpp).
  void check_digest(const Manifest& m) {
    const std::int64_t tp = layout_->topology().tp;
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      for (std::int64_t t = 0; t < hf_->size(); ++t) {
        Digest sum = 0;
        for (std::int64_t ts = 0; ts < tp; ++ts) {
          sum += receivers_[r * static_cast<std::size_t>(tp) + static_cast<std::size_t>(ts)]
                     ->digest()[static_cast<std::size_t>(t)];
        }
        if (!receive::replica_holds(*hf_, *layout_, t, sum,
                                    m.digest[static_cast<std::size_t>(t)])) {
          dirty_ = true;
          throw protocol_error("after applying version " + std::to_string(m.version) +
                               ", replica " + std::to_string(replicas_[r]) + " disagrees with " +
                               "the manifest's digest of " + hf_->name(t) +
                               "; do not serve it: the next poll reseeds from the anchor");
        }
      }
    }
  }

  const layout::HfModel* hf_;
  const layout::ServingLayout* layout_;
  std::filesystem::path root_;
  std::vector<std::int64_t> replicas_;
  std::vector<ReceiverTensors> tensors_;
  ReaderConfig cfg_;
  std::vector<std::unique_ptr<Receiver>> receivers_;
  ChunkScratch scratch_;  // reused from one chunk to the next
  bool dirty_ = false;
};

}  // namespace dte::storage
