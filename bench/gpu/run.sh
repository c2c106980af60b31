#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one GPU script: runs the offline bundle (tools/gpu-bundle.sh) on a machine with a CUDA
# device, with no network and no compiler, within a device-time budget of 285 s (under five
# minutes, start to summary.json; DTE_GPU_BUDGET_S lowers it). Each step has its own timeout, cut
# to what is left of the budget; a step that no longer fits is "not run". In order:
#   test_cuda_backend, test_cuda_pipeline (the host and device senders' messages byte for byte),
#   test_cuda_golden, test_cuda_publication, test_nccl_transport (needs the machine's
#   libnccl.so.2: the system's, the CUDA toolkit's, or torch's nvidia-nccl wheel; needs 2 GPUs,
#   else it skips),
#   bench_gpu (bench_gpu.json: detect bandwidth as a fraction of a copy measured in the same run),
#   compute-sanitizer memcheck on test_cuda_pipeline's receiver and refusal cases ("skipped: no
#   compute-sanitizer" where the tool is missing, or the reason it could not start),
#   the binding's CUDA test (tests/python/test_cuda.py) and bench_binding.py, with the machine's
#   python3 and torch, where the bundle's dte._native is for that python (else skipped, saying so).
# Writes under OUTDIR (default $OUT, else ./gpu-out): summary.json (the device's name, driver,
# memory and compute capability; per step its status, exit code, seconds and log), device.txt,
# one log per step, bench_gpu.json, bench_binding.json.
# Where no device is (tools/gpu-bundle.sh runs it so in CI) every executable must load, pass its
# no-device checks and skip (exit 77); summary.json then says "no device". Exit 0 when nothing
# failed.
#   bench/gpu/run.sh BUNDLE [OUTDIR]       (the bundle's own copy: BUNDLE/run.sh BUNDLE [OUTDIR])
set -uo pipefail
bundle="${1:?usage: run.sh BUNDLE [OUTDIR] (BUNDLE: what tools/gpu-bundle.sh made)}"
bundle="$(cd "$bundle" && pwd)"
out="${2:-${OUT:-$PWD/gpu-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
budget="${DTE_GPU_BUDGET_S:-285}"
[ "$budget" -le 285 ] || budget=285
start=$(date +%s)
deadline=$((start + budget))
[ -d "$bundle/bin" ] && [ -f "$bundle/MANIFEST" ] || {
  echo "run.sh: $bundle is not a bundle (no bin/ or MANIFEST): make one with tools/gpu-bundle.sh" >&2
  exit 2
}

json_escape() { local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '%s' "${s//$'\n'/ }"; }
steps=()  # '"name": {...}' each
record() {  # name status rc seconds log
  steps+=("\"$1\": {\"status\": \"$(json_escape "$2")\", \"rc\": ${3:-null}, \"seconds\": $4, \"log\": \"$5\"}")
  printf 'run.sh: %-22s %s (%s s)\n' "$1" "$2" "$4"
}

# The device.
devices=0
name="" driver="" memory="" capability=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$out/device.txt" 2>&1 || true
  line=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv,noheader 2>/dev/null | head -1)
  devices=$(timeout 20 nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  IFS=',' read -r name driver memory capability <<<"$line"
  name="${name# }" driver="${driver# }" memory="${memory# }" capability="${capability# }"
else
  echo "no nvidia-smi on this machine" >"$out/device.txt"
fi

# Libraries: the bundle's, then the machine's NCCL (the system's, else a Python wheel's).
libs="$bundle/lib"
nccl=""
if ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
  nccl="system"
elif n=$(ls /usr/local/cuda*/lib*/libnccl.so.2 2>/dev/null | head -1) && [ -n "$n" ]; then
  nccl="$(dirname "$n")"
  libs="$libs:$nccl"
else
  for py in python3 /usr/bin/python3; do
    command -v "$py" >/dev/null || continue
    for site in $("$py" -c "import site; print(' '.join(site.getsitepackages()))" 2>/dev/null); do
      n=$(find "$site/nvidia" -maxdepth 4 -name 'libnccl.so.2' 2>/dev/null | head -1)
      if [ -n "$n" ]; then nccl="$(dirname "$n")"; libs="$libs:$nccl"; break 2; fi
    done
  done
fi
machine_ld="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="$libs${machine_ld:+:$machine_ld}"

# One step: name cap command...; its timeout is min(cap, what the budget has left).
status_of() {  # rc -> status
  case "$1" in
    0) echo passed ;;
    77) echo "skipped: no CUDA device" ;;
    124 | 137) echo "timed out after $2 s" ;;
    *) echo "failed (exit $1)" ;;
  esac
}
failed=0
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((deadline - $(date +%s) - 10))
  if [ "$left" -lt 5 ]; then
    record "$name" "not run: the ${budget} s budget was spent" null 0 ""
    return 1
  fi
  local t=$((cap < left ? cap : left)) t0 rc
  t0=$(date +%s)
  timeout -k 5 "$t" "$@" >"$out/$name.log" 2>&1
  rc=$?
  local st
  st=$(status_of "$rc" "$t")
  case "$st" in passed | skipped*) ;; *) failed=1 ;; esac
  record "$name" "$st" "$rc" "$(($(date +%s) - t0))" "$name.log"
  return "$rc"
}
# An executable of the bundle: refused before it runs when a library it needs is missing.
run_exe() {
  local name="$1" cap="$2"
  shift 2
  local exe="$bundle/bin/$name" missing
  if [ ! -x "$exe" ]; then
    record "$name" "not in this bundle" null 0 ""
    return
  fi
  missing=$(ldd "$exe" 2>&1 | sed -n 's/^[[:space:]]*\([^ ]*\) => not found/\1/p' | tr '\n' ' ')
  if [ -n "$missing" ]; then
    if [ "$missing" = "libnccl.so.2 " ]; then
      record "$name" "skipped: no libnccl.so.2 on this machine (system or python wheel)" null 0 ""
    else
      record "$name" "failed: libraries not found: $missing" null 0 ""
      failed=1
    fi
    return
  fi
  step "$name" "$cap" "$exe" "$@"
}

run_exe test_cuda_backend 40
run_exe test_cuda_pipeline 75
run_exe test_cuda_golden 45
run_exe test_cuda_publication 30
run_exe test_nccl_transport 30
run_exe bench_gpu 45 --out "$out/bench_gpu.json"

# compute-sanitizer memcheck on the receiver's writes and a refusal.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "$devices" = 0 ]; then
  record memcheck "skipped: no CUDA device" null 0 ""
elif [ ! -x "$sanitizer" ]; then
  record memcheck "skipped: no compute-sanitizer" null 0 ""
else
  t0=$(date +%s)
  left=$((deadline - t0 - 10))
  if [ "$left" -lt 5 ]; then
    record memcheck "not run: the ${budget} s budget was spent" null 0 ""
  else
    cap=$((60 < left ? 60 : left))
    timeout -k 5 "$cap" "$sanitizer" --tool memcheck --error-exitcode 1 \
      "$bundle/bin/test_cuda_pipeline" '--test-case=*device apply*,*refused*' >"$out/memcheck.log" 2>&1
    rc=$?
    if [ "$rc" != 0 ] && grep -qiE 'not supported|unable to|could not|failed to (start|launch|initialize)' "$out/memcheck.log" &&
      ! grep -q 'ERROR SUMMARY: [1-9]' "$out/memcheck.log"; then
      record memcheck "skipped: compute-sanitizer could not run here: $(grep -m1 -iE 'not supported|unable to|could not|failed to' "$out/memcheck.log")" "$rc" "$(($(date +%s) - t0))" memcheck.log
    else
      st=$(status_of "$rc" "$cap")
      [ "$st" = passed ] || failed=1
      record memcheck "$st" "$rc" "$(($(date +%s) - t0))" memcheck.log
    fi
  fi
fi

# The binding, with this machine's python3 and torch.
python=""
for p in ${DTE_GPU_PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then python="$p"; break; fi
done
binding_skip=""
if [ ! -f "$bundle/python/TAG" ]; then
  binding_skip="skipped: the bundle has no binding ($(sed -n 's/^binding: //p' "$bundle/MANIFEST"))"
elif [ -z "$python" ]; then
  binding_skip="skipped: no python3 with torch on this machine"
elif [ "$("$python" -c 'import sys; print(sys.implementation.cache_tag)')" != "$(cat "$bundle/python/TAG")" ]; then
  binding_skip="skipped: the bundle's dte._native is for $(cat "$bundle/python/TAG"), this machine's $python is $("$python" -c 'import sys; print(sys.implementation.cache_tag)') (make the bundle with a venv of that Python: DTE_PYTHON_VENV)"
elif ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  binding_skip="skipped: this machine's torch sees no CUDA device"
fi
if [ -n "$binding_skip" ]; then
  record binding_test "$binding_skip" null 0 ""
  record binding_bench "$binding_skip" null 0 ""
else
  # (the bundle's dte and pytest first; the machine's libraries first, then the extension's own
  # python/lib: not the bundle's CUDA runtime, torch loads its own)
  py_env=(env PYTHONPATH="$bundle/python" PYTHONDONTWRITEBYTECODE=1)
  py_env+=(LD_LIBRARY_PATH="${machine_ld:+$machine_ld:}$bundle/python/lib")
  step binding_test 60 "${py_env[@]}" "$python" -m pytest -q -rs -p no:cacheprovider \
    "$bundle/src/tests/python/test_cuda.py"
  step binding_bench 60 "${py_env[@]}" "$python" "$bundle/src/bench/gpu/bench_binding.py" \
    --small --out "$out/bench_binding.json"
fi

status=ok
[ "$devices" = 0 ] && status="no device"
[ "$failed" = 0 ] || status=failed
{
  printf '{\n  "status": "%s",\n' "$status"
  printf '  "device": {"name": "%s", "driver": "%s", "memory": "%s", "compute_capability": "%s", "count": %s},\n' \
    "$(json_escape "$name")" "$(json_escape "$driver")" "$(json_escape "$memory")" "$(json_escape "$capability")" "${devices:-0}"
  printf '  "bundle": "%s",\n' "$(json_escape "$(head -1 "$bundle/MANIFEST")")"
  printf '  "nccl": "%s",\n' "$(json_escape "${nccl:-not found}")"
  printf '  "budget_s": %s,\n  "seconds": %s,\n  "steps": {\n' "$budget" "$(($(date +%s) - start))"
  for i in "${!steps[@]}"; do
    printf '    %s%s\n' "${steps[$i]}" "$([ "$i" -lt $((${#steps[@]} - 1)) ] && echo ,)"
  done
  printf '  }\n}\n'
} >"$out/summary.json"
cat "$out/summary.json"
[ "$status" != failed ]
