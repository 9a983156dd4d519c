#!/usr/bin/env python3
"""The GPU benchmark's driver logic without PyTorch or a GPU (tests/gpu/bench_workloads.py): the
frontier search against workers that answer by rule, the search stopping when the budget runs out
or a worker fails, the interleaving of throughput windows (A B C D per round) and their medians,
a run whose budget is spent (every row present, each saying why it was skipped), the checks that
judge a run, and the cost split of the gpt step computed by hand. Runs in tests/run.sh; the dry
run (gpu_checks.py --dry-run) runs the same driver over real worker processes."""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pyharness import case, finish  # noqa: E402

import bench_workloads as bw  # noqa: E402


class FakeProc:
    """A worker whose `fits` answer is a rule on the batch; every command is recorded."""

    def __init__(self, name, limit=None, log=None, fail_at=None, ms=10.0):
        self.allocator, self.dead, self.limit, self.log, self.fail_at, self.ms = name, None, limit, log, fail_at, ms
        self.trials = 0

    def ask(self, cmd, timeout):
        if self.log is not None:
            self.log.append((self.allocator, cmd["op"]))
        if cmd["op"] == "cap":
            return {"fraction": 0.5}
        if cmd["op"] == "fits":
            self.trials += 1
            if self.fail_at is not None and self.trials == self.fail_at:
                self.dead = "worker exited (rc -11)"
                return {"error": self.dead}
            ok = cmd["batch"] <= self.limit
            return {"batch": cmd["batch"], "ok": ok, "oom": None if ok else "CUDA out of memory.",
                    "tokens_per_s": 1000.0 * cmd["batch"] if ok else None, "ms_per_step": 5.0,
                    "peak_reserved": 7, "peak_allocated": 5, "trial_s": 0.1}
        if cmd["op"] == "throughput":
            self.ms += 1.0  # 11, 12, 13 ms: the median is the second window
            return {"tokens_per_s": 1000.0 / self.ms, "ms_per_step": self.ms, "peak_reserved": int(self.ms * 10),
                    "peak_allocated": int(self.ms), "allocator_seen": self.allocator}
        return {"error": f"unexpected {cmd}"}


class Clock:
    """Bench.left() that drops to nothing after `n` calls."""

    def __init__(self, n):
        self.n = n

    def __call__(self):
        self.n -= 1
        return 1000.0 if self.n >= 0 else 5.0


def spec(batch=32):
    return {"kind": "gpt", "batch": batch, "cap_gib": 2.0, "f_steps": 4, "warm": 1, "steps": 3}


tmp = tempfile.mkdtemp(prefix="memshim-bench-plan-")

# ---- the frontier search: bracket, then bisect to 1/16 of the batch --------------------------
for limit in (1, 5, 37, 100, 511, 1999):
    B = bw.Bench(tmp, 1000, False)
    p, row = FakeProc("native", limit), {}
    f = B.frontier(p, spec(32), row)
    lo, hi = f["largest"], f["first_failure"]
    case(f"frontier: a worker that fits up to batch {limit}: largest {lo}, first failure {hi}, "
         f"{len(f['trials'])} trials",
         lo is not None and lo <= limit < hi and hi - lo <= max(1, lo // 16) and len(f["trials"]) <= 14
         and f["tokens_per_s"] == 1000.0 * lo and f["cap_bytes"] == 2 * bw.GiB and "incomplete" not in f, f)
B = bw.Bench(tmp, 1000, False)
f = B.frontier(FakeProc("native", 10 ** 6), spec(32), {})
case("frontier: no failure up to 64 times the batch: the largest tried, no first failure, a note saying so",
     f["largest"] == 64 * 32 and f["first_failure"] is None and "no failure" in f.get("note", ""), f)
f = B.frontier(FakeProc("native", 0), spec(32), {})
case("frontier: not even batch 1 fits: no largest, first failure 1", f["largest"] is None and f["first_failure"] == 1, f)
# the exact answer where the resolution allows it (the dry run relies on this)
for limit, start in ((12, 4), (20, 8), (6, 2), (10, 4), (5, 2)):
    f = bw.Bench(tmp, 1000, False).frontier(FakeProc("native", limit), spec(start), {})
    case(f"frontier: from batch {start}, a limit of {limit} is found exactly", (f["largest"], f["first_failure"]) ==
         (limit, limit + 1), f["trials"])

# ---- the search stops: budget, worker failure ------------------------------------------------
B = bw.Bench(tmp, 1000, False)
B.left = Clock(3)
f = B.frontier(FakeProc("native", 1000), spec(32), {})
case("frontier: the budget runs out mid-search: stopped, marked incomplete, the largest so far kept as a lower bound",
     "incomplete" in f and f["largest"] is not None and f["largest"] <= 1000 and len(f["trials"]) <= 3, f)
B = bw.Bench(tmp, 1000, False)
p = FakeProc("memshim", 1000, fail_at=3)
f = B.frontier(p, spec(32), {})
case("frontier: the worker dies mid-search: the error recorded, the search stopped, no trial after it",
     f.get("error", "").startswith("worker exited") and len(f["trials"]) == 3 and "incomplete" not in f, f)
f = B.frontier(p, spec(32), {})
case("frontier: a dead worker is not asked again: skipped with its reason", f.get("skipped", "").startswith("worker"), f)

# ---- throughput: interleaved rounds, medians --------------------------------------------------
log = []
procs = {a: FakeProc(a, log=log) for a in bw.ALLOCATORS}
rows = {a: {} for a in bw.ALLOCATORS}
bw.Bench(tmp, 1000, False).throughput(procs, spec(), rows)
order = [a for a, op in log if op == "throughput"]
case("throughput: one window per allocator per round, 3 rounds",
     all(sorted(order[k:k + 4]) == sorted(bw.ALLOCATORS) for k in (0, 4, 8)) and len(order) == 12, order)
case("throughput: the medians of the 3 windows (12 ms of 11, 12, 13), the highest peaks",
     all(r["ms_per_step"] == 12.0 and abs(r["tokens_per_s"] - 1000 / 12) < 1e-9 and r["peak_reserved"] == 130
         and len(r["repeats"]) == 3 for r in rows.values()), rows["native"])
procs = {a: FakeProc(a) for a in bw.ALLOCATORS}
rows = {a: {} for a in bw.ALLOCATORS}
B = bw.Bench(tmp, 1000, False)
B.left = Clock(1)
bw.Bench.throughput(B, procs, spec(), rows)
case("throughput: the budget runs out after a round: whole rounds only (one window each), one note, the figures "
     "of what ran",
     all(len(r["repeats"]) == 1 and r["notes"] == ["the budget ran out after 1 of 3 rounds"] and r["ms_per_step"] == 11.0
         for r in rows.values()), rows)

# ---- a run with no budget: every row, each with the reason -----------------------------------
out = os.path.join(tmp, "spent")
res = bw.bench(out, 0.0, False)
rows_ok = {(r["workload"], r["allocator"]) for r in res["rows"]} == {(w, a) for w in bw.PLAN for a in bw.ALLOCATORS}
case("bench with its budget spent: every workload x allocator row, each skipped with the budget named, "
     "the JSON and the table written, no worker started",
     rows_ok and all("budget" in r.get("skipped", "") for r in res["rows"])
     and json.load(open(os.path.join(out, "gpu-bench.json")))["rows"] == res["rows"]
     and open(os.path.join(out, "gpu-bench.md")).read().count("| gpt-small |") == 4
     and not [n for n in os.listdir(out) if n.endswith(".log")],
     res["rows"][:2])
bad = bw.check_bench(res, False)
case("check: a bench whose budget was spent fails, each row named as cut short by the budget (issue 31)",
     len(bad) == len(res["rows"]) and all("cut short by the budget" in b for b in bad), bad[:3])

# ---- the checks that judge a run --------------------------------------------------------------
bad = bw.check_bench({"rows": res["rows"][1:]}, False)
case("check: a missing row is a failure", any("missing" in b for b in bad), bad)
r2 = [dict(r, skipped=None) for r in res["rows"]]
r2[0].update(error="worker exited (rc -11)")
bad = bw.check_bench({"rows": r2}, False)
case("check: a worker's error is a failure (GPU run)", any("rc -11" in b for b in bad), bad)
r3 = [dict(r, skipped=None, tokens_per_s=1.0, repeats=[{}] * 3,
           frontier={"largest": bw.WORKLOADS[r["workload"]]["dry"]["dry_cap"],
                     "first_failure": bw.WORKLOADS[r["workload"]]["dry"]["dry_cap"] + 1}) for r in res["rows"]]
good = bw.check_bench({"rows": r3}, True)
r3[5] = dict(r3[5], frontier={"largest": 3, "first_failure": 4})
bad = bw.check_bench({"rows": r3}, True)
case("check (dry run): every frontier must sit exactly at its emulated cap", good == [] and len(bad) == 1, (good, bad))

# ---- the gpt step's split, by hand --------------------------------------------------------------
rows = {"native": {"ms_per_step": 12.0}, "memshim": {"ms_per_step": 15.0, "memshim_report": [{"x": 1}]},
        "memshim-segment": {"ms_per_step": 12.5}}
prof = {"native": {"top": [{"op": "aten::empty_strided", "self_cpu_us_per_step": 400.0},
                           {"op": "aten::mm", "self_cpu_us_per_step": 3000.0}],
                   "focus": [{"op": "aten::empty", "self_cpu_us_per_step": 100.0}], "self_cpu_us_per_step_total": 8000.0},
        "memshim": {"top": [{"op": "aten::empty_strided", "self_cpu_us_per_step": 2400.0},
                            {"op": "aten::mm", "self_cpu_us_per_step": 3000.0}],
                    "focus": [{"op": "aten::empty", "self_cpu_us_per_step": 300.0}], "self_cpu_us_per_step_total": 11000.0}}
sp = bw.split_cost(rows, prof)
# tensor - native: 3 ms; segment - native: 0.5 ms; allocation ops: (2400+300) - (400+100) us = 2.2 ms;
# the rest: (11000-2700) - (8000-500) us = 0.8 ms
case("gpt split: 3 ms in all, 0.5 ms with PyTorch allocating, 2.2 ms in the allocation ops, 0.8 ms elsewhere",
     abs(sp["tensor_minus_native_ms"] - 3.0) < 1e-9 and abs(sp["segment_minus_native_ms"] - 0.5) < 1e-9
     and abs(sp["alloc_ops_minus_native_ms"] - 2.2) < 1e-9 and abs(sp["other_ops_minus_native_ms"] - 0.8) < 1e-9
     and abs(sp["tensor_overhead"] - 0.25) < 1e-9, sp)
# ---- the gpt step's markdown names memshim's own costs (issue 24) -------------------------------
res = {"dry_run": False, "date_utc": "2026-12-05 00:00", "gpu": "GPU", "commit": "abc", "split": {},
       "profile": {}, "rows": [
           {"allocator": "native", "tokens_per_s": 1.0, "ms_per_step": 12.0, "repeats": []},
           {"allocator": "memshim", "tokens_per_s": 1.0, "ms_per_step": 13.0, "repeats": [], "memshim_report": [
               {"memshim_overhead": {"driver_calls": {"cuMemCreate": {"count": 44, "seconds": 0.0004},
                                                      "cuEventRecord": {"count": 3, "seconds": 0.00001},
                                                      "cuMemMap": {"count": 44, "seconds": 0.0001},
                                                      "cuCtxGetCurrent": {"count": 300, "seconds": 0.00002}},
                                     "synchronizes": {"context": {"count": 2, "seconds": 0.001}},
                                     "alloc_path_ns": {"p50": 639, "p99": 6143}, "share_of_wall": 0.019}},
               None]}]}
md = bw.gpt_markdown(res)
line = [ln for ln in md.splitlines() if ln.startswith("memshim_overhead memshim window 1:")]
case("gpt markdown: a line per memshim window with its three largest driver costs, largest first, its "
     "synchronizes, alloc p50/p99 and share of the wall time; none for a window without a report",
     len(line) == 1 and "cuMemCreate 44 x 0.40 ms, cuMemMap 44 x 0.10 ms, cuCtxGetCurrent 300 x 0.02 ms" in line[0]
     and "synchronizes 2" in line[0] and "639/6143 ns" in line[0] and "1.90%" in line[0]
     and "window 2" not in md, md)
# ==== issue 31 item 5: honest by construction ====================================================
import types  # noqa: E402

# ---- the varlen LM's shapes depend on the step only: "fits" is monotone in the batch -----------
vs = bw.spec_of("varlen-lm", False)
bad = []
for i in range(60):
    shapes = [bw.Loop.shape(types.SimpleNamespace(s=vs), b, i) for b in range(1, 65)]
    if len({T for _, T in shapes}) != 1:
        bad.append(f"step {i}: {len({T for _, T in shapes})} lengths over batches 1..64")
    if any(r2 < r1 for (r1, _), (r2, _) in zip(shapes, shapes[1:])):
        bad.append(f"step {i}: fewer rows for a larger batch")
    if any(not (max(1, b // 4) <= r <= b) for b, (r, _) in zip(range(1, 65), shapes)):
        bad.append(f"step {i}: rows outside B/4..B")
case("varlen-lm: each step's length is the same for every batch and its rows grow with the batch (B/4..B), so a "
     "larger batch never needs less memory at any step", not bad, bad[:4])

# ---- the window order rotates between rounds --------------------------------------------------
log = []
procs = {a: FakeProc(a, log=log) for a in bw.ALLOCATORS}
bw.Bench(tmp, 1000, False).throughput(procs, spec(), {a: {} for a in bw.ALLOCATORS})
order = [a for a, op in log if op == "throughput"]
A = list(bw.ALLOCATORS)
case("throughput: the window order rotates between rounds (A B C D, B C D A, C D A B): no allocator always "
     "measures first", order == A + A[1:] + A[:1] + A[2:] + A[:2], order)

# ---- one bisection serves the bench's frontier and the OOM step's finder -------------------------
try:
    import bracket
    import oom_check
except ImportError as e:
    bracket = oom_check = None
    case("one bisection: tests/gpu/bracket.py serves bench_workloads.py and oom_check.py", False, e)
if bracket is not None:
    calls = []
    real_search = bracket.search

    def recording(*a, **k):
        calls.append(k.get("resolution", a[2] if len(a) > 2 else None))
        return real_search(*a, **k)
    bracket.search = recording
    fits = lambda n: n <= 1000  # noqa: E731
    try:
        f = bw.Bench(tmp, 1000, False).frontier(FakeProc("native", 37), spec(32), {})
        h = oom_check.hand_finder(fits, 16)
    except Exception as e:  # noqa: BLE001 - the code under test is missing a piece: a failure, not a crash
        f = h = {"error": f"{type(e).__name__}: {e}"}
    finally:
        bracket.search = real_search
    want = real_search(lambda n: n <= 37, 32, resolution=16)
    case("one bisection: the bench's frontier and the OOM step's finder both go through bracket.search "
         "(resolution 16 and 32), the frontier's answer its bracket",
         calls == [16, 32] and (f.get("largest"), f.get("first_failure")) == (want.largest, want.first_failure)
         and h.get("answer") == real_search(fits, 16, resolution=32, grow_limit=None).largest, (calls, f, h))
    for limit, start in ((1, 1), (5, 32), (37, 32), (1999, 32), (12, 4), (0, 8)):
        b = real_search(lambda n: n <= limit, start, resolution=16)
        lo, hi = b.largest, b.first_failure
        case(f"bracket.search: fits up to {limit} from {start}: largest {lo}, first failure {hi}, within 1/16, every "
             f"trial on the "
             f"right side ({len(b.trials)} trials)",
             lo <= limit and hi is not None and limit < hi and hi - lo <= max(1, lo // 16)
             and all(ok == (n <= limit) for n, ok in b.trials), b.trials)


# ---- a whole bench over workers that answer by rule: fresh frontier workers, the bracket ---------
class FakeWorker:
    """Stands in for bench_workloads.Proc: every process the driver starts is one of these."""
    started = []
    limits = {"gpt-small": 40, "varlen-lm": 21, "gpt2-small": 9, "vit": 200, "hf-gpt2": 5}

    def __init__(self, allocator, dry, out, extra=None, tag="bench"):
        self.allocator, self.dead, self.info, self.tag, self.cmds, self.workload = allocator, None, {}, tag, [], None
        self.answer_ = None
        FakeWorker.started.append(self)

    def ready(self, timeout):
        self.info = {"torch": "fake"}
        return True

    def send(self, c):
        self.cmds.append(c["op"])
        op = c["op"]
        if op == "load":
            self.workload = c["workload"]
            r = {"params": 1}
        elif op == "throughput":
            r = {"tokens_per_s": 100.0, "ms_per_step": 10.0, "peak_reserved": 2, "peak_allocated": 1}
        elif op == "stepfig":
            r = {"step_allocated_over_reserved": None}
        elif op == "cap":
            r = {"fraction": 0.5}
        elif op == "fits":
            ok = c["batch"] <= self.limits[self.workload]
            r = {"batch": c["batch"], "ok": ok, "oom": None if ok else "CUDA out of memory.", "tokens_per_s": 1.0,
                 "ms_per_step": 1.0, "peak_reserved": 2, "peak_allocated": 1, "trial_s": 0.01}
        else:
            r = {"error": f"unexpected {c}"}
        r["allocator_seen"] = self.allocator
        self.answer_ = r
        return True

    def _get(self, timeout):
        r, self.answer_ = self.answer_, None
        return r

    def ask(self, c, timeout):
        self.send(c)
        return self._get(timeout)

    def close(self):
        self.cmds.append("exit")

    def reap(self, deadline):
        pass

    def kill(self, why):
        self.dead = self.dead or why


real_proc = bw.Proc
bw.Proc = FakeWorker
try:
    out = os.path.join(tmp, "fake")
    res = bw.bench(out, 10000.0, False)
finally:
    bw.Proc = real_proc
ws = FakeWorker.started
capped = [w for w in ws if "cap" in w.cmds]
after_cap = [(w.allocator, w.cmds[w.cmds.index("cap"):]) for w in capped]
case("bench: every frontier runs in a fresh worker (load, cap, then only trials and exit), and no worker that "
     "measured throughput is ever capped: no frontier leaves a cap or a cache behind for another measurement",
     len(capped) == len(bw.PLAN) * len(bw.ALLOCATORS)
     and all(w.cmds[:2] == ["load", "cap"] and set(w.cmds[2:]) <= {"fits", "exit"} and w.cmds[-1] == "exit"
             for w in capped)
     and not any("throughput" in w.cmds and "cap" in w.cmds for w in ws), after_cap[:3])
fr = {(r["workload"], r["allocator"]): r["frontier"] for r in res["rows"]}
md = open(os.path.join(out, "gpu-bench.md")).read()
case("bench: each frontier brackets its limit within 1/16, and the table prints the bracket (largest that fits / "
     "first that fails)",
     all(f["largest"] <= FakeWorker.limits[w] < f["first_failure"] for (w, a), f in fr.items())
     and all(f"| {f['largest']} / {f['first_failure']} |" in md for f in fr.values())
     and "largest fits / first fails" in md and bw.check_bench(res, False) == [], (md[-600:], bw.check_bench(res, False)))

# ---- a row the budget cut fails the run (a GPU run too) ----------------------------------------
r4 = [dict(r) for r in res["rows"]]
r4[3] = dict(r4[3], notes=["the budget ran out after 2 of 3 rounds"])
r4[7] = dict(r4[7], frontier=dict(r4[7]["frontier"], incomplete="the budget ran out during the search"))
bad = bw.check_bench({"rows": r4}, False)
case("check: rows cut short by the budget fail the run, on a GPU as in the dry run (an incomplete table is "
     "never a pass)", len(bad) == 2 and all("budget" in b for b in bad), bad)

# ---- the GPU check runs the bench alone, with its own budget -------------------------------------
import gpu_checks  # noqa: E402
default = getattr(gpu_checks, "DEFAULT_STEPS", gpu_checks.STEPS)
case("GPU check: the default steps leave the bench out (it runs alone: --steps machine,glue,bench)",
     "bench" not in default and set(default) | {"bench"} == set(gpu_checks.STEPS), default)
seen = {}
run = gpu_checks.Run(tmp, False, 100.0, ["machine", "glue", "bench"], bench_budget=540)
run.facts.update(torch=True, gpu=True, glue=True, vmm=True)
run.bench = lambda limit: (seen.setdefault("limit", limit), (True, {}))[1]
run.t0 -= 30  # machine and glue took their time first
if hasattr(run, "bench_step"):
    run.bench_step()
else:  # the call the check made before issue 31
    run.step("bench", run.bench, run.bench_budget, needs=("torch", "vmm", "glue"))
case("GPU check: the bench's limit is its own budget (540 s), not what a shared budget leaves",
     seen.get("limit") == 540, seen)
import contextlib  # noqa: E402
import io  # noqa: E402
argv, buf = sys.argv, io.StringIO()
sys.argv = ["run_gpu_checks.sh", "--steps", "machine,torch,bench"]
try:
    with contextlib.redirect_stdout(buf):
        rc = gpu_checks.main()
finally:
    sys.argv = argv
case("GPU check: the bench with other steps is refused before anything runs (it runs alone)",
     rc == 2 and "runs alone" in buf.getvalue(), buf.getvalue())

# --pack: every result but gpu-checks.json in one archive, nested folders too, nothing lost
import tarfile  # noqa: E402
with tempfile.TemporaryDirectory() as d:
    files = {"gpu-checks.json": "{}", "vmm-costs.json": "[1]", "memreport-demo/a.json": "{\"x\": 1}",
             "memreport-demo/sub/b.txt": "b"}
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "w") as f:
            f.write(text)
    with contextlib.redirect_stdout(io.StringIO()):
        gpu_checks.pack(d)
    left = sorted(os.listdir(d))
    with tarfile.open(os.path.join(d, "gpu-results.tgz")) as t:
        got = {m.name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}
    case("GPU check --pack: two files stay (the summary and the archive), the archive holds every other file whole",
         left == ["gpu-checks.json", "gpu-results.tgz"] and got == {k: v for k, v in files.items() if k != "gpu-checks.json"},
         (left, got))

finish()
