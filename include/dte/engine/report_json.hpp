// SPDX-License-Identifier: Apache-2.0
// SyncReport as JSON (nlohmann-json; target dte::io): what `dte simulate --json` prints per
// publication and what a trainer logs.
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "dte/engine/report.hpp"

namespace dte {

inline void to_json(nlohmann::ordered_json& j, const SyncReport& r) {
  char digest[17];
  std::snprintf(digest, sizeof digest, "%08llx", static_cast<unsigned long long>(r.digest));
  j = nlohmann::ordered_json{
      {"version", r.version},
      {"kind", r.kind},
      {"steps", r.steps},
      {"elements_scanned", r.elements_scanned},
      {"changed", r.changed},
      {"guard_extra", r.guard},
      {"changed_fraction", r.changed_fraction()},
      {"receiver_writes", r.routed_writes},
      {"entries", r.entries},
      {"bytes", r.bytes},
      {"dense_bytes", r.dense_bytes},
      {"digest", digest},
      {"verified", r.verified},
      {"resynced_receivers", r.resynced.size()},
      {"repair_refused_receivers", r.repair_refused.size()},
      {"stale_messages", r.stale_messages},
      {"seconds",
       {{"detect", r.detect_s},
        {"route", r.route_s},
        {"exchange", r.exchange_s},
        {"apply", r.apply_s},
        {"verify", r.verify_s}}},
      {"repaired", r.repaired},
      {"bytes_to", r.bytes_to},
  };
}

// One line of JSON.
inline std::string json(const SyncReport& r) {
  nlohmann::ordered_json j;
  to_json(j, r);
  return j.dump();
}

}  // namespace dte
