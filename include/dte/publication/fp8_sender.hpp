// SPDX-License-Identifier: Apache-2.0
// The FP8 side of a publication (docs/fp8.md): what the TP ranks of an online-FP8 engine must
// write so that each holds, bit for bit, the engine's own quantization of the trainer's BF16
// weights. The sender frame's scan finds the elements whose BF16 value can have changed (the
// guard band and the K-step dirty mask included); Fp8Sink passes those of quantized tensors here
// and the others to the chunk sink. Then, per rank and quantized tensor, every block holding a
// changed element (a touched block) is read whole from the trainer's weights:
//   - its new scale is the recipe's, from the block's largest magnitude;
//   - an element's code is sent when it can differ from the one the rank holds: a changed
//     element unless its previous bits (PreviousBits: the reconstruction of the last step) give
//     the new code for certain under the old scale; any element whose code the new scale moves;
//   - the new scale is sent when its bits differ from the old one's.
// Only touched blocks can change at all (a block's scale and codes are functions of its BF16
// values). The sender keeps, per block, the scale and the digest of the codes and scale that the
// rank holds (8 bytes per 16,384 elements); a full publication sends every code and scale.
// Each rank's digest after the version goes into the message, and the receiver refuses a
// publication whose result differs (publication/fp8_receiver.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
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
 public:
  Fp8Sender(const layout::HfModel& hf, layout::InferTopology t)
      : hf_(&hf),
        layout_(hf, one_replica(t)),
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

  static layout::InferTopology one_replica(layout::InferTopology t) {
    t.replicas = 1;
    return t;
  }

  [[nodiscard]] std::size_t slot(std::int64_t ts, std::int64_t id) const {
    return static_cast<std::size_t>(ts) * grid_.quantized_ids().size() +
           static_cast<std::size_t>(slot_[static_cast<std::size_t>(id)]);
  }

  // The writes of tensor `id` on rank ts into w; returns the tensor's digest after them.
  Digest tensor(const HfWeights& weights, std::int64_t ts, std::int64_t id, receive::Fp8Writes& w) {
    const layout::BlockGrid& g = grid_.grid(id);
    const std::size_t k = slot(ts, id);
    State& st = state_[k];
    std::vector<Flag>& flags = flags_[k];
    // the touched blocks in order, each with its flags in offset order
    std::vector<std::pair<std::uint32_t, std::uint32_t>> order;  // (block, flag)
    order.reserve(flags.size());
    for (std::size_t i = 0; i < flags.size(); ++i) {
      order.emplace_back(static_cast<std::uint32_t>(g.block_of(flags[i].offset)),
                         static_cast<std::uint32_t>(i));
    }
    std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
      return a.first != b.first ? a.first < b.first
                                : flags[a.second].offset < flags[b.second].offset;
    });
    std::vector<std::pair<std::uint32_t, std::uint8_t>> codes;  // (offset, code)
    std::size_t at = 0;
    const std::size_t updates = pending_.size();
    const auto blocks = static_cast<std::size_t>(g.blocks());
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::size_t first = at;
      while (at < order.size() && order[at].first == b)
        ++at;
      if (!full_ && first == at) continue;  // untouched: scale and codes as they are
      block(weights, ts, id, g, b, st,
            std::span<const std::pair<std::uint32_t, std::uint32_t>>(order).subspan(first,
                                                                                    at - first),
            flags, k, w, codes);
    }
    std::sort(codes.begin(), codes.end());
    w.index.reserve(codes.size());
    w.code.reserve(codes.size());
    for (const auto& [o, c] : codes) {
      w.index.push_back(o);
      w.code.push_back(c);
    }
    Digest d = 0;
    for (std::size_t b = 0; b < blocks; ++b)
      d += st.digest[b];
    for (std::size_t u = updates; u < pending_.size(); ++u)
      d += pending_[u].digest - st.digest[pending_[u].block];
    return d;
  }

  void block(const HfWeights& weights, std::int64_t ts, std::int64_t id, const layout::BlockGrid& g,
             std::size_t b, const State& st,
             std::span<const std::pair<std::uint32_t, std::uint32_t>> touched,
             const std::vector<Flag>& flags, std::size_t k, receive::Fp8Writes& w,
             std::vector<std::pair<std::uint32_t, std::uint8_t>>& codes) {
    const auto bi = static_cast<std::int64_t>(b);
    const std::int64_t r0 = g.row0(bi), c0 = g.col0(bi), nr = g.rows_of(bi), nc = g.cols_of(bi);
    // the block's BF16 values, row by row (a row's columns are contiguous in its HF tensor)
    bits_.resize(static_cast<std::size_t>(nr * nc));
    float amax = 0.0f;
    for (std::int64_t r = 0; r < nr; ++r) {
      const layout::Canonical c = layout_.source({ts, id, (r0 + r) * g.cols + c0});
      const std::span<const float> x = weights(c.tensor);
      if (static_cast<std::uint64_t>(c.index + nc) > x.size()) {
        throw invalid_argument("FP8 sender: the weights of " + hf_->name(c.tensor) +
                               " are not the whole tensor");
      }
      std::uint16_t* out = bits_.data() + r * nc;
      for (std::int64_t j = 0; j < nc; ++j) {
        out[j] = Detect::store(x[static_cast<std::size_t>(c.index + j)]);
        amax = std::max(amax, Recipe::magnitude(out[j]));
      }
    }
    const float scale = Recipe::scale(amax);
    const float mult = Recipe::multiplier(scale);
    const float old_mult = Recipe::multiplier(st.scale[b]);
    const bool rescaled = full_ || float_bits(scale) != float_bits(st.scale[b]);
    std::size_t f = 0;  // the next touched flag (offset order)
    Digest digest = fp8_scale_digest(g.numel(), bi, scale);
    for (std::int64_t r = 0; r < nr; ++r) {
      for (std::int64_t j = 0; j < nc; ++j) {
        const std::uint16_t v = bits_[static_cast<std::size_t>(r * nc + j)];
        const std::uint8_t code = Recipe::code(v, mult);
        const std::int64_t o = (r0 + r) * g.cols + c0 + j;
        digest += fp8_code_digest(o, code);
        bool send;
        if (full_) {
          send = true;
        } else if (f < touched.size() && flags[touched[f].second].offset == o) {
          std::uint8_t before = 0;
          send = !Recipe::previous_code(flags[touched[f].second].prev, old_mult, before) ||
                 before != code;
          ++f;
        } else {
          send = rescaled && Recipe::code(v, old_mult) != code;
        }
        if (send) codes.emplace_back(static_cast<std::uint32_t>(o), code);
      }
    }
    if (rescaled) {
      w.block.push_back(static_cast<std::uint32_t>(b));
      w.scale.push_back(scale);
    }
    pending_.push_back({k, b, scale, digest});
  }

  const layout::HfModel* hf_;
  layout::ServingLayout layout_;
  layout::Fp8Grid grid_;
  std::vector<std::int64_t> slot_;        // per serving tensor: its index among the quantized
  std::vector<State> state_;              // per (rank, quantized tensor)
  std::vector<std::vector<Flag>> flags_;  // this publication's, per (rank, quantized tensor)
  std::vector<Update> pending_;
  std::vector<std::uint16_t> bits_;  // one block's values
  bool known_ = false;               // whether state_ holds what the ranks hold
  bool full_ = true;
  std::pair<std::uint64_t, std::uint64_t> sent_{0, 0};
};

// The sink of an FP8 publication's scan: elements of quantized tensors go to the FP8 stage, the
// others to the chunk sink (`Inner`). with_previous: the scan is one optimizer step's detect pass,
// whose reconstruction says what each element's previous bits can be.
template <class Inner>
class Fp8Sink {
 public:
  Fp8Sink(Inner& inner, Fp8Stage& stage, bool with_previous)
      : inner_(&inner), stage_(&stage), previous_(with_previous) {}

  template <class Frame>
  void begin(const Frame& f, pipeline::ScanMode mode) {
    changed_ = 0;
    inner_->begin(f, mode);
  }
  template <class Frame>
  void prepare(const Frame&, layout::BufferKind, std::size_t, typename Frame::Tile&) {}

  template <class Frame>
  void changed(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_changed(b, t, s, [&](const pipeline::Run& run, std::int64_t o, std::uint16_t bits) {
      const auto tensor = static_cast<std::uint32_t>(run.tensor);
      const std::uint32_t index = f.canonical_index(run, o);
      if (stage_->takes(run.tensor)) {
        stage_->changed(run.tensor, index, previous_ ? f.previous(b, run, o) : PreviousBits{});
      } else if constexpr (Inner::diff) {
        inner_->put(tensor, index, bits, f.previous(b, run, o));
      } else {
        inner_->put(tensor, index, bits);
      }
      ++changed_;
    });
  }

  // A full publication: the tensors that stay BF16 go whole into the chunks (the FP8 stage sends
  // every code and scale itself).
  template <class Frame>
  void all(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          if (stage_->takes(run.tensor)) return;
          const auto tensor = static_cast<std::uint32_t>(run.tensor);
          const std::uint32_t first = f.canonical_index(run, run.shard_begin + at);
          for (std::size_t j = 0; j < bits.size(); ++j)
            inner_->put(tensor, first + static_cast<std::uint32_t>(j), bits[j]);
        });
  }

  template <class Frame, class Access>
  void end(const Frame&, const Access&, pipeline::ScanMode) {
    inner_->flush();
  }

  [[nodiscard]] std::uint64_t entries() const noexcept { return changed_; }

 private:
  Inner* inner_;
  Fp8Stage* stage_;
  bool previous_;
  std::uint64_t changed_ = 0;
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
