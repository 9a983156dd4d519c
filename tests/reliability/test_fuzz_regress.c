/*
 * test_fuzz_regress.c: inputs the option fuzzers (tests/fuzz/fuzz_options.c, fuzz_conf.c) found,
 * kept as regression tests, with the same invariants (tests/fuzz/options_checks.h). Linked with
 * policy/base/options.c, policy/base/log.c and policy/base/paths.c only. A case that shows a known issue in code this suite does
 * not own is skipped with the reason, unless RELI_STRICT=1.
 *
 * Found by the first 60-second runs (2026-11-30):
 *   fuzz_options crash-903f1a48: MEMSHIM_EPOCH_SECONDS=3333333333 (option byte 0x33, then ten 3s) prints as
 *     "3.33333e+09"; read back, that is not a duration, so the default (0) is used.
 *   fuzz_conf crash-2b8fcb6a: MEMSHIM_CONF=...,epoch_seconds:8888988880888888 prints as
 *     "8.88899e+15", same effect.
 *   fuzz_conf crash-cce44b88: MEMSHIM_CONF=limit:0.000000000000000000093 prints as "9.3e-20";
 *     read back, MEMSHIM_LIMIT falls to its default (0, no limit).
 * Cause: policy/base/options.c format_value() prints T_SECONDS, T_FRACTION and T_LIMIT fractions with
 * "%g" (6 significant digits, exponent form for large values), and parse_decimal() accepts no
 * exponent. So reports and `memshim-options --check` can show values that cannot be pasted back,
 * and lose precision (1234567 s shows as 1.23457e+06).
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "msh.h"
#include "../fuzz/options_checks.h"

static int strict(void)
{
    const char *v = getenv("RELI_STRICT");
    return v && strcmp(v, "1") == 0;
}

/* Load envp; return the printed effective value of option `name` (static buffer). */
static const char *printed(char *const *envp, const char *name)
{
    static char val[4200];
    oc_setup();
    oc_log_reset();
    msh_config_load_from(envp);
    oc_check_ranges();
    oc_check_log();
    const char *n, *src;
    for (int i = 0; msh_config_iter(i, &n, val, sizeof val, &src); i++)
        if (strcmp(n, name) == 0) return val;
    return "";
}

static void round_trip(const char *var, const char *value, const char *known)
{
    char first[300], env1[300], env2[400];
    snprintf(env1, sizeof env1, "%s=%s", var, value);
    char *e1[] = {env1, NULL};
    snprintf(first, sizeof first, "%s", printed(e1, var));
    snprintf(env2, sizeof env2, "%s=%s", var, first);
    char *e2[] = {env2, NULL};
    const char *second = printed(e2, var);
    int same = strcmp(first, second) == 0;
    printf("    %s=%s prints '%s'; read back, '%s'\n", var, value, first, second);
    if (!same && known && !strict()) SKIP("%s", known);
    CHECKF(same, "%s=%s printed '%s', read back '%s'", var, value, first, second);
}

#define KNOWN_G "known issue: policy/base/options.c prints durations and fractions with %g (exponent form the parser refuses)"

TEST(fuzz_options_crash_903f1a48_epoch_seconds_exponent)
{
    round_trip("MEMSHIM_EPOCH_SECONDS", "3333333333", KNOWN_G);
}

/* fuzz_options crash-29629218 (make check, 2026-11-30): the decimal parser accumulated digits in
 * a double, so a 17-digit value printed exactly did not read back to the same double. */
TEST(fuzz_options_crash_29629218_seventeen_digit_duration)
{
    round_trip("MEMSHIM_EMPTY_CACHE_IDLE", "99999999000000016", NULL);
    round_trip("MEMSHIM_EPOCH_SECONDS", "99999999899999999", NULL);
}

TEST(fuzz_conf_crash_2b8fcb6a_epoch_seconds_in_conf)
{
    char conf[] = "MEMSHIM_CONF=epocgs_hinal:28888posr1,epoch_seconds:8888988880888888";
    char *e[] = {conf, NULL};
    char first[300], env2[400];
    snprintf(first, sizeof first, "%s", printed(e, "MEMSHIM_EPOCH_SECONDS"));
    snprintf(env2, sizeof env2, "MEMSHIM_CONF=epoch_seconds:%s", first);
    char *e2[] = {env2, NULL};
    const char *second = printed(e2, "MEMSHIM_EPOCH_SECONDS");
    printf("    epoch_seconds:8888988880888888 prints '%s'; read back, '%s'\n", first, second);
    if (strcmp(first, second) != 0 && !strict()) SKIP("%s", KNOWN_G);
    CHECK(strcmp(first, second) == 0);
}

TEST(fuzz_conf_crash_cce44b88_tiny_limit_fraction)
{
    round_trip("MEMSHIM_LIMIT", "0.000000000000000000093", KNOWN_G);
}

TEST(idle_seconds_and_fractions_round_trip_when_small)
{
    /* what does work today: ordinary values print and read back unchanged */
    round_trip("MEMSHIM_EMPTY_CACHE_IDLE", "2.5s", NULL);
    round_trip("MEMSHIM_GC_THRESHOLD", "0.75", NULL);
    round_trip("MEMSHIM_LIMIT", "0.9", NULL);
    round_trip("MEMSHIM_LIMIT", "40G", NULL);
    round_trip("MEMSHIM_SMALL_MAX", "512KiB", NULL);
}

TEST(typical_configuration_is_a_fixed_point)
{
    char a[] = "MEMSHIM_LIMIT=40G", b[] = "MEMSHIM_CONF=empty_cache:epoch,log:info,epoch:steps,epoch_steps:100",
         c[] = "MEMSHIM_REPORT_DIR= /tmp/r-%p ", d[] = "MEMSHIM_EPOCH_SIGNAL=usr1";
    char *e[] = {a, b, c, d, NULL};
    oc_setup();
    oc_log_reset();
    msh_config_load_from(e);
    oc_check_ranges();
    oc_check_log();
    oc_check_fixed_point(); /* aborts on failure */
    CHECK(msh_cfg.limit_bytes == 40 * MSH_GiB);
    CHECK(strcmp(msh_cfg.report_dir, "/tmp/r-%p") == 0);
}

TEST_MAIN()
