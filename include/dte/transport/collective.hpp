// SPDX-License-Identifier: Apache-2.0
// Named, typed collectives over a transport's one reduction (sum(values, phase): element-wise,
// result on every rank; concept dte::transport). Each phase of a publication sums one set of
// parts that every rank fills in by name, and agrees on failures in one place:
//   - sum_fields(world, phase, parts...): one sum over every part, in order. A part is a struct
//     whose members are all std::uint64_t (summed member by member), a std::vector of such
//     structs, a std::vector<std::uint64_t>, or a std::vector<std::uint32_t> (digests: summed
//     mod 2^32);
//   - agree(world, slots, slot, mine, phase, fail): every rank passes its error (empty: none);
//     when any of the `slots` ranks that can fail did, every rank calls fail(first failed slot),
//     which throws the same exception everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dte/error.hpp"

namespace dte {

// A struct summed member by member: every member a std::uint64_t.
template <class T>
concept summable_fields = std::is_trivially_copyable_v<T> && std::is_standard_layout_v<T> &&
                                  std::is_class_v<T> && sizeof(T) %
                                  sizeof(std::uint64_t) ==
                              0 &&
                          alignof(T) == alignof(std::uint64_t);

namespace detail {

template <summable_fields T>
std::size_t words_of(const T&) noexcept {
  return sizeof(T) / sizeof(std::uint64_t);
}
template <summable_fields T>
std::size_t words_of(const std::vector<T>& v) noexcept {
  return v.size() * (sizeof(T) / sizeof(std::uint64_t));
}
template <class U>
requires(std::is_same_v<U, std::uint64_t> || std::is_same_v<U, std::uint32_t>) std::size_t
    words_of(const std::vector<U>& v)
noexcept {
  return v.size();
}

template <summable_fields T>
void pack(std::uint64_t* at, const T& x) noexcept {
  std::memcpy(at, &x, sizeof(T));
}
template <summable_fields T>
void pack(std::uint64_t* at, const std::vector<T>& v) noexcept {
  if (!v.empty()) std::memcpy(at, v.data(), v.size() * sizeof(T));
}
template <class U>
requires(std::is_same_v<U, std::uint64_t> ||
         std::is_same_v<U, std::uint32_t>) void pack(std::uint64_t* at,
                                                     const std::vector<U>& v) noexcept {
  for (std::size_t i = 0; i < v.size(); ++i)
    at[i] = v[i];
}

template <summable_fields T>
void unpack(const std::uint64_t* at, T& x) noexcept {
  std::memcpy(&x, at, sizeof(T));
}
template <summable_fields T>
void unpack(const std::uint64_t* at, std::vector<T>& v) noexcept {
  if (!v.empty()) std::memcpy(v.data(), at, v.size() * sizeof(T));
}
template <class U>
requires(std::is_same_v<U, std::uint64_t> ||
         std::is_same_v<U, std::uint32_t>) void unpack(const std::uint64_t* at,
                                                       std::vector<U>& v) noexcept {
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<U>(at[i]);  // (uint32: mod 2^32)
}

}  // namespace detail

// One sum over the world of every part, in order; every rank passes parts of the same sizes.
template <class World, class... Parts>
void sum_fields(World& world, const char* phase, Parts&... parts) {
  std::vector<std::uint64_t> v((detail::words_of(parts) + ... + 0));
  std::size_t at = 0;
  ((detail::pack(v.data() + at, parts), at += detail::words_of(parts)), ...);
  world.sum(std::span<std::uint64_t>(v), phase);
  at = 0;
  ((detail::unpack(v.data() + at, parts), at += detail::words_of(parts)), ...);
}

// Every rank of the world calls it. Of `slots` ranks that can fail (trainer ranks, writers), this
// one is `slot` (-1: it cannot) and passes its error `mine` (empty: none). Returns when none
// failed; else every rank calls fail(the first failed slot), which must throw.
template <class World, class Fail>
void agree(World& world, std::size_t slots, std::int64_t slot, const std::string& mine,
           const char* phase, Fail&& fail) {
  std::vector<std::uint64_t> failed(slots, 0);
  if (slot >= 0 && !mine.empty()) failed[static_cast<std::size_t>(slot)] = 1;
  world.sum(std::span<std::uint64_t>(failed), phase);
  for (std::size_t k = 0; k < slots; ++k) {
    if (failed[k] != 0) {
      fail(static_cast<std::int64_t>(k));
      throw error(std::string("dte: agree(") + phase + "): fail() returned; report this to the " +
                  "dte developers");
    }
  }
}

}  // namespace dte
