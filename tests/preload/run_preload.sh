#!/usr/bin/env bash
# run_preload.sh: memshim's LD_PRELOAD integration tests. Runs each program of tests/preload
# (built by `make tests` as $BUILD/tests/preload/NAME) under LD_PRELOAD=$BUILD/libmemshim.so with
# the driver double ($BUILD/double) in the environment it needs, plus the checks on the library
# file itself (its NEEDED list and its exported symbols). Prints one line per program or check,
# and as its LAST line "N passed, N failed": a harness program adds its own counts, a program or
# check without a harness adds one case. Exit status 1 when anything failed.
#
# Environment: BUILD (default build), PRELOAD_TIMEOUT seconds per program (default 60, 300 with
# MSH_SANITIZER; a harness program names a hung test itself after MSH_TEST_TIMEOUT, 50 s),
# MSH_SANITIZER=asan|tsan for sanitizer builds (the sanitizer runtime is preloaded first).

set -u
BUILD=${BUILD:-build}
LIB=$BUILD/libmemshim.so
DBL=$BUILD/double
BIN=$BUILD/tests/preload
TIMEOUT=${PRELOAD_TIMEOUT:-$([ -n "${MSH_SANITIZER:-}" ] && echo 300 || echo 60)}
passed=0
failed=0
TMP=$(mktemp -d "${TMPDIR:-/tmp}/memshim-preload.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

PRELOAD=$(cd "$(dirname "$LIB")" && pwd)/$(basename "$LIB")
case "${MSH_SANITIZER:-}" in
    asan) PRELOAD="$(${CC:-gcc} -print-file-name=libasan.so):$PRELOAD"
          export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} ;;
    tsan) rt=$(${CC:-clang} -print-file-name=libclang_rt.tsan-x86_64.so 2>/dev/null)
          [ -f "$rt" ] && PRELOAD="$rt:$PRELOAD" ;;
esac

ok()   { echo "ok   $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1${2:+: $2}"; failed=$((failed + 1)); }

show_tail() { # FILE: the last lines of a program's output, indented
    [ -s "$1" ] && tail -n 25 "$1" | sed 's/^/    | /'
}

# run_prog CASE PROGRAM [ARGS...] -- runs under preload with extra environment from $ENV_EXTRA
# (an array). Adds the harness' own counts; a crash, timeout or missing summary is a failure.
# PROGRAM NAME.py is tests/preload/NAME.py run by python3 (a CPython process under preload).
run_prog() {
    local name=$1 prog=$2
    shift 2
    local exe=$BIN/$prog out=$TMP/$name.out err=$TMP/$name.err
    local -a cmd=("$exe")
    case "$prog" in *.py) exe=$(dirname "$0")/$prog; cmd=(python3 "$exe") ;; esac
    if [ ! -x "$exe" ] && [ "${cmd[0]}" = "$exe" ]; then
        fail "$name" "$exe not built (make tests)"
        return
    fi
    timeout "$TIMEOUT" env LD_PRELOAD="$PRELOAD" LD_LIBRARY_PATH="$DBL" "${ENV_EXTRA[@]}" \
        "${cmd[@]}" "$@" >"$out" 2>"$err"
    local rc=$?
    local summary
    summary=$(grep -E '[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
    if [ -z "$summary" ]; then
        fail "$name" "no summary (exit $rc$([ $rc = 124 ] && echo ', timed out'))"
        show_tail "$out"; show_tail "$err"
        return
    fi
    local p f s
    p=$(sed -E 's/^(.* )?([0-9]+) passed.*/\2/' <<<"$summary")
    f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$summary")
    s=$(sed -nE 's/.* ([0-9]+) skipped.*/\1/p' <<<"$summary")
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$f" -gt 0 ] || [ $rc -ne 0 ]; then
        [ "$f" -eq 0 ] && failed=$((failed + 1))
        echo "FAIL $name ($p passed, $f failed${s:+, $s skipped}; exit $rc)"
        grep -E '^(FAIL|skip)' "$out" | sed 's/^/    /'
        show_tail "$err"
    else
        echo "ok   $name ($p passed${s:+, $s skipped})"
        grep -E '^skip' "$out" | sed 's/^/    /'
    fi
}

# ---- (6) the library's NEEDED list: glibc only (a missing dependency would kill every job) ----
if [ ! -f "$LIB" ]; then
    fail "library" "$LIB not built"
else
    bad=$(readelf -d "$LIB" | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' |
          grep -vE '^(libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|ld-linux[-a-z0-9_.]*\.so\.[0-9]+|libasan\.so\.[0-9]+|libubsan\.so\.[0-9]+|libtsan\.so\.[0-9]+)$')
    if [ -z "$bad" ]; then ok "needed_glibc_only"; else fail "needed_glibc_only" "NEEDED: $(echo $bad)"; fi

    # ---- (7) exported symbols: only the hooks and memshim_* -----------------------------------
    hooks="cudaMalloc cudaFree cudaMemGetInfo cudaMallocAsync cudaFreeAsync cudaMallocAsync_ptsz
           cudaFreeAsync_ptsz cudaGetDriverEntryPoint cudaGetDriverEntryPoint_ptsz
           cudaGetDriverEntryPointByVersion cudaGetDriverEntryPointByVersion_ptsz
           cuMemAlloc_v2 cuMemFree_v2 cuMemGetInfo_v2 cuMemAllocAsync cuMemFreeAsync
           cuMemAllocAsync_ptsz cuMemFreeAsync_ptsz cuMemCreate cuMemRelease cuMemMap cuMemUnmap
           cuGetProcAddress cuGetProcAddress_v2 cudaStreamDestroy cudaPointerGetAttributes
           cudaIpcGetMemHandle cuStreamDestroy cuStreamDestroy_v2 cuMemGetAddressRange_v2
           cuPointerGetAttribute cuPointerGetAttributes cuIpcGetMemHandle
           cudaDeviceEnablePeerAccess cudaStreamBeginCapture cudaStreamBeginCapture_ptsz
           cudaStreamEndCapture cudaStreamEndCapture_ptsz cuCtxEnablePeerAccess
           cuStreamBeginCapture_v2 cuStreamBeginCapture_v2_ptsz cuStreamEndCapture cuStreamEndCapture_ptsz
           cuStreamBeginCapture cuStreamBeginCapture_ptsz cuStreamBeginCaptureToGraph
           cuStreamBeginCaptureToGraph_ptsz cudaStreamBeginCaptureToGraph cudaStreamBeginCaptureToGraph_ptsz dlsym"
    exported=$(nm -D --defined-only "$LIB" | awk '$2 != "A" {print $3}' | sed 's/@.*//' | sort -u)
    extra=""
    for s in $exported; do
        case " $(echo $hooks) " in *" $s "*) continue ;; esac
        case "$s" in memshim_*) continue ;; esac
        case "${MSH_SANITIZER:-}" in asan|tsan) case "$s" in __*|_*san*) continue ;; esac ;; esac
        extra="$extra $s"
    done
    missing=""
    for s in $hooks; do grep -qx "$s" <<<"$exported" || missing="$missing $s"; done
    if [ -z "$extra$missing" ]; then ok "exports_hooks_only"
    else fail "exports_hooks_only" "${extra:+unexpected:$extra}${missing:+ missing:$missing}"; fi
fi

# ---- (1) interception, (8) driver pass-through and accounting, (9) _ptsz, (10) threads --------
ENV_EXTRA=(MEMSHIM_LOG=warn)
run_prog intercept intercept
mkdir -p "$TMP/reports"
ENV_EXTRA=(MEMSHIM_REPORT_DIR="$TMP/reports")
run_prog driverapi driverapi
ENV_EXTRA=()
run_prog ptsz ptsz
run_prog threads threads

# ---- (3) lookups; (2) off mode, where the same lookups must be untouched -----------------------
ENV_EXTRA=()
run_prog lookups lookups
ENV_EXTRA=(MEMSHIM_MODE=off EXPECT_OFF=1)
run_prog lookups_off lookups
run_prog offmode offmode

# ---- issues 27, 31 and 32: every function memshim exports or substitutes leaves the caller's
# device, context, stack, capture mode and last error as the real CUDA would, from every thread
# state, on two and on three devices (one more holds the capture the second pass keeps open)
ENV_EXTRA=(CUDBL_DEVICES=3)
run_prog caller_state caller_state
ENV_EXTRA=(CUDBL_DEVICES=4)
run_prog caller_state_3_devices caller_state

# ---- MEMSHIM_LIMIT as seen by cudaMemGetInfo / cuMemGetInfo_v2 -------------------------------
ENV_EXTRA=(CUDBL_CAPACITY=2G MEMSHIM_LIMIT=256M EXPECT_TOTAL_MIB=256)
run_prog meminfo_limit_bytes meminfo_limit
ENV_EXTRA=(CUDBL_CAPACITY=2G MEMSHIM_LIMIT=0.5 EXPECT_TOTAL_MIB=1024)
run_prog meminfo_limit_fraction meminfo_limit
# issue 31: a limit at or above the device is none (the driver's own figures, no page mode)
ENV_EXTRA=(CUDBL_CAPACITY=2G MEMSHIM_LIMIT=100G EXPECT_NO_LIMIT=1)
run_prog meminfo_limit_above_device meminfo_limit
ENV_EXTRA=(CUDBL_CAPACITY=2G MEMSHIM_LIMIT=1 EXPECT_NO_LIMIT=1)
run_prog meminfo_limit_whole_device meminfo_limit
# issue 27: what free says can be allocated, and (under a limit) no more, in every combination
# of defragmentation, empty-cache policy, limit, spill and mode, on a 1 GiB device
for lim in none 256M 0.25; do
    for defrag in 1 0; do
        for ec in oom never; do
            for spill in off host; do
                for mode in segment tensor; do
                    ENV_EXTRA=(CUDBL_CAPACITY=1G MEMSHIM_DEFRAG=$defrag MEMSHIM_EMPTY_CACHE=$ec MEMSHIM_SPILL=$spill
                               MEMSHIM_LOG=error EXPECT_TOTAL_MIB=1024)
                    [ "$lim" != none ] && ENV_EXTRA+=(MEMSHIM_LIMIT=$lim LIMITED=1 EXPECT_TOTAL_MIB=256)
                    [ "$defrag" = 0 ] && [ "$ec" = never ] && ENV_EXTRA+=(CACHE_NOT_COUNTED=1)
                    [ "$mode" = tensor ] && ENV_EXTRA+=(TENSOR_MODE=1)
                    [ "$spill" = host ] && ENV_EXTRA+=(SPILL_ON=1)
                    run_prog "meminfo_truth_limit-${lim}_defrag-${defrag}_ec-${ec}_spill-${spill}_${mode}" meminfo_truth
                done
            done
        done
    done
done
# issue 25: with no MEMSHIM_LIMIT, a memory fraction alone caps what cudaMemGetInfo reports
ENV_EXTRA=(CUDBL_CAPACITY=2G)
run_prog meminfo_fraction_only meminfo_limit

# ---- found by review: the GC step's own frees, and cuMemFree of another device's block ----------
ENV_EXTRA=(MEMSHIM_LIMIT=8M MEMSHIM_LOG=error)
run_prog gc_reentry gc_reentry
ENV_EXTRA=(CUDBL_DEVICES=2)
run_prog multidev_free multidev_free
run_prog free_ordering free_ordering
ENV_EXTRA=()
run_prog driver_oom driver_oom
ENV_EXTRA=(CUDBL_CAPACITY=8G MEMSHIM_LOG=error)
run_prog oom_fast oom_fast
ENV_EXTRA=()

# ---- issue 8: peers, streams that go away, address ranges, legacy IPC, cudaFree ---------------
ENV_EXTRA=(CUDBL_DEVICES=2)
run_prog peer_copy peer_copy
ENV_EXTRA=(CUDBL_DEVICES=3 MEMSHIM_LIMIT=64M)
run_prog peer_grants_owner_only peer_grants pages_are_granted_to_the_owner_only_until_a_peer_is_enabled
run_prog peer_grants_driver peer_grants the_driver_call_and_its_entry_point_grant_too
ENV_EXTRA=(CUDBL_DEVICES=3 MEMSHIM_LIMIT=8M)
run_prog peer_record_stream peer_grants record_stream_with_a_stream_of_another_device
ENV_EXTRA=()
run_prog stream_destroy stream_destroy
run_prog ranges ranges
ENV_EXTRA=(MEMSHIM_LOG=warn)
run_prog ipc ipc
# the refusal names memshim and the setting that avoids it, once
n=$(grep -c 'memshim\[[0-9]*\]: warning: cudaIpcGetMemHandle.*memshim.s pool.*MEMSHIM_MODE=off' "$TMP/ipc.err")
if [ "$n" = 1 ]; then ok "ipc_log_names_memshim_and_the_setting"
else fail "ipc_log_names_memshim_and_the_setting" "$n matching lines"; show_tail "$TMP/ipc.err"; fi
ENV_EXTRA=(MEMSHIM_MODE=off EXPECT_OFF=1)
run_prog ipc_off ipc
ENV_EXTRA=()
run_prog free_release free_release
ENV_EXTRA=(MEMSHIM_EMPTY_CACHE=never EXPECT_KEEP=1)
run_prog free_release_never free_release
ENV_EXTRA=(TENSOR_MODE=1 EXPECT_KEEP=1)
run_prog free_release_tensor_mode free_release
ENV_EXTRA=(MEMSHIM_GC=threshold)
run_prog gc_threshold_cost gc_threshold_cost
ENV_EXTRA=()
run_prog capture_reuse capture_reuse
# issue 31: memshim_overhead.synchronizes equal to the double's counts, runtime synchronizes included
mkdir -p "$TMP/sync-segment" "$TMP/sync-tensor"
ENV_EXTRA=(MEMSHIM_REPORT_DIR="$TMP/sync-segment" MEMSHIM_REPORT_FORMAT=json)
run_prog sync_ledger_segment sync_ledger
ENV_EXTRA=(MEMSHIM_REPORT_DIR="$TMP/sync-tensor" MEMSHIM_REPORT_FORMAT=json TENSOR_MODE=1)
run_prog sync_ledger_tensor sync_ledger
# issue 31: a request refused before any driver work leaves its OOM files to the watcher thread,
# and they are written even when the program ends right after the refusal
mkdir -p "$TMP/oomthread" "$TMP/oomthread-exit"
ENV_EXTRA=(CUDBL_CAPACITY=1G MEMSHIM_LIMIT=64M MEMSHIM_LOG=error MEMSHIM_REPORT_DIR="$TMP/oomthread"
           MEMSHIM_SNAPSHOT="$TMP/oomthread/snap.pickle")
run_prog oom_thread oom_thread
ENV_EXTRA=(CUDBL_CAPACITY=1G MEMSHIM_LIMIT=64M MEMSHIM_LOG=error MEMSHIM_REPORT_DIR="$TMP/oomthread-exit"
           MEMSHIM_SNAPSHOT="$TMP/oomthread-exit/snap.pickle" EXIT_AT_ONCE=1)
run_prog oom_thread_exit oom_thread
ENV_EXTRA=(CUDBL_CAPACITY=1G MEMSHIM_LIMIT=64M MEMSHIM_LOG=error)
run_prog oom_thread_no_reports oom_thread
# issue 31: the docs' "never" claims that only a program around memshim can count (no malloc for
# the pool's own memory, no fsync at an epoch close)
mkdir -p "$TMP/never"
ENV_EXTRA=(CUDBL_CAPACITY=8G MEMSHIM_REPORT_DIR="$TMP/never")
run_prog never_calls never_calls
# SLOW_WATCHER: the watcher is still writing when the program ends (the end waits for it)
mkdir -p "$TMP/oomthread-slow"
ENV_EXTRA=(CUDBL_CAPACITY=1G MEMSHIM_LIMIT=64M MEMSHIM_LOG=error MEMSHIM_REPORT_DIR="$TMP/oomthread-slow"
           MEMSHIM_SNAPSHOT="$TMP/oomthread-slow/snap.pickle" EXIT_AT_ONCE=1 SLOW_WATCHER=1)
run_prog oom_thread_exit_slow oom_thread
for d in oomthread-exit oomthread-slow; do
    if [ -f "$TMP/$d/snap-oom0000.pickle" ] && ls "$TMP"/$d/memshim-*-oom0000.json >/dev/null 2>&1 &&
        python3 -c 'import json,glob,sys; r=json.load(open(glob.glob(sys.argv[1] + "/memshim-*-oom0000.json")[0])); \
sys.exit(0 if r["last_oom"]["case"] == "larger_than_device" else 1)' "$TMP/$d"; then
        ok "oom_thread_written_at_exit $d (a refusal right before the end still gets its OOM report and snapshot)"
    else
        fail "oom_thread_written_at_exit $d" "$(ls "$TMP/$d" | tr '\n' ' ')"
    fi
done
ENV_EXTRA=()
# issue 31: every route that begins a capture is seen before the next allocation on its stream
run_prog capture_routes capture_routes
# issue 24: a warm training step's driver calls, reports and the snapshot ring on
mkdir -p "$TMP/step-reports"
ENV_EXTRA=(MEMSHIM_REPORT_DIR="$TMP/step-reports" MEMSHIM_SNAPSHOT="$TMP/step-snapshot.pickle" MEMSHIM_LOG=info)
run_prog step_costs step_costs
# MEMSHIM_LOG=info: one line at exit with the three largest costs of memshim's own driver calls,
# and the summary report carries them (memshim_overhead)
if grep -qE "info: exit: memshim's driver calls, largest costs: cu[A-Za-z]+ [0-9]+ calls [0-9.]+ ms" "$TMP/step_costs.err" &&
    python3 -c 'import json,glob,sys; r=[json.load(open(f)) for f in glob.glob(sys.argv[1] + "/*summary*.json")]; \
sys.exit(0 if r and all(x["memshim_overhead"]["driver_calls"].get("cuEventRecord", {}).get("count", 0) >= 20 for x in r) else 1)' \
        "$TMP/step-reports"; then
    ok "step_costs_overhead_line (MEMSHIM_LOG=info names the largest driver costs; the summary counts the event records)"
else
    fail "step_costs_overhead_line" "no cost line at exit, or no memshim_overhead in the summary report"
    grep "exit:" "$TMP/step_costs.err" | sed 's/^/    | /'
fi
# ... and its system calls: none between the markers step_costs makes around its warm steps (two
# getppid calls on the allocating thread), with reports and the snapshot ring on
if command -v strace >/dev/null 2>&1 && strace -f -o /dev/null true >/dev/null 2>&1; then
    timeout "$TIMEOUT" env LD_PRELOAD="$PRELOAD" LD_LIBRARY_PATH="$DBL" MEMSHIM_REPORT_DIR="$TMP/step-reports" \
        MEMSHIM_SNAPSHOT="$TMP/step-snapshot.pickle" strace -f -o "$TMP/step.strace" "$BIN/step_costs" >/dev/null 2>&1
    # (a marker, or any call, that another thread's call interrupts in strace's output is two
    # lines: "getppid( <unfinished ...>" and "<... getppid resumed>": each call counts once)
    counts=$(awk '/ getppid\(/ { if (!(($1) in open)) { open[$1] = 1; n[$1] = 0; next }
                                 printf "%d ", n[$1]; delete open[$1]; next }
                 /<\.\.\. [a-z_0-9]+ resumed>/ { next }
                 { for (p in open) if ($1 == p) n[p]++ }' "$TMP/step.strace")
    if [ "$(echo $counts | wc -w)" -ne 2 ]; then
        fail "step_costs_strace" "expected two marked windows, found: '$counts'"
    elif [ "$counts" = "0 0 " ]; then
        ok "step_costs_strace (no system call on the allocating thread in 40 warm steps, 1760 allocations and frees)"
    else
        fail "step_costs_strace" "system calls in the marked windows (no capture pool, capture pool alive): $counts"
        grep -v getppid "$TMP/step.strace" | tail -5 | sed 's/^/    | /'
    fi
else
    echo "skip step_costs_strace (strace missing or not permitted here)"
fi
# issue 30: memshim's share of the allocating threads' time stays within 0..1 with four busy threads
# (path seconds over the wall time alone, the figure before, is above 1 there), and names them
for nt in 1 4; do
    mkdir -p "$TMP/share-$nt"
    ENV_EXTRA=(MEMSHIM_REPORT_DIR="$TMP/share-$nt" MEMSHIM_LATENCY_SAMPLE=1 THREADS=$nt)
    run_prog "threads_share_$nt" threads_share
    if python3 -c 'import json,glob,sys
r=[json.load(open(f)) for f in glob.glob(sys.argv[1] + "/*summary*.json")]
o=r[0]["memshim_overhead"] if len(r) == 1 else {}
ok = o.get("threads") == int(sys.argv[2]) and o.get("share_of_wall") is not None and 0 < o["share_of_wall"] <= 1
print(o.get("threads"), o.get("share_of_wall"), o.get("path_seconds"))
sys.exit(0 if ok else 1)' "$TMP/share-$nt" "$nt" > "$TMP/share-$nt.out" 2>&1; then
        ok "threads_share_${nt}_summary (memshim_overhead.threads $nt, 0 < share_of_wall <= 1: $(cat "$TMP/share-$nt.out"))"
    else
        fail "threads_share_${nt}_summary" "threads, share_of_wall, path_seconds: $(tail -3 "$TMP/share-$nt.out")"
    fi
done
ENV_EXTRA=()
mkdir -p "$TMP/epoch-reports"
ENV_EXTRA=(MEMSHIM_EPOCH=seconds MEMSHIM_EPOCH_SECONDS=0.5 MEMSHIM_REPORT_DIR="$TMP/epoch-reports"
           REPORTS="$TMP/epoch-reports")
run_prog epoch_seconds_race epoch_seconds_race

# ---- (4) fork while allocating (with a trace: the child must not keep it open) ---------------
ENV_EXTRA=(MEMSHIM_TRACE_FILE="$TMP/fork-trace.txt" TRACE="$TMP/fork-trace.txt")
run_prog fork fork
ENV_EXTRA=()
run_prog trace_fd0 trace_fd0
mkdir -p "$TMP/fork-logs"
ENV_EXTRA=(MEMSHIM_LOG=info MEMSHIM_LOG_FILE="$TMP/fork-logs/log-%p.txt" LOGDIR="$TMP/fork-logs")
run_prog log_fork log_fork.py

# ---- (4b) a run a signal ends keeps its reports (issue 16): SIGTERM, SIGINT, SIGHUP, chaining --
ENV_EXTRA=()
run_prog interrupt interrupt

# ---- (5) no usable driver: untouched, quiet ----------------------------------------------------
# quiet_case NAME EXPECT_RC COMMAND...: runs twice with LD_PRELOAD (environment from $ENV_EXTRA).
# At the default log level memshim must write nothing at all; with MEMSHIM_LOG=info at most one
# info line (the echo of the user's own MEMSHIM_LOG setting aside) and nothing at warning or
# error level. Both runs must exit with EXPECT_RC.
quiet_case() {
    local name=$1 want=$2
    shift 2
    local out=$TMP/$name.out err=$TMP/$name.err err2=$TMP/$name.err2
    timeout "$TIMEOUT" env LD_PRELOAD="$PRELOAD" "${ENV_EXTRA[@]}" "$@" >"$out" 2>"$err"
    local rc=$?
    timeout "$TIMEOUT" env LD_PRELOAD="$PRELOAD" MEMSHIM_LOG=info "${ENV_EXTRA[@]}" "$@" \
        >>"$out" 2>"$err2"
    local rc2=$?
    local quiet warns infos
    quiet=$(grep -c '^memshim\[' "$err")
    warns=$(grep -cE '^memshim\[[0-9]+\]: (warning|error):' "$err2")
    infos=$(grep -E '^memshim\[[0-9]+\]: info:' "$err2" | grep -vc 'set by environment')
    if [ $rc -eq "$want" ] && [ $rc2 -eq "$want" ] && [ "$quiet" -eq 0 ] && [ "$warns" -eq 0 ] &&
       [ "$infos" -le 1 ]; then
        ok "$name"
    else
        fail "$name" "exit $rc/$rc2 (want $want); default level: $quiet memshim lines;" \
             "info level: $warns warning/error lines, $infos info lines"
        show_tail "$out"; show_tail "$err"; show_tail "$err2"
    fi
}
mkdir -p "$TMP/empty"
if [ -x "$BIN/nodriver" ]; then
    ENV_EXTRA=(LD_LIBRARY_PATH="$DBL" CUDBL_FAIL_INIT=1)
    quiet_case nodriver_init_fails_cudamalloc 0 "$BIN/nodriver"
    quiet_case nodriver_init_fails_cpu_only 0 "$BIN/nodriver" cpu
    # The program finds libcudart through its RUNPATH; the runtime's dlopen("libcuda.so.1") and
    # memshim's both fail.
    ENV_EXTRA=(LD_LIBRARY_PATH="$TMP/empty")
    if readelf -d "$BIN/nodriver" | grep -q 'NEEDED.*\[libcuda\.so'; then
        echo "skip nodriver_no_libcuda_cudamalloc (this build links nodriver to libcuda directly)"
    else
        quiet_case nodriver_no_libcuda_cudamalloc 0 "$BIN/nodriver"
    fi
    quiet_case nodriver_no_libcuda_cpu_only 0 "$BIN/nodriver" cpu
else
    fail "nodriver" "$BIN/nodriver not built (make tests)"
fi
# A program with no CUDA at all, where libcuda.so.1 cannot even be found.
ENV_EXTRA=(LD_LIBRARY_PATH="$TMP/empty")
quiet_case nodriver_plain_shell 0 /bin/sh -c 'echo hello >/dev/null'

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
