#!/usr/bin/env python3
"""The epoch reports' fragmentation figures of issue 26, computed by hand (docs/reports.md):
`step_allocated_over_reserved` (STAlloc's: each optimizer step's peak allocated over its peak
reserved, {min, median, max} over the epoch's steps) and `reserved_minus_allocated_at_peak_bytes`
(reserved minus allocated at the first allocation that saw the reserved peak), beside the kept
`peak_allocated_over_peak_reserved`.

A Python workload (this file with --workload) runs under LD_PRELOAD=libmemshim.so on the driver
double with MEMSHIM_LIMIT=64M, where every 2 MiB page is a handle of its own and blocks are placed
from the start of the line at the lowest fitting address, so every figure follows from the sizes:
  epoch 0: a step before anything is allocated (no figure); A 4 MiB, B 3 MiB at 4 MiB (8 MiB
           reserved, 7 live), B freed, step: 7/8; C 2 MiB in B's place, freed, step: 6/8; D 10 MiB
           at 4 MiB (14 reserved, 14 live), step: 14/14. Steps 4, measured 3: min 0.75, median
           0.875, max 1; the reserve reached 14 MiB with 14 live: 0 bytes; peak 14 / 14.
  epoch 1: D freed, step: 14/14 (the step began with 14 held and live); the cache emptied (4 MiB
           held), E 5 MiB at 4 MiB (10 reserved, 9 live), step: 9/14 (the step's reserve peak is
           the 14 MiB held when it began). Min 9/14, median (1 + 9/14)/2, max 1; no allocation
           raised the reserve above the 14 MiB held at the epoch's start: 0 bytes.
  epoch 2: E freed, H 3 MiB at 4 MiB, J 8 MiB at 7 MiB (pages to 16 MiB: 16 reserved, 15 live),
           step: 15/16; the reserve peak 16 MiB came with 15 live: 1 MiB; peak 15 / 16.
The summary covers the epoch in progress (as its other peaks do): no step, and the 16 MiB reserved
with 15 live it began with. With MEMSHIM_EPOCH=steps and MEMSHIM_EPOCH_STEPS=2 (no manual epochs), the step that closes an
epoch is that epoch's: epoch 0 holds the unmeasured step and 7/8, epoch 1 holds 6/8 and 14/14.
The figures are checked against docs/report.schema.json too."""
import ctypes
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "replay"))
from pyharness import BUILD, case, finish, skip  # noqa: E402

MiB = 1 << 20


def workload(manual):
    lib = ctypes.PyDLL(None)
    lib.memshim_malloc.restype = ctypes.c_void_p
    lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    where = {}

    def m(name, n):
        p = lib.memshim_malloc(n * MiB, 0, None)
        where[name] = p
        return p

    def f(p, n):
        lib.memshim_free(p, n * MiB, 0, None)

    def epoch():
        if manual:
            lib.memshim_epoch()
    lib.memshim_step()
    a = m("A", 4)
    b = m("B", 3)
    f(b, 3)
    lib.memshim_step()
    c = m("C", 2)
    f(c, 2)
    lib.memshim_step()
    d = m("D", 10)
    lib.memshim_step()
    epoch()
    f(d, 10)
    lib.memshim_step()
    lib.memshim_empty_cache()
    e = m("E", 5)
    lib.memshim_step()
    epoch()
    f(e, 5)
    m("H", 3)
    m("J", 8)
    lib.memshim_step()
    epoch()
    print("PLACED", json.dumps({k: (v - a) // MiB for k, v in where.items()}), flush=True)


def run(tmp, extra):
    rdir = tempfile.mkdtemp(dir=tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_")) and k != "LD_PRELOAD"}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": os.path.join(BUILD, "libmemshim.so"),
                "CUDBL_CAPACITY": "1G", "CUDBL_GRANULARITY": str(2 * MiB), "MEMSHIM_LIMIT": "64M",
                "MEMSHIM_REPORT_DIR": rdir, "MEMSHIM_LOG": "error", **extra})
    manual = extra.get("MEMSHIM_EPOCH") == "manual"
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--workload", "manual" if manual else "steps"],
                       env=env, capture_output=True, text=True, timeout=60)
    placed = json.loads(p.stdout.split("PLACED ", 1)[1]) if "PLACED " in p.stdout else None
    reps = {}
    for path in glob.glob(os.path.join(rdir, "*.json")):
        r = json.load(open(path))
        reps[(r["kind"], r["epoch"])] = r
    return p, placed, reps


def close(a, b):
    return a is not None and abs(a - b) < 1e-12


def frag_ok(r, steps, fig, gap, peak_ratio):
    fr = r["fragmentation"]
    s = fr["step_allocated_over_reserved"]
    got = None if s is None else (s["min"], s["median"], s["max"], s["steps"])
    want_ok = (s is None) if fig is None else (got is not None and all(close(x, y) for x, y in zip(got, fig))
                                                and got[3] == fig[3])
    return (r["steps"] == steps and want_ok and fr["reserved_minus_allocated_at_peak_bytes"] == gap
            and close(fr["peak_allocated_over_peak_reserved"], peak_ratio)), (r["steps"], got, fr)


def main():
    if not os.path.exists(os.path.join(BUILD, "libmemshim.so")):
        case("built", False, "libmemshim.so missing (make)")
        finish()
    from schema_check import report_problems
    with tempfile.TemporaryDirectory(prefix="memshim-stepfig-") as tmp:
        p, placed, reps = run(tmp, {"MEMSHIM_EPOCH": "manual"})
        case("the workload ran and placed its blocks where the figures below assume (MiB from A: B 4, C 4, D 4, "
             "E 4, H 4, J 7)", p.returncode == 0 and placed == {"A": 0, "B": 4, "C": 4, "D": 4, "E": 4, "H": 4, "J": 7},
             (p.returncode, placed, p.stderr[-600:]))
        want = {0: (4, (0.75, 0.875, 1.0, 3), 0, 1.0),
                1: (2, (9 / 14, (1 + 9 / 14) / 2, 1.0, 2), 0, 1.0),
                2: (1, (15 / 16, 15 / 16, 15 / 16, 1), MiB, 15 / 16)}
        for ep, (steps, fig, gap, pr) in want.items():
            r = reps.get(("epoch", ep))
            ok, got = frag_ok(r, steps, fig, gap, pr) if r else (False, "no report")
            case(f"epoch {ep}: {steps} steps, step allocated/reserved min {fig[0]:.4f} median {fig[1]:.4f} max "
                 f"{fig[2]:.4f} over {fig[3]}, {gap} bytes reserved beyond allocated at the peak, peak ratio {pr:.4f}",
                 ok, got)
        s = reps.get(("summary", 3))
        case("the summary (the epoch in progress: nothing since epoch 2 closed): no step measured (null); its "
             "reserve peak is the 16 MiB held when it began, with 15 live: 1 MiB",
             s is not None and s["fragmentation"]["step_allocated_over_reserved"] is None
             and s["fragmentation"]["reserved_minus_allocated_at_peak_bytes"] == MiB, s and s["fragmentation"])
        bad = [(k, report_problems(r)) for k, r in reps.items() if report_problems(r)]
        case(f"its {len(reps)} reports match docs/report.schema.json", reps and not bad, bad[:2])

        p, placed, reps = run(tmp, {"MEMSHIM_EPOCH": "steps", "MEMSHIM_EPOCH_STEPS": "2"})
        r0, r1 = reps.get(("epoch", 0)), reps.get(("epoch", 1))
        ok0, g0 = frag_ok(r0, 2, (0.875, 0.875, 0.875, 1), MiB, 7 / 8) if r0 else (False, "no report")
        ok1, g1 = frag_ok(r1, 2, (0.75, 0.875, 1.0, 2), 0, 1.0) if r1 else (False, "no report")
        case("MEMSHIM_EPOCH_STEPS=2: the step that closes an epoch is that epoch's (epoch 0: the unmeasured step "
             "and 7/8; epoch 1: 6/8 and 14/14)", p.returncode == 0 and ok0 and ok1, (g0, g1, p.stderr[-400:]))
    finish()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--workload":
        workload(sys.argv[2] == "manual")
    elif os.environ.get("MSH_SKIP_NATIVE"):
        skip("step figures", "MSH_SKIP_NATIVE")
        finish()
    else:
        main()
