"""Batch-size finders against one device (issue 25); argv: OUT_JSON FINDER... (lightning, accelerate,
hand). Prints nothing of its own; writes each finder's answer and, under memshim, what every
probe cost to OUT_JSON.

A training step of batch b holds b samples' activations (ACT bytes each, one tensor) beside
WEIGHTS bytes of weights that stay live. The finders are the libraries' own: Lightning's
BatchSizeFinder through its Tuner (mode "binsearch": doubles from 32 until refused, then
bisects; margin 0), accelerate's find_executable_batch_size (from 64, 0.9 of the batch after each
refusal), and a hand-written doubling-then-bisecting loop.

The device:
  - under memshim (LD_PRELOAD, the driver double, MEMSHIM_TEST_GLUE and MEMSHIM_TEST_PROBE set by
    the suite): each tensor is allocated through memshim's PyTorch glue inside PyTorch's own
    C++ -> Python error translation (tests/torch/oom_probe.cpp), so a refusal is the
    torch.OutOfMemoryError tensor mode raises on a GPU; the double's own counters say what each
    probe cost the driver (cuMemCreate calls, how far the device's charge rose);
  - without memshim (FINDER_NATIVE_CAPACITY=bytes): PyTorch's native caching allocator as a rule,
    since PyTorch's CUDA runtime cannot run without a GPU: a request fits when it and the live
    tensors, each rounded up to 2 MiB as PyTorch rounds large blocks, fit in the capacity (its OOM
    after freeing its cache, as PyTorch retries). Not PyTorch's code: the GPU check
    (tests/gpu/oom_check.py) compares with the real one."""
import ctypes
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

MiB = 1 << 20
WEIGHTS = 256 * MiB
ACT = 24 * MiB


class MemshimDevice:
    def __init__(self):
        glue = ctypes.CDLL(os.environ["MEMSHIM_TEST_GLUE"])
        spec = importlib.util.spec_from_file_location("memshim_oom_probe", os.environ["MEMSHIM_TEST_PROBE"])
        self.probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.probe)
        self.fa = ctypes.cast(glue.memshim_glue_malloc, ctypes.c_void_p).value
        self.ff = ctypes.cast(glue.memshim_glue_free, ctypes.c_void_p).value
        dbl = ctypes.CDLL("libcuda.so.1")  # the driver double (LD_LIBRARY_PATH)
        self.calls = dbl.cudbl_call_count
        self.calls.argtypes, self.calls.restype = [ctypes.c_char_p], ctypes.c_long
        self.peak = dbl.cudbl_device_mark_peak
        self.peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        self.peak.restype = ctypes.c_size_t
        self.probes = []

    def alloc(self, n):
        c0 = self.calls(b"cuMemCreate")
        used = ctypes.c_size_t(0)
        self.peak(0, 1, ctypes.byref(used))
        t0 = time.perf_counter()
        try:
            return (self.probe.alloc(self.fa, n, 0), n)
        except torch.OutOfMemoryError:
            dt = time.perf_counter() - t0
            rise = max(0, self.peak(0, 1, None) - used.value)
            self.probes.append({"bytes": n, "refused": True, "seconds": dt, "creates": self.calls(b"cuMemCreate") - c0,
                                "device_rise_bytes": rise})
            raise

    def free(self, block):
        self.probe.free(self.ff, block[0], block[1], 0)


class NativeRule:
    def __init__(self, capacity):
        self.capacity, self.used, self.probes = capacity, 0, []

    def alloc(self, n):
        r = -(-n // (2 * MiB)) * (2 * MiB)
        if self.used + r > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n / MiB:.2f} MiB. GPU 0 has a total capacity of "
                f"{self.capacity / MiB:.2f} MiB of which {(self.capacity - self.used) / MiB:.2f} MiB is free.")
        self.used += r
        return (None, r)

    def free(self, block):
        self.used -= block[1]


dev = MemshimDevice() if os.environ.get("MEMSHIM_TEST_GLUE") else NativeRule(int(os.environ["FINDER_NATIVE_CAPACITY"]))
weights = dev.alloc(WEIGHTS)


def step(b):
    act = dev.alloc(b * ACT)
    dev.free(act)


def hand():
    lo, hi, b = 0, 0, 1
    while True:
        try:
            step(b)
        except torch.OutOfMemoryError:
            hi = b
            break
        lo, b = b, b * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            step(mid)
            lo = mid
        except torch.OutOfMemoryError:
            hi = mid
    return lo


def accelerate_finder():
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        step(batch_size)
        return batch_size

    return train()


def lightning_finder():
    import logging

    import pytorch_lightning as pl
    from pytorch_lightning.tuner import Tuner

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    X, Y = torch.randn(4096, 4), torch.randn(4096, 1)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.lin = torch.nn.Linear(4, 1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=self.batch_size)

        def training_step(self, batch, i):
            x, y = batch
            step(len(x))
            return ((self.lin(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
        return Tuner(trainer).scale_batch_size(Model(), mode="binsearch", steps_per_trial=1, init_val=32, margin=0.0)


out = {}
for name in sys.argv[2:]:
    n0 = len(dev.probes)
    t0 = time.perf_counter()
    try:
        answer = {"hand": hand, "accelerate": accelerate_finder, "lightning": lightning_finder}[name]()
    except ImportError as e:  # the library is not installed: the suite skips it
        out[name] = {"skipped": str(e)}
        continue
    out[name] = {"answer": answer, "seconds": time.perf_counter() - t0, "refused": dev.probes[n0:]}
dev.free(weights)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
