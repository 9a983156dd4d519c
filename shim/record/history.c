/*
 * history.c: the allocation history behind memshim's PyTorch memory snapshots: the last N events
 * in one ring per recording thread, the pages each pool has mapped (always, through a wrapper
 * around the device backend, so `segments` are exact whenever a snapshot is taken),
 * MEMSHIM_SNAPSHOT's files at exit and at each OOM, and the C entry points
 * hooks/python/memshim/_history.py calls to serve torch.cuda.memory._record_memory_history(),
 * _snapshot() and _dump_snapshot().
 *
 * Recording an event takes no lock and reads no system clock: each thread appends to its own
 * ring (a few stores and a release of the ring's head) with a number from one shared counter
 * (one atomic add) and a msh_ticks() stamp, the time source PyTorch's own recorder uses. A
 * snapshot merges the rings by number and turns the stamps into wall-clock microseconds. The
 * numbers, not the stamps, give the order: the counter's adds are ordered like the pool calls
 * around them, while the time-stamp counters of two CPUs may disagree by tens of ns (measured on
 * a 2-vCPU VM whose kernel trusts its TSC), enough to put a reuse before its free. A reader copies a
 * ring while its owner writes, seqlock-style: an entry counts only if the head, read after it,
 * shows that the owner has not started to overwrite its slot. Rings live in mmap'd memory
 * (MAP_NORESERVE: committed as they fill), so recording never calls malloc; a thread's ring
 * outlives the thread (its events stay) and goes to the next thread that needs one.
 *
 * The history lock covers the mapped-page tables, ring ownership and every reader; it is a
 * leaf: nothing is called while it is held, and no snapshot is built or written while any
 * memshim lock is held. Must never call a CUDA hook.
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
#include "hotclock.h"
#include "memshim.h"
#include "msh.h"
#include "report.h"
#include "sites.h"

#define RING_MAX ((size_t)1 << 24) /* MEMSHIM_SNAPSHOT_EVENTS' upper bound */
#define RES_MAX 256

static pthread_mutex_t hist_lock = PTHREAD_MUTEX_INITIALIZER;
_Atomic int msh_history_on;   /* 0 off, 1 "state" (frames for blocks, no events), 2 "all" (history.h) */
static _Atomic bool record_frames = true;

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

static inline size_t hmix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 29));
}

/* ---- the rings ----------------------------------------------------------------------------------
 * One entry per event, a free being one entry that a snapshot writes as PyTorch's two
 * (free_requested, free_completed). Every field is written and read with relaxed atomics and
 * ordered by fences around the head (the seqlock pattern), so a reader racing its owner never
 * reads a torn entry as a whole one. */

struct rent {
    _Atomic uint64_t addr, size, stream, stamp;
    _Atomic uint64_t seq;  /* from hist_seq: the order across threads */
    _Atomic uint64_t meta; /* stack | action << 32 | device << 40 */
};
/* One add per event. Its own cache line: the rings' owners write it, nothing else shares it. */
static struct {
    _Alignas(64) _Atomic uint64_t n;
    char pad[64 - sizeof(uint64_t)];
} hist_seq;

#define NRINGS 64 /* rings with an owner at once; ring 0 is shared (under hist_lock) by the rest */
struct ring {
    _Atomic uint64_t head;  /* entries ever written since the last clear (owner: release) */
    struct rent *buf;       /* cap entries; index i lives in slot i % cap */
    size_t cap;
    size_t pos;             /* owner: head % cap */
    uint64_t clear_gen;     /* the clear it was last reset for: older rings read as empty */
    uint64_t gen;           /* ring_gen the owner last adopted (owner) */
    bool owned;
};
static struct ring rings[NRINGS];
static size_t ring_cap;            /* MEMSHIM_SNAPSHOT_EVENTS or max_entries (hist_lock) */
static uint64_t clear_gen;         /* bumped when the events are dropped (hist_lock) */
static _Atomic uint64_t ring_gen;  /* bumped on every change an owner must act on */
static __thread struct ring *tl_ring;
static pthread_key_t ring_key;
static pthread_once_t ring_key_once = PTHREAD_ONCE_INIT;

/* Thread exit: the ring and its events stay for the snapshot; the next thread may take it. */
static void ring_release(void *arg)
{
    struct ring *r = arg;
    tl_ring = NULL; /* runs on the exiting thread: a later destructor's free takes a ring anew */
    pthread_mutex_lock(&hist_lock);
    if (r && r != &rings[0]) r->owned = false;
    pthread_mutex_unlock(&hist_lock);
}

static void ring_key_create(void)
{
    if (pthread_key_create(&ring_key, ring_release)) ring_key = (pthread_key_t)-1;
}

/* Bring ring r to the current settings (hist_lock held; r's owner is this thread or none):
 * dropped events are dropped, a new capacity keeps the newest entries. */
static void ring_refresh(struct ring *r)
{
    if (r->clear_gen != clear_gen) {
        atomic_store_explicit(&r->head, 0, memory_order_relaxed);
        r->pos = 0;
        r->clear_gen = clear_gen;
    }
    if (r->cap != ring_cap && ring_cap) {
        struct rent *nb = vm(ring_cap * sizeof *nb);
        if (nb) {
            uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
            uint64_t keep = h < r->cap ? h : r->cap;
            if (keep > ring_cap) keep = ring_cap;
            for (uint64_t k = 0; k < keep; k++) {
                uint64_t i = h - keep + k;
                struct rent *s = &r->buf[i % r->cap], *d = &nb[k];
                atomic_store_explicit(&d->addr, atomic_load_explicit(&s->addr, memory_order_relaxed), memory_order_relaxed);
                atomic_store_explicit(&d->size, atomic_load_explicit(&s->size, memory_order_relaxed), memory_order_relaxed);
                atomic_store_explicit(&d->stream, atomic_load_explicit(&s->stream, memory_order_relaxed), memory_order_relaxed);
                atomic_store_explicit(&d->stamp, atomic_load_explicit(&s->stamp, memory_order_relaxed), memory_order_relaxed);
                atomic_store_explicit(&d->seq, atomic_load_explicit(&s->seq, memory_order_relaxed), memory_order_relaxed);
                atomic_store_explicit(&d->meta, atomic_load_explicit(&s->meta, memory_order_relaxed), memory_order_relaxed);
            }
            if (r->buf) munmap(r->buf, r->cap * sizeof *r->buf);
            r->buf = nb;
            r->cap = ring_cap;
            atomic_store_explicit(&r->head, keep, memory_order_release);
            r->pos = keep % ring_cap;
        }
    }
    r->gen = atomic_load_explicit(&ring_gen, memory_order_relaxed);
}

/* This thread's ring, taken or refreshed (the slow path: first event, or settings changed). */
static __attribute__((noinline)) struct ring *ring_attach(void)
{
    pthread_once(&ring_key_once, ring_key_create);
    struct ring *r = tl_ring;
    bool fresh = false;
    pthread_mutex_lock(&hist_lock);
    if (!r) {
        for (int i = 1; i < NRINGS && !r; i++)
            if (!rings[i].owned) r = &rings[i];
        if (r && ring_key == (pthread_key_t)-1) r = NULL; /* without a key its release would never come */
        if (!r) r = &rings[0]; /* NRINGS threads hold rings: share ring 0, under the lock */
        r->owned = true;
        fresh = r != &rings[0];
    }
    ring_refresh(r);
    pthread_mutex_unlock(&hist_lock);
    if (fresh) pthread_setspecific(ring_key, r); /* may allocate: never under a memshim lock */
    tl_ring = r;
    return r;
}

/* More than NRINGS - 1 threads hold rings: this one shares ring 0, whose writers and readers all
 * hold hist_lock. Numbered in the lock, so several threads' entries go in order. */
static __attribute__((noinline)) void put_shared(struct ring *r, uint8_t action, int device, uint64_t addr,
                                                 uint64_t size, uint64_t stream, uint32_t stack)
{
    pthread_mutex_lock(&hist_lock);
    uint64_t stamp = msh_ticks(), seq = atomic_fetch_add_explicit(&hist_seq.n, 1, memory_order_relaxed);
    if (r->cap && r->buf) {
        uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
        struct rent *e = &r->buf[h % r->cap];
        atomic_store_explicit(&e->addr, addr, memory_order_relaxed);
        atomic_store_explicit(&e->size, size, memory_order_relaxed);
        atomic_store_explicit(&e->stream, stream, memory_order_relaxed);
        atomic_store_explicit(&e->stamp, stamp, memory_order_relaxed);
        atomic_store_explicit(&e->seq, seq, memory_order_relaxed);
        atomic_store_explicit(&e->meta, stack | (uint64_t)action << 32 | (uint64_t)(uint8_t)device << 40,
                              memory_order_relaxed);
        atomic_store_explicit(&r->head, h + 1, memory_order_release);
    }
    pthread_mutex_unlock(&hist_lock);
}

/* Numbers are taken here, once this thread owns its ring: a ring then holds its entries in order
 * even across a change of owner (the new owner's first add follows the old owner's last). Every
 * caller is inside the window its event stands for (after the pool placed a block, before it
 * frees one, under the pool lock for a map): an event that depends on another through a pool
 * lock (a reuse after a free) gets a larger number, as the adds are ordered like the lock. */
static inline void put(uint8_t action, int device, uint64_t addr, uint64_t size, uint64_t stream, uint32_t stack)
{
    struct ring *r = tl_ring;
    /* ring 0 first: its fields belong to hist_lock (its gen is rewritten by every sharer) */
    if (MSH_UNLIKELY(!r || r == &rings[0] || r->gen != atomic_load_explicit(&ring_gen, memory_order_relaxed))) {
        r = ring_attach();
        if (r == &rings[0]) {
            put_shared(r, action, device, addr, size, stream, stack);
            return;
        }
    }
    if (MSH_UNLIKELY(!r->buf)) return; /* no memory for a ring: this thread's events are lost */
    uint64_t stamp = msh_ticks(), seq = atomic_fetch_add_explicit(&hist_seq.n, 1, memory_order_relaxed);
    struct rent *e = &r->buf[r->pos];
    uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
    /* The slot's new contents must not be seen before the head that still counts its old entry
     * as readable has been replaced: readers check the head after reading (fence pairing). */
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&e->addr, addr, memory_order_relaxed);
    atomic_store_explicit(&e->size, size, memory_order_relaxed);
    atomic_store_explicit(&e->stream, stream, memory_order_relaxed);
    atomic_store_explicit(&e->stamp, stamp, memory_order_relaxed);
    atomic_store_explicit(&e->seq, seq, memory_order_relaxed);
    atomic_store_explicit(&e->meta, stack | (uint64_t)action << 32 | (uint64_t)(uint8_t)device << 40,
                          memory_order_relaxed);
    r->pos = r->pos + 1 == r->cap ? 0 : r->pos + 1;
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    /* a ring bigger than the caches misses on every new line: ask for lines a few events ahead */
    if (MSH_LIKELY(r->pos + 8 < r->cap)) __builtin_prefetch(&r->buf[r->pos + 8], 1, 3);
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

static bool recording_events(void)
{
    return atomic_load_explicit(&msh_history_on, memory_order_relaxed) == 2;
}

static int w_map(struct msh_device *d, uint64_t va, size_t size, uint64_t h)
{
    int dev = d->ordinal;
    int rc = orig_ops[dev]->map(d, va, size, h);
    if (rc == 0) {
        pthread_mutex_lock(&hist_lock);
        maps_add(&dm[dev], va, size);
        pthread_mutex_unlock(&hist_lock);
        /* still under the pool lock that covers the map: a snapshot sees both or neither */
        if (recording_events()) put(MSH_H_SEGMENT_MAP, dev, va, size, 0, 0);
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
        pthread_mutex_unlock(&hist_lock);
        if (recording_events()) put(MSH_H_SEGMENT_UNMAP, dev, va, size, 0, 0);
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

/* The rings' capacity becomes `cap` (0: recording stops and their memory goes back to the
 * system); `clear` drops every event. Owners adopt the change at their next event; rings with
 * no owner are brought up to date here. */
static int set_recording(int mode, size_t cap, bool frames, bool clear)
{
    if (cap > RING_MAX) cap = RING_MAX;
    if (mode < 2) cap = 0;
    if (cap) { /* can a ring of this size be had at all (a strict overcommit policy)? */
        struct rent *probe = vm(cap * sizeof *probe);
        while (!probe && cap > 1024) {
            cap /= 2;
            probe = vm(cap * sizeof *probe);
        }
        if (!probe) return ENOMEM;
        munmap(probe, cap * sizeof *probe);
    }
    pthread_mutex_lock(&hist_lock);
    if (clear || !cap) clear_gen++;
    ring_cap = cap;
    for (int i = 0; i < NRINGS; i++) {
        struct ring *r = &rings[i];
        if (!r->buf) continue;
        if (!cap) /* a racing owner may still store into it: give the pages back, keep the mapping */
            madvise(r->buf, r->cap * sizeof *r->buf, MADV_DONTNEED);
        else if (!r->owned || r == &rings[0])
            ring_refresh(r);
    }
    atomic_fetch_add_explicit(&ring_gen, 1, memory_order_release);
    pthread_mutex_unlock(&hist_lock);
    record_frames = frames;
    atomic_store(&msh_history_on, mode);
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
    if (!recording_events() || device < 0 || device >= MSH_MAX_DEVICES) return;
    if (!atomic_load_explicit(&record_frames, memory_order_relaxed)) stack = MSH_STACK_NONE;
    if (op == 'a') put(MSH_H_ALLOC, device, addr, size, stream, stack);
    else if (op == 'f') put(MSH_H_FREE_REQUESTED, device, addr, size, stream, 0); /* and completed */
}

void msh_history_mark_snapshot(int device)
{
    if (recording_events()) put(MSH_H_SNAPSHOT, device, 0, 0, 0, 0);
}

/* ---- reading the rings (hist_lock held) ----------------------------------------------------------- */

struct cursor {
    struct ring *r;
    uint64_t i, lo; /* next entry to read (going back) is i - 1; none below lo */
    bool have;
    uint64_t seq;            /* the entry's number: the merge order */
    struct msh_hist_event e; /* the entry at i (time_us holds its stamp until converted) */
};

/* Read the entry before c->i into c->e; false when the ring has no more (or its owner has
 * overwritten the rest: everything older than that is gone too). */
static bool cursor_step(struct cursor *c)
{
    c->have = false;
    if (c->i <= c->lo) return false;
    uint64_t i = c->i - 1;
    struct rent *s = &c->r->buf[i % c->r->cap];
    uint64_t addr = atomic_load_explicit(&s->addr, memory_order_relaxed);
    uint64_t size = atomic_load_explicit(&s->size, memory_order_relaxed);
    uint64_t stream = atomic_load_explicit(&s->stream, memory_order_relaxed);
    uint64_t stamp = atomic_load_explicit(&s->stamp, memory_order_relaxed);
    uint64_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
    uint64_t meta = atomic_load_explicit(&s->meta, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    uint64_t h = atomic_load_explicit(&c->r->head, memory_order_relaxed);
    if (i + c->r->cap <= h) return false; /* the owner may be rewriting this slot */
    c->i = i;
    c->seq = seq;
    c->e = (struct msh_hist_event){addr, size, stream, stamp, (uint32_t)meta, (uint8_t)(meta >> 32),
                                   (uint8_t)(meta >> 40)};
    c->have = true;
    return true;
}

static size_t ring_entries(const struct ring *r)
{
    if (!r->buf || r->clear_gen != clear_gen) return 0;
    uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
    return h < r->cap ? (size_t)h : r->cap;
}

void msh_history_sizes(int device, size_t *nev, size_t *nmapped, size_t *nreserved)
{
    pthread_mutex_lock(&hist_lock);
    size_t n = 0;
    for (int i = 0; i < NRINGS; i++) n += ring_entries(&rings[i]);
    *nev = 2 * n < ring_cap ? 2 * n : ring_cap; /* a free entry is two events */
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
    /* The newest events of every ring, merged by number from the newest back: the last ring_cap
     * events of the process (a free counting as its two), of which this device's, at most evcap,
     * are written from the end of c->ev and moved to its front. */
    struct cursor cur[NRINGS];
    int nc = 0;
    for (int i = 0; i < NRINGS; i++) {
        struct ring *r = &rings[i];
        size_t n = ring_entries(r);
        if (!n) continue;
        uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
        cur[nc] = (struct cursor){.r = r, .i = h, .lo = h - n};
        if (cursor_step(&cur[nc])) nc++;
    }
    size_t total = 0, w = evcap;
    while (nc > 0 && w > 0) {
        int best = 0;
        for (int k = 1; k < nc; k++)
            if (cur[k].seq > cur[best].seq) best = k;
        struct msh_hist_event e = cur[best].e;
        size_t n = e.action == MSH_H_FREE_REQUESTED ? 2 : 1;
        /* a free's two halves go together or not at all: the window never starts between them */
        if (total + n > ring_cap || (e.device == device && w < n)) break;
        total += n;
        if (e.device == device) {
            if (n == 2) {
                c->ev[--w] = e;
                c->ev[w].action = MSH_H_FREE_COMPLETED;
            }
            c->ev[--w] = e;
        }
        if (!cursor_step(&cur[best])) cur[best] = cur[--nc];
    }
    c->nev = evcap - w;
    memmove(c->ev, c->ev + w, c->nev * sizeof *c->ev);
    pthread_mutex_unlock(&hist_lock);
    struct msh_ticks_wall wall;
    msh_ticks_wall_init(&wall);
    /* Two CPUs' counters may disagree by tens of ns: times are kept from going back along the order */
    for (size_t i = 0; i < c->nev; i++) {
        c->ev[i].time_us = msh_ticks_wall_us(&wall, c->ev[i].time_us);
        if (i && c->ev[i].time_us < c->ev[i - 1].time_us) c->ev[i].time_us = c->ev[i - 1].time_us;
    }
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
    if (msh_resolve_path(tmpl, path, sizeof path)) return ENAMETOOLONG;
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
void msh_history_oom_event(int device)
{
    struct msh_pool *p = msh_core_pool_get(device);
    if (!p || atomic_load_explicit(&msh_history_on, memory_order_relaxed) != 2) return;
    struct msh_pool_oom o;
    msh_pool_last_oom(p, &o);
    put(MSH_H_OOM, device, o.device_free, o.requested, 0, 0);
}

int msh_history_oom_claim(void)
{
    static _Atomic int claimed;
    if (!msh_cfg.snapshot[0]) return -1;
    int i = atomic_fetch_add(&claimed, 1); /* the number this failure's file takes, whoever writes it */
    return i < OOM_SNAPSHOTS_MAX ? i : -1;
}

void msh_history_oom_write(int index)
{
    if (index < 0) return;
    char tag[32];
    snprintf(tag, sizeof tag, "-oom%04d", index);
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
