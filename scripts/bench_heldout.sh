#!/usr/bin/env bash
# make bench, the section "Held-out-like traces": section 3's steady state on SYNTHETIC
# transformations of every recording in ../shared/traces (scripts/gen_heldout_traces.py: several
# steps, a recording that starts mid-step, a warm-up of another shape, sizes that vary per step, a
# short last batch, evaluation steps), the traces another author's script would plausibly record
# (issue 15, item 5). Written into $BUILD/bench/heldout/ at each run, never kept as data. Each row
# is measured by scripts/bench_offload.py --page-model: the pool's minimum capacity C next to the
# page model's (one handle per page), and map+unmap in passes 2 and 3 of 3 at C, C+0.5%, C+1%.
# Runs alone too: BUILD=build bash scripts/bench_heldout.sh
set -euo pipefail
BUILD="${BUILD:-build}"
cd "$(dirname "$0")/.."
TRACES="${MEMSHIM_TRACES:-../shared/traces}"
if [ ! -d "$TRACES" ]; then
    echo "($TRACES not found: no recording to transform, the held-out-like table is skipped)"
    exit 0
fi
out="$BUILD/bench/heldout"
mkdir -p "$out"
# three transformations of each recording, seeded: the same bytes at every run
transforms=("--steps 3 --jitter 0.1 --seed 1" "--steps 3 --rotate 0.37 --warmup --seed 2"
            "--steps 4 --eval 1 --last-batch --seed 3")
rows=()
i=0
while IFS= read -r f; do
    rel="${f#"$TRACES"/}"
    for t in "${transforms[@]}"; do
        i=$((i + 1))
        dst="$out/heldout$i.txt"
        # shellcheck disable=SC2086 # the transformation is a list of words
        if python3 scripts/gen_heldout_traces.py --replay "$BUILD/memshim-replay" "$f" -o "$dst" $t 2>"$dst.err"; then
            rows+=("$rel ${t% --seed*}=$dst")
        else
            echo "- $rel ${t% --seed*}: not transformed ($(tail -n1 "$dst.err"))"
        fi
    done
done < <(find "$TRACES" -name '*.pickle' | sort)
python3 scripts/bench_offload.py --page-model "$BUILD/memshim-replay" "${rows[@]}"
