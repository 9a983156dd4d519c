"""A torchrun rank: gloo process group, DDP over a tiny model on the CPU, steps until a signal
stops it. argv: READY_DIR. After 8 steps each rank appends "READY rank pid" to READY_DIR/ready."""
import os
import sys

import torch
import torch.distributed as dist

from _dev import Device, mark

dist.init_process_group("gloo")
rank = dist.get_rank()
dev = Device()
weights = dev.alloc((8 + rank) << 20)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    act = dev.alloc(2 << 20)
    opt.zero_grad()
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    dev.free(act)
    step += 1
    if step == 8:
        mark(os.path.join(sys.argv[1], "ready"), f"READY {rank} {os.getpid()}")
