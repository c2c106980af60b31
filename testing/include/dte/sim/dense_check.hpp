// SPDX-License-Identifier: Apache-2.0
// The dense-sync reference, computed without the transfer plan: every receiver element is
// looked up through the receiver layout's inverse map in the trainer's canonical FP32 weights
// and rounded. Used by `dte simulate` (all_bit_identical) and examples; O(receiver elements).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dte/engine/receiver.hpp"
#include "dte/error.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/serving.hpp"
#include "dte/numeric/round.hpp"

namespace dte::sim {

// Elements of receiver rank `rank`'s tensors that differ from round(canonical); the vocabulary
// tail must be 0. tensors[k]: receiver tensor k in ServingLayout order, in host memory (a
// receiver's own, or a copy of tensors held in device memory).
template <class Format = Bf16Format>
std::int64_t dense_mismatches(const layout::HfModel& hf, const layout::ServingLayout& recv,
                              const std::vector<float>& canonical, std::int64_t rank,
                              std::span<const std::span<const std::uint16_t>> tensors) {
  if (static_cast<std::int64_t>(tensors.size()) != recv.size()) {
    throw invalid_argument("dense_mismatches: given " + std::to_string(tensors.size()) +
                           " tensors, the layout has " + std::to_string(recv.size()));
  }
  std::int64_t bad = 0;
  const std::int64_t ts = rank % recv.topology().tp;
  for (std::int64_t k = 0; k < recv.size(); ++k) {
    const std::span<const std::uint16_t> t = tensors[static_cast<std::size_t>(k)];
    const std::int64_t n = static_cast<std::int64_t>(t.size());
    DTE_OMP(parallel for reduction(+ : bad) schedule(static))
    for (std::int64_t i = 0; i < n; ++i) {
      const layout::Canonical c = recv.source({ts, k, i});
      const std::uint16_t want =
          c.tensor < 0
              ? std::uint16_t{0}
              : Format::round(canonical[static_cast<std::size_t>(hf[c.tensor].base + c.index)]);
      bad += t[static_cast<std::size_t>(i)] != want;
    }
  }
  return bad;
}

// Elements of one receiver (host tensors) that differ from round(canonical).
template <class Format = Bf16Format>
std::int64_t dense_mismatches(const layout::HfModel& hf, const layout::ServingLayout& recv,
                              const std::vector<float>& canonical, const Receiver& r) {
  std::vector<std::span<const std::uint16_t>> tensors;
  for (std::int64_t k = 0; k < recv.size(); ++k)
    tensors.push_back(r.tensor(k));
  return dense_mismatches<Format>(hf, recv, canonical, r.rank(), tensors);
}

// The same over every receiver rank.
template <class Format = Bf16Format>
std::int64_t dense_mismatches(const layout::HfModel& hf, const layout::ServingLayout& recv,
                              const std::vector<float>& canonical,
                              const std::vector<const Receiver*>& receivers) {
  std::int64_t bad = 0;
  for (const Receiver* r : receivers)
    bad += dense_mismatches<Format>(hf, recv, canonical, *r);
  return bad;
}

// Elements of a receiver holding the model as HF tensors (tensors[t]: HF tensor t, in HfModel
// order) that differ from round(canonical).
template <class Format = Bf16Format>
std::int64_t hf_mismatches(const layout::HfModel& hf, const std::vector<float>& canonical,
                           std::span<const std::span<std::uint16_t>> tensors) {
  std::int64_t bad = 0;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const std::span<const std::uint16_t> x = tensors[static_cast<std::size_t>(t)];
    for (std::size_t i = 0; i < x.size(); ++i)
      bad += x[i] != Format::round(canonical[static_cast<std::size_t>(hf[t].base) + i]);
  }
  return bad;
}

}  // namespace dte::sim
