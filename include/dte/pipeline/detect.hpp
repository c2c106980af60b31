// SPDX-License-Identifier: Apache-2.0
// Stage 1, detect: one pass over a piece of a run (a contiguous range of one plan segment whose
// canonical index advances by one per element), reading theta and the optimizer state once:
// validate every element (what Inverse::bind would check: a refusal is reported, nothing is
// sent), reconstruct, round both values, compare bit patterns with the guard band, add the
// element's digest term, OR into the dirty mask when K > 1, and set one bit per element to send.
// No per-element index map: the digest uses the run's canonical base.
//
// The rule is the per-element functors (Inverse::kernel, Detect::classify, element_digest);
// this file applies them element by element, and pipeline/detect_vector.hpp applies the same
// rules eight or sixteen elements at a time where the CPU allows it (tests compare the two bit
// for bit) and chooses between the two (pipeline::detect).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/core/digest.hpp"
#include "dte/reconstruction.hpp"

namespace dte::pipeline {

// all: send every element (a full publication: no reconstruction). detect: K = 1, send what
// this step changed. mark: OR this step's changes into the dirty mask, send nothing. mask: OR
// the last step in, send everything marked, clear the mask.
enum class ScanMode : std::uint8_t { all, detect, mark, mask };

// A piece of a run, as the detect stage sees it.
struct Piece {
  std::size_t first;  // index of its first element in the segment's kernel
  std::size_t length;
  std::int64_t canonical;  // canonical index of its first element; < 0: not digested
  bool send;               // false: validated only (padding, TP replicas that do not send)
};

struct DetectCounts {
  std::uint64_t flagged = 0;  // elements to send
  std::uint64_t guard = 0;    // of the detected ones, flagged by the guard band only
  Digest digest = 0;          // sum of the digest terms (0 for mark and for undigested pieces)
  std::int64_t invalid = -1;  // first element of the piece that bind would refuse, or -1

  DetectCounts& operator+=(const DetectCounts& o) noexcept {
    flagged += o.flagged;
    guard += o.guard;
    digest += o.digest;
    if (invalid < 0) invalid = o.invalid;
    return *this;
  }
};

namespace detail {

inline void set_bit(std::uint64_t* words, std::uint64_t bit) noexcept {
  words[bit / 64] |= std::uint64_t{1} << (bit % 64);
}
inline bool get_bit(const std::uint64_t* words, std::uint64_t bit) noexcept {
  return (words[bit / 64] >> (bit % 64)) & 1u;
}
inline void clear_bit(std::uint64_t* words, std::uint64_t bit) noexcept {
  words[bit / 64] &= ~(std::uint64_t{1} << (bit % 64));
}

// 64 bits from bit position `bit` (any alignment; the bitmap holds them all).
inline std::uint64_t load64(const std::uint64_t* words, std::uint64_t bit) noexcept {
  const std::uint64_t w = bit / 64, sh = bit % 64;
  return sh == 0 ? words[w] : (words[w] >> sh) | (words[w + 1] << (64 - sh));
}
inline void store64(std::uint64_t* words, std::uint64_t bit, std::uint64_t v) noexcept {
  const std::uint64_t w = bit / 64, sh = bit % 64;
  if (sh == 0) {
    words[w] = v;
    return;
  }
  const std::uint64_t low = ~std::uint64_t{0} << sh;  // the bits of words[w] that are ours
  words[w] = (words[w] & ~low) | (v << sh);
  words[w + 1] = (words[w + 1] & low) | (v >> (64 - sh));
}
inline void or64(std::uint64_t* words, std::uint64_t bit, std::uint64_t v) noexcept {
  const std::uint64_t w = bit / 64, sh = bit % 64;
  words[w] |= v << sh;
  if (sh != 0) words[w + 1] |= v >> (64 - sh);
}

}  // namespace detail

// A piece of a full publication (every element sent, no reconstruction): bits[j] =
// Detect::store(theta[j]); returns the sum of their digest terms.
template <change_detector Detect>
Digest store_piece(const float* theta, std::size_t n, std::int64_t canonical,
                   std::uint16_t* bits) noexcept {
  for (std::size_t j = 0; j < n; ++j)
    bits[j] = Detect::store(theta[j]);
  Digest d = 0;
  for (std::size_t j = 0; j < n; ++j)
    d += element_digest(canonical + static_cast<std::int64_t>(j), bits[j]);
  return d;
}

// The rule for one element, shared by detect_scalar and the CUDA detect kernel
// (pipeline/device_stages.hpp): i is the element's index in the segment's kernel; canonical its
// canonical index when its digest term counts (else < 0); send_piece whether its piece is sent
// at all; marked whether the dirty mask held it before this step (mask mode only). What the
// caller does with the mask: OR `hit` in (detect, mark) or clear the mark (mask).
struct ElementVerdict {
  bool invalid = false;  // bind would refuse it: the publication is refused
  bool hit = false;      // this step changed it (guard band included)
  bool guard = false;    // flagged by the guard band only
  bool send = false;     // it goes into this publication
  Digest term = 0;       // its digest term (0 when not digested)
};

template <change_detector Detect, class Kernel>
DTE_HOST_DEVICE ElementVerdict detect_element(const Kernel& k, std::size_t i,
                                              std::int64_t canonical, bool send_piece,
                                              ScanMode mode, bool marked) noexcept {
  ElementVerdict v;
  if (!k.valid(i)) {
    v.invalid = true;
    return v;
  }
  if (!send_piece) return v;
  const float now = k.current(i);
  const Verdict c = Detect::classify(now, k(i));
  v.hit = c != Verdict::unchanged;
  v.guard = c == Verdict::guard;
  if (mode == ScanMode::mark) return v;
  v.send = v.hit || (mode == ScanMode::mask && marked);
  if (canonical >= 0) v.term = element_digest(canonical, Detect::store(now));
  return v;
}

// Element by element. mask: the dirty mask (bit mask_bit + j for element j), or null when
// K = 1. out: bit out_bit + j is set for every element j to send (the caller zeroed them);
// unused in mark mode. Stops at the first invalid element (the publication is refused).
template <change_detector Detect, class Kernel>
DetectCounts detect_scalar(const Kernel& k, const Piece& piece, ScanMode mode, std::uint64_t* mask,
                           std::uint64_t mask_bit, std::uint64_t* out,
                           std::uint64_t out_bit) noexcept {
  DetectCounts c;
  const bool digest = mode != ScanMode::mark && piece.send && piece.canonical >= 0;
  for (std::size_t j = 0; j < piece.length; ++j) {
    const bool marked =
        mask != nullptr && mode == ScanMode::mask && detail::get_bit(mask, mask_bit + j);
    const ElementVerdict v = detect_element<Detect>(
        k, piece.first + j, digest ? piece.canonical + static_cast<std::int64_t>(j) : -1,
        piece.send, mode, marked);
    if (v.invalid) {
      c.invalid = static_cast<std::int64_t>(j);
      return c;
    }
    c.guard += v.guard;
    if (mask != nullptr && piece.send) {
      if (mode == ScanMode::mask) {
        detail::clear_bit(mask, mask_bit + j);
      } else if (v.hit) {
        detail::set_bit(mask, mask_bit + j);
      }
    }
    c.digest += v.term;
    if (v.send) {
      ++c.flagged;
      detail::set_bit(out, out_bit + j);
    }
  }
  return c;
}

}  // namespace dte::pipeline
