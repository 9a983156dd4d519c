#!/usr/bin/env python3
"""Report figures over a run longer than memshim's trend ring, and over reports from several hosts
(issue 18, item 2).

A Python workload (memshim_malloc through ctypes, MEMSHIM_EPOCH=manual) runs 80 epochs, more than
the 64 epoch ends the reports' trend keeps (report/report.h, MSH_TREND_MAX; docs/reports.md: "the
last 64"): 10 flat epochs, then 2 MiB kept at every epoch. The test keeps its own ledger of the live
bytes (nothing from memshim) and holds against it:
  - every epoch report's allocated bytes at its end;
  - the summary's trend: the last 64 epoch ends, and the verdict docs/reports.md's rule gives on them;
  - memshim-report (docs/reports.md#memshim-report): "allocated memory at the end of the first and
    last epoch and the growth per epoch" over the whole run, whose every epoch report it reads,
    not over the ring's last 64;
then copies the run as the ranks of one job on two more hosts (same launcher job id, other host
names, pids and ranks) and checks the tool sees one run of 3 ranks on 3 hosts with each rank's
figures from its own files."""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
from pyharness import BUILD, case, finish, step  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
TOOL = os.path.join(ROOT, "scripts", "memshim-report")
MiB = 1 << 20
EPOCHS, FLAT, KEEP = 80, 10, 2 * MiB
RING = 64

JOB = r"""
import ctypes, json, sys
lib = ctypes.PyDLL(None)
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
EPOCHS, FLAT, KEEP = %d, %d, %d
kept, ledger, live = [], [], 0
w = lib.memshim_malloc(5 << 20, 0, None); live += 5 << 20
for e in range(EPOCHS):
    acts = [(lib.memshim_malloc(n, 0, None), n) for n in ((i %% 4 + 1) * 700 * 1024 for i in range(12))]
    for p, n in acts:
        lib.memshim_free(p, n, 0, None)
    if e >= FLAT:
        kept.append(lib.memshim_malloc(KEEP, 0, None)); live += KEEP
    ledger.append(live)
    lib.memshim_epoch()
print(json.dumps(ledger))
""" % (EPOCHS, FLAT, KEEP)


def verdict(series):
    """docs/reports.md, trend.verdict: fewer than 3 epochs; growth by more than 1 MiB at every boundary."""
    if len(series) < 3:
        return "too few epochs"
    return "possible leak" if all(b > a + MiB for a, b in zip(series, series[1:])) else "flat"


step("an 80-epoch run")
tmp = tempfile.mkdtemp(prefix="memshim-rings-")
try:
    rdir = os.path.join(tmp, "rep")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_", "RANK", "LOCAL_RANK",
                                                                     "TORCHELASTIC", "SLURM"))}
    env.update(LD_PRELOAD=LIB, LD_LIBRARY_PATH=os.path.join(BUILD, "double"), CUDBL_CAPACITY="4G",
               MEMSHIM_REPORT_DIR=rdir, MEMSHIM_EPOCH="manual", MEMSHIM_LOG="warn", RANK="0",
               TORCHELASTIC_RUN_ID="rings-job")
    p = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True, text=True, timeout=300)
    case("the run completes", p.returncode == 0, p.stdout[-500:] + p.stderr[-1500:])
    if p.returncode:
        finish()
    ledger = json.loads(p.stdout.strip().splitlines()[-1])
    reps = {}
    for f in glob.glob(os.path.join(rdir, "*.json")):
        r = json.load(open(f))
        reps[(r["kind"], r.get("epoch"))] = r
    epochs = [reps.get(("epoch", e)) for e in range(EPOCHS)]
    summary = next((r for k, r in reps.items() if k[0] == "summary"), None)
    case(f"{EPOCHS} epoch reports and a summary", all(epochs) and summary is not None, sorted(reps)[:5])
    if not all(epochs) or summary is None:
        finish()
    bad = [(e, r["memory"]["allocated_bytes"], ledger[e]) for e, r in enumerate(epochs)
           if r["memory"]["allocated_bytes"] != ledger[e]]
    case("every epoch report's allocated bytes at its end equal the workload's own ledger", not bad, bad[:4])
    tr = summary["trend"]
    case(f"the summary's trend keeps the last {RING} epoch ends (docs: 'the last 64'), the ledger's",
         tr["epoch_end_allocated_bytes"] == ledger[-RING:], (len(tr["epoch_end_allocated_bytes"]),
                                                            tr["epoch_end_allocated_bytes"][:3], ledger[-RING:][:3]))
    case("its verdict is the documented rule over those epoch ends",
         tr["verdict"].startswith(verdict(ledger[-RING:])), (tr["verdict"], verdict(ledger[-RING:])))
    mid = epochs[40]["trend"]
    case("an epoch report inside the ring's span (epoch 40) keeps every epoch end so far",
         mid["epoch_end_allocated_bytes"] == ledger[:41][-RING:], len(mid["epoch_end_allocated_bytes"]))

    step("memshim-report over the run")
    j = subprocess.run([sys.executable, TOOL, "--json", rdir], capture_output=True, text=True, timeout=120)
    doc = json.loads(j.stdout) if j.returncode == 0 else {}
    runs = doc.get("runs", [])
    rk = runs[0]["ranks"][0] if runs and runs[0].get("ranks") else {}
    t = rk.get("trend", {})
    want_growth = (ledger[-1] - ledger[0]) / (EPOCHS - 1)
    case("memshim-report: the trend's first and last epoch ends are the run's (epoch 0 and 79), its growth per "
         "epoch over the whole run, all from the epoch reports it read",
         t.get("epoch_end_allocated_bytes", [None])[0] == ledger[0]
         and t.get("epoch_end_allocated_bytes", [None])[-1] == ledger[-1]
         and abs((t.get("growth_bytes_per_epoch") or 0) - want_growth) < 1,
         {"first": (t.get("epoch_end_allocated_bytes") or [None])[0], "want_first": ledger[0],
          "growth": t.get("growth_bytes_per_epoch"), "want_growth": want_growth, "source": t.get("source")})
    case("memshim-report keeps the library's verdict (the reports' own)", t.get("verdict") == tr["verdict"],
         (t.get("verdict"), tr["verdict"]))

    step("the same job on three hosts")
    multi = os.path.join(tmp, "multi")
    shutil.copytree(rdir, os.path.join(multi, "hostA"))
    for i, host in ((1, "hostB"), (2, "hostC")):
        d = os.path.join(multi, host)
        os.makedirs(d)
        for f in glob.glob(os.path.join(rdir, "*.json")):
            r = json.load(open(f))
            r["host"], r["pid"], r["rank"] = host, r["pid"] + 1000 * i, i
            r["memory"]["allocated_peak_bytes"] += i * MiB  # each rank its own figures
            r["memory"]["allocated_run_peak_bytes"] += i * MiB
            json.dump(r, open(os.path.join(d, os.path.basename(f).replace("rank0", f"rank{i}")), "w"))
    j = subprocess.run([sys.executable, TOOL, "--json", multi], capture_output=True, text=True, timeout=180)
    doc = json.loads(j.stdout) if j.returncode == 0 else {}
    runs = doc.get("runs", [])
    ranks = {r["rank"]: r for r in runs[0]["ranks"]} if len(runs) == 1 else {}
    case("three hosts, one launcher job id: one run of ranks 0-2 on the three hosts",
         len(runs) == 1 and sorted(ranks) == [0, 1, 2]
         and set(runs[0].get("hosts", [])) == {summary["host"], "hostB", "hostC"},
         [(r.get("run"), r.get("hosts"), [k.get("rank") for k in r.get("ranks", [])]) for r in runs] or j.stderr[-800:])
    peak0 = max(max(r["memory"]["allocated_peak_bytes"], r["memory"]["allocated_run_peak_bytes"]) for r in reps.values())
    case("each rank's peak allocated is its own files' (rank i: +i MiB), the highest-peak rank is rank 2",
         ranks and all(ranks[i]["allocated_peak_bytes"] == peak0 + i * MiB for i in range(3))
         and runs[0]["highest_peak"]["rank"] == 2,
         {i: ranks[i]["allocated_peak_bytes"] for i in ranks} if ranks else runs)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
finish()
