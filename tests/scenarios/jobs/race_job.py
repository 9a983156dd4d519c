"""Two threads reach PyTorch's first CUDA use at once (a pin-memory thread, a DataLoader, the
program's own threads). PyTorch's native CUDA initialization must never run before memshim's
allocator is in place. The switch is slowed down (CUDAPluggableAllocator takes 0.3 s to build here)
so the second thread arrives while the first is switching. Prints ORDER with, for each call of
PyTorch's native initialization (torch._C._cuda_init), whether memshim's switch was complete."""
import threading
import time

import torch
import torch.cuda.memory as mem
from memshim import _torch as mt

order = []
orig_init = torch._C._cuda_init


def spy_init():
    order.append(mt.state.tensor)
    return orig_init()


torch._C._cuda_init = spy_init
orig_cls = mem.CUDAPluggableAllocator


class Slow(orig_cls):
    def __init__(self, *a, **k):
        time.sleep(0.3)
        super().__init__(*a, **k)


mem.CUDAPluggableAllocator = Slow
barrier = threading.Barrier(2)


def first_use():
    barrier.wait()
    try:
        torch.empty(1, device="cuda")
    except Exception:  # noqa: BLE001 - PyTorch's own runtime cannot run over the driver double
        pass


ts = [threading.Thread(target=first_use) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print("ORDER", order, "TENSOR", mt.state.tensor, "WHY", mt.state.why)
