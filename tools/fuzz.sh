#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The libFuzzer harnesses (fuzz/): build them with clang under ASan + UBSan, replay the seed
# corpus, fuzz for a bounded time. CTest runs `replay` + a short `run` per harness (label fuzz).
#   tools/fuzz.sh build                   configure and build into $DTE_FUZZ_DIR (build/fuzz)
#   tools/fuzz.sh check <harness> <secs>  replay fuzz/corpus/<harness>, then fuzz <secs> seconds
#   tools/fuzz.sh long <secs>             every harness for <secs> seconds, two at a time; the
#                                         findings (if any) and the figures under $DTE_FUZZ_DIR/long
# Harnesses: safetensors model_config buffer_layout optimizer_dump receiver chunk manifest
# publication.
# A crash leaves its input as $DTE_FUZZ_DIR/<harness>-crash-* (replay: build/fuzz/fuzz_<h> FILE).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${DTE_FUZZ_DIR:-$root/build/fuzz}"
cxx="${DTE_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++ || true)}"
harnesses=(safetensors model_config buffer_layout optimizer_dump receiver chunk manifest publication)

fuzz_one() {  # harness seconds work-dir
  local h="$1" secs="$2" work="$3"
  mkdir -p "$work"
  # New inputs go to $work (first directory); the repo's seeds are read only.
  "$dir/fuzz_$h" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$dir/$h-" "$work" "$root/fuzz/corpus/$h"
}

case "${1:-}" in
  build)
    if [ -z "$cxx" ]; then
      echo "fuzz.sh: no clang++ found (tools/install-deps.sh installs clang-14)" >&2
      exit 1
    fi
    launcher=()
    if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
    cmake -S "$root/fuzz" -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" >/dev/null
    cmake --build "$dir" -j "${DTE_JOBS:-$(nproc)}"
    ;;
  check)
    h="$2"
    secs="$3"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # 1. Every seed once: a regression in a reader shows here first.
    rc=0
    "$dir/fuzz_$h" "$root"/fuzz/corpus/"$h"/* >"$work/replay.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      tail -n 40 "$work/replay.log"
      exit "$rc"
    fi
    echo "fuzz_$h: replayed $(ls "$root/fuzz/corpus/$h" | wc -l) seeds"
    # 2. A short bounded run from the seeds, in a scratch directory.
    fuzz_one "$h" "$secs" "$work/corpus" >"$work/run.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      tail -n 60 "$work/run.log"
      exit "$rc"
    fi
    grep -E "^Done|stat::number_of_executed_units|stat::peak_rss_mb" "$work/run.log"
    ;;
  long)
    secs="$2"
    out="$dir/long"
    mkdir -p "$out"
    pids=()
    for h in "${harnesses[@]}"; do
      (fuzz_one "$h" "$secs" "$out/corpus_$h" >"$out/$h.log" 2>&1; echo "$?" >"$out/$h.rc") &
      pids+=($!)
      if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
    done
    wait
    for h in "${harnesses[@]}"; do
      printf '%-16s rc=%s %s\n' "$h" "$(cat "$out/$h.rc")" \
        "$(grep -E '^Done' "$out/$h.log" | tail -n 1)"
    done
    ;;
  *)
    sed -n '3,11p' "${BASH_SOURCE[0]}"
    exit 2
    ;;
esac
