/*
 * core.c: process-wide state of libmemshim.so: start-up, one pool per device, epochs and the
 * empty-cache / GC policies, accounting of memory memshim does not serve, fork and exit.
 *
 * Start-up is lazy (the first hook or API call) and idempotent; it must survive being re-entered
 * from dlsym/dlopen and must never make the host job fail: any problem turns memshim into a pass-
 * through with one message. Nothing here calls a CUDA hook, and the pool lock is never held
 * while a report is built or the GC callback runs.
 */
#include "core.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_real.h"
#include "drvlog.h"
#include "device.h"
#include "history.h"
#include "hotclock.h"
#include "memshim.h"
#include "msh.h"
#include "peers.h"
#include "report.h"
#include "sites.h"
#include "torch.h"
#include "watch.h"

__thread struct msh_core_tls msh_core_tls;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static bool enabled;
static _Atomic bool started; /* do_init finished with memshim enabled (readable without init) */
static bool epoch_detect;     /* MEMSHIM_EPOCH=auto with no steps/seconds: the Python detector decides */
static int mode_eff = MSH_MODE_OFF;
static uint64_t t0_ns;

static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
static struct msh_pool *_Atomic pools[MSH_MAX_DEVICES];
static struct msh_device devices[MSH_MAX_DEVICES];
static bool pool_failed[MSH_MAX_DEVICES];
/* MEMSHIM_GC=threshold's capacity per device, fixed when the pool is made (no query per tick) */
static size_t gc_cap[MSH_MAX_DEVICES];
static _Atomic int64_t external[MSH_MAX_DEVICES][MSH_EXT_NKINDS];

/* epochs and policies */
static pthread_mutex_t epoch_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t epoch_index, epoch_start_ns, steps_in_epoch, steps_total;
static bool steps_close_claimed;           /* a thread is closing the steps epoch (epoch_lock) */
static bool lat_on; /* reports on: tensor mode's entries time sampled calls (msh_core_alloc) */
static uint64_t ec_runs, ec_bytes, gc_runs;
static uint64_t trim_base[MSH_MAX_DEVICES][2]; /* pool trim_runs/trim_bytes at the epoch's start */
static uint64_t trend_live[MSH_MAX_DEVICES][MSH_TREND_MAX]; /* under epoch_lock */
static int trend_n[MSH_MAX_DEVICES];
static uint64_t epoch_allocs_base[MSH_MAX_DEVICES]; /* pool allocs when the epoch began (epoch_lock) */
/* Each optimizer step's peak allocated over its peak reserved in this epoch, per device: made at
 * the device's first step mark, under epoch_lock (fragmentation.step_allocated_over_reserved). */
static struct msh_stepfig *step_ratio[MSH_MAX_DEVICES];
/* The figures of each device's last closed epoch, for the frameworks' loggers (epoch_lock). */
static struct memshim_epoch_figures last_fig[MSH_MAX_DEVICES];
static void spill_mark_all(void);
static bool last_fig_ok[MSH_MAX_DEVICES];
/* The end of the run (msh_core_finish): 0 not yet, 1 being written, 2 written. */
static _Atomic int finish_state;

/* MEMSHIM_TRACE_FILE: memshim's text trace (docs/trace-format.md), buffered, flushed at exit */
static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static int trace_fd = -1;
/* trace_fd >= 0, readable without trace_lock: the hot paths skip all trace work when off */
_Atomic bool msh_core_tracing_on; /* MEMSHIM_TRACE_FILE is written (core.h msh_core_trace) */
static char trace_buf[64 * 1024];
static size_t trace_len;
static uint64_t trace_committed; /* bytes of whole lines in the file */

static memshim_gc_fn gc_user_fn;
static void *gc_user_arg;

static void at_exit(void);
static void fork_prepare(void);
static void fork_parent(void);
static void fork_child(void);
static void *idle_thread(void *arg);
static void *trim_thread(void *arg);

uint64_t msh_now_ns(void);

/* Write the buffer out. The buffer holds whole lines, so on a failed or short write (disk full)
 * the file is cut back to where this flush began: a trace always ends with a whole line. Then
 * one warning, and tracing stops; the job continues. */
static void trace_flush_locked(void)
{
    size_t off = 0;
    while (off < trace_len) {
        ssize_t w = write(trace_fd, trace_buf + off, trace_len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int err = w < 0 ? errno : EIO;
            int cut = ftruncate(trace_fd, (off_t)trace_committed);
            msh_warn("MEMSHIM_TRACE_FILE: write failed (%s); tracing stops at %llu bytes%s, the job "
                     "continues",
                     strerror(err), (unsigned long long)trace_committed,
                     cut == 0 ? " of whole lines" : " (the last line may be cut)");
            close(trace_fd);
            trace_fd = -1;
            atomic_store(&msh_core_tracing_on, false);
            break;
        }
        off += (size_t)w;
    }
    if (trace_fd >= 0) trace_committed += trace_len;
    trace_len = 0;
}

/* MEMSHIM_TRACE_FILE can reveal the job's code paths: the file is 0600 and must be the job's own.
 * A new file is created with O_EXCL; an existing one (a rerun with the same path) is reused only
 * if it is a regular file owned by this user with a single link, then truncated and set to 0600.
 * O_NOFOLLOW refuses a symlink planted at the name, O_NONBLOCK keeps a planted FIFO from hanging
 * the job, O_CLOEXEC keeps the descriptor out of exec'ed children. */
static void trace_open(void)
{
    char path[4096];
    if (msh_resolve_path(msh_cfg.trace_file, path, sizeof path)) {
        msh_warn("MEMSHIM_TRACE_FILE='%.200s' is too long after expansion; no trace", msh_cfg.trace_file);
        return;
    }
    const int flags = O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK;
    int fd = open(path, flags | O_CREAT | O_EXCL, 0600);
    const char *refused = NULL;
    if (fd < 0 && errno == EEXIST) {
        fd = open(path, flags);
        struct stat sb;
        if (fd >= 0) {
            if (fstat(fd, &sb) != 0) refused = "cannot be examined";
            else if (!S_ISREG(sb.st_mode)) refused = "is not a regular file";
            else if (sb.st_uid != geteuid()) refused = "belongs to another user";
            else if (sb.st_nlink != 1) refused = "has several links";
            else if (ftruncate(fd, 0) != 0 || fchmod(fd, 0600) != 0) refused = "cannot be truncated";
            if (refused) {
                close(fd);
                fd = -1;
            }
        }
    }
    if (fd < 0) {
        if (refused)
            msh_warn("refusing MEMSHIM_TRACE_FILE '%.300s': it %s; no trace", path, refused);
        else if (errno == ELOOP)
            msh_warn("refusing MEMSHIM_TRACE_FILE '%.300s': it is a symbolic link; no trace", path);
        else
            msh_warn("cannot open MEMSHIM_TRACE_FILE '%.300s': %s; no trace", path, strerror(errno));
        return;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    trace_fd = fd;
    atomic_store(&msh_core_tracing_on, true);
    trace_committed = 0;
    static const char hdr[] = "# memshim-trace 1\n";
    memcpy(trace_buf, hdr, sizeof hdr - 1);
    trace_len = sizeof hdr - 1;
}

bool msh_core_tracing(void)
{
    return atomic_load_explicit(&msh_core_tracing_on, memory_order_relaxed) || msh_history_recording();
}

void msh_core_trace_slow(char op, int device, uint64_t stream, uint64_t addr, uint64_t size)
{
    if (msh_history_recording()) msh_history_note(op, device, stream, addr, size); /* snapshot ring */
    if (!atomic_load_explicit(&msh_core_tracing_on, memory_order_relaxed)) return;
    char line[128];
    int n = snprintf(line, sizeof line, "%c %d 0x%llx 0x%llx %llu %llu\n", op, device, (unsigned long long)stream,
                     (unsigned long long)addr, (unsigned long long)size,
                     (unsigned long long)((msh_now_ns() - t0_ns) / 1000));
    if (n <= 0 || (size_t)n >= sizeof line) return;
    pthread_mutex_lock(&trace_lock);
    if (trace_fd >= 0) {
        if (trace_len + (size_t)n > sizeof trace_buf) trace_flush_locked();
        if (trace_fd >= 0) {
            memcpy(trace_buf + trace_len, line, (size_t)n);
            trace_len += (size_t)n;
        }
    }
    pthread_mutex_unlock(&trace_lock);
}

static void do_init(void)
{
    msh_in_hook++;
    msh_config_load();
    if (msh_cfg.log_file[0]) msh_log_open(msh_cfg.log_file);
    msh_hotclock_init();
    t0_ns = msh_now_ns();
    epoch_start_ns = t0_ns;
    if (msh_cfg.mode == MSH_MODE_OFF) {
        msh_info("MEMSHIM_MODE=off: pure pass-through");
        msh_in_hook--;
        return;
    }
    if (msh_cuda_load()) { /* a CPU-only process: stay out of the way */
        msh_in_hook--;
        return;
    }
    mode_eff = msh_cfg.mode == MSH_MODE_AUTO ? MSH_MODE_SEGMENT : msh_cfg.mode;
    enabled = true;
    /* info already echoes each non-default setting as it is read; the full table is debug */
    if (msh_log_level >= MSH_LOG_DEBUG) msh_config_dump(MSH_LOG_DEBUG);
    msh_history_init(msh_report_init());
    if (msh_cfg.trace_file[0]) trace_open();
    atexit(at_exit);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    epoch_detect = msh_cfg.epoch_src == MSH_EPOCH_AUTO && !msh_cfg.epoch_steps && !(msh_cfg.epoch_seconds > 0);
    if (msh_cfg.epoch_src == MSH_EPOCH_AUTO) /* documented in the option table */
        msh_cfg.epoch_src = msh_cfg.epoch_steps ? MSH_EPOCH_STEPS
                            : msh_cfg.epoch_seconds > 0 ? MSH_EPOCH_SECONDS : MSH_EPOCH_MANUAL;
    /* Time and signal epochs, and the reports of a run a signal ends: memshim's watcher thread. */
    msh_watch_start();
    if (msh_cfg.empty_cache == MSH_EC_IDLE || msh_cfg.empty_cache == MSH_EC_THRESHOLD) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, msh_cfg.empty_cache == MSH_EC_IDLE ? idle_thread : trim_thread, NULL))
            msh_warn("MEMSHIM_EMPTY_CACHE=%s: cannot start the watcher thread; %s",
                     msh_cfg.empty_cache == MSH_EC_IDLE ? "idle" : "threshold",
                     msh_cfg.empty_cache == MSH_EC_IDLE ? "idle release is off"
                                                        : "the excess is released at frees only");
        pthread_attr_destroy(&attr);
    }
    msh_info("memshim %s active (%s mode)", MEMSHIM_VERSION, mode_eff == MSH_MODE_TENSOR ? "tensor" : "segment");
    atomic_store(&started, true);
    msh_in_hook--;
}

bool msh_core_started(void)
{
    return atomic_load(&started);
}

bool msh_core_epoch_detect(void)
{
    return msh_core_started() && epoch_detect;
}

bool msh_core_init(void)
{
    pthread_once(&init_once, do_init);
    return enabled;
}

int msh_core_mode(void)
{
    return msh_core_init() ? mode_eff : MSH_MODE_OFF;
}

/* ---- the GC step ------------------------------------------------------------------------------
 * A callback set with memshim_set_gc_callback() wins, under the same rules. Without one, when
 * the process runs CPython memshim calls PyGC_Collect() itself, but only (1) on a thread that holds the GIL
 * (PyGILState_Check: autograd's worker threads do not, and taking the GIL there can deadlock
 * against the main thread, DESIGN.md 2), and (2) from memshim_malloc or an epoch boundary,
 * never from inside the cudaMalloc hook: there PyTorch's caching allocator is mid-way through
 * its own malloc, and a __del__ that frees a tensor would re-enter it. */
#define in_tensor_alloc (msh_core_tls.tensor_alloc)
static uint64_t gc_skipped_no_gil;
static struct {
    int (*gil_check)(void);
    int (*is_initialized)(void);
    ssize_t (*collect)(void);
} py;
static pthread_once_t py_once = PTHREAD_ONCE_INIT;

static void py_resolve(void)
{
    *(void **)&py.gil_check = dlsym(RTLD_DEFAULT, "PyGILState_Check");
    *(void **)&py.is_initialized = dlsym(RTLD_DEFAULT, "Py_IsInitialized");
    *(void **)&py.collect = dlsym(RTLD_DEFAULT, "PyGC_Collect");
}

/* The callback (or Python code run by the collector) frees and allocates through the hooks and
 * memshim_free: they must work as for any caller, so the re-entry guard is lifted around it. */
static size_t call_unguarded(memshim_gc_fn fn, void *arg)
{
    int saved = msh_in_hook;
    msh_in_hook = 0;
    size_t r = fn(arg);
    msh_in_hook = saved;
    return r;
}

static size_t py_collect_fn(void *arg)
{
    (void)arg;
    ssize_t n = py.collect();
    msh_debug("gc.collect() from the allocator found %zd unreachable objects", n);
    return n > 0 ? (size_t)n : 0;
}

/* A callback set with memshim_set_gc_callback() runs under the same rules as memshim's own
 * gc.collect() (issue 8: the documented use is pointing it at gc.collect()): only from
 * memshim_malloc or an epoch boundary, and in a CPython process only on a thread that holds the
 * GIL. Without CPython (a C program) the GIL rule does not apply. */
static size_t run_gc(bool from_epoch)
{
    memshim_gc_fn fn = __atomic_load_n(&gc_user_fn, __ATOMIC_ACQUIRE);
    void *arg = gc_user_arg;
    if (!from_epoch && !in_tensor_alloc) return 0;
    pthread_once(&py_once, py_resolve);
    bool python = py.gil_check && py.is_initialized && py.is_initialized();
    if (!fn && (!python || !py.collect)) return 0;
    if (python && !py.gil_check()) {
        pthread_mutex_lock(&epoch_lock);
        gc_skipped_no_gil++;
        pthread_mutex_unlock(&epoch_lock);
        return 0;
    }
    pthread_mutex_lock(&epoch_lock);
    gc_runs++;
    pthread_mutex_unlock(&epoch_lock);
    return fn ? call_unguarded(fn, arg) : call_unguarded(py_collect_fn, NULL);
}

static size_t gc_bridge(void *arg)
{
    (void)arg;
    if (msh_cfg.gc != MSH_GC_OOM && msh_cfg.gc != MSH_GC_THRESHOLD) return 0;
    return run_gc(false);
}

struct msh_pool *msh_core_pool(int device)
{
    if (device < 0 || device >= MSH_MAX_DEVICES) return NULL;
    /* a pool exists only once memshim started (a fork child's are gone): no init call per request */
    struct msh_pool *p = atomic_load_explicit(&pools[device], memory_order_acquire);
    if (MSH_LIKELY(p != NULL)) return p;
    if (!msh_core_init()) return NULL;
    pthread_mutex_lock(&pools_lock);
    p = atomic_load(&pools[device]);
    if (!p && !pool_failed[device]) {
        msh_in_hook++;
        int rc = msh_dev_cuda_init(&devices[device], device);
        if (rc == 0) {
            msh_history_wrap_device(&devices[device]); /* segment_map/unmap for snapshots */
            struct msh_pool_params prm;
            msh_pool_params_default(&prm);
            size_t f = 0, t = 0;
            devices[device].ops->mem_info(&devices[device], &f, &t);
            prm.limit_bytes = msh_cfg.limit_bytes;
            if (msh_cfg.limit_fraction > 0) prm.limit_bytes = (size_t)(msh_cfg.limit_fraction * (double)t);
            if (prm.limit_bytes && t && prm.limit_bytes > t) prm.limit_bytes = t; /* the pool takes t as none */
            prm.small_max = msh_cfg.small_max;
            prm.defrag = msh_cfg.defrag;
            prm.front = msh_cfg.front;
            if (msh_cfg.empty_cache == MSH_EC_THRESHOLD) prm.release_threshold = msh_cfg.empty_cache_threshold;
            prm.no_release_on_oom = msh_cfg.empty_cache == MSH_EC_NEVER;
            gc_cap[device] = msh_cfg.limit_bytes ? msh_cfg.limit_bytes
                             : msh_cfg.limit_fraction > 0 ? (size_t)(msh_cfg.limit_fraction * (double)t) : t;
            msh_torch_pool_params(device, t, &prm); /* one limit shared with capture pools */
            rc = msh_pool_create(&devices[device], &prm, &p);
        }
        if (rc == 0) {
            msh_pool_set_gc(p, gc_bridge, NULL);
            /* Latency figures serve the reports only; tensor mode times its calls from entry to
             * return (msh_core_alloc), the pool times the other callers' (the hooks). */
            msh_pool_set_timing(p, msh_report_init());
            lat_on = msh_report_init();
            atomic_store_explicit(&pools[device], p, memory_order_release);
            msh_info("device %d: pool ready", device);
            msh_peers_apply(device); /* peers the program enabled before this device's first allocation */
        } else {
            pool_failed[device] = true;
            p = NULL;
            if (rc != ENODEV) msh_warn("device %d: cannot create the pool (error %d); passing through", device, rc);
        }
        msh_in_hook--;
    }
    pthread_mutex_unlock(&pools_lock);
    return p;
}

struct msh_pool *msh_core_pool_get(int device)
{
    return device >= 0 && device < MSH_MAX_DEVICES ? atomic_load_explicit(&pools[device], memory_order_acquire) : NULL;
}

struct msh_pool *msh_core_pool_owning(uint64_t addr, int *device)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load_explicit(&pools[d], memory_order_acquire);
        if (p && msh_pool_owns(p, addr)) {
            if (device) *device = d;
            return p;
        }
    }
    return NULL;
}

struct msh_device *msh_core_device(int device)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || !atomic_load(&pools[device])) return NULL;
    return &devices[device];
}

int msh_core_sync_device(int device)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || !atomic_load(&pools[device]) || !devices[device].ops) return ENODEV;
    return devices[device].ops->synchronize(&devices[device]);
}

void msh_core_note_external(int device, int kind, int64_t delta)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || kind < 0 || kind >= MSH_EXT_NKINDS) return;
    atomic_fetch_add_explicit(&external[device][kind], delta, memory_order_relaxed);
}

/* ---- epochs ---------------------------------------------------------------------------------- */

static void fill_report(struct msh_report *r, const char *kind, const char *reason)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->reason = reason;
    r->mode = mode_eff == MSH_MODE_TENSOR ? "tensor" : mode_eff == MSH_MODE_SEGMENT ? "segment" : "off";
    r->epoch = epoch_index;
    r->t_start = (double)(epoch_start_ns - t0_ns) / 1e9;
    r->t_end = (double)(msh_now_ns() - t0_ns) / 1e9;
    r->steps = steps_in_epoch;
    r->empty_cache_runs = ec_runs;
    r->empty_cache_bytes = ec_bytes;
    r->gc_runs = gc_runs;
    r->gc_skipped_no_gil = gc_skipped_no_gil;
    for (int d = 0; d < MSH_MAX_DEVICES && r->ndev < (int)(sizeof r->dev / sizeof r->dev[0]); d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        bool ext = false;
        for (int k = 0; k < MSH_EXT_NKINDS; k++) ext |= atomic_load(&external[d][k]) != 0;
        if (!p && !ext) continue;
        struct msh_report_device *rd = &r->dev[r->ndev++];
        memset(rd, 0, sizeof *rd);
        rd->device = d;
        for (int k = 0; k < MSH_EXT_NKINDS && k < 3; k++) rd->external[k] = atomic_load(&external[d][k]);
        rd->epoch_end_live = trend_live[d];
        rd->nepoch_end = trend_n[d];
        if (p) {
            rd->has_pool = true;
            msh_pool_get_stats(p, &rd->st);
            /* threshold releases, made by the pool at a free or by the trim thread */
            r->empty_cache_runs += rd->st.trim_runs - trim_base[d][0];
            r->empty_cache_bytes += rd->st.trim_bytes - trim_base[d][1];
            msh_pool_last_oom(p, &rd->oom);
            rd->had_oom = rd->st.oom_events > 0;
            if (step_ratio[d]) msh_stepfig_summarize(step_ratio[d], &rd->step_ratio);
            size_t f = 0, t = 0;
            if (devices[d].ops && devices[d].ops->mem_info(&devices[d], &f, &t) == 0) {
                rd->device_total = t;
                rd->device_free = f;
            }
        }
    }
}

/* Hand a filled report what else it shows (shim/report_feed.c) and write it; nothing is read
 * when reports are off. Never with a pool lock held. */
static void write_report(struct msh_report *r)
{
    if (!msh_report_init()) return;
    msh_report_feed(r);
    msh_report_write(r);
}

/* Give every pool's cached pages back to the driver and count it for the epoch report. The
 * caller holds epoch_lock when `locked`. Returns the bytes released per device in `out` (may be
 * NULL). */
static size_t empty_all_pools(bool locked, size_t out[MSH_MAX_DEVICES])
{
    size_t total = 0;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (out) out[d] = 0;
        if (!p) continue;
        size_t n = msh_pool_empty_cache(p);
        if (!locked) pthread_mutex_lock(&epoch_lock);
        ec_runs++;
        ec_bytes += n;
        if (!locked) pthread_mutex_unlock(&epoch_lock);
        if (out) out[d] = n;
        total += n;
    }
    return total;
}

/* The figures the frameworks' loggers get for a closed epoch (epoch_lock held). */
static void keep_figures(const struct msh_report *r)
{
    for (int i = 0; i < r->ndev; i++) {
        const struct msh_report_device *d = &r->dev[i];
        if (!d->has_pool) continue;
        const struct msh_pool_stats *st = &d->st;
        struct memshim_epoch_figures *f = &last_fig[d->device];
        memset(f, 0, sizeof *f);
        f->epoch = r->epoch;
        f->steps = r->steps;
        f->allocated_bytes = st->live_bytes;
        f->allocated_peak_bytes = st->peak_live_bytes;
        f->reserved_peak_bytes = st->peak_mapped_bytes;
        f->fragmentation = st->free_bytes ? 1.0 - (double)st->largest_free / (double)st->free_bytes : 0.0;
        f->peak_allocated_over_peak_reserved =
            st->peak_mapped_bytes ? (double)st->peak_live_bytes / (double)st->peak_mapped_bytes : 1.0;
        f->ooms = st->oom_events;
        f->oom_rescues = st->rescue_reclaim + st->rescue_gc + st->rescue_empty_cache;
        int n = d->nepoch_end;
        f->growth_bytes = n >= 2 ? (int64_t)(d->epoch_end_live[n - 1] - d->epoch_end_live[n - 2]) : 0;
        last_fig_ok[d->device] = true;
    }
}

/* Close the current epoch: report, run epoch policies, reset peaks. `may_gc`: the caller is
 * somewhere the GC step may run (not inside the cudaMalloc hook, where PyTorch's caching
 * allocator is mid-call). `policies`: the epoch policies act (not when the run is ending). `by`:
 * the signal that interrupted the run (reason `interrupted`), else NULL. */
static void close_epoch(const char *reason, bool may_gc, bool policies, const char *by)
{
    if (atomic_load(&finish_state) == 2) return; /* the summary is written: the run has ended */
    msh_in_hook++;
    if (policies && msh_cfg.gc == MSH_GC_EPOCH && may_gc) run_gc(true); /* outside epoch_lock: it frees memory */
    pthread_mutex_lock(&epoch_lock);
    if (policies && msh_cfg.empty_cache == MSH_EC_EPOCH) empty_all_pools(true, NULL);
    struct msh_report r;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (!p) continue;
        struct memshim_stats ms;
        if (memshim_get_stats(d, &ms)) continue;
        if (trend_n[d] == MSH_TREND_MAX) { /* keep the newest */
            memmove(trend_live[d], trend_live[d] + 1, (MSH_TREND_MAX - 1) * sizeof trend_live[d][0]);
            trend_n[d]--;
        }
        trend_live[d][trend_n[d]++] = ms.live_bytes;
    }
    msh_sites_epoch_end();
    fill_report(&r, "epoch", reason);
    r.interrupted_by = by;
    keep_figures(&r);
    if (r.ndev) write_report(&r);
    for (int i = 0; i < r.ndev; i++)
        msh_info("epoch %llu (%s) device %d: peak allocated %.1f MiB, peak reserved %.1f MiB, maps %llu, "
                 "unmaps %llu, reclaimed pages %llu",
                 (unsigned long long)epoch_index, reason, r.dev[i].device, r.dev[i].st.peak_live_bytes / 1048576.0,
                 r.dev[i].st.peak_mapped_bytes / 1048576.0, (unsigned long long)r.dev[i].st.map_ops,
                 (unsigned long long)r.dev[i].st.unmap_ops, (unsigned long long)r.dev[i].st.reclaimed_pages);
    spill_mark_all(); /* after the report: the epoch's spill figures are its own */
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (p) msh_pool_reset_peaks(p); /* the step peaks too: an epoch's steps are its own */
        if (step_ratio[d]) msh_stepfig_reset(step_ratio[d]);
    }
    msh_sites_epoch_reset();
    epoch_index++;
    steps_in_epoch = 0;
    steps_close_claimed = false;
    ec_runs = ec_bytes = gc_runs = gc_skipped_no_gil = 0;
    for (int i = 0; i < r.ndev; i++) { /* the pool's threshold releases so far belong to this epoch */
        trim_base[r.dev[i].device][0] = r.dev[i].st.trim_runs;
        trim_base[r.dev[i].device][1] = r.dev[i].st.trim_bytes;
        epoch_allocs_base[r.dev[i].device] = r.dev[i].st.allocs;
    }
    epoch_start_ns = msh_now_ns();
    pthread_mutex_unlock(&epoch_lock);
    msh_in_hook--;
}

/* Reached through msh_core_count (core.h): at most every MSH_TICK_BYTES of a thread's
 * allocations (or MSH_TICK_BYTES / MSH_TICK_CALL_BYTES calls), or at once when an epoch is due.
 * Idle detection reads the pools' own counters instead (idle_thread). */
void msh_core_tick(void)
{
    msh_tick_left = MSH_TICK_BYTES;
    uint64_t now = msh_now_ns(); /* rare enough for the precise clock: a due epoch is never missed */
    /* A time or signal epoch that is due ends here, between two allocations; the watcher thread
     * closes it when no allocation comes (shim/watch.c). */
    const char *due = msh_watch_poll(now);
    if (MSH_UNLIKELY(due != NULL)) close_epoch(due, in_tensor_alloc, true, NULL);
    if (MSH_UNLIKELY(msh_cfg.gc == MSH_GC_THRESHOLD)) {
        /* GC when the pools hold more than the threshold fraction of their limit (or device),
         * at most once a second: a collection costs milliseconds. */
        static _Atomic uint64_t last_gc_ns;
        uint64_t last = atomic_load_explicit(&last_gc_ns, memory_order_relaxed);
        if (last && now - last < 1000000000ull) return;
        for (int d = 0; d < MSH_MAX_DEVICES; d++) {
            struct msh_pool *p = atomic_load(&pools[d]);
            if (!p) continue;
            size_t held = msh_pool_mapped_bytes(p), cap = gc_cap[d];
            if (cap && (double)held > msh_cfg.gc_threshold * (double)cap &&
                atomic_compare_exchange_strong(&last_gc_ns, &last, now)) {
                run_gc(false);
                break;
            }
        }
    }
}

/* The allocations and frees every pool has served: what tells the idle thread the job is busy
 * (no clock is read on the allocation path for it). */
static uint64_t pools_activity(void)
{
    uint64_t n = 0;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (p) n += msh_pool_activity(p);
    }
    return n;
}

static void *idle_thread(void *arg)
{
    (void)arg;
    msh_in_hook = 1; /* this thread never serves hooks */
    bool released = false;
    uint64_t seen = 0, last = 0;
    for (;;) {
        struct timespec ts = {0, 250 * 1000 * 1000};
        nanosleep(&ts, NULL);
        uint64_t act = pools_activity(), now = msh_now_ns();
        if (act != seen || !last) { /* busy since the last look (or the first look) */
            seen = act;
            last = now;
        }
        if (!act) continue; /* nothing allocated yet */
        uint64_t idle = now - last;
        if (idle < (uint64_t)(msh_cfg.empty_cache_idle_s * 1e9)) {
            released = false;
            continue;
        }
        if (released) continue;
        released = true;
        size_t per_dev[MSH_MAX_DEVICES];
        empty_all_pools(false, per_dev);
        for (int d = 0; d < MSH_MAX_DEVICES; d++)
            if (per_dev[d])
                msh_info("idle for %.1f s: released %zu cached bytes on device %d", (double)idle / 1e9, per_dev[d], d);
    }
    return NULL;
}

/* MEMSHIM_EMPTY_CACHE=threshold: the pool gives back cached bytes above the threshold once they
 * have stayed unused for its quiet period (policy/pool/pool.c); this thread makes that happen when the
 * job stops allocating and freeing, too. */
static void *trim_thread(void *arg)
{
    (void)arg;
    msh_in_hook = 1; /* this thread never serves hooks */
    for (;;) {
        struct timespec ts = {0, 250 * 1000 * 1000};
        nanosleep(&ts, NULL);
        for (int d = 0; d < MSH_MAX_DEVICES; d++) {
            struct msh_pool *p = atomic_load(&pools[d]);
            if (p) msh_pool_trim(p); /* counted by the pool (trim_runs), like a trim at a free */
        }
    }
    return NULL;
}

/* ---- fork and exit ------------------------------------------------------------------------------ */

/* Hold the locks across fork so the child never inherits one mid-update (jemalloc's pattern). The
 * child's pools describe the parent's device memory, which the child cannot use (CUDA does not
 * survive fork): the child passes through. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&pools_lock);
    pthread_mutex_lock(&epoch_lock);
    pthread_mutex_lock(&trace_lock);
}

static void fork_parent(void)
{
    pthread_mutex_unlock(&trace_lock);
    pthread_mutex_unlock(&epoch_lock);
    pthread_mutex_unlock(&pools_lock);
}

static void fork_child(void)
{
    /* The child must not append the parent's buffered lines a second time. */
    trace_len = 0;
    if (trace_fd >= 0) close(trace_fd);
    trace_fd = -1;
    atomic_store(&msh_core_tracing_on, false);
    pthread_mutex_unlock(&trace_lock);
    pthread_mutex_unlock(&epoch_lock);
    pthread_mutex_unlock(&pools_lock);
    for (int d = 0; d < MSH_MAX_DEVICES; d++) atomic_store(&pools[d], NULL);
    enabled = false;
    atomic_store(&started, false);
    msh_watch_fork_child();
}

/* The epoch in progress saw work: a step, or an allocation on some device (epoch_lock held). */
static bool epoch_open_locked(void)
{
    if (steps_in_epoch) return true;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (!p) continue;
        struct msh_pool_stats st;
        msh_pool_get_stats(p, &st);
        if (st.allocs != epoch_allocs_base[d]) return true;
    }
    return false;
}

void msh_core_finish(bool interrupted, int signo)
{
    if (!enabled) return;
    int expect = 0;
    if (!atomic_compare_exchange_strong(&finish_state, &expect, 1)) {
        /* Another thread writes them (a signal's thread while the program exits, or the other way
         * round): wait for it, a few seconds at most, so the process does not end mid-write. */
        for (int i = 0; i < 500 && atomic_load(&finish_state) != 2; i++) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        return;
    }
    msh_in_hook++;
    /* A program whose own handler dealt with SIGTERM/SIGINT and then exited was interrupted too. */
    if (!interrupted && msh_watch_noted_signal()) {
        interrupted = true;
        signo = msh_watch_noted_signal();
    }
    char nb[32];
    const char *by = interrupted ? msh_signal_name(signo, nb, sizeof nb) : NULL;
    bool any = false;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) any |= atomic_load(&pools[d]) != NULL;
    if (any && interrupted) {
        pthread_mutex_lock(&epoch_lock);
        bool open = epoch_open_locked();
        pthread_mutex_unlock(&epoch_lock);
        /* The epoch the signal cut short; no policy runs: the process is ending. */
        if (open) close_epoch("interrupted", false, false, by);
    }
    pthread_mutex_lock(&trace_lock);
    if (trace_fd >= 0) {
        trace_flush_locked();
        if (trace_fd >= 0) close(trace_fd);
        trace_fd = -1;
        atomic_store(&msh_core_tracing_on, false);
    }
    pthread_mutex_unlock(&trace_lock);
    if (any) {
        msh_watch_flush_oom(true); /* refusals the watcher has not written yet come before the summary */
        pthread_mutex_lock(&epoch_lock);
        struct msh_report r;
        fill_report(&r, "summary", interrupted ? "interrupted" : "exit");
        r.interrupted_by = by;
        pthread_mutex_unlock(&epoch_lock);
        if (r.ndev) write_report(&r);
        msh_history_exit();
        /* The pools' pooled events (issue 10), at a normal exit only: after a signal the program's
         * threads still run until the signal ends them, and may still use them. */
        for (int d = 0; d < MSH_MAX_DEVICES && !interrupted; d++) {
            struct msh_pool *p = atomic_load(&pools[d]);
            if (p) msh_pool_release_events(p);
        }
        for (int i = 0; i < r.ndev; i++)
            msh_info("exit: device %d: allocs %llu, peak allocated %.1f MiB, peak reserved %.1f MiB, maps %llu, "
                     "unmaps %llu, OOMs %llu",
                     r.dev[i].device, (unsigned long long)r.dev[i].st.allocs, r.dev[i].st.peak_live_bytes / 1048576.0,
                     r.dev[i].st.peak_mapped_bytes / 1048576.0, (unsigned long long)r.dev[i].st.map_ops,
                     (unsigned long long)r.dev[i].st.unmap_ops, (unsigned long long)r.dev[i].st.oom_events);
        if (msh_log_level >= MSH_LOG_INFO) {
            /* issue 24: what memshim cost this process in driver calls, the three largest first */
            struct msh_drvlog_snap dl;
            char top[256];
            msh_drvlog_read(&dl);
            msh_drvlog_top3(&dl, top, sizeof top);
            msh_info("exit: memshim's driver calls, largest costs: %s", top[0] ? top : "none");
        }
    }
    atomic_store(&finish_state, 2);
    msh_in_hook--;
}

static void at_exit(void)
{
    msh_core_finish(false, 0);
}

/* An OOM report per failed request, capped so a job retrying in a loop cannot fill the disk. */
#define OOM_REPORTS_MAX 16
void msh_core_write_oom(int device, int index, int snap, const struct msh_pool_oom *o)
{
    msh_in_hook++;
    msh_history_oom_write(snap);
    if (index >= 0) {
        pthread_mutex_lock(&epoch_lock);
        struct msh_report r;
        fill_report(&r, "oom", "oom");
        r.oom_index = (uint64_t)index;
        pthread_mutex_unlock(&epoch_lock);
        for (int i = 0; i < r.ndev; i++)
            if (r.dev[i].device == device) {
                r.dev[0] = r.dev[i];
                if (o) r.dev[0].oom = *o; /* this failure, whatever failed since */
                r.ndev = 1;
                write_report(&r);
                break;
            }
    }
    msh_in_hook--;
}

void msh_core_note_oom(int device)
{
    msh_history_oom_event(device);
    int snap = msh_history_oom_claim();
    static _Atomic int written;
    /* The index is the value this failure claimed: two threads failing at once get two files
     * (reading the counter again later could give both the same name). */
    int index = msh_cfg.report_dir[0] && msh_report_init() ? atomic_fetch_add(&written, 1) : -1;
    if (index >= OOM_REPORTS_MAX) index = -1;
    if (index < 0 && snap < 0) return;
    struct msh_pool *p = msh_core_pool_get(device);
    struct msh_pool_oom o;
    if (p) {
        msh_pool_last_oom(p, &o);
        /* refused before any driver work (issue 25): the refusal costs microseconds, and the
         * files, a driver query and file writes, must not add to it (issue 31) */
        if (o.kind != MSH_OOM_NOW && msh_watch_defer_oom(device, index, snap, &o)) return;
    }
    msh_core_write_oom(device, index, snap, p ? &o : NULL);
}

/* ---- spill (MEMSHIM_SPILL=host, docs/pool.md "Spill") ---------------------------------------------- */

static atomic_bool spill_on[MSH_MAX_DEVICES];

/* MEMSHIM_SPILL_MAX in bytes: a fraction of host RAM, a size, or 0 (no cap). */
static size_t spill_max_bytes(void)
{
    if (msh_cfg.spill_max_fraction > 0) {
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        if (pages > 0 && psz > 0) return (size_t)(msh_cfg.spill_max_fraction * (double)pages * (double)psz);
        msh_warn("MEMSHIM_SPILL_MAX=%g: the host's memory size is unknown; no cap on spilled bytes",
                 msh_cfg.spill_max_fraction);
        return 0;
    }
    return (size_t)msh_cfg.spill_max_bytes;
}

/* The first tensor-mode allocation on a device: spilling starts (segment mode never spills:
 * PyTorch's cache reuses every segment it holds, so none is cold). */
static void spill_enable(int device, struct msh_pool *p)
{
    if (atomic_exchange(&spill_on[device], true)) return;
    size_t max = spill_max_bytes();
    msh_pool_set_spill(p, true, max);
    msh_info("device %d: MEMSHIM_SPILL=host: cold pages may move to host memory, up to %s", device,
             max ? "MEMSHIM_SPILL_MAX" : "what the host gives");
}

/* A step or an epoch boundary: cold from here on, and spilled pages may come back. */
static void spill_mark_all(void)
{
    if (msh_cfg.spill != MSH_SPILL_HOST) return;
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (!p || !atomic_load_explicit(&spill_on[d], memory_order_relaxed)) continue;
        msh_in_hook++;
        msh_pool_mark_step(p);
        msh_in_hook--;
    }
}

/* ---- public API (memshim.h) ---------------------------------------------------------------------- */

/* Latency for the reports (memshim_overhead's path figures): sampled calls (hotclock.h: the
 * first MSH_LAT_EXACT of a thread, then one in MEMSHIM_LATENCY_SAMPLE) timed with the CPU counter
 * from the entry point to its return, the whole path the caller sees. */
static inline uint32_t lat_begin(uint64_t *t0)
{
    uint32_t w = MSH_UNLIKELY(lat_on) ? msh_lat_sample() : 0;
    *t0 = w ? msh_ticks() : 0;
    return w;
}
static void lat_end(struct msh_pool *p, bool alloc, uint32_t w, uint64_t t0)
{
    uint64_t ns = (uint64_t)((double)(msh_ticks() - t0) * msh_ticks_ns_per_tick());
    if (p) msh_pool_note_latency(p, alloc, ns, w);
}

void *msh_core_alloc(ssize_t size, int device, void *stream, bool counted)
{
    if (size < 0) return NULL;
    /* the thread-locals by address, found once (each access by name calls the TLS descriptor) */
    struct msh_core_tls *tl = MSH_TLS_ADDR(msh_core_tls);
    struct msh_pool_tags *pt = MSH_TLS_ADDR(msh_pool_tags);
    tl->in_hook++;
    /* init first (msh_core_pool): when this is memshim's first call, mode_eff is only set by it.
     * Being called here means PyTorch's pluggable allocator is memshim: that is tensor mode. The
     * timing starts after it (the first call's start-up is no allocation's cost, and only then is
     * it known whether reports, and so latency figures, are on). */
    struct msh_pool *p = device >= 0 && device < MSH_MAX_DEVICES ? atomic_load_explicit(&pools[device], memory_order_acquire)
                                                                 : NULL;
    if (MSH_UNLIKELY(!p)) p = msh_core_pool(device); /* (the first call: start memshim, make the pool) */
    uint64_t t0;
    uint32_t lw = lat_begin(&t0);
    if (MSH_UNLIKELY(mode_eff == MSH_MODE_SEGMENT) && msh_cfg.mode == MSH_MODE_AUTO && enabled)
        mode_eff = MSH_MODE_TENSOR;
    void *out = NULL;
    if (!p) {
        msh_error("memshim_malloc: no pool for device %d (is memshim off, or the driver unusable?)", device);
    } else {
        uint64_t a = 0;
        /* The site is read before the pool is entered; the pool keeps it on the block. A GC
         * callback inside the pool may allocate: the outer mark is put back after. */
        uint32_t tag = msh_sites_tag((size_t)size), outer = pt->next;
        pt->next = tag;
        if (MSH_UNLIKELY(msh_cfg.spill == MSH_SPILL_HOST) && !atomic_load_explicit(&spill_on[device], memory_order_relaxed))
            spill_enable(device, p);
        tl->tensor_alloc = 1;
        int arc = msh_pool_alloc_ex(p, (size_t)size, (uint64_t)(uintptr_t)stream,
                                    MSH_PA_TIMED | (counted ? MSH_PA_COUNTED : 0), &a);
        pt->next = outer;
        if (MSH_LIKELY(arc == 0)) {
            out = (void *)(uintptr_t)a;
            msh_sites_alloc(device, tag, (size_t)size);
            msh_core_trace('a', device, (uint64_t)(uintptr_t)stream, a, (uint64_t)size);
            /* served calls only, as the pool's own figures; timed before the tick below, whose
             * rare work (an epoch closed here, its report) is not this call's and would count the
             * call in the next epoch's figures */
            if (lw) lat_end(p, true, lw, t0);
        } else {
            msh_core_note_oom(device);
        }
        msh_core_count_at(tl, (size_t)size); /* in_tensor_alloc still 1: a GC threshold may collect here */
        tl->tensor_alloc = 0;
    }
    tl->in_hook--;
    return out;
}

MSH_EXPORT void *memshim_malloc(ssize_t size, int device, memshim_stream_t stream)
{
    return msh_core_alloc(size, device, stream, false);
}

MSH_EXPORT void memshim_free(void *ptr, ssize_t size, int device, memshim_stream_t stream)
{
    if (!ptr) return;
    uint64_t t0;
    uint32_t lw = lat_begin(&t0);
    struct msh_core_tls *tl = MSH_TLS_ADDR(msh_core_tls); /* (found once: msh_core_alloc) */
    struct msh_pool_tags *pt = MSH_TLS_ADDR(msh_pool_tags);
    tl->in_hook++;
    struct msh_pool *p = device >= 0 && device < MSH_MAX_DEVICES ? atomic_load(&pools[device]) : NULL;
    /* The trace line goes out before the block can be reused by another thread, so a trace
     * never shows the reuse before the free. */
    bool owned = p != NULL;
    bool file = atomic_load_explicit(&msh_core_tracing_on, memory_order_relaxed);
    if (p && !file && size >= 0 && msh_history_recording()) /* the snapshot ring: the caller's size will do */
        msh_history_note('f', device, (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)ptr, (uint64_t)size);
    else if (p && msh_core_tracing()) { /* two extra lookups, paid only while tracing */
        owned = msh_pool_owns(p, (uint64_t)(uintptr_t)ptr);
        if (owned)
            msh_core_trace('f', device, (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)ptr,
                           msh_pool_block_size(p, (uint64_t)(uintptr_t)ptr));
    }
    int d = device;
    pt->freed = 0; /* the pool leaves the block's mark and size here */
    pt->freed_req = 0;
    int rc = owned ? msh_pool_free_ex(p, (uint64_t)(uintptr_t)ptr, (uint64_t)(uintptr_t)stream, MSH_PA_TIMED) : EINVAL;
    if (MSH_UNLIKELY(rc == EINVAL)) { /* another device's block? */
        struct msh_pool *q = msh_core_pool_owning((uint64_t)(uintptr_t)ptr, &d);
        rc = q ? msh_pool_free(q, (uint64_t)(uintptr_t)ptr, (uint64_t)(uintptr_t)stream) : EINVAL;
        if (rc == EINVAL) msh_warn("memshim_free: %p was not allocated by memshim (device %d); ignored", ptr, device);
    }
    if (MSH_UNLIKELY(rc == EALREADY))
        msh_warn("memshim_free: %p was freed already and not allocated again (a double free, device %d); ignored", ptr,
                 device);
    msh_sites_free(d, pt->freed, pt->freed_req);
    tl->in_hook--;
    if (lw && rc == 0) lat_end(d == device ? p : msh_core_pool_get(d), false, lw, t0);
}

MSH_EXPORT void memshim_record_stream(void *ptr, memshim_stream_t stream)
{
    msh_in_hook++;
    int d;
    struct msh_pool *p = msh_core_pool_owning((uint64_t)(uintptr_t)ptr, &d);
    if (p) msh_pool_record_stream(p, (uint64_t)(uintptr_t)ptr, (uint64_t)(uintptr_t)stream);
    msh_in_hook--;
}

MSH_EXPORT void memshim_empty_cache(void)
{
    if (!msh_core_init()) return;
    msh_in_hook++;
    empty_all_pools(false, NULL);
    msh_in_hook--;
}

MSH_EXPORT void memshim_epoch(void)
{
    if (!msh_core_init()) return;
    close_epoch("manual", true, true, NULL);
}

void msh_core_epoch(const char *reason)
{
    if (!msh_core_init()) return;
    close_epoch(reason, true, true, NULL);
}

void msh_core_close_epoch(const char *reason)
{
    if (!msh_core_started() || atomic_load(&finish_state)) return;
    close_epoch(reason, true, true, NULL);
}

MSH_EXPORT int memshim_run_interrupted(int signo)
{
    if (signo <= 0 || signo >= 65) return EINVAL;
    if (!msh_core_started()) return ENODEV;
    msh_core_finish(true, signo);
    return 0;
}

MSH_EXPORT int memshim_last_epoch(int device, struct memshim_epoch_figures *out)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || !out) return EINVAL;
    if (!atomic_load(&pools[device])) return ENODEV;
    pthread_mutex_lock(&epoch_lock);
    int rc = last_fig_ok[device] ? 0 : ENOENT;
    if (!rc) *out = last_fig[device];
    pthread_mutex_unlock(&epoch_lock);
    return rc;
}

/* One optimizer step ended: its peak allocated over its peak reserved, per device (epoch_lock
 * held). Only the pool's lock is taken: nothing here waits for the device. */
static void note_step_peaks(void)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = atomic_load(&pools[d]);
        if (!p) continue;
        size_t live, reserved;
        msh_pool_step(p); /* the front end's bins that served nothing this step give back (pool.h) */
        msh_pool_take_step_peaks(p, &live, &reserved);
        if (!reserved) continue; /* nothing held: no figure */
        if (!step_ratio[d] && !(step_ratio[d] = calloc(1, sizeof *step_ratio[d]))) continue;
        msh_stepfig_note(step_ratio[d], (double)live / (double)reserved);
    }
}

MSH_EXPORT void memshim_step(void)
{
    if (!msh_core_init()) return;
    bool close = false;
    pthread_mutex_lock(&epoch_lock);
    note_step_peaks();
    steps_total++;
    steps_in_epoch++;
    if (msh_cfg.epoch_src == MSH_EPOCH_STEPS && msh_cfg.epoch_steps && steps_in_epoch >= msh_cfg.epoch_steps &&
        !steps_close_claimed) {
        steps_close_claimed = true; /* one close per boundary, however many threads step */
        close = true;
    }
    pthread_mutex_unlock(&epoch_lock);
    if (close) close_epoch("steps", true, true, NULL);
    else spill_mark_all();
}

MSH_EXPORT void memshim_set_gc_callback(memshim_gc_fn fn, void *arg)
{
    gc_user_arg = arg;
    __atomic_store_n(&gc_user_fn, fn, __ATOMIC_RELEASE);
}

MSH_EXPORT int memshim_get_stats(int device, struct memshim_stats *out)
{
    if (device < 0 || device >= MSH_MAX_DEVICES || !out) return EINVAL;
    struct msh_pool *p = atomic_load(&pools[device]);
    if (!p) return ENODEV;
    struct msh_pool_stats st;
    msh_pool_get_stats(p, &st);
    out->live_bytes = st.live_bytes;
    out->peak_live_bytes = st.peak_live_bytes;
    out->reserved_bytes = st.mapped_bytes;
    out->peak_reserved_bytes = st.peak_mapped_bytes;
    out->map_ops = st.map_ops;
    out->unmap_ops = st.unmap_ops;
    out->reclaimed_pages = st.reclaimed_pages;
    out->allocs = st.allocs;
    out->frees = st.frees;
    out->ooms = st.oom_events;
    return 0;
}
