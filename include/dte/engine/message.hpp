// SPDX-License-Identifier: Apache-2.0
// The payload one sender puts on the wire for one receiver in one publication: a header (version,
// base version, kind) and the changed elements as (receiver tensor, index, 16-bit value) —
// absolute values, so applying a message twice changes nothing (idempotent overwrite). Dense
// runs carry a whole contiguous range without per-element indices when that is cheaper.
// Decoding checks every length and bound before anything is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
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

// Decodes and checks the framing: magic, kind, counts against the byte length. Index ranges
// are the receiver's to check (it knows its tensors). `from` names the sender in errors.
inline Message decode(std::span<const std::byte> in, const std::string& from) {
  auto fail = [&](const std::string& what) {
    throw format_error("message from " + from + ": " + what + "; the version is refused");
  };
  if (in.size() < Message::kHeaderBytes) {
    fail("only " + std::to_string(in.size()) + " bytes, shorter than the 40-byte header");
  }
  std::size_t at = 0;
  const auto magic = detail::take<std::uint64_t>(in, at);
  if ((magic >> 32) != 0x65746400u) fail("bad magic (not a dte message)");
  Message m;
  const auto kind = static_cast<std::uint32_t>(magic & 0xFFFFFFFFu);
  if (kind < 1 || kind > 4) fail("unknown kind " + std::to_string(kind));
  m.kind = static_cast<MessageKind>(kind);
  m.version = detail::take<std::uint64_t>(in, at);
  m.base = detail::take<std::uint64_t>(in, at);
  const auto n_entries = detail::take<std::uint64_t>(in, at);
  const auto n_runs = detail::take<std::uint64_t>(in, at);
  if (n_entries > (in.size() - at) / 10) {
    fail(std::to_string(n_entries) + " entries announced, " + std::to_string(in.size()) +
         " bytes received");
  }
  m.entries.resize(static_cast<std::size_t>(n_entries));
  for (DeltaEntry& e : m.entries) {
    e.tensor = detail::take<std::uint32_t>(in, at);
    e.index = detail::take<std::uint32_t>(in, at);
    e.bits = detail::take<std::uint16_t>(in, at);
  }
  if (n_runs > (in.size() - at) / 12) fail("more runs announced than bytes received");
  m.runs.resize(static_cast<std::size_t>(n_runs));
  for (DenseRun& r : m.runs) {
    if (in.size() - at < 12) fail("truncated run header");
    r.tensor = detail::take<std::uint32_t>(in, at);
    r.index = detail::take<std::uint32_t>(in, at);
    const auto len = detail::take<std::uint32_t>(in, at);
    if (len > (in.size() - at) / 2) fail("run of " + std::to_string(len) + " elements truncated");
    r.bits.resize(len);
    std::memcpy(r.bits.data(), in.data() + at, 2 * static_cast<std::size_t>(len));
    at += 2 * static_cast<std::size_t>(len);
  }
  if (at != in.size()) fail(std::to_string(in.size() - at) + " trailing bytes");
  return m;
}

}  // namespace dte
