"""The done-when script of issue 9 (tests/torch/test_torch_cpu.py runs it with and without memshim):
a CPU training loop over a DataLoader, 3 epochs, a validation pass in the middle of each. It knows
nothing of memshim except that, when libmemshim.so is in the process, it also holds some device
memory through memshim_malloc (as a GPU job would), which it prints nothing about. Its output must
be the same with and without memshim."""
import ctypes
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

held = []
alloc = getattr(ctypes.CDLL(None), "memshim_malloc", None)
if alloc is not None:
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    held = [alloc(8 << 20, 0, None) for _ in range(4)]

workers = int(sys.argv[1]) if len(sys.argv) > 1 else 0
torch.manual_seed(0)
x = torch.randn(256, 16)
y = (x.sum(dim=1, keepdim=True) > 0).float()
train = DataLoader(TensorDataset(x[:192], y[:192]), batch_size=16, shuffle=True, num_workers=workers,
                   generator=torch.Generator().manual_seed(1))
val = DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
lossf = torch.nn.BCEWithLogitsLoss()
for epoch in range(3):
    model.train()
    total = 0.0
    for i, (xb, yb) in enumerate(train):
        opt.zero_grad()
        loss = lossf(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
        if i == len(train) // 2:  # a validation pass in the middle of the epoch
            model.eval()
            with torch.no_grad():
                vloss = sum(lossf(model(a), b).item() for a, b in val) / len(val)
            model.train()
    print(f"epoch {epoch} train {total / len(train):.6f} val {vloss:.6f}")
print("done", all(held) if held else True)
