// SPDX-License-Identifier: Apache-2.0
// The class index of canonical chunks (storage/chunk.hpp, `dte.index = "classes"`): which
// elements of a tensor a chunk changes, coded conditioned on what the reader already holds.
//
// Why: a small-learning-rate step changes an element's BF16 value with a probability that falls
// as its magnitude grows (the step is about the learning rate, an ulp grows with the value), so
// the changed set is far more predictable once the base value is known: on the 0.5 % delta of
// bench_storage the index entropy falls from 1.12 to 0.75 bytes per changed element. The reader
// holds the base version (a diff chunk already needs it), so both sides can sort every position
// by its base value's *class* (value_class: the 16-bit pattern's magnitude above its 7 low bits,
// i.e. a BF16 value's exponent) and code, per class, the gaps between changed positions among
// that class's positions only.
//
// The stream of one tensor entry (the U8 "<name>:index" tensor), varints being LEB128:
//   G, then G groups (start, length, stride, count): the positions the writer owns in this
//      entry's range, as runs start + j * stride (j < count) of `length` positions each; the
//      first group's start is absolute, each later one counts from the end of the previous
//      group's last run; runs increase and never overlap (stride >= length);
//   X, then X positions as a gap code (storage::put_gaps): elements of this chunk whose base
//      class the writer does not know (a guard-band element whose bounds straddle a class);
//      they are sent and not counted in any class;
//   S, then S positions as a gap code: positions of the domain another chunk of the version
//      writes (the writer's value chunk beside a diff chunk); neither sent here nor counted;
//   K, then K triples (class as one byte, strictly increasing; count; Rice parameter r as one
//      byte, 0..31): the classes with changed elements; then per class, from a new byte, the
//      gaps between the ranks of its changed elements among the class's domain positions (the
//      exceptions and skips not counted; the first gap is the first rank, each next one the rank
//      minus the previous minus one) as Rice codes: the gap >> r in unary (that many 1 bits,
//      then a 0), then its r low bits, least significant first; bits fill each byte from its
//      lowest, and the bits after a class's last code are 0.
// Why Rice codes: within one class the changes are close to independent draws of one
// probability, so the gaps are close to geometric, which a Rice code with the best r codes
// within a few percent of its entropy; the byte gap code of plain indices (put_gaps) pays three
// bytes for every gap from 255 on, which at low densities is a quarter of them.
// The elements of the entry are, in position order, the exceptions and the class-coded ones
// together; their values follow in that order as in a plain entry.
//
// Both sides classify from the base version: the writer from its current weights at positions
// it does not send (they are unchanged for certain) and from the reconstruction's bounds at those
// it sends (PreviousBits); the reader from the bits it holds before applying anything of the
// version. Decoding therefore needs the base at every domain position (ClassBase) and is refused
// (unsupported) by readers that cannot read it back. In a chunk, a mode byte before each stream
// says whether it is a class index or, for an entry where that is smaller, the plain gap code
// (storage/chunk.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dte/config.hpp"
#include "dte/core/gap_code.hpp"
#include "dte/error.hpp"

namespace dte::storage {

// The class of a 16-bit value: its magnitude's pattern above the 7 low bits (a BF16 value's
// exponent; an FP16 value's exponent and its 3 high mantissa bits), 0..255. Any function of the
// bits would do for correctness (writer and reader compute it alike); this one follows how
// likely an element is to change.
DTE_HOST_DEVICE constexpr std::uint8_t value_class(std::uint16_t bits) noexcept {
  return static_cast<std::uint8_t>((bits & 0x7FFFu) >> 7);
}

inline constexpr int unknown_class = -1;

// The class every pattern between lo and hi on the ordered line (storage/value_code.hpp) has,
// or unknown_class when they differ. Within one sign the class grows with the magnitude, so the
// two ends decide; across zero every magnitude up to the larger end's occurs.
DTE_HOST_DEVICE constexpr int class_between(std::uint16_t lo, std::uint16_t hi) noexcept {
  const std::uint8_t a = value_class(lo), b = value_class(hi);
  if (a != b) return unknown_class;
  if (((lo ^ hi) & 0x8000u) != 0 && a != 0) return unknown_class;
  return a;
}

// Runs start + j * stride, j < count, each `length` positions (tensor-relative indices).
struct DomainGroup {
  std::uint64_t start = 0, length = 0, stride = 0, count = 0;
  friend bool operator==(const DomainGroup&, const DomainGroup&) = default;
};

// Groups for runs given as (start, length) in increasing, non-overlapping order: consecutive
// runs of one length at one stride share a group.
inline std::vector<DomainGroup> group_runs(
    std::span<const std::pair<std::uint64_t, std::uint64_t>> runs) {
  std::vector<DomainGroup> out;
  for (const auto& [start, length] : runs) {
    if (length == 0) continue;
    if (!out.empty()) {
      DomainGroup& g = out.back();
      const std::uint64_t last = g.start + (g.count - 1) * g.stride;
      if (g.length == length &&
          (g.count == 1 ? start - last >= length : start - last == g.stride)) {
        if (g.count == 1) g.stride = start - last;
        ++g.count;
        continue;
      }
    }
    out.push_back({start, length, length, 1});
  }
  return out;
}

namespace detail {

inline void put_varint(std::uint64_t v, std::vector<std::uint8_t>& out) {
  while (v >= 0x80) {
    out.push_back(static_cast<std::uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<std::uint8_t>(v));
}

// The bits of the Rice codes of the gaps of `v` with parameter r.
inline std::uint64_t rice_bits(std::span<const std::uint32_t> v, int r) {
  std::uint64_t bits = 0;
  dte::detail::for_each_gap(
      v, [&](std::uint64_t g) { bits += (g >> r) + 1 + static_cast<unsigned>(r); });
  return bits;
}

// The Rice parameter that codes the gaps of `v` in the fewest bits.
inline int best_rice(std::span<const std::uint32_t> v) {
  int best = 0;
  std::uint64_t least = ~std::uint64_t{0};
  for (int r = 0; r < 32; ++r) {
    const std::uint64_t bits = rice_bits(v, r);
    if (bits < least) least = bits, best = r;
  }
  return best;
}

// Appends the Rice codes of the gaps of `v` with parameter r, from a new byte.
inline void put_rice(std::span<const std::uint32_t> v, int r, std::vector<std::uint8_t>& out) {
  std::uint64_t acc = 0;  // bits not yet written, lowest first
  int held = 0;
  const auto put = [&](std::uint64_t bits, int n) {  // n <= 32
    acc |= bits << held;
    held += n;
    while (held >= 8) {
      out.push_back(static_cast<std::uint8_t>(acc));
      acc >>= 8;
      held -= 8;
    }
  };
  dte::detail::for_each_gap(v, [&](std::uint64_t g) {
    for (std::uint64_t q = g >> r; q > 0;) {
      const int n = q >= 32 ? 32 : static_cast<int>(q);
      put((std::uint64_t{1} << n) - 1, n);
      q -= static_cast<std::uint64_t>(n);
    }
    put(0, 1);
    if (r > 0) put(g & ((std::uint64_t{1} << r) - 1), r);
  });
  if (held > 0) out.push_back(static_cast<std::uint8_t>(acc));
}

// Reads LEB128 varints and gap codes from one stream, refusing (format_error) anything that
// ends early or overflows.
class StreamReader {
 public:
  StreamReader(std::span<const std::uint8_t> in, const std::string& where)
      : in_(in), where_(where) {}

  std::uint64_t varint(const char* what) {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (at_ >= in_.size()) fail(std::string("the stream ends inside ") + what);
      const std::uint8_t b = in_[at_++];
      if (shift == 63 && b > 1) fail(std::string(what) + " overflows 64 bits");
      v |= std::uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80u) == 0) return v;
    }
  }
  std::uint8_t byte(const char* what) {
    if (at_ >= in_.size()) fail(std::string("the stream ends before ") + what);
    return in_[at_++];
  }
  // `count` strictly increasing values below `limit`, as put_gaps wrote them.
  std::vector<std::uint64_t> gaps(std::uint64_t count, std::uint64_t limit, const char* what) {
    if (count > in_.size() - at_) {
      fail(std::to_string(count) + " " + what + " but only " + std::to_string(in_.size() - at_) +
           " bytes left (each takes at least one)");
    }
    return dte::detail::take_gaps<std::uint64_t>(
        in_, at_, count, limit, [&](dte::detail::GapFault f, std::uint64_t k, std::uint64_t v) {
          if (f == dte::detail::GapFault::ends) {
            fail(std::string("the stream ends before ") + what);
          } else if (f == dte::detail::GapFault::escape_ends) {
            fail(std::string("the stream ends inside an escaped gap of ") + what);
          }
          fail(std::string(what) + " entry " + std::to_string(k) + " is " + std::to_string(v) +
               ", not below " + std::to_string(limit));
        });
  }
  // `count` strictly increasing values below `limit`, as put_rice wrote their gaps with
  // parameter r, from the current byte; the stream then continues at the next byte.
  std::vector<std::uint64_t> rice(std::uint64_t count, int r, std::uint64_t limit,
                                  const char* what) {
    if (count > (in_.size() - at_) * 8) {
      fail(std::to_string(count) + " " + what + " but only " + std::to_string(in_.size() - at_) +
           " bytes left (each takes at least one bit)");
    }
    std::vector<std::uint64_t> out;
    out.reserve(static_cast<std::size_t>(count));
    std::size_t bit = 0;  // into in_[at_...]
    const std::size_t bits = (in_.size() - at_) * 8;
    const auto next_bit = [&]() -> unsigned {
      if (bit >= bits) fail(std::string("the stream ends inside the Rice codes of ") + what);
      const unsigned b = (in_[at_ + bit / 8] >> (bit % 8)) & 1u;
      ++bit;
      return b;
    };
    std::uint64_t next = 0;
    for (std::uint64_t k = 0; k < count; ++k) {
      std::uint64_t q = 0;
      while (next_bit() == 1) {
        if (++q > limit)
          fail(std::string("a Rice code of ") + what + " passes " + std::to_string(limit));
      }
      std::uint64_t low = 0;
      for (int b = 0; b < r; ++b)
        low |= std::uint64_t{next_bit()} << b;
      const std::uint64_t gap = (q << r) | low;
      if (gap >= limit || next + gap >= limit) {
        fail(std::string(what) + " entry " + std::to_string(k) + " is not below " +
             std::to_string(limit));
      }
      out.push_back(next + gap);
      next += gap + 1;
    }
    while (bit % 8 != 0) {
      if (next_bit() != 0)
        fail(std::string("the bits after the Rice codes of ") + what + " are not 0");
    }
    at_ += bit / 8;
    return out;
  }
  [[nodiscard]] bool done() const noexcept { return at_ == in_.size(); }
  [[noreturn]] void fail(const std::string& what) const {
    throw format_error(where_ + ": class index: " + what);
  }

 private:
  std::span<const std::uint8_t> in_;
  const std::string& where_;
  std::size_t at_ = 0;
};

}  // namespace detail

// One tensor entry to code: its sorted changed indices, per index its base class
// (0..255, or unknown_class: an exception), the domain, and the skipped positions.
struct ClassedEntry {
  std::span<const std::uint32_t> index;
  std::span<const std::int16_t> cls;
  std::span<const DomainGroup> domain;
  std::span<const std::uint32_t> skip;  // sorted, in the domain, none of them in index
};

// Appends the class index of `e`. base(start, count, out) writes the base bits of the positions
// [start, start + count) the writer does not send (it is asked for whole runs; the values it
// gives at sent or skipped positions are not used). Throws invalid_argument when an index or a
// skip is outside the domain, or the lists are not sorted.
template <class Base>
void put_class_index(const ClassedEntry& e, Base&& base, std::vector<std::uint8_t>& out) {
  using detail::put_varint;
  const auto refuse = [](const std::string& what) {
    throw invalid_argument("dte::storage::put_class_index: " + what);
  };
  if (e.cls.size() != e.index.size()) refuse("one class per index expected");
  put_varint(e.domain.size(), out);
  std::uint64_t end = 0;  // the end of the previous group's last run
  for (std::size_t g = 0; g < e.domain.size(); ++g) {
    const DomainGroup& d = e.domain[g];
    if (d.length == 0 || d.count == 0 || (d.count > 1 && d.stride < d.length) ||
        (g > 0 && d.start < end)) {
      refuse("domain group " + std::to_string(g) + " is empty, overlaps itself or the previous");
    }
    put_varint(g == 0 ? d.start : d.start - end, out);
    put_varint(d.length, out);
    put_varint(d.count > 1 ? d.stride : 0, out);
    put_varint(d.count, out);
    end = d.start + (d.count - 1) * d.stride + d.length;
  }
  // Walk the domain: ranks per class, the exceptions.
  std::array<std::uint64_t, 256> seen{};
  std::array<std::vector<std::uint32_t>, 256> ranks;
  std::vector<std::uint32_t> exceptions;
  std::size_t k = 0, s = 0;
  std::vector<std::uint16_t> bits;
  for (const DomainGroup& d : e.domain) {
    for (std::uint64_t j = 0; j < d.count; ++j) {
      const std::uint64_t start = d.start + j * d.stride;
      const std::uint64_t stop = start + d.length;
      if (k < e.index.size() && e.index[k] < start) {
        refuse("index " + std::to_string(e.index[k]) + " is outside the domain");
      }
      if (s < e.skip.size() && e.skip[s] < start) {
        refuse("skip " + std::to_string(e.skip[s]) + " is outside the domain");
      }
      bits.resize(static_cast<std::size_t>(d.length));
      base(start, d.length, bits.data());
      for (std::uint64_t p = start; p < stop;) {
        // (the positions up to the next index or skip are only counted: a tight loop)
        const std::uint64_t event = std::min<std::uint64_t>(
            {stop, k < e.index.size() ? e.index[k] : stop, s < e.skip.size() ? e.skip[s] : stop});
        for (; p < event; ++p)
          ++seen[value_class(bits[static_cast<std::size_t>(p - start)])];
        if (p == stop) break;
        if (k < e.index.size() && e.index[k] == p) {
          if (s < e.skip.size() && e.skip[s] == p) refuse("a skip is also an index");
          const int c = e.cls[k];
          if (c == unknown_class) {
            exceptions.push_back(static_cast<std::uint32_t>(p));
          } else {
            if (c < 0 || c > 255) refuse("class " + std::to_string(c) + " is not 0..255");
            const auto cc = static_cast<std::size_t>(c);
            ranks[cc].push_back(static_cast<std::uint32_t>(seen[cc]++));
          }
          ++k;
        } else if (s < e.skip.size() && e.skip[s] == p) {
          ++s;
        } else {
          refuse("indices or skips not sorted");
        }
        ++p;
      }
    }
  }
  if (k != e.index.size() || s != e.skip.size()) {
    refuse("indices or skips beyond the domain, or not sorted");
  }
  const auto put_positions = [&](std::span<const std::uint32_t> v) {
    put_varint(v.size(), out);
    dte::detail::for_each_gap(v, [&](std::uint64_t g) { dte::detail::put_gap(g, out); });
  };
  put_positions(exceptions);
  put_positions(e.skip);
  std::size_t classes = 0;
  for (const auto& r : ranks)
    classes += r.empty() ? 0 : 1;
  put_varint(classes, out);
  std::array<int, 256> rice{};
  for (std::size_t c = 0; c < 256; ++c) {
    if (ranks[c].empty()) continue;
    rice[c] = detail::best_rice(ranks[c]);
    out.push_back(static_cast<std::uint8_t>(c));
    put_varint(ranks[c].size(), out);
    out.push_back(static_cast<std::uint8_t>(rice[c]));
  }
  for (std::size_t c = 0; c < 256; ++c) {
    if (!ranks[c].empty()) detail::put_rice(ranks[c], rice[c], out);
  }
}

// A decoded class index, not yet resolved against the base.
struct ClassIndex {
  std::vector<DomainGroup> domain;
  std::vector<std::uint64_t> exceptions, skip;
  std::vector<std::pair<std::uint8_t, std::vector<std::uint64_t>>> ranks;  // per class
  std::uint64_t values = 0;  // exceptions plus every rank
};

// Parses a class index stream of a tensor of `numel` elements; format_error naming `where` for
// anything out of bounds, unsorted, overlapping or left over.
inline ClassIndex get_class_index(std::span<const std::uint8_t> in, std::uint64_t numel,
                                  const std::string& where) {
  detail::StreamReader r(in, where);
  ClassIndex x;
  const std::uint64_t groups = r.varint("the group count");
  if (groups > in.size()) r.fail("more groups than bytes");
  std::uint64_t end = 0, domain = 0;
  for (std::uint64_t g = 0; g < groups; ++g) {
    DomainGroup d;
    const std::uint64_t from = r.varint("a group start");
    d.length = r.varint("a group length");
    d.stride = r.varint("a group stride");
    d.count = r.varint("a group count");
    if (d.length == 0 || d.count == 0) r.fail("group " + std::to_string(g) + " is empty");
    if (d.count == 1) d.stride = d.length;
    if (d.stride < d.length) r.fail("group " + std::to_string(g) + "'s runs overlap");
    if (from > numel - end) r.fail("group " + std::to_string(g) + " starts past the tensor");
    d.start = end + from;
    // the last run's end, without overflow: start + (count-1)*stride + length <= numel
    const std::uint64_t room = numel - d.start;
    if (d.length > room || (d.count - 1) > (room - d.length) / d.stride) {
      r.fail("group " + std::to_string(g) + " runs past the tensor's " + std::to_string(numel) +
             " elements");
    }
    end = d.start + (d.count - 1) * d.stride + d.length;
    domain += d.count * d.length;
    x.domain.push_back(d);
  }
  const std::uint64_t n_exc = r.varint("the exception count");
  x.exceptions = r.gaps(n_exc, numel, "exceptions");
  const std::uint64_t n_skip = r.varint("the skip count");
  x.skip = r.gaps(n_skip, numel, "skips");
  const std::uint64_t classes = r.varint("the class count");
  if (classes > 256) r.fail(std::to_string(classes) + " classes, more than 256");
  x.values = n_exc;
  int previous = -1;
  std::vector<std::pair<std::uint64_t, int>> counts;  // (count, Rice parameter)
  for (std::uint64_t c = 0; c < classes; ++c) {
    const std::uint8_t cls = r.byte("a class");
    if (static_cast<int>(cls) <= previous) r.fail("classes not strictly increasing");
    previous = cls;
    const std::uint64_t n = r.varint("a class count");
    if (n == 0 || n > domain)
      r.fail("class " + std::to_string(cls) + " has no or too many entries");
    const std::uint8_t rice = r.byte("a Rice parameter");
    if (rice > 31) r.fail("Rice parameter " + std::to_string(rice) + " is over 31");
    counts.emplace_back(n, rice);
    x.ranks.push_back({cls, {}});
    x.values += n;
  }
  if (x.values > domain) r.fail("more elements than domain positions");
  for (std::size_t c = 0; c < counts.size(); ++c)
    x.ranks[c].second = r.rice(counts[c].first, counts[c].second, domain, "class ranks");
  if (!r.done()) r.fail("bytes follow the last class's ranks");
  return x;
}

// The sorted indices of `x`, resolved against the base: base(start, count, out) writes the bits
// held before the version at positions [start, start + count). format_error naming `where`
// when an exception or skip is not a domain position, two coincide, or a class's ranks pass its
// positions (the chunk does not belong to this base, or is corrupt).
template <class Base>
std::vector<std::uint32_t> resolve_class_index(const ClassIndex& x, Base&& base,
                                               const std::string& where) {
  const auto fail = [&](const std::string& what) {
    throw format_error(where + ": class index: " + what);
  };
  constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();
  std::array<std::uint64_t, 256> seen{}, next{};
  std::array<std::size_t, 256> at{};
  std::array<const std::vector<std::uint64_t>*, 256> list{};
  next.fill(none);
  for (const auto& [cls, r] : x.ranks) {
    list[cls] = &r;
    next[cls] = r.front();
  }
  std::vector<std::uint32_t> out;
  out.reserve(static_cast<std::size_t>(x.values));
  std::size_t e = 0, s = 0;
  std::vector<std::uint16_t> bits;
  for (const DomainGroup& d : x.domain) {
    for (std::uint64_t j = 0; j < d.count; ++j) {
      const std::uint64_t start = d.start + j * d.stride;
      if ((e < x.exceptions.size() && x.exceptions[e] < start) ||
          (s < x.skip.size() && x.skip[s] < start)) {
        fail("an exception or skip is not a domain position");
      }
      bits.resize(static_cast<std::size_t>(d.length));
      base(start, d.length, bits.data());
      const std::uint64_t stop = start + d.length;
      for (std::uint64_t p = start; p < stop;) {
        // (up to the next exception or skip, every position is classed and maybe sent)
        const std::uint64_t event =
            std::min<std::uint64_t>({stop, e < x.exceptions.size() ? x.exceptions[e] : stop,
                                     s < x.skip.size() ? x.skip[s] : stop});
        for (; p < event; ++p) {
          const std::uint8_t c = value_class(bits[static_cast<std::size_t>(p - start)]);
          if (seen[c]++ == next[c]) {
            out.push_back(static_cast<std::uint32_t>(p));
            next[c] = ++at[c] < list[c]->size() ? (*list[c])[at[c]] : none;
          }
        }
        if (p == stop) break;
        const bool exc = e < x.exceptions.size() && x.exceptions[e] == p;
        const bool skip = s < x.skip.size() && x.skip[s] == p;
        if (exc && skip) fail("position " + std::to_string(p) + " is both exception and skip");
        if (exc) {
          out.push_back(static_cast<std::uint32_t>(p));
          ++e;
        } else {
          ++s;
        }
        ++p;
      }
    }
  }
  if (e != x.exceptions.size() || s != x.skip.size()) {
    fail("an exception or skip is not a domain position");
  }
  for (const auto& [cls, r] : x.ranks) {
    if (at[cls] != r.size()) {
      fail("class " + std::to_string(cls) + " has " + std::to_string(r.size()) +
           " changed elements but only " + std::to_string(seen[cls]) +
           " positions in the base held (a chunk for another base, or a corrupt one)");
    }
  }
  return out;
}

}  // namespace dte::storage
