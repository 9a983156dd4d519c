#!/usr/bin/env python3
"""Every fallback condition of docs/pytorch.md's table, in real PyTorch processes (issue 18, item 2).

Each row of "Fallbacks to segment mode" is one condition under which memshim must not become
PyTorch's allocator; where the condition is PyTorch's own (its allocator settings, its CUDA
state), the test sets it up the way PyTorch reads it, from PyTorch's source:
  - c10/core/AllocatorConfig.cpp (AcceleratorAllocatorConfig): PyTorch reads PYTORCH_ALLOC_CONF,
    else the older PYTORCH_CUDA_ALLOC_CONF, and parses the value's comma-separated key:value
    pairs; an empty value configures nothing, so it must not stop tensor mode either;
  - torch/cuda/__init__.py: is_initialized() is `_initialized and not _is_in_bad_fork()`, the flag
    _lazy_init sets once CUDA is up; no GPU here, so "CUDA initialized first" is that flag set
    before `import memshim` (the program's order when memshim is imported late);
  - torch/cuda/memory.py: change_current_allocator and _set_allocator_settings (already checked by
    tests/torch/test_torch_cpu.py, named in tests/promises/index.txt).
Runs python3 with PyTorch under LD_PRELOAD=libmemshim.so on the driver double, like
tests/torch/test_torch_cpu.py. Ends with "N passed, N failed, N skipped"."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pyharness import BUILD, ROOT, case, finish, need_torch_and_glue, step  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
GLUE = os.path.join(BUILD, "libmemshim_torch.so")
DOUBLE = os.path.join(BUILD, "double")
PYDIR = os.path.join(ROOT, "hooks", "python")

FIRST_USE = '''
import torch
try:
    torch.empty(1, device="cuda")
except Exception as exc:
    print("CUDA", type(exc).__name__)
from memshim import _torch as mt
print("STATE", mt.state.decided, mt.state.tensor)
print("WHY", mt.state.why)
'''


def py(code, extra=None, flags=(), double=True, preload=LIB):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMSHIM_", "_MEMSHIM_", "CUDBL_", "PYTORCH_")) and k not in ("PYTHONPATH", "LD_PRELOAD")}
    env["LD_PRELOAD"] = preload
    env["MEMSHIM_LOG"] = "info"
    if double:
        env["LD_LIBRARY_PATH"] = DOUBLE
    else:
        env.pop("LD_LIBRARY_PATH", None)
    env.update(extra or {})
    p = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for l in p.stdout.splitlines():
        k, _, v = l.partition(" ")
        out[k] = v
    said = [l for l in p.stderr.splitlines() if "memshim stays in segment mode" in l]
    return p.returncode, out, said, p.stdout + p.stderr[-1500:]


need_torch_and_glue("fallbacks as PyTorch decides them", GLUE)

step("allocator settings in the environment", timeout=200)
for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    rc, o, said, log = py(FIRST_USE, {var: "expandable_segments:True"})
    case(f"{var}=expandable_segments:True (auto): segment mode, said once naming {var}",
         rc == 0 and o.get("STATE") == "True False" and len(said) == 1 and var in said[0], log)
rc, o, said, log = py(FIRST_USE, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "MEMSHIM_MODE": "tensor"})
case("PYTORCH_CUDA_ALLOC_CONF set, MEMSHIM_MODE=tensor overrides: tensor mode", rc == 0 and
     o.get("STATE") == "True True" and not said, log)
rc, o, said, log = py(FIRST_USE, {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""})
case("PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF empty (PyTorch parses no setting from them): tensor mode",
     rc == 0 and o.get("STATE") == "True True" and not said, log)

rc, o, said, log = py(FIRST_USE, {"MEMSHIM_MODE": "segment"})
case("MEMSHIM_MODE=segment: PyTorch keeps its allocator, and nothing is said about a fallback",
     rc == 0 and o.get("STATE") == "True False" and o.get("WHY") == "None" and not said, log)

step("CUDA initialized before the hook", timeout=200)
late = f'''
import sys, torch
torch.cuda._initialized = True   # what _lazy_init leaves once CUDA is up (no GPU here to do it)
sys.path.insert(0, {PYDIR!r})
import memshim
from memshim import _torch as mt
print("STATE", mt.state.decided, mt.state.tensor)
print("WHY", mt.state.why)
'''
rc, o, said, log = py(late, flags=("-I",))
case("CUDA initialized before memshim's hook (import memshim after the first CUDA use): segment mode, said once",
     rc == 0 and o.get("STATE") == "True False" and "CUDA was initialized before" in o.get("WHY", "")
     and sum("CUDA was initialized before" in l for l in said) == 1, log)

step("no usable driver", timeout=200)
rc, o, said, log = py(FIRST_USE, double=False)
case("no CUDA driver at all (no libcuda.so.1): memshim does not switch and says why",
     rc == 0 and o.get("STATE") == "True False" and "no usable CUDA driver" in o.get("WHY", ""), log)
rc, o, said, log = py(FIRST_USE, {"CUDBL_FAIL_INIT": "1"})
case("a driver whose cuInit fails: memshim does not switch and says why",
     rc == 0 and o.get("STATE") == "True False" and "no usable CUDA driver" in o.get("WHY", ""), log)

step("glue not loadable", timeout=200)
with tempfile.TemporaryDirectory(prefix="memshim-fb-") as tmp:
    os.makedirs(os.path.join(tmp, "lib"))
    subprocess.run(["cp", LIB, os.path.join(tmp, "lib", "libmemshim.so")], check=True)
    os.symlink(PYDIR, os.path.join(tmp, "lib", "memshim-python"))
    with open(os.path.join(tmp, "lib", "libmemshim_torch.so"), "wb") as f:
        f.write(b"\x7fELF not really a shared object\n")
    rc, o, said, log = py(FIRST_USE, preload=os.path.join(tmp, "lib", "libmemshim.so"))
    case("libmemshim_torch.so present but not loadable: segment mode, said once ('cannot load')",
         rc == 0 and o.get("STATE") == "True False" and len(said) == 1 and "cannot load" in said[0], log)

step("first CUDA use a pinned factory", timeout=200)
pinned = '''
import torch
try:
    torch.empty(8, pin_memory=True)
except Exception as exc:
    print("PIN", type(exc).__name__)
try:
    torch.empty(1, device="cuda")
except Exception as exc:
    print("CUDA", type(exc).__name__)
from memshim import _torch as mt
print("STATE", mt.state.decided, mt.state.tensor)
print("WHY", mt.state.why)
'''
rc, o, said, log = py(pinned)
# PyTorch initializes CUDA from C++ for a pinned factory (getPinnedMemoryAllocator -> lazyInitDevice):
# on the double that initialization fails, so the tensor-mode switch that follows is all one can see
# here; the case holds what docs/pytorch.md promises: no tensor mode claimed unless the switch is
# complete, and at most one line.
case("a factory with pin_memory=True as the first CUDA use: never a half switch (tensor mode only with the "
     "allocator swapped), at most one line", rc == 0 and o.get("STATE", "").startswith("True")
     and len(said) <= 1 and (o.get("STATE") == "True False") == bool(o.get("WHY", "None") != "None"), log)
finish()
