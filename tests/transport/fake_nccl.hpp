// SPDX-License-Identifier: Apache-2.0
// A fake NCCL + CUDA runtime (concept dte::nccl_runtime) for BasicNcclTwoRound on the host: the
// ranks of a world are threads of one process, "device memory" is host memory the fake knows,
// and each rank's one stream is a queue of operations run in order, as far as they can go,
// whenever that rank calls into the runtime. It behaves as the parts of NCCL and CUDA that the
// protocol's correctness depends on:
//   - a non-blocking communicator: ncclCommInitRankConfig, ncclGroupEnd and ncclAllReduce return
//     ncclInProgress and their operations reach the stream only after `in_progress_polls`
//     polls of ncclCommGetAsyncError (NCCL issues them later, from its own thread); a copy
//     enqueued before then runs before them, on memory NCCL has not written yet;
//   - a send completes only when the peer's receive has taken it, a receive only when the
//     peer's send has been posted, an all-reduce only when every rank's has (a stalled or
//     absent peer stalls the stream);
//   - a copy into host memory enqueued behind NCCL work that has not completed is recorded as a
//     violation: from pageable memory CUDA blocks the host until such a copy is done, so a dead
//     peer would hang the rank inside CUDA where no deadline runs; so is a stream
//     synchronisation with NCCL work still queued;
//   - faults: the k-th ncclSend of a rank returns ncclSystemError; ncclCommAbort and
//     ncclCommFinalize are counted per rank.
#pragma once

#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dte/concepts.hpp"
#include "dte/transport/nccl_two_round.hpp"

namespace fake_nccl {

// A send posted to its receiver; the send completes once the receive has taken it.
struct Message {
  std::vector<std::byte> bytes;
  bool taken = false;
};

struct Op {
  enum Kind { copy, fill, send, recv, reduce, event } kind = copy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t n = 0;  // bytes (copy, fill, send, recv) or elements (reduce)
  int peer = 0;
  int value = 0;
  ncclRedOp_t op = ncclSum;
  std::uint64_t seq = 0;
  bool posted = false;
  bool* flag = nullptr;
  std::shared_ptr<Message> message{};  // a send's, once posted
  [[nodiscard]] bool is_nccl() const { return kind == send || kind == recv || kind == reduce; }
};

// One rank's communicator and stream.
struct Rank {
  std::deque<Op> stream;
  std::vector<Op> group, deferred;
  bool in_group = false;
  int polls_left = 0;
  std::uint64_t reductions = 0;
  int sends = 0;
  std::map<const std::byte*, std::size_t> device;  // allocation -> bytes
};

class World {
 public:
  World(int size, int in_progress_polls)
      : size_(size),
        in_progress_polls_(in_progress_polls),
        ranks_(static_cast<std::size_t>(size)),
        aborts_(static_cast<std::size_t>(size), 0),
        finalizes_(static_cast<std::size_t>(size), 0) {}

  [[nodiscard]] int size() const { return size_; }
  // Rank r's k-th ncclSend (from 1) returns ncclSystemError.
  void fail_send(int rank, int k) {
    std::lock_guard lock(m_);
    fail_rank_ = rank;
    fail_at_ = k;
  }
  [[nodiscard]] std::vector<std::string> violations() {
    std::lock_guard lock(m_);
    return violations_;
  }
  [[nodiscard]] int aborts(int rank) {
    std::lock_guard lock(m_);
    return aborts_[static_cast<std::size_t>(rank)];
  }
  [[nodiscard]] int finalizes(int rank) {
    std::lock_guard lock(m_);
    return finalizes_[static_cast<std::size_t>(rank)];
  }
  // Device bytes a rank still holds.
  [[nodiscard]] std::size_t device_bytes(int rank) {
    std::lock_guard lock(m_);
    std::size_t n = 0;
    for (const auto& [p, b] : ranks_[static_cast<std::size_t>(rank)].device)
      n += b;
    return n;
  }

 private:
  friend class Runtime;
  struct Reduction {
    std::vector<std::vector<std::uint64_t>> parts;
    int posted = 0, taken = 0;
  };

  Rank& at(int r) { return ranks_[static_cast<std::size_t>(r)]; }
  void violation(int r, const std::string& what) {
    violations_.push_back("rank " + std::to_string(r) + ": " + what);
  }
  ncclResult_t issue(int r, std::vector<Op> ops) {
    Rank& k = at(r);
    if (in_progress_polls_ > 0) {
      k.deferred.insert(k.deferred.end(), ops.begin(), ops.end());
      k.polls_left = in_progress_polls_;
      return ncclInProgress;
    }
    k.stream.insert(k.stream.end(), ops.begin(), ops.end());
    progress(r);
    return ncclSuccess;
  }
  [[nodiscard]] bool on_device(int r, const void* p) {
    const auto* b = static_cast<const std::byte*>(p);
    const auto& d = at(r).device;
    auto it = d.upper_bound(b);
    if (it == d.begin()) return false;
    --it;
    return b < it->first + it->second;
  }
  // Runs rank r's stream as far as it can go.
  void progress(int r) {
    Rank& k = at(r);
    while (!k.stream.empty()) {
      Op& o = k.stream.front();
      switch (o.kind) {
        case Op::copy:
          std::memcpy(o.dst, o.src, o.n);
          break;
        case Op::fill:
          std::memset(o.dst, o.value, o.n);
          break;
        case Op::event:
          *o.flag = true;
          break;
        case Op::send: {
          if (!o.posted) {
            const auto* b = static_cast<const std::byte*>(o.src);
            o.message = std::make_shared<Message>(Message{{b, b + o.n}, false});
            mail_[{r, o.peer}].push_back(o.message);
            o.posted = true;
          }
          if (!o.message->taken) return;  // stalled: the peer has not received it
          break;
        }
        case Op::recv: {
          auto& q = mail_[{o.peer, r}];
          if (q.empty()) return;  // stalled: the peer's send has not run
          const std::vector<std::byte>& got = q.front()->bytes;
          if (got.size() != o.n) {
            violation(r, "received " + std::to_string(got.size()) + " bytes from rank " +
                             std::to_string(o.peer) + " into a receive of " + std::to_string(o.n));
          }
          std::memcpy(o.dst, got.data(), std::min(o.n, got.size()));
          q.front()->taken = true;
          q.pop_front();
          break;
        }
        case Op::reduce: {
          Reduction& red = reductions_[o.seq];
          if (!o.posted) {
            red.parts.resize(static_cast<std::size_t>(size_));
            const auto* v = static_cast<const std::uint64_t*>(o.src);
            red.parts[static_cast<std::size_t>(r)].assign(v, v + o.n);
            ++red.posted;
            o.posted = true;
          }
          if (red.posted < size_) return;  // stalled: a peer has not reached it
          std::vector<std::uint64_t> out = red.parts[0];
          for (std::size_t p = 1; p < red.parts.size(); ++p) {
            for (std::size_t i = 0; i < out.size(); ++i) {
              const std::uint64_t x = red.parts[p][i];
              out[i] = o.op == ncclMax ? std::max(out[i], x) : out[i] + x;
            }
          }
          std::memcpy(o.dst, out.data(), 8 * o.n);
          if (++red.taken == size_) reductions_.erase(o.seq);
          break;
        }
      }
      k.stream.pop_front();
    }
  }

  std::mutex m_;
  int size_;
  int in_progress_polls_;
  std::vector<Rank> ranks_;
  std::vector<int> aborts_, finalizes_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mail_;  // (from, to)
  std::map<std::uint64_t, Reduction> reductions_;
  std::vector<std::string> violations_;
  int fail_rank_ = -1, fail_at_ = 0;
};

// Rank r's view of the world, as BasicNcclTwoRound<Runtime> calls it.
class Runtime {
 public:
  using comm_type = Rank*;
  using stream_type = int;
  using event_type = bool*;
  using unique_id = int;

  Runtime(World& w, int rank) : w_(&w), r_(rank) {}

  ncclResult_t init(Rank*& comm, int ranks, const int&, int rank) const {
    std::lock_guard lock(w_->m_);
    if (ranks != w_->size_ || rank != r_) return ncclInvalidArgument;
    comm = &w_->at(r_);
    return w_->issue(r_, {});
  }
  ncclResult_t async_error(Rank*, ncclResult_t* state) const {
    std::lock_guard lock(w_->m_);
    Rank& k = w_->at(r_);
    w_->progress(r_);
    *state = ncclSuccess;
    if (k.polls_left > 0) {
      *state = ncclInProgress;
      if (--k.polls_left == 0) {  // NCCL's thread issues the calls now
        k.stream.insert(k.stream.end(), k.deferred.begin(), k.deferred.end());
        k.deferred.clear();
        w_->progress(r_);
      }
    }
    return ncclSuccess;
  }
  std::string last_error(Rank*) const { return "(fake)"; }
  std::string error_string(ncclResult_t r) const {
    return r == ncclSystemError ? "unhandled system error" : "error " + std::to_string(r);
  }
  ncclResult_t finalize(Rank*) const {
    std::lock_guard lock(w_->m_);
    ++w_->finalizes_[static_cast<std::size_t>(r_)];
    return w_->issue(r_, {});
  }
  ncclResult_t destroy(Rank*) const { return ncclSuccess; }
  ncclResult_t abort(Rank*) const {
    std::lock_guard lock(w_->m_);
    ++w_->aborts_[static_cast<std::size_t>(r_)];
    Rank& k = w_->at(r_);
    k.stream.clear();
    k.deferred.clear();
    k.polls_left = 0;
    return ncclSuccess;
  }
  ncclResult_t group_start() const {
    std::lock_guard lock(w_->m_);
    w_->at(r_).in_group = true;
    return ncclSuccess;
  }
  ncclResult_t group_end() const {
    std::lock_guard lock(w_->m_);
    Rank& k = w_->at(r_);
    k.in_group = false;
    return w_->issue(r_, std::exchange(k.group, {}));
  }
  ncclResult_t send(const void* p, std::size_t n, ncclDataType_t t, int peer, Rank*, int) const {
    std::lock_guard lock(w_->m_);
    Rank& k = w_->at(r_);
    if (r_ == w_->fail_rank_ && ++k.sends == w_->fail_at_) return ncclSystemError;
    return point_to_point(k, {.kind = Op::send, .src = p, .n = n * bytes_of(t), .peer = peer});
  }
  ncclResult_t recv(void* p, std::size_t n, ncclDataType_t t, int peer, Rank*, int) const {
    std::lock_guard lock(w_->m_);
    return point_to_point(w_->at(r_),
                          {.kind = Op::recv, .dst = p, .n = n * bytes_of(t), .peer = peer});
  }
  ncclResult_t all_reduce(const void* in, void* out, std::size_t n, ncclDataType_t t,
                          ncclRedOp_t op, Rank*, int) const {
    std::lock_guard lock(w_->m_);
    if (t != ncclUint64) return ncclInvalidArgument;
    const Op o{.kind = Op::reduce,
               .dst = out,
               .src = in,
               .n = n,
               .op = op,
               .seq = w_->at(r_).reductions++};
    return w_->issue(r_, {o});
  }
  int create_stream() const { return 1; }
  void destroy_stream(int) const noexcept {}
  bool* create_event() const { return new bool(true); }
  void destroy_event(bool* e) const noexcept { delete e; }
  void record(bool* e, int) const {
    std::lock_guard lock(w_->m_);
    *e = false;
    enqueue({.kind = Op::event, .flag = e});
  }
  bool query(bool* e) const {
    std::lock_guard lock(w_->m_);
    w_->progress(r_);
    return *e;
  }
  void synchronize(int) const {
    std::lock_guard lock(w_->m_);
    w_->progress(r_);
    if (!w_->at(r_).stream.empty()) {
      w_->violation(r_, "a stream synchronisation with NCCL work queued (it would block on peers)");
    }
  }
  void* device_alloc(std::size_t n) const {
    std::lock_guard lock(w_->m_);
    auto* p = new std::byte[n]();
    w_->at(r_).device[p] = n;
    return p;
  }
  void device_free(void* p) const noexcept {
    std::lock_guard lock(w_->m_);
    auto* b = static_cast<std::byte*>(p);
    w_->at(r_).device.erase(b);
    delete[] b;
  }
  void copy_async(void* dst, const void* src, std::size_t n, int) const {
    std::lock_guard lock(w_->m_);
    Rank& k = w_->at(r_);
    if (!w_->on_device(r_, dst) && !w_->on_device(r_, src)) {
      w_->violation(r_, "a copy between two host buffers");
    }
    if (!w_->on_device(r_, dst)) {
      const bool behind =
          !k.deferred.empty() ||
          std::any_of(k.stream.begin(), k.stream.end(), [](const Op& o) { return o.is_nccl(); });
      if (behind) {
        w_->violation(r_,
                      "a copy to host memory enqueued behind NCCL work that has not completed "
                      "(from pageable memory it blocks the host until a peer answers)");
      }
    }
    enqueue({.kind = Op::copy, .dst = dst, .src = src, .n = n});
  }
  void memset_async(void* p, int value, std::size_t n, int) const {
    std::lock_guard lock(w_->m_);
    enqueue({.kind = Op::fill, .dst = p, .n = n, .value = value});
  }

 private:
  static std::size_t bytes_of(ncclDataType_t t) { return t == ncclUint64 ? 8 : 1; }
  ncclResult_t point_to_point(Rank& k, const Op& o) const {
    if (!k.in_group) return w_->issue(r_, {o});
    k.group.push_back(o);
    return ncclSuccess;
  }
  void enqueue(const Op& o) const {
    w_->at(r_).stream.push_back(o);
    w_->progress(r_);
  }

  World* w_;
  int r_;
};
static_assert(dte::nccl_runtime<Runtime>);

using Transport = dte::BasicNcclTwoRound<Runtime>;
static_assert(dte::transport<Transport>);

}  // namespace fake_nccl
