"""A nanoGPT-style loop: batches from get_batch(), no DataLoader, a fixed number of iterations.
argv: MAX_ITERS LEAK_EVERY (steps between 512 KiB kept for good: a slow leak; 0: none)."""
import sys

import torch

from _dev import Device

max_iters, leak_every = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
data = torch.randint(0, 64, (4096,))
block, batch = 16, 8


def get_batch():
    ix = torch.randint(len(data) - block, (batch,))
    return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1))


dev = Device()
params = dev.alloc(16 << 20)
model = Tiny()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
leaked = []
for it in range(max_iters):
    x, y = get_batch()
    act = dev.alloc(4 << 20)
    logits, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    dev.free(act)
    if leak_every and it % leak_every == 0:
        leaked.append(dev.alloc(512 << 10))
print(f"iter {max_iters}: loss {loss.item():.4f}")
