#!/usr/bin/env python3
"""The pip package end to end (issue 17; docs/install.md). Runs in make check.

Builds the wheel from this checkout (`pip wheel --no-build-isolation`: the setuptools that
scripts/setup.sh installed, no network), with the CUDA headers PyTorch's wheels install when they
are there (CUDA_HOME=site-packages/nvidia/cu13: the route of a machine with only the driver and
pip's PyTorch), and checks what it holds. Then, in a fresh virtual environment that sees the
system's PyTorch (`python3 -m venv --system-site-packages`; the system's pip runs in it, so the
venv's bundled setuptools does not stand in for the installed one), `pip install <checkout>` and,
from another directory: `memshim lib`, `memshim doctor` (no GPU: exit 1; on the driver double:
exit 0), `memshim run -- python train.py` (reports written, tensor mode at the first CUDA use,
python -I through memshim.pth), `memshim report` and `memshim replay` (what the tools print),
reports with libjansson unreachable (an rtld-audit module, tests/package/hide_jansson.c), a glue
built for another PyTorch (segment mode, `memshim doctor` says how to rebuild, `memshim
build-glue` does), and `pip uninstall memshim` leaving nothing. Needs `make` first (the driver
double, the demo workload, the dlopen build as the control). Ends with "N passed, N failed, N
skipped"."""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
# Each check here waits for processes that import PyTorch (seconds each, a minute on a loaded CI
# machine): 300 s per check unless MSH_TEST_TIMEOUT says otherwise.
os.environ.setdefault("MSH_TEST_TIMEOUT", "300")
from pyharness import BUILD, ROOT, case, finish, skip, step  # noqa: E402

DOUBLE = os.path.join(BUILD, "double")
DEMO = os.path.join(BUILD, "memshim-train-demo")


def load_build_helpers():
    import importlib.util
    spec = importlib.util.spec_from_file_location("memshim_build", os.path.join(ROOT, "hooks", "python", "memshim",
                                                                                 "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clean_env(extra=None):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("MEMSHIM_", "_MEMSHIM_", "CUDBL_", "PIP_")) and k not in ("PYTHONPATH", "LD_PRELOAD",
                                                                                       "LD_LIBRARY_PATH")}
    e["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    e.update(extra or {})
    return e


def sh(argv, extra=None, cwd=None, timeout=300):
    p = subprocess.run(argv, env=clean_env(extra), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


# ---- 1. where the CUDA headers come from (constructed directories) --------------------------------

def touch(*parts):
    p = os.path.join(*parts)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "w").close()


def check_header_finder(tmp):
    b = load_build_helpers()
    full = ("cuda.h", "cuda_runtime_api.h", "driver_types.h", "crt/host_defines.h")
    tk = os.path.join(tmp, "toolkit")
    for h in full:
        touch(tk, "include", h)
    site = os.path.join(tmp, "site")
    for h in full[:3]:  # what torch 2.15's nvidia/cu13/include holds: no crt/
        touch(site, "nvidia", "cu13", "include", h)
    touch(site, "triton", "backends", "nvidia", "include", "crt", "host_defines.h")
    got = b.find_cuda_headers([site], env={}, toolkits=[tk])
    case("CUDA headers: a toolkit comes before PyTorch's wheels", got[0] == os.path.join(tk, "include") and not got[1],
         got)
    got = b.find_cuda_headers([site], env={}, toolkits=[os.path.join(tmp, "none")])
    case("CUDA headers: without a toolkit, nvidia/cu13/include, with crt/host_defines.h from triton's copy after it",
         got[0] == os.path.join(site, "nvidia", "cu13", "include")
         and got[1] == [os.path.join(site, "triton", "backends", "nvidia", "include")], got)
    got = b.find_cuda_headers([site], env={"CUDA_HOME": tk}, toolkits=[])
    case("CUDA headers: CUDA_HOME wins", got[0] == os.path.join(tk, "include"), got)
    got = b.find_cuda_headers([site], env={"CUDA_HOME": os.path.join(tmp, "nowhere")}, toolkits=[tk])
    case("CUDA headers: a CUDA_HOME without headers is an error naming it, not a silent fallback",
         got[0] is None and "CUDA_HOME=" in got[2] and "nowhere" in got[2], got)
    shutil.rmtree(os.path.join(site, "triton"))
    got = b.find_cuda_headers([site], env={}, toolkits=[])
    case("CUDA headers: wheel headers without crt/host_defines.h anywhere are not a complete set",
         got[0] is None and "nvidia/cu13/include" in got[2], got)


# ---- 2. the wheel -----------------------------------------------------------------------------------

def wheel_header_env():
    """CUDA_HOME at PyTorch's nvidia/cu13 when it is there (the wheel-headers route), else as is."""
    b = load_build_helpers()
    info = b.probe_python(sys.executable)
    for sd in info["site_dirs"]:
        d = os.path.join(sd, "nvidia", "cu13")
        if os.path.isfile(os.path.join(d, "include", "cuda.h")):
            return {"CUDA_HOME": d}, info
    return {}, info


def needed(path):
    p = subprocess.run(["readelf", "-d", path], capture_output=True, text=True)
    return [ln.split("[")[1].rstrip("]") for ln in p.stdout.splitlines() if "(NEEDED)" in ln]


GLIBC = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2")


def check_wheel(tmp, hdr_env, info):
    step("pip wheel (the whole native build)", timeout=900)
    out = os.path.join(tmp, "wheels")
    rc, so, se = sh([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                     "-w", out, ROOT], hdr_env, cwd=tmp, timeout=900)
    whl = glob.glob(os.path.join(out, "memshim-*.whl"))
    case("pip wheel . builds one wheel", rc == 0 and len(whl) == 1, (so + se)[-1500:])
    if not whl:
        return None
    name = os.path.basename(whl[0])
    case("the wheel is py3-none-<platform> (native code, no Python extension)",
         name.endswith("-py3-none-linux_x86_64.whl"), name)
    z = zipfile.ZipFile(whl[0])
    names = set(z.namelist())
    torch_ok = "torch" in info
    want = {"memshim/__init__.py", "memshim/cli.py", "memshim/report.py", "memshim/__main__.py", "memshim.pth",
            "memshim/_lib/libmemshim.so", "memshim/_lib/memshim-replay", "memshim/_lib/memshim-options",
            "memshim/_lib/torch_glue.cpp", "memshim/_lib/build-info.json", "memshim/_lib/LICENSE.jansson",
            "memshim/_startup/sitecustomize.py"}
    if torch_ok:
        want.add("memshim/_lib/libmemshim_torch.so")
    case("the wheel holds the library, the glue, the tools, the hook, the command and memshim.pth",
         want <= names, sorted(want - names))
    ep = z.read([n for n in names if n.endswith(".dist-info/entry_points.txt") and "_startup" not in n][0]).decode()
    case("console scripts: memshim and memshim-report", "memshim = memshim.cli:main" in ep
         and "memshim-report = memshim.report:console_main" in ep, ep)
    # Lightning prints a line for every entry-point callback it loads: memshim declares none
    stray = sorted(n for n in names if "_startup/" in n and ".dist-info" in n)
    case("no Lightning entry point in the wheel (the job's output stays unchanged)",
         not stray and "lightning" not in ep.lower(), stray or ep)
    x = os.path.join(tmp, "unzipped")
    z.extractall(x)
    lib = os.path.join(x, "memshim", "_lib", "libmemshim.so")
    nd = needed(lib)
    case("the packaged libmemshim.so NEEDs only glibc (jansson linked in)", nd and all(n in GLIBC for n in nd), nd)
    dyn = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout
    case("jansson's symbols stay inside the library (none exported)", " json_" not in dyn and "memshim_" in dyn)
    nd = needed(os.path.join(x, "memshim", "_lib", "memshim-replay"))
    case("the packaged memshim-replay NEEDs only glibc", nd and all(n in GLIBC for n in nd), nd)
    bi = json.loads(z.read("memshim/_lib/build-info.json"))
    if torch_ok:
        case("build-info: the glue was built for this PyTorch", bi.get("torch") == info["torch"]["version"], bi)
    if hdr_env:
        case("build-info: the CUDA headers came from PyTorch's wheels (CUDA_HOME=.../nvidia/cu13)",
             bi.get("cuda_include", "").endswith("nvidia/cu13/include"), bi)
        # The compile that proves those headers are enough by themselves: nothing from the
        # default include path but gcc's own and /usr/include (this machine's /usr/local/include
        # holds a copy of the toolkit's headers that would hide a missing one).
        gcc_inc = subprocess.run(["gcc", "-print-file-name=include"], capture_output=True, text=True).stdout.strip()
        multi = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
        cmd = ["gcc", "-std=c11", "-D_GNU_SOURCE", "-fsyntax-only", "-nostdinc", "-isystem", gcc_inc]
        if multi:
            cmd += ["-isystem", f"/usr/include/{multi}"]
        cmd += ["-isystem", "/usr/include", f"-I{bi['cuda_include']}"]
        for d in bi.get("cuda_include_after") or []:
            cmd += ["-idirafter", d]
        cmd += ["-Ishim", "-Ipolicy", "-Ipolicy/base", "-Ireport", "-Ireport/trace"]
        p = subprocess.run(cmd + ["policy/base/cuda_real.c", "hooks/runtime.c"], cwd=ROOT, capture_output=True, text=True)
        case("the wheel-header set compiles memshim's CUDA sources with no other include directory "
             f"(after: {bi.get('cuda_include_after')})", p.returncode == 0, p.stderr[-800:])
    return whl[0]


# ---- 3. the venv ------------------------------------------------------------------------------------

def tree(d):
    out = set()
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            out.add(os.path.relpath(os.path.join(root, n), d))
    return out


def check_venv(tmp, hdr_env, info):
    venv = os.path.join(tmp, "venv")
    rc, so, se = sh([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    py = os.path.join(venv, "bin", "python")
    case("python3 -m venv --system-site-packages", rc == 0 and os.path.exists(py), se)
    before = tree(venv)
    step("pip install <checkout> into the venv", timeout=900)
    rc, so, se = sh([py, "-m", "pip", "install", "--no-build-isolation", "--no-cache-dir", ROOT], hdr_env, cwd=tmp,
                    timeout=900)
    case("pip install <checkout> into the venv", rc == 0 and "Successfully installed memshim" in so, (so + se)[-1500:])
    if rc != 0:
        return
    bindir = os.path.join(venv, "bin")
    memshim = os.path.join(bindir, "memshim")
    away = os.path.join(tmp, "elsewhere")
    os.makedirs(away)
    site = [d for d in glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))][0]
    lib = os.path.join(site, "memshim", "_lib", "libmemshim.so")
    venv_path = {"PATH": bindir + os.pathsep + os.environ.get("PATH", "")}

    rc, so, se = sh([memshim, "lib"], venv_path, cwd=away)
    case("memshim lib: the installed library's absolute path", rc == 0 and so.strip() == lib, (so, se))
    rc2, so2, _ = sh([py, "-m", "memshim", "lib"], venv_path, cwd=away)
    case("python -m memshim lib: the same", rc2 == 0 and so2 == so, so2)
    rc, so, se = sh(["env", "LD_DEBUG=files", py, "-m", "memshim", "lib"], venv_path, cwd=away)
    case("the command does not load libmemshim.so into itself", rc == 0 and "libmemshim.so" not in
         "".join(ln for ln in se.splitlines() if "calling init" in ln), se[-400:])

    rc, so, se = sh([memshim, "doctor"], venv_path, cwd=away, timeout=300)
    case("memshim doctor without a GPU: says there is no GPU, exit 1",
         rc == 1 and "no GPU" in so and "verdict:" in so and "JSON writer: built in" in so, (rc, so, se[-400:]))
    dbl = dict(venv_path, LD_LIBRARY_PATH=DOUBLE, CUDBL_CAPACITY="8G")
    rc, so, se = sh([memshim, "doctor"], dbl, cwd=away, timeout=300)
    tensor_ok = "torch" in info
    case("memshim doctor on the driver double: devices, VMM, the glue; exit 0 (tensor mode would work)",
         (rc == 0 and "tensor mode" in so and "virtual memory management supported" in so) if tensor_ok else rc == 1,
         (rc, so, se[-400:]))
    rc, so, se = sh([memshim, "doctor", "--json"], dict(dbl, MEMSHIM_LIMIT="2G", MEMSHIM_CONF="gc:epoch"), cwd=away)
    try:
        d = json.loads(so)
        src = {s["name"]: s["source"] for s in d["settings"]}
        ok = src.get("MEMSHIM_LIMIT") == "environment" and src.get("MEMSHIM_GC") == "MEMSHIM_CONF" and \
            d["reports"]["writer"] == "built in" and d["driver"]["devices"][0]["vmm"] is True
    except (ValueError, KeyError, IndexError, TypeError):
        ok, src = False, so[-400:]
    case("memshim doctor --json: each setting with where it came from, the writer, the devices", ok, src)
    # MEMSHIM_REPORT_DIR set: doctor says whether the directory can be made and written (the first
    # existing directory above it decides); %p and %h are expanded as memshim does
    blocker = os.path.join(away, "a-file")
    open(blocker, "w").close()
    said = []
    for rd in (os.path.join(away, "doctor-rep", "%h-%p"), os.path.join(blocker, "rep")):
        rc, so, se = sh([memshim, "doctor"], dict(dbl, MEMSHIM_REPORT_DIR=rd), cwd=away)
        said.append([ln for ln in so.splitlines() if ln.startswith("reports:")] or [f"exit {rc}: {se[-300:]}"])
    case("memshim doctor with MEMSHIM_REPORT_DIR: writable below a directory, NOT writable below a file",
         "(writable)" in said[0][0] and "(NOT writable)" in said[1][0], said)

    # memshim run -- python train.py, from another directory, reports written
    shutil.copy(os.path.join(ROOT, "tests", "torch", "train_cpu.py"), os.path.join(away, "train.py"))
    step("memshim run -- python train.py", timeout=300)
    rc0, plain, _ = sh([py, "train.py"], dbl, cwd=away)
    rc, so, se = sh([memshim, "run", "--report-dir", "rep", "--limit", "4G", "--", "python", "train.py"], dbl,
                    cwd=away)
    reps = sorted(os.listdir(os.path.join(away, "rep"))) if os.path.isdir(os.path.join(away, "rep")) else []
    case("memshim run -- python train.py: exit 0, output unchanged, 3 epoch reports and a summary in --report-dir",
         rc == 0 and rc0 == 0 and so == plain and len([r for r in reps if "-epoch" in r]) == 3
         and len([r for r in reps if r.endswith("-summary.json")]) == 1, (rc, reps, se[-600:]))
    summ = [r for r in reps if r.endswith("-summary.json")]
    if summ and tensor_ok:
        mode = json.load(open(os.path.join(away, "rep", summ[0]))).get("mode")
        case("memshim run -- python train.py: the job ran in tensor mode (its summary says so), no hook error",
             mode == "tensor" and "could not start" not in se, (mode, se[-600:]))
    if reps:
        cfg = json.load(open(os.path.join(away, "rep", reps[-1]))).get("config", {})
        case("the flags reached the job as settings (MEMSHIM_LIMIT from --limit)",
             str(cfg.get("MEMSHIM_LIMIT", {}).get("value", "")).startswith("4"), cfg.get("MEMSHIM_LIMIT"))
    # every rank of a launcher inherits it through the environment: torchrun with 2 ranks
    step("memshim run -- torchrun (2 ranks)", timeout=300)
    rc, so, se = sh([memshim, "run", "--report-dir", "rep-ranks", "--", py, "-m", "torch.distributed.run",
                     "--standalone", "--nproc-per-node", "2", "train.py"], dbl, cwd=away, timeout=300)
    got = sorted(os.listdir(os.path.join(away, "rep-ranks"))) if os.path.isdir(os.path.join(away, "rep-ranks")) else []
    case("memshim run -- torchrun --nproc-per-node 2: both ranks write their reports (rank0 and rank1 summaries)",
         rc == 0 and [f for f in got if f.endswith("-summary.json") and "-rank0-" in f]
         and [f for f in got if f.endswith("-summary.json") and "-rank1-" in f], (rc, got, se[-600:]))
    probe = ("import os, sys, torch\ntry:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
             "from memshim import _torch as mt\nprint('PROBE', os.environ['LD_PRELOAD'], mt.state.tensor)")
    rc, so, se = sh([memshim, "run", "--", py, "-c", probe], dict(dbl, LD_PRELOAD="libm.so.6"), cwd=away)
    line = [ln for ln in so.splitlines() if ln.startswith("PROBE")]
    if tensor_ok:
        case("memshim run: LD_PRELOAD has the library first, the one already set after it; tensor mode at the first "
             "CUDA use", line == [f"PROBE {lib}:libm.so.6 True"], (so, se[-800:]))
    # A python from another environment (here the one running this test, which has PyTorch but not
    # memshim): no memshim.pth runs there, so memshim/_startup's sitecustomize loads the package by
    # its location.
    other = ("import sys, torch\ntry:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
             "m = sys.modules.get('memshim')\nfrom memshim import _torch as mt\n"
             "print('OTHER', m is not None and m.__file__.startswith(sys.argv[1]), mt.state.tensor)")
    rc, so, se = sh([memshim, "run", "--", sys.executable, "-c", other, venv], dbl, cwd=away)
    line = [ln for ln in so.splitlines() if ln.startswith("OTHER")]
    if tensor_ok:
        case("memshim run with a python of another environment: the hook loads the package from memshim/_startup's "
             "parent, tensor mode at the first CUDA use", line == ["OTHER True True"] and "could not start" not in se,
             (so, se[-800:]))
    rc, so, se = sh([memshim, "run", "--", py, "-I", "-c", "import sys; print('ISO', 'memshim' in sys.modules)"], dbl,
                    cwd=away)
    case("python -I under memshim run: memshim.pth boots the hook", "ISO True" in so, (so, se[-400:]))
    rc, so, se = sh([py, "-c", "import sys; print('PLAIN', 'memshim' in sys.modules)"], dbl, cwd=away)
    case("without memshim run, the venv's python does not load memshim", "PLAIN False" in so, so)
    rc, so, se = sh([memshim, "run", "--limit", "40X", "--", "true"], dbl, cwd=away)
    case("memshim run --limit 40X: a usage error naming MEMSHIM_LIMIT, nothing started",
         rc == 2 and "MEMSHIM_LIMIT" in se and "nothing was started" in se, (rc, se))
    rc, so, se = sh([memshim, "run", "--no-such-flag", "1", "--", "true"], dbl, cwd=away)
    case("memshim run --no-such-flag: exit 2", rc == 2 and "unknown option" in se, se)
    rc, so, se = sh([memshim, "run", "--", "no-such-command-xyz"], dbl, cwd=away)
    case("memshim run of a missing command: exit 127, said", rc == 127 and "command not found" in se, (rc, se))

    # report and replay: the tools, unchanged in what they print
    rc, so, se = sh([memshim, "report", "rep"], venv_path, cwd=away)
    rc2, so2, _ = sh([sys.executable, os.path.join(ROOT, "scripts", "memshim-report"), "rep"], cwd=away)
    case("memshim report prints what scripts/memshim-report prints", rc == 0 and rc2 == 0 and so == so2 and "== run 1" in so,
         (so[:300], so2[:300]))
    rc, so, se = sh([os.path.join(bindir, "memshim-report"), "rep", "--json"], venv_path, cwd=away)
    case("the memshim-report console script works", rc == 0 and json.loads(so)["reports_read"] == 4, se[-300:])
    rc, so, se = sh([memshim, "replay", "--help"], venv_path, cwd=away)
    rc2, so2, _ = sh([os.path.join(BUILD, "memshim-replay"), "--help"], cwd=away)
    case("memshim replay prints what build/memshim-replay prints", rc == rc2 and so == so2 and "usage" in so,
         (so[:200], so2[:200]))

    check_no_jansson(tmp, lib, away)
    if tensor_ok:
        check_glue_mismatch(tmp, site, memshim, py, dbl, away)

    step("pip uninstall memshim", timeout=300)
    rc, so, se = sh([py, "-m", "pip", "uninstall", "-y", "memshim"], cwd=tmp)
    left = sorted(tree(venv) - before)
    case("pip uninstall memshim leaves nothing in the venv", rc == 0 and not left, (left[:10], se[-300:]))
    rc, so, se = sh([py, "-c", "import memshim"], cwd=away)
    case("after uninstall, memshim is gone from the venv's python", rc != 0, so)


def check_no_jansson(tmp, lib, away):
    """libjansson unreachable to every library of the process: an rtld-audit module vetoes it."""
    audit = os.path.join(tmp, "hide_jansson.so")
    rc, so, se = sh(["cc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-o", audit,
                     os.path.join(HERE, "hide_jansson.c")])
    if rc != 0:
        case("the audit module that hides libjansson builds", False, se)
        return
    rc, so, se = sh([sys.executable, "-c", "import ctypes; ctypes.CDLL('libjansson.so.4'); print('FOUND')"],
                    {"LD_AUDIT": audit})
    rc2, so2, _ = sh([sys.executable, "-c", "import ctypes; ctypes.CDLL('libjansson.so.4'); print('FOUND')"])
    if "FOUND" not in so2:
        skip("reports without libjansson", "this machine has no libjansson.so.4 to hide")
        return
    case("the audit module makes libjansson.so.4 unreachable (control: found without it)", "FOUND" not in so, so + se)
    base = {"LD_AUDIT": audit, "LD_LIBRARY_PATH": DOUBLE, "CUDBL_CAPACITY": "8G"}
    r1, r2 = os.path.join(tmp, "nojansson-pkg"), os.path.join(tmp, "nojansson-make")
    rc, so, se = sh([DEMO, "--epochs", "3", "--steps", "2"], dict(base, LD_PRELOAD=lib, MEMSHIM_REPORT_DIR=r1))
    got = sorted(os.listdir(r1)) if os.path.isdir(r1) else []
    case("without libjansson the packaged library writes its reports (3 epochs and a summary), no warning",
         rc == 0 and len(got) == 4 and "jansson" not in se, (rc, got, se[-400:]))
    if got:
        ok = all(json.load(open(os.path.join(r1, f))).get("schema_version") == 2 for f in got)
        case("those reports are complete JSON of schema 2", ok)
    rc, so, se = sh([DEMO, "--epochs", "3", "--steps", "2"],
                    dict(base, LD_PRELOAD=os.path.join(BUILD, "libmemshim.so"), MEMSHIM_REPORT_DIR=r2))
    case("control: the default build (jansson loaded at run time) writes none there and says why in one warning",
         rc == 0 and not os.path.exists(r2) and se.count("libjansson.so.4 not found") == 1, (rc, se[-400:]))
    rc, so, se = sh([os.path.join(os.path.dirname(lib), "memshim-replay"), "--help"], {"LD_AUDIT": audit})
    case("the packaged memshim-replay runs without libjansson", rc == 0 and "usage" in so, se[-300:])


def check_glue_mismatch(tmp, site, memshim, py, dbl, away):
    """A glue built for another PyTorch (as after installing another torch): segment mode, the
    doctor says how to rebuild, `memshim build-glue` rebuilds it."""
    b = load_build_helpers()
    info = b.probe_python(py)
    libdir = os.path.join(site, "memshim", "_lib")
    bi = json.load(open(os.path.join(libdir, "build-info.json")))
    fake = dict(info["torch"], version="0.0.1")
    step("a glue for another PyTorch", timeout=300)
    cmd = b.glue_command(os.path.join(libdir, "torch_glue.cpp"), os.path.join(libdir, "libmemshim_torch.so"), fake,
                         bi["cuda_include"], bi["cuda_include_after"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    case("(setup) a glue built for PyTorch 0.0.1", p.returncode == 0, p.stderr[-500:])
    rc, so, se = sh([memshim, "doctor"], dbl, cwd=away)
    case("memshim doctor: the glue was built for another PyTorch, exit 1, and how to rebuild",
         rc == 1 and "built for PyTorch 0.0.1" in so and "memshim build-glue" in so, (rc, so))
    probe = ("import torch\ntry:\n    torch.empty(1, device='cuda')\nexcept Exception:\n    pass\n"
             "from memshim import _torch as mt\nprint('PROBE', mt.state.tensor)")
    rc, so, se = sh([memshim, "run", "--log", "info", "--", py, "-c", probe], dbl, cwd=away)
    said = [ln for ln in se.splitlines() if "stays in segment mode" in ln]
    case("a job with that glue stays in segment mode and says why (built for 0.0.1, memshim build-glue)",
         "PROBE False" in so and said and "0.0.1" in said[0] and "memshim build-glue" in said[0], (so, se[-600:]))
    step("memshim build-glue", timeout=600)
    rc, so, se = sh([memshim, "build-glue"], dbl, cwd=away, timeout=600)
    case("memshim build-glue rebuilds the glue for the installed PyTorch", rc == 0 and "built" in so, (so, se[-800:]))
    rc, so, se = sh([memshim, "doctor"], dbl, cwd=away)
    case("memshim doctor after build-glue: tensor mode again, exit 0", rc == 0, so)


def main():
    needed_files = [os.path.join(BUILD, "libmemshim.so"), DEMO, os.path.join(DOUBLE, "libcuda.so.1"),
                    os.path.join(BUILD, "memshim-replay")]
    missing = [p for p in needed_files if not os.path.exists(p)]
    if missing:
        skip("the pip package", f"build first (make): missing {missing}")
        finish()
    try:
        import setuptools
        old = tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1)
    except ImportError:
        old = True
    if old:
        skip("the pip package", "setuptools >= 70.1 is not installed (bash scripts/setup.sh installs it)")
        finish()
    with tempfile.TemporaryDirectory(prefix="memshim-pkg-") as tmp:
        check_header_finder(tmp)
        hdr_env, info = wheel_header_env()
        if not hdr_env:
            skip("the wheel-headers route", "PyTorch's nvidia/cu13 headers are not installed here")
        if check_wheel(tmp, hdr_env, info):
            check_venv(tmp, hdr_env, info)
    finish()


if __name__ == "__main__":
    main()
