"""memshim's Python side, start: find libmemshim.so in the process, declare its entry points, and
watch imports (torch, transformers.trainer, torch._inductor.config) to act right after them.

Nothing here starts memshim's CUDA side: it reads settings only. Everything that can fail says so
in one line through memshim's logger and leaves the program as it was.
"""
import ctypes
import os
import sys
import threading

LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = 0, 1, 2, 3
MODE_AUTO, MODE_TENSOR, MODE_SEGMENT, MODE_OFF = 0, 1, 2, 3

_lib = None
_lib_path = None
_armed = False
_lock = threading.RLock()

_SIGS = {
    "memshim_library_path": ([], ctypes.c_char_p),
    "memshim_torch_setting": ([ctypes.c_char_p], ctypes.c_long),
    "memshim_torch_log": ([ctypes.c_int, ctypes.c_char_p], None),
    "memshim_epoch": ([], None),
    "memshim_step": ([], None),
    "memshim_epoch_from": ([ctypes.c_char_p], ctypes.c_int),
    "memshim_step_if_started": ([], None),
    "memshim_torch_stats": ([ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int], ctypes.c_int),
    "memshim_torch_stat_name": ([ctypes.c_int], ctypes.c_char_p),
    "memshim_torch_reset_peak": ([ctypes.c_int], None),
    "memshim_torch_reset_accumulated": ([ctypes.c_int], None),
    "memshim_torch_get_memory_fraction": ([ctypes.c_int], ctypes.c_double),
    "memshim_torch_epoch_stat": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_longlong], None),
    "memshim_torch_epoch_stats_clear": ([], None),
    "memshim_torch_set_version": ([ctypes.c_char_p], None),
    "memshim_run_interrupted": ([ctypes.c_int], ctypes.c_int),
}


class Stats(ctypes.Structure):
    """struct memshim_stats (memshim.h)."""
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "live_bytes", "peak_live_bytes", "reserved_bytes", "peak_reserved_bytes", "map_ops", "unmap_ops",
        "reclaimed_pages", "allocs", "frees", "ooms")]


class EpochFigures(ctypes.Structure):
    """struct memshim_epoch_figures (memshim.h)."""
    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "epoch", "steps", "allocated_bytes", "allocated_peak_bytes", "reserved_peak_bytes")] + \
        [("fragmentation", ctypes.c_double), ("peak_allocated_over_peak_reserved", ctypes.c_double),
         ("ooms", ctypes.c_ulonglong), ("oom_rescues", ctypes.c_ulonglong), ("growth_bytes", ctypes.c_longlong)]


def _declare(so):
    for name, (args, res) in _SIGS.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, res
    so.memshim_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]
    so.memshim_get_stats.restype = ctypes.c_int
    so.memshim_last_epoch.argtypes = [ctypes.c_int, ctypes.POINTER(EpochFigures)]
    so.memshim_last_epoch.restype = ctypes.c_int
    return so


def _find():
    """The preloaded libmemshim.so (its own path, from dladdr), else one beside this package:
    installed (lib/memshim-python/memshim -> lib) or the source tree (hooks/python -> build)."""
    try:
        fn = ctypes.PyDLL(None).memshim_library_path
        fn.restype = ctypes.c_char_p
        p = (fn() or b"").decode()
        if p:
            return p
    except AttributeError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (os.path.join(here, "..", "..", "libmemshim.so"),
              os.path.join(here, "..", "..", "..", "build", "libmemshim.so")):
        if os.path.exists(c):
            return os.path.realpath(c)
    return None


def lib():
    """libmemshim.so through ctypes.PyDLL (calls keep the GIL, so an epoch may run gc.collect()),
    or None when memshim is not in this process."""
    return _lib


def lib_path():
    return _lib_path


def setting(name):
    return _lib.memshim_torch_setting(name.encode()) if _lib else -1


def log(level, msg):
    if _lib:
        _lib.memshim_torch_log(level, str(msg).encode("utf-8", "replace"))
    elif level <= LOG_WARN:
        print(f"memshim: {msg}", file=sys.stderr)


# ---- import watching ------------------------------------------------------------------------
_watch = {}  # module name -> [callback(module)]


class _Loader:
    """Runs the real loader, then the callbacks; the module keeps its real loader."""

    def __init__(self, inner, name):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        try:
            self._inner.exec_module(module)
        finally:
            # Some modules refuse new attributes (torch._inductor.config): the spec is enough then.
            for obj, attr in ((module, "__loader__"), (getattr(module, "__spec__", None), "loader")):
                try:
                    if obj is not None and getattr(obj, attr, None) is self:
                        setattr(obj, attr, self._inner)
                except Exception:  # noqa: BLE001
                    pass
        _fire(self._name, module)

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name not in _watch:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(name, path, target)
            except Exception:  # noqa: BLE001 - leave the error to the normal import
                return None
            if spec is not None:
                if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                    return None
                spec.loader = _Loader(spec.loader, name)
                return spec
        return None


_finder = _Finder()


def _fire(name, module):
    with _lock:
        cbs = _watch.pop(name, [])
    for cb in cbs:
        try:
            cb(module)
        except Exception as exc:  # noqa: BLE001
            log(LOG_WARN, f"memshim's hook on `import {name}` failed ({type(exc).__name__}: {exc}); "
                          "memshim stays in segment mode for it")


def watch(name, cb):
    """Call cb(module) once `name` is imported (at once when it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        try:
            cb(mod)
        except Exception as exc:  # noqa: BLE001
            log(LOG_WARN, f"memshim's hook on {name} failed ({type(exc).__name__}: {exc})")
        return
    with _lock:
        _watch.setdefault(name, []).append(cb)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


# ---- the end of a run interrupted by Ctrl-C ---------------------------------------------------
def _dying_of_sigint():
    """Whether this interpreter is ending after an uncaught KeyboardInterrupt. CPython then
    finalizes and kills itself with SIGINT (Modules/main.c, exit_sigint), so libmemshim.so's C exit
    handler never runs. CPython 3.8-3.11 keep the flag in _Py_UnhandledKeyboardInterrupt (exported
    by the interpreter here); where it is not found, the uncaught exception that ended the script
    is in sys.last_value (PyErr_Print sets it) on every version."""
    try:
        return bool(ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value)
    except (ValueError, AttributeError, OSError):
        pass
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)


def _at_python_exit():
    """Python's exit path (atexit, registered before the program's own, so it runs after them):
    after an uncaught KeyboardInterrupt write the open epoch, the summary and the snapshot now."""
    try:
        if _lib is None or not _dying_of_sigint() or setting("started") != 1:
            return
        torch_side = sys.modules.get("memshim._torch")
        if torch_side is not None:
            try:
                torch_side.hand_epoch_stats()  # segment mode: PyTorch's own figures for the reports
            except Exception:  # noqa: BLE001
                pass
        import signal
        _lib.memshim_run_interrupted(int(signal.SIGINT))
    except Exception:  # noqa: BLE001 - never in the way of the interpreter's own exit
        pass


# ---- start ----------------------------------------------------------------------------------
def arm():
    """Find libmemshim.so and watch for torch and the frameworks. Idempotent."""
    global _armed, _lib, _lib_path
    with _lock:
        if _armed:
            return _lib is not None
        _armed = True
        path = _find()
        if not path:
            return False
        try:
            _lib = _declare(ctypes.PyDLL(path, mode=ctypes.RTLD_GLOBAL))
            _lib_path = path
        except (OSError, AttributeError) as exc:
            print(f"memshim: cannot use {path} ({exc}); memshim's Python hook is off", file=sys.stderr)
            _lib = None
            return False
    if setting("mode") == MODE_OFF:
        return True
    import atexit
    atexit.register(_at_python_exit)
    try:  # with the GIL held here: let allocations read their sites without it (CPython 3.11)
        _lib.memshim_sites_probe()
    except AttributeError:
        pass
    from . import _frameworks, _torch
    watch("torch", _torch.on_torch)
    watch("transformers.trainer", _frameworks.on_transformers_trainer)
    _frameworks.watch_lightning()
    return True


def from_pth():
    """The line `make install-python` puts in a .pth file (python -I/-E, embedded interpreters)."""
    try:
        arm()
    except Exception as exc:  # noqa: BLE001
        print(f"memshim: the Python hook could not start ({exc}); memshim stays in segment mode", file=sys.stderr)
