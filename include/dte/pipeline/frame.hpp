// SPDX-License-Identifier: Apache-2.0
// SenderFrame: what one trainer rank does for a publication on the host, whatever the elements
// become. Its shard is processed in tiles of consecutive offsets, each through the pipeline
// stages (include/dte/pipeline/): detect (validate, reconstruct, classify, digest, dirty mask:
// one bit per element) -> compact (offsets and bits of the flagged elements); then a sink
// chosen by the caller takes them, tile by tile in shard order:
//   - the routing sink (engine/routing_sink.hpp): route through the run table to every receiver
//     copy, then encode one wire message per receiver (the engine's outbox);
//   - the chunk sink (storage/chunk_sink.hpp): every element in canonical coordinates into
//     chunks (storage versions, publication messages).
//   - either behind pipeline/flag_sink.hpp, which hands the changed elements of FP8 receivers'
//     quantized tensors to an FP8 stage.
// A sink has begin(frame, mode); prepare(frame, buffer, tile, scratch) (in parallel); changed or
// all(frame, buffer, tile, scratch) (serial: a delta's compacted elements or a full pass's
// values); end(frame, access, mode); and entries(), what it wrote one by one.
// Tiles run in parallel on the executor; the sink's serial step runs in tile order, so what it
// writes does not depend on the thread count. Memory: the K-step dirty mask and tile-sized
// buffers per executor thread: nothing scales with the model but the mask.
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
#include "dte/core/digest.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/shape_check.hpp"
#include "dte/pipeline/compact.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/detect_vector.hpp"
#include "dte/pipeline/route.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/pipeline/segment_weights.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

// What one rank's pass found (the digest and counts are this rank's part).
struct ScanResult {
  std::vector<Digest> digest;  // per canonical tensor (not for mark)
  std::uint64_t scanned = 0;   // elements looked at
  std::uint64_t changed = 0;   // elements sent (full: every element this rank sends)
  std::uint64_t guard = 0;     // of the changed, sent because of the guard band only
  std::uint64_t entries = 0;   // what the sink wrote one by one (not as dense runs): entries()
  double seconds = 0;
};

template <optimizer_inverse Inverse, change_detector Detect, transfer_plan Plan, executor Exec>
class SenderFrame {
 public:
  using kernel = typename Inverse::kernel;
  using detector = Detect;
  // Shard offsets per tile: the unit of parallel work and of every per-thread buffer.
  static constexpr std::int64_t tile = std::int64_t{1} << 16;

  // receivers: the serving layout a routing sink writes into (the runs are then affine in every
  // receiver copy too), or null for a sink that writes canonical coordinates.
  SenderFrame(const layout::HfModel& hf, const layout::TrainTopology& train,
              const layout::ServingLayout* receivers, std::int64_t rank, bool keep_mask, Exec exec)
      : hf_(&hf),
        receivers_(receivers),
        rank_(rank),
        train_(train),
        plan_(hf, train, rank),
        table_(plan_, hf, receivers),
        exec_(exec) {
    init(keep_mask);
  }

  // The same over a plan the caller built (layout::LocalShardPlan: pieces a sharded PyTorch
  // trainer rank holds), for a sink that writes canonical coordinates.
  SenderFrame(const layout::HfModel& hf, Plan plan, std::int64_t rank, bool keep_mask, Exec exec)
      : hf_(&hf),
        receivers_(nullptr),
        rank_(rank),
        plan_(std::move(plan)),
        table_(plan_, hf, nullptr),
        exec_(exec) {
    init(keep_mask);
  }

 private:
  void init(bool keep_mask) {
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
    scratch_.resize(static_cast<std::size_t>(std::max(1, exec_.threads())));
  }

 public:
  // One tile's buffers between the stages. The frame reuses one per executor thread, tile after
  // tile; the benchmark keeps one per tile to time each stage on its own.
  struct Tile {
    std::vector<std::uint64_t> words;    // one bit per tile offset: send
    std::vector<std::uint32_t> offsets;  // compacted, tile-relative
    std::vector<std::uint16_t> bits;     // their 16-bit values (full: every value)
    std::size_t compacted = 0;
    pipeline::RoutedEntries routed;                       // the routing sink's
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
  [[nodiscard]] const layout::HfModel& model() const noexcept { return *hf_; }
  [[nodiscard]] const layout::ServingLayout* receivers() const noexcept { return receivers_; }
  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const pipeline::RunTable& runs() const noexcept { return table_; }

  // A publication's pass over this rank's shard (mode all, detect or mask), written into sink.
  // Throws (invalid_argument or unsupported, from Inverse::bind) when the optimizer state is
  // refused; what the sink holds is then incomplete and must be discarded.
  template <class Access, class Sink>
  ScanResult scan(const Access& access, pipeline::ScanMode mode, Sink& sink) {
    const auto t0 = std::chrono::steady_clock::now();
    check_trainer(access);
    ScanResult out;
    out.digest.assign(static_cast<std::size_t>(hf_->size()), 0);
    sink.begin(*this, mode);
    for (layout::BufferKind b : buffers) {
      if (mode != pipeline::ScanMode::all) bind(access, b);
      scan_buffer(access, b, mode, out, sink);
      if (invalid_segment_ >= 0) refuse(access, b);  // throws
    }
    sink.end(*this, access, mode);
    out.entries = sink.entries();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  // Between publications (publish_every > 1): ORs this step's changes into the dirty mask.
  // Throws as scan() does.
  template <class Access>
  ScanResult mark(const Access& access) {
    const auto t0 = std::chrono::steady_clock::now();
    check_trainer(access);
    ScanResult out;
    Marking none;
    for (layout::BufferKind b : buffers) {
      bind(access, b);
      scan_buffer(access, b, pipeline::ScanMode::mark, out, none);
      if (invalid_segment_ >= 0) refuse(access, b);  // throws
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
  }

  void clear_masks() {
    for (auto& m : masks_)
      std::fill(m.begin(), m.end(), 0);
  }

  [[nodiscard]] std::uint64_t mask_bytes() const noexcept {
    return 8 * (masks_[0].size() + masks_[1].size());
  }
  // The tile buffers of every executor thread.
  [[nodiscard]] std::uint64_t tile_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const Tile& s : scratch_)
      n += s.bytes();
    return n;
  }
  // Bounded by the plan, not by what changed: the tables, the kernels and the tile buffers.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return 8 * static_cast<std::uint64_t>(hf_->size()) + table_.bytes() +
           sizeof(kernel) * (kernels_[0].capacity() + kernels_[1].capacity()) + tile_bytes();
  }

  // The trainer holds what the plan says, before anything is read: the optimizer-shard sizes
  // always, the parameters' names and local shapes once when the accessor can list them
  // (access.parameters(rank)). A mismatch is a misrouting no digest could catch; it refuses the
  // publication naming the parameter and the likely cause (layout/shape_check.hpp). A buffer
  // the plan leaves empty is never read, so what the accessor returns for it is not checked.
  template <class Access>
  void check_trainer(const Access& access) {
    if constexpr (segmented_access<Access>) {
      // (each segment's weights apart: weights() checks each one's size as it binds it)
      return;
    } else {
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
  }

  // ---- The stages of one tile, as scan() runs them (public for the sinks and the benchmark) --

  // The inverse of every segment of buffer b, without the pass over the elements (the detect
  // stage checks each element as it reads it). Before the detect stage of b's tiles.
  template <class Access>
  void bind(const Access& access, layout::BufferKind b) {
    auto& ks = kernels_[idx(b)];
    ks.clear();
    for (const layout::PlanSegment& s : plan_.segments(b)) {
      ks.push_back(Inverse::bind_unchecked(access.hyperparameters(rank_, b, s),
                                           weights(access, b, s), access.state(rank_, b, s),
                                           label(s)));
    }
  }

  // Segment s's weights (s.length of them).
  template <class Access>
  [[nodiscard]] std::span<const float> weights(const Access& access, layout::BufferKind b,
                                               const layout::PlanSegment& s) const {
    return pipeline::segment_weights(access, rank_, b, s, label(s));
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
        digest = pipeline::store_piece<Detect>(at(theta, b, run, lo), len, canonical,
                                               s.bits.data() + (lo - begin));
        s.scanned += len;
      } else {
        const layout::PlanSegment& seg = segs[static_cast<std::size_t>(run.segment)];
        const pipeline::Piece piece{static_cast<std::size_t>(lo - seg.shard_begin), len, canonical,
                                    send};
        const pipeline::DetectCounts c = pipeline::detect<Detect>(
            kernels_[idx(b)][static_cast<std::size_t>(run.segment)], piece, mode, mask,
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

  // Stage 2: the flagged offsets of the tile and their bits (theta empty: a segmented accessor's,
  // each read where its segment lives).
  void compact_tile(std::span<const float> theta, layout::BufferKind b, std::size_t t, Tile& s) {
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    const auto n = static_cast<std::size_t>(std::min(plan_.shard_size(b), begin + tile) - begin);
    s.offsets.resize(n);
    s.bits.resize(n);
    if (!theta.empty()) {
      s.compacted = pipeline::compact<Detect>(s.words.data(), n, theta.data() + begin,
                                              s.offsets.data(), s.bits.data());
      return;
    }
    s.compacted = pipeline::compact_offsets(s.words.data(), n, s.offsets.data());
    const auto runs = table_.runs(b);
    std::uint32_t r = tile_run_[idx(b)][t];
    for (std::size_t k = 0; k < s.compacted; ++k) {
      const std::int64_t o = begin + s.offsets[k];
      while (runs[r].shard_begin + runs[r].length <= o)
        ++r;
      s.bits[k] = Detect::store(*at(theta, b, runs[r], o));
    }
  }

  // Stage 3 of the routing sink: every receiver copy of the compacted elements (the frame was
  // built with receivers).
  void route_tile(layout::BufferKind b, std::size_t t, Tile& s) const {
    const auto runs = table_.runs(b);
    const std::uint32_t first = tile_run_[idx(b)][t];
    const std::uint32_t stop_run = std::min<std::uint32_t>(static_cast<std::uint32_t>(runs.size()),
                                                           tile_run_[idx(b)][t + 1] + 1);
    s.routed.clear();
    pipeline::route(table_, runs.subspan(first, stop_run - first),
                    static_cast<std::int64_t>(t) * tile, std::span(s.offsets).first(s.compacted),
                    std::span(s.bits).first(s.compacted), s.routed);
  }

  // A delta: f(run, shard offset, bits) for every compacted element of tile t, in shard order.
  template <class F>
  void for_each_changed(layout::BufferKind b, std::size_t t, const Tile& s, F&& f) const {
    const auto runs = table_.runs(b);
    std::uint32_t r = tile_run_[idx(b)][t];
    const std::int64_t begin = static_cast<std::int64_t>(t) * tile;
    for (std::size_t k = 0; k < s.compacted; ++k) {
      const std::int64_t o = begin + s.offsets[k];
      while (runs[r].shard_begin + runs[r].length <= o)
        ++r;
      if (!runs[r].sender || runs[r].tensor < 0) continue;  // (detect flags neither)
      f(runs[r], o, s.bits[k]);
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

  // The index in its HF tensor of the element at shard offset o of run (which sends it).
  [[nodiscard]] std::uint32_t canonical_index(const pipeline::Run& run,
                                              std::int64_t o) const noexcept {
    return pipeline::canonical_index(*hf_, run, o);
  }

  // What the previous published bits of the element at shard offset o of run (buffer b) can be:
  // the reconstruction of the last step, re-evaluated (after bind, during the scan).
  [[nodiscard]] PreviousBits previous(layout::BufferKind b, const pipeline::Run& run,
                                      std::int64_t o) const {
    const layout::PlanSegment& seg = plan_.segments(b)[static_cast<std::size_t>(run.segment)];
    return Detect::previous(kernels_[idx(b)][static_cast<std::size_t>(run.segment)](
        static_cast<std::size_t>(o - seg.shard_begin)));
  }

 private:
  static constexpr layout::BufferKind buffers[2] = {layout::BufferKind::dense,
                                                    layout::BufferKind::expert};
  static int idx(layout::BufferKind b) noexcept { return static_cast<int>(b); }

  // The weight at shard offset o of run (buffer b): in theta, or (theta empty) in its segment.
  [[nodiscard]] const float* at(std::span<const float> theta, layout::BufferKind b,
                                const pipeline::Run& run, std::int64_t o) const noexcept {
    if (!theta.empty()) return theta.data() + o;
    const layout::PlanSegment& seg = plan_.segments(b)[static_cast<std::size_t>(run.segment)];
    return segment_theta_[idx(b)][static_cast<std::size_t>(run.segment)] + (o - seg.shard_begin);
  }

  // The sink of mark(): nothing is written.
  struct Marking {
    void prepare(const SenderFrame&, layout::BufferKind, std::size_t, Tile&) {}
    void changed(const SenderFrame&, layout::BufferKind, std::size_t, const Tile&) {}
    void all(const SenderFrame&, layout::BufferKind, std::size_t, const Tile&) {}
  };

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
    (void)Inverse::bind(access.hyperparameters(rank_, b, s), weights(access, b, s),
                        access.state(rank_, b, s), label(s));
    throw invalid_argument(label(s) + ": the optimizer state failed an element check that " +
                           std::string(Inverse::name) +
                           "::bind accepts; report this to the "
                           "dte developers");
  }

  // The tiles of buffer b: detect and compact (and the sink's prepare) in parallel, then the
  // counts, the digest and the sink's write in tile order.
  template <class Access, class Sink>
  void scan_buffer(const Access& access, layout::BufferKind b, pipeline::ScanMode mode,
                   ScanResult& out, Sink& sink) {
    using pipeline::ScanMode;
    if (plan_.shard_size(b) == 0) return;
    std::span<const float> theta;
    if constexpr (segmented_access<Access>) {
      auto& w = segment_theta_[idx(b)];
      w.clear();
      for (const layout::PlanSegment& s : plan_.segments(b))
        w.push_back(weights(access, b, s).data());
    } else {
      theta = access.theta(rank_, b);
    }
    std::atomic<bool> stop{false};  // a refusal: later tiles need not be looked at
    auto par = [&](std::size_t t, int worker) {
      Tile& s = scratch_[static_cast<std::size_t>(worker)];
      if (!detect_tile(theta, b, t, mode, s, stop.load(std::memory_order_relaxed))) return;
      if (mode == ScanMode::mark || mode == ScanMode::all) return;
      compact_tile(theta, b, t, s);
      sink.prepare(*this, b, t, s);
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
      if (mode == ScanMode::all) {
        sink.all(*this, b, t, s);
      } else {
        out.changed += s.counts.flagged;
        sink.changed(*this, b, t, s);
      }
    };
    exec_.for_each_ordered(tiles(b), par, ser);
    if (mode == ScanMode::all) {
      for (const pipeline::Run& run : table_.runs(b)) {
        if (run.sender && run.tensor >= 0) out.changed += static_cast<std::uint64_t>(run.length);
      }
    }
  }

  const layout::HfModel* hf_;
  const layout::ServingLayout* receivers_;
  std::int64_t rank_;
  layout::TrainTopology train_;
  bool parameters_checked_ = false;
  Plan plan_;
  pipeline::RunTable table_;
  Exec exec_;
  std::vector<std::uint32_t> tile_run_[2];      // per buffer: the first run of each tile (+ end)
  std::vector<kernel> kernels_[2];              // per buffer: the inverse of each plan segment
  std::vector<std::uint64_t> masks_[2];         // K > 1: one bit per shard element, per buffer
  std::vector<const float*> segment_theta_[2];  // a segmented accessor's, per plan segment
  std::vector<Tile> scratch_;                   // one per executor thread
  std::int32_t invalid_segment_ = -1;
};

}  // namespace dte
