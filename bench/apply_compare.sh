#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_apply (bench/bench_apply.cpp) of this checkout against the same benchmark built on an
# older revision, in one run, alternating: what docs/benchmarks.md's "Apply" figures come from.
# bench_apply uses only the public API, so the same source builds against either tree.
#   bench/apply_compare.sh [REV (default HEAD~1)] [bench_apply arguments...]
# Environment: CXX (default g++), DTE_COMPARE_DIR (default build/apply_compare).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="${1:-HEAD~1}"
shift || true
out="${DTE_COMPARE_DIR:-$root/build/apply_compare}"
cxx="${CXX:-g++}"
mkdir -p "$out"
rm -rf "$out/old"
git -C "$root" worktree add --detach --force "$out/old" "$rev" >/dev/null
trap 'git -C "$root" worktree remove --force "$out/old" >/dev/null 2>&1 || true' EXIT
flags=(-O3 -DNDEBUG -std=c++20 -fopenmp -ffp-contract=off)
libs=(-lzstd -lxxhash)
"$cxx" "${flags[@]}" -I"$out/old/include" "$root/bench/bench_apply.cpp" -o "$out/bench_apply_old" "${libs[@]}"
"$cxx" "${flags[@]}" -I"$root/include" "$root/bench/bench_apply.cpp" -o "$out/bench_apply_new" "${libs[@]}"
# (a passive OpenMP wait: the publisher's idle threads must not spin beside the timed apply)
export OMP_WAIT_POLICY=passive
for round in 1 2; do
  echo "== round $round: $rev"
  "$out/bench_apply_old" "$@"
  echo "== round $round: this checkout"
  "$out/bench_apply_new" "$@"
done
