/*
 * report.h: per-epoch JSON reports, the final summary and OOM reports (docs/reports.md).
 *
 * JSON is built with jansson, loaded at run time (dlopen "libjansson.so.4"): when it is missing
 * the job runs on with one warning and no JSON. Files are written atomically (a temp file with an
 * unguessable name created O_EXCL|O_NOFOLLOW in the report directory, then rename), mode 0644,
 * in a directory memshim creates 0755 when needed. A failing disk gives one warning and stops
 * reports; it never stops the job. Nothing here runs with a pool lock held.
 */
#ifndef MSH_REPORT_H
#define MSH_REPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "pool.h"

#define MSH_REPORT_SCHEMA 2

struct msh_report_device {
    int device;
    bool has_pool;
    struct msh_pool_stats st;
    bool had_oom;
    struct msh_pool_oom oom;
    int64_t external[3]; /* bytes allocated by others through hooked calls, by enum msh_ext_kind */
    uint64_t device_total, device_free;
    /* allocated bytes at the end of each closed epoch, oldest first (the last MSH_TREND_MAX) */
    const uint64_t *epoch_end_live;
    int nepoch_end;
};
#define MSH_TREND_MAX 64

struct msh_report {
    const char *kind;      /* "epoch", "summary" or "oom" */
    uint64_t epoch;        /* epoch index (0-based): the epoch under way for an OOM report */
    uint64_t oom_index;    /* OOM reports: 0, 1, ... in the order the failures claimed them */
    const char *reason;    /* what closed the epoch: manual, steps, seconds, signal, exit, oom,
                            * interval, interrupted (and the Python detectors' reasons) */
    double t_start, t_end; /* seconds since the process started using memshim */
    uint64_t steps;
    const char *mode;
    struct msh_report_device dev[8];
    int ndev;
    /* policy actions during the epoch */
    uint64_t empty_cache_runs, empty_cache_bytes, gc_runs;
    uint64_t gc_skipped_no_gil; /* GC steps skipped: this thread did not hold Python's GIL */
    const char *interrupted_by; /* reason `interrupted`: the signal ("SIGTERM"), else NULL */
};

/* Open the report directory (MEMSHIM_REPORT_DIR with %p/%h expanded). Returns true when reports
 * will be written. */
bool msh_report_init(void);
/* Write one report; returns 0 or an errno (already logged once). */
int msh_report_write(const struct msh_report *r);
/* The file a report would go to (for logs and tests). */
int msh_report_path(const struct msh_report *r, int device, char *out, size_t len);
/* The process's rank from RANK, LOCAL_RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID; -1: none. */
long msh_report_rank(void);
/* Write `len` bytes to `path` through a temp file with an unguessable name in the same directory
 * (O_EXCL|O_NOFOLLOW|O_CLOEXEC, `mode`) renamed into place. 0 or an errno; never leaves the temp
 * file behind. */
int msh_write_file_atomic(const char *path, const void *data, size_t len, int mode);

#endif
