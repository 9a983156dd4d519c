"""PyTorch's allocator settings as PyTorch reads them (issue 25; docs/pytorch.md, "PyTorch's
allocator settings"): which variable PyTorch takes, its key:value pairs, the keys that tune
PyTorch's own allocator (they keep memshim in segment mode) and the ones memshim honours in tensor
mode. No PyTorch import here (`memshim doctor` uses it too); the caller passes PyTorch in when it
has it. Never raises on a bad value: the caller says what it makes of it.

Which variable: PyTorch 2.15 reads the deprecated PYTORCH_CUDA_ALLOC_CONF when it is set, even
empty, else PYTORCH_ALLOC_CONF (c10/cuda/CUDAAllocatorConfig.h, CUDAAllocatorConfig::instance;
AcceleratorAllocatorConfig::instance in c10/core/AllocatorConfig.cpp reads them in the same
order). PyTorch 2.8 to 2.11 read PYTORCH_ALLOC_CONF first in the accelerator config (and warned
that the old name is deprecated). So where both are set with different values and this PyTorch can
say which one it parsed (torch._C._accelerator_getAllocatorSettings), its answer decides.
"""
import os

CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# Keys memshim honours in tensor mode, where PyTorch's pluggable allocator would leave them unused.
HONOURED = ("per_process_memory_fraction",)


def pick(env=None, torch=None):
    """(variable, value) of the settings PyTorch uses, or (None, None) when neither is set."""
    env = os.environ if env is None else env
    present = [(v, env[v]) for v in CONF_VARS if v in env]
    if not present:
        return None, None
    if len(present) == 2 and present[0][1] != present[1][1] and torch is not None:
        get = getattr(getattr(torch, "_C", None), "_accelerator_getAllocatorSettings", None)
        parsed = None
        if get is not None:
            try:
                parsed = get()
            except Exception:  # noqa: BLE001 (a value PyTorch refuses: it says so itself, later)
                parsed = None
        for var, value in present:
            if parsed == value:
                return var, value
    return present[0]


def pairs(value):
    """[(key, value)] as PyTorch's ConfigTokenizer splits a setting string: ',', ':', '[' and ']'
    are tokens of their own, white space is dropped, a bracketed list is one value."""
    toks, buf = [], ""
    for ch in value or "":
        if ch in ",:[]":
            if buf:
                toks.append(buf)
                buf = ""
            toks.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        toks.append(buf)
    out, i = [], 0
    while i < len(toks):
        key = toks[i]
        i += 1
        if key in ",:[]":
            continue
        val = ""
        if i < len(toks) and toks[i] == ":":
            i += 1
            if i < len(toks) and toks[i] == "[":
                depth, j = 0, i
                while j < len(toks):
                    depth += (toks[j] == "[") - (toks[j] == "]")
                    if depth == 0:
                        break
                    j += 1
                val, i = "".join(toks[i:j + 1]), j + 1
            elif i < len(toks) and toks[i] not in ",[]":
                val, i = toks[i], i + 1
        out.append((key, val))
    return out


def blocking(kv):
    """The keys that tune PyTorch's own device allocator: they keep memshim out in auto mode. Not
    the ones memshim honours, nor pinned_* (PyTorch's pinned host memory allocator, which the
    switch leaves in place)."""
    return [k for k, _ in kv if k not in HONOURED and not k.startswith("pinned_")]


def fraction(kv):
    """per_process_memory_fraction: (None, None) when absent, (fraction, None) when usable, (None,
    why) when not. The last one counts, as PyTorch parses left to right. PyTorch accepts [0, 1];
    memshim takes (0, 1], as set_per_process_memory_fraction's hook does: 0 would refuse every
    allocation."""
    vals = [v for k, v in kv if k == "per_process_memory_fraction"]
    if not vals:
        return None, None
    raw = vals[-1]
    try:
        f = float(raw)
    except ValueError:
        f = None
    if f is None or not 0.0 < f <= 1.0:
        return None, f"per_process_memory_fraction:{raw} is not a number in (0, 1]"
    return f, None


def true(kv, key):
    """Whether `key` is set to True (PyTorch's booleans are exactly True and False)."""
    vals = [v for k, v in kv if k == key]
    return bool(vals) and vals[-1] == "True"
