#!/usr/bin/env python3
"""What reports, allocation sites and the snapshot ring cost on memshim's tensor-mode allocation
path (memshim_malloc + memshim_free), side by side in one run. Not a test: scripts/bench.sh runs
it and docs/benchmarks.md quotes the table.

The path is driven as PyTorch drives it: a C loop (compiled here) calls memshim_malloc and
memshim_free through function pointers (the operator), called from four frames in a package under
site-packages/torch/ (as nn.Module's __call__, forward and F.linear are), called from the user's
code DEPTH frames deep: the site is the fifth frame from the top. With ctypes.CDLL the loop runs with the GIL released, as PyTorch's
operators do before they allocate, so memshim re-takes the GIL to read the stack; with
ctypes.PyDLL the GIL stays held. Sizes: 200 per step, 1 KiB to 1 MiB (a small-tensor mix: the
case where per-call costs weigh most). The double serves the memory (pages stay mapped after the
warm-up, so no driver call is timed).

memshim reads its settings once per process, so each configuration is its own process; the
configurations alternate over ROUNDS rounds. A process times REPS runs of STEPS steps and keeps
the fastest, timed in thread CPU time (clock_gettime(CLOCK_THREAD_CPUTIME_ID): preemption by other
processes on a shared machine is not counted; cache pollution still is); the table gives the median
and the range of the rounds' ns per alloc+free pair, and the fastest round (the least disturbed
estimate of the CPU cost when the machine is loaded). Usage: bench_reports.py [BUILD] (default: build, or $BUILD).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BUILD", "build"))
LIB = os.path.join(BUILD, "libmemshim.so")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "11"))
STEPS, BLOCKS, DEPTH, REPS = 100, 200, 6, 5

LOOP_C = r"""
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
typedef void *(*mf)(ssize_t, int, void *);
typedef void (*ff)(void *, ssize_t, int, void *);
/* thread CPU time: time this thread ran, so other processes on a shared machine do not count */
static uint64_t now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1000000000ull + t.tv_nsec; }
double loop(void *m_, void *f_, const long *sizes, int n, int steps)
{
    mf m = (mf)m_; ff f = (ff)f_; void *p[1024];
    if (n > 1024) n = 1024;
    uint64_t t0 = now();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < n; i++) p[i] = m(sizes[i], 0, 0);
        for (int i = n; i-- > 0;) f(p[i], sizes[i], 0, 0);
    }
    return (double)(now() - t0) / ((double)n * steps);
}
"""

CHILD = r"""
import ctypes, json, os, sys
lib = ctypes.PyDLL(os.environ["LIB"])
held = os.environ["GIL"] == "held"
L = (ctypes.PyDLL if held else ctypes.CDLL)(os.environ["LOOP"])
L.loop.restype = ctypes.c_double
L.loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_long), ctypes.c_int, ctypes.c_int]
n, steps, depth = int(os.environ["BLOCKS"]), int(os.environ["STEPS"]), int(os.environ["DEPTH"])
sizes = (ctypes.c_long * n)(*[(512 << (i % 12)) + 512 * (i % 7) for i in range(n)])
m = ctypes.cast(lib.memshim_malloc, ctypes.c_void_p).value
f = ctypes.cast(lib.memshim_free, ctypes.c_void_p).value
sys.path.insert(0, os.environ["FAKE_SITE_PACKAGES"])
import torch_like  # 4 frames in a package under .../site-packages/torch/, as nn.Module and F.linear are
def op(steps):
    return L.loop(m, f, sizes, n, steps)
def forward(d, steps):  # the user's code: the site
    if d:
        return forward(d - 1, steps)
    return torch_like.call_module(op, steps)
forward(depth, 20)  # warm-up: pages mapped, frames and stacks interned, the ring's pages touched
print(json.dumps({"ns": min(forward(depth, steps) for _ in range(int(os.environ["REPS"])))}))
"""

# (name, GIL mode, settings); None: the variable is unset
CONFIGS = [
    ("everything off", "released", {"MEMSHIM_REPORT_DIR": None, "MEMSHIM_SITES": "off"}),
    ("reports on, sites off", "released", {"MEMSHIM_SITES": "off"}),
    ("reports + snapshot ring, sites off", "released", {"MEMSHIM_SITES": "off", "MEMSHIM_SNAPSHOT": "SNAP"}),
    ("reports + sites (GIL re-taken)", "released", {}),
    ("reports + sites (GIL held)", "held", {}),
    ("reports + sites (GIL re-taken), sampled below 1 MiB", "released", {"MEMSHIM_SITES_SAMPLE": "1M"}),
    ("reports + sites + snapshot ring (GIL re-taken)", "released", {"MEMSHIM_SNAPSHOT": "SNAP"}),
]


TORCH_LIKE = """
def linear(op, steps):
    return op(steps)
def forward(op, steps):
    return linear(op, steps)
def _call_impl(op, steps):
    return forward(op, steps)
def call_module(op, steps):
    return _call_impl(op, steps)
"""


def run(tmp, loop, gil, settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "8G", "MEMSHIM_LOG": "error",
                "MEMSHIM_REPORT_DIR": os.path.join(tmp, "rep"), "LIB": LIB, "LOOP": loop, "GIL": gil,
                "BLOCKS": str(BLOCKS), "STEPS": str(STEPS), "DEPTH": str(DEPTH), "REPS": str(REPS),
                "FAKE_SITE_PACKAGES": os.path.join(tmp, "site-packages")})
    for k, v in settings.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = os.path.join(tmp, "snap.pickle") if v == "SNAP" else v
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"bench_reports: child failed: {p.stderr[-400:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["ns"]


TORCH_OPS = r"""
import json, time, torch
torch.set_num_threads(1)
x, y = torch.ones(256), torch.ones(256)
lin, inp = torch.nn.Linear(64, 64), torch.ones(8, 64)
out = []
for name, fn in (("torch.empty(256)", lambda: torch.empty(256)), ("x + y (256 floats)", lambda: x + y),
                 ("nn.Linear(64, 64) on 8 rows", lambda: lin(inp))):
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(20000):
            fn()
        best = min(best, (time.thread_time_ns() - t0) / 20000)
    out.append((name, best))
print(json.dumps(out))
"""


def torch_op_costs():
    """What small PyTorch operators cost on the CPU (thread CPU ns per call), or None without torch."""
    p = subprocess.run([sys.executable, "-c", TORCH_OPS], capture_output=True, text=True, timeout=600)
    return json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else None


def main():
    if not os.path.exists(LIB):
        raise SystemExit(f"bench_reports: {LIB} not built (make)")
    with tempfile.TemporaryDirectory(prefix="memshim-bench-reports-") as tmp:
        src, loop = os.path.join(tmp, "loop.c"), os.path.join(tmp, "loop.so")
        with open(src, "w") as f:
            f.write(LOOP_C)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", loop, src], check=True)
        pkg = os.path.join(tmp, "site-packages", "torch")
        os.makedirs(pkg)
        with open(os.path.join(tmp, "site-packages", "torch_like.py"), "w") as f:
            f.write("from torch import fns\ncall_module = fns.call_module\n")
        with open(os.path.join(pkg, "__init__.py"), "w") as f:
            f.write("")
        with open(os.path.join(pkg, "fns.py"), "w") as f:
            f.write(TORCH_LIKE)
        res = {name: [] for name, _, _ in CONFIGS}
        for _ in range(ROUNDS):
            for name, gil, settings in CONFIGS:
                res[name].append(run(tmp, loop, gil, settings))
    base, base_min = statistics.median(res[CONFIGS[0][0]]), min(res[CONFIGS[0][0]])
    print(f"{ROUNDS} rounds, configurations alternating; per process the fastest of {REPS} runs of {STEPS} steps x "
          f"{BLOCKS} memshim_malloc (1 KiB - 1 MiB) then {BLOCKS} memshim_free, from a C loop under 4 torch-like "
          f"frames and {DEPTH + 1} user frames; thread CPU ns per alloc+free pair (median of the rounds, and their range)")
    print()
    print("| configuration | ns per pair, median | range | cost vs. everything off (medians) | fastest round | "
          "cost vs. everything off (fastest) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _, _ in CONFIGS:
        v = res[name]
        m, lo = statistics.median(v), min(v)
        print(f"| {name} | {m:.0f} | {lo:.0f}-{max(v):.0f} | {m - base:+.0f} ns ({100 * (m / base - 1):+.1f}%) | "
              f"{lo:.0f} | {lo - base_min:+.0f} ns ({100 * (lo / base_min - 1):+.1f}%) |")
    scale = torch_op_costs()
    if scale:
        print()
        print("For scale, PyTorch CPU operators called from Python on this machine (thread CPU ns per call, fastest "
              "of 5 x 20000; a CUDA operator adds its launch): " + ", ".join(f"{k} {v:.0f}" for k, v in scale))
    print()
    print("bench_reports: " + " ".join(f"{n.replace(' ', '_')}={statistics.median(v):.0f}" for n, v in
                                       ((c[0], res[c[0]]) for c in CONFIGS)))


if __name__ == "__main__":
    main()
