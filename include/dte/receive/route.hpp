// SPDX-License-Identifier: Apache-2.0
// Canonical writes (HF tensor, index in the unsharded tensor, 16-bit value or diff code: a
// chunk-v1 entry, an anchor's tensor) into the StagedWrites of the receiver ranks that hold them,
// in their own coordinates (receive/staged.hpp). No wire message in between and no second
// validation: the canonical indices were bounded by the decoder, and the layout maps them.
//   - to HF tensors (a receiver that holds the model in HF layout): the identity;
//   - through a serving layout (fused qkv_proj / gate_up_proj, TP shards, vocabulary padding,
//     replicated KV heads and norms): Router, one layout lookup per index-contiguous run of the
//     layout (layout::ServingLayout::contiguous), not per element.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/staged.hpp"

namespace dte::receive {

// Writes at index[k] (strictly increasing; index == nullptr: 0, 1, 2, ...) with bits[k], k < n,
// copied into pieces of `out`, cut by cut_runs. Receiver index = index + shift; canonical global
// index = index + global_shift.
inline void push_writes(StagedWrites& out, std::uint32_t tensor, std::uint32_t canonical,
                        const std::uint32_t* index, std::int64_t first, std::int64_t shift,
                        std::int64_t global_shift, const std::uint16_t* bits, std::size_t n) {
  if (index == nullptr) {
    out.push_run(tensor, canonical, static_cast<std::uint32_t>(first + shift), first + global_shift,
                 bits, n);
    return;
  }
  cut_runs(
      index, n,
      [&](std::size_t k, std::size_t end) {
        out.push_sparse(tensor, canonical, index + k, shift, global_shift, bits + k, end - k);
      },
      [&](std::size_t k, std::size_t end) {
        out.push_run(tensor, canonical, static_cast<std::uint32_t>(index[k] + shift),
                     index[k] + global_shift, bits + k, end - k);
      });
}

// Writes of HF tensor `tensor` at index[k] (index == nullptr: 0, 1, 2, ...) with bits[k], k < n,
// into a receiver whose tensors are the HF tensors.
inline void route_hf(const layout::HfModel& hf, std::int64_t tensor, const std::uint32_t* index,
                     const std::uint16_t* bits, std::size_t n, StagedWrites& out) {
  const auto t = static_cast<std::uint32_t>(tensor);
  push_writes(out, t, t, index, 0, 0, hf[tensor].base, bits, n);
}

// A receiver core over the model's HF tensors themselves (tensor t is canonical tensor t, every
// element live); `who` starts its refusals.
inline Core hf_core(const layout::HfModel& hf, std::string who) {
  std::vector<std::uint64_t> numel;
  for (std::int64_t t = 0; t < hf.size(); ++t)
    numel.push_back(static_cast<std::uint64_t>(hf[t].numel()));
  auto name = [&hf](std::int64_t t) { return hf.name(t); };
  return Core(std::move(who), -1, numel, numel, numel.size(), name, name);
}

// Canonical writes into the TP ranks of one replica of a serving layout: out[ts] receives the
// writes of TP rank ts (nullptr: a rank not served here).
class Router {
 public:
  Router(const layout::ServingLayout& layout, std::vector<StagedWrites*> out)
      : layout_(&layout), out_(std::move(out)) {}

  // As route_hf, through the layout: per index-contiguous run of the layout, one lookup of its
  // targets, then the run's writes in bulk to each.
  void route(std::int64_t tensor, const std::uint32_t* index, const std::uint16_t* bits,
             std::size_t n) {
    const auto c = static_cast<std::uint32_t>(tensor);
    const std::int64_t base = layout_->model()[tensor].base;
    for (std::size_t k = 0; k < n;) {
      const std::int64_t i = index == nullptr ? static_cast<std::int64_t>(k) : index[k];
      const std::int64_t end = open(tensor, i);
      // The writes of this run: [k, k_end).
      std::size_t k_end = 0;
      if (index == nullptr) {
        k_end = static_cast<std::size_t>(std::min<std::int64_t>(end, static_cast<std::int64_t>(n)));
      } else {
        k_end = run_end(index, k, n, static_cast<std::uint64_t>(end));
      }
      for (const Target& t : targets_) {
        push_writes(*t.out, t.tensor, c, index == nullptr ? nullptr : index + k, i,
                    static_cast<std::int64_t>(t.index) - i, base, bits + k, k_end - k);
      }
      k = k_end;
    }
  }

 private:
  struct Target {
    StagedWrites* out;
    std::uint32_t tensor;
    std::uint32_t index;  // of the run's first element
  };

  // The first of index[k + 1, n) (increasing) at or past `end`: galloping from k, since a run
  // of the layout often holds a few writes (a row-parallel weight's half rows at 1 % changed:
  // about four) and a binary search over the whole entry per run cost more than the run.
  static std::size_t run_end(const std::uint32_t* index, std::size_t k, std::size_t n,
                             std::uint64_t end) {
    std::size_t lo = k + 1, step = 1;  // index[lo - 1] < end
    while (lo < n && index[lo] < end) {
      const std::size_t hi = std::min(n, lo + step);
      if (index[hi - 1] < end) {
        lo = hi;
        step *= 2;
        continue;
      }
      return static_cast<std::size_t>(
          std::lower_bound(index + lo, index + hi - 1, end,
                           [](std::uint32_t a, std::uint64_t b) { return a < b; }) -
          index);
    }
    return lo;
  }

  // The targets of canonical element (tensor, i); returns where its run ends.
  std::int64_t open(std::int64_t tensor, std::int64_t i) {
    targets_.clear();
    layout_->targets(layout::Canonical{tensor, i}, [&](const layout::ReceiverElement& e) {
      StagedWrites* o = out_[static_cast<std::size_t>(e.ts)];
      if (o != nullptr) {
        targets_.push_back(
            {o, static_cast<std::uint32_t>(e.tensor), static_cast<std::uint32_t>(e.index)});
      }
    });
    return i + std::max<std::int64_t>(1, layout_->contiguous(layout::Canonical{tensor, i}));
  }

  const layout::ServingLayout* layout_;
  std::vector<StagedWrites*> out_;
  std::vector<Target> targets_;
};

}  // namespace dte::receive
