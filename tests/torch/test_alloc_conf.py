#!/usr/bin/env python3
"""PyTorch's own allocator settings, read as PyTorch reads them (issue 25, item 5; docs/pytorch.md).

PyTorch takes its allocator settings from PYTORCH_ALLOC_CONF or the deprecated
PYTORCH_CUDA_ALLOC_CONF (PyTorch 2.15: the old name when it is set, even empty, else the new one;
c10/cuda/CUDAAllocatorConfig.h and c10/core/AllocatorConfig.cpp). In real PyTorch processes under
LD_PRELOAD=libmemshim.so on the driver double:
  - memshim picks the variable PyTorch itself parsed (torch._C._accelerator_getAllocatorSettings),
    whichever is set;
  - in auto mode only keys that tune PyTorch's own device allocator keep memshim in segment mode:
    per_process_memory_fraction (memshim honours it) and pinned_* (the host allocator) do not;
  - per_process_memory_fraction becomes memshim's limit in tensor mode, as
    set_per_process_memory_fraction does, and cudaMemGetInfo reports that cap, not the card; a bad
    value is a warning and no limit; the program's own set_per_process_memory_fraction wins;
  - throw_on_cudamalloc_oom:True with MEMSHIM_SPILL=host in segment mode is a warning (PyTorch
    refuses before calling cudaMalloc, so spill cannot serve).
Ends with "N passed, N failed, N skipped"."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pyharness import BUILD, case, finish, need_torch_and_glue, step  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
GLUE = os.path.join(BUILD, "libmemshim_torch.so")
DOUBLE = os.path.join(BUILD, "double")
GiB = 1 << 30

CODE = r'''
import ctypes, json, torch
from memshim import _torch as mt, _allocconf
try:
    torch.empty(1, device="cuda")
except Exception:
    pass                                   # no GPU: the switch was decided all the same
print("STATE", json.dumps([mt.state.tensor, mt.state.why]))
print("PICK", json.dumps(list(_allocconf.pick(torch=torch))))
try:
    theirs = torch._C._accelerator_getAllocatorSettings()
except Exception as exc:
    theirs = "error " + type(exc).__name__
print("TORCH", json.dumps(theirs))
lib = ctypes.CDLL(None)
lib.memshim_torch_get_memory_fraction.restype = ctypes.c_double
# PyTorch's own CUDA runtime cannot run over the double: the driver API, as a job's other libraries
cu = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
lib.memshim_malloc.restype = ctypes.c_void_p
assert lib.memshim_malloc(ctypes.c_ssize_t(8 << 20), 0, None)   # the pool serves device 0 from now on
def meminfo():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert lib.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0   # memshim's, as the program sees it
    return [t.value, f.value]
print("LIMIT", json.dumps([round(lib.memshim_torch_get_memory_fraction(0), 6), meminfo()]))
lib.memshim_torch_set_memory_fraction(ctypes.c_double(0.125), 0)   # the program's own, later
print("PROGRAM", json.dumps([round(lib.memshim_torch_get_memory_fraction(0), 6), meminfo()]))
'''


def run(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMSHIM_", "_MEMSHIM_", "CUDBL_", "PYTORCH_")) and k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update({"LD_PRELOAD": LIB, "LD_LIBRARY_PATH": DOUBLE, "CUDBL_CAPACITY": "4G", "MEMSHIM_LOG": "info"})
    env.update(extra)
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for line in p.stdout.splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return p.returncode, out, p.stderr, f"rc {p.returncode}\n{p.stdout}\n{p.stderr[-1500:]}"


def warnings(err):
    return [l for l in err.splitlines() if "warning" in l]


need_torch_and_glue("PyTorch's allocator settings", GLUE)

step("per_process_memory_fraction under either name", timeout=250)
for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    rc, o, err, log = run({var: "per_process_memory_fraction:0.25"})
    case(f"{var}=per_process_memory_fraction:0.25 (auto): tensor mode, memshim's limit is a quarter of the device "
         "and cudaMemGetInfo reports it (total 1 GiB of 4, free under it)",
         rc == 0 and o.get("STATE") == [True, None] and o.get("PICK") == [var, "per_process_memory_fraction:0.25"]
         and o.get("LIMIT", [0, [0, 0]])[0] == 0.25 and o["LIMIT"][1][0] == GiB and o["LIMIT"][1][1] <= GiB - (8 << 20)
         and f"{var}: per_process_memory_fraction:0.25" in err, log)
    case(f"{var}: the program's own set_per_process_memory_fraction(0.125) afterwards wins, and cudaMemGetInfo "
         "follows it", rc == 0 and o.get("PROGRAM", [0, [0]])[0] == 0.125 and o["PROGRAM"][1][0] == GiB // 2, log)

step("both names set: PyTorch's own choice", timeout=250)
rc, o, err, log = run({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5",
                       "PYTORCH_ALLOC_CONF": "per_process_memory_fraction:0.25"})
picked = (o.get("PICK") or [None, None])
case("both set and different: memshim takes the variable PyTorch parsed (its _accelerator_getAllocatorSettings), and "
     "that one's fraction", rc == 0 and picked[1] == o.get("TORCH") and picked[0] is not None
     and o.get("LIMIT", [0])[0] == float(picked[1].split(":")[1]), log)
rc, o, err, log = run({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
case("PYTORCH_CUDA_ALLOC_CONF empty and PYTORCH_ALLOC_CONF=expandable_segments:True: memshim follows what PyTorch "
     "parsed (here the empty one: nothing configured, tensor mode; else segment mode)",
     rc == 0 and o.get("PICK", [None, None])[1] == o.get("TORCH")
     and o.get("STATE", [None])[0] == (o.get("TORCH") == ""), log)

step("keys that keep memshim out, and keys that do not", timeout=250)
rc, o, err, log = run({"PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.25"})
case("expandable_segments with a fraction (auto): segment mode naming expandable_segments only; PyTorch keeps its "
     "own allocator and applies the fraction itself (memshim's limit unchanged)",
     rc == 0 and o.get("STATE", [None])[0] is False and "(expandable_segments;" in (o["STATE"][1] or "")
     and "per_process_memory_fraction" not in o["STATE"][1] and o.get("LIMIT", [0])[0] == 1.0, log)
rc, o, err, log = run({"PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.25",
                       "MEMSHIM_MODE": "tensor"})
case("the same with MEMSHIM_MODE=tensor: tensor mode, and the fraction is memshim's limit",
     rc == 0 and o.get("STATE") == [True, None] and o.get("LIMIT", [0, [0]])[0] == 0.25 and o["LIMIT"][1][0] == GiB, log)
rc, o, err, log = run({"PYTORCH_ALLOC_CONF": "pinned_use_background_threads:True, per_process_memory_fraction : 0.5"})
case("pinned_* keys (the host allocator) and spaces (PyTorch drops them): tensor mode, limit half the device",
     rc == 0 and o.get("STATE") == [True, None] and o.get("LIMIT", [0, [0]])[0] == 0.5 and o["LIMIT"][1][0] == 2 * GiB,
     log)

step("a bad fraction", timeout=200)
rc, o, err, log = run({"PYTORCH_ALLOC_CONF": "per_process_memory_fraction:1.5"})
w = warnings(err)
case("per_process_memory_fraction:1.5: one warning naming the variable, the value and what is allowed; no limit; "
     "the job runs", rc == 0 and o.get("STATE") == [True, None] and o.get("LIMIT", [0])[0] == 1.0
     and len([l for l in w if "PYTORCH_ALLOC_CONF" in l and "per_process_memory_fraction:1.5" in l and "(0, 1]" in l]) == 1,
     log)

step("throw_on_cudamalloc_oom with spill", timeout=250)
for extra, want, title in (
        ({"MEMSHIM_SPILL": "host"}, 1, "with MEMSHIM_SPILL=host (auto, segment mode): a warning naming the key and spill"),
        ({"MEMSHIM_SPILL": "host", "MEMSHIM_MODE": "segment"}, 1, "with MEMSHIM_SPILL=host and MEMSHIM_MODE=segment: "
                                                                  "the same warning"),
        ({}, 0, "without spill: nothing to say")):
    rc, o, err, log = run({"PYTORCH_CUDA_ALLOC_CONF": "throw_on_cudamalloc_oom:True", **extra})
    n = len([l for l in warnings(err) if "throw_on_cudamalloc_oom:True" in l and "MEMSHIM_SPILL=host" in l])
    case(f"throw_on_cudamalloc_oom:True {title}", rc == 0 and o.get("STATE", [None])[0] is False and n == want, log)
rc, o, err, log = run({"PYTORCH_CUDA_ALLOC_CONF": "throw_on_cudamalloc_oom:True", "MEMSHIM_SPILL": "host",
                       "MEMSHIM_MODE": "tensor"})
case("throw_on_cudamalloc_oom:True in tensor mode: PyTorch's check does not run (memshim places the tensors), no "
     "warning", rc == 0 and o.get("STATE") == [True, None] and not [l for l in warnings(err) if "throw_on" in l], log)

finish()
