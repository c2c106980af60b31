// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: the safetensors reader. Any bytes either parse into a file whose every
// tensor lies inside the data section and can be copied out, or are refused with a
// dte::format_error (or bounds_error); nothing else may escape, crash or trip a sanitizer.
#include <cstddef>
#include <cstdint>

#include "dte/io/safetensors.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto f = dte::io::SafetensorsFile::parse(dte::fuzz::bytes(data, size), "fuzz");
    for (const dte::io::TensorInfo& t : f.tensors()) {
      DTE_FUZZ_REQUIRE(t.begin <= t.end);
      DTE_FUZZ_REQUIRE(f.bytes(t).size() == t.end - t.begin);
      DTE_FUZZ_REQUIRE(t.end - t.begin == t.numel() * dte::io::dtype_size(t.dtype));
      if (t.dtype == dte::io::DType::F32) (void)f.read_as<float>(t.name);
    }
  } catch (const dte::format_error&) {
  } catch (const dte::bounds_error&) {
  }
  return 0;
}
