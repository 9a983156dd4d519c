/*
 * report.c: write per-epoch, summary and OOM reports as JSON (schema in docs/reports.md).
 *
 * jansson is resolved at run time so libmemshim.so has no NEEDED entry outside glibc; without it
 * reports are skipped with one warning. Every file is written to an O_EXCL|O_NOFOLLOW|O_CLOEXEC
 * temp file (mode 0644 before the umask) with an unguessable name in the target directory and
 * renamed into place, so a reader never sees half a report, a planted symlink is never followed
 * (rename replaces a link at the final name, it does not write through it) and no descriptor
 * leaks into a child that execs. Directories memshim creates get mode 0755 before the umask. A
 * write error (disk full, read-only directory) disables reports with one warning naming
 * MEMSHIM_REPORT_DIR; the job always continues. Reports are not fsync'ed: they are atomic for
 * readers and across a crash of the job, not durable across a power loss (an epoch close must
 * not wait for the disk). Must never be called with a pool lock held.
 *
 * Schema 2 (docs/report.schema.json) adds `versions` (CUDA driver and runtime, device name,
 * memshim, torch), `latency` (percentiles of the pool's timed alloc/free calls, from the pool's
 * log-linear histogram: per epoch in epoch reports, since start otherwise), `driver` (the pool's
 * driver calls by kind and their modelled seconds), `sites` (allocation sites at the epoch's
 * peak, shim/sites.c) and `trend.growing_sites`.
 *
 * Everything a report shows is handed over in struct msh_report (report.h), filled by the shim
 * (shim/core.c, shim/report_feed.c): this file formats and writes it, and never calls back into
 * the shim.
 */
#include "report.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "drvcost.h"
#include "drvlog.h"
#include "msh.h"

static struct {
    void *h;
    json_t *(*object)(void);
    json_t *(*array)(void);
    json_t *(*integer)(json_int_t);
    json_t *(*real)(double);
    json_t *(*string)(const char *);
    json_t *(*boolean_true)(void);
    json_t *(*boolean_false)(void);
    int (*object_set_new)(json_t *, const char *, json_t *);
    int (*array_append_new)(json_t *, json_t *);
    json_t *(*null)(void);
    char *(*dumps)(const json_t *, size_t);
    void (*del)(json_t *);
} J;

static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;
static bool report_on, report_inited;
static char report_dir[PATH_MAX];
static char host[64];

#ifdef MSH_JANSSON_STATIC
/* `make JANSSON=static` (the pip package, the GPU check): jansson is linked into the library,
 * its symbols local to it (shim/exports.map), so reports need no libjansson on the machine and
 * NEEDED stays glibc only. */
static bool load_jansson(void)
{
    J.h = &J;
    J.object = json_object;
    J.array = json_array;
    J.integer = json_integer;
    J.real = json_real;
    J.string = json_string;
    J.boolean_true = json_true;
    J.boolean_false = json_false;
    J.object_set_new = json_object_set_new;
    J.array_append_new = json_array_append_new;
    J.null = json_null;
    J.dumps = json_dumps;
    J.del = json_delete;
    return true;
}
#else
static bool load_jansson(void)
{
    J.h = dlopen("libjansson.so.4", RTLD_NOW | RTLD_LOCAL);
    if (!J.h) return false;
#define SYM(f, n) (*(void **)&J.f = dlsym(J.h, n))
    SYM(object, "json_object");
    SYM(array, "json_array");
    SYM(integer, "json_integer");
    SYM(real, "json_real");
    SYM(string, "json_string");
    SYM(boolean_true, "json_true");
    SYM(boolean_false, "json_false");
    SYM(object_set_new, "json_object_set_new");
    SYM(array_append_new, "json_array_append_new");
    SYM(null, "json_null");
    SYM(dumps, "json_dumps");
    SYM(del, "json_delete");
#undef SYM
    return J.object && J.array && J.integer && J.real && J.string && J.boolean_true &&
           J.boolean_false && J.object_set_new && J.array_append_new && J.dumps && J.del && J.null;
}
#endif

/* For `memshim doctor`: where this library gets its JSON writer ("built in" when jansson is
 * linked in, else the libjansson file it loads), or NULL when it has none and writes no reports. */
MSH_EXPORT const char *memshim_report_writer(void)
{
#ifdef MSH_JANSSON_STATIC
    return "built in";
#else
    static char where[PATH_MAX];
    pthread_mutex_lock(&report_lock);
    bool ok = J.h || load_jansson();
    Dl_info di;
    if (ok && !where[0] && dladdr((void *)J.dumps, &di) && di.dli_fname)
        snprintf(where, sizeof where, "%s", di.dli_fname);
    pthread_mutex_unlock(&report_lock);
    return ok ? (where[0] ? where : "libjansson.so.4") : NULL;
#endif
}

/* json_decref is an inline that calls json_delete by symbol; ours goes through the table. */
static void jdecref(json_t *j)
{
    if (j && j->refcount != (size_t)-1 && --j->refcount == 0) J.del(j);
}

static int mkdirs(const char *dir)
{
    char buf[PATH_MAX];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof buf) return ENAMETOOLONG;
    memcpy(buf, dir, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(buf, 0755) && errno != EEXIST) return errno;
    struct stat sb;
    if (stat(buf, &sb) || !S_ISDIR(sb.st_mode)) return ENOTDIR;
    return 0;
}

bool msh_report_init(void)
{
    pthread_mutex_lock(&report_lock);
    if (report_inited) {
        bool on = report_on;
        pthread_mutex_unlock(&report_lock);
        return on;
    }
    report_inited = true;
    if (gethostname(host, sizeof host - 1)) strcpy(host, "host");
    for (char *p = host; *p; p++)
        if (*p == '/' || *p == '.') *p = *p == '.' ? 0 : '_';
    if (msh_cfg.report_dir[0]) {
        if (msh_resolve_path(msh_cfg.report_dir, report_dir, sizeof report_dir)) {
            msh_warn("MEMSHIM_REPORT_DIR='%.200s' is too long after expansion; reports are off",
                     msh_cfg.report_dir);
        } else if (!load_jansson()) {
            msh_warn("libjansson.so.4 not found (install libjansson4); running without JSON reports");
        } else {
            int rc = mkdirs(report_dir);
            if (rc)
                msh_warn("MEMSHIM_REPORT_DIR: cannot create report directory '%s': %s; reports are off",
                         report_dir, strerror(rc));
            else report_on = true;
        }
    }
    pthread_mutex_unlock(&report_lock);
    return report_on;
}

int msh_report_path(const struct msh_report *r, int device, char *out, size_t len)
{
    char rank[32] = "";
    long rk = msh_report_rank();
    if (rk >= 0) snprintf(rank, sizeof rank, "-rank%ld", rk); /* the same rank as the report's */
    char what[48];
    if (!strcmp(r->kind, "epoch")) snprintf(what, sizeof what, "epoch%04llu", (unsigned long long)r->epoch);
    else if (!strcmp(r->kind, "oom")) snprintf(what, sizeof what, "oom%04llu", (unsigned long long)r->oom_index);
    else snprintf(what, sizeof what, "summary");
    int n = snprintf(out, len, "%s/memshim-%s-pid%d%s-dev%d-%s.json", report_dir, host, (int)getpid(), rank,
                     device, what);
    return n < 0 || (size_t)n >= len ? ENAMETOOLONG : 0;
}

static void set_u(json_t *o, const char *k, uint64_t v) { J.object_set_new(o, k, J.integer((json_int_t)v)); }
static void set_i(json_t *o, const char *k, int64_t v) { J.object_set_new(o, k, J.integer((json_int_t)v)); }
static void set_d(json_t *o, const char *k, double v) { J.object_set_new(o, k, J.real(v)); }
static void set_s(json_t *o, const char *k, const char *v) { J.object_set_new(o, k, J.string(v ? v : "")); }
static void set_b(json_t *o, const char *k, bool v) { J.object_set_new(o, k, v ? J.boolean_true() : J.boolean_false()); }
static void set_sn(json_t *o, const char *k, const char *v) { J.object_set_new(o, k, v ? J.string(v) : J.null()); }
static void set_ni(json_t *o, const char *k, long v) { J.object_set_new(o, k, v >= 0 ? J.integer((json_int_t)v) : J.null()); }

/* ---- versions ---------------------------------------------------------------------------------- */

/* The driver's, the runtime's and the device's were read by the shim (shim/report_feed.c). */
static json_t *versions_json(const struct msh_report *r, const struct msh_report_device *d)
{
    json_t *v = J.object();
    set_sn(v, "cuda_driver", r->cuda_driver[0] ? r->cuda_driver : NULL);
    set_sn(v, "cuda_runtime", r->cuda_runtime[0] ? r->cuda_runtime : NULL);
    set_sn(v, "device_name", d->device_name[0] ? d->device_name : NULL);
    set_s(v, "memshim", r->memshim_version);
    set_sn(v, "torch", r->torch_version); /* handed over by the Python side (shim/torch.c) */
    return v;
}

/* ---- latency ------------------------------------------------------------------------------------ */

/* Histograms at the last epoch report, per device, so an epoch report covers its own epoch. Read
 * and written under core.c's epoch lock (every report is built under it). */
static uint64_t lat_prev[MSH_MAX_DEVICES][2][MSH_LAT_BUCKETS];

static json_t *percentiles(const uint64_t *h, const uint64_t *prev, uint64_t max)
{
    uint64_t d[MSH_LAT_BUCKETS], n = 0;
    int top = -1;
    for (int b = 0; b < MSH_LAT_BUCKETS; b++) {
        d[b] = h[b] - (prev ? prev[b] : 0);
        n += d[b];
        if (d[b]) top = b;
    }
    json_t *o = J.object();
    static const struct { const char *k; double p; } ps[] = {{"p50", 0.50}, {"p90", 0.90}, {"p99", 0.99}};
    for (size_t i = 0; i < sizeof ps / sizeof *ps; i++) {
        if (!n) {
            J.object_set_new(o, ps[i].k, J.null());
            continue;
        }
        uint64_t want = (uint64_t)(ps[i].p * (double)n + 0.999999), cum = 0;
        int b = 0;
        for (; b < MSH_LAT_BUCKETS; b++) {
            cum += d[b];
            if (cum >= want) break;
        }
        uint64_t v = msh_lat_upper(b < MSH_LAT_BUCKETS ? b : MSH_LAT_BUCKETS - 1);
        set_u(o, ps[i].k, v < max ? v : max);
    }
    if (!n) J.object_set_new(o, "max", J.null());
    else {
        uint64_t up = msh_lat_upper(top);
        set_u(o, "max", prev && up < max ? up : max);
    }
    set_u(o, "count", n);
    return o;
}

static json_t *latency_json(const struct msh_report *r, const struct msh_report_device *d)
{
    bool epoch = !strcmp(r->kind, "epoch");
    int dev = d->device >= 0 && d->device < MSH_MAX_DEVICES ? d->device : 0;
    json_t *l = J.object();
    J.object_set_new(l, "alloc_ns", percentiles(d->st.alloc_lat, epoch ? lat_prev[dev][0] : NULL, d->st.alloc_ns_max));
    J.object_set_new(l, "free_ns", percentiles(d->st.free_lat, epoch ? lat_prev[dev][1] : NULL, d->st.free_ns_max));
    set_s(l, "covers", epoch ? "epoch" : "run");
    if (epoch) {
        memcpy(lat_prev[dev][0], d->st.alloc_lat, sizeof lat_prev[dev][0]);
        memcpy(lat_prev[dev][1], d->st.free_lat, sizeof lat_prev[dev][1]);
    }
    return l;
}

/* ---- memshim's own cost (issue 24) ------------------------------------------------------------
 * Every driver function memshim called itself (policy/base/drvlog.h: exact counts, measured
 * seconds), the synchronizes among them by kind, and memshim's time on its allocation and free
 * paths (sampled: policy/base/hotclock.h) against the wall time the report covers. The ledger is
 * the process's; an epoch report shows what changed since the device's previous epoch report. */
static struct msh_drvlog_snap dl_prev[MSH_MAX_DEVICES];
static uint64_t path_prev[MSH_MAX_DEVICES]; /* alloc + free ns at the device's last epoch report */

static json_t *count_seconds(uint64_t n, double sec)
{
    json_t *o = J.object();
    set_u(o, "count", n);
    set_d(o, "seconds", sec > 0 ? sec : 0);
    return o;
}

static json_t *overhead_json(const struct msh_report *r, const struct msh_report_device *d)
{
    bool epoch = !strcmp(r->kind, "epoch");
    int dev = d->device >= 0 && d->device < MSH_MAX_DEVICES ? d->device : 0;
    struct msh_drvlog_snap now, delta;
    msh_drvlog_read(&now);
    msh_drvlog_diff(&now, epoch ? &dl_prev[dev] : NULL, &delta);
    json_t *o = J.object();
    set_s(o, "covers", epoch ? "epoch" : "run");
    set_s(o, "scope", "process");
    json_t *calls = J.object();
    double drv_s = 0;
    for (int f = 0; f < MSH_DL_N; f++) {
        if (!delta.count[f]) continue;
        J.object_set_new(calls, msh_drvlog_names[f], count_seconds(delta.count[f], delta.seconds[f]));
        drv_s += delta.seconds[f];
    }
    J.object_set_new(o, "driver_calls", calls);
    set_d(o, "driver_seconds", drv_s);
    json_t *sync = J.object();
    for (int k = 0; k < MSH_SYNC_NKINDS; k++) {
        int f = msh_sync_kind_fn(k);
        J.object_set_new(sync, msh_sync_kind_names[k], f < 0 ? count_seconds(0, 0) : count_seconds(delta.count[f], delta.seconds[f]));
    }
    J.object_set_new(o, "synchronizes", sync);
    const struct msh_pool_stats *st = &d->st;
    J.object_set_new(o, "alloc_path_ns", percentiles(st->alloc_lat, epoch ? lat_prev[dev][0] : NULL, st->alloc_ns_max));
    J.object_set_new(o, "free_path_ns", percentiles(st->free_lat, epoch ? lat_prev[dev][1] : NULL, st->free_ns_max));
    uint64_t path_ns = st->alloc_ns_total + st->free_ns_total;
    uint64_t path_d = path_ns - (epoch ? path_prev[dev] : 0);
    /* an epoch covers its interval; a summary or OOM report the run (times count from start-up).
     * Several threads' paths add up: the share is of the allocating threads' wall time (each
     * thread with a timed call in what the report covers counts its whole wall), so it stays
     * within 0..1 however many threads allocate. */
    double wall = epoch ? r->t_end - r->t_start : r->t_end;
    uint64_t threads = epoch ? st->timed_threads : st->timed_threads_run;
    set_d(o, "path_seconds", (double)path_d * 1e-9);
    set_u(o, "threads", threads);
    if (wall > 0) set_d(o, "share_of_wall", (double)path_d * 1e-9 / (wall * (double)(threads ? threads : 1)));
    else J.object_set_new(o, "share_of_wall", J.null());
    if (epoch) {
        dl_prev[dev] = now;
        path_prev[dev] = path_ns;
    }
    return o;
}

/* ---- sites -------------------------------------------------------------------------------------- */

static json_t *site_json(const char *file, int line, const char *function)
{
    json_t *o = J.object();
    set_s(o, "file", file);
    set_i(o, "line", line);
    set_s(o, "function", function);
    return o;
}

static void sites_json(json_t *root, json_t *trend, const struct msh_report *r, const struct msh_report_device *d,
                       char *verdict_extra, size_t extra_len)
{
    const struct msh_site_row *rows = d->sites;
    int n = d->nsites;
    json_t *arr = J.array();
    for (int i = 0; i < n; i++) {
        json_t *o = site_json(rows[i].file, rows[i].line, rows[i].function);
        set_u(o, "bytes", rows[i].bytes);
        set_u(o, "count", rows[i].count);
        J.array_append_new(arr, o);
    }
    J.object_set_new(root, "sites", arr);
    const char *note = r->sites_note;
    char buf[200];
    if (!note && !n && strcmp(r->mode, "tensor"))
        note = "segment mode: memshim sees PyTorch's segments, not tensors; sites need tensor mode";
    else if (!note && !n)
        note = "no tensor allocations were attributed in this period";
    else if (!note && r->sites_sample_bytes) {
        snprintf(buf, sizeof buf, "allocations below %llu bytes are sampled: their bytes and counts are estimates",
                 (unsigned long long)r->sites_sample_bytes);
        note = buf;
    }
    set_sn(root, "sites_note", note);

    const struct msh_site_growth *g = d->growing;
    int ng = d->ngrowing;
    json_t *garr = J.array();
    for (int i = 0; i < ng; i++) {
        json_t *o = site_json(g[i].file, g[i].line, g[i].function);
        set_u(o, "growth_bytes_per_epoch", g[i].growth_bytes_per_epoch);
        J.array_append_new(garr, o);
    }
    J.object_set_new(trend, "growing_sites", garr);
    if (ng) {
        const char *base = strrchr(g[0].file, '/');
        snprintf(verdict_extra, extra_len, " (fastest-growing site: %s:%d %s, +%.1f MiB per epoch)",
                 base ? base + 1 : g[0].file, g[0].line, g[0].function, g[0].growth_bytes_per_epoch / 1048576.0);
    }
}

static json_t *build(const struct msh_report *r, const struct msh_report_device *d)
{
    json_t *root = J.object();
    set_i(root, "schema_version", MSH_REPORT_SCHEMA);
    set_s(root, "kind", r->kind);
    set_s(root, "memshim_version", r->memshim_version);
    set_s(root, "host", host);
    set_i(root, "pid", getpid());
    /* who wrote it (report/identity.c): one reading of the environment for all of it */
    struct msh_identity id;
    msh_report_identity(&id);
    set_i(root, "rank", id.rank);
    set_ni(root, "local_rank", id.local_rank);
    set_ni(root, "world_size", id.world_size);
    set_ni(root, "node_rank", id.node_rank);
    set_ni(root, "restart", id.restart);
    set_sn(root, "launcher", id.launcher);
    set_sn(root, "run_id", id.run_id[0] ? id.run_id : NULL);
    set_i(root, "device", d->device);
    set_u(root, "epoch", r->epoch);
    if (!strcmp(r->kind, "oom")) set_u(root, "oom_index", r->oom_index);
    set_s(root, "reason", r->reason);
    if (r->interrupted_by) set_s(root, "interrupted_by", r->interrupted_by);
    set_s(root, "mode", r->mode);
    set_d(root, "t_start_s", r->t_start);
    set_d(root, "t_end_s", r->t_end);
    set_u(root, "steps", r->steps);
    set_u(root, "wall_time_unix", (uint64_t)time(NULL));
    /* When memshim started in this process on the wall clock, to the microsecond: memshim-report
     * orders processes by it (an elastic restart starts its ranks within the second the last attempt
     * ended in, where wall_time_unix's whole seconds cannot tell the attempts apart). */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    set_d(root, "start_unix", (double)now.tv_sec + (double)now.tv_nsec / 1e9 - r->t_end);
    J.object_set_new(root, "versions", versions_json(r, d));

    const struct msh_pool_stats *st = &d->st;
    json_t *mem = J.object();
    set_b(mem, "pool_active", d->has_pool);
    set_u(mem, "allocated_bytes", st->live_bytes);
    set_u(mem, "allocated_peak_bytes", st->peak_live_bytes);
    set_u(mem, "reserved_bytes", st->mapped_bytes);
    set_u(mem, "reserved_peak_bytes", st->peak_mapped_bytes);
    set_u(mem, "allocated_run_peak_bytes", st->run_peak_live_bytes);
    set_u(mem, "reserved_run_peak_bytes", st->run_peak_mapped_bytes);
    set_u(mem, "touched_bytes", st->touched_bytes);
    set_u(mem, "touched_peak_bytes", st->peak_touched_bytes);
    set_u(mem, "physical_mapped_bytes", st->mapped_bytes);
    set_u(mem, "virtual_reserved_bytes", st->va_bytes);
    set_u(mem, "free_in_mapped_bytes", st->free_bytes);
    set_u(mem, "largest_free_extent_bytes", st->largest_free);
    set_u(mem, "live_blocks", st->live_blocks);
    set_u(mem, "device_total_bytes", d->device_total);
    set_u(mem, "device_free_bytes", d->device_free);
    json_t *ext = J.object();
    set_i(ext, "cuda_malloc_passthrough_bytes", d->external[0]);
    set_i(ext, "async_pool_bytes", d->external[1]);
    set_i(ext, "vmm_by_others_bytes", d->external[2]);
    int64_t other = 0;
    if (d->device_total) {
        int64_t used = (int64_t)(d->device_total - d->device_free);
        other = used - (int64_t)st->mapped_bytes;
        if (other < 0) other = 0;
    }
    set_i(ext, "other_bytes_on_device", other);
    J.object_set_new(mem, "not_served_by_memshim", ext);
    J.object_set_new(root, "memory", mem);

    json_t *frag = J.object();
    double f_extent = st->free_bytes ? 1.0 - (double)st->largest_free / (double)st->free_bytes : 0.0;
    set_d(frag, "free_extent_fragmentation", f_extent);
    set_d(frag, "peak_allocated_over_peak_reserved",
          st->peak_mapped_bytes ? (double)st->peak_live_bytes / (double)st->peak_mapped_bytes : 1.0);
    if (d->step_ratio.steps) { /* STAlloc's figure (docs/reports.md) */
        json_t *sr = J.object();
        set_d(sr, "min", d->step_ratio.min);
        set_d(sr, "median", d->step_ratio.median);
        set_d(sr, "max", d->step_ratio.max);
        set_u(sr, "steps", d->step_ratio.steps);
        J.object_set_new(frag, "step_allocated_over_reserved", sr);
    } else {
        J.object_set_new(frag, "step_allocated_over_reserved", J.null());
    }
    /* negative only with spill: live blocks whose pages are on the host */
    set_i(frag, "reserved_minus_allocated_at_peak_bytes",
          (int64_t)st->at_peak_mapped_bytes - (int64_t)st->at_peak_live_bytes);
    J.object_set_new(root, "fragmentation", frag);

    json_t *ops = J.object();
    set_u(ops, "allocs", st->allocs);
    set_u(ops, "frees", st->frees);
    set_u(ops, "alloc_failures", st->alloc_fail);
    set_u(ops, "map_ops", st->map_ops);
    set_u(ops, "unmap_ops", st->unmap_ops);
    set_u(ops, "create_ops", st->create_ops);
    set_u(ops, "release_ops", st->release_ops);
    set_u(ops, "reclaimed_pages", st->reclaimed_pages);
    set_u(ops, "released_pages", st->released_pages);
    set_u(ops, "cross_stream_waits", st->cross_stream_waits);
    /* the pool's streams, learned step and threads (docs/pool.md; issue 10) */
    set_u(ops, "cross_stream_reuses", st->cross_stream_reuses);
    set_u(ops, "free_event_records", st->free_event_records);
    set_u(ops, "reuse_event_records", st->reuse_event_records);
    set_u(ops, "event_queries", st->event_queries);
    set_u(ops, "demand_records", st->demand_records);
    set_u(ops, "fresh_placements", st->fresh_placements);
    set_u(ops, "capture_deferrals", st->capture_deferrals);
    set_u(ops, "parked_frees", st->parked_frees);
    set_u(ops, "plans_built", st->plans_built);
    set_u(ops, "plan_placed", st->plan_placed);
    set_u(ops, "plan_dropped", st->plan_dropped);
    set_u(ops, "lock_waits", st->lock_waits);
    set_u(ops, "handles", st->handles);
    set_d(ops, "alloc_mean_ns", st->allocs ? (double)st->alloc_ns_total / (double)st->allocs : 0.0);
    set_d(ops, "free_mean_ns", st->frees ? (double)st->free_ns_total / (double)st->frees : 0.0);
    J.object_set_new(root, "operations", ops);
    /* the front end (issue 30, docs/pool.md): cumulative like operations; binned bytes now and
     * at their most in the epoch (reserved and inactive, never allocated) */
    json_t *fe = J.object();
    set_s(fe, "state", msh_front_state_name(st->front_state));
    set_u(fe, "hits", st->front_hits);
    set_u(fe, "misses", st->front_misses);
    set_u(fe, "puts", st->front_puts);
    set_u(fe, "drains", st->front_drains);
    set_u(fe, "drained_blocks", st->front_drained);
    set_u(fe, "grown_instead_of_draining", st->front_kept);
    set_u(fe, "grown_instead_of_draining_bytes", st->front_grown_aside);
    set_u(fe, "double_frees", st->double_frees);
    set_u(fe, "binned_bytes", st->binned_bytes);
    set_u(fe, "binned_blocks", st->binned_blocks);
    set_u(fe, "peak_binned_bytes", st->peak_binned_bytes);
    J.object_set_new(root, "front", fe);
    J.object_set_new(root, "memshim_overhead", overhead_json(r, d)); /* before latency: it reads lat_prev */
    J.object_set_new(root, "latency", latency_json(r, d));

    /* Every call the pool made to the driver, by kind, and what they cost by the default cost
     * table (policy/drvcost.c; docs/benchmarks.md): cumulative, like `operations`. */
    json_t *drv = J.object(), *calls = J.object();
    for (int k = 0; k < MSH_DRV_NKINDS; k++) set_u(calls, msh_drv_call_names[k], st->drv_calls[k]);
    J.object_set_new(drv, "calls", calls);
    set_d(drv, "modelled_seconds", msh_drvcost_seconds(msh_drvcost_default(), st->drv_calls, st->drv_bytes, st->drv_maps));
    J.object_set_new(root, "driver", drv);

    json_t *hist = J.array();
    for (int i = 0; i < 24; i++) {
        json_t *b = J.object();
        set_u(b, "lt_bytes", (uint64_t)512 << i);
        set_u(b, "count", st->hist[i]);
        J.array_append_new(hist, b);
    }
    J.object_set_new(root, "size_histogram", hist);

    json_t *res = J.object();
    set_u(res, "oom_events", st->oom_events);
    set_u(res, "rescued_by_reclaim", st->rescue_reclaim);
    set_u(res, "rescued_by_gc", st->rescue_gc);
    set_u(res, "rescued_by_empty_cache", st->rescue_empty_cache);
    set_u(res, "rescued_by_spill", st->rescue_spill);
    J.object_set_new(root, "oom", res);

    /* MEMSHIM_SPILL=host (docs/pool.md "Spill"): host memory behind the pool's addresses */
    json_t *sp = J.object();
    J.object_set_new(sp, "enabled", msh_cfg.spill == MSH_SPILL_HOST ? J.boolean_true() : J.boolean_false());
    set_u(sp, "spilled_bytes", st->spilled_bytes);
    set_u(sp, "spilled_peak_bytes", st->peak_spilled_bytes);
    set_u(sp, "spilled_run_peak_bytes", st->run_peak_spilled_bytes);
    set_u(sp, "pages_to_host", st->spill_out_pages);
    set_u(sp, "pages_to_device", st->spill_in_pages);
    set_u(sp, "bytes_to_host", st->spill_out_bytes);
    set_u(sp, "bytes_to_device", st->spill_in_bytes);
    set_d(sp, "seconds_moving", (double)st->spill_ns / 1e9);
    set_u(sp, "requests_refused", st->spill_refused);
    /* where the spilled bytes are: the sites of the blocks on the host now, by host bytes */
    json_t *ss = J.array();
    for (int i = 0; i < d->nspilled_sites; i++) {
        const struct msh_site_row *x = &d->spilled_sites[i];
        json_t *o = J.object();
        J.object_set_new(o, "file", J.string(x->file));
        set_i(o, "line", x->line);
        J.object_set_new(o, "function", J.string(x->function));
        set_u(o, "host_bytes", x->bytes);
        set_u(o, "blocks", x->count);
        J.array_append_new(ss, o);
    }
    J.object_set_new(sp, "sites", ss);
    set_u(sp, "unattributed_host_bytes", d->spilled_unattributed);
    J.object_set_new(root, "spill", sp);

    if (d->had_oom) {
        const struct msh_pool_oom *o = &d->oom;
        json_t *diag = J.object();
        set_u(diag, "requested_bytes", o->requested);
        set_u(diag, "device_total_bytes", o->device_total);
        set_u(diag, "device_free_bytes", o->device_free);
        set_u(diag, "live_bytes", o->live_bytes);
        set_u(diag, "reserved_bytes", o->mapped_bytes);
        set_u(diag, "limit_bytes", o->limit_bytes);
        set_u(diag, "largest_free_extent_bytes", o->largest_free);
        set_s(diag, "cause", o->fragmentation ? "fragmentation" : "capacity");
        set_s(diag, "case", msh_oom_case_name(o->kind));
        set_u(diag, "cached_bytes", o->cached_bytes);
        json_t *top = J.array();
        for (int i = 0; i < o->ntop; i++) {
            json_t *b = J.object();
            char hex[32];
            snprintf(hex, sizeof hex, "0x%llx", (unsigned long long)o->top[i].addr);
            set_s(b, "addr", hex);
            set_u(b, "bytes", o->top[i].size);
            J.array_append_new(top, b);
        }
        J.object_set_new(diag, "largest_live_blocks", top);
        J.object_set_new(root, "last_oom", diag);
    }

    json_t *pol = J.object();
    set_u(pol, "empty_cache_runs", r->empty_cache_runs);
    set_u(pol, "empty_cache_released_bytes", r->empty_cache_bytes);
    set_u(pol, "gc_runs", r->gc_runs);
    set_u(pol, "gc_skipped_no_gil", r->gc_skipped_no_gil);
    J.object_set_new(root, "policies", pol);

    /* Leak/trend verdict: allocated bytes at the end of each epoch so far. Growth at every one of
     * at least three boundaries (by more than 1 MiB each) is reported as a possible leak. */
    json_t *trend = J.array();
    int grew = 0;
    for (int i = 0; i < d->nepoch_end; i++) {
        J.array_append_new(trend, J.integer((json_int_t)d->epoch_end_live[i]));
        if (i && d->epoch_end_live[i] > d->epoch_end_live[i - 1] + MSH_MiB) grew++;
    }
    json_t *tr = J.object();
    J.object_set_new(tr, "epoch_end_allocated_bytes", trend);
    char extra[256] = "";
    sites_json(root, tr, r, d, extra, sizeof extra);
    char verdict[400];
    if (d->nepoch_end < 3) snprintf(verdict, sizeof verdict, "too few epochs");
    else if (grew == d->nepoch_end - 1)
        snprintf(verdict, sizeof verdict, "possible leak: allocated memory grew at every epoch%s", extra);
    else snprintf(verdict, sizeof verdict, "flat");
    set_s(tr, "verdict", verdict);
    J.object_set_new(root, "trend", tr);

    /* Segment mode: PyTorch's own memory_stats() for the epoch, handed over by the Python side
     * (shim/torch.c); absent when it handed none (tensor mode, or CUDA not initialized). */
    if (d->ntorch_stats) {
        json_t *ts = J.object();
        for (int i = 0; i < d->ntorch_stats; i++) set_i(ts, d->torch_stats[i].key, d->torch_stats[i].val);
        J.object_set_new(root, "torch_memory_stats", ts);
    }

    json_t *cfg = J.object();
    char val[512];
    const char *name, *source;
    for (int i = 0; msh_config_iter(i, &name, val, sizeof val, &source); i++) {
        json_t *e = J.object();
        set_s(e, "value", val);
        set_s(e, "source", source);
        J.object_set_new(cfg, name, e);
    }
    J.object_set_new(root, "config", cfg);
    return root;
}

/* All of text, retrying on EINTR; 0 or an errno value (a write of 0 bytes counts as EIO). */
static int write_full(int fd, const char *text, size_t len)
{
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, text + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        off += (size_t)w;
    }
    return 0;
}

int msh_write_file_atomic(const char *path, const void *data, size_t len, int mode)
{
    char tmp[PATH_MAX + 32];
    int fd = -1;
    /* A name taken by someone else (O_EXCL) gets a new random one, a few times. */
    for (int attempt = 0; attempt < 4 && fd < 0; attempt++) {
        unsigned char rnd[8];
        if (getrandom(rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
            uint64_t t = msh_now_ns() ^ ((uint64_t)getpid() << 32) ^ ((uint64_t)attempt << 60);
            memcpy(rnd, &t, sizeof rnd);
        }
        int n = snprintf(tmp, sizeof tmp, "%s.tmp%02x%02x%02x%02x%02x%02x%02x%02x", path, rnd[0], rnd[1],
                         rnd[2], rnd[3], rnd[4], rnd[5], rnd[6], rnd[7]);
        if (n < 0 || (size_t)n >= sizeof tmp) return ENAMETOOLONG;
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
        if (fd < 0 && errno != EEXIST) return errno;
    }
    if (fd < 0) return EEXIST;
    int rc = write_full(fd, data, len);
    /* close() reports a delayed write error (NFS, quota); EINTR still releases the descriptor. */
    if (close(fd) && errno != EINTR && !rc) rc = errno;
    /* rename() replaces a planted symlink at the final name rather than following it. */
    if (!rc && rename(tmp, path)) rc = errno;
    if (rc) unlink(tmp);
    return rc;
}

/* The first failure turns reports off with one warning; later writers return quietly. */
static int reports_off(const char *path, int err)
{
    pthread_mutex_lock(&report_lock);
    bool was_on = report_on;
    report_on = false;
    pthread_mutex_unlock(&report_lock);
    if (was_on)
        msh_warn("MEMSHIM_REPORT_DIR: cannot write report %.300s: %s; reports are off for the rest of "
                 "this run (the job continues)",
                 path, strerror(err));
    return err;
}

int msh_report_write(const struct msh_report *r)
{
    if (!msh_report_init()) return ENOENT;
    int rc = 0;
    for (int i = 0; i < r->ndev; i++) {
        const struct msh_report_device *d = &r->dev[i];
        char path[PATH_MAX];
        if (msh_report_path(r, d->device, path, sizeof path))
            return reports_off(report_dir, ENAMETOOLONG);
        json_t *root = build(r, d);
        char *text = root ? J.dumps(root, msh_cfg.report_format == MSH_REPORT_JSON_PRETTY
                                              ? JSON_INDENT(2) | JSON_SORT_KEYS
                                              : JSON_COMPACT | JSON_SORT_KEYS)
                          : NULL;
        jdecref(root);
        if (!text) {
            rc = ENOMEM;
            continue;
        }
        size_t tl = strlen(text);
        text[tl] = '\n'; /* json_dumps leaves room: the NUL becomes the newline */
        int w = msh_write_file_atomic(path, text, tl + 1, 0644);
        free(text);
        if (w) return reports_off(path, w);
        msh_debug("wrote %s", path);
    }
    return rc;
}
