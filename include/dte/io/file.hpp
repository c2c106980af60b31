// SPDX-License-Identifier: Apache-2.0
// POSIX file access the readers and writers share: a descriptor guard; a bounded read loop;
// and writing a file so that a reader sees the old contents or the new, never a torn file:
// write to `path` + ".tmp-<pid>", fsync, rename over `path`, fsync the directory (so the rename
// survives a power loss).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dte/error.hpp"

namespace dte::io {

// Whether `name` is a plain file name (letters, digits, '.', '_', '-'; not starting with '.';
// at most max_file_name bytes): a name read from a file that may only ever name a file inside
// one directory (storage chunks and manifests, checkpoint shards), never a path.
inline constexpr std::size_t max_file_name = 128;
inline bool plain_file_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > max_file_name || name.front() == '.') return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

namespace detail {

inline std::string errno_text(int err) {
  return std::strerror(err);
}

// Closes a POSIX file descriptor on scope exit.
class FdGuard {
 public:
  explicit FdGuard(int fd) noexcept : fd_(fd) {}
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  FdGuard(FdGuard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  FdGuard& operator=(FdGuard&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~FdGuard() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const noexcept { return fd_; }
  // Closes now and returns 0, or -1 with errno set (a deferred write error shows here).
  int close() noexcept {
    const int fd = std::exchange(fd_, -1);
    return fd >= 0 ? ::close(fd) : 0;
  }

 private:
  int fd_;
};

// Reads from fd until the end of the file or `limit` bytes, whichever comes first (EINTR is
// retried). io_error "cannot read <what> '<name>'" when the OS refuses. The buffer grows with
// what is read (a generous limit costs nothing for a small file).
inline std::vector<std::byte> read_up_to(int fd, std::size_t limit, const std::string& what,
                                         const std::string& name) {
  std::vector<std::byte> bytes(std::min(limit, std::size_t{1} << 16));
  std::size_t done = 0;
  while (done < limit) {
    if (done == bytes.size()) bytes.resize(std::min(limit, 2 * bytes.size()));
    const ::ssize_t got = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (got < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      throw io_error("cannot read " + what + " '" + name + "': " + errno_text(err));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  bytes.resize(done);
  return bytes;
}

// fsyncs a directory (after a rename into it). dte::io_error naming `what` on failure.
inline void fsync_directory(const std::filesystem::path& dir, const std::string& what) {
  const std::filesystem::path d = dir.empty() ? std::filesystem::path(".") : dir;
  FdGuard dfd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0 || ::fsync(dfd.get()) != 0) {
    const int err = errno;
    throw io_error("wrote " + what + " but cannot fsync its directory '" + d.string() +
                   "': " + errno_text(err));
  }
}

}  // namespace detail

// Writes `bytes` to `path` atomically (see the top of this file). `what` names the file in
// messages ("safetensors file", "chunk"). dte::io_error on failure; the temporary is removed.
inline void write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> bytes,
                              const std::string& what) {
  const std::string target = path.string();
  const std::string tmp = target + ".tmp-" + std::to_string(::getpid());
  // Reads errno first, before anything else can change it; removes the temporary file.
  const auto fail = [&](const char* step) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw io_error("cannot write " + what + " '" + target + "': " + step + " '" + tmp +
                   "': " + detail::errno_text(err));
  };
  {
    detail::FdGuard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      const int err = errno;  // nothing to unlink: the temporary was not created
      throw io_error("cannot write " + what + " '" + target + "': open '" + tmp +
                     "': " + detail::errno_text(err));
    }
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ::ssize_t put = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
      if (put < 0) {
        if (errno == EINTR) continue;
        fail("write");
      }
      done += static_cast<std::size_t>(put);
    }
    if (::fsync(fd.get()) != 0) fail("fsync");
    if (fd.close() != 0) fail("close");
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) fail("rename");
  detail::fsync_directory(path.parent_path(), what + " '" + target + "'");
}

// Where the temporary suffix of a name write_file_atomic or write_file_exclusive makes begins
// ("<name>.tmp-<pid>", "<name>.new-<pid>"), or npos for a finished file.
inline std::size_t temporary_suffix(std::string_view name) noexcept {
  return std::min(name.find(".tmp-"), name.find(".new-"));
}

// Writes `bytes` to `path` only if no file of that name exists, atomically: written to a
// temporary name and fsynced, then hard-linked to `path` (link() fails when `path` exists, so of
// two writers racing for one name exactly one wins), the temporary removed, the directory
// fsynced. Returns false, having written nothing under `path`, when the name was taken.
inline bool write_file_exclusive(const std::filesystem::path& path,
                                 std::span<const std::byte> bytes, const std::string& what) {
  const std::string staged = path.string() + ".new-" + std::to_string(::getpid());
  write_file_atomic(staged, bytes, what);
  const int linked = ::link(staged.c_str(), path.c_str());
  const int err = errno;
  ::unlink(staged.c_str());
  if (linked != 0) {
    if (err == EEXIST) return false;
    throw io_error("cannot write " + what + " '" + path.string() +
                   "': link: " + detail::errno_text(err));
  }
  detail::fsync_directory(path.parent_path(), what + " '" + path.string() + "'");
  return true;
}

}  // namespace dte::io
