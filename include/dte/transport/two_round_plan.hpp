// SPDX-License-Identifier: Apache-2.0
// The schedule both sides of a two-round exchange derive from round one's counts, as host code
// (tested in tests/transport/test_two_round_plan.cpp) so that the NCCL transport only issues the
// calls it lists: where each message lies in the one staging buffer, and how a message above the
// chunk limit (NCCL's count is a size_t, but a single call above 2^31 bytes is where transports
// and proxies have had overflow bugs) is cut into consecutive chunks, in the same order on the
// sending and on the receiving side (NCCL matches the p2p calls of a peer pair in issue order).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/error.hpp"

namespace dte::two_round {

// The largest chunk a transport may issue as one call.
inline constexpr std::uint64_t max_chunk_bytes = std::uint64_t{1} << 31;

struct Chunk {
  std::uint64_t offset;  // from the start of its message
  std::uint64_t bytes;   // 1 .. chunk limit
};

// The chunks of a message of `bytes` bytes: none for an empty message; otherwise
// ceil(bytes / chunk) consecutive pieces, all of `chunk` bytes but the last.
inline std::vector<Chunk> chunks(std::uint64_t bytes, std::uint64_t chunk) {
  if (chunk == 0 || chunk > max_chunk_bytes) {
    throw invalid_argument("two-round exchange: the chunk size must be in [1, 2^31] bytes (got " +
                           std::to_string(chunk) + ")");
  }
  std::vector<Chunk> out;
  for (std::uint64_t at = 0; at < bytes; at += chunk)
    out.push_back({at, bytes - at < chunk ? bytes - at : chunk});
  return out;
}

// Messages laid end to end in one staging buffer, in peer order: offsets[p] is where peer p's
// message starts, total the buffer's size. Throws bounds_error if the total overflows 64 bits.
struct StagingLayout {
  std::vector<std::uint64_t> offsets;
  std::uint64_t total = 0;
};

inline StagingLayout staging_layout(std::span<const std::uint64_t> counts) {
  StagingLayout s;
  s.offsets.reserve(counts.size());
  for (std::uint64_t n : counts) {
    s.offsets.push_back(s.total);
    if (n > UINT64_MAX - s.total) {
      throw bounds_error(
          "two-round exchange: the messages of one rank sum to more than 2^64 "
          "bytes; the round-one counts are corrupt");
    }
    s.total += n;
  }
  return s;
}

// "ranks 3..6" / "rank 3" / "no rank": the peers a phase waits on, for error messages.
inline std::string peer_range(int first, int count) {
  if (count <= 0) return "no rank";
  if (count == 1) return "rank " + std::to_string(first);
  return "ranks " + std::to_string(first) + ".." + std::to_string(first + count - 1);
}

}  // namespace dte::two_round
