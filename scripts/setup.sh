#!/usr/bin/env bash
# Install what building and testing memshim needs, only when it is missing (Debian 12).
# Safe to run again: it checks before it installs. Needs root (or sudo) only to install.
#   --with-torch   also pip-install PyTorch (for tests/torch and tests/gpu; about 3.5 GB with its
#                  CUDA libraries) when `import torch` fails, and PyTorch Lightning, transformers and
#                  accelerate (the framework epoch tests) and matplotlib and tensorboard (memshim-report's
#                  optional outputs) when they install; their tests skip without
#   --with-mutants also pip-install universalmutator (`mutate`), which `make mutants` uses for its
#                  generated mutants (tests/mutants/gen_mutants.py); make check does not need it
set -euo pipefail
with_torch=0
with_mutants=0
for a in "$@"; do
    case "$a" in
    --with-torch) with_torch=1 ;;
    --with-mutants) with_mutants=1 ;;
    *) echo "setup: unknown option $a (known: --with-torch, --with-mutants)" >&2; exit 2 ;;
    esac
done

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have gcc || need+=(gcc)
have g++ || need+=(g++)   # the PyTorch glue (libmemshim_torch.so) is C++
have make || need+=(make)
have clang || need+=(clang)
have readelf || need+=(binutils)
have python3 || need+=(python3)
[ -f /usr/include/jansson.h ] || need+=(libjansson-dev)
[ -f /usr/include/zlib.h ] || need+=(zlib1g-dev)
dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || need+=(libclang-rt-14-dev)
have strace || need+=(strace)   # the preload suite counts system calls on the allocation path
# memshim-report's HTML page is tested in a real browser (tests/report_tool/test_html_browser.py)
have chromium || have chromium-browser || need+=(chromium)

if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The report tests check every report against docs/report.schema.json with python3's jsonschema.
if ! python3 -c 'import jsonschema' >/dev/null 2>&1; then
    echo "setup: installing jsonschema for python3 (report schema checks)"
    if [ "$(command -v python3)" = /usr/bin/python3 ]; then
        $([ "$(id -u)" -eq 0 ] || echo sudo) apt-get install -y -qq --no-install-recommends python3-jsonschema >/dev/null
    else
        python3 -m pip install --quiet jsonschema
    fi
fi

# The pip package (pyproject.toml, docs/install.md) builds with setuptools >= 70.1; the package
# test builds it with --no-build-isolation, so it must be installed (no network in that test).
if ! python3 -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' \
        >/dev/null 2>&1; then
    echo "setup: installing setuptools >= 70.1 for python3 (the pip package's build backend)"
    python3 -m pip install --quiet "setuptools>=70.1" || echo "setup: warning: setuptools could not be installed; the pip package test will skip" >&2
fi

cuda_home="${CUDA_HOME:-}"
if [ -z "$cuda_home" ]; then
    for d in /usr/local/cuda /usr/local/cuda-*; do
        [ -f "$d/include/cuda.h" ] && { cuda_home="$d"; break; }
    done
fi
if [ -z "$cuda_home" ] || [ ! -f "$cuda_home/include/cuda.h" ] || [ ! -f "$cuda_home/include/cuda_runtime_api.h" ]; then
    echo "setup: error: CUDA headers (cuda.h, cuda_runtime_api.h) not found." >&2
    echo "setup: install the NVIDIA CUDA toolkit (only its headers are needed to build memshim)" >&2
    echo "setup: and set CUDA_HOME to it, e.g. CUDA_HOME=/usr/local/cuda-13.0." >&2
    exit 1
fi
if [ "$with_torch" = 1 ] && ! python3 -c 'import torch' >/dev/null 2>&1; then
    echo "setup: installing PyTorch with pip (the tests use its Python-level allocator API)"
    python3 -m pip install --quiet torch || echo "setup: warning: PyTorch could not be installed; its tests will skip" >&2
fi
if [ "$with_torch" = 1 ] && python3 -c 'import torch' >/dev/null 2>&1; then
    # Each alone, so one that fails to install leaves the others; never let pip replace torch.
    for pkg in pytorch-lightning:pytorch_lightning transformers:transformers accelerate:accelerate; do
        if ! python3 -c "import ${pkg#*:}" >/dev/null 2>&1; then
            echo "setup: installing ${pkg%%:*} with pip (framework epoch tests)"
            python3 -m pip install --quiet "${pkg%%:*}" "torch==$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')" \
                || echo "setup: note: ${pkg%%:*} could not be installed; its tests will skip" >&2
        fi
    done
fi
if [ "$with_torch" = 1 ]; then
    # memshim-report's optional parts (their tests skip without them): plots drawn with matplotlib,
    # --tensorboard with TensorBoard's event writer.
    for pkg in matplotlib:matplotlib tensorboard:tensorboard; do
        if ! python3 -c "import ${pkg#*:}" >/dev/null 2>&1; then
            echo "setup: installing ${pkg%%:*} with pip (memshim-report's optional ${pkg%%:*} output)"
            python3 -m pip install --quiet "${pkg%%:*}" || echo "setup: note: ${pkg%%:*} could not be installed; its tests will skip" >&2
        fi
    done
fi
if [ "$with_mutants" = 1 ] && ! command -v mutate >/dev/null 2>&1; then
    echo "setup: installing universalmutator with pip (make mutants: the generated mutants)"
    python3 -m pip install --quiet universalmutator || echo "setup: warning: universalmutator could not be installed; make mutants will say so" >&2
fi
echo "setup: ok (CUDA headers in $cuda_home/include)"
