#!/usr/bin/env bash
# make bench: the pool's figures side by side, in one run (about 30-60 s on a loaded 2-core machine).
#  1. capacity: every snapshot in ../shared/traces replayed through memshim's pool (tensor mode:
#     memshim places every tensor) on the simulated device; its minimum capacity next to the
#     minimum of the models of PyTorch's allocator (like with like), and what PyTorch held in the
#     recording with no limit (shown alongside, not a minimum);
#  1b. the front end (issue 30): its hit rate per trace with no limit (first pass, passes 2-3), and
#     the minimum capacity, steady state and no-limit reserve with and without it;
#  2. modelled driver time of the first pass (policy/drvcost.c's table): memshim vs torch vs
#     torch-expandable, with no limit and at each one's minimum capacity;
#  3. steady state at tight capacity: memshim's map+unmap in passes 2 and 3 at its minimum
#     capacity, +0.5% and +1% (the issue 10 target table), with the last pass's driver time;
#  4. replay speed as a range over BENCH_RUNS runs (default 5), and the cached-path latency of the
#     pool next to glibc malloc/free;
#  then section 3's steady state on SYNTHETIC offload/reload traces (scripts/gen_offload_trace.py,
#  written into $BUILD/bench/ at each run: no real trace of that workload exists), on SYNTHETIC
#  held-out-like transformations of every recording (scripts/bench_heldout.sh, about 5 minutes), and
#  every recording replayed below its live peak with spill to host memory (scripts/bench_spill.py,
#  about 5 minutes);
#  5b. the cached alloc+free pair through the tensor-mode entry points beside glibc in the same
#     process (tests/bench/bench_front.py): hits, misses, the pool path, the learned-step regime,
#     1 and 4 threads, with no limit and at 1.1x the live peak, with callgrind's instructions;
#  7. streams: event records, waits, queries and synchronizes per 1000 alloc/free pairs for a
#     DDP-like stream mix (tests/bench/bench_streams.c), beside PyTorch's allocator's rules.
# Prints markdown (docs/benchmarks.md quotes it with the date and the machine). MEMSHIM_TRACES
# points at another trace folder; BENCH_RUNS sets the number of speed runs.
set -euo pipefail
BUILD="${BUILD:-build}"
cd "$(dirname "$0")/.."
TRACES="${MEMSHIM_TRACES:-../shared/traces}"
RUNS="${BENCH_RUNS:-5}"
started=$(date +%s.%N)

echo "## memshim bench — $(date -u +%Y-%m-%d) — $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
if [ -d "$TRACES" ]; then
    mapfile -t files < <(find "$TRACES" -name '*.pickle' | sort)
    out="$BUILD/bench"
    mkdir -p "$out"
    # speed runs first (also the minimum capacity of every trace), then the side by side
    for r in $(seq 1 "$RUNS"); do
        "$BUILD/memshim-replay" --json --capacity auto "${files[@]}" > "$out/auto-$r.jsonl"
    done
    "$BUILD/memshim-replay" --compare --json --passes 3 --capacity A100-80GB "${files[@]}" > "$out/compare.jsonl"
    # the pool without its front end (issue 30): what the front end may not make worse
    "$BUILD/memshim-replay" --no-front --json --capacity auto --passes 3 "${files[@]}" > "$out/nofront.jsonl"
    "$BUILD/memshim-replay" --json --capacity auto --passes 3 "${files[@]}" > "$out/front.jsonl"
    BUILD="$BUILD" python3 - "$out" "$TRACES" "$RUNS" <<'PY'
import json, math, os, statistics, subprocess, sys
out, root, runs = sys.argv[1], sys.argv[2].rstrip("/") + "/", int(sys.argv[3])
replay = os.path.join(os.environ.get("BUILD", "build"), "memshim-replay")
MiB, PAGE = 2**20, 2 * 2**20
key = lambda d: (d["trace"], d["device"])
auto = [[json.loads(l) for l in open(f"{out}/auto-{r}.jsonl")] for r in range(1, runs + 1)]
first = auto[0]
speeds = {key(d): [] for d in first}
speeds_np = {key(d): [] for d in first}  # less the learned step's packing (a job does it on the planner thread)
plan_s = {key(d): [] for d in first}
for run in auto:
    for d in run:
        speeds[key(d)].append(d["events_per_second"] / 1e6)
        speeds_np[key(d)].append(d["events_per_second_excluding_planner"] / 1e6)
        plan_s[key(d)].append(d["planner_seconds"])
cmp = {key(d): d for d in map(json.loads, open(f"{out}/compare.jsonl"))}
name = lambda d: d["trace"].replace(root, "") + (f" (device {d['device']})" if d["device"] else "")
noev = lambda d: d["events"] == 0

print("Tensor mode (memshim places every tensor), replayed on the simulated device with 2 MiB pages.")
print("Traces marked † have no events (the allocator state at dump time only): their figures are")
print("the dump's live set and they are left out of every summary line.")
print()
print("### 1. Minimum capacity, like with like")
print()
print("| trace | events | peak live (MiB) | memshim min (x live) | torch model min (x live) | torch-expandable model min (x live) | memshim vs torch min | PyTorch held, recorded, no limit (x live) | memshim, no limit (x live) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
gain, worst = [], []
for d in first:
    c = cmp[key(d)]["policies"]
    pl = d["peak_live_bytes"] or 1
    ms, tn, te = (c[k]["min_capacity_bytes"] for k in ("memshim", "torch", "torch-expandable"))
    rec = d["recorded_peak_reserved_bytes"] / pl if d["recorded_peak_reserved_bytes"] else float("nan")
    if not noev(d):
        gain.append(1 - ms / tn)
        worst.append(ms / pl)
    print(f"| {name(d)}{' †' if noev(d) else ''} | {d['events']} | {pl / MiB:.0f} | {ms / pl:.4f} | {tn / pl:.4f} | "
          f"{te / pl:.4f} | {-100 * (1 - ms / tn):+.1f}% | {rec:.3f} | {d['unlimited_peak_reserved_bytes'] / pl:.4f} |")
print()
print(f"memshim's minimum capacity / peak live: max {max(worst):.4f}, median {statistics.median(worst):.4f}; "
      f"vs the torch model's minimum: {100 * min(gain):.1f}% to {100 * max(gain):.1f}% smaller "
      f"(median {100 * statistics.median(gain):.1f}%), {len(gain)} traces with events")

print()
print("### 1b. The front end (issue 30): hit rate, and what it may not make worse")
print()
print("Allocations served from the front end's bins (a block freed on the same stream with the same")
print("size), as a share of the trace's allocations, with no limit, in the first pass and in passes 2-3")
print("of the trace replayed three times (while it is out for churn, none are served); the")
print("minimum capacity, passes 2-3 at it (map+unmap) and the peak reserved with no limit, with the front")
print("end and without it (memshim-replay --no-front), on the same streams.")
print()
print("| trace | hits, pass 1 | hits, passes 2-3 | front state after | min capacity (MiB): front / none | passes 2-3 at C, map+unmap: front / none | no limit, reserved / live: front / none |")
print("|---|---:|---:|---|---:|---:|---:|")
fr = {key(d): d for d in map(json.loads, open(f"{out}/front.jsonl"))}
nf = {key(d): d for d in map(json.loads, open(f"{out}/nofront.jsonl"))}
r1, r2, worse = [], [], []
for d in first:
    if noev(d):
        continue
    a, b = fr[key(d)], nf[key(d)]
    h, m = a["front_hits"], a["front_misses"]
    h2, m2 = a["front_later_hits"], a["front_later_misses"]
    n = a["allocs"] or 1
    p1 = h / n
    p2 = h2 / (2 * n)
    r1.append(p1)
    r2.append(p2)
    st = "churn (out)" if h2 + m2 == 0 and h + m else "on"
    sa, sb = a["steady_map_ops"] + a["steady_unmap_ops"], b["steady_map_ops"] + b["steady_unmap_ops"]
    pl = a["peak_live_bytes"] or 1
    ua, ub = a["unlimited_peak_reserved_bytes"] / pl, b["unlimited_peak_reserved_bytes"] / pl
    if a["min_capacity_bytes"] > b["min_capacity_bytes"] or sa > sb:
        worse.append(name(d))
    print(f"| {name(d)} | {100 * p1:.0f}% | {100 * p2:.0f}% | {st} | {a['min_capacity_bytes'] // MiB} / {b['min_capacity_bytes'] // MiB} | "
          f"{sa} / {sb} | {ua:.3f} / {ub:.3f} |")
print()
print(f"allocations served, first pass: {100 * min(r1):.0f}% to {100 * max(r1):.0f}% (median {100 * statistics.median(r1):.0f}%); "
      f"passes 2-3: {100 * min(r2):.0f}% to {100 * max(r2):.0f}% (median {100 * statistics.median(r2):.0f}%); "
      f"minimum capacity or steady state worse with the front end: {len(worse)} of {len(r1)} traces {worse if worse else ''}")

print()
print("### 2. Modelled driver time of the first pass (seconds; cost table: docs/benchmarks.md)")
print()
print("| trace | memshim, no limit | torch, no limit | torch-expandable, no limit | memshim at its min | torch at its min | torch-expandable at its min | memshim / torch-expandable (no limit) | memshim calls (create/map/set_access/unmap/sync) at min |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
ratio = []
for d in first:
    c = cmp[key(d)]["policies"]
    u = [c[k]["unlimited_driver_seconds"] for k in ("memshim", "torch", "torch-expandable")]
    m = [c[k]["driver_seconds"] for k in ("memshim", "torch", "torch-expandable")]
    dc = c["memshim"]["driver_calls"]
    r = u[0] / u[2] if u[2] else float("inf")
    if not noev(d):
        ratio.append(r)
    print(f"| {name(d)}{' †' if noev(d) else ''} | {u[0]:.3f} | {u[1]:.3f} | {u[2]:.3f} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} | "
          f"{r:.1f}x | {dc['create']}/{dc['map']}/{dc['set_access']}/{dc['unmap']}/{dc['synchronize']} |")
print()
met = sum(1 for d in first if not noev(d) and
          cmp[key(d)]["policies"]["memshim"]["unlimited_driver_seconds"] <= cmp[key(d)]["policies"]["torch-expandable"]["unlimited_driver_seconds"])
print(f"memshim / torch-expandable, first pass with no limit: {min(ratio):.1f}x to {max(ratio):.1f}x "
      f"(median {statistics.median(ratio):.1f}x); target (<= 1x) met on {met} of {len(ratio)} traces with events")
# at each allocator's own minimum capacity: under a limit the pool keeps one handle per page (every
# page reclaimable alone), expandable segments 20 MiB handles; access grants are paid per mapping
rm = [cmp[key(d)]["policies"]["memshim"]["driver_seconds"] / cmp[key(d)]["policies"]["torch-expandable"]["driver_seconds"]
      for d in first if not noev(d) and cmp[key(d)]["policies"]["torch-expandable"]["driver_seconds"]]
print(f"memshim / torch-expandable, first pass, each at its own minimum capacity: {min(rm):.1f}x to {max(rm):.1f}x "
      f"(median {statistics.median(rm):.1f}x): one 2 MiB handle per page near a limit, against their 20 MiB handles")

print()
print("### 3. Steady state at tight capacity (memshim, passes 2 and 3 of 3)")
print()
print("map+unmap operations in the 2nd and 3rd pass of the same stream (the live set released between")
print("passes, as a training step does), at memshim's minimum capacity C, C+0.5% and C+1% (each rounded")
print("up to a 2 MiB page), and the modelled driver time of the 3rd pass.")
print()
print("| trace | C (MiB) | at C: pass 2 / pass 3 | driver s, pass 3 | at C+0.5% | driver s | at C+1% | driver s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
churn = {0: 0, 1: 0, 2: 0}
for d in first:
    if noev(d):
        continue
    cmin = d["min_capacity_bytes"]
    cells = []
    for i, f in enumerate((1.0, 1.005, 1.01)):
        cap = math.ceil(cmin * f / PAGE) * PAGE
        p = subprocess.run([replay, "--json", "--passes", "3", "--capacity", str(cap), d["trace"]],
                           capture_output=True, text=True, check=True)
        s = [json.loads(l) for l in p.stdout.splitlines() if json.loads(l)["device"] == d["device"]][0]
        last = s["last_pass_map_ops"] + s["last_pass_unmap_ops"]
        p2 = s["steady_map_ops"] + s["steady_unmap_ops"] - last
        churn[i] += (p2 > 0 or last > 0)
        oom = f", {s['steady_ooms']} OOM" if s["steady_ooms"] else ""
        cells.append(f"{p2} / {last}{oom} | {s['steady_driver_seconds']:.3f}")
    print(f"| {name(d)} | {cmin / MiB:.0f} | " + " | ".join(cells) + " |")
n = sum(1 for d in first if not noev(d))
print()
print(f"traces that still map or unmap after the first pass: {churn[0]} of {n} at C, {churn[1]} at C+0.5%, "
      f"{churn[2]} at C+1% (target: none at C+1%, aim: none at C+0.5%)")

print()
print(f"### 4. Replay speed (sustained Mevents/s, the stream replayed back to back; {runs} runs)")
print()
print("At memshim's minimum capacity. The replay packs the learned step on its own thread where it")
print("found the step (so that its figures do not depend on thread timing): the first columns include")
print("the packing; the next ones leave it out (what the allocating thread of a job sees: there the")
print("pool's planner thread packs while allocations go on); the last is the packing time.")
print()
print("| trace | events | min | median | max | min, packing left out | median | max | packing s (max) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
lo, lo_np = [], []
for d in first:
    if noev(d):
        continue
    v, w = speeds[key(d)], speeds_np[key(d)]
    lo.append(min(v))
    lo_np.append(min(w))
    print(f"| {name(d)} | {d['events']} | {min(v):.1f} | {statistics.median(v):.1f} | {max(v):.1f} | "
          f"{min(w):.1f} | {statistics.median(w):.1f} | {max(w):.1f} | {max(plan_s[key(d)]):.3f} |")
print()
print(f"slowest trace's worst run: {min(lo):.1f} Mevents/s ({min(lo_np):.1f} with the packing left out); "
      f"median over traces of the worst run: {statistics.median(lo):.1f} Mevents/s "
      f"({statistics.median(lo_np):.1f}) (target >= 5)")
PY
else
    echo "(../shared/traces not found: skipping the trace replay tables)"
fi
echo
echo "### Synthetic offload/reload traces: steady state at tight capacity (section 3's method)"
echo
echo "SYNTHETIC, not recorded: scripts/gen_offload_trace.py writes a training step that reloads each"
echo "layer's weights (24 layers, 50-400 MiB, seeded) before use and offloads them after, keeps"
echo "activations for backward and prefetches the next layer on a copy stream (docs/benchmarks.md)."
echo "Generated into $BUILD/bench/ at each run; map+unmap in passes 2 and 3 of 3 at memshim's"
echo "minimum C, C+0.5% and C+1%, and the 3rd pass's modelled driver time, as in section 3."
echo
mkdir -p "$BUILD/bench"
offload=()
for s in 1 2 3 4; do
    python3 scripts/gen_offload_trace.py --seed "$s" -o "$BUILD/bench/synthetic-offload-seed$s.txt"
    offload+=("synthetic, seed $s=$BUILD/bench/synthetic-offload-seed$s.txt")
done
python3 scripts/gen_offload_trace.py --seed 1 --no-prefetch -o "$BUILD/bench/synthetic-offload-seed1-noprefetch.txt"
offload+=("synthetic, seed 1, no prefetch=$BUILD/bench/synthetic-offload-seed1-noprefetch.txt")
python3 scripts/bench_offload.py "$BUILD/memshim-replay" "${offload[@]}"
echo
echo "### Held-out-like traces: SYNTHETIC transformations of every recording (section 3's method, page model beside)"
echo
BUILD="$BUILD" bash scripts/bench_heldout.sh
echo
echo "### Spill to host memory: every trace at 0.95x and 0.9x of its live peak (MEMSHIM_SPILL=host, first pass)"
echo
if [ -d "$TRACES" ]; then
    mapfile -t spill_traces < <(find "$TRACES" -name '*.pickle' | sort)
    python3 scripts/bench_spill.py "$BUILD/memshim-replay" "${spill_traces[@]}"
else
    echo "($TRACES not found: skipping the spill table)"
fi
echo
echo "### 5. Cached-path latency (pool over the simulated device vs glibc, same sizes, same process)"
echo
if [ -f tests/bench/bench_latency.c ]; then
    gcc -O2 -std=c11 -D_GNU_SOURCE -pthread -Ishim -Ipolicy -Ipolicy/base -I"${CUDA_HOME:-/usr/local/cuda}/include" tests/bench/bench_latency.c "$BUILD/libmemshim_core.a" -ldl -lm -o "$BUILD/bench_latency"
    "$BUILD/bench_latency"
else
    echo "(tests/bench/bench_latency.c missing)"
fi

echo
echo "### 5b. The cached pair through the tensor-mode entry points, beside glibc (issue 30)"
echo
python3 tests/bench/bench_front.py "$BUILD"
echo
echo "### 6. Cost of reports, allocation sites and the snapshot ring (tensor-mode path, CPython + driver double)"
echo
python3 tests/bench/bench_reports.py "$BUILD"
echo
echo "### 7. Streams: event records and waits per 1000 alloc/free pairs (pool on the CUDA driver double)"
echo
gcc -O2 -std=c11 -D_GNU_SOURCE -pthread -Ishim -Ipolicy -Ipolicy/base -Itests/cudadouble tests/bench/bench_streams.c \
    "$BUILD/libmemshim_core.a" -L"$BUILD/double" -Wl,-rpath,"$(cd "$BUILD/double" && pwd)" -lcuda -ldl -lm \
    -o "$BUILD/bench_streams"
"$BUILD/bench_streams"
echo
echo "### 8. Allocation latency without the GIL while another Python thread runs (issue 16)"
echo
python3 tests/bench/bench_gil.py "$BUILD"
echo
echo "(make bench took $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.0f}')" "$started" "$(date +%s.%N)") s)"
