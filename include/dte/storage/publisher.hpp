// SPDX-License-Identifier: Apache-2.0
// storage::Publisher: one per trainer rank, publishing versions to shared storage instead of to
// receivers over a communicator (docs/storage.md). The sender frame is the engine's
// (pipeline/frame.hpp: detect and compact); its sink is the chunk sink (storage/chunk_sink.hpp):
// every element to send goes out in canonical coordinates (HF tensor, index in the unsharded
// tensor, BF16 bits) into chunks of bounded size, each written atomically as it fills.
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
#include "dte/core/digest.hpp"
#include "dte/engine/schedule.hpp"
#include "dte/error.hpp"
#include "dte/exec/host.hpp"
#include "dte/io/file.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/topology.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/receive/core.hpp"
#include "dte/receive/route.hpp"
#include "dte/receive/staged.hpp"
#include "dte/storage/chunk.hpp"
#include "dte/storage/chunk_sink.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/retention.hpp"
#include "dte/storage/shard_base.hpp"
#include "dte/transport/collective.hpp"

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

namespace detail {

inline std::uint64_t file_size(const std::filesystem::path& p) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(p, ec);
  if (ec) throw io_error("cannot stat '" + p.string() + "': " + ec.message());
  return n;
}

}  // namespace detail

// Rank 0 of an anchor: the writers' parts (listed in `parts`, already checked by size and
// xxh3 on reading) assembled into a Hugging Face checkpoint directory in `dir`. The parts are
// committed one by one through a receiver core over the model's HF tensors
// (receive::Core::begin_full .. finish_full): every element exactly once and the world's digest,
// the rules every receiver applies to a full publication. Returns the shard files for the
// manifest. Holds the model as BF16 (2 bytes per parameter) while it writes, and one part's
// decoded chunk at a time.
inline std::vector<ChunkEntry> write_anchor_shards(const layout::HfModel& hf,
                                                   const std::filesystem::path& dir, Version v,
                                                   const std::vector<ChunkEntry>& parts,
                                                   const std::vector<Digest>& digest,
                                                   std::uint64_t shard_bytes) {
  const auto tensors = static_cast<std::size_t>(hf.size());
  std::vector<std::vector<std::uint16_t>> full(tensors);
  ReceiverTensors views;
  for (std::size_t t = 0; t < tensors; ++t) {
    full[t].resize(static_cast<std::size_t>(hf[static_cast<std::int64_t>(t)].numel()));
    views.emplace_back(full[t]);
  }
  receive::Core core = receive::hf_core(hf, "anchor v" + std::to_string(v));
  core.hold(std::move(views));
  core.begin_full(v);
  ChunkScratch scratch;
  receive::StagedWrites w;
  for (const ChunkEntry& e : parts) {
    w.clear();
    w.kind = MessageKind::full;
    w.version = v;
    const std::vector<std::byte> bytes = read_chunk_bytes(dir, e);
    const ChunkHeader expect{v, no_version, e.chunk, e.writer};
    (void)visit_chunk(hf, bytes, (dir / e.file).string(), &expect, nullptr, scratch,
                      [&](const Chunk&, std::int64_t t, std::span<const std::uint32_t> index,
                          std::span<const std::uint16_t> bits) {
                        receive::route_hf(hf, t, index.data(), bits.data(), index.size(), w);
                      });
    core.commit_part(w);
  }
  try {
    core.finish_full(digest);
  } catch (const protocol_error& x) {
    throw error(std::string(x.what()) +
                "; the trainer ranks do not cover the model exactly once (report this)");
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
  using Sender = SenderFrame<Inverse, Detect, typename Layout::plan_type, HostExecutor>;

  // One writer rank of `world` (its senders are the trainer ranks; it has no receivers).
  Publisher(const layout::HfModel& hf, const layout::TrainTopology& train,
            std::filesystem::path root, PublisherConfig cfg, World& world, HostExecutor exec = {})
      : hf_(&hf),
        root_(std::move(root)),
        cfg_(checked(cfg)),
        world_(&world),
        schedule_(cfg_.publish_every),
        sender_(hf, train, nullptr, world.rank(), schedule_.keeps_mask(), exec) {
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
    if (!schedule_.step()) {
      schedule_.mark([&] { (void)sender_.mark(access); });
      return std::nullopt;
    }
    return publish_version(access, false);
  }

  // Publishes now: a delta of what changed since the last publication, or an anchor.
  template <class Access>
  PublishReport publish(const Access& access) {
    return publish_version(access, false);
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
    dte::agree(*world_, static_cast<std::size_t>(world_->senders()), world_->rank(), mine, phase,
               [&](std::int64_t who) {
                 schedule_.require_full();
                 throw io_error("storage publication failed on writer " + std::to_string(who) +
                                " (" + phase + ")" +
                                (mine.empty() ? "; that rank's error says why" : ": " + mine) +
                                "; LATEST was not moved, readers keep the version they hold");
               });
  }

  template <class Access>
  PublishReport publish_version(const Access& access, bool want_anchor) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto rank = static_cast<std::uint32_t>(world_->rank());
    const auto writers = static_cast<std::size_t>(world_->senders());
    // 1. The version, and delta or anchor.
    std::string err;
    struct Head {
      std::uint64_t version;   // rank 0: above everything complete
      std::uint64_t ours;      // rank 0: the newest version is the one we wrote last
      std::uint64_t due_full;  // writers whose schedule is due a full publication (a refused mark)
    } head{0, 0, schedule_.full_due() ? 1u : 0u};
    if (rank == 0) {
      try {
        // Above LATEST and above any complete version LATEST does not name (a writer that died
        // between its manifest and LATEST: this one holds the lock, so that writer is gone).
        const Version latest = read_latest(root_).value_or(0);
        const Version top = std::max(latest, newest_complete(root_));
        head.version = top + 1;
        head.ours = top == version_ ? 1 : 0;
        clear_unfinished(version_dir(root_, head.version));
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "choosing the version");
    sum_fields(*world_, "choosing the version", head);
    const Version v = head.version;
    // (an anchor also when LATEST is not ours, when any writer is due one, and every
    // anchor_every versions)
    const bool anchor_due =
        head.ours == 0 || head.due_full > 0 ||
        (cfg_.anchor_every > 0 && v % static_cast<Version>(cfg_.anchor_every) == 0);
    const PublicationSchedule::Pass pass = schedule_.next(want_anchor || anchor_due);
    const bool anchor = pass.full();
    const Version base = anchor ? no_version : version_;
    const std::filesystem::path dir = version_dir(root_, v);
    const pipeline::ScanMode mode = pass.mode;
    // 2. The staged pass, chunks written as they fill.
    ScanResult scan;
    std::vector<ChunkEntry> mine;
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) throw io_error("cannot create '" + dir.string() + "': " + ec.message());
      const auto write_chunks = [&](auto& sink) {
        scan = sender_.scan(access, mode, sink);
        mine = sink.written();
      };
      // (diff needs the base to be the previous optimizer step: one step since the last one;
      // an explicit publish() after step() published covers none)
      if (cfg_.encoding == Encoding::diff && !anchor && pass.steps == 1) {
        std::optional<ShardBase> classes;
        if (cfg_.index == IndexCode::classes) {
          classes.emplace(std::type_identity<Detect>{}, *hf_, sender_.runs(),
                          [&](layout::BufferKind b) {
                            return access.theta(static_cast<std::int64_t>(rank), b);
                          });
        }
        ChunkSink<true, ChunkFiles> sink(*hf_, {v, base, 0, rank}, cfg_.zstd_level,
                                         cfg_.chunk_entries, {dir, anchor},
                                         classes ? &*classes : nullptr);
        write_chunks(sink);
      } else {
        ChunkSink<false, ChunkFiles> sink(*hf_, {v, base, 0, rank}, cfg_.zstd_level,
                                          cfg_.chunk_entries, {dir, anchor});
        write_chunks(sink);
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
    agree(err, "writing the chunks");
    if (pass.clears_masks()) sender_.clear_masks();
    // 3. Counts, digest, and every chunk's size and checksum, to every rank.
    struct Counts {
      std::uint64_t changed, scanned;
    } counts{scan.changed, scan.scanned};
    std::vector<std::uint64_t> chunks(writers, 0);  // per writer
    chunks[rank] = mine.size();
    std::vector<Digest> digest = scan.digest;  // per canonical tensor
    sum_fields(*world_, "the chunk counts and the digest", counts, chunks, digest);
    std::vector<std::uint64_t> first(writers + 1, 0);  // each writer's first row of the table
    for (std::size_t w = 0; w < writers; ++w)
      first[w + 1] = first[w] + chunks[w];
    struct ChunkRow {
      std::uint64_t bytes, xxh3;
    };
    std::vector<ChunkRow> table(first[writers], ChunkRow{0, 0});
    for (std::size_t k = 0; k < mine.size(); ++k)
      table[first[rank] + k] = {mine[k].bytes, mine[k].xxh3};
    sum_fields(*world_, "the chunk table", table);
    // 4. Rank 0: the anchor's checkpoint directory, the manifest, LATEST.
    Manifest m;
    m.model = hf_->spec().name;
    m.version = v;
    m.base = base;
    m.writers = static_cast<std::uint32_t>(writers);
    m.changed = counts.changed;
    m.digest = digest;
    struct Outcome {
      std::uint64_t bytes, files;  // on storage
    } outcome{0, 0};
    CollectReport collected;
    std::string collect_problem;
    if (rank == 0) {
      try {
        std::vector<ChunkEntry> listed;
        for (std::uint32_t w = 0; w < writers; ++w) {
          for (std::uint64_t k = 0; k < chunks[w]; ++k) {
            const ChunkRow& row = table[first[w] + k];
            const auto c = static_cast<std::uint32_t>(k);
            listed.push_back({anchor ? anchor_part_name(c, w) : chunk_file_name(c, w), row.bytes,
                              row.xxh3, c, w});
          }
        }
        m.chunks = std::move(listed);
        outcome.bytes = commit_version(*hf_, root_, m, cfg_.anchor_file_bytes);
        if (cfg_.collect) {
          // (the version is published: a failure here is reported, not a failed publication)
          try {
            collected = collect(*hf_, root_);
          } catch (const std::exception& e) {
            collect_problem = e.what();
          }
        }
        outcome.files = m.chunks.size();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "writing the manifest");
    sum_fields(*world_, "the publication's size", outcome);
    version_ = v;
    schedule_.published();
    PublishReport rep;
    rep.version = v;
    rep.base = base;
    rep.changed = counts.changed;
    rep.scanned = counts.scanned;
    rep.files = outcome.files;
    rep.bytes = outcome.bytes;
    rep.dense_bytes = 2 * static_cast<std::uint64_t>(hf_->total());
    for (Digest d : m.digest)
      rep.digest += d;
    rep.collected = std::move(collected.removed);
    rep.collect_problem = std::move(collect_problem);
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
  }

  const layout::HfModel* hf_;
  std::filesystem::path root_;
  PublisherConfig cfg_;
  World* world_;
  PublicationSchedule schedule_;
  Sender sender_;
  Version version_ = 0;
  io::detail::FdGuard lock_{-1};  // rank 0: the root's writer lock
};

}  // namespace dte::storage
