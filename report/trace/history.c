/*
 * history.c: the allocation history behind memshim's PyTorch memory snapshots: a bounded ring of
 * the last N events, the pages each pool has mapped (always, through a wrapper around the device
 * backend, so `segments` are exact whenever a snapshot is taken), MEMSHIM_SNAPSHOT's files at
 * exit and at each OOM, and the C entry points hooks/python/memshim/_history.py calls to serve
 * torch.cuda.memory._record_memory_history(), _snapshot() and _dump_snapshot().
 *
 * The ring lives in mmap'd memory (MAP_NORESERVE: committed as it fills), so recording never
 * calls malloc; map/unmap are recorded under the pool lock that covers them, alloc/free with no
 * lock held. The history lock is a leaf: nothing is called while it is held, and no snapshot is
 * built or written while any memshim lock is held. Must never call a CUDA hook.
 */
#include "history.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "memshim.h"
#include "msh.h"
#include "report.h"
#include "sites.h"

#define RING_MAX ((size_t)1 << 24) /* MEMSHIM_SNAPSHOT_EVENTS' upper bound */
#define RES_MAX 256

static pthread_mutex_t hist_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int recording;   /* 0 off, 1 "state" (frames for blocks, no events), 2 "all" */
static _Atomic bool record_frames = true;
static struct msh_hist_event *ring;
static size_t ring_cap, ring_head, ring_n;

struct dev_maps {
    struct msh_hist_range *m; /* open addressing by va: va 0 empty, 1 deleted */
    size_t mcap, mused, mlive;
    struct msh_hist_range res[RES_MAX];
    int nres;
    uint64_t gran;
};
static struct dev_maps dm[MSH_MAX_DEVICES];

static const struct msh_device_ops *orig_ops[MSH_MAX_DEVICES];
static struct msh_device_ops wrap_ops[MSH_MAX_DEVICES];

static void *vm(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static inline size_t hmix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 29));
}

bool msh_history_recording(void)
{
    return atomic_load_explicit(&recording, memory_order_relaxed) != 0;
}

/* ---- the ring (hist_lock held) ------------------------------------------------------------------ */

static void ring_put(const struct msh_hist_event *e)
{
    if (!ring_cap) return;
    ring[ring_head] = *e;
    ring_head = ring_head + 1 == ring_cap ? 0 : ring_head + 1;
    if (ring_n < ring_cap) ring_n++;
}

/* Resize to `cap` events (0: none), keeping the newest. */
static int ring_resize(size_t cap)
{
    struct msh_hist_event *n = cap ? vm(cap * sizeof *n) : NULL;
    if (cap && !n) return ENOMEM;
    pthread_mutex_lock(&hist_lock);
    struct msh_hist_event *old = ring;
    size_t oldcap = ring_cap;
    size_t keep = ring_n < cap ? ring_n : cap;
    for (size_t i = 0; i < keep; i++) {
        size_t src = (ring_head + oldcap - keep + i) % oldcap;
        n[i] = old[src];
    }
    ring = n;
    ring_cap = cap;
    ring_n = keep;
    ring_head = cap ? keep % cap : 0;
    pthread_mutex_unlock(&hist_lock);
    if (old) munmap(old, oldcap * sizeof *old);
    return 0;
}

/* ---- mapped pages per device (hist_lock held) ----------------------------------------------------- */

static bool maps_grow(struct dev_maps *d)
{
    size_t cap = d->mcap ? (d->mlive * 4 > d->mcap ? d->mcap * 2 : d->mcap) : 1024;
    struct msh_hist_range *m = vm(cap * sizeof *m);
    if (!m) return false;
    for (size_t i = 0; i < d->mcap; i++) {
        if (d->m[i].va <= 1) continue;
        size_t j = hmix(d->m[i].va) & (cap - 1);
        while (m[j].va) j = (j + 1) & (cap - 1);
        m[j] = d->m[i];
    }
    if (d->m) munmap(d->m, d->mcap * sizeof *d->m);
    d->m = m;
    d->mcap = cap;
    d->mused = d->mlive;
    return true;
}

static void maps_add(struct dev_maps *d, uint64_t va, uint64_t size)
{
    if ((d->mused + 1) * 2 > d->mcap && !maps_grow(d)) return;
    size_t j = hmix(va) & (d->mcap - 1);
    while (d->m[j].va > 1 && d->m[j].va != va) j = (j + 1) & (d->mcap - 1);
    if (d->m[j].va != va) {
        if (!d->m[j].va) d->mused++;
        d->mlive++;
    }
    d->m[j] = (struct msh_hist_range){va, size};
    /* the page size: maps cover runs of pages of different lengths (issue 10), so the greatest
     * common divisor of their sizes, which is the granularity once two runs differ */
    uint64_t g = d->gran, x = size;
    while (x) {
        uint64_t t = g % x;
        g = x;
        x = t;
    }
    d->gran = g;
}

/* Remove the map entries that make up [va, va + size). */
static void maps_remove(struct dev_maps *d, uint64_t va, uint64_t size)
{
    uint64_t end = va + size;
    while (va < end && d->mcap) {
        size_t j = hmix(va) & (d->mcap - 1);
        while (d->m[j].va && d->m[j].va != va) j = (j + 1) & (d->mcap - 1);
        if (d->m[j].va != va) return; /* not a map boundary: nothing we know of */
        uint64_t s = d->m[j].size;
        d->m[j].va = 1;
        d->mlive--;
        va += s ? s : end - va;
    }
}

/* ---- the device wrapper ---------------------------------------------------------------------------- */

static void record_at(uint64_t t, uint8_t action, int device, uint64_t addr, uint64_t size, uint64_t stream,
                      uint32_t stack)
{
    struct msh_hist_event e = {addr, size, stream, t, stack, action, (uint8_t)device};
    ring_put(&e);
}

static void record(uint8_t action, int device, uint64_t addr, uint64_t size, uint64_t stream, uint32_t stack)
{
    record_at(wall_us(), action, device, addr, size, stream, stack);
}

static int w_map(struct msh_device *d, uint64_t va, size_t size, uint64_t h)
{
    int dev = d->ordinal;
    int rc = orig_ops[dev]->map(d, va, size, h);
    if (rc == 0) {
        pthread_mutex_lock(&hist_lock);
        maps_add(&dm[dev], va, size);
        if (atomic_load_explicit(&recording, memory_order_relaxed) == 2)
            record(MSH_H_SEGMENT_MAP, dev, va, size, 0, 0);
        pthread_mutex_unlock(&hist_lock);
    }
    return rc;
}

static int w_unmap(struct msh_device *d, uint64_t va, size_t size)
{
    int dev = d->ordinal;
    int rc = orig_ops[dev]->unmap(d, va, size);
    if (rc == 0) {
        pthread_mutex_lock(&hist_lock);
        maps_remove(&dm[dev], va, size);
        if (atomic_load_explicit(&recording, memory_order_relaxed) == 2)
            record(MSH_H_SEGMENT_UNMAP, dev, va, size, 0, 0);
        pthread_mutex_unlock(&hist_lock);
    }
    return rc;
}

static int w_reserve(struct msh_device *d, size_t size, size_t align, uint64_t *va)
{
    int dev = d->ordinal;
    int rc = orig_ops[dev]->reserve(d, size, align, va);
    if (rc == 0) {
        pthread_mutex_lock(&hist_lock);
        if (dm[dev].nres < RES_MAX) dm[dev].res[dm[dev].nres++] = (struct msh_hist_range){*va, size};
        pthread_mutex_unlock(&hist_lock);
    }
    return rc;
}

static int w_unreserve(struct msh_device *d, uint64_t va, size_t size)
{
    int dev = d->ordinal;
    int rc = orig_ops[dev]->unreserve(d, va, size);
    if (rc == 0) {
        pthread_mutex_lock(&hist_lock);
        struct dev_maps *m = &dm[dev];
        for (int i = 0; i < m->nres; i++)
            if (m->res[i].va == va) {
                m->res[i] = m->res[--m->nres];
                break;
            }
        pthread_mutex_unlock(&hist_lock);
    }
    return rc;
}

void msh_history_wrap_device(struct msh_device *d)
{
    int dev = d->ordinal;
    if (dev < 0 || dev >= MSH_MAX_DEVICES || !d->ops || d->ops == &wrap_ops[dev]) return;
    orig_ops[dev] = d->ops;
    wrap_ops[dev] = *d->ops;
    wrap_ops[dev].map = w_map;
    wrap_ops[dev].unmap = w_unmap;
    wrap_ops[dev].reserve = w_reserve;
    wrap_ops[dev].unreserve = w_unreserve;
    d->ops = &wrap_ops[dev];
}

/* ---- recording ----------------------------------------------------------------------------------- */

static int set_recording(int mode, size_t cap, bool frames, bool clear)
{
    if (cap > RING_MAX) cap = RING_MAX;
    if (mode < 2) cap = 0;
    if (clear) {
        pthread_mutex_lock(&hist_lock);
        ring_n = ring_head = 0;
        pthread_mutex_unlock(&hist_lock);
    }
    int rc = cap != ring_cap ? ring_resize(cap) : 0;
    while (rc == ENOMEM && cap > 1024) { /* a strict overcommit policy: take what there is */
        cap /= 2;
        rc = ring_resize(cap);
    }
    if (rc) return rc;
    record_frames = frames;
    atomic_store(&recording, mode);
    msh_sites_init(mode != 0);
    msh_sites_set_capture_all(mode != 0 && frames);
    return 0;
}

void msh_history_init(bool reports_on)
{
    msh_sites_init(reports_on || msh_cfg.snapshot[0]);
    if (!msh_cfg.snapshot[0]) return;
    if (set_recording(2, (size_t)msh_cfg.snapshot_events, true, false))
        msh_warn("MEMSHIM_SNAPSHOT: cannot map the history ring of %llu events; no snapshot history",
                 (unsigned long long)msh_cfg.snapshot_events);
}

void msh_history_note(char op, int device, uint64_t stream, uint64_t addr, uint64_t size)
{
    uint32_t stack = msh_sites_last_stack;
    msh_sites_last_stack = MSH_STACK_NONE;
    if (atomic_load_explicit(&recording, memory_order_relaxed) != 2 || device < 0 || device >= MSH_MAX_DEVICES) return;
    if (!record_frames) stack = MSH_STACK_NONE;
    uint64_t t = wall_us(); /* read before the lock: the clock is the slowest part here */
    pthread_mutex_lock(&hist_lock);
    if (op == 'a') {
        record_at(t, MSH_H_ALLOC, device, addr, size, stream, stack);
    } else if (op == 'f') { /* both at once: PyTorch's viewer pairs them */
        record_at(t, MSH_H_FREE_REQUESTED, device, addr, size, stream, 0);
        record_at(t, MSH_H_FREE_COMPLETED, device, addr, size, stream, 0);
    }
    pthread_mutex_unlock(&hist_lock);
}

void msh_history_mark_snapshot(int device)
{
    if (atomic_load_explicit(&recording, memory_order_relaxed) != 2) return;
    pthread_mutex_lock(&hist_lock);
    record(MSH_H_SNAPSHOT, device, 0, 0, 0, 0);
    pthread_mutex_unlock(&hist_lock);
}

void msh_history_sizes(int device, size_t *nev, size_t *nmapped, size_t *nreserved)
{
    pthread_mutex_lock(&hist_lock);
    *nev = ring_n;
    *nmapped = device >= 0 && device < MSH_MAX_DEVICES ? dm[device].mlive : 0;
    *nreserved = device >= 0 && device < MSH_MAX_DEVICES ? (size_t)dm[device].nres : 0;
    pthread_mutex_unlock(&hist_lock);
}

int msh_history_copy(int device, struct msh_hist_copy *c, size_t evcap, size_t mapcap, size_t rescap)
{
    c->nev = c->nmapped = c->nreserved = 0;
    c->gran = 0;
    if (device < 0 || device >= MSH_MAX_DEVICES) return EINVAL;
    pthread_mutex_lock(&hist_lock);
    struct dev_maps *d = &dm[device];
    if (d->mlive > mapcap || (size_t)d->nres > rescap) {
        pthread_mutex_unlock(&hist_lock);
        return ENOSPC;
    }
    for (size_t i = 0; i < d->mcap; i++)
        if (d->m[i].va > 1) c->mapped[c->nmapped++] = d->m[i];
    memcpy(c->reserved, d->res, (size_t)d->nres * sizeof d->res[0]);
    c->nreserved = (size_t)d->nres;
    c->gran = d->gran;
    /* this device's events, the newest evcap of them, oldest first */
    size_t take = 0;
    for (size_t k = 0; k < ring_n && take < evcap; k++) {
        size_t i = (ring_head + ring_cap - 1 - k) % ring_cap;
        if (ring[i].device == device) take++;
    }
    size_t w = take;
    for (size_t k = 0; k < ring_n && w > 0; k++) {
        size_t i = (ring_head + ring_cap - 1 - k) % ring_cap;
        if (ring[i].device == device) c->ev[--w] = ring[i];
    }
    c->nev = take;
    pthread_mutex_unlock(&hist_lock);
    return 0;
}

/* ---- files -------------------------------------------------------------------------------------- */

/* MEMSHIM_SNAPSHOT with %r (rank; 0 without one), %p, %h expanded; without %r a rank is added as
 * -rankR before the extension; `tag` (e.g. "-oom0003") goes before the extension too. */
static int snapshot_path(const char *tag, char *out, size_t len)
{
    char tmpl[4096 + 64];
    long rank = msh_report_rank();
    bool has_r = false;
    size_t o = 0;
    for (const char *p = msh_cfg.snapshot; *p && o + 24 < sizeof tmpl; p++) {
        if (p[0] == '%' && p[1] == 'r') {
            o += (size_t)snprintf(tmpl + o, sizeof tmpl - o, "%ld", rank < 0 ? 0 : rank);
            p++;
            has_r = true;
        } else if (p[0] == '%' && p[1] == '%') {
            tmpl[o++] = '%';
            tmpl[o++] = '%';
            p++;
        } else {
            tmpl[o++] = *p;
        }
    }
    tmpl[o] = 0;
    char path[4096];
    if (msh_expand_path(tmpl, path, sizeof path)) return ENAMETOOLONG;
    char extra[64] = "";
    if (!has_r && rank >= 0) snprintf(extra, sizeof extra, "-rank%ld", rank);
    strncat(extra, tag, sizeof extra - strlen(extra) - 1);
    const char *slash = strrchr(path, '/');
    const char *dot = strrchr(path, '.');
    size_t stem = dot && dot > (slash ? slash : path) && dot != (slash ? slash + 1 : path) ? (size_t)(dot - path)
                                                                                        : strlen(path);
    int n = snprintf(out, len, "%.*s%s%s", (int)stem, path, extra, path + stem);
    return n < 0 || (size_t)n >= len ? ENAMETOOLONG : 0;
}

static void write_snapshot_file(const char *tag)
{
    char path[PATH_MAX];
    if (snapshot_path(tag, path, sizeof path)) {
        msh_warn("MEMSHIM_SNAPSHOT='%.200s' is too long after expansion; no snapshot", msh_cfg.snapshot);
        return;
    }
    int rc = msh_snapshot_write(path);
    if (rc) msh_warn("MEMSHIM_SNAPSHOT: cannot write %.300s: %s (the job continues)", path, strerror(rc));
    else msh_info("wrote the memory snapshot %s", path);
}

void msh_history_exit(void)
{
    if (msh_cfg.snapshot[0]) write_snapshot_file("");
}

#define OOM_SNAPSHOTS_MAX 16
void msh_history_oom(int device)
{
    struct msh_pool *p = msh_core_pool_get(device);
    if (!p) return;
    if (atomic_load_explicit(&recording, memory_order_relaxed) == 2) {
        struct msh_pool_oom o;
        msh_pool_last_oom(p, &o);
        pthread_mutex_lock(&hist_lock);
        record(MSH_H_OOM, device, o.device_free, o.requested, 0, 0);
        pthread_mutex_unlock(&hist_lock);
    }
    static _Atomic int written;
    if (!msh_cfg.snapshot[0] || atomic_fetch_add(&written, 1) >= OOM_SNAPSHOTS_MAX) return;
    char tag[32];
    snprintf(tag, sizeof tag, "-oom%04d", atomic_load(&written) - 1);
    write_snapshot_file(tag);
}

/* ---- entry points for the Python side (memshim.h) -------------------------------------------------- */

MSH_EXPORT int memshim_history_record(int mode, long long max_entries, int clear, int frames)
{
    if (mode < 0 || mode > 2) return EINVAL;
    if (!msh_core_init()) return ENODEV;
    msh_in_hook++;
    size_t cap = max_entries <= 0 ? 0 : (unsigned long long)max_entries > RING_MAX ? RING_MAX : (size_t)max_entries;
    int rc = set_recording(mode, cap, frames != 0, clear != 0);
    msh_in_hook--;
    return rc;
}

MSH_EXPORT int memshim_snapshot(unsigned char **buf, size_t *len)
{
    if (!buf || !len) return EINVAL;
    *buf = NULL;
    *len = 0;
    if (!msh_core_init()) return ENODEV;
    msh_in_hook++;
    int rc = msh_snapshot_build(buf, len);
    msh_in_hook--;
    return rc;
}

MSH_EXPORT void memshim_snapshot_free(unsigned char *buf)
{
    free(buf);
}

MSH_EXPORT int memshim_snapshot_dump(const char *path)
{
    if (!path || !*path) return EINVAL;
    if (!msh_core_init()) return ENODEV;
    msh_in_hook++;
    int rc = msh_snapshot_write(path);
    msh_in_hook--;
    return rc;
}

MSH_EXPORT int memshim_sites_library_path(const char *prefix)
{
    return msh_sites_add_internal_prefix(prefix);
}
