// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: the canonical chunk reader (storage/chunk.hpp). The first byte chooses the
// layer the rest reaches: even, the bytes are the chunk as stored (a zstd frame); odd, they are
// the container inside it, compressed here first, so mutations reach the safetensors, metadata
// and gap-code checks rather than dying in zstd. A class index resolves against a fixed base
// (chunk_base.hpp). Either the chunk decodes, and then every index lies inside its tensor,
// strictly increasing, one value each, and encoding it again (a class index as plain indices)
// decodes to the same chunk; or it is refused with a format_error, bounds_error or
// protocol_error.
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "chunk_base.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/storage/chunk.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3"));
  std::vector<std::byte> in = dte::fuzz::bytes(data + 1, size - 1);
  if ((data[0] & 1u) != 0) {
    std::vector<std::byte> z(ZSTD_compressBound(in.size()));
    const std::size_t n = ZSTD_compress(z.data(), z.size(), in.data(), in.size(), 1);
    if (ZSTD_isError(n)) return 0;
    z.resize(n);
    in = std::move(z);
  }
  try {
    static const dte::fuzz::PatternBase base;
    dte::storage::Chunk c = dte::storage::decode_chunk(hf, in, "fuzz", nullptr, 1u << 24, &base);
    for (const dte::storage::TensorDelta& t : c.tensors) {
      DTE_FUZZ_REQUIRE(t.tensor >= 0 && t.tensor < hf.size());
      DTE_FUZZ_REQUIRE(t.index.size() == t.bits.size());
      for (std::size_t k = 0; k < t.index.size(); ++k) {
        DTE_FUZZ_REQUIRE(t.index[k] < static_cast<std::uint64_t>(hf[t.tensor].numel()));
        DTE_FUZZ_REQUIRE(k == 0 || t.index[k] > t.index[k - 1]);
      }
    }
    c.index = dte::storage::IndexCode::plain;
    const auto again = dte::storage::encode_chunk(hf, c, 1);
    const dte::storage::Chunk back = dte::storage::decode_chunk(hf, again, "again", &c.header);
    DTE_FUZZ_REQUIRE(back.tensors == c.tensors);
  } catch (const dte::format_error&) {
  } catch (const dte::bounds_error&) {
  } catch (const dte::protocol_error&) {
  }
  return 0;
}
