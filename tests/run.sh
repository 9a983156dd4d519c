#!/usr/bin/env bash
# Runs memshim's test suites and adds up their "N passed, N failed" lines.
#   tests/run.sh          every suite on $BUILD (default build), then the sanitizer builds
#   tests/run.sh quick    only the suites on $BUILD
#   tests/run.sh stress   only the stress and pool tests (used for the TSan build)
# The last line is the total: "N passed, N failed, N skipped". Exit 1 when anything failed.
set -u
cd "$(dirname "$0")/.."
BUILD="${BUILD:-build}"
what="${1:-all}"
P=0; F=0; S=0
FAILED_SUMMARY=""

add_counts() { # suite-name exit-code output
    local name="$1" rc="$2" out="$3" line p f s
    line=$(printf '%s\n' "$out" | grep -Eo '[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?' | tail -1)
    p=0; f=0; s=0
    if [ -n "$line" ]; then
        p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
        f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
        s=$(echo "$line" | grep -Eo '[0-9]+ skipped' | grep -Eo '[0-9]+' || echo 0)
    fi
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    if [ -z "$line" ] && [ "$rc" -eq 0 ]; then p=1; fi
    P=$((P + p)); F=$((F + f)); S=$((S + s))
    printf '%-34s %4d passed, %d failed, %d skipped\n' "$name" "$p" "$f" "$s"
    if [ "$f" -ne 0 ]; then
        printf '%s\n' "$out" | grep -vE '^ok ' | tail -40 | sed 's/^/    | /'
        # again at the end, briefly: a CI log is often read from its tail
        FAILED_SUMMARY+="$(printf '%s: ' "$name"; printf '%s\n' "$out" | grep -E '^FAIL|failed:|CHECK|Error|error:' | head -3 | cut -c1-300 | tr '\n' ' ')"$'\n'
    fi
}

run_suite() { # name command...
    local name="$1"; shift
    local out rc
    out=$(timeout 900 "$@" 2>&1); rc=$?
    add_counts "$name" "$rc" "$out"
}

unit_suites() { # build-dir label [filter]
    local b="$1" label="$2" filter="${3:-}"
    for t in "$b"/tests/test_*; do
        [ -x "$t" ] || continue
        case "$(basename "$t")" in $filter*) ;; *) [ -n "$filter" ] && continue ;; esac
        run_suite "$label $(basename "$t")" "$t"
    done
}

case "$what" in
stress)
    unit_suites "$BUILD" "[${MSH_SANITIZER:-plain}]" test_stress
    unit_suites "$BUILD" "[${MSH_SANITIZER:-plain}]" test_pool
    unit_suites "$BUILD" "[${MSH_SANITIZER:-plain}]" test_lock
    ;;
quick|all)
    unit_suites "$BUILD" "[${MSH_SANITIZER:-plain}]"
    if [ -z "${MSH_SANITIZER:-}" ]; then
        # issue 19: the folders are floors (hooks -> shim -> report -> policy), files stay small
        run_suite "layers (includes run one way, sizes)" python3 tests/layers/check_layers.py
        run_suite "layers (the check catches a breach)" python3 tests/layers/test_check_layers.py
        # issue 25: the doubles' lookups have the real driver's signature at every version
        run_suite "doubles' ABI (cudaTypedefs.h)" env BUILD="$BUILD" python3 tests/cudadouble/test_abi.py
        [ -f tests/preload/run_preload.sh ] && run_suite "preload (LD_PRELOAD + double)" env BUILD="$BUILD" bash tests/preload/run_preload.sh
        run_suite "replay (CLI, traces, targets)" env BUILD="$BUILD" bash tests/replay/run_replay.sh
        run_suite "replay (torch models vs traces)" env BUILD="$BUILD" python3 tests/replay/test_models_traces.py
        run_suite "replay --check (pool invariants)" env BUILD="$BUILD" python3 tests/replay/check_traces.py
        run_suite "reports (figures vs ground truth)" env BUILD="$BUILD" python3 tests/reports/test_report_truth.py
        run_suite "reports (step figures by hand)" env BUILD="$BUILD" python3 tests/reports/test_step_figures.py
        run_suite "demo (main job, reports)" env BUILD="$BUILD" bash tests/replay/run_demo.sh
        run_suite "promises (every documented promise has a test)" env BUILD="$BUILD" python3 tests/promises/check_promises.py
        run_suite "promises (never claims, by program)" env BUILD="$BUILD" python3 tests/promises/test_never.py
        run_suite "report tool (memshim-report)" env BUILD="$BUILD" python3 tests/report_tool/test_report_tool.py
        run_suite "report tool (advice rules, charts)" env BUILD="$BUILD" python3 tests/report_tool/test_advice.py
        run_suite "report page in Chromium (errors, charts, widths)" env BUILD="$BUILD" python3 tests/report_tool/test_html_browser.py
        # issue 32: identity as each launcher sets it, and the runs memshim-report makes of it
        run_suite "report tool (identity per launcher)" env BUILD="$BUILD" python3 tests/report_tool/test_launchers.py
        run_suite "report tool (oracle, random report sets)" env BUILD="$BUILD" python3 tests/report_tool/test_oracle.py
        run_suite "python GC step (CPython + double)" env BUILD="$BUILD" python3 tests/replay/test_pygc.py
        run_suite "allocation sites (CPython + double)" env BUILD="$BUILD" python3 tests/replay/test_sites.py
        run_suite "spill to host (CPython + double)" env BUILD="$BUILD" python3 tests/replay/test_spill_job.py
        run_suite "PyTorch snapshots (CPython + double)" env BUILD="$BUILD" python3 tests/replay/test_snapshot.py
        run_suite "reliability" env BUILD="$BUILD" bash tests/reliability/run_reliability.sh
        run_suite "pytorch (allocator API; GPU parts)" env BUILD="$BUILD" python3 tests/gpu/test_torch.py
        run_suite "GPU bench plan (search, budget, rows)" env BUILD="$BUILD" python3 tests/gpu/test_bench_plan.py
        run_suite "pytorch on CPU (hook, tensor mode, epochs)" env BUILD="$BUILD" python3 tests/torch/test_torch_cpu.py
        run_suite "pytorch allocator settings (PYTORCH_ALLOC_CONF)" env BUILD="$BUILD" python3 tests/torch/test_alloc_conf.py
        run_suite "differential (PyTorch's own rules)" env BUILD="$BUILD" python3 tests/differential/test_differential.py
        run_suite "differential (fallbacks as PyTorch decides)" env BUILD="$BUILD" python3 tests/differential/test_fallbacks.py
        run_suite "differential (snapshot fields as PyTorch's)" env BUILD="$BUILD" python3 tests/differential/test_snapshot_fields.py
        run_suite "differential (reports past the rings, hosts)" env BUILD="$BUILD" python3 tests/differential/test_report_rings.py
        run_suite "scenarios (real jobs: signals, chdir, loops, torchrun)" env BUILD="$BUILD" python3 tests/scenarios/run_scenarios.py
        run_suite "pip package (venv, memshim command)" env BUILD="$BUILD" python3 tests/package/test_package.py
        run_suite "GPU check --dry-run (every step, double)" bash -c \
            'bash tests/gpu/run_gpu_checks.sh --prepare >/tmp/memshim-gpu-prepare.log 2>&1 || { tail -20 /tmp/memshim-gpu-prepare.log; exit 1; }; env -u OUT bash tests/gpu/run_gpu_checks.sh --dry-run'
        # issue 5: each parser fuzzed "a minute or so" in CI (all targets at once, 2 cores)
        run_suite "fuzz (libFuzzer, ${FUZZ_SECONDS:-60} s per target)" env FUZZ_SECONDS="${FUZZ_SECONDS:-60}" \
            bash tests/fuzz/run_fuzz.sh
    fi
    if [ "$what" = all ] && [ -z "${MSH_SANITIZER:-}" ]; then
        echo "== AddressSanitizer + UndefinedBehaviorSanitizer build"
        if make -s BUILD=build-asan SAN=address,undefined OPT=-O1 tests >/tmp/memshim-asan-build.log 2>&1; then
            ASAN_OPTIONS=detect_leaks=1 unit_suites build-asan "[asan]"
            run_suite "[asan] preload (LD_PRELOAD + double)" env BUILD=build-asan MSH_SANITIZER=asan \
                ASAN_OPTIONS=detect_leaks=0 bash tests/preload/run_preload.sh
        else
            add_counts "asan build" 1 "$(tail -20 /tmp/memshim-asan-build.log)"
        fi
        echo "== ThreadSanitizer build (clang)"
        if make -s BUILD=build-tsan CC=clang SAN=thread OPT=-O1 tests >/tmp/memshim-tsan-build.log 2>&1; then
            TSAN_OPTIONS=halt_on_error=1 unit_suites build-tsan "[tsan]" test_stress
            TSAN_OPTIONS=halt_on_error=1 unit_suites build-tsan "[tsan]" test_pool
            TSAN_OPTIONS=halt_on_error=1 unit_suites build-tsan "[tsan]" test_lock
        else
            add_counts "tsan build" 1 "$(tail -20 /tmp/memshim-tsan-build.log)"
        fi
    fi
    ;;
*) echo "usage: tests/run.sh [all|quick|stress]" >&2; exit 2 ;;
esac
if [ -n "$FAILED_SUMMARY" ]; then
    echo "== failed (each suite's output is above, after its line):"
    printf '%s' "$FAILED_SUMMARY" | sed 's/^/  /'
fi
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ]
