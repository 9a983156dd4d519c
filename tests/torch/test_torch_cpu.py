#!/usr/bin/env python3
"""memshim and real PyTorch without a GPU (issue 9; docs/pytorch.md). Runs in make check.

Every case runs real python3 processes under LD_PRELOAD=libmemshim.so, on the CUDA driver double
(build/double) where memshim needs a driver. Cases are grouped so each PyTorch import (seconds on
a loaded machine) serves many checks:
  - the start-up hook without PyTorch: plain, venv, a user sitecustomize, -I/-E/-S, subprocess,
    spawn and shell children, ctypes loading, non-Python programs;
  - the switch at PyTorch's lazy CUDA initialization, the memory API answering from memshim's
    counters, the OOM that PyTorch turns into torch.OutOfMemoryError, graph trees off;
  - the program's own allocator choice respected (change_current_allocator, _set_allocator_settings);
  - epoch detection on CPU training loops; HF Trainer and Lightning when installed;
  - the done-when script: 3 epoch reports and a summary, output unchanged.
Without PyTorch every PyTorch case skips. Ends with "N passed, N failed, N skipped"."""
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pyharness import BUILD, ROOT, case, finish, skip  # noqa: E402

LIB = os.path.join(BUILD, "libmemshim.so")
GLUE = os.path.join(BUILD, "libmemshim_torch.so")
DOUBLE = os.path.join(BUILD, "double")
PYDIR = os.path.join(ROOT, "hooks", "python")


def env(extra=None, preload=True, double=True):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("MEMSHIM_", "_MEMSHIM_", "CUDBL_")) and k not in ("PYTHONPATH", "LD_PRELOAD")}
    if preload:
        e["LD_PRELOAD"] = LIB
    if double:
        e["LD_LIBRARY_PATH"] = DOUBLE
    e.update(extra or {})
    return e


def run(argv, extra=None, timeout=300, **kw):
    p = subprocess.run(argv, env=env(extra, **kw), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def py(code, extra=None, args=(), flags=(), **kw):
    return run([sys.executable, *flags, "-c", code, *args], extra, **kw)


def schema_case(title, rdir):
    """Issue 11: the reports PyTorch CPU runs write match docs/report.schema.json."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "replay"))
    from schema_check import report_problems
    reps = [json.load(open(os.path.join(rdir, f))) for f in sorted(os.listdir(rdir)) if f.endswith(".json")]
    bad = [(r.get("kind"), r.get("epoch"), report_problems(r)[:2]) for r in reps if report_problems(r)]
    case(f"{title}: its {len(reps)} reports match docs/report.schema.json", reps and not bad, bad[:2])


def lines(out, tag):
    return [l[len(tag) + 1:] for l in out.splitlines() if l.startswith(tag + " ")]


# ---- 1. the start-up hook, no PyTorch -----------------------------------------------------------
PROBE = "import os, sys; print('HOOK', 'memshim' in sys.modules, repr(os.environ.get('PYTHONPATH')), " \
        "'_MEMSHIM_PYTHONPATH' in os.environ)"
rc, out, err = py(PROBE)
case("plain python3 under LD_PRELOAD: memshim's hook ran, PYTHONPATH unset again, no trace in os.environ",
     rc == 0 and lines(out, "HOOK") == ["True None False"], out + err)
rc, out, err = py(PROBE, {"PYTHONPATH": "/nonexistent/a:/nonexistent/b"})
case("the user's PYTHONPATH is restored in os.environ", rc == 0 and
     lines(out, "HOOK") == ["True '/nonexistent/a:/nonexistent/b' False"], out + err)
rc, out, err = py("import sys; print('LAST', sys.path[-1], sys.path.count(sys.path[-1]))")
case("memshim's directory moves to the end of sys.path (it shadows none of the program's modules)",
     rc == 0 and lines(out, "LAST") == [f"{PYDIR} 1"], out + err)

with tempfile.TemporaryDirectory(prefix="memshim-t9-") as tmp:
    user = os.path.join(tmp, "user")
    os.makedirs(user)
    with open(os.path.join(user, "sitecustomize.py"), "w") as f:
        f.write("import builtins\nbuiltins.USER_SITECUSTOMIZE = 'ran'\n")
    rc, out, err = py("import builtins, sys; print('USER', getattr(builtins, 'USER_SITECUSTOMIZE', None), "
                      "'memshim' in sys.modules)", {"PYTHONPATH": user})
    case("a user sitecustomize that memshim's shadows still runs", rc == 0 and lines(out, "USER") == ["ran True"],
         out + err)

    venv = os.path.join(tmp, "venv")
    vrc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], capture_output=True, text=True)
    if vrc.returncode != 0:
        skip("a venv's python3 gets the hook", f"python3 -m venv failed: {vrc.stderr.strip()[-120:]}")
    else:
        rc, out, err = run([os.path.join(venv, "bin", "python"), "-c",
                            "import sys; print('VENV', sys.prefix != sys.base_prefix, 'memshim' in sys.modules)"])
        case("a venv's python3 gets the hook", rc == 0 and lines(out, "VENV") == ["True True"], out + err)

    for flag in ("-I", "-E", "-S", "-IS"):
        rc, out, err = py("import sys; print('FLAG', 'memshim' in sys.modules)", {"MEMSHIM_LOG": "info"},
                          flags=(flag,))
        case(f"python3 {flag}: no hook, segment mode, and one info line saying how to get tensor mode",
             rc == 0 and lines(out, "FLAG") == ["False"] and "import memshim" in err and "install-python" in err,
             out + err)
    rc, out, err = py("import sys; print('FLAG', 'memshim' in sys.modules)", {"MEMSHIM_LOG": "info"},
                      flags=("-W", "ignore", "-X", "utf8"))
    case("options with values (-W x, -X y) are not taken for -I/-E/-S",
         rc == 0 and lines(out, "FLAG") == ["True"] and "ignores PYTHONPATH" not in err, out + err)

    child = ("import os, subprocess, sys; print('PARENT', 'memshim' in sys.modules);"
             "subprocess.run([sys.executable, '-c', \"import os, sys; print('CHILD', 'memshim' in sys.modules, "
             "repr(os.environ.get('PYTHONPATH')))\"]);"
             "subprocess.run(['sh', '-c', 'echo SHELL \"${PYTHONPATH-unset}\"'])")
    rc, out, err = py(child, {"PYTHONPATH": "/nonexistent/u"})
    case("a python3 subprocess gets the hook and the user's PYTHONPATH",
         rc == 0 and lines(out, "CHILD") == ["True '/nonexistent/u'"], out + err)
    case("a shell child sees the user's PYTHONPATH, untouched", lines(out, "SHELL") == ["/nonexistent/u"], out + err)
    rc, out, err = py(child)
    case("a shell child of a program without PYTHONPATH sees none", lines(out, "SHELL") == ["unset"], out + err)

    spawn = os.path.join(tmp, "spawn_child.py")
    with open(spawn, "w") as f:
        f.write("import multiprocessing as mp, sys\n"
                "def f(q):\n    q.put('memshim' in sys.modules)\n"
                "if __name__ == '__main__':\n"
                "    for m in ('spawn', 'forkserver'):\n"
                "        ctx = mp.get_context(m); q = ctx.Queue(); p = ctx.Process(target=f, args=(q,)); p.start()\n"
                "        print('MP', m, q.get(timeout=60)); p.join()\n")
    rc, out, err = run([sys.executable, spawn])
    case("spawn and forkserver children get the hook as the parent does",
         rc == 0 and lines(out, "MP") == ["spawn True", "forkserver True"], out + err)

    rc, out, err = run(["sh", "-c", "echo SH \"${PYTHONPATH-unset}\""])
    case("a non-Python program under LD_PRELOAD keeps its environment", lines(out, "SH") == ["unset"], out + err)
    rc, out, err = py(f"import ctypes, os; ctypes.CDLL({LIB!r}); print('CT', repr(os.environ.get('PYTHONPATH')), "
                      "'_MEMSHIM_PYTHONPATH' in os.environ)", preload=False)
    case("libmemshim.so loaded into a running interpreter (ctypes) changes nothing",
         rc == 0 and lines(out, "CT") == ["None False"], out + err)
    # make install puts the hook beside the library, where the library looks for it; make
    # install-python's .pth boots it where PYTHONPATH is ignored (python -I).
    prefix, dest = os.path.join(tmp, "prefix"), os.path.join(tmp, "dest")
    mk = subprocess.run(["make", "-s", f"BUILD={os.path.relpath(BUILD, ROOT)}", f"PREFIX={prefix}", "install"],
                        cwd=ROOT, capture_output=True, text=True)
    mk2 = subprocess.run(["make", "-s", f"BUILD={os.path.relpath(BUILD, ROOT)}", f"PREFIX={prefix}",
                          f"DESTDIR={dest}", "install-python"], cwd=ROOT, capture_output=True, text=True)
    inst_lib = os.path.join(prefix, "lib", "libmemshim.so")
    rc, out, err = run([sys.executable, "-c", "import memshim; print('INST', memshim.__file__)"],
                       {"LD_PRELOAD": inst_lib})
    case("make install: the installed library finds its Python hook beside it",
         mk.returncode == 0 and lines(out, "INST") == [os.path.join(prefix, "lib", "memshim-python", "memshim",
                                                                    "__init__.py")], mk.stderr + out + err)
    pth = [os.path.join(d, "memshim.pth") for d, _, fs in os.walk(dest) if "memshim.pth" in fs]  # (.pyenv: hidden)
    rc, out, err = run([sys.executable, "-I", "-c", "import site, sys; before = 'memshim' in sys.modules; "
                        f"site.addsitedir({os.path.dirname(pth[0]) if pth else tmp!r}); "
                        "print('PTH', before, 'memshim' in sys.modules)"], {"LD_PRELOAD": inst_lib})
    case("make install-python: its .pth boots memshim under python -I", mk2.returncode == 0 and bool(pth)
         and lines(out, "PTH") == ["False True"], (pth, mk2.stderr + out + err))
    rc, out, err = run([sys.executable, "-I", "-c", "import site, sys; "
                        f"site.addsitedir({os.path.dirname(pth[0]) if pth else tmp!r}); "
                        "print('PTH', 'memshim' in sys.modules)"], preload=False)
    case("the .pth does nothing without libmemshim.so preloaded", lines(out, "PTH") == ["False"], out + err)

    rc, out, err = py(PROBE, {"MEMSHIM_MODE": "off"})
    case("MEMSHIM_MODE=off: no hook", rc == 0 and lines(out, "HOOK") == ["False None False"], out + err)

    # A program without PyTorch (CuPy, JAX, a CUDA extension) closes its epochs with memshim.epoch().
    rdir = os.path.join(tmp, "no-torch-reports")
    rc, out, err = py("import ctypes, sys, memshim\nctypes.CDLL('libcudart.so')\nrt = ctypes.CDLL(None)\n"
                      "p = ctypes.c_void_p()\nassert rt.cudaMalloc(ctypes.byref(p), 1 << 20) == 0\nmemshim.epoch()\n"
                      "print('EPOCH', 'torch' in sys.modules)", {"MEMSHIM_REPORT_DIR": rdir})
    reps = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rdir, "*-epoch*.json")))]
    case("without PyTorch, memshim.epoch() closes an epoch: one report, reason manual, the 1 MiB in it",
         rc == 0 and lines(out, "EPOCH") == ["False"] and len(reps) == 1 and reps[0].get("reason") == "manual"
         and reps[0]["memory"]["allocated_peak_bytes"] == 1 << 20,
         (out + err[-600:], [(r.get("reason"), r.get("epoch")) for r in reps]))
    # A script that calls memshim stays runnable under MEMSHIM_MODE=off (no hook: `import memshim`
    # from the script's own path, and the package does not arm, so only _boot of it is loaded).
    rc, out, err = py(f"import sys\nsys.path.insert(0, {PYDIR!r})\nimport memshim\nmemshim.epoch()\n"
                      "memshim.step()\nprint('OFF', memshim.stats()['mode'])",
                      {"MEMSHIM_MODE": "off", "MEMSHIM_REPORT_DIR": rdir + "-off"})
    case("MEMSHIM_MODE=off: memshim.epoch(), step() and stats() return (mode off), no report",
         rc == 0 and lines(out, "OFF") == ["off"] and not os.path.exists(rdir + "-off"), out + err[-600:])
    # The figures the Lightning and HF callbacks log at each epoch end (memshim/..., docs/pytorch.md),
    # as the callbacks get them (memshim._frameworks.epoch_metrics), here without either installed.
    rdir_m = os.path.join(tmp, "metrics-reports")
    rc, out, err = py("import ctypes, json, memshim\nctypes.CDLL('libcudart.so')\nrt = ctypes.CDLL(None)\n"
                      "p = ctypes.c_void_p()\nassert rt.cudaMalloc(ctypes.byref(p), 3 << 20) == 0\nmemshim.epoch()\n"
                      "from memshim import _frameworks\nprint('METRICS', json.dumps(_frameworks.epoch_metrics()))\n"
                      "print('AGAIN', json.dumps(_frameworks.epoch_metrics()))", {"MEMSHIM_REPORT_DIR": rdir_m})
    m = json.loads(lines(out, "METRICS")[0]) if lines(out, "METRICS") else {}
    rep = [json.load(open(f)) for f in glob.glob(os.path.join(rdir_m, "*-epoch*.json"))]
    mem = rep[0]["memory"] if len(rep) == 1 else {}
    case("the trainers' memshim/ figures of an epoch: the seven of docs/pytorch.md, equal to its report, logged once",
         sorted(m) == sorted("memshim/" + k for k in (
             "allocated_peak_bytes", "reserved_peak_bytes", "fragmentation", "peak_allocated_over_peak_reserved",
             "ooms", "oom_rescues", "growth_bytes_per_epoch"))
         and m["memshim/allocated_peak_bytes"] == mem.get("allocated_peak_bytes")
         and m["memshim/reserved_peak_bytes"] == mem.get("reserved_peak_bytes") and m["memshim/ooms"] == 0
         and lines(out, "AGAIN") == ["{}"], (m, mem, err[-400:]))
    # Ctrl-C in a job without PyTorch: CPython ends by SIGINT, past libmemshim.so's C exit handler,
    # so the hook's atexit writes the open epoch and the summary (reason interrupted).
    rdir_i = os.path.join(tmp, "interrupted-reports")
    rc, out, err = py("import ctypes\nctypes.CDLL('libcudart.so')\nrt = ctypes.CDLL(None)\np = ctypes.c_void_p()\n"
                      "assert rt.cudaMalloc(ctypes.byref(p), 1 << 20) == 0\nraise KeyboardInterrupt",
                      {"MEMSHIM_REPORT_DIR": rdir_i})
    got = sorted((json.load(open(f)).get("kind"), json.load(open(f)).get("reason"))
                 for f in glob.glob(os.path.join(rdir_i, "*.json")))
    case("an uncaught KeyboardInterrupt: the process ends by SIGINT with its epoch and summary written (interrupted)",
         rc == -2 and got == [("epoch", "interrupted"), ("summary", "interrupted")], (rc, got, err[-400:]))

# ---- PyTorch ---------------------------------------------------------------------------------------
probe = py("import torch; print('TORCH', torch.__version__)", preload=False)
if probe[0] != 0 or not lines(probe[1], "TORCH"):
    for n in ("switch at lazy CUDA init", "memory API", "OOM", "own allocator respected", "epochs",
              "HF Trainer", "Lightning", "done-when script"):
        skip(n, "PyTorch is not installed (bash scripts/setup.sh --with-torch installs it)")
    finish()
print(f"torch {lines(probe[1], 'TORCH')[0]}")
if not os.path.exists(GLUE):
    skip("switch, memory API and OOM", f"{GLUE} was not built (make builds it where torch imports)")
else:
    probes = glob.glob(os.path.join(BUILD, "tests", "torch", "memshim_oom_probe*.so"))
    # ---- 2. switch at lazy init, memory API, OOM: one process -----------------------------------
    code = r'''
import ctypes, importlib.util, json, sys
import torch
from memshim import _torch as mt
print("BEFORE", mt.state.decided, torch.cuda.memory._get_current_allocator() is not None)
# a switch of its own right after import still works: memshim did not switch at import
try:
    torch.empty(1, device="cuda")
except Exception as exc:
    print("CUDA", type(exc).__name__)
print("AFTER", mt.state.decided, mt.state.tensor, mt.state.why)
import torch._inductor.config as ic
print("TREES", ic.triton.cudagraph_trees)
glue = ctypes.CDLL(sys.argv[1])
spec = importlib.util.spec_from_file_location("memshim_oom_probe", sys.argv[2])
probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)
fa = ctypes.cast(glue.memshim_glue_malloc, ctypes.c_void_p).value
ff = ctypes.cast(glue.memshim_glue_free, ctypes.c_void_p).value
MiB = 1 << 20
a = probe.alloc(fa, 3 * MiB, 0); b = probe.alloc(fa, 1000, 0); c = probe.alloc(fa, 5 * MiB, 0)
s = torch.cuda.memory_stats(0)
print("ALLOC", torch.cuda.memory_allocated(0), torch.cuda.memory_allocated("cuda:0"), s["allocation.all.current"],
      s["requested_bytes.all.current"], s["allocated_bytes.small_pool.current"], s["allocated_bytes.large_pool.current"],
      torch.cuda.memory_reserved(0) >= torch.cuda.memory_allocated(0) > 0)
am = getattr(torch, "accelerator", None)
if am is not None and hasattr(am, "memory_allocated"):
    print("ACCEL", am.memory_allocated(0) == torch.cuda.memory_allocated(0) > 0,
          am.memory_stats(0)["allocation.all.current"], am.max_memory_reserved(0) == torch.cuda.max_memory_reserved(0))
else:
    print("ACCEL none")
probe.free(ff, c, 5 * MiB, 0)
print("FREE", torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0), s["allocated_bytes.all.allocated"])
torch.cuda.reset_peak_memory_stats(0)
print("RESET", torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_reserved(0) == torch.cuda.memory_reserved(0))
torch.cuda.reset_accumulated_memory_stats(0)
s2 = torch.cuda.memory_stats(0)
print("ACCUM", s2["allocated_bytes.all.allocated"], s2["allocated_bytes.all.freed"], s2["allocated_bytes.all.current"])
summ = torch.cuda.memory_summary(0)
print("SUMMARY", "PyTorch CUDA memory summary" in summ and "Allocated memory" in summ)
lib = ctypes.CDLL(None)
lib.memshim_torch_set_memory_fraction(ctypes.c_double(0.25), 0)
print("FRACTION", round(torch.cuda.get_per_process_memory_fraction(0), 6))
try:
    probe.alloc(fa, 3 * 1024 * MiB, 0)
    print("OOM none")
except torch.OutOfMemoryError as e:
    msg = str(e)
    print("OOM", json.dumps(msg))
print("OOMS", torch.cuda.memory_stats(0)["num_ooms"])
d = probe.alloc(fa, 64 * MiB, 0)
print("CONTINUE", d != 0)
e = probe.alloc(fa, 600 * MiB, 0)
try:
    probe.alloc(fa, 600 * MiB, 0)
    print("NOW none")
except torch.OutOfMemoryError as exc:
    print("NOW", json.dumps(str(exc)))
probe.free(ff, e, 600 * MiB, 0)
import memshim
st = memshim.stats(0)
print("STATS", st["mode"], st["torch"]["allocated_bytes.all.current"] == torch.cuda.memory_allocated(0))
'''
    rc, out, err = py(code, {"CUDBL_CAPACITY": "4G", "MEMSHIM_LOG": "info"}, args=(GLUE, probes[0] if probes else ""))
    o = {}
    for l in out.splitlines():
        k, _, v = l.partition(" ")
        o[k] = v
    case("import torch does not switch the allocator (the program could still switch its own)",
         o.get("BEFORE") == "False True", out + err[-2000:])
    case("the switch happens at PyTorch's lazy CUDA initialization (tensor mode)",
         o.get("AFTER") == "True True None" and "tensor mode: PyTorch allocates every tensor through memshim" in err,
         out + err[-2000:])
    case("tensor mode turns cudagraph trees off for torch.compile", o.get("TREES") == "False", out + err[-1500:])
    if not probes:
        skip("memory API and OOM", "the PyTorch test extension was not built (make tests)")
    else:
        MiB = 1 << 20
        r3, r5, r1 = 3 * MiB, 5 * MiB, 1024  # 1000 bytes round to 1024 (512-byte blocks)
        case("memory_allocated/memory_stats answer from memshim's counters, PyTorch's key names, small/large pools",
             o.get("ALLOC") == f"{r3 + r5 + r1} {r3 + r5 + r1} 3 {r3 + r5 + 1000} {r1} {r3 + r5} True",
             out + err[-1500:])
        if o.get("ACCEL") == "none":
            skip("torch.accelerator's memory functions answer too", "this PyTorch has no torch.accelerator memory API")
        else:
            case("torch.accelerator's memory functions answer from the same counters",
                 o.get("ACCEL") == "True 3 True", out + err[-1500:])
        case("a free lowers allocated, the peak stays", o.get("FREE") == f"{r3 + r1} {r3 + r5 + r1} {r3 + r5 + r1}",
             out + err[-1500:])
        case("reset_peak_memory_stats resets the peaks", o.get("RESET") == f"{r3 + r1} True", out + err[-1500:])
        case("reset_accumulated_memory_stats resets the cumulative figures only",
             o.get("ACCUM") == f"0 0 {r3 + r1}", out + err[-1500:])
        case("memory_summary works", o.get("SUMMARY") == "True", out + err[-1500:])
        case("set_per_process_memory_fraction's hook sets the limit; get_per_process_memory_fraction answers",
             o.get("FRACTION") == "0.25", out + err[-1500:])
        msg = json.loads(o["OOM"]) if o.get("OOM", "none") != "none" else ""
        case("OOM: the glue's exception becomes torch.OutOfMemoryError through PyTorch's translation, with "
             "PyTorch's opening words and memshim's diagnosis",
             msg.startswith("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 ")
             and "memshim (tensor mode): larger than the limit (1.00 GiB) set by set_per_process_memory_fraction(0.25)"
             in msg and "before any driver work" in msg and "raise the memory fraction" in msg
             and "could ever" not in msg, out + err[-1500:])
        case("num_ooms counts it, and the job continues with a smaller request",
             o.get("OOMS") == "1" and o.get("CONTINUE") == "True", out + err[-1500:])
        now = json.loads(o["NOW"]) if o.get("NOW", "none") != "none" else ""
        case("OOM under the limit but beyond what is left: 'does not fit now' with free, cached, live, the "
             "largest free extent and what memshim tried (issue 25)",
             now.startswith("CUDA out of memory. Tried to allocate 600.00 MiB. GPU 0 ")
             and "memshim (tensor mode): does not fit now: capacity" in now and "cached by memshim" in now
             and "device free" in now and "largest free extent" in now and "memshim tried:" in now, out + err[-1500:])
        case("memshim.stats() reports tensor mode and the same figures", o.get("STATS") == "tensor True",
             out + err[-1500:])

# ---- 3. the program's own allocator choices are respected ----------------------------------------
own = f'''
import torch
from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator
change_current_allocator(CUDAPluggableAllocator({LIB!r}, "memshim_malloc", "memshim_free"))
try:
    torch.empty(1, device="cuda")
except Exception as exc:
    print("CUDA", type(exc).__name__, "swap" in str(exc))
from memshim import _torch as mt
print("OWN", mt.state.decided, mt.state.tensor)
'''
rc, out, err = py(own, {"MEMSHIM_LOG": "info"})
case("a program that switches the allocator itself keeps it; memshim says so once at info level",
     rc == 0 and lines(out, "OWN") == ["True False"] and err.count("memshim stays in segment mode") == 1
     and "change_current_allocator" in err and "Can't swap" not in out + err, out + err[-1500:])
rc, out, err = py("import torch\ntorch.cuda.memory._set_allocator_settings('expandable_segments:False')\n"
                  "try:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
                  "from memshim import _torch as mt\nprint('SET', mt.state.decided, mt.state.tensor)",
                  {"MEMSHIM_LOG": "info"})
case("a program that sets PyTorch's allocator settings keeps PyTorch's allocator (segment mode, said once)",
     rc == 0 and lines(out, "SET") == ["True False"]
     and sum("memshim stays in segment mode" in l and "_set_allocator_settings" in l for l in err.splitlines()) == 1,
     out + err[-1500:])

# A program that calls the settings binding itself (PyTorch 2.15 deprecates
# torch.cuda.memory._set_allocator_settings in favour of torch._C._accelerator_setAllocatorSettings).
rc, out, err = py("import torch\nf = getattr(torch._C, '_accelerator_setAllocatorSettings', None)\n"
                  "print('HAS', f is not None)\nf and f('expandable_segments:False')\n"
                  "try:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
                  "from memshim import _torch as mt\nprint('SET', mt.state.decided, mt.state.tensor)",
                  {"MEMSHIM_LOG": "info"})
if lines(out, "HAS") == ["False"]:
    skip("torch._C._accelerator_setAllocatorSettings called directly keeps PyTorch's allocator",
         "this PyTorch has no torch._C._accelerator_setAllocatorSettings")
else:
    case("a program that calls torch._C._accelerator_setAllocatorSettings itself keeps PyTorch's allocator "
         "(segment mode, said once)",
         rc == 0 and lines(out, "SET") == ["True False"]
         and sum("memshim stays in segment mode" in l and "_accelerator_setAllocatorSettings" in l
                 for l in err.splitlines()) == 1, out + err[-1500:])

# ---- 3b. another PyTorch's pluggable-allocator hooks (simulated on this one) ------------------------
if os.path.exists(GLUE):
    hooks = r'''
import sys, torch
P = torch._C._CUDAPluggableAllocator
calls = []
def spy(name, orig):
    def f(self, addr):
        calls.append(name)
        return orig(self, addr)
    return f
for name in [n for n in dir(P) if n.startswith("set_")]:
    setattr(P, name, spy(name, getattr(P, name)))
if sys.argv[1] == "no_release":      # a PyTorch without set_release_pool
    delattr(P, "set_release_pool")
elif sys.argv[1] == "bad_setter":    # a binding of another shape
    def bad(self, addr):
        raise TypeError("set_record_stream_fn(): incompatible function arguments")
    P.set_record_stream_fn = bad
try:
    torch.empty(1, device="cuda")
except Exception as exc:
    print("CUDA", type(exc).__name__)
from memshim import _torch as mt
print("MODE", mt.state.decided, mt.state.tensor)
print("CALLS", ",".join(sorted(calls)))
'''
    rc, out, err = py(hooks, {"MEMSHIM_LOG": "info"}, args=("no_release",))
    said = [l for l in err.splitlines() if "capture-pool hook" in l]
    case("a PyTorch without set_release_pool: tensor mode, no capture-pool hook set (begin without release "
         "would keep capture pools forever), said in one line",
         rc == 0 and lines(out, "MODE") == ["True True"]
         and lines(out, "CALLS") == ["set_base_alloc_fn,set_init_fn,set_memory_fraction_fn,set_record_stream_fn,"
                                     "set_reset_fn"]
         and len(said) == 1 and "set_release_pool" in said[0] and "backstop" in said[0], out + err[-1500:])
    rc, out, err = py(hooks, {"MEMSHIM_LOG": "info"}, args=("bad_setter",))
    case("a hook setter that refuses memshim's argument (another binding shape): that hook is left unset, "
         "the switch still happens and names it",
         rc == 0 and lines(out, "MODE") == ["True True"]
         and "set_begin_allocate_to_pool" in lines(out, "CALLS")[0]
         and any("tensor mode" in l and "set_record_stream_fn (TypeError)" in l for l in err.splitlines()),
         out + err[-1500:])

with tempfile.TemporaryDirectory(prefix="memshim-t9-") as tmp:
    # an installed layout without the C++ glue: memshim stays in segment mode and says why
    os.makedirs(os.path.join(tmp, "lib"))
    subprocess.run(["cp", LIB, os.path.join(tmp, "lib", "libmemshim.so")], check=True)
    os.symlink(PYDIR, os.path.join(tmp, "lib", "memshim-python"))
    rc, out, err = py("import torch\ntry:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
                      "from memshim import _torch as mt\nprint('NOGLUE', mt.state.decided, mt.state.tensor)",
                      {"MEMSHIM_LOG": "info", "LD_PRELOAD": os.path.join(tmp, "lib", "libmemshim.so")})
    said = [l for l in err.splitlines() if "memshim stays in segment mode" in l]
    case("without the C++ glue memshim does not switch, and says why in one line",
         rc == 0 and lines(out, "NOGLUE") == ["True False"] and len(said) == 1 and "libmemshim_torch.so is missing"
         in said[0], out + err[-1500:])

# ---- 4. epochs ----------------------------------------------------------------------------------
with tempfile.TemporaryDirectory(prefix="memshim-t9-") as rdir:
    rc, out, err = run([sys.executable, os.path.join(HERE, "epochs_cpu.py"), rdir],
                       {"MEMSHIM_REPORT_DIR": rdir, "MEMSHIM_LOG": "info", "RANK": "0", "MEMSHIM_GC": "epoch"})
    res = {}
    for l in lines(out, "RESULT"):
        name, _, js = l.partition(" ")
        res[name] = json.loads(js)

    def reasons(name):
        return [(r["reason"], r["steps"]) for r in res.get(name, [])]
    detail = out[-1500:] + err[-1500:]
    case("epochs: two passes with a validation loader mid-epoch give two epochs (dataloader, 8 steps each)",
         reasons("validation_mid_epoch") == [("dataloader", 8), ("dataloader", 8)], detail)
    case("epochs: a pass left with break closes at that loader's next pass",
         reasons("break_before_next_pass") == [("dataloader", 3)] and reasons("break_next_pass") == [("dataloader", 3)],
         detail)
    case("epochs: with two optimizers a batch counts one step", reasons("two_optimizers") == [("dataloader", 8)], detail)
    case("epochs: a validation-only pass closes nothing", reasons("validation_only") == [], detail)
    case("epochs: num_workers=2 gives one epoch", reasons("workers_2") == [("dataloader", 8)], detail)
    pids = {l.split("]")[0] for l in err.splitlines() if l.startswith("memshim[")}
    case("DataLoader workers stay idle: memshim lines and reports come from the main process only",
         len(pids) == 1 and all(f"pid{p.split('[')[1]}" in f for p in pids for f in os.listdir(rdir)), (pids, detail))
    case("an IterableDataset without __len__: memshim says once that such passes may never end",
         err.count("IterableDataset without __len__") == 1 and reasons("iterable_no_len") == [("dataloader", 2)], detail)
    tms = (res.get("segment_torch_stats") or [{}])[0].get("torch")
    case("segment mode: the epoch report carries PyTorch's own memory_stats() (torch_memory_stats)",
         tms == {"allocated_bytes.all.current": 1234, "reserved_bytes.all.peak": 4 << 20, "num_ooms": 0,
                 "num_alloc_retries": 2} and res["segment_torch_stats"][0]["reason"] == "dataloader", detail)
    case("MEMSHIM_GC=epoch: a detected epoch end runs gc.collect() on the training thread",
         lines(out, "GC_BEFORE") == ["[]"] and lines(out, "GC_AFTER") == ["[True]"]
         and reasons("gc_epoch") == [("dataloader", 8)], detail)
    case("epochs: memshim.epoch() closes one with reason manual", reasons("manual_epoch") == [("manual", 0)], detail)
    case("torchrun-style RANK goes into the report names", all("-rank0-" in f for f in os.listdir(rdir)),
         os.listdir(rdir))
    schema_case("epochs", rdir)

# A nanoGPT-style loop (get_batch, no DataLoader) of 25 optimizer steps with MEMSHIM_EPOCH_INTERVAL=10:
# interval reports are memshim's own epoch detection, so only MEMSHIM_EPOCH=auto writes them; epochs
# the user chose (steps every 100 here) get none, and no warning about them.
GETBATCH = ("import ctypes, torch\nlib = ctypes.CDLL(None)\nlib.memshim_malloc.restype = ctypes.c_void_p\n"
            "lib.memshim_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
            "hold = lib.memshim_malloc(1 << 20, 0, None)\nmodel = torch.nn.Linear(4, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.01)\nfor i in range(25):\n"
            "    opt.zero_grad()\n    model(torch.randn(8, 4)).sum().backward()\n    opt.step()\n")
for label, extra, want in (("MEMSHIM_EPOCH=auto", {}, [("interval", 10), ("interval", 10)]),
                           ("MEMSHIM_EPOCH=steps", {"MEMSHIM_EPOCH": "steps", "MEMSHIM_EPOCH_STEPS": "100"}, [])):
    with tempfile.TemporaryDirectory(prefix="memshim-t9-") as rdir:
        rc, out, err = py(GETBATCH, dict(extra, MEMSHIM_REPORT_DIR=rdir, MEMSHIM_EPOCH_INTERVAL="10"))
        got = [(json.load(open(f))["reason"], json.load(open(f))["steps"])
               for f in sorted(glob.glob(os.path.join(rdir, "*-epoch*.json")))]
        warned = [l for l in err.splitlines() if "optimizer steps and no epoch has ended" in l]
        case(f"{label}, a get_batch loop of 25 steps, MEMSHIM_EPOCH_INTERVAL=10: "
             + ("an interval report every 10 steps, said once" if want else "no interval reports, no warning"),
             rc == 0 and got == want and len(warned) == (1 if want else 0), (got, err[-800:]))

# ---- 5. HF Trainer and Lightning --------------------------------------------------------------------
for fw, reason, title in (("hf", "hf_trainer", "HF Trainer"), ("lightning", "lightning", "Lightning")):
    with tempfile.TemporaryDirectory(prefix="memshim-t9-") as rdir:
        rc, out, err = run([sys.executable, os.path.join(HERE, "frameworks_cpu.py"), fw, rdir],
                           {"MEMSHIM_REPORT_DIR": rdir}, timeout=600)
        if lines(out, "SKIP"):
            skip(f"{title}: one epoch report per epoch from its own callback", lines(out, "SKIP")[0])
            continue
        got = json.loads(lines(out, "RESULT")[0]) if lines(out, "RESULT") else None
        case(f"{title}: one epoch report per epoch from its own callback (reason {reason})",
             rc == 0 and got == [{"reason": reason, "steps": 4}, {"reason": reason, "steps": 4}],
             out[-1200:] + err[-1500:])
        schema_case(title, rdir)

# ---- 6. done when ------------------------------------------------------------------------------------
script = os.path.join(HERE, "train_cpu.py")
rc0, base, err0 = run([sys.executable, script], preload=False)
with tempfile.TemporaryDirectory(prefix="memshim-t9-") as rdir:
    rc, out, err = run([sys.executable, script], {"MEMSHIM_REPORT_DIR": rdir})
    files = sorted(os.listdir(rdir))
    epochs = [f for f in files if "-epoch" in f]
    summ = [f for f in files if f.endswith("-summary.json")]
    case("done when: 3 epochs with validation inside each leave exactly 3 epoch reports and a summary",
         rc == 0 and len(epochs) == 3 and len(summ) == 1 and len(files) == 4
         and all(json.load(open(os.path.join(rdir, f)))["reason"] == "dataloader" for f in epochs),
         (files, err[-1500:]))
    case("done when: the script's output is the same as without memshim",
         rc0 == 0 and rc == 0 and out == base and "epoch 2 " in base, (base, out, err0[-500:]))
    schema_case("done when", rdir)
    summ_rep = json.load(open(os.path.join(rdir, summ[0]))) if summ else {}
    top = (summ_rep.get("sites") or [{}])[0]
    case("done when: the summary names torch's version and the site of the 4 x 8 MiB memshim_malloc calls "
         "(train_cpu.py, GIL re-taken: ctypes.CDLL releases it as a PyTorch operator does)",
         summ_rep.get("mode") == "tensor" and summ_rep.get("versions", {}).get("torch")
         and top.get("file", "").endswith("train_cpu.py") and top.get("bytes") == 32 << 20 and top.get("count") == 4,
         {k: summ_rep.get(k) for k in ("mode", "versions", "sites", "sites_note")})
finish()
