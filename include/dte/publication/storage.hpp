// SPDX-License-Identifier: Apache-2.0
// Publication messages through shared storage (docs/storage.md, docs/python.md): a message is
// a storage version already (its manifest and its chunks, publication/message.hpp), so
//   StorageWriter  writes each message as the next version of a root: the chunks as files, a
//                  full publication as an anchor (a Hugging Face checkpoint directory), the
//                  manifest, LATEST, then retention — what storage::Publisher's rank 0 does
//                  (storage::commit_version), for a trainer that publishes messages;
//   StorageSource  turns what a root holds into the messages that take a receiver from the
//                  version it holds to LATEST: the deltas along the chain, or, when the version
//                  held is not on it (a fresh or lagging-past-retention receiver), the newest
//                  anchor at or below LATEST as a full publication first. Every file is checked
//                  on reading (size, xxh3); the receiver checks the rest as for any message.
// So any receiver kind (HF tensors, an SGLang TP rank) follows storage through its apply().
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/layout/hf.hpp"
#include "dte/publication/message.hpp"
#include "dte/storage/chunk_sink.hpp"
#include "dte/storage/layout.hpp"
#include "dte/storage/manifest.hpp"
#include "dte/storage/publisher.hpp"
#include "dte/storage/read.hpp"
#include "dte/storage/reader.hpp"
#include "dte/storage/retention.hpp"

namespace dte::publication {

struct StorageWriterConfig {
  std::uint64_t anchor_file_bytes = std::uint64_t{2} << 30;
  bool collect = true;
};

struct WriteReport {
  Version version = 0;
  std::uint64_t files = 0;
  std::uint64_t bytes = 0;
  std::vector<Version> collected;
};

class StorageWriter {
 public:
  StorageWriter(const layout::ModelSpec& model, std::filesystem::path root,
                StorageWriterConfig cfg = {})
      : spec_(named_by_structure(model)), hf_(spec_), root_(std::move(root)), cfg_(cfg) {
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec) {
      throw io_error("StorageWriter: cannot create the storage root '" + root_.string() +
                     "': " + ec.message());
    }
    lock_ = storage::lock_root(root_);
  }

  // The message as the root's next version. The root's versions are the publisher's: the
  // message must be LATEST + 1, and a delta must apply to LATEST as this writer wrote it.
  WriteReport write(std::span<const std::byte> bytes) {
    View v = decode(hf_, bytes, "publication");
    storage::Manifest m = v.manifest;
    const Version top =
        std::max(storage::read_latest(root_).value_or(0), storage::newest_complete(root_));
    if (m.version != top + 1 || (!m.anchor() && (m.base != top || top != written_))) {
      throw protocol_error(
          "StorageWriter: publication v" + std::to_string(m.version) +
          (m.anchor() ? " (full)" : " on v" + std::to_string(m.base)) + " cannot follow " +
          (top == 0 ? std::string("an empty root") : "version " + std::to_string(top)) + " in '" +
          root_.string() + "'" +
          (top != 0 && written_ == 0 ? " (written by another publisher: use an empty root)" : "") +
          "; write every publication of one publisher, in order, from its first (full) one "
          "(after a failed write, a full one: TorchPublisher.publish_full())");
    }
    const std::filesystem::path dir = storage::version_dir(root_, m.version);
    storage::clear_unfinished(dir);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw io_error("cannot create '" + dir.string() + "': " + ec.message());
    for (std::size_t k = 0; k < m.chunks.size(); ++k)
      io::write_file_atomic(dir / m.chunks[k].file, v.chunks[k], "chunk");
    WriteReport rep;
    rep.version = m.version;
    rep.bytes = storage::commit_version(hf_, root_, m, cfg_.anchor_file_bytes);
    rep.files = m.chunks.size();
    written_ = m.version;
    if (cfg_.collect) rep.collected = storage::collect(hf_, root_).removed;
    return rep;
  }

 private:
  layout::ModelSpec spec_;
  layout::HfModel hf_;
  std::filesystem::path root_;
  StorageWriterConfig cfg_;
  Version written_ = 0;
  io::detail::FdGuard lock_{-1};
};

class StorageSource {
 public:
  // name: non-empty registers the receiver (ROOT/readers/<name>) with every version it reaches
  // (reached()), so retention keeps what it needs to follow deltas from there.
  StorageSource(const layout::ModelSpec& model, std::filesystem::path root, std::string name = {},
                std::size_t max_chain = 4096)
      : spec_(named_by_structure(model)),
        hf_(spec_),
        root_(std::move(root)),
        name_(std::move(name)),
        max_chain_(max_chain) {}

  // The messages, oldest first, from `held` (no_version: nothing) to LATEST; none when LATEST
  // is the version held or there is no LATEST yet.
  std::vector<Bytes> since(Version held) const {
    const std::optional<Version> latest = storage::read_latest(root_);
    if (!latest || (held != no_version && *latest == held)) return {};
    if (held != no_version && *latest < held) {
      throw protocol_error("LATEST in '" + root_.string() + "' is " + std::to_string(*latest) +
                           ", older than the version " + std::to_string(held) + " held");
    }
    const std::vector<storage::Manifest> chain =
        storage::chain_to(hf_, root_, *latest, held, max_chain_);
    std::vector<Bytes> out;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it)
      out.push_back(it->anchor() ? anchor_message(*it) : delta_message(*it));
    return out;
  }

  // The receiver now holds v: registered, when named.
  void reached(Version v) const {
    if (!name_.empty()) storage::register_reader(root_, name_, v);
  }

 private:
  [[nodiscard]] Bytes delta_message(const storage::Manifest& m) const {
    const std::filesystem::path dir = storage::version_dir(root_, m.version);
    std::vector<Bytes> blobs;
    for (const storage::ChunkEntry& e : m.chunks)
      blobs.push_back(storage::read_chunk_bytes(dir, e));
    return encode(spec_, m, blobs);
  }

  // An anchor's checkpoint, every element checked by read_anchor, as one full publication in
  // chunks of at most 2^24 elements (a tensor larger than that spans several).
  [[nodiscard]] Bytes anchor_message(const storage::Manifest& anchor) const {
    std::vector<Bytes> blobs;
    storage::ChunkSink<false, storage::ChunkMemory> sink(hf_, {anchor.version, no_version, 0, 0}, 1,
                                                         std::uint64_t{1} << 24, {&blobs, true});
    (void)storage::read_anchor(hf_, storage::version_dir(root_, anchor.version), anchor,
                               [&](std::int64_t t, const auto& bits) {
                                 for (std::size_t i = 0; i < bits.size(); ++i)
                                   sink.put(static_cast<std::uint32_t>(t),
                                            static_cast<std::uint32_t>(i), bits[i]);
                               });
    sink.flush();
    storage::Manifest m = anchor;
    m.chunks = sink.written();
    return encode(spec_, m, blobs);
  }

  layout::ModelSpec spec_;
  layout::HfModel hf_;
  std::filesystem::path root_;
  std::string name_;
  std::size_t max_chain_;
};

}  // namespace dte::publication
