// SPDX-License-Identifier: Apache-2.0
// SyncReport: what one publication did, the same on every rank of the world (the engine sums
// every rank's part through the transport). dte/engine/report_json.hpp writes it as JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dte/core/message.hpp"

namespace dte {

struct SyncReport {
  Version version = 0;
  std::string kind;                     // full | delta | noop
  std::int64_t steps = 0;               // optimizer steps this publication covers
  std::uint64_t elements_scanned = 0;   // sender elements read by the detect pass
  std::uint64_t changed = 0;            // elements sent (changed or guard band)
  std::uint64_t guard = 0;              // of which only flagged by the guard band
  std::uint64_t routed_writes = 0;      // receiver element writes, all replicas
  std::uint64_t entries = 0;            // indexed entries on the wire (dense runs excluded)
  std::uint64_t bytes = 0;              // on the wire, all receivers
  std::vector<std::uint64_t> bytes_to;  // per receiver rank
  std::uint64_t dense_bytes = 0;        // what a dense BF16 sync would move: 2 per live element
  std::uint64_t digest = 0;             // trainer total: sum over canonical tensors, mod 2^32
  bool verified = false;                // every replica matched (after repair, if any)
  std::vector<std::string> repaired;    // canonical tensors resent densely
  std::vector<std::int64_t> resynced;   // receivers that refused and got a full resync
  std::vector<std::int64_t> repair_refused;  // receivers that refused their repair (unverified)
  std::uint64_t stale_messages = 0;          // replays of older versions, ignored by the receivers
  // FP8 receivers (docs/fp8.md): codes and block scales sent, one replica's worth; and the
  // quantized tensors whose digest a replica does not match (the next publication is full).
  std::uint64_t fp8_codes = 0, fp8_scales = 0;
  std::vector<std::string> fp8_mismatched;
  // Memory beyond the model (bytes), for the rank with the largest ratio to its payload: the
  // sender's messages and pipeline buffers (+ its dirty masks when K > 1), the receiver's
  // received messages.
  std::uint64_t sender_extra_bytes = 0, sender_payload_bytes = 0;
  std::uint64_t receiver_extra_bytes = 0, receiver_payload_bytes = 0;
  std::uint64_t sender_mask_bytes = 0;     // K > 1: one bit per shard element, per rank
  std::uint64_t sender_fixed_bytes = 0;    // chunks, tables and tile buffers, per rank (largest)
  std::uint64_t payload_total_bytes = 0;   // all senders' messages
  std::uint64_t received_total_bytes = 0;  // all receivers' messages
  // Seconds, the slowest rank of each phase. detect: the staged pass (detect, compact, route,
  // bucket, encode) over every sender's shard; route: closing the messages (dense groups);
  // then exchange, apply, verify (and repair).
  double detect_s = 0, route_s = 0, exchange_s = 0, apply_s = 0, verify_s = 0;

  [[nodiscard]] double changed_fraction() const noexcept {
    return elements_scanned == 0 ? 0.0 : static_cast<double>(changed) / elements_scanned;
  }
};

}  // namespace dte
