#!/usr/bin/env python3
"""Which public PyTorch entries initialize CUDA without calling torch.cuda._lazy_init (issue 16
item 6; docs/pytorch.md lists the result). memshim switches PyTorch's allocator inside a wrapper of
torch.cuda._lazy_init; an entry whose C++ initializes CUDA by itself
(at::globalContext().lazyInitDevice(kCUDA), which never calls Python) must be wrapped to decide
first, or tensor mode is lost ("Can't swap an already initialized allocator").

Each candidate runs in a fresh python3 without memshim, with PYTORCH_API_USAGE_STDERR=1: PyTorch's
C++ CUDA initialization (CUDAHooks::init) logs the API-usage event `aten.init.cuda` when it starts,
whether or not it then finds a device, so this works without a GPU. torch.cuda._lazy_init is
replaced by a spy that prints a line. Verdicts:
  BYPASS        aten.init.cuda without _lazy_init before it: memshim must wrap this entry
  via_lazy_init _lazy_init came first: memshim's switch already runs there
  no_init       CUDA was not initialized by PyTorch (a device-less answer, or the call failed first)

    python3 tests/torch/init_paths.py            # every candidate, a table
    python3 tests/torch/init_paths.py -k pin     # the candidates whose text contains "pin"

Not part of make check (a minute or more: one interpreter per candidate). Run it on each PyTorch
memshim supports (the GPU machine's 2.11 too) and keep docs/pytorch.md's list in step.
"""
import argparse
import os
import subprocess
import sys

CANDIDATES = """
torch.cuda.current_device()
torch.cuda.device_count()
torch.cuda.is_available()
torch.cuda.get_device_name(0)
torch.cuda.get_device_properties(0)
torch.cuda.get_device_capability(0)
torch.cuda.synchronize()
torch.cuda.set_device(0)
torch.cuda.Stream()
torch.cuda.current_stream()
torch.cuda.default_stream()
torch.cuda.Event(enable_timing=True)
torch.cuda.empty_cache()
torch.cuda.memory_stats()
torch.cuda.memory_allocated()
torch.cuda.memory_reserved()
torch.cuda.mem_get_info()
torch.cuda.set_per_process_memory_fraction(0.5)
torch.cuda.get_per_process_memory_fraction()
torch.cuda.reset_peak_memory_stats()
torch.cuda.memory_summary()
torch.cuda.memory_snapshot()
torch.cuda.caching_allocator_alloc(1024)
torch.cuda.memory.get_allocator_backend()
torch.cuda.memory._record_memory_history()
torch.cuda.memory._record_memory_history(enabled=None)
torch.cuda.memory._record_memory_history(True)
torch.cuda.memory._record_memory_history_impl()
torch.cuda.memory._record_memory_history_legacy(True)
torch.cuda.memory._snapshot()
torch.cuda.memory._dump_snapshot('/dev/null')
torch.cuda.host_memory_stats()
torch.cuda.ipc_collect()
torch.cuda.manual_seed(1)
torch.cuda.manual_seed_all(1)
torch.cuda.initial_seed()
torch.cuda.get_rng_state()
torch.manual_seed(1)
torch.cuda.graph_pool_handle()
torch.cuda.CUDAGraph()
torch.cuda.is_current_stream_capturing()
torch.cuda.MemPool()
torch.cuda.cudart()
torch.cuda.can_device_access_peer(0, 0)
torch.cuda.get_sync_debug_mode()
torch.cuda.memory.caching_allocator_enable(True)
torch.backends.cudnn.version()
torch.backends.cuda.is_flash_attention_available()
torch.cuda.tunable.enable(True)
torch.ones(3).pin_memory()
torch.empty(3, pin_memory=True)
torch.zeros(3, pin_memory=True)
torch.tensor([1.0], pin_memory=True)
torch.ones(3).is_pinned()
torch.UntypedStorage(3).pin_memory()
torch.ones(3).share_memory_()
torch.Generator(device='cuda')
torch.ones(3).to('cuda')
torch.ones(3).cuda()
torch.nn.Linear(2, 2).cuda()
torch.empty(3, device='cuda')
torch.UntypedStorage(3, device='cuda')
torch.cuda.FloatTensor(3)
torch.set_default_device('cuda'); torch.empty(3)
torch.accelerator.current_device_index()
torch.accelerator.set_device_index(0)
torch.accelerator.synchronize()
torch.accelerator.current_stream()
torch.accelerator.memory_stats()
torch.accelerator.empty_cache()
torch.accelerator.get_memory_info()
torch.amp.autocast('cuda').__enter__()
torch.amp.GradScaler('cuda')
torch.utils.dlpack.from_dlpack(torch.ones(3))
torch.cuda.current_blas_handle()
""".strip().splitlines()

PROBE = r"""
import sys, torch
orig = torch.cuda._lazy_init
def spy():
    print("PROBE _lazy_init", file=sys.stderr, flush=True)
    return orig()
for m in list(sys.modules.values()):
    if getattr(m, "__name__", "").startswith("torch") and getattr(m, "_lazy_init", None) is orig:
        m._lazy_init = spy
try:
    exec(sys.argv[1])
    print("PROBE ok", file=sys.stderr, flush=True)
except Exception as exc:
    print("PROBE raised", type(exc).__name__, file=sys.stderr, flush=True)
"""


def verdict(expr):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("MEMSHIM_")}
    env["PYTORCH_API_USAGE_STDERR"] = "1"
    p = subprocess.run([sys.executable, "-c", PROBE, expr], env=env, capture_output=True, text=True, timeout=120)
    ev = [l for l in p.stderr.splitlines() if "PROBE _lazy_init" in l or "aten.init.cuda" in l]
    if not any("aten.init.cuda" in l for l in ev):
        return "no_init"
    return "via_lazy_init" if "_lazy_init" in ev[0] else "BYPASS"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only candidates whose text contains this")
    a = ap.parse_args()
    import torch
    print(f"torch {torch.__version__}")
    for expr in CANDIDATES:
        if a.k in expr:
            print(f"{verdict(expr):14s} {expr}", flush=True)


if __name__ == "__main__":
    main()
