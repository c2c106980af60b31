// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness: publication messages (publication/message.hpp) into an HfReceiver
// (publication/receiver.hpp), the bytes a Python receiver gets from anywhere. A deterministic
// AdamW trainer on tiny-qwen3 makes v1 (full) and v2 (a delta on v1) once. Per input, a fresh
// receiver applies v1, then a message made from the input:
//   byte 0 bit 1 set: the rest of the input is the message itself;
//   else the base message (bit 0: v1, else v2) with the rest applied as patches: triples of u16
//   position (mod the message's size) and u8 XOR.
// Either the apply is refused with format_error, bounds_error or protocol_error and tensors,
// version and digest are untouched; or it commits, and then the tensors hold exactly v2's
// state (the only delta on v1 there is) or v1 again (a re-delivery), and their digest is the one
// the receiver keeps (verify()).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "harness.hpp"

namespace {

using dte::publication::Bytes;

struct Fixture {
  dte::layout::ModelSpec spec = dte::layout::model_preset("tiny-qwen3");
  dte::layout::HfModel hf{spec};
  Bytes v1, v2;
  std::vector<std::vector<std::uint16_t>> at_v1, at_v2;

  Fixture() {
    const auto n = static_cast<std::size_t>(hf.total());
    std::vector<float> theta(n), m(n, 0.0f), v(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i)
      theta[i] = 0.05f * std::sin(0.37f * static_cast<float>(i));
    dte::publication::Publisher<dte::AdamWInverse, dte::BF16Detect> pub(spec);
    dte::publication::FlatTrainer<dte::AdamWInverse> f;
    f.theta = theta;
    const auto access = dte::publication::FlatAccess<dte::AdamWInverse>{&f};
    v1 = pub.publish(access, true);
    at_v1 = bf16(theta);
    // One AdamW step (lr 1e-3, no decay) with a made-up gradient.
    for (std::size_t i = 0; i < n; ++i) {
      const float g = 0.01f * std::cos(1.3f * static_cast<float>(i));
      m[i] = 0.1f * g;
      v[i] = 0.001f * g * g;
      const float denom = std::sqrt(v[i]) / std::sqrt(0.001f) + 1e-8f;
      theta[i] -= (1e-3f / 0.1f) * (m[i] / denom);
    }
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      const auto b = static_cast<std::size_t>(hf[t].base);
      const auto k = static_cast<std::size_t>(hf[t].numel());
      f.hyper.push_back({.lr = 1e-3, .step = 1, .decay_form = dte::DecayForm::multiply});
      f.state.push_back(
          {std::span<const float>(m).subspan(b, k), std::span<const float>(v).subspan(b, k)});
    }
    v2 = pub.publish(access, false);
    at_v2 = bf16(theta);
  }

  [[nodiscard]] std::vector<std::vector<std::uint16_t>> bf16(const std::vector<float>& x) const {
    std::vector<std::vector<std::uint16_t>> out;
    for (std::int64_t t = 0; t < hf.size(); ++t) {
      out.emplace_back();
      for (std::int64_t i = 0; i < hf[t].numel(); ++i)
        out.back().push_back(dte::BF16Detect::store(x[static_cast<std::size_t>(hf[t].base + i)]));
    }
    return out;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const Fixture fx;
  Bytes msg;
  if ((data[0] & 2u) != 0) {
    msg = dte::fuzz::bytes(data + 1, size - 1);
  } else {
    msg = (data[0] & 1u) != 0 ? fx.v1 : fx.v2;
    for (std::size_t k = 1; k + 3 <= size; k += 3) {
      const std::size_t at = (data[k] | (static_cast<std::size_t>(data[k + 1]) << 8)) % msg.size();
      msg[at] ^= static_cast<std::byte>(data[k + 2]);
    }
  }
  std::vector<std::vector<std::uint16_t>> tensors(fx.at_v1.size());
  std::vector<std::span<std::uint16_t>> views;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    tensors[t].assign(fx.at_v1[t].size(), 0);
    views.emplace_back(tensors[t]);
  }
  dte::publication::HfReceiver rx(fx.spec, views);
  DTE_FUZZ_REQUIRE(rx.apply(fx.v1).committed());
  DTE_FUZZ_REQUIRE(tensors == fx.at_v1);
  const auto digest = rx.digest();
  try {
    const auto r = rx.apply(msg);
    if (r.outcome == dte::ApplyOutcome::current) {
      DTE_FUZZ_REQUIRE(rx.version() == 1 && tensors == fx.at_v1 && rx.digest() == digest);
    } else {
      DTE_FUZZ_REQUIRE(rx.version() == 2 && tensors == fx.at_v2);
    }
    DTE_FUZZ_REQUIRE(rx.verify().empty());
  } catch (const dte::format_error&) {
    DTE_FUZZ_REQUIRE(rx.version() == 1 && tensors == fx.at_v1 && rx.digest() == digest);
  } catch (const dte::bounds_error&) {
    DTE_FUZZ_REQUIRE(rx.version() == 1 && tensors == fx.at_v1 && rx.digest() == digest);
  } catch (const dte::protocol_error&) {
    DTE_FUZZ_REQUIRE(rx.version() == 1 && tensors == fx.at_v1 && rx.digest() == digest);
  }
  return 0;
}
