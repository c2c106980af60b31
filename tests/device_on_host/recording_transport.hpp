// SPDX-License-Identifier: Apache-2.0
// Recording<T>: a transport that keeps the bytes each trainer rank sends, for the tests that
// compare two engines' messages byte for byte (tests/cuda/test_cuda_pipeline.cu on a GPU,
// tests/device_on_host/test_device_path_on_host.cpp on the host twin); describe() and
// first_difference() say how two messages differ.
#pragma once

#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/core/payload.hpp"
#include "dte/engine/wire.hpp"

namespace dte_test {

// A transport that forwards every member to T and records, per exchange, the bytes this rank
// sends to each receiver (each payload's spans joined): the engines' messages themselves, as
// they leave the sender, before any transport (or fault) touches them. Receivers record nothing.
template <class T>
class Recording {
 public:
  using transport_tag = void;
  using inbox_type = typename T::inbox_type;
  // [exchange][receiver]: what this rank sent.
  using Log = std::vector<std::vector<dte::Bytes>>;

  Recording(T& inner, Log& log) : inner_(&inner), log_(&log) {}

  [[nodiscard]] int senders() const { return inner_->senders(); }
  [[nodiscard]] int receivers() const { return inner_->receivers(); }
  [[nodiscard]] int rank() const { return inner_->rank(); }
  [[nodiscard]] bool is_sender() const { return inner_->is_sender(); }
  [[nodiscard]] bool is_receiver() const { return inner_->is_receiver(); }

  inbox_type exchange(const std::vector<dte::Payload>& out) {
    if (is_sender()) {
      std::vector<dte::Bytes> sent;
      sent.reserve(out.size());
      for (const dte::Payload& p : out) {
        dte::Bytes& b = sent.emplace_back();
        b.reserve(dte::payload_size(p));
        for (const std::span<const std::byte> part : p)
          b.insert(b.end(), part.begin(), part.end());
      }
      log_->push_back(std::move(sent));
    }
    return inner_->exchange(out);
  }
  void sum(std::span<std::uint64_t> v, const char* phase) { inner_->sum(v, phase); }
  void checkpoint(const char* phase) { inner_->checkpoint(phase); }
  // Only where T has it (the engine looks for it; LoopbackTwoRound does not).
  template <class F>
  requires requires(T& t, F f) { t.between_rounds(std::move(f)); }
  void between_rounds(F f) { inner_->between_rounds(std::move(f)); }

 private:
  T* inner_;
  Log* log_;
};

// For a failed byte comparison: the message's size and header, what it holds, and where two
// messages first differ.
inline std::string describe(const dte::Bytes& m) {
  std::string s = std::to_string(m.size()) + " bytes";
  try {
    const dte::wire::MessageView v(m, "describe");
    s += ", kind " + std::to_string(static_cast<int>(v.kind())) + ", version " +
         std::to_string(v.version()) + ", base " + std::to_string(v.base()) + ", " +
         std::to_string(v.group_count()) + " groups, " + std::to_string(v.entry_count()) +
         " indexed entries, " + std::to_string(v.run_count()) + " dense runs of " +
         std::to_string(v.run_elements()) + " values";
  } catch (const std::exception& e) {
    s += std::string(" (not a valid message: ") + e.what() + ")";
  }
  return s;
}

inline std::string first_difference(const dte::Bytes& a, const dte::Bytes& b) {
  std::size_t at = 0;
  while (at < a.size() && at < b.size() && a[at] == b[at])
    ++at;
  return at == a.size() && at == b.size() ? "none" : "byte " + std::to_string(at);
}

}  // namespace dte_test
