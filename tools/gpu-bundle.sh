#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The offline GPU bundle (docs/gpu.md): on this machine (nvcc, no GPU needed), everything a bare,
# offline GPU machine needs to run dte's GPU checks with bench/gpu/run.sh, and nothing it must
# build or fetch there:
#   bin/      every `gpu` test executable (tests/cuda) and bench_gpu, built for sm_80 and sm_90
#             (the build directory's CMAKE_CUDA_ARCHITECTURES);
#   lib/      the shared libraries they load that a bare machine may lack (ldd: the CUDA runtime,
#             zstd; not the driver's libcuda, not glibc or libstdc++, and not NCCL, ~200 MiB:
#             run.sh uses the machine's own libnccl.so.2, e.g. torch's);
#   python/   the binding as pip installed it (dte, with dte._native built with the CUDA
#             publisher), what the extension loads (python/lib: zstd, OpenMP) and pytest with
#             what it imports, for tests/python/test_cuda.py;
#   src/      the Python test, its example model and bench/gpu/bench_binding.py;
#   run.sh    bench/gpu/run.sh;  MANIFEST  each file's size and sha256, and what built it.
# Then it checks the bundle: at most 64 MiB, every executable present and every library it
# needs found in lib/ or among those a machine has (ldd), and run.sh run on it here, where no
# device is: each executable runs its no-device checks and skips (exit 77), and summary.json
# says "no device". CI runs this after the tests (tools/test.sh), so the bundle cannot rot.
#   tools/gpu-bundle.sh [BUNDLE]       (default: $DTE_BUILD_DIR/gpu-bundle)
# Environment: DTE_BUILD_DIR (default build; tools/test.sh's), DTE_PYTHON_VENV (the venv that
# tools/python-tests.sh installed the binding into; default build/pyenv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTE_BUILD_DIR:-$root/build}"
bundle="${1:-$build/gpu-bundle}"
venv="${DTE_PYTHON_VENV:-$root/build/pyenv}"
limit=$((64 * 1024 * 1024))
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
fail() { echo "gpu-bundle: $*" >&2; exit 1; }
command -v nvcc >/dev/null || fail "no nvcc: the bundle's executables are CUDA programs (install the CUDA toolkit)"
[ -f "$build/CMakeCache.txt" ] || fail "no build in $build: run tools/test.sh (or cmake) first"

# The executables: every `gpu` test CTest knows in this build but the examples (example_nccl_sync
# runs under mpirun, which a bare GPU machine lacks), and bench_gpu.
mapfile -t tests < <(ctest --test-dir "$build" -L gpu -N 2>/dev/null |
  sed -n 's/^ *Test *#[0-9]*: *\([A-Za-z0-9_]*\)$/\1/p' | grep -v '^example_')
[ ${#tests[@]} -gt 0 ] || fail "CTest in $build lists no 'gpu' test: was it configured with nvcc?"
cmake --build "$build" --target "${tests[@]}" bench_gpu

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/python" "$bundle/src"
for t in "${tests[@]}"; do
  exe=$(find "$build/tests" -type f -name "$t" -perm -u+x | head -1)
  [ -n "$exe" ] || fail "built $t, but found no executable of that name under $build/tests"
  cp "$exe" "$bundle/bin/"
done
cp "$build/bench/bench_gpu" "$bundle/bin/"

# What they load, but what every Linux machine with a GPU driver has.
baseline='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|libcuda|libnccl|libpython)'
missing=()
collect() {  # elf dir: the libraries elf needs, outside the baseline, copied into dir
  local name arrow path
  mkdir -p "$2"
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ "$name" =~ $baseline ]] && continue
    if [ "$path" = "not" ]; then missing+=("$(basename "$1"): $name"); continue; fi
    [ -f "$2/$name" ] || cp -L "$path" "$2/$name"
  done < <(ldd "$1")
}
for exe in "$bundle"/bin/*; do collect "$exe" "$bundle/lib"; done
[ ${#missing[@]} -eq 0 ] || fail "libraries not found here: ${missing[*]}"

# The binding, where tools/python-tests.sh installed it with the CUDA publisher.
site=$(ls -d "$venv"/lib/python3*/site-packages 2>/dev/null | head -1 || true)
binding="not bundled: no binding installed in $venv (tools/python-tests.sh installs it)"
if [ -n "$site" ] && [ -d "$site/dte" ]; then
  if "$venv/bin/python" -c "import dte, sys; sys.exit(0 if dte._native.cuda_built else 1)"; then
    cp -r "$site/dte" "$bundle/python/"
    # pytest and what it imports (pure Python), from the venv or the system it sees.
    for m in pytest _pytest pluggy iniconfig packaging py.py exceptiongroup tomli; do
      from=$("$venv/bin/python" - "$m" <<'EOF'
import importlib.util, os, sys
name = sys.argv[1].removesuffix(".py")
s = importlib.util.find_spec(name)
print(os.path.dirname(s.origin) if s and s.submodule_search_locations else (s.origin if s else ""))
EOF
      )
      [ -n "$from" ] && [ -e "$from" ] && cp -r "$from" "$bundle/python/"
    done
    find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
    # (what the extension loads besides Python and torch: python/lib, run.sh puts it on the path)
    for so in "$bundle"/python/dte/*.so; do collect "$so" "$bundle/python/lib"; done
    [ ${#missing[@]} -eq 0 ] || fail "libraries not found here: ${missing[*]}"
    tag=$("$venv/bin/python" -c "import sys; print(sys.implementation.cache_tag)")
    binding="dte._native with the CUDA publisher, for $tag"
    echo "$tag" >"$bundle/python/TAG"
  else
    binding="not bundled: the installed dte._native was built without nvcc"
  fi
fi
mkdir -p "$bundle/src/tests/python" "$bundle/src/examples/python" "$bundle/src/bench/gpu"
cp "$root/tests/python/test_cuda.py" "$bundle/src/tests/python/"
cp "$root/examples/python/tiny_qwen3.py" "$bundle/src/examples/python/"
cp "$root/bench/gpu/bench_binding.py" "$bundle/src/bench/gpu/"
cp "$root/bench/gpu/run.sh" "$bundle/run.sh"

{
  echo "dte GPU bundle: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(
    git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%FT%TZ) on $(uname -m), $(nvcc --version | tail -1)"
  echo "architectures: $(grep -o 'code=\[compute_[0-9]*,sm_[0-9]*\]' "$build/build.ninja" |
    grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')(the build's nvcc flags)"
  echo "binding: $binding"
  (cd "$bundle" && find . -type f ! -name MANIFEST | sort | while read -r f; do
    printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "$f"
  done)
} >"$bundle/MANIFEST"

size=$(du -sb "$bundle" | cut -f1)
echo "gpu-bundle: $bundle: $(find "$bundle" -type f | wc -l) files, $size bytes ($((size / 1024 / 1024)) MiB of at most 64); binding: $binding"
[ "$size" -le "$limit" ] || fail "the bundle is $size bytes, over the 64 MiB a device call can carry"

# The check: run.sh on the bundle, here (no device: every executable must load, pass its
# no-device checks and skip).
check="$build/gpu-bundle-check"
rm -rf "$check"
"$bundle/run.sh" "$bundle" "$check" >"$build/gpu-bundle-check.log" 2>&1 ||
  { cat "$build/gpu-bundle-check.log"; fail "run.sh failed on the bundle (above)"; }
grep -q '"status": "no device"' "$check/summary.json" ||
  { cat "$check/summary.json"; fail "run.sh did not report 'no device' here"; }
for t in "${tests[@]}"; do
  grep -q "\"$t\": {\"status\": \"skipped: no CUDA device\"" "$check/summary.json" ||
    { cat "$check/summary.json"; fail "$t did not load and skip on this machine"; }
done
echo "gpu-bundle: checked: run.sh loads every executable here and each skips (no device)"
