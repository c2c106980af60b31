// SPDX-License-Identifier: Apache-2.0
// Coverage of a set of transfer plans, checked on runs rather than elements so that it scales to
// real models: every canonical element must be sent by exactly one trainer element, and every
// receiver element that holds data must be written exactly once per replica.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dte/layout/hf.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/serving.hpp"

namespace dte::layout {

struct CoverageReport {
  bool exact = true;
  std::string problem;                  // the first violation, empty when exact
  std::int64_t source_elements = 0;     // optimizer-shard elements of all ranks, padding included
  std::int64_t sender_elements = 0;     // of which carry a canonical element to send
  std::int64_t canonical_elements = 0;  // elements of the HF checkpoint
  std::int64_t receiver_elements = 0;   // live receiver elements, all replicas
  std::int64_t receiver_writes = 0;     // element writes the plans produce, all replicas
};

namespace detail {

struct CanonicalRun {
  std::int64_t start;  // global canonical index
  std::int64_t length;
};

struct ReceiverRun {
  std::int64_t ts, tensor, index, length;
};

}  // namespace detail

// receivers = false checks the trainer side only: the plain unsharded HF layout (storage) is the
// canonical space itself.
inline CoverageReport check_coverage(const HfModel& hf, const ServingLayout& recv,
                                     const std::vector<TransferPlan>& plans,
                                     bool receivers = true) {
  CoverageReport rep;
  rep.canonical_elements = hf.total();
  auto fail = [&](const std::string& what) {
    if (rep.exact) rep.problem = what;
    rep.exact = false;
  };

  // 1. Canonical runs sent by the trainer ranks: one per piece the mapping calls contiguous (a
  //    local row of a matrix, a head of the QKV bias), merged when they abut.
  std::vector<detail::CanonicalRun> sent;
  for (const TransferPlan& plan : plans) {
    for (BufferKind b : {BufferKind::dense, BufferKind::expert}) {
      rep.source_elements += plan.shard_size(b);
      for (const PlanSegment& s : plan.segments(b)) {
        if (!s.sender) continue;
        const MegatronParam& p = plan.params()[static_cast<std::size_t>(s.param)];
        for (std::int64_t pos = 0; pos < s.length;) {
          const std::int64_t local = s.param_begin + pos;
          const std::int64_t n = std::min(s.length - pos, plan.mapping().contiguous(p, local));
          const Canonical c = plan.mapping()(p, local);
          if (c.tensor >= 0) {
            const std::int64_t g = hf[c.tensor].base + c.index;
            rep.sender_elements += n;
            if (!sent.empty() && sent.back().start + sent.back().length == g) {
              sent.back().length += n;
            } else {
              sent.push_back({g, n});
            }
          }
          pos += n;
        }
      }
    }
  }
  std::sort(sent.begin(), sent.end(),
            [](const auto& a, const auto& b) { return a.start < b.start; });
  auto name_of = [&](std::int64_t g) {
    std::int64_t lo = 0, hi = hf.size() - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (hf[mid].base <= g)
        lo = mid;
      else
        hi = mid - 1;
    }
    return hf.name(lo) + "[" + std::to_string(g - hf[lo].base) + "]";
  };
  std::int64_t next = 0;
  for (const auto& r : sent) {
    if (r.start > next) fail("canonical " + name_of(next) + " is never sent");
    if (r.start < next) fail("canonical " + name_of(r.start) + " is sent more than once");
    next = std::max(next, r.start + r.length);
  }
  if (next < hf.total()) fail("canonical " + name_of(next) + " is never sent");
  if (!receivers) {
    rep.receiver_elements = rep.canonical_elements;
    rep.receiver_writes = rep.sender_elements;
    return rep;
  }

  // 2. Receiver runs of one replica (the others are copies): split each canonical run where a
  //    receiver row block or column chunk ends, and follow every target.
  std::vector<detail::ReceiverRun> written;
  std::int64_t tensor = 0;
  for (const auto& r : sent) {
    for (std::int64_t g = r.start; g < r.start + r.length;) {
      while (hf[tensor].base + hf[tensor].numel() <= g)
        ++tensor;
      while (hf[tensor].base > g)
        --tensor;
      const Canonical c{tensor, g - hf[tensor].base};
      const std::int64_t n =
          std::min({r.start + r.length - g, hf[tensor].numel() - c.index, recv.contiguous(c)});
      recv.targets(c, [&](const ReceiverElement& e) {
        written.push_back({e.ts, e.tensor, e.index, n});
      });
      g += n;
    }
  }
  std::sort(written.begin(), written.end(), [](const auto& a, const auto& b) {
    return a.ts != b.ts           ? a.ts < b.ts
           : a.tensor != b.tensor ? a.tensor < b.tensor
                                  : a.index < b.index;
  });
  const InferTopology& it = recv.topology();
  std::size_t k = 0;
  for (std::int64_t ts = 0; ts < it.tp; ++ts) {
    rep.receiver_elements += recv.live_elements(ts) * it.replicas;
    for (std::int64_t id = 0; id < recv.size(); ++id) {
      const ReceiverTensor& x = recv[id];
      std::int64_t live = x.numel;
      if (x.kind == ReceiverKind::embed || x.kind == ReceiverKind::lm_head) {
        const std::int64_t per = x.shape[0];
        live = std::clamp<std::int64_t>(hf.spec().vocab - ts * per, 0, per) * hf.spec().hidden;
      }
      std::int64_t at = 0;
      for (; k < written.size() && written[k].ts == ts && written[k].tensor == id; ++k) {
        const auto& w = written[k];
        rep.receiver_writes += w.length * it.replicas;
        if (w.index != at) {
          fail("receiver TP rank " + std::to_string(ts) + " " + recv.name(id) + "[" +
               std::to_string(std::min(w.index, at)) + "] is " +
               (w.index > at ? "never written" : "written more than once"));
        }
        at = std::max(at, w.index + w.length);
      }
      if (at != live) {
        fail("receiver TP rank " + std::to_string(ts) + " " + recv.name(id) + " has " +
             std::to_string(live) + " live elements but " + std::to_string(at) + " are written");
      }
    }
  }
  if (k != written.size()) fail("writes outside the receiver tensors");
  if (rep.receiver_writes != rep.receiver_elements) {
    fail("receiver writes (" + std::to_string(rep.receiver_writes) +
         ") differ from live elements (" + std::to_string(rep.receiver_elements) + ")");
  }
  return rep;
}

}  // namespace dte::layout
