#!/usr/bin/env bash
# The whole GPU check in a few minutes, for a session that has a device (see README). Builds,
# runs the suite that needs no GPU as a sanity check, then the real-driver checks:
#   1. the main job (demo) on the real driver, reports and summary table;
#   2. memshim-replay --device on a small real snapshot (the pool over the real VMM API);
#   3. PyTorch (tests/gpu/test_torch.py, under 8 minutes): LM and ViT without memshim, in segment
#      and tensor mode, largest batch under 24 GiB, OOM, CUDA graphs, torch.compile, DDP; JSON
#      results in $OUT/gpu-torch.json; then `make demo` (a real PyTorch script in tensor mode);
#   4. the replay bench for comparison of the simulated and the real device.
# Writes everything under $OUT (default ./gpu-out) so the results come back.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-checks.log") 2>&1
echo "== $(date -u) $(hostname)"
nvidia-smi || echo "(nvidia-smi missing)"
bash scripts/setup.sh --with-torch || echo "setup failed (continuing with what is there)"
make -j"$(nproc)" all tests || exit 1
echo "== 1. demo on the real driver"
DEMO=c MEMSHIM_REPORT_DIR="$OUT/memreport" timeout 300 bash scripts/demo.sh --epochs 3 --steps 20 --scale 4
echo "== 2. replay on the real device"
t=$(find ../shared/traces -name 'memory_forward_fp32_128.pickle' 2>/dev/null | head -1)
[ -n "$t" ] && timeout 300 build/memshim-replay --device --json "$t" | tee "$OUT/replay-device.jsonl"
[ -n "$t" ] && build/memshim-replay --json "$t" | tee "$OUT/replay-sim.jsonl"
echo "== 3. PyTorch"
OUT="$OUT" timeout 540 python3 tests/gpu/test_torch.py --json "$OUT/gpu-torch.json" | tee "$OUT/torch.txt"
MEMSHIM_REPORT_DIR="$OUT/memreport-torch" timeout 300 bash scripts/demo.sh 40 | tee "$OUT/demo-torch.txt"
echo "== 4. preload suite on the real driver (no double)"
echo "(the preload suite needs the double's test API; skipped on the real driver)"
echo "== done $(date -u)"
