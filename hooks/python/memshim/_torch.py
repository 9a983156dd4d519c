"""memshim's Python side, PyTorch: the switch to memshim's pluggable allocator at PyTorch's lazy
CUDA initialization (not at import: a program that sets its own allocator, or its allocator
settings, keeps working and memshim stays in segment mode), the memory API answering from
memshim's counters in tensor mode, and PyTorch's own figures for the epoch reports in segment
mode. See docs/pytorch.md.

Every hook is probed with hasattr: PyTorch versions differ. Nothing here runs before the program
touches CUDA, except wrapping functions.
"""
import ctypes
import functools
import os
import sys
import threading

from . import _allocconf, _boot, _epochs
from ._boot import LOG_INFO, LOG_WARN, MODE_AUTO, MODE_OFF, MODE_SEGMENT, MODE_TENSOR, log, setting


class _State:
    decided = False       # the switch was considered and, if made, is complete (set last, under _lock)
    deciding = None       # the thread deciding now (its own re-entry must not wait for itself)
    tensor = False        # PyTorch allocates through memshim
    user_choice = None    # why the program's own allocator choice keeps memshim out
    allocator = None      # the CUDAPluggableAllocator (kept alive)
    glue = None
    why = None            # why memshim stayed in segment mode


state = _State()
# Held from the start of the decision until the switch is complete: a first CUDA use from another
# thread (the pin-memory thread, a DataLoader, the program's threads) waits here, so PyTorch's
# own initialization can never run before memshim's allocator is in place.
_lock = threading.RLock()
_torch = None

# PyTorch's own memory_stats() keys carried by segment-mode epoch reports.
EPOCH_KEYS = [f"{m}.all.{f}" for m in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")
              for f in ("current", "peak", "allocated", "freed")] + \
             [f"inactive_split_bytes.all.{f}" for f in ("current", "peak")] + \
             ["num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"]


def _replace(mods, name, orig, new):
    """Put `new` wherever a module holds `orig` under `name` (modules bound it at import)."""
    for m in mods:
        if m is not None and getattr(m, name, None) is orig:
            setattr(m, name, new)


def _torch_modules():
    return [m for n, m in list(sys.modules.items()) if n == "torch" or n.startswith("torch.")]


def on_torch(torch):
    """Right after `import torch` finished."""
    global _torch
    _torch = torch
    _boot.lib().memshim_torch_set_version(str(torch.__version__).encode())
    cuda = torch.cuda
    mem = getattr(cuda, "memory", None)
    orig_lazy = getattr(cuda, "_lazy_init", None)
    if orig_lazy is not None and not getattr(orig_lazy, "_memshim", False):
        @functools.wraps(orig_lazy)
        def _lazy_init():
            # `decided` is set only once the switch is complete, so a thread that sees it may go on;
            # any other waits in _decide() for the thread that is switching.
            if not state.decided and not cuda.is_initialized():
                _decide()
            return orig_lazy()
        _lazy_init._memshim = True
        # torch.cuda.memory and torch.cuda.random bound it with `from . import _lazy_init`
        _replace(_torch_modules(), "_lazy_init", orig_lazy, _lazy_init)
    if not cuda.is_initialized():
        _wrap_init_paths(torch)

    for name, why in (("change_current_allocator", "the program set its own allocator (change_current_allocator)"),
                      ("_set_allocator_settings", "the program set PyTorch's allocator settings "
                                                  "(_set_allocator_settings)")):
        orig = getattr(mem, name, None)
        if orig is None:
            continue
        _replace([mem, cuda], name, orig, _noting(orig, why))
    # The bindings themselves, for programs that call them directly. PyTorch 2.15's
    # torch.cuda.memory._set_allocator_settings is deprecated in favour of
    # torch._C._accelerator_setAllocatorSettings (and only forwards to it); older PyTorch has
    # torch._C._cuda_cudaCachingAllocator_set_allocator_settings. Both are looked up at call time.
    C = getattr(torch, "_C", None)
    for name in _SETTINGS_BINDINGS:
        orig = getattr(C, name, None)
        if orig is not None and not getattr(orig, "_memshim", False):
            try:
                setattr(C, name, _noting(orig, f"the program set PyTorch's allocator settings (torch._C.{name})"))
            except (AttributeError, TypeError):
                pass
    state.orig_change = getattr(mem, "change_current_allocator", None)
    if state.orig_change is not None and hasattr(state.orig_change, "__wrapped__"):
        state.orig_change = state.orig_change.__wrapped__
    _epochs.install(torch)
    if cuda.is_initialized():  # `import memshim` after the program's first CUDA use
        state.decided = True
        state.why = "CUDA was initialized before memshim's hook could switch the allocator"
        if setting("mode") not in (MODE_SEGMENT, MODE_OFF):
            log(LOG_INFO, f"memshim stays in segment mode: {state.why}")
    import atexit
    atexit.register(_at_exit)


# The bindings that change PyTorch's allocator settings, newest first (feature-checked).
_SETTINGS_BINDINGS = ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings")


def _noting(orig, why):
    """orig, noting before the switch that the program made its own allocator choice."""
    def wrapper(*a, **k):
        if not state.decided and state.user_choice is None:
            state.user_choice = why
        return orig(*a, **k)
    try:
        functools.update_wrapper(wrapper, orig)
    except (AttributeError, TypeError):  # a builtin without some attributes
        pass
    wrapper._memshim = True
    return wrapper


def _decide():
    """Decide the switch once, before PyTorch initializes CUDA. The lock is held until the switch
    is complete and `decided` is set last: a thread that finds `decided` set may let PyTorch
    initialize; another one arriving meanwhile waits here."""
    me = threading.get_ident()
    with _lock:
        if state.decided or state.deciding == me:  # done, or this thread's own re-entry
            return
        state.deciding = me
        try:
            _decide_locked()
        finally:
            state.decided = True
            state.deciding = None
        _unwrap_init_paths()


def _decide_locked():
    mode = setting("mode")
    if mode == MODE_OFF:
        return
    if mode != MODE_SEGMENT:
        why = _why_not(mode)
        if why:
            state.why = why
            log(LOG_WARN if mode == MODE_TENSOR else LOG_INFO, f"memshim stays in segment mode: {why}")
        else:
            try:
                _switch()
            except Exception as exc:  # noqa: BLE001
                state.why = f"the switch failed ({type(exc).__name__}: {exc})"
                log(LOG_WARN, f"memshim stays in segment mode: {state.why}")
            else:
                _honour_settings()
                return
    _segment_settings()


def _honour_settings():
    """Tensor mode: what PyTorch's allocator settings ask of the allocator, memshim does.
    per_process_memory_fraction becomes every device's limit, as set_per_process_memory_fraction
    makes it (PyTorch applies the key in its own caching allocator only)."""
    var, value = _allocconf.pick(torch=_torch)
    if var is None:
        return
    f, bad = _allocconf.fraction(_allocconf.pairs(value))
    if bad:
        log(LOG_WARN, f"{var}: {bad}; memshim sets no limit from it (torch.cuda.set_per_process_memory_fraction "
            "takes the same values)")
    elif f is not None:
        _boot.lib().memshim_torch_conf_memory_fraction(ctypes.c_double(f))
        log(LOG_INFO, f"{var}: per_process_memory_fraction:{f:g}: each device's limit is {f:g} of its memory, as "
            f"torch.cuda.set_per_process_memory_fraction({f:g}) sets it")


def _segment_settings():
    """Segment mode: PyTorch's allocator acts on its settings before memshim sees a request.
    throw_on_cudamalloc_oom:True makes it refuse a segment that would take its reserved memory past
    per_process_memory_fraction of the device (all of it by default) without calling cudaMalloc, so
    MEMSHIM_SPILL=host can never serve past the device's memory."""
    var, value = _allocconf.pick(torch=_torch)
    if var is not None and setting("spill") > 0 and _allocconf.true(_allocconf.pairs(value), "throw_on_cudamalloc_oom"):
        log(LOG_WARN, f"{var} sets throw_on_cudamalloc_oom:True: PyTorch refuses a segment past its memory fraction "
            "(the whole device by default) before calling cudaMalloc, so MEMSHIM_SPILL=host cannot serve beyond the "
            "device's memory; remove the key, or let memshim place the tensors (tensor mode)")


# ---- the paths into CUDA that do not pass torch.cuda._lazy_init ------------------------------
# PyTorch's C++ initializes CUDA itself (at::globalContext().lazyInitDevice(kCUDA), which never
# calls Python) behind these public entries; docs/pytorch.md lists them, how they were found
# (tests/torch/init_paths.py) and the one left open (factories called with pin_memory=True: a
# Python wrapper around torch.empty & co. would break torch.jit.script, which resolves them by
# identity). memshim decides before each; the wrappers go away once decided, so a pinned copy in
# the DataLoader's pin-memory thread pays nothing after the first.
_INIT_PATHS = [  # (module, attribute owner inside it or None, name)
    ("torch.cuda.memory", None, "_record_memory_history"),
    ("torch.cuda.memory", None, "_record_memory_history_impl"),
    ("torch.cuda.memory", None, "_record_memory_history_legacy"),
    ("torch._C", None, "_cuda_record_memory_history"),
    ("torch._C", None, "_cuda_record_memory_history_legacy"),
    ("torch", "Tensor", "pin_memory"),
    ("torch", "UntypedStorage", "pin_memory"),
    ("torch", "TypedStorage", "pin_memory"),
]
_wrapped = []  # (owner, name, original, wrapper, the owner held it itself)


def _cuda_initialized():
    try:
        return _torch.cuda.is_initialized()
    except Exception:  # noqa: BLE001
        return True


def _decide_first(owner, name, also=()):
    """owner.name (and the same object where `also` modules hold it), with the switch decided
    before it runs. After the decision a call goes to whatever owner.name is then (memshim's
    history API in tensor mode), else to the original."""
    orig = getattr(owner, name, None)
    if orig is None or _is_first(orig):
        return

    def first(*args, **kwargs):
        if not state.decided and not _cuda_initialized():
            _decide()
        cur = getattr(owner, name, None)
        if cur is not None and not _is_first(cur):
            return cur(*args, **kwargs)
        return orig(*args, **kwargs)
    try:
        functools.update_wrapper(first, orig)
    except (AttributeError, TypeError):
        pass
    own = name in getattr(owner, "__dict__", {})
    try:
        setattr(owner, name, first)
    except (AttributeError, TypeError):  # a type that refuses new attributes: leave it
        return
    _wrapped.append((owner, name, orig, first, own))
    for m in also:
        if m is not None and getattr(m, name, None) is orig:
            setattr(m, name, first)
            _wrapped.append((m, name, orig, first, True))


_FIRST_CODE = next(c for c in _decide_first.__code__.co_consts if getattr(c, "co_name", None) == "first")


def _is_first(fn):
    # Every wrapper made by _decide_first shares one code object (functools.wraps copies __dict__,
    # so an attribute mark would be copied onto whatever wraps it later).
    return getattr(fn, "__code__", None) is _FIRST_CODE


def _wrap_init_paths(torch):
    import importlib
    for modname, holder, name in _INIT_PATHS:
        try:
            owner = importlib.import_module(modname)
            if holder:
                owner = getattr(owner, holder)
        except (ImportError, AttributeError):
            continue
        # torch.cuda re-exports some of torch.cuda.memory's names
        _decide_first(owner, name, also=(torch.cuda,) if modname == "torch.cuda.memory" else ())


def _unwrap_init_paths():
    """Once decided the wrappers have done their work: the originals go back where nothing else
    replaced them since (memshim's history API stays)."""
    while _wrapped:
        owner, name, orig, first, own = _wrapped.pop()
        try:
            if getattr(owner, name, None) is first:
                if own:
                    setattr(owner, name, orig)
                else:
                    delattr(owner, name)  # inherited (torch.Tensor.pin_memory is TensorBase's)
        except (AttributeError, TypeError):
            pass


def _why_not(mode):
    """Why memshim must not become PyTorch's allocator here, or None."""
    torch = _torch
    if state.user_choice:
        return state.user_choice
    if mode == MODE_AUTO:
        # the settings PyTorch takes; keys memshim honours (per_process_memory_fraction) or that
        # concern the pinned host allocator do not keep it out
        var, value = _allocconf.pick(torch=torch)
        keys = _allocconf.blocking(_allocconf.pairs(value)) if var else []
        if keys:
            return f"{var} configures PyTorch's own allocator ({', '.join(keys)}; MEMSHIM_MODE=tensor overrides)"
    if torch.cuda.is_initialized():
        return "CUDA was initialized before memshim's hook could switch the allocator"
    if not setting("enabled"):
        return "memshim has no usable CUDA driver"
    lib_dir = os.path.dirname(_boot.lib_path() or "")
    glue_path = os.path.join(lib_dir, "libmemshim_torch.so")
    if not os.path.exists(glue_path):
        return (f"{glue_path} is missing (it is built only where python3 can import torch: run make there, or "
                "`memshim build-glue` for the pip package)")
    try:
        glue = ctypes.CDLL(glue_path)
        glue.memshim_glue_torch_version.restype = ctypes.c_char_p
        built = glue.memshim_glue_torch_version().decode()
    except (OSError, AttributeError) as exc:
        return f"cannot load {glue_path} ({exc})"
    if built.split("+")[0] != torch.__version__.split("+")[0]:
        return (f"{glue_path} was built for PyTorch {built}, this is {torch.__version__} (rebuild with make, or "
                "`memshim build-glue` for the pip package)")
    if not glue.memshim_glue_ready():
        return f"{glue_path} cannot find libmemshim.so's entry points"
    state.glue = (glue_path, glue)
    return None


def _switch():
    torch = _torch
    from torch.cuda.memory import CUDAPluggableAllocator
    glue_path, glue = state.glue
    lib = _boot.lib()
    alloc = CUDAPluggableAllocator(glue_path, "memshim_glue_malloc", "memshim_glue_free")
    missing = _set_hooks(alloc._allocator, lib, glue)
    (state.orig_change or torch.cuda.memory.change_current_allocator)(alloc)
    state.allocator, state.tensor = alloc, True
    _patch_memory_api(torch)
    try:
        from . import _history  # issue 11: memory snapshots in tensor mode
    except ImportError:
        _history = None
    if _history is not None:
        try:
            _history.install(torch, lib)
        except Exception as exc:  # noqa: BLE001
            log(LOG_WARN, f"memory history under memshim is unavailable ({type(exc).__name__}: {exc})")
    _boot.watch("torch._inductor.config", _no_cudagraph_trees)
    log(LOG_INFO, "tensor mode: PyTorch allocates every tensor through memshim"
        + (f" (hooks this PyTorch lacks: {', '.join(missing)})" if missing else ""))


# Capture-pool hooks, set last to first: begin (which routes capture allocations into a pool) only
# once end and release are in place, so a pool that begins always ends and is released.
_POOL_HOOKS = ("set_release_pool", "set_end_allocate_to_pool_fn", "set_begin_allocate_to_pool")


def _set_hooks(a, lib, glue):
    """Set every hook this PyTorch's pluggable allocator has (probed: versions differ). Returns
    the hooks left unset. The capture-pool hooks go as a group or not at all: without one of them
    captures use memshim's capture-only pool (the backstop) instead."""
    plain = [("set_init_fn", lib, "memshim_torch_init"),
             ("set_reset_fn", lib, "memshim_empty_cache"),
             ("set_memory_fraction_fn", lib, "memshim_torch_set_memory_fraction"),
             ("set_base_alloc_fn", lib, "memshim_torch_base_alloc"),
             ("set_record_stream_fn", lib, "memshim_torch_record_stream")]
    pool = [("set_release_pool", glue, "memshim_glue_release_pool"),
            ("set_end_allocate_to_pool_fn", glue, "memshim_glue_end_allocate_to_pool"),
            ("set_begin_allocate_to_pool", glue, "memshim_glue_begin_allocate_to_pool")]
    unset = []

    def put(setter, so, sym):
        fn = getattr(a, setter, None)
        if fn is None:
            unset.append(setter)
            return False
        try:
            fn(ctypes.cast(getattr(so, sym), ctypes.c_void_p).value)
        except (TypeError, RuntimeError, ValueError) as exc:  # a binding of another shape
            unset.append(f"{setter} ({type(exc).__name__})")
            return False
        return True

    for h in plain:
        put(*h)
    lacking = [s for s in _POOL_HOOKS if not hasattr(a, s)]
    if lacking:
        unset.extend(s for s in _POOL_HOOKS)
    else:
        for h in pool:
            if not put(*h):
                unset.extend(s for s, _, _ in pool[pool.index(h) + 1:])
                lacking = [h[0]]
                break
    if lacking:
        log(LOG_INFO, f"this PyTorch lacks the capture-pool hook {', '.join(lacking)}: allocations during "
                      "CUDA-graph capture go to memshim's capture-only pool (backstop)")
    return unset


def _no_cudagraph_trees(cfg):
    """torch.compile(mode="reduce-overhead") uses cudagraph trees, which fail under any pluggable
    allocator; plain CUDA graphs use memshim's capture pools."""
    triton = getattr(cfg, "triton", None)
    if triton is not None and getattr(triton, "cudagraph_trees", False):
        triton.cudagraph_trees = False
        log(LOG_INFO, "torch._inductor.config.triton.cudagraph_trees = False (graph trees need PyTorch's own "
                      "allocator; compiled graphs use plain CUDA graphs over memshim's capture pools)")


# ---- the memory API in tensor mode ------------------------------------------------------------
def stat_names():
    lib = _boot.lib()
    n = lib.memshim_torch_stats(0, None, 0)
    return [lib.memshim_torch_stat_name(i).decode() for i in range(n)]


def flat_stats(device):
    lib = _boot.lib()
    names = stat_names()
    vals = (ctypes.c_longlong * len(names))()
    lib.memshim_torch_stats(int(device), vals, len(names))
    return dict(zip(names, vals))


def nested_stats(device):
    out = {}
    for key, val in flat_stats(device).items():
        d = out
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = val
    return out


def _patch_memory_api(torch):
    cuda, mem, lib = torch.cuda, torch.cuda.memory, _boot.lib()

    def dev(device):
        return cuda._get_device_index(device, optional=True)

    def memory_stats_as_nested_dict(device=None):
        return nested_stats(dev(device))

    def reset_peak_memory_stats(device=None):
        lib.memshim_torch_reset_peak(dev(device))

    def reset_accumulated_memory_stats(device=None):
        lib.memshim_torch_reset_accumulated(dev(device))

    def get_per_process_memory_fraction(device=None):
        return lib.memshim_torch_get_memory_fraction(dev(device))

    # memory_stats, memory_allocated, max_memory_*, memory_reserved, memory_summary and
    # reset_max_memory_* reach these through torch.cuda.memory's globals.
    for new in (memory_stats_as_nested_dict, reset_peak_memory_stats, reset_accumulated_memory_stats,
                get_per_process_memory_fraction):
        orig = getattr(mem, new.__name__, None)
        if orig is None:
            continue
        functools.update_wrapper(new, orig)
        new.__doc__ = (orig.__doc__ or "") + "\n\n(memshim tensor mode: answered from memshim's counters.)"
        _replace([mem, cuda], new.__name__, orig, new)

    # torch.accelerator's memory functions (newer PyTorch) go to the device's allocator stats
    # directly, which a pluggable allocator does not serve: answer them from the same counters.
    # Its memory_allocated, max_memory_* and memory_reserved read memory_stats through the module.
    amem = getattr(getattr(torch, "accelerator", None), "memory", None)
    if amem is not None:
        def acc_memory_stats(device_index=None, /):
            return cuda.memory_stats(device_index)

        def acc_reset_peak_memory_stats(device_index=None, /):
            reset_peak_memory_stats(device_index)

        def acc_reset_accumulated_memory_stats(device_index=None, /):
            reset_accumulated_memory_stats(device_index)

        for name, new in (("memory_stats", acc_memory_stats), ("reset_peak_memory_stats", acc_reset_peak_memory_stats),
                          ("reset_accumulated_memory_stats", acc_reset_accumulated_memory_stats)):
            orig = getattr(amem, name, None)
            if orig is None:
                continue
            functools.update_wrapper(new, orig)
            new.__doc__ = (orig.__doc__ or "") + "\n\n(memshim tensor mode: answered from memshim's counters.)"
            _replace([amem, torch.accelerator], name, orig, new)


# ---- segment mode: PyTorch's own figures for the reports -------------------------------------
def hand_epoch_stats():
    """Segment mode, CUDA initialized: copy torch.cuda.memory_stats() of each device to memshim
    for the report being written. Returns whether any was handed over."""
    torch, lib = _torch, _boot.lib()
    if torch is None or lib is None or state.tensor or not torch.cuda.is_initialized():
        return False
    handed = False
    for d in range(torch.cuda.device_count()):
        try:
            s = torch.cuda.memory_stats(d)
        except Exception:  # noqa: BLE001 - a device PyTorch never used, or an allocator without stats
            continue
        for k in EPOCH_KEYS:
            if k in s:
                lib.memshim_torch_epoch_stat(d, k.encode(), int(s[k]))
                handed = True
    return handed


def _at_exit():
    """The summary (written by libmemshim.so's exit handler, after Python's) carries them too."""
    try:
        if setting("started") == 1:
            hand_epoch_stats()
    except Exception:  # noqa: BLE001
        pass
