"""memshim's build helpers, shared by the pip build (setup.py loads this file by its path) and
`memshim build-glue`: where the CUDA headers are, what the installed PyTorch needs to build the C++
glue against it, and that build.

CUDA headers, first complete set wins (docs/install.md):
  1. CUDA_HOME (or CUDA_PATH) when set;
  2. a toolkit: /usr/local/cuda, then /usr/local/cuda-* (newest first);
  3. the headers PyTorch's CUDA wheels install in site-packages: nvidia/cu13/include (CUDA 13
     wheels), nvidia/cuda_runtime/include (CUDA 12 wheels). Those sets can lack the compiler's
     crt/host_defines.h that cuda_runtime_api.h includes (torch 2.15's nvidia/cu13/include does:
     it comes with nvidia-cuda-crt, which PyTorch does not require); it is then taken from another
     directory that has it (triton/backends/nvidia/include, which triton ships whole), searched
     after the first (-idirafter).
Standard library only; nothing here imports torch (that runs in the target interpreter).
"""
import glob
import json
import os
import shlex
import subprocess
import sys

NEED = ("cuda.h", "cuda_runtime_api.h", "driver_types.h")
CRT = os.path.join("crt", "host_defines.h")
WHEEL_INCS = ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include")
CRT_INCS = ("nvidia/cu13/include", "nvidia/cuda_nvcc/include", "nvidia/cuda_crt/include",
            "triton/backends/nvidia/include")


def _complete(d):
    return all(os.path.isfile(os.path.join(d, h)) for h in NEED)


def _version_key(path):
    tail = os.path.basename(path.rstrip("/")).split("-")[-1]
    try:
        return tuple(int(x) for x in tail.split("."))
    except ValueError:
        return ()


def find_cuda_headers(site_dirs=(), env=None, toolkits=None):
    """(include_dir, [after_dirs], where) for a complete set of CUDA headers, or (None, [], why)."""
    env = os.environ if env is None else env
    tried = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home:
            inc = os.path.join(home, "include")
            got = _with_crt(inc, site_dirs)
            if got:
                return got[0], got[1], f"{var}={home}"
            return None, [], (f"{var}={home} has no complete CUDA headers in {inc} (need "
                              f"{', '.join(NEED)} and {CRT})")
    if toolkits is None:
        toolkits = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), key=_version_key, reverse=True)
    for tk in toolkits:
        inc = os.path.join(tk, "include")
        tried.append(inc)
        got = _with_crt(inc, ())
        if got:
            return got[0], got[1], f"the CUDA toolkit in {tk}"
    for sd in site_dirs:
        for rel in WHEEL_INCS:
            inc = os.path.join(sd, rel)
            tried.append(inc)
            got = _with_crt(inc, site_dirs)
            if got:
                return got[0], got[1], f"PyTorch's CUDA wheels ({inc}" + (
                    f", {CRT} from {got[1][0]})" if got[1] else ")")
    return None, [], "no CUDA headers in " + ", ".join(tried or ["(nowhere to look)"])


def _with_crt(inc, site_dirs):
    if not _complete(inc):
        return None
    if os.path.isfile(os.path.join(inc, CRT)):
        return inc, []
    for sd in site_dirs:
        for rel in CRT_INCS:
            d = os.path.join(sd, rel)
            if os.path.realpath(d) != os.path.realpath(inc) and os.path.isfile(os.path.join(d, CRT)):
                return inc, [d]
    return None


# Run in the interpreter whose PyTorch the glue is for (with -I: pip's build isolation hides the
# target environment from the build, not from its interpreter).
_PROBE = r"""
import json, os, site, sys, sysconfig
out = {"python": sys.executable, "site_dirs": []}
for d in list(getattr(site, "getsitepackages", lambda: [])()) + [sysconfig.get_paths()["purelib"],
                                                                  sysconfig.get_paths()["platlib"]]:
    if d not in out["site_dirs"]:
        out["site_dirs"].append(d)
try:
    import torch
    from torch.utils import cpp_extension
    out["torch"] = {"version": torch.__version__,
                    "include": [p for p in cpp_extension.include_paths() if os.path.isdir(p)],
                    "libdir": os.path.join(os.path.dirname(torch.__file__), "lib"),
                    "cxx11_abi": int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))}
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
"""


def probe_python(python=None):
    """What the interpreter `python` (default: this one) has: its site dirs and its PyTorch."""
    python = python or sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE")}
    p = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        return {"python": python, "site_dirs": [], "torch_error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def glue_command(src, out, torch_info, cuda_inc, cuda_after, cxx=None):
    """The compile command of the C++ glue, as the Makefile's rule for libmemshim_torch.so."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    t = torch_info
    cmd = shlex.split(cxx) + ["-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra"]
    cmd += [f"-I{p}" for p in t["include"]] + [f"-D_GLIBCXX_USE_CXX11_ABI={t['cxx11_abi']}", f"-I{cuda_inc}"]
    for d in cuda_after:
        cmd += ["-idirafter", d]
    cmd += [f'-DMSH_TORCH_VERSION="{t["version"]}"', "-o", out, src, f"-L{t['libdir']}",
            f"-Wl,-rpath,{t['libdir']}", "-lc10", "-ldl"]
    return cmd


def build_glue(src, out_dir, python=None, log=print):
    """Build libmemshim_torch.so for the PyTorch of `python` into out_dir (atomically: a failed
    build leaves the old glue). Returns (ok, message)."""
    info = probe_python(python)
    if "torch" not in info:
        return False, f"{info['python']} cannot import torch ({info.get('torch_error', 'unknown error')})"
    inc, after, where = find_cuda_headers(info["site_dirs"])
    if not inc:
        return False, f"CUDA headers not found: {where} (set CUDA_HOME to a CUDA toolkit)"
    final = os.path.join(out_dir, "libmemshim_torch.so")
    tmp = os.path.join(out_dir, f".libmemshim_torch.so.{os.getpid()}.tmp")
    cmd = glue_command(src, tmp, info["torch"], inc, after)
    log(f"memshim: building the glue for PyTorch {info['torch']['version']} (CUDA headers: {where})")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run the compiler {cmd[0]} ({e})"
    if p.returncode != 0:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False, "the compiler failed:\n" + (p.stderr.strip()[-2000:] or p.stdout.strip()[-2000:])
    os.replace(tmp, final)
    return True, f"built {final} for PyTorch {info['torch']['version']}"
