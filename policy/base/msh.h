/*
 * msh.h: the one internal header shared by every part of libmemshim.so and its tools.
 *
 * Error convention (one for the whole project): internal functions return 0 on success or a
 * positive errno value (ENOMEM: the device or the limit has no room; EINVAL: a bad argument;
 * EIO: the driver failed for another reason; ENODEV: no usable driver/device). CUDA error
 * types (CUresult, cudaError_t) appear only at the API boundary in hooks/. Nothing declared here
 * may call back into a CUDA hook. The pool takes its own memory from mmap, never from malloc,
 * so an allocation hook never depends on the host allocator while it holds a pool lock.
 *
 * policy/base/ is the ground floor: this header and what it declares (log.c, paths.c, options.c),
 * the real driver table (cuda_real.h) and the clocks (hotclock.h). Every folder may use it; it
 * includes nothing of memshim's outside policy/base, so it stands on no other floor.
 */
#ifndef MSH_H
#define MSH_H

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MSH_EXPORT __attribute__((visibility("default")))
#define MSH_UNUSED __attribute__((unused))
#define MSH_LIKELY(x) __builtin_expect(!!(x), 1)
#define MSH_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define MSH_KiB ((size_t)1 << 10)
#define MSH_MiB ((size_t)1 << 20)
#define MSH_GiB ((size_t)1 << 30)
#define MSH_MAX_DEVICES 64

/* ---- logging (policy/base/log.c) -------------------------------------------------------------------
 * Lines go out with one write(2) from a stack buffer: no allocation, no interleaving of partial
 * lines across threads. Prefix "memshim[pid]: level: ". Warnings are capped (MSH_LOG_WARN_CAP) so
 * a bad loop cannot flood the job's stderr. */
enum msh_log_level { MSH_LOG_ERROR = 0, MSH_LOG_WARN = 1, MSH_LOG_INFO = 2, MSH_LOG_DEBUG = 3 };
#define MSH_LOG_WARN_CAP 100
extern int msh_log_level; /* current level; read without a lock (an int) */
void msh_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void msh_vlog(int level, const char *fmt, va_list ap);
/* Open MEMSHIM_LOG_FILE (with %p and %h expanded); on failure warn once and keep stderr. */
void msh_log_open(const char *path_template);
/* Expand %p (pid), %h (host name) and %% in `tmpl` into `out`; returns 0 or ENAMETOOLONG. */
int msh_expand_path(const char *tmpl, char *out, size_t outlen);
/* (policy/base/paths.c) The directory the job started in: the first CPython process with a relative
 * path setting exports its own as _MEMSHIM_START_DIR to the processes it launches; else this
 * process's directory at start-up. NULL when unknown. */
const char *msh_start_dir(void);
/* msh_expand_path, then a relative result is made absolute against msh_start_dir(), so a job
 * that changes directory keeps writing where it started. 0 or ENAMETOOLONG. */
int msh_resolve_path(const char *tmpl, char *out, size_t outlen);
#define MSH_LOG_LINE_MAX 1024 /* bytes per line, newline included; longer lines end in "..." */
/* Test hooks: send lines to `fd` (-1: back to stderr; the caller keeps ownership), and restart
 * the warning cap's count. */
void msh_log_set_fd(int fd);
void msh_log_reset_warn_count(void);
#define msh_error(...) msh_log(MSH_LOG_ERROR, __VA_ARGS__)
#define msh_warn(...) msh_log(MSH_LOG_WARN, __VA_ARGS__)
#define msh_info(...) do { if (msh_log_level >= MSH_LOG_INFO) msh_log(MSH_LOG_INFO, __VA_ARGS__); } while (0)
#define msh_debug(...) do { if (msh_log_level >= MSH_LOG_DEBUG) msh_log(MSH_LOG_DEBUG, __VA_ARGS__); } while (0)

/* ---- configuration (policy/base/options.c) -------------------------------------------------------
 * Every MEMSHIM_* variable is one row of the option table in policy/base/options.c; this struct is
 * the parsed result. msh_config_load() reads the environment once; a bad value gives one warning
 * and the default (MEMSHIM_STRICT=1: abort after all are read). */
enum msh_mode { MSH_MODE_AUTO, MSH_MODE_TENSOR, MSH_MODE_SEGMENT, MSH_MODE_OFF };
enum msh_empty_cache { MSH_EC_NEVER, MSH_EC_OOM, MSH_EC_EPOCH, MSH_EC_THRESHOLD, MSH_EC_IDLE };
enum msh_gc { MSH_GC_NEVER, MSH_GC_OOM, MSH_GC_EPOCH, MSH_GC_THRESHOLD };
enum msh_epoch_src { MSH_EPOCH_AUTO, MSH_EPOCH_STEPS, MSH_EPOCH_SECONDS, MSH_EPOCH_SIGNAL, MSH_EPOCH_MANUAL };
enum msh_report_fmt { MSH_REPORT_JSON, MSH_REPORT_JSON_PRETTY };
enum msh_sites_mode { MSH_SITES_OFF, MSH_SITES_HELD, MSH_SITES_ACQUIRE, MSH_SITES_FRAMES };

enum msh_spill { MSH_SPILL_OFF, MSH_SPILL_HOST };

struct msh_config {
    int mode;                  /* enum msh_mode */
    uint64_t limit_bytes;      /* MEMSHIM_LIMIT as bytes; 0 = no limit */
    double limit_fraction;     /* MEMSHIM_LIMIT as a fraction of device memory; 0 = not used */
    int empty_cache;           /* enum msh_empty_cache */
    uint64_t empty_cache_threshold; /* bytes of reserved-but-free memory that trigger a release */
    double empty_cache_idle_s; /* seconds without an allocation that trigger a release */
    int gc;                    /* enum msh_gc */
    double gc_threshold;       /* fraction of the limit (or device) in use that triggers GC */
    bool defrag;               /* reclaim and remap free pages under pressure */
    bool front;                /* MEMSHIM_FRONT: the pool's front end of exact-size bins */
    int spill;                 /* enum msh_spill: MEMSHIM_SPILL */
    uint64_t spill_max_bytes;  /* MEMSHIM_SPILL_MAX as bytes (0 with no fraction: what the host gives) */
    double spill_max_fraction; /* MEMSHIM_SPILL_MAX as a fraction of host RAM; 0 = not used */
    uint64_t small_max;        /* requests up to this size are packed into small pages */
    int epoch_src;             /* enum msh_epoch_src */
    uint64_t epoch_steps;
    double epoch_seconds;
    int epoch_signal;          /* signal number, e.g. SIGUSR2 */
    uint64_t epoch_interval;   /* auto: interval reports every this many steps while no epoch closes; 0 = off */
    bool catch_signals;        /* SIGTERM/SIGINT/SIGHUP at their default: reports first, then the signal */
    bool trainer_metrics;      /* log per-epoch figures through Lightning's / HF Trainer's loggers */
    char report_dir[4096];     /* empty = no reports */
    int report_format;         /* enum msh_report_fmt */
    uint64_t latency_sample;   /* with reports: time one pool call in this many (1: all) */
    char trace_file[4096];     /* empty = no trace */
    int sites;                 /* enum msh_sites_mode */
    uint64_t sites_sample;     /* allocations below this many bytes are sampled; 0 = none */
    char snapshot[4096];       /* MEMSHIM_SNAPSHOT: PyTorch snapshot file; empty = none */
    uint64_t snapshot_events;  /* events the history ring keeps */
    int log_level;             /* enum msh_log_level */
    char log_file[4096];       /* empty = stderr */
    bool strict;
};
extern struct msh_config msh_cfg;
/* Parse the environment into msh_cfg (idempotent; the first call wins). Returns the number of
 * invalid values seen. */
int msh_config_load(void);
/* Reset msh_cfg to defaults and parse `envp` (NULL-terminated "NAME=value" strings) instead of
 * the process environment. For tests and for the replay tool. */
int msh_config_load_from(char *const *envp);
/* Print every option with its effective value and where it came from. */
void msh_config_dump(int level);
/* Option i (0-based) of the table: its name, its effective value formatted into val (vlen
 * bytes; the same spelling the docs use, e.g. "40GiB", "0.9", "SIGUSR2") and its source:
 * "default", "environment" or "MEMSHIM_CONF". Returns 1, or 0 when i is past the end. For
 * reports and tools. */
int msh_config_iter(int i, const char **name, char *val, size_t vlen, const char **source);
/* The whole of docs/configuration.md, generated from the option table (memshim-options). */
void msh_config_print_markdown(FILE *f);
/* Called by MEMSHIM_STRICT=1 after all options were read and some were invalid; abort() by
 * default. Tests replace it (the load then returns normally). */
extern void (*msh_config_abort_fn)(void);

/* Value parsers shared by the option table, the replay tool and tests. Each returns 0 or EINVAL
 * (ERANGE for a size that overflows 64 bits). */
int msh_parse_size(const char *s, uint64_t *out);     /* 123, 4K, 4KiB, 1.5G, 2TiB */
int msh_parse_fraction(const char *s, double *out);   /* 0 .. 1 */
int msh_parse_bool(const char *s, bool *out);         /* 1/0 true/false yes/no on/off */
int msh_parse_seconds(const char *s, double *out);    /* 5, 0.5, 5s, 100ms, 2m */
int msh_parse_signal(const char *s, int *out);        /* SIGUSR2, usr2, 12 (not KILL/STOP) */

/* ---- time ------------------------------------------------------------------------------------ */
uint64_t msh_now_ns(void); /* CLOCK_MONOTONIC */

#endif
