"""The main job on a GPU (scripts/demo.sh): a small Transformer language model trained for 3 epochs
over a DataLoader, with a validation pass per epoch, written as any PyTorch user would, with no
memshim code. Under LD_PRELOAD=libmemshim.so memshim becomes its allocator (tensor mode), closes
one epoch per training pass and writes a report each. It prints the losses and what
torch.cuda.memory_allocated()/max_memory_allocated() answer per epoch."""
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
torch.manual_seed(0)
dev = "cuda"
vocab, seq, dim = 1000, 128, 256
tokens = torch.randint(0, vocab, (steps * 16 + 64, seq + 1))
train = DataLoader(TensorDataset(tokens[:-64]), batch_size=16, shuffle=True)
val = DataLoader(TensorDataset(tokens[-64:]), batch_size=32)


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0)
        self.body = torch.nn.TransformerEncoder(layer, 4)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.body(self.emb(x), mask=mask, is_causal=True))


model = LM().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
lossf = torch.nn.CrossEntropyLoss()
for epoch in range(3):
    model.train()
    total = 0.0
    for (batch,) in train:
        batch = batch.to(dev, non_blocking=True)
        loss = lossf(model(batch[:, :-1]).reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.item()
    model.eval()
    with torch.no_grad():
        vl = sum(lossf(model(b[:, :-1].to(dev)).reshape(-1, vocab), b[:, 1:].to(dev).reshape(-1)).item()
                 for (b,) in val) / len(val)
    print(f"epoch {epoch}: train loss {total / len(train):.4f}, val loss {vl:.4f}, "
          f"memory_allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, "
          f"max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB", flush=True)
    torch.cuda.reset_peak_memory_stats()
