#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian packages dte's build, tests, tools and benchmarks need: only those that
# are missing, so a prepared machine pays nothing. The CUDA toolkit (nvcc, CCCL, NCCL) is
# expected from the machine image; without it the CUDA targets are simply not built.
#   tools/install-deps.sh        everything (tools/test.sh)
#   tools/install-deps.sh demo   only what configuring and building the dte command needs
#                                (tools/demo.sh): no torch, MPI or clang, which only tests use
#   tools/install-deps.sh plots  only matplotlib, for tools/plot_benchmarks.py (docs/benchmarks.md)
set -euo pipefail

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
if [ "${1:-}" = "demo" ]; then packages=("${demo_packages[@]}"); fi
if [ "${1:-}" = "plots" ]; then packages=(python3-matplotlib); fi

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
  if python_missing "${1:-}"; then pip_install; fi
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if python_missing "${1:-}"; then pip_install; fi
echo "install-deps: done"
