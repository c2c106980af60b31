// SPDX-License-Identifier: Apache-2.0
// Verified sync: after every publication each inference replica's digest, per canonical tensor
// (summed over its TP ranks), must equal the trainer's times the copies of that tensor a replica
// holds; a tensor that disagrees in any replica is named and resent densely.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"

namespace dte::detail {

// The verification verdict: canonical tensor t disagrees when, in some replica, the sum of the
// receivers' digests (replica_sums[replica * tensors + t]) differs from the trainer's digest
// times the copies of t a replica holds.
// (Digests are sums mod 2^32: sum_fields sums them in 64-bit words and keeps them mod 2^32.)
inline std::vector<bool> mismatched_tensors(const layout::HfModel& hf,
                                            const layout::ServingLayout& receivers,
                                            const std::vector<Digest>& trainer,
                                            std::span<const Digest> replica_sums) {
  const std::size_t tensors = trainer.size();
  std::vector<bool> bad(tensors, false);
  for (std::int64_t replica = 0; replica < receivers.topology().replicas; ++replica) {
    for (std::size_t t = 0; t < tensors; ++t) {
      const auto copies =
          static_cast<Digest>(receivers.copies(hf[static_cast<std::int64_t>(t)].kind));
      const Digest replica_sum = replica_sums[static_cast<std::size_t>(replica) * tensors + t];
      if (replica_sum != static_cast<Digest>(copies * trainer[t])) {
        bad[t] = true;
      }
    }
  }
  return bad;
}

}  // namespace dte::detail
