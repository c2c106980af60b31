// SPDX-License-Identifier: Apache-2.0
// PublicationSchedule (dte/engine/schedule.hpp), the one schedule of every front-end: which
// optimizer steps publish, what each publication scans (all, mask, detect), how many steps it
// covers, when the dirty mask is cleared, and that a refused pass makes the next publication full
// while its steps stay pending. The front-ends' behaviour under it is tested end to end in
// test_engine, test_publish (a refused mark on one storage writer) and test_publication.
#include <doctest/doctest.h>

#include <cstdint>

#include "dte/engine/schedule.hpp"
#include "dte/error.hpp"

using dte::PublicationSchedule;
using dte::pipeline::ScanMode;

TEST_CASE("publish_every below 1 is refused, naming the value") {
  CHECK_THROWS_WITH_AS(PublicationSchedule(0), "publish_every must be >= 1 (got 0)",
                       dte::invalid_argument);
  CHECK_THROWS_AS(PublicationSchedule(-3), dte::invalid_argument);
}

TEST_CASE("K = 1: every step publishes; the first publication is full, then this step's changes") {
  PublicationSchedule s(1);
  CHECK_FALSE(s.keeps_mask());
  CHECK(s.full_due());
  CHECK(s.step());
  PublicationSchedule::Pass p = s.next();
  CHECK(p.mode == ScanMode::all);
  CHECK(p.full());
  CHECK(p.steps == 1);
  s.published();
  CHECK(s.pending() == 0);
  CHECK_FALSE(s.full_due());
  for (int i = 0; i < 3; ++i) {
    CHECK(s.step());
    p = s.next();
    CHECK(p.mode == ScanMode::detect);
    CHECK(p.steps == 1);
    CHECK(p.clears_masks());  // (there is no mask at K = 1; clearing it is a no-op)
    s.published();
  }
  // A publication asked for without a step covers none; a full one is asked for by name.
  CHECK(s.next().steps == 0);
  CHECK(s.next().mode == ScanMode::detect);
  CHECK(s.next(true).mode == ScanMode::all);
}

TEST_CASE("K = 3: two steps mark, the third publishes the mask in one pass") {
  PublicationSchedule s(3);
  CHECK(s.keeps_mask());
  CHECK(s.next(true).full());
  s.published();  // the first, full publication
  for (int round = 0; round < 3; ++round) {
    CHECK_FALSE(s.step());
    s.marked();
    CHECK_FALSE(s.step());
    s.marked();
    CHECK(s.pending() == 2);
    CHECK(s.step());
    const PublicationSchedule::Pass p = s.next();
    CHECK(p.mode == ScanMode::mask);
    CHECK(p.steps == 3);
    CHECK_FALSE(p.clears_masks());  // the mask pass clears what it sends
    s.published();
    CHECK(s.pending() == 0);
  }
  // flush after one marked step: the mask.
  CHECK_FALSE(s.step());
  s.marked();
  CHECK(s.next().mode == ScanMode::mask);
  CHECK(s.next().steps == 1);
}

TEST_CASE("a refused pass: the next publication is full and clears the mask; steps stay pending") {
  PublicationSchedule s(2);
  s.published();
  CHECK_FALSE(s.step());
  s.require_full();  // the mark pass threw: this step's changes are recorded nowhere
  CHECK(s.full_due());
  CHECK(s.pending() == 1);
  CHECK(s.step());
  PublicationSchedule::Pass p = s.next();
  CHECK(p.mode == ScanMode::all);
  CHECK(p.steps == 2);
  CHECK(p.clears_masks());
  // ... and stays due until a publication goes out (a publication that throws changes nothing).
  CHECK(s.next().full());
  s.published();
  CHECK_FALSE(s.full_due());
  CHECK_FALSE(s.step());
  s.marked();
  CHECK(s.step());
  CHECK(s.next().mode == ScanMode::mask);
}
