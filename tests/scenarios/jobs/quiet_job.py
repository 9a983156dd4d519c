"""Device memory, then a long quiet phase with no allocation at all (an evaluation loop, a data
wait, PyTorch's cache serving every tensor), then a little more work. argv: READY_FILE SECONDS."""
import os
import sys
import time

import torch

from _dev import Device, mark

dev = Device()
keep = dev.alloc(8 << 20)
model = torch.nn.Linear(8, 8)
mark(sys.argv[1], f"READY {os.getpid()}")
t_end = time.monotonic() + float(sys.argv[2])
with torch.no_grad():
    while time.monotonic() < t_end:  # evaluation on the CPU: no device allocation
        model(torch.randn(16, 8))
        time.sleep(0.01)
b = dev.alloc(1 << 20)
dev.free(b)
print("done")
