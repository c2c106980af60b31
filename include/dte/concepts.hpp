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
#include <vector>

#include "dte/core/payload.hpp"
#include "dte/layout/segment.hpp"
#include "dte/reconstruction.hpp"

namespace dte {

// Reconstructs the previous value of each element of a shard from optimizer state.
//   P::bind(hyperparameters, theta, state, tensor_name) validates and returns P::kernel, a
//   trivially copyable functor: kernel(i) -> Reconstruction, kernel.current(i) -> float,
//   kernel.size() -> std::size_t, kernel.valid(i) -> bool (the per-element checks of bind).
//   P::bind_unchecked(...) skips the pass over the elements: a caller that reads every element
//   anyway checks valid(i) as it goes and calls bind() to report a refusal.
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
  { P::bind_unchecked(h, theta, s, std::string_view{}) } -> std::same_as<typename P::kernel>;
  { k(i) } -> std::same_as<Reconstruction>;
  { k.valid(i) } -> std::same_as<bool>;
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
  { D::previous(r) } -> std::same_as<PreviousBits>;
};

// How an online-FP8 engine quantizes BF16 weights, per block (detect/fp8.hpp): the block's
// shape, its scale from its largest magnitude, each code from the BF16 bits and 1 / scale, and
// the code an element had when its previous bits are only known to lie in a range.
template <class R>
concept fp8_recipe = requires {
  typename R::fp8_recipe_tag;
  { R::block_rows } -> std::convertible_to<std::int64_t>;
  { R::block_cols } -> std::convertible_to<std::int64_t>;
}
&&requires(std::uint16_t b, float x, const PreviousBits& p, std::uint8_t& c) {
  { R::magnitude(b) } -> std::same_as<float>;
  { R::scale(x) } -> std::same_as<float>;
  { R::multiplier(x) } -> std::same_as<float>;
  { R::code(b, x) } -> std::same_as<std::uint8_t>;
  { R::previous_code(p, x, c) } -> std::same_as<bool>;
};

// Maps a trainer parameter element to its canonical (HF) element, per trainer rank:
//   l(param, flat_index) -> L::canonical_type, l.is_sender(param) -> bool (one source per
//   canonical element when parameters are replicated), l.contiguous(param, flat_index) -> how
//   far the canonical index keeps advancing by one; L::plan_type is the transfer_plan it brings
//   (built once per trainer rank).
template <class L>
concept layout_mapping = requires {
  typename L::layout_mapping_tag;
}
&&requires {
  typename L::param_type;
  typename L::canonical_type;
  typename L::plan_type;
}
&&requires(const L& l, const typename L::param_type& p, std::int64_t i) {
  { l(p, i) } -> std::same_as<typename L::canonical_type>;
  { l.is_sender(p) } -> std::same_as<bool>;
  // How many elements from flat index i on map to consecutive canonical indices (at least 1):
  // the pipeline's runs and the coverage check never extend a run past it.
  { l.contiguous(p, i) } -> std::same_as<std::int64_t>;
};

// What a layout's plan tells the engine about one trainer rank's shard: its segments per buffer
// (contiguous ranges of one parameter), the parameters (name(), cols, numel()), the buffer
// sizes, and the mapping to canonical elements (RunTable builds the affine runs from these).
template <class P>
concept transfer_plan = requires(const P& p, layout::BufferKind b) {
  { p.segments(b) } -> std::convertible_to<const std::vector<layout::PlanSegment>&>;
  { p.shard_size(b) } -> std::convertible_to<std::int64_t>;
  { p.params()[0].name() } -> std::convertible_to<std::string_view>;
  { p.params()[0].cols } -> std::convertible_to<std::int64_t>;
  p.mapping();
};

// The trainer's state as the engine reads it, per trainer rank, buffer and plan segment: the
// rank's FP32 shard of the buffer (theta(rank, b)), or, for a rank whose pieces live apart (a
// sharded PyTorch trainer's local tensors: layout/identity.hpp), each segment's weights
// (segment_theta(rank, b, s); the publisher's sender frame only); the segment's hyperparameters
// (its parameter group's, after the scheduler) and its optimizer state (spans over the
// segment). The engine binds the inverse.
template <class A, class Inverse>
concept trainer_access = optimizer_inverse<Inverse> &&
    requires(const A& a, std::int64_t rank, layout::BufferKind b, const layout::PlanSegment& s) {
  { a.hyperparameters(rank, b, s) } -> std::convertible_to<typename Inverse::hyperparameters>;
  { a.state(rank, b, s) } -> std::convertible_to<typename Inverse::state>;
} &&(
    requires(const A& a, std::int64_t rank, layout::BufferKind b) {
      { a.theta(rank, b) } -> std::convertible_to<std::span<const float>>;
    } ||
    requires(const A& a, std::int64_t rank, layout::BufferKind b, const layout::PlanSegment& s) {
      { a.segment_theta(rank, b, s) } -> std::convertible_to<std::span<const float>>;
    });

// A trainer_access that gives each plan segment's weights apart (segment_theta) rather than one
// span per buffer: the sender stages then read each segment where it lives.
template <class A>
concept segmented_access = requires(const A& a, std::int64_t rank, layout::BufferKind b,
                                    const layout::PlanSegment& s) {
  a.segment_theta(rank, b, s);
};

// Carries the pipeline's data-parallel stages (exec/host.hpp; exec/cuda.cuh, whose device
// stages are pipeline/device_stages.hpp and whose sender is engine/device_sender.hpp):
//   for_each(n, f(i, worker)), for_each_ordered(n, par(i, worker), ser(i, worker)) (ser in
//   increasing i), exclusive_scan(in, out) -> total. Primitives only: the stages themselves
//   (pipeline/) choose their fastest form of the shared rules.
namespace detail {
// Stands for a stage's per-item callable in the executor concept (a lambda in a requires
// expression is valid C++20, but nvcc's front end rejects it).
struct item_callable {
  void operator()(std::size_t, int) const noexcept {}
};
}  // namespace detail

template <class E>
concept executor = requires {
  typename E::executor_tag;
}
&&requires(const E& e, std::size_t n, std::span<const std::uint64_t> in,
           std::span<std::uint64_t> out) {
  { e.threads() } -> std::convertible_to<int>;
  e.for_each(n, detail::item_callable{});
  e.for_each_ordered(n, detail::item_callable{}, detail::item_callable{});
  { e.exclusive_scan(in, out) } -> std::same_as<std::uint64_t>;
};

// An executor with device memory: allocate / deallocate (from its allocator), upload / download
// / fill (enqueued, in order) and synchronize() (waits for everything enqueued).
// exec::BasicDeviceArray (exec/device_array.hpp) holds its arrays.
template <class E>
concept device_memory = requires(const E& e, void* d, const void* h, std::size_t n) {
  { e.allocate(n) } -> std::convertible_to<void*>;
  e.deallocate(d, n);
  e.upload(d, h, n);
  e.download(d, h, n);
  e.fill(d, 0, n);
  e.synchronize();
};

namespace exec {
// What the device stages (pipeline/device_stages.hpp) ask of the executor they run on, beyond
// its memory: pinned host buffers, the pointer check, its launches of the kernel bodies
// (pipeline/device_kernels.hpp) and its device-wide algorithms (select, scan, sort). Each device
// executor specialises it: exec::Cuda in exec/cuda_device_ops.cuh, the host twin that runs the
// same stages on the CPU in dte/sim/simt_host.hpp (ctest -L device-on-host).
template <class E>
struct device_ops;

// Where device_ops<E>::sort_pairs left the sorted keys and values (one of each pair of buffers it
// was given), and the temporary it took.
template <class K, class V>
struct SortedPairs {
  K* keys;
  V* values;
  std::size_t temp_bytes;
};
}  // namespace exec

// An executor the device stages run on: an executor with device memory, device_ops and a scratch
// limit.
template <class E>
concept device_executor = executor<E> && device_memory<E> && requires(const E& e) {
  typename exec::device_ops<E>::pinned;
  { e.scratch_limit() } -> std::convertible_to<std::uint64_t>;
};

// A per-rank endpoint of a world of S sender (trainer) ranks and R receiver ranks: ranks
// [0, S) send, [S, S + R) receive. Every rank calls the same operations in the same order.
//   exchange(payloads) -> inbox_type: round 1 every sender tells every receiver its byte count,
//   zeros
//     included; round 2 the payloads move. A sender passes one payload per receiver and gets an
//     empty inbox; a receiver passes nothing and gets (sender, bytes) per non-empty payload.
//   sum(values, phase): element-wise sum over every rank of the world, result on every rank.
//   checkpoint(phase): returns once every rank reached it.
// Every wait has a deadline; a peer that does not answer becomes a deadline_error naming it
// and the phase, never a hang.
template <class T>
concept transport = requires {
  typename T::transport_tag;
  typename T::inbox_type;
}
&&requires(T& t, const T& ct, const std::vector<Payload>& out, std::span<std::uint64_t> v,
           const char* phase) {
  { ct.senders() } -> std::convertible_to<int>;
  { ct.receivers() } -> std::convertible_to<int>;
  { ct.rank() } -> std::convertible_to<int>;
  { ct.is_sender() } -> std::same_as<bool>;
  { ct.is_receiver() } -> std::same_as<bool>;
  { t.exchange(out) } -> std::same_as<typename T::inbox_type>;
  t.sum(v, phase);
  t.checkpoint(phase);
};

}  // namespace dte
