/*
 * report.h: per-epoch JSON reports, the final summary and OOM reports (docs/reports.md).
 *
 * JSON is built with jansson, loaded at run time (dlopen "libjansson.so.4"): when it is missing
 * the job runs on with one warning and no JSON. Files are written atomically (a temp file with an
 * unguessable name created O_EXCL|O_NOFOLLOW in the report directory, then rename), mode 0644,
 * in a directory memshim creates 0755 when needed. A failing disk gives one warning and stops
 * reports; it never stops the job. Nothing here runs with a pool lock held.
 *
 * A report is handed everything it shows: the shim fills struct msh_report (the pools' figures in
 * shim/core.c, the versions, allocation sites and PyTorch's facts in shim/report_feed.c) and
 * report.c formats and writes it. report/ never calls back into the shim; it reads only the pool's
 * types (pool.h), the driver cost table and the configuration below it.
 */
#ifndef MSH_REPORT_H
#define MSH_REPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "pool.h"
#include "stepfig.h"

#define MSH_REPORT_SCHEMA 2

/* Allocation sites (filled by shim/sites.c). */
struct msh_site_row {
    const char *file, *function; /* interned: valid for the life of the process */
    int line;
    uint64_t bytes, count; /* live bytes and blocks at the epoch's peak (estimates when sampled) */
};
struct msh_site_growth {
    const char *file, *function;
    int line;
    uint64_t growth_bytes_per_epoch;
    int epochs; /* epoch ends the growth was seen over */
};
#define MSH_REPORT_SITES 10

/* One of PyTorch's own memory_stats() figures handed over by the Python side (shim/torch.c). */
struct msh_report_stat {
    const char *key; /* stable until the Python side clears them after the report */
    int64_t val;
};
#define MSH_REPORT_TORCH_STATS 48

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
    char device_name[128]; /* the driver's name for the device; "" when unknown */
    /* top sites by live bytes at the epoch's peak, largest first; sites that grew every epoch */
    struct msh_site_row sites[MSH_REPORT_SITES];
    int nsites;
    struct msh_site_growth growing[MSH_REPORT_SITES];
    int ngrowing;
    /* MEMSHIM_SPILL=host: the sites of the blocks on host memory now, by host bytes, and the host
     * bytes of blocks with no known site */
    struct msh_site_row spilled_sites[MSH_REPORT_SITES];
    int nspilled_sites;
    uint64_t spilled_unattributed;
    /* segment mode: PyTorch's memory_stats() for the epoch; none in tensor mode */
    struct msh_report_stat torch_stats[MSH_REPORT_TORCH_STATS];
    int ntorch_stats;
    /* each optimizer step's peak allocated over its peak reserved, over the epoch's steps (the
     * shim notes one at every memshim_step); steps 0: no step was measured */
    struct msh_stepfig_summary step_ratio;
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
    /* versions: "13.0" as the driver and the process's libcudart report them, "" when unknown;
     * PyTorch's as the Python side reported it, NULL when unknown */
    char cuda_driver[16], cuda_runtime[16];
    const char *memshim_version; /* MEMSHIM_VERSION (memshim.h, the shim's public face) */
    const char *torch_version;
    const char *sites_note;      /* why `sites` is empty or estimated; NULL: nothing to say */
    uint64_t sites_sample_bytes; /* allocations below this are sampled; 0: none */
};

/* Open the report directory (MEMSHIM_REPORT_DIR with %p/%h expanded). Returns true when reports
 * will be written. */
bool msh_report_init(void);
/* Write one report; returns 0 or an errno (already logged once). */
int msh_report_write(const struct msh_report *r);
/* The file a report would go to (for logs and tests). */
int msh_report_path(const struct msh_report *r, int device, char *out, size_t len);
/* Who wrote a report (report/identity.c): the launcher whose variables gave the figures (NULL:
 * none), the process's rank, local rank, world size, node rank and restart count (-1: unknown),
 * and the launcher's job id ("": none). Read from the environment at each call. */
struct msh_identity {
    const char *launcher;
    long rank, local_rank, world_size, node_rank, restart;
    char run_id[80];
};
void msh_report_identity(struct msh_identity *id);
/* The identity's rank; -1: none. */
long msh_report_rank(void);
/* Write `len` bytes to `path` through a temp file with an unguessable name in the same directory
 * (O_EXCL|O_NOFOLLOW|O_CLOEXEC, `mode`) renamed into place. 0 or an errno; never leaves the temp
 * file behind. */
int msh_write_file_atomic(const char *path, const void *data, size_t len, int mode);

#endif
