#!/usr/bin/env python3
"""Fault injection end to end (issue 5). A workload runs under LD_PRELOAD=libmemshim.so on the
CUDA driver double with CUDBL_FAIL=<function>:<N>, for every driver function the run calls and
every N up to the number of calls a clean run makes (counted first by libreli-callcount.so).

Workloads:
  reli-workload (tests/reliability/fi_workload.c): cudaMalloc/cudaFree and memshim_malloc/free on
    two streams, record_stream, empty_cache, epochs, cudaMemGetInfo, under MEMSHIM_LIMIT=48M so
    pages are reclaimed and remapped; patterns on every live block. Every N of every function.
  memshim-train-demo (the README's main job, 1 epoch x 2 steps at scale 0.05): up to
    RELI_FI_DEMO_SAMPLES values of N per function, evenly spread (first and last included).

Every run preloads libreli-poolcheck.so in front of libmemshim.so (tests/reliability/poolcheck.c):
after every allocator call of the workload, so right after every injected failure, and at exit, it
runs memshim_debug_check(), the pool's invariants (msh_pool_check, docs/testing.md).

Each run must: keep the pool's invariants after every call; end by exit(), not a signal or a hang
(limit 20 s); exit with 0 or a documented
"could not start" status (reli-workload: 3 when cudaSetDevice/cudaStreamCreate fail; demo: 1
with its "failed" message); never see a corrupted pattern; leave every report it wrote complete
JSON with no temp file; and leak nothing. Leaks are read from the double's exit line
(CUDBL_REPORT_AT_EXIT=1): reli-workload frees everything and calls memshim_empty_cache(), so
handles=0 mappings=0 events=0 allocs=0; the demo exits with its pool's cached pages still mapped
(memshim does not tear its pools down at exit, see docs/reliability.md), so there the double's
handles and mappings must equal the pages memshim's own summary report says it holds.

Known issues (reported, in code this suite does not own) are listed in KNOWN: a case whose only
problem is exactly that symptom counts as skipped with the reason; RELI_STRICT=1 makes it fail.

Ends with "N passed, N failed, N skipped" (one case per function and workload)."""
import concurrent.futures as cf
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
RBIN = os.path.join(BUILD, "reliability")
JOBS = int(os.environ.get("RELI_JOBS", "2"))
DEMO_SAMPLES = int(os.environ.get("RELI_FI_DEMO_SAMPLES", "6"))
STRICT = os.environ.get("RELI_STRICT") == "1"
GRAN = 2 << 20
# function -> (symptom test on one run's "why" list, reason). Reported to the lead; see
# docs/reliability.md "Known gaps".
KNOWN = {
    # none: the pool keeps a handle whose cuMemRelease failed as an orphan and retries it, and
    # tries a failed cuEventDestroy once more (policy/pool/streams.c ev_destroy); both pass RELI_STRICT=1
}
res = {"passed": 0, "failed": 0, "skipped": 0}
EXIT_RE = re.compile(r"cudbl: exit handles=(\d+) mappings=(\d+) reservations=(\d+) allocs=(\d+) events=(\d+)")
CHECK_RE = re.compile(r"^reli-poolcheck: (\d+) checks, (\d+) violations$", re.M)
BROKEN_RE = re.compile(r"^reli-poolcheck: POOL INVARIANT BROKEN after .*$", re.M)


def case(name, ok, detail=""):
    res["passed" if ok else "failed"] += 1
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)


def base_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"),
                "LD_PRELOAD": os.path.join(RBIN, "libreli-poolcheck.so") + ":" +
                os.path.join(BUILD, "libmemshim.so") + ":" + os.path.join(RBIN, "libreli-callcount.so"),
                "CUDBL_CAPACITY": "1G", "CUDBL_REPORT_AT_EXIT": "1"})
    return env


WORKLOADS = {
    "reli-workload": ([os.path.join(RBIN, "reli-workload")], {"MEMSHIM_LIMIT": "48M"}),
    "demo": ([os.path.join(BUILD, "memshim-train-demo"), "--epochs", "1", "--steps", "2", "--scale", "0.05"], {}),
}


def run(workload, fail, tmp, counts=False):
    """One run; returns a dict of what happened."""
    argv, extra = WORKLOADS[workload]
    rdir = tempfile.mkdtemp(dir=tmp)
    env = base_env()
    env.update(extra)
    env["MEMSHIM_REPORT_DIR"] = rdir
    if fail:
        env["CUDBL_FAIL"] = fail
    if counts:
        env["RELI_CALLCOUNT"] = "1"
    out = {"fail": fail, "rc": None, "why": []}
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        out["why"].append("hung (killed after 20 s)")
        shutil.rmtree(rdir, ignore_errors=True)
        return out
    out["rc"], out["stdout"], out["stderr"] = p.returncode, p.stdout, p.stderr
    if p.returncode < 0:
        out["why"].append(f"killed by signal {-p.returncode}")
    m = EXIT_RE.search(p.stderr)
    out["exit"] = tuple(int(x) for x in m.groups()) if m else None
    if not m:
        out["why"].append("no exit line from the double (the process did not exit normally)")
    out["calls"] = {a: int(b) for a, b in re.findall(r"^reli-calls (\S+) (\d+)$", p.stderr, re.M)}
    if "CORRUPT" in p.stderr or p.returncode == 4:
        out["why"].append("corrupted pattern")
    broken = BROKEN_RE.search(p.stderr)
    if broken:
        out["why"].append(broken.group(0)[len("reli-poolcheck: "):])
    cm = CHECK_RE.search(p.stderr)
    out["pool_checks"] = int(cm.group(1)) if cm else 0
    if not cm and m:
        out["why"].append("no line from libreli-poolcheck.so (the invariant checks did not run)")
    # reports: complete JSON, no temp files
    summary = None
    for f in glob.glob(os.path.join(rdir, "*")):
        if ".tmp" in os.path.basename(f):
            out["why"].append(f"temp file left: {os.path.basename(f)}")
            continue
        try:
            r = json.load(open(f))
        except ValueError as e:
            out["why"].append(f"{os.path.basename(f)} is not valid JSON ({e})")
            continue
        if r.get("kind") == "summary":
            summary = r
    out["summary"] = summary
    out["reports"] = len(glob.glob(os.path.join(rdir, "*.json")))
    shutil.rmtree(rdir, ignore_errors=True)
    if workload == "reli-workload":
        last = [l for l in p.stdout.splitlines() if l.startswith("reli-workload:")]
        out["line"] = last[-1] if last else ""
        if p.returncode not in (0, 3):
            out["why"].append({4: "corruption", 5: "handles or mappings left after free + empty_cache",
                               6: "a block could never be freed"}.get(p.returncode, f"exit {p.returncode}")
                              + f" ({out['line']})")
        if m and (out["exit"][0] or out["exit"][1] or out["exit"][3] or out["exit"][4]):
            out["why"].append("leak at exit: " + m.group(0))
    else:
        if p.returncode not in (0, 1) or (p.returncode == 1 and "failed" not in p.stderr + p.stdout
                                          and "cannot" not in p.stderr):
            out["why"].append(f"exit {p.returncode}")
        if m:
            # a handle may cover several pages (issue 10): each is mapped once, and the bytes the
            # double still holds are what memshim's summary says it holds
            held = summary["memory"]["physical_mapped_bytes"] if summary else 0
            h, mp, _, allocs, ev = out["exit"]
            b = re.search(r"bytes=(\d+)", p.stderr[m.start():])
            nbytes = int(b.group(1)) if b else h * GRAN
            if mp != h or nbytes != held or ev:
                out["why"].append(f"{m.group(0)} but memshim's summary holds {held // GRAN} pages")
            if allocs and p.returncode == 0 and "finished" in p.stdout:
                # pass-through cudaMallocs are freed by the demo before it ends
                out["why"].append(f"{allocs} cuMemAlloc blocks left")
    return out


def kinds(r):
    """The reli-workload counters of one run."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", r.get("line", ""))}


def outcome(r, clean):
    """What the job saw in this run beyond what the clean run saw."""
    k, c = kinds(r), kinds(clean)
    seen = set()
    if r["rc"] not in (0, None):
        seen.add(f"exit {r['rc']}")
    if r.get("summary") is None and r["rc"] == 0:
        seen.add("pass-through (no pool)")
    for key, what in (("pool_null", "memshim_malloc NULL"), ("rt_oom", "cudaMalloc OOM"),
                      ("rt_err", "other CUDA error"), ("free_err", "cudaFree error")):
        if k.get(key, 0) > c.get(key, 0):
            seen.add(what)
    if not seen:
        seen.add("no visible effect")
    return seen


def main():
    for exe in [os.path.join(RBIN, "reli-workload"), os.path.join(RBIN, "libreli-callcount.so"),
                os.path.join(RBIN, "libreli-poolcheck.so"),
                os.path.join(BUILD, "memshim-train-demo"), os.path.join(BUILD, "libmemshim.so")]:
        if not os.path.exists(exe):
            print(f"FAIL setup: {exe} not built")
            print("0 passed, 1 failed, 0 skipped")
            return 1
    t_start = time.time()
    total_runs = 0
    with tempfile.TemporaryDirectory(prefix="memshim-fi-") as tmp, cf.ThreadPoolExecutor(JOBS) as pool:
        for workload in ("reli-workload", "demo"):
            clean = run(workload, None, tmp, counts=True)
            total_runs += 1
            case(f"{workload}: clean run", not clean["why"] and clean["rc"] == 0, clean["why"])
            # the checker must have seen a pool: the clean run allocates through memshim
            case(f"{workload}: pool invariants checked after every call ({clean.get('pool_checks', 0)} checks)",
                 clean.get("pool_checks", 0) >= 10 and "memshim_debug_check not found" not in clean.get("stderr", ""),
                 clean.get("stderr", "")[-300:])
            calls = clean.get("calls", {})
            if not calls:
                case(f"{workload}: call counts", False, "libreli-callcount.so printed nothing")
                continue
            print(f"  {workload}: a clean run makes " +
                  ", ".join(f"{k} {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])))
            plan = []
            for fn, n in sorted(calls.items()):
                if fn in ("cuGetErrorString", "cuGetErrorName"):
                    continue  # only called to print an error that already happened
                if workload == "demo" and n > DEMO_SAMPLES:
                    ns = sorted({1 + round(i * (n - 1) / (DEMO_SAMPLES - 1)) for i in range(DEMO_SAMPLES)})
                else:
                    ns = list(range(1, n + 1))
                plan.append((fn, "", ns, n))
                # the default error of these two is OUT_OF_MEMORY; also try a plain driver error
                if fn in ("cuMemCreate", "cuMemAddressReserve"):
                    plan.append((fn, ":CUDA_ERROR_UNKNOWN", ns, n))
            for fn, err, ns, n in plan:
                futs = [pool.submit(run, workload, f"{fn}:{k}{err}", tmp) for k in ns]
                results = [f.result() for f in futs]
                total_runs += len(results)
                bad = [r for r in results if r["why"]]
                seen = {}
                for r in results:
                    for what in outcome(r, clean):
                        seen[what] = seen.get(what, 0) + 1
                label = f"{workload}: {fn}{err or ''} failing call N for N in " + \
                    (f"1..{n}" if len(ns) == n else f"{len(ns)} of 1..{n} ({', '.join(map(str, ns))})")
                detail = "; ".join(f"N={r['fail'].split(':')[1]}: {', '.join(r['why'])}" for r in bad[:3])
                known = KNOWN.get(fn)
                if bad and known and not STRICT and all(known[0](r["why"]) for r in bad):
                    res["skipped"] += 1
                    print(f"skip {label}: {len(bad)} of {len(ns)} runs: {known[1]}")
                else:
                    case(label, not bad, f"{len(bad)} of {len(ns)} runs wrong: {detail}")
                print("       what the job saw: " + ", ".join(f"{k} in {v}" for k, v in sorted(seen.items())))
    dt = time.time() - t_start
    print(f"fault injection: {total_runs} runs in {dt:.1f} s ({JOBS} at a time)")
    print(f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped")
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
