/*
 * harness.h: the project's minimal C test harness (one header, no dependencies).
 *
 * A test file defines TEST(name) { ... } functions and ends with TEST_MAIN(). Each test runs in
 * order; CHECK() records a failure with file:line and the expression and lets the test go on,
 * REQUIRE() returns from the test. The binary prints one line per test and ends with the line
 * "N passed, N failed" (plus ", N skipped"), which tests/run.sh adds up. SKIP("why") marks a
 * test skipped with its reason. Exit status is 1 when any test failed.
 *
 * A test that hangs must not hang the suite (docs/testing.md): a watchdog thread gives each test
 * MSH_TEST_TIMEOUT seconds (default 50, 250 in sanitizer builds); past that it prints "FAIL <name> (timed out ...)" and
 * the closing line, and ends the process with status 1. A thread, not alarm(): several tests use
 * SIGALRM and setitimer themselves, and a test stuck in a blocked signal or a held lock still
 * gets named. A test that legitimately needs longer says so with TH_SET_TIMEOUT(seconds).
 */
#ifndef MSH_HARNESS_H
#define MSH_HARNESS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void (*th_fn)(void);
struct th_case { const char *name; th_fn fn; };
static struct th_case th_cases[512];
static int th_ncases;
static int th_failed_now, th_skipped_now;
static char th_skip_reason[256];

static inline void th_register(const char *name, th_fn fn)
{
    if (th_ncases < (int)(sizeof th_cases / sizeof th_cases[0]))
        th_cases[th_ncases++] = (struct th_case){name, fn};
}

#define TEST(name)                                                                  \
    static void name(void);                                                         \
    __attribute__((constructor)) static void th_reg_##name(void) { th_register(#name, name); } \
    static void name(void)

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            th_failed_now++;                                                        \
            fprintf(stderr, "    %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
        }                                                                           \
    } while (0)
#define CHECKF(cond, ...)                                                           \
    do {                                                                            \
        if (!(cond)) {                                                              \
            th_failed_now++;                                                        \
            fprintf(stderr, "    %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                           \
            fputc('\n', stderr);                                                    \
        }                                                                           \
    } while (0)
#define REQUIRE(cond)                                                               \
    do {                                                                            \
        if (!(cond)) {                                                              \
            th_failed_now++;                                                        \
            fprintf(stderr, "    %s:%d: REQUIRE(%s) failed\n", __FILE__, __LINE__, #cond); \
            return;                                                                 \
        }                                                                           \
    } while (0)
#define SKIP(...)                                                                   \
    do {                                                                            \
        th_skipped_now = 1;                                                         \
        snprintf(th_skip_reason, sizeof th_skip_reason, __VA_ARGS__);               \
        return;                                                                     \
    } while (0)

/* ---- the watchdog: per-test deadlines ---------------------------------------------------------- */
/* Sanitizer builds run several times slower (TSan: a threaded test of ~5 s takes ~50 s): they get
 * five times the default. The one-minute promise is for the plain build that mutants run on. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define TH_DEFAULT_TIMEOUT 250
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define TH_DEFAULT_TIMEOUT 250
#endif
#endif
#ifndef TH_DEFAULT_TIMEOUT
#define TH_DEFAULT_TIMEOUT 50
#endif
static _Atomic int th_current = -1;            /* index of the running test, -1 between tests */
static _Atomic long long th_deadline_ns;       /* CLOCK_MONOTONIC; 0: no deadline */
static _Atomic long long th_limit_ms;          /* the running test's limit, for the message */
static _Atomic int th_npassed, th_nfailed, th_nskipped;
static double th_timeout_s = TH_DEFAULT_TIMEOUT;
static const char *th_prog;

static inline long long th_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* From inside a test: this test may run `seconds` from now before it counts as hung. */
static inline void th_set_timeout(double seconds)
{
    atomic_store(&th_limit_ms, (long long)(seconds * 1e3));
    atomic_store(&th_deadline_ns, th_now_ns() + (long long)(seconds * 1e9));
}
#define TH_SET_TIMEOUT(seconds) th_set_timeout(seconds)

static inline void th_write_all(int fd, const char *s)
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static inline void *th_watchdog(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        long long dl = atomic_load(&th_deadline_ns);
        int cur = atomic_load(&th_current);
        if (!dl || cur < 0 || th_now_ns() < dl) continue;
        /* What the test printed so far, if stdout is not locked by the hung thread itself. */
        if (ftrylockfile(stdout) == 0) {
            fflush_unlocked(stdout);
            funlockfile(stdout);
        }
        char buf[512];
        snprintf(buf, sizeof buf,
                 "FAIL %s (timed out: still running after %.1f s; a hang? "
                 "MSH_TEST_TIMEOUT sets the limit)\n%s: %d passed, %d failed, %d skipped\n",
                 th_cases[cur].name, atomic_load(&th_limit_ms) / 1e3, th_prog, atomic_load(&th_npassed),
                 atomic_load(&th_nfailed) + 1, atomic_load(&th_nskipped));
        th_write_all(1, buf);
        snprintf(buf, sizeof buf, "harness: test %s hung; the remaining tests were not run\n", th_cases[cur].name);
        th_write_all(2, buf);
        _exit(1);
    }
    return NULL;
}

static inline int th_main(const char *prog, int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;
    th_prog = prog;
    const char *e = getenv("MSH_TEST_TIMEOUT");
    if (e && *e) {
        char *end;
        double v = strtod(e, &end);
        if (*end || !(v > 0) || v > 86400)
            fprintf(stderr, "harness: MSH_TEST_TIMEOUT='%s' is not a number of seconds (0 < s <= 86400); "
                            "using %.0f\n", e, th_timeout_s);
        else th_timeout_s = v;
    }
    pthread_t wd;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&wd, &attr, th_watchdog, NULL))
        fprintf(stderr, "harness: cannot start the watchdog thread; a hung test will not be named\n");
    pthread_attr_destroy(&attr);
    for (int i = 0; i < th_ncases; i++) {
        if (only && strcmp(only, th_cases[i].name) != 0) continue;
        th_failed_now = 0;
        th_skipped_now = 0;
        th_set_timeout(th_timeout_s);
        atomic_store(&th_current, i);
        th_cases[i].fn();
        atomic_store(&th_current, -1);
        atomic_store(&th_deadline_ns, 0);
        if (th_failed_now) {
            atomic_fetch_add(&th_nfailed, 1);
            printf("FAIL %s\n", th_cases[i].name);
        } else if (th_skipped_now) {
            atomic_fetch_add(&th_nskipped, 1);
            printf("skip %s (%s)\n", th_cases[i].name, th_skip_reason);
        } else {
            atomic_fetch_add(&th_npassed, 1);
            printf("ok   %s\n", th_cases[i].name);
        }
        fflush(stdout);
    }
    int failed = atomic_load(&th_nfailed);
    printf("%s: %d passed, %d failed, %d skipped\n", prog, atomic_load(&th_npassed), failed,
           atomic_load(&th_nskipped));
    return failed ? 1 : 0;
}
#define TEST_MAIN() \
    int main(int argc, char **argv) { return th_main(__FILE__, argc, argv); }

#endif
