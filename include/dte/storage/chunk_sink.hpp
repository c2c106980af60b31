// SPDX-License-Identifier: Apache-2.0
// ChunkSink: the canonical sink of a sender frame (pipeline/frame.hpp). Every element the frame
// sends goes out in canonical coordinates (HF tensor, index in the unsharded tensor, BF16 bits),
// in shard order, into chunks of bounded size (storage/chunk.hpp), each handed on as it fills:
// into a version directory (storage::Publisher) or kept in memory (a publication message).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/pipeline/detect.hpp"
#include "dte/pipeline/runs.hpp"
#include "dte/reconstruction.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/shard_base.hpp"
#include "dte/storage/value_code.hpp"

namespace dte::storage {

// Where a ChunkSink's finished chunks go: into the version directory, as the storage publisher
// writes them (an anchor's as parts rank 0 assembles). Returns the manifest's entry for it.
struct ChunkFiles {
  std::filesystem::path dir;
  bool anchor = false;
  ChunkEntry operator()(std::uint32_t chunk, std::uint32_t writer,
                        std::vector<std::byte> bytes) const {
    const std::string name =
        anchor ? anchor_part_name(chunk, writer) : chunk_file_name(chunk, writer);
    io::write_file_atomic(dir / name, bytes, "chunk");
    return {name, bytes.size(), checksum(bytes), chunk, writer};
  }
};

// ... or kept in memory, in order: a publication message's chunks (publication/message.hpp).
struct ChunkMemory {
  std::vector<std::vector<std::byte>>* blobs;
  bool anchor = false;
  ChunkEntry operator()(std::uint32_t chunk, std::uint32_t writer,
                        std::vector<std::byte> bytes) const {
    ChunkEntry e{anchor ? anchor_part_name(chunk, writer) : chunk_file_name(chunk, writer),
                 bytes.size(), checksum(bytes), chunk, writer};
    blobs->push_back(std::move(bytes));
    return e;
  }
};

// One writer's chunks of one version, filled in shard order by a sender frame (or put() one by
// one) and handed to `store` (ChunkFiles or ChunkMemory) as each fills. Diff: every changed element
// goes into a diff chunk (storage/value_code.hpp): its step from the previous bits where the
// reconstruction knows those for certain, its near code where it knows them to within a few
// patterns (the guard band's elements: 12 % of those sent at lr 2e-7 in a dte simulate run); the
// rare others (a step of 32766 ulps or more, a reconstruction without bounds) into a value chunk
// beside it. classes (diff only): the diff chunks' indices as class indices
// (storage/class_index.hpp) against this rank's shard; the value chunk's positions are their skips.
template <bool Diff, class Store>
class ChunkSink {
 public:
  // Whether changed elements go with what their previous bits can be (put()'s second form).
  static constexpr bool diff = Diff;

  ChunkSink(const layout::HfModel& hf, ChunkHeader header, int zstd_level,
            std::uint64_t chunk_entries, Store store, const ShardBase* classes = nullptr)
      : hf_(&hf),
        header_(header),
        level_(zstd_level),
        limit_(chunk_entries),
        store_(std::move(store)),
        classes_(Diff ? classes : nullptr) {
    for (Open& o : open_)
      o.tensors.resize(static_cast<std::size_t>(hf.size()));
    if (classes_ != nullptr) valued_.resize(static_cast<std::size_t>(hf.size()));
  }

  // HF tensors this sink leaves out (skip[t]: FP8 receivers' quantized tensors, which
  // publication/fp8_sender.hpp writes).
  void skip(std::vector<bool> skip) { skip_ = std::move(skip); }

  // ---- What the frame calls ----

  template <class Frame>
  void begin(const Frame&, pipeline::ScanMode) {
    changed_ = 0;
  }
  template <class Frame>
  void prepare(const Frame&, layout::BufferKind, std::size_t, typename Frame::Tile&) {}

  // In tile order: the tile's changed elements.
  template <class Frame>
  void changed(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_changed(b, t, s, [&](const pipeline::Run& run, std::int64_t o, std::uint16_t bits) {
      if (skipped(run.tensor)) return;
      const auto tensor = static_cast<std::uint32_t>(run.tensor);
      if constexpr (Diff) {
        // (what the previous stored value can be: the reconstruction of the last step)
        put(tensor, f.canonical_index(run, o), bits, f.previous(b, run, o));
      } else {
        put(tensor, f.canonical_index(run, o), bits);
      }
      ++changed_;
    });
  }

  // A full publication, in tile order: every value of the tile's piece of every run.
  template <class Frame>
  void all(const Frame& f, layout::BufferKind b, std::size_t t, const typename Frame::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          if (skipped(run.tensor)) return;
          const auto tensor = static_cast<std::uint32_t>(run.tensor);
          const std::uint32_t first = f.canonical_index(run, run.shard_begin + at);
          for (std::size_t j = 0; j < bits.size(); ++j)
            put(tensor, first + static_cast<std::uint32_t>(j), bits[j]);
        });
  }

  // After the last tile: the open chunks are written.
  template <class Frame, class Access>
  void end(const Frame&, const Access&, pipeline::ScanMode) {
    flush();
  }

  // The changed elements of the last delta (a full publication writes none one by one).
  [[nodiscard]] std::uint64_t entries() const noexcept { return changed_; }

  // ---- Element by element ----

  void put(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    add(open_[0], tensor, index, bits);
  }
  // Diff: previous is what the element's previous bits can be.
  void put(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits,
           const PreviousBits& previous) {
    if (previous.certain && diff_fits(previous.bits, bits)) {
      add(open_[1], tensor, index, diff_code(previous.bits, bits), value_class(previous.bits));
    } else if (!previous.certain && previous.bounded && near_fits(previous.lo, previous.hi, bits)) {
      add(open_[1], tensor, index, near_code(bits), class_between(previous.lo, previous.hi));
    } else {
      if (classes_ != nullptr) valued_[tensor].push_back(index);
      add(open_[0], tensor, index, bits);
    }
  }

  // Writes the open chunks (nothing for an empty one).
  void flush() {
    write(open_[0], Encoding::value);
    write(open_[1], Encoding::diff);
  }

  [[nodiscard]] const std::vector<ChunkEntry>& written() const noexcept { return written_; }
  [[nodiscard]] Store& store() noexcept { return store_; }

 private:
  struct Open {
    std::vector<TensorDelta> tensors;  // per HF tensor
    std::vector<std::uint32_t> touched;
    std::uint64_t pending = 0;
  };

  [[nodiscard]] bool skipped(std::int64_t t) const noexcept {
    return !skip_.empty() && skip_[static_cast<std::size_t>(t)];
  }

  void add(Open& o, std::uint32_t tensor, std::uint32_t index, std::uint16_t bits, int cls = 0) {
    TensorDelta& d = o.tensors[tensor];
    if (d.index.empty()) o.touched.push_back(tensor);
    d.index.push_back(index);
    d.bits.push_back(bits);
    if (classes_ != nullptr && &o == &open_[1]) d.cls.push_back(static_cast<std::int16_t>(cls));
    if (++o.pending >= limit_) flush();
  }

  void write(Open& o, Encoding encoding) {
    if (o.pending == 0) return;
    Chunk c;
    c.header = header_;
    c.header.chunk = static_cast<std::uint32_t>(written_.size());
    c.encoding = encoding;
    const bool classed = classes_ != nullptr && encoding == Encoding::diff;
    c.index = classed ? IndexCode::classes : IndexCode::plain;
    std::sort(o.touched.begin(), o.touched.end());
    for (std::uint32_t t : o.touched) {
      TensorDelta& d = o.tensors[t];
      d.tensor = t;
      if (classed) {
        // (ShardBase checked that elements arrive in index order; every value-chunk element up
        // to this entry's last index has therefore arrived)
        d.domain = classes_->domain(t, d.index.front(), d.index.back());
        auto& v = valued_[t];
        const auto from = std::lower_bound(v.begin(), v.end(), d.index.front());
        const auto to = std::upper_bound(from, v.end(), d.index.back());
        d.skip.assign(from, to);
        v.erase(v.begin(), to);
      } else {
        sort_by_index(d);
      }
      c.tensors.push_back(std::move(d));
      d = TensorDelta{};
    }
    o.touched.clear();
    o.pending = 0;
    written_.push_back(store_(c.header.chunk, c.header.writer,
                              encode_chunk(*hf_, c, level_, classed ? classes_ : nullptr)));
  }

  // A writer's elements of one tensor arrive in shard order, which is index order for every
  // layout dte knows; sort when it is not.
  static void sort_by_index(TensorDelta& d) {
    if (std::is_sorted(d.index.begin(), d.index.end())) return;
    std::vector<std::uint32_t> order(d.index.size());
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(),
              [&](std::uint32_t a, std::uint32_t b) { return d.index[a] < d.index[b]; });
    TensorDelta s;
    for (std::uint32_t k : order) {
      s.index.push_back(d.index[k]);
      s.bits.push_back(d.bits[k]);
    }
    d.index = std::move(s.index);
    d.bits = std::move(s.bits);
  }

  const layout::HfModel* hf_;
  ChunkHeader header_;
  int level_;
  std::uint64_t limit_;
  Store store_;
  const ShardBase* classes_;
  std::vector<std::vector<std::uint32_t>> valued_;  // classes: per tensor, value-chunk indices
  Open open_[2];                                    // value, diff
  std::vector<ChunkEntry> written_;
  std::uint64_t changed_ = 0;  // this delta's changed elements
  std::vector<bool> skip_;     // per HF tensor (empty: none)
};

}  // namespace dte::storage
