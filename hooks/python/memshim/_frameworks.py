"""memshim's Python side, frameworks: epoch callbacks for the HF Trainer (added to
transformers.trainer.DEFAULT_CALLBACKS, so every Trainer gets one) and PyTorch Lightning (loaded
by Lightning from the entry points in memshim_hooks-*.dist-info beside this package). Each marks
its framework as the epoch source while it trains; the epochs close with reason hf_trainer or
lightning. Without libmemshim.so in the process they add nothing.
"""
from . import _boot, _epochs


def on_transformers_trainer(mod):
    from transformers import TrainerCallback

    class MemshimEpochCallback(TrainerCallback):
        """memshim: one report per HF Trainer epoch."""

        def on_train_begin(self, args, state, control, **kwargs):
            _epochs.framework_begin("hf_trainer")

        def on_epoch_end(self, args, state, control, **kwargs):
            _epochs.framework_epoch_end("hf_trainer")

        def on_train_end(self, args, state, control, **kwargs):
            _epochs.framework_end("hf_trainer")

    cbs = getattr(mod, "DEFAULT_CALLBACKS", None)
    if isinstance(cbs, list) and not any(getattr(c, "__name__", "") == "MemshimEpochCallback" for c in cbs):
        cbs.append(MemshimEpochCallback)


def _lightning_callback(base):
    class MemshimEpochCallback(base):
        """memshim: one report per Lightning training epoch."""

        def on_train_start(self, trainer, pl_module):
            _epochs.framework_begin("lightning")

        def on_train_epoch_end(self, trainer, pl_module):
            _epochs.framework_epoch_end("lightning")

        def on_train_end(self, trainer, pl_module):
            _epochs.framework_end("lightning")

    return MemshimEpochCallback()


def lightning_callbacks():
    """Entry point lightning.pytorch.callbacks_factory."""
    if _boot.lib() is None:
        return []
    from lightning.pytorch import Callback
    return [_lightning_callback(Callback)]


def pytorch_lightning_callbacks():
    """Entry point pytorch_lightning.callbacks_factory."""
    if _boot.lib() is None:
        return []
    from pytorch_lightning import Callback
    return [_lightning_callback(Callback)]
