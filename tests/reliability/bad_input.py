#!/usr/bin/env python3
"""Bad input end to end (issue 5): every MEMSHIM_* variable, taken from the option table
(`memshim-options --markdown`), is set one at a time to garbage, empty, huge, negative and
out-of-range values under the demo workload (memshim-train-demo, 1 epoch x 2 steps, scale 0.05,
reports on). For each value:
  - the demo completes ("finished", exit 0);
  - if the value is invalid (memshim-options --check says so, or it is a path memshim cannot
    use), exactly one warning is printed and it names the variable (MEMSHIM_CONF for its
    entries); a valid value prints no warning at all;
  - no line of memshim's output is broken by the value (control characters become '?').
Garbage includes printf directives ("%s%n"), bytes that are not UTF-8, an escape sequence and
a newline. Ends with "N passed, N failed, N skipped" (one case per variable)."""
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
res = {"passed": 0, "failed": 0, "skipped": 0}
WARN = re.compile(rb"^memshim\[\d+\]: warning: ", re.M)

GARBAGE = [b"banana", b"%s%n%s%n%p%99999999d", b"\xff\xfe\x1b[31m\nmemshim[1]: error: forged"]
EMPTY = [b"", b"   "]
HUGE = [b"9" * 5000]
NEGATIVE = [b"-1", b"-0.5"]
OUT_OF_RANGE = {
    "enum": [b"7", b"auto,off"],
    "size or fraction": [b"1.5", b"20000000T", b"99999999999999999999"],
    "size": [b"20000000T", b"99999999999999999999", b"65MiB"],
    "fraction": [b"1.5", b"1e-3", b"inf"],
    "boolean": [b"2", b"yess"],
    "duration": [b"1e999", b"10d", b"nan"],
    "integer": [b"0", b"1000000000001", b"18446744073709551616"],
    "signal": [b"SIGKILL", b"STOP", b"65", b"0"],
    "path": [b"/proc/nonexistent/dir/x", b"/etc/hostname/sub"],
    "string": [b"limit:banana", b"limt:1G", b"conf:x", b":", b"a:1," * 70, b"x" * 9000],
}
# Paths that parse but cannot be used: one warning from where memshim opens them. A directory is
# also unusable as a trace or log file.
UNUSABLE_PATHS = {b"/proc/nonexistent/dir/x", b"/etc/hostname/sub"}
FILE_PATHS = [b"/"]


def options():
    p = subprocess.run([os.path.join(BUILD, "memshim-options"), "--markdown"], capture_output=True, text=True)
    return re.findall(r"^\| `(MEMSHIM_[A-Z_]+)` \| ([a-z ]+) \|", p.stdout, re.M)


def env_for(name, value, tmp):
    env = {k.encode(): v.encode() for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env[b"LD_LIBRARY_PATH"] = os.path.join(BUILD, "double").encode()
    env[b"CUDBL_CAPACITY"] = b"2G"
    if name != "MEMSHIM_REPORT_DIR":
        env[b"MEMSHIM_REPORT_DIR"] = os.path.join(tmp, "reports").encode()
    env[name.encode()] = value
    return env


def main():
    opts = options()
    if len(opts) < 10:
        print("FAIL option list from memshim-options --markdown")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    t0 = time.time()
    runs = 0
    demo = [os.path.join(BUILD, "memshim-train-demo"), "--epochs", "1", "--steps", "2", "--scale", "0.05"]
    for name, typ in opts:
        values = GARBAGE + EMPTY + HUGE + NEGATIVE + OUT_OF_RANGE.get(typ, [])
        if typ == "path" and name != "MEMSHIM_REPORT_DIR":
            values += FILE_PATHS
        problems, invalid = [], 0
        for v in values:
            with tempfile.TemporaryDirectory(prefix="memshim-bad-") as tmp:
                env = env_for(name, v, tmp)
                chk = subprocess.run([os.path.join(BUILD, "memshim-options"), "--check"], env=env, cwd=tmp,
                                     capture_output=True, timeout=30)
                bad = chk.returncode != 0 or (typ == "path" and (v in UNUSABLE_PATHS or v in FILE_PATHS))
                env[b"LD_PRELOAD"] = os.path.join(BUILD, "libmemshim.so").encode()
                try:
                    p = subprocess.run(demo, env=env, cwd=tmp, capture_output=True, timeout=60)
                except subprocess.TimeoutExpired:
                    problems.append(f"{v[:40]!r}: hung")
                    continue
                runs += 1
                invalid += bad
                warns = [l for l in p.stderr.splitlines() if WARN.match(l)]
                named = name.encode()
                ok = p.returncode == 0 and b"finished" in p.stdout
                if not ok:
                    problems.append(f"{v[:40]!r}: exit {p.returncode}: {p.stderr[-200:]!r}")
                    continue
                if bad and not (len(warns) == 1 and named in warns[0]):
                    problems.append(f"{v[:40]!r} (invalid): {len(warns)} warnings {[w[:160] for w in warns[:3]]}")
                elif not bad and warns:
                    problems.append(f"{v[:40]!r} (valid): unexpected warnings {[w[:160] for w in warns[:3]]}")
                stray = [l for l in p.stderr.splitlines() if l and not l.startswith((b"memshim[", b"cudbl:"))]
                if stray:
                    problems.append(f"{v[:40]!r}: a line of stderr is not memshim's: {stray[0][:120]!r}")
        ok = not problems
        print(("ok   " if ok else "FAIL ") + f"{name} ({typ}): {len(values)} values, {invalid} invalid"
              + ("" if ok else ": " + "; ".join(problems[:4])), flush=True)
        res["passed" if ok else "failed"] += 1
    print(f"bad input: {runs} demo runs over {len(opts)} variables in {time.time() - t0:.1f} s")
    print(f"{res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped")
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
