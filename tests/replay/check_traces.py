#!/usr/bin/env python3
"""memshim-replay --check over every trace in ../shared/traces (issue 12, docs/testing.md).

--check runs msh_pool_check(), the pool's structural invariants, during the replay: after every
event of short streams, periodically (and at every pass end) in long ones. Every trace is replayed
with no limit (the default run: first pass, then the timing passes); the small ones (at most
SMALL_EVENTS events) also at the smallest capacity that fits (--capacity auto --passes 2: pages are
reclaimed and remapped, then the steady second pass) and at 90% of their live peak, where requests
fail and the rescue chain runs. A violation makes memshim-replay exit 3 and name the event; each
run here is one case. For the small traces, the memshim column of --compare (the policy runner of
report/replay/models/policy_memshim.c) must also equal what the plain replay found on its own code path:
the minimum capacity, the unlimited peak and the maps at the minimum. Skips with a clear message
when the traces are absent.
Ends with "N passed, N failed, N skipped"."""
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, TRACES, case, finish, skip, step  # noqa: E402

REPLAY = os.path.join(BUILD, "memshim-replay")
SMALL_EVENTS = 5000
JOBS = int(os.environ.get("CHECK_TRACES_JOBS", "2"))


def replay(*args, check=True):
    t0 = time.monotonic()
    p = subprocess.run([REPLAY, *(["--check"] if check else []), "--json", *args], capture_output=True,
                       text=True, timeout=45)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return p, rows, time.monotonic() - t0


def verdict(label, run):
    p, rows, dt = run
    broken = [line for line in p.stderr.splitlines() if "--check" in line]
    ok = p.returncode == 0 and rows and not broken
    case(f"{label} ({dt:.1f} s)", ok, f"exit {p.returncode}: {' '.join(broken) or p.stderr[-400:]}")
    return rows if ok else []


def traces():
    out = []
    for d, _, files in os.walk(TRACES):
        for f in sorted(files):
            if f.endswith((".pickle", ".json", ".json.gz", ".txt")) and f != "manifest.json":
                out.append(os.path.join(d, f))
    return sorted(out)


def main():
    if not os.access(REPLAY, os.X_OK):
        case("memshim-replay is built", False, f"{REPLAY} missing (make)")
        finish()
    p = subprocess.run([REPLAY, "--check", "--compare", "/dev/null"], capture_output=True, text=True, timeout=30)
    case("--check is refused with --compare (it verifies memshim's pool only)",
         p.returncode == 2 and "--check" in p.stderr, p.stderr[-300:])
    files = traces() if os.path.isdir(TRACES) else []
    if not files:
        skip("memshim-replay --check over ../shared/traces", f"no traces in {TRACES}")
        finish()
    rel = lambda f: os.path.relpath(f, TRACES)  # noqa: E731
    step("memshim-replay --check, unlimited, over every trace", timeout=45 * len(files) / JOBS + 30)
    with cf.ThreadPoolExecutor(JOBS) as pool:
        first = dict(zip(files, pool.map(lambda f: replay(f), files)))
        small = []
        for f in files:
            for row in verdict(f"--check {rel(f)}: invariants hold (no limit)", first[f]):
                if 0 < row["events"] <= SMALL_EVENTS:
                    small.append((f, row))
        step("memshim-replay --check under pressure (small traces)", timeout=45 * len(small) / JOBS + 30)
        jobs = {}
        for f, row in small:
            jobs[(f, row["device"], "auto")] = pool.submit(replay, "--capacity", "auto", "--passes", "2", f)
            cap = max(row["peak_live_bytes"] * 9 // 10 // 2**20, 2)
            jobs[(f, row["device"], "90%")] = pool.submit(replay, "--capacity", f"{cap}MiB", f)
        compare = {f: pool.submit(replay, "--compare", f, check=False) for f in {f for f, _ in small}}
        auto_rows = {}
        for (f, dev, what), fut in jobs.items():
            rows = [r for r in verdict(f"--check {rel(f)} dev {dev}: invariants hold at "
                                       f"{'the minimum capacity, 2 passes' if what == 'auto' else '90% of peak live'}",
                                       fut.result()) if r["device"] == dev]
            if what == "90%" and rows:
                case(f"  {rel(f)} dev {dev} at 90% of peak live really failed requests (the OOM path ran)",
                     rows[0]["ooms"] > 0, rows[0])
            if what == "auto" and rows:
                auto_rows[(f, dev)] = rows[0]
        step("--compare's memshim column against the plain replay (small traces)")
        for f, fut in sorted(compare.items()):
            p, rows, dt = fut.result()
            for row in rows:
                plain = auto_rows.get((f, row["device"]))
                if plain is None:
                    continue
                m = row["policies"]["memshim"]
                want = {"min_capacity_bytes": plain["min_capacity_bytes"],
                        "unlimited_peak_reserved_bytes": plain["unlimited_peak_reserved_bytes"],
                        "map_ops": plain["map_ops"], "unmap_ops": plain["unmap_ops"]}
                diff = {k: (m.get(k), v) for k, v in want.items() if m.get(k) != v}
                case(f"--compare {rel(f)} dev {row['device']}: memshim's column equals the plain replay "
                     f"(minimum {plain['min_capacity_bytes'] >> 20} MiB)", p.returncode == 0 and not diff,
                     diff or p.stderr[-300:])
    finish()


main()
