// SPDX-License-Identifier: Apache-2.0
// StagedWrites: what one receiver rank writes for one publication, in its own coordinates, once
// a decoder has checked it (receive/core.hpp commits it). Every decoder produces this one type,
// whatever the encoding: the engine's wire v2 messages (engine/receiver.hpp) and canonical
// chunk-v1 entries routed through the receiver layout (receive/route.hpp).
//
// The writes come in pieces. A piece writes into one receiver tensor, every element of it holding
// an element of one canonical tensor, at strictly increasing indices:
//   - sparse: per write its index and the digest key of the canonical element it holds
//     (detail::digest_key), so a commit moves the verified-sync digest without mapping anything
//     back;
//   - dense: consecutive indices from `first`, holding consecutive canonical elements from
//     `global` (a full publication: two bytes per write, no index).
// Per write its 16-bit value, or for the diff encoding its code against the value held
// (storage/value_code.hpp). Memory is O(written): nothing model-sized beyond what a full
// publication writes.
//
// Writes arrive copied (push, push_sparse, push_run) or decoded in place: a decoder asks for
// room(n), writes n indices and values there, and push_decoded cuts them into pieces where they
// lie (the chunk decoder into HF tensors: no copy between the decode and the commit).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "dte/core/digest.hpp"
#include "dte/core/message.hpp"

namespace dte::receive {

static_assert(std::endian::native == std::endian::little,
              "StagedWrites reads little-endian 16-bit values in place");

// An allocator whose resize() leaves new elements of a trivial type uninitialized: staging
// grows its columns by the size of each chunk entry and overwrites them at once, so the zero fill
// a std::vector does first is a pass over memory for nothing (up to 11% of an apply, measured).
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  explicit UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

// A column of staged writes: a std::vector that grows without zero-filling.
template <class T>
using Column = std::vector<T, UninitAllocator<T>>;

// Runs of consecutive indices at least this long become dense pieces (no index per write).
inline constexpr std::size_t min_dense_run = 8;

// The pieces n writes at strictly increasing index[0, n) are cut into: runs of at least
// min_dense_run consecutive indices dense(k, end), the stretches between them sparse(k, end)
// (called for empty stretches too), in order.
template <class Sparse, class Dense>
void cut_runs(const std::uint32_t* index, std::size_t n, Sparse&& sparse, Dense&& dense) {
  std::size_t from = 0;  // the stretch [from, k) not yet cut
  // (the indices increase strictly: min_dense_run of them from k are consecutive exactly when
  // the last is min_dense_run - 1 above the first, one comparison per position)
  for (std::size_t k = 0; n - k >= min_dense_run;) {
    if (index[k + min_dense_run - 1] - index[k] != min_dense_run - 1) {
      ++k;
      continue;
    }
    std::size_t end = k + min_dense_run;
    while (end < n && index[end] == index[end - 1] + 1)
      ++end;
    sparse(from, k);
    dense(k, end);
    k = from = end;
  }
  sparse(from, n);
}

struct Piece {
  std::uint32_t tensor = 0;     // receiver tensor
  std::uint32_t canonical = 0;  // the canonical (HF) tensor its elements hold
  std::size_t begin = 0;        // its writes' values: bits[begin, end)
  std::size_t end = 0;
  bool dense = false;
  bool diff = false;         // its bits are diff codes against the values held
  std::size_t at = 0;        // sparse: its indices and keys from index[at], key[at]
  std::uint32_t first = 0;   // dense: the first write's index (then first + 1, ...)
  std::int64_t global = 0;   // dense: the canonical global index the first write holds
  std::int64_t source = -1;  // who sent it, where a publication has several senders
  // dense only: its values read in place, little-endian, from a received message that outlives
  // the commit (then bits[begin, end) is empty and `external` counts them)
  const std::byte* values = nullptr;
  std::size_t external = 0;

  [[nodiscard]] std::size_t count() const noexcept {
    return values != nullptr ? external : end - begin;
  }
  // Write k's value (or diff code).
  [[nodiscard]] std::uint16_t value(const std::uint16_t* bits, std::size_t k) const noexcept {
    if (values == nullptr) return bits[begin + k];
    std::uint16_t v;
    std::memcpy(&v, values + 2 * k, 2);
    return v;
  }
};

struct StagedWrites {
  MessageKind kind = MessageKind::delta;
  Version version = no_version;
  Version base = no_version;
  // What the writes pushed from now on carry: diff codes (true) or values. A publication may
  // mix both (storage's diff chunks beside value chunks).
  bool diff = false;
  std::vector<Piece> pieces;
  Column<std::uint16_t> bits;  // per write
  // per sparse write (and, for writes decoded in place, unread entries under dense pieces):
  Column<std::uint32_t> index;
  Column<std::uint32_t> key;  // beside each index: detail::digest_key of its element

  std::size_t external = 0;  // writes whose values are read in place (Piece::values)

  [[nodiscard]] std::size_t size() const noexcept { return bits.size() + external; }
  [[nodiscard]] bool full() const noexcept { return kind == MessageKind::full; }
  // The receiver tensors these writes touch, ascending, each once. (A tensor's pieces mostly
  // follow one another: only a change of tensor is kept before the sort, which then sorts about
  // as many entries as there are tensors, not pieces.)
  [[nodiscard]] std::vector<std::uint32_t> tensors() const {
    std::vector<std::uint32_t> out;
    for (const Piece& p : pieces)
      if (p.count() > 0 && (out.empty() || out.back() != p.tensor)) out.push_back(p.tensor);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
  [[nodiscard]] bool any_diff() const noexcept {
    for (const Piece& p : pieces) {
      if (p.diff) return true;
    }
    return false;
  }

  [[nodiscard]] std::uint32_t first(const Piece& p) const noexcept {
    return p.dense ? p.first : index[p.at];
  }
  [[nodiscard]] std::uint32_t last(const Piece& p) const noexcept {
    return p.dense ? p.first + static_cast<std::uint32_t>(p.count() - 1)
                   : index[p.at + p.count() - 1];
  }

  void reserve(std::size_t n) {
    bits.reserve(n);
    index.reserve(n);
    key.reserve(n);
  }

  // One sparse write; it extends the open piece when it continues it (same tensors and sender,
  // a larger index).
  void push(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t i, std::uint16_t b,
            std::uint32_t k, std::int64_t source = -1) {
    open_sparse(tensor, canonical, i, source);
    index.push_back(i);
    key.push_back(k);
    bits.push_back(b);
    pieces.back().end = bits.size();
  }

  // n sparse writes at indices idx[k] + shift (strictly increasing), holding the canonical
  // elements of global index idx[k] + global_shift, with values b[k]; one piece, or the open one
  // continued.
  void push_sparse(std::uint32_t tensor, std::uint32_t canonical, const std::uint32_t* idx,
                   std::int64_t shift, std::int64_t global_shift, const std::uint16_t* b,
                   std::size_t n, std::int64_t source = -1) {
    if (n == 0) return;
    const auto first = static_cast<std::uint32_t>(idx[0] + shift);
    open_sparse(tensor, canonical, first, source);
    const std::size_t at = index.size();
    index.resize(at + n);
    key.resize(at + n);
    std::uint32_t* i_out = index.data() + at;
    std::uint32_t* k_out = key.data() + at;
    for (std::size_t k = 0; k < n; ++k) {
      i_out[k] = static_cast<std::uint32_t>(idx[k] + shift);
      k_out[k] = detail::digest_key(idx[k] + global_shift);
    }
    append(b, n);
    pieces.back().end = bits.size();
  }

  // Where a decoder writes n indices and values (then push_decoded): the end of the columns,
  // grown by n, uninitialized. Valid until the columns grow again.
  struct Room {
    std::uint32_t* index;
    std::uint16_t* bits;
  };
  Room room(std::size_t n) {
    const std::size_t at = index.size(), begin = bits.size();
    index.resize(at + n);
    key.resize(at + n);
    bits.resize(begin + n);
    return {index.data() + at, bits.data() + begin};
  }

  // The last room(n)'s n writes, filled by a decoder: receiver indices strictly increasing,
  // holding the canonical elements of global index index + global_shift. Cut as every decoder's
  // writes are (cut_runs), where they lie: a sparse piece reads its indices and values in place
  // and gets its digest keys, a dense one its values (its indices stay unread).
  void push_decoded(std::uint32_t tensor, std::uint32_t canonical, std::size_t n,
                    std::int64_t global_shift, std::int64_t source = -1) {
    const std::size_t at = index.size() - n, begin = bits.size() - n;
    const std::uint32_t* idx = index.data() + at;
    std::uint32_t* keys = key.data() + at;
    cut_runs(
        idx, n,
        [&](std::size_t k, std::size_t end) {
          if (k == end) return;
          for (std::size_t j = k; j < end; ++j)
            keys[j] = detail::digest_key(idx[j] + global_shift);
          open_sparse(tensor, canonical, idx[k], source, at + k, begin + k);
          pieces.back().end = begin + end;
        },
        [&](std::size_t k, std::size_t end) {
          open_dense(tensor, canonical, idx[k], idx[k] + global_shift, source, begin + k).end =
              begin + end;
        });
  }

  // n consecutive writes from index `first`, holding canonical elements from `global`.
  void push_run(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t first,
                std::int64_t global, const std::uint16_t* b, std::size_t n,
                std::int64_t source = -1) {
    if (n == 0) return;
    Piece& p = open_dense(tensor, canonical, first, global, source);
    append(b, n);
    p.end = bits.size();
  }

  // The same from n little-endian 16-bit values at b, read in place when the commit runs (a
  // received wire message, which must outlive it): nothing copied, so a full publication is
  // applied without a model-sized staging.
  void push_run(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t first,
                std::int64_t global, const std::byte* b, std::size_t n, std::int64_t source) {
    if (n == 0) return;
    Piece& p = open_dense(tensor, canonical, first, global, source);
    p.values = b;
    p.external = n;
    external += n;
  }

  // f(tensor, index, bits) for every write, in order.
  template <class F>
  void for_each(F&& f) const {
    for (const Piece& p : pieces) {
      for (std::size_t k = 0; k < p.count(); ++k) {
        f(p.tensor, p.dense ? p.first + static_cast<std::uint32_t>(k) : index[p.at + k],
          p.value(bits.data(), k));
      }
    }
  }

  void clear() {
    external = 0;
    pieces.clear();
    bits.clear();
    index.clear();
    key.clear();
  }

 private:
  void append(const std::uint16_t* b, std::size_t n) {
    const std::size_t at = bits.size();
    bits.resize(at + n);
    std::memcpy(bits.data() + at, b, n * sizeof(std::uint16_t));
  }

  // A new sparse piece whose writes lie from index[at] and bits[begin] (by default: appended
  // next), unless the open one continues with this write (same tensors, sender and encoding, its
  // columns ending there, a larger index).
  void open_sparse(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t i,
                   std::int64_t source) {
    open_sparse(tensor, canonical, i, source, index.size(), bits.size());
  }
  void open_sparse(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t i,
                   std::int64_t source, std::size_t at, std::size_t begin) {
    if (!pieces.empty()) {
      const Piece& open = pieces.back();
      if (!open.dense && open.tensor == tensor && open.canonical == canonical &&
          open.source == source && open.diff == diff && open.at + open.count() == at &&
          open.end == begin && index[at - 1] < i) {
        return;
      }
    }
    Piece p;
    p.tensor = tensor;
    p.canonical = canonical;
    p.begin = p.end = begin;
    p.at = at;
    p.source = source;
    p.diff = diff;
    pieces.push_back(p);
  }

  // A new dense piece from index `first`, holding canonical elements from `global`, empty; its
  // values from bits[begin] (by default: appended next).
  Piece& open_dense(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t first,
                    std::int64_t global, std::int64_t source) {
    return open_dense(tensor, canonical, first, global, source, bits.size());
  }
  Piece& open_dense(std::uint32_t tensor, std::uint32_t canonical, std::uint32_t first,
                    std::int64_t global, std::int64_t source, std::size_t begin) {
    Piece p;
    p.tensor = tensor;
    p.canonical = canonical;
    p.begin = p.end = begin;
    p.dense = true;
    p.first = first;
    p.global = global;
    p.source = source;
    p.diff = diff;
    return pieces.emplace_back(p);
  }
};

}  // namespace dte::receive
