#!/usr/bin/env python3
"""Impossible requests and batch-size finders on a GPU, natively and under memshim (issue 25; the
GPU check's `oom` step, tests/gpu/gpu_checks.py). Under a minute on an H200.

Each mode runs in its own process (`--worker MODE`): natively (PyTorch's caching allocator), and
under memshim in tensor mode with LD_PRELOAD alone, as tests/gpu/test_torch.py runs it. In each:
  - `torch.empty` of twice the device, then of the device's free memory + 4 GiB: the time to
    torch.OutOfMemoryError and the card's used memory meanwhile (before issue 25, under memshim:
    20 s and the whole card for the first, 10.8 s for the second; natively 28 ms);
  - a hand-written batch-size finder on a small MLP (forward and backward in bf16): doubles the
    batch until torch.OutOfMemoryError, then bisects to within 1/32 (tests/gpu/bracket.py's
    search, the one the GPU bench's frontier uses); each OOM is followed by gc.collect() and
    torch.cuda.empty_cache(), as finders do;
  - accelerate's find_executable_batch_size over the same step, if accelerate imports.
`nvidia-smi --query-gpu=memory.used -lms 50` samples the card's used memory in a thread all along;
each phase records its time, its answer and the most the card used during it.

--dry-run (make check, tests/gpu/run_gpu_checks.sh --dry-run): on the CUDA driver double and the
CPU, memshim only: the same requests through memshim_malloc (the entry point PyTorch's
pluggable allocator calls) on the double's device, the finder over the same entry point, the
double's own device charge sampled instead of nvidia-smi (and its exact peak around each refused
request), so the plumbing cannot fail on the GPU on a typo and the refusals' cost is checked.

Writes everything to --json PATH (default $OUT/oom-check.json). Exit 0 when the checks held:
under memshim each impossible request was refused within 1 s and the card's used memory never
rose by more than 1 GiB meanwhile; on a GPU the finder's answer under memshim is at least 95% of the
native one (larger is memshim fitting more: the finder ran a step at it). Prints "N passed, N failed, N skipped"."""
import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pyharness import BUILD, case, finish, skip  # noqa: E402
import bracket  # noqa: E402 - the one batch-size search, shared with the bench's frontier

LIB = os.path.abspath(os.path.join(BUILD, "libmemshim.so"))
GiB, MiB = 1 << 30, 1 << 20


# ============================================================================== sampling the card
class Sampler:
    """The card's used memory over time: nvidia-smi's own loop on a GPU; in a dry run the double's
    device charge, read every 50 ms."""

    def __init__(self, dry):
        self.samples, self.stop, self.proc = [], threading.Event(), None
        if dry:
            dbl = ctypes.CDLL("libcuda.so.1")
            f = dbl.cudbl_device_mark_peak
            f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_size_t
            self.read = lambda: (lambda u: (f(0, 0, ctypes.byref(u)), u.value)[1])(ctypes.c_size_t(0))
            self.thread = threading.Thread(target=self._poll, daemon=True)
        else:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-i", "0", "-lms", "50"], stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self._lines, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), self.read()))
            time.sleep(0.05)

    def _lines(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.monotonic(), int(line.strip()) * MiB))
            except ValueError:
                pass

    def during(self, t0, t1):
        v = [b for t, b in self.samples if t0 <= t <= t1 + 0.06]
        return max(v) if v else None

    def close(self):
        self.stop.set()
        if self.proc:
            self.proc.terminate()


# ================================================================================== the finder
def hand_finder(fits, start):
    """The hand-written batch-size finder: the batch doubled from `start` until it fails, then
    bisected to within 1/32 (as finders do), through bracket.search, the search the GPU bench's
    frontier uses (issue 31: one bisection for both). {answer, bracket}."""
    b = bracket.search(fits, start, resolution=32, grow_limit=None)
    return {"answer": b.largest, "first_failure": b.first_failure}


# ================================================================================== the worker
def worker(mode, dry):
    import torch
    out = {"mode": mode}
    sampler = Sampler(dry)
    time.sleep(0.2)

    def phase(name, fn):
        gc.collect()
        base = sampler.samples[-1][1] if sampler.samples else None
        t0 = time.monotonic()
        r = fn()
        t1 = time.monotonic()
        time.sleep(0.12)  # one more sample after it
        peak = sampler.during(t0, t1)
        r.update(seconds=round(t1 - t0, 4), used_before_bytes=base, used_max_bytes=peak,
                 rise_bytes=None if base is None or peak is None else max(0, peak - base))
        out[name] = r

    if dry:
        # memshim_malloc: the tensor-mode entry point, on the double's device
        m = ctypes.CDLL(None)
        m.memshim_malloc.restype = ctypes.c_void_p
        m.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        m.memshim_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        dbl = ctypes.CDLL("libcuda.so.1")
        dbl.cudbl_call_count.argtypes, dbl.cudbl_call_count.restype = [ctypes.c_char_p], ctypes.c_long
        f = dbl.cudbl_device_mark_peak
        f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_size_t
        warm = m.memshim_malloc(64 * MiB, 0, None)  # memshim's first call starts the pool
        ctx = ctypes.c_void_p()  # this thread's context, for cuMemGetInfo
        dbl.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
        dbl.cuCtxSetCurrent(ctx)

        def info():
            fr, tot = ctypes.c_size_t(0), ctypes.c_size_t(0)
            dbl.cuMemGetInfo_v2(ctypes.byref(fr), ctypes.byref(tot))
            return fr.value, tot.value
        total = info()[1]

        def free_now():
            return info()[0]

        def try_empty(n):
            used = ctypes.c_size_t(0)
            f(0, 1, ctypes.byref(used))
            c0 = dbl.cudbl_call_count(b"cuMemCreate")
            p = m.memshim_malloc(n, 0, None)
            if p:
                m.memshim_free(p, n, 0, None)
            return {"requested_bytes": n, "oom": not p, "creates": dbl.cudbl_call_count(b"cuMemCreate") - c0,
                    "exact_rise_bytes": max(0, f(0, 1, None) - used.value)}

        def step(b):
            p = m.memshim_malloc(b * 24 * MiB, 0, None)
            if not p:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b * 24} MiB (dry run)")
            m.memshim_free(p, b * 24 * MiB, 0, None)
        start = 16
    else:
        torch.cuda.init()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.empty(1, device="cuda")

        def free_now():
            return torch.cuda.mem_get_info()[0]

        def try_empty(n):
            try:
                x = torch.empty(n, dtype=torch.uint8, device="cuda")
                del x
                return {"requested_bytes": n, "oom": False}
            except torch.OutOfMemoryError as e:
                return {"requested_bytes": n, "oom": True, "message": str(e)[:600]}

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).to("cuda", torch.bfloat16)

        def step(b):
            x = torch.randn(b, 1024, device="cuda", dtype=torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        start = 4096
    out["device_total_bytes"] = total

    phase("twice_the_device", lambda: try_empty(2 * total))
    phase("free_plus_4g", lambda: try_empty(free_now() + 4 * GiB))

    probes = []

    def fits(b):
        """One probe: [batch, served, seconds to the step's end or to the OOM], then the finder's
        own clean-up after an OOM (not timed)."""
        t = time.monotonic()
        try:
            step(b)
            probes.append([b, True, round(time.monotonic() - t, 4)])
            return True
        except torch.OutOfMemoryError:
            probes.append([b, False, round(time.monotonic() - t, 4)])
            gc.collect()
            if not dry:
                torch.cuda.empty_cache()
            return False

    phase("hand_finder", lambda: dict(hand_finder(fits, start), probes=probes[:]))

    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError as e:
        out["accelerate"] = {"skipped": str(e)[:200]}
    else:
        # start where the hand-written finder saw its first refusal: a few refusals, then a fit
        first = next((b for b, ok, _ in out["hand_finder"]["probes"] if not ok), start)
        del probes[:]

        @find_executable_batch_size(starting_batch_size=first)
        def train(batch_size):
            t = time.monotonic()
            try:
                step(batch_size)
                probes.append([batch_size, True, round(time.monotonic() - t, 4)])
            except torch.OutOfMemoryError:
                probes.append([batch_size, False, round(time.monotonic() - t, 4)])
                raise
            return batch_size
        phase("accelerate", lambda: {"answer": train(), "probes": probes[:]})
    sampler.close()
    if dry:
        m.memshim_free(warm, 64 * MiB, 0, None)
    print("RESULT", json.dumps(out), flush=True)


# ==================================================================================== the driver
def run_worker(mode, dry, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and k != "LD_PRELOAD"}
    if mode == "memshim":
        env["LD_PRELOAD"] = LIB
    argv = [sys.executable, os.path.abspath(__file__), "--worker", mode] + (["--dry-run"] if dry else [])
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), p.stderr[-1500:]
    return None, f"rc={p.returncode}\n{p.stdout[-800:]}\n{p.stderr[-2000:]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--budget", type=float, default=55.0)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.dry_run)
    t0 = time.time()
    path = a.json or os.path.join(os.environ.get("OUT", "."), "oom-check.json")
    rep = {"dry_run": a.dry_run, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "library": LIB}
    modes = ("memshim",) if a.dry_run else ("native", "memshim")
    for mode in modes:
        left = a.budget - (time.time() - t0)
        if left < 8:
            skip(f"{mode}: the budget is spent", f"{a.budget:.0f} s")
            continue
        r, why = run_worker(mode, a.dry_run, left / (len(modes) - modes.index(mode)) if mode == "native" else left)
        rep[mode] = r if r is not None else {"error": why}
        case(f"{mode}: the worker completed", r is not None, why)
    if a.dry_run:
        skip("native: PyTorch's own allocator", "no GPU (dry run: the driver double)")
    ms, nat = rep.get("memshim") or {}, rep.get("native") or {}
    for name, before in (("twice_the_device", "20 s and the whole card"), ("free_plus_4g", "10.8 s")):
        r = ms.get(name)
        if not r:
            continue
        rise = r.get("exact_rise_bytes", r.get("rise_bytes"))
        native = (nat.get(name) or {}).get("seconds")
        case(f"memshim: {name} refused in {r['seconds'] * 1e3:.1f} ms ("
             + (f"native {native * 1e3:.1f} ms; " if native is not None else "") + f"before issue 25: {before}), the "
             f"card rising {0 if rise is None else rise / MiB:.0f} MiB meanwhile",
             r["oom"] and r["seconds"] < 1.0 and (rise is None or rise <= GiB) and r.get("creates", 0) == 0, r)
    h = ms.get("hand_finder")
    if h:
        refused = [p for p in h["probes"] if not p[1]]
        case(f"memshim: the hand-written finder found {h['answer']} in {h['seconds']:.2f} s, its {len(refused)} "
             f"refusals at most {max((p[2] for p in refused), default=0) * 1e3:.0f} ms each",
             h["answer"] > 0 and refused, h)
    if not a.dry_run and h and nat.get("hand_finder"):
        n = nat["hand_finder"]["answer"]
        # One-sided: memshim must not make a finder settle for less (a refusal it should not
        # make, a rescue that fails). A larger answer is memshim fitting more, and it is real: the
        # finder ran a whole step at that batch (H200, 2026-12-06: 3,801,088 against 3,145,728).
        ran = any(p[0] == h["answer"] and p[1] for p in h["probes"])
        case(f"the finder's answer under memshim ({h['answer']}, {h['answer'] / n if n else 0:.3f}x the native "
             f"{n}) is at least 95% of the native one, and a step at it ran",
             n > 0 and h["answer"] >= 0.95 * n and ran, (h, nat["hand_finder"]))
    if "answer" in (ms.get("accelerate") or {}):
        case(f"accelerate's find_executable_batch_size under memshim: {ms['accelerate']['answer']} "
             f"(native {(nat.get('accelerate') or {}).get('answer')})", ms["accelerate"]["answer"] > 0, ms["accelerate"])
    rep["total_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"oom-check: {rep['total_s']} s; results in {path}")
    finish()


if __name__ == "__main__":
    sys.exit(main())
