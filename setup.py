"""The pip build of memshim (docs/install.md): setuptools runs the Makefile, the one build
definition of the C and C++ parts, and packages what it builds with the Python side.

`pip install .` / `pip wheel .` build, with make into build/pip/make:
  - libmemshim.so with jansson linked in (JANSSON=static: reports on machines without
    libjansson; NEEDED still glibc only), memshim-replay and memshim-options;
  - libmemshim_torch.so, the C++ glue, for the PyTorch of the interpreter pip installs for (found
    by running that interpreter with -I: pip's build isolation hides the target environment from
    the build's sys.path, not from the interpreter). No PyTorch there: no glue, memshim runs in
    segment mode until `memshim build-glue`;
with the CUDA headers of CUDA_HOME, a toolkit, or PyTorch's CUDA wheels (memshim/_build.py).

The wheel (py3-none-<platform>: native code, no Python extension) holds, in site-packages:
  memshim/            the Python package (hooks/python/memshim), with memshim.cli and memshim.report
  memshim/_lib/       libmemshim.so, libmemshim_torch.so, memshim-replay, memshim-options, the
                      glue's source (for `memshim build-glue`), build-info.json, jansson's license
  memshim/_startup/   sitecustomize.py: the directory the library's constructor puts first on
                      PYTHONPATH (shim/torch.c); Lightning needs no entry point (the hook adds
                      memshim's callback through Lightning's callback connector, printing nothing)
  memshim.pth         boots the hook where PYTHONPATH is ignored (python -I/-E), only in processes
                      with libmemshim in LD_PRELOAD
Every file is in the wheel's RECORD, so `pip uninstall memshim` removes them all.
"""
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import setuptools
from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel  # older setuptools, with the wheel package
    except ImportError:
        raise SystemExit(f"memshim: setuptools {setuptools.__version__} is too old to build a wheel without the "
                         "`wheel` package (a venv's bundled setuptools is): `pip install -U 'setuptools>=70.1'` in "
                         "this environment, or build without --no-build-isolation") from None

HERE = os.path.dirname(os.path.abspath(__file__))
PIP_BUILD = os.path.join("build", "pip")            # everything the pip build writes (make clean removes it)
MAKE_BUILD = os.path.join(PIP_BUILD, "make")
PYDIR = os.path.join("hooks", "python")
PTH_LINE = ("import os; 'libmemshim' in os.environ.get('LD_PRELOAD', '') and "
            "__import__('memshim._boot')._boot.from_pth()\n")
JANSSON_LICENSES = ("/usr/share/doc/libjansson-dev/copyright", "/usr/share/doc/libjansson4/copyright")


def version():
    with open(os.path.join(HERE, "shim", "memshim.h"), encoding="utf-8") as f:
        m = re.search(r'#define MEMSHIM_VERSION "([^"]+)"', f.read())
    if not m:
        raise SystemExit("memshim: cannot read MEMSHIM_VERSION from shim/memshim.h")
    return m.group(1)


def helpers():
    """memshim/_build.py, loaded by its path: the package is not importable during its own build."""
    spec = importlib.util.spec_from_file_location("memshim_build_helpers", os.path.join(HERE, PYDIR, "memshim",
                                                                                       "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def say(msg):
    print(f"memshim build: {msg}", flush=True)


def build_native(lib_dir):
    """make the native parts for the target interpreter and copy them into lib_dir."""
    h = helpers()
    target = h.probe_python(sys.executable)
    inc, after, where = h.find_cuda_headers(target["site_dirs"])
    if not inc:
        raise SystemExit(f"memshim build: error: {where}.\nmemshim needs the CUDA headers (cuda.h, "
                         "cuda_runtime_api.h) to build: set CUDA_HOME to a CUDA toolkit, or install PyTorch's CUDA "
                         "wheels (they carry the headers) into this environment first.")
    torch = target.get("torch")
    say(f"CUDA headers: {where}")
    say(f"PyTorch: {torch['version'] + ' (the glue is built for it)' if torch else 'none'}"
        + ("" if torch else f" ({target.get('torch_error', '')}): no glue; tensor mode needs `memshim build-glue`"))
    jobs = [] if "-j" in os.environ.get("MAKEFLAGS", "") else [f"-j{min(8, os.cpu_count() or 1)}"]
    cmd = ["make", *jobs, "-C", HERE, f"BUILD={MAKE_BUILD}", "JANSSON=static",
           f"PYTHON={shlex.quote(sys.executable)} -I", f"CUDA_INC={inc}", f"CUDA_INC_AFTER={' '.join(after)}",
           "native"]
    # make tracks files, not flags: another compiler or other CUDA headers than the last pip
    # build's start from a clean build directory.
    config = json.dumps({"cc": os.environ.get("CC"), "cxx": os.environ.get("CXX"), "inc": inc, "after": after})
    stamp = os.path.join(HERE, MAKE_BUILD, "pip-config.json")
    try:
        with open(stamp, encoding="utf-8") as f:
            same = f.read() == config
    except OSError:
        same = False
    if not same:
        shutil.rmtree(os.path.join(HERE, MAKE_BUILD), ignore_errors=True)
        os.makedirs(os.path.join(HERE, MAKE_BUILD))
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(config)
    # The glue must match the target interpreter's PyTorch, which may differ from the last pip
    # build's (another venv) while being older on disk: always regenerate its flags.
    for stale in ("torch-flags.mk", "libmemshim_torch.so"):
        try:
            os.unlink(os.path.join(HERE, MAKE_BUILD, stale))
        except FileNotFoundError:
            pass
    say(" ".join(shlex.quote(c) for c in cmd))
    subprocess.run(cmd, check=True)
    out = os.path.join(HERE, MAKE_BUILD)
    os.makedirs(lib_dir, exist_ok=True)
    parts = ["libmemshim.so", "memshim-replay", "memshim-options"]
    if torch:
        if not os.path.exists(os.path.join(out, "libmemshim_torch.so")):
            raise SystemExit("memshim build: error: PyTorch is importable but make built no libmemshim_torch.so")
        parts.append("libmemshim_torch.so")
    for name in parts:
        shutil.copy2(os.path.join(out, name), os.path.join(lib_dir, name))
        os.chmod(os.path.join(lib_dir, name), 0o755)
    shutil.copy2(os.path.join(HERE, "shim", "torch_glue.cpp"), os.path.join(lib_dir, "torch_glue.cpp"))
    lic = next((p for p in JANSSON_LICENSES if os.path.isfile(p)), None)
    if lic:
        shutil.copy2(lic, os.path.join(lib_dir, "LICENSE.jansson"))
    else:
        say("warning: jansson's license text not found (libjansson-dev's copyright file); the wheel carries "
            "jansson without it")
    info = {"memshim": version(), "torch": torch["version"] if torch else None,
            "torch_error": None if torch else target.get("torch_error"), "python": sys.executable,
            "cuda_headers": where, "cuda_include": inc, "cuda_include_after": after, "jansson": "static"}
    with open(os.path.join(lib_dir, "build-info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
        f.write("\n")


class BuildPy(build_py):
    """The Python package, then the native parts, the start-up directory and the .pth beside it."""

    def run(self):
        if getattr(self, "editable_mode", False):
            raise SystemExit("memshim: editable installs (pip install -e) are not supported: the library and its "
                             "Python hook must sit together; use `pip install .` (or make, for the source tree)")
        super().run()
        pkg = os.path.join(self.build_lib, "memshim")
        build_native(os.path.join(pkg, "_lib"))
        startup = os.path.join(pkg, "_startup")
        shutil.rmtree(startup, ignore_errors=True)
        os.makedirs(startup)
        shutil.copy2(os.path.join(HERE, PYDIR, "sitecustomize.py"), startup)
        with open(os.path.join(self.build_lib, "memshim.pth"), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)


class NativeDistribution(Distribution):
    """Native code: a platform wheel, its files installed to platlib (the wheel's root)."""

    def has_ext_modules(self):
        return True


class Wheel(bdist_wheel):
    """Native code but no Python extension: one wheel serves every Python 3 on the platform."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


os.makedirs(os.path.join(HERE, PIP_BUILD), exist_ok=True)
setup(
    version=version(),
    distclass=NativeDistribution,
    cmdclass={"build_py": BuildPy, "bdist_wheel": Wheel},
    options={"build": {"build_base": os.path.join(PIP_BUILD, "setuptools")},
             "egg_info": {"egg_base": PIP_BUILD}},
)
