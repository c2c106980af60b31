# SPDX-License-Identifier: Apache-2.0
# Sourced by tools/test.sh and tools/python-tests.sh: `phase NAME COMMAND...` runs the command and
# prints its wall time to stderr (CI has 35 minutes: these lines say where they go).
phase() {
  local name="$1" t0=$SECONDS
  shift
  "$@"
  echo "phase: $name took $((SECONDS - t0)) s" >&2
}
