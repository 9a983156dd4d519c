#!/usr/bin/env python3
"""Fit the driver cost table (policy/drvcost.c) to the H200's measured VMM call times.

Reads scripts/drvcost_h200.json (p50 per call at handles of 2 MiB, 64 MiB and 2 GiB, and
cuMemSetAccess over 8 mappings at once) and fits, per call, time = per_call + per_mib * MiB
(+ per_mapping * mappings for cuMemSetAccess, the one call measured over several mappings), by
least squares on the relative residuals ((model - measured) / measured): the points span three
orders of magnitude, and a plain least-squares fit would follow the 2 GiB points and miss the
2 MiB ones, which are what the pool pays for most. Negative terms are not allowed (a term that
would come out negative is fixed at 0 and the others refitted). Prints the fit, the residual of
every point, and the C initializers drvcost.c holds (docs/benchmarks.md "Driver cost table").

    python3 scripts/fit_drvcost.py [scripts/drvcost_h200.json]
"""
import itertools
import json
import os
import sys


def solve(a, b):
    """Gaussian elimination with partial pivoting: a x = b (a square, small)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            raise ValueError("singular")
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def wls(rows, ys, free):
    """Least squares of the relative residuals over the columns in `free` (others fixed at 0)."""
    ws = [1.0 / y for y in ys]
    k = len(free)
    ata = [[sum((w * r[free[i]]) * (w * r[free[j]]) for r, w in zip(rows, ws)) for j in range(k)] for i in range(k)]
    atb = [sum((w * r[free[i]]) * (w * y) for r, w, y in zip(rows, ws, ys)) for i in range(k)]
    x = [0.0] * len(rows[0])
    for i, v in zip(free, solve(ata, atb)):
        x[i] = v
    return x


def fit(points, with_mappings):
    # columns: per_call, per_mib, per_mapping
    rows = [[1.0, mib, float(maps)] for maps, mib, _ in points]
    ys = [float(t) for _, _, t in points]
    cols = [0, 1, 2] if with_mappings else [0, 1]
    best = None
    # non-negative least squares by enumeration of the active set (three columns at most)
    for n in range(len(cols), 0, -1):
        for free in itertools.combinations(cols, n):
            try:
                x = wls(rows, ys, list(free))
            except ValueError:
                continue
            if min(x) < 0:
                continue
            err = sum(((sum(a * b for a, b in zip(r, x)) - y) / y) ** 2 for r, y in zip(rows, ys))
            if best is None or err < best[0] - 1e-15:
                best = (err, x)
        if best:
            break
    return best[1]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                              "drvcost_h200.json")
    data = json.load(open(path))
    out = {}
    print(f"source: {data['source']}")
    print("fit: least squares of relative residuals, terms >= 0\n")
    print("| kind | per call (us) | per MiB (us) | per mapping (us) | point (mappings x MiB) | measured (us) | modelled (us) | residual |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for kind, pts in data["points"].items():
        x = fit(pts, kind == "set_access")
        out[kind] = x
        for i, (maps, mib, t) in enumerate(pts):
            model = x[0] + x[1] * mib + x[2] * maps
            head = f"| `{kind}` | {x[0]:.4g} | {x[1]:.4g} | {x[2]:.4g}" if i == 0 else "| | | |"
            print(f"{head} | {maps} x {mib:g} | {t:g} | {model:.4g} | {100 * (model - t) / t:+.1f}% |")
    print()
    for kind, (lo, hi) in data["ranges_us"].items():
        print(f"{kind}: measured {lo:g}-{hi:g} us over handle sizes (no per-size figure): per call {hi:g} us (the top)")
        out[kind] = [hi, 0.0, 0.0]
    for kind, (us, why) in data.get("single_us", {}).items():
        print(f"{kind}: one per-call figure, no size term: {us:g} us ({why})")
        out[kind] = [us, 0.0, 0.0]
    for kind, (us, why) in data.get("not_measured_us", {}).items():
        print(f"{kind}: not measured on this machine: per call {us:g} us ({why})")
        out[kind] = [us, 0.0, 0.0]
    print("\nC initializers (policy/drvcost.c; us):")
    for kind, x in out.items():
        print(f"  {kind:11s} per_call {x[0]:.4g}  per_mib {x[1]:.4g}  per_mapping {x[2]:.4g}")


if __name__ == "__main__":
    main()
