// SPDX-License-Identifier: Apache-2.0
// The replica digest: one replica of a serving layout holds the trainer's state when, per
// canonical tensor, the digests of its TP ranks (each rank's receiver core digest, over its
// copies of the tensor's elements) sum to the trainer's digest times the copies of that tensor a
// replica holds (KV heads and norms replicated over TP ranks count more than once). Digests are
// sums mod 2^32. The engine's verification (engine/verify.hpp), the storage reader and
// publication::check_replica decide with this one rule.
#pragma once

#include <cstdint>

#include "dte/core/digest.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"

namespace dte::receive {

// Whether a replica whose ranks' digests of canonical tensor `tensor` sum to `replica_sum`
// holds the trainer's state of it (the trainer's digest `trainer`).
inline bool replica_holds(const layout::HfModel& hf, const layout::ServingLayout& layout,
                          std::int64_t tensor, Digest replica_sum, Digest trainer) noexcept {
  const auto copies = static_cast<Digest>(layout.copies(hf[tensor].kind));
  return replica_sum == static_cast<Digest>(copies * trainer);
}

}  // namespace dte::receive
