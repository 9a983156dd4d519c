#!/usr/bin/env python3
"""memshim with real PyTorch on a GPU (issues 9 and 17), in one script within a time budget on one
H200 (tests/gpu/run_gpu_checks.sh runs it with what is left of 8 minutes).

Without PyTorch every case skips. Without a GPU (make check on the CPU machines) only the
allocator API is tested, and the GPU cases skip; `--dry-run` instead runs every worker on the CPU
with small sizes and the CUDA-only calls replaced (stated per worker), through the same
subprocess, RESULT-line and JSON plumbing, so the GPU run cannot fail on a typo. With a GPU, after
probing that the driver's VMM calls work (device attribute, then memshim's own pool on the
device), in this order until the budget runs out:
  - a small Transformer LM natively, with PyTorch's expandable segments, and under memshim in
    tensor mode (LD_PRELOAD alone), fixed seed, deterministic kernels: losses equal (bit-exact
    expected; the largest relative difference is recorded), step time and peak reserved side by
    side, 3 epoch reports;
  - the largest batch that trains under a 24 GiB cap: MEMSHIM_LIMIT=24G in tensor mode vs
    PyTorch's set_per_process_memory_fraction natively; the OOM is torch.OutOfMemoryError with
    PyTorch's words and memshim's diagnosis, and the job continues with a smaller batch;
  - CUDA graphs sharing one memory pool (graph_pool_handle): two graphs captured into it, the second
    reading the first's output, replayed with other tensors allocated and freed around them, then
    the first reset and the second replayed again: the same values as eager;
  - torch.compile default and reduce-overhead (plain CUDA graphs under memshim);
  - the ViT in the same three modes; DDP with one process over NCCL.
Each run is a subprocess of this script (`--worker NAME`): CUDA cannot be re-initialised.
BUILD (default build) names the build whose libmemshim.so is preloaded. Writes every figure to a
JSON file (--json PATH; default $OUT/gpu-torch.json when OUT is set, else gpu-torch.json). Ends
with "N passed, N failed, N skipped"."""
import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pyharness import BUILD, case, finish, results, skip, step  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
GiB = 1 << 30
DEADLINE_S = 420  # default budget (--budget): later items skip past it


# =========================================================================================== workers
# Run as `test_torch.py --worker NAME [args]`, in a process whose environment chooses the mode.
# Each prints one line "RESULT <json>".

def _det():
    import torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch


def _lm(torch, dim=256, layers=4, vocab=1000):
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, dim)
            layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0)
            self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, vocab)

        def forward(self, x):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            return self.head(self.body(self.emb(x), mask=mask, is_causal=True))
    return LM()


def _vit(torch, dim=192, layers=4, classes=10, patch=8, img=64):
    class ViT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = torch.nn.Conv2d(3, dim, patch, patch)
            self.pos = torch.nn.Parameter(torch.zeros(1, (img // patch) ** 2 + 1, dim))
            self.cls = torch.nn.Parameter(torch.zeros(1, 1, dim))
            layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0)
            self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, classes)

        def forward(self, x):
            p = self.patch(x).flatten(2).transpose(1, 2)
            p = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], 1) + self.pos
            return self.head(self.body(p)[:, 0])
    return ViT()


def worker_train(which, steps, dry="0"):
    """3 epochs over a DataLoader with a validation pass each; losses, step times, memory.
    Dry run: on the CPU with tiny models, no memory figures."""
    dry = dry == "1"
    dev = "cpu" if dry else "cuda"
    steps = int(steps)
    torch = _det()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(1)
    if which == "lm":
        data = torch.randint(0, 1000, (steps * 16, 17 if dry else 129), generator=g)
        ds, model = TensorDataset(data), (_lm(torch, dim=32, layers=1) if dry else _lm(torch))

        def loss_of(m, b):
            (x,) = b
            x = x.to(dev)
            return torch.nn.functional.cross_entropy(m(x[:, :-1]).reshape(-1, 1000), x[:, 1:].reshape(-1))
    else:
        img = 16 if dry else 64
        ds = TensorDataset(torch.randn(steps * 16, 3, img, img, generator=g), torch.randint(0, 10, (steps * 16,),
                                                                                            generator=g))
        model = _vit(torch, dim=32, layers=1, img=16) if dry else _vit(torch)

        def loss_of(m, b):
            x, y = b
            return torch.nn.functional.cross_entropy(m(x.to(dev)), y.to(dev))
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    train = DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))
    val = DataLoader(ds, batch_size=32)
    losses, times = [], []
    mem = {}
    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention kernels, forward and backward
        for epoch in range(3):
            for i, b in enumerate(train):
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = loss_of(model, b)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())  # synchronizes
                times.append(time.perf_counter() - t0)
                if i == len(train) // 2:
                    with torch.no_grad():
                        for vb in list(val)[:2]:
                            loss_of(model, vb)
            if dev == "cuda":
                mem[f"epoch{epoch}"] = {"allocated": torch.cuda.memory_allocated(),
                                        "max_allocated": torch.cuda.max_memory_allocated()}
    out = {"losses": losses, "step_s_median": sorted(times[5:])[len(times[5:]) // 2] if len(times) > 5 else None}
    if dev == "cuda":
        st = torch.cuda.memory_stats()
        out.update(mem=mem, peak_reserved=torch.cuda.max_memory_reserved(), peak_allocated=torch.cuda.max_memory_allocated(),
                   stats_keys=len(st), num_ooms=st.get("num_ooms"), allocator=_allocator_name(torch))
    print("RESULT", json.dumps(out), flush=True)


def _allocator_name(torch):
    try:
        from memshim import _torch as mt
        return "memshim" if mt.state.tensor else "pytorch"
    except ImportError:
        return "pytorch"


def worker_maxbatch(cap_mode, dry="0"):
    """Largest batch of a bigger LM that trains one step under a 24 GiB cap; after the first OOM
    the job continues with smaller batches (that is the OOM-continue check too). Dry run: a tiny
    LM on the CPU, whose steps above 32 sequences raise torch.OutOfMemoryError themselves."""
    dry = dry == "1"
    dev = "cpu" if dry else "cuda"
    torch = _det()
    if cap_mode == "fraction" and not dry:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, 24 * GiB / total))
    vocab, seq = (128, 16) if dry else (8192, 512)
    model = (_lm(torch, dim=64, layers=1, vocab=vocab) if dry else _lm(torch, dim=1024, layers=8, vocab=vocab)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fits(bs):
        try:
            if dry and bs > 32:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate (dry run: batch {bs} > 32)")
            x = torch.randint(0, vocab, (bs, seq + 1), device=dev)
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if not dry:
                torch.cuda.synchronize()
            return True, None
        except torch.OutOfMemoryError as e:
            return False, str(e)
        finally:
            opt.zero_grad(set_to_none=True)
            x = loss = None  # noqa: F841
            if not dry:
                torch.cuda.empty_cache()
    lo, hi, bs, first_oom = 0, None, 4, None
    while hi is None and bs <= 4096:
        ok, msg = fits(bs)
        if ok:
            lo, bs = bs, bs * 2
        else:
            hi, first_oom = bs, msg
    while hi is not None and hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        ok, msg = fits(mid)
        lo, hi = (mid, hi) if ok else (lo, mid)
    again, _ = fits(max(1, lo // 2))  # the job continues after OOMs with a smaller batch
    print("RESULT", json.dumps({"largest_batch": lo, "first_oom": (first_oom or "")[:400], "continued": again,
                                "peak_reserved": None if dry else torch.cuda.max_memory_reserved(),
                                "allocator": _allocator_name(torch)}), flush=True)


def worker_graph(dry="0"):
    """Two CUDA graphs captured into one shared pool (torch.cuda.graph_pool_handle), the second
    reading the first's output, as make_graphed_callables does; replayed with other tensors
    allocated and freed around them; then the first is reset and the second, which still holds
    the pool, replayed again. Every replay must equal eager. Dry run: the same arithmetic eagerly
    on the CPU, without capture."""
    dry = dry == "1"
    dev = "cpu" if dry else "cuda"
    torch = _det()
    lin1, lin2 = torch.nn.Linear(1024, 1024).to(dev), torch.nn.Linear(1024, 256).to(dev)
    x = torch.randn(256, 1024, device=dev)

    def f1(inp):
        tmp = lin1(inp) * 2.0  # a temporary freed inside the capture
        return tmp.relu() + 1.0

    def f2(h):
        return lin2(h).tanh().sum(dim=1)
    if dry:
        def replay1():
            with torch.no_grad():
                y1.copy_(f1(x))

        def replay2():
            with torch.no_grad():
                y2.copy_(f2(y1))
        with torch.no_grad():
            y1, y2 = f1(x), f2(f1(x))
        reset1 = None
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(3):
                f2(f1(x))
        torch.cuda.current_stream().wait_stream(s)
        pool = torch.cuda.graph_pool_handle()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.no_grad():
            with torch.cuda.graph(g1, pool=pool):
                y1 = f1(x)
            with torch.cuda.graph(g2, pool=pool):
                y2 = f2(y1)
        replay1, replay2, reset1 = g1.replay, g2.replay, g1.reset
    results, after_reset = [], None
    for k in range(3):
        junk = [torch.full((1 << 20,), float(k + 7), device=dev) for _ in range(4 if dry else 64)]  # other tensors
        x.copy_(torch.randn(256, 1024, device=dev))
        replay1()
        replay2()
        if not dry:
            torch.cuda.synchronize()
        with torch.no_grad():
            ref = f2(f1(x))
        results.append(bool(torch.allclose(y2, ref, rtol=1e-5, atol=1e-4)))
        del junk
    if reset1 is not None:
        h = y1.clone()
        reset1()  # g2 still holds the pool: its memory must stay its own
        junk = [torch.full((1 << 20,), 3.0, device=dev) for _ in range(64)]
        y1_in = h  # g2 reads the pool's copy of y1, which the reset must not have handed out
        replay2()
        torch.cuda.synchronize()
        with torch.no_grad():
            ref = f2(y1_in)
        after_reset = bool(torch.allclose(y2, ref, rtol=1e-5, atol=1e-4))
        del junk
    print("RESULT", json.dumps({"replays_equal": results, "after_reset_equal": after_reset,
                                "allocator": _allocator_name(torch)}), flush=True)


def worker_compile(mode, dry="0"):
    """torch.compile in the given mode. Dry run: on the CPU with the eager backend (no inductor)."""
    dry = dry == "1"
    dev = "cpu" if dry else "cuda"
    torch = _det()
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).to(dev)
    x = torch.randn(64, 512, device=dev)
    with torch.no_grad():
        ref = m(x)
        cm = torch.compile(m, backend="eager") if dry else torch.compile(m, mode=None if mode == "default" else mode)
        outs = [cm(x) for _ in range(4)]
    ok = all(bool(torch.allclose(o, ref, rtol=1e-3, atol=1e-3)) for o in outs)
    trees = None
    try:
        import torch._inductor.config as ic
        trees = ic.triton.cudagraph_trees
    except Exception:  # noqa: BLE001
        pass
    print("RESULT", json.dumps({"equal": ok, "cudagraph_trees": trees, "allocator": _allocator_name(torch)}),
          flush=True)


def worker_ddp(dry="0"):
    """DDP, one process. Dry run: gloo on the CPU."""
    dry = dry == "1"
    dev = "cpu" if dry else "cuda"
    torch = _det()
    import socket
    import torch.distributed as dist
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    dist.init_process_group("gloo" if dry else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).to(dev),
                                                      device_ids=None if dry else [0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(10):
        x = torch.randn(64, 256, device=dev)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.destroy_process_group()
    print("RESULT", json.dumps({"losses": losses, "allocator": _allocator_name(torch)}), flush=True)


WORKERS = {"train": worker_train, "maxbatch": worker_maxbatch, "graph": worker_graph, "compile": worker_compile,
           "ddp": worker_ddp}


# =========================================================================================== driver
def run(argv_or_code, env_extra=None, timeout=300, preload=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and k != "LD_PRELOAD"}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if preload:
        env["LD_PRELOAD"] = LIB
    env.update(env_extra or {})
    argv = [sys.executable, "-c", argv_or_code] if isinstance(argv_or_code, str) else argv_or_code
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"timed out after {timeout} s"


def worker(name, *args, mode="native", env_extra=None, timeout=300):
    """Run a worker natively, with PyTorch's expandable segments, in memshim's segment mode or in
    tensor mode; its RESULT dict or None, and why not."""
    extra = dict(env_extra or {})
    if mode == "segment":
        extra["MEMSHIM_MODE"] = "segment"
    if mode == "expandable":
        extra["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode in ("native", "expandable"):
        mode = "native"
    extra.setdefault("MSH_TEST_TIMEOUT", "86400")  # a worker's limit is its subprocess timeout, not the watchdog
    rc, out, err = run([sys.executable, os.path.abspath(__file__), "--worker", name, *map(str, args)], extra,
                       timeout=timeout, preload=mode != "native")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), err
    return None, f"rc={rc}\n{out[-1500:]}\n{err[-2500:]}"


def rel_diff(a, b):
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--json")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget", type=float, default=DEADLINE_S, help="seconds for the GPU items (later ones skip)")
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    if a.worker:
        WORKERS[a.worker](*a.rest)  # strings: each worker converts its own
        return
    t_start = time.time()
    dry = a.dry_run
    rep = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": platform.node(), "dry_run": dry,
           "library": LIB, "budget_s": a.budget}
    probe = run("import torch; print('TORCH', torch.__version__, torch.cuda.is_available())")
    if probe[0] != 0 or "TORCH" not in probe[1]:
        for n in ("allocator API", "GPU checks"):
            skip(n, "PyTorch is not installed (bash scripts/setup.sh --with-torch installs it)")
        finish()
    version, has_gpu = probe[1].split("TORCH ")[1].split()[:2]
    has_gpu = has_gpu == "True"
    rep["torch"] = version
    print(f"torch {version}, GPU available: {has_gpu}{' (dry run: on the CPU)' if dry else ''}")

    # The allocator API as far as it runs without a GPU (and with one).
    api = f"""
import ctypes, torch
from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator
a = CUDAPluggableAllocator({LIB!r}, "memshim_malloc", "memshim_free")
so = ctypes.CDLL({LIB!r})
hooks = [s for s in ("set_reset_fn", "set_record_stream_fn", "set_init_fn", "set_memory_fraction_fn",
         "set_base_alloc_fn", "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool")
         if hasattr(a._allocator, s)]
a._allocator.set_reset_fn(ctypes.cast(so.memshim_empty_cache, ctypes.c_void_p).value)
change_current_allocator(a)
print("API-OK", hooks)
"""
    rc, out, err = run(api)
    case("CUDAPluggableAllocator over libmemshim.so, hooks set, allocator swapped before CUDA init",
         rc == 0 and "API-OK" in out, (out + err)[-600:])
    items = ("VMM probe", "LM: native, expandable segments, tensor mode", "largest batch under 24 GiB",
             "OOM caught and continuing", "CUDA graphs sharing a pool", "torch.compile default",
             "torch.compile reduce-overhead", "ViT: native, expandable segments, tensor mode", "DDP over NCCL")
    if not has_gpu and not dry:
        for n in items:
            skip(n, "no GPU on this machine (--dry-run runs the plumbing on the CPU)")
        finish()

    json_path = a.json or os.path.join(os.environ.get("OUT", "."), "gpu-torch.json")
    left = lambda: a.budget - (time.time() - t_start)  # noqa: E731
    D = "1" if dry else "0"
    rep["gpu"] = None if dry else run("import torch; print(torch.cuda.get_device_name(0))")[1].strip()

    # 1. Probe the VMM calls before relying on them: the device attribute, then memshim's pool.
    vmm = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
d = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(d), 0) == 0
v = ctypes.c_int(); r = cu.cuDeviceGetAttribute(ctypes.byref(v), 102, d)  # VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
m = ctypes.CDLL(None)
m.memshim_malloc.restype = ctypes.c_void_p
m.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
p = m.memshim_malloc(8 << 20, 0, None)
print("VMM", r, v.value, bool(p))
"""
    rc, out, err = run(vmm, preload=True)
    vmm_ok = "VMM 0 1 True" in out
    rep["vmm_probe"] = out.strip() or err[-300:]
    case("the driver's VMM calls work (device attribute, memshim's pool maps memory)"
         + (" (dry run: the driver double)" if dry else ""), vmm_ok, (out + err)[-800:])
    if not vmm_ok:
        skip("memshim GPU checks", "VMM is not usable on this device: memshim passes through")
        json.dump(rep, open(json_path, "w"), indent=1)
        finish()

    def train_three(model, steps, modes=("native", "expandable", "tensor")):
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            # tensor mode's reports stay in $OUT (the GPU check summarises them), else in a temp dir
            rdir = os.path.join(os.environ["OUT"], f"memreport-{model}") if os.environ.get("OUT") else tmp
            for mode in modes:
                extra = {"MEMSHIM_REPORT_DIR": os.path.join(rdir, mode)} if mode == "tensor" else {}
                r, why = worker("train", model, steps, D, mode=mode, env_extra=extra, timeout=max(30, min(240, left())))
                runs[mode] = r
                if r is None:
                    case(f"{model}: {mode} run completes", False, why)
            epochs_tensor = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rdir, "tensor", "*epoch*.json")))]
            summ = glob.glob(os.path.join(rdir, "tensor", "*summary.json"))
            summary = json.load(open(summ[0])) if summ else {}
        base = (runs.get("native") or {}).get("losses")
        out = {}
        for mode in modes:
            r = runs.get(mode) or {}
            out[mode] = {"step_s_median": r.get("step_s_median"), "peak_reserved": r.get("peak_reserved"),
                         "peak_allocated": r.get("peak_allocated"), "allocator": r.get("allocator")}
            if mode == "native" or not base or not r.get("losses"):
                continue
            exact = r["losses"] == base
            d = rel_diff(r["losses"], base)
            out[mode].update(bit_exact=exact, max_rel_diff=d,
                             step_overhead=(r["step_s_median"] / runs["native"]["step_s_median"] - 1.0)
                             if r.get("step_s_median") and runs["native"].get("step_s_median") else None)
            # Deterministic kernels (math attention, no TF32, cuBLAS workspace config) should make
            # the losses bit-exact; 1e-5 relative is allowed for cuBLAS heuristics that differ
            # between processes, and the difference is recorded either way.
            case(f"{model}: {mode}: same losses as natively (bit-exact: {exact}, max rel diff {d:.2e})",
                 d <= 1e-5, (base[:5], r["losses"][:5]))
        tr = runs.get("tensor") or {}
        if dry or "tensor" not in modes:
            case(f"{model}: dry run: three runs returned their figures", all(runs.values()), list(runs))
        else:
            case(f"{model}: tensor mode: memshim is PyTorch's allocator", tr.get("allocator") == "memshim", tr)
            case(f"{model}: tensor mode: memory_allocated and memory_stats answer",
                 bool(tr.get("mem")) and all(v["max_allocated"] > 0 for v in tr["mem"].values())
                 and (tr.get("stats_keys") or 0) > 50, tr.get("mem"))
            case(f"{model}: tensor mode: 3 epoch reports (dataloader) and a summary",
                 [e["reason"] for e in epochs_tensor] == ["dataloader"] * 3 and bool(summary),
                 [(e.get("reason"), e.get("steps")) for e in epochs_tensor])
        out["memshim_reserved_run_peak"] = (summary.get("memory") or {}).get("reserved_run_peak_bytes")
        print(f"{model}: " + "; ".join(f"{m} step {fmt_s(out[m]['step_s_median'])} peak reserved "
                                       f"{fmt_b(out[m]['peak_reserved'])}" for m in modes))
        rep.setdefault("train", {})[model] = out

    def maxbatch():
        nat, why_n = worker("maxbatch", "fraction", D, mode="native", timeout=max(30, min(200, left() / 2)))
        ten, why_t = worker("maxbatch", "limit", D, mode="tensor", env_extra={"MEMSHIM_LIMIT": "24G"},
                            timeout=max(30, min(200, left())))
        rep["max_batch_24GiB"] = {"pytorch_fraction": nat, "memshim_limit": ten}
        case("largest batch under 24 GiB found with PyTorch's memory fraction and with MEMSHIM_LIMIT",
             bool(nat and ten and nat["largest_batch"] and ten["largest_batch"]), (why_n, why_t))
        case("OOM" + (" (dry run: raised by the worker)" if dry else " in tensor mode") + ": torch.OutOfMemoryError "
             "with PyTorch's words" + ("" if dry else " and memshim's diagnosis") + ", and the job continues with a "
             "smaller batch",
             bool(ten) and ten["first_oom"].startswith("CUDA out of memory. Tried to allocate") and
             (dry or "memshim" in ten["first_oom"]) and ten["continued"], ten or why_t)

    def tensor_check(name, args, title, ok):
        r, why = worker(name, *args, D, mode="tensor", timeout=max(30, min(180, left())))
        rep.setdefault("checks", {})[title] = r
        case(title, r is not None and (dry or r.get("allocator") == "memshim") and ok(r), r or why)

    plan = [
        ("LM: native, expandable segments, tensor mode", lambda: train_three("lm", 4 if dry else 30)),
        ("largest batch under 24 GiB", maxbatch),
        ("CUDA graphs sharing a pool", lambda: tensor_check(
            "graph", (), "CUDA graphs sharing a pool: replays equal eager, also after one graph is reset",
            lambda r: r["replays_equal"] == [True, True, True] and r["after_reset_equal"] in (True, None if dry else True))),
        ("torch.compile default", lambda: tensor_check("compile", ("default",), "torch.compile (default) in tensor mode",
                                                       lambda r: r["equal"])),
        ("torch.compile reduce-overhead", lambda: tensor_check(
            "compile", ("reduce-overhead",), "torch.compile (reduce-overhead, plain CUDA graphs) in tensor mode",
            lambda r: r["equal"] and (dry or r["cudagraph_trees"] is False))),
        # (dry run: the ViT's own code natively; the three-mode comparison is the LM's)
        ("ViT: native, expandable segments, tensor mode",
         lambda: train_three("vit", 4, ("native",)) if dry else train_three("vit", 30)),
        ("DDP over NCCL", lambda: tensor_check("ddp", (), "DDP with one process" + (" (dry run: gloo)" if dry else
                                                                                     " over NCCL") + " in tensor mode",
                                               lambda r: len(r["losses"]) == 10 and all(x == x for x in r["losses"]))),
    ]
    for title, fn in plan:
        if left() < 20:
            skip(title, f"time budget ({a.budget:.0f} s) spent")
            rep.setdefault("skipped", []).append(title)
            continue
        step(title, timeout=max(60, left() + 60))  # the watchdog allows what the budget allows
        fn()

    rep["elapsed_s"] = round(time.time() - t_start, 1)
    rep["summary"] = dict(results)
    json.dump(rep, open(json_path, "w"), indent=1)
    print(f"results written to {json_path} ({rep['elapsed_s']} s)")
    finish()


def fmt_s(v):
    return "n/a" if v is None else f"{1000 * v:.1f} ms"


def fmt_b(v):
    return "n/a" if v is None else f"{v / GiB:.2f} GiB"


if __name__ == "__main__":
    main()
