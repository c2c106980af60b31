// SPDX-License-Identifier: Apache-2.0
// One Receiver over tensors the test owns, with the helpers the receiver tests and the
// receiver fuzz harness share: snapshots (tensors, version, digest) to show that a refusal
// changed nothing, and the digest recomputed from the tensors to show that a commit kept it
// consistent.
#pragma once

#include <cstdint>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/wire.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/sim/full_message.hpp"

namespace dte::test {

struct ReceiverFixture {
  layout::HfModel hf;
  layout::ServingLayout recv;
  std::int64_t senders;
  std::vector<std::vector<std::uint16_t>> storage;  // the inference engine's own tensors
  Receiver rx;

  // tiny-qwen3 (or `model`), receivers tp=2 (rank 1 of tiny-qwen3 holds 20 padded vocabulary
  // rows), `senders` senders.
  ReceiverFixture(std::int64_t rank, std::int64_t senders_,
                  const layout::ModelSpec& model = layout::model_preset("tiny-qwen3"))
      : hf(model),
        recv(hf, layout::parse_infer_topology("tp=2")),
        senders(senders_),
        storage(make_storage(recv)),
        rx(hf, recv, rank, senders_, views(storage)) {}
  ReceiverFixture(const ReceiverFixture&) = delete;  // rx points into the members
  ReceiverFixture& operator=(const ReceiverFixture&) = delete;

  // A model smaller than tiny-qwen3 with the same traps (two query heads per KV head, a padded
  // vocabulary tail on receiver rank 1: rows 100..127): 2.7K elements per receiver rank, so the
  // fuzz harness runs ~6x faster.
  static layout::ModelSpec micro_model() {
    layout::ModelSpec m;
    m.name = "micro-qwen3";
    m.architecture = "Qwen3ForCausalLM";
    m.hidden = 16, m.layers = 1, m.heads = 4, m.kv_heads = 2, m.head_dim = 8;
    m.intermediate = 16, m.vocab = 100;
    m.validate();
    return m;
  }

  static std::vector<std::vector<std::uint16_t>> make_storage(const layout::ServingLayout& l) {
    std::vector<std::vector<std::uint16_t>> s;
    for (std::int64_t k = 0; k < l.size(); ++k)
      s.emplace_back(static_cast<std::size_t>(l[k].numel), std::uint16_t{0x7FC1});  // poison
    return s;
  }
  static ReceiverTensors views(std::vector<std::vector<std::uint16_t>>& s) {
    ReceiverTensors v;
    for (auto& t : s)
      v.emplace_back(t);
    return v;
  }

  // A full message from one sender writing every live element of the given tensors (none: a
  // bare header).
  [[nodiscard]] wire::Message full(Version v, std::uint16_t bits,
                                   const std::vector<std::int64_t>& tensors) const {
    return sim::full_message(recv, rx.rank() % recv.topology().tp, v, bits, tensors);
  }

  // Version 0 from every sender, each writing its share of the tensors (sender s: tensors
  // k with k % senders == s), so together they write every live element.
  [[nodiscard]] Inbox full_publication(Version v, std::uint16_t bits) const {
    Inbox in;
    for (std::int64_t s = 0; s < senders; ++s) {
      std::vector<std::int64_t> mine;
      for (std::int64_t k = s; k < recv.size(); k += senders)
        mine.push_back(k);
      in.emplace_back(s, wire::encode(full(v, bits, mine)));
    }
    return in;
  }

  // A delta of version v on `base` from every sender: sender 0 carries `entries`, the others a
  // bare header.
  [[nodiscard]] Inbox delta_publication(Version v, Version base,
                                        const std::vector<DeltaEntry>& entries) const {
    Inbox in;
    for (std::int64_t s = 0; s < senders; ++s) {
      wire::Message m;
      m.kind = MessageKind::delta;
      m.version = v;
      m.base = base;
      if (s == 0) m.entries = entries;
      in.emplace_back(s, wire::encode(m));
    }
    return in;
  }

  // An explicit no-op version v on `base`: a bare header from every sender.
  [[nodiscard]] Inbox noop_publication(Version v, Version base) const {
    Inbox in;
    for (std::int64_t s = 0; s < senders; ++s) {
      wire::Message m;
      m.kind = MessageKind::noop;
      m.version = v;
      m.base = base;
      in.emplace_back(s, wire::encode(m));
    }
    return in;
  }

  struct Snapshot {
    std::vector<std::vector<std::uint16_t>> tensors;
    Version version;
    std::vector<Digest> digest;
    bool operator==(const Snapshot&) const = default;
  };
  [[nodiscard]] Snapshot snapshot() const { return {storage, rx.version(), rx.digest()}; }

  // The digest of what the tensors hold, per canonical tensor (live elements only).
  [[nodiscard]] std::vector<Digest> digest_of_tensors() const {
    std::vector<Digest> d(static_cast<std::size_t>(hf.size()), 0);
    const std::int64_t ts = rx.rank() % recv.topology().tp;
    for (std::int64_t k = 0; k < recv.size(); ++k) {
      for (std::int64_t i = 0; i < recv.live_end(ts, k); ++i) {
        const layout::Canonical c = recv.source({ts, k, i});
        d[static_cast<std::size_t>(c.tensor)] +=
            element_digest(hf[c.tensor].base + c.index,
                           storage[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)]);
      }
    }
    return d;
  }
};

}  // namespace dte::test
