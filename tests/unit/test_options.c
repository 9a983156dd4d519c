/*
 * test_options.c: the MEMSHIM_* option table, its value parsers, MEMSHIM_CONF, strict mode, the
 * logging it relies on (format, cap, whole lines under concurrency, the log file), and that
 * docs/configuration.md is exactly what memshim-options --markdown prints.
 *
 * Log output is captured by pointing the logger at a temporary file (msh_log_set_fd); tests
 * never read or change the real environment except the one that checks msh_config_load().
 */
#include "harness.h"
#include "msh.h"

#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- capturing the log ---------------------------------------------------------------------- */

static FILE *cap_file;
static char cap_buf[1 << 20];

static void cap_begin(void)
{
    cap_file = tmpfile();
    msh_log_set_fd(fileno(cap_file));
    msh_log_reset_warn_count();
}

/* Everything logged since cap_begin (the capture stays open). */
static const char *cap_text(void)
{
    ssize_t n = pread(fileno(cap_file), cap_buf, sizeof cap_buf - 1, 0);
    cap_buf[n > 0 ? n : 0] = '\0';
    return cap_buf;
}

static const char *cap_end(void)
{
    const char *t = cap_text();
    msh_log_set_fd(-1);
    fclose(cap_file);
    cap_file = NULL;
    msh_log_reset_warn_count();
    return t;
}

static int count_substr(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
    return n;
}

static int count_warnings(const char *t)
{
    return count_substr(t, "]: warning: ");
}

/* Load a NULL-terminated list of "NAME=value" strings, capturing the log into *log. */
static int load_env(const char *const *env, const char **log)
{
    cap_begin();
    int n = msh_config_load_from((char *const *)env);
    const char *t = cap_end();
    if (log) *log = t;
    return n;
}

static const char *value_of(const char *opt, char *buf, size_t len, const char **source)
{
    const char *name;
    for (int i = 0; msh_config_iter(i, &name, buf, len, source); i++)
        if (strcmp(name, opt) == 0) return buf;
    return NULL;
}

/* ---- parsers -------------------------------------------------------------------------------- */

TEST(size_plain_and_suffixes)
{
    static const struct { const char *s; uint64_t v; } ok[] = {
        {"0", 0}, {"123", 123}, {"1073741824", 1073741824ull}, {"1B", 1}, {"1b", 1},
        {"4K", 4096}, {"4k", 4096}, {"4KB", 4096}, {"4kb", 4096}, {"4KiB", 4096}, {"4kib", 4096},
        {"1M", MSH_MiB}, {"1MB", MSH_MiB}, {"512MiB", 512 * MSH_MiB}, {"1m", MSH_MiB},
        {"1G", MSH_GiB}, {"40G", 40 * (uint64_t)MSH_GiB}, {"1GiB", MSH_GiB}, {"1gb", MSH_GiB},
        {"2T", 2ull << 40}, {"2TiB", 2ull << 40}, {"2tb", 2ull << 40},
        {"1.5G", 3 * (uint64_t)MSH_GiB / 2}, {"0.5K", 512}, {".5K", 512}, {"0.1K", 102},
        {"  40G  ", 40 * (uint64_t)MSH_GiB}, {"\t8M\n", 8 * MSH_MiB}, {"512 MiB", 512 * MSH_MiB},
        {"18446744073709551615", UINT64_MAX}, {"16777215T", 16777215ull << 40},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint64_t v = 42;
        int rc = msh_parse_size(ok[i].s, &v);
        CHECKF(rc == 0 && v == ok[i].v, "'%s' -> rc %d value %llu, want %llu", ok[i].s, rc,
               (unsigned long long)v, (unsigned long long)ok[i].v);
    }
}

TEST(size_rejects_overflow_negative_garbage)
{
    static const char *const range[] = {"18446744073709551616", "99999999999999999999999",
                                        "16777216T", "17179869184G", "16777216.5T"};
    for (size_t i = 0; i < sizeof range / sizeof range[0]; i++) {
        uint64_t v = 42;
        CHECKF(msh_parse_size(range[i], &v) == ERANGE && v == 42, "'%s' should overflow", range[i]);
    }
    static const char *const bad[] = {"-1", "-1G", "+1", "banana", "1X", "G", "", "   ", "1.5",
                                      "1GiBx", "1iB", "1..5G", "1.5.G", "1 G B", "0x10", "1e9",
                                      "1P", "K1", "1 2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v = 42;
        CHECKF(msh_parse_size(bad[i], &v) == EINVAL && v == 42, "'%s' should be invalid", bad[i]);
    }
    uint64_t v;
    CHECK(msh_parse_size(NULL, &v) == EINVAL);
}

TEST(fraction_values)
{
    static const struct { const char *s; double v; } ok[] = {
        {"0", 0}, {"1", 1}, {"0.9", 0.9}, {" 0.5 ", 0.5}, {"1.0", 1}, {".25", 0.25}, {"0.", 0}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        double v = -1;
        CHECKF(msh_parse_fraction(ok[i].s, &v) == 0 && fabs(v - ok[i].v) < 1e-12, "'%s'", ok[i].s);
    }
    static const char *const bad[] = {"1.1", "2", "-0.1", "abc", "", " ", "0.9x", "50%", "."};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        double v = -1;
        CHECKF(msh_parse_fraction(bad[i], &v) == EINVAL && v == -1, "'%s' should be invalid", bad[i]);
    }
}

TEST(bool_values)
{
    static const char *const t[] = {"1", "true", "TRUE", "True", "yes", "YES", "on", "On", " on "};
    static const char *const f[] = {"0", "false", "FALSE", "no", "No", "off", "OFF", "\t0\n"};
    static const char *const bad[] = {"2", "", "maybe", "y", "n", "tru", "onn", "-1"};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        bool b = false;
        CHECKF(msh_parse_bool(t[i], &b) == 0 && b, "'%s'", t[i]);
    }
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        bool b = true;
        CHECKF(msh_parse_bool(f[i], &b) == 0 && !b, "'%s'", f[i]);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bool b = true;
        CHECKF(msh_parse_bool(bad[i], &b) == EINVAL && b, "'%s' should be invalid", bad[i]);
    }
}

TEST(seconds_values)
{
    static const struct { const char *s; double v; } ok[] = {
        {"10", 10}, {"2.5", 2.5}, {"0", 0}, {"5s", 5}, {"5S", 5}, {"100ms", 0.1}, {"100MS", 0.1},
        {"2m", 120}, {"1.5m", 90}, {"1h", 3600}, {"1H", 3600}, {" 3 s ", 3}, {"0.5h", 1800}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        double v = -1;
        CHECKF(msh_parse_seconds(ok[i].s, &v) == 0 && fabs(v - ok[i].v) < 1e-9, "'%s' -> %g",
               ok[i].s, v);
    }
    static const char *const bad[] = {"-1", "1d", "", "s", "ms", "1sec", "1 h x", "abc", "1e3"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        double v = -1;
        CHECKF(msh_parse_seconds(bad[i], &v) == EINVAL && v == -1, "'%s' should be invalid", bad[i]);
    }
}

TEST(signal_values)
{
    static const struct { const char *s; int v; } ok[] = {
        {"SIGUSR1", SIGUSR1}, {"USR1", SIGUSR1}, {"usr2", SIGUSR2}, {"sigusr2", SIGUSR2},
        {"SIGTERM", SIGTERM}, {"10", 10}, {"64", 64}, {"1", 1}, {" SIGHUP ", SIGHUP}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int v = -1;
        CHECKF(msh_parse_signal(ok[i].s, &v) == 0 && v == ok[i].v, "'%s' -> %d", ok[i].s, v);
    }
    static const char *const bad[] = {"0", "65", "KILL", "SIGKILL", "9", "SIGSTOP", "SIGFOO",
                                      "", "SIG", "-1", "USR"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int v = -1;
        CHECKF(msh_parse_signal(bad[i], &v) != 0 && v == -1, "'%s' should be invalid", bad[i]);
    }
}

/* ---- the table and loading ------------------------------------------------------------------ */

TEST(defaults)
{
    static const char *const none[] = {NULL};
    const char *log;
    CHECK(load_env(none, &log) == 0);
    CHECK(log[0] == '\0');
    CHECK(msh_cfg.mode == MSH_MODE_AUTO);
    CHECK(msh_cfg.limit_bytes == 0 && msh_cfg.limit_fraction == 0);
    CHECK(msh_cfg.empty_cache == MSH_EC_OOM);
    CHECK(msh_cfg.empty_cache_threshold == 0);
    CHECK(msh_cfg.empty_cache_idle_s == 10);
    CHECK(msh_cfg.gc == MSH_GC_OOM);
    CHECK(fabs(msh_cfg.gc_threshold - 0.9) < 1e-12);
    CHECK(msh_cfg.defrag);
    CHECK(msh_cfg.small_max == MSH_MiB);
    CHECK(msh_cfg.epoch_src == MSH_EPOCH_AUTO);
    CHECK(msh_cfg.epoch_steps == 0 && msh_cfg.epoch_seconds == 0);
    CHECK(msh_cfg.epoch_signal == SIGUSR2);
    CHECK(msh_cfg.report_dir[0] == '\0' && msh_cfg.trace_file[0] == '\0');
    CHECK(msh_cfg.log_file[0] == '\0');
    CHECK(msh_cfg.report_format == MSH_REPORT_JSON);
    CHECK(msh_cfg.log_level == MSH_LOG_WARN && msh_log_level == MSH_LOG_WARN);
    CHECK(!msh_cfg.strict);
    CHECK(msh_cfg.sites == MSH_SITES_FRAMES && msh_cfg.sites_sample == 0);
    CHECK(msh_cfg.epoch_interval == 1000 && msh_cfg.catch_signals && msh_cfg.trainer_metrics);
    CHECK(msh_cfg.snapshot[0] == '\0' && msh_cfg.snapshot_events == 100000);
    CHECK(msh_cfg.latency_sample == 64);
    CHECK(msh_cfg.spill == MSH_SPILL_OFF && msh_cfg.spill_max_fraction == 0.5 && msh_cfg.spill_max_bytes == 0);
    char val[256];
    const char *name, *source;
    int n = 0;
    for (; msh_config_iter(n, &name, val, sizeof val, &source); n++) {
        CHECKF(strncmp(name, "MEMSHIM_", 8) == 0, "%s", name);
        CHECKF(strcmp(source, "default") == 0, "%s from %s", name, source);
    }
    CHECK(n == 31);
    CHECK(msh_config_iter(n, &name, val, sizeof val, &source) == 0);
    CHECK(msh_config_iter(-1, &name, val, sizeof val, &source) == 0);
    CHECK(strcmp(value_of("MEMSHIM_SMALL_MAX", val, sizeof val, NULL), "1MiB") == 0);
    CHECK(strcmp(value_of("MEMSHIM_EPOCH_SIGNAL", val, sizeof val, NULL), "SIGUSR2") == 0);
    CHECK(strcmp(value_of("MEMSHIM_GC_THRESHOLD", val, sizeof val, NULL), "0.9") == 0);
}

TEST(every_option_parses)
{
    static const char *const env[] = {
        "MEMSHIM_MODE=Segment", "MEMSHIM_LIMIT=40G", "MEMSHIM_EMPTY_CACHE=idle",
        "MEMSHIM_EMPTY_CACHE_THRESHOLD=2GiB", "MEMSHIM_EMPTY_CACHE_IDLE=500ms", "MEMSHIM_GC=epoch",
        "MEMSHIM_GC_THRESHOLD=0.75", "MEMSHIM_DEFRAG=off", "MEMSHIM_SMALL_MAX=64MiB",
        "MEMSHIM_EPOCH=steps", "MEMSHIM_EPOCH_STEPS=100", "MEMSHIM_EPOCH_SECONDS=1h",
        "MEMSHIM_EPOCH_SIGNAL=USR1", "MEMSHIM_REPORT_DIR=/tmp/rep-%p",
        "MEMSHIM_REPORT_FORMAT=json-pretty", "MEMSHIM_TRACE_FILE= /tmp/t.trace ",
        "MEMSHIM_LOG=debug", "MEMSHIM_LOG_FILE=/tmp/memshim-%h.log", "MEMSHIM_STRICT=yes", "MEMSHIM_SPILL=Host",
        "MEMSHIM_SPILL_MAX=64G", NULL};
    const char *log;
    CHECK(load_env(env, &log) == 0);
    CHECK(count_warnings(log) == 0);
    CHECK(msh_cfg.mode == MSH_MODE_SEGMENT);
    CHECK(msh_cfg.limit_bytes == 40 * (uint64_t)MSH_GiB && msh_cfg.limit_fraction == 0);
    CHECK(msh_cfg.empty_cache == MSH_EC_IDLE);
    CHECK(msh_cfg.empty_cache_threshold == 2 * (uint64_t)MSH_GiB);
    CHECK(fabs(msh_cfg.empty_cache_idle_s - 0.5) < 1e-12);
    CHECK(msh_cfg.gc == MSH_GC_EPOCH && fabs(msh_cfg.gc_threshold - 0.75) < 1e-12);
    CHECK(!msh_cfg.defrag);
    CHECK(msh_cfg.small_max == 64 * MSH_MiB);
    CHECK(msh_cfg.epoch_src == MSH_EPOCH_STEPS && msh_cfg.epoch_steps == 100);
    CHECK(msh_cfg.epoch_seconds == 3600);
    CHECK(msh_cfg.epoch_signal == SIGUSR1);
    CHECK(strcmp(msh_cfg.report_dir, "/tmp/rep-%p") == 0);
    CHECK(msh_cfg.report_format == MSH_REPORT_JSON_PRETTY);
    CHECK(strcmp(msh_cfg.trace_file, "/tmp/t.trace") == 0);
    CHECK(msh_cfg.log_level == MSH_LOG_DEBUG && msh_log_level == MSH_LOG_DEBUG);
    CHECK(strcmp(msh_cfg.log_file, "/tmp/memshim-%h.log") == 0);
    CHECK(msh_cfg.strict);
    CHECK(msh_cfg.spill == MSH_SPILL_HOST && msh_cfg.spill_max_bytes == 64 * (uint64_t)MSH_GiB &&
          msh_cfg.spill_max_fraction == 0);
    char val[256];
    const char *src;
    CHECK(strcmp(value_of("MEMSHIM_LIMIT", val, sizeof val, &src), "40GiB") == 0);
    CHECK(strcmp(src, "environment") == 0);
    CHECK(strcmp(value_of("MEMSHIM_EMPTY_CACHE_IDLE", val, sizeof val, NULL), "0.5") == 0);
    CHECK(strcmp(value_of("MEMSHIM_EPOCH_SIGNAL", val, sizeof val, NULL), "SIGUSR1") == 0);
    CHECK(strcmp(value_of("MEMSHIM_MODE", val, sizeof val, NULL), "segment") == 0);
    CHECK(strcmp(value_of("MEMSHIM_DEFRAG", val, sizeof val, NULL), "0") == 0);
    static const char *const none[] = {NULL};
    load_env(none, NULL);
}

/* A bad value of each type: default kept, exactly one warning naming variable and value. */
TEST(bad_values_keep_default_with_one_warning)
{
    static const struct { const char *var, *value, *reason; } bad[] = {
        {"MEMSHIM_MODE", "bogus", "expected one of auto, tensor, segment, off"},
        {"MEMSHIM_LIMIT", "banana", "is not a size or fraction (expected bytes like 40G or a fraction 0..1); using the default (0: no limit)"},
        {"MEMSHIM_LIMIT", "1.5", "is not a size or fraction"},
        {"MEMSHIM_LIMIT", "-0.5", "is not a size or fraction"},
        {"MEMSHIM_LIMIT", "99999999999T", "out of range"},
        {"MEMSHIM_EMPTY_CACHE", "sometimes", "one of never, oom, epoch, threshold, idle"},
        {"MEMSHIM_EMPTY_CACHE_THRESHOLD", "-1G", "is not a size"},
        {"MEMSHIM_EMPTY_CACHE_THRESHOLD", "18446744073709551616", "out of range"},
        {"MEMSHIM_EMPTY_CACHE_IDLE", "1d", "is not a duration"},
        {"MEMSHIM_GC", "always", "one of never, oom, epoch, threshold)"},
        {"MEMSHIM_GC_THRESHOLD", "1.5", "out of range (expected a fraction 0..1); using the default (0.9)"},
        {"MEMSHIM_GC_THRESHOLD", "lots", "is not a fraction"},
        {"MEMSHIM_DEFRAG", "maybe", "is not a boolean"},
        {"MEMSHIM_SPILL", "disk", "expected one of off, host); using the default (off)"},
        {"MEMSHIM_SPILL_MAX", "lots", "is not a size or fraction"},
        {"MEMSHIM_SPILL_MAX", "1.5", "is not a size or fraction"},
        {"MEMSHIM_SMALL_MAX", "65MiB", "out of range (expected a size from 0 to 64MiB); using the default (1MiB)"},
        {"MEMSHIM_SMALL_MAX", "1.5", "is not a size"},
        {"MEMSHIM_EPOCH", "weekly", "one of auto, steps, seconds, signal, manual"},
        {"MEMSHIM_EPOCH_STEPS", "0", "out of range"},
        {"MEMSHIM_EPOCH_STEPS", "1000000000001", "out of range"},
        {"MEMSHIM_EPOCH_STEPS", "ten", "is not a whole number"},
        {"MEMSHIM_EPOCH_SECONDS", "soon", "is not a duration"},
        {"MEMSHIM_EPOCH_SIGNAL", "SIGKILL", "cannot be caught"},
        {"MEMSHIM_EPOCH_SIGNAL", "SIGNOPE", "is not a signal"},
        {"MEMSHIM_EPOCH_SIGNAL", "65", "out of range"},
        {"MEMSHIM_REPORT_FORMAT", "xml", "one of json, json-pretty"},
        {"MEMSHIM_LOG", "loud", "one of error, warn, info, debug"},
        {"MEMSHIM_STRICT", "sure", "is not a boolean"},
        {"MEMSHIM_LIMIT", "", "is empty"},
        {"MEMSHIM_MODE", "  ", "is empty"},
        {"MEMSHIM_DEFRAG", "", "is empty"},
    };
    static const char *const none[] = {NULL};
    char defaults[32][512];
    load_env(none, NULL);
    const char *name, *src;
    for (int i = 0; i < 32 && msh_config_iter(i, &name, defaults[i], sizeof defaults[i], &src); i++) {}
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char setting[256];
        snprintf(setting, sizeof setting, "%s=%s", bad[k].var, bad[k].value);
        const char *env[] = {setting, NULL};
        const char *log;
        int n = load_env(env, &log);
        CHECKF(n == 1, "%s: %d problems", setting, n);
        CHECKF(count_warnings(log) == 1, "%s: log was:\n%s", setting, log);
        char expect[600];
        snprintf(expect, sizeof expect, "]: warning: %s='%s' ", bad[k].var, bad[k].value);
        CHECKF(strstr(log, expect) != NULL, "%s: log was:\n%s", setting, log);
        CHECKF(strstr(log, bad[k].reason) != NULL, "%s: want '%s' in:\n%s", setting, bad[k].reason, log);
        CHECKF(strstr(log, "using the default (") != NULL, "%s: %s", setting, log);
        char val[512];
        for (int i = 0; msh_config_iter(i, &name, val, sizeof val, &src); i++) {
            CHECKF(strcmp(val, defaults[i]) == 0 && strcmp(src, "default") == 0,
                   "%s: %s is '%s' from %s, default '%s'", setting, name, val, src, defaults[i]);
        }
    }
    load_env(none, NULL);
}

TEST(path_too_long_is_rejected)
{
    static char setting[6000], path[4096];
    memset(path, 'a', sizeof path);
    path[0] = '/';
    path[4095] = '\0'; /* 4095 bytes: the longest that fits */
    snprintf(setting, sizeof setting, "MEMSHIM_REPORT_DIR=%s", path);
    const char *env[] = {setting, NULL};
    const char *log;
    CHECK(load_env(env, &log) == 0);
    CHECK(strcmp(msh_cfg.report_dir, path) == 0);
    snprintf(setting, sizeof setting, "MEMSHIM_TRACE_FILE=%sb", path); /* 4096 bytes */
    CHECK(load_env(env, &log) == 1);
    CHECK(msh_cfg.trace_file[0] == '\0');
    CHECK(count_warnings(log) == 1);
    CHECK(strstr(log, "MEMSHIM_TRACE_FILE='/aaa") != NULL);
    CHECK(strstr(log, "is too long (4096 bytes; at most 4095); using the default (no trace)") != NULL);
    CHECK(strlen(log) < MSH_LOG_LINE_MAX); /* the value is shortened in the message */
    /* An empty path is a valid "none". */
    static const char *const empty[] = {"MEMSHIM_LOG_FILE=", NULL};
    CHECK(load_env(empty, &log) == 0 && count_warnings(log) == 0);
}

TEST(limit_fraction_or_bytes)
{
    static const struct { const char *v; uint64_t bytes; double frac; } cases[] = {
        {"0.9", 0, 0.9}, {"1", 0, 1.0}, {"1.0", 0, 1.0}, {"0.5", 0, 0.5}, {".25", 0, 0.25},
        {"40G", 40ull << 30, 0}, {"512MiB", 512ull << 20, 0}, {"1073741824", 1073741824ull, 0},
        {"2", 2, 0}, {"0", 0, 0}, {"1.5G", 3ull << 29, 0}, {" 0.9 ", 0, 0.9}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char setting[64];
        snprintf(setting, sizeof setting, "MEMSHIM_LIMIT=%s", cases[k].v);
        const char *env[] = {setting, NULL};
        CHECKF(load_env(env, NULL) == 0, "%s", setting);
        CHECKF(msh_cfg.limit_bytes == cases[k].bytes && fabs(msh_cfg.limit_fraction - cases[k].frac) < 1e-12,
               "%s -> bytes %llu fraction %g", setting, (unsigned long long)msh_cfg.limit_bytes,
               msh_cfg.limit_fraction);
    }
    char val[64];
    static const char *const frac[] = {"MEMSHIM_LIMIT=0.9", NULL};
    load_env(frac, NULL);
    CHECK(strcmp(value_of("MEMSHIM_LIMIT", val, sizeof val, NULL), "0.9") == 0);
}

TEST(unknown_names_suggest_nearest)
{
    static const struct { const char *setting, *want; } cases[] = {
        {"MEMSHIM_LIMT=40G", "unknown variable MEMSHIM_LIMT (did you mean MEMSHIM_LIMIT?)"},
        {"MEMSHIM_EMPTY_CACH=oom", "unknown variable MEMSHIM_EMPTY_CACH (did you mean MEMSHIM_EMPTY_CACHE?)"},
        {"MEMSHIM_GC_TRESHOLD=0.5", "(did you mean MEMSHIM_GC_THRESHOLD?)"},
        {"MEMSHIM_limit=1", "unknown variable MEMSHIM_limit (did you mean MEMSHIM_LIMIT?)"},
        {"MEMSHIM_REPORTDIR=/x", "(did you mean MEMSHIM_REPORT_DIR?)"},
        {"MEMSHIM_=", "unknown variable MEMSHIM_ (did you mean"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const char *env[] = {"PATH=/bin", "XMEMSHIM_FOO=1", cases[k].setting, NULL};
        const char *log;
        CHECKF(load_env(env, &log) == 1, "%s", cases[k].setting);
        CHECKF(count_warnings(log) == 1, "%s: %s", cases[k].setting, log);
        CHECKF(strstr(log, cases[k].want) != NULL, "want '%s' in: %s", cases[k].want, log);
    }
    CHECK(msh_cfg.limit_bytes == 0);
}

TEST(conf_combined_form)
{
    static const char *const env[] = {"MEMSHIM_CONF= limit:40G , EMPTY_CACHE:epoch,Log:info,,"
                                      "gc_threshold: 0.5,epoch_signal:usr1,",
                                      NULL};
    const char *log;
    CHECK(load_env(env, &log) == 0);
    CHECK(count_warnings(log) == 0);
    CHECK(msh_cfg.limit_bytes == 40ull << 30);
    CHECK(msh_cfg.empty_cache == MSH_EC_EPOCH);
    CHECK(msh_cfg.log_level == MSH_LOG_INFO);
    CHECK(fabs(msh_cfg.gc_threshold - 0.5) < 1e-12);
    CHECK(msh_cfg.epoch_signal == SIGUSR1);
    char val[256];
    const char *src;
    value_of("MEMSHIM_LIMIT", val, sizeof val, &src);
    CHECK(strcmp(src, "MEMSHIM_CONF") == 0);
    value_of("MEMSHIM_CONF", val, sizeof val, &src);
    CHECK(strcmp(src, "environment") == 0 && strncmp(val, "limit:40G", 9) == 0);
    value_of("MEMSHIM_GC", val, sizeof val, &src);
    CHECK(strcmp(src, "default") == 0);
    /* The last of a repeated key wins. */
    static const char *const twice[] = {"MEMSHIM_CONF=limit:1G,limit:2G", NULL};
    CHECK(load_env(twice, NULL) == 0 && msh_cfg.limit_bytes == 2ull << 30);
    /* An empty MEMSHIM_CONF is no setting at all. */
    static const char *const empty[] = {"MEMSHIM_CONF=", NULL};
    CHECK(load_env(empty, &log) == 0 && count_warnings(log) == 0);
    msh_log_level = MSH_LOG_WARN;
}

TEST(conf_bad_pairs_are_named)
{
    static const struct { const char *conf, *want; } cases[] = {
        {"limit:banana", "invalid MEMSHIM_CONF entry 'limit:banana': 'banana' is not a size or fraction (expected bytes like 40G or a fraction 0..1); using the default (0: no limit)"},
        {"empty_cache:sometimes", "invalid MEMSHIM_CONF entry 'empty_cache:sometimes': 'sometimes' is not a valid value (expected one of never, oom, epoch, threshold, idle)"},
        {"defrag", "invalid MEMSHIM_CONF entry 'defrag': expected key:value"},
        {":1", "invalid MEMSHIM_CONF entry ':1': the key is empty"},
        {"conf:x", "invalid MEMSHIM_CONF entry 'conf:x': MEMSHIM_CONF cannot contain itself"},
        {"limt:4G", "invalid MEMSHIM_CONF entry 'limt:4G': unknown key 'limt' (did you mean 'limit'?)"},
        {"EMPTY_CACHE_TRESHOLD:1G", "unknown key 'EMPTY_CACHE_TRESHOLD' (did you mean 'empty_cache_threshold'?)"},
        {"small_max:", "invalid MEMSHIM_CONF entry 'small_max:': '' is empty"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char setting[256];
        snprintf(setting, sizeof setting, "MEMSHIM_CONF=gc:epoch,%s", cases[k].conf);
        const char *env[] = {setting, NULL};
        const char *log;
        CHECKF(load_env(env, &log) == 1, "%s", setting);
        CHECKF(count_warnings(log) == 1, "%s: %s", setting, log);
        CHECKF(strstr(log, cases[k].want) != NULL, "want '%s' in: %s", cases[k].want, log);
        CHECKF(msh_cfg.gc == MSH_GC_EPOCH, "%s: the good entry still applies", setting);
        CHECK(msh_cfg.limit_bytes == 0 && msh_cfg.empty_cache == MSH_EC_OOM);
    }
}

TEST(conf_precedence)
{
    /* A per-variable setting wins over MEMSHIM_CONF, whatever the order in the environment. */
    static const char *const env1[] = {"MEMSHIM_CONF=limit:40G,gc:never", "MEMSHIM_LIMIT=20G", NULL};
    static const char *const env2[] = {"MEMSHIM_LIMIT=20G", "MEMSHIM_CONF=limit:40G,gc:never", NULL};
    const char *log;
    char val[64];
    const char *src;
    CHECK(load_env(env1, &log) == 0 && msh_cfg.limit_bytes == 20ull << 30 && msh_cfg.gc == MSH_GC_NEVER);
    CHECK(load_env(env2, &log) == 0 && msh_cfg.limit_bytes == 20ull << 30);
    value_of("MEMSHIM_LIMIT", val, sizeof val, &src);
    CHECK(strcmp(src, "environment") == 0 && strcmp(val, "20GiB") == 0);
    /* A bad per-variable value falls back to MEMSHIM_CONF's, and says so. */
    static const char *const env3[] = {"MEMSHIM_LIMIT=lots", "MEMSHIM_CONF=limit:40G", NULL};
    CHECK(load_env(env3, &log) == 1 && msh_cfg.limit_bytes == 40ull << 30);
    CHECK(count_warnings(log) == 1);
    CHECK(strstr(log, "MEMSHIM_LIMIT='lots' is not a size or fraction") != NULL);
    CHECK(strstr(log, "using MEMSHIM_LIMIT=40G from MEMSHIM_CONF") != NULL);
    value_of("MEMSHIM_LIMIT", val, sizeof val, &src);
    CHECK(strcmp(src, "MEMSHIM_CONF") == 0);
    /* A bad MEMSHIM_CONF value under a good variable: warned, the variable is used. */
    static const char *const env4[] = {"MEMSHIM_LIMIT=8G", "MEMSHIM_CONF=limit:lots", NULL};
    CHECK(load_env(env4, &log) == 1 && msh_cfg.limit_bytes == 8ull << 30);
    CHECK(strstr(log, "invalid MEMSHIM_CONF entry 'limit:lots'") != NULL);
    CHECK(strstr(log, "using MEMSHIM_LIMIT=8G from the environment") != NULL);
}

static int abort_calls, warnings_at_abort, errors_at_abort;
static void fake_abort(void)
{
    abort_calls++;
    const char *t = cap_text();
    warnings_at_abort = count_warnings(t);
    errors_at_abort = count_substr(t, "]: error: ");
}

TEST(strict_aborts_after_reading_everything)
{
    void (*saved)(void) = msh_config_abort_fn;
    msh_config_abort_fn = fake_abort;
    abort_calls = 0;
    static const char *const env[] = {"MEMSHIM_LIMIT=bad", "MEMSHIM_STRICT=1", "MEMSHIM_GC=bad",
                                      "MEMSHIM_CONF=nope:1", NULL};
    const char *log;
    CHECK(load_env(env, &log) == 3);
    CHECK(abort_calls == 1);
    CHECK(warnings_at_abort == 3); /* every bad one reported before the abort */
    CHECK(errors_at_abort == 1);
    CHECK(strstr(log, "error: MEMSHIM_STRICT=1 and 3 MEMSHIM_* settings are invalid or unknown") != NULL);
    /* The later option is still read when an earlier one is bad. */
    static const char *const env2[] = {"MEMSHIM_MODE=x", "MEMSHIM_STRICT=on", "MEMSHIM_LOG_FILE=/tmp/x", NULL};
    abort_calls = 0;
    CHECK(load_env(env2, &log) == 1 && abort_calls == 1 && strcmp(msh_cfg.log_file, "/tmp/x") == 0);
    /* Strict from MEMSHIM_CONF, tripped by an unknown variable. */
    static const char *const env3[] = {"MEMSHIM_CONF=strict:true", "MEMSHIM_LIMT=1", NULL};
    abort_calls = 0;
    CHECK(load_env(env3, NULL) == 1 && abort_calls == 1);
    /* Valid settings: no abort; invalid ones without strict: no abort. */
    static const char *const ok[] = {"MEMSHIM_STRICT=1", "MEMSHIM_LIMIT=1G", NULL};
    static const char *const lax[] = {"MEMSHIM_LIMIT=bad", NULL};
    abort_calls = 0;
    CHECK(load_env(ok, NULL) == 0 && load_env(lax, NULL) == 1 && abort_calls == 0);
    msh_config_abort_fn = saved;
}

TEST(info_echo_of_non_default_settings)
{
    static const char *const env[] = {"MEMSHIM_LOG=info", "MEMSHIM_LIMIT=40G",
                                      "MEMSHIM_CONF=empty_cache:epoch,limit:1G", NULL};
    const char *log;
    CHECK(load_env(env, &log) == 0);
    CHECK(strstr(log, "]: info: MEMSHIM_LIMIT set by environment to 40G\n") != NULL);
    CHECK(strstr(log, "]: info: MEMSHIM_EMPTY_CACHE set by MEMSHIM_CONF to epoch\n") != NULL);
    CHECK(strstr(log, "]: info: MEMSHIM_LOG set by environment to info\n") != NULL);
    CHECK(strstr(log, "limit:1G in MEMSHIM_CONF is overridden by MEMSHIM_LIMIT") != NULL);
    CHECK(strstr(log, "MEMSHIM_GC ") == NULL); /* defaults are not echoed */
    CHECK(count_warnings(log) == 0);
    /* At the default level there is no echo. */
    static const char *const quiet[] = {"MEMSHIM_LIMIT=40G", NULL};
    CHECK(load_env(quiet, &log) == 0 && log[0] == '\0');
    /* msh_config_dump lists every option with its source. */
    load_env(env, NULL);
    cap_begin();
    msh_config_dump(MSH_LOG_INFO);
    log = cap_end();
    CHECK(count_substr(log, "]: info: ") == 32);
    CHECK(strstr(log, "MEMSHIM_LIMIT=40GiB (environment)") != NULL);
    CHECK(strstr(log, "MEMSHIM_GC=oom (default)") != NULL);
    msh_log_level = MSH_LOG_WARN;
    cap_begin();
    msh_config_dump(MSH_LOG_INFO);
    CHECK(cap_end()[0] == '\0');
}

TEST(log_level_applies_before_other_warnings)
{
    static const char *const env[] = {"MEMSHIM_LIMIT=bad", "MEMSHIM_FOO=1", "MEMSHIM_LOG=error", NULL};
    const char *log;
    CHECK(load_env(env, &log) == 2);
    CHECK(log[0] == '\0');
    static const char *const env2[] = {"MEMSHIM_LIMIT=bad", "MEMSHIM_CONF=limit:x,log:ERROR", NULL};
    CHECK(load_env(env2, &log) == 2);
    CHECK(log[0] == '\0');
    static const char *const none[] = {NULL};
    load_env(none, NULL);
    CHECK(msh_log_level == MSH_LOG_WARN);
}

TEST(load_from_ignores_the_real_environment)
{
    setenv("MEMSHIM_LIMIT", "7G", 1);
    static const char *const none[] = {NULL};
    CHECK(load_env(none, NULL) == 0);
    CHECK(msh_cfg.limit_bytes == 0);
    unsetenv("MEMSHIM_LIMIT");
}

TEST(load_reads_the_environment_once)
{
    char dir[] = "/tmp/msh-loadtest-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    char tmpl[256], path[256];
    snprintf(tmpl, sizeof tmpl, "%s/log-%%p", dir);
    snprintf(path, sizeof path, "%s/log-%d", dir, (int)getpid());
    setenv("MEMSHIM_SMALL_MAX", "2MiB", 1);
    setenv("MEMSHIM_REPORT_DIR", "/tmp/memshim-test-reports", 1);
    setenv("MEMSHIM_LOG", "info", 1);
    setenv("MEMSHIM_LOG_FILE", tmpl, 1);
    int n = msh_config_load();
    CHECK(n == 0);
    CHECK(msh_cfg.small_max == 2 * MSH_MiB);
    CHECK(strcmp(msh_cfg.report_dir, "/tmp/memshim-test-reports") == 0);
    setenv("MEMSHIM_SMALL_MAX", "4MiB", 1);
    CHECK(msh_config_load() == 0);
    CHECK(msh_cfg.small_max == 2 * MSH_MiB); /* the first call wins */
    /* The log file was opened before the echo, so every line of it went there. */
    msh_log_set_fd(-1);
    msh_log_level = MSH_LOG_WARN;
    FILE *f = fopen(path, "r");
    CHECKF(f != NULL, "%s was not created", path);
    if (f) {
        char buf[4096];
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        buf[len] = '\0';
        fclose(f);
        CHECKF(strstr(buf, "info: MEMSHIM_LOG set by environment to info\n") &&
                   strstr(buf, "info: MEMSHIM_LOG_FILE set by environment to /tmp/msh-loadtest-") &&
                   strstr(buf, "info: MEMSHIM_SMALL_MAX set by environment to 2MiB\n"),
               "log file holds:\n%s", buf);
    }
    unlink(path);
    rmdir(dir);
    unsetenv("MEMSHIM_SMALL_MAX");
    unsetenv("MEMSHIM_REPORT_DIR");
    unsetenv("MEMSHIM_LOG");
    unsetenv("MEMSHIM_LOG_FILE");
}

/* ---- logging -------------------------------------------------------------------------------- */

TEST(log_prefix_levels_and_errno)
{
    char want[64];
    snprintf(want, sizeof want, "memshim[%d]: ", (int)getpid());
    cap_begin();
    msh_log_level = MSH_LOG_DEBUG;
    errno = EAGAIN;
    msh_error("e %d", 1);
    CHECK(errno == EAGAIN);
    msh_warn("w");
    msh_info("i");
    msh_debug("d");
    msh_log_level = MSH_LOG_WARN;
    msh_info("hidden");
    msh_debug("hidden");
    msh_error("e2");
    errno = ENOENT;
    msh_warn("%m");
    const char *t = cap_end();
    char expect[512];
    snprintf(expect, sizeof expect,
             "%serror: e 1\n%swarning: w\n%sinfo: i\n%sdebug: d\n%serror: e2\n%swarning: %s\n",
             want, want, want, want, want, want, strerror(ENOENT));
    CHECKF(strcmp(t, expect) == 0, "got:\n%s", t);
}

TEST(log_lines_are_truncated_and_single)
{
    static char big[4000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    cap_begin();
    msh_warn("start %s end", big);
    const char *t = cap_text();
    size_t len = strlen(t);
    CHECK(len == MSH_LOG_LINE_MAX);
    CHECK(len >= 4 && strcmp(t + len - 4, "...\n") == 0);
    CHECK(count_substr(t, "\n") == 1);
    cap_end();

    /* A multi-byte character straddling the cut is dropped whole. */
    static char utf[2000];
    size_t n = 0;
    while (n + 2 < sizeof utf) { utf[n++] = (char)0xC3; utf[n++] = (char)0xA9; } /* é */
    utf[n] = '\0';
    cap_begin();
    msh_warn("a%s", utf); /* odd offset: the cut would fall mid-character */
    t = cap_text();
    len = strlen(t);
    CHECK(len <= MSH_LOG_LINE_MAX && strcmp(t + len - 4, "...\n") == 0);
    CHECK((unsigned char)t[len - 5] == 0xA9);
    cap_end();

    /* Control characters inside a message cannot split the line. */
    cap_begin();
    msh_warn("one\ntwo\rthree\n");
    t = cap_end();
    CHECK(count_substr(t, "\n") == 1 && strstr(t, "one?two?three\n") != NULL);
}

TEST(warning_cap)
{
    cap_begin();
    for (int i = 0; i < MSH_LOG_WARN_CAP + 50; i++) msh_warn("w%d", i);
    msh_error("errors are not capped");
    const char *t = cap_end();
    CHECK(count_warnings(t) == MSH_LOG_WARN_CAP + 1);
    CHECK(count_substr(t, "further warnings are suppressed") == 1);
    char last[32];
    snprintf(last, sizeof last, ": w%d\n", MSH_LOG_WARN_CAP - 1);
    CHECK(strstr(t, last) != NULL);
    snprintf(last, sizeof last, ": w%d\n", MSH_LOG_WARN_CAP);
    CHECK(strstr(t, last) == NULL);
    CHECK(strstr(t, "error: errors are not capped\n") != NULL);
}

#define LOG_THREADS 8
#define LOG_LINES 400
struct reader_arg { int fd; char *buf; size_t cap, len; };
static void *pipe_reader(void *p)
{
    struct reader_arg *r = p;
    for (;;) {
        ssize_t n = read(r->fd, r->buf + r->len, r->cap - 1 - r->len);
        if (n <= 0) break;
        r->len += (size_t)n;
    }
    r->buf[r->len] = '\0';
    return NULL;
}
static void *log_writer(void *p)
{
    int t = (int)(intptr_t)p;
    char fill[1000];
    for (int i = 0; i < LOG_LINES; i++) {
        int n = (i * 37 + t * 101) % 900; /* up to ~900 bytes: more than one stdio chunk */
        memset(fill, 'a' + t, (size_t)n);
        fill[n] = '\0';
        msh_log(MSH_LOG_INFO, "T%d L%d N%d %s|", t, i, n, fill);
    }
    return NULL;
}

TEST(log_lines_stay_whole_across_threads)
{
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    struct reader_arg r = {fds[0], malloc(8 << 20), 8 << 20, 0};
    REQUIRE(r.buf != NULL);
    pthread_t reader, writers[LOG_THREADS];
    pthread_create(&reader, NULL, pipe_reader, &r);
    msh_log_set_fd(fds[1]);
    msh_log_level = MSH_LOG_INFO;
    for (int t = 0; t < LOG_THREADS; t++)
        pthread_create(&writers[t], NULL, log_writer, (void *)(intptr_t)t);
    for (int t = 0; t < LOG_THREADS; t++) pthread_join(writers[t], NULL);
    msh_log_set_fd(-1);
    msh_log_level = MSH_LOG_WARN;
    close(fds[1]);
    pthread_join(reader, NULL);
    close(fds[0]);

    char prefix[64];
    int plen = snprintf(prefix, sizeof prefix, "memshim[%d]: info: ", (int)getpid());
    int seen[LOG_THREADS] = {0}, bad = 0, lines = 0;
    for (char *line = r.buf; *line;) {
        char *nl = strchr(line, '\n');
        if (!nl) { bad++; break; }
        *nl = '\0';
        lines++;
        int t, i, n, off = 0;
        if (strncmp(line, prefix, (size_t)plen) != 0 ||
            sscanf(line + plen, "T%d L%d N%d %n", &t, &i, &n, &off) != 3 || t < 0 ||
            t >= LOG_THREADS || i != seen[t]) {
            bad++;
        } else {
            const char *f = line + plen + off;
            bool whole = strlen(f) == (size_t)n + 1 && f[n] == '|';
            for (int k = 0; k < n && whole; k++) whole = f[k] == 'a' + t;
            if (!whole) bad++;
            seen[t]++;
        }
        line = nl + 1;
    }
    CHECKF(bad == 0, "%d broken lines", bad);
    CHECK(lines == LOG_THREADS * LOG_LINES);
    for (int t = 0; t < LOG_THREADS; t++) CHECK(seen[t] == LOG_LINES);
    free(r.buf);
}

TEST(expand_path)
{
    char out[512], want[512], host[256];
    gethostname(host, sizeof host);
    host[255] = '\0';
    CHECK(msh_expand_path("/tmp/m-%p.log", out, sizeof out) == 0);
    snprintf(want, sizeof want, "/tmp/m-%d.log", (int)getpid());
    CHECK(strcmp(out, want) == 0);
    CHECK(msh_expand_path("%h/%p/%%p/%z/%", out, sizeof out) == 0);
    snprintf(want, sizeof want, "%s/%d/%%p/%%z/%%", host, (int)getpid());
    CHECKF(strcmp(out, want) == 0, "%s vs %s", out, want);
    CHECK(msh_expand_path("plain", out, sizeof out) == 0 && strcmp(out, "plain") == 0);
    CHECK(msh_expand_path("abcdef", out, 6) == ENAMETOOLONG);
    CHECK(msh_expand_path("abcde", out, 6) == 0);
    CHECK(msh_expand_path("%p%p%p", out, 4) == ENAMETOOLONG);
}

/* issue 16: relative paths resolve against the directory the process started in, not where it is
 * when the file is opened (a script that calls os.chdir keeps its reports). */
TEST(resolve_path_against_the_start_directory)
{
    char start[4096], out[4096], want[4200];
    REQUIRE(getcwd(start, sizeof start) != NULL);
    const char *sd = msh_start_dir(); /* pinned by the library's constructor, before main */
    REQUIRE(sd != NULL);
    CHECKF(strcmp(sd, start) == 0, "%s vs %s", sd, start);
    char moved[] = "/tmp/msh-chdir-XXXXXX";
    REQUIRE(mkdtemp(moved) != NULL);
    REQUIRE(chdir(moved) == 0);
    CHECK(msh_resolve_path("memreport/%p", out, sizeof out) == 0);
    snprintf(want, sizeof want, "%s/memreport/%d", start, (int)getpid());
    CHECKF(strcmp(out, want) == 0, "%s vs %s", out, want);
    CHECK(msh_resolve_path("./snap.pickle", out, sizeof out) == 0);
    snprintf(want, sizeof want, "%s/snap.pickle", start);
    CHECKF(strcmp(out, want) == 0, "%s vs %s", out, want);
    CHECK(msh_resolve_path(".", out, sizeof out) == 0 && strcmp(out, start) == 0);
    CHECK(msh_resolve_path("/abs/x-%p", out, sizeof out) == 0 && strncmp(out, "/abs/x-", 7) == 0);
    CHECK(msh_resolve_path("", out, sizeof out) == 0 && out[0] == 0);
    CHECK(msh_resolve_path("x", out, strlen(start) + 2) == ENAMETOOLONG); /* no room for "/x" and the NUL */
    REQUIRE(chdir(start) == 0);
    rmdir(moved);
}

TEST(log_file_open)
{
    char dir[] = "/tmp/msh-logtest-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    char tmpl[256], path[256];
    snprintf(tmpl, sizeof tmpl, "%s/log-%%p.txt", dir);
    snprintf(path, sizeof path, "%s/log-%d.txt", dir, (int)getpid());

    /* Failure: one warning on the current output, which stays. */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/no/such/dir/x.log", dir);
    cap_begin();
    msh_log_open(missing);
    msh_log_open(missing); /* the configuration and the core may both try: one warning */
    msh_warn("still here");
    const char *t = cap_text();
    CHECK(count_warnings(t) == 2 && strstr(t, "cannot open MEMSHIM_LOG_FILE") != NULL);
    CHECK(strstr(t, "still here") != NULL);
    /* A symbolic link is not followed. */
    char link[300];
    snprintf(link, sizeof link, "%s/link.log", dir);
    REQUIRE(symlink(path, link) == 0);
    msh_log_open(link);
    CHECK(count_warnings(cap_text()) == 3);

    /* Success: lines go to the file, appended, and the same path is not reopened. */
    msh_log_open(tmpl);
    msh_warn("to the file");
    msh_log_open(tmpl);
    msh_warn("again");
    CHECK(count_warnings(cap_text()) == 3);
    cap_end();
    int fd = open(path, O_RDONLY);
    REQUIRE(fd >= 0);
    char buf[512];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n > 0 ? n : 0] = '\0';
    CHECK(count_warnings(buf) == 2 && strstr(buf, "to the file\n") && strstr(buf, "again\n"));
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0133) == 0); /* 0644 less the umask */
    unlink(link);
    unlink(path);
    rmdir(dir);
}

TEST(now_ns_is_monotonic)
{
    uint64_t a = msh_now_ns();
    usleep(2000);
    uint64_t b = msh_now_ns();
    CHECK(b > a && b - a >= 1000000);
}

/* ---- docs/configuration.md ------------------------------------------------------------------ */

static char *read_all(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += k;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    *len = n;
    return buf;
}

TEST(docs_match_generated_markdown)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    REQUIRE(n > 0);
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0'; /* build/tests */
    char tool[PATH_MAX + 32], root[PATH_MAX], docs[PATH_MAX + 32];
    snprintf(tool, sizeof tool, "%s/../memshim-options", exe);
    snprintf(root, sizeof root, "%s", exe);
    bool found = false;
    while (!found) {
        snprintf(docs, sizeof docs, "%s/docs/configuration.md", root);
        if (access(docs, R_OK) == 0) { found = true; break; }
        char *slash = strrchr(root, '/');
        if (!slash || slash == root) break;
        *slash = '\0';
    }
    CHECKF(found, "docs/configuration.md not found above %s: generate it with "
                  "build/memshim-options --markdown > docs/configuration.md", exe);
    if (!found) return;

    FILE *f = fopen(docs, "r");
    REQUIRE(f != NULL);
    size_t dlen;
    char *doc = read_all(f, &dlen);
    fclose(f);

    /* The library's own generator... */
    char *gen = NULL;
    size_t glen = 0;
    FILE *m = open_memstream(&gen, &glen);
    REQUIRE(m != NULL);
    msh_config_print_markdown(m);
    fclose(m);
    CHECKF(glen == dlen && memcmp(gen, doc, dlen) == 0,
           "%s differs from the option table: run build/memshim-options --markdown > "
           "docs/configuration.md", docs);

    /* ...and the tool that writes the file. */
    CHECKF(access(tool, X_OK) == 0, "%s is missing: build it (make %s) before this test", tool,
           "build/memshim-options");
    if (access(tool, X_OK) == 0) {
        char cmd[PATH_MAX + 64];
        snprintf(cmd, sizeof cmd, "'%s' --markdown", tool);
        FILE *p = popen(cmd, "r");
        REQUIRE(p != NULL);
        size_t tlen;
        char *out = read_all(p, &tlen);
        int st = pclose(p);
        CHECK(st == 0);
        CHECKF(tlen == dlen && memcmp(out, doc, dlen) == 0,
               "%s differs from `%s --markdown`: regenerate it", docs, tool);
        free(out);
    }
    free(gen);
    free(doc);
}

TEST_MAIN()
