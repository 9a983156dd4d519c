"""Two Lightning epochs on the CPU; argv: LOG_DIR or "-" (no logger). Prints nothing of its own:
its output is Lightning's, which must be the same with and without memshim."""
import sys

import torch
import pytorch_lightning as pl

from _dev import Device

dev = Device()
hold = dev.alloc(4 << 20)
torch.manual_seed(0)
X, Y = torch.randn(32, 8), torch.randn(32, 1)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch, i):
        x, y = batch
        act = dev.alloc(1 << 20)
        loss = ((self.lin(x) - y) ** 2).mean()
        dev.free(act)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


logger = False if sys.argv[1] == "-" else pl.loggers.CSVLogger(sys.argv[1], name="run")
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(Tiny(), dl)
