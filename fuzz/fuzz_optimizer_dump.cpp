// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: the optimizer-dump reader and its audit (`dte audit-inverse`). Any bytes
// are either audited (hyperparameters within their documented ranges, every count consistent)
// or refused with a dte::error.
#include <cstddef>
#include <cstdint>

#include "dte/detect/detect.hpp"
#include "dte/io/optimizer_dump.hpp"
#include "dte/io/safetensors.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto f = dte::io::SafetensorsFile::parse(dte::fuzz::bytes(data, size), "fuzz");
    dte::io::OptimizerStep step;
    const dte::AuditCounts c = dte::io::audit_inverse_file<dte::BF16Detect>(f, &step);
    DTE_FUZZ_REQUIRE(c.detected <= c.elements && c.true_changed <= c.elements);
    DTE_FUZZ_REQUIRE(c.missed <= c.true_changed);
    const double lr = step.kind == dte::io::OptimizerKind::sgd ? step.sgd.lr : step.adam.lr;
    DTE_FUZZ_REQUIRE(lr >= 0.0 && lr <= dte::limits::max_lr);
  } catch (const dte::error&) {
  }
  return 0;
}
