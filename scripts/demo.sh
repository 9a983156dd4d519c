#!/usr/bin/env bash
# The main job, with per-epoch JSON reports in memreport/ and a summary table.
# With a GPU and PyTorch: a small real PyTorch training script (tests/demo/train_torch.py) under
# LD_PRELOAD=libmemshim.so and nothing else: memshim becomes PyTorch's allocator (tensor mode) and
# detects the epochs. Otherwise: memshim-train-demo (a training-loop allocation pattern through
# the CUDA runtime) under LD_PRELOAD, on the CUDA driver double (build/double) without a GPU.
# DEMO=c forces the C workload. Arguments go to the workload.
set -euo pipefail
BUILD="${BUILD:-build}"
cd "$(dirname "$0")/.."

report_dir="${MEMSHIM_REPORT_DIR:-memreport}"
if [ "${DEMO:-auto}" != c ] && [ -e /dev/nvidiactl ] && [ -e "$BUILD/libmemshim_torch.so" ] &&
    python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "demo: a GPU and PyTorch are here: a real PyTorch training script, memshim in tensor mode"
    rm -rf "$report_dir"
    mkdir -p "$report_dir"
    echo "demo: LD_PRELOAD=$BUILD/libmemshim.so MEMSHIM_REPORT_DIR=$report_dir python3 tests/demo/train_torch.py $*"
    LD_PRELOAD="$BUILD/libmemshim.so" MEMSHIM_REPORT_DIR="$report_dir" \
    MEMSHIM_REPORT_FORMAT="${MEMSHIM_REPORT_FORMAT:-json-pretty}" MEMSHIM_LOG="${MEMSHIM_LOG:-info}" \
        python3 tests/demo/train_torch.py "$@"
    echo
    echo "demo: reports written to $report_dir/:"
    ls -1 "$report_dir"
    echo
    python3 scripts/memshim-report "$report_dir"
    exit 0
fi
echo "demo: no GPU with PyTorch here (or DEMO=c): the C training-loop workload"

if [ -e /dev/nvidiactl ] && ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1'; then
    echo "demo: a GPU driver is present: using the real driver"
    libpath="$BUILD/double-runtime-only"
    mkdir -p "$libpath"
    ln -sf "$(realpath "$BUILD/double/libcudart.so.13")" "$libpath/libcudart.so.13"
else
    echo "demo: no GPU driver here: using the CUDA driver double ($BUILD/double/libcuda.so.1)"
    libpath="$BUILD/double"
    export CUDBL_CAPACITY="${CUDBL_CAPACITY:-8G}"
fi

rm -rf "$report_dir"
mkdir -p "$report_dir"
trace="$report_dir/train-demo.trace"
echo "demo: LD_PRELOAD=$BUILD/libmemshim.so MEMSHIM_REPORT_DIR=$report_dir MEMSHIM_TRACE_FILE=$trace $BUILD/memshim-train-demo $*"
LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
LD_PRELOAD="$BUILD/libmemshim.so" \
MEMSHIM_REPORT_DIR="$report_dir" MEMSHIM_REPORT_FORMAT="${MEMSHIM_REPORT_FORMAT:-json-pretty}" \
MEMSHIM_TRACE_FILE="$trace" MEMSHIM_LOG="${MEMSHIM_LOG:-info}" \
    "$BUILD/memshim-train-demo" "$@"

echo
echo "demo: reports written to $report_dir/:"
ls -1 "$report_dir"
echo
python3 scripts/memshim-report "$report_dir"

echo
echo "demo: the same allocation stream (from $trace) under PyTorch's own allocator, modelled:"
"$BUILD/memshim-replay" --compare "$trace"
