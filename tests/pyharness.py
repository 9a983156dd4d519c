"""pyharness: what memshim's Python test scripts share (paths, case/skip bookkeeping, the closing
line that tests/run.sh adds up). Standard library only.

    sys.path.insert(0, <tests dir>); from pyharness import BUILD, TRACES, case, skip, finish
    ...
    finish()   # prints "N passed, N failed, N skipped" and exits 1 when anything failed

A script that hangs must not hang the suite (docs/testing.md): a watchdog thread gives the work
before each check MSH_TEST_TIMEOUT seconds (default 50). step("name", timeout=None) names the work
that follows and gives it a fresh deadline (a longer one when it needs it); every case() or skip()
starts the next deadline. Past it the watchdog kills the script's child processes, prints
"FAIL <name>: timed out ..." and the closing line, and exits 1. A thread, not SIGALRM: a script
blocked inside C code (ctypes, a hung library) never runs a Python signal handler.
"""
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
results = {"passed": 0, "failed": 0, "skipped": 0}


def _timeout_default():
    v = os.environ.get("MSH_TEST_TIMEOUT", "")
    try:
        t = float(v) if v else 50.0
        if not 0 < t <= 86400:
            raise ValueError
        return t
    except ValueError:
        print(f"pyharness: MSH_TEST_TIMEOUT='{v}' is not a number of seconds (0 < s <= 86400); using 50",
              file=sys.stderr)
        return 50.0


TIMEOUT = _timeout_default()
_watch = {"label": "the start of the script (before its first check)", "limit": TIMEOUT,
          "deadline": time.monotonic() + TIMEOUT}
_watch_lock = threading.Lock()


def step(name, timeout=None):
    """Name the work that follows (until the next check) and give it `timeout` seconds."""
    with _watch_lock:
        t = TIMEOUT if timeout is None else float(timeout)
        _watch.update(label=name, limit=t, deadline=time.monotonic() + t)


def _descendants():
    """Every process below this one (children of children too), from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            parent[int(d)] = int(st[st.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [os.getpid()]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _watchdog():
    while True:
        time.sleep(0.1)
        with _watch_lock:
            if time.monotonic() < _watch["deadline"]:
                continue
            label, limit = _watch["label"], _watch["limit"]
        for pid in _descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        results["failed"] += 1
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - the main thread may be mid-write; the lines below still go out
            pass
        msg = (f"FAIL {label}: timed out after {limit:.0f} s (a hang? MSH_TEST_TIMEOUT sets the limit; "
               f"child processes killed)\n{summary()}\n")
        os.write(1, msg.encode())
        os._exit(1)


threading.Thread(target=_watchdog, name="pyharness-watchdog", daemon=True).start()


def case(name, ok, detail=""):
    """Record one check; a failure prints its detail. The next deadline starts now."""
    ok = bool(ok)
    results["passed" if ok else "failed"] += 1
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    step(f"the work after '{name}'")
    return ok


def skip(name, why):
    results["skipped"] += 1
    print(f"skip {name} ({why})")
    step(f"the work after '{name}'")


def need_torch_and_glue(what, glue):
    """Skip `what` and finish unless python3 imports PyTorch and the glue `glue` was built."""
    import subprocess
    step("PyTorch present", timeout=120)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True)
    if probe.returncode != 0 or not os.path.exists(glue):
        skip(what, "needs PyTorch and the glue (bash scripts/setup.sh --with-torch; make)")
        finish()


def summary():
    return f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped"


def finish():
    print(summary())
    sys.exit(1 if results["failed"] else 0)
