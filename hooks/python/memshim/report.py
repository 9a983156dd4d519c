"""memshim-report: what memshim's JSON reports say, for people and for machines.

usage: memshim-report [--json | --csv] [--plot OUT.png|OUT.svg] [--plot-engine auto|matplotlib|builtin]
                      [--html OUT.html] [--tensorboard LOGDIR] [--per-process] PATH [PATH ...]

PATH is a report directory (searched, with its subdirectories, for memshim-*.json) or report
files. Reports of schema 1 and 2 are read (docs/reports.md); a field a report does not carry is
shown as n/a. Files that are not memshim reports are named on stderr and skipped.

The reports are grouped into runs. A process without a rank is a run of its own. Processes with
a rank (as their launcher set it: torchrun, DeepSpeed, mpirun, Slurm; docs/reports.md, "Who wrote
a report") are grouped by the launcher's job id their reports carry (run_id: TORCHELASTIC_RUN_ID
or SLURM_JOB_ID), then taken in order of their start time; they join one run until a rank repeats
or a process starts more than 60 s after every process of the run has ended, which starts the next
run.

For each run it prints one row per epoch (per-rank columns when the run has several processes),
the trend verdict with the growing sites, the sites at the peak, and advice, each item from one
documented rule on the figures (docs/reports.md, "Advice"): a leak (growth at every epoch, at
the sites that grow), capacity (the peak near the device or MEMSHIM_LIMIT, with the site that
holds most of it), fragmentation (memory held well above the live peak: what helps), OOMs, one
rank far above the others, runs that did not finish or were interrupted, ranks without reports.

  --json          one JSON document (shape in docs/reports.md, "memshim-report")
  --csv           one CSV row per report (bytes as integers; other numbers to 6 significant
                  digits; n/a where a field is absent)
  --plot OUT      per-epoch peak allocated and reserved, fragmentation and allocated memory at
                  epoch end, one line per rank: OUT.png or OUT.svg, drawn with matplotlib when it
                  is importable, else by this script (--plot-engine builtin: always by this script)
  --html OUT      one self-contained page: charts (inline SVG), tables, memshim's own cost, sites, advice
  --tensorboard LOGDIR  the per-epoch figures as TensorBoard scalars (memshim/...), one
                  TensorBoard run per process and device (needs the tensorboard package)
  --per-process   in runs of several processes, also print every process's epoch rows

Exit status: 0 when reports were read, 1 when none were (or an output could not be written),
2 for a usage error. Python's standard library is enough; matplotlib and tensorboard are used
when they are importable.
"""
# This module turns report files into tables, JSON, CSV, SVG, PNG, HTML and TensorBoard events.
# It must never write into the report directory, never stop on one bad file (it names it and goes
# on), never say a thing it cannot back with a figure from the reports, and never need more than
# Python's standard library: users run it on login nodes and laptops where nothing else is
# installed (matplotlib and tensorboard are used only when they import).
import argparse
import csv
import html
import io
import json
import math
import os
import statistics
import struct
import sys
import time
import zlib

MiB = 1024 * 1024
READS_SCHEMAS = (1, 2)
FORMAT_VERSION = 1          # of this tool's --json output
MAX_FILE_BYTES = 64 * MiB   # a report is a few KiB; anything this large is not one
RUN_GAP_S = 60              # a ranked process starting this long after a run ended starts a new run
LEAK_STEP_BYTES = MiB       # the library's rule: growth by more than 1 MiB at every boundary
FRAG_RATIO = 1.10           # reserved / allocated at the peak from which memory held is "high"
FRAG_MIN_BYTES = 64 * MiB   # ... and only when the excess is at least this much
SITE_SHARE = 0.5            # one site "dominates" the peak from this share of the peak's live bytes
IMBALANCE_RATIO = 1.2       # a rank's peak this far above the median rank's is named
IMBALANCE_MIN_BYTES = 64 * MiB
TINY_SHARE = 0.05           # a peak reserved below this share of the capacity gets no memory-need advice
CAPACITY_SHARE = 0.80       # from this share of the capacity at the peak, capacity is what limits the job
# Epoch reasons the library writes (docs/reports.md); any other is shown as written and named once.
# an OOM short by at most this share of the capacity gets the MEMSHIM_SPILL=host suggestion
SPILL_SHORT_SHARE = 0.1
KNOWN_REASONS = ("manual", "steps", "seconds", "signal", "exit", "oom", "dataloader", "hf_trainer", "lightning",
                 "interval", "interrupted")
MATRIX_COLUMNS = 16         # per-rank columns in one block of the text tables
LEAK_VERDICT = "possible leak: allocated memory grew at every epoch"
PROG = "memshim-report"


def note(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)


# ---- reading ------------------------------------------------------------------------------------

class Malformed(Exception):
    pass


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def nonneg_int(v):
    return is_int(v) and v >= 0


def nonneg_num(v):
    return is_num(v) and v >= 0


def _reject_constant(name):
    raise Malformed(f"{name} is not a number JSON allows")


def required(obj, key, check, what, where=""):
    v = obj.get(key) if isinstance(obj, dict) else None
    if not check(v):
        raise Malformed(f"{where}{key} is {'missing' if v is None else 'not ' + what}")
    return v


class Fields:
    """Optional fields of one report: a field that is absent or null is None (shown n/a); one
    that is present but malformed is None too, with a warning naming it."""

    def __init__(self, obj, path, warnings):
        self.obj, self.path, self.warnings = obj, path, warnings

    def get(self, dotted, check, what):
        cur = self.obj
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
        if cur is None:
            return None
        if not check(cur):
            self.warnings.append((self.path, f"field {dotted} ignored: not {what}"))
            return None
        return cur


def parse_site_list(v, name, f, growth):
    if v is None:
        return None
    if not isinstance(v, list):
        f.warnings.append((f.path, f"field {name} ignored: not a list"))
        return None
    out = []
    for i, s in enumerate(v):
        ok = (isinstance(s, dict) and isinstance(s.get("file"), str) and nonneg_int(s.get("line"))
              and isinstance(s.get("function"), str))
        if ok and growth:
            ok = is_num(s.get("growth_bytes_per_epoch"))
        elif ok:
            ok = nonneg_int(s.get("bytes")) and (s.get("count") is None or nonneg_int(s.get("count")))
        if not ok:
            f.warnings.append((f.path, f"{name}[{i}] ignored: not a site of the documented shape"))
            continue
        site = {"file": s["file"], "line": s["line"], "function": s["function"]}
        if growth:
            site["growth_bytes_per_epoch"] = s["growth_bytes_per_epoch"]
        else:
            site["bytes"], site["count"] = s["bytes"], s.get("count")
        out.append(site)
    return out


def torch_stat(stats, dotted):
    """A figure of PyTorch's memory_stats(): flat keys ("allocated_bytes.all.peak", as
    memory_stats() returns them) or nested ones (memory_stats_as_nested_dict())."""
    v = stats.get(dotted)
    if v is None:
        cur = stats
        for part in dotted.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        v = cur
    return v if nonneg_num(v) else None


def _count_seconds(v):
    return isinstance(v, dict) and nonneg_int(v.get("count")) and nonneg_num(v.get("seconds"))


def parse_overhead(f):
    """memshim_overhead (issue 24; reports written before it lack it: None): what memshim cost the
    process in driver calls and synchronizes, and its own time on the allocation and free paths."""
    o = f.get("memshim_overhead", lambda v: isinstance(v, dict), "an object")
    if o is None:
        return None
    calls = f.get("memshim_overhead.driver_calls",
                  lambda v: isinstance(v, dict) and all(_count_seconds(x) for x in v.values()),
                  "an object of {count, seconds}") or {}
    sync = f.get("memshim_overhead.synchronizes",
                 lambda v: isinstance(v, dict) and all(_count_seconds(x) for x in v.values()),
                 "an object of {count, seconds}") or {}
    return {
        "covers": f.get("memshim_overhead.covers", lambda v: v in ("epoch", "run"), "epoch or run"),
        "driver_calls": {k: {"count": v["count"], "seconds": v["seconds"]} for k, v in calls.items()},
        "driver_seconds": f.get("memshim_overhead.driver_seconds", nonneg_num, "a number"),
        "synchronizes": {k: {"count": v["count"], "seconds": v["seconds"]} for k, v in sync.items()},
        "alloc_path_ns": {q: f.get(f"memshim_overhead.alloc_path_ns.{q}", nonneg_num, "a number") for q in ("p50", "p99")},
        "free_path_ns": {q: f.get(f"memshim_overhead.free_path_ns.{q}", nonneg_num, "a number") for q in ("p50", "p99")},
        "path_seconds": f.get("memshim_overhead.path_seconds", nonneg_num, "a number"),
        "share_of_wall": f.get("memshim_overhead.share_of_wall", nonneg_num, "a number"),
    }


def overhead_text(o):
    """One line: the three largest driver costs, the synchronizes, memshim's path time and share."""
    if not o:
        return "n/a (reports written before memshim measured itself)"
    top = sorted(o["driver_calls"].items(), key=lambda kv: -kv[1]["seconds"])[:3]
    calls = ", ".join(f"{k} {v['count']} x {v['seconds'] * 1e3:.3f} ms" for k, v in top) or "none"
    ns = sum(v["count"] for v in o["synchronizes"].values())
    ss = sum(v["seconds"] for v in o["synchronizes"].values())
    a, fr = o["alloc_path_ns"], o["free_path_ns"]
    share = "n/a" if o["share_of_wall"] is None else f"{o['share_of_wall'] * 100:.3f}%"
    return (f"driver {calls}; synchronizes {ns} ({ss * 1e3:.3f} ms blocked); alloc path p50/p99 "
            f"{usec(a['p50'])}/{usec(a['p99'])} us, free {usec(fr['p50'])}/{usec(fr['p99'])} us; "
            f"memshim's path time {share} of the wall time")


def parse(path, obj, warnings):
    """Check one decoded file and return the record the rest of the tool works from."""
    if not isinstance(obj, dict):
        raise Malformed("not a JSON object")
    sv = obj.get("schema_version")
    if not is_int(sv):
        raise Malformed("no integer schema_version: not a memshim report")
    if sv not in READS_SCHEMAS:
        raise Malformed(f"schema_version {sv}: this tool reads {' and '.join(map(str, READS_SCHEMAS))}")
    kind = required(obj, "kind", lambda v: v in ("epoch", "summary", "oom"), "epoch, summary or oom")
    rec = {
        "path": path, "schema": sv, "kind": kind,
        "host": required(obj, "host", lambda v: isinstance(v, str), "a string"),
        "pid": required(obj, "pid", nonneg_int, "a non-negative integer"),
        "device": required(obj, "device", nonneg_int, "a non-negative integer"),
        "epoch": required(obj, "epoch", nonneg_int, "a non-negative integer"),
    }
    # OOM reports name their failure in oom_index (schema 2); older files used epoch for it
    oi = obj.get("oom_index")
    rec["oom_index"] = oi if kind == "oom" and nonneg_int(oi) else None
    rank = obj.get("rank", -1)
    if not is_int(rank):
        raise Malformed("rank is not an integer")
    rec["rank"] = rank if rank >= 0 else None
    rid = obj.get("run_id")  # the launcher's job id (newer reports); None when absent or null
    rec["run_id"] = rid if isinstance(rid, str) and rid else None
    mem = required(obj, "memory", lambda v: isinstance(v, dict), "an object")
    for key, name in (("allocated_bytes", "alloc_end"), ("allocated_peak_bytes", "alloc_peak"),
                      ("reserved_bytes", "resv_end"), ("reserved_peak_bytes", "resv_peak")):
        rec[name] = required(mem, key, nonneg_int, "a non-negative integer", "memory.")
    f = Fields(obj, path, warnings)
    s = lambda v: isinstance(v, str)  # noqa: E731
    rec.update({
        "reason": f.get("reason", s, "a string"),
        "interrupted_by": f.get("interrupted_by", s, "a string"),
        "mode": f.get("mode", s, "a string"),
        "steps": f.get("steps", nonneg_int, "an integer"),
        "wall": f.get("wall_time_unix", nonneg_num, "a number"),
        "start_unix": f.get("start_unix", nonneg_num, "a number"),  # since issue 32; None in older reports
        "t_start": f.get("t_start_s", nonneg_num, "a number"),
        "t_end": f.get("t_end_s", nonneg_num, "a number"),
        "alloc_run_peak": f.get("memory.allocated_run_peak_bytes", nonneg_int, "an integer"),
        "resv_run_peak": f.get("memory.reserved_run_peak_bytes", nonneg_int, "an integer"),
        "touched_peak": f.get("memory.touched_peak_bytes", nonneg_int, "an integer"),
        "device_total": f.get("memory.device_total_bytes", nonneg_int, "an integer"),
        "frag": f.get("fragmentation.free_extent_fragmentation", nonneg_num, "a number"),
        # issue 26 (None in older reports): GMLake's, STAlloc's and the users' fragmentation figures
        "peak_ratio": f.get("fragmentation.peak_allocated_over_peak_reserved", nonneg_num, "a number"),
        "gap_at_peak": f.get("fragmentation.reserved_minus_allocated_at_peak_bytes", is_int, "an integer"),
        "maps": f.get("operations.map_ops", nonneg_int, "an integer"),
        "unmaps": f.get("operations.unmap_ops", nonneg_int, "an integer"),
        "reclaimed": f.get("operations.reclaimed_pages", nonneg_int, "an integer"),
        "ooms": f.get("oom.oom_events", nonneg_int, "an integer"),
        "rescued": {k: f.get(f"oom.rescued_by_{k}", nonneg_int, "an integer")
                    for k in ("reclaim", "gc", "empty_cache")},
        "trend_series": None, "trend_verdict": f.get("trend.verdict", s, "a string"),
        "driver_seconds": f.get("driver.modelled_seconds", nonneg_num, "a number"),
        # MEMSHIM_SPILL=host (reports since issue 20; None in older ones)
        "spill_peak": f.get("spill.spilled_peak_bytes", nonneg_int, "an integer"),
        "spill_to_host": f.get("spill.bytes_to_host", nonneg_int, "an integer"),
        "spill_to_dev": f.get("spill.bytes_to_device", nonneg_int, "an integer"),
        "spill_seconds": f.get("spill.seconds_moving", nonneg_num, "a number"),
        "sites_note": f.get("sites_note", s, "a string"),
    })
    series = f.get("trend.epoch_end_allocated_bytes",
                   lambda v: isinstance(v, list) and all(nonneg_int(x) for x in v), "a list of integers")
    rec["trend_series"] = series
    sr = f.get("fragmentation.step_allocated_over_reserved", lambda v: v is None or (
        isinstance(v, dict) and all(nonneg_num(v.get(k)) for k in ("min", "median", "max"))), "null or {min, median, max}")
    rec["step_ratio"] = {k: sr[k] for k in ("min", "median", "max", "steps") if k in sr} if sr else None
    rec["sites"] = parse_site_list(obj.get("sites"), "sites", f, growth=False)
    trend = obj.get("trend")
    rec["growing_sites"] = parse_site_list(trend.get("growing_sites") if isinstance(trend, dict) else None,
                                           "trend.growing_sites", f, growth=True)
    lat = f.get("latency", lambda v: isinstance(v, dict), "an object")
    rec["latency"] = None
    if lat is not None:
        rec["latency"] = {op: {q: f.get(f"latency.{op}.{q}", nonneg_num, "a number")
                               for q in ("p50", "p90", "p99", "max")} for op in ("alloc_ns", "free_ns")}
    rec["overhead"] = parse_overhead(f)
    ver = f.get("versions", lambda v: isinstance(v, dict), "an object")
    rec["versions"] = None
    if ver is not None:
        rec["versions"] = {k: (None if ver.get(k) is None else str(ver.get(k)))
                           for k in ("memshim", "torch", "cuda_driver", "cuda_runtime", "device_name")}
    rec["memshim_version"] = f.get("memshim_version", s, "a string")
    tms = f.get("torch_memory_stats", lambda v: isinstance(v, dict), "an object")
    rec["torch"] = None
    if tms is not None:
        rec["torch"] = {"allocated_peak_bytes": torch_stat(tms, "allocated_bytes.all.peak"),
                        "reserved_peak_bytes": torch_stat(tms, "reserved_bytes.all.peak"),
                        "num_alloc_retries": torch_stat(tms, "num_alloc_retries"),
                        "num_ooms": torch_stat(tms, "num_ooms")}
    oom = f.get("last_oom", lambda v: isinstance(v, dict), "an object")
    rec["last_oom"] = None
    if oom is not None:
        rec["last_oom"] = {k: f.get(f"last_oom.{k}", nonneg_int, "an integer")
                           for k in ("requested_bytes", "live_bytes", "reserved_bytes", "device_total_bytes",
                                     "device_free_bytes", "limit_bytes", "largest_free_extent_bytes")}
        rec["last_oom"]["cause"] = f.get("last_oom.cause", s, "a string")
        # issue 25: which case it was (reports from before it lack both keys)
        rec["last_oom"]["case"] = f.get("last_oom.case", s, "a string") if "case" in oom else None
        rec["last_oom"]["cached_bytes"] = (f.get("last_oom.cached_bytes", nonneg_int, "an integer")
                                           if "cached_bytes" in oom else None)
    cfg = obj.get("config")
    rec["config"] = {}
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            if isinstance(v, dict) and isinstance(v.get("value"), str):
                rec["config"][k] = v["value"]
    return rec


def find_files(paths):
    files, skipped, seen = [], [], set()
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names)
                          if n.startswith("memshim-") and n.endswith(".json")]
            if not found:
                skipped.append((p, "no memshim-*.json files in this directory"))
        elif os.path.exists(p):
            found = [p]
        else:
            skipped.append((p, "no such file or directory"))
            found = []
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:
                seen.add(real)
                files.append(f)
    return files, skipped


def load(paths):
    """Every readable report under `paths`; the rest named with the reason."""
    files, skipped = find_files(paths)
    recs, warnings, keys = [], [], {}
    for path in files:
        try:
            if not os.path.isfile(path):
                raise Malformed("not a regular file")
            if os.path.getsize(path) > MAX_FILE_BYTES:
                raise Malformed(f"larger than {MAX_FILE_BYTES // MiB} MiB: not a memshim report")
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8")
            rec = parse(path, json.loads(text, parse_constant=_reject_constant), warnings)
        except (OSError, UnicodeDecodeError, ValueError, Malformed, RecursionError) as e:
            why = str(e) if isinstance(e, Malformed) else f"{type(e).__name__}: {e}"
            skipped.append((path, why))
            continue
        key = (rec["host"], rec["pid"], rec["rank"], rec["device"], rec["kind"], rec["epoch"], rec["oom_index"])
        if key in keys:
            skipped.append((path, f"duplicate of {keys[key]} (same host, pid, rank, device, kind and epoch)"))
            continue
        keys[key] = path
        recs.append(rec)
    return recs, skipped, warnings


# ---- streams, processes, runs -------------------------------------------------------------------

KIND_ORDER = {"oom": 0, "epoch": 1, "summary": 2}


def row_order(r):
    # A summary closes the process. An OOM report's `epoch` counts OOM reports, not epochs, so
    # time (t_end_s: when the report was made) puts it among the epochs where it happened.
    return (r["kind"] == "summary", r["t_end"] if r["t_end"] is not None else -1.0, r["epoch"], KIND_ORDER[r["kind"]])


def computed_verdict(series):
    if len(series) < 3:
        return "too few epochs"
    if all(b > a + LEAK_STEP_BYTES for a, b in zip(series, series[1:])):
        return LEAK_VERDICT
    return "flat"


def is_leak(verdict):
    return bool(verdict) and verdict.startswith("possible leak")


def build_stream(recs):
    """One process's reports for one device."""
    if any(r["t_end"] is None for r in recs):  # no common clock: by number
        recs = sorted(recs, key=lambda r: (r["kind"] == "summary", r["epoch"], KIND_ORDER[r["kind"]]))
    else:
        recs = sorted(recs, key=row_order)
    first = recs[0]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    summaries = [r for r in recs if r["kind"] == "summary"]
    # the report with the latest trend: the summary, else the last epoch report (an OOM report
    # carries the trend of the last closed epoch too, but was written mid-epoch)
    newest = summaries[-1] if summaries else epochs[-1] if epochs else recs[-1]
    # the highest of the per-epoch peaks and the run peaks (epoch files may be missing)
    alloc_peak = max(v for r in recs for v in (r["alloc_peak"], r["alloc_run_peak"]) if v is not None)
    resv_peak = max(v for r in recs for v in (r["resv_peak"], r["resv_run_peak"]) if v is not None)
    # The reports' trend keeps the last 64 epoch ends (MSH_TREND_MAX): a longer run whose every
    # epoch report is here gets its first epoch and its growth from those reports instead.
    whole = [r["alloc_end"] for r in epochs]
    every = [r["epoch"] for r in epochs] == list(range(len(epochs))) and None not in whole
    if newest["trend_series"] is not None and not (every and len(whole) > len(newest["trend_series"])):
        series, source = newest["trend_series"], "trend.epoch_end_allocated_bytes of the newest report"
    else:
        series, source = whole, "allocated_bytes of the epoch reports"
    verdict = newest["trend_verdict"] or computed_verdict(series)
    growth = (series[-1] - series[0]) / (len(series) - 1) if len(series) >= 2 else None
    with_sites = [r for r in recs if r["sites"] is not None and r["kind"] != "summary"] or \
                 [r for r in recs if r["sites"] is not None]
    at_peak = max(with_sites, key=lambda r: r["alloc_peak"]) if with_sites else None
    if at_peak is not None:
        sites = {"epoch": at_peak["epoch"], "kind": at_peak["kind"], "allocated_peak_bytes": at_peak["alloc_peak"],
                 "sites": at_peak["sites"], "note": at_peak["sites_note"]}
    else:
        notes = [r["sites_note"] for r in recs if r["sites_note"]]
        why = notes[-1] if notes else ("reports of schema 1 name no sites" if all(r["schema"] == 1 for r in recs)
                                       else "these reports name no sites")
        sites = {"epoch": None, "kind": None, "allocated_peak_bytes": None, "sites": None, "note": why}
    totals = [r["device_total"] for r in recs if r["device_total"]]
    device_total = max(totals) if totals else None
    limits = [r["last_oom"]["limit_bytes"] for r in recs if r["last_oom"] and r["last_oom"]["limit_bytes"]]
    limit = limits[-1] if limits else limit_bytes(newest["config"].get("MEMSHIM_LIMIT"), device_total)
    # When the process started and last wrote: start_unix (to the microsecond) where the reports carry
    # it, else wall_time_unix (whole seconds) less t_end_s
    times = [r["start_unix"] + r["t_end"] if r["start_unix"] is not None and r["t_end"] is not None else r["wall"]
             for r in recs if r["wall"] is not None or r["start_unix"] is not None]
    times = [t for t in times if t is not None]
    starts = [r["start_unix"] if r["start_unix"] is not None else r["wall"] - r["t_end"]
              for r in recs if r["start_unix"] is not None or (r["wall"] is not None and r["t_end"] is not None)]
    p99s = [r["latency"]["alloc_ns"]["p99"] for r in recs
            if r["kind"] == "epoch" and r["latency"] and r["latency"]["alloc_ns"]["p99"] is not None]
    return {
        "host": first["host"], "pid": first["pid"], "rank": first["rank"], "device": first["device"],
        "run_id": first["run_id"], "recs": recs, "epochs": epochs, "newest": newest,
        "schemas": sorted({r["schema"] for r in recs}), "modes": sorted({r["mode"] for r in recs if r["mode"]}),
        "alloc_peak": alloc_peak, "resv_peak": resv_peak,
        "frag_max": max([r["frag"] for r in epochs if r["frag"] is not None], default=None),
        "alloc_p99_max": max(p99s, default=None),
        "trend": {"verdict": verdict, "series": series, "source": source, "growth": growth,
                  "growing_sites": newest["growing_sites"]},
        "sites": sites,
        "versions": newest["versions"], "memshim_version": newest["memshim_version"],
        "start": min(starts) if starts else (min(times) if times else None),
        "end": max(times) if times else None,
        "device_total": device_total, "limit": limit,
        "capacity": limit if limit else device_total, "capacity_name": "MEMSHIM_LIMIT" if limit else "device",
        "has_summary": bool(summaries),
        "interrupted": [r for r in recs if r["kind"] == "epoch" and r["reason"] == "interrupted"],
        "reasons": sorted({r["reason"] for r in recs if r["reason"]}),
    }


def limit_bytes(value, device_total):
    """MEMSHIM_LIMIT as the reports' config gives it (memshim-options' spelling: 40GiB, 0.9, 0) in
    bytes; None for no limit or a value this tool cannot read."""
    if not isinstance(value, str):
        return None
    v = value.strip()
    try:
        f = float(v)
        if 0 < f <= 1:
            return int(f * device_total) if device_total else None
        return int(f) if f > 1 else None
    except ValueError:
        pass
    units = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": MiB, "MB": MiB, "MIB": MiB, "G": 1024 * MiB,
             "GB": 1024 * MiB, "GIB": 1024 * MiB, "T": 1024 ** 4, "TB": 1024 ** 4, "TIB": 1024 ** 4}
    num = v.rstrip("KMGTIBkmgtib ")
    unit = v[len(num):].strip().upper()
    try:
        n = float(num)
    except ValueError:
        return None
    return int(n * units[unit]) if unit in units and n > 0 else None


def build_runs(recs):
    by_stream = {}
    for r in recs:
        by_stream.setdefault((r["host"], r["pid"], r["rank"], r["device"]), []).append(r)
    procs = {}
    for recs_ in by_stream.values():
        st = build_stream(recs_)
        procs.setdefault((st["host"], st["pid"], st["rank"]), []).append(st)
    processes = []
    for (host, pid, rank), streams in procs.items():
        streams.sort(key=lambda s: s["device"])
        starts = [s["start"] for s in streams if s["start"] is not None]
        ends = [s["end"] for s in streams if s["end"] is not None]
        processes.append({"host": host, "pid": pid, "rank": rank, "streams": streams,
                          "run_id": next((s["run_id"] for s in streams if s["run_id"]), None),
                          "start": min(starts) if starts else None, "end": max(ends) if ends else None})
    # Ranked processes with the launcher's job id (run_id) are grouped by it first: two jobs
    # started at once into one directory stay apart. Within a job id, and for processes without
    # one, ranked processes in start order (pid breaks ties: reports time-stamp whole seconds)
    # form a run up to the first repeated rank (a restart) or a late start.
    order = lambda p: (p["start"] if p["start"] is not None else float("inf"), p["host"], p["pid"])  # noqa: E731
    groups = []
    by_job = {}
    for p in processes:
        if p["rank"] is not None:
            by_job.setdefault(p["run_id"], []).append(p)
    for job in by_job.values():
        cur = None
        for p in sorted(job, key=order):
            if cur is not None:
                ranks = {q["rank"] for q in cur}
                ends = [q["end"] for q in cur if q["end"] is not None]
                late = p["start"] is not None and ends and p["start"] > max(ends) + RUN_GAP_S
                if p["rank"] in ranks or late:
                    groups.append(cur)
                    cur = None
            cur = (cur or []) + [p]
        if cur:
            groups.append(cur)
    groups += [[p] for p in processes if p["rank"] is None]
    runs = [make_run(g) for g in groups]
    runs.sort(key=lambda r: (r["start"] if r["start"] is not None else float("inf"), r["hosts"], r["pids"]))
    for i, r in enumerate(runs, 1):
        r["index"] = i
    return runs


def ranges(nums):
    """[0,1,2,3,5] -> '0-3,5'"""
    nums = sorted(set(nums))
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def make_run(procs):
    procs = sorted(procs, key=lambda p: (p["rank"] if p["rank"] is not None else -1, p["host"], p["pid"]))
    streams = [s for p in procs for s in p["streams"]]
    ranked = procs[0]["rank"] is not None
    multi_dev = {(p["host"], p["pid"]) for p in procs if len(p["streams"]) > 1}
    for s in streams:
        if ranked:
            s["label"] = f"r{s['rank']}" + (f".d{s['device']}" if (s["host"], s["pid"]) in multi_dev else "")
        else:
            s["label"] = f"dev{s['device']}"
    hosts = sorted({p["host"] for p in procs})
    pids = sorted({p["pid"] for p in procs})
    starts = [p["start"] for p in procs if p["start"] is not None]
    ends = [p["end"] for p in procs if p["end"] is not None]
    if ranked:
        rk = [p["rank"] for p in procs]
        names = ", ".join(hosts[:4]) + (", ..." if len(hosts) > 4 else "")
        what = (f"ranks {ranges(rk)}: {len(procs)} process{'es' if len(procs) > 1 else ''} on "
                f"{len(hosts)} host{'s' if len(hosts) > 1 else ''} ({names})")
        rid = procs[0]["run_id"]
        why = ((f"the launcher's job id {rid}, then " if rid else "") +
               "ranked processes in start order, up to the first repeated rank or a start more than "
               f"{RUN_GAP_S} s after the run ended")
    else:
        what = f"one process without a rank (host {hosts[0]}, pid {pids[0]})"
        why = "a process without a rank is a run of its own"
    return {"procs": procs, "streams": streams, "ranked": ranked, "hosts": hosts, "pids": pids,
            "start": min(starts) if starts else None, "end": max(ends) if ends else None,
            "what": what, "why": why,
            "schemas": sorted({v for s in streams for v in s["schemas"]}),
            "modes": sorted({m for s in streams for m in s["modes"]})}


# ---- figures and advice -------------------------------------------------------------------------

def mib(b):
    return "n/a" if b is None else f"{b / MiB:.1f}"


def fnum(v, d=3):
    return "n/a" if v is None else f"{v:.{d}f}"


def usec(ns):
    return "n/a" if ns is None else f"{ns / 1000:.1f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def site_name(s):
    return f"{s['file']}:{s['line']} ({s['function']})"


def who(s, run):
    """How advice names a stream: by rank in a job, by device otherwise."""
    if s["rank"] is not None:
        return f"rank {s['rank']}" + (f" device {s['device']}" if "." in s["label"] else "")
    return f"device {s['device']}" if len(run["streams"]) > 1 else ""


def row_json(r):
    run_scope = r["kind"] == "summary"
    ap = r["alloc_run_peak"] if run_scope and r["alloc_run_peak"] is not None else r["alloc_peak"]
    rp = r["resv_run_peak"] if run_scope and r["resv_run_peak"] is not None else r["resv_peak"]
    return {
        "file": r["path"], "schema_version": r["schema"], "host": r["host"], "pid": r["pid"], "rank": r["rank"],
        "device": r["device"], "kind": r["kind"], "epoch": r["epoch"], "oom_index": r["oom_index"],
        "reason": r["reason"], "mode": r["mode"],
        "steps": r["steps"], "peak_scope": "run" if ap is r["alloc_run_peak"] and run_scope else "epoch",
        "allocated_end_bytes": r["alloc_end"], "allocated_peak_bytes": ap,
        "reserved_end_bytes": r["resv_end"], "reserved_peak_bytes": rp,
        "reserved_over_allocated": ratio(rp, ap), "touched_peak_bytes": r["touched_peak"],
        "fragmentation": r["frag"], "peak_allocated_over_peak_reserved": r["peak_ratio"],
        "step_allocated_over_reserved": r["step_ratio"], "reserved_minus_allocated_at_peak_bytes": r["gap_at_peak"],
        "map_ops": r["maps"], "unmap_ops": r["unmaps"],
        "reclaimed_pages": r["reclaimed"], "oom_events": r["ooms"],
        "latency": r["latency"], "torch_memory_stats": r["torch"], "driver_modelled_seconds": r["driver_seconds"],
        "sites": r["sites"], "last_oom": r["last_oom"], "memshim_overhead": r["overhead"],
    }


def pct(v):
    """A share for people: 83%, not 83.33333%; 0.37% or 0.0024% of a device, not 0%."""
    return f"{100 * v:.0f}%" if 100 * v >= 10 else f"{100 * v:.2g}%"


def share_of(s, b):
    return ratio(b, s["capacity"])


def tiny(s):
    """The stream's peak is a tiny share of its capacity: no advice about memory need."""
    sh = share_of(s, s["resv_peak"])
    return sh is not None and sh < TINY_SHARE


def advise(run):
    """Advice items, each from one documented rule on the figures (docs/reports.md, "advice"),
    each quoting the figures it rests on. Items of the same kind and subject on several ranks are
    merged into one that names the ranks and quotes the worst."""
    items = []   # (group key, severity, stream, figures, render(on) -> text)
    for s in run["streams"]:
        tr = s["trend"]
        leaking = {(x["file"], x["line"], x["function"]) for x in (tr["growing_sites"] or [])} \
            if is_leak(tr["verdict"]) else set()

        # unfinished: no summary, or an epoch closed as interrupted
        last_epoch = max([r["epoch"] for r in s["epochs"]], default=None)
        if s["interrupted"]:
            r = s["interrupted"][-1]
            fig = {"epoch": r["epoch"], "epochs": len(s["epochs"]), "summary": s["has_summary"]}

            def render(on, r=r, n=len(s["epochs"])):
                by = r.get("interrupted_by") or "SIGINT or SIGTERM"
                return (f"interrupted run{on}: epoch {r['epoch']} was closed early because the job was stopped "
                        f"({by}: Ctrl-C, torchrun, Slurm, Kubernetes); the {n} epoch report"
                        f"{'s' if n != 1 else ''} cover the run up to then, the last one a partial epoch")
            items.append((("interrupted",), r["epoch"], s, fig, render))
        if not s["has_summary"]:
            fig = {"reports": len(s["recs"]), "last_epoch": last_epoch}

            def render(on, n=len(s["recs"]), e=last_epoch):
                return (f"unfinished run{on}: no summary report, so the process never reached memshim's exit (it is "
                        "still running, or was killed with SIGKILL or by the OOM killer, crashed, or called os._exit); "
                        f"the figures stop at its last report ({n} report{'s' if n != 1 else ''}"
                        + (f", last epoch {e}" if e is not None else ", no epoch closed") + ")")
            items.append((("unfinished",), 0, s, fig, render))

        # leak: the library's verdict (growth by more than 1 MiB at every epoch boundary)
        if is_leak(tr["verdict"]) and tr["growth"] is not None:
            n, first, last, g = len(tr["series"]), tr["series"][0], tr["series"][-1], tr["growth"]
            gs = tr["growing_sites"]
            fig = {"epochs": n, "first_bytes": first, "last_bytes": last, "growth_bytes_per_epoch": g,
                   "growing_sites": gs}
            if gs:
                where = " at these sites: " + "; ".join(
                    f"{site_name(x)} {x['growth_bytes_per_epoch'] / MiB:+.1f} MiB/epoch" for x in gs[:5])
            elif gs == []:
                where = "; no site's live bytes grew epoch over epoch"
            else:
                where = "; the sites are n/a (these reports name no growing sites)"

            def render(on, n=n, first=first, last=last, g=g, where=where):
                return (f"steady growth{on}: allocated memory at epoch end rose at every boundary of {n} epochs, "
                        f"{mib(first)} -> {mib(last)} MiB ({g / MiB:+.1f} MiB/epoch): a leak{where}; tensors kept "
                        "alive across steps (losses appended with their graph, caches, lists of outputs) are the usual "
                        "cause")
            items.append((("leak", s["label"]), g, s, fig, render))

        # capacity: the peak near the device (or MEMSHIM_LIMIT); the dominant site, when one is
        cap = s["capacity"]
        if cap and s["resv_peak"]:
            # the highest peak reserved: an epoch's, or the run's peak a summary or OOM report carries
            # when no epoch report has it (one was lost, or the peak came in the epoch the exit closed)
            at = [r for r in s["epochs"] if r["resv_peak"] == s["resv_peak"]]
            r = at[0] if at else {"epoch": None, "resv_peak": s["resv_peak"], "alloc_peak": None}
            sh = r["resv_peak"] / cap
            if sh >= CAPACITY_SHARE:
                fig = {"epoch": r["epoch"], "reserved_peak_bytes": r["resv_peak"], "allocated_peak_bytes": r["alloc_peak"],
                       "capacity_bytes": cap, "capacity": s["capacity_name"], "share": sh}
                si = s["sites"]
                top = max(si["sites"], key=lambda x: x["bytes"]) if si["sites"] else None
                tshare = ratio(top["bytes"], si["allocated_peak_bytes"]) if top else None
                if top and tshare is not None and tshare >= SITE_SHARE:
                    fig.update(site={k: top[k] for k in ("file", "line", "function")}, site_bytes=top["bytes"],
                               site_share=tshare, site_epoch=si["epoch"], site_peak_bytes=si["allocated_peak_bytes"])
                    if (top["file"], top["line"], top["function"]) in leaking:
                        fix = (f"; its largest site, {site_name(top)} ({pct(tshare)} of the live peak), is the one that "
                               "grows: fix the leak first")
                    else:
                        fix = (f"; one site holds most of it: {site_name(top)}, {mib(top['bytes'])} MiB of the "
                               f"{mib(si['allocated_peak_bytes'])} MiB live at epoch {si['epoch']} ({pct(tshare)}): "
                               "activation checkpointing (torch.utils.checkpoint) around it or a smaller batch lowers "
                               "the peak")
                else:
                    fix = ("; a smaller batch or activation checkpointing (torch.utils.checkpoint) lowers the peak" +
                           ("" if top else " (the reports name no sites to say where)"))

                def render(on, r=r, cap=cap, sh=sh, fix=fix, what=s["capacity_name"]):
                    when = f"at epoch {r['epoch']}" if r["epoch"] is not None else "in the run (no epoch report has it)"
                    return (f"near capacity{on}: peak reserved {mib(r['resv_peak'])} MiB {when} is "
                            f"{pct(sh)} of the {mib(cap)} MiB {'limit (MEMSHIM_LIMIT)' if what == 'MEMSHIM_LIMIT' else 'device'}"
                            f"{fix}")
                items.append((("capacity",), sh, s, fig, render))

        # spill: cold pages lived on host memory (MEMSHIM_SPILL=host): what it cost, what would stop it
        sp = [r for r in s["recs"] if r.get("spill_peak")]
        if sp:
            r = max(sp, key=lambda x: x["spill_peak"])
            last = s["recs"][-1]
            fig = {"epoch": r["epoch"], "spilled_peak_bytes": r["spill_peak"],
                   "bytes_to_host": last.get("spill_to_host"), "bytes_to_device": last.get("spill_to_dev"),
                   "seconds_moving": last.get("spill_seconds"), "capacity_bytes": cap, "capacity": s["capacity_name"]}

            def render(on, r=r, last=last, cap=cap, what=s["capacity_name"]):
                moved = ""
                if last.get("spill_to_host") is not None:
                    moved = (f"; {mib(last['spill_to_host'])} MiB moved to the host and {mib(last['spill_to_dev'] or 0)} "
                             f"MiB back, {fnum(last['spill_seconds'] or 0, 2)} s spent moving")
                where = ('the limit (MEMSHIM_LIMIT): raise it if the device has room, or' if what == 'MEMSHIM_LIMIT'
                         else 'the device:')
                return (f"spilled to host memory{on}: up to {mib(r['spill_peak'])} MiB of cold pages lived on the host "
                        f"at epoch {r['epoch']} (MEMSHIM_SPILL=host; kernels reach them over the host link, slower)"
                        f"{moved}; the job needs about {mib(r['spill_peak'])} MiB more than {where} a smaller batch or "
                        "activation checkpointing (torch.utils.checkpoint) would stop the spilling")
            items.append((("spill", s["label"]), r["spill_peak"], s, fig, render))

        small = tiny(s)
        # fragmentation inside PyTorch's segments (segment mode, schema 2)
        def frag(rv, al):  # reserved at least 1.10 x allocated and 64 MiB more
            return rv >= FRAG_RATIO * al and rv - al >= FRAG_MIN_BYTES

        # in any epoch where both hold (the largest gap of all may be a small share of a large peak)
        tor = [(r, r["torch"]) for r in s["epochs"] if r["torch"] and r["torch"]["reserved_peak_bytes"] is not None
               and r["torch"]["allocated_peak_bytes"]
               and frag(r["torch"]["reserved_peak_bytes"], r["torch"]["allocated_peak_bytes"])]
        if tor and not small:
            r, t = max(tor, key=lambda x: x[1]["reserved_peak_bytes"] - x[1]["allocated_peak_bytes"])
            rv, al = t["reserved_peak_bytes"], t["allocated_peak_bytes"]
            fig = {"epoch": r["epoch"], "torch_reserved_peak_bytes": rv, "torch_allocated_peak_bytes": al,
                   "ratio": rv / al}

            def render(on, r=r, rv=rv, al=al):
                return (f"fragmentation{on}: PyTorch's caching allocator reserved {mib(rv)} MiB for a live peak "
                        f"of {mib(al)} MiB ({rv / al:.2f}x) at epoch {r['epoch']}: tensor mode (memshim places "
                        "every tensor; README, \"Tensor mode\") or "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets that memory be used")
            items.append((("torch-frag",), rv / al, s, fig, render))

        # fragmentation in memshim's own pool: reserved well above allocated at an epoch's peak
        cand = [r for r in s["epochs"] if r["alloc_peak"]] or [r for r in s["recs"] if r["alloc_peak"]]
        cand = [r for r in cand if frag(r["resv_peak"], r["alloc_peak"])]
        if cand and not small:
            r = max(cand, key=lambda x: x["resv_peak"] - x["alloc_peak"])
            rv, al, tp = r["resv_peak"], r["alloc_peak"], r["touched_peak"]
            defrag = r["config"].get("MEMSHIM_DEFRAG")
            fig = {"epoch": r["epoch"], "reserved_peak_bytes": rv, "allocated_peak_bytes": al, "ratio": rv / al,
                   "touched_peak_bytes": tp, "fragmentation": r["frag"], "mode": r["mode"],
                   "MEMSHIM_DEFRAG": defrag}
            parts = ""
            if tp is not None and al <= tp <= rv:
                fig["shared_page_bytes"], fig["cached_page_bytes"] = tp - al, rv - tp
                parts = (f" ({mib(tp - al)} MiB in pages shared with live blocks, {mib(rv - tp)} MiB in cached "
                         "pages)")
            if defrag == "0":
                fix = "; MEMSHIM_DEFRAG=1 (now 0) lets the pool reclaim and remap cached pages under pressure"
            else:
                fix = ("; the pool reclaims cached pages itself when memory runs short (MEMSHIM_DEFRAG=" +
                       (defrag or "n/a") + "), and MEMSHIM_EMPTY_CACHE=epoch gives them back to the driver at "
                       "each epoch for other processes")
            if r["mode"] == "segment":
                fix += ("; in segment mode PyTorch's caching allocator chooses the segments: tensor mode or "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

            def render(on, r=r, rv=rv, al=al, parts=parts, fix=fix):
                return (f"fragmentation{on}: memshim held {mib(rv)} MiB at the peak of epoch "
                        f"{r['epoch']} for {mib(al)} MiB live ({rv / al:.2f}x){parts}{fix}")
            items.append((("pool-frag", r["mode"], defrag), rv / al, s, fig, render))

        # OOMs: failed requests after the whole rescue chain
        n_oom = max([r["ooms"] for r in s["recs"] if r["ooms"] is not None], default=0)
        lo = [r for r in s["recs"] if r["last_oom"]]
        if n_oom:
            last = lo[-1]["last_oom"] if lo else None  # recs are in time order
            fig = {"oom_events": n_oom, "last_oom": last}
            alone = last and last.get("case") in ("larger_than_device", "larger_than_limit")
            if last and not alone and last["cause"] == "capacity" and (last["limit_bytes"] or last["device_total_bytes"]):
                # the shortfall the MEMSHIM_SPILL=host suggestion quotes is a figure too (every number
                # in an advice text is one of its figures)
                cap0 = last["limit_bytes"] or last["device_total_bytes"]
                short0 = last["live_bytes"] + last["requested_bytes"] - cap0
                if short0 > 0:
                    fig["short_bytes"], fig["short_share"] = short0, short0 / cap0
            mode = s["newest"]["mode"]
            defrag = s["newest"]["config"].get("MEMSHIM_DEFRAG")
            spill = s["newest"]["config"].get("MEMSHIM_SPILL")

            def render(on, n=n_oom, o=last, mode=mode, defrag=defrag, spill=spill):
                t = f"{n} failed request{'s' if n > 1 else ''} (OOM){on}"
                if not o:
                    return t + ": the reports do not say why (no last_oom)"
                cap = o["limit_bytes"] or o["device_total_bytes"]
                if o.get("case") == "larger_than_device":
                    return t + (f": the last asked for {mib(o['requested_bytes'])} MiB, larger than the device "
                                f"({mib(o['device_total_bytes'])} MiB) alone: no allocator could serve it (memshim "
                                "refused it before any driver work); a smaller batch or shape")
                if o.get("case") == "larger_than_limit":
                    # a limit refuses it, not memory (issue 31): name the limit that did, and its knob
                    env = limit_bytes(s["newest"]["config"].get("MEMSHIM_LIMIT"), o["device_total_bytes"])
                    by_env = env is not None and abs(env - o["limit_bytes"]) < 2 * MiB  # the pool's page rounding
                    who = "MEMSHIM_LIMIT" if by_env else "the limit set_per_process_memory_fraction set"
                    knob = "raise MEMSHIM_LIMIT" if by_env else "raise the memory fraction"
                    return t + (f": the last asked for {mib(o['requested_bytes'])} MiB, larger than {who} "
                                f"({mib(o['limit_bytes'])} MiB) alone: it cannot fit under that limit whatever is "
                                f"freed (memshim refused it before any driver work); {knob}, or a smaller batch or "
                                "shape")
                t += (f": the last asked for {mib(o['requested_bytes'])} MiB with {mib(o['live_bytes'])} MiB live and "
                      f"{mib(o['reserved_bytes'])} MiB reserved of {mib(cap)} MiB "
                      f"({'MEMSHIM_LIMIT' if o['limit_bytes'] else 'the device'})")
                if o["cause"] == "fragmentation":
                    t += f", largest free extent {mib(o['largest_free_extent_bytes'])} MiB: fragmentation"
                    if mode == "segment":
                        t += "; tensor mode or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
                    elif defrag == "0":
                        t += "; MEMSHIM_DEFRAG=1 (now 0)"
                elif o["cause"] == "capacity":
                    t += ": capacity, the live set does not fit; a smaller batch or activation checkpointing lowers the peak"
                    short = o["live_bytes"] + o["requested_bytes"] - cap if cap else None
                    if short is not None and 0 < short <= cap * SPILL_SHORT_SHARE and spill != "host":
                        t += (f"; it was short by {mib(short)} MiB ({pct(short / cap)} of "
                              f"{'the limit' if o['limit_bytes'] else 'the device'}): MEMSHIM_SPILL=host would keep it "
                              "going with its coldest pages on host memory, slower")
                return t
            items.append((("oom", s["label"]), n_oom, s, fig, render))

    # one rank far above the median rank; a rank's peak is the highest of its devices'
    if run["ranked"] and len(run["procs"]) >= 3:
        peaks = [max(s["alloc_peak"] for s in p["streams"]) for p in run["procs"]]
        med = statistics.median(peaks)
        top = max(run["streams"], key=lambda s: (s["alloc_peak"], -(s["rank"] or 0), -s["device"]))
        if med and top["alloc_peak"] >= IMBALANCE_RATIO * med and top["alloc_peak"] - med >= IMBALANCE_MIN_BYTES \
                and not tiny(top):
            fig = {"rank": top["rank"], "allocated_peak_bytes": top["alloc_peak"], "median_bytes": med,
                   "ratio": top["alloc_peak"] / med}

            def render(on, top=top, med=med):
                return (f"one rank above the others: {who(top, run)} peaks at {mib(top['alloc_peak'])} MiB allocated, "
                        f"{top['alloc_peak'] / med:.2f}x the median rank ({mib(med)} MiB); the job's memory need "
                        "is set by this rank")
            items.append((("imbalance",), top["alloc_peak"] / med, top, fig, render))

    # ranks the run has but that wrote nothing
    if run["ranked"]:
        rk = {s["rank"] for s in run["streams"]}
        missing = sorted(set(range(max(rk) + 1)) - rk)
        if missing:
            fig = {"missing_ranks": missing, "ranks_reported": sorted(rk)}

            def render(on, missing=missing, rk=rk):
                return (f"unreported rank{'s' if len(missing) > 1 else ''}: no reports from rank"
                        f"{'s' if len(missing) > 1 else ''} {ranges(missing)} (the run has reports from ranks "
                        f"{ranges(rk)}): they ran without MEMSHIM_REPORT_DIR or ended before their first report")
            items.append((("unreported",), len(missing), run["streams"][0], fig, render))

    # merge per subject
    merged, order = {}, []
    for key, sev, s, fig, render in items:
        if key not in merged:
            merged[key] = []
            order.append(key)
        merged[key].append((sev, s, fig, render))
    out = []
    for key in order:
        grp = merged[key]
        sev, s, fig, render = max(grp, key=lambda x: x[0])
        labels = [x[1] for x in grp]
        if key[0] == "unreported":
            on = ""
        elif len(grp) > 1 and all(x["rank"] is not None for x in labels):
            on = f" on ranks {ranges([x['rank'] for x in labels])} (figures of {who(s, run)}, the worst)"
        elif len(grp) > 1:
            on = " on devices " + ranges([x["device"] for x in labels]) + f" (figures of {who(s, run)}, the worst)"
        else:
            w = who(s, run)
            on = f" on {w}" if w and key[0] != "imbalance" else ""
        fig = dict(fig, rank=s["rank"], device=s["device"],
                   ranks=sorted(x["rank"] for x in labels if x["rank"] is not None))
        out.append({"kind": key[0], "text": render(on), "figures": fig})
    if not [a for a in out if a["kind"] not in ("unfinished", "interrupted", "unreported")]:
        worst = max(run["streams"], key=lambda s: ratio(s["resv_peak"], s["alloc_peak"]) or 0)
        r = ratio(worst["resv_peak"], worst["alloc_peak"])
        verdicts = {s["trend"]["verdict"] for s in run["streams"]}
        epochs = max(len(s["trend"]["series"]) for s in run["streams"])
        trend = ("too few epochs for a trend (at most %d)" % epochs if verdicts == {"too few epochs"}
                 else "no growth of allocated memory at every epoch")
        w = who(worst, run)
        sh = share_of(worst, worst["resv_peak"])
        of = (f" ({pct(sh)} of the {mib(worst['capacity'])} MiB "
              f"{'limit' if worst['capacity_name'] == 'MEMSHIM_LIMIT' else 'device'})" if sh is not None else "")
        text = (f"nothing to change: peak reserved {mib(worst['resv_peak'])} MiB{of} is "
                f"{fnum(r, 2)}x peak allocated {mib(worst['alloc_peak'])} MiB{' on ' + w if w else ''}"
                f"{' (the highest ratio of the run)' if len(run['streams']) > 1 else ''}, {trend}, no failed request")
        out.append({"kind": "none", "text": text,
                    "figures": {"rank": worst["rank"], "device": worst["device"],
                                "reserved_peak_bytes": worst["resv_peak"], "allocated_peak_bytes": worst["alloc_peak"],
                                "ratio": r, "epochs": epochs, "capacity_bytes": worst["capacity"], "share": sh}})
    return out


def run_notes(run):
    notes = []
    seg = [s for s in run["streams"] if "segment" in s["modes"]]
    if seg and not any(r["torch"] for s in seg for r in s["recs"]):
        notes.append("segment mode: PyTorch's memory_stats() figures are n/a in these reports, so fragmentation "
                     "inside PyTorch's segments is not judged")
    if 1 in run["schemas"]:
        notes.append("schema 1 reports: sites, growing sites, latency percentiles, versions and PyTorch's "
                     "memory_stats() are n/a")
    other = sorted({x for s in run["streams"] for x in s["reasons"] if x not in KNOWN_REASONS})
    if other:
        notes.append(f"epoch reason{'s' if len(other) > 1 else ''} {', '.join(repr(x) for x in other)}: not one this "
                     "tool knows (a newer memshim?); those reports are read as epochs")
    if all(s["capacity"] is None for s in run["streams"]):
        notes.append("the reports carry no device size (memory.device_total_bytes), so no advice judges the peak "
                     "against the device")
    return notes


def analyse(recs):
    runs = build_runs(recs)
    for run in runs:
        top = max(run["streams"], key=lambda s: (s["alloc_peak"], -(s["rank"] or 0), -s["device"]))
        run["highest"] = top
        run["growing"] = sorted((s for s in run["streams"] if is_leak(s["trend"]["verdict"])),
                                key=lambda s: -(s["trend"]["growth"] or 0))
        run["advice"] = advise(run)
        run["notes"] = run_notes(run)
    return runs


# ---- JSON and CSV -------------------------------------------------------------------------------

def trend_json(s):
    t = s["trend"]
    return {"verdict": t["verdict"], "epoch_end_allocated_bytes": t["series"], "source": t["source"],
            "growth_bytes_per_epoch": t["growth"], "growing_sites": t["growing_sites"]}


def stream_json(s):
    return {"device": s["device"], "label": s["label"], "allocated_peak_bytes": s["alloc_peak"],
            "reserved_peak_bytes": s["resv_peak"], "reserved_over_allocated": ratio(s["resv_peak"], s["alloc_peak"]),
            "fragmentation_max": s["frag_max"], "alloc_p99_ns_max": s["alloc_p99_max"], "trend": trend_json(s),
            "sites_at_peak": s["sites"], "versions": s["versions"], "memshim_version": s["memshim_version"],
            "schema_versions": s["schemas"], "modes": s["modes"], "rows": [row_json(r) for r in s["recs"]]}


def ident(s):
    return {"rank": s["rank"], "host": s["host"], "pid": s["pid"], "device": s["device"]}


def run_json(run):
    ranks = []
    for p in run["procs"]:
        ss = p["streams"]
        worst = max(ss, key=lambda s: (is_leak(s["trend"]["verdict"]), s["trend"]["growth"] or 0))
        ranks.append({"rank": p["rank"], "host": p["host"], "pid": p["pid"], "devices": [s["device"] for s in ss],
                      "allocated_peak_bytes": max(s["alloc_peak"] for s in ss),
                      "reserved_peak_bytes": max(s["resv_peak"] for s in ss),
                      "trend": dict(trend_json(worst), device=worst["device"]),
                      "streams": [stream_json(s) for s in ss]})
    h = run["highest"]
    return {"run": run["index"], "ranked": run["ranked"], "run_id": run["procs"][0]["run_id"],
            "description": run["what"], "recognised_by": run["why"],
            "hosts": run["hosts"], "pids": run["pids"], "start_unix": run["start"], "end_unix": run["end"],
            "schema_versions": run["schemas"], "modes": run["modes"], "ranks": ranks,
            "highest_peak": dict(ident(h), allocated_peak_bytes=h["alloc_peak"], reserved_peak_bytes=h["resv_peak"]),
            "growing": [dict(ident(s), growth_bytes_per_epoch=s["trend"]["growth"], verdict=s["trend"]["verdict"])
                        for s in run["growing"]],
            "advice": run["advice"], "notes": run["notes"]}


def to_json(runs, paths, nrecs, skipped, warnings):
    return {"memshim_report_format": FORMAT_VERSION, "inputs": paths, "reports_read": nrecs,
            "skipped": [{"path": p, "reason": w} for p, w in skipped],
            "warnings": [{"path": p, "message": w} for p, w in warnings],
            "runs": [run_json(r) for r in runs]}


CSV_COLUMNS = ["run", "file", "schema_version", "host", "pid", "rank", "device", "kind", "epoch", "oom_index",
               "reason", "mode",
               "steps", "peak_scope", "allocated_end_bytes", "allocated_peak_bytes", "reserved_end_bytes",
               "reserved_peak_bytes", "reserved_over_allocated", "touched_peak_bytes", "fragmentation",
               "peak_allocated_over_peak_reserved", "step_alloc_over_resv_min", "step_alloc_over_resv_median",
               "step_alloc_over_resv_max", "reserved_minus_allocated_at_peak_bytes", "map_ops",
               "unmap_ops", "reclaimed_pages", "oom_events", "alloc_p50_ns", "alloc_p90_ns", "alloc_p99_ns",
               "alloc_max_ns", "free_p50_ns", "free_p90_ns", "free_p99_ns", "free_max_ns",
               "torch_allocated_peak_bytes", "torch_reserved_peak_bytes", "torch_num_alloc_retries",
               "torch_num_ooms", "driver_modelled_seconds", "top_site", "top_site_bytes"]


def csv_cell(v):
    """A CSV cell for people: integers exact (bytes), other numbers to 6 significant digits
    (0.00048052, not 0.00048051999999999996), n/a where absent."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else "n/a"
    return v


def write_csv(runs, out):
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for run in runs:
        for s in run["streams"]:
            for r in s["recs"]:
                j = row_json(r)
                j["run"] = run["index"]
                for q in ("min", "median", "max"):
                    j[f"step_alloc_over_resv_{q}"] = (r["step_ratio"] or {}).get(q)
                lat = r["latency"] or {}
                for op, pre in (("alloc_ns", "alloc"), ("free_ns", "free")):
                    for q in ("p50", "p90", "p99", "max"):
                        j[f"{pre}_{q}_ns"] = (lat.get(op) or {}).get(q)
                t = r["torch"] or {}
                j["torch_allocated_peak_bytes"] = t.get("allocated_peak_bytes")
                j["torch_reserved_peak_bytes"] = t.get("reserved_peak_bytes")
                j["torch_num_alloc_retries"] = t.get("num_alloc_retries")
                j["torch_num_ooms"] = t.get("num_ooms")
                top = max(r["sites"], key=lambda x: x["bytes"]) if r["sites"] else None
                j["top_site"] = f"{top['file']}:{top['line']}:{top['function']}" if top else None
                j["top_site_bytes"] = top["bytes"] if top else None
                w.writerow([csv_cell(j[c]) for c in CSV_COLUMNS])


# ---- text ---------------------------------------------------------------------------------------

def table(headers, rows, left=()):
    """Right-aligned columns (those named in `left` left-aligned), one space apart."""
    cols = [[h] + [r[i] for r in rows] for i, h in enumerate(headers)]
    wid = [max(len(c) for c in col) for col in cols]
    out = []
    for r in [headers] + rows:
        out.append(" ".join(c.ljust(wid[i]) if headers[i] in left else c.rjust(wid[i])
                            for i, c in enumerate(r)).rstrip())
    out.insert(1, "-" * len(out[0]))
    return out


DETAIL_HEADERS = ["host", "pid", "rank", "dev", "kind", "epoch", "reason", "steps", "alloc_end", "alloc_peak",
                  "resv_peak", "resv/alloc", "frag", "step_a/r", "gap@pk", "maps", "unmaps", "reclaim", "ooms", "a.p50us", "a.p99us",
                  "pt_alloc", "pt_resv"]


def detail_row(r):
    j = row_json(r)
    lat = (r["latency"] or {}).get("alloc_ns") or {}
    t = r["torch"] or {}
    na = lambda v: "n/a" if v is None else str(v)  # noqa: E731
    kind = f"oom#{r['oom_index']}" if r["oom_index"] is not None else r["kind"]  # which failure, as in its file name
    return [r["host"], str(r["pid"]), na(r["rank"]), str(r["device"]), kind, str(r["epoch"]), na(r["reason"]),
            na(r["steps"]), mib(r["alloc_end"]), mib(j["allocated_peak_bytes"]), mib(j["reserved_peak_bytes"]),
            fnum(j["reserved_over_allocated"]), fnum(r["frag"]), step_ratio_text(r["step_ratio"]), mib(r["gap_at_peak"]),
            na(r["maps"]), na(r["unmaps"]), na(r["reclaimed"]),
            na(r["ooms"]), usec(lat.get("p50")), usec(lat.get("p99")), mib(t.get("allocated_peak_bytes")),
            mib(t.get("reserved_peak_bytes"))]


def step_ratio_text(sr):
    """STAlloc's figure as min/median/max (n/a: no step measured, or an older report)."""
    return "n/a" if not sr else "/".join(f"{sr[q]:.3f}" for q in ("min", "median", "max"))


def versions_line(run):
    seen = {}
    for s in run["streams"]:
        v = s["versions"] or {}
        key = (v.get("memshim") or s["memshim_version"], v.get("torch"), v.get("cuda_driver"), v.get("cuda_runtime"),
               v.get("device_name"))
        seen.setdefault(key, []).append(s)
    lines = []
    for key, ss in seen.items():
        na = ["n/a" if x is None else x for x in key]
        txt = f"memshim {na[0]}, torch {na[1]}, CUDA driver {na[2]}, runtime {na[3]}, device {na[4]}"
        if len(seen) > 1:
            txt += " (" + (f"ranks {ranges([s['rank'] for s in ss])}" if run["ranked"]
                           else f"devices {ranges([s['device'] for s in ss])}") + ")"
        lines.append("versions: " + txt)
    return lines


def trend_text(s):
    t = s["trend"]
    if not t["series"]:
        return f"{t['verdict']} (no epoch closed)"
    txt = (f"{t['verdict']}: allocated at epoch end {mib(t['series'][0])} -> {mib(t['series'][-1])} MiB over "
           f"{len(t['series'])} epoch{'s' if len(t['series']) > 1 else ''}")
    if t["growth"] is not None:
        txt += f" ({t['growth'] / MiB:+.1f} MiB/epoch)"
    return txt


def growing_sites_text(s):
    gs = s["trend"]["growing_sites"]
    if gs is None:
        return "n/a (these reports name no growing sites)"
    if not gs:
        return "none"
    return "; ".join(f"{site_name(x)} {x['growth_bytes_per_epoch'] / MiB:+.1f} MiB/epoch" for x in gs)


def sites_lines(s, who_):
    si = s["sites"]
    head = f"sites at the peak{who_}"
    if si["sites"] is None:
        return [f"{head}: n/a ({si['note']})"]
    if not si["sites"]:
        return [f"{head}: none" + (f" ({si['note']})" if si["note"] else "")]
    lines = [f"{head} (epoch {si['epoch']}, peak allocated {mib(si['allocated_peak_bytes'])} MiB):"]
    rows = [[mib(x["bytes"]), fnum(ratio(x["bytes"], si["allocated_peak_bytes"]), 3),
             "n/a" if x["count"] is None else str(x["count"]), site_name(x)]
            for x in sorted(si["sites"], key=lambda x: -x["bytes"])]
    lines += ["  " + ln for ln in table(["MiB", "share", "count", "site"], rows, left=("site",))]
    return lines


def no_growth(run):
    what = "rank" if run["ranked"] else "device"
    return (f"on no {what} (no {what}'s allocated memory at epoch end rose at every epoch boundary)")


def text_report(runs, args, nrecs, nfiles_skipped):
    out = []
    out.append(f"{PROG}: {nrecs} report{'s' if nrecs != 1 else ''} in {len(runs)} run{'s' if len(runs) != 1 else ''}"
               f"{f', {nfiles_skipped} file(s) skipped' if nfiles_skipped else ''}")
    out.append("memory in MiB; resv/alloc: peak reserved / peak allocated; frag: 1 - largest free extent / free "
               "bytes in mapped pages; step_a/r: each optimizer step's peak allocated / its peak reserved, "
               "min/median/max over the epoch's steps; gap@pk: reserved - allocated at the reserved peak; a.p50us, a.p99us: allocation latency percentiles (us); pt_alloc, pt_resv: "
               "PyTorch's memory_stats() peaks; summary rows: peaks since the pool was created")
    for run in runs:
        out.append("")
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run["start"]))
        except (TypeError, ValueError, OverflowError, OSError):  # no time stamp, or one out of range
            when = "n/a"
        out.append(f"== run {run['index']} of {len(runs)}: {run['what']}; started {when}; "
                   f"mode {'/'.join(run['modes']) or 'n/a'}; schema {'/'.join(map(str, run['schemas']))}")
        out.append(f"recognised by: {run['why']}")
        out += versions_line(run)
        multi = len(run["streams"]) > 1
        if multi:
            out.append("")
            out.append("per rank:" if run["ranked"] else "per device:")
            rows = []
            for s in run["streams"]:
                rows.append([s["label"], s["host"], str(s["pid"]), str(s["device"]), str(len(s["epochs"])),
                             mib(s["alloc_peak"]), mib(s["resv_peak"]), fnum(ratio(s["resv_peak"], s["alloc_peak"])),
                             fnum(s["frag_max"]), usec(s["alloc_p99_max"]),
                             "n/a" if s["trend"]["growth"] is None else f"{s['trend']['growth'] / MiB:+.1f}",
                             s["trend"]["verdict"]])
            out += table(["rank" if run["ranked"] else "stream", "host", "pid", "dev", "epochs", "alloc_peak",
                          "resv_peak", "resv/alloc", "frag_max", "a.p99us", "growth/ep", "verdict"], rows,
                         left=("verdict", "host"))
            epochs = sorted({r["epoch"] for s in run["streams"] for r in s["epochs"]})
            by_epoch = [{r["epoch"]: r for r in s["epochs"]} for s in run["streams"]]
            for what, key in (("peak allocated", "alloc_peak"), ("peak reserved", "resv_peak")):
                out.append("")
                out.append(f"{what} per epoch (MiB), one column per {'rank' if run['ranked'] else 'device'}:")
                for c0 in range(0, len(run["streams"]), MATRIX_COLUMNS):  # wide jobs: blocks of columns
                    cols = range(c0, min(c0 + MATRIX_COLUMNS, len(run["streams"])))
                    rows = [[str(e)] + [mib(by_epoch[i][e][key]) if e in by_epoch[i] else "n/a" for i in cols]
                            for e in epochs]
                    rows.append(["run"] + [mib(run["streams"][i][key]) for i in cols])
                    out += table(["epoch"] + [run["streams"][i]["label"] for i in cols], rows)
            h = run["highest"]
            out.append("")
            out.append(f"highest peak: {who(h, run)} (host {h['host']}, pid {h['pid']}, device {h['device']}): "
                       f"{mib(h['alloc_peak'])} MiB allocated, {mib(h['resv_peak'])} MiB reserved")
            if run["growing"]:
                for s in run["growing"]:
                    out.append(f"memory grows: {who(s, run)} (host {s['host']}, pid {s['pid']}): {trend_text(s)}")
                    out.append(f"  growing sites: {growing_sites_text(s)}")
            else:
                out.append(f"memory grows: {no_growth(run)}")
        if not multi or args.per_process:
            out.append("")
            rows = [detail_row(r) for s in run["streams"] for r in s["recs"]]
            out += table(DETAIL_HEADERS, rows, left=("host", "kind", "reason"))
        if not multi:
            s = run["streams"][0]
            out.append(f"trend: {trend_text(s)}")
            out.append(f"growing sites: {growing_sites_text(s)}")
        for s in run["streams"]:  # issue 24: what memshim cost, from the stream's last report
            last = s["recs"][-1] if s["recs"] else None
            if last is not None and (last["overhead"] or not multi):
                scope = "" if not multi else f" ({who(s, run)})"
                out.append(f"memshim's own cost{scope}, {last['kind']} report: {overhead_text(last['overhead'])}")
        out.append("")
        h = run["highest"]
        out += sites_lines(h, f" of {who(h, run)}" if multi else "")
        if run["advice"]:
            out.append("")
            out.append("advice:")
            out += [f"  - {a['text']}" for a in run["advice"]]
        if run["notes"]:
            out.append("notes:")
            out += [f"  - {n}" for n in run["notes"]]
    return "\n".join(out) + "\n"


# ---- charts: one figure model, drawn as SVG or rasterized to PNG ---------------------------------

PALETTE = ["#2364aa", "#e4572e", "#17a35a", "#a23bb0", "#c9a227", "#2bb3c0", "#8c5a2b", "#e0569b", "#5a6b7a",
           "#7fae1f"]
INK, GRID, FRAME = "#222222", "#e3e3e3", "#888888"
FIG_W, MARGIN_L, MARGIN_R = 1000, 84, 224
PLOT_W = FIG_W - MARGIN_L - MARGIN_R
PANEL_PAD_T, PLOT_H, PANEL_PAD_B, RUN_HEAD = 34, 200, 46, 36
PANEL_H = PANEL_PAD_T + PLOT_H + PANEL_PAD_B
CHAR_W, CHAR_H = 12, 14       # the raster font at scale 2: 5x7 glyphs in 6x8 cells


class Figure:
    def __init__(self, width, height):
        self.w, self.h, self.items = width, height, []

    def rect(self, x, y, w, h, color):
        self.items.append(("rect", x, y, w, h, color))

    def line(self, pts, color, width=2, dash=False, meta=None):
        self.items.append(("line", pts, color, width, dash, meta))

    def text(self, x, y, s, color=INK, anchor="start"):
        self.items.append(("text", x, y, s, color, anchor))

    def group(self, meta):
        """Open a panel (its axes, for readers of the SVG); `end_group` closes it."""
        self.items.append(("group", meta))

    def end_group(self):
        self.items.append(("end",))


def nice_ticks(lo, hi, n=5):
    if hi <= lo:  # a flat line: centre it
        pad = max(abs(lo) * 0.05, 1)
        lo, hi = max(0, lo - pad) if lo >= 0 else lo - pad, hi + pad
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step + 1e-9) * step
    end = math.ceil(hi / step - 1e-9) * step
    k = int(round((end - start) / step))
    dec = next((d for d in range(6) if abs(round(step, d) - step) < 1e-9 * max(1, step)), 6)
    return start, end, [(start + i * step, f"{start + i * step:.{dec}f}") for i in range(k + 1)]


def panel(fig, top, title, unit, series, zero_based, fixed=None):
    """One chart: `series` = [{label, color, dash, points: [(epoch, value)]}]."""
    x0, y0 = MARGIN_L, top + PANEL_PAD_T
    fig.text(x0, top + 8, title)
    pts = [p for s in series for p in s["points"]]
    if not pts:
        fig.rect(x0, y0, PLOT_W, PLOT_H, "#f6f6f6")
        fig.text(x0 + PLOT_W / 2, y0 + PLOT_H / 2 - CHAR_H / 2, "no epoch reports", FRAME, "middle")
        return
    if fixed:
        lo, hi = fixed
        ticks = [(lo + (hi - lo) * i / 4, f"{lo + (hi - lo) * i / 4:.2f}") for i in range(5)]
    else:
        vals = [v for _, v in pts]
        lo, hi, ticks = nice_ticks(0 if zero_based else min(vals), max(vals))
    ex = [e for e, _ in pts]
    e0, e1 = min(ex), max(ex)
    if e0 == e1:
        e0, e1 = e0 - 1, e1 + 1
    X = lambda e: x0 + (e - e0) / (e1 - e0) * PLOT_W  # noqa: E731
    Y = lambda v: y0 + PLOT_H - (v - lo) / (hi - lo) * PLOT_H  # noqa: E731
    fig.group({"title": title, "unit": unit, "lo": lo, "hi": hi, "top": y0, "height": PLOT_H,
               "left": x0, "width": PLOT_W, "e0": e0, "e1": e1})
    for v, lab in ticks:
        fig.line([(x0, Y(v)), (x0 + PLOT_W, Y(v))], GRID, 1)
        fig.text(x0 - 8, Y(v) - CHAR_H / 2, lab, INK, "end")
    step = max(1, math.ceil((e1 - e0) / 10))
    e = math.ceil(e0)
    while e <= e1:
        fig.line([(X(e), y0 + PLOT_H), (X(e), y0 + PLOT_H + 5)], FRAME, 1)
        fig.text(X(e), y0 + PLOT_H + 12, str(e), INK, "middle")
        e += step
    fig.text(x0 + PLOT_W / 2, y0 + PLOT_H + 29, "epoch", INK, "middle")
    for a, b in (((x0, y0), (x0 + PLOT_W, y0)), ((x0, y0 + PLOT_H), (x0 + PLOT_W, y0 + PLOT_H)),
                 ((x0, y0), (x0, y0 + PLOT_H)), ((x0 + PLOT_W, y0), (x0 + PLOT_W, y0 + PLOT_H))):
        fig.line([a, b], FRAME, 1)
    for s in series:
        if not s["points"]:
            continue
        p = [(X(e), Y(v)) for e, v in s["points"]]
        meta = {"label": s["label"], "epochs": [e for e, _ in s["points"]], "values": [v for _, v in s["points"]]}
        # a series another one equals is drawn wide underneath it: both stay visible
        wide = s.get("under", False)
        fig.line(p, s["color"], 6 if wide else 2, s["dash"], meta)
        m = 9 if wide else 5
        for x, y in p:
            fig.rect(x - m / 2, y - m / 2, m, m, s["color"])
    # legend: colour keys right of the plot
    lx, ly = x0 + PLOT_W + 14, y0
    keys = [(s.get("legend_label", s["label"]), s["color"], s["dash"]) for s in series if s.get("legend", True)]
    keys += [(k, FRAME, d) for k, d in (series[0].get("style_keys") or [])]
    room = PLOT_H // 18
    if len(keys) > room:
        keys = keys[:room - 1] + [(f"+{len(keys) - room + 1} more", None, False)]
    width = (MARGIN_R - 46) // CHAR_W
    for label, color, dash in keys:
        if color:
            fig.line([(lx, ly + 7), (lx + 24, ly + 7)], color, 3, dash)
        # a long label ("reserved (= allocated)") goes on two lines, broken before "(" or at a space
        parts = [label]
        if len(label) > width:
            cut = label.find(" (")
            cut = cut if 0 < cut <= width else label.rfind(" ", 0, width + 1)
            if cut > 0:
                parts = [label[:cut], label[cut + 1:]]
        for part in parts:
            fig.text(lx + 32, ly, part[:width])
            ly += 18
    fig.end_group()


def run_height(run):
    return RUN_HEAD + 3 * PANEL_H


def mark_equal(series):
    """A series whose points equal an earlier one's in the same panel would be drawn exactly over
    it (tensor mode: reserved often equals allocated). The earlier one is drawn wide underneath
    (`under`) and each legend says what it equals, so both stay visible."""
    for i, s in enumerate(series):
        for t in series[:i]:
            if s["points"] and s["points"] == t["points"]:
                t["under"] = True
                s["legend_label"] = f"{s['label']} (= {t['label']})"
                t.setdefault("legend_label", f"{t['label']} (= {s['label']})")
                break
    return series


def run_panels(run):
    """The three charts of a run, for every renderer: (title, unit, series, zero_based, fixed)."""
    streams = run["streams"]
    one = len(streams) == 1
    colors = {id(s): PALETTE[i % len(PALETTE)] for i, s in enumerate(streams)}
    pts = lambda s, key: [(r["epoch"], r[key] / MiB) for r in s["epochs"]]  # noqa: E731
    if one:
        s = streams[0]
        mem = [{"label": "allocated", "color": PALETTE[0], "dash": False, "points": pts(s, "alloc_peak")},
               {"label": "reserved", "color": PALETTE[1], "dash": False, "points": pts(s, "resv_peak")}]
    else:
        mem = []
        for s in streams:
            mem.append({"label": s["label"], "color": colors[id(s)], "dash": False, "points": pts(s, "alloc_peak")})
            mem.append({"label": s["label"] + " reserved", "color": colors[id(s)], "dash": True,
                        "points": pts(s, "resv_peak"), "legend": False})
        mem[0]["style_keys"] = [("allocated", False), ("reserved", True)]
    frag = [{"label": "fragmentation" if one else s["label"], "color": PALETTE[2] if one else colors[id(s)],
             "dash": False, "points": [(r["epoch"], r["frag"]) for r in s["epochs"] if r["frag"] is not None]}
            for s in streams]
    end = [{"label": "at epoch end" if one else s["label"], "color": PALETTE[3] if one else colors[id(s)],
            "dash": False, "points": [(r["epoch"], r["alloc_end"] / MiB) for r in s["epochs"]]} for s in streams]
    return [("peak allocated and reserved per epoch (MiB)", "MiB", mark_equal(mem), True, None),
            ("fragmentation: 1 - largest free extent / free bytes in mapped pages", "", mark_equal(frag), True,
             (0.0, 1.0)),
            ("allocated at epoch end (MiB; a line rising every epoch is a leak)", "MiB", mark_equal(end), False, None)]


def draw_run(fig, run, top):
    fig.text(12, top + 10, f"run {run['index']}: {run['what']}"[:(FIG_W - 24) // CHAR_W])
    top += RUN_HEAD
    for title, unit, series, zero_based, fixed in run_panels(run):
        panel(fig, top, title, unit, series, zero_based, fixed)
        top += PANEL_H


def figure_for(runs):
    fig = Figure(FIG_W, 12 + sum(run_height(r) for r in runs))
    fig.rect(0, 0, fig.w, fig.h, "#ffffff")
    top = 12
    for run in runs:
        draw_run(fig, run, top)
        top += run_height(run)
    return fig


def fmt(v):
    return f"{v:.2f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def to_svg(fig, standalone=True):
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    out = [f'<svg{ns} width="{fig.w}" height="{fig.h}" viewBox="0 0 {fig.w} {fig.h}" '
           f'font-family="DejaVu Sans Mono, monospace" font-size="13">']
    for it in fig.items:
        if it[0] == "group":
            out.append('<g class="panel" ' + " ".join(f'data-{k}="{e(fmt(v))}"' for k, v in it[1].items()) + ">")
        elif it[0] == "end":
            out.append("</g>")
        elif it[0] == "rect":
            _, x, y, w, h, c = it
            out.append(f'<rect x="{fmt(x)}" y="{fmt(y)}" width="{fmt(w)}" height="{fmt(h)}" fill="{c}"/>')
        elif it[0] == "line":
            _, pts, c, w, dash, meta = it
            attrs = f'fill="none" stroke="{c}" stroke-width="{w}"' + (' stroke-dasharray="8 5"' if dash else "")
            if meta:
                attrs += (f' class="series" data-label="{e(meta["label"])}" data-epochs="'
                          + ",".join(map(str, meta["epochs"])) + '" data-values="'
                          + ",".join(repr(float(v)) for v in meta["values"]) + '"')
            out.append(f'<polyline points="{" ".join(f"{fmt(x)},{fmt(y)}" for x, y in pts)}" {attrs}/>')
        else:
            _, x, y, s, c, anchor = it
            out.append(f'<text x="{fmt(x)}" y="{fmt(y + 12)}" fill="{c}" text-anchor="{anchor}">{e(s)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# A 5x7 bitmap font for the PNG drawn without matplotlib: each glyph is seven rows, bit 4 the
# leftmost column; lower case has its own glyphs (a host `vm` is not `VM`); anything else is '?'.
FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12), "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14), "D": (30, 17, 17, 17, 17, 17, 30), "E": (31, 16, 16, 30, 16, 16, 31),
    "F": (31, 16, 16, 30, 16, 16, 16), "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14), "J": (7, 2, 2, 2, 2, 18, 12), "K": (17, 18, 20, 24, 20, 18, 17),
    "L": (16, 16, 16, 16, 16, 16, 31), "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14), "P": (30, 17, 17, 30, 16, 16, 16), "Q": (14, 17, 17, 17, 21, 18, 13),
    "R": (30, 17, 17, 30, 20, 18, 17), "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14), "V": (17, 17, 17, 17, 17, 10, 4), "W": (17, 17, 17, 21, 21, 21, 10),
    "X": (17, 17, 10, 4, 10, 17, 17), "Y": (17, 17, 10, 4, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    " ": (0,) * 7, ".": (0, 0, 0, 0, 0, 12, 12), ",": (0, 0, 0, 0, 12, 4, 8), ":": (0, 12, 12, 0, 12, 12, 0),
    ";": (0, 12, 12, 0, 12, 4, 8), "-": (0, 0, 0, 31, 0, 0, 0), "+": (0, 4, 4, 31, 4, 4, 0),
    "/": (1, 1, 2, 4, 8, 16, 16), "(": (2, 4, 8, 8, 8, 4, 2), ")": (8, 4, 2, 2, 2, 4, 8),
    "%": (24, 25, 2, 4, 8, 19, 3), "_": (0, 0, 0, 0, 0, 0, 31), "=": (0, 0, 31, 0, 31, 0, 0),
    "<": (2, 4, 8, 16, 8, 4, 2), ">": (8, 4, 2, 1, 2, 4, 8), "[": (14, 8, 8, 8, 8, 8, 14),
    "]": (14, 2, 2, 2, 2, 2, 14), "'": (4, 4, 8, 0, 0, 0, 0), "?": (14, 17, 1, 2, 4, 0, 4),
    "!": (4, 4, 4, 4, 4, 0, 4), "*": (0, 4, 21, 14, 21, 4, 0), "#": (10, 10, 31, 10, 31, 10, 10),
    "&": (12, 18, 20, 8, 21, 18, 13), '"': (10, 10, 0, 0, 0, 0, 0), "|": (4, 4, 4, 4, 4, 4, 4),
    "a": (0, 0, 14, 1, 15, 17, 15), "b": (16, 16, 22, 25, 17, 17, 30), "c": (0, 0, 14, 16, 16, 17, 14),
    "d": (1, 1, 13, 19, 17, 17, 15), "e": (0, 0, 14, 17, 31, 16, 14), "f": (6, 9, 8, 28, 8, 8, 8),
    "g": (0, 15, 17, 17, 15, 1, 14), "h": (16, 16, 22, 25, 17, 17, 17), "i": (4, 0, 12, 4, 4, 4, 14),
    "j": (2, 0, 6, 2, 2, 18, 12), "k": (16, 16, 18, 20, 24, 20, 18), "l": (12, 4, 4, 4, 4, 4, 14),
    "m": (0, 0, 26, 21, 21, 17, 17), "n": (0, 0, 22, 25, 17, 17, 17), "o": (0, 0, 14, 17, 17, 17, 14),
    "p": (0, 0, 30, 17, 30, 16, 16), "q": (0, 0, 13, 19, 15, 1, 1), "r": (0, 0, 22, 25, 16, 16, 16),
    "s": (0, 0, 14, 16, 14, 1, 30), "t": (8, 8, 28, 8, 8, 9, 6), "u": (0, 0, 17, 17, 17, 19, 13),
    "v": (0, 0, 17, 17, 17, 10, 4), "w": (0, 0, 17, 17, 21, 21, 10), "x": (0, 0, 17, 10, 4, 10, 17),
    "y": (0, 0, 17, 17, 15, 1, 14), "z": (0, 0, 31, 2, 4, 8, 31),
}


def rgb(color):
    return bytes(int(color[i:i + 2], 16) for i in (1, 3, 5))


class Raster:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def fill(self, x, y, w, h, c):
        px = lambda v: int(math.floor(v + 0.5))  # noqa: E731  (round() would round halves to even)
        x0, y0 = max(0, px(x)), max(0, px(y))
        x1, y1 = min(self.w, max(px(x + w), x0 + 1)), min(self.h, max(px(y + h), y0 + 1))
        if x1 <= x0 or y1 <= y0:
            return
        row = c * (x1 - x0)
        for yy in range(y0, y1):
            o = (yy * self.w + x0) * 3
            self.px[o:o + len(row)] = row

    def polyline(self, pts, c, width, dash):
        walked = 0.0
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            length = math.hypot(xb - xa, yb - ya)
            n = max(1, int(math.ceil(max(abs(xb - xa), abs(yb - ya)))))
            for i in range(n + 1):
                t = i / n
                if dash and (walked + t * length) % 13 >= 8:
                    continue
                self.fill(xa + (xb - xa) * t - width / 2, ya + (yb - ya) * t - width / 2, width, width, c)
            walked += length

    def text(self, x, y, s, c, anchor):
        w = len(s) * CHAR_W
        x -= w if anchor == "end" else w / 2 if anchor == "middle" else 0
        for i, ch in enumerate(s):
            glyph = FONT.get(ch) or FONT["?"]
            for r, bits in enumerate(glyph):
                for col in range(5):
                    if bits & (16 >> col):
                        self.fill(x + i * CHAR_W + col * 2, y + r * 2, 2, 2, c)


def to_png(fig):
    ras = Raster(int(fig.w), int(fig.h))
    for it in fig.items:
        if it[0] == "rect":
            ras.fill(it[1], it[2], it[3], it[4], rgb(it[5]))
        elif it[0] == "line":
            ras.polyline(it[1], rgb(it[2]), it[3], it[4])
        elif it[0] == "text":
            ras.text(it[1], it[2], it[3], rgb(it[4]), it[5])
    stride = ras.w * 3
    raw = b"".join(b"\x00" + bytes(ras.px[y * stride:(y + 1) * stride]) for y in range(ras.h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", ras.w, ras.h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# ---- charts with matplotlib (when it is importable) -----------------------------------------------

def matplotlib_version():
    """matplotlib's version when it can be imported, else None (the built-in drawing is used)."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure as _F  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure: draw without it
        return None
    return matplotlib.__version__


def to_matplotlib(runs, fmt):
    """The same charts as the built-in drawing (run_panels), drawn with matplotlib's object API (no
    pyplot, no display): bytes of a PNG or an SVG (text kept as text)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator
    panels = [(run, p) for run in runs for p in run_panels(run)]
    fig = MplFigure(figsize=(11, 3.1 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for i, (ax, (run, (title, unit, series, zero_based, fixed))) in enumerate(zip(axes, panels)):
        head = f"run {run['index']}: {run['what']}\n" if i % 3 == 0 else ""
        ax.set_title(head + title, loc="left", fontsize=10)
        ax.grid(True, color=GRID, linewidth=0.8)
        ax.set_xlabel("epoch")
        if unit:
            ax.set_ylabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not any(sr["points"] for sr in series):
            ax.text(0.5, 0.5, "no epoch reports", ha="center", va="center", transform=ax.transAxes, color=FRAME)
            continue
        handles = []
        for sr in series:
            if not sr["points"]:
                continue
            xs, ys = zip(*sr["points"])
            wide = sr.get("under", False)
            (ln,) = ax.plot(xs, ys, color=sr["color"], linestyle="--" if sr["dash"] else "-",
                            linewidth=5.5 if wide else 1.8, alpha=0.45 if wide else 1.0, marker="o" if wide else "s",
                            markersize=8 if wide else 4, zorder=1 if wide else 2,
                            label=sr.get("legend_label", sr["label"]))
            if sr.get("legend", True):
                handles.append(ln)
        for label, dash in series[0].get("style_keys") or []:
            handles.append(Line2D([], [], color=FRAME, linestyle="--" if dash else "-", label=label))
        if len(handles) > 16:
            more = Line2D([], [], color="none", label=f"+{len(handles) - 15} more")
            handles = handles[:15] + [more]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        if fixed:
            ax.set_ylim(*fixed)
        elif zero_based:
            top = max(v for sr in series for _, v in sr["points"])
            ax.set_ylim(0, top * 1.08 if top > 0 else 1)
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "memshim"}):
        fig.savefig(buf, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else None)
    return buf.getvalue()


# ---- TensorBoard ----------------------------------------------------------------------------------

TB_SCALARS = (  # tag, what (from an epoch row)
    ("memshim/allocated_peak_mib", lambda r: r["alloc_peak"] / MiB),
    ("memshim/reserved_peak_mib", lambda r: r["resv_peak"] / MiB),
    ("memshim/allocated_end_mib", lambda r: r["alloc_end"] / MiB),
    ("memshim/reserved_over_allocated", lambda r: ratio(r["resv_peak"], r["alloc_peak"])),
    ("memshim/fragmentation", lambda r: r["frag"]),
    ("memshim/oom_events", lambda r: r["ooms"]),
    ("memshim/oom_rescues", lambda r: None if all(v is None for v in r["rescued"].values())
     else sum(v or 0 for v in r["rescued"].values())),
)


def tb_run_name(run, s):
    return f"run{run['index']}-{s['label']}"


def to_tensorboard(runs, logdir):
    """One TensorBoard run (a subdirectory of logdir) per process and device, a scalar per figure
    and epoch (step = epoch, wall time = the report's). Returns (ok, message)."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except Exception as e:  # noqa: BLE001 - any failure: no TensorBoard here
        return False, (f"--tensorboard: the tensorboard package cannot be imported ({type(e).__name__}: {e}); "
                       "pip install tensorboard")
    n = 0
    try:
        for run in runs:
            for s in run["streams"]:
                d = os.path.join(logdir, tb_run_name(run, s))
                os.makedirs(d, exist_ok=True)
                if any(f.startswith("events.out.tfevents") for f in os.listdir(d)):
                    note(f"--tensorboard: {d} already holds event files (an earlier export?); TensorBoard shows both")
                w = EventFileWriter(d)
                for r in s["epochs"]:
                    vals = [summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                            for tag, fn in TB_SCALARS for v in [fn(r)] if v is not None]
                    ev = event_pb2.Event(wall_time=float(r["wall"] or 0), step=r["epoch"],
                                         summary=summary_pb2.Summary(value=vals))
                    w.add_event(ev)
                    n += len(vals)
                w.flush()
                w.close()
    except OSError as e:
        return False, f"--tensorboard: cannot write {logdir}: {e.strerror or e}"
    return True, f"wrote {n} scalars to {logdir} (tensorboard --logdir {logdir})"


# ---- HTML ---------------------------------------------------------------------------------------

# No table or chart may run past the page (issue 31: the epoch table of 23 columns needed a
# horizontal scroll): the epoch rows are two tables (memory; work, latency and PyTorch's figures),
# headers and slashed figures may break after `_` and `/` (<wbr>), a long word breaks rather than
# overflow, and the charts scale down.
CSS = """body{font-family:sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px;max-width:100%}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;overflow-wrap:break-word}th{background:#f0f0f0}
td.l,th.l{text-align:left}section.run{border-top:2px solid #888;margin-top:2em}
.charts svg{max-width:100%;height:auto}
li{margin:.3em 0}.na{color:#999}code{background:#f4f4f4}"""

# The epoch rows on the page: DETAIL_HEADERS split in two tables, each row named by its report.
HTML_EPOCH_TABLES = (
    ("epochs", ["host", "pid", "rank", "dev", "kind", "epoch", "reason", "steps", "alloc_end", "alloc_peak",
                "resv_peak", "resv/alloc", "frag", "step_a/r", "gap@pk"]),
    ("epochs-work", ["pid", "rank", "dev", "kind", "epoch", "maps", "unmaps", "reclaim", "ooms", "a.p50us", "a.p99us",
                     "pt_alloc", "pt_resv"]),
)


def html_table(headers, rows, cls, left=()):
    def e(v, heading=False):  # a line may break before `_` in a heading and after `/` anywhere
        t = html.escape(str(v)).replace("/", "/<wbr>")
        return t.replace("_", "<wbr>_") if heading else t
    lc = ' class="l"'
    out = [f'<table class="{cls}"><thead><tr>' +
           "".join(f'<th{lc if h in left else ""}>{e(h, True)}</th>' for h in headers) + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(f'<td{lc if headers[i] in left else ""}>{e(c)}</td>'
                                    for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def to_html(runs, paths, nrecs, skipped):
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>memshim report</title>',
           f"<style>{CSS}</style></head><body>", "<h1>memshim report</h1>",
           f"<p>{nrecs} report{'s' if nrecs != 1 else ''} in {len(runs)} run{'s' if len(runs) != 1 else ''} from "
           + ", ".join(f"<code>{e(p)}</code>" for p in paths) + ".</p>"]
    if skipped:
        out.append("<p>Skipped:</p><ul>" + "".join(f"<li><code>{e(p)}</code>: {e(w)}</li>" for p, w in skipped)
                   + "</ul>")
    for run in runs:
        out.append(f'<section class="run" id="run-{run["index"]}">')
        out.append(f"<h2>Run {run['index']}: {e(run['what'])}</h2>")
        out.append(f"<p>Recognised by: {e(run['why'])}. Mode {e('/'.join(run['modes']) or 'n/a')}, schema "
                   f"{e('/'.join(map(str, run['schemas'])))}.</p>")
        out.append("<p>" + "<br>".join(e(v) for v in versions_line(run)) + "</p>")
        if run["advice"]:
            out.append('<h3>Advice</h3><ul class="advice">' + "".join(f"<li>{e(a['text'])}</li>" for a in run["advice"])
                       + "</ul>")
        if run["notes"]:
            out.append('<ul class="notes">' + "".join(f"<li>{e(n)}</li>" for n in run["notes"]) + "</ul>")
        h = run["highest"]
        out.append(f"<p>Highest peak: {e(who(h, run) or 'device ' + str(h['device']))}, "
                   f"{e(mib(h['alloc_peak']))} MiB allocated, {e(mib(h['resv_peak']))} MiB reserved. Memory grows: "
                   + (e("; ".join(f"{who(s, run) or 'device ' + str(s['device'])}: {trend_text(s)}"
                                  for s in run["growing"])) if run["growing"] else e(no_growth(run))) + ".</p>")
        out.append("<h3>Per rank</h3>" if run["ranked"] else "<h3>Per device</h3>")
        rows = [[s["label"], s["host"], str(s["pid"]), str(s["device"]), str(len(s["epochs"])), mib(s["alloc_peak"]),
                 mib(s["resv_peak"]), fnum(ratio(s["resv_peak"], s["alloc_peak"])), fnum(s["frag_max"]),
                 "n/a" if s["trend"]["growth"] is None else f"{s['trend']['growth'] / MiB:+.1f}", s["trend"]["verdict"],
                 growing_sites_text(s)] for s in run["streams"]]
        out.append(html_table(["stream", "host", "pid", "dev", "epochs", "alloc_peak MiB", "resv_peak MiB",
                               "resv/alloc", "frag_max", "growth MiB/epoch", "verdict", "growing sites"], rows,
                              "ranks", left=("stream", "host", "verdict", "growing sites")))
        fig = Figure(FIG_W, run_height(run))
        fig.rect(0, 0, fig.w, fig.h, "#ffffff")
        draw_run(fig, run, 0)
        out.append('<h3>Charts</h3><div class="charts">' + to_svg(fig, standalone=False) + "</div>")
        out.append("<h3>Epochs</h3>")
        rows = [dict(zip(DETAIL_HEADERS, detail_row(r))) for s in run["streams"] for r in s["recs"]]
        for cls, cols in HTML_EPOCH_TABLES:
            out.append(html_table(cols, [[row[c] for c in cols] for row in rows], cls, left=("host", "kind", "reason")))
        # issue 24/31: what memshim cost, from each stream's last report, as the text report says it
        cost = [(s, s["recs"][-1]) for s in run["streams"] if s["recs"]]
        out.append("<h3>memshim's own cost</h3><ul class=\"cost\">" + "".join(
            f"<li>memshim's own cost{e(' (' + who(s, run) + ')') if len(run['streams']) > 1 else ''}, "
            f"{e(last['kind'])} report: {e(overhead_text(last['overhead']))}</li>" for s, last in cost) + "</ul>")
        out.append("<h3>Sites at the peak</h3>")
        for s in run["streams"]:
            si = s["sites"]
            cap = f"{who(s, run) or 'device ' + str(s['device'])}"
            if not si["sites"]:
                what = "n/a" if si["sites"] is None else "none"
                out.append(f'<p class="na">{e(cap)}: {what} ({e(si["note"] or "")})</p>')
                continue
            out.append(f"<p>{e(cap)}, epoch {si['epoch']}, peak allocated "
                       f"{e(mib(si['allocated_peak_bytes']))} MiB:</p>")
            rows = [[mib(x["bytes"]), fnum(ratio(x["bytes"], si["allocated_peak_bytes"])),
                     "n/a" if x["count"] is None else str(x["count"]), site_name(x)]
                    for x in sorted(si["sites"], key=lambda x: -x["bytes"])]
            out.append(html_table(["MiB", "share", "count", "site"], rows, "sites", left=("site",)))
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---- main ---------------------------------------------------------------------------------------

def write_out(path, data):
    try:
        mode = "wb" if isinstance(data, bytes) else "w"
        with open(path, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            f.write(data)
        note(f"wrote {path}")
        return True
    except OSError as e:
        note(f"cannot write {path}: {e.strerror or e}")
        return False


def main(argv):
    ap = argparse.ArgumentParser(prog=PROG, add_help=False, usage=__doc__.split("\n\n")[1].split("usage: ")[1])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("-h", "--help", action="store_true")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true")
    g.add_argument("--csv", action="store_true")
    ap.add_argument("--plot", metavar="OUT")
    ap.add_argument("--plot-engine", choices=("auto", "matplotlib", "builtin"), default="auto")
    ap.add_argument("--html", metavar="OUT")
    ap.add_argument("--tensorboard", metavar="LOGDIR")
    ap.add_argument("--per-process", action="store_true")
    args = ap.parse_args(argv)
    if args.help:
        print(__doc__.strip())
        return 0
    if not args.paths:
        ap.error("no report directory or file given")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in (".png", ".svg"):
        ap.error(f"--plot {args.plot}: the name must end in .png or .svg")
    recs, skipped, warnings = load(args.paths)
    for p, why in skipped:
        note(f"skipping {p}: {why}")
    for p, why in warnings:
        note(f"{p}: {why}")
    if not recs:
        note(f"no memshim reports in {', '.join(args.paths)}")
        return 1
    runs = analyse(recs)
    if args.json:
        sys.stdout.write(json.dumps(to_json(runs, args.paths, len(recs), skipped, warnings), indent=1) + "\n")
    elif args.csv:
        buf = io.StringIO()
        write_csv(runs, buf)
        sys.stdout.write(buf.getvalue())
    else:
        sys.stdout.write(text_report(runs, args, len(recs), len([s for s in skipped])))
    ok = True
    if args.plot:
        fmt = "png" if args.plot.lower().endswith(".png") else "svg"
        mpl = matplotlib_version() if args.plot_engine != "builtin" else None
        if args.plot_engine == "matplotlib" and not mpl:
            note("--plot-engine matplotlib: matplotlib cannot be imported here; drawing with the built-in renderer")
        data = None
        if mpl:
            try:
                data = to_matplotlib(runs, fmt)
            except Exception as e:  # noqa: BLE001 - a matplotlib failure must not lose the chart
                note(f"matplotlib {mpl} failed ({type(e).__name__}: {e}); drawing with the built-in renderer")
        if data is None:
            fig = figure_for(runs)
            data = to_png(fig) if fmt == "png" else to_svg(fig)
        ok &= write_out(args.plot, data)
    if args.html:
        ok &= write_out(args.html, to_html(runs, args.paths, len(recs), skipped))
    if args.tensorboard:
        done, msg = to_tensorboard(runs, args.tensorboard)
        note(msg)
        ok &= done
    return 0 if ok else 1


def run(argv):
    """main() with a closed pipe (`memshim-report DIR | head`) ending quietly: the exit status."""
    try:
        return main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console_main():
    """The `memshim-report` console script of the pip package."""
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
