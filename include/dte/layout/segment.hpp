// SPDX-License-Identifier: Apache-2.0
// The unit a transfer plan describes a trainer rank's optimizer shard in: which buffer (the
// distributed optimizer's dense or expert buffer), and a contiguous range of it that belongs to
// one parameter (so one parameter group: one set of hyperparameters).
#pragma once

#include <cstdint>

namespace dte::layout {

enum class BufferKind : std::uint8_t { dense = 0, expert = 1 };

struct PlanSegment {
  std::int64_t shard_begin;  // offset in the rank's shard of this buffer
  std::int64_t length;
  std::int64_t param_begin;  // flat index in the parameter of the first element
  std::int32_t param;        // index into params()
  bool sender;               // false for TP replicas of replicated tensors (not sent)
};

}  // namespace dte::layout
