/*
 * harness.h: the project's minimal C test harness (one header, no dependencies).
 *
 * A test file defines TEST(name) { ... } functions and ends with TEST_MAIN(). Each test runs in
 * order; CHECK() records a failure with file:line and the expression and lets the test go on,
 * REQUIRE() returns from the test. The binary prints one line per test and ends with the line
 * "N passed, N failed" (plus ", N skipped"), which tests/run.sh adds up. SKIP("why") marks a
 * test skipped with its reason. Exit status is 1 when any test failed.
 */
#ifndef MSH_HARNESS_H
#define MSH_HARNESS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static inline int th_main(const char *prog, int argc, char **argv)
{
    int passed = 0, failed = 0, skipped = 0;
    const char *only = argc > 1 ? argv[1] : NULL;
    for (int i = 0; i < th_ncases; i++) {
        if (only && strcmp(only, th_cases[i].name) != 0) continue;
        th_failed_now = 0;
        th_skipped_now = 0;
        th_cases[i].fn();
        if (th_failed_now) {
            failed++;
            printf("FAIL %s\n", th_cases[i].name);
        } else if (th_skipped_now) {
            skipped++;
            printf("skip %s (%s)\n", th_cases[i].name, th_skip_reason);
        } else {
            passed++;
            printf("ok   %s\n", th_cases[i].name);
        }
        fflush(stdout);
    }
    printf("%s: %d passed, %d failed, %d skipped\n", prog, passed, failed, skipped);
    return failed ? 1 : 0;
}
#define TEST_MAIN() \
    int main(int argc, char **argv) { return th_main(__FILE__, argc, argv); }

#endif
