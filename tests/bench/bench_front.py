#!/usr/bin/env python3
"""The cached alloc+free pair through the tensor-mode entry points (memshim_torch_alloc /
memshim_torch_free, what PyTorch's pluggable allocator calls), beside glibc's malloc/free over the
same sizes in the same processes (issue 30). Not a test: scripts/bench.sh runs it (make bench) and
docs/benchmarks.md quotes the table.

Each configuration is its own process (memshim reads its settings once), built from
tests/bench/bench_front.c and run under LD_PRELOAD=libmemshim.so on the CUDA driver double; the
configurations alternate over ROUNDS rounds and the table gives the median and range over the
rounds of ns per pair (thread CPU time, the fastest of 5 timed runs of 200 steps of 100 blocks in
each process), glibc's the same way in the same process, their ratio (taken within each round,
then the median), and the driver calls the double counted during the timed runs. The regimes:

  hit       the same 100 sizes every step (a training step repeating itself): the front end's hits
  small     the same, sizes 512 B - 8 KiB only: glibc's thread cache serves every one of them, the
            strictest comparison there is
  miss      new sizes at every step: the pool's general path (the front end steps out: churn)
  pool      the hit sequence with MEMSHIM_FRONT=0: the pool's general path for every request, what
            every allocation cost before the front end
  plan      a step that interleaves its frees, under a limit where it had to reclaim at first: the
            learned step places it (the front end stays out of its way)

The sizes: a PyTorch-like mix (55% 512 B - 64 KiB, 30% up to 1 MiB, 15% 1 - 24 MiB). Each step ends
with memshim_step() as PyTorch's optimizer hook calls it (under a limit the front end serves once two
steps showed room); the warm-up is 6 steps (100 for the learned step).
With BENCH_INSTRUCTIONS=1 (the default under make bench) it also counts the instructions executed
inside the two entry points per pair with valgrind's callgrind (the difference of a run of 25 and
one of 5 steps, so start-up and warm-up cancel out): what does not depend on the machine's load.

Usage: bench_front.py [BUILD]   (BENCH_ROUNDS, default 5; BENCH_INSTRUCTIONS=0 to skip callgrind)
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BUILD", "build"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
INSTR = os.environ.get("BENCH_INSTRUCTIONS", "1") != "0"

# (label, pattern, stream, limit, threads, warm-up steps, environment)
CONFIGS = [
    ("hit, default stream, no limit", "hit", "default", "none", 1, 6, {}),
    ("hit, side stream, no limit", "hit", "side", "none", 1, 6, {}),
    ("hit, default stream, limit 1.1x live peak", "hit", "default", "1.1", 1, 6, {}),
    ("hit, side stream, limit 1.1x live peak", "hit", "side", "1.1", 1, 6, {}),
    ("small (512 B - 8 KiB), default stream", "small", "default", "none", 1, 6, {}),
    ("hit, 4 threads (a stream each), one device", "hit", "side", "none", 4, 6, {}),
    ("hit, 4 threads on the default stream", "hit", "default", "none", 4, 6, {}),
    ("miss (new sizes every step), no limit", "miss", "default", "none", 1, 6, {}),
    ("pool path (MEMSHIM_FRONT=0), hit sequence", "hit", "default", "none", 1, 6, {"MEMSHIM_FRONT": "0"}),
    ("pool path (MEMSHIM_FRONT=0), side stream", "hit", "side", "none", 1, 6, {"MEMSHIM_FRONT": "0"}),
    ("learned step (plan), limit 1.12x live peak", "plan", "default", "1.12", 1, 100, {}),
]


def build_bench():
    exe = os.path.join(BUILD, "bench_front")
    src = os.path.join(ROOT, "tests", "bench", "bench_front.c")
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    p = subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-pthread",
                        "-I" + os.path.join(cuda, "include"), "-I" + os.path.join(ROOT, "tests", "cudadouble"), src,
                        "-L" + os.path.join(BUILD, "double"), "-lcuda", "-ldl", "-o", exe],
                       capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"bench_front.c does not build: {p.stderr[-800:]}")
    return exe


def env_for(extra, reports=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
    env.update({"LD_PRELOAD": os.path.join(BUILD, "libmemshim.so"), "LD_LIBRARY_PATH": os.path.join(BUILD, "double"),
                "MEMSHIM_LOG": "error", "CUDBL_CAPACITY": "8G"})
    if reports:
        env["MEMSHIM_REPORT_DIR"] = reports
    env.update(extra)
    return env


def run_one(exe, cfg, steps=200, reports=None):
    _, pat, stream, limit, threads, warm, extra = cfg
    p = subprocess.run([exe, pat, stream, limit, str(threads), str(steps), str(warm)], env=env_for(extra, reports),
                       capture_output=True, text=True, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return None
    return json.loads(lines[-1])


def front_state(exe, cfg):
    """What the front end and the learned step did in one run (its summary report)."""
    d = tempfile.mkdtemp(prefix="memshim-bench-front-")
    try:
        run_one(exe, cfg, steps=20, reports=d)
        for f in sorted(os.listdir(d)):
            if "summary" in f:
                r = json.load(open(os.path.join(d, f)))
                fr, o = r.get("front", {}), r["operations"]
                hits, misses = fr.get("hits", 0), fr.get("misses", 0)
                return f"{fr.get('state', '?')}, {100 * hits / max(1, hits + misses):.0f}% hits, {o['plans_built']} plans"
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return "?"


def instructions(exe, cfg):
    if not shutil.which("valgrind"):
        return None
    totals = []
    for steps in (5, 25):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cg.out")
            _, pat, stream, limit, threads, warm, extra = cfg
            p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                "--toggle-collect=memshim_torch_alloc", "--toggle-collect=memshim_torch_free",
                                exe, pat, stream, limit, str(threads), str(steps), str(warm)],
                               env=env_for(extra), capture_output=True, text=True, timeout=900)
            if p.returncode or not os.path.exists(out):
                return None
            total = None
            for line in open(out):
                if line.startswith("summary:") or line.startswith("totals:"):
                    total = int(line.split()[1])
            if total is None:
                return None
            totals.append(total)
    pairs = (25 - 5) * 5 * 100 * cfg[4]  # REPS timed runs of 100 blocks per step, per thread
    return (totals[1] - totals[0]) / pairs


def main():
    exe = build_bench()
    res = {c[0]: [] for c in CONFIGS}
    for _ in range(ROUNDS):
        for c in CONFIGS:
            d = run_one(exe, c)
            if d and not d["failed"]:
                res[c[0]].append(d)
    print("The cached alloc+free pair through the tensor-mode entry points (memshim_torch_alloc/_free) on the "
          "driver double, beside glibc malloc/free over the same sizes in the same process; ns per pair are "
          f"thread CPU time, median [range] over {ROUNDS} rounds (each the fastest of 5 timed runs of 200 steps "
          "x 100 blocks); ratio: memshim / glibc within each round, median; driver calls: what the double "
          "counted during the timed runs.")
    print()
    print("| regime | memshim ns/pair | glibc ns/pair | memshim / glibc | driver calls | instructions/pair | front end (a 20-step run) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    summary = {}
    for c in CONFIGS:
        rows = res[c[0]]
        if not rows:
            print(f"| {c[0]} | failed | | | | | |")
            continue
        ns = [r["ns"] for r in rows]
        g = [r["glibc_ns"] for r in rows]
        ratio = statistics.median(r["ns"] / r["glibc_ns"] for r in rows)
        calls = max(r["driver_calls"] for r in rows)
        ins = instructions(exe, c) if INSTR and c[4] == 1 else None
        summary[c[0]] = dict(ns=statistics.median(ns), glibc=statistics.median(g), ratio=ratio, instr=ins)
        print(f"| {c[0]} | {statistics.median(ns):.0f} [{min(ns):.0f}-{max(ns):.0f}] | {statistics.median(g):.0f} "
              f"[{min(g):.0f}-{max(g):.0f}] | {ratio:.2f} | {calls} | {'%.0f' % ins if ins else 'n/a'} | "
              f"{front_state(exe, c)} |")
    print()
    hit = summary.get("hit, default stream, no limit")
    pool = summary.get("pool path (MEMSHIM_FRONT=0), hit sequence")
    if hit and pool:
        print(f"front end hit / pool path: {hit['ns'] / pool['ns']:.2f} of the time"
              + (f", {hit['instr'] / pool['instr']:.2f} of the instructions" if hit["instr"] and pool["instr"] else ""))
    print(f"BENCH_FRONT_JSON {json.dumps(summary)}")


if __name__ == "__main__":
    main()
