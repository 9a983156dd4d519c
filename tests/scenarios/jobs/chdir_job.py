"""A job that changes directory (as Hydra and many scripts do), before and after its first device
memory, then starts a `spawn` child from there that holds device memory too. argv: DIR1 DIR2."""
import multiprocessing as mp
import os
import sys

import torch

from _dev import Device


def child():
    d = Device()
    b = d.alloc(4 << 20)
    d.free(b)
    print("child", os.getpid())


if __name__ == "__main__":
    os.chdir(sys.argv[1])
    dev = Device()
    keep = dev.alloc(8 << 20)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    import memshim
    memshim.epoch()
    os.chdir(sys.argv[2])
    p = mp.get_context("spawn").Process(target=child)
    p.start()
    p.join()
    memshim.epoch()
    print("done", p.exitcode)
