// SPDX-License-Identifier: Apache-2.0
// Megatron's distributed-optimizer buffers (shared/LAYOUTS.md §7): one flat buffer per
// dense/expert group, parameters in reverse named_parameters() order, each starting at a
// multiple of 64 elements, buckets padded to lcm(dp, 128), and DP rank r owning
// [bucket_start + r*S/dp, bucket_start + (r+1)*S/dp) of every bucket, parameter boundaries
// ignored. The rank's optimizer shard is the concatenation of its slices, bucket by bucket.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dte/error.hpp"

namespace dte::layout {

struct BufferParam {
  std::int64_t param;  // index into the rank's parameter list
  std::int64_t start;  // first element in the buffer
  std::int64_t numel;
};

struct Bucket {
  std::int64_t start;
  std::int64_t end;  // padded
};

struct BufferLayout {
  std::vector<BufferParam> params;  // in buffer order
  std::vector<Bucket> buckets;
  std::int64_t dp = 1;

  [[nodiscard]] std::int64_t size() const noexcept {
    return buckets.empty() ? 0 : buckets.back().end;
  }
  // The slices rank r owns, in shard order.
  [[nodiscard]] std::vector<Bucket> owned(std::int64_t r) const {
    std::vector<Bucket> out;
    for (const Bucket& b : buckets) {
      const std::int64_t s = (b.end - b.start) / dp;
      out.push_back({b.start + r * s, b.start + (r + 1) * s});
    }
    return out;
  }
  [[nodiscard]] std::int64_t shard_size() const noexcept { return size() / dp; }
};

// Lays out `numels` (given in named_parameters() order, indices into the caller's list) the way
// _ParamAndGradBuffer does. bucket_size 0: a single bucket (overlap_grad_reduce off, or pp > 0).
// own_bucket[k] (Megatron's shared_embedding: tied embeddings with pp > 1) closes the bucket
// before parameter k and puts k in a bucket of its own, whatever the bucket size.
inline BufferLayout megatron_buffer_layout(const std::vector<std::int64_t>& param_ids,
                                           const std::vector<std::int64_t>& numels, std::int64_t dp,
                                           std::int64_t bucket_size,
                                           const std::vector<bool>& own_bucket = {}) {
  BufferLayout b;
  b.dp = dp;
  const std::int64_t pad = std::lcm<std::int64_t>(dp, 128);
  auto pad_end = [&](std::int64_t e) { return (e + pad - 1) / pad * pad; };
  std::int64_t cur = 0, bucket_start = 0;
  for (std::size_t k = param_ids.size(); k-- > 0;) {  // reverse order
    const bool own = k < own_bucket.size() && own_bucket[k];
    std::int64_t start = (cur + 63) / 64 * 64;
    if (own && start > bucket_start) {  // close the bucket of the parameters before it
      const std::int64_t end = pad_end(start);
      b.buckets.push_back({bucket_start, end});
      bucket_start = start = end;
    }
    b.params.push_back({param_ids[k], start, numels[k]});
    cur = start + numels[k];
    if ((bucket_size > 0 && cur - bucket_start >= bucket_size) || own) {
      const std::int64_t end = pad_end(cur);
      b.buckets.push_back({bucket_start, end});
      bucket_start = cur = end;
    }
  }
  if (cur > bucket_start || b.buckets.empty()) b.buckets.push_back({bucket_start, pad_end(cur)});
  return b;
}

}  // namespace dte::layout
