"""memshim's Python side, epochs without code (MEMSHIM_EPOCH=auto, docs/pytorch.md).

Sources, first match wins: the frameworks' own epoch callbacks while one is training (HF Trainer,
PyTorch Lightning: _frameworks.py), else the generic rule: an epoch is one pass over a
torch.utils.data.DataLoader during which at least one optimizer step ran. A pass with no step
(validation, test) closes nothing; a pass left with `break` closes at that loader's next pass;
with several optimizers a batch counts one step; steps already counted by a closed epoch never
count again (two loaders zipped give one epoch). Optimizer steps feed memshim_step().

Loops that never end a DataLoader pass (nanoGPT-style get_batch loops, an endless sampler, LLM
pretraining) get interval reports instead: when MEMSHIM_EPOCH_INTERVAL optimizer steps (1000)
pass with no epoch closed, and no pass of known length of at most 16 intervals is open (it will
end soon enough to close one), an epoch closes with reason `interval`; memshim says so once.

DataLoader worker processes do nothing here, and nothing calls libmemshim.so before it has
started on its own (no driver call in a CPU-only process).
"""
import threading
import weakref

from . import _boot
from ._boot import LOG_INFO, LOG_WARN, log, setting

EC_EPOCH = 2  # enum msh_empty_cache


class _Pass:
    __slots__ = ("start_steps", "ended", "length", "__weakref__")

    def __init__(self, start_steps, length=None):
        self.start_steps, self.ended, self.length = start_steps, False, length


class _State:
    steps = 0             # optimizer steps, one per batch
    last_close_steps = 0  # steps at the last epoch closed by a pass or a framework
    batch = 0             # batches fetched from any DataLoader
    step_batch = -1       # the batch the last counted step belonged to
    open_passes = 0
    framework = None      # "hf_trainer" / "lightning" while one is training
    told_infinite = False
    told_interval = False
    interval = None       # MEMSHIM_EPOCH_INTERVAL (read once memshim has started)


state = _State()
_lock = threading.Lock()
_loader_pass = weakref.WeakKeyDictionary()  # DataLoader -> its current _Pass
_iter_pass = weakref.WeakKeyDictionary()    # its iterator -> the same _Pass
_torch = None


def _in_worker():
    try:
        return _torch.utils.data.get_worker_info() is not None
    except Exception:  # noqa: BLE001
        return False


def close(reason):
    """Close the current epoch (memshim_epoch_from), with PyTorch's own figures in segment mode and
    MEMSHIM_EMPTY_CACHE=epoch's torch.cuda.empty_cache(). False when memshim has not started."""
    lib = _boot.lib()
    if lib is None or _in_worker() or setting("started") != 1:
        return False
    from . import _torch as t
    handed = False
    try:
        handed = t.hand_epoch_stats()
        if not t.state.tensor and setting("empty_cache") == EC_EPOCH and _torch.cuda.is_initialized():
            _torch.cuda.empty_cache()  # PyTorch's cached segments back to memshim, and so to the driver
    except Exception as exc:  # noqa: BLE001
        log(LOG_WARN, f"epoch close: PyTorch's figures are unavailable ({type(exc).__name__}: {exc})")
    rc = lib.memshim_epoch_from(reason.encode())
    if handed:
        lib.memshim_torch_epoch_stats_clear()
    return rc == 0


def _close_detected(reason):
    """An epoch end seen by a detector: only when MEMSHIM_EPOCH=auto leaves epochs to it."""
    if setting("epoch_detect") == 1:
        close(reason)


# ---- frameworks ------------------------------------------------------------------------------
def framework_begin(name):
    state.framework = name


def framework_epoch_end(name):
    with _lock:
        state.last_close_steps = state.steps
    _close_detected(name)


def framework_end(name):
    if state.framework == name:
        state.framework = None


# ---- the generic rule --------------------------------------------------------------------------
def _end_locked(p):
    """End pass p; True when it closes an epoch (it saw a step no closed epoch counted)."""
    if p.ended:
        return False
    p.ended = True
    state.open_passes -= 1
    if state.framework is not None:
        return False
    if state.steps > max(p.start_steps, state.last_close_steps):
        state.last_close_steps = state.steps
        return True
    return False


def _begin_pass(loader, it):
    closes = False
    with _lock:
        prev = _loader_pass.get(loader)
        if prev is not None:
            closes = _end_locked(prev)  # the last pass over this loader was left early (break)
        p = _Pass(state.steps, _length(loader))
        state.open_passes += 1
        _loader_pass[loader] = p
        try:
            _iter_pass[it] = p
        except TypeError:  # an iterator without weak references: its end is seen at the next pass
            pass
    if closes:
        _close_detected("dataloader")
    _check_infinite(loader)


def _length(loader):
    """Batches in a pass over loader, or None when it has no length (an IterableDataset)."""
    try:
        return len(loader)
    except Exception:  # noqa: BLE001 - TypeError for no __len__; anything else: unknown
        return None


def _check_infinite(loader):
    if state.told_infinite:
        return
    try:
        if not isinstance(loader.dataset, _torch.utils.data.IterableDataset):
            return
        len(loader)
        return
    except TypeError:
        pass
    except Exception:  # noqa: BLE001
        return
    if setting("epoch_detect") == 1:
        state.told_infinite = True
        n = _interval()
        log(LOG_WARN, "a DataLoader over an IterableDataset without __len__ may never end a pass, and a pass "
                      "that never ends closes no epoch: "
                      + (f"memshim writes an interval report every {n} optimizer steps instead; " if n else "")
                      + "set MEMSHIM_EPOCH_STEPS=N (an epoch every N optimizer steps) or MEMSHIM_EPOCH_SECONDS=S "
                        "for epochs of your choosing")


def _exhausted(it):
    with _lock:
        p = _iter_pass.get(it)
        closes = p is not None and _end_locked(p)
    if closes:
        _close_detected("dataloader")


def _interval():
    """MEMSHIM_EPOCH_INTERVAL, once memshim has started (0 before: nothing to report yet)."""
    if state.interval is None:
        if setting("started") != 1:
            return 0
        v = setting("epoch_interval")
        state.interval = v if v >= 0 else 0  # -1: a library without the setting
    return state.interval


def _interval_due_locked():
    """N optimizer steps since the last epoch closed, and nothing in sight that will close one."""
    n = _interval()
    if not n or state.steps - state.last_close_steps < n:
        return False
    # A pass of known length that is not too long ends soon enough to close the epoch itself.
    for p in list(_loader_pass.values()):
        if not p.ended and p.length is not None and p.length <= 16 * n:
            return False
    return True


def _on_step(optimizer, args, kwargs):
    if _in_worker():
        return
    with _lock:
        if state.open_passes and state.step_batch == state.batch:
            return  # another optimizer in the same batch
        state.step_batch = state.batch
        state.steps += 1
    lib = _boot.lib()
    if lib is not None:
        lib.memshim_step_if_started()
    if setting("epoch_detect") != 1:
        return
    with _lock:
        due = _interval_due_locked()
        if due:
            state.last_close_steps = state.steps
            first = not state.told_interval
            state.told_interval = True
    if due:
        if first:
            n = _interval()
            log(LOG_WARN, f"{n} optimizer steps and no epoch has ended (no DataLoader pass that ends: a loop over "
                          f"get_batch(), an endless sampler, an IterableDataset): memshim writes an interval "
                          f"report every {n} optimizer steps (reason interval). For epochs of your choosing set "
                          "MEMSHIM_EPOCH_STEPS=N (every N optimizer steps) or MEMSHIM_EPOCH_SECONDS=S; "
                          "MEMSHIM_EPOCH_INTERVAL=0 turns interval reports off")
        close("interval")


def install(torch):
    """Wrap DataLoader passes and count optimizer steps (called right after `import torch`)."""
    global _torch
    _torch = torch
    import torch.utils.data.dataloader as dl
    loader_cls, iter_cls = dl.DataLoader, getattr(dl, "_BaseDataLoaderIter", None)
    orig_iter = loader_cls.__iter__
    if not getattr(orig_iter, "_memshim", False):
        def __iter__(self):
            it = orig_iter(self)
            try:
                if not _in_worker():
                    _begin_pass(self, it)
            except Exception as exc:  # noqa: BLE001
                log(LOG_WARN, f"epoch detection: {type(exc).__name__}: {exc}")
            return it
        __iter__._memshim = True
        __iter__.__wrapped__ = orig_iter
        loader_cls.__iter__ = __iter__
    if iter_cls is not None and not getattr(iter_cls.__next__, "_memshim", False):
        orig_next = iter_cls.__next__

        def __next__(self):
            try:
                batch = orig_next(self)
            except StopIteration:
                _exhausted(self)
                raise
            state.batch += 1
            return batch
        __next__._memshim = True
        __next__.__wrapped__ = orig_next
        iter_cls.__next__ = __next__
    _boot.watch("torch.optim.optimizer", _hook_optimizers)  # imported lazily by recent PyTorch


def _hook_optimizers(mod):
    hook = getattr(mod, "register_optimizer_step_post_hook", None)
    if hook is not None:
        hook(_on_step)
    else:
        log(LOG_INFO, "this PyTorch has no register_optimizer_step_post_hook: optimizer steps are not counted")
