#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one test command: install what is missing, then two lanes side by side:
#   C++:    configure, build everything (host targets with g++, every CUDA target with nvcc when
#           it is present), run the whole CTest suite;
#   Python: the venvs (the vLLM one comes from PyPI: mostly download), the package built as a
#           wheel, its pytest suites (tools/python-tests.sh), its output lines prefixed "python| ".
# The Python lane needs nothing the C++ lane builds, and runs on about one core while the C++ lane
# waits on it rarely: side by side they fill both cores of a small CI machine (one after the
# other, the whole took 3103 s on 2 cores, 1.64 of them busy). Then the GPU bundle, which needs
# both. The exit status is the first lane's failure; both lanes always run to their end.
#   tools/test.sh [extra ctest arguments, e.g. -L oracle or -R safetensors]
# Environment: DTE_BUILD_DIR (default build), DTE_JOBS (default: number of cores),
# DTE_SKIP_PYTHON=1 (the C++ lane only).
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

# (tests run side by side, each with every core: idle OpenMP threads sleep instead of spinning)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"

python_rc=0
if [ "${DTE_SKIP_PYTHON:-0}" != "1" ]; then
  # The Python lane, in the background; stopped if this script is.
  # (its own process group, so that the trap below stops all of it)
  set -m
  (phase python "$root/tools/python-tests.sh" 2>&1 | sed -u 's/^/python| /') &
  python_lane=$!
  set +m
  trap 'kill -- -$python_lane 2>/dev/null || true; exit 130' INT TERM
fi

cpp_lane() {
  # (&&: set -e does not reach into a function called with ||)
  phase configure cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${launcher[@]}" &&
    phase build cmake --build "$build" -j "$jobs" &&
    phase ctest ctest --test-dir "$build" -j "$jobs" --output-on-failure "$@"
}
cpp_rc=0
cpp_lane "$@" || cpp_rc=$?

if [ -n "${python_lane:-}" ]; then
  wait "$python_lane" || python_rc=$?
  trap - INT TERM
fi
if [ "$cpp_rc" -ne 0 ] || [ "$python_rc" -ne 0 ]; then
  echo "test.sh: FAILED: the C++ lane exited $cpp_rc, the Python lane $python_rc (its lines: python| )" >&2
  exit $((cpp_rc != 0 ? cpp_rc : python_rc))
fi
# The offline GPU bundle (docs/gpu.md), wherever nvcc is: built and checked (size, libraries,
# its run.sh loading every executable here), so that it cannot rot.
if command -v nvcc >/dev/null; then
  DTE_BUILD_DIR="$build" phase gpu-bundle "$root/tools/gpu-bundle.sh"
fi
