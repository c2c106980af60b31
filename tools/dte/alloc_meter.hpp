// SPDX-License-Identifier: Apache-2.0
// Heap bytes measured by account: the `dte` command replaces the global operator new and
// delete (alloc_meter.cpp) so that every allocation made through them is charged to the account
// current when it was made, and its release to that same account, whichever thread frees it.
// `dte bench compare` charges each approach's sender and receiver work to their own accounts, so
// their peak extra memory is measured, not estimated. malloc calls made directly (zstd's
// contexts, the OpenMP runtime) are not seen.
#pragma once

#include <cstdint>

namespace dte::tool::meter {

inline constexpr int accounts = 8;  // 0: everything not charged elsewhere

struct Figures {
  std::int64_t current = 0;  // bytes held now
  std::int64_t peak = 0;     // the most held at once since the last reset_peak
};

// Allocations from now on (every thread) are charged to account a.
void charge(int a) noexcept;
[[nodiscard]] int charged() noexcept;
[[nodiscard]] Figures figures(int a) noexcept;
// The peak of account a restarts at what it holds now.
void reset_peak(int a) noexcept;

// Charges an account for its lifetime, then restores the previous one.
class Scope {
 public:
  explicit Scope(int a) noexcept : previous_(charged()) { charge(a); }
  ~Scope() { charge(previous_); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  int previous_;
};

}  // namespace dte::tool::meter
