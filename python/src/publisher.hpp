// SPDX-License-Identifier: Apache-2.0
// The publisher behind dte.TorchPublisher, without Python: native.cpp binds it (the host one)
// and cuda_publisher.cu instantiates it over exec::Cuda (compiled by nvcc when the package is
// built with CUDA), both behind AnyPublisher. Python passes, once, the pieces of HF tensors this
// rank holds (layout::LocalPiece, each with its slot: the local tensor it lives in, and its
// offset there) and each slot's element count and parameter group; then per step the groups'
// hyperparameters as the step used them and per slot its weights' and state's addresses and its
// step count. Every piece is read where it lives (the frame's segmented access): nothing is
// copied or moved.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/publication/publisher.hpp"

namespace dte::python {

using publication::Bytes;

// One parameter group's hyperparameters as Python passes them each step.
struct Group {
  double lr, weight_decay, beta1, beta2, eps, momentum, dampening;
};

// (HF tensor, index, length, sender, slot, offset in the slot)
using PieceTuple =
    std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t>;

// What a publisher is made of, as Python gives it.
struct PublisherArgs {
  layout::ModelSpec model;
  std::int64_t publish_every = 1;
  int zstd_level = 1;
  bool diff = true;
  std::vector<PieceTuple> pieces;
  std::vector<std::int64_t> slot_numel, slot_group;  // per slot (group -1: frozen)
  bool decoupled = true;                             // AdamW's decay (else Adam's L2)
  std::uint32_t writer = 0, writers = 1;
};

// A publisher whatever its optimizer inverse and where its tensors live. stream: the caller's
// CUDA stream (the one its optimizer step ran on; 0 on the host), which the device publisher
// waits for before it reads anything.
class AnyPublisher {
 public:
  virtual ~AnyPublisher() = default;
  virtual std::optional<Bytes> step(const std::vector<Group>& groups,
                                    const std::vector<std::uintptr_t>& theta,
                                    const std::vector<std::uintptr_t>& a,
                                    const std::vector<std::uintptr_t>& b,
                                    const std::vector<std::int64_t>& steps,
                                    std::uintptr_t stream) = 0;
  virtual Bytes publish_full(const std::vector<std::uintptr_t>& theta, std::uintptr_t stream) = 0;
  virtual void commit() = 0;
  virtual void abort() = 0;
  virtual void require_full() = 0;
  virtual void continue_after(std::uint64_t v) = 0;
  virtual void resync(const std::vector<std::int64_t>& steps, bool full) = 0;
  [[nodiscard]] virtual std::uint64_t version() const = 0;
  [[nodiscard]] virtual std::vector<Digest> digest() const = 0;
  [[nodiscard]] virtual publication::PublishReport last() const = 0;
  // From the next publication on (a full one): for the TP ranks of an engine serving `recipe`.
  virtual void serve_fp8(const std::string& recipe, const layout::InferTopology& topology) = 0;
};

// The host's place for tensors: the host executor; zeros in host memory; no stream to wait for.
struct HostMemory {
  using executor = HostExecutor;
  struct Scope {};  // no device to select
  std::vector<float> zero;
  [[nodiscard]] executor exec() const { return {}; }
  [[nodiscard]] Scope enter() const { return {}; }
  void wait_for(std::uintptr_t) {}
  // n zeros; the same n every call (the largest slot's), so the address stays valid.
  const float* zeros(std::size_t n) {
    if (zero.size() < n) zero.assign(n, 0.0f);
    return zero.data();
  }
};

// Memory: HostMemory, or cuda_publisher.cu's device memory (its executor, zeros on the device,
// a wait for the caller's stream, and its device selected while the publisher works: enter()).
template <class Inverse, class Memory>
class Publisher final : public AnyPublisher {
 public:
  using Pub = publication::Publisher<Inverse, BF16Detect, layout::LocalShardPlan,
                                     typename Memory::executor>;

  struct Piece {
    std::int64_t tensor, index, length;
    bool sender;
    std::int64_t slot, offset;
  };

  template <class... M>
  explicit Publisher(const PublisherArgs& args, M&&... memory)
      : memory_(std::forward<M>(memory)...),
        pub_(args.model, local_pieces(args.pieces), {args.writer, args.writers},
             {.publish_every = args.publish_every,
              .zstd_level = args.zstd_level,
              .encoding = args.diff ? storage::Encoding::diff : storage::Encoding::value},
             memory_.exec()),
        numel_(args.slot_numel),
        group_of_(args.slot_group),
        decoupled_(args.decoupled) {
    if (group_of_.size() != numel_.size()) {
      throw invalid_argument("dte._native publisher: per-slot lists of different lengths");
    }
    for (const auto& [tensor, index, length, sender, slot, offset] : args.pieces) {
      if (slot < 0 || static_cast<std::size_t>(slot) >= numel_.size() || offset < 0 ||
          offset > numel_[static_cast<std::size_t>(slot)] - length) {
        throw invalid_argument("dte._native publisher: a piece of " + pub_.model().name(tensor) +
                               " lies outside its local tensor");
      }
      pieces_.push_back({tensor, index, length, sender, slot, offset});
    }
    const auto n = numel_.size();
    theta_.assign(n, nullptr);
    hyper_.resize(n);
    s0_.assign(n, nullptr);
    s1_.assign(n, nullptr);
    last_step_.assign(n, 0);
    for (std::int64_t x : numel_)
      zeros_size_ = std::max(zeros_size_, static_cast<std::size_t>(x));
  }

  // Per slot: weights, state addresses (0: no state yet) and step count; per group:
  // hyperparameters. A part (several writers) awaits commit() / abort().
  std::optional<Bytes> step(const std::vector<Group>& groups,
                            const std::vector<std::uintptr_t>& theta,
                            const std::vector<std::uintptr_t>& a,
                            const std::vector<std::uintptr_t>& b,
                            const std::vector<std::int64_t>& steps,
                            std::uintptr_t stream) override {
    [[maybe_unused]] const auto scope = memory_.enter();
    bind(groups, theta, a, b, steps);
    memory_.wait_for(stream);
    return pub_.step(Access{this});
  }

  Bytes publish_full(const std::vector<std::uintptr_t>& theta, std::uintptr_t stream) override {
    [[maybe_unused]] const auto scope = memory_.enter();
    set_theta(theta);
    memory_.wait_for(stream);
    return pub_.publish(Access{this}, true);
  }

  void commit() override { pub_.commit(); }
  void abort() override { pub_.abort(); }
  void require_full() override { pub_.require_full(); }
  void continue_after(std::uint64_t v) override { pub_.continue_after(v); }
  // The step counts as they are now are the start of the next step (a new publisher over an
  // optimizer that stepped before, or a full publication); full: the caller lost track of the
  // optimizer steps, so the next publication is full.
  void resync(const std::vector<std::int64_t>& steps, bool full) override {
    if (steps.size() != last_step_.size()) {
      throw invalid_argument("dte._native publisher: per-slot lists of the wrong length");
    }
    last_step_ = steps;
    if (full) pub_.require_full();
  }

  [[nodiscard]] std::uint64_t version() const override { return pub_.version(); }
  [[nodiscard]] std::vector<Digest> digest() const override { return pub_.digest(); }
  [[nodiscard]] publication::PublishReport last() const override { return pub_.last(); }
  void serve_fp8(const std::string& recipe, const layout::InferTopology& topology) override {
    whole_.assign(static_cast<std::size_t>(pub_.model().size()), -1);
    for (std::size_t k = 0; k < pieces_.size(); ++k) {
      const Piece& q = pieces_[k];
      if (q.sender && q.index == 0 && q.length == pub_.model()[q.tensor].numel())
        whole_[static_cast<std::size_t>(q.tensor)] = static_cast<std::int64_t>(k);
    }
    pub_.serve_fp8({recipe, topology});
  }

 private:
  // What the frame reads: each piece where it lives.
  struct Access {
    const Publisher* p;
    [[nodiscard]] const Piece& piece(const layout::PlanSegment& s) const {
      return p->pieces_[static_cast<std::size_t>(p->pub_.plan().source(s))];
    }
    [[nodiscard]] std::span<const float> segment_theta(std::int64_t, layout::BufferKind,
                                                       const layout::PlanSegment& s) const {
      const Piece& q = piece(s);
      return {p->theta_[static_cast<std::size_t>(q.slot)] + q.offset,
              static_cast<std::size_t>(q.length)};
    }
    // HF tensor t's weights whole (FP8 receivers): one piece of this writer holds it all.
    [[nodiscard]] std::span<const float> hf_weights(std::int64_t t) const {
      const std::int64_t k = p->whole_[static_cast<std::size_t>(t)];
      if (k < 0) {
        throw unsupported("dte: FP8 receivers need each HF tensor whole in one process; " +
                          p->pub_.model().name(t) + " is split (docs/fp8.md)");
      }
      const Piece& q = p->pieces_[static_cast<std::size_t>(k)];
      return {p->theta_[static_cast<std::size_t>(q.slot)] + q.offset,
              static_cast<std::size_t>(q.length)};
    }
    [[nodiscard]] typename Inverse::hyperparameters hyperparameters(
        std::int64_t, layout::BufferKind, const layout::PlanSegment& s) const {
      return p->hyper_[static_cast<std::size_t>(piece(s).slot)];
    }
    [[nodiscard]] typename Inverse::state state(std::int64_t, layout::BufferKind,
                                                const layout::PlanSegment& s) const {
      const Piece& q = piece(s);
      const auto k = static_cast<std::size_t>(q.slot);
      const auto n = static_cast<std::size_t>(q.length);
      if constexpr (std::is_same_v<Inverse, SgdMomentumInverse>) {
        return {std::span<const float>(p->s0_[k] + q.offset, n)};
      } else {
        return {std::span<const float>(p->s0_[k] + q.offset, n),
                std::span<const float>(p->s1_[k] + q.offset, n)};
      }
    }
  };

  static std::vector<layout::LocalPiece> local_pieces(const std::vector<PieceTuple>& pieces) {
    std::vector<layout::LocalPiece> out;
    for (const auto& [tensor, index, length, sender, slot, offset] : pieces)
      out.push_back({tensor, index, length, sender});
    return out;
  }

  void set_theta(const std::vector<std::uintptr_t>& theta) {
    if (theta.size() != numel_.size()) {
      throw invalid_argument("dte._native publisher: per-slot lists of the wrong length");
    }
    for (std::size_t k = 0; k < theta.size(); ++k)
      theta_[k] = reinterpret_cast<const float*>(theta[k]);
  }

  // Each slot's kernel inputs for this step. A slot whose step count did not move was not
  // updated (torch skips parameters without a gradient): its inverse is the identity (lr 0).
  void bind(const std::vector<Group>& groups, const std::vector<std::uintptr_t>& theta,
            const std::vector<std::uintptr_t>& a, const std::vector<std::uintptr_t>& b,
            const std::vector<std::int64_t>& steps) {
    const std::size_t n = numel_.size();
    if (a.size() != n || b.size() != n || steps.size() != n) {
      throw invalid_argument("dte._native publisher: per-slot lists of the wrong length");
    }
    set_theta(theta);
    for (std::size_t t = 0; t < n; ++t) {
      if (group_of_[t] < 0) {
        // Frozen (in no parameter group): never updated, its inverse the identity.
        const float* zeros = memory_.zeros(zeros_size_);
        set(t, {0.0, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.0}, 1, false, zeros, zeros);
        continue;
      }
      const auto g = static_cast<std::size_t>(group_of_[t]);
      if (g >= groups.size()) throw invalid_argument("dte._native publisher: bad group");
      const Group& G = groups[g];
      const bool moved = steps[t] != last_step_[t];
      if (steps[t] < last_step_[t] || steps[t] > last_step_[t] + 1) {
        const std::int64_t before = last_step_[t];
        pub_.require_full();
        last_step_ = steps;
        throw protocol_error(
            "local tensor " + std::to_string(t) + ": the optimizer's step count went from " +
            std::to_string(before) + " to " + std::to_string(steps[t]) +
            " between two calls of step(); dte inverts exactly one optimizer step per call "
            "(call pub.step() after every optimizer.step()). The next publication will be full");
      }
      last_step_[t] = steps[t];
      const float* s0 = reinterpret_cast<const float*>(a[t]);
      const float* s1 = reinterpret_cast<const float*>(b[t]);
      if (a[t] == 0 || (needs_second() && b[t] == 0)) {
        // No state: never updated (lr 0 below); zeros stand in for the moments.
        s0 = s1 = memory_.zeros(zeros_size_);
      }
      set(t, G, moved ? steps[t] : std::max<std::int64_t>(steps[t], 1), moved, s0, s1);
    }
  }

  static constexpr bool needs_second() { return !std::is_same_v<Inverse, SgdMomentumInverse>; }

  void set(std::size_t t, const Group& G, std::int64_t step, bool moved, const float* s0,
           const float* s1) {
    s0_[t] = s0;
    s1_[t] = s1;
    // (member by member: nvcc's front end refuses a designated initializer list assigned)
    typename Inverse::hyperparameters& h = hyper_[t];
    h = {};
    h.lr = moved ? G.lr : 0.0;
    h.weight_decay = G.weight_decay;
    if constexpr (std::is_same_v<Inverse, SgdMomentumInverse>) {
      h.momentum = G.momentum;
      h.dampening = G.dampening;
    } else {
      h.beta1 = G.beta1;
      h.beta2 = G.beta2;
      h.eps = G.eps;
      h.step = step;
      h.decay_form = decoupled_ ? DecayForm::multiply : DecayForm::unknown;
    }
  }

  Memory memory_;
  Pub pub_;
  std::vector<Piece> pieces_;
  std::vector<std::int64_t> whole_;     // FP8: per HF tensor, the piece holding it whole (-1: none)
  std::vector<std::int64_t> numel_;     // per slot
  std::vector<std::int64_t> group_of_;  // per slot (-1: frozen)
  bool decoupled_;
  std::vector<const float*> theta_;
  std::vector<typename Inverse::hyperparameters> hyper_;
  std::vector<const float*> s0_, s1_;
  std::vector<std::int64_t> last_step_;
  std::size_t zeros_size_ = 0;  // the largest slot: the moments of a slot without state
};

// The publisher of optimizer `kind` ("adamw", "adam", "sgd") over Memory.
template <class Memory, class... M>
std::unique_ptr<AnyPublisher> make_publisher(const std::string& kind, const PublisherArgs& args,
                                             M&&... memory) {
  if (kind == "adamw") {
    return std::make_unique<Publisher<AdamWInverse, Memory>>(args, std::forward<M>(memory)...);
  }
  if (kind == "adam") {
    return std::make_unique<Publisher<AdamInverse, Memory>>(args, std::forward<M>(memory)...);
  }
  if (kind == "sgd") {
    return std::make_unique<Publisher<SgdMomentumInverse, Memory>>(args,
                                                                   std::forward<M>(memory)...);
  }
  throw invalid_argument("dte._native publisher: no optimizer inverse named '" + kind + "'");
}

}  // namespace dte::python
