// SPDX-License-Identifier: Apache-2.0
// What moves between ranks: a sender hands a transport one payload per receiver (consecutive
// byte spans: a chunked message, never copied into one buffer), a receiver gets (sender, bytes)
// for every sender with a non-empty payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace dte {

using Bytes = std::vector<std::byte>;
using Payload = std::vector<std::span<const std::byte>>;
// What one receiver got in one exchange: (sender index, payload), in sender order.
using Inbox = std::vector<std::pair<std::int64_t, Bytes>>;

inline std::size_t payload_size(const Payload& p) noexcept {
  std::size_t n = 0;
  for (const auto& part : p)
    n += part.size();
  return n;
}

}  // namespace dte
