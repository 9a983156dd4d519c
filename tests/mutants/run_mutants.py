#!/usr/bin/env python3
"""make mutants: the mutation run (issue 12, docs/testing.md).

Each mutant of tests/mutants/mutants.txt (a file, the exact original text, its replacement: one
realistic one-line bug) is applied to a scratch copy of the working tree, built, and run against
the quick suites until one fails (killed) or all pass (survived); then it is reverted. The scratch
copy lives in a temporary directory beside a link to ../shared (the traces), is built once, and is
rebuilt incrementally per mutant. Before any mutant, the unmutated copy must pass every suite,
or nothing below would mean anything.

A spec whose text is no longer in its file is STALE, one whose text is there twice AMBIGUOUS,
one whose mutant does not compile BUILD-FAILED: each is reported and fails the run, never
skipped quietly (the code moves under the specs; fix the spec). A hang is a kill: the per-test
watchdogs of tests/harness.h and tests/pyharness.py name the test that hung within a minute; a
suite that still runs past its backstop is killed and reported as "hung (backstop)".

    tests/mutants/run_mutants.py [--only ID[,ID...]] [--list] [--keep] [--report FILE]

Prints one line per mutant, then a markdown table (also written to build/mutants/report.md) and
the kill rate: killed / (killed + survived), pending mutants apart. Exit status 0 when the kill
rate is at least 95%, every survivor is accepted in its spec with a reason, and no spec is stale,
ambiguous or unbuildable; else 1."""
import argparse
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = os.path.join(ROOT, "tests", "mutants", "mutants.txt")
KILL_RATE_MIN = 0.95
# A mutant can make a program allocate without end (a loop that never exits while it leaks); on a
# shared machine that must end as a failed allocation, not as the machine's OOM killer. Private
# writable memory only (RLIMIT_DATA): the driver double's huge PROT_NONE reservations and its
# shared memfd mappings do not count. Above 8 GiB: test_oom's device is the 8 GiB one,
# and its cuMemAlloc of 7 GiB ("another allocator") is private memory of the double, never
# touched (at 6 GiB the unmutated test_oom failed there, and the run stopped before any mutant).
DATA_LIMIT = 12 << 30

# The quick suites: every unit binary of build/tests, then every suite tests/run.sh runs on the
# plain build (read from its run_suite lines, so a suite added there is mutated against too),
# except the fuzzers (time-bounded and random). Each gets a backstop far above its run time; the
# per-test watchdogs fire long before. Mutants of a file try first the suites meant for it.
UNIT_FIRST = {
    "test_pool": ("policy/pool/", "policy/dev_sim.c"), "test_stress": ("policy/pool/", "policy/dev_cuda.c"),
    "test_oom": ("policy/pool/",),
    "test_trace": ("report/trace/",), "test_profiler": ("report/trace/profiler.c", "report/trace/trace.c"),
    "test_models": ("report/replay/models/",), "test_options": ("policy/base/options.c", "policy/base/log.c"),
    "test_double": ("tests/cudadouble/",), "test_drvcost": ("policy/drvcost.c",), "test_torch": ("shim/torch.c",),
    "test_limits": ("policy/pool/pool.c", "policy/pool/pages.c", "shim/torch.c"),
}
SCRIPT_FIRST = [  # (word in the suite's name, files whose mutants try it first)
    ("preload", ("hooks/", "shim/", "policy/dev_cuda.c", "policy/base/drvlog.c")),
    ("--check", ("policy/pool/", "report/replay/", "report/replay/models/policy_memshim.c")),
    ("replay", ("report/replay/", "report/trace/", "report/replay/models/")),
    ("demo", ("shim/", "report/report.c")),
    ("reports", ("report/report.c", "shim/core.c", "policy/pool/")),
    ("report tool", ("report/report.c", "report/identity.c", "hooks/python/memshim/report.py")),
    ("report page", ("hooks/python/memshim/report.py",)),
    ("bench plan", ("tests/gpu/",)),
    ("GC", ("shim/core.c",)),
    ("pytorch", ("shim/torch.c", "hooks/python/")),
    ("reliability", ("hooks/", "policy/dev_cuda.c")),
]


def discover_suites(repo):
    suites = []
    for t in sorted(os.listdir(os.path.join(repo, "build", "tests"))):
        path = os.path.join("build", "tests", t)
        if t.startswith("test_") and os.access(os.path.join(repo, path), os.X_OK) and os.path.isfile(
                os.path.join(repo, path)):
            suites.append((f"unit {t}", [path], 180, UNIT_FIRST.get(t, ())))
    for line in open(os.path.join(repo, "tests", "run.sh")):
        m = re.match(r'^\s*(?:\[ -f \S+ \] && )?run_suite "([^"]+)" env BUILD="\$BUILD" (.+?)\s*$', line)
        if not m or "fuzz" in m.group(1) or m.group(2).endswith("\\"):
            continue
        name = m.group(1)
        first = next((files for word, files in SCRIPT_FIRST if word in name), ())
        # real PyTorch jobs and a pip install take minutes each on a loaded 2-core machine, and so
        # do the replay targets (about 5 minutes idle: at 300 s the unmutated run was called hung)
        slow = any(w in name for w in ("reliability", "scenarios", "pip package", "replay (CLI"))
        suites.append((name, shlex.split(m.group(2)), 900 if slow else 300, first))
    return suites


SUITES = []


def parse_specs(path):
    specs, cur, key = [], None, None
    for n, raw in enumerate(open(path, encoding="utf-8"), 1):
        line = raw.rstrip("\n")
        if not line.strip() or line.startswith("#"):
            key = None
            continue
        m = re.match(r"^\[([A-Za-z0-9_.-]+)\]$", line)
        if m:
            cur = {"id": m.group(1), "line": n}
            specs.append(cur)
            key = None
            continue
        m = re.match(r"^\s+\| ?(.*)$", line)
        if m and cur is not None and key in ("find", "replace"):
            cur[key] += "\n" + m.group(1)
            continue
        m = re.match(r"^(file|find|replace|bug|pending|accepted):\s?(.*)$", line)
        if not m or cur is None:
            raise SystemExit(f"{path}:{n}: cannot read '{line}'")
        key = m.group(1)
        cur[key] = m.group(2)
    ids = [s["id"] for s in specs]
    for s in specs:
        for k in ("file", "find", "replace", "bug"):
            if k not in s:
                raise SystemExit(f"{path}:{s['line']}: mutant [{s['id']}] has no '{k}:'")
        if ids.count(s["id"]) > 1:
            raise SystemExit(f"{path}:{s['line']}: mutant id [{s['id']}] is used twice")
        if s["find"] == s["replace"]:
            raise SystemExit(f"{path}:{s['line']}: mutant [{s['id']}] changes nothing")
    return specs


def limit_data():
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))


CHILD = {}  # the process group running now, killed if the run itself is stopped


def sh(cmd, cwd, timeout, env=None):
    """Run cmd in its own process group, its memory capped; kill the whole group past the timeout."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, errors="replace", start_new_session=True, preexec_fn=limit_data)
    CHILD["p"] = p
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out, time.monotonic() - t0, False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -9, out, time.monotonic() - t0, True
    finally:
        CHILD.pop("p", None)


def stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def copy_tree(dst):
    """The working tree as it is (tracked and untracked-but-not-ignored files), not HEAD."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        f = f.decode()
        src = os.path.join(ROOT, f)
        if not os.path.isfile(src):
            continue  # deleted in the working tree
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, f))


def suite_failed(rc, out, timed_out):
    """None when the suite passed, else a short description of what failed."""
    if timed_out:
        return "hung (backstop: no watchdog named a test)"
    last = re.findall(r"(\d+) passed, (\d+) failed", out)
    failed = int(last[-1][1]) if last else None
    if rc == 0 and failed == 0:
        return None
    fails = [l.strip() for l in out.splitlines() if re.match(r"^\s*(\|\s*)?FAIL\b", l)]
    fails = [re.sub(r"^\|\s*", "", f) for f in fails]
    why = "; ".join(f[:160] for f in fails[:2]) or f"exit {rc}, no FAIL line (last: {out.strip()[-160:]!r})"
    return why


def run_suites(repo, env, first_for=None):
    """Suites in order (those meant for `first_for` first) until one fails. Returns (suite, why)
    for the first failure, or (None, None)."""
    order = list(SUITES)
    if first_for:
        order.sort(key=lambda s: 0 if any(first_for.startswith(p) for p in s[3]) else 1)
    for name, cmd, backstop, _ in order:
        if cmd[0].startswith("build/") and not os.path.exists(os.path.join(repo, cmd[0])):
            continue
        rc, out, dt, to = sh(cmd, repo, backstop, env)
        why = suite_failed(rc, out, to)
        if why:
            return name, why, out
    return None, None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--list", action="store_true", help="check and list the specs, run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--report", default=os.path.join(ROOT, "build", "mutants", "report.md"))
    a = ap.parse_args()
    specs = parse_specs(SPECS)
    if a.only:
        want = set(a.only.split(","))
        unknown = want - {s["id"] for s in specs}
        if unknown:
            raise SystemExit(f"unknown mutant id(s): {', '.join(sorted(unknown))}")
        specs = [s for s in specs if s["id"] in want]
    for s in specs:  # stale or ambiguous against the working tree as it is now
        path = os.path.join(ROOT, s["file"])
        text = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        n = text.count(s["find"]) if text is not None else 0
        s["status"] = "ok" if n == 1 else "STALE" if n == 0 else "AMBIGUOUS"
        if text is None:
            s["why"] = f"{s['file']} does not exist"
        elif n != 1:
            s["why"] = f"the text is in {s['file']} {n} times (must be exactly once)"
    if a.list:
        for s in specs:
            print(f"{s['status']:9} {s['id']:45} {s['file']}" + (f"  ({s['why']})" if s["status"] != "ok" else ""))
        return 0 if all(s["status"] == "ok" for s in specs) else 1

    signal.signal(signal.SIGTERM, stop)
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="memshim-mutants-")
    try:
        return run_all(a, specs, tmp, t_start)
    except KeyboardInterrupt as e:
        p = CHILD.get("p")
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        print(f"mutants: stopped ({e})", file=sys.stderr)
        return 130
    finally:
        if a.keep:
            print(f"mutants: scratch copy kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run_all(a, specs, tmp, t_start):
    repo = os.path.join(tmp, "memshim")
    print(f"mutants: scratch copy in {repo}", flush=True)
    copy_tree(repo)
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(tmp, "shared"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
    env.update(BUILD="build", FUZZ_SECONDS="5")
    rc, out, dt, _ = sh(["make", "-j2", "tests"], repo, 1800, env)
    if rc:
        print(out[-3000:])
        raise SystemExit("mutants: the unmutated scratch copy does not build")
    SUITES[:] = discover_suites(repo)
    print(f"mutants: built the scratch copy in {dt:.0f} s; {len(SUITES)} suites: " +
          ", ".join(n for n, _, _, _ in SUITES), flush=True)
    print("mutants: running every suite on it unmutated", flush=True)
    t0 = time.monotonic()
    name, why, out = run_suites(repo, env)
    if name:
        print(out[-3000:])
        raise SystemExit(f"mutants: the UNMUTATED code fails suite '{name}': {why}; fix that first")
    baseline = time.monotonic() - t0
    print(f"mutants: every suite passes unmutated ({baseline:.0f} s)", flush=True)

    for i, s in enumerate(specs, 1):
        t0 = time.monotonic()
        if s["status"] != "ok":
            print(f"[{i}/{len(specs)}] {s['id']}: {s['status']}: {s['why']}", flush=True)
            s["secs"] = 0
            continue
        path = os.path.join(repo, s["file"])
        orig = open(path, encoding="utf-8").read()
        open(path, "w", encoding="utf-8").write(orig.replace(s["find"], s["replace"], 1))
        try:
            brc, bout, _, _ = sh(["make", "-j2", "tests"], repo, 900, env)
            if brc:
                s["status"], s["why"] = "BUILD-FAILED", " ".join(
                    l.strip() for l in bout.splitlines() if "error" in l)[:200]
            else:
                suite, why, _ = run_suites(repo, env, s["file"])
                if suite:
                    s["status"], s["by"], s["why"] = "killed", suite, why
                else:
                    s["status"] = "survived"
                    s["why"] = s.get("pending") or s.get("accepted") or "NOT EXPLAINED: add a test, or 'accepted:' with a reason"
        finally:
            open(path, "w", encoding="utf-8").write(orig)
        if s["status"] == "killed" and s.get("pending"):
            s["note"] = "pending no more: remove 'pending:' from its spec"
        s["secs"] = time.monotonic() - t0
        print(f"[{i}/{len(specs)}] {s['id']}: {s['status']}"
              + (f" by {s['by']}: {s['why']}" if s["status"] == "killed" else f": {s.get('why', '')}")
              + f" ({s['secs']:.0f} s)", flush=True)
    # one last build so the scratch copy ends unmutated (and --keep leaves a usable tree)
    sh(["make", "-j2", "tests"], repo, 900, env)

    killed = [s for s in specs if s["status"] == "killed"]
    surv = [s for s in specs if s["status"] == "survived" and not s.get("pending")]
    pending = [s for s in specs if s["status"] == "survived" and s.get("pending")]
    broken = [s for s in specs if s["status"] in ("STALE", "AMBIGUOUS", "BUILD-FAILED")]
    counted = len(killed) + len(surv)
    rate = len(killed) / counted if counted else 0.0
    total = time.monotonic() - t_start
    lines = ["| # | mutant | file | result | killed by / reason | s |", "|---|---|---|---|---|---|"]
    for i, s in enumerate(specs, 1):
        res = s["status"] + (" (pending)" if s.get("pending") and s["status"] == "survived" else "")
        detail = f"{s['by']}: {s['why']}" if s["status"] == "killed" else s.get("why", "")
        if s.get("note"):
            detail += f" ({s['note']})"
        detail = detail.replace("|", "/")
        lines.append(f"| {i} | {s['id']} | {s['file']} | {res} | {detail[:220]} | {s.get('secs', 0):.0f} |")
    lines.append("")
    lines.append(f"{len(specs)} mutants: {len(killed)} killed, {len(surv)} survived, {len(pending)} pending "
                 f"(survived, waiting for what they need), {len(broken)} stale/ambiguous/unbuildable. "
                 f"Kill rate {len(killed)}/{counted} = {100 * rate:.1f}% (pending apart; at least "
                 f"{100 * KILL_RATE_MIN:.0f}% required).")
    lines.append(f"Run time {total / 60:.1f} min on {os.cpu_count()} CPUs (scratch build and the unmutated "
                 f"baseline {baseline:.0f} s included).")
    for s in surv:
        lines.append(f"- survivor {s['id']}: {s['why']}")
    for s in pending:
        lines.append(f"- pending {s['id']}: {s['pending']}")
    report = "\n".join(lines)
    print("\n" + report)
    os.makedirs(os.path.dirname(a.report), exist_ok=True)
    with open(a.report, "w") as f:
        f.write(report + "\n")
    ok = rate >= KILL_RATE_MIN and not broken and all(s.get("accepted") for s in surv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
