#!/usr/bin/env python3
"""Allocation latency from a thread without the GIL while another Python thread is busy (issue 16
item 5): memshim_malloc timed one call at a time (wall clock), on the main thread inside an
"operator" (a C loop called through ctypes.CDLL, which releases the GIL as PyTorch's operators do,
its Python frames above) and on a thread with an idle Python thread state (autograd's device
threads), while a Python thread spins (holding the GIL but for the interpreter's switch interval).
Reports off against reports on with the default sites (MEMSHIM_SITES=frames), and with
MEMSHIM_SITES=acquire (re-taking the GIL: the default before issue 16) for context. Not a test:
scripts/bench.sh runs it; docs/benchmarks.md quotes the table.

Each configuration is its own process under LD_PRELOAD=libmemshim.so on the driver double (memshim
reads its settings once), the configurations alternate over ROUNDS rounds (BENCH_GIL_ROUNDS,
default 7); a process makes N=2000 allocations of 1 MiB, 200 us apart (pages stay mapped after the
warm-up: no driver call is timed), and reports p50 and p99. The table gives each percentile's median
over the rounds and its range. Target: p99 with reports and default sites within 2x of reports off.

Usage: bench_gil.py [BUILD [BUILD_BEFORE]]: with BUILD_BEFORE (a build of another commit, e.g. main
before issue 16) its default configuration with reports on runs in every round too."""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BUILD", "build"))
BEFORE = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else None
ROUNDS = int(os.environ.get("BENCH_GIL_ROUNDS", "7"))
N, GAP_NS, SIZE = 2000, 200_000, 1 << 20

JOB = r"""
import ctypes, json, os, sys, threading
lib = ctypes.CDLL(None)
bench = ctypes.CDLL(sys.argv[1])
kind = sys.argv[2]
m = ctypes.cast(lib.memshim_malloc, ctypes.c_void_p)
f = ctypes.cast(lib.memshim_free, ctypes.c_void_p)
lat = (ctypes.c_uint64 * N)()
def operator():  # the user's line that calls an operator: its frames are what sites name
    fn = bench.run_here if kind == "main" else bench.run_thread
    return fn(m, f, N, ctypes.c_ulonglong(GAP), ctypes.c_ulonglong(SIZE), lat)
warm = (ctypes.c_uint64 * 50)()
bench.run_here(m, f, 50, ctypes.c_ulonglong(0), ctypes.c_ulonglong(SIZE), warm)  # memshim starts, pages map
stop = False
def spin():
    x = 0
    while not stop:
        x += 1
t = threading.Thread(target=spin)
t.start()
rc = operator()
stop = True
t.join()
v = sorted(lat)
print(json.dumps({"rc": rc, "p50": v[len(v) // 2], "p99": v[int(len(v) * 0.99)], "max": v[-1]}))
""".replace("N)", f"{N})").replace(" N,", f" {N},").replace("GAP)", f"{GAP_NS})").replace("SIZE)", f"{SIZE})")

CONFIGS = [("reports off", {}),
           ("reports on, default sites (frames)", {"MEMSHIM_REPORT_DIR": "@"}),
           ("reports on, MEMSHIM_SITES=acquire (re-takes the GIL)", {"MEMSHIM_REPORT_DIR": "@", "MEMSHIM_SITES": "acquire"})]
if BEFORE:
    CONFIGS.append(("BUILD_BEFORE, reports on, its default sites", {"MEMSHIM_REPORT_DIR": "@", "_LIB": BEFORE}))
KINDS = [("main", "main thread inside an operator"), ("thread", "thread with an idle thread state")]


def main():
    so = os.path.join(BUILD, "bench", "gil_latency.so")
    os.makedirs(os.path.dirname(so), exist_ok=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", so, os.path.join(ROOT, "tests", "bench",
                                                                                       "gil_latency.c"), "-ldl"],
                   check=True)
    res = {(k, c): [] for k, _ in KINDS for c, _ in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="memshim-bench-gil-") as tmp:
        job = os.path.join(tmp, "job.py")
        with open(job, "w") as fh:
            fh.write(JOB)
        for r in range(ROUNDS):
            for k, _ in KINDS:
                for c, extra in CONFIGS:
                    env = {x: y for x, y in os.environ.items() if not x.startswith(("MEMSHIM_", "CUDBL_"))}
                    b = extra.get("_LIB", BUILD)
                    env.update({"LD_PRELOAD": os.path.join(b, "libmemshim.so"), "CUDBL_CAPACITY": "8G",
                                "LD_LIBRARY_PATH": os.path.join(b, "double"), "MEMSHIM_LOG": "error"})
                    env.update({x: (os.path.join(tmp, f"rep-{r}-{k}") if y == "@" else y) for x, y in extra.items()
                                if x != "_LIB"})
                    p = subprocess.run([sys.executable, job, so, k], env=env, capture_output=True, text=True,
                                       timeout=300)
                    d = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
                    if not d or d["rc"]:
                        sys.exit(f"bench_gil: {k}/{c} failed: {p.stderr[-500:]}")
                    res[(k, c)].append(d)

    def cell(v):
        return f"{statistics.median(v) / 1000:.1f} [{min(v) / 1000:.1f}-{max(v) / 1000:.1f}]"
    print(f"memshim_malloc latency in us, {N} calls of 1 MiB {GAP_NS // 1000} us apart while another Python thread "
          f"spins; median over {ROUNDS} rounds [range]")
    print()
    print("| allocating thread | configuration | p50 | p99 | max (median) | p99 / reports off |")
    print("|---|---|---:|---:|---:|---:|")
    for k, kname in KINDS:
        base = statistics.median(d["p99"] for d in res[(k, CONFIGS[0][0])])
        for c, _ in CONFIGS:
            v = res[(k, c)]
            p99 = statistics.median(d["p99"] for d in v)
            print(f"| {kname} | {c} | {cell([d['p50'] for d in v])} | {cell([d['p99'] for d in v])} | "
                  f"{statistics.median(d['max'] for d in v) / 1000:.1f} | {p99 / base:.2f}x |")
    for k, kname in KINDS:
        base = statistics.median(d["p99"] for d in res[(k, CONFIGS[0][0])])
        on = statistics.median(d["p99"] for d in res[(k, CONFIGS[1][0])])
        print(f"\n{kname}: p99 with reports and default sites {on / base:.2f}x reports off (target <= 2x): "
              f"{'met' if on <= 2 * base else 'NOT met'}")


if __name__ == "__main__":
    main()
