#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tools/install-deps.sh's command line (issue 45): -h and --help print the usage (every mode,
# --dte included) and exit 0; an unknown argument says so on stderr and exits 2; none of them
# installs anything. apt-get, sudo, dpkg-query, pip and python3 are shadowed on PATH by fakes
# that leave a marker, so a call that reached the installer is seen without installing anything.
#   install_deps_cli.sh [INSTALL_DEPS]   (default: tools/install-deps.sh of this checkout)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
script="${1:-$here/../../tools/install-deps.sh}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
marker="$work/installer-ran"
mkdir "$work/bin"
for fake in apt-get apt sudo dpkg-query pip pip3 python python3 python3.10 python3.11 python3.12; do
  printf '#!/bin/sh\necho "%s $*" >>"%s"\nexit 0\n' "$fake" "$marker" >"$work/bin/$fake"
  chmod +x "$work/bin/$fake"
done
export PATH="$work/bin:$PATH"
# A vllm run that got past the checks would build this venv.
export DTE_VLLM_VENV="$work/vllm-venv"

failures=0
fail() {
  echo "install_deps_cli: FAIL: $*" >&2
  failures=$((failures + 1))
}
# run ARGS...: the script's exit status in $rc, its stdout and stderr in $work/out, $work/err
run() {
  rc=0
  bash "$script" "$@" >"$work/out" 2>"$work/err" </dev/null || rc=$?
}
nothing_ran() {
  if [ -e "$marker" ]; then
    fail "$1 ran the installer: $(tr '\n' ';' <"$marker" | head -c 200)"
    rm -f "$marker"
  fi
  if [ -e "$DTE_VLLM_VENV" ]; then
    fail "$1 created $DTE_VLLM_VENV"
    rm -rf "$DTE_VLLM_VENV"
  fi
}

for help in --help -h; do
  run "$help"
  [ "$rc" -eq 0 ] || fail "$help exited $rc, not 0"
  grep -q "vllm" "$work/out" || fail "$help: the usage on stdout does not mention vllm"
  grep -q -- "--dte" "$work/out" || fail "$help: the usage on stdout does not mention --dte"
  for mode in demo plots; do
    grep -q "$mode" "$work/out" || fail "$help: the usage on stdout does not mention $mode"
  done
  nothing_ran "$help"
done

# Unknown arguments, alone and after a valid mode; --dte without vllm.
for args in "--bogus" "vllm --bogus" "demo --bogus" "--dte"; do
  # shellcheck disable=SC2086 # the words of $args are the arguments
  run $args
  [ "$rc" -eq 2 ] || fail "'$args' exited $rc, not 2"
  [ ! -s "$work/out" ] || fail "'$args' wrote to stdout: $(head -1 "$work/out")"
  grep -q "usage:" "$work/err" || fail "'$args': no usage on stderr"
  nothing_ran "'$args'"
done
run --bogus
grep -q "unknown argument" "$work/err" || fail "--bogus: no 'unknown argument' on stderr"

if [ "$failures" -ne 0 ]; then
  echo "install_deps_cli: $failures check(s) failed" >&2
  exit 1
fi
echo "install_deps_cli: OK"
