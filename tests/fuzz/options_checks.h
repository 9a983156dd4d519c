/*
 * options_checks.h: the invariants the option fuzzers (fuzz_options.c, fuzz_conf.c) and their
 * regression tests (tests/reliability/test_fuzz_regress.c) check after msh_config_load_from.
 * Header-only so each target stays one .c file plus policy/base/options.c, policy/base/log.c and policy/base/paths.c. A broken
 * invariant calls abort(), which libFuzzer reports with the input.
 *
 *  - every parsed field is within its documented range, and every path is a NUL-terminated
 *    string shorter than its buffer;
 *  - every line memshim logged is whole: it starts with "memshim[", ends in exactly one newline,
 *    fits MSH_LOG_LINE_MAX and holds no other control character;
 *  - the effective configuration is a fixed point: feeding the values msh_config_iter prints
 *    back as MEMSHIM_* variables gives the same printed values (what reports and
 *    `memshim-options --check` show can be pasted back into a job).
 *
 * Known issue (found by these fuzzers, reported; policy/base/options.c is not this suite's to fix):
 * durations and fractions are printed with "%g", so a large value prints in exponent form
 * ("3.33333e+09") that the parser refuses. Until it is fixed, a printed value in exponent form is
 * left out of the fixed-point check; build with -DMSH_FUZZ_STRICT to check it anyway.
 * tests/reliability/test_fuzz_regress.c keeps the inputs that showed it.
 */
#ifndef MSH_OPTIONS_CHECKS_H
#define MSH_OPTIONS_CHECKS_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "msh.h"

#define OC_MAX_OPTS 64

static int oc_log_fd = -1;

static void oc_no_abort(void) {}

/* Once per process: logs go to a memfd we can read back; MEMSHIM_STRICT never aborts. */
static void oc_setup(void)
{
    if (oc_log_fd >= 0) return;
    oc_log_fd = memfd_create("msh-fuzz-log", MFD_CLOEXEC);
    if (oc_log_fd < 0) abort();
    msh_log_set_fd(oc_log_fd);
    msh_config_abort_fn = oc_no_abort;
}

static void oc_log_reset(void)
{
    if (ftruncate(oc_log_fd, 0) != 0 || lseek(oc_log_fd, 0, SEEK_SET) != 0) abort();
    msh_log_reset_warn_count();
}

/* Every logged line is whole and clean. */
static void oc_check_log(void)
{
    off_t n = lseek(oc_log_fd, 0, SEEK_END);
    if (n <= 0) return;
    if (n > 4 << 20) abort(); /* a bounded number of bounded lines */
    char *buf = malloc((size_t)n);
    if (!buf) abort();
    if (pread(oc_log_fd, buf, (size_t)n, 0) != n) abort();
    if (buf[n - 1] != '\n') abort();
    size_t start = 0;
    for (size_t i = 0; i < (size_t)n; i++) {
        unsigned char c = (unsigned char)buf[i];
        if (c == '\n') {
            if (i - start + 1 > MSH_LOG_LINE_MAX) abort();
            if (i - start < 8 || memcmp(buf + start, "memshim[", 8) != 0) abort();
            start = i + 1;
        } else if (c < 0x20 || c == 0x7f) {
            abort();
        }
    }
    free(buf);
}

static void oc_check_ranges(void)
{
    const struct msh_config *c = &msh_cfg;
    if (c->mode < MSH_MODE_AUTO || c->mode > MSH_MODE_OFF) abort();
    if (c->empty_cache < MSH_EC_NEVER || c->empty_cache > MSH_EC_IDLE) abort();
    if (c->gc < MSH_GC_NEVER || c->gc > MSH_GC_THRESHOLD) abort();
    if (c->epoch_src < MSH_EPOCH_AUTO || c->epoch_src > MSH_EPOCH_MANUAL) abort();
    if (c->report_format != MSH_REPORT_JSON && c->report_format != MSH_REPORT_JSON_PRETTY) abort();
    if (c->log_level < MSH_LOG_ERROR || c->log_level > MSH_LOG_DEBUG) abort();
    if (!(c->limit_fraction >= 0 && c->limit_fraction <= 1)) abort();
    if (c->limit_fraction > 0 && c->limit_bytes) abort();
    if (!(c->gc_threshold >= 0 && c->gc_threshold <= 1)) abort();
    if (!(c->empty_cache_idle_s >= 0) || c->empty_cache_idle_s != c->empty_cache_idle_s) abort();
    if (!(c->epoch_seconds >= 0) || c->epoch_seconds != c->epoch_seconds) abort();
    if (c->small_max > 64 * MSH_MiB) abort();
    if (c->epoch_steps > 1000000000000ull) abort();
    if (c->epoch_signal < 1 || c->epoch_signal > 64 || c->epoch_signal == SIGKILL || c->epoch_signal == SIGSTOP)
        abort();
    if (strnlen(c->report_dir, sizeof c->report_dir) >= sizeof c->report_dir) abort();
    if (strnlen(c->trace_file, sizeof c->trace_file) >= sizeof c->trace_file) abort();
    if (strnlen(c->log_file, sizeof c->log_file) >= sizeof c->log_file) abort();
}

/* "1.5e+09": a number in the exponent form of "%g" (see the known issue above). */
static bool oc_exponent_form(const char *v)
{
#ifdef MSH_FUZZ_STRICT
    (void)v;
    return false;
#else
    const char *e = strpbrk(v, "eE");
    if (!e || e == v) return false;
    for (const char *p = v; p < e; p++)
        if (!((*p >= '0' && *p <= '9') || *p == '.')) return false;
    e++;
    if (*e == '+' || *e == '-') e++;
    if (!*e) return false;
    for (; *e; e++)
        if (*e < '0' || *e > '9') return false;
    return true;
#endif
}

struct oc_snapshot {
    int n;
    char val[OC_MAX_OPTS][4096 + 64];
};

static void oc_take(struct oc_snapshot *s)
{
    const char *name, *src;
    s->n = 0;
    while (s->n < OC_MAX_OPTS && msh_config_iter(s->n, &name, s->val[s->n], sizeof s->val[s->n], &src)) s->n++;
}

/* The printed effective values, fed back as variables, print the same again. MEMSHIM_CONF is
 * left out (its entries are already in the other values). */
static void oc_check_fixed_point(void)
{
    static struct oc_snapshot before, after;
    static char env_store[OC_MAX_OPTS][4096 + 128];
    static char *envp[OC_MAX_OPTS + 1];
    oc_take(&before);
    int k = 0;
    for (int i = 0; i < before.n; i++) {
        const char *name, *src;
        char v[8];
        msh_config_iter(i, &name, v, sizeof v, &src);
        if (strcmp(name, "MEMSHIM_CONF") == 0) continue;
        snprintf(env_store[k], sizeof env_store[k], "%s=%s", name, before.val[i]);
        envp[k] = env_store[k];
        k++;
    }
    envp[k] = NULL;
    oc_log_reset();
    msh_config_load_from(envp);
    oc_check_ranges();
    oc_take(&after);
    for (int i = 0; i < before.n; i++) {
        const char *name, *src;
        char v[8];
        msh_config_iter(i, &name, v, sizeof v, &src);
        if (strcmp(name, "MEMSHIM_CONF") == 0 || oc_exponent_form(before.val[i])) continue;
        if (strcmp(before.val[i], after.val[i]) != 0) {
            fprintf(stderr, "fixed point broken: %s printed '%s', read back it prints '%s'\n", name, before.val[i],
                    after.val[i]);
            abort();
        }
    }
}

#endif
