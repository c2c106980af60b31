#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one test command: install what is missing, configure, build everything (host targets with
# g++, every CUDA target with nvcc when it is present), run the whole CTest suite, then build the
# Python package into a venv and run its pytest suite (tools/python-tests.sh).
#   tools/test.sh [extra ctest arguments, e.g. -L oracle or -R safetensors]
# Environment: DTE_BUILD_DIR (default build), DTE_JOBS (default: number of cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/phase.sh
. "$root/tools/phase.sh"
build="${DTE_BUILD_DIR:-$root/build}"
jobs="${DTE_JOBS:-$(nproc)}"

phase install-deps "$root/tools/install-deps.sh"

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# nvcc is on PATH on CUDA images only through /usr/local/cuda/bin at times.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

phase configure cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}"
phase build cmake --build "$build" -j "$jobs"
# (tests run side by side, each with every core: idle OpenMP threads sleep instead of spinning)
OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}" phase ctest ctest --test-dir "$build" -j "$jobs" --output-on-failure "$@"
phase python "$root/tools/python-tests.sh"
# The offline GPU bundle (docs/gpu.md), wherever nvcc is: built and checked (size, libraries,
# its run.sh loading every executable here), so that it cannot rot.
if command -v nvcc >/dev/null; then
  DTE_BUILD_DIR="$build" phase gpu-bundle "$root/tools/gpu-bundle.sh"
fi
