// SPDX-License-Identifier: Apache-2.0
// Reading a chunk a manifest lists (storage/read.hpp), against the storage faults of
// RELIABILITY.md 6.2: M1 a missing chunk, M2 a short one (metadata before bytes), M12 another
// chunk of equal size in its place, F16 a flipped bit, M13 a symlink out of the directory.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/storage/read.hpp"

using namespace dte;
namespace fs = std::filesystem;

namespace {

const layout::HfModel& model() {
  static const layout::HfModel hf(layout::model_preset("tiny-qwen3"));
  return hf;
}

struct Dir {
  static inline int made = 0;
  fs::path path = fs::temp_directory_path() /
                  ("dte-read-" + std::to_string(::getpid()) + "-" + std::to_string(made++));
  Dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
};

storage::Chunk chunk(std::uint32_t number, std::uint16_t bits) {
  storage::Chunk c;
  c.header = {5, 4, number, 0};
  c.tensors.push_back({0, {1, 2, 300}, {bits, bits, bits}});
  return c;
}

// Writes chunk c as `file` and returns its manifest entry.
storage::ChunkEntry put(const Dir& d, const storage::Chunk& c, const std::string& file) {
  const auto bytes = storage::encode_chunk(model(), c);
  io::write_file_atomic(d.path / file, bytes, "chunk");
  return {file, bytes.size(), storage::checksum(bytes), c.header.chunk, c.header.writer};
}

storage::Manifest manifest(std::vector<storage::ChunkEntry> chunks) {
  storage::Manifest m;
  m.model = model().spec().name;
  m.version = 5;
  m.base = 4;
  m.chunks = std::move(chunks);
  return m;
}

template <class E>
void refuses(const Dir& d, const storage::Manifest& m, const storage::ChunkEntry& e,
             const std::string& why) {
  try {
    (void)storage::read_chunk(model(), d.path, m, e);
    FAIL("accepted; expected a refusal saying: " << why);
  } catch (const E& err) {
    CHECK_MESSAGE(std::string(err.what()).find(why) != std::string::npos, err.what());
  }
}

}  // namespace

TEST_CASE("a listed chunk reads back verified") {
  const Dir d;
  const auto e = put(d, chunk(0, 0x3F80), "c0-w0.zst");
  const storage::Manifest m = manifest({e});
  const storage::Chunk c = storage::read_chunk(model(), d.path, m, e);
  CHECK(c.header == storage::ChunkHeader{5, 4, 0, 0});
  REQUIRE(c.tensors.size() == 1);
  CHECK(c.tensors[0] == chunk(0, 0x3F80).tensors[0]);
}

TEST_CASE("storage faults are refused before anything is decoded") {
  const Dir d;
  const auto e0 = put(d, chunk(0, 0x3F80), "c0-w0.zst");
  // A chunk that differs only in its slot and compresses to the same size.
  auto e1 = put(d, chunk(1, 0x3F80), "c1-w0.zst");
  for (std::uint32_t k = 2; k < 10 && e1.bytes != e0.bytes; ++k)
    e1 = put(d, chunk(k, 0x3F80), "c" + std::to_string(k) + "-w0.zst");
  const storage::Manifest m = manifest({e0, e1});
  // M1: listed but missing.
  storage::ChunkEntry missing = e0;
  missing.file = "c7-w0.zst";
  refuses<io_error>(d, m, missing, "the version is incomplete on storage");
  // M2: the manifest lists more bytes than are there yet.
  storage::ChunkEntry longer = e0;
  longer.bytes += 10;
  refuses<format_error>(d, m, longer, "still being written, truncated, or replaced");
  // M12: another chunk of the same size in this one's place.
  REQUIRE(e0.bytes == e1.bytes);
  fs::copy_file(d.path / e1.file, d.path / e0.file, fs::copy_options::overwrite_existing);
  refuses<format_error>(d, m, e0, "another chunk in its place");
  // ... and with the checksum doctored to match, the header check still refuses it.
  storage::ChunkEntry doctored = e0;
  doctored.xxh3 = e1.xxh3;
  refuses<protocol_error>(d, m, doctored, "another version or slot");
  // F16: one flipped bit.
  std::vector<char> raw(e1.bytes);
  std::ifstream(d.path / e1.file, std::ios::binary).read(raw.data(), static_cast<long>(raw.size()));
  raw[raw.size() / 2] ^= 0x04;
  std::ofstream(d.path / e1.file, std::ios::binary)
      .write(raw.data(), static_cast<long>(raw.size()));
  refuses<format_error>(d, m, e1, "corrupt, or another chunk in its place");
}

TEST_CASE("a symlinked or non-regular chunk file is refused (M13)") {
  const Dir d;
  const Dir outside;  // a second directory: the link would escape into it
  const auto e = put(d, chunk(0, 0x3F80), "c0-w0.zst");
  fs::rename(d.path / e.file, outside.path.string() + "-target.zst");
  fs::create_symlink(outside.path.string() + "-target.zst", d.path / e.file);
  refuses<format_error>(d, manifest({e}), e, "is a symbolic link");
  fs::remove(outside.path.string() + "-target.zst");
  fs::remove(d.path / e.file);
  fs::create_directory(d.path / e.file);
  refuses<format_error>(d, manifest({e}), e, "not a regular file");
  storage::ChunkEntry escape = e;
  escape.file = "../c0-w0.zst";
  refuses<bounds_error>(d, manifest({e}), escape, "is not a plain name");
}
