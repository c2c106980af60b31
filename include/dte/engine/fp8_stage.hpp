// SPDX-License-Identifier: Apache-2.0
// The FP8 side of the engine's trainer ranks (docs/fp8.md, "The engine"): the receivers serve
// online FP8 (layout/fp8_grid.hpp), and a block of a receiver's weight may hold elements of
// several trainer ranks, so its new scale is a reduction over the world. One publication:
//   1. the scan (pipeline/frame.hpp) flags the elements whose BF16 value can have changed;
//      pipeline::FlagSink gives those of quantized tensors here, with what their previous bits
//      can be (one optimizer step's detect pass), and the routing sink the others;
//   2. local(): per block of one replica's receivers, this rank's largest magnitude, whether it
//      flagged an element there, and (trainers - rank) where it holds one; every rank of the
//      world takes the element-wise maximum (transport max(); receiver ranks give zeros), so
//      every trainer rank knows each block's new scale, whether it is touched, and its owner
//      (the lowest trainer rank holding an element of it);
//   3. finish(): for its elements of touched blocks, the codes that can differ from what the
//      receivers hold (the send rule, detect/fp8.hpp's fp8_held_code: a flagged element unless
//      its previous bits give the new code under the old scale; any element the new scale moves);
//      the owner adds the scale where it changed; one FP8 part per TP rank (receive/fp8_part.hpp),
//      which the engine attaches to each replica's message; and this rank's share of every
//      quantized tensor's digest (codes and scales after the version), which the engine sums over
//      the trainer ranks for the receivers to check against.
// The rank keeps per block the scale the receivers hold and its share of the block's digest
// (8 bytes per 16,384 elements); a full publication sends every code and scale.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/core/digest.hpp"
#include "dte/core/message.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/receive/fp8_core.hpp"
#include "dte/receive/fp8_part.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

// The blocks of one replica's quantized tensors, numbered (TP rank, quantized tensor, block):
// the length of each third of the engine's max-reduction, the same on every rank.
inline std::size_t fp8_blocks(const layout::Fp8Grid& grid) {
  std::size_t n = 0;
  for (std::int64_t id : grid.quantized_ids())
    n += static_cast<std::size_t>(grid.grid(id).blocks());
  return n * static_cast<std::size_t>(grid.layout().topology().tp);
}

template <fp8_recipe Recipe, change_detector Detect>
class EngineFp8Stage {
 public:
  // receivers: the engine's serving layout (every replica); table: this trainer rank's runs.
  EngineFp8Stage(const layout::HfModel& hf, const layout::ServingLayout& receivers,
                 const pipeline::RunTable& table, std::int64_t rank, std::int64_t trainers)
      : hf_(&hf),
        table_(&table),
        grid_(receivers, Recipe::block_rows, Recipe::block_cols),
        tp_(receivers.topology().tp),
        rank_(rank),
        trainers_(trainers) {
    const std::vector<std::int64_t>& ids = grid_.quantized_ids();
    slot_.assign(static_cast<std::size_t>(receivers.size()), -1);
    for (std::size_t k = 0; k < ids.size(); ++k)
      slot_[static_cast<std::size_t>(ids[k])] = static_cast<std::int64_t>(k);
    std::size_t at = 0;
    for (std::int64_t ts = 0; ts < tp_; ++ts) {
      for (std::int64_t id : ids) {
        base_.push_back(at);
        at += static_cast<std::size_t>(grid_.grid(id).blocks());
      }
    }
    blocks_ = at;
    scale_.assign(blocks_, 0.0f);
    share_.assign(blocks_, 0);
  }

  [[nodiscard]] const layout::Fp8Grid& grid() const noexcept { return grid_; }
  [[nodiscard]] std::size_t blocks() const noexcept { return blocks_; }
  [[nodiscard]] bool takes(std::int64_t t) const noexcept {
    return layout::Fp8Grid::quantized_hf((*hf_)[t].kind);
  }

  void begin(bool full) {
    full_ = full || !known_;
    known_ = false;  // (until finish() completes)
    for (auto& f : flags_)
      f.clear();
  }

  // A flagged element of a quantized tensor: shard offset o of buffer b, in shard order
  // (pipeline/flag_sink.hpp).
  void changed(layout::BufferKind b, const pipeline::Run&, std::int64_t o,
               const PreviousBits& prev) {
    flags_[static_cast<int>(b)].push_back({o, prev});
  }

  // This rank's part of the max-reduction: [amax bits | touched | trainers - rank], per block.
  // The amax of a piece of a block: its largest FP32 magnitude, rounded once (abs_max_bits).
  template <class ThetaOf>
  std::vector<std::uint64_t> local(ThetaOf&& theta_of) const {
    std::vector<std::uint64_t> v(3 * blocks_, 0);
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      if (table_->runs(b).empty()) continue;
      const std::span<const float> theta = theta_of(b);
      for_each_piece(b, [&](const pipeline::Run&, std::size_t blk, std::int64_t, std::int64_t so,
                            std::int64_t n) {
        const std::uint32_t top = abs_max_bits(theta.data() + so, n);
        const std::uint64_t m = float_bits(Recipe::magnitude(Detect::store(bits_float(top))));
        v[blk] = std::max(v[blk], m);
        v[2 * blocks_ + blk] = static_cast<std::uint64_t>(trainers_ - rank_);
      });
    }
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      walk_flags(b, [&](std::size_t blk) { v[blocks_ + blk] = 1; });
    }
    return v;
  }

  // After the reduction (`global`): the parts, one per TP rank (empty: nothing to write), and
  // this rank's share of each (TP rank, quantized tensor)'s digest.
  template <class ThetaOf>
  std::vector<std::vector<std::byte>> finish(std::span<const std::uint64_t> global,
                                             ThetaOf&& theta_of, Version version, Version base,
                                             std::vector<Digest>& digest_share) {
    const std::vector<std::int64_t>& ids = grid_.quantized_ids();
    const std::size_t nq = ids.size();
    sent_codes_ = sent_scales_ = 0;
    std::vector<float> scale(blocks_);
    std::vector<bool> touched(blocks_);
    for (std::size_t blk = 0; blk < blocks_; ++blk) {
      scale[blk] = Recipe::scale(bits_float(static_cast<std::uint32_t>(global[blk])));
      touched[blk] = full_ || global[blocks_ + blk] != 0;
      if (touched[blk]) share_[blk] = 0;
    }
    // per (TP rank, quantized tensor): the codes sent
    std::vector<std::vector<std::pair<std::uint32_t, std::uint8_t>>> codes(
        static_cast<std::size_t>(tp_) * nq);
    for_each_element(theta_of, [&](std::size_t blk, std::int64_t o, std::uint16_t bits,
                                   const PreviousBits* prev) {
      if (!touched[blk]) return;
      const float mult = Recipe::multiplier(scale[blk]);
      const std::uint8_t code = Recipe::code(bits, mult);
      share_[blk] += receive::fp8_code_digest(o, code);
      const bool send =
          full_ || fp8_held_code<Recipe>(bits, code, prev, Recipe::multiplier(scale_[blk]),
                                         float_bits(scale[blk]) != float_bits(scale_[blk]))
                       .sends(code);
      if (send) codes[slot_of(blk)].emplace_back(static_cast<std::uint32_t>(o), code);
    });
    std::vector<receive::Fp8Part> parts(static_cast<std::size_t>(tp_));
    for (std::int64_t ts = 0; ts < tp_; ++ts) {
      receive::Fp8Part& p = parts[static_cast<std::size_t>(ts)];
      p.header = {version, base, static_cast<std::uint32_t>(ts)};
      for (std::size_t k = 0; k < nq; ++k) {
        const std::size_t s = static_cast<std::size_t>(ts) * nq + k;
        const layout::BlockGrid& g = grid_.grid(ids[k]);
        receive::Fp8Writes w;
        w.tensor = ids[k];
        std::sort(codes[s].begin(), codes[s].end());
        for (const auto& [o, c] : codes[s]) {
          w.index.push_back(o);
          w.code.push_back(c);
        }
        for (std::int64_t b = 0; b < g.blocks(); ++b) {
          const std::size_t blk = base_[s] + static_cast<std::size_t>(b);
          // the owner: the lowest trainer rank holding an element of the block
          if (trainers_ - static_cast<std::int64_t>(global[2 * blocks_ + blk]) != rank_) continue;
          if (touched[blk]) share_[blk] += receive::fp8_scale_digest(g.numel(), b, scale[blk]);
          if (touched[blk] && (full_ || float_bits(scale[blk]) != float_bits(scale_[blk]))) {
            w.block.push_back(static_cast<std::uint32_t>(b));
            w.scale.push_back(scale[blk]);
          }
        }
        sent_codes_ += w.index.size();
        sent_scales_ += w.block.size();
        if (!w.index.empty() || !w.block.empty()) p.tensors.push_back(std::move(w));
      }
    }
    for (std::size_t blk = 0; blk < blocks_; ++blk) {
      if (touched[blk]) scale_[blk] = scale[blk];
    }
    digest_share.assign(static_cast<std::size_t>(tp_) * nq, 0);
    for (std::size_t s = 0; s < digest_share.size(); ++s) {
      const std::size_t end = s + 1 < base_.size() ? base_[s + 1] : blocks_;
      for (std::size_t blk = base_[s]; blk < end; ++blk)
        digest_share[s] += share_[blk];
    }
    known_ = true;
    std::vector<std::vector<std::byte>> out;
    for (std::int64_t ts = 0; ts < tp_; ++ts) {
      const receive::Fp8Part& p = parts[static_cast<std::size_t>(ts)];
      out.push_back(p.tensors.empty() ? std::vector<std::byte>{}
                                      : receive::encode_fp8_part(grid_, Recipe::name, p));
    }
    return out;
  }

  // A publication failed after finish(): what the receivers hold is not known; the next one
  // sends everything.
  void forget() noexcept { known_ = false; }
  // Codes and scales the last finish() sent.
  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> sent() const noexcept {
    return {sent_codes_, sent_scales_};
  }

 private:
  struct Flag {
    std::int64_t offset;
    PreviousBits prev;
  };

  // Block numbers are (TP rank, quantized tensor, block): the (TP rank, tensor) slot of one.
  [[nodiscard]] std::size_t slot_of(std::size_t blk) const noexcept {
    return static_cast<std::size_t>(std::upper_bound(base_.begin(), base_.end(), blk) -
                                    base_.begin()) -
           1;
  }

  // f(run, block, local offset, shard offset, n) for every piece of n consecutive elements of a
  // replica-0 copy of this rank's quantized runs of buffer b that lies in one block: per run in
  // shard order, per copy, in offset order.
  template <class F>
  void for_each_piece(layout::BufferKind b, F&& f) const {
    const std::size_t nq = grid_.quantized_ids().size();
    for (const pipeline::Run& run : table_->runs(b)) {
      if (!run.sender || run.tensor < 0 || !takes(run.tensor)) continue;
      for (const pipeline::RunTarget& t : table_->targets(run)) {
        if (static_cast<std::int64_t>(t.rank) >= tp_) continue;  // (other replicas: the same)
        const auto id = static_cast<std::int64_t>(t.tensor);
        const layout::BlockGrid& g = grid_.grid(id);
        const std::size_t base =
            base_[t.rank * nq + static_cast<std::size_t>(slot_[static_cast<std::size_t>(id)])];
        for (std::int64_t j = 0; j < run.length;) {
          const std::int64_t o = static_cast<std::int64_t>(t.index) + j;
          const std::int64_t col = o % g.cols;
          const std::int64_t end = std::min(g.cols, (col / g.block_cols + 1) * g.block_cols);
          const std::int64_t n = std::min(run.length - j, end - col);
          f(run, base + static_cast<std::size_t>(g.block_of(o)), o, run.shard_begin + j, n);
          j += n;
        }
      }
    }
  }

  // f(block, local offset, bits, previous bits or null) for every element of this rank's
  // quantized runs and every replica-0 copy of it, in shard order.
  template <class ThetaOf, class F>
  void for_each_element(ThetaOf& theta_of, F&& f) const {
    for (layout::BufferKind b : {layout::BufferKind::dense, layout::BufferKind::expert}) {
      if (table_->runs(b).empty()) continue;
      const std::span<const float> theta = theta_of(b);
      const std::vector<Flag>& flags = flags_[static_cast<int>(b)];
      std::size_t fi = 0, fj = 0;  // the run's first flag; the copy's next
      for_each_piece(b, [&](const pipeline::Run& run, std::size_t blk, std::int64_t o,
                            std::int64_t so, std::int64_t n) {
        if (so == run.shard_begin) {  // a copy of the run starts
          while (fi < flags.size() && flags[fi].offset < run.shard_begin)
            ++fi;
          fj = fi;
        }
        for (std::int64_t j = 0; j < n; ++j) {
          const PreviousBits* prev = nullptr;
          if (fj < flags.size() && flags[fj].offset == so + j) prev = &flags[fj++].prev;
          f(blk, o + j, Detect::store(theta[static_cast<std::size_t>(so + j)]), prev);
        }
      });
    }
  }

  // f(block) for every replica-0 copy of every flagged element of buffer b.
  template <class F>
  void walk_flags(layout::BufferKind b, F&& f) const {
    const std::size_t nq = grid_.quantized_ids().size();
    const auto runs = table_->runs(b);
    std::size_t r = 0;
    for (const Flag& x : flags_[static_cast<int>(b)]) {
      while (runs[r].shard_begin + runs[r].length <= x.offset)
        ++r;
      for (const pipeline::RunTarget& t : table_->targets(runs[r])) {
        if (static_cast<std::int64_t>(t.rank) >= tp_) continue;
        const auto id = static_cast<std::int64_t>(t.tensor);
        const std::size_t base =
            base_[t.rank * nq + static_cast<std::size_t>(slot_[static_cast<std::size_t>(id)])];
        f(base + static_cast<std::size_t>(grid_.grid(id).block_of(
                     static_cast<std::int64_t>(t.index) + (x.offset - runs[r].shard_begin))));
      }
    }
  }

  const layout::HfModel* hf_;
  const pipeline::RunTable* table_;
  layout::Fp8Grid grid_;
  std::int64_t tp_, rank_, trainers_;
  std::vector<std::int64_t> slot_;  // per serving tensor: its index among the quantized
  std::vector<std::size_t> base_;   // per (TP rank, quantized tensor): its first block
  std::size_t blocks_ = 0;
  std::vector<float> scale_;    // per block, as the receivers hold it
  std::vector<Digest> share_;   // per block, this rank's share of its digest
  std::vector<Flag> flags_[2];  // this publication's, per buffer, in shard order
  bool known_ = false, full_ = true;
  std::uint64_t sent_codes_ = 0, sent_scales_ = 0;
};

}  // namespace dte
