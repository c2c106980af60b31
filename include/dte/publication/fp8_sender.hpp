// SPDX-License-Identifier: Apache-2.0
// The FP8 side of a publication (docs/fp8.md): what the TP ranks of an online-FP8 engine must
// write so that each holds, bit for bit, the engine's own quantization of the trainer's BF16
// weights. The sender frame's scan finds the elements whose BF16 value can have changed (the
// guard band and the K-step dirty mask included); pipeline::FlagSink passes those of quantized
// tensors here, and the chunk sink, which skips the quantized tensors, takes the others. Then,
// per rank and quantized tensor, every block holding a changed element (a touched block) is read
// whole from the trainer's weights:
//   - its new scale is the recipe's, from the block's largest magnitude;
//   - an element's code is sent when it can differ from the one the rank holds (the send rule,
//     detect/fp8.hpp's fp8_held_code): a changed element unless its previous bits (PreviousBits:
//     the reconstruction of the last step) give the new code for certain under the old scale;
//     any element whose code the new scale moves;
//   - the new scale is sent when its bits differ from the old one's.
// Only touched blocks can change at all (a block's scale and codes are functions of its BF16
// values). The sender keeps, per block, the scale and the digest of the codes and scale that the
// rank holds (8 bytes per 16,384 elements); a full publication sends every code and scale.
// Each rank's digest after the version goes into the message, and the receiver refuses a
// publication whose result differs (publication/receiver.hpp, an FP8 ShardReceiver).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/core/digest.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/publication/message.hpp"
#include "dte/receive/fp8_core.hpp"
#include "dte/receive/fp8_part.hpp"
#include "dte/reconstruction.hpp"
#include "dte/storage/chunk.hpp"  // (checksum)

namespace dte::publication {

using receive::fp8_code_digest;
using receive::fp8_scale_digest;

// Where the sender reads HF tensor t's FP32 weights, whole, in canonical order.
using HfWeights = std::function<std::span<const float>(std::int64_t)>;

// The receivers of an FP8 publication: one replica's TP ranks and the recipe they quantize by.
struct Fp8Target {
  std::string recipe = VllmBlockFp8::name;
  layout::InferTopology topology{};
};

// The FP8 stage of a publisher, whatever its recipe.
class Fp8Stage {
 public:
  virtual ~Fp8Stage() = default;
  // Whether HF tensor t lands in quantized tensors.
  [[nodiscard]] virtual bool takes(std::int64_t t) const = 0;
  // A publication starts; full: every code and scale is sent.
  virtual void begin(bool full) = 0;
  // HF tensor t's element `index` can have changed; prev: what its previous bits can be.
  virtual void changed(std::int64_t t, std::uint32_t index, const PreviousBits& prev) = 0;
  // The same for the element at shard offset o of a run of the scan (pipeline/flag_sink.hpp).
  virtual void changed(layout::BufferKind b, const pipeline::Run& run, std::int64_t o,
                       const PreviousBits& prev) = 0;
  // The parts of the version, one per rank, and the fp8 section; pending until commit().
  virtual Fp8Section finish(const HfWeights& weights, Version version, Version base,
                            std::vector<Bytes>& parts) = 0;
  virtual void commit() = 0;
  virtual void abort() noexcept = 0;
  // What the last finish() sent: codes, scales.
  [[nodiscard]] virtual std::pair<std::uint64_t, std::uint64_t> sent() const = 0;
};

template <fp8_recipe Recipe, change_detector Detect>
class Fp8Sender final : public Fp8Stage {
  static_assert(std::is_same_v<typename Detect::format, Bf16Format>,
                "FP8 receivers quantize BF16 weights: the detector is BF16Detect");

 public:
  Fp8Sender(const layout::HfModel& hf, layout::InferTopology t)
      : hf_(&hf),
        layout_(hf, t.one_replica()),
        grid_(layout_, Recipe::block_rows, Recipe::block_cols) {
    const auto ranks = static_cast<std::size_t>(layout_.topology().tp);
    const auto ids = grid_.quantized_ids().size();
    state_.resize(ranks * ids);
    flags_.resize(ranks * ids);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t k = 0; k < ids; ++k) {
        const layout::BlockGrid& g = grid_.grid(grid_.quantized_ids()[k]);
        state_[r * ids + k].scale.assign(static_cast<std::size_t>(g.blocks()), 0.0f);
        state_[r * ids + k].digest.assign(static_cast<std::size_t>(g.blocks()), 0);
      }
    }
    slot_.assign(static_cast<std::size_t>(layout_.size()), -1);
    for (std::size_t k = 0; k < ids; ++k)
      slot_[static_cast<std::size_t>(grid_.quantized_ids()[k])] = static_cast<std::int64_t>(k);
  }

  [[nodiscard]] const layout::ServingLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] const layout::Fp8Grid& grid() const noexcept { return grid_; }

  [[nodiscard]] bool takes(std::int64_t t) const override {
    return layout::Fp8Grid::quantized_hf((*hf_)[t].kind);
  }

  void begin(bool full) override {
    full_ = full || !known_;
    for (auto& f : flags_)
      f.clear();
    pending_.clear();
  }

  void changed(std::int64_t t, std::uint32_t index, const PreviousBits& prev) override {
    if (!takes(t)) {
      throw invalid_argument("FP8 sender: " + hf_->name(t) +
                             " is not quantized; its changes go to the chunks");
    }
    layout_.targets(layout::Canonical{t, index}, [&](const layout::ReceiverElement& e) {
      flags_[slot(e.ts, e.tensor)].push_back({static_cast<std::uint32_t>(e.index), prev});
    });
  }

  void changed(layout::BufferKind, const pipeline::Run& run, std::int64_t o,
               const PreviousBits& prev) override {
    changed(run.tensor, pipeline::canonical_index(*hf_, run, o), prev);
  }

  Fp8Section finish(const HfWeights& weights, Version version, Version base,
                    std::vector<Bytes>& parts) override {
    Fp8Section s;
    s.recipe = Recipe::name;
    s.tp = layout_.topology().tp;
    s.ep = layout_.topology().ep;
    sent_ = {0, 0};
    const std::vector<std::int64_t>& ids = grid_.quantized_ids();
    for (std::int64_t ts = 0; ts < s.tp; ++ts) {
      receive::Fp8Part part;
      part.header = {version, base, static_cast<std::uint32_t>(ts)};
      Fp8Section::Part q;
      q.rank = static_cast<std::uint32_t>(ts);
      for (std::int64_t id : ids) {
        receive::Fp8Writes w;
        w.tensor = id;
        q.digest.push_back(tensor(weights, ts, id, w));
        sent_.first += w.index.size();
        sent_.second += w.block.size();
        if (!w.index.empty() || !w.block.empty()) part.tensors.push_back(std::move(w));
      }
      parts.push_back(receive::encode_fp8_part(grid_, Recipe::name, part));
      q.bytes = parts.back().size();
      q.xxh3 = storage::checksum(parts.back());
      s.parts.push_back(std::move(q));
    }
    return s;
  }

  void commit() override {
    for (const Update& u : pending_) {
      State& st = state_[u.slot];
      st.scale[u.block] = u.scale;
      st.digest[u.block] = u.digest;
    }
    pending_.clear();
    known_ = true;
  }

  void abort() noexcept override {
    pending_.clear();
    known_ = false;  // (the next publication is full)
  }

  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> sent() const override { return sent_; }

 private:
  struct Flag {
    std::uint32_t offset;
    PreviousBits prev;
  };
  struct State {
    std::vector<float> scale;    // per block, as the rank holds it
    std::vector<Digest> digest;  // per block, of its codes and scale
  };
  struct Update {
    std::size_t slot, block;
    float scale;
    Digest digest;
  };

  [[nodiscard]] std::size_t slot(std::int64_t ts, std::int64_t id) const {
    return static_cast<std::size_t>(ts) * grid_.quantized_ids().size() +
           static_cast<std::size_t>(slot_[static_cast<std::size_t>(id)]);
  }

  // What one touched block sends, and its state after the version.
  struct BlockResult {
    std::vector<std::pair<std::uint32_t, std::uint8_t>> codes;  // (offset, code)
    float scale = 0;
    Digest digest = 0;
    bool rescaled = false;
  };
  using FlagRef = std::pair<std::uint32_t, std::uint32_t>;  // (block, flag)

  // The writes of tensor `id` on rank ts into w; returns the tensor's digest after them.
  // Touched blocks are independent: they run in parallel.
  Digest tensor(const HfWeights& weights, std::int64_t ts, std::int64_t id, receive::Fp8Writes& w) {
    const layout::BlockGrid& g = grid_.grid(id);
    const std::size_t k = slot(ts, id);
    State& st = state_[k];
    const std::vector<Flag>& flags = flags_[k];
    // the flags by block, in offset order within each
    std::vector<FlagRef> order;
    order.reserve(flags.size());
    for (std::size_t i = 0; i < flags.size(); ++i) {
      order.emplace_back(static_cast<std::uint32_t>(g.block_of(flags[i].offset)),
                         static_cast<std::uint32_t>(i));
    }
    std::sort(order.begin(), order.end(), [&](const FlagRef& a, const FlagRef& b) {
      return a.first != b.first ? a.first < b.first
                                : flags[a.second].offset < flags[b.second].offset;
    });
    // the touched blocks: (block, its flags in order)
    std::vector<std::pair<std::size_t, std::span<const FlagRef>>> touched;
    const auto blocks = static_cast<std::size_t>(g.blocks());
    for (std::size_t b = 0, at = 0; b < blocks; ++b) {
      const std::size_t first = at;
      while (at < order.size() && order[at].first == b)
        ++at;
      if (full_ || first != at) {
        touched.emplace_back(b, std::span<const FlagRef>(order).subspan(first, at - first));
      }
    }
    std::vector<BlockResult> out(touched.size());
    std::vector<std::string> errors(touched.size());
    const auto n = static_cast<std::int64_t>(touched.size());
    DTE_OMP(parallel for schedule(dynamic, 8))
    for (std::int64_t i = 0; i < n; ++i) {
      const auto u = static_cast<std::size_t>(i);
      try {
        out[u] = block(weights, ts, id, g, touched[u].first, st, touched[u].second, flags);
      } catch (const std::exception& e) {
        errors[u] = e.what();
      }
    }
    for (const std::string& e : errors) {
      if (!e.empty()) throw invalid_argument(e);
    }
    Digest d = 0;
    for (std::size_t b = 0; b < blocks; ++b)
      d += st.digest[b];
    std::vector<std::pair<std::uint32_t, std::uint8_t>> codes;
    for (std::size_t u = 0; u < touched.size(); ++u) {
      const std::size_t b = touched[u].first;
      BlockResult& r = out[u];
      codes.insert(codes.end(), r.codes.begin(), r.codes.end());
      if (r.rescaled) {
        w.block.push_back(static_cast<std::uint32_t>(b));
        w.scale.push_back(r.scale);
      }
      d += r.digest - st.digest[b];
      pending_.push_back({k, b, r.scale, r.digest});
    }
    std::sort(codes.begin(), codes.end());
    w.index.reserve(codes.size());
    w.code.reserve(codes.size());
    for (const auto& [o, c] : codes) {
      w.index.push_back(o);
      w.code.push_back(c);
    }
    return d;
  }

  // One touched block. Its largest magnitude is the rounding of the largest FP32 magnitude
  // (rounding is monotone and symmetric), found without rounding every element. Where the scale
  // stays, only the flagged elements can change: each is sent unless its old code is known and
  // equal, and the digest moves by the codes that changed; it is recomputed from the whole block
  // only when an old code is not known. Where the scale changes (or everything is sent), every
  // element is coded.
  BlockResult block(const HfWeights& weights, std::int64_t ts, std::int64_t id,
                    const layout::BlockGrid& g, std::size_t b, const State& st,
                    std::span<const FlagRef> touched, const std::vector<Flag>& flags) const {
    const auto bi = static_cast<std::int64_t>(b);
    const std::int64_t r0 = g.row0(bi), c0 = g.col0(bi), nr = g.rows_of(bi), nc = g.cols_of(bi);
    // each row's weights (a row's columns are contiguous in its HF tensor)
    std::vector<const float*> row(static_cast<std::size_t>(nr));
    std::uint32_t top = 0;  // (the largest magnitude as bits: abs_max_bits)
    for (std::int64_t r = 0; r < nr; ++r) {
      const layout::Canonical c = layout_.source({ts, id, (r0 + r) * g.cols + c0});
      const std::span<const float> x = weights(c.tensor);
      if (static_cast<std::uint64_t>(c.index + nc) > x.size()) {
        throw invalid_argument("FP8 sender: the weights of " + hf_->name(c.tensor) +
                               " are not the whole tensor");
      }
      const float* p = x.data() + c.index;
      row[static_cast<std::size_t>(r)] = p;
      top = abs_max_bits(p, nc, top);
    }
    BlockResult res;
    res.scale = Recipe::scale(Recipe::magnitude(Detect::store(bits_float(top))));
    res.rescaled = full_ || float_bits(res.scale) != float_bits(st.scale[b]);
    const float mult = Recipe::multiplier(res.scale);
    const auto value = [&](std::int64_t o) {
      return Detect::store(row[static_cast<std::size_t>(o / g.cols - r0)][o % g.cols - c0]);
    };
    if (!res.rescaled) {
      res.digest = st.digest[b];
      bool unknown = false;
      for (const FlagRef& f : touched) {
        const Flag& x = flags[f.second];
        const std::uint16_t bits = value(x.offset);
        const std::uint8_t code = Recipe::code(bits, mult);
        const Fp8HeldCode held = fp8_held_code<Recipe>(bits, code, &x.prev, mult, false);
        if (!held.sends(code)) continue;
        res.codes.emplace_back(x.offset, code);
        if (held.known) {
          res.digest += fp8_code_digest(x.offset, code) - fp8_code_digest(x.offset, held.code);
        } else {
          unknown = true;
        }
      }
      if (!unknown) return res;
    }
    // every element of the block, a row at a time: the codes and their digest (a loop the
    // compiler vectorises: the key of consecutive offsets advances by a constant), then, where
    // the scale changed, which codes to send
    res.digest = fp8_scale_digest(g.numel(), bi, res.scale);
    const float old_mult = Recipe::multiplier(st.scale[b]);
    std::uint8_t codes[Recipe::block_cols];
    std::size_t f = 0;  // the next flag (offset order)
    for (std::int64_t r = 0; r < nr; ++r) {
      const float* p = row[static_cast<std::size_t>(r)];
      const std::int64_t o0 = (r0 + r) * g.cols + c0;
      const std::uint32_t key = dte::detail::digest_key(o0);
      Digest sum = 0;
      DTE_OMP(simd reduction(+ : sum))
      for (std::int64_t j = 0; j < nc; ++j) {
        // (the frame validated the weights: no NaN)
        const std::uint8_t code = Recipe::code(Bf16Format::round_not_nan(p[j]), mult);
        codes[j] = code;
        sum += dte::detail::digest_mix(key + static_cast<std::uint32_t>(j) * 0x9E3779B1u, code);
      }
      res.digest += sum;
      if (!res.rescaled) continue;  // (the flags were sent above)
      for (std::int64_t j = 0; j < nc; ++j) {
        const std::int64_t o = o0 + j;
        const PreviousBits* prev = nullptr;
        if (f < touched.size() && flags[touched[f].second].offset == o) {
          prev = &flags[touched[f++].second].prev;
        }
        if (full_ || fp8_held_code<Recipe>(Detect::store(p[j]), codes[j], prev, old_mult, true)
                         .sends(codes[j])) {
          res.codes.emplace_back(static_cast<std::uint32_t>(o), codes[j]);
        }
      }
    }
    return res;
  }

  const layout::HfModel* hf_;
  layout::ServingLayout layout_;
  layout::Fp8Grid grid_;
  std::vector<std::int64_t> slot_;        // per serving tensor: its index among the quantized
  std::vector<State> state_;              // per (rank, quantized tensor)
  std::vector<std::vector<Flag>> flags_;  // this publication's, per (rank, quantized tensor)
  std::vector<Update> pending_;
  bool known_ = false;  // whether state_ holds what the ranks hold
  bool full_ = true;
  std::pair<std::uint64_t, std::uint64_t> sent_{0, 0};
};

// The FP8 stage for a target's recipe.
template <change_detector Detect>
std::unique_ptr<Fp8Stage> make_fp8_stage(const layout::HfModel& hf, const Fp8Target& target) {
  if (target.recipe == VllmBlockFp8::name) {
    return std::make_unique<Fp8Sender<VllmBlockFp8, Detect>>(hf, target.topology);
  }
  throw unsupported("FP8 receivers: no recipe \"" + target.recipe + "\"; dte covers \"" +
                    std::string(VllmBlockFp8::name) + "\" (docs/fp8.md)");
}

}  // namespace dte::publication
