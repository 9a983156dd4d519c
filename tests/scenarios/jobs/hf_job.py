"""Two HF Trainer epochs on the CPU with a TensorBoard logger (no network; its event files under
TENSORBOARD_LOGGING_DIR when set, transformers 5's setting). argv: OUT_DIR. Prints
the Trainer's own output, then (on a line of its own) the memshim/ entries of its log history."""
import json
import sys

import torch
from transformers import Trainer, TrainingArguments

from _dev import Device

dev = Device()
hold = dev.alloc(4 << 20)
torch.manual_seed(0)
X, Y = torch.randn(32, 8), torch.randn(32, 1)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


data = [{"x": X[i], "labels": Y[i]} for i in range(32)]
args = TrainingArguments(output_dir=sys.argv[1], num_train_epochs=2, per_device_train_batch_size=8, use_cpu=True,
                         report_to=["tensorboard"], save_strategy="no",
                         logging_strategy="epoch", disable_tqdm=True, dataloader_num_workers=0)
trainer = Trainer(model=Tiny(), args=args, train_dataset=data)
trainer.train()
ours = [{k: v for k, v in e.items() if k.startswith("memshim/") or k in ("epoch", "step")}
        for e in trainer.state.log_history if any(k.startswith("memshim/") for k in e)]
print("MEMSHIM_LOG_HISTORY " + json.dumps(ours))
