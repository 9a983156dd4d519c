#!/usr/bin/env python3
"""Soak (issue 5): converts the real PyTorch snapshots in ../shared/traces (MSH_TRACES to point
elsewhere) to memshim text traces with `memshim-replay --to-text`, then runs reli-soak
(tests/reliability/soak.c) over all of them under LD_PRELOAD=libmemshim.so with reports on, until
RELI_SOAK_OPS operations (default 1000000) were made. reli-soak asserts that host RSS, open file
descriptors and the double's handles and mappings stay flat after the warm-up pass; this script
adds that every report it wrote is complete JSON and no temp file is left. Skips cleanly when
the traces are absent. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
TRACES = os.environ.get("MSH_TRACES", os.path.join(os.path.dirname(ROOT), "shared", "traces"))


def main():
    pickles = sorted(glob.glob(os.path.join(TRACES, "**", "*.pickle"), recursive=True))
    if not pickles:
        print(f"skip soak: no traces in {TRACES} (the real snapshots live beside the project, never in it)")
        print("0 passed, 0 failed, 1 skipped")
        return 0
    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="memshim-soak-") as tmp:
        texts = []
        for p in pickles:
            out = os.path.join(tmp, os.path.relpath(p, TRACES).replace(os.sep, "_") + ".txt")
            with open(out, "w") as f:
                r = subprocess.run([os.path.join(BUILD, "memshim-replay"), "--to-text", p], stdout=f,
                                   stderr=subprocess.PIPE, text=True)
            if r.returncode == 0:
                texts.append(out)
            else:
                print(f"    {os.path.relpath(p, TRACES)}: not converted ({r.stderr.strip()[:120]})")
        print(f"    {len(texts)} of {len(pickles)} snapshots converted to memshim text traces")
        rd = os.path.join(tmp, "reports")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
        # the largest snapshot holds 52 GiB live: the double's memory is sparse, only touched
        # host pages are real
        env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "80G",
                    "LD_PRELOAD": os.path.join(BUILD, "libmemshim.so"), "MEMSHIM_REPORT_DIR": rd})
        # about 7 s alone; a hang must fail within a minute with its name (docs/testing.md)
        limit = float(os.environ.get("RELI_SOAK_TIMEOUT", "60"))
        try:
            p = subprocess.run([os.path.join(BUILD, "reliability", "reli-soak"), *texts], env=env,
                               capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            print(f"FAIL reli-soak over {len(texts)} traces: timed out after {limit:.0f} s (a hang? "
                  f"RELI_SOAK_TIMEOUT sets the limit)")
            print(f"{passed} passed, {failed + 1} failed, 0 skipped")
            return 1
        print(p.stdout, end="")
        if p.returncode != 0:
            print(p.stderr[-2000:])
        for line in p.stdout.splitlines():
            if line.startswith("ok   "):
                passed += 1
            elif line.startswith("FAIL "):
                failed += 1
        if p.returncode != 0 and not failed:
            failed += 1
        bad, reps = [], 0
        for f in glob.glob(os.path.join(rd, "*")):
            if ".tmp" in f:
                bad.append(os.path.basename(f))
                continue
            try:
                json.load(open(f))
                reps += 1
            except ValueError:
                bad.append(os.path.basename(f))
        ok = reps > 0 and not bad
        print(("ok   " if ok else "FAIL ") + f"soak: {reps} reports, all complete JSON, no temp file"
              + ("" if ok else f": {bad[:5]}"))
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
