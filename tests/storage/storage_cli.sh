#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue 12, done-when 5: `dte simulate --transport storage` with a reader lagging 3 versions
# ends bit-identical, `dte verify` passes on the result, and after one byte of a chunk is
# flipped `dte verify` fails naming that chunk. `dte inspect --json` reports every version. A
# run with the class index (--encoding diff --index classes) verifies too.
#   storage_cli.sh DTE WORKDIR
set -euo pipefail
dte="$1"
work="$2"
rm -rf "$work"
mkdir -p "$work"
root="$work/root"

"$dte" simulate --transport storage --dir "$root" --model tiny-qwen3 --train tp=2,dp=2 \
  --infer tp=2,replicas=2 --steps 12 --anchor-every 5 --reader-lag 3 --lr 3e-5 | tee "$work/sim.txt"
grep -q "the lagging reader caught up bit-identical" "$work/sim.txt"
grep -q "^VERIFIED" "$work/sim.txt"

"$dte" verify "$root" | tee "$work/verify.txt"
grep -q ": OK$" "$work/verify.txt"

"$dte" inspect "$root" --json > "$work/inspect.json"
grep -q '"latest":13' "$work/inspect.json"
grep -q '"chain":\[13,12,11,10\]' "$work/inspect.json"

# One byte of one chunk of version 7, flipped.
chunk="$(ls "$root"/v00000000000000000007/*.zst | head -1)"
size=$(stat -c %s "$chunk")
offset=$((size / 2))
byte=$(od -An -tu1 -j "$offset" -N1 "$chunk" | tr -d ' ')
printf "$(printf '\\%03o' $((byte ^ 1)))" | dd of="$chunk" bs=1 seek="$offset" conv=notrunc status=none
set +e
"$dte" verify "$root" > "$work/verify-bad.txt"
rc=$?
set -e
cat "$work/verify-bad.txt"
[ "$rc" -eq 1 ] || { echo "dte verify exited $rc after a flipped byte, expected 1"; exit 1; }
grep -q "^FAULT $chunk: .*xxh3" "$work/verify-bad.txt"

# The same with diff values and the class index: readers and dte verify resolve it.
"$dte" simulate --transport storage --dir "$work/classes" --model tiny-qwen3 --train tp=2,dp=2 \
  --infer tp=2,replicas=2 --steps 8 --anchor-every 5 --reader-lag 3 --lr 3e-6 --encoding diff \
  --index classes | tee "$work/sim-classes.txt"
grep -q "the lagging reader caught up bit-identical" "$work/sim-classes.txt"
grep -q "^VERIFIED" "$work/sim-classes.txt"
"$dte" verify "$work/classes" | tee "$work/verify-classes.txt"
grep -q ": OK$" "$work/verify-classes.txt"
set +e
"$dte" simulate --transport storage --dir "$work/refused" --index classes > "$work/refused.txt" 2>&1
rc=$?
set -e
[ "$rc" -ne 0 ] && grep -q "needs --encoding diff" "$work/refused.txt"
echo "storage_cli: OK"
