"""memshim from Python (docs/pytorch.md).

Under LD_PRELOAD=libmemshim.so this package is imported by memshim's start-up hook; importing it
yourself (`import memshim` at the top of a script) does the same where the hook cannot run
(python -I, -E, -S, embedded interpreters). It makes memshim PyTorch's allocator at PyTorch's
first CUDA use (tensor mode), keeps torch.cuda's memory API answering, and closes one epoch per
training pass (MEMSHIM_EPOCH=auto).

    epoch()            close the current epoch now (a report when MEMSHIM_REPORT_DIR is set)
    step()             count one optimizer step (MEMSHIM_EPOCH=steps counts these)
    stats(device=0)    memshim's counters for a device, with the mode and PyTorch-named figures
    reset_peak(device=None)  reset the peaks torch.cuda.max_memory_allocated() and friends report
"""
from . import _boot

__all__ = ["epoch", "step", "stats", "reset_peak"]


def _lib():
    lib = _boot.lib()
    if lib is None:
        raise RuntimeError("libmemshim.so is not in this process (run under LD_PRELOAD=.../libmemshim.so)")
    return lib


def epoch():
    """Close the current epoch: a report per device, then the epoch policies (MEMSHIM_GC=epoch,
    MEMSHIM_EMPTY_CACHE=epoch)."""
    from . import _epochs
    if not _epochs.close("manual"):
        _lib().memshim_epoch()  # memshim has not started yet: this starts it


def step():
    """Count one optimizer step (memshim counts them itself when torch.optim is used)."""
    _lib().memshim_step()


def stats(device=0):
    """memshim's counters for `device`: mode, pool figures (absent before memshim serves the
    device) and, in tensor mode, the PyTorch-named statistics torch.cuda.memory_stats() returns."""
    lib = _lib()
    from . import _torch
    mode = "tensor" if _torch.state.tensor else "off" if _boot.setting("mode") == _boot.MODE_OFF else "segment"
    out = {"mode": mode, "started": _boot.setting("started") == 1}
    s = _boot.Stats()
    if lib.memshim_get_stats(int(device), s) == 0:
        out.update({name: getattr(s, name) for name, _ in _boot.Stats._fields_})
    out["torch"] = _torch.flat_stats(int(device))
    return out


def reset_peak(device=None):
    """Reset the peaks of PyTorch-named statistics (all devices when device is None). The epoch
    reports keep their own peaks."""
    _lib().memshim_torch_reset_peak(-1 if device is None else int(device))


def _tool_process():
    """The `memshim` command or memshim-report (console scripts, `python -m memshim`): tools with
    nothing to hook, which must not load libmemshim.so into themselves."""
    import os
    import sys
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("memshim", "memshim-report"):
        return True
    orig = list(getattr(sys, "orig_argv", []))
    for i, a in enumerate(orig[1:], 1):
        if a == "-m" or a.startswith("-m"):
            return (a[2:] or (orig[i + 1] if i + 1 < len(orig) else "")) == "memshim"
        if not a.startswith("-"):
            return False
    return False


if not _tool_process():
    _boot.arm()
