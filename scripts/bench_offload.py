#!/usr/bin/env python3
"""make bench, the section "Synthetic offload/reload traces": the steady state on SYNTHETIC traces
written by scripts/gen_offload_trace.py (no real trace of that workload exists), measured exactly as section 3 measures the real traces: the
minimum capacity C from `memshim-replay --json --capacity auto`, then `--json --passes 3
--capacity CAP` at C, C+0.5% and C+1% (each rounded up to a 2 MiB page); map+unmap of pass 2 is
steady_map_ops + steady_unmap_ops less the last pass's, pass 3 is last_pass_map_ops +
last_pass_unmap_ops, and the driver seconds are the last pass's modelled steady_driver_seconds.

Usage: scripts/bench_offload.py [--no-header] [--page-model] REPLAY LABEL=TRACE...
Prints the markdown table (one row per trace) and a closing line: how many traces still map or
unmap after the first pass at C, C+0.5% and C+1%. REPLAY may be an older build of memshim-replay
(every field read here exists since f6166e1, the commit before issue 10's pool rewrite).
--page-model adds the page model's minimum capacity (`--max-handle 2MiB`: one handle per page,
issue 15), found the same way by the same REPLAY (memshim-replay since b471a51), and a closing
count of the traces where the pool's minimum is above it. Any trace works (the held-out-like
transformations of scripts/gen_heldout_traces.py too).
"""
import json
import math
import subprocess
import sys

PAGE, MiB = 2 * 2**20, 2**20

HEADER = ("| trace (synthetic) | peak live (MiB) | C (MiB) | C / live | pass 1 map+unmap at C | at C: pass 2 / pass 3 "
          "| driver s, pass 3 | at C+0.5% | driver s | at C+1% | driver s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def replay(exe, *args):
    p = subprocess.run([exe, "--json", *args], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in p.stdout.splitlines()][0]


def row(exe, trace, label, churn, page=None):
    d = replay(exe, "--capacity", "auto", trace)
    cmin, live = d["min_capacity_bytes"], d["peak_live_bytes"]
    pcell = ""
    if page is not None:
        cp = replay(exe, "--capacity", "auto", "--max-handle", "2MiB", trace)["min_capacity_bytes"]
        page.append(cmin > cp)
        pcell = f" {cp / MiB:.0f} |"
    cells, first = [], None
    for i, f in enumerate((1.0, 1.005, 1.01)):
        cap = math.ceil(cmin * f / PAGE) * PAGE
        s = replay(exe, "--passes", "3", "--capacity", str(cap), trace)
        if first is None:
            first = s["map_ops"] + s["unmap_ops"]
        last = s["last_pass_map_ops"] + s["last_pass_unmap_ops"]
        p2 = s["steady_map_ops"] + s["steady_unmap_ops"] - last
        churn[i] += (p2 > 0 or last > 0)
        oom = f", {s['steady_ooms']} OOM" if s["steady_ooms"] else ""
        cells.append(f"{p2} / {last}{oom} | {s['steady_driver_seconds']:.3f}")
    return (f"| {label} | {live / MiB:.0f} | {cmin / MiB:.0f} |{pcell} {cmin / live:.4f} | {first} | "
            + " | ".join(cells) + " |")


if __name__ == "__main__":
    argv = sys.argv[1:]
    header = "--no-header" not in argv
    page = [] if "--page-model" in argv else None
    argv = [a for a in argv if a not in ("--no-header", "--page-model")]
    if len(argv) < 2 or not all("=" in a for a in argv[1:]):
        sys.exit(__doc__)
    if header:
        h = HEADER
        if page is not None:
            h = h.replace("| C (MiB) |", "| C (MiB) | page model C (MiB) |", 1).replace("|---:|---:|", "|---:|---:|---:|", 1)
        print(h)
    churn = [0, 0, 0]
    for a in argv[1:]:
        label, trace = a.split("=", 1)
        print(row(argv[0], trace, label, churn, page))
    print()
    print(f"synthetic traces that still map or unmap after the first pass: {churn[0]} of {len(argv) - 1} at C, "
          f"{churn[1]} at C+0.5%, {churn[2]} at C+1%")
    if page is not None:
        print(f"traces whose minimum capacity is above the page model's: {sum(page)} of {len(page)}")
