// SPDX-License-Identifier: Apache-2.0
// A receiver rank (one SGLang TP rank of one replica) keeps tensors it does not own current: it
// is given views of the inference engine's own 16-bit tensors (in SglangLayout order), the
// version they hold, and its part of the verified-sync digest, kept per canonical tensor and
// updated from the values it overwrites (O(changed)). dte allocates nothing model-sized for it.
//
// apply() is transactional: every message of the publication is decoded and checked first
// (framing, version chain, tensor ids, index ranges); only then are values scattered in place
// and the version committed. A refused publication leaves tensors, version and digest untouched.
//
// Until the first full publication the tensors' contents are unknown to dte (whatever the caller
// loaded): a full publication writes every live element, and the digest is rebuilt from the
// values written rather than updated, so dte never reads the caller's memory to start.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/engine/digest.hpp"
#include "dte/engine/wire.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/transport/payload.hpp"

namespace dte {

struct ApplyResult {
  bool committed = false;
  std::string refusal;        // why the publication was refused (empty when committed)
  std::uint64_t written = 0;  // element writes
  std::uint64_t stale = 0;    // messages of older versions ignored (replays)
  std::uint64_t bytes = 0;    // received
};

// One receiver rank's tensors: views[k] is receiver tensor k of the layout (layout[k].numel
// elements), owned by the caller.
using ReceiverTensors = std::vector<std::span<std::uint16_t>>;

class Receiver {
 public:
  Receiver(const layout::HfModel& hf, const layout::SglangLayout& layout, std::int64_t rank,
           ReceiverTensors tensors)
      : hf_(&hf),
        layout_(&layout),
        rank_(rank),
        ts_(rank % layout.topology().tp),
        tensors_(std::move(tensors)) {
    if (static_cast<std::int64_t>(tensors_.size()) != layout.size()) {
      throw invalid_argument("Receiver " + std::to_string(rank) + ": given " +
                             std::to_string(tensors_.size()) + " tensors, the layout has " +
                             std::to_string(layout.size()) +
                             "; pass one view per receiver tensor, in SglangLayout order");
    }
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      const auto n = static_cast<std::size_t>(layout[k].numel);
      if (tensors_[static_cast<std::size_t>(k)].size() != n) {
        throw invalid_argument("Receiver " + std::to_string(rank) + ": tensor " + layout.name(k) +
                               " has " +
                               std::to_string(tensors_[static_cast<std::size_t>(k)].size()) +
                               " elements, the layout says " + std::to_string(n) +
                               " (receiver TP rank " + std::to_string(ts_) + ")");
      }
    }
    digest_.assign(static_cast<std::size_t>(hf.size()), 0);
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] std::span<const std::uint16_t> tensor(std::int64_t id) const {
    return tensors_[static_cast<std::size_t>(id)];
  }
  // Per canonical tensor: the sum of h(canonical, bits) over this rank's copies of it.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return digest_; }
  // Memory this receiver holds beyond the caller's tensors.
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return sizeof(*this) + digest_.capacity() * 8 + tensors_.capacity() * sizeof(tensors_[0]);
  }

  // Applies one publication: all messages addressed to this rank (any sender order), read in
  // place: no memory beyond what was received and one view per message.
  ApplyResult apply(Version version, const Inbox& inbox) {
    ApplyResult res;
    std::vector<wire::MessageView> accepted;
    bool full = false;
    try {
      for (const auto& [src, bytes] : inbox) {
        res.bytes += bytes.size();
        wire::MessageView m(
            bytes, "sender " + std::to_string(src) + " to receiver " + std::to_string(rank_));
        if (m.version() < version && m.kind() != MessageKind::repair) {
          ++res.stale;  // a replay of an older publication: ignored, it changes nothing
          continue;
        }
        check(m, version, src);
        full = full || m.kind() == MessageKind::full;
        accepted.push_back(m);
      }
    } catch (const error& e) {
      res.refusal = e.what();
      return res;  // nothing touched
    }
    // A full publication rewrites every live element and a repair every element of the
    // canonical tensors it carries: their digests are rebuilt from the values written, so
    // elements a lost message left stale cannot keep a wrong term alive.
    std::vector<bool> rebuild(digest_.size(), full);
    for (const wire::MessageView& m : accepted) {
      if (m.kind() != MessageKind::repair) continue;
      m.for_each_entry([&](const DeltaEntry& e) { mark(rebuild, e.tensor, e.index); });
      m.for_each_run(
          [&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len, const std::byte*) {
            for (std::uint32_t i = 0; i < len; ++i)
              mark(rebuild, tensor, index + i);
          });
    }
    for (std::size_t t = 0; t < digest_.size(); ++t) {
      if (rebuild[t]) digest_[t] = 0;
    }
    for (const wire::MessageView& m : accepted) {
      m.for_each_entry([&](const DeltaEntry& e) { write(e.tensor, e.index, e.bits, rebuild); });
      m.for_each_run(
          [&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len, const std::byte* bits) {
            for (std::uint32_t i = 0; i < len; ++i) {
              std::uint16_t b;
              std::memcpy(&b, bits + 2 * static_cast<std::size_t>(i), 2);
              write(tensor, index + i, b, rebuild);
            }
          });
      res.written += m.entry_count() + m.run_elements();
    }
    version_ = version;
    res.committed = true;
    return res;
  }

 private:
  void check(const wire::MessageView& m, Version version, std::int64_t src) const {
    const std::string who =
        "receiver " + std::to_string(rank_) + ", message from sender " + std::to_string(src) + ": ";
    if (m.version() != version) {
      throw error(who + "version " + std::to_string(m.version()) + " where " +
                  std::to_string(version) + " is being applied");
    }
    if (m.kind() == MessageKind::delta || m.kind() == MessageKind::noop) {
      if (m.base() != version_) {
        throw error(who + "delta on base version " + std::to_string(m.base()) +
                    " but this receiver holds " + std::to_string(version_) +
                    "; refused, a full resync is needed");
      }
    } else if (m.kind() == MessageKind::repair && version_ != version) {
      throw error(who + "repair for version " + std::to_string(version) +
                  " but this receiver holds " + std::to_string(version_));
    }
    if (m.kind() == MessageKind::noop && (m.entry_count() != 0 || m.run_count() != 0)) {
      throw error(who + "a no-op version carries elements");
    }
    m.for_each_group([&](const wire::Group& g) {
      if (g.tensor >= tensors_.size()) {
        throw error(who + "tensor id " + std::to_string(g.tensor) + " does not exist (" +
                    std::to_string(tensors_.size()) + " tensors)");
      }
      if (g.last >= tensors_[g.tensor].size()) {
        throw error(who + "index " + std::to_string(g.last) + " is outside " +
                    layout_->name(g.tensor) + " (" + std::to_string(tensors_[g.tensor].size()) +
                    " elements)");
      }
    });
  }

  void mark(std::vector<bool>& rebuild, std::uint32_t tensor, std::uint32_t index) const {
    const layout::Canonical c = layout_->source({ts_, tensor, index});
    if (c.tensor >= 0) rebuild[static_cast<std::size_t>(c.tensor)] = true;
  }

  void write(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits,
             const std::vector<bool>& rebuild) {
    std::uint16_t& cell = tensors_[tensor][index];
    const layout::Canonical c = layout_->source({ts_, tensor, index});
    if (c.tensor >= 0) {
      const std::int64_t g = (*hf_)[c.tensor].base + c.index;
      const auto t = static_cast<std::size_t>(c.tensor);
      digest_[t] += element_digest(g, bits) - (rebuild[t] ? 0 : element_digest(g, cell));
    }
    cell = bits;
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* layout_;
  std::int64_t rank_;
  std::int64_t ts_;
  Version version_ = no_version;
  ReceiverTensors tensors_;
  std::vector<Digest> digest_;
};

}  // namespace dte
