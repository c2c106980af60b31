// SPDX-License-Identifier: Apache-2.0
// PublicationSchedule: when a trainer publishes and what each publication scans. One value, the
// same for every front-end (DeltaEngine, storage::Publisher, publication::Publisher):
//   - step() after every optimizer step: every publish_every-th step since the last publication
//     publishes; the others mark (OR the step's changes into the dirty mask);
//   - next(): what the publication about to be made scans: every element (full) for the first
//     one, after a refusal (a refused pass did not record what its step changed) or on request;
//     else the dirty mask when steps were marked (mask: the marked elements and this step's
//     changes); else this step's changes (detect);
//   - published() when it went out; require_full() when a pass (mark or publication) threw, or
//     the caller lost track of its steps.
// The version numbers are the front-ends' own (the engine counts from 0, a storage root from
// LATEST).
#pragma once

#include <cstdint>
#include <string>

#include "dte/error.hpp"
#include "dte/pipeline/detect.hpp"

namespace dte {

class PublicationSchedule {
 public:
  // What a publication scans.
  struct Pass {
    pipeline::ScanMode mode;  // all, detect or mask
    std::int64_t steps;       // optimizer steps it covers (0: none since the last one)
    [[nodiscard]] bool full() const noexcept { return mode == pipeline::ScanMode::all; }
    // Whether the dirty mask is to be cleared after this pass: a mask pass clears what it sends;
    // a full or detect pass leaves behind (detect: ORs in) changes it sent.
    [[nodiscard]] bool clears_masks() const noexcept { return mode != pipeline::ScanMode::mask; }
  };

  explicit PublicationSchedule(std::int64_t publish_every) : every_(publish_every) {
    if (publish_every < 1) {
      throw invalid_argument("publish_every must be >= 1 (got " + std::to_string(publish_every) +
                             ")");
    }
  }

  [[nodiscard]] std::int64_t publish_every() const noexcept { return every_; }
  // Optimizer steps since the last publication.
  [[nodiscard]] std::int64_t pending() const noexcept { return pending_; }
  // Whether the next publication is full whatever is asked.
  [[nodiscard]] bool full_due() const noexcept { return !started_ || needs_full_; }
  // Whether a dirty mask is kept at all (publish_every > 1).
  [[nodiscard]] bool keeps_mask() const noexcept { return every_ > 1; }

  // After an optimizer step: true when this step publishes (then next(), published()); false
  // when it marks (then the mark pass, marked()).
  [[nodiscard]] bool step() noexcept { return ++pending_ >= every_; }
  void marked() noexcept { marked_ = true; }
  // A step that marks: runs mark_pass(); marked() when it returns, require_full() (then
  // rethrows) when it throws.
  template <class MarkPass>
  void mark(MarkPass&& mark_pass) {
    try {
      mark_pass();
    } catch (...) {
      require_full();
      throw;
    }
    marked();
  }

  [[nodiscard]] Pass next(bool want_full = false) const noexcept {
    using pipeline::ScanMode;
    const ScanMode mode = want_full || full_due() ? ScanMode::all
                          : marked_               ? ScanMode::mask
                                                  : ScanMode::detect;
    return {mode, pending_};
  }

  // The publication went out: the steps it covered are published.
  void published() noexcept {
    pending_ = 0;
    marked_ = false;
    needs_full_ = false;
    started_ = true;
  }

  // The next publication is full. After a pass threw (a refused optimizer state, a failed
  // write): what its step changed is recorded nowhere. The steps stay pending.
  void require_full() noexcept { needs_full_ = true; }

 private:
  std::int64_t every_;
  std::int64_t pending_ = 0;
  bool marked_ = false;      // the dirty mask holds marked steps
  bool needs_full_ = false;  // required since the last publication
  bool started_ = false;     // a publication went out
};

}  // namespace dte
