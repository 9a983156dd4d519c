#!/usr/bin/env python3
"""Print the make variables for the PyTorch C++ glue (shim/torch_glue.cpp) and the PyTorch test
extension, for the Makefile to include: TORCH_OK := 1 with the installed PyTorch's include paths,
library directory, C++ ABI flag and version; TORCH_OK := 0 with the reason when PyTorch cannot be
imported. The file names torch's version.py as its own prerequisite, so installing another PyTorch
regenerates it. Usage: torch_flags.py OUTPUT-PATH"""
import os
import sys
import sysconfig

out = sys.argv[1] if len(sys.argv) > 1 else "torch-flags.mk"
try:
    import torch
    from torch.utils import cpp_extension
except Exception as e:  # noqa: BLE001 - any failure means: no glue
    reason = f"{type(e).__name__}: {e}".replace("\n", " ").replace("$", "$$")[:200]
    print("TORCH_OK := 0")
    print(f"TORCH_WHY := python3 cannot import torch ({reason})")
    sys.exit(0)
incs = [p for p in cpp_extension.include_paths() if os.path.isdir(p)]
abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
print("TORCH_OK := 1")
print(f"TORCH_VERSION := {torch.__version__}")
print(f"TORCH_CXXFLAGS := {' '.join('-I' + p for p in incs)} -D_GLIBCXX_USE_CXX11_ABI={abi}")
print(f"TORCH_LIBDIR := {libdir}")
print(f"TORCH_PYINC := {sysconfig.get_paths()['include']}")
print(f"TORCH_PYEXT := {sysconfig.get_config_var('EXT_SUFFIX') or '.so'}")
print(f"{out}: {os.path.join(os.path.dirname(torch.__file__), 'version.py')}")
