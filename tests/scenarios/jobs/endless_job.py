"""minGPT's endless sampler (a DataLoader whose pass never ends in practice), or an IterableDataset
without __len__. argv: sampler|iterable ITERS."""
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from _dev import Device

kind, iters = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
if kind == "sampler":
    loader = DataLoader(ds, sampler=RandomSampler(ds, replacement=True, num_samples=int(1e10)), batch_size=4)
else:
    class Stream(IterableDataset):
        def __iter__(self):
            while True:
                yield torch.randn(8), torch.randn(1)
    loader = DataLoader(Stream(), batch_size=4)
dev = Device()
params = dev.alloc(8 << 20)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for it, (x, y) in enumerate(loader):
    act = dev.alloc(1 << 20)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    dev.free(act)
    if it + 1 >= iters:
        break
print("trained", iters, "iterations")
