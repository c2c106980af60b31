// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: config.json. Any text is either a model spec whose every field and derived
// size lies within dte/bounds.hpp's limits (and, when small, maps to HF and SGLang layouts), or
// is refused with a dte::error; no crash, hang, overflow or runaway allocation.
#include <cstddef>
#include <cstdint>

#include "dte/bounds.hpp"
#include "dte/io/json.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto j = dte::io::parse_strict(dte::fuzz::text(data, size), "fuzz", "model config", 64);
    const dte::layout::ModelSpec m = dte::io::model_from_config_json(j, "fuzz");
    DTE_FUZZ_REQUIRE(m.hidden >= 1 && m.hidden <= dte::limits::hidden);
    DTE_FUZZ_REQUIRE(m.vocab >= 1 && m.vocab <= dte::limits::vocab);
    DTE_FUZZ_REQUIRE(m.kv_heads >= 1 && m.heads % m.kv_heads == 0);
    DTE_FUZZ_REQUIRE(!m.moe() || (m.experts_per_token >= 1 && m.experts_per_token <= m.experts));
    // Building the layouts costs per tensor: only for models of a few thousand tensors.
    if (m.layers * (m.moe() ? 9 + 3 * m.experts : 11) <= 4096) {
      const dte::layout::HfModel hf(m);
      dte::layout::InferTopology t;
      dte::layout::validate(m, t);
      const dte::layout::ServingLayout recv(hf, t);
      for (std::int64_t k = 0; k < recv.size(); ++k)
        DTE_FUZZ_REQUIRE(recv[k].numel <= dte::limits::tensor_elements);
    }
  } catch (const dte::error&) {
  }
  return 0;
}
