// SPDX-License-Identifier: Apache-2.0
// Where a plan segment's weights are, from a trainer access (concept trainer_access): its own
// span (segmented_access: a sharded PyTorch rank's local tensor, its size checked against the
// segment's), or its piece of the buffer's one span. The host frame (pipeline/frame.hpp) and the
// device stages (pipeline/device_stages.hpp) alike: the spans are sliced, never read here.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "dte/concepts.hpp"
#include "dte/error.hpp"
#include "dte/layout/plan.hpp"

namespace dte::pipeline {

// Segment s's weights (s.length of them) on trainer rank `rank`; label names the segment in an
// error (throws invalid_argument when a segment's own span has another size).
template <class Access>
[[nodiscard]] std::span<const float> segment_weights(const Access& access, std::int64_t rank,
                                                     layout::BufferKind b,
                                                     const layout::PlanSegment& s,
                                                     const std::string& label) {
  if constexpr (segmented_access<Access>) {
    const std::span<const float> w = access.segment_theta(rank, b, s);
    if (static_cast<std::int64_t>(w.size()) != s.length) {
      throw invalid_argument(label + ": the accessor gives " + std::to_string(w.size()) +
                             " weights for a piece of " + std::to_string(s.length) +
                             " elements. Nothing was sent.");
    }
    return w;
  } else {
    return access.theta(rank, b).subspan(static_cast<std::size_t>(s.shard_begin),
                                         static_cast<std::size_t>(s.length));
  }
}

}  // namespace dte::pipeline
