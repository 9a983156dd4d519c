#!/usr/bin/env bash
# run_reliability.sh: memshim's reliability suites (issue 5, docs/reliability.md). Builds the
# helper programs of tests/reliability/ into $BUILD/reliability/ (with the flags of the Makefile;
# needs `make` to have built the library, the tools and the doubles), then runs, each printing
# what it tried:
#   fault_injection.py  every driver call failing, N = 1..(calls of a clean run), end to end
#   concurrency.py      8 threads x streams, fork while allocating, signal storms
#   soak.py             one million operations replayed from ../shared/traces (skips without them)
#   bad_input.py        every MEMSHIM_* variable set to bad values under the demo
#   files.py            file flags and modes, planted links and FIFOs, read-only and full disks
#   test_fuzz_regress   inputs the option fuzzers found, as regression tests
# and prints the total last: "N passed, N failed, N skipped". Exit status 1 when anything failed.
# Environment: BUILD (default build), RELI_ONLY=name to run one suite, RELI_STRICT=1 to count
# known issues (reported, in code this suite does not own) as failures instead of skips.
set -u
cd "$(dirname "$0")/../.."
BUILD="${BUILD:-build}"
OUT="$BUILD/reliability"
CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
CC="${CC:-gcc}"
CFLAGS="-O2 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fPIC -pthread \
-Ishim -Ipolicy -Ipolicy/base -Itests -Itests/cudadouble -I$CUDA_INC"
P=0; F=0; S=0
mkdir -p "$OUT"

build() { # output source extra-args... (rebuilt when any source, header or the library is newer)
    local out=$1 src=$2 dep
    shift 2
    for dep in "$src" "$@" tests/cudadouble/cudbl.h tests/harness.h tests/fuzz/options_checks.h policy/base/msh.h \
               "$BUILD/libmemshim.so"; do
        case "$dep" in -*) continue ;; esac
        if [ ! -f "$out" ] || [ "$dep" -nt "$out" ]; then
            $CC $CFLAGS -o "$out" "$src" "$@" || return 1
            return 0
        fi
    done
}
DBL="-L$BUILD/double -Wl,-rpath,\$ORIGIN/../double"
ok_build=1
build "$OUT/reli-workload" tests/reliability/fi_workload.c $DBL -lcudart -lcuda -ldl || ok_build=0
build "$OUT/reli-concurrency" tests/reliability/concurrency.c $DBL -lcudart -lcuda -ldl || ok_build=0
build "$OUT/reli-soak" tests/reliability/soak.c $DBL -lcudart -lcuda -ldl || ok_build=0
build "$OUT/libreli-callcount.so" tests/reliability/callcount.c -shared $DBL -lcuda || ok_build=0
build "$OUT/libreli-openspy.so" tests/reliability/openspy.c -shared || ok_build=0
build "$OUT/libreli-poolcheck.so" tests/reliability/poolcheck.c -shared -ldl || ok_build=0
build "$OUT/test_fuzz_regress" tests/reliability/test_fuzz_regress.c policy/base/options.c policy/base/log.c policy/base/paths.c -lm || ok_build=0
if [ "$ok_build" = 0 ]; then
    echo "FAIL building the reliability helpers"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi

suite() { # name command...
    local name=$1
    shift
    [ -n "${RELI_ONLY:-}" ] && [ "$RELI_ONLY" != "$name" ] && return
    echo "== $name"
    local t0=$SECONDS out rc
    out=$("$@" 2>&1)
    rc=$?
    printf '%s\n' "$out"
    local line p=0 f=0 s=0
    line=$(printf '%s\n' "$out" | grep -Eo '[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?' | tail -1)
    if [ -n "$line" ]; then
        p=$(sed -E 's/^([0-9]+) passed.*/\1/' <<<"$line")
        f=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")
        s=$(grep -Eo '[0-9]+ skipped' <<<"$line" | grep -Eo '[0-9]+' || echo 0)
    fi
    [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
    P=$((P + p)); F=$((F + f)); S=$((S + s))
    echo "-- $name: $p passed, $f failed, $s skipped in $((SECONDS - t0)) s"
}

export BUILD
suite fault_injection python3 tests/reliability/fault_injection.py
suite concurrency python3 tests/reliability/concurrency.py
suite soak python3 tests/reliability/soak.py
suite bad_input python3 tests/reliability/bad_input.py
suite files python3 tests/reliability/files.py
suite fuzz_regress "$OUT/test_fuzz_regress"
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ]
