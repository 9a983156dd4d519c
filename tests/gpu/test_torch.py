#!/usr/bin/env python3
"""memshim with real PyTorch. Without PyTorch: every case skips. Without a GPU: the Python-level
allocator API is tested as far as it runs (CUDAPluggableAllocator over libmemshim.so, the optional
hooks, change_current_allocator); the GPU cases skip. With a GPU: a small training loop in segment
mode (LD_PRELOAD) and in tensor mode (pluggable allocator) must give the same losses as without
memshim, memshim's pool must have served it, and reports must be written.
Each case runs in a subprocess (CUDA cannot be re-initialised). Ends with "N passed, N failed, N skipped"."""
import json
import os
import re
import subprocess
import sys
import tempfile
import glob

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, case, finish, skip  # noqa: E402
LIB = os.path.join(BUILD, "libmemshim.so")




def py(code, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_")}
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


probe = py("import torch; print(torch.__version__, torch.cuda.is_available())")
if probe[0] != 0:
    for n in ["allocator API", "segment mode", "tensor mode"]:
        skip(n, "PyTorch is not installed (bash scripts/setup.sh --with-torch installs it)")
    finish()
version, has_gpu = probe[1].split()[0], probe[1].split()[1] == "True"
print(f"torch {version}, GPU available: {has_gpu}")

API = f"""
import ctypes, torch
from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator
a = CUDAPluggableAllocator({LIB!r}, "memshim_malloc", "memshim_free")
so = ctypes.CDLL({LIB!r})
hooks = {{}}
for setter, sym in [("set_reset_fn", "memshim_empty_cache"), ("set_record_stream_fn", "memshim_record_stream")]:
    if hasattr(a._allocator, setter):
        getattr(a._allocator, setter)(ctypes.cast(getattr(so, sym), ctypes.c_void_p).value)
        hooks[setter] = True
change_current_allocator(a)
print("API-OK", sorted(hooks))
"""
rc, out, err = py(API, {"MEMSHIM_LOG": "warn"})
case("CUDAPluggableAllocator over libmemshim.so, hooks set, allocator swapped before CUDA init",
     rc == 0 and "API-OK" in out and "set_reset_fn" in out, (out + err)[-600:])

if not has_gpu:
    # Fails in PyTorch: its own CUDA initialisation raises (no process crash), not an error from
    # memshim: memshim logged no warning or error, and it served nothing (no pool exists).
    NODEV = API + '''
import re
class S(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("live", "peak_live", "res", "peak_res", "maps", "unmaps",
                                                "reclaimed", "allocs", "frees", "ooms")]
try:
    torch.empty(1, device='cuda')
    print('NO-ERROR')
except Exception as e:
    from_torch = type(e).__module__.split('.')[0] in ('builtins', 'torch') and 'memshim' not in str(e)
    print('NO-DEVICE', type(e).__name__, 'from-torch' if from_torch else 'not-from-torch')
print('STATS', so.memshim_get_stats(0, ctypes.byref(S())))
'''
    rc, out, err = py(NODEV, {"MEMSHIM_LOG": "warn"})
    memshim_complaints = [ln for ln in err.splitlines() if re.match(r"memshim\[\d+\]: (warning|error):", ln)]
    case("without a GPU a CUDA tensor fails cleanly in PyTorch, not in memshim",
         rc == 0 and "from-torch" in out and "STATS 19" in out and not memshim_complaints, (out + err)[-400:])
    for n in ["segment mode training loop", "tensor mode training loop"]:
        skip(n, "no GPU on this machine")
    finish()

TRAIN = """
import torch, json, sys
torch.manual_seed(0)
dev = "cuda"
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
side = torch.cuda.Stream()
losses = []
for step in range(40):
    bs = 64 * (1 + step % 4)
    x = torch.randn(bs, 1024, device=dev)
    with torch.cuda.stream(side):
        y = torch.randn(bs, 1024, device=dev)
    torch.cuda.current_stream().wait_stream(side)
    y.record_stream(torch.cuda.current_stream())
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(round(loss.item(), 4))
    if step % 10 == 9:
        torch.cuda.empty_cache()
torch.cuda.synchronize()
print("LOSSES", json.dumps(losses))
"""


def same_losses(a, b):
    """cuBLAS may pick other kernels between processes: equal to 1e-3 relative is the same run."""
    return a is not None and b is not None and len(a) == len(b) and all(
        abs(x - y) <= 1e-3 * max(1.0, abs(y)) for x, y in zip(a, b))


def losses(out):
    for line in out.splitlines():
        if line.startswith("LOSSES "):
            return json.loads(line[7:])
    return None


rc, out, err = py(TRAIN)
base = losses(out)
case("reference run without memshim", rc == 0 and base, err[-400:])
with tempfile.TemporaryDirectory() as tmp:
    rc, out, err = py(TRAIN + "\nimport ctypes\n", {"LD_PRELOAD": LIB, "MEMSHIM_REPORT_DIR": tmp, "MEMSHIM_LOG": "info"})
    case("segment mode: same losses under LD_PRELOAD", rc == 0 and same_losses(losses(out), base), (out + err)[-800:])
    summ = glob.glob(os.path.join(tmp, "*summary.json"))
    ok = bool(summ) and json.load(open(summ[0]))["operations"]["allocs"] > 0
    case("segment mode: the pool served PyTorch's segments and wrote a summary", ok, os.listdir(tmp))
with tempfile.TemporaryDirectory() as tmp:
    code = API + TRAIN + f"""
import ctypes
class S(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "live peak_live reserved peak_reserved maps unmaps reclaimed allocs frees ooms".split()]
s = S(); ctypes.CDLL({LIB!r}).memshim_get_stats(0, ctypes.byref(s))
print("STATS", s.allocs, s.peak_live, s.peak_reserved)
"""
    rc, out, err = py(code, {"MEMSHIM_REPORT_DIR": tmp})
    case("tensor mode: same losses with memshim as PyTorch's allocator", rc == 0 and same_losses(losses(out), base),
         (out + err)[-800:])
    st = [l for l in out.splitlines() if l.startswith("STATS")]
    ok = bool(st) and int(st[0].split()[1]) > 100
    case("tensor mode: every tensor came from the pool", ok, st)
    if ok:
        _, _, peak_live, peak_res = st[0].split()
        print(f"    tensor mode: peak live {int(peak_live)/2**20:.1f} MiB, peak reserved {int(peak_res)/2**20:.1f} MiB")
finish()
