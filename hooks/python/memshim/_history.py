"""PyTorch's memory-history API, served by memshim in tensor mode.

Under a pluggable allocator PyTorch's own torch.cuda.memory._record_memory_history(), _snapshot(),
memory_snapshot() and _dump_snapshot() raise: its caching allocator, which keeps that history, is
not in use. install() replaces them with versions backed by memshim's history ring
(shim/record/history.c): the snapshot is built in C (the same pickle PyTorch writes) and loaded
here with an unpickler that refuses every class. Existing memory-debugging code, torch.cuda's
_memory_viz and pytorch.org/memory_viz then work unchanged.

The memshim package's start-up code calls install(torch, lib) once it has switched PyTorch to
tensor mode (lib: ctypes.PyDLL of libmemshim.so). Nothing here runs at import time.
"""
import ctypes
import functools
import io
import os
import pickle
import sys
import warnings

_ENABLED = {None: 0, "state": 1, "all": 2}
_CONTEXTS = (None, "state", "alloc", "all")
_STACKS = ("python", "all")
_state = {"skip": frozenset()}


class _Refuse(pickle.Unpickler):
    """A snapshot is plain containers; anything that names a class is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"memshim snapshot names {module}.{name}: refused")


def _declare(lib):
    c = ctypes
    lib.memshim_history_record.argtypes = [c.c_int, c.c_longlong, c.c_int, c.c_int]
    lib.memshim_history_record.restype = c.c_int
    lib.memshim_snapshot.argtypes = [c.POINTER(c.POINTER(c.c_ubyte)), c.POINTER(c.c_size_t)]
    lib.memshim_snapshot.restype = c.c_int
    lib.memshim_snapshot_free.argtypes = [c.POINTER(c.c_ubyte)]
    lib.memshim_snapshot_free.restype = None
    lib.memshim_snapshot_dump.argtypes = [c.c_char_p]
    lib.memshim_snapshot_dump.restype = c.c_int
    lib.memshim_sites_library_path.argtypes = [c.c_char_p]
    lib.memshim_sites_library_path.restype = c.c_int
    if hasattr(lib, "memshim_torch_set_version"):
        lib.memshim_torch_set_version.argtypes = [c.c_char_p]
        lib.memshim_torch_set_version.restype = None
    return lib


def _check(rc, what):
    if rc:
        raise RuntimeError(f"memshim: {what} failed: {os.strerror(rc)}")


def _snapshot_bytes(lib):
    buf = ctypes.POINTER(ctypes.c_ubyte)()
    n = ctypes.c_size_t(0)
    _check(lib.memshim_snapshot(ctypes.byref(buf), ctypes.byref(n)), "building the memory snapshot")
    try:
        return ctypes.string_at(buf, n.value)
    finally:
        lib.memshim_snapshot_free(buf)


def _load(data):
    snap = _Refuse(io.BytesIO(data)).load()
    skip = _state["skip"]
    if skip:
        snap["device_traces"] = [[e for e in t if e.get("action") not in skip] for t in snap["device_traces"]]
    return snap


def install(torch_module, lib):
    """Serve torch.cuda.memory's history API from memshim (tensor mode). Returns the names
    replaced. Safe to call more than once."""
    lib = _declare(lib)
    mem = torch_module.cuda.memory
    version = getattr(torch_module, "__version__", "")
    if version and hasattr(lib, "memshim_torch_set_version"):  # the start-up hook hands it over too
        lib.memshim_torch_set_version(str(version).encode())
    # Frames in torch's own files and in this package are library frames, never a site.
    for path in (os.path.dirname(os.path.abspath(torch_module.__file__)),
                 os.path.dirname(os.path.abspath(__file__))):
        lib.memshim_sites_library_path((path + os.sep).encode())

    def _record(mode, max_entries, clear, frames, skip_actions):
        entries = min(int(max_entries), (1 << 63) - 1) if max_entries is not None else sys.maxsize
        _check(lib.memshim_history_record(mode, entries, 1 if clear else 0, 1 if frames else 0),
               "recording the memory history")
        _state["skip"] = frozenset(skip_actions or ())

    def _record_memory_history_impl(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                                    device=None, clear_history=False, compile_context=False,
                                    global_record_annotations=False, skip_actions=None,
                                    record_pinned_host_memory=False, record_cuda=True):
        if enabled not in _ENABLED:
            raise RuntimeError("expected state to be 'state', 'all', or None")
        if context not in _CONTEXTS:
            raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
        if stacks not in _STACKS:
            raise RuntimeError("expected stacks to be 'python', or 'all'")
        mode = _ENABLED[enabled] if record_cuda else 0
        # "state" keeps no events, as in PyTorch (max_entries becomes 1 there).
        _record(mode, max_entries if mode == 2 else 0, clear_history, context is not None, skip_actions)

    def _record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                      trace_alloc_record_context=False, device=None, record_context_cpp=False,
                                      clear_history=False, compile_context=False,
                                      global_record_annotations=False, skip_actions=None,
                                      record_pinned_host_memory=False, record_cuda=True):
        mode = 0 if not enabled or not record_cuda else (2 if trace_alloc_max_entries > 1 else 1)
        _record(mode, trace_alloc_max_entries if mode == 2 else 0, clear_history,
                record_context or trace_alloc_record_context, skip_actions)

    def _record_memory_history(enabled="all", *args, **kwargs):
        if isinstance(enabled, bool):
            return _record_memory_history_legacy(enabled, *args, **kwargs)
        return _record_memory_history_impl(enabled, *args, **kwargs)

    def _snapshot(device=None, augment_with_fx_traces=False):
        snap = _load(_snapshot_bytes(lib))
        if augment_with_fx_traces:
            augment = getattr(mem, "_augment_memory_snapshot_stack_traces", None)
            if augment is not None:
                snap = augment(snap)
        return snap

    def memory_snapshot(mempool_id=None, include_traces=True):
        return _snapshot()["segments"]

    def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        if augment_with_fx_traces or _state["skip"]:
            snap = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
            with open(filename, "wb") as f:
                pickle.dump(snap, f, protocol=4)
            return
        _check(lib.memshim_snapshot_dump(os.fsencode(filename)), f"writing the memory snapshot {filename}")

    new = {"_record_memory_history": _record_memory_history,
           "_record_memory_history_impl": _record_memory_history_impl,
           "_record_memory_history_legacy": _record_memory_history_legacy,
           "_snapshot": _snapshot, "memory_snapshot": memory_snapshot, "_dump_snapshot": _dump_snapshot}
    replaced = []
    for name, fn in new.items():
        orig = getattr(mem, name, None)
        if orig is None:
            continue
        if getattr(orig, "_memshim", False):  # installed before
            replaced.append(name)
            continue
        fn = functools.wraps(orig)(fn)
        fn._memshim = True
        # torch.cuda re-exports some of these (`from .memory import *`): replace every binding.
        for m in (mem, torch_module.cuda):
            if getattr(m, name, None) is orig:
                setattr(m, name, fn)
        replaced.append(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hist = getattr(mem, "_record_memory_history", None)
        impl = getattr(mem, "_record_memory_history_impl", None)
        if hist is not None and impl is not None:
            try:
                import inspect
                hist.__signature__ = inspect.signature(impl)
            except (TypeError, ValueError):
                pass
    return replaced
