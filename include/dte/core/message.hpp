// SPDX-License-Identifier: Apache-2.0
// What a message between a sender and a receiver carries, as values: its kind, its version and
// the version it applies to, and the elements as (receiver tensor, index, 16-bit value) entries
// or dense runs — absolute values, so applying a message twice changes nothing (idempotent
// overwrite). The bytes on the wire are dte/engine/wire.hpp's (docs/wire.md).
#pragma once

#include <cstdint>
#include <vector>

namespace dte {

using Version = std::uint64_t;
inline constexpr Version no_version = ~Version{0};  // a receiver that holds nothing yet

enum class MessageKind : std::uint32_t {
  delta = 1,   // changes since `base`
  noop = 2,    // an explicit no-op version (skipped step, lr = 0): nothing changed
  full = 3,    // every element (the first publication, or a resync): any base is accepted
  repair = 4,  // a dense resync of some tensors within the version already held
};

struct DeltaEntry {
  std::uint32_t tensor;
  std::uint32_t index;
  std::uint16_t bits;
};

struct DenseRun {
  std::uint32_t tensor;
  std::uint32_t index;  // first element
  std::vector<std::uint16_t> bits;
};

}  // namespace dte
