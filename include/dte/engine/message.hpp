// SPDX-License-Identifier: Apache-2.0
// The payload one sender puts on the wire for one receiver in one publication: a header (version,
// base version, kind) and the changed elements as (receiver tensor, index, 16-bit value) —
// absolute values, so applying a message twice changes nothing (idempotent overwrite). Dense
// runs carry a whole contiguous range without per-element indices when that is cheaper.
// Decoding checks every length and bound before anything is used.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dte/error.hpp"

namespace dte {

using Version = std::uint64_t;
inline constexpr Version no_version = ~Version{0};  // a receiver that holds nothing yet

enum class MessageKind : std::uint32_t {
  delta = 1,   // changes since `base`
  noop = 2,    // an explicit no-op version (skipped step, lr = 0): nothing changed
  full = 3,    // every element (the first publication, or a resync): any base is accepted
  repair = 4,  // a dense resync of some tensors within the version already held
};

struct DeltaEntry {
  std::uint32_t tensor;
  std::uint32_t index;
  std::uint16_t bits;
};

struct DenseRun {
  std::uint32_t tensor;
  std::uint32_t index;  // first element
  std::vector<std::uint16_t> bits;
};

struct Message {
  Version version = 0;
  Version base = no_version;
  MessageKind kind = MessageKind::delta;
  std::vector<DeltaEntry> entries;
  std::vector<DenseRun> runs;

  // Bytes on the wire, for reports (header + 10 per entry + 12 + 2 per run element).
  [[nodiscard]] std::size_t wire_bytes() const noexcept {
    std::size_t n = kHeaderBytes + entries.size() * 10;
    for (const DenseRun& r : runs)
      n += 12 + 2 * r.bits.size();
    return n;
  }
  static constexpr std::size_t kHeaderBytes = 40;
};

namespace detail {

inline void put(std::vector<std::byte>& out, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + n);
}

template <class T>
T take(std::span<const std::byte> in, std::size_t& at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof v);
  at += sizeof v;
  return v;
}

}  // namespace detail

// Little-endian layout: u64 magic-and-kind, u64 version, u64 base, u64 entry count, u64 run count,
// then entries (u32 tensor, u32 index, u16 bits), then runs (u32 tensor, u32 index, u32 length,
// u16 bits[length]).
inline std::vector<std::byte> encode(const Message& m) {
  std::vector<std::byte> out;
  out.reserve(m.wire_bytes());
  const std::uint64_t magic = 0x6574640000000000ull | static_cast<std::uint64_t>(m.kind);  // "dte"
  const std::uint64_t n_entries = m.entries.size(), n_runs = m.runs.size();
  detail::put(out, &magic, 8);
  detail::put(out, &m.version, 8);
  detail::put(out, &m.base, 8);
  detail::put(out, &n_entries, 8);
  detail::put(out, &n_runs, 8);
  for (const DeltaEntry& e : m.entries) {
    detail::put(out, &e.tensor, 4);
    detail::put(out, &e.index, 4);
    detail::put(out, &e.bits, 2);
  }
  for (const DenseRun& r : m.runs) {
    const std::uint32_t len = static_cast<std::uint32_t>(r.bits.size());
    detail::put(out, &r.tensor, 4);
    detail::put(out, &r.index, 4);
    detail::put(out, &len, 4);
    detail::put(out, r.bits.data(), 2 * r.bits.size());
  }
  return out;
}

// A received message, checked for framing (magic, kind, counts against the byte length) and
// read in place: entries and runs are visited straight from the received bytes, so applying a
// message needs no memory beyond the message itself. Index ranges are the receiver's to check
// (it knows its tensors). `from` names the sender in errors.
class MessageView {
 public:
  MessageView(std::span<const std::byte> in, const std::string& from) : in_(in) {
    auto fail = [&](const std::string& what) {
      throw format_error("message from " + from + ": " + what + "; the version is refused");
    };
    if (in.size() < Message::kHeaderBytes) {
      fail("only " + std::to_string(in.size()) + " bytes, shorter than the 40-byte header");
    }
    std::size_t at = 0;
    const auto magic = detail::take<std::uint64_t>(in, at);
    if ((magic >> 32) != 0x65746400u) fail("bad magic (not a dte message)");
    const auto kind = static_cast<std::uint32_t>(magic & 0xFFFFFFFFu);
    if (kind < 1 || kind > 4) fail("unknown kind " + std::to_string(kind));
    kind_ = static_cast<MessageKind>(kind);
    version_ = detail::take<std::uint64_t>(in, at);
    base_ = detail::take<std::uint64_t>(in, at);
    entries_ = detail::take<std::uint64_t>(in, at);
    runs_ = detail::take<std::uint64_t>(in, at);
    if (entries_ > (in.size() - at) / 10) {
      fail(std::to_string(entries_) + " entries announced, " + std::to_string(in.size()) +
           " bytes received");
    }
    at += 10 * static_cast<std::size_t>(entries_);
    runs_at_ = at;
    for (std::uint64_t r = 0; r < runs_; ++r) {
      if (in.size() - at < 12) fail("truncated run header");
      at += 8;
      const auto len = detail::take<std::uint32_t>(in, at);
      if (len > (in.size() - at) / 2) fail("run of " + std::to_string(len) + " elements truncated");
      at += 2 * static_cast<std::size_t>(len);
    }
    if (at != in.size()) fail(std::to_string(in.size() - at) + " trailing bytes");
  }

  [[nodiscard]] MessageKind kind() const noexcept { return kind_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] Version base() const noexcept { return base_; }
  [[nodiscard]] std::uint64_t entry_count() const noexcept { return entries_; }
  [[nodiscard]] std::uint64_t run_count() const noexcept { return runs_; }

  // f(DeltaEntry)
  template <class F>
  void for_each_entry(F&& f) const {
    std::size_t at = Message::kHeaderBytes;
    for (std::uint64_t i = 0; i < entries_; ++i) {
      DeltaEntry e;
      e.tensor = detail::take<std::uint32_t>(in_, at);
      e.index = detail::take<std::uint32_t>(in_, at);
      e.bits = detail::take<std::uint16_t>(in_, at);
      f(e);
    }
  }

  // f(tensor, first index, length, pointer to length little-endian u16 values)
  template <class F>
  void for_each_run(F&& f) const {
    std::size_t at = runs_at_;
    for (std::uint64_t r = 0; r < runs_; ++r) {
      const auto tensor = detail::take<std::uint32_t>(in_, at);
      const auto index = detail::take<std::uint32_t>(in_, at);
      const auto len = detail::take<std::uint32_t>(in_, at);
      f(tensor, index, len, in_.data() + at);
      at += 2 * static_cast<std::size_t>(len);
    }
  }

 private:
  std::span<const std::byte> in_;
  MessageKind kind_ = MessageKind::delta;
  Version version_ = 0, base_ = 0;
  std::uint64_t entries_ = 0, runs_ = 0;
  std::size_t runs_at_ = 0;
};

// Builds one message for one receiver in fixed-size chunks, so a sender holds its payload plus
// at most one partly filled chunk per receiver, never a doubling vector's slack. Entries come
// first, then dense runs; counts are patched into the header at finish().
class MessageWriter {
 public:
  static constexpr std::size_t chunk_bytes = std::size_t{1} << 16;

  // Starts a message; its kind, version and base are written by finish().
  void begin() {
    clear();
    const std::uint64_t zero[5] = {0, 0, 0, 0, 0};
    put(zero, sizeof zero);
  }

  void add(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    if (runs_ != 0) throw invalid_argument("MessageWriter: entries must precede dense runs");
    put(&tensor, 4);
    put(&index, 4);
    put(&bits, 2);
    ++entries_;
  }

  void add_run(std::uint32_t tensor, std::uint32_t index, std::span<const std::uint16_t> bits) {
    const auto len = static_cast<std::uint32_t>(bits.size());
    put(&tensor, 4);
    put(&index, 4);
    put(&len, 4);
    put(bits.data(), 2 * bits.size());
    ++runs_;
  }

  void finish(MessageKind kind, Version version, Version base) {
    const std::uint64_t magic = 0x6574640000000000ull | static_cast<std::uint64_t>(kind);
    std::byte* h = chunks_[0].get();
    std::memcpy(h, &magic, 8);
    std::memcpy(h + 8, &version, 8);
    std::memcpy(h + 16, &base, 8);
    std::memcpy(h + 24, &entries_, 8);
    std::memcpy(h + 32, &runs_, 8);
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return chunks_.size() * chunk_bytes; }
  [[nodiscard]] std::uint64_t entries() const noexcept { return entries_; }

  // The message as consecutive byte spans (one per chunk).
  [[nodiscard]] std::vector<std::span<const std::byte>> spans() const {
    std::vector<std::span<const std::byte>> out;
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      const std::size_t n = std::min(chunk_bytes, size_ - c * chunk_bytes);
      out.emplace_back(chunks_[c].get(), n);
    }
    return out;
  }

  void clear() {
    chunks_.clear();
    size_ = 0;
    entries_ = runs_ = 0;
  }

 private:
  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    while (n > 0) {
      if (size_ == chunks_.size() * chunk_bytes) {
        chunks_.push_back(std::make_unique_for_overwrite<std::byte[]>(chunk_bytes));
      }
      const std::size_t off = size_ % chunk_bytes;
      const std::size_t k = std::min(n, chunk_bytes - off);
      std::memcpy(chunks_.back().get() + off, b, k);
      size_ += k, b += k, n -= k;
    }
  }

  std::vector<std::unique_ptr<std::byte[]>> chunks_;
  std::size_t size_ = 0;
  std::uint64_t entries_ = 0, runs_ = 0;
};

}  // namespace dte
