"""Framework epochs for tests/torch/test_torch_cpu.py: `hf` trains a tiny model with the HF Trainer
for 2 epochs, `lightning` with PyTorch Lightning for 2 epochs, on CPU, under LD_PRELOAD=libmemshim.so
on the driver double (memshim started by one memshim_malloc). Prints `RESULT <json>` with the epoch
reports written (reason and steps) and `SKIP <why>` when the framework is not installed."""
import ctypes
import glob
import json
import os
import sys
import tempfile

which, rdir = sys.argv[1], sys.argv[2]
try:
    import torch
    if which == "hf":
        import transformers  # noqa: F401
        from transformers import Trainer, TrainingArguments
    else:
        import pytorch_lightning as pl
except Exception as exc:  # noqa: BLE001
    print("SKIP", f"{which}: {type(exc).__name__}: {exc}"[:200])
    sys.exit(0)

lib = ctypes.CDLL(None)
lib.memshim_malloc.restype = ctypes.c_void_p
lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
hold = lib.memshim_malloc(4 << 20, 0, None)
torch.manual_seed(0)
X, Y = torch.randn(32, 8), torch.randn(32, 1)

if which == "hf":
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    data = [{"x": X[i], "labels": Y[i]} for i in range(32)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, num_train_epochs=2, per_device_train_batch_size=8,
                                 use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0)
        Trainer(model=Tiny(), args=args, train_dataset=data).train()
else:
    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            return ((self.lin(x) - y) ** 2).mean()

        def validation_step(self, batch, i):
            x, y = batch
            self.lin(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(), dl, dl)
    print("CALLBACKS", [type(c).__name__ for c in trainer.callbacks])

reps = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rdir, "*epoch*.json")))]
print("RESULT", json.dumps([{"reason": r["reason"], "steps": r["steps"]} for r in reps]))
