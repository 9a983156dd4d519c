#!/usr/bin/env bash
# The replay suite: memshim-replay's CLI, bad input and the real traces (test_replay.py), and the
# SYNTHETIC offload/reload generator replayed under --check (test_offload_trace.py), and the targets
# of issue 15 on SYNTHETIC 10-stream and held-out-like traces (test_heldout.py). Prints each
# script's lines, then one closing line adding both up (tests/run.sh reads the last one).
d="$(dirname "$0")"
rc=0; P=0; F=0; S=0
for t in test_replay.py test_offload_trace.py test_heldout.py; do
    out=$(python3 "$d/$t" 2>&1) || rc=1
    printf '%s\n' "$out" | grep -vE '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$'
    line=$(printf '%s\n' "$out" | grep -Eo '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' | tail -1)
    [ -n "$line" ] || { echo "FAIL $t: no closing line"; F=$((F + 1)); continue; }
    set -- ${line//,/}
    P=$((P + $1)); F=$((F + $3)); S=$((S + ${5:-0}))
done
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ] && exit "$rc" || exit 1
