# SPDX-License-Identifier: Apache-2.0
# Sourced by tools/test.sh and tools/python-tests.sh: `phase NAME COMMAND...` runs the command and
# prints its wall time to stderr (CI has 35 minutes: these lines say where they go). Returns the
# command's status, also where the caller tests it (set -e does not reach into such a call).
phase() {
  local name="$1" t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "phase: $name took $((SECONDS - t0)) s" >&2
  else
    echo "phase: $name FAILED (exit $rc) after $((SECONDS - t0)) s" >&2
  fi
  return "$rc"
}
