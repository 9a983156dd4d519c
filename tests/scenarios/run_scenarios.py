#!/usr/bin/env python3
"""Scenario suite (issue 16): small real PyTorch jobs run the way people run them, under
LD_PRELOAD=libmemshim.so alone, on the CPU with the CUDA driver double, and what memshim must make
of each. Runs in make check (tests/run.sh).

  - Ctrl-C (an uncaught KeyboardInterrupt: Python finalizes, then kills itself with SIGINT, or
    exits with status 1 once torch._dynamo is imported) and SIGTERM: the open epoch (reason
    interrupted), the summary and the snapshot are written and the job ends as it does without
    memshim; a SIGTERM handler the program installed still runs;
  - a job that changes directory, and a spawn child started from the new one: reports, log,
    trace and snapshot where the job started;
  - a nanoGPT-style loop and minGPT's endless sampler: interval reports, the one warning, the leak
    verdict over intervals; an IterableDataset: the hint at warn level;
  - time epochs over a quiet phase, signal epochs with no allocation at all;
  - torchrun with 2 gloo ranks, SIGTERM to both, then Ctrl-C to the whole job;
  - two threads racing to the first CUDA use; the entries that initialize CUDA without
    torch.cuda._lazy_init (the memory history API, pinned memory);
  - Lightning's output unchanged, and memshim's figures in Lightning's CSVLogger and the HF
    Trainer's log history (TensorBoard logger).
Every job prints what it prints without memshim. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "replay"))
from pyharness import BUILD, ROOT, case, finish, skip, step  # noqa: E402
from schema_check import report_problems  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
GLUE = os.path.join(BUILD, "libmemshim_torch.so")
JOBS = os.path.join(HERE, "jobs")
all_reports = []


def env(extra=None, preload=True):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("MEMSHIM_", "_MEMSHIM_", "CUDBL_")) and k not in ("PYTHONPATH", "LD_PRELOAD")}
    e["PYTHONPATH"] = JOBS  # the jobs' helper module (_dev.py): restored by memshim's hook for the job
    e["LD_LIBRARY_PATH"] = os.path.join(BUILD, "double")
    if preload:
        e["LD_PRELOAD"] = LIB
    e["PYTHONUNBUFFERED"] = "1"
    for k, v in (extra or {}).items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


def run(args, extra=None, cwd=None, timeout=120, preload=True):
    p = subprocess.run([sys.executable, *args], env=env(extra, preload), cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _default_signals():
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored (and
    # CPython keeps it so): the Ctrl-C cases would then wait for a SIGINT nobody gets. Each job
    # gets the signals a job started from a terminal has.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def start(args, extra=None, cwd=None, new_session=False, argv0=None, preload=True):
    return subprocess.Popen(argv0 or [sys.executable, *args], env=env(extra, preload), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=new_session,
                            preexec_fn=_default_signals)


def wait_for(path, lines=1, timeout=60.0):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if os.path.exists(path):
            with open(path) as f:
                got = [l.split() for l in f if l.startswith("READY")]
            if len(got) >= lines:
                return got
        time.sleep(0.05)
    return None


def reports(rdir):
    out = []
    for f in sorted(glob.glob(os.path.join(rdir, "**", "*.json"), recursive=True)):
        with open(f) as fh:
            r = json.load(fh)
        r["_file"] = os.path.basename(f)
        out.append(r)
    all_reports.extend(out)
    return out


def kinds(reps):
    return [(r["kind"], r["reason"], r.get("interrupted_by")) for r in reps]


def lines(text, tag):
    return [l[len(tag) + 1:] for l in text.splitlines() if l.startswith(tag + " ")]


probe = run(["-c", "import torch; print('TORCH', torch.__version__)"], preload=False)
if probe[0] != 0:
    skip("scenario suite", "PyTorch is not installed (bash scripts/setup.sh --with-torch installs it)")
    finish()
tmp_root = tempfile.mkdtemp(prefix="memshim-scen-")


def tmpdir(name):
    d = os.path.join(tmp_root, name)
    os.makedirs(d)
    return d


# ---- 1. Ctrl-C and SIGTERM ------------------------------------------------------------------------
def interrupted(name, sig, mode="", preload=True):
    d = tmpdir(name)
    ready = os.path.join(d, "ready")
    p = start([os.path.join(JOBS, "interrupt_job.py"), ready] + ([mode] if mode else []),
              {"MEMSHIM_REPORT_DIR": "rep", "MEMSHIM_SNAPSHOT": "snap.pickle"}, cwd=d, preload=preload)
    got = wait_for(ready)
    if got:
        p.send_signal(sig)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return d, p.returncode, out, err, got


step("Ctrl-C", timeout=180)
# The same job without memshim first: CPython ends an uncaught KeyboardInterrupt by SIGINT, but
# once torch._dynamo is imported (every torch.optim optimizer imports it, PyTorch 2.15) the same
# job ends with status 1. memshim must end it exactly as it would have ended.
_, rc0, _, err0, got0 = interrupted("ctrl-c-alone", signal.SIGINT, preload=False)
d, rc, out, err, got = interrupted("ctrl-c", signal.SIGINT)
reps = reports(os.path.join(d, "rep"))
case("Ctrl-C (uncaught KeyboardInterrupt): the job ends as it does without memshim (status %s), with Python's "
     "traceback" % rc0,
     got and got0 and rc == rc0 and rc0 in (-signal.SIGINT, 1) and "KeyboardInterrupt" in err
     and "KeyboardInterrupt" in err0, (rc, rc0, err[-800:]))
case("Ctrl-C: the open epoch (reason interrupted, with its steps) and the summary (interrupted by SIGINT) are "
     "written",
     kinds(reps) == [("epoch", "interrupted", "SIGINT"), ("summary", "interrupted", "SIGINT")]
     and reps[0]["steps"] >= 12, (kinds(reps), err[-800:]))
case("Ctrl-C: MEMSHIM_SNAPSHOT is written", os.path.exists(os.path.join(d, "snap.pickle")), os.listdir(d))

step("SIGTERM", timeout=120)
d, rc, out, err, got = interrupted("sigterm", signal.SIGTERM)
reps = reports(os.path.join(d, "rep"))
case("SIGTERM (torchrun, Slurm, Kubernetes): the job still ends by SIGTERM", got and rc == -signal.SIGTERM,
     (rc, err[-800:]))
case("SIGTERM: the open epoch (reason interrupted) and the summary (interrupted by SIGTERM) are written",
     kinds(reps) == [("epoch", "interrupted", "SIGTERM"), ("summary", "interrupted", "SIGTERM")]
     and reps[0]["steps"] >= 12, (kinds(reps), err[-800:]))
snap = os.path.join(d, "snap.pickle")
ok_snap = False
if os.path.exists(snap):
    with open(snap, "rb") as f:
        s = pickle.load(f)
    ok_snap = isinstance(s, dict) and "segments" in s and "device_traces" in s
case("SIGTERM: MEMSHIM_SNAPSHOT is written, a PyTorch snapshot", ok_snap, os.listdir(d))

step("SIGTERM with the program's own handler", timeout=120)
d, rc, out, err, got = interrupted("sigterm-handler", signal.SIGTERM, "handler")
reps = reports(os.path.join(d, "rep"))
case("SIGTERM with the program's own handler: memshim runs it (never replaces it), the job ends as the program "
     "decided (exit 0), and its last epoch and summary say it was interrupted",
     got and rc == 0 and "stopped by the program's handler" in out
     and kinds(reps) == [("epoch", "interrupted", "SIGTERM"), ("summary", "interrupted", "SIGTERM")],
     (rc, out, kinds(reps), err[-600:]))

# ---- 2. paths fixed at start --------------------------------------------------------------------
step("chdir", timeout=120)
d = tmpdir("chdir")
a, b = tmpdir("chdir-a"), tmpdir("chdir-b")
rc, out, err = run([os.path.join(JOBS, "chdir_job.py"), a, b],
                   {"MEMSHIM_REPORT_DIR": "memreport", "MEMSHIM_LOG_FILE": "memshim-%p.log", "MEMSHIM_LOG": "info",
                    "MEMSHIM_TRACE_FILE": "trace-%p.txt", "MEMSHIM_SNAPSHOT": "snap-%p.pickle"}, cwd=d)
reps = reports(os.path.join(d, "memreport"))
pids = sorted({r["pid"] for r in reps})
child = next((int(l.split()[1]) for l in out.splitlines() if l.startswith("child")), None)
case("chdir: a job that changes directory before and after its first device memory keeps every report in "
     "MEMSHIM_REPORT_DIR=memreport where it started (2 epochs and a summary)",
     rc == 0 and [r["kind"] for r in reps if r["pid"] != child] == ["epoch", "epoch", "summary"]
     and not os.path.exists(os.path.join(a, "memreport")) and not os.path.exists(os.path.join(b, "memreport")),
     (rc, [r["_file"] for r in reps], err[-600:]))
case("chdir: a spawn child started from the new directory writes its summary there too (it inherits where the "
     "job started)", child is not None and child in pids and len(pids) == 2, (child, pids))
have = sorted(os.listdir(d))
case("chdir: MEMSHIM_LOG_FILE, MEMSHIM_TRACE_FILE and MEMSHIM_SNAPSHOT resolved against the start directory",
     any(f.startswith("memshim-") and f.endswith(".log") for f in have)
     and any(f.startswith("trace-") for f in have) and any(f.startswith("snap-") for f in have)
     and os.listdir(a) == [] and os.listdir(b) == [], (have, os.listdir(a), os.listdir(b)))

# ---- 3. iteration-based training ---------------------------------------------------------------------
step("nanoGPT-style loop", timeout=120)
d = tmpdir("nanogpt")
rc, out, err = run([os.path.join(JOBS, "nanogpt_job.py"), "130", "10"],
                   {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"), "MEMSHIM_EPOCH_INTERVAL": "40"})
reps = reports(os.path.join(d, "rep"))
said = [l for l in err.splitlines() if "no epoch has ended" in l]
case("nanoGPT-style loop (get_batch, no DataLoader): an interval report every 40 optimizer steps (reason "
     "interval), then the summary",
     rc == 0 and [(r["kind"], r["reason"], r["steps"]) for r in reps]
     == [("epoch", "interval", 40)] * 3 + [("summary", "exit", 10)], ([(r["kind"], r["reason"], r["steps"])
                                                                         for r in reps], err[-600:]))
case("... memshim says once, at warn level, what it does and how to choose MEMSHIM_EPOCH_STEPS or "
     "MEMSHIM_EPOCH_SECONDS",
     len(said) == 1 and ": warning: " in said[0] and "MEMSHIM_EPOCH_STEPS" in said[0]
     and "MEMSHIM_EPOCH_SECONDS" in said[0] and "interval" in said[0], said or err[-400:])
summ = reps[-1] if reps else {}
case("... the trend and leak verdict work on intervals: 512 KiB kept every 10 steps is a possible leak",
     summ.get("trend", {}).get("verdict", "").startswith("possible leak")
     and len(summ["trend"]["epoch_end_allocated_bytes"]) == 3, summ.get("trend"))
case("... the job's own output is unchanged", out == "iter 130: loss " + out.split("loss ")[-1] and out.count("\n") == 1,
     out)

step("endless sampler", timeout=120)
d = tmpdir("endless")
rc, out, err = run([os.path.join(JOBS, "endless_job.py"), "sampler", "95"],
                   {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"), "MEMSHIM_EPOCH_INTERVAL": "30"})
reps = reports(os.path.join(d, "rep"))
case("minGPT's endless sampler (RandomSampler, replacement, 1e10 samples): interval reports every 30 steps",
     rc == 0 and [(r["reason"], r["steps"]) for r in reps if r["kind"] == "epoch"] == [("interval", 30)] * 3,
     ([(r["kind"], r["reason"], r["steps"]) for r in reps], err[-600:]))
rc, out, err = run([os.path.join(JOBS, "endless_job.py"), "iterable", "50"],
                   {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep2"), "MEMSHIM_EPOCH_INTERVAL": "20"})
reps = reports(os.path.join(d, "rep2"))
hint = [l for l in err.splitlines() if "IterableDataset without __len__" in l]
case("an IterableDataset without __len__: the hint comes once at warn level (default log level), and intervals "
     "report the run",
     rc == 0 and len(hint) == 1 and ": warning: " in hint[0]
     and [r["reason"] for r in reps if r["kind"] == "epoch"] == ["interval", "interval"], (hint, err[-600:]))

step("MEMSHIM_EPOCH=steps without a count", timeout=60)
rc, out, err = run(["-c", "print('ok')"], {"MEMSHIM_EPOCH": "steps"})
said = [l for l in err.splitlines() if "MEMSHIM_EPOCH=steps" in l]
case("MEMSHIM_EPOCH=steps without MEMSHIM_EPOCH_STEPS says no epoch will close and what to set",
     len(said) == 1 and "no epoch will close" in said[0] and "MEMSHIM_EPOCH_STEPS=N" in said[0], err[-400:])

# ---- 4. time and signal epochs without allocations ------------------------------------------------------
step("seconds epochs over a quiet phase", timeout=120)
d = tmpdir("seconds")
t_run = time.monotonic()
rc, out, err = run([os.path.join(JOBS, "quiet_job.py"), os.path.join(d, "ready"), "2.6"],
                   {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"), "MEMSHIM_EPOCH": "seconds",
                    "MEMSHIM_EPOCH_SECONDS": "0.5"})
t_run = time.monotonic() - t_run
reps = reports(os.path.join(d, "rep"))
ep = [r for r in reps if r["kind"] == "epoch"]
# the clock runs from memshim's start, before PyTorch's import (seconds on a loaded machine): at
# least the quiet phase's 4 epochs, at most one per 0.5 s of the whole run
most = max(8, int(t_run / 0.5) + 1)
case("MEMSHIM_EPOCH=seconds, 0.5 s epochs over 2.6 s without an allocation: they close on time (at least 4 "
     "epoch reports, at most one per 0.5 s of the run, reason seconds, each about 0.5 s long)",
     rc == 0 and 4 <= len(ep) <= most and all(r["reason"] == "seconds" for r in ep)
     and all(0.3 < r["t_end_s"] - r["t_start_s"] < 1.5 for r in ep[1:]),
     (round(t_run, 1), most, [(r["reason"], round(r["t_end_s"] - r["t_start_s"], 2)) for r in ep], err[-600:]))

step("signal epochs with no allocation", timeout=120)
d = tmpdir("signal")
ready = os.path.join(d, "ready")
p = start([os.path.join(JOBS, "quiet_job.py"), ready, "3"],
          {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"), "MEMSHIM_EPOCH": "signal"})
got = wait_for(ready)
for _ in range(3):
    if got:
        p.send_signal(signal.SIGUSR2)
    time.sleep(0.4)
out, err = p.communicate(timeout=60)
reps = reports(os.path.join(d, "rep"))
case("MEMSHIM_EPOCH=signal: three kill -USR2 while the job allocates nothing close three epochs (reason signal)",
     got and p.returncode == 0 and [r["reason"] for r in reps if r["kind"] == "epoch"] == ["signal"] * 3,
     (p.returncode, kinds(reps), err[-600:]))

# ---- 5. torchrun with 2 gloo ranks -------------------------------------------------------------------------
torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(JOBS, "ddp_job.py")]


def torchrun_case(name, how):
    d = tmpdir(name)
    p = start(None, {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"), "OMP_NUM_THREADS": "1"}, cwd=d,
              new_session=True, argv0=torchrun + [d])
    got = wait_for(os.path.join(d, "ready"), 2, timeout=90)
    if got:
        if how == "ranks":
            for _, _, pid in got:
                os.kill(int(pid), signal.SIGTERM)
        else:  # Ctrl-C in the terminal: SIGINT to the whole foreground group
            os.killpg(p.pid, signal.SIGINT)
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return got, p.returncode, err, reports(os.path.join(d, "rep"))


step("torchrun, SIGTERM to both ranks", timeout=240)
got, rc, err, reps = torchrun_case("torchrun-term", "ranks")
summ = {r["rank"]: r for r in reps if r["kind"] == "summary"}
case("torchrun, 2 gloo ranks, SIGTERM to both: each rank writes its open epoch (interrupted) and its summary "
     "(interrupted by SIGTERM), and torchrun sees them end by SIGTERM",
     got and sorted(summ) == [0, 1] and all(s["reason"] == "interrupted" and s["interrupted_by"] == "SIGTERM"
                                            for s in summ.values())
     and sorted(r["rank"] for r in reps if r["kind"] == "epoch" and r["reason"] == "interrupted") == [0, 1]
     and rc != 0 and err.count("exitcode  : -15") == 2,
     (got, rc, kinds(reps), err[-800:]))
step("torchrun, Ctrl-C", timeout=240)
got, rc, err, reps = torchrun_case("torchrun-int", "group")
summ = {r["rank"]: r for r in reps if r["kind"] == "summary"}
case("torchrun, 2 gloo ranks, Ctrl-C (SIGINT to the job's process group): each rank writes its summary, "
     "interrupted",
     got and sorted(summ) == [0, 1] and all(s["reason"] == "interrupted" for s in summ.values()),
     (got, rc, kinds(reps), err[-800:]))

# ---- 6. every path into CUDA switches first ------------------------------------------------------------------
if not os.path.exists(GLUE):
    skip("first CUDA use: race and init paths", f"{GLUE} was not built (make builds it where torch imports)")
else:
    step("two threads racing to the first CUDA use", timeout=120)
    rc, out, err = run([os.path.join(JOBS, "race_job.py")], {"MEMSHIM_LOG": "info"})
    case("two threads race to the first CUDA use: PyTorch's native CUDA initialization runs only after memshim's "
         "switch is complete (tensor mode, never lost)",
         rc == 0 and lines(out, "ORDER") and lines(out, "ORDER")[0].startswith("[True, True] TENSOR True"),
         (out, err[-800:]))
    for which, title in (("record_history", "torch.cuda.memory._record_memory_history()"),
                         ("record_history_legacy", "_record_memory_history(True) (the legacy form)")):
        step(title, timeout=120)
        rc, out, err = run([os.path.join(JOBS, "initpath_job.py"), which], {"MEMSHIM_LOG": "info"})
        case(f"{title} before any CUDA use: memshim switches first and serves it (tensor mode; the snapshot "
             "has the 3 MiB allocation made after)",
             rc == 0 and lines(out, "CALL") == ["ok"] and lines(out, "TENSOR") == ["True WHY None"]
             and lines(out, "SNAPSHOT") == [f"1 {3 << 20}"], (out, err[-800:]))
    for which, title in (("pin_memory", "Tensor.pin_memory()"), ("storage_pin", "UntypedStorage.pin_memory()")):
        step(title, timeout=120)
        rc, out, err = run([os.path.join(JOBS, "initpath_job.py"), which],
                           {"MEMSHIM_LOG": "info", "PYTORCH_API_USAGE_STDERR": "1"})
        el = err.splitlines()
        switched = next((i for i, l in enumerate(el) if "tensor mode: PyTorch allocates every tensor" in l), None)
        native = next((i for i, l in enumerate(el) if "aten.init.cuda" in l), None)
        case(f"{title} before any CUDA use (PyTorch initializes CUDA from C++ there): memshim switches before "
             "PyTorch's own initialization, and the wrapper is gone after",
             rc == 0 and lines(out, "TENSOR") == ["True WHY None"] and switched is not None
             and (native is None or switched < native) and lines(out, "PIN_WRAPPED") == ["False"],
             (out, err[-800:]))

# ---- 6b. the GIL-free frame reader (CPython 3.11) ----------------------------------------------------------
step("frame reader layout", timeout=120)
import sysconfig  # noqa: E402
inc = sysconfig.get_paths().get("include", "")
if sys.version_info[:2] != (3, 11) or not os.path.exists(os.path.join(inc, "internal", "pycore_frame.h")):
    skip("shim/pyframes.h mirrors CPython 3.11's layout", f"needs CPython 3.11 and its headers (this is "
         f"{sys.version.split()[0]}, include {inc})")
else:
    exe = os.path.join(tmp_root, "pyframes_layout")
    cc = subprocess.run(["gcc", "-I" + inc, "-I" + os.path.join(ROOT, "shim"), "-o", exe,
                         os.path.join(HERE, "pyframes_layout.c")], capture_output=True, text=True)
    lay = subprocess.run([exe], capture_output=True, text=True) if cc.returncode == 0 else None
    case("shim/pyframes.h mirrors CPython 3.11's thread state, frames, code objects and strings member by member "
         "(the real headers)", lay is not None and lay.returncode == 0, (cc.stderr[-400:], lay and lay.stdout))
d = tmpdir("reader")
src = os.path.join(d, "donn\u00e9es_\u6f22.py")
with open(src, "w", encoding="utf-8") as f:
    f.write("import ctypes, memshim\n"
            "lib = ctypes.CDLL(None)  # GIL released, as inside an operator\n"
            "lib.memshim_malloc.restype = ctypes.c_void_p\n"
            "lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
            "def f\u00e4rbe_\u00fc(n):\n"
            "    x = [\n"
            "        1, 2, 3]\n" + "\n" * 300 +
            "    return (len(x) and\n"
            "            lib.memshim_malloc(n, 0, None))  # SITE\n"
            "class K:\n"
            "    def m(self):\n"
            "        return [f\u00e4rbe_\u00fc(1 << 20) for _ in range(3)]\n"
            "keep = K().m()\n"
            "memshim.epoch()\n")
want_line = 1 + next(i for i, l in enumerate(open(src, encoding="utf-8")) if "# SITE" in l)
rc, out, err = run([src], {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep")})
ep = [r for r in reports(os.path.join(d, "rep")) if r["kind"] == "epoch"]
top = ep[0]["sites"][0] if ep and ep[0]["sites"] else {}
case("the frame reader, without the GIL: a non-ASCII file and function name, a line 300 lines into the function "
     "(long location entries), a list comprehension's caller: file, function and line as Python reports them",
     rc == 0 and top.get("file") == src and top.get("function") == "f\u00e4rbe_\u00fc" and top.get("line") == want_line
     and top.get("bytes") == 3 << 20, (top, want_line, err[-500:]))

# ---- 7. output unchanged; figures in the frameworks' loggers ------------------------------------------------
step("Lightning", timeout=240)
d = tmpdir("lightning")
rc0, out0, err0 = run([os.path.join(JOBS, "lightning_job.py"), os.path.join(d, "plain")], preload=False)
rc, out, err = run([os.path.join(JOBS, "lightning_job.py"), os.path.join(d, "memshim")],
                   {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep")})
if rc0 != 0 and "No module named" in err0:
    skip("Lightning: output unchanged, figures in its logger", err0.strip().splitlines()[-1][:160])
else:
    reps = reports(os.path.join(d, "rep"))
    case("Lightning under LD_PRELOAD alone: the same output as without memshim (no 'Adding 1 callbacks from entry "
         "point'), and its epochs still reported", rc == 0 and rc0 == 0 and out == out0 and err == err0
         and [r["reason"] for r in reps if r["kind"] == "epoch"] == ["lightning"] * 2,
         (out0[-400:], err0[-600:], out[-400:], err[-600:]))
    csvs = glob.glob(os.path.join(d, "memshim", "run", "*", "metrics.csv"))
    rows = []
    if csvs:
        import csv
        with open(csvs[0]) as f:
            rows = [r for r in csv.DictReader(f) if r.get("memshim/allocated_peak_bytes")]
    ep = [r for r in reps if r["kind"] == "epoch"]
    case("Lightning's CSVLogger gets memshim/ figures at each epoch end, equal to the epoch reports (peak allocated "
         "and reserved, fragmentation, OOMs, rescues, growth)",
         len(rows) == 2 and len(ep) == 2
         and [int(float(r["memshim/allocated_peak_bytes"])) for r in rows]
         == [e["memory"]["allocated_peak_bytes"] for e in ep]
         and [int(float(r["memshim/reserved_peak_bytes"])) for r in rows]
         == [e["memory"]["reserved_peak_bytes"] for e in ep]
         and all(k in rows[0] for k in ("memshim/fragmentation", "memshim/ooms", "memshim/oom_rescues",
                                        "memshim/growth_bytes_per_epoch")), (csvs, rows[:2]))
    rc, out, err = run([os.path.join(JOBS, "lightning_job.py"), os.path.join(d, "off")],
                       {"MEMSHIM_TRAINER_METRICS": "0"})
    csvs = glob.glob(os.path.join(d, "off", "run", "*", "metrics.csv"))
    case("MEMSHIM_TRAINER_METRICS=0: nothing of memshim's in Lightning's logger",
         rc == 0 and (not csvs or "memshim/" not in open(csvs[0]).read()), (csvs, err[-400:]))

step("HF Trainer", timeout=300)
d = tmpdir("hf")
rc, out, err = run([os.path.join(JOBS, "hf_job.py"), d], {"MEMSHIM_REPORT_DIR": os.path.join(d, "rep"),
                                                   "TENSORBOARD_LOGGING_DIR": os.path.join(d, "tb")}, timeout=280)
if rc != 0 and "No module named" in err:
    skip("HF Trainer: figures in its log history", err.strip().splitlines()[-1][:160])
else:
    reps = reports(os.path.join(d, "rep"))
    hist = json.loads(lines(out, "MEMSHIM_LOG_HISTORY")[0]) if lines(out, "MEMSHIM_LOG_HISTORY") else None
    ep = [r for r in reps if r["kind"] == "epoch"]
    case("HF Trainer with a TensorBoard logger: memshim/ figures in its log history at each epoch end, equal to the "
         "epoch reports",
         rc == 0 and hist is not None and len(hist) == 2 and len(ep) == 2
         and [h["memshim/allocated_peak_bytes"] for h in hist] == [e["memory"]["allocated_peak_bytes"] for e in ep]
         and [h["epoch"] for h in hist] == [1.0, 2.0], (hist, [r["_file"] for r in reps], err[-600:]))
    tb = glob.glob(os.path.join(d, "tb", "**", "events.out.tfevents.*"), recursive=True)
    found = False
    for f in tb:
        with open(f, "rb") as fh:
            found |= b"memshim/allocated_peak_bytes" in fh.read()
    case("... the TensorBoard event file holds them too; and the Trainer's printed logs do not (output unchanged)",
         found and "memshim/" not in "\n".join(l for l in out.splitlines() if not l.startswith("MEMSHIM_LOG_HISTORY"))
         and "memshim/" not in err, (tb, out[-600:]))

# ---- 8. batch-size finders (issue 25) -----------------------------------------------------------------------
probes = glob.glob(os.path.join(BUILD, "tests", "torch", "memshim_oom_probe*.so"))
if not os.path.exists(GLUE) or not probes:
    skip("batch-size finders: the same batch as without memshim, refusals at no driver cost",
         "the PyTorch glue or its test extension was not built (make tests where torch imports)")
else:
    d = tmpdir("finders")
    seen_cases = set()
    for label, cap, limit, finders in (("a 1 GiB device", 1 << 30, None, ["hand", "accelerate", "lightning"]),
                                       ("MEMSHIM_LIMIT=512M on it", 1 << 30, 512 << 20, ["hand", "accelerate"])):
        tag = "limit" if limit else "device"
        step(f"batch-size finders on {label}", timeout=600)
        mine, native, rep = (os.path.join(d, f"{tag}-{k}") for k in ("memshim.json", "native.json", "rep"))
        # both at once: Lightning's trials take seconds each
        pm = start([os.path.join(JOBS, "finder_job.py"), mine, *finders],
                   {"CUDBL_CAPACITY": str(cap), "MEMSHIM_LIMIT": str(limit) if limit else None,
                    "MEMSHIM_TEST_GLUE": GLUE, "MEMSHIM_TEST_PROBE": probes[0], "MEMSHIM_REPORT_DIR": rep,
                    "MEMSHIM_LOG": "error"})
        pn = start([os.path.join(JOBS, "finder_job.py"), native, *finders], {"FINDER_NATIVE_CAPACITY": str(limit or cap)},
                   preload=False)
        (out, err), (out0, err0) = pm.communicate(timeout=580), pn.communicate(timeout=580)
        rc, rc0 = pm.returncode, pn.returncode
        got = json.load(open(mine)) if rc == 0 and os.path.exists(mine) else {}
        want = json.load(open(native)) if rc0 == 0 and os.path.exists(native) else {}
        ran = [f for f in finders if "answer" in got.get(f, {}) and "answer" in want.get(f, {})]
        for f in finders:
            if f not in ran and "skipped" in got.get(f, {}):
                skip(f"{label}: {f}", got[f]["skipped"][:160])
        answers = {f: (got[f]["answer"], want[f]["answer"]) for f in ran}
        case(f"{label}: {', '.join(ran)} find the same batch under memshim (tensor mode, the double) as PyTorch's "
             "capacity rule gives without it", rc == 0 and rc0 == 0 and ran and "hand" in ran
             and all(a == b and a > 0 for a, b in answers.values()), (answers, err[-800:], err0[-800:]))
        refused = [p for f in ran for p in got[f]["refused"]]
        case(f"{label}: each of the {len(refused)} refused probes cost the driver no cuMemCreate and the device none "
             "of its free memory", refused and all(p["creates"] == 0 and p["device_rise_bytes"] == 0 for p in refused),
             [(p["bytes"] >> 20, p["creates"], p["device_rise_bytes"]) for p in refused])
        print(f"    {label}: answers {answers}; refusals (MiB, s): "
              f"{[(p['bytes'] >> 20, round(p['seconds'], 4)) for p in refused]}")
        for r in reports(rep):
            if r["kind"] == "oom":
                seen_cases.add(r["last_oom"].get("case"))
    case("the finders' OOM reports name each case: larger_than_device, larger_than_limit, does_not_fit_now",
         seen_cases >= {"larger_than_device", "larger_than_limit", "does_not_fit_now"}, seen_cases)

bad = [(r["_file"], report_problems({k: v for k, v in r.items() if k != "_file"})[:2]) for r in all_reports
       if report_problems({k: v for k, v in r.items() if k != "_file"})]
case(f"all {len(all_reports)} reports of these scenarios match docs/report.schema.json", all_reports and not bad, bad[:3])
finish()
