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
    # Side by side with PyTorch (docs/models.md): the same streams through the models of PyTorch's
    # caching allocator, native (seeded with the segments the snapshot recorded) and expandable.
    t0=$(date +%s.%N)
    "$BUILD/memshim-replay" --compare --json --capacity A100-80GB "${files[@]}" > "$BUILD/bench-compare.jsonl"
    t1=$(date +%s.%N)
    python3 - "$BUILD/bench-compare.jsonl" "$TRACES" "$t0" "$t1" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
root = sys.argv[2].rstrip("/") + "/"
print()
print("### Side by side with PyTorch (minimum capacity, simulated device, 2 MiB pages)")
print()
print("| trace | peak live (MiB) | PyTorch held, recorded (x live) | torch model, no limit (x live) | memshim min (x live) | torch min (x live) | torch-expandable min (x live) | memshim vs torch | fits A100-80GB (memshim/torch/exp.) | memshim maps/unmaps at min | torch cudaMalloc/cudaFree at min |")
print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|")
gain, fails = [], 0
for d in rows:
    pl = d["peak_live_bytes"] or 1
    p = d["policies"]
    ms, tn, te = (p[k]["min_capacity_bytes"] for k in ("memshim", "torch", "torch-expandable"))
    rec = d["recorded_peak_reserved_bytes"] / pl if d["recorded_peak_reserved_bytes"] else float("nan")
    gain.append(1 - ms / tn)
    ok = ms <= tn and ms <= te and (tn <= 1.15 * pl or ms <= 0.9 * tn)
    fails += not ok
    fit = "/".join("yes" if p[k]["fits"] else "no" for k in ("memshim", "torch", "torch-expandable"))
    print(f"| {d['trace'].replace(root, '')} | {pl/2**20:.0f} | {rec:.3f} | {p['torch']['unlimited_peak_reserved_bytes']/pl:.3f} | "
          f"{ms/pl:.4f} | {tn/pl:.4f} | {te/pl:.4f} | {-100*(1-ms/tn):+.1f}% | {fit} | "
          f"{p['memshim']['map_ops']}/{p['memshim']['unmap_ops']} | {p['torch']['segments_created']}/{p['torch']['segments_freed']} |")
print()
print(f"memshim's minimum capacity vs the native model's: {100*min(gain):.1f}% to {100*max(gain):.1f}% smaller "
      f"(median {100*statistics.median(gain):.1f}%); targets (memshim <= both models; >= 10% below native where "
      f"native > 1.15x live) met on {len(rows)-fails} of {len(rows)} traces")
print(f"the whole comparison ({len(rows)} device traces, 3 policies, capacity searches): {float(sys.argv[4]) - float(sys.argv[3]):.1f} s")
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

echo
echo "### Cost of reports, allocation sites and the snapshot ring (tensor-mode path, CPython + driver double)"
echo
python3 tests/bench/bench_reports.py "$BUILD"
