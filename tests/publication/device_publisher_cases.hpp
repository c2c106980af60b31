// SPDX-License-Identifier: Apache-2.0
// publication::Publisher on a device executor (publication/device_sender.hpp: DeviceChunkSender
// over pipeline/device_stages.hpp) against the host publisher, byte for byte, written once for
// every backend: exec::Cuda on a GPU (tests/cuda/test_cuda_publication.cu) and the host twin in
// CI (tests/device_on_host/test_device_path_on_host.cpp). The same trainer state, on the host and
// copied to the executor's memory, must give the same messages (one writer) and the same parts
// (several writers, each piece read where it lives), in every mode (full, K = 1 with diff codes
// and with values, K = 3 through the dirty mask); a refused element throws on both and the next
// publication is full on both; the batches of changed elements are the same whatever their size;
// and receivers fed the device's messages hold the BF16 rounding of the trainer's weights.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "dte/detect/detect.hpp"
#include "dte/layout/identity.hpp"
#include "dte/layout/model.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/device_stages.hpp"
#include "dte/publication/device_sender.hpp"
#include "dte/publication/message.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "flat_adamw.hpp"
#include "hf_tensors.hpp"
#include "local_pieces.hpp"

namespace dte_test::device_publisher {

using namespace dte;
using publication::Bytes;
using testing::FlatAdamW;
using testing::PieceAccess;
using testing::Split;

using HostPub = publication::Publisher<AdamWInverse, BF16Detect>;
using HostPart = publication::Publisher<AdamWInverse, BF16Detect, layout::LocalShardPlan>;

// The trainer's buffers in the device executor's memory, copied after every step. Backend: the
// executor type E, a default executor and to_device(e, device, host, bytes), a copy that has
// landed when it returns.
template <class Backend>
struct DeviceCopy {
  using E = typename Backend::E;
  template <class T>
  using Array = pipeline::device::Array<E, T>;
  E e = Backend::executor();
  Array<float> theta, m, v;
  explicit DeviceCopy(const FlatAdamW& tr)
      : theta(e, tr.theta.size()), m(e, tr.m.size()), v(e, tr.v.size()) {
    upload(tr);
  }
  void upload(const FlatAdamW& tr) {
    Backend::to_device(e, theta.data(), tr.theta.data(), theta.bytes());
    Backend::to_device(e, m.data(), tr.m.data(), m.bytes());
    Backend::to_device(e, v.data(), tr.v.data(), v.bytes());
  }
  // FlatAdamW::flat() with its spans pointing here.
  [[nodiscard]] publication::FlatTrainer<AdamWInverse> flat(const FlatAdamW& tr) const {
    publication::FlatTrainer<AdamWInverse> f = tr.flat();
    f.theta = {theta.data(), theta.size()};
    for (std::int64_t t = 0; t < tr.hf.size(); ++t) {
      const auto& x = tr.hf[t];
      const auto at = [&](const Array<float>& a) {
        return std::span<const float>(a.data() + x.base, static_cast<std::size_t>(x.numel()));
      };
      f.state[static_cast<std::size_t>(t)] = {at(m), at(v)};
    }
    return f;
  }
  [[nodiscard]] PieceAccess pieces(const FlatAdamW& tr) const {
    return PieceAccess(tr, theta.data(), m.data(), v.data());
  }
};

// Elements of the receiver's tensors that are not the BF16 rounding of the trainer's weight.
std::int64_t mismatches(const testing::HfTensors& got, const FlatAdamW& tr) {
  std::int64_t bad = 0;
  for (std::int64_t t = 0; t < tr.hf.size(); ++t) {
    for (std::int64_t i = 0; i < tr.hf[t].numel(); ++i) {
      bad += got.data[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)] !=
             BF16Detect::store(tr.theta[static_cast<std::size_t>(tr.hf[t].base + i)]);
    }
  }
  return bad;
}

template <class Backend>
void one_writer(std::int64_t K, storage::Encoding enc) {
  using DevicePub =
      publication::Publisher<AdamWInverse, BF16Detect, layout::IdentityPlan, typename Backend::E>;
  CAPTURE(K);
  CAPTURE(static_cast<int>(enc));
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  FlatAdamW tr(spec);
  DeviceCopy<Backend> d(tr);
  const publication::PublisherConfig cfg{.publish_every = K, .encoding = enc};
  HostPub host(spec, cfg);
  DevicePub device(spec, cfg);
  testing::HfTensors got(host.model());
  publication::HfReceiver rx(spec, got.views);
  const auto same = [&](const std::optional<Bytes>& a, const std::optional<Bytes>& b) {
    REQUIRE(a.has_value() == b.has_value());
    if (!a) return;
    CHECK(*a == *b);
    CHECK(host.digest() == device.digest());
    CHECK(host.last().changed == device.last().changed);
    CHECK(host.last().guard == device.last().guard);
    REQUIRE(rx.apply(*b).committed());
    CHECK(mismatches(got, tr) == 0);
    CHECK(rx.verify().empty());
  };
  // One optimizer step, then each publisher's step() (full: publish(.., true)) on its copy.
  const auto both = [&](bool full) {
    if (!full) {
      tr.step();
      d.upload(tr);
    }
    const auto hf = tr.flat();
    const auto df = d.flat(tr);
    const publication::FlatAccess<AdamWInverse> ha{&hf}, da{&df};
    return full ? std::pair{std::optional<Bytes>(host.publish(ha, true)),
                            std::optional<Bytes>(device.publish(da, true))}
                : std::pair{host.step(ha), device.step(da)};
  };
  {
    const auto [a, b] = both(true);
    same(a, b);
  }
  int published = 0, expected = 0;
  std::int64_t window = 0;  // steps since the last publication (the schedule's count)
  for (int s = 0; s < 12; ++s) {
    tr.lr = s % 3 == 0 ? 2e-4 : 2e-6;
    const auto [a, b] = both(false);
    published += a.has_value();
    if (++window == K) {
      ++expected;
      window = 0;
    }
    same(a, b);
    if (s == 6) {  // a full publication asked for between steps (it starts a new window)
      const auto [fa, fb] = both(true);
      same(fa, fb);
      window = 0;
    }
  }
  CHECK(published == expected);  // (K = 1: 12; K = 3: 3, the window cut by the full one)
  CHECK(host.last().changed > 0);

  // A refused element (a negative second moment): both throw, publish nothing, and the next
  // publication is full on both.
  tr.step();
  const auto k = static_cast<std::size_t>(tr.hf[1].base + 3);
  const float saved = tr.v[k];
  tr.v[k] = -1.0f;
  d.upload(tr);
  for (std::int64_t s = 0; s < K; ++s) {
    const auto hf = tr.flat();
    const auto df = d.flat(tr);
    bool host_threw = false, device_threw = false;
    try {
      (void)host.step(publication::FlatAccess<AdamWInverse>{&hf});
    } catch (const dte::error&) {
      host_threw = true;
    }
    try {
      (void)device.step(publication::FlatAccess<AdamWInverse>{&df});
    } catch (const dte::invalid_argument&) {
      device_threw = true;
    }
    CHECK(host_threw == device_threw);
    if (host_threw) break;
  }
  CHECK(host.version() == device.version());
  tr.v[k] = saved;
  bool full = false;
  for (std::int64_t s = 0; s < K && !full; ++s) {
    const auto [a, b] = both(false);
    same(a, b);
    if (a) {
      CHECK(host.last().full());
      CHECK(device.last().full());
      full = true;
    }
  }
  CHECK(full);
}

// W writers over `split`: every rank's part from the device equals the host's, byte for byte.
template <class Backend>
void writers(Split split, std::int64_t W, std::int64_t K, storage::Encoding enc) {
  using DevicePart =
      publication::Publisher<AdamWInverse, BF16Detect, layout::LocalShardPlan, typename Backend::E>;
  CAPTURE(static_cast<int>(split));
  CAPTURE(W);
  CAPTURE(K);
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  FlatAdamW tr(spec);
  DeviceCopy<Backend> d(tr);
  const publication::PublisherConfig cfg{.publish_every = K, .encoding = enc};
  std::vector<std::unique_ptr<HostPart>> host;
  std::vector<std::unique_ptr<DevicePart>> device;
  std::vector<std::vector<layout::LocalPiece>> all;
  for (std::int64_t w = 0; w < W; ++w)
    all.push_back(testing::pieces_of(tr.hf, split, w, W));
  layout::check_writers(tr.hf, all);
  for (std::int64_t w = 0; w < W; ++w) {
    const publication::Writer writer{static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(W)};
    host.push_back(std::make_unique<HostPart>(spec, all[static_cast<std::size_t>(w)], writer, cfg));
    device.push_back(
        std::make_unique<DevicePart>(spec, all[static_cast<std::size_t>(w)], writer, cfg));
  }
  testing::HfTensors got(tr.hf);
  publication::HfReceiver rx(spec, got.views);
  int published = 0;
  for (int s = 0; s < 9; ++s) {
    if (s > 0) {
      tr.lr = s % 3 == 0 ? 2e-4 : 2e-6;
      tr.step();
      d.upload(tr);
    }
    std::vector<Bytes> parts;
    for (std::int64_t w = 0; w < W; ++w) {
      const auto x = static_cast<std::size_t>(w);
      const std::optional<Bytes> a =
          s == 0 ? std::optional<Bytes>(host[x]->publish(PieceAccess(tr), true))
                 : host[x]->step(PieceAccess(tr));
      const std::optional<Bytes> b =
          s == 0 ? std::optional<Bytes>(device[x]->publish(d.pieces(tr), true))
                 : device[x]->step(d.pieces(tr));
      REQUIRE(a.has_value() == b.has_value());
      if (!a) continue;
      CHECK(*a == *b);
      parts.push_back(*b);
    }
    if (parts.empty()) continue;
    std::vector<std::span<const std::byte>> views(parts.begin(), parts.end());
    REQUIRE(rx.apply(publication::merge(spec, views)).committed());
    for (std::int64_t w = 0; w < W; ++w) {
      host[static_cast<std::size_t>(w)]->commit();
      device[static_cast<std::size_t>(w)]->commit();
    }
    CHECK(mismatches(got, tr) == 0);
    ++published;
  }
  CHECK(published == 1 + 8 / K);
}

// The batches of changed elements (SenderPipeline::gather) do not depend on their size.
template <class Backend>
void batches() {
  namespace dev = pipeline::device;
  const layout::ModelSpec spec = layout::model_preset("tiny-qwen3");
  FlatAdamW tr(spec);
  tr.step();
  DeviceCopy<Backend> d(tr);
  const std::vector<layout::LocalPiece> pieces = testing::pieces_of(tr.hf, Split::flat, 1, 2);
  dev::SenderPipeline<AdamWInverse, BF16Detect, layout::LocalShardPlan, typename Backend::E> p(
      tr.hf, layout::LocalShardPlan(tr.hf, pieces, 1), 1, false, d.e);
  using Element = std::tuple<std::int64_t, std::uint16_t, std::uint16_t, bool, bool, std::uint16_t,
                             std::uint16_t>;
  const auto collect = [&](std::int64_t batch) {
    const auto found = p.detect(d.pieces(tr), pipeline::ScanMode::detect);
    std::vector<Element> out;
    p.gather(layout::BufferKind::dense, found[0].flagged, true, batch,
             [&](std::int64_t begin, std::span<const std::uint32_t> offset,
                 std::span<const std::uint16_t> bits, std::span<const PreviousBits> previous) {
               REQUIRE(previous.size() == offset.size());
               for (std::size_t k = 0; k < offset.size(); ++k) {
                 CHECK(offset[k] < batch);
                 const PreviousBits& q = previous[k];
                 out.emplace_back(begin + offset[k], bits[k], q.bits, q.certain, q.bounded, q.lo,
                                  q.hi);
               }
             });
    CHECK(out.size() == found[0].flagged);
    return out;
  };
  const std::vector<Element> whole = collect(std::int64_t{1} << 22);
  REQUIRE(whole.size() > 100);
  for (std::size_t k = 1; k < whole.size(); ++k)
    CHECK(std::get<0>(whole[k - 1]) < std::get<0>(whole[k]));
  CHECK(collect(97) == whole);
  CHECK(collect(64) == whole);
  CHECK(collect(1) == whole);
}

// Both publishers' cases (one writer, several writers, batches), once for every backend
template <class Backend>
void one_writer_cases() {
  one_writer<Backend>(1, storage::Encoding::diff);
  one_writer<Backend>(1, storage::Encoding::value);
  one_writer<Backend>(3, storage::Encoding::diff);
}
template <class Backend>
void writer_cases() {
  for (Split split : {Split::rows, Split::flat, Split::columns, Split::owner}) {
    writers<Backend>(split, 3, 1, storage::Encoding::diff);
    writers<Backend>(split, 2, 2, storage::Encoding::value);
  }
  writers<Backend>(Split::rows, 7, 1, storage::Encoding::diff);  // empty pieces on some ranks
}
}  // namespace dte_test::device_publisher
