// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: the version manifest reader (storage/manifest.hpp). Any text either parses
// into a manifest whose chunk files are plain names, whose (writer, chunk) slots are distinct
// and whose digest covers the model, and which writes and reads back to itself; or is refused
// with a format_error, bounds_error or protocol_error.
#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>

#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/storage/manifest.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3"));
  try {
    const dte::storage::Manifest m =
        dte::storage::parse_manifest(dte::fuzz::text(data, size), "fuzz", hf);
    DTE_FUZZ_REQUIRE(m.digest.size() == static_cast<std::size_t>(hf.size()));
    DTE_FUZZ_REQUIRE(m.anchor() || m.base < m.version);
    std::set<std::pair<std::uint32_t, std::uint32_t>> slots;
    for (const dte::storage::ChunkEntry& c : m.chunks) {
      DTE_FUZZ_REQUIRE(dte::storage::plain_file_name(c.file));
      DTE_FUZZ_REQUIRE(c.writer < m.writers);
      DTE_FUZZ_REQUIRE(slots.insert({c.writer, c.chunk}).second);
    }
    const dte::storage::Manifest back =
        dte::storage::parse_manifest(dte::storage::manifest_json(m), "again", hf);
    DTE_FUZZ_REQUIRE(back == m);
  } catch (const dte::format_error&) {
  } catch (const dte::bounds_error&) {
  } catch (const dte::protocol_error&) {
  }
  return 0;
}
