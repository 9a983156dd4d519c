"""pyharness: what memshim's Python test scripts share (paths, case/skip bookkeeping, the closing
line that tests/run.sh adds up). Standard library only.

    sys.path.insert(0, <tests dir>); from pyharness import BUILD, TRACES, case, skip, finish
    ...
    finish()   # prints "N passed, N failed, N skipped" and exits 1 when anything failed
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
results = {"passed": 0, "failed": 0, "skipped": 0}


def case(name, ok, detail=""):
    """Record one check; a failure prints its detail."""
    ok = bool(ok)
    results["passed" if ok else "failed"] += 1
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    return ok


def skip(name, why):
    results["skipped"] += 1
    print(f"skip {name} ({why})")


def summary():
    return f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped"


def finish():
    print(summary())
    sys.exit(1 if results["failed"] else 0)
