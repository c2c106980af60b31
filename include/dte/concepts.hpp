// SPDX-License-Identifier: Apache-2.0
// One concept per policy kind: an opt-in tag plus the structure the engine relies on, so that a
// wrong combination fails at compile time with the name of the missing piece.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include "dte/optim/reconstruction.hpp"

namespace dte {

// Reconstructs the previous value of each element of a shard from optimizer state.
//   P::bind(hyperparameters, theta, state, tensor_name) validates and returns P::kernel, a
//   trivially copyable functor: kernel(i) -> Reconstruction, kernel.current(i) -> float,
//   kernel.size() -> std::size_t.
template <class P>
concept optimizer_inverse = requires {
  typename P::optimizer_inverse_tag;
}
&&requires {
  typename P::hyperparameters;
  typename P::state;
  typename P::kernel;
  { P::name } -> std::convertible_to<std::string_view>;
}
&&std::is_trivially_copyable_v<typename P::kernel>&& requires(const typename P::hyperparameters& h,
                                                              std::span<const float> theta,
                                                              const typename P::state& s,
                                                              const typename P::kernel& k,
                                                              std::size_t i) {
  { P::bind(h, theta, s, std::string_view{}) } -> std::same_as<typename P::kernel>;
  { k(i) } -> std::same_as<Reconstruction>;
  { k.current(i) } -> std::same_as<float>;
  { k.size() } -> std::same_as<std::size_t>;
};

// Decides, per element, whether the receivers' stored value changed.
template <class D>
concept change_detector = requires {
  typename D::change_detector_tag;
  typename D::format;
}
&&requires(float x, const Reconstruction& r) {
  { D::store(x) } -> std::same_as<std::uint16_t>;
  { D::classify(x, r) } -> std::same_as<Verdict>;
  { D::changed(x, r) } -> std::same_as<bool>;
};

// Maps a trainer parameter element to its canonical (HF) element, per trainer rank:
//   l(param, flat_index) -> L::canonical_type, l.is_sender(param) -> bool (one source per
//   canonical element when parameters are replicated).
template <class L>
concept layout_mapping = requires {
  typename L::layout_mapping_tag;
}
&&requires {
  typename L::param_type;
  typename L::canonical_type;
}
&&requires(const L& l, const typename L::param_type& p, std::int64_t i) {
  { l(p, i) } -> std::same_as<typename L::canonical_type>;
  { l.is_sender(p) } -> std::same_as<bool>;
};

}  // namespace dte
