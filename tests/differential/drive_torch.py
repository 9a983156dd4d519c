"""drive_torch.py: runs a list of operations through memshim's PyTorch entry points, the ones
PyTorch's pluggable allocator calls (memshim_torch_alloc / memshim_torch_free, the reset hook
memshim_empty_cache, set_memory_fraction) and the ones memshim's torch.cuda.memory replacements
read (memshim_torch_stats, memshim_torch_reset_peak / _reset_accumulated,
memshim_torch_get_memory_fraction). Run under LD_PRELOAD=libmemshim.so on the driver double by
test_differential.py; standard library only.

argv[1]: a JSON list of operations; prints one JSON line per "stats" operation and per failed
allocation:
  ["alloc", name, size]   ["free", name]          ["stats"]          ["empty_cache"]
  ["reset_peak"]          ["reset_accumulated"]   ["fraction", f]    ["get_fraction"]
  ["fill", name, size]    allocate blocks of `size` until one fails; prints how many fitted"""
import ctypes
import json
import sys

lib = ctypes.PyDLL(None)
lib.memshim_torch_alloc.restype = ctypes.c_void_p
lib.memshim_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.memshim_torch_stats.restype = ctypes.c_int
lib.memshim_torch_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
lib.memshim_torch_stat_name.restype = ctypes.c_char_p
lib.memshim_torch_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
lib.memshim_torch_get_memory_fraction.restype = ctypes.c_double
lib.memshim_torch_get_memory_fraction.argtypes = [ctypes.c_int]


def stats():
    n = lib.memshim_torch_stats(0, None, 0)
    vals = (ctypes.c_longlong * n)()
    lib.memshim_torch_stats(0, vals, n)
    return {lib.memshim_torch_stat_name(i).decode(): vals[i] for i in range(n)}


# PyTorch's lazy CUDA init calls the init hook first (set_init_fn), before any allocation and
# before set_per_process_memory_fraction (which calls _lazy_init itself).
lib.memshim_torch_init(1)
live = {}
for op in json.loads(sys.argv[1]):
    kind = op[0]
    if kind == "alloc":
        p = lib.memshim_torch_alloc(op[2], 0, None)
        if p or op[2] == 0:  # size 0: NULL is the answer (and not an OOM), as in PyTorch
            live[op[1]] = (p, op[2])
        else:
            print(json.dumps({"oom": op[1]}), flush=True)
    elif kind == "free":
        p, size = live.pop(op[1])
        if p:  # a NULL data pointer is never freed (c10::DataPtr has no context to delete)
            lib.memshim_torch_free(p, size, 0, None)  # PyTorch frees with the allocation's size
    elif kind == "stats":
        print(json.dumps({"stats": stats()}), flush=True)
    elif kind == "empty_cache":
        lib.memshim_empty_cache()
    elif kind == "reset_peak":
        lib.memshim_torch_reset_peak(0)
    elif kind == "reset_accumulated":
        lib.memshim_torch_reset_accumulated(0)
    elif kind == "fraction":
        lib.memshim_torch_set_memory_fraction(op[1], 0)
    elif kind == "get_fraction":
        print(json.dumps({"fraction": lib.memshim_torch_get_memory_fraction(0)}), flush=True)
    elif kind == "fill":
        n = 0
        while True:
            p = lib.memshim_torch_alloc(op[2], 0, None)
            if not p:
                break
            live[f"{op[1]}{n}"] = (p, op[2])
            n += 1
        print(json.dumps({"fill": n}), flush=True)
    else:
        raise SystemExit(f"drive_torch: unknown operation {op!r}")
