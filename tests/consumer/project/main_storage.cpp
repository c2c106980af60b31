// SPDX-License-Identifier: Apache-2.0
// dte::storage from an installed dte: a chunk round trip (zstd linked, xxHash included).
#include <cstdio>

#include "dte/layout/model.hpp"
#include "dte/storage/chunk.hpp"

int main() {
  const dte::layout::HfModel hf(dte::layout::model_preset("tiny-qwen3"));
  dte::storage::Chunk c;
  c.header = {2, 1, 0, 0};
  c.tensors.push_back({0, {3, 9}, {0x3F80, 0xBF80}});
  const auto bytes = dte::storage::encode_chunk(hf, c);
  const auto back = dte::storage::decode_chunk(hf, bytes, "consumer", &c.header);
  const bool ok = back.tensors.size() == 1 && back.tensors[0] == c.tensors[0];
  std::printf("consumer_storage: %s (%zu bytes, xxh3 %016llx)\n", ok ? "ok" : "MISMATCH",
              bytes.size(), static_cast<unsigned long long>(dte::storage::checksum(bytes)));
  return ok ? 0 : 1;
}
