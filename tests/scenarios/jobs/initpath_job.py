"""A public entry that makes PyTorch initialize CUDA from C++ without torch.cuda._lazy_init,
called before any other CUDA use (argv: record_history | record_history_legacy | pin_memory |
storage_pin). Prints what memshim decided, and for the history API what the snapshot holds."""
import ctypes
import sys

import torch
from memshim import _torch as mt

which = sys.argv[1]
try:
    if which == "record_history":
        torch.cuda.memory._record_memory_history(max_entries=1000)
    elif which == "record_history_legacy":
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=1000)
    elif which == "pin_memory":
        torch.ones(3).pin_memory()
    elif which == "storage_pin":
        torch.UntypedStorage(3).pin_memory()
    print("CALL ok")
except Exception as exc:  # noqa: BLE001 - PyTorch's own CUDA init fails over the driver double
    print("CALL", type(exc).__name__)
print("TENSOR", mt.state.tensor, "WHY", mt.state.why)
print("PIN_WRAPPED", getattr(torch.Tensor.pin_memory, "__code__", None) is not None)
if which.startswith("record_history") and mt.state.tensor:
    glue = ctypes.CDLL(mt.state.glue[0])  # what PyTorch calls for each tensor in tensor mode
    glue.memshim_glue_malloc.restype = ctypes.c_void_p
    glue.memshim_glue_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib = ctypes.CDLL(None)
    lib.memshim_malloc.restype = ctypes.c_void_p
    lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    p = lib.memshim_malloc(3 << 20, 0, None)
    snap = torch.cuda.memory._snapshot()
    allocs = [e for t in snap["device_traces"] for e in t if e["action"] == "alloc"]
    print("SNAPSHOT", len(allocs), allocs[0]["size"] if allocs else None)
