#!/usr/bin/env python3
"""Training shapes for the GPU benchmark (issue 26) and the GPT-loop cost check (issue 24 item 5),
run by tests/gpu/gpu_checks.py as its `bench` and `gpt` steps (docs/benchmarks.md, "GPU benchmark").

  bench_workloads.py bench --out DIR [--budget S] [--dry-run] [--only W,W]
        every workload under every allocator: throughput interleaved (one window each per round,
        the order rotated each round, 3 rounds, medians) and the frontier (the bracket of the
        largest batch that completes a fixed number of steps under one cap, the same for all four,
        each in a fresh worker), most valuable rows first, the rest skipped with the reason when
        the budget runs out (which fails the run); writes DIR/gpu-bench.json and DIR/gpu-bench.md
  bench_workloads.py gpt --out DIR [--budget S] [--dry-run]
        the GPT loop natively, in memshim's tensor mode and in its segment mode, interleaved, 3
        repeats each, with memshim's own account of the timed part (its epoch report) and a few
        iterations under torch.profiler natively and in tensor mode; writes DIR/gpu-gpt.json and
        DIR/gpu-gpt.md
  bench_workloads.py serve [--dry-run]
        one allocator's worker (its environment chooses the allocator): loads workloads one after
        another and answers JSON commands on stdin, one RESULT line each

Workloads (our own code, shaped as people train):
  gpt-small   a GPT trained by a plain iteration loop as public scripts do it (nanoGPT-shaped): bf16
              autocast, fused AdamW, gradient clipping, batches cut from a token array on the host,
              pinned and copied with non_blocking=True, a no_grad eval pass every 20 steps;
              6 layers x 384, batch 32 x 256
  gpt2-small  the same loop at GPT-2 small: 12 layers x 768, vocab 50304, batch 8 x 1024
  varlen-lm   a decoder LM whose batch and sequence length change every step (batch B/4..B, 64..1024
              tokens, every 5th step the largest shape; the draws depend on the step only, so a
              larger B is never a smaller step): the shape that fragments PyTorch's cache
  vit         a ViT-S/16 (12 layers x 384, 224 px) in the same loop, batch 128
  hf-gpt2     Hugging Face's Trainer on a small GPT-2 built from a config (no download): 6 layers x
              512, 512 tokens, batch 16 (skipped with the reason where transformers is missing)
Allocators: native; expandable (expandable_segments:True); cudaMallocAsync (backend:cudaMallocAsync),
both through PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF; memshim (LD_PRELOAD alone: tensor mode),
and for the gpt step memshim-segment (MEMSHIM_MODE=segment: memshim loaded, PyTorch's allocator).

Each allocator runs in its own long-lived worker process for throughput (CUDA cannot change
allocator once initialised), started in parallel, which loads each workload in turn (the last one
and its cache freed first); each frontier runs in a worker started for it, which takes the cap
(torch.cuda.set_per_process_memory_fraction(cap / total): memshim takes it as its limit;
cudaMallocAsync counts allocated bytes against it, not reserved), runs its trials and exits, so
no cap or cache outlives its frontier. The driver hands one command at a time to one worker, so
no two measure at once. The frontier's search is tests/gpu/bracket.py's, the OOM step's too.

--dry-run (make check, through gpu_checks.py --dry-run): the same processes, commands, search and
files on the CPU with tiny models: no pinning, no fused AdamW, no autocast, no memory figures, and
set_per_process_memory_fraction stood in for by an emulated cap (a batch above the workload's dry
cap raises torch.OutOfMemoryError), so the search must find exactly that batch.
"""
import argparse
import gc
import glob
import json
import math
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bracket  # noqa: E402 - the one batch-size search, shared with tests/gpu/oom_check.py
GiB = 1 << 30

# name: the model, the throughput batch and window, the frontier's cap and steps. "dry" overrides
# for the CPU; dry_cap: the largest batch the emulated cap lets through.
WORKLOADS = {
    "gpt-small": dict(kind="gpt", layers=6, dim=384, heads=6, block=256, vocab=65, batch=32,
                      warm=5, steps=40, eval_every=20, eval_iters=4, cap_gib=2.0, f_steps=4,
                      dry=dict(layers=1, dim=32, heads=2, block=16, batch=4, warm=1, steps=3, eval_every=2,
                               eval_iters=1, f_steps=2, dry_cap=12)),
    "varlen-lm": dict(kind="varlen", layers=8, dim=1024, heads=16, block=1024, min_len=64, vocab=32000, batch=16,
                      warm=3, steps=10, cap_gib=9.0, f_steps=10,
                      dry=dict(layers=1, dim=32, heads=2, block=32, min_len=8, vocab=128, batch=8, warm=1, steps=3,
                               f_steps=5, dry_cap=20)),
    "gpt2-small": dict(kind="gpt", layers=12, dim=768, heads=12, block=1024, vocab=50304, batch=8,
                       warm=3, steps=10, eval_every=10, eval_iters=2, cap_gib=16.0, f_steps=4,
                       dry=dict(layers=2, dim=32, heads=2, block=32, vocab=128, batch=2, warm=1, steps=3,
                                eval_every=2, eval_iters=1, f_steps=2, dry_cap=6)),
    "vit": dict(kind="vit", layers=12, dim=384, heads=6, img=224, patch=16, classes=1000, batch=128,
                warm=3, steps=15, cap_gib=8.0, f_steps=4,
                dry=dict(layers=1, dim=32, heads=2, img=32, patch=8, classes=10, batch=4, warm=1, steps=3,
                         f_steps=2, dry_cap=10)),
    "hf-gpt2": dict(kind="hf", layers=6, dim=512, heads=8, block=512, vocab=8192, batch=16,
                    warm=3, steps=15, cap_gib=4.0, f_steps=4,
                    dry=dict(layers=1, dim=32, heads=2, block=32, vocab=128, batch=2, warm=1, steps=3,
                             f_steps=2, dry_cap=5)),
}
ALLOCATORS = ("native", "memshim", "expandable", "cudaMallocAsync")  # the order of each round


def spec_of(name, dry):
    s = {k: v for k, v in WORKLOADS[name].items() if k != "dry"}
    if dry:
        s.update(WORKLOADS[name]["dry"])
    return s


# ============================================================================ workloads (in a worker)

def _gpt_classes(torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, h, causal):
            super().__init__()
            self.h, self.causal = h, causal
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab, block, layers, d, h):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.blocks = nn.ModuleList(Block(d, h, True) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as GPT-2

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    class ViT(nn.Module):
        def __init__(self, img, patch, layers, d, h, classes):
            super().__init__()
            self.patch = nn.Conv2d(3, d, patch, patch)
            self.cls = nn.Parameter(torch.zeros(1, 1, d))
            self.pos = nn.Parameter(torch.zeros(1, (img // patch) ** 2 + 1, d))
            self.blocks = nn.ModuleList(Block(d, h, False) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

        def forward(self, x, y):
            p = self.patch(x).flatten(2).transpose(1, 2)
            p = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], 1) + self.pos
            for b in self.blocks:
                p = b(p)
            return F.cross_entropy(self.head(self.ln(p[:, 0])).float(), y)
    return GPT, ViT


class Loop:
    """The plain iteration loop of public training scripts, for the gpt, varlen and vit kinds."""

    def __init__(self, torch, spec, dry):
        self.torch, self.s, self.dry = torch, spec, dry
        self.dev = "cpu" if dry else "cuda"
        torch.manual_seed(0)
        GPT, ViT = _gpt_classes(torch)
        if spec["kind"] == "vit":
            self.model = ViT(spec["img"], spec["patch"], spec["layers"], spec["dim"], spec["heads"], spec["classes"])
        else:
            self.model = GPT(spec["vocab"], spec["block"], spec["layers"], spec["dim"], spec["heads"])
        self.model.to(self.dev)
        self.params = sum(p.numel() for p in self.model.parameters())
        fused = {} if dry else {"fused": True}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), **fused)
        # the token array a script memory-maps; batches are cut from it on the host
        self.data = torch.randint(0, spec.get("vocab", 2), (1 << 20,), dtype=torch.int64)
        self.images = None

    def autocast(self):
        import contextlib
        return contextlib.nullcontext() if self.dry else self.torch.autocast("cuda", dtype=self.torch.bfloat16)

    def to_dev(self, t):
        return t if self.dry else t.pin_memory().to(self.dev, non_blocking=True)

    def shape(self, batch, i):
        """(rows, tokens per row) of step i. The varlen LM's are drawn from a generator seeded by the
        step alone (issue 31): the length is the same for every batch and the rows a fraction
        (1/4..1) of it, rounded up, so a larger batch never needs less memory at any step and
        "fits" is monotone in the batch, which the frontier's bisection assumes."""
        s = self.s
        if s["kind"] == "varlen":
            if i % 5 == 4:
                return batch, s["block"]
            r = random.Random(1000003 + i)
            frac, T = r.uniform(0.25, 1.0), r.randint(s["min_len"], s["block"])
            return min(batch, max(1, batch // 4, math.ceil(frac * batch))), T
        if s["kind"] == "vit":
            return batch, (s["img"] // s["patch"]) ** 2 + 1
        return batch, s["block"]

    def get_batch(self, b, T, i):
        torch = self.torch
        if self.s["kind"] == "vit":
            if self.images is None or self.images.shape[0] < b:  # a loader's pinned staging area
                imgs = torch.randn(b, 3, self.s["img"], self.s["img"], generator=torch.Generator().manual_seed(b))
                self.images = imgs if self.dry else imgs.pin_memory()
            y = torch.randint(0, self.s["classes"], (b,), generator=torch.Generator().manual_seed(i))
            return self.images[:b].to(self.dev, non_blocking=not self.dry), self.to_dev(y)
        g = torch.Generator().manual_seed(i)
        ix = torch.randint(len(self.data) - T - 1, (b,), generator=g)
        x = torch.stack([self.data[j:j + T] for j in ix.tolist()])
        y = torch.stack([self.data[j + 1:j + 1 + T] for j in ix.tolist()])
        return self.to_dev(x), self.to_dev(y)

    def loss(self, x, y):
        with self.autocast():
            return self.model(x, y)

    def eval_pass(self):
        self.model.eval()
        with self.torch.no_grad():
            for k in range(self.s["eval_iters"]):
                b, T = self.shape(self.s["batch"], k)
                self.loss(*self.get_batch(b, T, 10 ** 6 + k))
        self.model.train()

    def train(self, batch, n, seed, mark):
        """n steps; mark(k) after k steps (mark(0) first). Returns the tokens of each step."""
        toks = []
        mark(0)
        for i in range(n):
            b, T = self.shape(batch, i)
            x, y = self.get_batch(b, T, seed * 7919 + i)
            loss = self.loss(x, y)
            loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            toks.append(b * T)
            if self.s.get("eval_every") and (i + 1) % self.s["eval_every"] == 0:
                self.eval_pass()
            mark(i + 1)
        return toks

    def drop(self):
        self.opt.zero_grad(set_to_none=True)


class HFLoop:
    """Hugging Face's Trainer on a GPT-2 built from a config: a new Trainer per call (each builds its
    optimizer, as a script calling trainer.train() does); steps are timed by a callback."""

    def __init__(self, torch, spec, dry):
        import transformers  # noqa: F401 - ImportError: the driver records the skip
        from transformers import GPT2Config, GPT2LMHeadModel
        self.torch, self.s, self.dry = torch, spec, dry
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=spec["layers"], n_embd=spec["dim"], n_head=spec["heads"],
                         n_positions=spec["block"], vocab_size=spec["vocab"])
        self.model = GPT2LMHeadModel(cfg).to("cpu" if dry else "cuda")
        self.params = sum(p.numel() for p in self.model.parameters())
        self.version = transformers.__version__
        self.tmp = tempfile.mkdtemp(prefix="memshim-hf-")

    def shape(self, batch, i):
        return batch, self.s["block"]

    def train(self, batch, n, seed, mark):
        import transformers
        torch, T, V = self.torch, self.s["block"], self.s["vocab"]

        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return batch * n

            def __getitem__(self, k):
                ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed * 7919 + k))
                return {"input_ids": ids, "labels": ids}

        class Timer(transformers.TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                mark(0)

            def on_step_end(self, args, state, control, **kw):
                mark(state.global_step)
        kw = dict(output_dir=self.tmp, per_device_train_batch_size=batch, max_steps=n, learning_rate=3e-4,
                  report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                  dataloader_num_workers=0, seed=seed)
        kw.update(use_cpu=True) if self.dry else kw.update(bf16=True)
        tr = transformers.Trainer(model=self.model, args=transformers.TrainingArguments(**kw),
                                  train_dataset=Tokens(), callbacks=[Timer()])
        try:
            tr.train()
        finally:
            tr.optimizer = tr.lr_scheduler = None
            del tr
        return [batch * T] * n

    def drop(self):
        self.model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- the worker's commands

class Worker:
    """One allocator's process: loads one workload after another (`load` frees the last one, its
    cache and its cap first) and runs the commands below on it."""

    def __init__(self, dry):
        import torch
        self.torch, self.dry = torch, dry
        if dry:
            torch.set_num_threads(1)  # several workers share the CPU machine's cores
        self.name = self.s = self.w = self.seen = None
        self.cap = None
        self.rdir = os.environ.get("MEMSHIM_REPORT_DIR")
        self.memshim = None
        if "libmemshim" in os.environ.get("LD_PRELOAD", ""):
            try:
                import memshim
                self.memshim = memshim
            except ImportError:
                pass

    def op_load(self, c):
        torch = self.torch
        if self.cap is not None:
            # issue 31: a cap is never taken back (set_per_process_memory_fraction(1.0) is a limit
            # of its own under memshim): the driver gives each frontier a fresh worker instead
            return {"error": "this worker ran a frontier under a cap: it loads nothing more"}
        self.w = None
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()
        self.name, self.s = c["workload"], spec_of(c["workload"], self.dry)
        try:
            self.w = (HFLoop if self.s["kind"] == "hf" else Loop)(torch, self.s, self.dry)
        except ImportError as e:
            return {"unavailable": f"{type(e).__name__}: {e}"}
        return {"params": self.w.params, "transformers": getattr(self.w, "version", None)}

    def sync(self):
        if not self.dry:
            self.torch.cuda.synchronize()

    def allocator(self):
        """What serves PyTorch's memory in this process, as seen from inside it."""
        if self.memshim is not None:
            from memshim import _torch as mt
            if mt.state.tensor:
                return "memshim"
            return "memshim-segment" if os.environ.get("MEMSHIM_MODE") == "segment" else "pytorch (memshim not in tensor mode)"
        if self.dry:
            return "cpu (dry run)"
        if self.seen:
            return self.seen
        try:
            be = self.torch.cuda.get_allocator_backend()
        except Exception:  # noqa: BLE001
            be = "native"
        if be != "native":
            return be
        try:  # PyTorch's segments say whether they are expandable (once it holds any)
            segs = self.torch.cuda.memory_snapshot()
        except Exception:  # noqa: BLE001
            segs = []
        if segs:
            self.seen = "expandable" if all(x.get("is_expandable") for x in segs) else \
                "native" if not any(x.get("is_expandable") for x in segs) else "native and expandable segments"
            return self.seen
        conf = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        return "expandable" if "expandable_segments:True" in conf else "native"

    def reset_peaks(self):
        if not self.dry:
            self.torch.cuda.reset_peak_memory_stats()

    def peaks(self):
        if self.dry:
            return {"peak_reserved": None, "peak_allocated": None}
        return {"peak_reserved": self.torch.cuda.max_memory_reserved(),
                "peak_allocated": self.torch.cuda.max_memory_allocated()}

    def report(self):
        """Close memshim's epoch and return the sections of its report (None without reports)."""
        if self.memshim is None:
            return None
        self.memshim.epoch()
        if not self.rdir:
            return None
        files = glob.glob(os.path.join(self.rdir, f"memshim-*-pid{os.getpid()}-*epoch*.json"))
        if not files:
            return None
        with open(max(files, key=os.path.getmtime)) as f:
            r = json.load(f)
        keep = ("memshim_overhead", "fragmentation", "steps", "epoch") if "memshim_overhead" in r else \
            ("driver", "latency", "fragmentation", "steps", "epoch")
        out = {k: r.get(k) for k in keep}
        out["allocs"] = (r.get("operations") or {}).get("allocs")
        out["t_span_s"] = (r.get("t_end_s") or 0) - (r.get("t_start_s") or 0)
        return out

    def timed(self, batch, warm, steps, seed, reports=False):
        """warm steps, then `steps` timed ones (synchronized at both ends). With reports, memshim's
        epoch is closed at both ends so that one report covers exactly the timed part."""
        marks, rep = {}, {}

        def mark(k):
            if k in (warm, warm + steps):
                self.sync()
                if reports and k == warm:
                    rep["before"] = self.report()
                marks[k] = time.perf_counter()
        toks = self.w.train(batch, warm + steps, seed, mark)
        if reports:
            rep["after"] = self.report()
        secs = marks[warm + steps] - marks[warm]
        n = sum(toks[warm:])
        out = {"batch": batch, "steps": steps, "tokens": n, "seconds": secs,
               "tokens_per_s": n / secs if secs > 0 else None, "ms_per_step": 1000 * secs / steps}
        a = rep.get("after")
        if a:
            b = rep.get("before") or {}
            if a.get("allocs") is not None and b.get("allocs") is not None:
                a["allocs_per_step"] = (a["allocs"] - b["allocs"]) / steps
            out["memshim_report"] = a
        return out

    def op_throughput(self, c):
        self.reset_peaks()
        r = self.timed(c["batch"], c["warm"], c["steps"], c.get("seed", 1), reports=c.get("reports", False))
        r.update(self.peaks())
        return r

    def op_stepfig(self, c):
        """STAlloc's figure through PyTorch's own API, the same for every allocator: `steps` steps
        (untimed) with the peaks read and reset after each; each step's peak allocated over its
        peak reserved, {min, median, max, steps}. None in a dry run (no CUDA memory figures)."""
        if self.dry:
            self.w.train(c["batch"], c["steps"], 5, lambda k: None)
            return {"step_allocated_over_reserved": None}
        torch, ratios = self.torch, []

        def mark(k):
            if k:
                a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
                if r:
                    ratios.append(a / r)
            torch.cuda.reset_peak_memory_stats()
        self.w.train(c["batch"], c["steps"], 5, mark)
        if not ratios:
            return {"step_allocated_over_reserved": None}
        return {"step_allocated_over_reserved": {"min": min(ratios), "median": statistics.median(ratios),
                                                 "max": max(ratios), "steps": len(ratios)}}

    def op_cap(self, c):
        self.w.drop()
        gc.collect()
        if self.dry:
            self.cap = c["bytes"]
            return {"fraction": None, "stood_in": "the dry run emulates the cap: batches above dry_cap raise OOM"}
        self.torch.cuda.empty_cache()
        total = self.torch.cuda.get_device_properties(0).total_memory
        frac = min(1.0, c["bytes"] / total)
        self.torch.cuda.set_per_process_memory_fraction(frac)
        self.cap = c["bytes"]
        return {"fraction": frac, "device_total": total}

    def op_fits(self, c):
        """Does `batch` complete c["steps"] steps under the cap? The first step is not timed."""
        torch, b = self.torch, c["batch"]
        oom = err = None
        r = {}
        if not self.dry:
            torch.cuda.empty_cache()
        self.reset_peaks()
        t0 = time.perf_counter()
        try:
            if self.dry and b > self.s["dry_cap"]:
                raise torch.OutOfMemoryError(f"CUDA out of memory. (dry run: batch {b} is above the emulated cap)")
            r = self.timed(b, 1, c["steps"] - 1, c.get("seed", 2))
        except torch.OutOfMemoryError as e:
            oom = str(e)[:300]
        except RuntimeError as e:
            if "out of memory" in str(e).lower():
                oom = str(e)[:300]
            else:
                err = f"{type(e).__name__}: {str(e)[:500]}"
        # outside the except blocks: the traceback (and the tensors its frames hold) is gone
        self.w.drop()
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()
        out = {"batch": b, "ok": oom is None and err is None, "oom": oom, "error": err,
               "trial_s": round(time.perf_counter() - t0, 3)}
        if out["ok"]:
            out.update(tokens_per_s=r["tokens_per_s"], ms_per_step=r["ms_per_step"], **self.peaks())
        return out

    def op_emptydel(self, c):
        """Issue 30: what `x = torch.empty(n); del x` costs from Python per pair, for a few sizes (the
        allocator's whole path as a script sees it: the op, PyTorch's allocator or the pluggable one,
        memshim's front end). The fastest of 5 loops of `calls` pairs after a warm loop."""
        torch = self.torch
        dev = "cpu" if self.dry else "cuda"
        out = {}
        for nbytes in c.get("sizes", (512, 65536, 4 << 20)):
            n = max(1, nbytes // 4)
            for _ in range(1000):
                x = torch.empty(n, dtype=torch.float32, device=dev)
                del x
            best = None
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(c.get("calls", 20000)):
                    x = torch.empty(n, dtype=torch.float32, device=dev)
                    del x
                dt = (time.perf_counter() - t0) / c.get("calls", 20000)
                best = dt if best is None else min(best, dt)
            out[str(nbytes)] = round(best * 1e6, 4)
        return {"us_per_pair": out, "device": dev}

    def op_profile(self, c):
        """CPU time per op over a few steps under torch.profiler (CPU activity only)."""
        from torch.profiler import ProfilerActivity, profile
        self.timed(c["batch"], 0, 1, 3)  # one step outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = self.timed(c["batch"], 0, c["steps"], 4)
        n = c["steps"]
        rows = [{"op": e.key, "calls_per_step": e.count / n, "self_cpu_us_per_step": e.self_cpu_time_total / n,
                 "cpu_us_per_step": e.cpu_time_total / n} for e in prof.key_averages()]
        rows.sort(key=lambda x: -x["self_cpu_us_per_step"])
        focus = [x for x in rows if x["op"] in FOCUS_OPS]
        return {"ms_per_step_profiled": r["ms_per_step"], "top": rows[:20], "focus": focus,
                "self_cpu_us_per_step_total": sum(x["self_cpu_us_per_step"] for x in rows)}


# Where an allocator's cost shows in a CPU profile: the allocation ops (the allocator runs inside
# them), and the copy and cast ops of autocast and host-to-device batches.
ALLOC_OPS = ("aten::empty_strided", "aten::empty", "aten::empty_like", "aten::resize_")
FOCUS_OPS = ALLOC_OPS + ("aten::copy_", "aten::_to_copy", "aten::to", "aten::pin_memory", "aten::_pin_memory")


def serve(dry):
    try:
        w = Worker(dry)
    except ImportError as e:
        print("READY", json.dumps({"unavailable": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print("READY", json.dumps({"torch": w.torch.__version__}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "exit":
            break
        try:
            res = getattr(w, "op_" + c["op"])(c)
        except Exception as e:  # noqa: BLE001 - a failed command is a result; the driver decides
            res = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        res["allocator_seen"] = w.allocator()
        print("RESULT", json.dumps(res), flush=True)


# ============================================================================ the driver

def lib_path():
    return os.path.join(ROOT, os.environ.get("BUILD", "build"), "libmemshim.so")


def alloc_env(allocator):
    e = {}
    if allocator == "expandable":
        e = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    elif allocator == "cudaMallocAsync":
        e = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}
    elif allocator in ("memshim", "memshim-segment"):
        e = {"LD_PRELOAD": lib_path()}
        if allocator == "memshim-segment":
            e["MEMSHIM_MODE"] = "segment"
    return e


class Proc:
    """One worker process: commands in on stdin, RESULT lines out through a reader thread."""

    def __init__(self, allocator, dry, out, extra=None, tag="bench"):
        self.allocator, self.dead, self.info = allocator, None, {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMSHIM_", "_MEMSHIM_"))
               and k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        env.update(alloc_env(allocator))
        env.update(extra or {})
        if dry:
            env["OMP_NUM_THREADS"] = "1"
        self.log_path = os.path.join(out, f"{tag}-{allocator}.log")
        self.log = open(self.log_path, "a")
        argv = [sys.executable, os.path.abspath(__file__), "serve"] + (["--dry-run"] if dry else [])
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=env, cwd=ROOT, start_new_session=True, bufsize=1)
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith(("RESULT ", "READY ")):
                self.q.put(line)
            else:
                self.log.write(line)
        self.q.put(None)

    def _get(self, timeout):
        try:
            line = self.q.get(timeout=max(1, timeout))
        except queue.Empty:
            self.kill(f"no answer within {timeout:.0f} s")
            return {"error": self.dead}
        if line is None:
            self.p.wait()
            self.dead = self.dead or f"worker exited (rc {self.p.returncode}); see {os.path.basename(self.log_path)}"
            return {"error": self.dead + self.tail()}
        return json.loads(line.split(" ", 1)[1])

    def tail(self):
        self.log.flush()
        try:
            with open(self.log_path) as f:
                return ": " + " | ".join(f.read()[-600:].strip().splitlines()[-4:])
        except OSError:
            return ""

    def ready(self, timeout):
        self.info = self._get(timeout)
        if "unavailable" in self.info:
            self.dead = self.info["unavailable"]
        elif "error" in self.info:
            self.dead = self.info["error"]
        return self.dead is None

    def send(self, cmd):
        if self.dead:
            return False
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
            return True
        except OSError as e:
            self.dead = f"worker gone ({e})"
            return False

    def ask(self, cmd, timeout):
        if not self.send(cmd):
            return {"error": self.dead}
        return self._get(timeout)

    def kill(self, why):
        self.dead = self.dead or why
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self):
        if self.p.poll() is None and not self.dead:
            try:
                self.p.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.p.stdin.flush()
                self.p.stdin.close()
            except OSError:
                pass

    def reap(self, deadline):
        try:
            self.p.wait(timeout=max(0.1, deadline - time.time()))  # memshim writes its summary at exit
        except subprocess.TimeoutExpired:
            self.kill("did not exit")
            self.p.wait()
        self.log.close()


def close_all(procs, wait_s=20):
    """Ask every worker to exit at once, then wait for them together."""
    for p in procs.values():
        p.close()
    deadline = time.time() + wait_s
    for p in procs.values():
        p.reap(deadline)


class _Stop(Exception):
    """The frontier search stops: the budget ran out, or the worker failed."""


def median(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


class Bench:
    def __init__(self, out, budget, dry):
        self.out, self.budget, self.dry, self.t0 = out, budget, dry, time.time()
        self.startup_s = 300 if dry else 150  # 2 shared cores import torch four times at once

    def left(self):
        return self.budget - (time.time() - self.t0)

    def start(self, allocators, extra=lambda a: None, tag="bench"):
        """One worker per allocator, started together; each answers READY once torch is imported."""
        procs = {a: Proc(a, self.dry, self.out, extra(a), tag) for a in allocators}
        for a, p in procs.items():
            p.ready(min(self.startup_s, max(5, self.left())))
        return procs

    def load(self, procs, workload):
        """Every live worker loads `workload` (in parallel); {allocator: its answer}."""
        sent = [a for a, p in procs.items() if p.send({"op": "load", "workload": workload})]
        res = {a: {"error": procs[a].dead} for a in procs if a not in sent}
        for a in sent:
            res[a] = procs[a]._get(min(self.startup_s, max(5, self.left())))
        return res

    def throughput(self, procs, s, rows, repeats=3, reports=False):
        """Rounds of one window per allocator, the order rotated each round (A B C D, B C D A,
        C D A B: no allocator always measures first or right after the same one): medians of
        `repeats` rounds."""
        per = {a: [] for a in procs}
        window_s = 60 if not self.dry else 120
        round_s = 0.0
        names = list(procs)
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)] if names else []
            # whole rounds only: every allocator gets as many windows as the others
            if self.left() < max(8.0, 1.2 * round_s):
                for a in procs:
                    rows[a].setdefault("notes", []).append(f"the budget ran out after {r} of {repeats} rounds")
                break
            t0 = time.time()
            for a in order:
                p = procs[a]
                if p.dead:
                    continue
                res = p.ask({"op": "throughput", "batch": s["batch"], "warm": s["warm"], "steps": s["steps"],
                             "seed": 1, "reports": reports}, min(window_s, max(5, self.left())))
                rows[a]["allocator_seen"] = res.get("allocator_seen", rows[a].get("allocator_seen"))
                if res.get("error"):
                    rows[a]["error"] = res["error"]
                    continue
                per[a].append(res)
            round_s = time.time() - t0
        for a, rs in per.items():
            row = rows[a]
            row["repeats"] = [{k: x.get(k) for k in ("tokens_per_s", "ms_per_step", "peak_reserved", "peak_allocated")}
                              for x in rs]
            row["tokens_per_s"] = median([x["tokens_per_s"] for x in rs])
            row["ms_per_step"] = median([x["ms_per_step"] for x in rs])
            row["peak_reserved"] = max((x["peak_reserved"] for x in rs if x["peak_reserved"] is not None), default=None)
            row["peak_allocated"] = max((x["peak_allocated"] for x in rs if x["peak_allocated"] is not None),
                                        default=None)
            if reports:
                row["memshim_report"] = [x.get("memshim_report") for x in rs]
        return per

    def frontier(self, p, s, row):
        """The largest batch that completes s["f_steps"] steps under the cap, bracketed by
        bracket.search (the OOM step's finder uses the same): from the throughput batch, doubling
        (or halving) until the answer changes, then bisection to 1/16 of the batch. `p` is a worker
        that ran nothing before (bench_workload starts one per frontier)."""
        cap = int(s["cap_gib"] * GiB)
        f = {"cap_bytes": cap, "parameter": "batch" if s["kind"] != "varlen" else "largest batch (B/4..B rows)",
             "steps": s["f_steps"], "largest": None, "first_failure": None, "trials": []}
        row["frontier"] = f
        if p.dead:
            f["skipped"] = p.dead
            return f
        t0 = time.time()
        c = p.ask({"op": "cap", "bytes": cap}, 60)
        if c.get("error"):
            f["error"] = c["error"]
            return f
        best = {}
        trial_s = 90 if not self.dry else 120

        def fits(b):
            if self.left() < 10:
                raise _Stop
            r = p.ask({"op": "fits", "batch": b, "steps": s["f_steps"]}, min(trial_s, max(5, self.left())))
            f["trials"].append([b, bool(r.get("ok")), r.get("trial_s")])
            if r.get("error"):
                f["error"] = r["error"]
                raise _Stop
            if r["ok"]:
                best[b] = r
            elif f.get("first_oom") is None:
                f["first_oom"] = r.get("oom")
            return r["ok"]
        br = bracket.Bracket()
        try:
            bracket.search(fits, s["batch"], resolution=16, grow_limit=64, into=br)
        except _Stop:
            if not f.get("error"):
                f["incomplete"] = "the budget ran out during the search: largest is a lower bound"
        lo, hi = br.largest, br.first_failure
        f.update(largest=lo or None, first_failure=hi, seconds=round(time.time() - t0, 1))
        if lo in best:
            f.update({k: best[lo].get(k) for k in ("tokens_per_s", "ms_per_step", "peak_reserved", "peak_allocated")})
        if hi is None and lo:
            f["note"] = f"completed up to {lo}, 64 times the throughput batch: no failure found"
        return f


def machine_facts(dry):
    d = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "dry_run": dry}
    try:
        d["commit"] = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        d["commit"] = None
    if not d["commit"]:  # a copied tree without .git: the commit --prepare recorded
        try:
            d["commit"] = json.load(open(os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                      "prepared.json")))["commit"][:12]
        except (OSError, ValueError, KeyError):
            pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        d["gpu"], d["driver"] = [x.strip() for x in smi[0].split(",")][:2]
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        d["gpu"] = d["driver"] = None
    return d


def gib(v):
    return "n/a" if v is None else f"{v / GiB:.2f}"


def num(v, fmt="{:.0f}"):
    return "n/a" if v is None else fmt.format(v)


# The order in which rows are worth the budget: the GPT loop's native vs memshim throughput, then
# the varlen LM (throughput, cheap, then its frontier), then everything else.
PLAN = ("gpt-small", "varlen-lm", "gpt2-small", "vit", "hf-gpt2")  # the rows' order
# The order the work is done in, and what each part needs on an H200 at least (load, windows,
# frontiers in fresh workers) to be begun at all: the GPT loop's throughput, the varlen LM's
# throughput and frontier, the GPT loop's frontier, then the rest.
PHASES = (("gpt-small", ("throughput",), 20), ("varlen-lm", ("throughput", "frontier"), 45),
          ("gpt-small", ("frontier",), 15), ("gpt2-small", ("throughput", "frontier"), 45),
          ("vit", ("throughput", "frontier"), 40), ("hf-gpt2", ("throughput", "frontier"), 60))


def bench(out, budget, dry, only=None):
    os.makedirs(out, exist_ok=True)
    B = Bench(out, budget, dry)
    res = {**machine_facts(dry), "budget_s": budget, "seconds": None, "rows": [],
           "workloads": {n: spec_of(n, dry) for n in PLAN},
           "notes": ["throughput: medians of 3 interleaved windows (one per allocator per round, the order rotated "
                     "each round), warm-up steps excluded; "
                     "peaks are the windows' highest", "frontier: one cap per workload "
                     "(set_per_process_memory_fraction, the same for all four; cudaMallocAsync counts allocated "
                     "bytes against it, not reserved); tokens/s there excludes each trial's first step",
                     "step_allocated_over_reserved: STAlloc's figure through PyTorch's memory API for every "
                     "allocator, one untimed window after the throughput rounds, peaks read and reset after each "
                     "step; peak_allocated_over_peak_reserved: the throughput windows' peaks",
                     "one throughput worker per allocator loads each workload in turn (the last one and its "
                     "cache freed first; never capped); each frontier runs in a fresh worker that exits after "
                     "it; a worker that died is started again for the next workload",
                     "frontier: the bracket, largest batch that fits / first that fails (tests/gpu/bracket.py)"]}
    rows = {}
    for name in PLAN:
        cap = int(spec_of(name, dry)["cap_gib"] * GiB)
        for a in ALLOCATORS:
            rows[name, a] = {"workload": name, "allocator": a, "tokens_per_s": None, "ms_per_step": None,
                             "peak_reserved": None, "peak_allocated": None, "frontier": {"cap_bytes": cap, "largest": None}}
    res["rows"] = list(rows.values())
    procs = {}
    try:
        for name, parts, need in PHASES:
            wrows = {a: rows[name, a] for a in ALLOCATORS}
            if only and name not in only:
                for r in wrows.values():
                    r["skipped"] = "not selected (--only)"
                continue
            if B.left() < need * (0 if dry else 1) or B.left() < 10:
                why = (f"the budget ({budget:.0f} s) ran out: {max(0, B.left()):.0f} s left, "
                       f"{' and '.join(parts)} needs ~{need} s")
                for r in wrows.values():
                    if "throughput" in parts:
                        r.setdefault("skipped", why)
                    r["frontier"].setdefault("skipped", why)
                continue
            t0 = time.time()
            try:
                bench_workload(B, procs, name, wrows, parts)
            except Exception as e:  # noqa: BLE001 - the file is written whatever happens; the row says why
                for r in wrows.values():
                    r.setdefault("error", f"bench: {type(e).__name__}: {e}")
            print(f"bench: {name} ({', '.join(parts)}): {time.time() - t0:.1f} s; " + "; ".join(
                f"{a} {num(wrows[a]['tokens_per_s'])} tok/s, largest {wrows[a]['frontier'].get('largest')}"
                for a in ALLOCATORS), flush=True)
    finally:
        close_all(procs)
        res["seconds"] = round(time.time() - B.t0, 1)
        with open(os.path.join(out, "gpu-bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out, "gpu-bench.md"), "w") as f:
            f.write(bench_markdown(res))
    return res


def bench_workload(B, procs, name, wrows, parts=("throughput", "frontier")):
    """One workload under every allocator: (re)start the workers that are not alive, load it, then
    its parts: throughput rounds and STAlloc's figure; each allocator's frontier (native and
    memshim first)."""
    s = spec_of(name, B.dry)
    dead = [a for a in ALLOCATORS if a not in procs or procs[a].dead]
    for a in dead:
        if a in procs:
            close_all({a: procs[a]}, 5)
    procs.update(B.start(dead, lambda a: {"MEMSHIM_REPORT_DIR": os.path.join(B.out, "memreport-bench")}
                         if a == "memshim" else None))
    for a, r in B.load(procs, name).items():
        p = procs[a]
        wrows[a]["worker"] = {"torch": p.info.get("torch"), **{k: r.get(k) for k in ("params", "transformers")}}
        if r.get("unavailable"):
            wrows[a]["skipped"] = r["unavailable"]
        elif r.get("error") or p.dead:
            wrows[a]["error"] = r.get("error") or p.dead
    live = {a: procs[a] for a in ALLOCATORS if not wrows[a].get("skipped") and not wrows[a].get("error")}
    for a in ALLOCATORS:
        if a not in live and "frontier" in parts:
            wrows[a]["frontier"].setdefault("skipped", wrows[a].get("skipped") or wrows[a].get("error"))
    if not live:
        return
    if "throughput" in parts:
        throughput_part(B, live, s, wrows)
    if "frontier" in parts:
        frontier_part(B, name, s, wrows, list(live))
    for a in live:
        seen = wrows[a].get("allocator_seen")
        # on the CPU memshim is loaded but PyTorch never asks it for memory (no CUDA)
        want = seen if B.dry and a == "memshim" else "cpu (dry run)" if B.dry else a
        if seen is not None and seen != want and not wrows[a].get("error"):
            wrows[a]["error"] = f"the worker's allocator is {seen!r}, not {want!r}"


def frontier_part(B, name, s, wrows, allocators):
    """Each allocator's frontier in a worker of its own, started for it (together, before any
    trial) and ended after it: a cap set there, its cache and whatever the trials left (an OOM's
    cleanup, fragments) die with the process, so no frontier changes another measurement (issue
    31: `set_per_process_memory_fraction(1.0)` was the way back, and under memshim it is a limit of
    its own). The throughput workers are never capped."""
    if B.left() < 10:
        for a in allocators:
            wrows[a]["frontier"]["skipped"] = f"the budget ({B.budget:.0f} s) ran out"
        return
    fresh = B.start(allocators, lambda a: {"MEMSHIM_REPORT_DIR": os.path.join(B.out, "memreport-frontier")}
                    if a == "memshim" else None, tag="frontier")
    try:
        loaded = B.load(fresh, name)
        for a in allocators:
            f = wrows[a]["frontier"]
            if loaded[a].get("error") or loaded[a].get("unavailable") or fresh[a].dead:
                f["error"] = loaded[a].get("error") or loaded[a].get("unavailable") or fresh[a].dead
                wrows[a]["error"] = f"frontier worker: {f['error']}"
                continue
            if B.left() < 10:
                f["skipped"] = f"the budget ({B.budget:.0f} s) ran out"
                continue
            B.frontier(fresh[a], s, wrows[a])
            wrows[a]["frontier"]["worker"] = "fresh"
            if wrows[a]["frontier"].get("error"):
                wrows[a]["error"] = wrows[a]["frontier"]["error"]
            seen = loaded[a].get("allocator_seen")
            want = seen if B.dry and a == "memshim" else "cpu (dry run)" if B.dry else a
            if seen is not None and seen != want and not wrows[a].get("error"):
                wrows[a]["error"] = f"the frontier worker's allocator is {seen!r}, not {want!r}"
    finally:
        close_all(fresh, 10)


def throughput_part(B, live, s, wrows):
    """Throughput rounds, then one untimed window each for STAlloc's per-step figure."""
    B.throughput(live, s, wrows)
    for a, p in live.items():
        if B.left() < 10:
            break
        r = p.ask({"op": "stepfig", "batch": s["batch"], "steps": s["warm"] + s["steps"]}, 120)
        if r.get("error"):
            wrows[a]["error"] = r["error"]
        wrows[a]["step_allocated_over_reserved"] = r.get("step_allocated_over_reserved")
        pa, pr = wrows[a].get("peak_allocated"), wrows[a].get("peak_reserved")
        wrows[a]["peak_allocated_over_peak_reserved"] = pa / pr if pa is not None and pr else None


def bench_markdown(res):
    head = (f"GPU benchmark{' (dry run: CPU, tiny models, no memory figures)' if res['dry_run'] else ''}: "
            f"{res['date_utc']} UTC, {res.get('gpu') or 'no GPU'}, driver {res.get('driver') or 'n/a'}, "
            f"PyTorch {next((r['worker'].get('torch') for r in res['rows'] if (r.get('worker') or {}).get('torch')), 'n/a')}, "
            f"commit {res.get('commit') or 'n/a'}; {res['seconds']} s of a {res['budget_s']:.0f} s budget.\n\n")
    lines = ["| workload | allocator | tokens/s | ms/step | peak reserved GiB | peak allocated GiB | step alloc/resv "
             "min/median/max | cap GiB | batch: largest fits / first fails | tokens/s there | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        f = r.get("frontier") or {}
        lgs = bracket_text(f)
        note = r.get("skipped") or r.get("error") or f.get("skipped") or f.get("note") or ""
        lines.append(f"| {r['workload']} | {r['allocator']} | {num(r['tokens_per_s'])} | "
                     f"{num(r['ms_per_step'], '{:.1f}')} | {gib(r['peak_reserved'])} | {gib(r['peak_allocated'])} | "
                     f"{stepfig_text(r.get('step_allocated_over_reserved'))} | {gib(f.get('cap_bytes'))} | {lgs} | {num(f.get('tokens_per_s'))} | "
                     f"{str(note).replace('|', '/')[:160]} |")
    return head + "\n".join(lines) + "\n"


def bracket_text(f):
    """The frontier as its bracket, "largest fits / first fails" (issue 31): "24 / 26"; "0 / 1" when
    not even batch 1 fits; "2048 / none" when nothing failed up to the search's bound; "n/a"
    without a search; "(lower bound)" when the budget stopped it."""
    lg, ff = f.get("largest"), f.get("first_failure")
    if lg is None and ff is None:
        return "n/a"
    return f"{lg or 0} / {'none' if ff is None else ff}" + (" (lower bound)" if f.get("incomplete") else "")


def budget_limited(r):
    """The row, its windows or its frontier were cut short by the budget (said in the row)."""
    f = r.get("frontier") or {}
    return any("budget" in str(x or "") for x in (r.get("skipped"), " ".join(r.get("notes") or []),
                                                   f.get("skipped"), f.get("incomplete")))


def stepfig_text(sr):
    return "n/a" if not sr else "/".join(f"{sr[q]:.3f}" for q in ("min", "median", "max"))


def check_bench(res, dry):
    """The run's own verdict: every row present; no worker error; no row, round of windows or
    frontier cut short by the budget (issue 31: an incomplete table is never a pass; the bench runs
    alone with a budget that lets it finish, docs/benchmarks.md); in a dry run every row measured
    and every frontier exactly at its emulated cap (the search is exact there)."""
    bad = []
    want = {(w, a) for w in PLAN for a in ALLOCATORS}
    have = {(r["workload"], r["allocator"]) for r in res["rows"]}
    if want != have:
        bad.append(f"rows missing: {sorted(want - have)}")
    for r in res["rows"]:
        who = f"{r['workload']}/{r['allocator']}"
        if r.get("error"):
            bad.append(f"{who}: {r['error']}")
        if budget_limited(r):
            f = r.get("frontier") or {}
            bad.append(f"{who}: cut short by the budget ({r.get('skipped') or '; '.join(r.get('notes') or []) or f.get('skipped') or f.get('incomplete')})")
        elif dry and not r.get("skipped"):
            if not (r["tokens_per_s"] or 0) > 0 or len(r.get("repeats") or []) != 3:
                bad.append(f"{who}: no throughput from 3 windows")
            exp = WORKLOADS[r["workload"]]["dry"]["dry_cap"]
            if r["frontier"].get("largest") != exp or r["frontier"].get("first_failure") != exp + 1:
                bad.append(f"{who}: frontier {r['frontier'].get('largest')}/{r['frontier'].get('first_failure')}, "
                           f"expected {exp}/{exp + 1}")
    return bad


# ---------------------------------------------------------------------------- the gpt step

def gpt(out, budget, dry):
    """The GPT loop natively, in tensor mode and in segment mode (rounds N T S, 3 repeats), memshim's
    report of each timed window, then a CPU profile natively and in tensor mode."""
    os.makedirs(out, exist_ok=True)
    B = Bench(out, budget, dry)
    s = spec_of("gpt-small", dry)
    modes = ("native", "memshim", "memshim-segment")
    rows = {a: {"workload": "gpt-small", "allocator": a, "tokens_per_s": None, "ms_per_step": None} for a in modes}
    rdir = {"memshim": os.path.join(out, "memreport-gpt-tensor"), "memshim-segment": os.path.join(out, "memreport-gpt-segment")}
    procs = B.start(modes, lambda a: {"MEMSHIM_REPORT_DIR": rdir[a], "MEMSHIM_LOG": "info"} if a in rdir else None,
                    tag="gpt")
    prof = {}
    try:
        for a, r in B.load(procs, "gpt-small").items():
            if r.get("error") or procs[a].dead:
                rows[a]["error"] = r.get("error") or procs[a].dead
        B.throughput(procs, s, rows, reports=True)
        for a in ("native", "memshim"):  # issue 30: torch.empty + del, natively and in tensor mode
            if B.left() >= 20 and not procs[a].dead:
                rows[a]["empty_del"] = procs[a].ask({"op": "emptydel", "calls": 2000 if dry else 20000},
                                                    min(60, max(5, B.left())))
        for a in ("native", "memshim"):
            if B.left() < 10:
                prof[a] = {"skipped": "the budget ran out"}
                continue
            prof[a] = procs[a].ask({"op": "profile", "batch": s["batch"], "steps": 3 if dry else 10},
                                   min(120, max(5, B.left())))
    finally:
        close_all(procs)
    res = {**machine_facts(dry), "budget_s": budget, "seconds": round(time.time() - B.t0, 1),
           "workload": {k: v for k, v in s.items()}, "rows": list(rows.values()), "profile": prof,
           "split": split_cost(rows, prof)}
    with open(os.path.join(out, "gpu-gpt.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "gpu-gpt.md"), "w") as f:
        f.write(gpt_markdown(res))
    return res


def split_cost(rows, prof):
    """Where memshim's extra time per step goes: tensor mode minus native (all of it), segment mode
    minus native (memshim loaded, PyTorch allocating: hooks, start-up, epochs), the allocation ops'
    CPU self time in the profiles (tensor minus native: the tensor-mode path, PyTorch's pluggable
    allocator plus memshim), and memshim's own time on its paths from its report."""
    ms = {a: rows[a].get("ms_per_step") for a in rows}
    d = {"ms_per_step": ms}
    if ms.get("native") and ms.get("memshim"):
        d["tensor_minus_native_ms"] = ms["memshim"] - ms["native"]
        d["tensor_overhead"] = ms["memshim"] / ms["native"] - 1
    if ms.get("native") and ms.get("memshim-segment"):
        d["segment_minus_native_ms"] = ms["memshim-segment"] - ms["native"]
    pa = {a: {x["op"]: x for x in (prof.get(a) or {}).get("top", []) + (prof.get(a) or {}).get("focus", [])}
          for a in ("native", "memshim")}
    if all(pa.values()):
        alloc = {a: sum(pa[a][o]["self_cpu_us_per_step"] for o in ALLOC_OPS if o in pa[a]) for a in pa}
        d["alloc_ops_self_cpu_us_per_step"] = alloc
        d["alloc_ops_minus_native_ms"] = (alloc["memshim"] - alloc["native"]) / 1000
        tot = {a: (prof[a] or {}).get("self_cpu_us_per_step_total") for a in pa}
        if all(tot.values()):
            d["other_ops_minus_native_ms"] = ((tot["memshim"] - alloc["memshim"]) - (tot["native"] - alloc["native"])) / 1000
    reps = [r for r in (rows["memshim"].get("memshim_report") or []) if r]
    if reps:
        d["memshim_report_windows"] = len(reps)
    return d


def gpt_markdown(res):
    lines = [f"GPT loop (gpt-small){' (dry run)' if res['dry_run'] else ''}: {res['date_utc']} UTC, "
             f"{res.get('gpu') or 'no GPU'}, commit {res.get('commit') or 'n/a'}", "",
             "| allocator | tokens/s | ms/step | repeats (ms/step) |", "|---|---:|---:|---|"]
    for r in res["rows"]:
        reps = ", ".join(num(x.get("ms_per_step"), "{:.2f}") for x in r.get("repeats") or [])
        lines.append(f"| {r['allocator']} | {num(r['tokens_per_s'])} | {num(r['ms_per_step'], '{:.2f}')} | "
                     f"{reps or r.get('error', '')} |")
    sp = res["split"]
    lines += ["", "split: " + json.dumps({k: v for k, v in sp.items() if k != "ms_per_step"}), ""]
    ed = {r["allocator"]: (r.get("empty_del") or {}).get("us_per_pair") for r in res["rows"]}
    if ed.get("native") and ed.get("memshim"):  # issue 30: within 0.1 us of native is the target
        lines.append("torch.empty + del per pair (us, fastest of 5 loops): " + "; ".join(
            f"{k} B: native {ed['native'][k]:.3f}, tensor mode {ed['memshim'][k]:.3f} "
            f"({ed['memshim'][k] - ed['native'][k]:+.3f})" for k in ed["native"] if k in ed["memshim"]))
        lines.append("")
    for r in res["rows"]:  # issue 24: what memshim says it cost, per timed window
        for i, rep in enumerate(r.get("memshim_report") or []):
            o = (rep or {}).get("memshim_overhead")
            if not o:
                continue
            top = sorted((o.get("driver_calls") or {}).items(), key=lambda kv: -kv[1]["seconds"])[:3]
            calls = ", ".join(f"{k} {v['count']} x {v['seconds'] * 1e3:.2f} ms" for k, v in top) or "none"
            sync = sum(v["count"] for v in (o.get("synchronizes") or {}).values())
            share = o.get("share_of_wall")
            lines.append(f"memshim_overhead {r['allocator']} window {i + 1}: driver {calls}; synchronizes {sync}; "
                         f"alloc p50/p99 {(o.get('alloc_path_ns') or {}).get('p50')}/"
                         f"{(o.get('alloc_path_ns') or {}).get('p99')} ns; share of wall "
                         f"{'n/a' if share is None else f'{share * 100:.2f}%'}")
    lines.append("")
    for a, p in res["profile"].items():
        if not p or p.get("error") or p.get("skipped"):
            lines.append(f"profile {a}: {p and (p.get('error') or p.get('skipped'))}")
            continue
        lines += [f"profile {a} (CPU self time per step, top ops):", "", "| op | calls/step | self us/step | us/step |",
                  "|---|---:|---:|---:|"]
        for x in p["top"][:12]:
            lines.append(f"| {x['op']} | {x['calls_per_step']:.1f} | {x['self_cpu_us_per_step']:.0f} | "
                         f"{x['cpu_us_per_step']:.0f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def check_gpt(res, dry):
    bad = []
    for r in res["rows"]:
        if r.get("error"):
            bad.append(f"{r['allocator']}: {r['error']}")
        elif len(r.get("repeats") or []) != 3 or not (r.get("tokens_per_s") or 0) > 0:
            bad.append(f"{r['allocator']}: no throughput from 3 windows")
    for a, p in res["profile"].items():
        if not p or p.get("error") or not p.get("top"):
            bad.append(f"profile {a}: {p and (p.get('error') or p.get('skipped'))}")
    if not dry:
        for r in res["rows"]:
            if r["allocator"] != "native" and not all(r.get("memshim_report") or [None]):
                bad.append(f"{r['allocator']}: no memshim report for a timed window")
    return bad


def main():
    ap = argparse.ArgumentParser(prog="bench_workloads.py")
    ap.add_argument("what", choices=("bench", "gpt", "serve"))
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--budget", type=float, default=240)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", help="bench: these workloads only (comma-separated); the others' rows say so")
    a = ap.parse_args()
    if a.what == "serve":
        serve(a.dry_run)
        return 0
    out = os.path.abspath(a.out)
    if a.what == "bench":
        only = set(a.only.split(",")) if a.only else None
        if only and only - set(WORKLOADS):
            ap.error(f"--only: unknown workload(s) {', '.join(sorted(only - set(WORKLOADS)))}")
        res = bench(out, a.budget, a.dry_run, only)
        bad = check_bench(res, a.dry_run)
    else:
        res = gpt(out, a.budget, a.dry_run)
        bad = check_gpt(res, a.dry_run)
    for b in bad:
        print(f"FAIL {b}")
    cut = [f"{r['workload']}/{r['allocator']}" for r in res["rows"] if budget_limited(r)]
    if cut:
        print(f"cut short by the budget ({a.budget:.0f} s): {', '.join(cut)}")
    print(f"{a.what}: {res['seconds']} s; {'ok' if not bad else f'{len(bad)} problem(s)'}; "
          f"{os.path.join(out, 'gpu-' + a.what + '.json')}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
