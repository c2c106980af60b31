// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: a receiver's message decoding and apply, over a sequence of publications.
// The receiver (ReceiverFixture::micro_model(), receiver tp=2, 2 senders) starts at version 0 after
// a full publication that wrote every live element, so its digest is a function of its tensors.
// Input (docs/hardening.md): byte 0 picks the receiver rank; then rounds of
//   u8 version step (the version applied is held + step % 5 - 2, at least 0), u8 message count
//   (% 5), and per message u8 sender (% 4: senders 2 and 3 do not exist), u16 length, bytes.
// After every round: refused or current => tensors, version and digest untouched; committed =>
// the version is the one applied and the digest equals the digest of the tensors.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "harness.hpp"
#include "receiver_fixture.hpp"

namespace {

class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : p_(data), left_(size) {}
  [[nodiscard]] bool empty() const noexcept { return left_ == 0; }
  std::uint8_t u8() {
    if (left_ == 0) return 0;
    --left_;
    return *p_++;
  }
  std::uint16_t u16() { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  dte::Bytes take(std::size_t n) {
    n = n < left_ ? n : left_;
    dte::Bytes b(n);
    if (n) std::memcpy(b.data(), p_, n);
    p_ += n;
    left_ -= n;
    return b;
  }

 private:
  const std::uint8_t* p_;
  std::size_t left_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader in(data, size);
  static const dte::layout::ModelSpec model = dte::test::ReceiverFixture::micro_model();
  dte::test::ReceiverFixture f(in.u8() & 1, 2, model);
  DTE_FUZZ_REQUIRE(f.rx.apply(0, f.full_publication(0, 0x3F80)).committed());
  for (int round = 0; round < 8 && !in.empty(); ++round) {
    const std::int64_t step = in.u8() % 5;
    const auto held = static_cast<std::int64_t>(f.rx.version());
    const auto version = static_cast<dte::Version>(held + step - 2 < 0 ? 0 : held + step - 2);
    const int count = in.u8() % 5;
    dte::Inbox inbox;
    for (int k = 0; k < count; ++k) {
      const std::int64_t src = in.u8() % 4;
      const std::uint16_t len = in.u16();
      inbox.emplace_back(src, in.take(len));
    }
    const auto before = f.snapshot();
    const dte::ApplyResult r = f.rx.apply(version, inbox);
    if (r.outcome == dte::ApplyOutcome::committed) {
      DTE_FUZZ_REQUIRE(f.rx.version() == version);
      DTE_FUZZ_REQUIRE(f.rx.digest() == f.digest_of_tensors());
      DTE_FUZZ_REQUIRE(r.refusal.empty());
    } else {
      DTE_FUZZ_REQUIRE(f.snapshot() == before);
      DTE_FUZZ_REQUIRE(r.written == 0);
      DTE_FUZZ_REQUIRE((r.outcome == dte::ApplyOutcome::refused) == !r.refusal.empty());
    }
  }
  return 0;
}
