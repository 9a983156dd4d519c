/*
 * torch.c: memshim as PyTorch's allocator (docs/pytorch.md). The library constructor that lets a
 * preloaded memshim reach Python (its start-up hook directory first on PYTHONPATH), the C entry
 * points behind every hook of torch._C._CUDAPluggableAllocator (init, memory fraction, base
 * allocation, record stream, CUDA-graph capture pools), PyTorch-named statistics with peaks that
 * reset, the out-of-memory diagnosis the C++ glue throws, and what the Python side hands to the
 * epoch reports.
 *
 * It must never make the host fail: the constructor only edits the environment of a CPython
 * process that has not started yet, and any problem leaves memshim in segment mode. Memory
 * allocated into a capture pool is never handed to an allocation outside that pool. Nothing
 * here calls a CUDA hook or Python; the capture pools' lock is never held while a report is
 * written.
 */
#include "torch.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capture.h"
#include "core.h"
#include "cuda_real.h"
#include "drvlog.h"
#include "device.h"
#include "memshim.h"
#include "msh.h"
#include "report.h"

/* ---- the Python start-up hook ---------------------------------------------------------------
 * glibc passes (argc, argv, envp) to constructors. Before CPython reads its environment, the
 * directory holding memshim's sitecustomize.py goes first on PYTHONPATH; the user's value is
 * kept in _MEMSHIM_PYTHONPATH ("1:" + value, or "0:" when unset) for sitecustomize to restore.
 * Not MEMSHIM_*: those names are settings. */

static char lib_path[PATH_MAX];
static pthread_mutex_t tlock_early = PTHREAD_MUTEX_INITIALIZER;

static void find_lib_path(void)
{
    Dl_info di;
    if (!dladdr((void *)find_lib_path, &di) || !di.dli_fname) return;
    if (!realpath(di.dli_fname, lib_path)) lib_path[0] = 0;
}

MSH_EXPORT const char *memshim_library_path(void)
{
    if (!lib_path[0]) find_lib_path();
    return lib_path;
}

/* The directory with sitecustomize.py: installed beside the library (lib/memshim-python), in the
 * source tree above a build directory (build/../hooks/python), or in the pip package
 * (memshim/_lib/libmemshim.so -> memshim/_startup; docs/install.md). */
static int find_python_dir(char *out, size_t len)
{
    if (!lib_path[0]) find_lib_path();
    if (!lib_path[0]) return ENOENT;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", lib_path);
    char *slash = strrchr(dir, '/');
    if (!slash) return ENOENT;
    *slash = 0;
    const char *cands[] = {"%s/memshim-python", "%s/../hooks/python", "%s/../_startup"};
    for (size_t i = 0; i < sizeof cands / sizeof *cands; i++) {
        char cand[PATH_MAX], site[PATH_MAX + 32], real[PATH_MAX];
        if (snprintf(cand, sizeof cand, cands[i], dir) >= (int)sizeof cand) continue;
        if (snprintf(site, sizeof site, "%s/sitecustomize.py", cand) >= (int)sizeof site) continue;
        if (access(site, R_OK) != 0 || !realpath(cand, real)) continue;
        if (strlen(real) >= len) return ENAMETOOLONG;
        strcpy(out, real);
        return 0;
    }
    return ENOENT;
}

/* The interpreter options that make CPython ignore PYTHONPATH or skip site: -I, -E, -S, alone
 * or grouped ("-IS"), before the script, -c or -m. Returns the first one found, or 0. */
static char python_blocking_option(int argc, char **argv)
{
    for (int i = 1; i < argc && argv && argv[i]; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || !a[1] || !strcmp(a, "--")) return 0;
        if (a[1] == '-') {
            if (!strcmp(a, "--check-hash-based-pycs")) i++;
            continue;
        }
        for (int j = 1; a[j]; j++) {
            char c = a[j];
            if (c == 'I' || c == 'E' || c == 'S') return c;
            if (c == 'c' || c == 'm') return 0;
            if (c == 'W' || c == 'X') {
                if (!a[j + 1]) i++; /* the option's value is the next argument */
                break;
            }
        }
    }
    return 0;
}

__attribute__((constructor)) static void msh_torch_ctor(int argc, char **argv, char **envp)
{
    (void)envp;
    /* CPython only: shells, env and CUDA programs stay untouched. */
    if (!dlsym(RTLD_DEFAULT, "Py_BytesMain")) return;
    int (*is_init)(void);
    *(void **)&is_init = dlsym(RTLD_DEFAULT, "Py_IsInitialized");
    if (is_init && is_init()) return; /* loaded into a running interpreter (ctypes) */
    msh_config_load();
    if (msh_cfg.mode == MSH_MODE_OFF) return;
    char opt = python_blocking_option(argc, argv);
    if (opt) {
        if (msh_cfg.log_file[0]) msh_log_open(msh_cfg.log_file);
        msh_info("python -%c ignores PYTHONPATH or skips site, so memshim's start-up hook cannot run: memshim stays in "
                 "segment mode. For tensor mode put `import memshim` at the top of the script, or run `make "
                 "install-python` (a .pth file)", opt);
        return;
    }
    char dir[PATH_MAX];
    if (find_python_dir(dir, sizeof dir)) return; /* no Python part installed: segment mode */
    const char *old = getenv("PYTHONPATH");
    size_t dl = strlen(dir);
    if (old && !strncmp(old, dir, dl) && (old[dl] == ':' || !old[dl])) return; /* already first */
    if (getenv("_MEMSHIM_PYTHONPATH")) return; /* a parent set it and its hook never ran: leave it */
    size_t ol = old ? strlen(old) : 0;
    char *saved = malloc(ol + 3), *now = malloc(dl + ol + 2);
    if (!saved || !now) {
        free(saved);
        free(now);
        return;
    }
    snprintf(saved, ol + 3, "%s%s", old ? "1:" : "0:", old ? old : "");
    snprintf(now, dl + ol + 2, "%s%s%s", dir, old && *old ? ":" : "", old && *old ? old : "");
    if (setenv("_MEMSHIM_PYTHONPATH", saved, 1) == 0) setenv("PYTHONPATH", now, 1);
    free(saved);
    free(now);
}

/* ---- logging and settings for the Python side ------------------------------------------------- */

MSH_EXPORT void memshim_torch_log(int level, const char *msg)
{
    if (!msg) return;
    msh_config_load();
    if (level < MSH_LOG_ERROR) level = MSH_LOG_ERROR;
    if (level > msh_log_level) return;
    msh_log(level, "%s", msg);
}

MSH_EXPORT long memshim_torch_setting(const char *name)
{
    if (!name) return -1;
    msh_config_load();
    if (!strcmp(name, "mode")) return msh_cfg.mode;
    if (!strcmp(name, "started")) return msh_core_started();
    if (!strcmp(name, "enabled")) return msh_core_init();
    if (!strcmp(name, "tensor")) return msh_core_started() && msh_core_mode() == MSH_MODE_TENSOR;
    if (!strcmp(name, "epoch_detect")) return msh_core_epoch_detect();
    if (!strcmp(name, "gc")) return msh_cfg.gc;
    if (!strcmp(name, "empty_cache")) return msh_cfg.empty_cache;
    if (!strcmp(name, "log")) return msh_log_level;
    if (!strcmp(name, "epoch_interval")) return (long)msh_cfg.epoch_interval;
    if (!strcmp(name, "trainer_metrics")) return msh_cfg.trainer_metrics;
    if (!strcmp(name, "spill")) return msh_cfg.spill;
    return -1;
}

MSH_EXPORT int memshim_epoch_from(const char *reason)
{
    static const char *const reasons[] = {"manual", "dataloader", "hf_trainer", "lightning", "interval"};
    const char *r = NULL;
    for (size_t i = 0; reason && i < sizeof reasons / sizeof *reasons; i++)
        if (!strcmp(reason, reasons[i])) r = reasons[i]; /* a static string for the report */
    if (!r) return EINVAL;
    if (!msh_core_started()) return ENODEV;
    msh_core_epoch(r);
    return 0;
}

/* The PyTorch version the Python side found (for the reports' versions.torch), or NULL. */
static char torch_version[64];

MSH_EXPORT void memshim_torch_set_version(const char *v)
{
    if (v && strlen(v) < sizeof torch_version) {
        pthread_mutex_lock(&tlock_early);
        strcpy(torch_version, v);
        pthread_mutex_unlock(&tlock_early);
    }
}

const char *msh_torch_version(void)
{
    return torch_version[0] ? torch_version : NULL;
}

MSH_EXPORT void memshim_step_if_started(void)
{
    if (msh_core_started()) memshim_step();
}

/* ---- per-device state --------------------------------------------------------------------------
 * PyTorch's statistics count what PyTorch allocated through the pluggable entry points, apart
 * from the epoch reports' own peaks, so resetting one never disturbs the other. The counters
 * themselves are the main pool's callers' counters (pool.h struct msh_pool_caller: plain fields
 * under the pool lock, counted at every allocation and free, front end or not); the capture
 * pools' allocations are counted there too (msh_pool_caller_note). "small" is PyTorch's small
 * pool: requests up to 1 MiB. */
enum { SP_ALL, SP_LARGE, SP_SMALL, SP_N };
struct tdev {
    _Atomic uint64_t ooms;
    /* cumulative pool figures at the last reset_accumulated */
    _Atomic uint64_t base_created, base_released, base_create_ops, base_release_ops, base_retries, base_syncs;
    size_t total, cfg_limit;
    double fraction; /* set_per_process_memory_fraction; 0 = not set */
    bool params_done;
};
static struct tdev tdevs[MSH_MAX_DEVICES];
static struct msh_pool_share shares[MSH_MAX_DEVICES];
static struct msh_pool_params tmpl[MSH_MAX_DEVICES]; /* the main pool's parameters, for capture pools */
static pthread_mutex_t tlock = PTHREAD_MUTEX_INITIALIZER;

static bool dev_ok(int device)
{
    return device >= 0 && device < MSH_MAX_DEVICES;
}

/* An allocation or free a capture pool served, in the device's counters (the main pool's). */
static void note_capture(int device, size_t size, bool alloc)
{
    struct msh_pool *m = msh_core_pool_get(device);
    if (m) msh_pool_caller_note(m, size, alloc);
}

/* ---- limits ------------------------------------------------------------------------------------ */

static size_t limit_for(const struct tdev *t)
{
    size_t lim = t->cfg_limit;
    if (t->fraction > 0 && t->total) {
        size_t f = (size_t)(t->fraction * (double)t->total);
        if (!lim || f < lim) lim = f;
    }
    /* At or above the device: no limit (issue 31; the pool holds the same rule, limit_now).
     * set_per_process_memory_fraction(1.0) is how jobs and the GPU bench reset a cap. */
    return t->total && lim >= t->total ? 0 : lim;
}

void msh_torch_pool_params(int device, size_t total, struct msh_pool_params *prm)
{
    if (!dev_ok(device)) return;
    pthread_mutex_lock(&tlock);
    struct tdev *t = &tdevs[device];
    t->total = total;
    t->cfg_limit = prm->limit_bytes;
    __atomic_store_n(&shares[device].limit_bytes, limit_for(t), __ATOMIC_RELAXED);
    prm->share = &shares[device];
    prm->capturing = msh_capture_counter(device); /* every pool of the device defers during a capture */
    tmpl[device] = *prm;
    t->params_done = true;
    pthread_mutex_unlock(&tlock);
}

size_t msh_torch_limit(int device)
{
    if (!dev_ok(device)) return 0;
    pthread_mutex_lock(&tlock);
    size_t l = tdevs[device].params_done ? __atomic_load_n(&shares[device].limit_bytes, __ATOMIC_RELAXED)
                                         : msh_cfg.limit_bytes;
    pthread_mutex_unlock(&tlock);
    return l;
}

MSH_EXPORT void memshim_torch_set_memory_fraction(double fraction, int device)
{
    if (!dev_ok(device)) return;
    if (!(fraction > 0.0 && fraction <= 1.0)) {
        msh_warn("set_per_process_memory_fraction(%g) on device %d: not in (0, 1]; the limit is unchanged",
                 fraction, device);
        return;
    }
    pthread_mutex_lock(&tlock);
    struct tdev *t = &tdevs[device];
    t->fraction = fraction;
    if (t->params_done) __atomic_store_n(&shares[device].limit_bytes, limit_for(t), __ATOMIC_RELAXED);
    size_t lim = limit_for(t);
    pthread_mutex_unlock(&tlock);
    msh_info("device %d: PyTorch set the memory fraction to %g: limit %zu bytes%s", device, fraction, lim,
             t->params_done ? "" : " (once the pool starts)");
}

/* per_process_memory_fraction in PyTorch's allocator settings (PYTORCH_ALLOC_CONF or the older
 * PYTORCH_CUDA_ALLOC_CONF, read by the Python hook as PyTorch reads them). PyTorch applies it in
 * its own caching allocator, so in tensor mode memshim does: every device's limit becomes fraction
 * x its memory, as set_per_process_memory_fraction(fraction, device) would make it; a device whose
 * fraction the program already set keeps it, and a later call overrides this one. 0, or EINVAL
 * (nothing changed) outside (0, 1]. */
MSH_EXPORT int memshim_torch_conf_memory_fraction(double fraction)
{
    if (!(fraction > 0.0 && fraction <= 1.0)) return EINVAL;
    pthread_mutex_lock(&tlock);
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct tdev *t = &tdevs[d];
        if (t->fraction > 0) continue;
        t->fraction = fraction;
        if (t->params_done) __atomic_store_n(&shares[d].limit_bytes, limit_for(t), __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&tlock);
    return 0;
}

MSH_EXPORT double memshim_torch_get_memory_fraction(int device)
{
    if (!dev_ok(device)) return 1.0;
    /* MEMSHIM_LIMIT counts as a fraction of the device's memory, known once the device's pool
     * exists: start it, so that the answer is the same before the first allocation and after. */
    if (!tdevs[device].params_done && msh_core_started()) (void)msh_core_pool(device);
    pthread_mutex_lock(&tlock);
    struct tdev *t = &tdevs[device];
    double f = t->fraction > 0 ? t->fraction : 1.0;
    size_t lim = limit_for(t);
    if (t->total && lim && (double)lim / (double)t->total < f) f = (double)lim / (double)t->total;
    pthread_mutex_unlock(&tlock);
    return f;
}

/* ---- capture pools -----------------------------------------------------------------------------
 * A capture pool is one PyTorch MempoolId_t of a device. PyTorch counts its uses
 * (CUDACachingAllocator.cpp, create_or_incref_pool / releasePool): every graph captured into it
 * adds one at begin_allocate_to_pool (newer PyTorch also at createOrIncrefPool, when a graph
 * retains another pool), every graph reset or destroyed subtracts one at release_pool, and only
 * at zero may its memory go: "other graph(s) might share the same pool" (torch.cuda.graph(pool=
 * other.pool()), graph_pool_handle(), make_graphed_callables). memshim keeps the same count per
 * (device, id): a begin with a live id joins that pool, and a pool goes only when its count is
 * zero and its last block is freed.
 *
 * Inside a group, one msh_pool per stream, all sharing the device's limit: a block freed on one
 * stream is reused only by allocations on that stream, as in PyTorch's private pools. Reuse across
 * streams would need an event recorded outside the capture and waited on inside it, which the
 * driver refuses while capturing (and which would invalidate the graph). The backstop group (ids
 * all ones) takes allocations on a capturing stream that no begun pool claimed; its memory is only
 * ever reused by such allocations, and it is never destroyed.
 *
 * Destroying a pool synchronizes the device and unmaps: while any capture of the device is in
 * progress (capture.h) that would invalidate it (a re-capture loop frees the old graph's last
 * output inside the next capture), so the group is marked doomed and goes at the next safe point
 * (msh_torch_capture_settle). caps_lock guards the tables only: no driver call, no pool creation
 * and no allocation runs under it. A per-stream pool in use by a call outside the lock is pinned,
 * so it is never destroyed under that call. Frees of main-pool memory never take caps_lock: the
 * main pool's address ranges are checked first, without a lock (msh_pool_covers_fast). */
#define CAPG_MAX 32
#define CAP_MAX 64
#define BACKSTOP_ID UINT64_MAX
struct capgroup {
    bool used, doomed;     /* doomed: no use and no live block left; destroyed at a safe point */
    int device;
    int uses;              /* PyTorch's use_count: begins (and retains) minus releases */
    int active;            /* begins not yet ended: allocations are routed here */
    uint64_t id0, id1, seq;
};
struct cap { /* one stream's pool inside a group */
    bool used, ready;      /* ready: the pool exists (it is created outside the lock) */
    int g, device;
    int pins;              /* calls using the pool outside caps_lock */
    uint64_t stream;
    size_t live;
    struct msh_pool *pool;
};
static pthread_mutex_t caps_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t caps_cv = PTHREAD_COND_INITIALIZER; /* a pool became ready or unpinned */
static struct capgroup groups[CAPG_MAX];
static struct cap caps[CAP_MAX];
static _Atomic int caps_alive; /* groups in use: frees look at capture pools only when > 0 */
static uint64_t caps_seq;
static uint64_t caps_destroyed, caps_deferred; /* groups destroyed; destroys deferred by a capture */
static _Atomic uint64_t caps_takes; /* times caps_lock was taken (tests: frees outside captures never take it) */
#define CAPS_LOCK() (atomic_fetch_add_explicit(&caps_takes, 1, memory_order_relaxed), pthread_mutex_lock(&caps_lock))

uint64_t msh_torch_capture_lock_takes(void)
{
    return atomic_load(&caps_takes);
}

static bool is_backstop(const struct capgroup *g)
{
    return g->id0 == BACKSTOP_ID && g->id1 == BACKSTOP_ID;
}

static struct capgroup *group_find_locked(int device, uint64_t id0, uint64_t id1)
{
    for (int i = 0; i < CAPG_MAX; i++)
        if (groups[i].used && groups[i].device == device && groups[i].id0 == id0 && groups[i].id1 == id1)
            return &groups[i];
    return NULL;
}

static struct capgroup *group_create_locked(int device, uint64_t id0, uint64_t id1)
{
    if (!msh_core_pool_get(device) || !msh_core_device(device)) return NULL; /* the main pool sets the limit up */
    for (int i = 0; i < CAPG_MAX; i++) {
        if (groups[i].used) continue;
        groups[i] = (struct capgroup){.used = true, .device = device, .id0 = id0, .id1 = id1};
        atomic_fetch_add(&caps_alive, 1);
        return &groups[i];
    }
    msh_warn("device %d: more than %d CUDA-graph capture pools alive; this one is refused", device, CAPG_MAX);
    return NULL;
}

/* The group's pool for `stream`, pinned (the caller unpins it with cap_unpin), or NULL. Called
 * with caps_lock held; drops it while it creates a pool. */
static struct cap *cap_get_pinned_locked(struct capgroup *g, uint64_t stream)
{
    int gi = (int)(g - groups);
    for (;;) {
        int found = -1, free_slot = -1;
        for (int i = 0; i < CAP_MAX; i++) {
            if (caps[i].used && caps[i].g == gi && caps[i].stream == stream) found = i;
            else if (!caps[i].used && free_slot < 0) free_slot = i;
        }
        if (found >= 0) {
            struct cap *c = &caps[found];
            if (!c->ready) { /* another thread is creating it */
                pthread_cond_wait(&caps_cv, &caps_lock);
                continue;
            }
            c->pins++;
            return c;
        }
        if (free_slot < 0) {
            msh_warn("device %d: more than %d CUDA-graph capture pools (per stream) alive; this one is refused",
                     g->device, CAP_MAX);
            return NULL;
        }
        struct cap *c = &caps[free_slot];
        *c = (struct cap){.used = true, .g = gi, .device = g->device, .stream = stream, .pins = 1};
        struct msh_pool_params prm = tmpl[g->device];
        /* A graph replays into every address its capture touched, freed blocks included: no page
         * of a capture pool may be unmapped, moved or given back before the pool is released. An
         * allocation on a capturing stream never touches a front end (pool.h params.front). */
        prm.front = false;
        prm.defrag = false;
        prm.no_release_on_oom = true;
        prm.release_threshold = 0;
        int device = g->device;
        pthread_mutex_unlock(&caps_lock);
        struct msh_pool *p = NULL;
        int rc = msh_pool_create(msh_core_device(device), &prm, &p);
        if (rc == 0) msh_pool_set_timing(p, msh_report_init()); /* latency figures serve the reports only */
        CAPS_LOCK();
        if (rc) {
            msh_warn("device %d: cannot create a CUDA-graph capture pool (error %d)", device, rc);
            memset(c, 0, sizeof *c);
            pthread_cond_broadcast(&caps_cv);
            return NULL;
        }
        c->pool = p;
        c->ready = true;
        pthread_cond_broadcast(&caps_cv);
        return c;
    }
}

/* Pools to destroy once caps_lock is dropped (a destroy synchronizes and unmaps). */
struct doomed_list {
    struct msh_pool *pools[CAP_MAX];
    int n;
};

/* A group whose uses are all released and whose blocks are all freed goes, with every page of
 * every stream's pool; while the device captures, it is only marked (see above). */
static void group_maybe_destroy_locked(struct capgroup *g, struct doomed_list *out)
{
    if (!g->used || g->uses > 0 || g->active > 0 || is_backstop(g)) return;
    int gi = (int)(g - groups);
    for (int i = 0; i < CAP_MAX; i++)
        if (caps[i].used && caps[i].g == gi && (caps[i].live || caps[i].pins || !caps[i].ready)) return;
    if (msh_capture_any()) {
        if (!g->doomed) caps_deferred++;
        g->doomed = true;
        return;
    }
    for (int i = 0; i < CAP_MAX; i++) {
        if (!caps[i].used || caps[i].g != gi) continue;
        out->pools[out->n++] = caps[i].pool;
        memset(&caps[i], 0, sizeof caps[i]);
    }
    memset(g, 0, sizeof *g);
    caps_destroyed++;
    atomic_fetch_sub(&caps_alive, 1);
}

static void destroy_doomed(struct doomed_list *d)
{
    for (int i = 0; i < d->n; i++) msh_pool_destroy(d->pools[i]);
    d->n = 0;
}

static void cap_unpin(struct cap *c, struct doomed_list *out)
{
    if (--c->pins == 0) {
        pthread_cond_broadcast(&caps_cv);
        group_maybe_destroy_locked(&groups[c->g], out);
    }
}

void msh_torch_capture_settle(int device)
{
    struct doomed_list d = {.n = 0};
    struct msh_pool *settle[CAP_MAX];
    int ns = 0;
    msh_in_hook++;
    CAPS_LOCK();
    for (int i = 0; i < CAPG_MAX; i++)
        if (groups[i].used && groups[i].device == device) group_maybe_destroy_locked(&groups[i], &d);
    for (int i = 0; i < CAP_MAX; i++)
        if (caps[i].used && caps[i].ready && caps[i].device == device) {
            caps[i].pins++;
            settle[ns++] = caps[i].pool;
        }
    pthread_mutex_unlock(&caps_lock);
    destroy_doomed(&d);
    for (int i = 0; i < ns; i++) msh_pool_after_capture(settle[i]);
    CAPS_LOCK();
    for (int i = 0; i < CAP_MAX; i++) /* unpin what was pinned above (same pools, same slots) */
        for (int k = 0; k < ns; k++)
            if (caps[i].used && caps[i].pool == settle[k]) {
                cap_unpin(&caps[i], &d);
                settle[k] = NULL;
                break;
            }
    pthread_mutex_unlock(&caps_lock);
    destroy_doomed(&d);
    msh_in_hook--;
}

void msh_torch_regrant_access(int device)
{
    struct msh_pool *pin[CAP_MAX];
    int n = 0;
    CAPS_LOCK();
    for (int i = 0; i < CAP_MAX; i++)
        if (caps[i].used && caps[i].ready && caps[i].device == device) {
            caps[i].pins++;
            pin[n++] = caps[i].pool;
        }
    pthread_mutex_unlock(&caps_lock);
    for (int i = 0; i < n; i++) msh_pool_regrant_access(pin[i]);
    struct doomed_list d = {.n = 0};
    CAPS_LOCK();
    for (int i = 0; i < CAP_MAX; i++)
        for (int k = 0; k < n; k++)
            if (pin[k] && caps[i].used && caps[i].pool == pin[k]) {
                cap_unpin(&caps[i], &d);
                pin[k] = NULL;
                break;
            }
    pthread_mutex_unlock(&caps_lock);
    destroy_doomed(&d);
}

void msh_torch_capture_counts(uint64_t *destroyed, uint64_t *deferred, int *alive)
{
    CAPS_LOCK();
    if (destroyed) *destroyed = caps_destroyed;
    if (deferred) *deferred = caps_deferred;
    if (alive) *alive = atomic_load(&caps_alive);
    pthread_mutex_unlock(&caps_lock);
}

/* A use of (device, id) begins: a graph is captured into it. */
static void group_use(int device, unsigned long long id0, unsigned long long id1, bool begin)
{
    CAPS_LOCK();
    struct capgroup *g = group_find_locked(device, id0, id1);
    if (!g) g = group_create_locked(device, id0, id1);
    if (g) {
        g->doomed = false; /* a released pool that still exists is joined, not replaced */
        g->uses++;
        if (begin) {
            g->active++;
            g->seq = ++caps_seq;
        }
    }
    pthread_mutex_unlock(&caps_lock);
    /* The window alone is no capture (issue 31): use_mem_pool opens one and captures nothing, and
     * torch.cuda.graph's capture opens in capture.c when its stream begins (every begin route is
     * hooked), so nothing is deferred and no capture mode exchanged for the window itself. */
}

MSH_EXPORT void memshim_torch_begin_allocate_to_pool(int device, unsigned long long id0, unsigned long long id1,
                                                     void *filter)
{
    (void)filter; /* a C++ std::function: the glue evaluates it */
    if (!dev_ok(device) || !msh_core_init() || !msh_core_pool(device)) return;
    msh_in_hook++;
    group_use(device, id0, id1, true);
    msh_in_hook--;
    msh_debug("device %d: allocations go to capture pool (%llu, %llu)", device, id0, id1);
}

/* Newer PyTorch (createOrIncrefPool, CUDAGraph::retain_pool): one more use, no capture window. */
MSH_EXPORT void memshim_torch_retain_pool(int device, unsigned long long id0, unsigned long long id1)
{
    if (!dev_ok(device) || !msh_core_init() || !msh_core_pool(device)) return;
    msh_in_hook++;
    group_use(device, id0, id1, false);
    msh_in_hook--;
}

MSH_EXPORT void memshim_torch_end_allocate_to_pool(int device, unsigned long long id0, unsigned long long id1)
{
    if (!dev_ok(device)) return;
    CAPS_LOCK();
    struct capgroup *g = group_find_locked(device, id0, id1);
    if (g && g->active > 0) g->active--;
    pthread_mutex_unlock(&caps_lock);
}

MSH_EXPORT void memshim_torch_release_pool(int device, unsigned long long id0, unsigned long long id1)
{
    if (!dev_ok(device)) return;
    struct doomed_list d = {.n = 0};
    msh_in_hook++;
    CAPS_LOCK();
    struct capgroup *g = group_find_locked(device, id0, id1);
    if (g && g->uses > 0 && --g->uses == 0) group_maybe_destroy_locked(g, &d);
    pthread_mutex_unlock(&caps_lock);
    destroy_doomed(&d);
    msh_in_hook--;
}

/* PyTorch's use count of (device, id) as memshim keeps it: 0 once every use was released (or
 * for an id memshim does not know). */
MSH_EXPORT int memshim_torch_pool_uses(int device, unsigned long long id0, unsigned long long id1)
{
    if (!dev_ok(device)) return 0;
    CAPS_LOCK();
    struct capgroup *g = group_find_locked(device, id0, id1);
    int n = g ? g->uses : 0;
    pthread_mutex_unlock(&caps_lock);
    return n;
}

/* Whether `stream` is capturing: the driver's cuStreamIsCapturing (msh_cu), or a test's. */
static int (*capture_query_override)(void *stream);

/* While a graph is being captured, the driver refuses "unsafe" calls (memory creation and
 * mapping among them) from any thread in the default global capture mode. Like PyTorch's own
 * allocator around cudaMalloc, memshim's pool calls run in relaxed mode then. Returns the mode
 * to restore (or -1). */
static int relaxed_begin(void)
{
    /* Only while a capture is open (shim/capture.h), not while capture pools merely exist: a job
     * that replays its graphs keeps them for good, and two cuThreadExchangeStreamCaptureMode per
     * allocation cost driver calls on the cached path (issue 24). PyTorch opens its pool window
     * before it begins the capture, so the window is open before the driver could refuse. */
    if (!msh_capture_any()) return -1;
    if (msh_cuda_load() || !msh_cu.cuThreadExchangeStreamCaptureMode) return -1;
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
    return MSH_DRV(cuThreadExchangeStreamCaptureMode, &m) == CUDA_SUCCESS ? (int)m : -1;
}

static void relaxed_end(int saved)
{
    if (saved < 0) return; /* a mode was saved: the driver has the call */
    CUstreamCaptureMode m = (CUstreamCaptureMode)saved;
    MSH_DRV(cuThreadExchangeStreamCaptureMode, &m);
}

void msh_torch_set_capture_query(int (*fn)(void *stream))
{
    capture_query_override = fn;
}

static int stream_capturing(void *stream)
{
    if (capture_query_override) return capture_query_override(stream);
    /* The legacy default stream cannot capture; PyTorch's default stream is that stream. */
    if (!stream) return 0;
    /* No capture open in the process (memshim sees every begin and end: PyTorch's pool window and
     * the runtime's and the driver's capture calls, shim/capture.h): no stream can be capturing,
     * and a side-stream allocation asks the driver nothing (issue 24: cuStreamIsCapturing cost a
     * driver call on every allocation off the default stream). */
    if (!msh_capture_any()) return 0;
    if (msh_cuda_load() || !msh_cu.cuStreamIsCapturing) return -1;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (MSH_DRV(cuStreamIsCapturing, (CUstream)stream, &st) != CUDA_SUCCESS) return -1;
    return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* ---- allocation entry points ------------------------------------------------------------------ */

static __thread struct msh_pool *last_oom_pool; /* the pool whose request failed last (this thread) */
static __thread bool last_oom_capture;

/* Issue 31: the main pool's cache goes back to the driver for a capture pool's request only when it
 * covers what the request lacked under the limit the pools share (as the pool's own empty-cache
 * step: only when the request would then fit); otherwise releasing it costs the main pool its
 * pages and serves nothing. */
static bool main_cache_would_help(struct msh_pool *cap_pool, struct msh_pool *main_pool)
{
    struct msh_pool_oom o;
    struct msh_pool_counters k;
    msh_pool_last_oom(cap_pool, &o);
    msh_pool_counters(main_pool, &k);
    return o.kind == MSH_OOM_NOW && k.cached_pages && o.short_bytes <= k.cached_pages * k.gran;
}

/* Allocate in a pinned capture pool (caps_lock not held). */
static void *cap_alloc(struct cap *c, size_t size, void *stream)
{
    uint64_t a = 0;
    int saved = relaxed_begin();
    int rc = msh_pool_alloc(c->pool, size, (uint64_t)(uintptr_t)stream, &a);
    if (rc == ENOMEM) {
        /* The limit is shared: the main pool's cached pages may be what stands in the way (while
         * the device captures, the main pool defers the release and this still fails). */
        struct msh_pool *main_pool = msh_core_pool_get(c->device);
        if (main_pool && main_cache_would_help(c->pool, main_pool) && msh_pool_empty_cache(main_pool))
            rc = msh_pool_alloc(c->pool, size, (uint64_t)(uintptr_t)stream, &a);
    }
    relaxed_end(saved);
    if (rc) {
        last_oom_pool = c->pool;
        last_oom_capture = true;
        return NULL;
    }
    msh_core_trace('a', c->device, (uint64_t)(uintptr_t)stream, a, size);
    return (void *)(uintptr_t)a;
}

static void *alloc_in_cap(int device, size_t size, void *stream, uint64_t id0, uint64_t id1, bool backstop)
{
    msh_in_hook++;
    struct doomed_list d = {.n = 0};
    CAPS_LOCK();
    struct capgroup *g = NULL;
    if (!backstop) {
        g = group_find_locked(device, id0, id1);
        if (!g) g = group_create_locked(device, id0, id1); /* a pool used without begin */
    } else { /* the most recently begun active pool of the device, else the backstop pool */
        for (int i = 0; i < CAPG_MAX; i++)
            if (groups[i].used && groups[i].device == device && groups[i].active && (!g || groups[i].seq > g->seq))
                g = &groups[i];
        if (!g) {
            g = group_find_locked(device, BACKSTOP_ID, BACKSTOP_ID);
            if (!g) {
                g = group_create_locked(device, BACKSTOP_ID, BACKSTOP_ID);
                if (g)
                    msh_info("device %d: an allocation on a capturing stream came with no capture pool begun; "
                             "it goes to a capture-only pool whose memory is never reused outside captures",
                             device);
            }
        }
    }
    if (g) g->doomed = false; /* allocated into again: it lives on */
    struct cap *c = g ? cap_get_pinned_locked(g, (uint64_t)(uintptr_t)stream) : NULL;
    pthread_mutex_unlock(&caps_lock);
    void *p = c ? cap_alloc(c, size, stream) : NULL;
    if (c) {
        CAPS_LOCK();
        if (p) c->live++;
        cap_unpin(c, &d);
        pthread_mutex_unlock(&caps_lock);
    }
    destroy_doomed(&d);
    if (p) note_capture(device, size, true);
    else tdevs[device].ooms++;
    msh_in_hook--;
    return p;
}

MSH_EXPORT void *memshim_torch_alloc_in_pool(ssize_t size, int device, memshim_stream_t stream,
                                             unsigned long long id0, unsigned long long id1)
{
    if (size <= 0 || !dev_ok(device) || !msh_core_init() || !msh_core_pool(device)) return NULL;
    return alloc_in_cap(device, (size_t)size, stream, id0, id1, false);
}

/* Size 0 (torch.empty(0) on the device): no block and no count, NULL, as PyTorch's own allocator
 * does (CUDACachingAllocator.cpp, NativeCachingAllocator::allocate calls malloc only for size != 0;
 * its stats never see the tensor). The glue does not take this NULL for an OOM, and PyTorch never
 * frees a NULL data pointer. */
MSH_EXPORT void *memshim_torch_alloc(ssize_t size, int device, memshim_stream_t stream)
{
    if (size <= 0 || !dev_ok(device)) return NULL;
    if (stream && stream_capturing(stream) == 1) {
        if (!msh_core_init() || !msh_core_pool(device)) return NULL;
        return alloc_in_cap(device, (size_t)size, stream, 0, 0, true);
    }
    int saved = relaxed_begin(); /* another thread may be capturing a graph */
    void *p = msh_core_alloc(size, device, stream, true); /* counted: PyTorch's memory_allocated */
    relaxed_end(saved);
    if (MSH_UNLIKELY(!p)) {
        tdevs[device].ooms++;
        last_oom_pool = msh_core_pool(device);
        last_oom_capture = false;
    }
    return p;
}

/* Whether ptr may be a capture pool's: memory of the device's main pool never is (its address
 * ranges are read without a lock), so main-pool frees never touch caps_lock. */
static bool maybe_capture_block(int device, void *ptr)
{
    if (!atomic_load_explicit(&caps_alive, memory_order_relaxed)) return false;
    struct msh_pool *m = dev_ok(device) ? msh_core_pool_get(device) : NULL;
    return !m || !msh_pool_covers_fast(m, (uint64_t)(uintptr_t)ptr);
}

/* The pinned capture pool holding the live block ptr, or NULL. */
static struct cap *cap_owning_pinned(void *ptr)
{
    CAPS_LOCK();
    struct cap *found = NULL;
    for (int i = 0; i < CAP_MAX && !found; i++) {
        struct cap *c = &caps[i];
        if (c->used && c->ready && msh_pool_owns(c->pool, (uint64_t)(uintptr_t)ptr)) {
            c->pins++;
            found = c;
        }
    }
    pthread_mutex_unlock(&caps_lock);
    return found;
}

/* A block in a capture pool: freed there (and the group destroyed when released and empty). */
static bool cap_free(int device, void *ptr, void *stream)
{
    if (!maybe_capture_block(device, ptr)) return false;
    msh_in_hook++;
    struct cap *c = cap_owning_pinned(ptr);
    if (!c) {
        msh_in_hook--;
        return false;
    }
    if (msh_core_tracing())
        msh_core_trace('f', c->device, (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)ptr,
                       msh_pool_block_size(c->pool, (uint64_t)(uintptr_t)ptr));
    msh_pool_tags.freed_req = 0;
    bool freed = msh_pool_free(c->pool, (uint64_t)(uintptr_t)ptr, (uint64_t)(uintptr_t)stream) == 0;
    if (freed) note_capture(c->device, msh_pool_tags.freed_req, false);
    struct doomed_list d = {.n = 0};
    CAPS_LOCK();
    if (freed && c->live) c->live--;
    cap_unpin(c, &d);
    pthread_mutex_unlock(&caps_lock);
    destroy_doomed(&d);
    msh_in_hook--;
    return true;
}

MSH_EXPORT void memshim_torch_free(void *ptr, ssize_t size, int device, memshim_stream_t stream)
{
    if (!ptr) return;
    if (cap_free(device, ptr, stream)) return;
    memshim_free(ptr, size, device, stream); /* the pool uncounts the block (its own size) */
}

MSH_EXPORT void memshim_torch_record_stream(void *ptr, memshim_stream_t stream)
{
    int device = -1;
    for (int d = 0; d < MSH_MAX_DEVICES && device < 0; d++) {
        struct msh_pool *m = msh_core_pool_get(d);
        if (m && msh_pool_covers_fast(m, (uint64_t)(uintptr_t)ptr)) device = d;
    }
    if (device < 0 && atomic_load_explicit(&caps_alive, memory_order_relaxed)) {
        struct cap *c = cap_owning_pinned(ptr);
        if (c) {
            msh_pool_record_stream(c->pool, (uint64_t)(uintptr_t)ptr, (uint64_t)(uintptr_t)stream);
            struct doomed_list d = {.n = 0};
            CAPS_LOCK();
            cap_unpin(c, &d);
            pthread_mutex_unlock(&caps_lock);
            destroy_doomed(&d);
            return;
        }
    }
    memshim_record_stream(ptr, stream);
}

MSH_EXPORT void memshim_torch_init(int device_count)
{
    msh_core_init();
    msh_info("PyTorch initialized CUDA with memshim as its allocator (%d device%s)", device_count,
             device_count == 1 ? "" : "s");
}

struct find_ctx {
    uint64_t addr, base;
    size_t size;
};

static void find_containing(void *arg, uint64_t addr, size_t size, uint64_t stream)
{
    (void)stream;
    struct find_ctx *f = arg;
    if (f->addr >= addr && f->addr < addr + (size ? size : 1)) {
        f->base = addr;
        f->size = size;
    }
}

static bool base_in(struct msh_pool *p, struct find_ctx *f)
{
    size_t s = msh_pool_block_size(p, f->addr);
    if (s) {
        f->base = f->addr;
        f->size = s;
        return true;
    }
    msh_pool_for_each_live(p, find_containing, f);
    return f->base != 0;
}

MSH_EXPORT void *memshim_torch_base_alloc(void *ptr, size_t *size)
{
    struct find_ctx f = {(uint64_t)(uintptr_t)ptr, 0, 0};
    bool found = false;
    for (int d = 0; d < MSH_MAX_DEVICES && !found; d++) {
        struct msh_pool *p = msh_core_started() && msh_core_device(d) ? msh_core_pool(d) : NULL;
        if (p) found = base_in(p, &f);
    }
    if (!found && atomic_load(&caps_alive)) {
        CAPS_LOCK();
        for (int i = 0; i < CAP_MAX && !found; i++)
            if (caps[i].used && caps[i].ready) found = base_in(caps[i].pool, &f);
        pthread_mutex_unlock(&caps_lock);
    }
    if (!found) return ptr;
    if (size) *size = f.size;
    return (void *)(uintptr_t)f.base;
}

/* ---- PyTorch-named statistics ------------------------------------------------------------------ */

struct pool_sum {
    uint64_t mapped, free_bytes, binned, created, released, create_ops, release_ops, retries, syncs;
};

static void sum_pool(struct msh_pool *p, struct pool_sum *s)
{
    struct msh_pool_stats st;
    msh_pool_get_stats(p, &st);
    s->mapped += st.mapped_bytes;
    s->free_bytes += st.free_bytes;
    s->binned += st.binned_bytes;
    s->created += st.drv_bytes[MSH_DRV_CREATE];
    s->released += st.drv_bytes[MSH_DRV_RELEASE];
    s->create_ops += st.create_ops;
    s->release_ops += st.release_ops;
    s->retries += st.rescue_reclaim + st.rescue_gc + st.rescue_empty_cache;
    s->syncs += st.drv_calls[MSH_DRV_SYNCHRONIZE];
}

static void sum_device(int device, struct pool_sum *s)
{
    memset(s, 0, sizeof *s);
    if (msh_core_started() && msh_core_device(device)) sum_pool(msh_core_pool(device), s);
    if (atomic_load(&caps_alive)) {
        CAPS_LOCK();
        for (int i = 0; i < CAP_MAX; i++)
            if (caps[i].used && caps[i].ready && caps[i].device == device) sum_pool(caps[i].pool, s);
        pthread_mutex_unlock(&caps_lock);
    }
}

/* The flat key list: 9 metrics x {all, large_pool, small_pool} x {current, peak, allocated,
 * freed}, then 2 x 4 oversize figures, then scalars. */
static const char *const metrics[] = {"allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                                      "inactive_split_bytes", "allocation", "active", "segment", "inactive_split"};
static const char *const subpools[] = {"all", "large_pool", "small_pool"};
static const char *const fields[] = {"current", "peak", "allocated", "freed"};
static const char *const scalars[] = {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                                      "num_device_free", "max_split_size"};
#define NMETRIC (int)(sizeof metrics / sizeof *metrics)
#define NSTAT (NMETRIC * 12 + 8 + (int)(sizeof scalars / sizeof *scalars))

static char stat_names[NSTAT][48];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void names_build(void)
{
    int k = 0;
    for (int m = 0; m < NMETRIC; m++)
        for (int sp = 0; sp < SP_N; sp++)
            for (int j = 0; j < 4; j++)
                snprintf(stat_names[k++], sizeof stat_names[0], "%s.%s.%s", metrics[m], subpools[sp], fields[j]);
    for (int o = 0; o < 2; o++)
        for (int j = 0; j < 4; j++)
            snprintf(stat_names[k++], sizeof stat_names[0], "%s.%s", o ? "oversize_segments" : "oversize_allocations",
                     fields[j]);
    for (size_t j = 0; j < sizeof scalars / sizeof *scalars; j++)
        snprintf(stat_names[k++], sizeof stat_names[0], "%s", scalars[j]);
}

MSH_EXPORT const char *memshim_torch_stat_name(int i)
{
    if (i < 0 || i >= NSTAT) return NULL;
    pthread_once(&names_once, names_build);
    return stat_names[i];
}

MSH_EXPORT int memshim_torch_stats(int device, long long *vals, int n)
{
    if (!dev_ok(device)) return 0;
    if (!vals || n <= 0) return NSTAT;
    struct tdev *t = &tdevs[device];
    struct pool_sum ps;
    sum_device(device, &ps);
    struct msh_pool_caller cc;
    memset(&cc, 0, sizeof cc);
    struct msh_pool *main_pool = msh_core_pool_get(device);
    if (main_pool) msh_pool_caller_stats(main_pool, &cc);
    size_t gran = 0;
    struct msh_device *dev = msh_core_device(device);
    if (dev) dev->ops->granularity(dev, &gran);
    uint64_t segs = gran ? ps.mapped / gran : 0;
    uint64_t rpeak = cc.reserved_peak > ps.mapped ? cc.reserved_peak : ps.mapped;
    long long v[NSTAT];
    memset(v, 0, sizeof v);
    int k = 0;
    for (int m = 0; m < NMETRIC; m++) {
        for (int sp = 0; sp < SP_N; sp++) {
            uint64_t f[4] = {0, 0, 0, 0};
            const struct msh_caller_count *c = NULL;
            /* active = allocated: a block in the front end's bins is inactive (and reserved) */
            if (m == 0 || m == 1) c = &cc.bytes[sp];
            else if (m == 2) c = &cc.req[sp];
            else if (m == 5 || m == 6) c = &cc.count[sp];
            if (c) {
                f[0] = c->cur;
                f[1] = c->peak;
                f[2] = c->allocated;
                f[3] = c->freed;
            } else if (sp != SP_SMALL) { /* pages are not split by PyTorch's pools: all under large */
                if (m == 3) {
                    f[0] = ps.mapped;
                    f[1] = rpeak;
                    f[2] = ps.created - atomic_load(&t->base_created);
                    f[3] = ps.released - atomic_load(&t->base_released);
                } else if (m == 7) {
                    f[0] = segs;
                    f[1] = gran ? rpeak / gran : 0;
                    f[2] = ps.create_ops - atomic_load(&t->base_create_ops);
                    f[3] = ps.release_ops - atomic_load(&t->base_release_ops);
                } else if (m == 4) { /* free and binned bytes inside mapped pages: held, not usable by others */
                    f[0] = f[1] = ps.free_bytes + ps.binned;
                }
            }
            for (int j = 0; j < 4; j++) v[k++] = (long long)f[j];
        }
    }
    k += 8; /* oversize_allocations, oversize_segments: memshim has no oversize class */
    v[k++] = (long long)(ps.retries - atomic_load(&t->base_retries));
    v[k++] = (long long)atomic_load(&t->ooms);
    v[k++] = (long long)(ps.syncs - atomic_load(&t->base_syncs));
    v[k++] = (long long)(ps.create_ops - atomic_load(&t->base_create_ops));
    v[k++] = (long long)(ps.release_ops - atomic_load(&t->base_release_ops));
    v[k++] = -1; /* max_split_size: no split limit */
    int out = n < NSTAT ? n : NSTAT;
    memcpy(vals, v, (size_t)out * sizeof *vals);
    return NSTAT;
}

static void reset_peak_one(int device)
{
    struct msh_pool *m = msh_core_pool_get(device);
    if (m) msh_pool_caller_reset(m, true, false);
}

MSH_EXPORT void memshim_torch_reset_peak(int device)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++)
        if (device < 0 || d == device) reset_peak_one(d);
}

static void reset_accumulated_one(int device)
{
    struct tdev *t = &tdevs[device];
    struct msh_pool *m = msh_core_pool_get(device);
    if (m) msh_pool_caller_reset(m, false, true);
    struct pool_sum ps;
    sum_device(device, &ps);
    atomic_store(&t->base_created, ps.created);
    atomic_store(&t->base_released, ps.released);
    atomic_store(&t->base_create_ops, ps.create_ops);
    atomic_store(&t->base_release_ops, ps.release_ops);
    atomic_store(&t->base_retries, ps.retries);
    atomic_store(&t->base_syncs, ps.syncs);
    atomic_store(&t->ooms, 0);
}

MSH_EXPORT void memshim_torch_reset_accumulated(int device)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++)
        if (device < 0 || d == device) reset_accumulated_one(d);
}

/* ---- the out-of-memory message ----------------------------------------------------------------- */

static void fmt_size(char *out, size_t len, uint64_t b)
{
    if (b >= MSH_GiB) snprintf(out, len, "%.2f GiB", (double)b / (double)MSH_GiB);
    else if (b >= MSH_MiB) snprintf(out, len, "%.2f MiB", (double)b / (double)MSH_MiB);
    else if (b >= MSH_KiB) snprintf(out, len, "%.2f KiB", (double)b / (double)MSH_KiB);
    else snprintf(out, len, "%llu bytes", (unsigned long long)b);
}

/* What set the limit a request failed against, for the OOM message (issue 31: a limit is not "no
 * memory could ever hold it"): PyTorch's memory fraction (set_per_process_memory_fraction, or
 * per_process_memory_fraction in its allocator settings) when it binds, else MEMSHIM_LIMIT; and
 * the setting that raises it. */
static const char *limit_origin(int device, char *out, size_t len)
{
    double f = 0;
    size_t total = 0, cfg = 0;
    if (dev_ok(device)) {
        pthread_mutex_lock(&tlock);
        f = tdevs[device].fraction, total = tdevs[device].total, cfg = tdevs[device].cfg_limit;
        pthread_mutex_unlock(&tlock);
    }
    if (f > 0 && total && (!cfg || (size_t)(f * (double)total) <= cfg)) {
        snprintf(out, len, "set_per_process_memory_fraction(%g)", f);
        return "raise the memory fraction (set_per_process_memory_fraction)";
    }
    if (msh_cfg.limit_fraction > 0) snprintf(out, len, "MEMSHIM_LIMIT=%g", msh_cfg.limit_fraction);
    else snprintf(out, len, "MEMSHIM_LIMIT");
    return "raise MEMSHIM_LIMIT";
}

MSH_EXPORT int memshim_torch_oom_message(int device, size_t size, char *buf, size_t len)
{
    if (!buf || !len) return 0;
    struct msh_pool *p = last_oom_pool;
    struct msh_pool_oom o;
    memset(&o, 0, sizeof o);
    if (p) msh_pool_last_oom(p, &o);
    char req[32], tot[32], fre[32], live[32], resv[32], lim[32], ext[32], torch_live[32], cached[32];
    fmt_size(req, sizeof req, size);
    fmt_size(cached, sizeof cached, o.cached_bytes);
    fmt_size(tot, sizeof tot, o.device_total);
    fmt_size(fre, sizeof fre, o.device_free);
    fmt_size(live, sizeof live, o.live_bytes);
    fmt_size(resv, sizeof resv, o.mapped_bytes);
    fmt_size(lim, sizeof lim, o.limit_bytes);
    fmt_size(ext, sizeof ext, o.largest_free);
    struct msh_pool_caller cc;
    memset(&cc, 0, sizeof cc);
    struct msh_pool *main_pool = dev_ok(device) ? msh_core_pool_get(device) : NULL;
    if (main_pool) msh_pool_caller_stats(main_pool, &cc);
    fmt_size(torch_live, sizeof torch_live, cc.req[SP_ALL].cur);
    const char *gc = msh_cfg.gc == MSH_GC_NEVER ? "no gc.collect() (MEMSHIM_GC=never)"
                     : msh_cfg.gc == MSH_GC_EPOCH ? "no gc.collect() (MEMSHIM_GC=epoch runs it only at epoch ends)"
                     : o.steps & MSH_OOM_STEP_GC  ? "gc.collect() where this thread holds the GIL"
                     : last_oom_capture ? "no gc.collect() (not for a CUDA-graph capture pool: code it runs could be captured)"
                                        : "no gc.collect() (freeing every tensor would not make room)";
    const char *rel = msh_cfg.empty_cache == MSH_EC_NEVER      ? "no release to the driver (MEMSHIM_EMPTY_CACHE=never)"
                      : o.steps & MSH_OOM_STEP_EMPTY_CACHE ? "release of cached pages to the driver"
                                                           : "its cache kept (releasing it would not make room)";
    /* Issue 25: the case first. A request larger than the device or the limit is refused before
     * any driver work (no step can change that); one that does not fit now gets the figures. */
    char origin[64], limit_txt[112];
    const char *raise = limit_origin(device, origin, sizeof origin);
    if (o.limit_bytes) snprintf(limit_txt, sizeof limit_txt, "%s (set by %s)", lim, origin);
    else snprintf(limit_txt, sizeof limit_txt, "none");
    int n;
    if (p && o.kind == MSH_OOM_DEVICE)
        n = snprintf(buf, len,
                     "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s is "
                     "free. Of the allocated memory %s is allocated by PyTorch. memshim (tensor mode%s): larger than "
                     "the device (%s): no memory on this GPU could ever hold it, so memshim refused it before any "
                     "driver work.",
                     req, device, tot, fre, torch_live, last_oom_capture ? ", CUDA-graph capture pool" : "", tot);
    else if (p && o.kind != MSH_OOM_NOW)
        n = snprintf(buf, len,
                     "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s is "
                     "free. Of the allocated memory %s is allocated by PyTorch. memshim (tensor mode%s): larger than "
                     "the limit (%s) set by %s: it cannot fit under that limit whatever is freed, so memshim refused "
                     "it before any driver work; %s%s.",
                     req, device, tot, fre, torch_live, last_oom_capture ? ", CUDA-graph capture pool" : "", lim,
                     origin, raise,
                     msh_cfg.spill == MSH_SPILL_HOST ? " (spill cannot help: a new tensor lives in device memory)" : "");
    else
        n = snprintf(buf, len,
                     "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s is "
                     "free. Of the allocated memory %s is allocated by PyTorch. memshim (tensor mode%s): %s: "
                     "%s; device free %s, cached by memshim %s, limit %s, live %s, reserved %s, largest free "
                     "extent %s. memshim tried: reuse of free blocks and cached pages, new pages within the limit "
                     "and the device's free memory, %s, %s, %s.",
                     req, device, tot, fre, torch_live, last_oom_capture ? ", CUDA-graph capture pool" : "",
                     !p ? "no pool for this device" : "does not fit now",
                     o.fragmentation ? "fragmentation (enough bytes are free, but not in usable pages)"
                                     : "capacity (the live set does not fit)",
                     fre, cached, limit_txt, live, resv, ext,
                     msh_cfg.defrag ? "reclaim and remap of cached pages" : "no remap (MEMSHIM_DEFRAG=0)", gc, rel);
    if (n < 0) {
        buf[0] = 0;
        return 0;
    }
    if (p && o.kind == MSH_OOM_NOW && o.others_bytes && (size_t)n < len) { /* issue 31 */
        char others[32];
        fmt_size(others, sizeof others, o.others_bytes);
        int m = snprintf(buf + n, len - (size_t)n, " The device's other memshim pools (CUDA-graph capture pools, or "
                         "the main pool) hold %s under the same limit.", others);
        if (m > 0) n += m;
    }
    if (o.kind == MSH_OOM_NOW && (o.capture || msh_capture_any()) && (size_t)n < len) {
        int m = snprintf(buf + n, len - (size_t)n,
                         " A CUDA-graph capture was in progress: memshim does not synchronize, unmap or release "
                         "memory during a capture (that would invalidate it), so cached memory could not be "
                         "reclaimed for this request; allocate what the capture needs before it begins.");
        if (m > 0) n += m;
    }
    if (p && o.kind == MSH_OOM_NOW && (size_t)n < len) { /* spill cannot help the other cases */
        char sp[32], short_by[32];
        fmt_size(sp, sizeof sp, o.spilled_bytes);
        size_t cap = o.limit_bytes ? o.limit_bytes : o.device_total;
        size_t need = o.live_bytes + size, lack = need > cap ? need - cap : size;
        fmt_size(short_by, sizeof short_by, lack);
        int m = 0;
        if (o.spill_stop)
            m = snprintf(buf + n, len - (size_t)n,
                         " MEMSHIM_SPILL=host: %s of cold pages are on host memory, and no more could go there (%s).",
                         sp,
                         !strcmp(o.spill_stop, "spill_max") ? "MEMSHIM_SPILL_MAX reached: raise it, or lower the batch"
                         : !strcmp(o.spill_stop, "nothing cold") ? "every page left is used by the current step: "
                                                                   "activation checkpointing or a smaller batch would help"
                                                                 : o.spill_stop);
        else if (cap && lack <= cap / 10)
            m = snprintf(buf + n, len - (size_t)n,
                         " The job is short by about %s (%.1f%% of %s): MEMSHIM_SPILL=host would keep it going with its "
                         "coldest pages on host memory, slower (docs/pool.md, \"Spill\").",
                         short_by, 100.0 * (double)lack / (double)cap, o.limit_bytes ? "the limit" : "the device");
        if (m > 0) n += m;
    }
    return (size_t)n < len ? n : (int)len - 1;
}

/* ---- PyTorch's own figures for the epoch report (segment mode) ---------------------------------- */

#define ESTAT_MAX MSH_REPORT_TORCH_STATS /* as many as a report carries (report.h) */
static struct {
    char key[64];
    int64_t val;
} estats[MSH_MAX_DEVICES][ESTAT_MAX];
static int nestats[MSH_MAX_DEVICES];
static pthread_mutex_t estat_lock = PTHREAD_MUTEX_INITIALIZER;

MSH_EXPORT void memshim_torch_epoch_stat(int device, const char *key, long long value)
{
    if (!dev_ok(device) || !key || !*key || strlen(key) >= sizeof estats[0][0].key) return;
    pthread_mutex_lock(&estat_lock);
    int i = 0;
    while (i < nestats[device] && strcmp(estats[device][i].key, key)) i++;
    if (i < ESTAT_MAX) {
        if (i == nestats[device]) {
            strcpy(estats[device][i].key, key);
            nestats[device]++;
        }
        estats[device][i].val = value;
    }
    pthread_mutex_unlock(&estat_lock);
}

MSH_EXPORT void memshim_torch_epoch_stats_clear(void)
{
    pthread_mutex_lock(&estat_lock);
    memset(nestats, 0, sizeof nestats);
    pthread_mutex_unlock(&estat_lock);
}

int msh_torch_report_stat(int device, int i, const char **key, int64_t *val)
{
    if (!dev_ok(device) || i < 0) return 0;
    pthread_mutex_lock(&estat_lock);
    int ok = i < nestats[device];
    if (ok) {
        *key = estats[device][i].key; /* stable until the Python side clears them after the report */
        *val = estats[device][i].val;
    }
    pthread_mutex_unlock(&estat_lock);
    return ok;
}
