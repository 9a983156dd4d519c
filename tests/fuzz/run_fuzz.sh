#!/usr/bin/env bash
# Builds and runs every libFuzzer target of memshim for a bounded time.
#
#   tests/fuzz/run_fuzz.sh              every target, FUZZ_SECONDS each (default 30), in parallel
#   FUZZ_SECONDS=600 tests/fuzz/run_fuzz.sh fuzz_profiler     one target, longer
#
# Targets are the files tests/fuzz/fuzz_*.c; each one is compiled with
# clang -fsanitize=fuzzer,address,undefined together with the sources listed for it in
# target_sources() below (a target without a list fails, so a new one cannot be skipped quietly;
# a listed target whose file does not exist yet is reported as skipped). Each runs from a copy of
# its seed corpus tests/fuzz/corpus/<name without fuzz_>/ in a temporary directory (the repository
# is never written), with tests/fuzz/<name>.dict when there is one. A target passes when libFuzzer
# exits 0 (no crash, leak, sanitizer report, timeout or out-of-memory within the time). Crashing
# inputs are kept in /tmp/memshim-fuzz-artifacts/<target>/ and named in the output: add them to
# the unit tests as regressions.
#
# Environment: FUZZ_SECONDS (default 30), FUZZ_PARALLEL (default 1: all targets at once; 0: one
# after the other), CC_FUZZ (default clang), CUDA_HOME (default /usr/local/cuda).
# Output: one line per target, then "N passed, N failed" (tests/run.sh adds these up).
set -u
cd "$(dirname "$0")/../.."

FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
FUZZ_PARALLEL="${FUZZ_PARALLEL:-1}"
CC_FUZZ="${CC_FUZZ:-clang}"
CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
FLAGS="-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -D_GNU_SOURCE \
-Ishim -Ishim/record -Ipolicy -Ipolicy/base -Ireport -Ireport/trace -Ireport/replay/models -I$CUDA_INC"
ARTIFACTS=/tmp/memshim-fuzz-artifacts

# Targets known to this script, whether or not their file exists yet.
KNOWN="fuzz_pickle fuzz_text fuzz_profiler fuzz_options fuzz_conf fuzz_drvcost"

# The sources each target links besides its own file. They are compiled once per list into a
# static archive, so a target pulls in only the objects it reaches (the trace readers reach the
# allocator models, which reach the pool; the options parser reaches only the log).
trace_sources() { # as the Makefile's libmemshim_trace.a + libmemshim_core.a
    ls report/trace/*.c report/replay/models/*.c shim/*.c shim/record/*.c policy/*.c policy/pool/*.c policy/base/*.c report/*.c 2>/dev/null | tr '\n' ' '
}
target_sources() { # target -> its source list, by name
    case "$1" in
    fuzz_pickle|fuzz_text|fuzz_profiler|fuzz_drvcost) echo "trace $(trace_sources)" ;;
    fuzz_options|fuzz_conf) echo "options policy/base/options.c policy/base/log.c policy/base/paths.c" ;;
    *) return 1 ;;
    esac
}
target_libs() { # target -> system libraries
    case "$1" in
    fuzz_pickle|fuzz_text|fuzz_profiler|fuzz_drvcost) echo "-lz -ldl -lm -pthread" ;;
    *) echo "-lm -pthread" ;;
    esac
}
target_args() { # target -> extra libFuzzer options
    case "$1" in
    fuzz_profiler) echo "-max_len=8192" ;;
    *) echo "-max_len=4096" ;;
    esac
}

if ! command -v "$CC_FUZZ" >/dev/null 2>&1; then
    echo "run_fuzz: $CC_FUZZ not found (scripts/setup.sh installs clang)" >&2
    echo "0 passed, 1 failed"
    exit 1
fi
if ! [[ "$FUZZ_SECONDS" =~ ^[0-9]+$ ]] || [ "$FUZZ_SECONDS" -lt 1 ]; then
    echo "run_fuzz: FUZZ_SECONDS='$FUZZ_SECONDS' must be a whole number of seconds" >&2
    echo "0 passed, 1 failed"
    exit 1
fi

# name -> file, for every target file present; then the known ones that are absent
declare -A file_of=()
for f in tests/fuzz/fuzz_*.c; do
    [ -f "$f" ] || continue
    n=$(basename "$f" .c)
    if [ -n "${file_of[$n]:-}" ]; then
        echo "run_fuzz: two files for $n: ${file_of[$n]} and $f" >&2
    fi
    file_of[$n]="$f"
done
names=$( { printf '%s\n' $KNOWN; printf '%s\n' "${!file_of[@]}"; } | sort -u)
if [ $# -gt 0 ]; then names=$(printf '%s\n' "$@"); fi

work=$(mktemp -d /tmp/memshim-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
P=0; F=0

run_one() { # name -> writes $work/<name>.result (one line) and .log
    local n="$1" f="${file_of[$1]:-}" src libs dict corpus bin rc
    local res="$work/$n.result" log="$work/$n.log"
    if [ -z "$f" ]; then
        echo "skip $n (no tests/fuzz/$n.c yet)" >"$res"
        return
    fi
    if ! src=$(target_sources "$n"); then
        echo "FAIL $n ($f has no source list: add it to target_sources in tests/fuzz/run_fuzz.sh)" >"$res"
        return
    fi
    libs=$(target_libs "$n")
    bin="$work/$n"
    local set="${src%% *}" lib="$work/lib-${src%% *}.a"
    if [ ! -f "$lib" ]; then
        echo "FAIL $n (its sources did not build:)" >"$res"
        tail -15 "$work/lib-$set.log" | sed 's/^/    | /' >>"$res"
        return
    fi
    # shellcheck disable=SC2086
    if ! "$CC_FUZZ" $FLAGS "$f" "$lib" -o "$bin" $libs >"$log" 2>&1; then
        echo "FAIL $n (does not build; $CC_FUZZ said:)" >"$res"
        tail -15 "$log" | sed 's/^/    | /' >>"$res"
        return
    fi
    corpus="$work/corpus-$n"
    mkdir -p "$corpus" "$ARTIFACTS/$n"
    local seeds="tests/fuzz/corpus/${n#fuzz_}"
    [ -d "$seeds" ] && cp -r "$seeds/." "$corpus/" 2>/dev/null
    dict=""
    [ -f "tests/fuzz/${n#fuzz_}.dict" ] && dict="-dict=tests/fuzz/${n#fuzz_}.dict"
    local nseeds
    nseeds=$(find "$corpus" -type f | wc -l)
    # shellcheck disable=SC2046,SC2086
    ASAN_OPTIONS="detect_leaks=1:abort_on_error=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
        timeout -k 10 $((FUZZ_SECONDS + 120)) "$bin" -max_total_time="$FUZZ_SECONDS" -timeout=10 \
        -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$ARTIFACTS/$n/" \
        $(target_args "$n") $dict "$corpus" >"$log" 2>&1
    rc=$?
    local runs cov
    runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)
    cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+')
    if [ "$rc" -eq 0 ]; then
        printf 'ok   %-16s %ss, %s runs, cov %s, %s seeds\n' "$n" "$FUZZ_SECONDS" "${runs:-?}" "${cov:-?}" \
            "$nseeds" >"$res"
    else
        printf 'FAIL %-16s exit %d after %s runs; artifacts in %s/%s/\n' "$n" "$rc" "${runs:-?}" \
            "$ARTIFACTS" "$n" >"$res"
        grep -E 'ERROR|SUMMARY|Test unit written|runtime error|deadly signal|Timeout|out-of-memory' "$log" |
            head -12 | sed 's/^/    | /' >>"$res"
    fi
}

build_lib() { # set-name sources... -> $work/lib-<set>.a (compiled with the fuzzer's sanitizers)
    local set="$1" o objs=() rc=0
    shift
    mkdir -p "$work/obj-$set"
    for s in "$@"; do
        o="$work/obj-$set/$(echo "$s" | tr / _).o"
        objs+=("$o")
        # shellcheck disable=SC2086
        "$CC_FUZZ" ${FLAGS/-fsanitize=fuzzer,/-fsanitize=fuzzer-no-link,} -c "$s" -o "$o" &
    done
    for p in $(jobs -p); do wait "$p" || rc=1; done
    [ "$rc" -eq 0 ] && ar rcs "$work/lib-$set.a" "${objs[@]}"
}
built=" "
for n in $names; do
    [ -n "${file_of[$n]:-}" ] || continue
    src=$(target_sources "$n") || continue
    set="${src%% *}"
    case "$built" in *" $set "*) continue ;; esac
    built="$built$set "
    # shellcheck disable=SC2086
    build_lib $src >"$work/lib-$set.log" 2>&1
done

pids=()
for n in $names; do
    if [ "$FUZZ_PARALLEL" = 0 ]; then
        run_one "$n"
        cat "$work/$n.result"
    else
        run_one "$n" &
        pids+=($!)
    fi
done
for p in "${pids[@]}"; do wait "$p"; done
for n in $names; do
    [ "$FUZZ_PARALLEL" = 0 ] || cat "$work/$n.result"
    case "$(head -c 4 "$work/$n.result")" in
    "ok  ") P=$((P + 1)) ;;
    FAIL) F=$((F + 1)) ;;
    esac
done
echo "$P passed, $F failed"
[ "$F" -eq 0 ]
