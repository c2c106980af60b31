// SPDX-License-Identifier: Apache-2.0
// SenderRank: what one trainer rank does for a publication, whatever carries its messages. Its
// shard is processed in tiles of consecutive offsets, each through the pipeline stages
// (include/dte/pipeline/): detect (validate, reconstruct, classify, digest, dirty mask: one
// bit per element) -> compact (offsets and bits of the flagged elements) -> route (through the
// run table: receiver, receiver tensor, index per copy) -> bucket/encode (appended to one
// message per receiver, in shard order). Tiles run in parallel on the executor; the encode step
// runs in tile order, so messages do not depend on the thread count. Memory: the messages, the
// K-step dirty mask, and tile-sized buffers per executor thread: nothing scales with the model
// but the mask.
//
// Per (receiver, receiver tensor) the elements go as indexed entries or, where the previous
// publication made a run of all values cheaper, as dense runs (a prediction: a wrong guess costs
// bytes, never correctness); full publications and repairs are dense.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/engine/digest.hpp"
#include "dte/engine/message.hpp"
#include "dte/engine/outbox.hpp"
#include "dte/engine/wire.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/shape_check.hpp"
#include "dte/pipeline/compact.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/route.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/transport/payload.hpp"

namespace dte {

namespace detail {

// One run's current values (theta: its buffer, host memory) to one copy, as dense runs of at
// most `chunk` elements.
template <change_detector Detect>
void emit_run(wire::MessageWriter& w, std::span<const float> theta, const pipeline::Run& run,
              const pipeline::RunTarget& t, std::int64_t chunk, std::vector<std::uint16_t>& bits) {
  for (std::int64_t at = 0; at < run.length; at += chunk) {
    const std::int64_t n = std::min(chunk, run.length - at);
    bits.resize(static_cast<std::size_t>(n));
    const float* x = theta.data() + run.shard_begin + at;
    for (std::int64_t j = 0; j < n; ++j)
      bits[static_cast<std::size_t>(j)] = Detect::store(x[j]);
    w.add_run(t.tensor, t.index + static_cast<std::uint32_t>(at), bits);
  }
}

// Repair messages, one per receiver (outbox[d]): every element of the bad canonical tensors to
// every receiver holding it, and everything to the receivers that must resync; current values
// (theta_of(buffer): host memory), as dense runs. Kind repair, or full for a resyncing
// receiver; an empty repair is an empty payload.
template <change_detector Detect, class ThetaOf>
std::vector<Payload> repair_messages(const pipeline::RunTable& table, wire::Outbox& outbox,
                                     ThetaOf&& theta_of, const std::vector<bool>& bad,
                                     const std::vector<bool>& resync, Version version,
                                     std::int64_t chunk) {
  outbox.begin();
  std::vector<std::uint16_t> bits;
  for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
    if (table.runs(b).empty()) continue;
    const std::span<const float> theta = theta_of(b);
    for (const pipeline::Run& run : table.runs(b)) {
      if (!run.sender || run.tensor < 0) continue;
      const bool tensor_bad = bad[static_cast<std::size_t>(run.tensor)];
      for (const pipeline::RunTarget& t : table.targets(run)) {
        if (tensor_bad || resync[t.rank])
          emit_run<Detect>(outbox[t.rank], theta, run, t, chunk, bits);
      }
    }
  }
  std::vector<Payload> out;
  for (std::size_t d = 0; d < outbox.size(); ++d) {
    wire::MessageWriter& w = outbox[d];
    w.finish(resync[d] ? MessageKind::full : MessageKind::repair, version, no_version);
    const bool empty = w.entries() == 0 && w.run_elements() == 0 && !resync[d];
    out.push_back(empty ? Payload{} : w.spans());
  }
  return out;
}

}  // namespace detail

struct ScanResult {
  std::vector<Digest> digest;  // per canonical tensor, this rank's part (not for mark)
  std::uint64_t scanned = 0, changed = 0, guard = 0, entries = 0;
  double seconds = 0;
};

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, executor Exec>
class SenderRank {
 public:
  using kernel = typename Inverse::kernel;
  // Shard offsets per tile: the unit of parallel work and of every per-thread buffer.
  static constexpr std::int64_t tile = std::int64_t{1} << 16;

  SenderRank(const layout::HfModel& hf, const layout::TrainTopology& train,
             const layout::ServingLayout& receivers, std::int64_t rank, bool keep_mask, Exec exec)
      : hf_(&hf),
        recv_(&receivers),
        rank_(rank),
        train_(train),
        plan_(hf, train, receivers, rank),
        table_(plan_, hf, receivers),
        exec_(exec) {
    const auto n_receivers = static_cast<std::size_t>(receivers.topology().ranks());
    outbox_ = wire::Outbox(n_receivers);
    for (layout::BufferKind b : buffers) {
      if (keep_mask) {
        masks_[idx(b)].assign((static_cast<std::size_t>(plan_.shard_size(b)) + 63) / 64, 0);
      }
      // The first run of every tile.
      const auto runs = table_.runs(b);
      const std::int64_t tiles = (plan_.shard_size(b) + tile - 1) / tile;
      std::size_t r = 0;
      for (std::int64_t t = 0; t < tiles; ++t) {
        while (r < runs.size() && runs[r].shard_begin + runs[r].length <= t * tile)
          ++r;
        tile_run_[idx(b)].push_back(static_cast<std::uint32_t>(r));
      }
      tile_run_[idx(b)].push_back(static_cast<std::uint32_t>(runs.size()));
    }
    // How many elements this rank contributes to each (receiver, tensor), in how many runs.
    const std::size_t cells = n_receivers * static_cast<std::size_t>(receivers.size());
    contributed_.assign(cells, 0);
    run_count_.assign(cells, 0);
    dense_.assign(cells, 0);
    for (layout::BufferKind b : buffers) {
      for (const pipeline::Run& run : table_.runs(b)) {
        for (const pipeline::RunTarget& t : table_.targets(run)) {
          contributed_[cell(t.rank, t.tensor)] += static_cast<std::uint64_t>(run.length);
          ++run_count_[cell(t.rank, t.tensor)];
        }
      }
    }
    scratch_.resize(static_cast<std::size_t>(std::max(1, exec_.threads())));
  }

  // One tile's buffers between the stages. The engine reuses one per executor thread, tile after
  // tile; the benchmark keeps one per tile to time each stage on its own.
  struct Tile {
    std::vector<std::uint64_t> words;    // one bit per tile offset: send
    std::vector<std::uint32_t> offsets;  // compacted, tile-relative
    std::vector<std::uint16_t> bits;     // their 16-bit values (full: every value)
    std::size_t compacted = 0;
    pipeline::RoutedEntries routed;
    std::vector<std::pair<std::int32_t, Digest>> digest;  // (canonical tensor, sum)
    pipeline::DetectCounts counts;
    std::uint64_t scanned = 0;
    std::int32_t invalid_segment = -1;

    [[nodiscard]] std::size_t bytes() const noexcept {
      return words.capacity() * 8 + offsets.capacity() * 4 + bits.capacity() * 2 + routed.bytes() +
             digest.capacity() * 16;
    }
  };

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const pipeline::RunTable& runs() const noexcept { return table_; }

  // The staged pass over this rank's shard. Throws (invalid_argument or unsupported, from
  // Inverse::bind) when the optimizer state is refused; nothing is then complete.
  template <class Access>
  ScanResult scan(const Access& access, pipeline::ScanMode mode) {
    const auto t0 = std::chrono::steady_clock::now();
    check_trainer(access);
    using pipeline::ScanMode;
    ScanResult out;
    if (mode != ScanMode::mark) {
      out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
      begin_messages();
    }
    if (mode == ScanMode::all) {
      for (std::size_t x = 0; x < dense_.size(); ++x)
        dense_[x] = contributed_[x] > 0;
    }
    std::vector<std::uint64_t> flagged(contributed_.size(), 0);
    for (layout::BufferKind b : buffers) {
      if (mode != ScanMode::all) bind(access, b);
      scan_buffer(access, b, mode, out, flagged);
      if (invalid_segment_ >= 0) {
        refuse(access, b);  // throws
      }
    }
    if (mode != ScanMode::mark) {
      if (mode != ScanMode::all) emit_dense_runs(access);
      for (std::size_t x = 0; x < dense_.size(); ++x) {
        // Bytes (docs/wire.md): an indexed entry costs 2.1 to 3.6 (2.3 near 90% density), a
        // dense element 2, a group header 20; dense pays only above ~87% of the elements. A
        // full publication says nothing about the next delta: start sparse after it.
        dense_[x] =
            mode != ScanMode::all && flagged[x] * 23 > contributed_[x] * 20 + run_count_[x] * 200;
      }
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  // The same staged pass for shared storage (storage/publisher.hpp): detect and compact as
  // above, then, instead of route and encode, every element to send in canonical coordinates,
  // in shard order: emit(HF tensor, index in the unsharded tensor, bits). all: every element
  // this rank sends. No message is built; the digest and counts are those of scan().
  template <class Access, class Emit>
  ScanResult scan_canonical(const Access& access, pipeline::ScanMode mode, Emit&& emit) {
    const auto t0 = std::chrono::steady_clock::now();
    ScanResult out;
    if (mode != pipeline::ScanMode::mark)
      out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
    std::vector<std::uint64_t> flagged;
    for (layout::BufferKind b : buffers) {
      if (mode != pipeline::ScanMode::all) bind(access, b);
      scan_buffer(access, b, mode, out, flagged, &emit);
      if (invalid_segment_ >= 0) refuse(access, b);  // throws
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  // Starts empty messages (header only): for a no-op version.
  void begin_messages() { outbox_.begin(); }

  void clear_masks() {
    for (auto& m : masks_)
      std::fill(m.begin(), m.end(), 0);
  }

  // Closes this publication's messages and returns them, one per receiver (each at least a
  // header, so every receiver checks the version chain against every sender).
  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    return outbox_.finish(kind, version, base);
  }

  void release() { outbox_.release(); }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept { return outbox_.payload_bytes(); }
  [[nodiscard]] std::uint64_t held_bytes() const noexcept {
    return mask_bytes() + scratch_bytes() + outbox_.capacity_bytes();
  }
  [[nodiscard]] std::uint64_t mask_bytes() const noexcept {
    return 8 * (masks_[0].size() + masks_[1].size());
  }
  // Bounded by the plan, not by what changed: a partly filled chunk per receiver, the tables,
  // the kernels and the tile buffers of every executor thread.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return outbox_.fixed_bytes() + 8 * static_cast<std::uint64_t>(hf_->size()) +
           25 * contributed_.size() + table_.bytes() +
           sizeof(kernel) * (kernels_[0].capacity() + kernels_[1].capacity()) + scratch_bytes();
  }

  // The trainer holds what the plan says, before anything is read: the optimizer-shard sizes
  // always, the parameters' names and local shapes once when the accessor can list them
  // (access.parameters(rank)). A mismatch is a misrouting no digest could catch; it refuses the
  // publication naming the parameter and the likely cause (layout/shape_check.hpp). A buffer
  // the plan leaves empty is never read, so what the accessor returns for it is not checked.
  template <class Access>
  void check_trainer(const Access& access) {
    std::int64_t want[2], held[2];
    for (layout::BufferKind b : buffers) {
      want[idx(b)] = plan_.shard_size(b);
      held[idx(b)] =
          want[idx(b)] == 0 ? 0 : static_cast<std::int64_t>(access.theta(rank_, b).size());
    }
    if constexpr (std::is_same_v<Plan, layout::TransferPlan>) {
      if constexpr (requires { access.parameters(rank_); }) {
        if (!parameters_checked_) {
          layout::check_parameters(hf_->spec(), train_, rank_, access.parameters(rank_));
          parameters_checked_ = true;
        }
      }
      layout::check_shard_sizes(hf_->spec(), train_, rank_, want, held);
    } else {
      for (int k = 0; k < 2; ++k) {
        if (want[k] != held[k]) {
          throw invalid_argument("trainer rank " + std::to_string(rank_) + "'s " +
                                 (k == 0 ? "dense" : "expert") + " shard has " +
                                 std::to_string(held[k]) + " elements where the plan expects " +
                                 std::to_string(want[k]) + ". Nothing was sent.");
        }
      }
    }
  }

  // ---- The stages of one tile, as scan() runs them (public for the benchmark) ----

  // The inverse of every segment of buffer b, without the pass over the elements (the detect
  // stage checks each element as it reads it). Before the detect stage of b's tiles.
  template <class Access>
  void bind(const Access& access, layout::BufferKind b) {
    auto& ks = kernels_[idx(b)];
    ks.clear();
    const std::span<const float> theta = access.theta(rank_, b);
    for (const layout::PlanSegment& s : plan_.segments(b)) {
      const auto part = theta.subspan(static_cast<std::size_t>(s.shard_begin),
                                      static_cast<std::size_t>(s.length));
      ks.push_back(Inverse::bind_unchecked(access.hyperparameters(rank_, b, s), part,
                                           access.state(rank_, b, s), label(s)));
    }
  }

  [[nodiscard]] std::size_t tiles(layout::BufferKind b) const noexcept {
    return tile_run_[idx(b)].size() - 1;
  }

  // Stage 1 over tile t of buffer b (theta: the buffer's weights): the send bits, counts and
  // digest sums of every run piece in the tile; all: every value's bits instead. Resets the
  // tile first; skip: leave it empty (a refusal elsewhere). Returns false when an element is
  // refused (s.invalid_segment names its segment).
  bool detect_tile(std::span<const float> theta, layout::BufferKind b, std::size_t t,
                   pipeline::ScanMode mode, Tile& s, bool skip = false) {
    using pipeline::ScanMode;
    s.counts = {};
    s.scanned = 0;
    s.invalid_segment = -1;
    s.compacted = 0;
    s.digest.clear();
    s.routed.clear();
    if (skip) return false;
    const auto runs = table_.runs(b);
    const auto& segs = plan_.segments(b);
    std::uint64_t* mask = masks_[idx(b)].empty() ? nullptr : masks_[idx(b)].data();
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    const std::int64_t end = std::min(plan_.shard_size(b), begin + tile);
    const auto n = static_cast<std::size_t>(end - begin);
    s.words.assign((n + 63) / 64, 0);
    if (mode == ScanMode::all) s.bits.resize(n);
    for (std::uint32_t r = tile_run_[idx(b)][t]; r < runs.size(); ++r) {
      const pipeline::Run& run = runs[r];
      if (run.shard_begin >= end) break;
      const std::int64_t lo = std::max(begin, run.shard_begin);
      const std::int64_t hi = std::min(end, run.shard_begin + run.length);
      const bool send = run.sender && run.tensor >= 0;
      const std::int64_t canonical = send ? run.canonical + (lo - run.shard_begin) : -1;
      const auto len = static_cast<std::size_t>(hi - lo);
      Digest digest = 0;
      if (mode == ScanMode::all) {
        if (!send) continue;
        digest = pipeline::store_piece<Detect>(theta.data() + lo, len, canonical,
                                               s.bits.data() + (lo - begin));
        s.scanned += len;
      } else {
        const layout::PlanSegment& seg = segs[static_cast<std::size_t>(run.segment)];
        const pipeline::Piece piece{static_cast<std::size_t>(lo - seg.shard_begin), len, canonical,
                                    send};
        const pipeline::DetectCounts c = pipeline::detect<Detect>(
            exec_, kernels_[idx(b)][static_cast<std::size_t>(run.segment)], piece, mode, mask,
            static_cast<std::uint64_t>(lo), s.words.data(), static_cast<std::uint64_t>(lo - begin));
        if (c.invalid >= 0) {
          s.invalid_segment = run.segment;
          return false;
        }
        s.counts += c;
        digest = c.digest;
        if (send && mode != ScanMode::mark) s.scanned += len;
      }
      if (send && mode != ScanMode::mark) {
        if (!s.digest.empty() && s.digest.back().first == run.tensor) {
          s.digest.back().second += digest;
        } else {
          s.digest.emplace_back(run.tensor, digest);
        }
      }
    }
    return true;
  }

  // Stage 2: the flagged offsets of the tile and their bits.
  void compact_tile(std::span<const float> theta, layout::BufferKind b, std::size_t t, Tile& s) {
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    const auto n = static_cast<std::size_t>(std::min(plan_.shard_size(b), begin + tile) - begin);
    s.offsets.resize(n);
    s.bits.resize(n);
    s.compacted = pipeline::compact<Detect>(s.words.data(), n, theta.data() + begin,
                                            s.offsets.data(), s.bits.data());
  }

  // Stage 3: every receiver copy of the compacted elements.
  void route_tile(layout::BufferKind b, std::size_t t, Tile& s) {
    const auto runs = table_.runs(b);
    const std::uint32_t first = tile_run_[idx(b)][t];
    const std::uint32_t stop_run = std::min<std::uint32_t>(static_cast<std::uint32_t>(runs.size()),
                                                           tile_run_[idx(b)][t + 1] + 1);
    s.routed.clear();
    pipeline::route(table_, runs.subspan(first, stop_run - first),
                    static_cast<std::int64_t>(t) * tile, std::span(s.offsets).first(s.compacted),
                    std::span(s.bits).first(s.compacted), s.routed);
  }

  // Stage 3 for storage: the compacted elements of tile t in canonical coordinates, in order;
  // emit(tensor, index, bits), or, for an emitter with a `wants_base` member, emit(tensor,
  // index, bits, what the previous bits can be: PreviousBits).
  template <class Emit>
  void canonical_tile(layout::BufferKind b, std::size_t t, const Tile& s, Emit&& emit) const {
    const auto runs = table_.runs(b);
    std::uint32_t r = tile_run_[idx(b)][t];
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    for (std::size_t k = 0; k < s.compacted; ++k) {
      const std::int64_t o = begin + s.offsets[k];
      while (runs[r].shard_begin + runs[r].length <= o)
        ++r;
      const pipeline::Run& run = runs[r];
      if (!run.sender || run.tensor < 0) continue;  // (detect flags neither)
      const auto tensor = static_cast<std::uint32_t>(run.tensor);
      const auto index = static_cast<std::uint32_t>(run.canonical - (*hf_)[run.tensor].base +
                                                    (o - run.shard_begin));
      if constexpr (requires { requires std::remove_cvref_t<Emit>::wants_base; }) {
        // The emitter also wants what the previous stored value can be (the reconstruction of
        // the last step, re-evaluated for the changed elements only).
        const layout::PlanSegment& seg = plan_.segments(b)[static_cast<std::size_t>(run.segment)];
        const auto prev = kernels_[idx(b)][static_cast<std::size_t>(run.segment)](
            static_cast<std::size_t>(o - seg.shard_begin));
        emit(tensor, index, s.bits[k], Detect::previous(prev));
      } else {
        emit(tensor, index, s.bits[k]);
      }
    }
  }

  // Stage 4, in tile order: each routed entry appended to its receiver's message (the messages
  // are the buckets), except for (receiver, tensor) pairs sent dense this time; flagged counts
  // the entries per pair for the next publication's dense prediction.
  void encode_tile(const Tile& s, ScanResult& out, std::vector<std::uint64_t>& flagged) {
    out.changed += s.counts.flagged;
    const pipeline::RoutedEntries& e = s.routed;
    for (std::size_t i = 0; i < e.size(); ++i) {
      const std::size_t x = cell(e.rank[i], e.tensor[i]);
      ++flagged[x];
      if (dense_[x]) continue;
      outbox_[e.rank[i]].add(e.tensor[i], e.index[i], e.bits[i]);
      ++out.entries;
    }
  }

  // Repair messages (detail::repair_messages) from the access's current weights.
  template <class Access>
  std::vector<Payload> repair(const Access& access, const std::vector<bool>& bad,
                              const std::vector<bool>& resync, Version version) {
    return detail::repair_messages<Detect>(
        table_, outbox_, [&](layout::BufferKind b) { return access.theta(rank_, b); }, bad, resync,
        version, tile);
  }

 private:
  static constexpr layout::BufferKind buffers[2] = {layout::BufferKind::dense,
                                                    layout::BufferKind::expert};
  static int idx(layout::BufferKind b) noexcept { return static_cast<int>(b); }

  [[nodiscard]] std::uint64_t scratch_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const Tile& s : scratch_)
      n += s.bytes();
    return n;
  }

  [[nodiscard]] std::size_t cell(std::uint32_t rank, std::uint32_t tensor) const noexcept {
    return static_cast<std::size_t>(rank) * static_cast<std::size_t>(recv_->size()) + tensor;
  }

  [[nodiscard]] std::string label(const layout::PlanSegment& s) const {
    return "trainer rank " + std::to_string(rank_) + " " +
           std::string(plan_.params()[static_cast<std::size_t>(s.param)].name());
  }

  // A segment's state was refused by the detect stage: bind with every check, which throws
  // the message a user can act on.
  template <class Access>
  [[noreturn]] void refuse(const Access& access, layout::BufferKind b) {
    const layout::PlanSegment& s = plan_.segments(b)[static_cast<std::size_t>(invalid_segment_)];
    invalid_segment_ = -1;
    const std::span<const float> theta = access.theta(rank_, b).subspan(
        static_cast<std::size_t>(s.shard_begin), static_cast<std::size_t>(s.length));
    (void)Inverse::bind(access.hyperparameters(rank_, b, s), theta, access.state(rank_, b, s),
                        label(s));
    throw invalid_argument(label(s) + ": the optimizer state failed an element check that " +
                           std::string(Inverse::name) +
                           "::bind accepts; report this to the "
                           "dte developers");
  }

  // canonical: null for messages (route, then encode into the outbox); else the storage
  // emitter of scan_canonical (no route, no outbox).
  template <class Access, class Canonical = std::nullptr_t>
  void scan_buffer(const Access& access, layout::BufferKind b, pipeline::ScanMode mode,
                   ScanResult& out, std::vector<std::uint64_t>& flagged,
                   Canonical* canonical = nullptr) {
    constexpr bool to_storage = !std::is_same_v<Canonical, std::nullptr_t>;
    using pipeline::ScanMode;
    if (plan_.shard_size(b) == 0) return;
    const std::span<const float> theta = access.theta(rank_, b);
    std::atomic<bool> stop{false};  // a refusal: later tiles need not be looked at
    auto par = [&](std::size_t t, int worker) {
      Tile& s = scratch_[static_cast<std::size_t>(worker)];
      if (!detect_tile(theta, b, t, mode, s, stop.load(std::memory_order_relaxed))) return;
      if (mode == ScanMode::mark || mode == ScanMode::all) return;
      compact_tile(theta, b, t, s);
      if constexpr (!to_storage) route_tile(b, t, s);
    };
    auto ser = [&](std::size_t t, int worker) {
      Tile& s = scratch_[static_cast<std::size_t>(worker)];
      if (stop.load(std::memory_order_relaxed)) return;
      if (s.invalid_segment >= 0) {
        invalid_segment_ = s.invalid_segment;
        stop.store(true, std::memory_order_relaxed);
        return;
      }
      out.scanned += s.scanned;
      out.guard += s.counts.guard;
      for (const auto& [tensor, d] : s.digest)
        out.digest[static_cast<std::size_t>(tensor)] += d;
      if (mode == ScanMode::mark) return;
      if constexpr (to_storage) {
        if (mode == ScanMode::all) {
          all_canonical_tile(b, t, s, *canonical);
        } else {
          out.changed += s.counts.flagged;
          out.entries += s.compacted;
          canonical_tile(b, t, s, *canonical);
        }
      } else if (mode == ScanMode::all) {
        emit_tile_runs(b, t, s);
      } else {
        encode_tile(s, out, flagged);
      }
    };
    exec_.for_each_ordered(tiles(b), par, ser);
    if (mode == ScanMode::all) {
      for (const pipeline::Run& run : table_.runs(b)) {
        if (run.sender && run.tensor >= 0) out.changed += static_cast<std::uint64_t>(run.length);
      }
    }
  }

  // A full publication: f(run, offset of the piece in the run, its bits) for tile t's piece of
  // every run this rank sends (s.bits holds every value of the tile).
  template <class F>
  void for_each_sent_piece(layout::BufferKind b, std::size_t t, const Tile& s, F&& f) const {
    const auto runs = table_.runs(b);
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    const std::int64_t end = std::min(plan_.shard_size(b), begin + tile);
    for (std::uint32_t r = tile_run_[idx(b)][t]; r < runs.size(); ++r) {
      const pipeline::Run& run = runs[r];
      if (run.shard_begin >= end) break;
      if (!run.sender || run.tensor < 0) continue;
      const std::int64_t lo = std::max(begin, run.shard_begin);
      const std::int64_t hi = std::min(end, run.shard_begin + run.length);
      f(run, lo - run.shard_begin,
        std::span<const std::uint16_t>(s.bits.data() + (lo - begin),
                                       static_cast<std::size_t>(hi - lo)));
    }
  }

  // ... as dense runs to every copy.
  void emit_tile_runs(layout::BufferKind b, std::size_t t, const Tile& s) {
    for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          for (const pipeline::RunTarget& target : table_.targets(run)) {
            outbox_[target.rank].add_run(target.tensor,
                                         target.index + static_cast<std::uint32_t>(at), bits);
          }
        });
  }

  // ... to storage, canonically.
  template <class Emit>
  void all_canonical_tile(layout::BufferKind b, std::size_t t, const Tile& s, Emit& emit) const {
    for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          const std::int64_t first = run.canonical - (*hf_)[run.tensor].base + at;
          for (std::size_t j = 0; j < bits.size(); ++j) {
            emit(static_cast<std::uint32_t>(run.tensor),
                 static_cast<std::uint32_t>(first + static_cast<std::int64_t>(j)), bits[j]);
          }
        });
  }

  // The dense part of a delta: every element of each dense (receiver, tensor) pair.
  template <class Access>
  void emit_dense_runs(const Access& access) {
    if (std::find(dense_.begin(), dense_.end(), std::uint8_t{1}) == dense_.end()) return;
    std::vector<std::uint16_t> bits;
    for (layout::BufferKind b : buffers) {
      const std::span<const float> theta = access.theta(rank_, b);
      for (const pipeline::Run& run : table_.runs(b)) {
        for (const pipeline::RunTarget& t : table_.targets(run)) {
          if (dense_[cell(t.rank, t.tensor)]) {
            detail::emit_run<Detect>(outbox_[t.rank], theta, run, t, tile, bits);
          }
        }
      }
    }
  }

  const layout::HfModel* hf_;
  const layout::ServingLayout* recv_;
  std::int64_t rank_;
  layout::TrainTopology train_;
  bool parameters_checked_ = false;
  Plan plan_;
  pipeline::RunTable table_;
  Exec exec_;
  std::vector<std::uint32_t> tile_run_[2];  // per buffer: the first run of each tile (+ end)
  std::vector<kernel> kernels_[2];          // per buffer: the inverse of each plan segment
  std::vector<std::uint64_t> masks_[2];     // K > 1: one bit per shard element, per buffer
  wire::Outbox outbox_;                     // one message per receiver
  std::vector<std::uint64_t> contributed_, run_count_;  // per receiver * receiver tensor
  std::vector<std::uint8_t> dense_;
  std::vector<Tile> scratch_;  // one per executor thread
  std::int32_t invalid_segment_ = -1;
};

namespace detail {
// The sender an engine over executor Exec runs: SenderRank on the host; the CUDA backend
// specialises it for exec::Cuda (engine/device_sender.cuh).
template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, executor Exec>
struct sender_rank {
  using type = SenderRank<Inverse, Detect, Plan, Exec>;
};
}  // namespace detail

}  // namespace dte
