#!/usr/bin/env python3
"""The docs' "never" claims that had no test of their own (issue 31 item 4; each is a `never:` line
of tests/promises/index.txt, which check_promises.py holds against the docs). Each runs the
program the claim is about and counts what must not happen:
  - a Python process that never uses CUDA makes no driver call (docs/pytorch.md): PyTorch imported
    and used on the CPU under LD_PRELOAD=libmemshim.so; the driver double counts every call;
  - memshim never loads a CUDA runtime (docs/interposition.md): a cudaMalloc reaching its hook in a
    process without libcudart fails as documented, and no libcudart is mapped after;
  - `memshim-replay --no-learn` never uses the learned step (docs/replay.md): at the minimum
    capacity of a real trace the default places blocks by a plan, --no-learn places none;
  - `memshim-replay --no-defrag` never reclaims and remaps pages (docs/replay.md): at a capacity
    where the default reclaims pages, --no-defrag reclaims none.
Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, skip  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
REPLAY = os.path.join(BUILD, "memshim-replay")
# every driver function the double knows that memshim's start-up or a pool would call first
DRIVER_FNS = ("cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName",
              "cuDeviceTotalMem", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent",
              "cuCtxSetCurrent", "cuCtxPushCurrent", "cuMemGetInfo", "cuMemGetAllocationGranularity",
              "cuMemAddressReserve", "cuMemCreate", "cuStreamIsCapturing", "cuGetProcAddress")

NO_RUNTIME = r'''
import ctypes, json
lib = ctypes.CDLL(None)  # memshim's exported cudaMalloc; no CUDA runtime in this process
p = ctypes.c_void_p()
rc = lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1 << 20))
maps = open("/proc/self/maps").read()
print(json.dumps({"rc": rc, "cudart_loaded": "libcudart" in maps}))
'''

NO_CUDA = r'''
import ctypes, json, sys
try:
    import torch
    x = (torch.ones(256, 256) @ torch.ones(256, 256)).sum().item()
    used = "torch " + torch.__version__
except ImportError:
    x, used = sum(range(1000)), "no torch"
d = ctypes.CDLL("libcuda.so.1")
d.cudbl_call_count.restype = ctypes.c_long
print(json.dumps({"used": used, "calls": {n: d.cudbl_call_count(n.encode()) for n in sys.argv[1:]}}))
'''


def replay(trace, *args):
    p = subprocess.run([REPLAY, "--json", "--passes", "3", *args, trace], capture_output=True, text=True, timeout=600)
    try:
        return json.loads(p.stdout.splitlines()[0])
    except (ValueError, IndexError):
        return {"error": (p.stderr or p.stdout)[-300:]}


def main():
    for f in (LIB, REPLAY):
        if not os.path.exists(f):
            case("built", False, f"{f} missing (make)")
            finish()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_"))}
    env.update(LD_PRELOAD=os.path.abspath(LIB), LD_LIBRARY_PATH=os.path.join(BUILD, "double"))
    p = subprocess.run([sys.executable, "-c", NO_CUDA, *DRIVER_FNS], env=env, capture_output=True, text=True,
                       timeout=300)
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        r = {"used": None, "calls": {}, "error": p.stderr[-600:]}
    made = {k: v for k, v in r["calls"].items() if v}
    case(f"a Python process that never uses CUDA ({r['used']}, under LD_PRELOAD) makes no driver call",
         r["calls"] and len(r["calls"]) == len(DRIVER_FNS) and all(v == 0 for v in r["calls"].values()),
         made or r)

    p = subprocess.run([sys.executable, "-c", NO_RUNTIME], env=env, capture_output=True, text=True, timeout=120)
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        r = {"error": (p.stderr or p.stdout)[-600:]}
    case("memshim never loads a CUDA runtime: a cudaMalloc reaching its hook in a process without one returns "
         "cudaErrorInitializationError (3) with a warning naming it, and no libcudart is mapped after",
         r.get("rc") == 3 and r.get("cudart_loaded") is False and "cudaMalloc was not found" in p.stderr,
         (r, p.stderr[-400:]))

    trace = os.path.join(os.path.dirname(ROOT), "shared", "traces", "cs336", "silmont2000", "memory_forward_bf16_128.pickle")
    if not os.path.exists(trace):
        cands = sorted(glob.glob(os.path.join(os.path.dirname(ROOT), "shared", "traces", "**", "*.pickle"), recursive=True))
        trace = cands[0] if cands else None
    if not trace:
        skip("memshim-replay --no-learn and --no-defrag", "no trace under ../shared/traces")
        finish()
    learn = replay(trace, "--capacity", "auto")
    cap = str(learn.get("capacity_bytes") or 0)
    nolearn = replay(trace, "--capacity", cap, "--no-learn")

    def placed(d):  # allocations placed by a plan, over the passes
        return sum(d.get(k) or 0 for k in ("plan_placed", "steady_plan_placed", "last_pass_plan_placed"))
    case(f"memshim-replay --no-learn never places a block by a plan (at the minimum capacity, {int(cap) >> 20} MiB: "
         f"{placed(learn)} placed by plans by default, {placed(nolearn)} with --no-learn)",
         placed(learn) > 0 and "error" not in nolearn and placed(nolearn) == 0
         and not any(nolearn.get(k) for k in nolearn if "plans_built" in k), (learn, nolearn))
    nodefrag = replay(trace, "--capacity", cap, "--no-defrag")
    case(f"memshim-replay --no-defrag never reclaims and remaps pages (at the same capacity: "
         f"{learn.get('reclaimed_pages')} pages reclaimed by default, {nodefrag.get('reclaimed_pages')} with --no-defrag)",
         (learn.get("reclaimed_pages") or 0) > 0 and nodefrag.get("reclaimed_pages") == 0, (learn, nodefrag))
    finish()


if __name__ == "__main__":
    main()
