#!/usr/bin/env bash
# make bench: the pool's figures side by side, in one run.
#  1. every snapshot in ../shared/traces replayed through the pool: peak live, what the pool held
#     with no limit, the minimum capacity (--capacity auto), what PyTorch's own allocator held in
#     the recording, the steady-state second pass, and replay speed (sustained events/s);
#  2. the cached-path latency of pool alloc/free next to glibc malloc/free on the same sizes.
# Prints markdown tables (docs/benchmarks.md quotes them with the date and the machine).
set -euo pipefail
BUILD="${BUILD:-build}"
cd "$(dirname "$0")/.."
TRACES="${MEMSHIM_TRACES:-../shared/traces}"

echo "## memshim bench — $(date -u +%Y-%m-%d) — $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo
if [ -d "$TRACES" ]; then
    mapfile -t files < <(find "$TRACES" -name '*.pickle' | sort)
    "$BUILD/memshim-replay" --json --capacity auto "${files[@]}" > "$BUILD/bench-auto.jsonl"
    "$BUILD/memshim-replay" --json --passes 2 "${files[@]}" > "$BUILD/bench-steady.jsonl"
    python3 - "$BUILD/bench-auto.jsonl" "$BUILD/bench-steady.jsonl" "$TRACES" <<'PY'
import json, sys, statistics
auto = [json.loads(l) for l in open(sys.argv[1])]
steady = {(d["trace"], d["device"]): d for d in map(json.loads, open(sys.argv[2]))}
root = sys.argv[3].rstrip("/") + "/"
print("### Capacity and speed per trace (simulated device, 2 MiB pages)")
print()
print("| trace | events | peak live (MiB) | pool, no limit (x live) | min capacity (x live) | PyTorch held (x live) | 2nd pass maps/unmaps | Mevents/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
ratios, speeds, torch = [], [], []
for d in auto:
    pl = d["peak_live_bytes"] or 1
    s = steady.get((d["trace"], d["device"]), {})
    r = d["min_capacity_bytes"] / pl
    ratios.append(r); speeds.append(d["events_per_second"])
    tr = d["recorded_peak_reserved_bytes"] / pl if d["recorded_peak_reserved_bytes"] else float("nan")
    if d["recorded_peak_reserved_bytes"]: torch.append(tr)
    print(f"| {d['trace'].replace(root, '')} | {d['events']} | {pl/2**20:.0f} | {d['unlimited_peak_reserved_bytes']/pl:.4f} | "
          f"{r:.4f} | {tr:.3f} | {s.get('steady_map_ops','?')}/{s.get('steady_unmap_ops','?')} | {d['events_per_second']/1e6:.1f} |")
print()
print(f"min capacity / peak live: max {max(ratios):.4f}, median {statistics.median(ratios):.4f} (target <= 1.03, aim 1.01)")
if torch:
    print(f"PyTorch's recorded peak reserved / peak live: max {max(torch):.3f}, median {statistics.median(torch):.3f}")
print(f"sustained replay speed: min {min(speeds)/1e6:.1f}, median {statistics.median(speeds)/1e6:.1f} Mevents/s (target >= 5)")
print(f"second pass at the first pass's capacity: {sum(s['steady_map_ops'] + s['steady_unmap_ops'] for s in steady.values())} map/unmap ops in total (target 0)")
PY
else
    echo "(../shared/traces not found: skipping the trace replay table)"
fi
echo
echo "### Cached-path latency (pool over the simulated device vs glibc, same sizes, same process)"
echo
if [ -f tests/bench/bench_latency.c ]; then
    gcc -O2 -std=c11 -D_GNU_SOURCE -pthread -Ishim -Ipolicy tests/bench/bench_latency.c "$BUILD/libmemshim_core.a" -ldl -lm -o "$BUILD/bench_latency"
    "$BUILD/bench_latency"
else
    echo "(tests/bench/bench_latency.c missing)"
fi
