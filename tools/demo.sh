#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: build the dte command, then train a small Qwen3-shaped model (small-qwen3,
# ~6M parameters) for 50 AdamW steps with the synthetic trainer on 4 in-process Megatron ranks
# (tp=2, dp=2) and keep 8 in-process SGLang receivers (tp=4, 2 replicas) in sync by deltas
# reconstructed from the optimizer state. Every publication is digest-verified and checked
# against a dense sync. Extra arguments go to `dte simulate` (see `dte simulate --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTE_BUILD_DIR:-$root/build}"

"$root/tools/install-deps.sh" demo
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build "$build" --target dte_tool -j "$(nproc)" >/dev/null

steps=(--steps 50)
for a in "$@"; do
  case "$a" in --steps | --steps=*) steps=() ;; esac  # the caller's count wins
done
exec "$build/tools/dte/dte" simulate --model small-qwen3 --train tp=2,dp=2 --infer tp=4,replicas=2 \
  "${steps[@]}" "$@"
