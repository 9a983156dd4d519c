#!/usr/bin/env python3
"""The SYNTHETIC offload/reload trace generator (scripts/gen_offload_trace.py) keeps writing a trace
that memshim-replay reads without repairs, and the pool keeps its invariants replaying it
(`--check`) with no limit and at its minimum capacity over 3 passes, where it reclaims and remaps;
and at C+1% the learned step takes over by pass 3 (no map or unmap) on seeds 2, 7 and 8, where it
once failed. About ten seconds. Prints one line per case and the closing line."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, step  # noqa: E402

REPLAY = os.path.join(BUILD, "memshim-replay")
GEN = os.path.join(ROOT, "scripts", "gen_offload_trace.py")


def gen(path, *args):
    p = subprocess.run([sys.executable, GEN, "-o", path, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stderr


def replay(*args):
    p = subprocess.run([REPLAY, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


with tempfile.TemporaryDirectory() as tmp:
    step("generate the default trace")
    a, b = os.path.join(tmp, "a.txt"), os.path.join(tmp, "b.txt")
    rc1, e1 = gen(a)
    rc2, e2 = gen(b)
    case("generator runs", rc1 == 0 and rc2 == 0, e1 + e2)
    text = open(a).read()
    case("generator is deterministic (same arguments, same bytes)", text == open(b).read())
    case("the trace says it is synthetic", "SYNTHETIC" in text.splitlines()[1], text.splitlines()[1][:120])
    rc, _ = gen(b, "--seed", "2")
    case("another seed, another trace", rc == 0 and open(b).read() != text)
    rc, _ = gen(b, "--layers", "0")
    case("bad arguments are refused", rc == 2)

    cases = [("default (24 layers, prefetch, 3 steps)", a, []),
             ("seed 2 (churns at its minimum)", os.path.join(tmp, "s2.txt"), ["--seed", "2"]),
             ("6 layers, no prefetch, 2 steps", os.path.join(tmp, "small.txt"),
              ["--layers", "6", "--steps", "2", "--no-prefetch"])]
    for name, path, args in cases:
        step(f"{name}: replay", timeout=60)
        if path != a:
            gen(path, *args)
        nalloc = sum(1 for line in open(path) if line.startswith("a "))
        rc, out, err = replay("--json", "--capacity", "auto", path)
        try:
            d = json.loads(out.splitlines()[0])
            case(f"{name}: reads with no repair, every allocation replayed",
                 rc == 0 and d["warnings"] == 0 and d["allocs"] == nalloc and d["prefix_blocks"] == 5
                 and d["ooms"] == 0, f"rc={rc} {err.strip()} warnings={d.get('warnings')} allocs={d.get('allocs')}")
            cmin = d["min_capacity_bytes"]
            case(f"{name}: minimum capacity within 3% of peak live",
                 d["peak_live_bytes"] <= cmin <= 1.03 * d["peak_live_bytes"] + 4 * 2**20,
                 f"{cmin} vs {d['peak_live_bytes']}")
        except (ValueError, IndexError, KeyError) as e:
            case(f"{name}: replay output parses", False, f"{e}: {out[:200]!r} {err[-300:]!r}")
            continue
        for cap in (None, cmin):
            where = "no limit" if cap is None else "its minimum capacity"
            rc, out, err = replay("--check", "--json", "--passes", "3", *(["--capacity", str(cap)] if cap else []),
                                  path)
            try:
                d = json.loads(out.splitlines()[0])
                case(f"{name}: --check --passes 3 at {where}: invariants hold, no OOM",
                     rc == 0 and d["ooms"] == 0 and d["steady_ooms"] == 0, f"rc={rc} {err.strip()[-300:]}")
            except (ValueError, IndexError, KeyError) as e:
                case(f"{name}: --check at {where} output parses", False, f"rc={rc} {e}: {err[-300:]!r}")
        if path == a:
            # the learned step's counters (docs/replay.md): at C+1% the default trace maps nothing
            # in pass 3, so a plan places every allocation of its step there
            cap = -(-cmin * 101 // 100 // 2**21) * 2**21
            rc, out, err = replay("--json", "--passes", "3", "--capacity", str(cap), path)
            try:
                d = json.loads(out.splitlines()[0])
                keys = [p + k for p in ("", "steady_", "last_pass_") for k in ("plans_built", "plan_placed", "plan_dropped")]
                got = {k: d[k] for k in keys}
                per_pass = d["allocs"] + d["prefix_blocks"]  # the prefix is allocated again each pass
                case(f"{name}: --json prints the learned step's counters, consistent with the churn at C+1%",
                     rc == 0 and d["last_pass_map_ops"] + d["last_pass_unmap_ops"] == 0
                     and d["plans_built"] >= 1 and 0 < d["plan_placed"] <= d["allocs"]
                     and d["plan_dropped"] <= d["plans_built"]
                     # every allocation of the pass placed by a plan, but the prefix, which may come
                     # before the step's plan resumes (issue 15) and lands where it was
                     and d["allocs"] <= d["last_pass_plan_placed"] <= per_pass
                     and d["last_pass_plan_dropped"] <= d["last_pass_plans_built"]
                     and d["last_pass_plan_placed"] <= d["steady_plan_placed"] <= 2 * per_pass
                     and d["steady_plan_dropped"] <= d["steady_plans_built"] + 1, got)
            except (ValueError, IndexError, KeyError) as e:
                case(f"{name}: learned-step counters parse", False, f"rc={rc} {e}: {out[:300]!r} {err[-300:]!r}")

    # The learned step at C+1% on the seeds where it used to fail (docs/benchmarks.md, "Offload and
    # reload"): on seeds 2 and 8 no fixed packing order fit the limit (no plan: every pass remapped,
    # 3341 and 1012 map+unmap in pass 3), fixed by the perturbed orders of pack_search; on seed 7
    # the plan was dropped at each pass boundary and never came back (1340), fixed by resuming it.
    for seed in ("2", "7", "8"):
        name = f"seed {seed} at C+1%"
        step(f"{name}: the learned step", timeout=60)
        path = os.path.join(tmp, f"c{seed}.txt")
        gen(path, "--seed", seed)
        rc, out, err = replay("--json", "--capacity", "auto", path)
        try:
            cmin = json.loads(out.splitlines()[0])["min_capacity_bytes"]
            cap = -(-cmin * 101 // 100 // 2**21) * 2**21
            rc, out, err = replay("--check", "--json", "--passes", "3", "--capacity", str(cap), path)
            d = json.loads(out.splitlines()[0])
            case(f"{name}: pass 3 maps and unmaps nothing, every allocation of its step placed by the plan",
                 rc == 0 and d["steady_ooms"] == 0 and d["last_pass_map_ops"] + d["last_pass_unmap_ops"] == 0
                 and d["last_pass_plan_placed"] >= d["allocs"] and d["last_pass_plan_dropped"] <= 1,
                 f"rc={rc} pass 3: {d.get('last_pass_map_ops')} maps, {d.get('last_pass_unmap_ops')} unmaps; "
                 + str({k: v for k, v in d.items() if "plan" in k and "second" not in k}) + err.strip()[-300:])
        except (ValueError, IndexError, KeyError) as e:
            case(f"{name}: replay output parses", False, f"rc={rc} {e}: {out[:200]!r} {err[-300:]!r}")

finish()
