// SPDX-License-Identifier: Apache-2.0
// Reading one chunk a manifest lists, as a reader of untrusted storage must (RELIABILITY.md 6.2):
// the name is a plain file name inside the version directory (the manifest reader checked it);
// the file is opened without following a symlink (O_NOFOLLOW: no escape from the directory) and
// must be a regular file of exactly the listed size, checked before anything is read (a chunk
// still being uploaded, or truncated, is refused unread); its xxh3-64 must equal the listed one
// (a flipped bit, a chunk of another version of the same size in its place); then the chunk
// decodes with the header the manifest implies.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"

namespace dte::storage {

// The bytes of chunk file `e` in version directory `dir`, checked against the manifest's size
// and checksum. io_error when the file cannot be read (missing: the caller retries or refuses
// the version); format_error when it is there but is not what the manifest says.
inline std::vector<std::byte> read_chunk_bytes(const std::filesystem::path& dir,
                                               const ChunkEntry& e) {
  if (!plain_file_name(e.file)) {
    throw bounds_error("chunk file name \"" + e.file + "\" is not a plain name; refused");
  }
  const std::filesystem::path path = dir / e.file;
  const std::string name = path.string();
  io::detail::FdGuard fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ELOOP) {
      throw format_error(name +
                         ": is a symbolic link; chunk files must be regular files inside "
                         "the version directory");
    }
    throw io_error("cannot open chunk '" + name + "': " + io::detail::errno_text(err) +
                   (err == ENOENT ? " (the manifest lists it: the version is incomplete on "
                                    "storage; retry later or refuse the version)"
                                  : ""));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    throw io_error("cannot stat chunk '" + name + "': " + io::detail::errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) throw format_error(name + ": not a regular file");
  if (static_cast<std::uint64_t>(st.st_size) != e.bytes) {
    throw format_error(name + ": " + std::to_string(st.st_size) + " bytes, the manifest lists " +
                       std::to_string(e.bytes) +
                       " (still being written, truncated, or replaced); not read");
  }
  const std::vector<std::byte> bytes =
      io::detail::read_up_to(fd.get(), static_cast<std::size_t>(e.bytes), "chunk", name);
  if (bytes.size() != e.bytes) {
    throw format_error(name + ": shrank to " + std::to_string(bytes.size()) +
                       " bytes while being read");
  }
  const std::uint64_t sum = checksum(bytes);
  if (sum != e.xxh3) {
    throw format_error(name + ": xxh3 " + detail::hex(sum, 16) + ", the manifest lists " +
                       detail::hex(e.xxh3, 16) + " (corrupt, or another chunk in its place)");
  }
  return bytes;
}

// Chunk `e` of manifest `m`, read, verified and decoded (a class index against `base`, the
// bits held before version m; storage/class_index.hpp).
inline Chunk read_chunk(const layout::HfModel& hf, const std::filesystem::path& dir,
                        const Manifest& m, const ChunkEntry& e, const ClassBase* base = nullptr) {
  const std::vector<std::byte> bytes = read_chunk_bytes(dir, e);
  const ChunkHeader expect{m.version, m.base, e.chunk, e.writer};
  return decode_chunk(hf, bytes, (dir / e.file).string(), &expect, max_decoded_bytes, base);
}

// ... read, verified and checked, its class index (if any) left unresolved.
inline void check_chunk_file(const layout::HfModel& hf, const std::filesystem::path& dir,
                             const Manifest& m, const ChunkEntry& e) {
  const std::vector<std::byte> bytes = read_chunk_bytes(dir, e);
  const ChunkHeader expect{m.version, m.base, e.chunk, e.writer};
  check_chunk(hf, bytes, (dir / e.file).string(), &expect);
}

// The largest manifest a reader reads (2^20 chunks of about 120 bytes each fit).
inline constexpr std::size_t max_manifest_bytes = std::size_t{256} << 20;

// The manifest of version v under `root`, read without following symlinks and parsed strictly;
// io_error when there is none (the version is not published, or incomplete), format_error when
// it is not a valid manifest of this model and of version v.
inline Manifest read_manifest(const layout::HfModel& hf, const std::filesystem::path& root,
                              Version v) {
  const std::string name = (version_dir(root, v) / manifest_name).string();
  io::detail::FdGuard fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) {
    const int err = errno;
    throw io_error("cannot open manifest '" + name + "': " + io::detail::errno_text(err) +
                   (err == ENOENT
                        ? " (version " + std::to_string(v) + " is not published, or not complete)"
                        : std::string{}));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    throw format_error(name + ": not a regular file");
  }
  const std::vector<std::byte> bytes =
      io::detail::read_up_to(fd.get(), max_manifest_bytes + 1, "manifest", name);
  if (bytes.size() > max_manifest_bytes) {
    throw bounds_error(name + ": over the manifest limit of " + std::to_string(max_manifest_bytes) +
                       " bytes; refused unread");
  }
  Manifest m = parse_manifest(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), name, hf);
  if (m.version != v) {
    throw format_error(name + ": says version " + std::to_string(m.version) +
                       " inside the directory of version " + std::to_string(v) +
                       " (moved or copied by hand); refused");
  }
  return m;
}

}  // namespace dte::storage
