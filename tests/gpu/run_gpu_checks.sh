#!/usr/bin/env bash
# The GPU check in one go (docs/testing.md, "The GPU check"); the work is tests/gpu/gpu_checks.py.
#   bash tests/gpu/run_gpu_checks.sh --prepare   here: build build-gpu/, the folder a device run carries
#   bash tests/gpu/run_gpu_checks.sh             on the lent GPU machine (build-gpu/ carried): every step
#                                                but the bench on the real driver, under 8 minutes, results
#                                                as JSON in $OUT
#   ... --steps machine,glue,bench [--bench-budget 420]   the bench, alone, with its own budget (a
#                                                row it cannot finish fails it): another device command
#   ... --pack                                   at the end, every result but gpu-checks.json into
#                                                $OUT/gpu-results.tgz (a lent machine returns 8 files)
#   bash tests/gpu/run_gpu_checks.sh --dry-run   here: every step, the bench too, on the driver double (make check)
# Nothing is installed and nothing is fetched: the lent machine has no network.
set -uo pipefail
cd "$(dirname "$0")/../.."
exec python3 tests/gpu/gpu_checks.py "$@"
