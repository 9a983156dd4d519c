#!/usr/bin/env python3
"""What reports, allocation sites and the snapshot ring cost on memshim's tensor-mode allocation
path (memshim_malloc + memshim_free), side by side in one run. Not a test: scripts/bench.sh runs
it and docs/benchmarks.md quotes the table.

The path is driven as PyTorch drives it: a C loop (compiled here) calls memshim_malloc and
memshim_free through function pointers (the operator); the loop is a C function called straight
from a function in a package under site-packages/torch/ (as F.linear calls torch._C._nn.linear),
under three more such frames (as nn.Module's __call__ and _call_impl, and forward), called from
the user's code DEPTH frames deep: the site is the fifth frame from the top. With ctypes.CDLL the
loop runs with the GIL released, as PyTorch's operators do before they allocate: memshim reads the
thread's own frames without it (MEMSHIM_SITES=frames, the default since issue 16; CPython 3.11) or
re-takes it (MEMSHIM_SITES=acquire, the default before); with ctypes.PyDLL the GIL stays held. Sizes: 200 per step,
1 KiB to 1 MiB (a small-tensor mix: the case where per-call costs weigh most). The library is
preloaded (LD_PRELOAD, as in production: its thread-locals are then static TLS); the double
serves the memory (pages stay mapped after the warm-up, so no driver call is timed).

memshim reads its settings once per process, so each configuration is its own process; the
configurations alternate over ROUNDS rounds. A process times REPS runs of STEPS steps and keeps
the fastest, timed in thread CPU time (clock_gettime(CLOCK_THREAD_CPUTIME_ID): preemption by other
processes on a shared machine is not counted; cache pollution still is). The table gives the
median and the range of the rounds' ns per alloc+free pair, the cost against "everything off"
(taken within each round, where the configurations ran back to back, then the median over the
rounds: the machine's slower and faster spells cancel out), and that cost as a share of two
denominators: memshim's own path per pair (the
strictest) and a PyTorch operator called from Python (measured here on the CPU, the smallest
operators; a CUDA operator adds its launch, so the real share is smaller). For the allocation-site
configurations it also gives how much of a probe step after the timed runs the sites left
'<python> unattributed' (memshim stops re-taking a GIL that was slow to get, for a second; on a
loaded machine a preempted acquisition can look slow, which would make those rounds cheaper than
they should be: the worst round is shown).

Usage: bench_reports.py [BUILD [BUILD_BEFORE]] (default: build, or $BUILD). With BUILD_BEFORE
(another build of memshim, e.g. of main) each round runs every configuration on both builds, and
the table gets a column with the other build's median. BENCH_INSTRUCTIONS=1 adds a second table
that does not depend on the machine's load: the instructions executed inside memshim_malloc and
memshim_free (callees included) per pair, counted by valgrind's callgrind (the difference of a
run of 120 and one of 20 steps, so start-up and warm-up cancel out). Instructions are not time:
a clock read or a cache miss costs far more than its few instructions.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BUILD", "build"))
BEFORE = os.path.join(ROOT, sys.argv[2]) if len(sys.argv) > 2 else None
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
/* the probe after the timed runs: n blocks left live for an epoch report, then freed */
void hold(void *m_, const long *sizes, int n, void **out) { for (int i = 0; i < n; i++) out[i] = ((mf)m_)(sizes[i], 0, 0); }
void drop(void *f_, const long *sizes, int n, void **out) { for (int i = 0; i < n; i++) ((ff)f_)(out[i], sizes[i], 0, 0); }
"""

CHILD = r"""
import ctypes, json, os, sys
lib = ctypes.PyDLL(os.environ["LIB"])
held = os.environ["GIL"] == "held"
L = (ctypes.PyDLL if held else ctypes.CDLL)(os.environ["LOOP"])
L.loop.restype = ctypes.c_double
L.loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_long), ctypes.c_int, ctypes.c_int]
L.hold.argtypes = L.drop.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_long), ctypes.c_int, ctypes.c_void_p]
n, steps, depth = int(os.environ["BLOCKS"]), int(os.environ["STEPS"]), int(os.environ["DEPTH"])
sizes = (ctypes.c_long * n)(*[(512 << (i % 12)) + 512 * (i % 7) for i in range(n)])
m = ctypes.cast(lib.memshim_malloc, ctypes.c_void_p).value
f = ctypes.cast(lib.memshim_free, ctypes.c_void_p).value
sys.path.insert(0, os.environ["FAKE_SITE_PACKAGES"])
import functools
import torch_like  # 4 frames in a package under .../site-packages/torch/, as nn.Module and F.linear are
# the operator: a C function called straight from torch_like.linear, as F.linear calls torch._C._nn.linear
op = functools.partial(L.loop, m, f, sizes, n)
def forward(d, steps):  # the user's code: the site
    if d:
        return forward(d - 1, steps)
    return torch_like.call_module(op, steps)
forward(depth, 20)  # warm-up: pages mapped, frames and stacks interned, the ring's pages touched
best = min(forward(depth, steps) for _ in range(int(os.environ["REPS"])))
# Probe: were the sites still read at the end (memshim stops re-taking a GIL that was slow to get,
# for a second)? One step's blocks held live through an epoch whose report names their sites.
lib.memshim_epoch()
held_blocks = (ctypes.c_void_p * n)()
op = functools.partial(L.hold, m, sizes, n, held_blocks)
forward(depth, 0)
lib.memshim_epoch()
L.drop(f, sizes, n, held_blocks)
print(json.dumps({"ns": best}))
"""

# (name, GIL mode, settings); None: the variable is unset. Reports on = MEMSHIM_REPORT_DIR set.
OFF = {"MEMSHIM_REPORT_DIR": None, "MEMSHIM_SITES": "off"}
CONFIGS = [
    ("everything off", "released", OFF),
    ("reports on, sites off", "released", {"MEMSHIM_SITES": "off"}),
    ("reports + sites (GIL released; the default, frames)", "released", {}),
    ("reports + sites (GIL re-taken: MEMSHIM_SITES=acquire)", "released", {"MEMSHIM_SITES": "acquire"}),
    ("reports + sites (GIL held)", "held", {}),
    ("reports + sites sampled below 1 MiB (GIL released)", "released", {"MEMSHIM_SITES_SAMPLE": "1M"}),
    ("reports + sites sampled below 16 MiB (GIL released)", "released", {"MEMSHIM_SITES_SAMPLE": "16M"}),
    ("snapshot ring alone (no reports, no sites)", "released", dict(OFF, MEMSHIM_SNAPSHOT="SNAP")),
    ("reports + sites + snapshot ring (GIL released)", "released", {"MEMSHIM_SNAPSHOT": "SNAP"}),
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


def unattributed_share(rep):
    """Share of the probe's bytes (the epoch report after the timed runs) that the sites left
    '<python> unattributed', or None without sites."""
    for path in sorted(glob.glob(os.path.join(rep, "*.json"))):
        with open(path) as fh:
            r = json.load(fh)
        if r.get("kind") != "epoch" or r.get("epoch") != 1:
            continue
        sites = r.get("sites") or []
        total = sum(s["bytes"] for s in sites)
        if total:
            return sum(s["bytes"] for s in sites if s["function"] == "unattributed") / total
    return None


def child_env(tmp, loop, build, gil, settings, rep):
    lib = os.path.join(build, "libmemshim.so")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(build, "double"), "LD_PRELOAD": lib, "CUDBL_CAPACITY": "8G",
                "MEMSHIM_LOG": "error", "MEMSHIM_REPORT_DIR": rep, "LIB": lib, "LOOP": loop, "GIL": gil,
                "BLOCKS": str(BLOCKS), "STEPS": str(STEPS), "DEPTH": str(DEPTH), "REPS": str(REPS),
                "FAKE_SITE_PACKAGES": os.path.join(tmp, "site-packages")})
    for k, v in settings.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = os.path.join(tmp, "snap.pickle") if v == "SNAP" else v
    return env


def instructions(tmp, loop, build, gil, settings):
    """Instructions inside memshim_malloc + memshim_free per pair (callgrind), or None."""
    counts = []
    for steps in (20, 120):
        out = os.path.join(tmp, "callgrind.out")
        # GIL held: under valgrind every GIL re-take is slow enough for memshim's back-off, which
        # would leave the sites unread and the count too low
        env = child_env(tmp, loop, build, "held", settings, os.path.join(tmp, "rep-cg"))
        env.update({"STEPS": str(steps), "REPS": "1"})
        p = subprocess.run(["valgrind", "--tool=callgrind", "--toggle-collect=memshim_malloc",
                            "--toggle-collect=memshim_free", f"--callgrind-out-file={out}", sys.executable, "-c",
                            CHILD], env=env, capture_output=True, text=True, timeout=1200)
        if p.returncode or not os.path.exists(out):
            return None
        with open(out) as fh:
            total = next((int(l.split()[1]) for l in fh if l.startswith("totals:")), None)
        os.unlink(out)
        if total is None:
            return None
        counts.append(total)
    return (counts[1] - counts[0]) / (100 * BLOCKS)


def run(tmp, loop, build, gil, settings, tag):
    rep = os.path.join(tmp, "rep-" + tag)
    env = child_env(tmp, loop, build, gil, settings, rep)
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"bench_reports: child failed: {p.stderr[-400:]}")
    share = unattributed_share(rep)
    subprocess.run(["rm", "-rf", rep], check=False)
    return json.loads(p.stdout.strip().splitlines()[-1])["ns"], share


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
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run([sys.executable, "-c", TORCH_OPS], capture_output=True, text=True, timeout=600, env=env)
    return json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else None


def main():
    builds = [BUILD] + ([BEFORE] if BEFORE else [])
    for b in builds:
        if not os.path.exists(os.path.join(b, "libmemshim.so")):
            raise SystemExit(f"bench_reports: {b}/libmemshim.so not built (make)")
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
        res = {(b, name): [] for b in builds for name, _, _ in CONFIGS}
        unattr = {(b, name): [] for b in builds for name, _, _ in CONFIGS}
        for r in range(ROUNDS):
            for name, gil, settings in CONFIGS:
                for i, b in enumerate(builds):
                    ns, share = run(tmp, loop, b, gil, settings, f"{r}-{i}")
                    res[(b, name)].append(ns)
                    if share is not None:
                        unattr[(b, name)].append(share)
        ir = {}
        if os.environ.get("BENCH_INSTRUCTIONS") == "1":
            for name, gil, settings in CONFIGS:
                for b in builds:
                    ir[(b, name)] = instructions(tmp, loop, b, gil, settings)
    scale = torch_op_costs()
    empty = dict(scale).get("torch.empty(256)") if scale else None
    off = CONFIGS[0][0]
    base = statistics.median(res[(BUILD, off)])

    def paired(build, name):
        """Each round runs every configuration back to back: the cost is taken within a round
        (config minus everything off, and that over everything off), so the machine's slower and
        faster spells between rounds cancel out. Median over the rounds, and the middle half."""
        d = [c - o for c, o in zip(res[(build, name)], res[(build, off)])]
        r = [c / o - 1 for c, o in zip(res[(build, name)], res[(build, off)])]
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0], r[0], r[0]]
        return statistics.median(d), statistics.median(r), q[0], q[2]

    print(f"{ROUNDS} rounds, configurations alternating; per process the fastest of {REPS} runs of {STEPS} steps x "
          f"{BLOCKS} memshim_malloc (1 KiB - 1 MiB) then {BLOCKS} memshim_free, from a C loop called from 4 "
          f"torch-like frames under {DEPTH + 1} user frames, libmemshim.so preloaded; thread CPU ns per alloc+free "
          f"pair (median of the rounds, and their range); cost against everything off taken within each round "
          f"(median over the rounds, and the middle half of the rounds' shares)")
    print()
    head = "| configuration | ns per pair, median | range | cost vs. everything off | share of memshim's path (middle half) | "
    head += f"share of torch.empty(256) ({empty:.0f} ns) |" if empty else "share of a PyTorch op |"
    head += " within 2% of memshim's path / of the op | unattributed (probe) |"
    if BEFORE:
        head += " before: median (cost, share; unattributed) |"
    print(head)
    print("|---|---:|---:|---:|---:|---:|:---:|---:|" + ("---:|" if BEFORE else ""))
    for name, _, _ in CONFIGS:
        v = res[(BUILD, name)]
        m = statistics.median(v)
        cost, share, lo, hi = paired(BUILD, name)
        op_share = cost / empty if empty else None
        ok = lambda s: "n/a" if s is None else ("yes" if s <= 0.02 else "no")  # noqa: E731
        u = unattr[(BUILD, name)]
        row = (f"| {name} | {m:.0f} | {min(v):.0f}-{max(v):.0f} | {cost:+.0f} ns | "
               f"{100 * share:+.1f}% ({100 * lo:+.0f}..{100 * hi:+.0f}%) | "
               + (f"{100 * op_share:+.1f}% | " if op_share is not None else "n/a | ")
               + f"{ok(share)} / {ok(op_share)} | "
               + (f"{100 * max(u):.0f}% |" if u else "- |"))
        if BEFORE:
            bm = statistics.median(res[(BEFORE, name)])
            bcost, bshare, _, _ = paired(BEFORE, name)
            bu = unattr[(BEFORE, name)]
            row += (f" {bm:.0f} ({bcost:+.0f} ns, {100 * bshare:+.0f}%"
                    + (f"; {100 * max(bu):.0f}% unattributed) |" if bu else ") |"))
        print(row)
    if ir:
        print()
        print("Instructions inside memshim_malloc + memshim_free per pair (callgrind; 120 minus 20 steps; every "
              "configuration with the GIL held, since under valgrind each re-take of the GIL is slow enough to trigger "
              "memshim's back-off; independent of the machine's load, blind to what a clock read or a cache miss "
              "costs):")
        print()
        print("| configuration | instructions per pair | vs. everything off |" + (" before |" if BEFORE else ""))
        print("|---|---:|---:|" + ("---:|" if BEFORE else ""))
        ib = ir.get((BUILD, CONFIGS[0][0]))
        for name, _, _ in CONFIGS:
            v = ir.get((BUILD, name))
            if v is None or ib is None:
                print(f"| {name} | n/a | n/a |" + (" n/a |" if BEFORE else ""))
                continue
            row = f"| {name} | {v:.0f} | {v - ib:+.0f} ({100 * (v / ib - 1):+.1f}%) |"
            if BEFORE:
                bv = ir.get((BEFORE, name))
                row += f" {bv:.0f} |" if bv is not None else " n/a |"
            print(row)
    if scale:
        print()
        print("PyTorch CPU operators called from Python on this machine (thread CPU ns per call, fastest of 5 x 20000; "
              "each allocates and frees about one tensor; a CUDA operator adds its launch): "
              + ", ".join(f"{k} {v:.0f}" for k, v in scale))
    print()
    print("bench_reports: " + " ".join(f"{n.split(' (')[0].replace(' ', '_').replace(',', '')}="
                                       f"{statistics.median(res[(BUILD, n)]):.0f}" for n, _, _ in CONFIGS))


if __name__ == "__main__":
    main()
