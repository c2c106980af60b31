#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one GPU script: on a machine with a CUDA device, in at most ~5 minutes,
#   1. builds the CUDA targets (Release, this machine's architecture only, ccache if present),
#   2. runs every `gpu` test (ctest -L gpu; test_cuda_pipeline compares the host and device
#      senders' message bytes, which the one sending policy makes equal),
#   3. runs compute-sanitizer (memcheck, racecheck) on the CUDA pipeline test (the > 2^31
#      element case left out: under the sanitizer it would take minutes),
#   4. runs the GPU benchmarks (bench_gpu),
#   5. the Python binding on CUDA tensors: builds dte._native with nvcc into a venv over a
#      python3 that has torch, then runs tests/python/test_cuda.py (the GPU publisher's
#      messages equal the host's byte for byte, receivers bit-identical) and
#      bench/gpu/bench_binding.py (time per element beside the optimizer step); skipped, with
#      the reason in summary.json, where no python3 has torch or torch sees no GPU,
# and writes under $OUT (or the directory given as the first argument):
#   summary.json  what ran and how it ended;   bench_gpu.json, bench_binding.json  the figures;
#   ctest_gpu.log, memcheck.log, racecheck.log, build.log, binding_build.log, binding_test.log.
# Without a device it builds (the binding too, where it can), says "no device" and writes
# summary.json saying so (exit 0).
#   bench/gpu/run.sh [OUTDIR]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-${OUT:-$root/build-gpu/out}}"
build="${DTE_GPU_BUILD_DIR:-$root/build-gpu}"
mkdir -p "$out"
start=$(date +%s)
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# What the build needs (Debian packages; apt only where something is missing).
need=()
for tool in cmake ninja; do command -v "$tool" >/dev/null || need+=("$tool"); done
[ -f /usr/include/doctest/doctest.h ] || need+=(doctest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
command -v mpirun >/dev/null || need+=(libopenmpi-dev openmpi-bin)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] && sudo="" || sudo="sudo"
  pkgs=("${need[@]/ninja/ninja-build}")
  { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "${pkgs[@]}"; } \
    >"$out/install.log" 2>&1 || echo "run.sh: could not install ${pkgs[*]} (see install.log)"
fi

arch="80;90"
if command -v nvidia-smi >/dev/null && cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1) && [ -n "$cc" ]; then
  arch="${cc//./}"
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
targets=(test_cuda_backend test_cuda_pipeline test_cuda_golden test_cuda_publication bench_gpu)
configure_and_build() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" "${launcher[@]}" || return 1
  # The NCCL test and example exist where NCCL (and MPI) were found.
  for t in test_nccl_transport example_nccl_sync; do
    ninja -C "$build" -t targets all 2>/dev/null | grep -q "^$t:" && targets+=("$t")
  done
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
}
configure_and_build >"$out/build.log" 2>&1
build_rc=$?

devices=0
if command -v nvidia-smi >/dev/null; then
  devices=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
fi
summary() {  # summary.json from the shell: no jq needed
  local status="$1" note="$2"
  printf '{\n  "status": "%s",\n  "note": "%s",\n  "devices": %s,\n  "architectures": "%s",\n  "build_rc": %s,\n  "ctest_gpu_rc": %s,\n  "memcheck_rc": %s,\n  "racecheck_rc": %s,\n  "bench_rc": %s,\n  "binding": "%s",\n  "binding_test_rc": %s,\n  "binding_bench_rc": %s,\n  "seconds": %s\n}\n' \
    "$status" "$note" "$devices" "$arch" "$build_rc" "${ctest_rc:-null}" "${memcheck_rc:-null}" \
    "${racecheck_rc:-null}" "${bench_rc:-null}" "$binding" "${binding_test_rc:-null}" \
    "${binding_bench_rc:-null}" "$(( $(date +%s) - start ))" >"$out/summary.json"
  cat "$out/summary.json"
}

# The binding: a python3 with torch (DTE_GPU_PYTHON, else the first on PATH), a venv over it
# (--system-site-packages: its torch), nanobind and scikit-build-core there (pip, where the
# machine can reach PyPI), then dte._native built with nvcc for this machine's architecture.
binding="not built"
binding_python=""
build_binding() {
  local p
  for p in ${DTE_GPU_PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then binding_python="$p"; break; fi
  done
  if [ -z "$binding_python" ]; then binding="skipped: no python3 with torch"; return 1; fi
  local venv="$build/pyenv"
  [ -x "$venv/bin/python" ] || "$binding_python" -m venv --system-site-packages "$venv" || {
    binding="skipped: could not make a venv"; return 1; }
  "$venv/bin/python" -c "import nanobind, scikit_build_core, pytest" 2>/dev/null ||
    "$venv/bin/python" -m pip install -q "nanobind>=2.0" "scikit-build-core>=0.8" pytest || {
    binding="skipped: no nanobind, scikit-build-core and pytest (and no PyPI)"; return 1; }
  "$venv/bin/python" -m pip install -q --no-build-isolation \
    --config-settings="build-dir=$build/python" \
    --config-settings="cmake.define.CMAKE_CUDA_ARCHITECTURES=$arch" "$root" || {
    binding="build failed (see binding_build.log)"; return 1; }
  "$venv/bin/python" -c "import dte; assert dte._native.cuda_built, 'built without CUDA'" || {
    binding="built without CUDA (see binding_build.log)"; return 1; }
  binding="built with CUDA ($arch)"
}
build_binding >"$out/binding_build.log" 2>&1
binding_rc=$?
if [ "$build_rc" != 0 ]; then
  tail -30 "$out/build.log"
  summary "build failed" "see build.log"
  exit 1
fi
if [ "$devices" = 0 ]; then
  echo "run.sh: built ${targets[*]}; binding: $binding; no device: nothing to run"
  "$build/bench/bench_gpu" --out "$out/bench_gpu.json" >/dev/null; bench_rc=$?
  summary "no device" "built; no CUDA device, so no test, sanitizer or benchmark ran"
  exit 0
fi

ctest --test-dir "$build" -L gpu --output-on-failure --timeout 240 >"$out/ctest_gpu.log" 2>&1
ctest_rc=$?
tail -15 "$out/ctest_gpu.log"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
exclude='--test-case-exclude=*2^31*'
timeout 150 "$sanitizer" --tool memcheck --error-exitcode 1 \
  "$build/tests/cuda/test_cuda_pipeline" "$exclude" >"$out/memcheck.log" 2>&1
memcheck_rc=$?
timeout 150 "$sanitizer" --tool racecheck --error-exitcode 1 \
  "$build/tests/cuda/test_cuda_pipeline" "$exclude" '--test-case=*every mode*' >"$out/racecheck.log" 2>&1
racecheck_rc=$?
tail -3 "$out/memcheck.log" "$out/racecheck.log"
timeout 120 "$build/bench/bench_gpu" --out "$out/bench_gpu.json" >"$out/bench_gpu.log" 2>&1
bench_rc=$?
cat "$out/bench_gpu.json" 2>/dev/null | head -60
if [ "$binding_rc" = 0 ] && ! "$build/pyenv/bin/python" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  binding="$binding; not run: this torch sees no GPU (a CPU-only torch?)"
  binding_rc=1
fi
if [ "$binding_rc" = 0 ]; then
  # (the tiny model's test, then the benchmark on a ~0.46 B parameter model)
  (cd "$root/tests/python" && timeout 240 "$build/pyenv/bin/python" -m pytest -q -rs test_cuda.py) \
    >"$out/binding_test.log" 2>&1
  binding_test_rc=$?
  timeout 180 "$build/pyenv/bin/python" "$root/bench/gpu/bench_binding.py" \
    --out "$out/bench_binding.json" >"$out/binding_bench.log" 2>&1
  binding_bench_rc=$?
  tail -5 "$out/binding_test.log"; head -30 "$out/binding_bench.log"
fi
status=ok
[ "$ctest_rc$memcheck_rc$racecheck_rc$bench_rc" = 0000 ] || status=failed
[ "${binding_test_rc:-0}${binding_bench_rc:-0}" = 00 ] || status=failed
summary "$status" "see the logs beside this file"
[ "$status" = ok ]
