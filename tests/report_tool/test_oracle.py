#!/usr/bin/env python3
"""memshim-report against an independent oracle (issue 32 item 4), by property tests.

Each round writes a random but valid set of report files, as memshim writes them, for a few jobs
and lone processes: several hosts whose processes have equal pids, ranked jobs with and without a
launcher's job id, started at once or one after the other, elastic restarts (the same ranks again,
the same job id), ranks that never wrote a report, epoch reports missing, runs longer than the
64 epoch ends the reports' trend keeps, leaks, OOMs, spills, interrupted and unfinished processes,
segment-mode PyTorch figures, limits, devices near capacity, copies of a file under another name,
reports with and without start_unix. Then memshim-report --json reads the directory and
tests/report_tool/oracle.py, written from docs/reports.md alone, derives the same figures; they
must agree on every one: files read and duplicates skipped, the runs (which processes, job id,
ranked), each stream's peaks, trend series, verdict, growth and growing sites, the highest peak,
the growing streams, and every advice rule that fires with the ranks it names.

MSH_ORACLE_ROUNDS (default 40) sets the number of rounds, MSH_ORACLE_SEED the first seed; a
failure names the seed that reproduces it. Ends with "N passed, N failed, N skipped"."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pyharness import ROOT, case, finish, step  # noqa: E402
import oracle  # noqa: E402

TOOL = os.environ.get("MSH_REPORT_TOOL", os.path.join(ROOT, "scripts", "memshim-report"))
MiB, GiB = 1 << 20, 1 << 30
RING = 64


# ---- a random valid report set ---------------------------------------------------------------------

def series_for(rng, n, base):
    kind = rng.choice(["flat", "flat", "leak", "leak", "noisy", "step"])
    out, v = [], base
    for e in range(n):
        if kind == "leak":
            v += rng.randint(2 * MiB, 40 * MiB)
        elif kind == "noisy":
            v = max(0, v + rng.randint(-30 * MiB, 30 * MiB))
        elif kind == "step" and e == n // 2:
            v += 500 * MiB
        else:
            v = max(0, v + rng.randint(-MiB // 2, MiB // 2))
        out.append(v)
    return out


def verdict(series):
    if len(series) < 3:
        return "too few epochs"
    if all(b > a + MiB for a, b in zip(series, series[1:])):
        return "possible leak: allocated memory grew at every epoch"
    return "flat"


def process_reports(rng, p):
    """Every report one process writes for each of its devices: dicts with their file names."""
    files = []
    nep, t0 = p["epochs"], p["start"]
    dt = rng.choice([0.2, 1.5, 7.0])
    for dev in p["devices"]:
        base = rng.randint(GiB // 2, 12 * GiB) if not p["big"] else rng.randint(13 * GiB, 15 * GiB)
        ends = series_for(rng, nep, base)
        extra = [rng.randint(0, 300 * MiB) for _ in range(nep + 1)]
        # reserved beyond allocated: none, small, large, or about a tenth of the live bytes (the
        # fragmentation rule's ratio, crossed as the live bytes move)
        gap = rng.choice([0, 0, 16 * MiB, 90 * MiB, 2 * GiB, base // 9, base // 9])
        seg = p["mode"] == "segment"
        cfg = {"MEMSHIM_LIMIT": {"value": p["limit"]}, "MEMSHIM_DEFRAG": {"value": p["defrag"]},
               "MEMSHIM_SPILL": {"value": "host" if p["spill"] else "off"}}
        run_peak = [0, 0]
        ooms, last_oom = 0, None
        oom_at = sorted(rng.sample(range(nep + 1), min(nep + 1, rng.choice([0, 0, 0, 1, 2]))))

        def report(kind, epoch, t_end, closed, live, apeak, reason):
            rpeak = apeak + gap + rng.randint(0, 40 * MiB)
            run_peak[0] = max(run_peak[0], apeak)
            run_peak[1] = max(run_peak[1], rpeak)
            ring = closed[-RING:]
            leak = verdict(ring).startswith("possible")
            r = {"schema_version": 2, "kind": kind, "memshim_version": "0.32-test", "host": p["host"],
                 "pid": p["pid"], "rank": -1 if p["rank"] is None else p["rank"], "run_id": p["run_id"],
                 "device": dev, "epoch": epoch, "reason": reason, "mode": p["mode"], "t_start_s": max(0.0, t_end - dt),
                 "t_end_s": round(t_end, 6), "steps": 3, "wall_time_unix": math.floor(t0 + t_end),
                 "memory": {"pool_active": True, "allocated_bytes": live, "allocated_peak_bytes": apeak,
                            "reserved_bytes": live + gap, "reserved_peak_bytes": rpeak,
                            "allocated_run_peak_bytes": run_peak[0], "reserved_run_peak_bytes": run_peak[1],
                            "touched_bytes": live, "touched_peak_bytes": apeak + gap // 2,
                            "device_total_bytes": p["device_total"]},
                 "fragmentation": {"free_extent_fragmentation": round(rng.random(), 4)},
                 "operations": {"map_ops": epoch, "unmap_ops": 0, "reclaimed_pages": 0},
                 "oom": {"oom_events": ooms, "rescued_by_reclaim": 0, "rescued_by_gc": 0, "rescued_by_empty_cache": 0},
                 "trend": {"verdict": verdict(ring), "epoch_end_allocated_bytes": ring,
                           "growing_sites": ([{"file": "train.py", "line": 40 + dev, "function": "step",
                                               "growth_bytes_per_epoch": (ring[-1] - ring[0]) // (len(ring) - 1)}]
                                             if leak and rng.random() < 0.7 else [])},
                 "sites": [{"file": "model.py", "line": 12, "function": "forward", "bytes": apeak // 2, "count": 3}],
                 "config": cfg, "spill": {"spilled_peak_bytes": p["spill"] if kind != "oom" else 0}}
            if p["start_unix"]:
                r["start_unix"] = round(t0 + rng.random() * 4e-4, 6)  # one process's reports: within a millisecond
            if seg:
                r["torch_memory_stats"] = {"allocated_bytes.all.peak": apeak,
                                           "reserved_bytes.all.peak": apeak + rng.choice([0, 30 * MiB, 400 * MiB])}
            if p["interrupted"] and reason == "interrupted":
                r["interrupted_by"] = "SIGTERM"
            if last_oom:
                r["last_oom"] = dict(last_oom)
            return r

        closed = []
        for e in range(nep + 1):
            if e in oom_at:  # a failed request during epoch e: an OOM report, numbered
                ooms += 1
                cap = p["limit_bytes"] or p["device_total"] or 16 * GiB
                last_oom = {"requested_bytes": rng.randint(MiB, 4 * GiB), "live_bytes": ends[min(e, nep - 1)] if nep else 0,
                            "reserved_bytes": cap - MiB, "device_total_bytes": p["device_total"] or 0,
                            "device_free_bytes": 0, "limit_bytes": p["limit_bytes"] or 0,
                            "largest_free_extent_bytes": 0, "cause": rng.choice(["capacity", "fragmentation"])}
                files.append((f"oom{ooms - 1:04d}", dev, dict(report("oom", e, (e + 0.5) * dt, closed, 0, 0, "oom"),
                                                              oom_index=ooms - 1)))
            if e == nep:
                break
            closed.append(ends[e])
            reason = "interrupted" if p["interrupted"] and e == nep - 1 else "manual"
            files.append((f"epoch{e:04d}", dev, report("epoch", e, (e + 1) * dt, closed, ends[e],
                                                        ends[e] + extra[e], reason)))
        if p["summary"]:
            files.append(("summary", dev, report("summary", nep, (nep + 1) * dt, closed, closed[-1] if closed else 0,
                                                 (closed[-1] if closed else 0) + extra[nep],
                                                 "interrupted" if p["interrupted"] else "exit")))
    out = []
    for what, dev, r in files:
        if what.startswith("epoch") and rng.random() < p["drop"]:
            continue  # an epoch report that is missing (deleted, never copied back)
        rank = "" if p["rank"] is None else f"-rank{p['rank']}"
        out.append((f"memshim-{p['host']}-pid{p['pid']}{rank}-dev{dev}-{what}.json", r))
    return out


def gen_set(rng):
    hosts = rng.sample(["alpha", "beta", "gamma", "delta"], rng.randint(1, 3))
    pids = [4242, 4243, 7, 1000]  # the same pids on several hosts (containers, restarted nodes)
    used = set()
    with_start_unix = rng.random() < 0.75
    t = 1.7e9 + rng.randint(0, 10 ** 6)

    def new_pid(host):
        for pid in pids + [rng.randint(10, 10 ** 6) for _ in range(20)]:
            if (host, pid) not in used:
                used.add((host, pid))
                return pid
        raise RuntimeError("no pid left")

    def proc(host, rank, run_id, start, job):
        dt_total = job["epochs"]
        dev_total = rng.choice([16 * GiB, 80 * GiB, None])
        limit = rng.choice(["0", "0", "12GiB", "0.5", "8G"])
        lb = oracle.limit_of(limit, dev_total)
        return {"host": host, "pid": new_pid(host), "rank": rank, "run_id": run_id, "start": start,
                "epochs": dt_total, "devices": job["devices"], "mode": job["mode"], "big": rng.random() < 0.15,
                "limit": limit, "limit_bytes": lb, "device_total": dev_total, "defrag": rng.choice(["1", "1", "0"]),
                "spill": rng.choice([0, 0, 0, 300 * MiB]), "interrupted": rng.random() < 0.1,
                "summary": rng.random() < 0.85, "drop": rng.choice([0, 0, 0.15]), "start_unix": with_start_unix}

    procs = []
    for j in range(rng.randint(1, 3)):  # ranked jobs
        world = rng.randint(1, 5)
        run_id = rng.choice([f"torchelastic:job{j}", f"slurm:{700 + j}.0", None])
        job = {"epochs": rng.choice([0, 1, 2, 4, 6, 90]), "devices": rng.choice([[0], [0], [0, 1]]),
               "mode": rng.choice(["tensor", "segment"])}
        start = t + rng.choice([0, 0.3, 5, 70, 200]) * j
        # ranks that never wrote a report: a few at random, or the processes of one node
        silent = rng.choice([set(), set(), set(), {r for r in range(world) if rng.random() < 0.2},
                             set(range(world // 2)), set(range(world // 2, world))])
        slow = rng.choice([None, None, None, rng.randrange(world)])  # a rank whose node came up late
        for attempt in range(rng.choice([1, 1, 2])):
            if attempt:  # an elastic restart: the same ranks, after every rank of the last attempt ended
                start = max(q["start"] + (q["epochs"] + 2) * 7.0 for q in procs[-world:]) + rng.choice([0.4, 3, 90])
            for r in range(world):
                # ranks placed on the hosts differently per job and attempt: the same rank and pid on
                # another host is another process
                late = rng.uniform(20, 150) if r == slow and not attempt else 0
                p = proc(hosts[(r + j + attempt) % len(hosts)], r, run_id, start + late + rng.random() * 0.05, job)
                if r not in silent:
                    procs.append(p)
                else:
                    procs.append(dict(p, epochs=-1))
    for _ in range(rng.randint(0, 2)):  # processes without a rank
        job = {"epochs": rng.choice([0, 3, 5]), "devices": rng.choice([[0], [0, 1]]), "mode": "tensor"}
        procs.append(proc(rng.choice(hosts), None, rng.choice([None, "slurm:9.1"]), t + rng.random() * 3, job))
    files = []
    for p in procs:
        if p["epochs"] >= 0:
            files += process_reports(rng, p)
    for name, r in rng.sample(files, min(len(files), rng.choice([0, 0, 1, 3]))):  # copies under another name
        files.append((name.replace(".json", ".copy.json"), r))
    return files


# ---- comparison ------------------------------------------------------------------------------------------

def close(a, b):
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def sid(s):
    return (s["host"], s["pid"], s["rank"], s["device"])


def compare(doc, want):
    bad = []
    if doc["reports_read"] != want["reports_read"]:
        bad.append(f"reports read: {doc['reports_read']}, the oracle {want['reports_read']}")
    dups = {x["path"] for x in doc["skipped"] if x["reason"].startswith("duplicate")}
    if dups != want["duplicates"]:
        bad.append(f"duplicates: {sorted(map(os.path.basename, dups))}, the oracle "
                   f"{sorted(map(os.path.basename, want['duplicates']))}")
    got_runs = {frozenset((x["host"], x["pid"], x["rank"]) for x in run["ranks"]): run for run in doc["runs"]}
    want_runs = {frozenset(run["procs"]): run for run in want["runs"]}
    if set(got_runs) != set(want_runs):
        fmt = lambda rs: sorted(sorted(map(str, r)) for r in rs)  # noqa: E731
        bad.append(f"runs: {fmt(got_runs)}, the oracle {fmt(want_runs)}")
        return bad
    for key, w in want_runs.items():
        g = got_runs[key]
        name = f"run {g['run']}"
        if g["run_id"] != w["run_id"] or g["ranked"] != w["ranked"]:
            bad.append(f"{name}: job id {g['run_id']!r} ranked {g['ranked']}, the oracle {w['run_id']!r} {w['ranked']}")
        ws = {sid(s): s for s in w["streams"]}
        for proc in g["ranks"]:
            for st in proc["streams"]:
                k = (proc["host"], proc["pid"], proc["rank"], st["device"])
                s = ws.get(k)
                if s is None:
                    bad.append(f"{name}: stream {k} the oracle does not have")
                    continue
                t = st["trend"]
                for what, a, b in (("peak allocated", st["allocated_peak_bytes"], s["alloc_peak"]),
                                   ("peak reserved", st["reserved_peak_bytes"], s["resv_peak"]),
                                   ("trend series", t["epoch_end_allocated_bytes"], s["series"]),
                                   ("verdict", t["verdict"], s["verdict"]),
                                   ("growing sites", t["growing_sites"], s["growing_sites"])):
                    if a != b:
                        bad.append(f"{name} {k}: {what} {str(a)[:120]}, the oracle {str(b)[:120]}")
                if not close(t["growth_bytes_per_epoch"], s["growth"]):
                    bad.append(f"{name} {k}: growth {t['growth_bytes_per_epoch']}, the oracle {s['growth']}")
        h = g["highest_peak"]
        hk = (h["host"], h["pid"], h["rank"], h["device"])
        if hk not in {sid(s) for s in w["highest"]} or h["allocated_peak_bytes"] != w["highest"][0]["alloc_peak"]:
            bad.append(f"{name}: highest peak {hk} {h['allocated_peak_bytes']}, the oracle "
                       f"{[sid(s) for s in w['highest']]} {w['highest'][0]['alloc_peak']}")
        gg = sorted(((x["host"], x["pid"], x["rank"], x["device"]), x["growth_bytes_per_epoch"]) for x in g["growing"])
        wg = sorted((sid(s), s["growth"]) for s in w["growing"])
        if [k for k, _ in gg] != [k for k, _ in wg] or \
                [x["growth_bytes_per_epoch"] for x in g["growing"]] != sorted((x[1] for x in gg), reverse=True):
            bad.append(f"{name}: growing {gg}, the oracle {wg} (largest growth first)")
        bad += compare_advice(name, g["advice"], w["advice"])
    return bad


def compare_advice(name, got, want):
    bad = []
    seen = {}
    for a in got:
        f = a["figures"]
        k = a["kind"]
        if k in ("leak", "spill", "oom"):
            key = (f["rank"], f["device"])
        elif k == "pool-frag":
            key = (f["mode"], f["MEMSHIM_DEFRAG"])
        elif k == "unreported":
            key = tuple(f["missing_ranks"])
        else:
            key = None
        seen.setdefault((k, key), []).append(a)
    if set(seen) != set(want):
        bad.append(f"{name}: advice {sorted(map(str, seen))}, the oracle {sorted(map(str, want))}")
        return bad
    for k, items in seen.items():
        if len(items) != 1:
            bad.append(f"{name}: advice {k} given {len(items)} times")
            continue
        f, group = items[0]["figures"], want[k]
        ranks = sorted(s["rank"] for _, s in group if s["rank"] is not None)
        if k[0] not in ("unreported", "none") and f["ranks"] != ranks:
            bad.append(f"{name}: advice {k} names ranks {f['ranks']}, the oracle {ranks}")
        top = max(sev for sev, _ in group)
        worst = {(s["rank"], s["device"]) for sev, s in group if sev == top}
        if k[0] not in ("unreported", "none") and (f["rank"], f["device"]) not in worst:
            bad.append(f"{name}: advice {k} quotes rank {f['rank']} device {f['device']}, the worst are {sorted(map(str, worst))}")
    return bad


def main():
    rounds = int(os.environ.get("MSH_ORACLE_ROUNDS", "40"))
    seed0 = int(os.environ.get("MSH_ORACLE_SEED", "3200"))
    failures, stats = [], {"files": 0, "runs": 0, "advice": set(), "dups": 0}
    with tempfile.TemporaryDirectory(prefix="memshim-oracle-") as tmp:
        for i in range(rounds):
            seed = seed0 + i
            step(f"round {i} (seed {seed})")
            rng = random.Random(seed)
            d = os.path.join(tmp, f"set{seed}")
            os.makedirs(d)
            files = []
            while not files:
                files = gen_set(rng)
            for name, r in files:
                with open(os.path.join(d, name), "w") as f:
                    json.dump(r, f)
            p = subprocess.run([sys.executable, TOOL, "--json", d], capture_output=True, text=True, timeout=120)
            if p.returncode != 0:
                failures.append(f"seed {seed}: memshim-report exited {p.returncode}: {p.stderr[-300:]}")
                shutil.rmtree(d)
                continue
            doc = json.loads(p.stdout)
            want = oracle.derive(d)
            bad = compare(doc, want)
            if bad:
                failures.append(f"seed {seed}: " + "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else ""))
            shutil.rmtree(d)
            stats["files"] += len(files)
            stats["runs"] += len(want["runs"])
            stats["dups"] += len(want["duplicates"])
            stats["advice"] |= {k for run in want["runs"] for k, _ in run["advice"]}
    case(f"memshim-report agrees with the oracle on {rounds} random report sets ({stats['files']} files, "
         f"{len(failures)} sets disagree, "
         f"{stats['runs']} runs, {stats['dups']} duplicates; seeds {seed0}-{seed0 + rounds - 1})",
         not failures, "\n    " + "\n    ".join(failures[:5]))
    # the sets must exercise what the oracle checks, or agreeing proves little
    kinds = {"unfinished", "interrupted", "unreported", "leak", "capacity", "torch-frag", "pool-frag", "oom",
             "spill", "imbalance", "none"}
    case(f"the random sets fire every advice rule ({len(stats['advice'] & kinds)} of {len(kinds)})",
         kinds <= stats["advice"], sorted(kinds - stats["advice"]))
    finish()


main()
