"""memshim's Python side, frameworks: epoch callbacks for the HF Trainer (added to
transformers.trainer.DEFAULT_CALLBACKS, so every Trainer gets one) and PyTorch Lightning (added to
the callbacks each Trainer loads from its entry points, by wrapping the function Lightning loads
them with: an entry point of memshim's own would make Lightning print "Adding 1 callbacks from
entry point 'memshim'" in every run, and memshim must not change what a job prints). Each marks its
framework as the epoch source while it trains; the epochs close with reason hf_trainer or
lightning. Without libmemshim.so in the process they add nothing.

At each epoch end the callbacks also log memshim's figures for that epoch (peak allocated and
reserved bytes, fragmentation, OOMs and rescues, growth) under `memshim/`, through the trainer's
own logging, the way the framework logs anything else (MEMSHIM_TRAINER_METRICS=0 turns it off):
Lightning: each of trainer.loggers gets log_metrics(), as Lightning's DeviceStatsMonitor does
(loggers write on rank 0, as they do for every metric); HF: state.log_history and the on_log of
the callbacks that listen (TensorBoard, W&B, MLflow, a program's own), as Trainer.log() does, but
not its printing callbacks (the job's output stays as it was).
"""
import sys

from . import _boot, _epochs
from ._boot import LOG_WARN, log, setting

_METRICS = (("allocated_peak_bytes", int), ("reserved_peak_bytes", int), ("fragmentation", float),
            ("peak_allocated_over_peak_reserved", float), ("ooms", int), ("oom_rescues", int),
            ("growth_bytes", int))
_logged_epoch = {}  # device -> the last epoch index logged (each closed epoch is logged once)


def epoch_metrics():
    """memshim/* figures of the epochs closed since the last call, one set per device (a single
    device gets plain names, several `memshim/devD/...`). {} when there is nothing new."""
    lib = _boot.lib()
    if lib is None or setting("started") != 1 or setting("trainer_metrics") != 1:
        return {}
    found = {}
    for d in range(64):
        f = _boot.EpochFigures()
        if lib.memshim_last_epoch(d, f) != 0:
            continue
        if _logged_epoch.get(d) == f.epoch:
            continue
        found[d] = f
    out = {}
    for d, f in found.items():
        _logged_epoch[d] = f.epoch
        prefix = "memshim/" if len(found) == 1 else f"memshim/dev{d}/"
        for name, kind in _METRICS:
            key = "growth_bytes_per_epoch" if name == "growth_bytes" else name
            out[prefix + key] = kind(getattr(f, name))
    return out


# ---- HF Trainer ---------------------------------------------------------------------------------
def _hf_handler():
    """The CallbackHandler calling us (its call_event is the caller's frame): HF passes callbacks
    neither the Trainer nor its handler."""
    try:
        frame = sys._getframe(2)
    except ValueError:
        return None
    for _ in range(3):
        if frame is None:
            break
        h = frame.f_locals.get("self")
        if h is not None and type(h).__name__ == "CallbackHandler" and hasattr(h, "callbacks"):
            return h
        frame = frame.f_back
    return None


def _hf_log(handler, args, state, control, metrics):
    """What Trainer.log() does, without the printing callbacks."""
    from transformers import trainer_callback as tc
    quiet = tuple(c for c in (getattr(tc, "ProgressCallback", None), getattr(tc, "PrinterCallback", None),
                              getattr(tc, "DefaultFlowCallback", None)) if c is not None)
    listeners = [cb for cb in handler.callbacks
                 if not isinstance(cb, quiet) and type(cb).__name__ != "MemshimEpochCallback"
                 and type(cb).on_log is not tc.TrainerCallback.on_log]
    if not listeners:
        return  # no logger: nothing to put figures in
    logs = dict(metrics)
    if getattr(state, "epoch", None) is not None:
        logs["epoch"] = state.epoch
    state.log_history.append({**logs, "step": state.global_step})
    # the keyword arguments CallbackHandler.call_event passes every callback
    extra = {k: getattr(handler, k) for k in ("model", "processing_class", "optimizer", "lr_scheduler",
                                              "train_dataloader", "eval_dataloader") if hasattr(handler, k)}
    for cb in listeners:
        cb.on_log(args, state, control, logs=logs, **extra)


def on_transformers_trainer(mod):
    from transformers import TrainerCallback

    class MemshimEpochCallback(TrainerCallback):
        """memshim: one report per HF Trainer epoch, its figures in the Trainer's logs."""

        def on_train_begin(self, args, state, control, **kwargs):
            _epochs.framework_begin("hf_trainer")

        def on_epoch_end(self, args, state, control, **kwargs):
            _epochs.framework_epoch_end("hf_trainer")
            try:
                metrics = epoch_metrics()
                handler = _hf_handler() if metrics else None
                if handler is not None:
                    _hf_log(handler, args, state, control, metrics)
            except Exception as exc:  # noqa: BLE001
                log(LOG_WARN, f"memshim's figures could not be logged to the HF Trainer ({type(exc).__name__}: {exc})")

        def on_train_end(self, args, state, control, **kwargs):
            _epochs.framework_end("hf_trainer")

    cbs = getattr(mod, "DEFAULT_CALLBACKS", None)
    if isinstance(cbs, list) and not any(getattr(c, "__name__", "") == "MemshimEpochCallback" for c in cbs):
        cbs.append(MemshimEpochCallback)


# ---- PyTorch Lightning ----------------------------------------------------------------------------
def _lightning_callback(base):
    class MemshimEpochCallback(base):
        """memshim: one report per Lightning training epoch, its figures in the trainer's loggers."""

        def on_train_start(self, trainer, pl_module):
            _epochs.framework_begin("lightning")

        def on_train_epoch_end(self, trainer, pl_module):
            _epochs.framework_epoch_end("lightning")
            try:
                loggers = list(getattr(trainer, "loggers", None) or [])
                metrics = epoch_metrics() if loggers else {}
                if metrics:
                    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
                    step = getattr(loop, "_batches_that_stepped", None)  # what DeviceStatsMonitor uses
                    step = trainer.global_step if step is None else step
                    for lg in loggers:
                        lg.log_metrics(metrics, step=step)
            except Exception as exc:  # noqa: BLE001
                log(LOG_WARN, f"memshim's figures could not be logged to Lightning ({type(exc).__name__}: {exc})")

        def on_train_end(self, trainer, pl_module):
            _epochs.framework_end("lightning")

    return MemshimEpochCallback()


def _on_callback_connector(mod):
    """Lightning's trainer/connectors/callback_connector.py: its callbacks from entry points come
    from _load_external_callbacks(group); memshim's is added to what that returns, silently."""
    orig = getattr(mod, "_load_external_callbacks", None)
    base = getattr(mod, "Callback", None)
    if orig is None or base is None or getattr(orig, "_memshim", False):
        if orig is None:
            log(LOG_WARN, f"{mod.__name__} has no _load_external_callbacks: memshim's Lightning epochs are off "
                          "(the DataLoader rule still applies)")
        return

    def _load_external_callbacks(group, *args, **kwargs):
        cbs = orig(group, *args, **kwargs)
        try:
            if _boot.lib() is not None and str(group).endswith("callbacks_factory"):
                cbs = list(cbs) + [_lightning_callback(base)]
        except Exception as exc:  # noqa: BLE001
            log(LOG_WARN, f"memshim's Lightning callback is off ({type(exc).__name__}: {exc})")
        return cbs
    _load_external_callbacks._memshim = True
    _load_external_callbacks.__wrapped__ = orig
    mod._load_external_callbacks = _load_external_callbacks


def watch_lightning():
    for pkg in ("pytorch_lightning", "lightning.pytorch"):
        _boot.watch(f"{pkg}.trainer.connectors.callback_connector", _on_callback_connector)


# Entry points of earlier installs (memshim_hooks-*.dist-info); the connector adds the callback now.
def lightning_callbacks():
    return []


def pytorch_lightning_callbacks():
    return []
