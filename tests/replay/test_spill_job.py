#!/usr/bin/env python3
"""MEMSHIM_SPILL=host in a real CPython process over the CUDA driver double (issue 20): tensor-mode
allocations through memshim_malloc (as PyTorch's pluggable allocator makes them), MEMSHIM_LIMIT
below what a step needs. With spill the job runs through, its weights' bytes intact through every
spill and return, and its reports say what moved and which sites are on the host; with spill off
the same job gets today's OOM, and its message (the glue's, memshim_torch_oom_message) says
MEMSHIM_SPILL=host would help; a bad
MEMSHIM_SPILL value is named and acts as off. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyharness import BUILD, case, finish  # noqa: E402
from schema_check import report_problems  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")

# Weights (6 x 6 MiB, written once) before the first step; each step 10 activations of 4 MiB at a
# 48 MiB limit: 36 + 40 MiB do not fit, so cold weight pages go to the host. An epoch report is
# closed in the middle of step 2, while pages are on the host; the weights are checked byte by
# byte at every step's end and at the end.
JOB = r"""
import ctypes, os, sys
lib = ctypes.CDLL(os.environ["LIB"])
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_alloc.restype = ctypes.c_void_p
lib.memshim_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_oom_message.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
MiB = 1 << 20
def pattern(i, n):
    return bytes(((k * 7 + i * 13) & 0xFF) for k in range(256)) * (n // 256)
def load_weights():
    ws = []
    for i in range(6):
        p = lib.memshim_malloc(6 * MiB, 0, None)  # SITE-W
        if not p:
            sys.exit(3)
        ctypes.memmove(p, pattern(i, 6 * MiB), 6 * MiB)
        ws.append(p)
    return ws
def check(ws):
    for i, p in enumerate(ws):
        if ctypes.string_at(p, 6 * MiB) != pattern(i, 6 * MiB):
            print(f"weight {i} damaged", flush=True)
            sys.exit(4)
ws = load_weights()
lib.memshim_step()
for step in range(3):
    acts = []
    for k in range(10):
        p = lib.memshim_torch_alloc(4 * MiB, 0, None)  # SITE-ACT (the glue's entry point)
        if not p:
            msg = ctypes.create_string_buffer(4096)
            lib.memshim_torch_oom_message(0, 4 * MiB, msg, 4096)
            print(f"OOM at step {step}, activation {k}: {msg.value.decode()}", flush=True)
            sys.exit(2)
        ctypes.memset(p, k, 4 * MiB)
        acts.append(p)
    if step == 1:
        lib.memshim_epoch()  # a report while weight pages are on the host
    for k, p in enumerate(acts):
        if ctypes.string_at(p, 4096) != bytes([k]) * 4096:
            sys.exit(5)
        lib.memshim_free(p, 4 * MiB, 0, None)
    check(ws)
    lib.memshim_step()
check(ws)
print("done", flush=True)
"""


def run(tmp, name, env_extra):
    rdir = os.path.join(tmp, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "4G", "MEMSHIM_REPORT_DIR": rdir,
                "MEMSHIM_LOG": "warn", "LIB": LIB, "MEMSHIM_LIMIT": "48M"})
    env.update(env_extra)
    path = os.path.join(tmp, "job.py")
    with open(path, "w") as f:
        f.write(JOB)
    p = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    p.reports = []
    for fn in sorted(glob.glob(os.path.join(rdir, "*.json"))):
        with open(fn) as fh:
            p.reports.append(json.load(fh))
    return p


with tempfile.TemporaryDirectory(prefix="memshim-spill-") as tmp:
    site_w = next(i + 1 for i, l in enumerate(JOB.splitlines()) if "SITE-W" in l)
    on = run(tmp, "on", {"MEMSHIM_SPILL": "host"})
    case("MEMSHIM_SPILL=host at a 48 MiB limit: the job runs through, the weights intact at every step",
         on.returncode == 0 and "done" in on.stdout, f"exit {on.returncode}: {on.stdout[-300:]} {on.stderr[-600:]}")
    ep = [r for r in on.reports if r["kind"] == "epoch"]
    summ = next((r for r in on.reports if r["kind"] == "summary"), None)
    sp = ep[0]["spill"] if ep else {}
    case(f"the epoch report closed mid-step says what is on the host: {sp.get('spilled_bytes', 0) >> 20} MiB, "
         f"peak {sp.get('spilled_peak_bytes', 0) >> 20} MiB", bool(ep) and sp.get("enabled") and sp["spilled_bytes"] > 0
         and sp["spilled_peak_bytes"] >= sp["spilled_bytes"] and sp["pages_to_host"] > 0, sp)
    sites = sp.get("sites") or []
    case(f"its spill sites name the weights' allocation (line {site_w}, load_weights) with their host bytes",
         bool(sites) and sites[0]["function"] == "load_weights" and sites[0]["line"] == site_w
         and sum(s["host_bytes"] for s in sites) + sp["unattributed_host_bytes"] == sp["spilled_bytes"], sites)
    ss = (summ or {}).get("spill", {})
    case("the summary: pages went to the host and came back at the step marks, time spent moving, nothing refused",
         ss.get("pages_to_host", 0) > 0 and ss.get("pages_to_device", 0) > 0 and ss.get("seconds_moving", 0) > 0
         and ss.get("requests_refused") == 0 and summ["oom"]["rescued_by_spill"] > 0, ss)
    probs = [(r["kind"], report_problems(r)) for r in on.reports if report_problems(r)]
    case(f"all {len(on.reports)} reports match docs/report.schema.json", bool(on.reports) and not probs, probs[:3])
    case("memshim's reserved bytes never counted the host's: at most the limit in every report",
         all(r["memory"]["reserved_peak_bytes"] <= 48 << 20 for r in on.reports),
         [r["memory"]["reserved_peak_bytes"] for r in on.reports])

    off = run(tmp, "off", {})
    case("spill off: the same job fails at step 0 (the allocation returns NULL: today's OOM)",
         off.returncode == 2 and "OOM at step 0" in off.stdout, f"exit {off.returncode}: {off.stdout[-300:]}")
    case("spill off: PyTorch's OOM message says how much was missing and that MEMSHIM_SPILL=host would keep it going",
         "CUDA out of memory" in off.stdout and "MEMSHIM_SPILL=host would keep it going" in off.stdout, off.stdout[-900:])
    so = next((r for r in off.reports if r["kind"] == "summary"), {}).get("spill", {})
    case("spill off: nothing moved, the reports say spill was off", so.get("enabled") is False and
         so.get("pages_to_host") == 0, so)
    cap = run(tmp, "capped", {"MEMSHIM_SPILL": "host", "MEMSHIM_SPILL_MAX": "8M"})
    case("MEMSHIM_SPILL_MAX=8M: the job fails with PyTorch's OOM, whose message says what was spilled and why no more",
         cap.returncode == 2 and "8.00 MiB of cold pages are on host memory" in cap.stdout
         and "MEMSHIM_SPILL_MAX reached" in cap.stdout, cap.stdout[-900:])
    bad = run(tmp, "bad", {"MEMSHIM_SPILL": "disk"})
    case("MEMSHIM_SPILL=disk: one warning naming the value, then as off (the same OOM)",
         bad.returncode == 2 and "MEMSHIM_SPILL='disk' is not a valid value" in bad.stderr, bad.stderr[-400:])
    nov = run(tmp, "novmm", {"MEMSHIM_SPILL": "host", "CUDBL_HOST_VMM": "none"})
    case("a driver without host VMM: MEMSHIM_SPILL=host warns once and acts as off (the same OOM)",
         nov.returncode == 2 and nov.stderr.count("spilling is off") == 1, nov.stderr[-600:])
finish()
