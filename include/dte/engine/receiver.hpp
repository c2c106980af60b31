// SPDX-License-Identifier: Apache-2.0
// A receiver rank (one SGLang TP rank of one replica): its live 16-bit tensors, the version it
// holds, and its part of the verified-sync digest, kept per canonical tensor and updated from
// the values it overwrites (O(changed)).
//
// apply() is transactional: every message of the publication is decoded and checked first
// (version chain, tensor ids, index ranges); only then are values scattered in place and the
// version committed. A refused publication leaves tensors, version and digest untouched.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/engine/digest.hpp"
#include "dte/engine/message.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/sglang.hpp"
#include "dte/transport/loopback.hpp"

namespace dte {

struct ApplyResult {
  bool committed = false;
  std::string refusal;        // why the publication was refused (empty when committed)
  std::uint64_t written = 0;  // element writes
  std::uint64_t stale = 0;    // messages of older versions ignored (replays)
  std::uint64_t bytes = 0;    // received
};

class Receiver {
 public:
  Receiver(const layout::HfModel& hf, const layout::SglangLayout& layout, std::int64_t rank)
      : hf_(&hf), layout_(&layout), rank_(rank), ts_(rank % layout.topology().tp) {
    for (std::int64_t k = 0; k < layout.size(); ++k) {
      tensors_.emplace_back(static_cast<std::size_t>(layout[k].numel), std::uint16_t{0});
    }
    digest_.assign(static_cast<std::size_t>(hf.size()), 0);
  }

  [[nodiscard]] std::int64_t rank() const noexcept { return rank_; }
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] const std::vector<std::uint16_t>& tensor(std::int64_t id) const {
    return tensors_[static_cast<std::size_t>(id)];
  }
  // Per canonical tensor: the sum of h(canonical, bits) over this rank's copies of it.
  [[nodiscard]] const std::vector<std::uint64_t>& digest() const noexcept { return digest_; }

  // Applies one publication: all messages addressed to this rank (any sender order). The
  // messages are read in place (MessageView): no memory beyond what was received.
  ApplyResult apply(Version version, const Inbox& inbox) {
    ApplyResult res;
    std::vector<MessageView> accepted;
    try {
      for (const auto& [src, bytes] : inbox) {
        res.bytes += bytes.size();
        MessageView m(bytes,
                      "sender " + std::to_string(src) + " to receiver " + std::to_string(rank_));
        if (m.version() < version && m.kind() != MessageKind::repair) {
          ++res.stale;  // a replay of an older publication: ignored, it changes nothing
          continue;
        }
        check(m, version, src);
        accepted.push_back(m);
      }
    } catch (const error& e) {
      res.refusal = e.what();
      return res;  // nothing touched
    }
    for (const MessageView& m : accepted) {
      m.for_each_entry([&](const DeltaEntry& e) { write(e.tensor, e.index, e.bits); });
      m.for_each_run(
          [&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len, const std::byte* bits) {
            for (std::uint32_t i = 0; i < len; ++i) {
              std::uint16_t b;
              std::memcpy(&b, bits + 2 * static_cast<std::size_t>(i), 2);
              write(tensor, index + i, b);
            }
            res.written += len;
          });
      res.written += m.entry_count();
    }
    version_ = version;
    res.committed = true;
    return res;
  }

 private:
  void check(const MessageView& m, Version version, std::int64_t src) const {
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
    auto in_range = [&](std::uint32_t tensor, std::uint64_t index, std::uint64_t count) {
      if (tensor >= tensors_.size()) {
        throw error(who + "tensor id " + std::to_string(tensor) + " does not exist (" +
                    std::to_string(tensors_.size()) + " tensors)");
      }
      if (index + count > tensors_[tensor].size()) {
        throw error(who + "index " + std::to_string(index + count - 1) + " is outside " +
                    layout_->name(tensor) + " (" + std::to_string(tensors_[tensor].size()) +
                    " elements)");
      }
    };
    m.for_each_entry([&](const DeltaEntry& e) { in_range(e.tensor, e.index, 1); });
    m.for_each_run([&](std::uint32_t tensor, std::uint32_t index, std::uint32_t len,
                       const std::byte*) { in_range(tensor, index, len); });
  }

  void write(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    std::uint16_t& cell = tensors_[tensor][index];
    const layout::Canonical c = layout_->source({ts_, tensor, index});
    if (c.tensor >= 0) {
      const std::int64_t g = (*hf_)[c.tensor].base + c.index;
      std::uint64_t& d = digest_[static_cast<std::size_t>(c.tensor)];
      d = d - element_digest(g, cell) + element_digest(g, bits);
    }
    cell = bits;
  }

  const layout::HfModel* hf_;
  const layout::SglangLayout* layout_;
  std::int64_t rank_;
  std::int64_t ts_;
  Version version_ = no_version;
  std::vector<std::vector<std::uint16_t>> tensors_;
  std::vector<std::uint64_t> digest_;
};

}  // namespace dte
