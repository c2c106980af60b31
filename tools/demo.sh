#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Today's main job, until the demo sync arrives (issue 4): build the dte command, let the real
# torch.optim.AdamW take 5 steps on 1M weight-like elements, dump the last step, and have
# `dte audit-inverse` check that reconstructing the previous weights from the optimizer state
# finds every BF16 change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTE_BUILD_DIR:-$root/build}"

"$root/tools/install-deps.sh"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build "$build" --target dte_tool -j "$(nproc)" >/dev/null

dump="$build/demo-adamw-step.safetensors"
py=/usr/bin/python3
"$py" -c "import torch" 2>/dev/null || py=python3
"$py" "$root/tests/oracle/torch_oracle.py" --setting adamw_lr1e-5_wd0.01_eps1e-8 \
  --steps 5 --audit-file "$dump"
"$build/tools/dte/dte" audit-inverse "$dump"
