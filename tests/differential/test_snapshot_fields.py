#!/usr/bin/env python3
"""The snapshot's segments, blocks and events against what torch.cuda.memory._snapshot() would
give for the same history (issue 18, item 2).

PyTorch's rules, from c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator::snapshot,
record_trace's callers) and torch/csrc/cuda/Module.cpp (the dict it builds):
  - a segment's total_size is the sum of its blocks' sizes, allocated_size the sum over allocated
    blocks, active_size over active ones (allocated, or with events pending), requested_size the
    requested bytes of the active ones; segments come sorted by address;
  - over all segments, allocated_size adds up to allocated_bytes.all.current, total_size to
    reserved_bytes.all.current, requested_size to requested_bytes.all.current;
  - a block's state is active_allocated, active_pending_free or inactive;
  - the trace: an alloc event per allocation with the requested size (alloc_found_block records
    orig_size), free_requested and free_completed with the block's requested size (free,
    free_block), never an event for size 0 (NativeCachingAllocator::allocate skips malloc).
memshim's blocks are its own (512-byte rounded, no segment of PyTorch's sizes), so the figures
are held to these relations and to memshim_torch_stats() on the same history, not to PyTorch's
layout. Driven through the tensor-mode entry points (memshim_torch_alloc/free) with
MEMSHIM_SNAPSHOT on the driver double."""
import json
import os
import pickle
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pyharness import BUILD, case, finish, step  # noqa: E402
import torch_model as tm  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
KiB, MiB = 1 << 10, 1 << 20

JOB = r"""
import ctypes, json, sys
lib = ctypes.PyDLL(None)
lib.memshim_torch_alloc.restype = ctypes.c_void_p
lib.memshim_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
lib.memshim_torch_stat_name.restype = ctypes.c_char_p
lib.memshim_torch_init(1)
ops = json.loads(sys.argv[1])
live, log = {}, []
for op in ops:
    if op[0] == "a":
        p = lib.memshim_torch_alloc(op[2], 0, None)
        live[op[1]] = (p or 0, op[2])
        log.append(["a", p or 0, op[2]])
    else:
        p, n = live.pop(op[1])
        if p:
            lib.memshim_torch_free(p, n, 0, None)
        log.append(["f", p, n])
n = lib.memshim_torch_stats(0, None, 0)
vals = (ctypes.c_longlong * n)()
lib.memshim_torch_stats(0, vals, n)
stats = {lib.memshim_torch_stat_name(i).decode(): vals[i] for i in range(n)}
print(json.dumps({"log": log, "live": [[p, n] for p, n in live.values()], "stats": stats}))
"""

step("a history through the tensor-mode entry points")
SIZES = [0, 1, 512, 513, 4000, MiB - 1, MiB, MiB + 1, 2 * MiB, 3 * MiB + 5, 10 * MiB, 20 * MiB + 1, 0, 700 * KiB]
ops = [["a", f"x{i}", s] for i, s in enumerate(SIZES)]
ops += [["f", f"x{i}"] for i in (1, 3, 6, 9, 12)]
ops += [["a", f"y{i}", s] for i, s in enumerate((300, 2 * MiB - 512, 5 * MiB, 0))]
ops += [["f", "y1"], ["f", "x0"]]
with tempfile.TemporaryDirectory(prefix="memshim-snapdiff-") as tmp:
    snap_path = os.path.join(tmp, "snap.pickle")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "CUDBL_", "PYTORCH_"))}
    env.update(LD_PRELOAD=LIB, LD_LIBRARY_PATH=os.path.join(BUILD, "double"), CUDBL_CAPACITY="8G",
               MEMSHIM_SNAPSHOT=snap_path, MEMSHIM_LOG="warn")
    p = subprocess.run([sys.executable, "-c", JOB, json.dumps(ops)], env=env, capture_output=True, text=True,
                       timeout=120)
    case("the job runs and writes its snapshot at exit", p.returncode == 0 and os.path.exists(snap_path),
         p.stdout[-800:] + p.stderr[-800:])
    if p.returncode != 0 or not os.path.exists(snap_path):
        finish()
    res = json.loads(p.stdout.strip().splitlines()[-1])
    with open(snap_path, "rb") as f:
        snap = pickle.load(f)

segs = snap["segments"]
blocks = [b for s in segs for b in s["blocks"]]
step("segments and blocks as PyTorch sums them")
bad = []
for s in segs:
    bs = s["blocks"]
    want = {"total_size": sum(b["size"] for b in bs),
            "allocated_size": sum(b["size"] for b in bs if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in bs if b["state"] in ("active_allocated", "active_pending_free")),
            "requested_size": sum(b["requested_size"] for b in bs
                                  if b["state"] in ("active_allocated", "active_pending_free"))}
    for k, v in want.items():
        if s[k] != v:
            bad.append(f"segment {s['address']:#x}: {k} {s[k]}, its blocks give {v}")
    if {b["state"] for b in bs} - {"active_allocated", "active_pending_free", "inactive"}:
        bad.append(f"segment {s['address']:#x}: block states {sorted({b['state'] for b in bs})}")
case("each segment's total, allocated, active and requested sizes are its blocks' sums (snapshot())", not bad,
     bad[:5])
case("segments come sorted by address", [s["address"] for s in segs] == sorted(s["address"] for s in segs),
     [hex(s["address"]) for s in segs][:8])
st = res["stats"]
tot = {k: sum(s[k] for s in segs) for k in ("total_size", "allocated_size", "requested_size")}
case("over all segments: allocated_size = allocated_bytes.all.current, total_size = reserved_bytes.all.current, "
     "requested_size = requested_bytes.all.current (the same history's memory_stats())",
     tot["allocated_size"] == st["allocated_bytes.all.current"] and tot["total_size"] == st["reserved_bytes.all.current"]
     and tot["requested_size"] == st["requested_bytes.all.current"], (tot, {k: st[k] for k in (
         "allocated_bytes.all.current", "reserved_bytes.all.current", "requested_bytes.all.current")}))
live = {p: n for p, n in res["live"] if p}
alloc_blocks = {b["address"]: b for b in blocks if b["state"] == "active_allocated"}
case("every live allocation is one active_allocated block at its address, requested_size its request, size "
     "round_size(request); nothing else is allocated",
     set(alloc_blocks) == set(live) and all(alloc_blocks[p]["requested_size"] == n
                                             and alloc_blocks[p]["size"] == tm.round_size(n) for p, n in live.items()),
     (sorted(set(alloc_blocks) ^ set(live))[:4],
      [(hex(p), n, alloc_blocks.get(p)) for p, n in live.items() if alloc_blocks.get(p, {}).get("requested_size") != n][:3]))

step("the trace as record_trace writes it")
trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_requested", "free_completed")]
want = []
for kind, ptr, n in res["log"]:
    if n == 0:
        continue  # PyTorch: no allocation, no event
    if kind == "a":
        want.append(("alloc", ptr, n))
    else:
        want += [("free_requested", ptr, n), ("free_completed", ptr, n)]
got = [(e["action"], e["addr"], e["size"]) for e in trace]
case(f"device_traces: {len(want)} alloc / free_requested / free_completed events in order, addr and the requested "
     f"size as PyTorch records them, none for size 0", got == want,
     [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w][:4] or (len(got), len(want)))
case("no event is at address 0 (a size-0 allocation is not an allocation)",
     all(e.get("addr") for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_requested")),
     [e for e in snap["device_traces"][0] if e["action"] == "alloc" and not e.get("addr")][:3])
finish()
