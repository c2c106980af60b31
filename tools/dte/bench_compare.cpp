// SPDX-License-Identifier: Apache-2.0
// dte bench compare: one synthetic AdamW run, published to the same receivers four ways, in one
// process, on the same data (the trainer is a pure function of seed, element and step, so each
// approach replays exactly the same steps):
//   dte            snapshot-free sparse: the engine's sender ranks and receivers (same cluster),
//                  and the storage publisher and a reader (across clusters);
//   snapshot-diff  PULSE / slime / verl style: a BF16 snapshot of the previous weights, the
//                  current weights converted to canonical BF16 and diffed by bit pattern on the
//                  fly, (int32 index, BF16 value) per tensor within a cluster and PULSE's
//                  encoding (u8/u16/u32 gaps, zstd -1) written to storage across clusters, the
//                  snapshot updated; each receiver replica scatters the delta into its shards;
//   dense          the whole model converted to the receiver layout in BF16 and sent;
//   checkpoint     ByteCheckpoint style: a full canonical BF16 HF checkpoint written to storage
//                  every version; the receivers load it and re-shard it.
// Per approach: sender and apply seconds (the slowest trainer rank, the receivers in parallel),
// bytes, and peak extra heap of the sender and receiver side measured by the metered operator
// new (alloc_meter.hpp); end-to-end for three links derived as measured compute plus bytes over
// bandwidth (and, for the approaches that copy the weights to the host on a GPU system, that
// copy at PCIe Gen5 speed, labelled derived). Every approach ends checked bit-identical to the
// trainer's BF16 weights.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "alloc_meter.hpp"
#include "commands.hpp"
#include "dte/bounds.hpp"
#include "dte/detect/detect.hpp"
#include "dte/engine/receiver.hpp"
#include "dte/engine/sender.hpp"
#include "dte/exec/host.hpp"
#include "dte/io/file.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/plan.hpp"
#include "dte/optim/adam.hpp"
#include "dte/pipeline/frame.hpp"
#include "dte/sim/access.hpp"
#include "dte/sim/baselines.hpp"
#include "dte/sim/storage_cluster.hpp"
#include "dte/sim/synthetic_trainer.hpp"

namespace dte::tool {

namespace {

using Sender = HostSenderRank<AdamWInverse, BF16Detect, layout::TransferPlan, HostExecutor>;
using Converter = SenderFrame<AdamWInverse, BF16Detect, layout::TransferPlan, HostExecutor>;

// The converter of the snapshot baselines (Megatron shard -> canonical BF16): a full pass of the
// sender frame whose sink calls emit(tensor, index, bits) for every element the rank sends, in
// shard order.
template <class Emit>
struct EveryElement {
  Emit emit;
  void begin(const Converter&, pipeline::ScanMode) {}
  void prepare(const Converter&, layout::BufferKind, std::size_t, Converter::Tile&) {}
  void changed(const Converter&, layout::BufferKind, std::size_t, const Converter::Tile&) {
    throw error("dte bench compare: the converter only runs full passes");
  }
  void all(const Converter& f, layout::BufferKind b, std::size_t t, const Converter::Tile& s) {
    f.for_each_sent_piece(
        b, t, s,
        [&](const pipeline::Run& run, std::int64_t at, std::span<const std::uint16_t> bits) {
          const std::uint32_t first = f.canonical_index(run, run.shard_begin + at);
          for (std::size_t j = 0; j < bits.size(); ++j)
            emit(static_cast<std::uint32_t>(run.tensor), first + static_cast<std::uint32_t>(j),
                 bits[j]);
        });
  }
  template <class Access>
  void end(const Converter&, const Access&, pipeline::ScanMode) {}
  [[nodiscard]] std::uint64_t entries() const noexcept { return 0; }
};

template <class Access, class Emit>
void convert(Converter& c, const Access& access, Emit&& emit) {
  EveryElement<Emit&> sink{emit};
  (void)c.scan(access, pipeline::ScanMode::all, sink);
}
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// Heap accounts (alloc_meter.hpp): the model, the trainer and the receivers' tensors are
// charged to 0 (not extra).
constexpr int sender_account = 1, receiver_account = 2, storage_sender_account = 3,
              storage_receiver_account = 4;

struct Link {
  const char* name;
  double bytes_per_s;
  bool cross_cluster;  // through shared storage
};
constexpr Link links[] = {
    {"450GBps", 450e9, false}, {"50GBps", 50e9, false}, {"10gbps", 1.25e9, true}};
constexpr double pcie_bytes_per_s = 50e9;  // PCIe Gen5 x16, for the derived device-to-host copy

struct CompareOptions {
  std::string model = "qwen3-8b", train = "tp=2", infer = "tp=2";
  std::int64_t layers = 1, vocab = 4096;
  int steps = 3;   // measured publications per approach (the mean is reported)
  int series = 0;  // dte only: changed fraction and bytes of this many publications
  double lr = 1e-6;
  int threads = 0;
  bool quick = false, json = false;
  std::string dir;  // storage root (default: a temporary directory, removed)
};

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Path {
  double sender_s = 0, apply_s = 0;
  std::uint64_t bytes = 0;
  std::int64_t sender_peak = 0, receiver_peak = 0;
};

struct Figures {
  std::string name;
  Path cluster, storage;         // storage: the cross-cluster path (10 Gbps)
  bool copies_to_host = false;   // on a GPU system the weights go to host memory first
  std::uint64_t changed = 0;     // elements sent per publication (mean), this approach's count
  double sender_read_bytes = 0;  // what the sender must read per publication, nominal
};

// The run everything shares: model, topologies, the receivers' tensors.
struct Setup {
  layout::ModelSpec spec;
  layout::TrainTopology train;
  layout::InferTopology infer;
  std::unique_ptr<layout::HfModel> hf;
  std::unique_ptr<layout::ServingLayout> recv;
  HostExecutor exec;
  CompareOptions o;
  fs::path root;
  std::int64_t full_elements = 0;  // the whole model (its own layers and vocabulary)

  [[nodiscard]] sim::SyntheticTrainer trainer() const {
    return sim::SyntheticTrainer(*hf, train, {.lr = o.lr, .warmup_steps = 0});
  }
};

// The receivers' tensors (the model: charged to account 0), zero-filled.
struct Tensors {
  std::vector<std::vector<std::vector<std::uint16_t>>> rank;  // [receiver rank][tensor]
  explicit Tensors(const Setup& s) {
    rank.resize(static_cast<std::size_t>(s.infer.ranks()));
    for (auto& r : rank) {
      for (std::int64_t k = 0; k < s.recv->size(); ++k)
        r.emplace_back(static_cast<std::size_t>((*s.recv)[k].numel), std::uint16_t{0});
    }
  }
  [[nodiscard]] ReceiverTensors views(std::size_t d) {
    ReceiverTensors v;
    for (auto& t : rank[d])
      v.emplace_back(t);
    return v;
  }
  // Receiver rank d = replica * tp + ts, as the layout numbers them.
  void put(const layout::ServingLayout& recv, std::int64_t tensor, std::int64_t index,
           std::uint16_t bits) {
    const std::size_t tp = static_cast<std::size_t>(recv.topology().tp);
    recv.targets(layout::Canonical{tensor, index}, [&](const layout::ReceiverElement& e) {
      for (std::size_t r = 0; r * tp < rank.size(); ++r) {
        rank[r * tp + static_cast<std::size_t>(e.ts)][static_cast<std::size_t>(e.tensor)]
            [static_cast<std::size_t>(e.index)] = bits;
      }
    });
  }
};

// The trainer's BF16 weights in the receivers' layout: what every approach must end with.
void check_identical(const Setup& s, const sim::SyntheticTrainer& t, const Tensors& got,
                     const std::string& approach) {
  Tensors want(s);
  const sim::AdamWAccess access{&t};
  for (std::int64_t r = 0; r < s.train.world(); ++r) {
    Converter conv(*s.hf, s.train, nullptr, r, false, s.exec);
    convert(conv, access, [&](std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
      want.put(*s.recv, tensor, index, bits);
    });
  }
  if (want.rank != got.rank) {
    throw error("dte bench compare: " + approach +
                " ended with receivers that differ from the trainer's BF16 weights; report this "
                "to the dte developers");
  }
}

// Runs f charged to account a; returns its seconds.
template <class F>
double timed(int a, F&& f) {
  const meter::Scope scope(a);
  const auto t0 = Clock::now();
  f();
  return since(t0);
}

// Measured publications start here: what each account holds now stays counted (the snapshot, the
// engine's buffers), and its peak restarts from it.
struct PeakWatch {
  std::int64_t base[meter::accounts] = {};
  PeakWatch() {
    for (int a = 0; a < meter::accounts; ++a)
      base[a] = meter::figures(a).current;
  }
  void start() {
    for (int a = 1; a < meter::accounts; ++a)
      meter::reset_peak(a);
  }
  [[nodiscard]] std::int64_t extra(int a) const { return meter::figures(a).peak - base[a]; }
};

std::vector<std::uint8_t> read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(fs::file_size(path)));
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (!in) throw io_error("dte bench compare: cannot read " + path.string());
  return out;
}

// The engine's ranks over the receivers' tensors: a sender per trainer rank (charged to the
// sender account) and a receiver per inference rank (receiver account).
struct EngineRanks {
  std::vector<std::unique_ptr<Sender>> senders;
  std::vector<Receiver> receivers;

  EngineRanks(const Setup& s, Tensors& tensors) {
    (void)timed(sender_account, [&] {
      for (std::int64_t r = 0; r < s.train.world(); ++r)
        senders.push_back(std::make_unique<Sender>(*s.hf, s.train, *s.recv, r, false, s.exec));
    });
    (void)timed(receiver_account, [&] {
      for (std::int64_t d = 0; d < s.infer.ranks(); ++d)
        receivers.emplace_back(*s.hf, *s.recv, d, s.train.world(),
                               tensors.views(static_cast<std::size_t>(d)));
    });
  }

  // One publication: each rank's messages (p.sender_s: the slowest rank), then every receiver
  // applies what it got (p.apply_s). Returns the elements sent.
  template <class Access>
  std::uint64_t publish(const Setup& s, const Access& access, MessageKind kind, Version version,
                        Path& p, const char* approach) {
    const bool full = kind == MessageKind::full;
    std::vector<std::vector<Payload>> out(senders.size());
    std::uint64_t changed = 0;
    for (std::size_t r = 0; r < senders.size(); ++r) {
      p.sender_s =
          std::max(p.sender_s, timed(sender_account, [&] {
                     const ScanResult res = senders[r]->scan(
                         access, full ? pipeline::ScanMode::all : pipeline::ScanMode::detect);
                     changed += res.changed;
                     out[r] = senders[r]->finish(kind, version, full ? no_version : version - 1);
                     p.bytes += senders[r]->payload_bytes();
                   }));
    }
    p.apply_s += timed(receiver_account, [&] {
      s.exec.for_each(receivers.size(), [&](std::size_t d, int) {
        Inbox inbox;
        for (std::size_t r = 0; r < out.size(); ++r) {
          Bytes bytes;
          for (const auto& part : out[r][d])
            bytes.insert(bytes.end(), part.begin(), part.end());
          inbox.emplace_back(static_cast<std::int64_t>(r), std::move(bytes));
        }
        const ApplyResult a = receivers[d].apply(version, inbox);
        if (!a.committed()) {
          throw error(std::string("dte bench compare: a ") + approach +
                      " receiver refused: " + a.refusal);
        }
      });
    });
    (void)timed(sender_account, [&] {
      for (auto& x : senders)
        x->release();
    });
    return changed;
  }
};

// A storage reader over every replica of `tensors` (charged to account a).
std::unique_ptr<storage::Reader> make_reader(const Setup& s, const fs::path& root, Tensors& tensors,
                                             int a) {
  const meter::Scope scope(a);
  std::vector<std::int64_t> replicas;
  std::vector<ReceiverTensors> views;
  for (std::int64_t r = 0; r < s.infer.replicas; ++r)
    replicas.push_back(r);
  for (std::size_t d = 0; d < tensors.rank.size(); ++d)
    views.push_back(tensors.views(d));
  return std::make_unique<storage::Reader>(*s.hf, *s.recv, root, replicas, std::move(views));
}

// A little-endian u32 at `at` (the callers have checked the bounds).
std::uint32_t get32(std::span<const std::uint8_t> in, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t b = 0; b < 4; ++b)
    v |= std::uint32_t{in[at + b]} << (8 * b);
  return v;
}

// --- dte ---------------------------------------------------------------------------------------

Figures run_dte(const Setup& s, nlohmann::ordered_json* series) {
  Figures f;
  f.name = "dte";
  sim::SyntheticTrainer t = s.trainer();
  const sim::AdamWAccess access{&t};
  Tensors tensors(s), storage_tensors(s);
  const fs::path root = s.root / "dte";
  fs::remove_all(root);
  const PeakWatch watch;
  EngineRanks ranks(s, tensors);
  std::unique_ptr<sim::StorageCluster> writers;
  (void)timed(storage_sender_account, [&] {
    storage::PublisherConfig cfg;
    cfg.zstd_level = 1;
    writers = std::make_unique<sim::StorageCluster>(*s.hf, s.train, root, cfg, s.o.threads);
  });
  const std::unique_ptr<storage::Reader> reader =
      make_reader(s, root, storage_tensors, storage_receiver_account);

  Version version = 0;
  auto publish = [&](MessageKind kind, Path& p) {
    return ranks.publish(s, access, kind, version, p, "dte");
  };
  auto publish_storage = [&](Path& p) {
    p.sender_s += timed(storage_sender_account, [&] {
      const storage::PublishReport rep = writers->publish(access);
      p.bytes += rep.bytes;
    });
    p.apply_s += timed(storage_receiver_account, [&] {
      const storage::ReadReport rep = reader->poll();
      if (!rep.ok()) throw error("dte bench compare: the dte storage reader failed: " + rep.error);
    });
  };

  for (int w = 0; w < 3; ++w)
    t.step();
  Path unused;
  (void)publish(MessageKind::full, unused);
  publish_storage(unused);
  PeakWatch measured = watch;
  measured.start();
  for (int k = 0; k < s.o.steps; ++k) {
    t.step();
    ++version;
    Path one;
    f.changed += publish(MessageKind::delta, one);
    f.cluster.sender_s += one.sender_s;
    f.cluster.apply_s += one.apply_s;
    f.cluster.bytes += one.bytes;
    publish_storage(f.storage);
  }
  f.cluster.sender_peak = measured.extra(sender_account);
  f.cluster.receiver_peak = measured.extra(receiver_account);
  f.storage.sender_peak = measured.extra(storage_sender_account);
  f.storage.receiver_peak = measured.extra(storage_receiver_account);
  check_identical(s, t, tensors, "dte");
  check_identical(s, t, storage_tensors, "dte (storage)");
  f.sender_read_bytes = 12.0 * static_cast<double>(s.hf->total());  // theta, exp_avg, exp_avg_sq

  if (series != nullptr) {
    for (int k = 0; k < s.o.series; ++k) {
      t.step();
      ++version;
      Path one, stored;
      const std::uint64_t changed = publish(MessageKind::delta, one);
      publish_storage(stored);
      series->push_back(
          {{"step", k + 1},
           {"changed_fraction", static_cast<double>(changed) / static_cast<double>(s.hf->total())},
           {"bytes", one.bytes},
           {"storage_bytes", stored.bytes}});
    }
    if (s.o.series > 0) check_identical(s, t, tensors, "dte (series)");
  }
  fs::remove_all(root);
  return f;
}

// --- snapshot-diff -----------------------------------------------------------------------------

Figures run_snapshot_diff(const Setup& s) {
  Figures f;
  f.name = "snapshot-diff";
  f.copies_to_host = true;
  sim::SyntheticTrainer t = s.trainer();
  const sim::AdamWAccess access{&t};
  Tensors tensors(s), storage_tensors(s);
  const fs::path root = s.root / "snapshot-diff";
  fs::remove_all(root);
  fs::create_directories(root);
  const PeakWatch watch;
  // Per trainer rank: its converter (Megatron shard -> canonical BF16) and its snapshot, one
  // value per element it owns, in the converter's (fixed) order.
  std::vector<std::unique_ptr<Converter>> conv;
  std::vector<std::vector<std::uint16_t>> snapshot(static_cast<std::size_t>(s.train.world()));
  (void)timed(sender_account, [&] {
    for (std::int64_t r = 0; r < s.train.world(); ++r)
      conv.push_back(std::make_unique<Converter>(*s.hf, s.train, nullptr, r, false, s.exec));
  });
  struct Delta {  // one rank's delta, per canonical tensor
    std::map<std::uint32_t, std::pair<std::vector<std::uint32_t>, std::vector<std::uint16_t>>>
        tensors;
  };
  // Converts rank r's weights and diffs them against its snapshot, updating it.
  auto diff = [&](std::size_t r, Delta& d) {
    std::size_t k = 0;
    auto& snap = snapshot[r];
    convert(*conv[r], access, [&](std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
      if (bits != snap[k]) {
        auto& [idx, val] = d.tensors[tensor];
        idx.push_back(index);
        val.push_back(bits);
        snap[k] = bits;
      }
      ++k;
    });
  };
  for (int w = 0; w < 3; ++w)
    t.step();
  // The first sync: the snapshot filled, every element to every receiver.
  (void)timed(sender_account, [&] {
    for (std::size_t r = 0; r < conv.size(); ++r) {
      convert(*conv[r], access, [&](std::uint32_t tensor, std::uint32_t index, std::uint16_t bits) {
        snapshot[r].push_back(bits);
        tensors.put(*s.recv, tensor, index, bits);
        storage_tensors.put(*s.recv, tensor, index, bits);
      });
      snapshot[r].shrink_to_fit();
    }
  });
  PeakWatch measured = watch;
  measured.start();
  const auto replicas = static_cast<std::uint64_t>(s.infer.replicas);
  for (int k = 0; k < s.o.steps; ++k) {
    t.step();
    // Same cluster: per rank, diff, then (int32, BF16) per tensor, broadcast to each replica;
    // across clusters: the same delta PULSE-encoded, zstd -1, written to storage.
    std::vector<Delta> deltas(conv.size());
    std::vector<std::vector<std::uint8_t>> wire(conv.size()), files(conv.size());
    double slowest = 0, slowest_storage = 0;
    for (std::size_t r = 0; r < conv.size(); ++r) {
      const double diff_s = timed(sender_account, [&] {
        diff(r, deltas[r]);
        for (const auto& [tensor, d] : deltas[r].tensors) {
          sim::baselines::put32(wire[r], tensor);
          sim::baselines::put32(wire[r], static_cast<std::uint32_t>(d.first.size()));
          sim::baselines::areal_append(wire[r], d.first, d.second);
        }
        for (const auto& [tensor, d] : deltas[r].tensors)
          f.changed += d.first.size();
      });
      slowest = std::max(slowest, diff_s);
      const double encode_s = timed(storage_sender_account, [&] {
        std::vector<std::uint8_t> plain;
        for (const auto& [tensor, d] : deltas[r].tensors) {
          sim::baselines::put32(plain, tensor);
          sim::baselines::put32(plain, static_cast<std::uint32_t>(d.first.size()));
          sim::baselines::pulse_append(plain, d.first, d.second);
        }
        files[r] = sim::baselines::zstd1(plain);
        io::write_file_atomic(root / ("delta-" + std::to_string(k) + "-" + std::to_string(r)),
                              std::as_bytes(std::span(files[r])), "PULSE delta");
      });
      // (the storage path diffs too: the same diff, timed once)
      slowest_storage = std::max(slowest_storage, diff_s + encode_s);
      f.cluster.bytes += wire[r].size() * replicas;
      f.storage.bytes += files[r].size();
    }
    f.cluster.sender_s += slowest;
    f.storage.sender_s += slowest_storage;
    // Each replica scatters every rank's delta into its TP shards.
    f.cluster.apply_s += timed(receiver_account, [&] {
      for (std::size_t r = 0; r < wire.size(); ++r) {
        const std::vector<std::uint8_t> received = wire[r];  // the receive buffer
        std::size_t at = 0;
        while (at < received.size()) {
          const std::uint32_t tensor = get32(received, at), count = get32(received, at + 4);
          at += 8;
          const std::size_t values = at + 4 * std::size_t{count};
          for (std::size_t e = 0; e < count; ++e) {
            const auto bits = static_cast<std::uint16_t>(received[values + 2 * e] |
                                                         (received[values + 2 * e + 1] << 8));
            tensors.put(*s.recv, tensor, get32(received, at + 4 * e), bits);
          }
          at += 6 * std::size_t{count};
        }
      }
    });
    f.storage.apply_s += timed(storage_receiver_account, [&] {
      for (std::size_t r = 0; r < files.size(); ++r) {
        const std::vector<std::uint8_t> plain = sim::baselines::unzstd(
            read_all(root / ("delta-" + std::to_string(k) + "-" + std::to_string(r))));
        std::size_t at = 0;
        std::vector<std::uint32_t> idx;
        std::vector<std::uint16_t> val;
        while (at < plain.size()) {
          const std::uint32_t tensor = get32(plain, at), count = get32(plain, at + 4);
          at += 8;
          idx.clear();
          val.clear();
          sim::baselines::pulse_read(plain, at, count, idx, val);
          for (std::size_t e = 0; e < idx.size(); ++e)
            storage_tensors.put(*s.recv, tensor, idx[e], val[e]);
        }
      }
    });
  }
  f.cluster.sender_peak = measured.extra(sender_account);
  f.cluster.receiver_peak = measured.extra(receiver_account);
  // The storage path holds the same snapshot (charged once, to the same-cluster account) plus
  // its own encoding buffers.
  f.storage.sender_peak = measured.extra(sender_account) + measured.extra(storage_sender_account);
  f.storage.receiver_peak = measured.extra(storage_receiver_account);
  check_identical(s, t, tensors, "snapshot-diff");
  check_identical(s, t, storage_tensors, "snapshot-diff (storage)");
  f.sender_read_bytes = 6.0 * static_cast<double>(s.hf->total());  // FP32 weights + snapshot
  fs::remove_all(root);
  return f;
}

// --- dense -------------------------------------------------------------------------------------

Figures run_dense(const Setup& s) {
  Figures f;
  f.name = "dense";
  sim::SyntheticTrainer t = s.trainer();
  const sim::AdamWAccess access{&t};
  Tensors tensors(s);
  const PeakWatch watch;
  EngineRanks ranks(s, tensors);
  for (int w = 0; w < 3; ++w)
    t.step();
  PeakWatch measured = watch;
  measured.start();
  for (int k = 0; k <= s.o.steps; ++k) {
    if (k > 0) t.step();
    Path one;
    (void)ranks.publish(s, access, MessageKind::full, static_cast<Version>(k), one, "dense");
    if (k == 0) {  // the first sync is every approach's start; not measured
      measured.start();
      continue;
    }
    f.cluster.sender_s += one.sender_s;
    f.cluster.apply_s += one.apply_s;
    f.cluster.bytes += one.bytes;
  }
  f.cluster.sender_peak = measured.extra(sender_account);
  f.cluster.receiver_peak = measured.extra(receiver_account);
  f.storage = f.cluster;  // the same bytes over any link
  f.changed = static_cast<std::uint64_t>(s.o.steps) * s.hf->total();
  check_identical(s, t, tensors, "dense");
  f.sender_read_bytes = 4.0 * static_cast<double>(s.hf->total());
  return f;
}

// --- checkpoint --------------------------------------------------------------------------------

Figures run_checkpoint(const Setup& s) {
  Figures f;
  f.name = "checkpoint";
  f.copies_to_host = true;
  sim::SyntheticTrainer t = s.trainer();
  const sim::AdamWAccess access{&t};
  Tensors tensors(s);
  const fs::path root = s.root / "checkpoint";
  fs::remove_all(root);
  const PeakWatch watch;
  std::unique_ptr<sim::StorageCluster> writers;
  (void)timed(sender_account, [&] {
    storage::PublisherConfig cfg;
    cfg.anchor_every = 1;  // every version a full HF checkpoint
    writers = std::make_unique<sim::StorageCluster>(*s.hf, s.train, root, cfg, s.o.threads);
  });
  const std::unique_ptr<storage::Reader> reader = make_reader(s, root, tensors, receiver_account);
  for (int w = 0; w < 3; ++w)
    t.step();
  PeakWatch measured = watch;
  for (int k = 0; k <= s.o.steps; ++k) {
    if (k > 0) t.step();
    Path one;
    one.sender_s = timed(sender_account, [&] {
      const storage::PublishReport rep = writers->publish(access);
      if (!rep.anchor()) throw error("dte bench compare: the checkpoint was not a full one");
      one.bytes = rep.bytes;
    });
    one.apply_s = timed(receiver_account, [&] {
      const storage::ReadReport rep = reader->poll();
      if (!rep.ok()) throw error("dte bench compare: the checkpoint reader failed: " + rep.error);
    });
    if (k == 0) {
      measured.start();
      continue;
    }
    f.cluster.sender_s += one.sender_s;
    f.cluster.apply_s += one.apply_s;
    f.cluster.bytes += one.bytes;
  }
  f.cluster.sender_peak = measured.extra(sender_account);
  f.cluster.receiver_peak = measured.extra(receiver_account);
  f.storage = f.cluster;  // a checkpoint goes through storage on any link
  f.changed = static_cast<std::uint64_t>(s.o.steps) * s.hf->total();
  check_identical(s, t, tensors, "checkpoint");
  f.sender_read_bytes = 4.0 * static_cast<double>(s.hf->total());
  fs::remove_all(root);
  return f;
}

// --- the report --------------------------------------------------------------------------------

// The machine's memory read, measured: three float arrays of the model's size, summed.
double memory_read_gbs(const Setup& s) {
  const auto n = static_cast<std::size_t>(s.hf->total());
  std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 3.0f);
  double best = 1e300, sink = 0;
  for (int r = 0; r < 5; ++r) {
    std::vector<double> part(static_cast<std::size_t>(s.exec.threads()), 0.0);
    const auto t0 = Clock::now();
    const std::size_t block = 1 << 16, blocks = (n + block - 1) / block;
    s.exec.for_each(blocks, [&](std::size_t k, int w) {
      double acc = 0;
      const std::size_t end = std::min(n, (k + 1) * block);
      for (std::size_t i = k * block; i < end; ++i)
        acc += a[i] + b[i] + c[i];
      part[static_cast<std::size_t>(w)] += acc;
    });
    best = std::min(best, since(t0));
    for (double x : part)
      sink += x;
  }
  return sink < 0 ? 0.0 : 12.0 * static_cast<double>(n) / best / 1e9;
}

nlohmann::ordered_json report(const Setup& s, const std::vector<Figures>& all, double mem_gbs,
                              const nlohmann::ordered_json& series) {
  const double steps = s.o.steps;
  auto e2e = [&](const Figures& f, const Link& l) {
    const Path& p = l.cross_cluster ? f.storage : f.cluster;
    const double d2h =
        f.copies_to_host ? 2.0 * static_cast<double>(s.hf->total()) / pcie_bytes_per_s : 0.0;
    return (p.sender_s + p.apply_s + static_cast<double>(p.bytes) / l.bytes_per_s) / steps + d2h;
  };
  nlohmann::ordered_json j;
  j["model"] = s.spec.name;
  j["layers"] = s.spec.layers;
  j["vocab"] = s.spec.vocab;
  j["elements"] = s.hf->total();
  j["full_model_elements"] = s.full_elements;
  j["train"] = s.o.train;
  j["infer"] = s.o.infer;
  j["lr"] = s.o.lr;
  j["steps"] = s.o.steps;
  j["threads"] = s.exec.threads();
  j["memory_read_gbs"] = mem_gbs;
  j["pcie_gbs_derived"] = pcie_bytes_per_s / 1e9;
  nlohmann::ordered_json approaches = nlohmann::ordered_json::object();
  std::map<std::string, const Figures*> by_name;
  for (const Figures& f : all) {
    by_name[f.name] = &f;
    nlohmann::ordered_json a;
    a["sender_s"] = f.cluster.sender_s / steps;
    a["apply_s"] = f.cluster.apply_s / steps;
    a["bytes"] = static_cast<double>(f.cluster.bytes) / steps;
    a["sender_peak_extra_bytes"] = f.cluster.sender_peak;
    a["receiver_peak_extra_bytes"] = f.cluster.receiver_peak;
    a["changed_fraction"] =
        static_cast<double>(f.changed) / steps / static_cast<double>(s.hf->total());
    a["sender_ns_per_element"] =
        1e9 * f.cluster.sender_s / steps / static_cast<double>(s.hf->total());
    // per element, so it scales to the whole model (extrapolated, not measured)
    a["full_model_sender_s_extrapolated"] = f.cluster.sender_s / steps /
                                            static_cast<double>(s.hf->total()) *
                                            static_cast<double>(s.full_elements);
    a["sender_memory_fraction"] =
        f.cluster.sender_s > 0 ? f.sender_read_bytes / (f.cluster.sender_s / steps) / 1e9 / mem_gbs
                               : 0.0;
    a["storage"] = {{"sender_s", f.storage.sender_s / steps},
                    {"apply_s", f.storage.apply_s / steps},
                    {"bytes", static_cast<double>(f.storage.bytes) / steps},
                    {"sender_peak_extra_bytes", f.storage.sender_peak},
                    {"receiver_peak_extra_bytes", f.storage.receiver_peak}};
    a["derived_device_to_host_s"] =
        f.copies_to_host ? 2.0 * static_cast<double>(s.hf->total()) / pcie_bytes_per_s : 0.0;
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    for (const Link& l : links)
      e[l.name] = e2e(f, l);
    a["e2e_s"] = e;
    approaches[f.name] = a;
  }
  j["approaches"] = approaches;
  const Figures& d = *by_name.at("dte");
  auto ratio = [&](const char* other, const Link& l) {
    return e2e(*by_name.at(other), l) / e2e(d, l);
  };
  j["speedup_vs_checkpoint_10gbps"] = ratio("checkpoint", links[2]);
  j["speedup_vs_snapshot_10gbps"] = ratio("snapshot-diff", links[2]);
  j["speedup_vs_checkpoint_50GBps"] = ratio("checkpoint", links[1]);
  j["speedup_vs_snapshot_50GBps"] = ratio("snapshot-diff", links[1]);
  const Figures& snap = *by_name.at("snapshot-diff");
  j["sender_memory_ratio_vs_snapshot"] = snap.cluster.sender_peak > 0
                                             ? static_cast<double>(d.cluster.sender_peak) /
                                                   static_cast<double>(snap.cluster.sender_peak)
                                             : 0.0;
  j["storage_bytes_per_changed_element"] = {
      {"dte",
       d.changed ? static_cast<double>(d.storage.bytes) / static_cast<double>(d.changed) : 0.0},
      {"pulse", snap.changed
                    ? static_cast<double>(snap.storage.bytes) / static_cast<double>(snap.changed)
                    : 0.0}};
  j["series"] = series;
  return j;
}

void print(const nlohmann::ordered_json& j) {
  std::printf(
      "dte bench compare: %s, %lld layers (vocab %lld), %lld elements, %s -> %s, lr %g, mean of "
      "%d publications, %d threads; memory read %.1f GB/s\n",
      j["model"].get<std::string>().c_str(), j["layers"].get<long long>(),
      j["vocab"].get<long long>(), j["elements"].get<long long>(),
      j["train"].get<std::string>().c_str(), j["infer"].get<std::string>().c_str(),
      j["lr"].get<double>(), j["steps"].get<int>(), j["threads"].get<int>(),
      j["memory_read_gbs"].get<double>());
  std::printf("%-14s %9s %9s %12s %12s %12s | %9s %9s %12s | %10s %10s %10s\n", "approach",
              "sender s", "apply s", "bytes", "send peak", "recv peak", "stor snd", "stor app",
              "stor bytes", "e2e 450GB", "e2e 50GB", "e2e 10Gb");
  for (const auto& [name, a] : j["approaches"].items()) {
    std::printf(
        "%-14s %9.4f %9.4f %12.0f %12lld %12lld | %9.4f %9.4f %12.0f | %10.4f %10.4f %10.4f\n",
        name.c_str(), a["sender_s"].get<double>(), a["apply_s"].get<double>(),
        a["bytes"].get<double>(), a["sender_peak_extra_bytes"].get<long long>(),
        a["receiver_peak_extra_bytes"].get<long long>(), a["storage"]["sender_s"].get<double>(),
        a["storage"]["apply_s"].get<double>(), a["storage"]["bytes"].get<double>(),
        a["e2e_s"]["450GBps"].get<double>(), a["e2e_s"]["50GBps"].get<double>(),
        a["e2e_s"]["10gbps"].get<double>());
  }
  std::printf(
      "dte vs checkpoint: %.2fx at 10 Gbps, %.2fx at 50 GB/s; vs snapshot-diff: %.2fx at 10 Gbps, "
      "%.2fx at 50 GB/s; sender peak extra memory %.3f of snapshot-diff's; storage bytes per "
      "changed element: dte %.3f, PULSE %.3f\n",
      j["speedup_vs_checkpoint_10gbps"].get<double>(),
      j["speedup_vs_checkpoint_50GBps"].get<double>(),
      j["speedup_vs_snapshot_10gbps"].get<double>(), j["speedup_vs_snapshot_50GBps"].get<double>(),
      j["sender_memory_ratio_vs_snapshot"].get<double>(),
      j["storage_bytes_per_changed_element"]["dte"].get<double>(),
      j["storage_bytes_per_changed_element"]["pulse"].get<double>());
}

int run_compare(CompareOptions o) {
  if (o.quick) {
    o.layers = 1;
    o.steps = 1;
    o.series = 0;
    if (o.model == "qwen3-8b") o.model = "small-qwen3";
  }
  Setup s{io::load_model(o.model),
          layout::parse_train_topology(o.train),
          layout::parse_infer_topology(o.infer),
          nullptr,
          nullptr,
          HostExecutor(o.threads),
          o,
          {},
          0};
  if (o.layers > 0) s.spec.layers = o.layers;
  if (o.vocab > 0) s.spec.vocab = o.vocab;
  s.spec.validate();
  s.full_elements = layout::HfModel(io::load_model(o.model)).total();
  layout::validate(s.spec, s.train);
  layout::validate(s.spec, s.infer);
  s.hf = std::make_unique<layout::HfModel>(s.spec);
  s.recv = std::make_unique<layout::ServingLayout>(*s.hf, s.infer);
  const bool temporary = o.dir.empty();
  s.root = temporary
               ? fs::temp_directory_path() / ("dte-bench-compare-" + std::to_string(::getpid()))
               : fs::path(o.dir);
  fs::create_directories(s.root);
  nlohmann::ordered_json series = nlohmann::ordered_json::array();
  std::vector<Figures> all;
  try {
    const double mem = memory_read_gbs(s);
    all.push_back(run_dte(s, &series));
    all.push_back(run_snapshot_diff(s));
    all.push_back(run_dense(s));
    all.push_back(run_checkpoint(s));
    const double mem_after = memory_read_gbs(s);
    const nlohmann::ordered_json j = report(s, all, std::max(mem, mem_after), series);
    if (o.json) {
      std::printf("%s\n", j.dump().c_str());
    } else {
      print(j);
    }
  } catch (...) {
    if (temporary) fs::remove_all(s.root);
    throw;
  }
  if (temporary) fs::remove_all(s.root);
  return exit_ok;
}

}  // namespace

void register_bench_compare(CLI::App& bench, int& status) {
  auto* cmd = bench.add_subcommand(
      "compare",
      "dte against snapshot-diff, dense and checkpoint sync: the same run, side by side");
  auto o = std::make_shared<CompareOptions>();
  cmd->add_option("--model", o->model, "preset or config.json")->capture_default_str();
  cmd->add_option("--layers", o->layers, "decoder layers (real per-layer shapes)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, limits::layers));
  cmd->add_option("--vocab", o->vocab, "vocabulary (0: the model's)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, limits::vocab));
  cmd->add_option("--train", o->train, "trainer topology")->capture_default_str();
  cmd->add_option("--infer", o->infer, "receiver topology")->capture_default_str();
  cmd->add_option("--density-steps", o->steps, "measured publications per approach")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--series", o->series,
                  "then this many more dte publications: changed fraction and bytes of each")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--lr", o->lr, "learning rate of the synthetic AdamW run")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--threads", o->threads, "executor threads (0: every core)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--dir", o->dir, "storage directory (default: a temporary one, removed)");
  cmd->add_flag("--quick", o->quick,
                "small-qwen3, 1 layer, 1 publication: checks that it runs (< 2 minutes)");
  cmd->add_flag("--json", o->json, "one JSON object");
  cmd->callback([o, &status] { status = run_compare(*o); });
}

}  // namespace dte::tool
