// SPDX-License-Identifier: Apache-2.0
// A sender rank's messages of one publication, one per receiver (wire format v2): begun empty,
// appended to through operator[] by the encode step, finished into payloads for the transport,
// released once the exchange has copied them. Host and CUDA senders share it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dte/core/message.hpp"
#include "dte/core/payload.hpp"
#include "dte/engine/wire.hpp"

namespace dte::wire {

class Outbox {
 public:
  Outbox() = default;
  explicit Outbox(std::size_t receivers) : writers_(receivers) {}

  [[nodiscard]] std::size_t size() const noexcept { return writers_.size(); }
  MessageWriter& operator[](std::size_t receiver) { return writers_[receiver]; }

  // Empty messages (header only; also what a no-op version sends). whole: the messages write
  // whole runs (a full publication, a repair), every stretch dense (MessageWriter::begin).
  void begin(bool whole = false) {
    for (MessageWriter& w : writers_)
      w.begin(whole ? 1 : dense_min_run);
  }
  // Ends every receiver's stream (MessageWriter::flush).
  void flush() {
    for (MessageWriter& w : writers_)
      w.flush();
  }
  // Elements written as indexed entries, over every message (final after flush()).
  [[nodiscard]] std::uint64_t entries() const noexcept {
    std::uint64_t n = 0;
    for (const MessageWriter& w : writers_)
      n += w.entries();
    return n;
  }

  // Closes every message and returns them, one per receiver (each at least a header, so every
  // receiver checks the version chain against every sender).
  std::vector<Payload> finish(MessageKind kind, Version version, Version base) {
    std::vector<Payload> out;
    for (MessageWriter& w : writers_) {
      w.finish(kind, version, base);
      out.push_back(w.spans());
    }
    return out;
  }
  void release() {
    for (MessageWriter& w : writers_)
      w.clear();
  }

  [[nodiscard]] std::uint64_t payload_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const MessageWriter& w : writers_)
      n += w.size();
    return n;
  }
  [[nodiscard]] std::uint64_t capacity_bytes() const noexcept {
    std::uint64_t n = 0;
    for (const MessageWriter& w : writers_)
      n += w.capacity();
    return n;
  }
  // What the messages hold however little changed: a partly filled chunk per receiver.
  [[nodiscard]] std::uint64_t fixed_bytes() const noexcept {
    return MessageWriter::chunk_bytes * writers_.size();
  }

 private:
  std::vector<MessageWriter> writers_;
};

}  // namespace dte::wire
