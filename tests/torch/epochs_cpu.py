"""Epoch detection scenarios for tests/torch/test_torch_cpu.py, run in one process under
LD_PRELOAD=libmemshim.so on the driver double (MEMSHIM_EPOCH=auto). memshim is started by one
memshim_malloc, as a GPU job's first tensor would. After each scenario it prints
`RESULT <name> <json>` with the epoch reports the scenario added (reason and steps of each)."""
import ctypes
import glob
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

rdir = sys.argv[1]
lib = ctypes.CDLL(None)
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
hold = lib.memshim_malloc(4 << 20, 0, None)
seen = set()


def report(name):
    new = []
    for f in sorted(glob.glob(os.path.join(rdir, "*epoch*.json"))):
        if f in seen:
            continue
        seen.add(f)
        r = json.load(open(f))
        new.append({"reason": r["reason"], "steps": r["steps"], "file": os.path.basename(f),
                    "torch": r.get("torch_memory_stats")})
    print("RESULT", name, json.dumps(new), flush=True)


torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def train_batch(xb, yb, opts=(opt,)):
    for o in opts:
        o.zero_grad()
    ((model(xb) - yb) ** 2).mean().backward()
    for o in opts:
        o.step()


# 1. two epochs, each with a validation loader run mid-epoch (no step: no epoch)
train, val = DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=16)
for ep in range(2):
    for i, (xb, yb) in enumerate(train):
        train_batch(xb, yb)
        if i == 3:
            with torch.no_grad():
                for xv, yv in val:
                    model(xv)
report("validation_mid_epoch")

# 2. a pass left with break closes at that loader's next pass
for ep in range(2):
    for i, (xb, yb) in enumerate(train):
        train_batch(xb, yb)
        if i == 2:
            break
report("break_before_next_pass")
for xb, yb in train:  # the next pass over the same loader, no steps: closes the second one
    pass
report("break_next_pass")

# 3. two optimizers: a batch counts one step
model2 = torch.nn.Linear(8, 1)
opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
for xb, yb in train:
    train_batch(xb, yb, (opt, opt2))
report("two_optimizers")

# 4. validation only: nothing
with torch.no_grad():
    for xv, yv in val:
        model(xv)
report("validation_only")

# 5. two worker processes
wtrain = DataLoader(ds, batch_size=8, num_workers=2)
for xb, yb in wtrain:
    train_batch(xb, yb)
report("workers_2")


# 6. an IterableDataset without __len__ (finite here): memshim says once that such passes may not end
class Stream(IterableDataset):
    def __iter__(self):
        for i in range(4):
            yield torch.randn(8), torch.randn(1)


for xb, yb in DataLoader(Stream(), batch_size=2):
    train_batch(xb, yb)
report("iterable_no_len")

# 7. segment mode carries PyTorch's own memory_stats(): CUDA cannot start on this machine, so
# torch.cuda's answers are stood in for (only here) to drive memshim's hand-over code.
fake = {"allocated_bytes.all.current": 1234, "reserved_bytes.all.peak": 4 << 20, "num_ooms": 0,
        "num_alloc_retries": 2}
saved = (torch.cuda.is_initialized, torch.cuda.memory_stats, torch.cuda.device_count)
torch.cuda.is_initialized, torch.cuda.memory_stats, torch.cuda.device_count = (lambda: True), (lambda d: fake), (
    lambda: 1)
for xb, yb in train:
    train_batch(xb, yb)
torch.cuda.is_initialized, torch.cuda.memory_stats, torch.cuda.device_count = saved
report("segment_torch_stats")

# 9. MEMSHIM_GC=epoch (set for this process): a detected epoch end runs gc.collect() on the training
# thread, which frees device memory held only by a reference cycle
import gc  # noqa: E402
lib.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
gc.set_threshold(1 << 30)  # no automatic collection: only memshim's
collected = []


class Cycle:
    def __init__(self):
        self.me, self.p = self, lib.memshim_malloc(1 << 20, 0, None)

    def __del__(self):
        collected.append(bool(self.p))
        lib.memshim_free(self.p, 1 << 20, 0, None)


c = Cycle()
del c
print("GC_BEFORE", collected)
for xb, yb in train:
    train_batch(xb, yb)
report("gc_epoch")
print("GC_AFTER", collected)

# 8. the memshim module: stats, manual epoch, reset_peak
import memshim  # noqa: E402
s = memshim.stats(0)
memshim.epoch()
report("manual_epoch")
print("STATS", json.dumps({"mode": s["mode"], "started": s["started"], "live": s.get("live_bytes")}))
