"""A CPU training loop that runs until a signal stops it (Ctrl-C, SIGTERM), for the scenario suite.
argv: READY_FILE [handler]. After 12 optimizer steps it appends READY to READY_FILE. With
`handler`, it installs its own SIGTERM handler first (before any device memory), which stops the
loop; the job then ends normally."""
import os
import signal
import sys

import torch

from _dev import Device, mark

ready, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
stop = False
if mode == "handler":
    def on_term(signum, frame):
        global stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
dev = Device()
weights = dev.alloc(8 << 20)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 16), torch.randn(64, 1)
step = 0
while not stop:
    act = dev.alloc(2 << 20)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    dev.free(act)
    step += 1
    if step == 12:
        mark(ready, f"READY {os.getpid()}")
print("stopped by the program's handler after", "some" if step > 12 else "few", "steps")
