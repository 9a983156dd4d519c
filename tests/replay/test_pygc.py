#!/usr/bin/env python3
"""memshim's GC step in a real CPython process, without a GPU (driver double): tensors held only by
reference cycles are freed when an allocation would fail, by memshim calling gc.collect() on a
thread that holds the GIL; a caller without the GIL (ctypes.CDLL releases it) is never made to run
Python code, and the skip is counted. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, case, finish  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
MiB = 1 << 20

CHILD = r"""
import ctypes, gc, os, sys
hold_gil = sys.argv[1] == "pydll"
lib = (ctypes.PyDLL if hold_gil else ctypes.CDLL)(sys.argv[2])
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
gc.set_threshold(1 << 30)  # no automatic collection: only memshim collects (PyGC_Collect honours gc.disable())
class Tensor:
    def __init__(self, n):
        self.n, self.ptr = n, lib.memshim_malloc(n, 0, None)
        self.me = self  # a reference cycle: unreachable after del, freed only by gc
    def __del__(self):
        if self.ptr:
            lib.memshim_free(self.ptr, self.n, 0, None)
held = [Tensor(16 << 20) for _ in range(3)]
ok = all(t.ptr for t in held)
del held  # unreachable cycles still hold 48 MiB of the 64 MiB limit
big = lib.memshim_malloc(40 << 20, 0, None)
print("FIRST", ok, "BIG", bool(big))
lib.memshim_epoch()
"""

# Found by review: with MEMSHIM_GC=epoch, an epoch closed inside the cudaMalloc hook (a signal
# epoch) ran gc.collect() while PyTorch's caching allocator would be mid-call.
IN_HOOK = r'''
import ctypes, gc, os, signal, sys
ctypes.CDLL(os.path.join(sys.argv[1], "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)
g = ctypes.PyDLL(None)  # cudaMalloc binds to memshim's hook; the GIL is kept, as in PyTorch
g.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
gc.set_threshold(1 << 30)
inside, ran = [False], []
class Cyc:
    def __init__(self): self.me = self
    def __del__(self): ran.append(inside[0])
p = ctypes.c_void_p()
g.cudaMalloc(ctypes.byref(p), 1 << 20)
c = Cyc(); del c
os.kill(os.getpid(), signal.SIGUSR2)
inside[0] = True
r = g.cudaMalloc(ctypes.byref(p), 1 << 20)
inside[0] = False
print("RESULT", r, True in ran)
'''

# Issue 8: a callback set with memshim_set_gc_callback (the documented use: gc.collect()) runs under
# the same rules as memshim's own step: never for a caller that does not hold the GIL.
USER_CB = r'''
import ctypes, gc, sys
lib = ctypes.CDLL(sys.argv[2])
held = ctypes.PyDLL(sys.argv[2])
for l in (lib, held):
    l.memshim_malloc.restype = ctypes.c_void_p
    l.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
calls = []
CB = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
cb = CB(lambda arg: (calls.append(1), gc.collect(), 0)[2])
lib.memshim_set_gc_callback(cb, None)
a = lib.memshim_malloc(48 << 20, 0, None)
no_gil = lib.memshim_malloc(48 << 20, 0, None)    # over the limit, GIL released by ctypes.CDLL
n_no_gil = len(calls)
with_gil = held.memshim_malloc(48 << 20, 0, None)  # over the limit, GIL held (PyDLL)
print("CALLS", n_no_gil, len(calls), bool(a))
'''

with tempfile.TemporaryDirectory() as tmp:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "1G",
                "MEMSHIM_LIMIT": "64M", "MEMSHIM_GC": "oom", "MEMSHIM_LOG": "error"})
    p = subprocess.run([sys.executable, "-c", USER_CB, "x", LIB], env=env, capture_output=True, text=True,
                       timeout=120)
    case("a user GC callback does not run for a caller without the GIL, and does with it",
         p.returncode == 0 and "CALLS 0 1 True" in p.stdout, (p.stdout + p.stderr)[-400:])

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": LIB, "MEMSHIM_EPOCH": "signal",
                "MEMSHIM_GC": "epoch", "MEMSHIM_LOG": "error"})
    p = subprocess.run([sys.executable, "-c", IN_HOOK, os.path.join(BUILD, "double")], env=env, capture_output=True,
                       text=True, timeout=120)
    case("an epoch closed inside the cudaMalloc hook does not run Python code there",
         p.returncode == 0 and "RESULT 0 False" in p.stdout, (p.stdout + p.stderr)[-400:])

    for mode, policy in (("pydll", "oom"), ("cdll", "oom"), ("pydll", "never")):
        rdir = os.path.join(tmp, mode + policy)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
        env.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "CUDBL_CAPACITY": "1G",
                    "MEMSHIM_LIMIT": "64M", "MEMSHIM_GC": policy, "MEMSHIM_REPORT_DIR": rdir,
                    "MEMSHIM_LOG": "error"})
        p = subprocess.run([sys.executable, "-c", CHILD, mode, LIB], env=env, capture_output=True, text=True,
                           timeout=120)
        reps = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rdir, "*-epoch*.json")))]
        pol = reps[0]["policies"] if reps else {}
        oom = reps[0]["oom"] if reps else {}
        if policy == "never":  # issue 31: docs/configuration.md, "memshim never runs Python's garbage collector"
            case("MEMSHIM_GC=never, GIL held: memshim never runs gc.collect(); the allocation blocked by garbage "
                 "cycles fails cleanly",
                 p.returncode == 0 and "FIRST True BIG False" in p.stdout and pol.get("gc_runs", 1) == 0
                 and oom.get("rescued_by_gc", 1) == 0, (p.stdout + p.stderr)[-500:] + str(pol) + str(oom))
        elif mode == "pydll":
            case("GIL held: an allocation blocked by garbage cycles succeeds after memshim's gc.collect()",
                 p.returncode == 0 and "FIRST True BIG True" in p.stdout and pol.get("gc_runs", 0) >= 1
                 and oom.get("rescued_by_gc", 0) >= 1, (p.stdout + p.stderr)[-500:] + str(pol) + str(oom))
        else:
            case("GIL released (ctypes.CDLL): memshim does not call into Python; the skip is counted, "
                 "the allocation fails cleanly",
                 p.returncode == 0 and "FIRST True BIG False" in p.stdout and pol.get("gc_runs", 1) == 0
                 and pol.get("gc_skipped_no_gil", 0) >= 1, (p.stdout + p.stderr)[-500:] + str(pol))
finish()
