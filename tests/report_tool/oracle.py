"""An independent oracle for memshim-report (issue 32 item 4): what the tool must derive from a
directory of memshim reports, recomputed from the raw per-epoch records by the rules docs/reports.md
states ("memshim-report", "Advice", "How a run is recognised"), written from those rules and
sharing no code with hooks/python/memshim/report.py (it imports nothing of memshim). Where the
rules leave a choice open it takes the one stated here: of two copies of a report the first in
the order the directory is read (names sorted) is kept; of equally bad ranks the first in rank
order is quoted (the comparison accepts any of them).

It covers the figures the tool derives across files, processes and epochs: which files are
duplicates, the runs (grouping by job id, start order, repeated ranks and late starts, across hosts
with equal pids and restarts), each stream's peaks, trend series (the reports' ring or every epoch
report), verdict, growth and growing sites, the highest peak, the growing streams, and which advice
rules fire on which ranks (merged per subject, leaks, spills and OOMs per rank). Input is what the
report generator of test_oracle.py writes: valid reports of schema 2 with t_end_s in every one;
parsing of malformed files and the text, charts and CSV are the other tests' business.

    expected = oracle.derive(directory)
"""
import json
import os
import statistics

MiB = 1 << 20
GiB = 1 << 30


def read_dir(d):
    """Reports in the order the tool reads them: the directory walked with sorted names."""
    out = []
    for root, dirs, names in os.walk(d):
        dirs.sort()
        for n in sorted(names):
            if n.startswith("memshim-") and n.endswith(".json"):
                p = os.path.join(root, n)
                with open(p) as f:
                    out.append((p, json.load(f)))
    return out


def ident(r):
    return (r["host"], r["pid"], r["rank"] if r["rank"] >= 0 else None)


def dedupe(files):
    """A file whose writer, device, kind, epoch and OOM number were already read is a duplicate."""
    kept, dups, seen = [], set(), set()
    for p, r in files:
        k = ident(r) + (r["device"], r["kind"], r["epoch"], r.get("oom_index") if r["kind"] == "oom" else None)
        if k in seen:
            dups.add(p)
        else:
            seen.add(k)
            kept.append(r)
    return kept, dups


def leak_rule(series):
    """The library's verdict: fewer than 3 epoch ends are too few; growth by more than 1 MiB at every
    boundary is a possible leak."""
    if len(series) < 3:
        return "too few epochs"
    for i in range(1, len(series)):
        if not series[i] > series[i - 1] + MiB:
            return "flat"
    return "possible leak"


def limit_of(value, device):
    """MEMSHIM_LIMIT as the generator writes it: "0" (none), a fraction, or N followed by G or GiB."""
    if value is None or value == "0":
        return None
    if value.endswith("GiB") or value.endswith("G"):
        return int(float(value.rstrip("GiB")) * GiB)
    f = float(value)
    return int(f * device) if f <= 1 and device else (int(f) if f > 1 else None)


def stream(recs):
    """One process's reports of one device."""
    KIND = {"oom": 0, "epoch": 1, "summary": 2}
    recs = sorted(recs, key=lambda r: (r["kind"] == "summary", r["t_end_s"], r["epoch"], KIND[r["kind"]]))
    mem = [r["memory"] for r in recs]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    summ = [r for r in recs if r["kind"] == "summary"]
    newest = summ[-1] if summ else (epochs[-1] if epochs else recs[-1])
    ring = newest["trend"]["epoch_end_allocated_bytes"]
    ends = [r["memory"]["allocated_bytes"] for r in epochs]
    complete = [r["epoch"] for r in epochs] == list(range(len(epochs)))
    series = ends if complete and len(ends) > len(ring) else ring
    verdict = newest["trend"]["verdict"] or leak_rule(series)
    dev = max([m.get("device_total_bytes") or 0 for m in mem]) or None
    limits = [r["last_oom"]["limit_bytes"] for r in recs if r.get("last_oom") and r["last_oom"]["limit_bytes"]]
    cfg = newest.get("config", {}).get("MEMSHIM_LIMIT", {}).get("value")
    limit = limits[-1] if limits else limit_of(cfg, dev)
    starts = [r["start_unix"] if "start_unix" in r else r["wall_time_unix"] - r["t_end_s"] for r in recs]
    ends_t = [r["start_unix"] + r["t_end_s"] if "start_unix" in r else r["wall_time_unix"] for r in recs]
    return {
        "host": recs[0]["host"], "pid": recs[0]["pid"], "rank": ident(recs[0])[2], "device": recs[0]["device"],
        "run_id": recs[0].get("run_id"), "recs": recs, "epochs": epochs, "newest": newest, "summary": bool(summ),
        "alloc_peak": max(max(m["allocated_peak_bytes"], m.get("allocated_run_peak_bytes", 0)) for m in mem),
        "resv_peak": max(max(m["reserved_peak_bytes"], m.get("reserved_run_peak_bytes", 0)) for m in mem),
        "series": series, "verdict": verdict,
        "growth": (series[-1] - series[0]) / (len(series) - 1) if len(series) > 1 else None,
        "growing_sites": newest["trend"].get("growing_sites"),
        "capacity": limit or dev, "start": min(starts), "end": max(ends_t),
    }


def group_runs(procs):
    """docs/reports.md, "How a run is recognised"."""
    runs = [[p] for p in procs if p["rank"] is None]
    jobs = {}
    for p in procs:
        if p["rank"] is not None:
            jobs.setdefault(p["run_id"], []).append(p)
    for members in jobs.values():
        members.sort(key=lambda p: (p["start"], p["host"], p["pid"]))
        cur = []
        for p in members:
            if cur and (p["rank"] in {q["rank"] for q in cur} or p["start"] > max(q["end"] for q in cur) + 60):
                runs.append(cur)
                cur = []
            cur.append(p)
        runs.append(cur)
    return runs


def tiny(s):
    return s["capacity"] is not None and s["resv_peak"] / s["capacity"] < 0.05


def is_leak(s):
    return s["verdict"].startswith("possible leak")


def advice(run, streams):
    """Which rules fire, as (kind, subject) -> [(severity, stream)]; docs/reports.md, "Advice"."""
    fired = {}

    def fire(kind, key, sev, s):
        fired.setdefault((kind, key), []).append((sev, s))

    for s in streams:
        intr = [r for r in s["epochs"] if r.get("reason") == "interrupted"]
        if intr:
            fire("interrupted", None, intr[-1]["epoch"], s)
        if not s["summary"]:
            fire("unfinished", None, 0, s)
        if is_leak(s) and s["growth"] is not None:
            fire("leak", (s["rank"], s["device"]), s["growth"], s)
        # "the highest peak reserved": a peak is the highest of the per-epoch peaks and the run peaks
        if s["capacity"] and s["resv_peak"] / s["capacity"] >= 0.8:
            fire("capacity", None, s["resv_peak"] / s["capacity"], s)
        sp = [r["spill"]["spilled_peak_bytes"] for r in s["recs"] if r.get("spill", {}).get("spilled_peak_bytes")]
        if sp:
            fire("spill", (s["rank"], s["device"]), max(sp), s)
        if not tiny(s):
            # reserved >= 1.10 x allocated and 64 MiB more "in an epoch": any epoch where both hold
            def frag(rv, al):
                return al and rv >= 1.1 * al and rv - al >= 64 * MiB
            tor = [r["torch_memory_stats"] for r in s["epochs"] if r.get("torch_memory_stats")]
            tor = [(t["reserved_bytes.all.peak"], t["allocated_bytes.all.peak"]) for t in tor
                   if t.get("reserved_bytes.all.peak") is not None and t.get("allocated_bytes.all.peak")]
            tor = [x for x in tor if frag(*x)]
            if tor:  # the epoch quoted: the largest excess
                rv, al = max(tor, key=lambda x: x[0] - x[1])
                fire("torch-frag", None, rv / al, s)
            cand = [r for r in s["epochs"] if r["memory"]["allocated_peak_bytes"]] or \
                   [r for r in s["recs"] if r["memory"]["allocated_peak_bytes"]]
            cand = [r for r in cand if frag(r["memory"]["reserved_peak_bytes"], r["memory"]["allocated_peak_bytes"])]
            if cand:  # the epoch quoted: the first of the largest excess, in the order the reports were written
                gap = lambda r: r["memory"]["reserved_peak_bytes"] - r["memory"]["allocated_peak_bytes"]  # noqa: E731
                r = [x for x in cand if gap(x) == max(map(gap, cand))][0]
                fire("pool-frag", (r.get("mode"), r.get("config", {}).get("MEMSHIM_DEFRAG", {}).get("value")),
                     r["memory"]["reserved_peak_bytes"] / r["memory"]["allocated_peak_bytes"], s)
        ooms = [r["oom"]["oom_events"] for r in s["recs"] if "oom" in r]
        if ooms and max(ooms) > 0:
            fire("oom", (s["rank"], s["device"]), max(ooms), s)
    ranked = streams[0]["rank"] is not None
    # "3 or more ranks, one rank's peak >= 1.2 x the median rank's": a rank's peak is the highest of
    # its devices'
    peak = {}
    for s in streams:
        peak[s["rank"]] = max(peak.get(s["rank"], 0), s["alloc_peak"])
    if ranked and len(peak) >= 3:
        med = statistics.median(peak.values())
        top = max(peak.values())
        tops = [s for s in streams if s["alloc_peak"] == top]
        if med and top >= 1.2 * med and top - med >= 64 * MiB and not tiny(tops[0]):
            fire("imbalance", None, top / med, tops[0])
    if ranked:
        have = {s["rank"] for s in streams}
        missing = sorted(set(range(max(have) + 1)) - have)
        if missing:
            fire("unreported", tuple(missing), len(missing), streams[0])
    if not [k for k in fired if k[0] not in ("unfinished", "interrupted", "unreported")]:
        fire("none", None, 0, streams[0])
    return fired


def derive(d):
    kept, dups = dedupe(read_dir(d))
    by_stream = {}
    for r in kept:
        by_stream.setdefault(ident(r) + (r["device"],), []).append(r)
    streams = {k: stream(v) for k, v in by_stream.items()}
    procs = {}
    for k, s in streams.items():
        p = procs.setdefault(k[:3], {"host": k[0], "pid": k[1], "rank": k[2], "streams": []})
        p["streams"].append(s)
    for p in procs.values():
        p["run_id"] = next((s["run_id"] for s in p["streams"] if s["run_id"]), None)
        p["start"] = min(s["start"] for s in p["streams"])
        p["end"] = max(s["end"] for s in p["streams"])
    runs = []
    for members in group_runs(list(procs.values())):
        ss = [s for p in members for s in p["streams"]]
        top = max(s["alloc_peak"] for s in ss)
        runs.append({
            "procs": {(p["host"], p["pid"], p["rank"]) for p in members},
            "run_id": members[0]["run_id"] if members[0]["rank"] is not None else members[0]["run_id"],
            "ranked": members[0]["rank"] is not None,
            "streams": ss,
            "highest": [s for s in ss if s["alloc_peak"] == top],
            "growing": sorted((s for s in ss if is_leak(s)), key=lambda s: -(s["growth"] or 0)),
            "advice": advice(members, ss),
        })
    return {"reports_read": len(kept), "duplicates": dups, "runs": runs}
