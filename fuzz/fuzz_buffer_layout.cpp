// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: the buffer-layout reader, against tiny-qwen3 with tp=2 (dense) and
// tiny-qwen3-moe with ep=2 (expert buffers). Any text is either a layout whose every parameter
// lies inside its buffer without overlap, or is refused with a dte::error.
#include <cstddef>
#include <cstdint>

#include "dte/io/buffer_layout.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/topology.hpp"
#include "harness.hpp"

namespace {

struct Target {
  dte::layout::HfModel hf;
  dte::layout::TrainTopology train;
};

const Target& target(bool moe) {
  static const Target dense{dte::layout::HfModel(dte::layout::model_preset("tiny-qwen3")),
                            dte::layout::parse_train_topology("tp=2")};
  static const Target experts{dte::layout::HfModel(dte::layout::model_preset("tiny-qwen3-moe")),
                              dte::layout::parse_train_topology("tp=2,ep=2,etp=1")};
  return moe ? experts : dense;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const Target& t = target(data[0] & 1);
  try {
    const auto j =
        dte::io::parse_strict(dte::fuzz::text(data + 1, size - 1), "fuzz", "buffer layout", 16);
    const auto ranks = dte::io::read_buffer_layout(j, t.hf, t.train, "fuzz");
    for (const auto& rb : ranks) {
      for (const auto& bl : rb.layout) {
        for (const auto& p : bl.params) {
          DTE_FUZZ_REQUIRE(p.start >= 0 && p.start + p.numel <= bl.size());
        }
      }
    }
  } catch (const dte::error&) {
  }
  return 0;
}
