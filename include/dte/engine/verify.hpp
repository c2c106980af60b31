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
#include "dte/receive/replica.hpp"

namespace dte::detail {

// The verification verdict: canonical tensor t disagrees when, in some replica, the receivers'
// digests (summed: replica_sums[replica * tensors + t]) do not hold the trainer's
// (receive/replica.hpp).
// (Digests are sums mod 2^32: sum_fields sums them in 64-bit words and keeps them mod 2^32.)
inline std::vector<bool> mismatched_tensors(const layout::HfModel& hf,
                                            const layout::ServingLayout& receivers,
                                            const std::vector<Digest>& trainer,
                                            std::span<const Digest> replica_sums) {
  const std::size_t tensors = trainer.size();
  std::vector<bool> bad(tensors, false);
  for (std::int64_t replica = 0; replica < receivers.topology().replicas; ++replica) {
    for (std::size_t t = 0; t < tensors; ++t) {
      const Digest replica_sum = replica_sums[static_cast<std::size_t>(replica) * tensors + t];
      if (!receive::replica_holds(hf, receivers, static_cast<std::int64_t>(t), replica_sum,
                                  trainer[t])) {
        bad[t] = true;
      }
    }
  }
  return bad;
}

}  // namespace dte::detail
