#!/usr/bin/env python3
"""Summarise memshim's JSON reports (docs/reports.md) as a table, CSV, or a plot.

usage: memshim_report.py DIR [--csv] [--plot OUT.png]

Reads every memshim-*.json in DIR (epoch reports, summaries, OOM reports), groups them by
process and device, and prints one row per epoch: peak allocated, peak reserved, their ratio,
fragmentation, map/unmap work and OOMs, then a trend verdict (allocated memory at the end of each
epoch rising every epoch hints at a leak). Files that are not valid reports are named and skipped.
Needs only the Python standard library; --plot needs matplotlib.
"""
import glob
import json
import os
import sys

MiB = 1024.0 * 1024.0


def load(directory):
    reports, bad = [], []
    for path in sorted(glob.glob(os.path.join(directory, "memshim-*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
            if not isinstance(r, dict) or r.get("schema_version") not in (1, 2) or "memory" not in r:
                raise ValueError("not a memshim report of schema 1")
            r["_row"] = row(r)  # every field the table needs, checked here
            if not all(isinstance(r["_row"][k], int) for k in ("pid", "device", "epoch")):
                raise ValueError("pid, device or epoch is not an integer")
            r["_path"] = path
            reports.append(r)
        except (OSError, ValueError, KeyError, TypeError) as e:
            bad.append((path, f"{type(e).__name__}: {e}"))
    return reports, bad


def run_or(what, r):
    key = f"{what}_run_peak_bytes"
    return key if r["kind"] == "summary" and key in r["memory"] else f"{what}_peak_bytes"


def row(r):
    m, o, f = r["memory"], r["operations"], r["fragmentation"]
    return {
        "pid": r["pid"], "rank": r["rank"], "device": r["device"], "kind": r["kind"],
        "epoch": r["epoch"], "reason": r["reason"], "steps": r["steps"],
        "alloc_end_mib": m["allocated_bytes"] / MiB,
        # a summary covers the whole run: its peaks are the run's, not the last partial epoch's
        "alloc_peak_mib": m[run_or("allocated", r)] / MiB,
        "reserved_peak_mib": m[run_or("reserved", r)] / MiB,
        "peak_ratio": (m[run_or("reserved", r)] / m[run_or("allocated", r)]) if m[run_or("allocated", r)] else 0.0,
        "frag": f["free_extent_fragmentation"],
        "maps": o["map_ops"], "unmaps": o["unmap_ops"], "reclaimed": o["reclaimed_pages"],
        "ooms": r["oom"]["oom_events"],
    }


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    directory = argv[1]
    if not os.path.isdir(directory):
        print(f"memshim_report: '{directory}' is not a directory", file=sys.stderr)
        return 2
    reports, bad = load(directory)
    for path, why in bad:
        print(f"memshim_report: skipping {path}: {why}", file=sys.stderr)
    if not reports:
        print(f"memshim_report: no memshim reports in {directory}", file=sys.stderr)
        return 1
    rows = [r["_row"] for r in reports]
    rows.sort(key=lambda x: (x["pid"], x["device"], x["kind"] != "epoch", x["epoch"]))
    if "--csv" in argv:
        keys = list(rows[0].keys())
        print(",".join(keys))
        for x in rows:
            print(",".join(str(x[k]) for k in keys))
        return 0
    hdr = f"{'pid':>7} {'dev':>3} {'kind':>7} {'epoch':>5} {'reason':>7} {'alloc_end':>10} {'alloc_peak':>10} {'resv_peak':>10} {'resv/alloc':>10} {'frag':>6} {'maps':>6} {'unmaps':>6} {'reclaim':>7} {'ooms':>4}"
    print(hdr)
    print("-" * len(hdr))
    for x in rows:
        print(f"{x['pid']:>7} {x['device']:>3} {x['kind']:>7} {x['epoch']:>5} {x['reason']:>7} "
              f"{x['alloc_end_mib']:>8.1f}Mi {x['alloc_peak_mib']:>8.1f}Mi {x['reserved_peak_mib']:>8.1f}Mi "
              f"{x['peak_ratio']:>10.3f} {x['frag']:>6.3f} {x['maps']:>6} {x['unmaps']:>6} {x['reclaimed']:>7} {x['ooms']:>4}")
    # Trend: allocated bytes at the end of each epoch, per process and device.
    groups = {}
    for x in rows:
        if x["kind"] == "epoch":
            groups.setdefault((x["pid"], x["device"]), []).append(x["alloc_end_mib"])
    for (pid, dev), ends in sorted(groups.items()):
        if len(ends) < 3:
            verdict = "too few epochs for a trend"
        elif all(b > a + 1.0 for a, b in zip(ends, ends[1:])):
            verdict = f"allocated memory grows every epoch ({ends[0]:.1f} -> {ends[-1]:.1f} MiB): possible leak"
        else:
            verdict = "flat: no sign of a leak"
        print(f"trend pid {pid} device {dev}: {verdict}")
    if "--plot" in argv:
        i = argv.index("--plot")
        out = argv[i + 1] if i + 1 < len(argv) else "memshim.png"
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("memshim_report: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        ep = [x for x in rows if x["kind"] == "epoch"]
        plt.plot([x["epoch"] for x in ep], [x["alloc_peak_mib"] for x in ep], label="peak allocated")
        plt.plot([x["epoch"] for x in ep], [x["reserved_peak_mib"] for x in ep], label="peak reserved")
        plt.xlabel("epoch")
        plt.ylabel("MiB")
        plt.legend()
        plt.savefig(out)
        print(f"memshim_report: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
