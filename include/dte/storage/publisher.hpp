// SPDX-License-Identifier: Apache-2.0
// storage::Publisher: one per trainer rank, publishing versions to shared storage instead of to
// receivers over a communicator (docs/storage.md). The pipeline is the engine's
// (engine/sender.hpp): detect and compact are the same stages; instead of route and encode, every
// element to send goes out in canonical coordinates (HF tensor, index in the unsharded tensor, BF16
// bits) into chunks of bounded size, each written atomically as it fills.
//
// One publication, top to bottom (every writer rank calls the same method):
//   1. rank 0 reads LATEST; the world agrees on the version V = LATEST + 1, and on whether V is
//      a delta on the version this publisher wrote last or an anchor (a full state: the first
//      publication, every anchor_every versions, after a failure, or when LATEST is not ours);
//   2. the staged pass; each writer writes its chunks into the version directory;
//   3. the world sums the counts, the digest per canonical tensor and every chunk's size and
//      xxh3, and agrees that no writer failed (the transport's sum: threads or MPI alike);
//   4. rank 0 only: an anchor's chunks become a Hugging Face checkpoint directory (sharded
//      model-*.safetensors and model.safetensors.index.json, loadable by transformers, SGLang,
//      vLLM); the manifest is written last and exclusively (of two publishers of V one wins, the
//      other fails naming the conflict), the directory fsynced, then LATEST replaced atomically;
//      (one writer group per root: rank 0 holds ROOT/writer.lock; a version directory above
//      everything complete is a dead writer's and is cleared first); then retention
//      (storage/retention.hpp) removes what no reader can need;
//   5. the world agrees on rank 0's outcome: every rank returns the same report or throws.
// A crash anywhere before LATEST moves leaves the old version current: readers never see V
// (files without a manifest are ignored, and replaced or collected later).
#pragma once

#include <sys/file.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/concepts.hpp"
#include "dte/engine/digest.hpp"
#include "dte/engine/sender.hpp"
#include "dte/error.hpp"
#include "dte/exec/host.hpp"
#include "dte/io/file.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/retention.hpp"
#include "dte/storage/shard_base.hpp"

namespace dte::storage {

struct PublisherConfig {
  std::int64_t anchor_every = 0;   // an anchor every N versions (0: only when needed)
  std::int64_t publish_every = 1;  // K: step() publishes every K optimizer steps
  int zstd_level = 3;              // 1 .. 19
  std::uint64_t chunk_entries = std::uint64_t{1} << 24;      // changed elements per chunk at most
  std::uint64_t anchor_file_bytes = std::uint64_t{2} << 30;  // an anchor's shard files
  // value: deltas carry the new bits; diff: their diff code against the previous bits where the
  // reconstruction knows those for certain (publish_every must be 1: the base is the last step)
  Encoding encoding = Encoding::value;
  // the diff chunks' indices: plain, or classes (coded against the base: about a quarter fewer
  // bytes at low densities; the reader needs the base: storage::Reader and `dte verify` have it;
  // storage/class_index.hpp)
  IndexCode index = IndexCode::plain;
  // after every publication rank 0 removes what no reader can need (storage/retention.hpp)
  bool collect = true;
};

// What one publication wrote; the same on every writer rank.
struct PublishReport {
  Version version = 0;
  Version base = no_version;      // no_version: an anchor
  std::uint64_t changed = 0;      // elements written (an anchor: all of them)
  std::uint64_t scanned = 0;      // elements looked at
  std::uint64_t files = 0;        // chunk or shard files, the manifest not counted
  std::uint64_t bytes = 0;        // every byte of the version on storage, the manifest included
  std::uint64_t dense_bytes = 0;  // the model as dense BF16
  Digest digest = 0;              // the full-state digest, summed over tensors
  double seconds = 0;
  // rank 0 only: the versions retention removed after publishing, or why it could not
  std::vector<Version> collected;
  std::string collect_problem;
  [[nodiscard]] bool anchor() const noexcept { return base == no_version; }
};

// The chunk and shard file names of a version directory.
inline std::string chunk_file_name(std::uint32_t chunk, std::uint32_t writer) {
  return "c" + std::to_string(chunk) + "-w" + std::to_string(writer) + ".zst";
}
inline std::string anchor_part_name(std::uint32_t chunk, std::uint32_t writer) {
  return "anchor-part-c" + std::to_string(chunk) + "-w" + std::to_string(writer) + ".zst";
}
inline std::string shard_file_name(std::size_t k, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}
inline constexpr std::string_view hf_index_name = "model.safetensors.index.json";

namespace detail {

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

// One writer's chunks of one version, filled in shard order by the pipeline's emitter and handed
// to `store` (ChunkFiles or ChunkMemory) as each fills. Diff: every changed element goes into a
// diff chunk (storage/value_code.hpp): its step from the previous bits where the reconstruction
// knows those for certain, its near code where it knows them to within a few patterns (the
// guard band's elements: 12 % of those sent at lr 2e-7 in a dte simulate run); the rare others (a
// step of 32766 ulps or more, a reconstruction without bounds) into a value chunk beside it.
// classes (diff only): the diff chunks' indices as class indices (storage/class_index.hpp)
// against this rank's shard; the value chunk's positions are their skips.
template <bool Diff, class Store>
class ChunkSink {
 public:
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

  // (wants_base: the sender passes what each element's previous bits can be)
  static constexpr bool wants_base = Diff;

  void operator()(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
    add(open_[0], tensor, index, bits);
  }
  void operator()(std::uint32_t tensor, std::uint32_t index, std::uint16_t bits,
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
};

inline std::uint64_t file_size(const std::filesystem::path& p) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(p, ec);
  if (ec) throw io_error("cannot stat '" + p.string() + "': " + ec.message());
  return n;
}

}  // namespace detail

// Rank 0 of an anchor: the writers' parts (listed in `parts`, already checked by size and
// xxh3 on reading) assembled into a Hugging Face checkpoint directory in `dir`; every element
// exactly once, checked against the world's digest. Returns the shard files for the manifest.
// Holds the model as BF16 (2 bytes per parameter) while it writes.
inline std::vector<ChunkEntry> write_anchor_shards(const layout::HfModel& hf,
                                                   const std::filesystem::path& dir, Version v,
                                                   const std::vector<ChunkEntry>& parts,
                                                   const std::vector<Digest>& digest,
                                                   std::uint64_t shard_bytes) {
  const auto tensors = static_cast<std::size_t>(hf.size());
  std::vector<std::vector<std::uint16_t>> full(tensors);
  std::vector<std::uint64_t> filled(tensors, 0);
  for (std::size_t t = 0; t < tensors; ++t)
    full[t].resize(static_cast<std::size_t>(hf[static_cast<std::int64_t>(t)].numel()));
  Manifest staged;
  staged.version = v;
  staged.base = no_version;
  for (const ChunkEntry& e : parts) {
    const Chunk c = read_chunk(hf, dir, staged, e);
    for (const TensorDelta& d : c.tensors) {
      auto& out = full[static_cast<std::size_t>(d.tensor)];
      for (std::size_t k = 0; k < d.index.size(); ++k)
        out[d.index[k]] = d.bits[k];
      filled[static_cast<std::size_t>(d.tensor)] += d.index.size();
    }
  }
  for (std::size_t t = 0; t < tensors; ++t) {
    const auto id = static_cast<std::int64_t>(t);
    Digest sum = 0;
    for (std::size_t i = 0; i < full[t].size(); ++i)
      sum += element_digest(hf[id].base + static_cast<std::int64_t>(i), full[t][i]);
    if (filled[t] != full[t].size() || sum != digest[t]) {
      throw error("anchor v" + std::to_string(v) + ": tensor " + hf.name(id) + " received " +
                  std::to_string(filled[t]) + " elements of " + std::to_string(full[t].size()) +
                  (sum != digest[t] ? " and its digest differs from the writers'" : "") +
                  "; the trainer ranks do not cover the model exactly once (report this)");
    }
  }
  // Tensors in model order, a new shard file when the next would pass shard_bytes.
  std::vector<std::vector<std::size_t>> files(1);
  std::uint64_t in_file = 0;
  for (std::size_t t = 0; t < tensors; ++t) {
    const std::uint64_t b = 2 * full[t].size();
    if (in_file > 0 && in_file + b > shard_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(t);
    in_file += b;
  }
  std::vector<ChunkEntry> out;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::uint64_t total = 0;
  for (std::size_t f = 0; f < files.size(); ++f) {
    const std::string name = shard_file_name(f, files.size());
    io::SafetensorsWriter w;
    for (std::size_t t : files[f]) {
      const auto id = static_cast<std::int64_t>(t);
      const auto shape = hf.shape(id);
      w.add<std::uint16_t>(hf.name(id), {shape.begin(), shape.end()}, full[t], io::DType::BF16);
      weight_map[hf.name(id)] = name;
      total += 2 * full[t].size();
      std::vector<std::uint16_t>().swap(full[t]);  // written into w: free it
    }
    w.set_metadata("format", "pt");
    w.set_metadata("dte.version", std::to_string(v));
    const std::vector<std::byte> bytes = w.serialize();
    io::write_file_atomic(dir / name, bytes, "anchor shard");
    out.push_back({name, bytes.size(), checksum(bytes), static_cast<std::uint32_t>(f), 0});
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}, {"dte.version", std::to_string(v)}};
  index["weight_map"] = std::move(weight_map);
  const std::string text = index.dump(2) + "\n";
  io::write_file_atomic(dir / hf_index_name, std::as_bytes(std::span(text)), "anchor index");
  return out;
}

// ---- What every writer group of a root does (the storage publisher's rank 0, and
// publication/storage.hpp's writer of publication messages) ----

// One publisher group per root: its writer holds an exclusive flock on ROOT/writer.lock for its
// lifetime (the kernel releases it when the process dies, SIGKILL included).
inline io::detail::FdGuard lock_root(const std::filesystem::path& root) {
  const std::string name = (root / "writer.lock").string();
  io::detail::FdGuard fd(::open(name.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) {
    const int err = errno;
    throw io_error("cannot open '" + name + "': " + io::detail::errno_text(err));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      throw protocol_error("another publisher holds '" + name +
                           "': one writer group per storage root (stop it, or use another root)");
    }
    throw io_error("cannot lock '" + name + "': " + io::detail::errno_text(err));
  }
  return fd;
}

// The newest version directory with a manifest (0: none).
inline Version newest_complete(const std::filesystem::path& root) {
  Version top = 0;
  for (const auto& e : std::filesystem::directory_iterator(root)) {
    const std::optional<Version> v = parse_version_dir(e.path().filename().string());
    if (v && *v > top && std::filesystem::exists(e.path() / manifest_name)) top = *v;
  }
  return top;
}

// A name a publisher writes into a version directory (finished, or a temporary of one).
inline bool own_file(const std::string& name) {
  const std::string base = name.substr(0, io::temporary_suffix(name));
  const auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  const auto chunk_like = [&](std::string_view s, std::string_view prefix) {
    if (!s.starts_with(prefix) || !s.ends_with(".zst")) return false;
    s.remove_prefix(prefix.size());
    s.remove_suffix(4);
    const auto w = s.find("-w");
    return w != std::string_view::npos && digits(s.substr(0, w)) && digits(s.substr(w + 2));
  };
  return chunk_like(base, "c") || chunk_like(base, "anchor-part-c") ||
         base == std::string(manifest_name) || base == std::string(hf_index_name) ||
         (base.starts_with("model-") && base.ends_with(".safetensors"));
}

// The directory of the version about to be written holds, at most, what a writer that died
// left there: its own chunk, shard and temporary files, which are removed. Anything else is
// not ours: refused, untouched.
inline void clear_unfinished(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return;
  std::vector<std::filesystem::path> ours;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!own_file(e.path().filename().string()) || !e.is_regular_file()) {
      throw protocol_error("'" + e.path().string() +
                           "' is in the directory of the next version and was not written by "
                           "a dte publisher; move it away before publishing");
    }
    ours.push_back(e.path());
  }
  for (const auto& p : ours)
    std::filesystem::remove(p);
}

// The last step of a publication, once every chunk listed in `m` is in `dir`: an anchor's parts
// become a Hugging Face checkpoint directory (m.chunks then lists its shards), the manifest is
// written exclusively (of two writers of one version one wins, the other fails naming the
// conflict), then LATEST moves. Returns the version's bytes on storage, the manifest included.
inline std::uint64_t commit_version(const layout::HfModel& hf, const std::filesystem::path& root,
                                    Manifest& m, std::uint64_t anchor_file_bytes) {
  const std::filesystem::path dir = version_dir(root, m.version);
  if (m.anchor()) {
    const std::vector<ChunkEntry> parts = m.chunks;
    m.chunks = write_anchor_shards(hf, dir, m.version, parts, m.digest, anchor_file_bytes);
    for (const ChunkEntry& e : parts)
      std::filesystem::remove(dir / e.file);
  }
  const std::string text = manifest_json(m);
  if (!io::write_file_exclusive(dir / manifest_name, std::as_bytes(std::span(text)), "manifest")) {
    throw protocol_error("version " + std::to_string(m.version) +
                         " was published by another writer while this one wrote it; "
                         "its chunks were replaced, publish again from an anchor");
  }
  write_latest(root, m.version);
  std::uint64_t bytes = text.size();
  for (const ChunkEntry& e : m.chunks)
    bytes += e.bytes;
  if (m.anchor()) bytes += detail::file_size(dir / hf_index_name);
  return bytes;
}

template <optimizer_inverse Inverse, change_detector Detect, layout_mapping Layout, transport World>
requires transfer_plan<typename Layout::plan_type>
class Publisher {
 public:
  using Sender = SenderRank<Inverse, Detect, typename Layout::plan_type, HostExecutor>;

  // One writer rank of `world` (its senders are the trainer ranks; it has no receivers).
  Publisher(const layout::HfModel& hf, const layout::TrainTopology& train,
            std::filesystem::path root, PublisherConfig cfg, World& world, HostExecutor exec = {})
      : hf_(&hf),
        canonical_(hf, layout::InferTopology{}),
        root_(std::move(root)),
        cfg_(checked(cfg)),
        world_(&world),
        sender_(hf, train, canonical_, world.rank(), cfg.publish_every > 1, exec) {
    if (cfg_.index == IndexCode::classes) ShardBase::check_order(hf, sender_.runs());
    if (world.senders() != train.world() || world.receivers() != 0) {
      throw invalid_argument(
          "storage::Publisher: the world has " + std::to_string(world.senders()) + " writers and " +
          std::to_string(world.receivers()) + " receivers; it needs the " +
          std::to_string(train.world()) + " trainer ranks as writers and no receivers");
    }
    // (rank 0 alone: a constructor does not wait for the other ranks, which may be built one
    // after the other on one thread; they fail at the first publication if rank 0 is missing)
    if (world.rank() == 0) {
      std::error_code ec;
      std::filesystem::create_directories(root_, ec);
      if (ec) {
        throw io_error("storage::Publisher: cannot create the storage root '" + root_.string() +
                       "': " + ec.message());
      }
      lock_ = lock_root(root_);
    }
  }

  // The version this publisher wrote last (0: none yet).
  [[nodiscard]] Version version() const noexcept { return version_; }
  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }

  // After every optimizer step: publishes every publish_every steps (returns the report then);
  // between publications, ORs the step's changes into the dirty mask.
  template <class Access>
  std::optional<PublishReport> step(const Access& access) {
    ++steps_;
    if (steps_ % cfg_.publish_every != 0) {
      (void)sender_.scan_canonical(access, pipeline::ScanMode::mark, [](auto, auto, auto) {});
      marked_ = true;
      return std::nullopt;
    }
    stepped_once_ = steps_ == published_step_ + 1;
    PublishReport rep = publish(access);
    published_step_ = steps_;
    return rep;
  }

  // Publishes now: a delta of what changed since the last publication, or an anchor.
  template <class Access>
  PublishReport publish(const Access& access) {
    PublishReport rep = publish_version(access, false);
    stepped_once_ = false;
    return rep;
  }

  // Publishes an anchor now.
  template <class Access>
  PublishReport publish_anchor(const Access& access) {
    return publish_version(access, true);
  }

 private:
  static PublisherConfig checked(const PublisherConfig& c) {
    if (c.anchor_every < 0 || c.publish_every < 1 || c.zstd_level < 1 || c.zstd_level > 19 ||
        c.chunk_entries < 1 || c.anchor_file_bytes < 1 ||
        (c.encoding == Encoding::diff && c.publish_every != 1) ||
        (c.index == IndexCode::classes && c.encoding != Encoding::diff)) {
      throw invalid_argument(
          "storage::PublisherConfig: anchor_every must be >= 0, publish_every >= 1, zstd_level "
          "in 1..19, chunk_entries and anchor_file_bytes >= 1, the diff encoding needs "
          "publish_every 1 (its base is the previous optimizer step), and the classes index "
          "the diff encoding");
    }
    return c;
  }

 private:
  // Every rank passes its error (empty: none); throws on every rank when any failed.
  void agree(const std::string& mine, const char* phase) {
    const auto n = static_cast<std::size_t>(world_->senders());
    std::vector<std::uint64_t> failed(n, 0);
    if (!mine.empty()) failed[static_cast<std::size_t>(world_->rank())] = 1;
    world_->sum(failed, phase);
    const auto first = std::find(failed.begin(), failed.end(), 1u);
    if (first == failed.end()) return;
    need_anchor_ = true;
    const auto who = first - failed.begin();
    throw io_error("storage publication failed on writer " + std::to_string(who) + " (" + phase +
                   ")" + (mine.empty() ? "; that rank's error says why" : ": " + mine) +
                   "; LATEST was not moved, readers keep the version they hold");
  }

  template <class Access>
  PublishReport publish_version(const Access& access, bool want_anchor) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto rank = static_cast<std::uint32_t>(world_->rank());
    const auto writers = static_cast<std::size_t>(world_->senders());
    const auto tensors = static_cast<std::size_t>(hf_->size());
    // 1. The version, and delta or anchor.
    std::string err;
    std::vector<std::uint64_t> head(2, 0);
    if (rank == 0) {
      try {
        // Above LATEST and above any complete version LATEST does not name (a writer that died
        // between its manifest and LATEST: this one holds the lock, so that writer is gone).
        const Version latest = read_latest(root_).value_or(0);
        const Version top = std::max(latest, newest_complete(root_));
        head[0] = top + 1;
        head[1] = top == version_ ? 1 : 0;  // the newest version is the one we wrote last
        clear_unfinished(version_dir(root_, head[0]));
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "choosing the version");
    world_->sum(head, "choosing the version");
    const Version v = head[0];
    const bool anchor = want_anchor || need_anchor_ || version_ == 0 || head[1] == 0 ||
                        (cfg_.anchor_every > 0 && v % static_cast<Version>(cfg_.anchor_every) == 0);
    const Version base = anchor ? no_version : version_;
    const std::filesystem::path dir = version_dir(root_, v);
    const pipeline::ScanMode mode = anchor    ? pipeline::ScanMode::all
                                    : marked_ ? pipeline::ScanMode::mask
                                              : pipeline::ScanMode::detect;
    // 2. The staged pass, chunks written as they fill.
    ScanResult scan;
    std::vector<ChunkEntry> mine;
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) throw io_error("cannot create '" + dir.string() + "': " + ec.message());
      const auto pass = [&](auto& sink) {
        scan = sender_.scan_canonical(access, mode, sink);
        sink.flush();
        mine = sink.written();
      };
      // (diff needs the base to be the previous optimizer step: one step() since the last one)
      if (cfg_.encoding == Encoding::diff && !anchor && stepped_once_) {
        std::optional<ShardBase> classes;
        if (cfg_.index == IndexCode::classes) {
          classes.emplace(std::type_identity<Detect>{}, *hf_, sender_.runs(),
                          [&](layout::BufferKind b) {
                            return access.theta(static_cast<std::int64_t>(rank), b);
                          });
        }
        detail::ChunkSink<true, detail::ChunkFiles> sink(*hf_, {v, base, 0, rank}, cfg_.zstd_level,
                                                         cfg_.chunk_entries, {dir, anchor},
                                                         classes ? &*classes : nullptr);
        pass(sink);
      } else {
        detail::ChunkSink<false, detail::ChunkFiles> sink(*hf_, {v, base, 0, rank}, cfg_.zstd_level,
                                                          cfg_.chunk_entries, {dir, anchor});
        pass(sink);
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
    agree(err, "writing the chunks");
    if (mode != pipeline::ScanMode::detect) {
      sender_.clear_masks();
      marked_ = false;
    }
    // 3. Counts, digest, and every chunk's size and checksum, to every rank.
    std::vector<std::uint64_t> sums(3 + writers + tensors,
                                    0);  // changed, scanned, -, chunks, digest
    sums[0] = scan.changed;
    sums[1] = scan.scanned;
    sums[3 + rank] = mine.size();
    for (std::size_t t = 0; t < tensors; ++t)
      sums[3 + writers + t] = scan.digest[t];
    world_->sum(sums, "the chunk counts and the digest");
    std::vector<std::uint64_t> first(writers + 1, 0);
    for (std::size_t w = 0; w < writers; ++w)
      first[w + 1] = first[w] + sums[3 + w];
    std::vector<std::uint64_t> table(2 * first[writers], 0);
    for (std::size_t k = 0; k < mine.size(); ++k) {
      table[2 * (first[rank] + k)] = mine[k].bytes;
      table[2 * (first[rank] + k) + 1] = mine[k].xxh3;
    }
    world_->sum(table, "the chunk table");
    // 4. Rank 0: the anchor's checkpoint directory, the manifest, LATEST.
    Manifest m;
    m.model = hf_->spec().name;
    m.version = v;
    m.base = base;
    m.writers = static_cast<std::uint32_t>(writers);
    m.changed = sums[0];
    for (std::size_t t = 0; t < tensors; ++t)
      m.digest.push_back(static_cast<Digest>(sums[3 + writers + t]));
    std::vector<std::uint64_t> outcome(2, 0);  // bytes on storage, files
    CollectReport collected;
    std::string collect_problem;
    if (rank == 0) {
      try {
        std::vector<ChunkEntry> listed;
        for (std::uint32_t w = 0; w < writers; ++w) {
          for (std::uint64_t k = 0; k < sums[3 + w]; ++k) {
            const std::size_t at = 2 * (first[w] + k);
            const auto c = static_cast<std::uint32_t>(k);
            listed.push_back({anchor ? anchor_part_name(c, w) : chunk_file_name(c, w), table[at],
                              table[at + 1], c, w});
          }
        }
        m.chunks = std::move(listed);
        outcome[0] = commit_version(*hf_, root_, m, cfg_.anchor_file_bytes);
        if (cfg_.collect) {
          // (the version is published: a failure here is reported, not a failed publication)
          try {
            collected = collect(*hf_, root_);
          } catch (const std::exception& e) {
            collect_problem = e.what();
          }
        }
        outcome[1] = m.chunks.size();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "writing the manifest");
    world_->sum(outcome, "the publication's size");
    version_ = v;
    need_anchor_ = false;
    PublishReport rep;
    rep.version = v;
    rep.base = base;
    rep.changed = sums[0];
    rep.scanned = sums[1];
    rep.files = outcome[1];
    rep.bytes = outcome[0];
    rep.dense_bytes = 2 * static_cast<std::uint64_t>(hf_->total());
    for (Digest d : m.digest)
      rep.digest += d;
    rep.collected = std::move(collected.removed);
    rep.collect_problem = std::move(collect_problem);
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

  const layout::HfModel* hf_;
  layout::ServingLayout canonical_;  // the plan's receiver side; only the runs are used
  std::filesystem::path root_;
  PublisherConfig cfg_;
  World* world_;
  Sender sender_;
  Version version_ = 0;
  std::int64_t steps_ = 0;
  std::int64_t published_step_ = 0;  // steps_ at the last publication through step()
  bool stepped_once_ = false;        // this publication follows exactly one step() (diff's base)
  bool marked_ = false;
  bool need_anchor_ = false;
  io::detail::FdGuard lock_{-1};  // rank 0: the root's writer lock
};

}  // namespace dte::storage
