// SPDX-License-Identifier: Apache-2.0
// Fp8ShardReceiver: one TP rank of an engine that serves online-quantized FP8 (docs/fp8.md),
// kept current from FP8 publications (publication/message.hpp, fp8_format) in the caller's own
// tensors: per quantized tensor (layout/fp8_grid.hpp) its E4M3FN codes ([out, in], one byte
// each) and its block scales (weight_scale_inv, FP32), and the tensors that stay BF16 (embeddings,
// lm_head, norms, biases) as a ShardReceiver holds them.
//
// One publication, top to bottom: decode the message (framing, checksums, header); the version
// chain; the BF16 chunks routed into staged writes for this rank and checked (receive/core.hpp);
// this rank's FP8 part decoded and checked (its header, offsets and blocks in range and
// ascending, a full publication writing every code and every scale exactly once). Only then are
// values written: the codes and scales first, each overwritten value kept, the rank's digest of
// every quantized tensor moved by what was overwritten and written; unless every digest equals
// the sender's (the message's: of the engine's own quantization of the trainer's weights), every
// FP8 write is undone and the publication refused. Then the BF16 writes and the version commit.
// A refusal leaves tensors, version and digests as they were.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/detect/fp8.hpp"
#include "dte/error.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/publication/message.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/fp8_core.hpp"
#include "dte/receive/fp8_part.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"

namespace dte::publication {

using receive::Fp8Tensor;

class Fp8ShardReceiver {
 public:
  // TP rank `ts` of one replica of `topology`, serving `recipe` (VllmBlockFp8::name).
  // bf16: one view per serving tensor in ServingLayout order, empty for the quantized ones;
  // fp8: per quantized tensor, in Fp8Grid::quantized_ids() order.
  Fp8ShardReceiver(const layout::ModelSpec& model, const layout::InferTopology& topology,
                   std::int64_t ts, std::string recipe, ReceiverTensors bf16,
                   std::vector<Fp8Tensor> fp8)
      : spec_(named_by_structure(model)),
        hf_(spec_),
        layout_(hf_, topology.one_replica()),
        grid_(layout_, block_of(recipe).first, block_of(recipe).second),
        ts_(detail::checked_rank(ts, topology, "Fp8ShardReceiver")),
        recipe_(std::move(recipe)),
        core_(make_core(hf_, layout_, grid_, ts_)),
        fp8_(grid_, "FP8 receiver " + std::to_string(ts_), std::move(fp8)) {
    core_.hold(std::move(bf16));
  }

  Fp8ShardReceiver(const Fp8ShardReceiver&) = delete;
  Fp8ShardReceiver& operator=(const Fp8ShardReceiver&) = delete;

  [[nodiscard]] const layout::HfModel& model() const noexcept { return hf_; }
  [[nodiscard]] const layout::ServingLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] const layout::Fp8Grid& grid() const noexcept { return grid_; }
  [[nodiscard]] std::int64_t rank() const noexcept { return ts_; }
  [[nodiscard]] Version version() const noexcept { return core_.version(); }
  // Per canonical tensor, of this rank's BF16 part.
  [[nodiscard]] const std::vector<Digest>& digest() const noexcept { return core_.digest(); }
  // Per quantized tensor, of its codes and scales.
  [[nodiscard]] const std::vector<Digest>& fp8_digest() const noexcept { return fp8_.digest(); }

  // The first quantized tensor whose codes or scales differ from what dte wrote ("" if none):
  // the digest recomputed from every element.
  [[nodiscard]] std::string verify() const {
    if (core_.version() == no_version) return {};
    return fp8_.verify();
  }

  ApplyReport apply(std::span<const std::byte> bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    ApplyReport rep;
    receive::StagedWrites& w = staged_;
    std::vector<receive::StagedWrites*> out(static_cast<std::size_t>(layout_.topology().tp),
                                            nullptr);
    out[static_cast<std::size_t>(ts_)] = &w;
    receive::Router router(layout_, out);
    View v = decode(hf_, bytes, "publication", fp8_format);
    const Fp8Section::Part& section = check_section(*v.fp8);
    const std::optional<storage::Manifest> m = detail::stage(
        hf_, v, bytes.size(), core_, scratch_, w, rep, storage::detail::ScratchRoom{&scratch_},
        [&](std::int64_t t, const std::uint32_t* index, const std::uint16_t* bits, std::size_t n) {
          router.route(t, index, bits, n);
        });
    if (!m) return rep;
    const receive::Fp8Part part = receive::decode_fp8_part(
        grid_, recipe_, v.fp8_parts[static_cast<std::size_t>(ts_)],
        "publication v" + std::to_string(m->version) + " FP8 part " + std::to_string(ts_),
        {m->version, m->base, static_cast<std::uint32_t>(ts_)});
    const bool full = m->anchor();
    const std::span<const receive::Fp8Part> parts(&part, 1);
    fp8_.check(parts, full);
    core_.check(w);
    // (nothing written before this line)
    rep.written = fp8_.commit(parts, full, section.digest);
    core_.commit(w);
    rep.outcome = ApplyOutcome::committed;
    rep.written += w.size();
    rep.touched = w.tensors();
    for (const receive::Fp8Writes& t : part.tensors)
      rep.touched.push_back(static_cast<std::uint32_t>(t.tensor));
    std::sort(rep.touched.begin(), rep.touched.end());
    detail::release_if_full(scratch_, w);
    rep.version = core_.version();
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

 private:
  static std::pair<std::int64_t, std::int64_t> block_of(const std::string& recipe) {
    if (recipe == VllmBlockFp8::name) return {VllmBlockFp8::block_rows, VllmBlockFp8::block_cols};
    throw unsupported("Fp8ShardReceiver: no recipe \"" + recipe + "\"; dte covers \"" +
                      std::string(VllmBlockFp8::name) + "\" (docs/fp8.md)");
  }
  // The BF16 part's core: the quantized tensors hold no BF16 element (numel 0).
  static receive::Core make_core(const layout::HfModel& hf, const layout::ServingLayout& l,
                                 const layout::Fp8Grid& g, std::int64_t ts) {
    std::vector<std::uint64_t> numel, live;
    for (std::int64_t k = 0; k < l.size(); ++k) {
      const bool q = g.quantized(k);
      numel.push_back(q ? 0 : static_cast<std::uint64_t>(l[k].numel));
      live.push_back(q ? 0 : static_cast<std::uint64_t>(l.live_end(ts, k)));
    }
    return receive::Core(
        "FP8 receiver " + std::to_string(ts), ts, std::move(numel), std::move(live),
        static_cast<std::size_t>(hf.size()), [&l](std::int64_t k) { return l.name(k); },
        [&hf](std::int64_t t) { return hf.name(t); });
  }

  [[nodiscard]] std::string who() const { return "FP8 receiver " + std::to_string(ts_); }

  const Fp8Section::Part& check_section(const Fp8Section& s) const {
    const layout::InferTopology& t = layout_.topology();
    if (s.recipe != recipe_ || s.tp != t.tp || s.ep != t.ep) {
      throw format_error(
          who() + ": the publication is quantized by \"" + s.recipe + "\" for tp=" +
          std::to_string(s.tp) + " ep=" + std::to_string(s.ep) + "; this receiver serves \"" +
          recipe_ + "\" at tp=" + std::to_string(t.tp) + " ep=" + std::to_string(t.ep) +
          ": publish for this topology (TorchPublisher(..., quantization=..., infer=...))");
    }
    if (s.parts.size() != static_cast<std::size_t>(t.tp)) {
      throw format_error(who() + ": the publication has " + std::to_string(s.parts.size()) +
                         " FP8 parts for " + std::to_string(t.tp) + " ranks");
    }
    const Fp8Section::Part& p = s.parts[static_cast<std::size_t>(ts_)];
    if (p.digest.size() != fp8_.digest().size()) {
      throw format_error(who() + ": the publication's FP8 part has " +
                         std::to_string(p.digest.size()) + " digests, this rank quantizes " +
                         std::to_string(fp8_.digest().size()) + " tensors");
    }
    return p;
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  layout::ServingLayout layout_;
  layout::Fp8Grid grid_;
  std::int64_t ts_;
  std::string recipe_;
  receive::Core core_;
  receive::Fp8Core fp8_;
  storage::ChunkScratch scratch_;
  receive::StagedWrites staged_;
};

}  // namespace dte::publication
