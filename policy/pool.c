/*
 * pool.c: the defragmenting pool (DESIGN.md 4, docs/pool.md).
 *
 * Virtual address space is plentiful and physical pages can be remapped, so fragmentation is a
 * physical-page problem. The pool keeps one long VA line per area (small requests and large
 * requests live in separate areas so a long-lived small block never pins a page in the middle of
 * large traffic), places blocks best-fit by (size, address) along it, and maps physical memory
 * only where a live block touches a page. Neighbours share pages, so the physical memory held
 * approaches the peak of live bytes. The interior of a large block gets one handle for the whole
 * run of pages it alone covers; pages a block shares (or may share) with a neighbour get a handle
 * of their own, so that they can be reclaimed one by one. A handle no live block touches stays
 * mapped as a cached handle; under pressure cached handles are unmapped (after their last use is
 * known complete: unmap is not stream-ordered) and their memory mapped where a new block needs
 * it. Training repeats the same step: once a step has been seen twice and remapped, the pool
 * places the next ones by a plan packed for that step, so that it fits in what is mapped.
 *
 * Driver work (create, map, access, unmap, release, events, synchronize) never runs under the
 * pool lock: a request claims its extent and pages under the lock ("in progress"), calls the
 * driver unlocked, and publishes the result under the lock again; a thread that needs a page
 * another thread is working on waits on a condition variable, never while holding a claim.
 *
 * It must never call a CUDA hook, never allocate with malloc (its memory comes from mmap), never
 * call the GC callback or the device while holding its lock, and never hand out a byte that a
 * live block or queued GPU work still uses.
 */
#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "hotclock.h" /* msh_lat_sample: which calls are timed */
#include "msh.h"

#define BLOCK_ALIGN 512 /* what PyTorch promises its callers */
#define MAX_SIZE ((uint64_t)1 << 48)
#define NO_PAGE UINT32_MAX
#define NO_EV UINT32_MAX
#define MAX_STREAMS 4
/* Pages per region: its page table (40 bytes a page, touched lazily) stays under 160 MiB of
 * address space and page indices fit 32 bits. 8 TiB of VA per region at 2 MiB pages. */
#define MAX_REGION_PAGES ((uint64_t)1 << 22)
#define NAREAS 2 /* 0: small requests, 1: large */

struct region;

/* B_PARKED: freed during a CUDA-graph capture while its free needs events (recorded once the
 * capture ends, docs/pool.md "Captures"); in no structure, its pages still touched. */
enum { B_FREE = 1, B_LIVE, B_PENDING, B_FREEING, B_PARKED };

/* claim_pages: the request needs a synchronize, an unmap or a release, which a capture in
 * progress on the device forbids; the caller places it where none is needed, or fails. */
#define ECAPTURE ECANCELED
enum { PG_MAPPED = 0, PG_MAPPING, PG_UNMAPPING };

/* A stream whose queued work may touch an extent: the pool's sequence number when that work was
 * last queued (the free), and the event recorded on the stream then (NO_EV: none; a reuse on the
 * same stream needs none, and a reuse elsewhere waits until some later event of that stream is
 * known complete). */
struct sref {
    uint64_t stream;
    uint64_t seq;
    uint64_t lo, hi; /* free extents: the bytes the tag is about (a merged extent holds clean
                      * bytes too, and the tags of each part) */
    uint32_t ev;
    uint32_t pad;
};

/* One extent of a region's VA line: live, free, or in a state between (pending: carved for an
 * allocation whose pages are being mapped; freeing: events being recorded for its free). Every
 * byte of a region belongs to exactly one block, kept in address order, so freeing coalesces
 * with neighbours in O(1). */
struct blk {
    uint64_t addr, size; /* size: VA bytes, a multiple of BLOCK_ALIGN */
    uint64_t req;        /* requested bytes while live */
    struct blk *prev, *next;
    struct region *reg;
    struct blk *kid[2][2]; /* the free treaps' children ([tree][0] left, [1] right): tree TS by
                            * (size, addr), TA by addr (the learned step places at given addresses) */
    struct blk *hnext;   /* live hash chain, or the spare list */
    struct sref s[MAX_STREAMS]; /* live: [0] alloc stream + recorded; free: last-use streams */
    uint64_t free_gen;   /* pool->free_gen when freed on a stream (work may still be queued) */
    uint64_t serial;     /* live: the allocation's number in the step log */
    uint64_t fstream;    /* parked: the stream of its free */
    uint64_t slo, shi;   /* free, sync_needed: the bytes that need the synchronize */
    uint32_t prio;
    uint8_t state, ns, sync_needed;
    uint8_t claimed;     /* pending: counted on its pages (a pending block waiting for another
                          * thread's pages has not claimed them yet) */
    uint32_t tag;        /* live: msh_pool_tags.next when it was placed (the caller's mark) */
};

/* One granularity-sized page of a region. A handle covers a run of pages; its first page (the
 * head) holds the handle's fields, the others point at it. */
struct page {
    uint64_t handle;       /* head: the driver's handle (0 while it is being created) */
    int32_t live;          /* live (or pending) blocks touching this page */
    uint32_t hd;           /* 1 + first page of the handle mapped here; 0: nothing mapped (so that
                            * a fresh, zero-filled page table needs no initialisation) */
    uint32_t npages;       /* head: pages the handle covers */
    uint32_t nlive;        /* head: its pages with live > 0 */
    uint32_t cprev, cnext; /* head: cached-handle list (mapped, nlive == 0), oldest first */
    uint32_t ctime;        /* head: when it became cached (ms since the pool was created) */
    uint8_t state;         /* head: PG_MAPPED, or a driver call in progress */
    uint8_t plan;          /* PLAN_PAGE: inside the learned step's footprint; PLAN_LIST (head):
                            * kept on the region's second cached list, reclaimed last */
};
#define PLAN_PAGE 1
#define PLAN_LIST 2

/* The head page of the handle mapped at pg, or NO_PAGE (hd - 1 wraps to it). */
static inline uint32_t pg_head(const struct page *pg) { return pg->hd - 1u; }

struct region {
    uint64_t base, size;
    uint32_t npages, hi_page; /* hi_page: one past the highest page ever mapped */
    struct page *pages;
    uint32_t chead[2], ctail[2]; /* cached handles outside [0] and inside [1] the learned step */
    size_t ncached;              /* pages of cached handles */
    struct region *next;
    struct blk *first; /* the block at base: merging never removes it */
    int area;
};

/* A pooled event: created once, recorded at frees, shared by the extents split from one free. */
struct pev {
    uint64_t h;       /* device event; 0 until created */
    uint64_t stream;  /* where it was last recorded */
    uint64_t seq;     /* pool->evseq at that record: it covers the work queued there before it */
    uint64_t home;    /* the context it was created in (0: the device's own; a stream of another
                       * device needs an event of its own context, device.h stream_home) */
    uint32_t refs;    /* extents, known streams (their latest event) and in-flight waits holding it */
    uint32_t next;    /* free list */
    uint8_t state;    /* EV_IDLE, EV_RECORDED, EV_DONE (seen complete by a query) */
};
enum { EV_IDLE = 0, EV_RECORDED, EV_DONE };

/* A stream the pool has seen, what it knows of its completed work, and whether another stream
 * wants its memory: then, for a while (the stream's next `window` frees, counted again at each
 * such want; the window doubles when the wants come back soon after it ran out, as they do for
 * two streams that trade memory every step, and at DEMAND_MAX it no longer runs out: a gap of
 * frees without events is memory the other stream cannot have, which makes the pool grow), each
 * of its frees records an
 * event, so that the other stream can take that memory after a wait on exactly the work queued
 * before the free (or none, once a query finds it complete). A stream nobody else wants memory of
 * records nothing, as in PyTorch's allocator. */
#define DEMAND_FREES 256
#define DEMAND_MAX 4096
#define MAX_KSTREAMS 32
struct kstream {
    uint64_t stream;
    uint64_t done;        /* all work queued on it before pool->evseq reached `done` has completed */
    uint64_t home;        /* its context (stream_home), once known */
    uint32_t demand;      /* frees left that record their own event (another stream wants them) */
    uint32_t window;      /* what a want sets demand to (DEMAND_FREES .. DEMAND_MAX) */
    uint64_t frees, ran_out; /* its frees so far; their count when demand last reached 0 */
    uint32_t latest;      /* the latest event recorded on it (a reference), or NO_EV: a tag of it
                           * without an event, numbered before, may wait on this one */
    uint8_t used, home_known;
};

struct step;

struct msh_pool {
    pthread_mutex_t lock;
    pthread_cond_t cv;    /* a mapping or unmapping another thread waits for was published */
    struct msh_device *dev;
    struct msh_pool_params prm;
    size_t gran, limit, device_total;
    uint32_t limit_pages, max_handle_pages, chunk_pages;
    struct region *areas[NAREAS];
    struct blk *tree[NAREAS], *atree[NAREAS];
    struct blk **htab;
    size_t hcap, hcount;
    struct blk *spare;
    size_t held;          /* pages of handles held, or being created (the budget against the limit) */
    /* Bytes the driver actually holds for this pool (created, not yet released; a handle whose
     * release failed stays counted) and their peaks: the reserved peaks of the reports follow the
     * driver, never a reservation whose create then failed. Atomics: the driver calls run
     * without the lock. */
    size_t drv_held, drv_peak_epoch, drv_peak_run;
    size_t nhandles, touched, cached;
    int jobs;             /* requests doing driver work right now (without the lock) */
    int waiters;
    uint64_t free_gen, synced_gen; /* frees with queued work; all of those up to synced_gen are done */
    bool driver_oom;      /* the driver itself refused a create since the last empty-cache */
    uint64_t pressure_reclaims; /* cached handles taken back because the pool was at its cap */
    struct kstream ks[MAX_KSTREAMS];
    uint32_t ks_last;     /* the last slot found (most calls name the same stream) */
    uint32_t poll_tick;   /* allocations since recorded events were last polled */
    struct blk *parked;   /* frees a capture deferred (hnext chain) */
    uint32_t nrecorded;   /* event slots recorded and not yet seen complete */
    uint32_t poll_cursor; /* where the next poll of recorded events starts */
    bool poll_soon;       /* an event was recorded for a waiting stream: poll at the next allocation */
    bool empty_deferred;  /* an empty-cache a capture deferred */
    /* The regions' address ranges, readable without the lock (msh_pool_covers_fast): written
     * once each, before nvr is raised with a release store. */
    struct { uint64_t base, end; } vr[16];
    int nvr;
    struct { uint64_t h; uint32_t pages; } orphans[64]; /* unmapped handles whose release failed */
    int norphans;
    struct pev *evs;
    uint32_t nevs, capevs, evfree;
    uint64_t evseq;
    uint32_t rng;
    bool timing;
    uint64_t t0_ns;
    msh_pool_gc_fn gc_fn;
    void *gc_arg;
    struct step *step;    /* the step log and learned plan (NULL: learning off) */
    struct msh_pool_stats st;
    struct msh_pool_oom oom;
};

/* ---- device calls, counted by kind (drvcost.h) ------------------------------------------------
 * Called without the pool lock, from any thread: the counters are atomic. */

const char *const msh_drv_call_names[MSH_DRV_NKINDS] = {
#define MSH_DRV_NAME_(e, s) s,
    MSH_DRV_CALLS(MSH_DRV_NAME_)
#undef MSH_DRV_NAME_
};

static inline void drv_count(struct msh_pool *pool, enum msh_drv_call k, uint64_t bytes)
{
    __atomic_fetch_add(&pool->st.drv_calls[k], 1, __ATOMIC_RELAXED);
    if (bytes) __atomic_fetch_add(&pool->st.drv_bytes[k], bytes, __ATOMIC_RELAXED);
}

static void peak_raise(size_t *peak, size_t v)
{
    size_t old = __atomic_load_n(peak, __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(peak, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static int dev_create(struct msh_pool *pool, size_t size, uint64_t *h)
{
    drv_count(pool, MSH_DRV_CREATE, size);
    int rc = pool->dev->ops->create(pool->dev, size, h);
    if (rc == 0) {
        size_t now = __atomic_add_fetch(&pool->drv_held, size, __ATOMIC_RELAXED);
        peak_raise(&pool->drv_peak_epoch, now);
        peak_raise(&pool->drv_peak_run, now);
    }
    return rc;
}

static int dev_release(struct msh_pool *pool, uint64_t h, size_t size)
{
    drv_count(pool, MSH_DRV_RELEASE, size);
    int rc = pool->dev->ops->release(pool->dev, h, size);
    if (rc == 0) __atomic_fetch_sub(&pool->drv_held, size, __ATOMIC_RELAXED);
    return rc;
}

static int dev_map(struct msh_pool *pool, uint64_t va, size_t size, uint64_t h)
{
    drv_count(pool, MSH_DRV_MAP, size);
    return pool->dev->ops->map(pool->dev, va, size, h);
}

static int dev_set_access(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_SET_ACCESS, size);
    return pool->dev->ops->set_access(pool->dev, va, size);
}

static int dev_unmap(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_UNMAP, size);
    return pool->dev->ops->unmap(pool->dev, va, size);
}

static int dev_synchronize(struct msh_pool *pool)
{
    drv_count(pool, MSH_DRV_SYNCHRONIZE, 0);
    return pool->dev->ops->synchronize(pool->dev);
}

static int dev_event_record(struct msh_pool *pool, uint64_t ev, uint64_t stream)
{
    drv_count(pool, MSH_DRV_EVENT_RECORD, 0);
    return pool->dev->ops->event_record(pool->dev, ev, stream);
}

static int dev_stream_wait(struct msh_pool *pool, uint64_t stream, uint64_t ev)
{
    drv_count(pool, MSH_DRV_STREAM_WAIT, 0);
    return pool->dev->ops->stream_wait(pool->dev, stream, ev);
}

static int dev_reserve(struct msh_pool *pool, size_t size, uint64_t *va)
{
    drv_count(pool, MSH_DRV_RESERVE, size);
    return pool->dev->ops->reserve(pool->dev, size, pool->gran, va);
}

static int dev_unreserve(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_UNRESERVE, size);
    return pool->dev->ops->unreserve(pool->dev, va, size);
}

/* ---- memory for the pool's own structures (mmap, never malloc) ------------------------------ */

static void *raw_alloc(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void raw_free(void *p, size_t bytes)
{
    if (p) munmap(p, bytes);
}

/* Grow an array kept in raw memory (or in `inl`, its first storage) to hold one more element. */
static bool arr_grow(void **v, uint32_t *cap, size_t elem, const void *inl)
{
    uint32_t ncap = *cap ? *cap * 2 : 64;
    void *n = raw_alloc((size_t)ncap * elem);
    if (!n) return false;
    if (*cap) memcpy(n, *v, (size_t)*cap * elem);
    if (*v && *v != inl) raw_free(*v, (size_t)*cap * elem);
    *v = n;
    *cap = ncap;
    return true;
}

#define SLAB_BYTES (256 * 1024)
static struct blk *blk_new(struct msh_pool *pool)
{
    if (!pool->spare) {
        struct blk *slab = raw_alloc(SLAB_BYTES);
        if (!slab) return NULL;
        size_t n = SLAB_BYTES / sizeof *slab;
        /* Slabs live until the process ends (a pool is per device and per process). */
        for (size_t i = 0; i < n; i++) {
            slab[i].hnext = pool->spare;
            pool->spare = &slab[i];
        }
    }
    struct blk *b = pool->spare;
    pool->spare = b->hnext;
    memset(b, 0, sizeof *b);
    pool->rng = pool->rng * 1103515245u + 12345u;
    b->prio = pool->rng ^ (pool->rng >> 16);
    return b;
}

static void blk_put(struct msh_pool *pool, struct blk *b)
{
    b->hnext = pool->spare;
    pool->spare = b;
}

/* ---- free treaps: by (size, addr), where best fit is a lower bound; and by addr ---------------- */

static inline bool key_less(const struct blk *a, const struct blk *b)
{
    return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

/* Two treaps over the same free blocks share one implementation: `tt` names the tree (its
 * children kid[tt]) and its order. */
enum { TS = 0, TA = 1 };

static inline bool tkey_less(int tt, const struct blk *a, const struct blk *b)
{
    return tt == TS ? key_less(a, b) : a->addr < b->addr;
}

static void treap_split(int tt, struct blk *t, const struct blk *key, struct blk **l, struct blk **r)
{
    if (!t) {
        *l = *r = NULL;
    } else if (tkey_less(tt, t, key)) {
        treap_split(tt, t->kid[tt][1], key, &t->kid[tt][1], r);
        *l = t;
    } else {
        treap_split(tt, t->kid[tt][0], key, l, &t->kid[tt][0]);
        *r = t;
    }
}

static struct blk *treap_merge(int tt, struct blk *a, struct blk *b)
{
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->kid[tt][1] = treap_merge(tt, a->kid[tt][1], b);
        return a;
    }
    b->kid[tt][0] = treap_merge(tt, a, b->kid[tt][0]);
    return b;
}

static void treap_insert(int tt, struct blk **root, struct blk *n)
{
    n->kid[tt][0] = n->kid[tt][1] = NULL;
    struct blk **t = root;
    while (*t && (*t)->prio >= n->prio) t = &(*t)->kid[tt][!tkey_less(tt, n, *t)];
    treap_split(tt, *t, n, &n->kid[tt][0], &n->kid[tt][1]);
    *t = n;
}

static void treap_remove(int tt, struct blk **root, struct blk *n)
{
    struct blk **t = root;
    while (*t && *t != n) t = &(*t)->kid[tt][!tkey_less(tt, n, *t)];
    if (*t) *t = treap_merge(tt, n->kid[tt][0], n->kid[tt][1]);
    n->kid[tt][0] = n->kid[tt][1] = NULL;
}

/* The free block with the highest address <= addr, or NULL. */
static struct blk *atreap_floor(struct blk *t, uint64_t addr)
{
    struct blk *best = NULL;
    while (t) {
        if (t->addr <= addr) {
            best = t;
            t = t->kid[TA][1];
        } else {
            t = t->kid[TA][0];
        }
    }
    return best;
}

static void free_insert(struct msh_pool *pool, struct blk *b)
{
    treap_insert(TS, &pool->tree[b->reg->area], b);
    treap_insert(TA, &pool->atree[b->reg->area], b);
}

static void free_remove(struct msh_pool *pool, struct blk *b)
{
    treap_remove(TS, &pool->tree[b->reg->area], b);
    treap_remove(TA, &pool->atree[b->reg->area], b);
}

/* ---- live-block hash (address -> block) ------------------------------------------------------ */

static inline size_t hash_addr(uint64_t a, size_t cap)
{
    return (size_t)(((a >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
}

static int hash_grow(struct msh_pool *pool)
{
    size_t ncap = pool->hcap ? pool->hcap * 2 : 4096;
    struct blk **nt = raw_alloc(ncap * sizeof *nt);
    if (!nt) return ENOMEM;
    for (size_t i = 0; i < pool->hcap; i++) {
        struct blk *b = pool->htab[i];
        while (b) {
            struct blk *nx = b->hnext;
            size_t h = hash_addr(b->addr, ncap);
            b->hnext = nt[h];
            nt[h] = b;
            b = nx;
        }
    }
    raw_free(pool->htab, pool->hcap * sizeof *pool->htab);
    pool->htab = nt;
    pool->hcap = ncap;
    return 0;
}

static struct blk *hash_find(struct msh_pool *pool, uint64_t addr)
{
    if (!pool->hcap) return NULL;
    for (struct blk *b = pool->htab[hash_addr(addr, pool->hcap)]; b; b = b->hnext)
        if (b->addr == addr) return b;
    return NULL;
}

static void hash_insert(struct msh_pool *pool, struct blk *b)
{
    size_t h = hash_addr(b->addr, pool->hcap);
    b->hnext = pool->htab[h];
    pool->htab[h] = b;
    pool->hcount++;
}

static struct blk *hash_remove(struct msh_pool *pool, uint64_t addr)
{
    if (!pool->hcap) return NULL;
    struct blk **pp = &pool->htab[hash_addr(addr, pool->hcap)];
    for (; *pp; pp = &(*pp)->hnext) {
        if ((*pp)->addr == addr) {
            struct blk *b = *pp;
            *pp = b->hnext;
            b->hnext = NULL;
            pool->hcount--;
            return b;
        }
    }
    return NULL;
}

/* ---- cached handles (mapped, touched by no live block), oldest first ---------------------------
 * Two lists per region: handles inside the learned step's footprint (page.plan) are reclaimed
 * last, so that a step that fits keeps its pages mapped. */

static inline uint32_t now_ms(const struct msh_pool *pool)
{
    return (uint32_t)((msh_now_ns() - pool->t0_ns) / 1000000u);
}

static void cache_add(struct msh_pool *pool, struct region *r, uint32_t h)
{
    struct page *pg = &r->pages[h];
    /* which list: whether the learned step uses any of its pages now */
    uint8_t in = 0;
    for (uint32_t q = h; q < h + pg->npages && !in; q++) in = r->pages[q].plan & PLAN_PAGE;
    pg->plan = (uint8_t)((pg->plan & PLAN_PAGE) | (in ? PLAN_LIST : 0));
    int l = in != 0;
    pg->cnext = NO_PAGE;
    pg->cprev = r->ctail[l];
    if (r->ctail[l] != NO_PAGE) r->pages[r->ctail[l]].cnext = h;
    else r->chead[l] = h;
    r->ctail[l] = h;
    r->ncached += pg->npages;
    pool->cached += pg->npages;
    pg->ctime = pool->prm.release_threshold ? now_ms(pool) : 0;
}

static void cache_remove(struct msh_pool *pool, struct region *r, uint32_t h)
{
    struct page *pg = &r->pages[h];
    int l = (pg->plan & PLAN_LIST) != 0;
    if (pg->cprev != NO_PAGE) r->pages[pg->cprev].cnext = pg->cnext;
    else r->chead[l] = pg->cnext;
    if (pg->cnext != NO_PAGE) r->pages[pg->cnext].cprev = pg->cprev;
    else r->ctail[l] = pg->cprev;
    pg->cprev = pg->cnext = NO_PAGE;
    r->ncached -= pg->npages;
    pool->cached -= pg->npages;
}

/* A live (or pending) block starts or stops touching page p. The handle mapped there leaves or
 * joins the cached list when the first of its pages is touched or the last one left. */
static void page_touch(struct msh_pool *pool, struct region *r, uint32_t p)
{
    struct page *pg = &r->pages[p];
    if (pg->live++ != 0) return;
    pool->touched++;
    uint32_t hp = pg_head(pg);
    if (hp == NO_PAGE) return;
    struct page *h = &r->pages[hp];
    if (h->nlive++ == 0 && h->state == PG_MAPPED) cache_remove(pool, r, hp);
}

static void page_untouch(struct msh_pool *pool, struct region *r, uint32_t p)
{
    struct page *pg = &r->pages[p];
    if (--pg->live != 0) return;
    pool->touched--;
    uint32_t hp = pg_head(pg);
    if (hp == NO_PAGE) return;
    struct page *h = &r->pages[hp];
    if (--h->nlive == 0 && h->state == PG_MAPPED) cache_add(pool, r, hp);
}

static void page_range(const struct msh_pool *pool, const struct blk *b, uint32_t *p0, uint32_t *p1)
{
    *p0 = (uint32_t)((b->addr - b->reg->base) / pool->gran);
    *p1 = (uint32_t)((b->addr + b->size - 1 - b->reg->base) / pool->gran);
}

static void block_untouch(struct msh_pool *pool, struct blk *b)
{
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    for (uint32_t p = p0; p <= p1; p++) page_untouch(pool, b->reg, p);
}

static inline uint64_t page_va(const struct msh_pool *pool, const struct region *r, uint32_t p)
{
    return r->base + (uint64_t)p * pool->gran;
}

/* ---- pooled events ------------------------------------------------------------------------------ */

/* A slot with one reference for an event of context `home`, or NO_EV when the table cannot grow.
 * Its event may not exist yet (h == 0): whoever records it creates it first, without the lock.
 * Slots keep their event when released, for the next record in the same context. */
static uint32_t ev_get(struct msh_pool *pool, uint64_t home)
{
    uint32_t *pp = &pool->evfree;
    for (int scan = 0; *pp != NO_EV && scan < 8; scan++, pp = &pool->evs[*pp].next)
        if (pool->evs[*pp].home == home || !pool->evs[*pp].h) break;
    if (*pp == NO_EV || (pool->evs[*pp].home != home && pool->evs[*pp].h)) {
        if (pool->nevs == pool->capevs) {
            void *v = pool->evs;
            if (!arr_grow(&v, &pool->capevs, sizeof *pool->evs, NULL)) return NO_EV;
            pool->evs = v;
        }
        pool->evs[pool->nevs] = (struct pev){.next = pool->evfree, .home = home};
        pool->evfree = pool->nevs++;
        pp = &pool->evfree;
    }
    uint32_t i = *pp;
    *pp = pool->evs[i].next;
    pool->evs[i].refs = 1;
    pool->evs[i].next = NO_EV;
    pool->evs[i].home = home; /* a slot without an event takes the context it is asked for */
    pool->evs[i].state = EV_IDLE;
    return i;
}

static void ev_put(struct msh_pool *pool, uint32_t i)
{
    if (i == NO_EV) return;
    if (--pool->evs[i].refs) return;
    if (pool->evs[i].state == EV_RECORDED) pool->nrecorded--;
    pool->evs[i].state = EV_IDLE;
    pool->evs[i].next = pool->evfree;
    pool->evfree = i;
}

static inline void ev_ref(struct msh_pool *pool, uint32_t i)
{
    if (i != NO_EV) pool->evs[i].refs++;
}

/* Destroy an event (without the lock). A destroy the driver refused is tried once more, so that
 * one failed call does not leak the event (docs/reliability.md). */
static void ev_destroy(struct msh_pool *pool, uint64_t h)
{
    if (pool->dev->ops->event_release(pool->dev, h)) pool->dev->ops->event_release(pool->dev, h);
}

static int dev_event_create(struct msh_pool *pool, uint64_t home, uint64_t *h)
{
    if (home && pool->dev->ops->event_create_on) return pool->dev->ops->event_create_on(pool->dev, home, h);
    return pool->dev->ops->event_create(pool->dev, h);
}

/* 0: complete; EBUSY: not yet; other: cannot tell. */
static int dev_event_query(struct msh_pool *pool, uint64_t h)
{
    __atomic_fetch_add(&pool->st.event_queries, 1, __ATOMIC_RELAXED);
    return pool->dev->ops->event_query(pool->dev, h);
}

/* ---- known streams ------------------------------------------------------------------------------ */

static inline bool capturing(const struct msh_pool *pool)
{
    return pool->prm.capturing && __atomic_load_n(pool->prm.capturing, __ATOMIC_ACQUIRE) > 0;
}

static struct kstream *ks_find(struct msh_pool *pool, uint64_t stream)
{
    if (stream == MSH_STREAM_COMPLETED) return NULL;
    struct kstream *k = &pool->ks[pool->ks_last];
    if (k->used && k->stream == stream) return k;
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++)
        if (pool->ks[i].used && pool->ks[i].stream == stream) {
            pool->ks_last = i;
            return &pool->ks[i];
        }
    return NULL;
}

/* The stream's entry, made when first seen. NULL when the table is full: tags naming such a
 * stream are never known complete before a synchronize (correct, only slower). */
static struct kstream *ks_get(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = ks_find(pool, stream);
    if (k || stream == MSH_STREAM_COMPLETED) return k;
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++)
        if (!pool->ks[i].used) {
            pool->ks[i] = (struct kstream){.stream = stream, .latest = NO_EV, .used = 1};
            pool->ks_last = i;
            return &pool->ks[i];
        }
    return NULL;
}

/* An event seen complete: the work queued on its stream before it is done, which covers every
 * tag of that stream numbered before the record. */
static void ev_done(struct msh_pool *pool, uint32_t e)
{
    struct pev *ev = &pool->evs[e];
    if (ev->state != EV_RECORDED) return;
    ev->state = EV_DONE;
    pool->nrecorded--;
    struct kstream *k = ks_find(pool, ev->stream);
    if (k && ev->seq > k->done) k->done = ev->seq;
}

/* The contexts of streams not yet known, resolved without the lock (device.h stream_home; most
 * backends have none: everything is the device's own). Called with the lock held; may drop it. */
static void ks_resolve_homes(struct msh_pool *pool, const uint64_t *streams, int n)
{
    if (!pool->dev->ops->stream_home) return;
    uint64_t want[MAX_STREAMS + 1], home[MAX_STREAMS + 1];
    int nw = 0;
    for (int i = 0; i < n; i++) {
        struct kstream *k = ks_get(pool, streams[i]);
        if (k && !k->home_known) want[nw++] = streams[i];
    }
    if (!nw) return;
    pool->jobs++; /* a check sees this thread's pending work as in flight */
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < nw; i++)
        if (pool->dev->ops->stream_home(pool->dev, want[i], &home[i])) home[i] = 0;
    pthread_mutex_lock(&pool->lock);
    pool->jobs--;
    for (int i = 0; i < nw; i++) {
        struct kstream *k = ks_find(pool, want[i]);
        if (k && !k->home_known) {
            k->home = home[i];
            k->home_known = 1;
        }
    }
}

static uint64_t ks_home(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = ks_find(pool, stream);
    return k ? k->home : 0;
}

/* ---- stream tags of extents ------------------------------------------------------------------- */

/* The work a tag names is known complete: its event was seen complete, or a later event of its
 * stream was. */
static bool tag_done(struct msh_pool *pool, const struct sref *t)
{
    if (t->ev != NO_EV && pool->evs[t->ev].state == EV_DONE && pool->evs[t->ev].seq > t->seq) return true;
    const struct kstream *k = ks_find(pool, t->stream);
    return k && t->seq < k->done;
}

/* No queued work can touch the extent: none was recorded, a synchronize covered its free, or
 * every tag is known complete. */
static bool blk_clean(struct msh_pool *pool, const struct blk *b)
{
    if (!b->ns && !b->sync_needed) return true;
    if (b->free_gen && b->free_gen <= pool->synced_gen) return true;
    if (b->sync_needed) return false;
    for (int i = 0; i < b->ns; i++)
        if (!tag_done(pool, &b->s[i])) return false;
    return true;
}

static void sref_clear(struct msh_pool *pool, struct blk *b)
{
    for (int i = 0; i < b->ns; i++) ev_put(pool, b->s[i].ev);
    b->ns = 0;
    b->sync_needed = 0;
    b->free_gen = 0;
    b->slo = b->shi = 0;
}

static inline bool blk_tagged(const struct blk *b)
{
    return b->ns || b->sync_needed;
}

static inline bool range_meets(uint64_t alo, uint64_t ahi, uint64_t blo, uint64_t bhi)
{
    return alo < bhi && blo < ahi;
}

/* Drop the tags known complete (their event references too). */
static void sref_prune(struct msh_pool *pool, struct blk *b)
{
    if (!blk_tagged(b)) return;
    if (b->free_gen && b->free_gen <= pool->synced_gen) {
        sref_clear(pool, b);
        return;
    }
    int k = 0;
    for (int i = 0; i < b->ns; i++) {
        if (tag_done(pool, &b->s[i])) ev_put(pool, b->s[i].ev);
        else b->s[k++] = b->s[i];
    }
    b->ns = (uint8_t)k;
    if (!blk_tagged(b)) b->free_gen = 0;
}

/* Add a tag to b, taking over the reference on its event. One tag per stream: the bytes of both,
 * the later free's number, and an event only if it was recorded after both (an earlier event does
 * not cover the later work). A fifth stream makes the extent need a synchronize before reuse
 * elsewhere (over the tag's bytes). */
static void sref_add(struct msh_pool *pool, struct blk *b, const struct sref *n)
{
    for (int i = 0; i < b->ns; i++) {
        struct sref *t = &b->s[i];
        if (t->stream != n->stream) continue;
        uint64_t top = n->seq > t->seq ? n->seq : t->seq;
        uint32_t keep = NO_EV;
        uint32_t cand[2] = {t->ev, n->ev};
        for (int c = 0; c < 2; c++) /* the earliest event that covers both: the least waiting */
            if (cand[c] != NO_EV && pool->evs[cand[c]].seq > top &&
                (keep == NO_EV || pool->evs[cand[c]].seq < pool->evs[keep].seq))
                keep = cand[c];
        for (int c = 0; c < 2; c++)
            if (cand[c] != keep) ev_put(pool, cand[c]);
        if (keep != NO_EV && keep == t->ev && keep == n->ev) ev_put(pool, n->ev); /* the same slot twice */
        t->ev = keep;
        t->seq = top;
        if (n->lo < t->lo) t->lo = n->lo;
        if (n->hi > t->hi) t->hi = n->hi;
        return;
    }
    if (b->ns < MAX_STREAMS) {
        b->s[b->ns++] = *n;
        return;
    }
    ev_put(pool, n->ev);
    if (!b->sync_needed) {
        b->slo = n->lo;
        b->shi = n->hi;
    }
    if (n->lo < b->slo) b->slo = n->lo;
    if (n->hi > b->shi) b->shi = n->hi;
    b->sync_needed = 1; /* too many streams to track: synchronize before reuse elsewhere */
}

/* Free neighbours always merge (the pool's capacity depends on it), and their tags stay exact:
 * each tag keeps the bytes it is about, so a piece carved from the merged extent carries only the
 * tags of its own bytes. (Two frees of one stream with other bytes between them are one tag over
 * both: the bytes between wait for that stream too, the only imprecision.) */
static void streams_merge(struct msh_pool *pool, struct blk *into, struct blk *from)
{
    sref_prune(pool, into);
    sref_prune(pool, from);
    for (int i = 0; i < from->ns; i++) sref_add(pool, into, &from->s[i]);
    from->ns = 0;
    if (from->sync_needed) {
        if (!into->sync_needed || from->slo < into->slo) into->slo = from->slo;
        if (!into->sync_needed || from->shi > into->shi) into->shi = from->shi;
        into->sync_needed = 1;
    }
    if (from->free_gen > into->free_gen) into->free_gen = from->free_gen;
    if (!blk_tagged(into)) into->free_gen = 0;
}

/* Copy of b's tags onto a piece split from it (one more reference on each event). */
static void streams_copy(struct msh_pool *pool, struct blk *to, const struct blk *from)
{
    memcpy(to->s, from->s, sizeof to->s);
    to->ns = from->ns;
    to->sync_needed = from->sync_needed;
    to->slo = from->slo;
    to->shi = from->shi;
    to->free_gen = from->free_gen;
    for (int i = 0; i < to->ns; i++) ev_ref(pool, to->s[i].ev);
}

/* b's extent changed (a piece of a carved one): it keeps only the tags about its own bytes. */
static void streams_clip(struct msh_pool *pool, struct blk *b)
{
    if (!blk_tagged(b)) return;
    uint64_t lo = b->addr, hi = b->addr + b->size;
    int k = 0;
    for (int i = 0; i < b->ns; i++) {
        struct sref *t = &b->s[i];
        if (!range_meets(t->lo, t->hi, lo, hi)) {
            ev_put(pool, t->ev);
            continue;
        }
        if (t->lo < lo) t->lo = lo;
        if (t->hi > hi) t->hi = hi;
        b->s[k++] = *t;
    }
    b->ns = (uint8_t)k;
    if (b->sync_needed && !range_meets(b->slo, b->shi, lo, hi)) b->sync_needed = 0;
    if (b->sync_needed) {
        if (b->slo < lo) b->slo = lo;
        if (b->shi > hi) b->shi = hi;
    }
    if (!blk_tagged(b)) b->free_gen = 0;
}

/* The event a reuse elsewhere waits on for tag t: its own, or else the latest event recorded on
 * its stream after it (an event of another block's free): that one also covers
 * some work queued after the free, but never more than up to its own record. NO_EV: none. */
static uint32_t tag_event(struct msh_pool *pool, const struct sref *t)
{
    if (t->ev != NO_EV) return t->ev;
    const struct kstream *k = ks_find(pool, t->stream);
    if (k && k->latest != NO_EV && pool->evs[k->latest].seq > t->seq) return k->latest;
    return NO_EV;
}

/* How a free extent can serve an allocation on `stream`: at once (clean, or its work is all on
 * that stream), after stream waits on recorded events (no host blocking), or only after a
 * synchronize (a tag without an event that is not known complete, too many streams, or a
 * host-synchronous caller). *blocked: a stream whose missing event made it FIT_SYNC. */
enum { FIT_READY = 0, FIT_WAIT, FIT_SYNC };
static int fit_kind(struct msh_pool *pool, const struct blk *b, uint64_t lo, uint64_t hi, uint64_t stream,
                    uint64_t *blocked)
{
    if (!blk_tagged(b) || (b->free_gen && b->free_gen <= pool->synced_gen)) return FIT_READY;
    if (b->sync_needed && range_meets(b->slo, b->shi, lo, hi)) return FIT_SYNC;
    int k = FIT_READY;
    for (int i = 0; i < b->ns; i++) {
        const struct sref *t = &b->s[i];
        if (!range_meets(t->lo, t->hi, lo, hi) || tag_done(pool, t)) continue;
        if (stream == MSH_STREAM_COMPLETED) return FIT_SYNC; /* a host user: all of it must be done */
        if (t->stream == stream) continue;
        if (tag_event(pool, t) == NO_EV) {
            if (blocked) *blocked = t->stream;
            return FIT_SYNC;
        }
        k = FIT_WAIT;
    }
    return k;
}

/* The bytes of b that keep `stream` waiting (tags of other streams not known complete, and what
 * needs a synchronize): false when there are none. */
static bool blocking_span(struct msh_pool *pool, const struct blk *b, uint64_t stream, uint64_t *lo, uint64_t *hi)
{
    bool any = false;
    if (b->free_gen && b->free_gen <= pool->synced_gen) return false;
    if (b->sync_needed) {
        *lo = b->slo;
        *hi = b->shi;
        any = true;
    }
    for (int i = 0; i < b->ns; i++) {
        const struct sref *t = &b->s[i];
        if ((t->stream == stream && stream != MSH_STREAM_COMPLETED) || tag_done(pool, t)) continue;
        if (!any || t->lo < *lo) *lo = t->lo;
        if (!any || t->hi > *hi) *hi = t->hi;
        any = true;
    }
    return any;
}

/* Another stream wanted memory last used on `stream` and could not have it without a synchronize
 * (its free recorded no event): from now on, for DEMAND_FREES of its frees, each records an event.
 * The first of them also covers the earlier frees of that stream (tag_event). Events are only
 * ever recorded at frees, never at reuse time. */
static void want_events(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = ks_find(pool, stream);
    if (!k) return;
    if (!k->window) k->window = DEMAND_FREES;
    if (!k->demand && k->ran_out && k->frees - k->ran_out < k->window && k->window < DEMAND_MAX) k->window *= 2;
    k->demand = k->window;
}

/* ---- driver work outside the lock: claim, run, publish ----------------------------------------
 * A job is what one request needs from the driver. Under the lock it claims pages (runs to map,
 * in state PG_MAPPING) and cached handles to take back (victims, PG_UNMAPPING) and copies the
 * events it will wait on; job_run() then calls the driver without the lock; job_publish() applies
 * the results under the lock and wakes threads waiting for those pages. Nobody waits while
 * holding a claim, so nobody waits forever. */

struct run {
    uint32_t p0, n;  /* pages [p0, p0 + n) of the job's region, one handle */
    uint64_t h;
    int32_t vic;     /* the victim whose handle it maps, or -1: a new handle */
    int rc;
    uint8_t fate;    /* on failure: RUN_NONE no handle, RUN_RELEASED, RUN_ORPHANED */
};
enum { RUN_NONE = 0, RUN_RELEASED, RUN_ORPHANED };

struct victim {
    struct region *r;
    uint32_t head, n;
    uint64_t h;
    int32_t run;     /* the run that maps its handle next, or -1: released */
    int rc, rel_rc;  /* unmap and release results */
    uint8_t kind;    /* V_RECLAIM (pressure), V_SPLIT (re-partitioned), V_RELEASE (empty-cache) */
};
enum { V_RECLAIM = 0, V_SPLIT, V_RELEASE };

struct ewait {
    uint64_t stream; /* the old stream */
    uint64_t h;      /* its event (recorded at the free), copied under the lock */
    uint32_t ev;     /* pooled slot (one reference held by the job) */
    uint8_t done;    /* a query found it complete: no wait was needed */
};

#define JOB_INL 8
struct job {
    struct region *r;
    struct run *runs;
    struct victim *vic;
    uint32_t nruns, capruns, nvic, capvic;
    uint32_t acc_p0, acc_p1;    /* grant access to these pages (when runs were mapped) */
    bool sync;                  /* synchronize first: unmapping pages freed on streams, or host use */
    bool host_sync;             /* the synchronize is for a host-synchronous user */
    bool driver_enomem;         /* the driver refused a create */
    uint64_t sync_gen;
    int sync_rc, wait_rc;
    uint64_t stream;            /* the allocation's stream (waits are enqueued on it) */
    struct ewait waits[MAX_STREAMS];
    int nwaits;
    /* what the driver work did, counted into the stats when the job is published: a plan that
     * fails (or falls back to a synchronize) must not count waits that never happened */
    int waits_done;
    bool foreign;               /* the extent was last used on another stream */
    struct { uint64_t h; uint32_t pages; int rc; } orph[64]; /* orphans to retry */
    int norph;
    struct run runs_inl[JOB_INL];
    struct victim vic_inl[JOB_INL];
};

static void job_init(struct job *j)
{
    memset(j, 0, offsetof(struct job, runs_inl));
    j->runs = j->runs_inl;
    j->vic = j->vic_inl;
    j->capruns = j->capvic = JOB_INL;
}

static void job_fini(struct msh_pool *pool, struct job *j)
{
    for (int i = 0; i < j->nwaits; i++) ev_put(pool, j->waits[i].ev);
    j->nwaits = 0;
    j->waits_done = 0;
    j->foreign = false;
    if (j->runs != j->runs_inl) raw_free(j->runs, (size_t)j->capruns * sizeof *j->runs);
    if (j->vic != j->vic_inl) raw_free(j->vic, (size_t)j->capvic * sizeof *j->vic);
    j->runs = j->runs_inl;
    j->vic = j->vic_inl;
    j->capruns = j->capvic = JOB_INL;
    j->nruns = j->nvic = 0;
}

static bool job_has_work(const struct job *j)
{
    return j->nruns || j->nvic || j->sync || j->nwaits || j->norph;
}

static bool job_add_run(struct job *j, uint32_t p0, uint32_t n)
{
    if (j->nruns == j->capruns) {
        void *v = j->runs;
        if (!arr_grow(&v, &j->capruns, sizeof *j->runs, j->runs_inl)) return false;
        j->runs = v;
    }
    j->runs[j->nruns++] = (struct run){.p0 = p0, .n = n, .vic = -1};
    return true;
}

static bool job_add_victim(struct job *j, struct region *r, uint32_t head, uint32_t n, uint64_t h)
{
    if (j->nvic == j->capvic) {
        void *v = j->vic;
        if (!arr_grow(&v, &j->capvic, sizeof *j->vic, j->vic_inl)) return false;
        j->vic = v;
    }
    j->vic[j->nvic++] = (struct victim){.r = r, .head = head, .n = n, .h = h, .run = -1};
    return true;
}

/* The limit in force: the pool's own, or the one it shares with other pools of the device
 * (struct msh_pool_share: PyTorch's capture pools beside the main pool, shim/torch.c). */
static size_t limit_now(const struct msh_pool *pool)
{
    if (!pool->prm.share) return pool->limit;
    return __atomic_load_n(&pool->prm.share->limit_bytes, __ATOMIC_RELAXED) / pool->gran * pool->gran;
}

/* The most pages of handles this pool may hold now (SIZE_MAX: no limit). Under a shared limit:
 * what it holds plus what the sharing pools leave free. */
static size_t cap_pages(const struct msh_pool *pool)
{
    size_t lim = limit_now(pool);
    if (!lim) return SIZE_MAX;
    if (!pool->prm.share) return pool->limit_pages;
    size_t used = __atomic_load_n(&pool->prm.share->handle_bytes, __ATOMIC_RELAXED);
    return pool->held + (lim > used ? (lim - used) / pool->gran : 0);
}

/* Pages of handles held change; a shared limit sees every change at once. */
static inline void held_add(struct msh_pool *pool, size_t pages)
{
    __atomic_fetch_add(&pool->held, pages, __ATOMIC_RELAXED);
    if (pool->prm.share) __atomic_fetch_add(&pool->prm.share->handle_bytes, pages * pool->gran, __ATOMIC_RELAXED);
}

static inline void held_sub(struct msh_pool *pool, size_t pages)
{
    __atomic_fetch_sub(&pool->held, pages, __ATOMIC_RELAXED);
    if (pool->prm.share) __atomic_fetch_sub(&pool->prm.share->handle_bytes, pages * pool->gran, __ATOMIC_RELAXED);
}

/* Reserve pages for new handles. Under a shared limit the reservation is claimed before anything
 * is created, so pools racing on other threads can never go over the limit together; false when
 * another pool took the room meanwhile (nothing reserved). */
static bool held_reserve(struct msh_pool *pool, size_t pages)
{
    struct msh_pool_share *sh = pool->prm.share;
    size_t lim = limit_now(pool);
    if (sh && lim && pages) {
        size_t bytes = pages * pool->gran;
        size_t prev = __atomic_fetch_add(&sh->handle_bytes, bytes, __ATOMIC_RELAXED);
        if (prev + bytes > lim) {
            __atomic_fetch_sub(&sh->handle_bytes, bytes, __ATOMIC_RELAXED);
            return false;
        }
        __atomic_fetch_add(&pool->held, pages, __ATOMIC_RELAXED);
        return true;
    }
    held_add(pool, pages);
    return true;
}

/* Unmapping is not stream-ordered: before a cached page is unmapped, every piece of work that
 * may still touch it must have finished. One device synchronize covers all of them. */
static void job_need_settle(struct msh_pool *pool, struct job *j)
{
    if (pool->free_gen > pool->synced_gen) {
        j->sync = true;
        j->sync_gen = pool->free_gen;
    }
}

/* Detach the cached handle at r's page h as a victim of job j. */
static bool take_victim(struct msh_pool *pool, struct job *j, struct region *r, uint32_t h, int kind)
{
    struct page *pg = &r->pages[h];
    if (!job_add_victim(j, r, h, pg->npages, pg->handle)) return false;
    j->vic[j->nvic - 1].kind = (uint8_t)kind;
    cache_remove(pool, r, h);
    pg->state = PG_UNMAPPING;
    job_need_settle(pool, j);
    return true;
}

/* The oldest cached handle: outside the learned step first, small area first (its pages are the
 * most likely to be scattered), or NULL. */
static struct region *oldest_cached(struct msh_pool *pool, uint32_t *h)
{
    for (int l = 0; l < 2; l++)
        for (int a = 0; a < NAREAS; a++)
            for (struct region *r = pool->areas[a]; r; r = r->next)
                if (r->chead[l] != NO_PAGE) {
                    *h = r->chead[l];
                    return r;
                }
    return NULL;
}

static bool handle_planned(const struct region *r, uint32_t h)
{
    for (uint32_t q = h; q < h + r->pages[h].npages; q++)
        if (!(r->pages[q].plan & PLAN_PAGE)) return false;
    return true;
}

struct step;
static bool step_want(const struct step *s, uint64_t addr);

/* Claim the pages block b touches: existing mappings are shared (a cached handle stops being
 * cached), missing pages become runs to map, one handle per run: a page b only partly covers
 * (which a neighbour may share) gets a handle of its own, the pages b covers whole one handle
 * together. A multi-page handle is therefore only ever touched by one block that covers all of
 * it; a cached one that b would cover only in part is split (unmapped, released, and b's part
 * mapped anew), so that no handle is ever partly in use and every page no block touches can be
 * reclaimed. Within `cap` pages of handles held; beyond it (defrag) cached handles are taken
 * back, oldest first, and a victim of the right size is mapped again instead of being released.
 * EAGAIN: another thread is mapping or unmapping one of these pages (nothing claimed); ENOMEM:
 * not enough memory even after reclaim (nothing claimed). */
static int claim_pages(struct msh_pool *pool, struct blk *b, struct job *j, size_t cap)
{
    struct region *r = b->reg;
    int err = ENOMEM;
    /* during a capture nothing may be unmapped (split or reclaimed): ECAPTURE instead */
    bool cap_now = capturing(pool);
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    for (uint32_t p = p0; p <= p1; p++) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h != NO_PAGE && r->pages[h].state != PG_MAPPED) return EAGAIN;
    }
    j->r = r;
    bool edge_lo = b->addr > page_va(pool, r, p0);
    bool edge_hi = b->addr + b->size < page_va(pool, r, p1) + pool->gran;
    int64_t q0 = (int64_t)p0 + edge_lo, q1 = (int64_t)p1 - edge_hi; /* pages b covers whole */
    /* Under a limit (or near the device's capacity) every page must stay reclaimable: split
     * handles b would cover in part. Far from any limit, handles may span several blocks (a
     * chunk mapped ahead at the open end of the line), which saves driver calls. */
    bool relaxed = !limit_now(pool) && !pool->driver_oom && pool->chunk_pages > 1 &&
                   (pool->held + (p1 - p0 + 1) + pool->chunk_pages) * pool->gran < pool->device_total / 4 * 3;
    uint32_t hi0 = r->hi_page;
    /* A block the learned step places may use part of a handle whose pages all belong to the
     * step: the step fits in what the pool may hold, so those pages need never be reclaimed,
     * and re-partitioning them would only cost driver calls. */
    bool planned = pool->step && step_want(pool->step, b->addr);
    for (uint32_t p = p0; p <= p1 && !relaxed;) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h == NO_PAGE) {
            p++;
            continue;
        }
        struct page *hp = &r->pages[h];
        uint32_t next = h + hp->npages;
        if (hp->npages > 1 && !((int64_t)h >= q0 && (int64_t)next - 1 <= q1) && !hp->nlive &&
            !(planned && handle_planned(r, h))) {
            if (cap_now) {
                err = ECAPTURE;
                goto fail;
            }
            if (!take_victim(pool, j, r, h, V_SPLIT)) goto fail;
            held_sub(pool, hp->npages);
        }
        p = next;
    }
    for (uint32_t p = p0; p <= p1; p++) page_touch(pool, r, p);
    b->claimed = 1;
    size_t need = 0;
    /* missing: unmapped, or in a handle this claim splits (the only ones unmapping here) */
#define MISSING_(q) (!r->pages[q].hd || r->pages[pg_head(&r->pages[q])].state == PG_UNMAPPING)
    for (uint32_t p = p0; p <= p1;) {
        if (!MISSING_(p)) {
            p++;
            continue;
        }
        uint32_t n = 1;
        if ((int64_t)p >= q0 && (int64_t)p <= q1)
            while ((int64_t)(p + n) <= q1 && MISSING_(p + n) && n < pool->max_handle_pages) n++;
        if (relaxed && p + n - 1 >= p1 - 1 && p + n >= hi0) {
            /* the run reaches the open end of the line: map up to the next chunk boundary, the
             * pages after b that the next blocks placed there will use */
            uint32_t end = p1 + 1;
            while (end % pool->chunk_pages && end < r->npages && end >= hi0) end++;
            if (end % pool->chunk_pages == 0 && end > p + n && end - p <= pool->max_handle_pages) n = end - p;
        }
        if (!job_add_run(j, p, n)) goto fail_touched;
        need += n;
        p += n;
    }
#undef MISSING_
    /* a split handle keeps its other pages mapped, as handles of their own (before and after b):
     * they stay cached, and the next time the same blocks come the handles fit them */
    for (uint32_t i = 0, nsplit = j->nvic; i < nsplit; i++) {
        const struct victim *v = &j->vic[i];
        if (v->head < p0) {
            if (!job_add_run(j, v->head, p0 - v->head)) goto fail_touched;
            need += p0 - v->head;
        }
        if (v->head + v->n - 1 > p1) {
            if (!job_add_run(j, p1 + 1, v->head + v->n - 1 - p1)) goto fail_touched;
            need += v->head + v->n - 1 - p1;
        }
    }
    if (!need) return 0;
    size_t avail = cap == SIZE_MAX ? SIZE_MAX : (cap > pool->held ? cap - pool->held : 0);
    if (avail < need) {
        if (!pool->prm.defrag || avail + pool->cached < need) goto fail_touched;
        if (cap_now) {
            err = ECAPTURE;
            goto fail_touched;
        }
        while (avail < need) {
            uint32_t h;
            struct region *vr = oldest_cached(pool, &h);
            if (!vr || !take_victim(pool, j, vr, h, V_RECLAIM)) goto fail_touched;
            struct victim *v = &j->vic[j->nvic - 1];
            /* Map the victim's handle again rather than release it and create another: it goes
             * to the smallest run it fits in, whose first pages it becomes (a run covers pages
             * that one block covers whole, or pages no block touches: any split of it is a valid
             * set of handles). */
            int best = -1;
            for (uint32_t i = 0; i < j->nruns; i++)
                if (j->runs[i].vic < 0 && j->runs[i].n >= v->n && (best < 0 || j->runs[i].n < j->runs[best].n))
                    best = (int)i;
            if (best >= 0 && j->runs[best].n > v->n) {
                if (!job_add_run(j, j->runs[best].p0 + v->n, j->runs[best].n - v->n)) goto fail_touched;
                j->runs[best].n = v->n;
                v = &j->vic[j->nvic - 1];
            }
            if (best >= 0) {
                j->runs[best].vic = (int32_t)(j->nvic - 1);
                v->run = best;
                need -= v->n;
            }
            if (v->run < 0) {
                avail += v->n;
                held_sub(pool, v->n);
            }
            pool->pressure_reclaims++;
        }
    }
    if (!held_reserve(pool, need)) goto fail_touched;
    for (uint32_t i = 0; i < j->nruns; i++) {
        struct run *ru = &j->runs[i];
        uint8_t plan = 0;
        for (uint32_t q = ru->p0; q < ru->p0 + ru->n; q++) {
            r->pages[q].hd = ru->p0 + 1;
            plan |= r->pages[q].plan & PLAN_PAGE;
        }
        struct page *hp = &r->pages[ru->p0];
        uint32_t nl = 0;
        for (uint32_t q = ru->p0; q < ru->p0 + ru->n; q++) nl += r->pages[q].live > 0;
        hp->npages = ru->n;
        hp->nlive = nl; /* all of them but the chunk mapped ahead */
        hp->state = PG_MAPPING;
        hp->handle = 0;
        hp->plan = (uint8_t)((hp->plan & PLAN_PAGE) | (plan ? PLAN_LIST : 0));
        if (ru->p0 + ru->n > r->hi_page) r->hi_page = ru->p0 + ru->n;
    }
    j->acc_p0 = UINT32_MAX;
    j->acc_p1 = 0;
    for (uint32_t i = 0; i < j->nruns; i++) {
        if (j->runs[i].p0 < j->acc_p0) j->acc_p0 = j->runs[i].p0;
        if (j->runs[i].p0 + j->runs[i].n - 1 > j->acc_p1) j->acc_p1 = j->runs[i].p0 + j->runs[i].n - 1;
    }
    return 0;
fail_touched:
    for (uint32_t p = p0; p <= p1; p++) page_untouch(pool, r, p);
    b->claimed = 0;
fail:
    /* give the victims back (split ones and reclaimed ones), at the head of their lists as the
     * oldest they were */
    while (j->nvic) {
        struct victim *v = &j->vic[--j->nvic];
        struct page *pg = &v->r->pages[v->head];
        pg->state = PG_MAPPED;
        if (v->run < 0) held_add(pool, v->n);
        if (pg->nlive) continue;
        int l = (pg->plan & PLAN_LIST) != 0;
        pg->cprev = NO_PAGE;
        pg->cnext = v->r->chead[l];
        if (pg->cnext != NO_PAGE) v->r->pages[pg->cnext].cprev = v->head;
        else v->r->ctail[l] = v->head;
        v->r->chead[l] = v->head;
        v->r->ncached += pg->npages;
        pool->cached += pg->npages;
    }
    j->nruns = 0;
    j->sync = false;
    return err;
}

/* Cached handles to give back: oldest first, until at most max_keep pages stay cached; with
 * quiet_ms, only those cached at least that long. Orphans are retried too. */
static void claim_release(struct msh_pool *pool, struct job *j, size_t max_keep, uint32_t quiet_ms)
{
    uint32_t now = quiet_ms ? now_ms(pool) : 0;
    for (int l = 0; l < 2; l++)
        for (int a = 0; a < NAREAS; a++)
            for (struct region *r = pool->areas[a]; r; r = r->next)
                while (r->chead[l] != NO_PAGE && pool->cached > max_keep) {
                    uint32_t h = r->chead[l];
                    if (quiet_ms && now - r->pages[h].ctime < quiet_ms) break; /* the rest are younger */
                    if (!take_victim(pool, j, r, h, V_RELEASE)) return;
                    held_sub(pool, r->pages[h].npages);
                }
    for (int i = 0; i < pool->norphans; i++) {
        j->orph[j->norph].h = pool->orphans[i].h;
        j->orph[j->norph].pages = pool->orphans[i].pages;
        j->norph++;
    }
    pool->norphans = 0;
}

/* A run that was mapped cannot be used (access refused): unmap and release its handle. */
static void run_undo(struct msh_pool *pool, struct job *j, struct run *ru, int rc)
{
    size_t bytes = (size_t)ru->n * pool->gran;
    ru->rc = rc;
    if (dev_unmap(pool, page_va(pool, j->r, ru->p0), bytes)) {
        ru->fate = RUN_ORPHANED; /* cannot happen on a sane driver; keep it counted */
        return;
    }
    ru->fate = dev_release(pool, ru->h, bytes) ? RUN_ORPHANED : RUN_RELEASED;
}

/* The driver work, without the lock. Order matters: a synchronize before any unmap; unmaps and
 * releases before creates, so that the device never holds more than the limit; access once over
 * the whole span just mapped; stream waits last. */
static void job_run(struct msh_pool *pool, struct job *j)
{
    size_t gran = pool->gran;
    if (j->sync) {
        j->sync_rc = dev_synchronize(pool);
        if (j->sync_rc) {
            for (uint32_t i = 0; i < j->nvic; i++) j->vic[i].rc = j->sync_rc;
            for (uint32_t i = 0; i < j->nruns; i++) j->runs[i].rc = j->sync_rc;
            j->wait_rc = j->sync_rc;
            return;
        }
    }
    for (int i = 0; i < j->norph; i++) j->orph[i].rc = dev_release(pool, j->orph[i].h, (size_t)j->orph[i].pages * gran);
    for (uint32_t i = 0; i < j->nvic; i++) {
        struct victim *v = &j->vic[i];
        v->rc = dev_unmap(pool, page_va(pool, v->r, v->head), (size_t)v->n * gran);
        if (!v->rc && v->run < 0) v->rel_rc = dev_release(pool, v->h, (size_t)v->n * gran);
    }
    bool ok = true;
    for (uint32_t i = 0; i < j->nruns; i++) {
        struct run *ru = &j->runs[i];
        uint64_t h = 0;
        size_t bytes = (size_t)ru->n * gran;
        bool blocked = false; /* over a split handle that is still mapped */
        for (uint32_t k = 0; k < j->nvic && !blocked; k++)
            blocked = j->vic[k].rc && j->vic[k].r == j->r && j->vic[k].head < ru->p0 + ru->n &&
                      ru->p0 < j->vic[k].head + j->vic[k].n;
        if (blocked) {
            ru->rc = EIO;
            ok = false;
            continue;
        }
        if (ru->vic >= 0) {
            if (j->vic[ru->vic].rc) {
                ru->rc = EIO; /* its handle is still mapped where it was */
                ok = false;
                continue;
            }
            h = j->vic[ru->vic].h;
        } else {
            ru->rc = dev_create(pool, bytes, &h);
            if (ru->rc) {
                if (ru->rc == ENOMEM) j->driver_enomem = true;
                ok = false;
                continue;
            }
        }
        ru->rc = dev_map(pool, page_va(pool, j->r, ru->p0), bytes, h);
        if (ru->rc) {
            ok = false;
            ru->fate = dev_release(pool, h, bytes) ? RUN_ORPHANED : RUN_RELEASED;
            ru->h = h;
            continue;
        }
        ru->h = h;
    }
    /* Access: one call over the whole span (every page between the runs is mapped already).
     * When a run failed, each mapped run gets its own call: it stays mapped, as a cached handle,
     * and must be usable when a block takes it later. A run whose access cannot be granted is
     * unmapped and released. */
    if (j->nruns && ok) {
        int rc = dev_set_access(pool, page_va(pool, j->r, j->acc_p0), (size_t)(j->acc_p1 - j->acc_p0 + 1) * gran);
        for (uint32_t i = 0; rc && i < j->nruns; i++) run_undo(pool, j, &j->runs[i], rc);
        if (rc) ok = false;
    } else {
        for (uint32_t i = 0; i < j->nruns; i++) {
            struct run *ru = &j->runs[i];
            if (ru->rc) continue;
            int rc = dev_set_access(pool, page_va(pool, j->r, ru->p0), (size_t)ru->n * gran);
            if (rc) run_undo(pool, j, ru, rc);
        }
    }
    if (!ok || !j->nwaits) return;
    /* The new stream waits for the work queued on each old stream before the free (the event
     * recorded then), never for what was queued after it; an event already complete (PyTorch's
     * process_events queries them the same way) costs a query and no wait. */
    for (int i = 0; i < j->nwaits && !j->wait_rc; i++) {
        struct ewait *w = &j->waits[i];
        if (dev_event_query(pool, w->h) == 0) {
            w->done = 1;
            continue;
        }
        int rc = dev_stream_wait(pool, j->stream, w->h);
        if (!rc) {
            j->waits_done++;
            continue;
        }
        /* cannot order the streams: wait for everything instead */
        j->wait_rc = dev_synchronize(pool);
        j->sync = !j->wait_rc; /* sync_gen was set with the waits, under the lock */
        break;
    }
}

/* Apply a job's results under the lock. Returns 0, or the first error (ENOMEM when the driver
 * ran out). Every page claimed is left either mapped or unmapped, never in between. */
static int job_publish(struct msh_pool *pool, struct job *j)
{
    int rc = 0;
    for (int i = 0; i < j->norph; i++) {
        if (!j->orph[i].rc) {
            pool->st.release_ops++;
            held_sub(pool, j->orph[i].pages);
        } else if (pool->norphans < 64) {
            pool->orphans[pool->norphans].h = j->orph[i].h;
            pool->orphans[pool->norphans++].pages = j->orph[i].pages;
        } else {
            held_sub(pool, j->orph[i].pages); /* left to the driver; warned below */
            msh_warn("pool: the driver refused to release 64 handles; one more is left to the driver");
        }
    }
    for (uint32_t i = 0; i < j->nruns; i++) {
        struct run *ru = &j->runs[i];
        struct page *hp = &j->r->pages[ru->p0];
        if (!ru->rc) {
            hp->handle = ru->h;
            hp->state = PG_MAPPED;
            pool->nhandles++;
            pool->st.map_ops++;
            if (ru->vic < 0) pool->st.create_ops++;
            if (!hp->nlive) cache_add(pool, j->r, ru->p0); /* a piece of a split handle */
            continue;
        }
        if (!rc || ru->rc == ENOMEM) rc = ru->rc;
        if (ru->vic < 0 && ru->fate == RUN_NONE) {
            held_sub(pool, ru->n); /* never created */
        } else if (ru->fate == RUN_RELEASED) {
            held_sub(pool, ru->n);
            pool->st.release_ops++;
        } else if (ru->fate == RUN_ORPHANED) {
            if (pool->norphans < 64) {
                pool->orphans[pool->norphans].h = ru->h;
                pool->orphans[pool->norphans++].pages = ru->n;
            } else {
                held_sub(pool, ru->n);
            }
        }
        if (ru->vic < 0 && ru->fate != RUN_NONE) pool->st.create_ops++;
        if (ru->vic < 0 && ru->fate == RUN_NONE && ru->rc == ENOMEM) pool->driver_oom = true;
        /* a reused handle whose victim failed to unmap stays with the victim (RUN_NONE) */
        for (uint32_t q = ru->p0; q < ru->p0 + ru->n; q++)
            if (j->r->pages[q].hd == ru->p0 + 1) j->r->pages[q].hd = 0;
        hp->state = PG_MAPPED;
        hp->handle = 0;
        hp->nlive = 0;
        hp->plan &= PLAN_PAGE;
    }
    for (uint32_t i = 0; i < j->nvic; i++) {
        struct victim *v = &j->vic[i];
        struct page *hp = &v->r->pages[v->head];
        if (v->rc) { /* still mapped where it was (runs over a split one failed above) */
            for (uint32_t q = v->head; q < v->head + v->n; q++) v->r->pages[q].hd = v->head + 1;
            hp->npages = v->n;
            hp->handle = v->h;
            hp->state = PG_MAPPED;
            uint32_t nl = 0;
            for (uint32_t q = v->head; q < v->head + v->n; q++) nl += v->r->pages[q].live > 0;
            hp->nlive = nl;
            if (!nl) cache_add(pool, v->r, v->head);
            if (v->run < 0) held_add(pool, v->n);
            if (!rc) rc = v->rc;
            continue;
        }
        /* pages a run of this job took over (a split handle) point at the run now */
        bool head_taken = false;
        for (uint32_t q = v->head; q < v->head + v->n; q++) {
            bool in_run = false;
            for (uint32_t k = 0; k < j->nruns && v->r == j->r; k++)
                if (q >= j->runs[k].p0 && q < j->runs[k].p0 + j->runs[k].n && !j->runs[k].rc) in_run = true;
            if (in_run) head_taken |= q == v->head;
            else v->r->pages[q].hd = 0;
        }
        if (!head_taken) {
            hp->state = PG_MAPPED;
            hp->handle = 0;
            hp->plan &= PLAN_PAGE;
        }
        pool->nhandles--;
        pool->st.unmap_ops++;
        if (v->kind == V_RECLAIM) pool->st.reclaimed_pages += v->n;
        else if (v->kind == V_RELEASE) pool->st.released_pages += v->n;
        if (v->run < 0) {
            if (!v->rel_rc) {
                pool->st.release_ops++;
            } else if (pool->norphans < 64) {
                pool->orphans[pool->norphans].h = v->h;
                pool->orphans[pool->norphans++].pages = v->n;
                held_add(pool, v->n);
            } else {
                msh_warn("pool: the driver refused to release 64 handles; one more is left to the driver");
            }
        }
    }
    pool->st.cross_stream_waits += (uint64_t)j->waits_done;
    if (j->foreign && !rc && !j->sync_rc) pool->st.cross_stream_reuses++;
    j->waits_done = 0;
    j->foreign = false;
    if (j->sync && !j->sync_rc && !j->wait_rc && j->sync_gen > pool->synced_gen) {
        pool->synced_gen = j->sync_gen;
    }
    if (j->sync_rc && !rc) rc = j->sync_rc;
    if (j->wait_rc && !rc) rc = j->wait_rc;
    for (int i = 0; i < j->nwaits; i++)
        if (j->waits[i].done) ev_done(pool, j->waits[i].ev);
    if (pool->waiters) pthread_cond_broadcast(&pool->cv);
    return rc;
}

/* Run a job without the lock (the caller holds it) and publish it. */
static int job_do(struct msh_pool *pool, struct job *j)
{
    if (!job_has_work(j)) return 0;
    pool->jobs++;
    pthread_mutex_unlock(&pool->lock);
    job_run(pool, j);
    pthread_mutex_lock(&pool->lock);
    pool->jobs--;
    return job_publish(pool, j);
}

/* Give cached handles back to the driver (all of them with max_keep = 0, or down to max_keep
 * bytes; with quiet_ms only those not reused for that long). Returns the bytes released. */
static size_t release_cached(struct msh_pool *pool, size_t max_keep, uint32_t quiet_ms)
{
    if (capturing(pool)) { /* an unmap (and its synchronize) would invalidate the capture */
        if (pool->cached) pool->st.capture_deferrals++;
        return 0;
    }
    struct job j;
    job_init(&j);
    size_t before = pool->st.released_pages;
    claim_release(pool, &j, max_keep / pool->gran, quiet_ms);
    job_do(pool, &j);
    job_fini(pool, &j);
    return (pool->st.released_pages - before) * pool->gran;
}

/* ---- regions ----------------------------------------------------------------------------------- */

static size_t round_up(size_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

/* Reserve a new VA range for `area` (called with the lock held; the reservation is made without
 * it). Returns false when the driver or memory refused. */
static bool region_add(struct msh_pool *pool, int area, uint64_t min_bytes)
{
    uint64_t size = pool->prm.va_bytes;
    if (size < min_bytes) size = min_bytes;
    size = round_up(size, pool->gran);
    if (size / pool->gran > MAX_REGION_PAGES) return false;
    uint32_t npages = (uint32_t)(size / pool->gran);
    pthread_mutex_unlock(&pool->lock);
    uint64_t va = 0;
    int rc = dev_reserve(pool, size, &va);
    struct region *r = rc ? NULL : raw_alloc(sizeof *r);
    struct page *pages = r ? raw_alloc((size_t)npages * sizeof *pages) : NULL;
    if (rc) msh_warn("pool: cannot reserve %llu bytes of virtual address space (error %d)", (unsigned long long)size, rc);
    if (!rc && (!r || !pages)) {
        raw_free(r, sizeof *r);
        raw_free(pages, (size_t)npages * sizeof *pages);
        dev_unreserve(pool, va, size);
        r = NULL;
    }
    pthread_mutex_lock(&pool->lock);
    if (!r) return false;
    struct blk *b = blk_new(pool);
    if (!b) {
        pthread_mutex_unlock(&pool->lock);
        raw_free(r, sizeof *r);
        raw_free(pages, (size_t)npages * sizeof *pages);
        dev_unreserve(pool, va, size);
        pthread_mutex_lock(&pool->lock);
        return false;
    }
    r->base = va;
    r->size = size;
    r->npages = npages;
    r->pages = pages;
    r->chead[0] = r->ctail[0] = r->chead[1] = r->ctail[1] = NO_PAGE;
    r->first = b;
    r->area = area;
    r->next = pool->areas[area];
    pool->areas[area] = r;
    pool->st.va_bytes += size;
    if (pool->nvr < (int)(sizeof pool->vr / sizeof pool->vr[0])) {
        pool->vr[pool->nvr].base = va;
        pool->vr[pool->nvr].end = va + size;
        __atomic_store_n(&pool->nvr, pool->nvr + 1, __ATOMIC_RELEASE);
    }
    b->addr = va;
    b->size = size;
    b->reg = r;
    b->state = B_FREE;
    free_insert(pool, b);
    return true;
}

/* ---- carving and coalescing ---------------------------------------------------------------------- */

static int area_of(const struct msh_pool *pool, uint64_t rsize)
{
    return rsize <= pool->prm.small_max ? 0 : 1;
}

/* Merge the free block b (in no treap) with its free neighbours; returns the block that holds
 * b's extent now. Their tags stay exact (streams_merge). */
static struct blk *coalesce(struct msh_pool *pool, struct blk *b)
{
    struct blk *n = b->next;
    if (n && n->state == B_FREE) {
        free_remove(pool, n);
        streams_merge(pool, b, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        blk_put(pool, n);
    }
    struct blk *p = b->prev;
    if (p && p->state == B_FREE) {
        free_remove(pool, p);
        streams_merge(pool, p, b);
        p->size += b->size;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        blk_put(pool, b);
        b = p;
    }
    return b;
}

/* Return a block to its area's free treaps, merging free neighbours. */
static void blk_make_free(struct msh_pool *pool, struct blk *b)
{
    b->state = B_FREE;
    free_insert(pool, coalesce(pool, b));
}

/* Make [at, at + rsize) of the free block b a pending block (returned); the rest stays free and
 * keeps b's stream tags. NULL when the pool's own memory ran out (b unchanged). */
static struct blk *carve_at(struct msh_pool *pool, struct blk *b, uint64_t at, uint64_t rsize)
{
    uint64_t end = b->addr + b->size;
    struct blk *lo = NULL, *hi = NULL;
    if (at > b->addr && !(lo = blk_new(pool))) return NULL;
    if (at + rsize < end && !(hi = blk_new(pool))) {
        if (lo) blk_put(pool, lo);
        return NULL;
    }
    free_remove(pool, b);
    b->state = B_PENDING; /* before the pieces may merge with their outer neighbours */
    if (lo) {
        lo->addr = b->addr;
        lo->size = at - b->addr;
        lo->reg = b->reg;
        lo->state = B_FREE;
        lo->prev = b->prev;
        lo->next = b;
        if (b->prev) b->prev->next = lo;
        else b->reg->first = lo;
        b->prev = lo;
        streams_copy(pool, lo, b);
        streams_clip(pool, lo);
        free_insert(pool, lo);
    }
    if (hi) {
        hi->addr = at + rsize;
        hi->size = end - hi->addr;
        hi->reg = b->reg;
        hi->state = B_FREE;
        hi->prev = b;
        hi->next = b->next;
        if (b->next) b->next->prev = hi;
        b->next = hi;
        streams_copy(pool, hi, b);
        streams_clip(pool, hi);
        free_insert(pool, hi);
    }
    b->addr = at;
    b->size = rsize;
    b->state = B_PENDING;
    streams_clip(pool, b);
    return b;
}

/* Pages a block at [a, a + size) would touch that no live block touches yet. Inside a free
 * extent only its first and last page can be shared with a live neighbour. */
static uint64_t new_pages(const struct msh_pool *pool, const struct region *r, uint64_t a, uint64_t size)
{
    uint64_t p0 = (a - r->base) / pool->gran, p1 = (a + size - 1 - r->base) / pool->gran;
    uint64_t n = p1 - p0 + 1;
    if (r->pages[p0].live) n--;
    if (p1 != p0 && r->pages[p1].live) n--;
    return n;
}

/* Place the block at the high end of the free extent when that shares more pages with live
 * neighbours than the low end does; ties stay low (address order keeps the line compact). */
static bool place_high(const struct msh_pool *pool, const struct blk *b, uint64_t rsize)
{
    if (!b->next) return false; /* the open end of the line: grow from the low end */
    const struct region *r = b->reg;
    return new_pages(pool, r, b->addr + b->size - rsize, rsize) < new_pages(pool, r, b->addr, rsize);
}

static struct blk *plan_place(struct msh_pool *pool, uint64_t rsize);

/* The best-fit search, in (size, address) order from the smallest extent that fits, looks at up
 * to FIT_LOOK candidates for one that serves the stream at once (PyTorch reuses a block on its
 * own stream only; memshim also reuses memory whose other streams are known done), remembering
 * the first that needs stream waits and the first that needs a synchronize. */
#define FIT_LOOK 32
/* A candidate and where it would be carved. */
struct fit_pick {
    struct blk *b;
    uint64_t at;
};

/* The best-fit search keeps, in (size, address) order, the first candidate of each kind: one that
 * serves the stream at once on pages mapped already (it ends the search), at once but on pages
 * that must be mapped above the top of the line (the pool grows), after stream waits on mapped
 * pages, after stream waits on new pages, and after a synchronize. */
enum { PICK_READY, PICK_WAIT, PICK_READY_GROW, PICK_WAIT_GROW, PICK_SYNC, PICK_N };
struct fit_search {
    uint64_t rsize, stream;
    struct fit_pick pick[PICK_N];
    bool room;           /* new pages fit without reclaim (fresh_fits): the clean part of a partly
                          * tagged extent may be used, though it may need pages mapped */
    int seen;
    uint64_t blocked[4]; /* streams whose missing events made candidates need a synchronize, */
    uint64_t blocked_size[4]; /* and those candidates' sizes */
    int nblocked;
};

static void fit_note(struct fit_search *fs, int kind, struct blk *b, uint64_t at)
{
    if (!fs->pick[kind].b) fs->pick[kind] = (struct fit_pick){b, at};
}

static bool fit_visit(struct msh_pool *pool, struct blk *t, struct fit_search *fs)
{
    while (t) {
        if (t->size < fs->rsize) {
            t = t->kid[TS][1];
            continue;
        }
        if (fit_visit(pool, t->kid[TS][0], fs)) return true;
        uint64_t blocked = MSH_STREAM_COMPLETED;
        uint64_t at = place_high(pool, t, fs->rsize) ? t->addr + t->size - fs->rsize : t->addr;
        uint64_t end = t->addr + t->size, top = page_va(pool, t->reg, t->reg->hi_page);
        int k = fit_kind(pool, t, at, at + fs->rsize, fs->stream, &blocked);
        if (k == FIT_READY) fit_note(fs, at + fs->rsize > top ? PICK_READY_GROW : PICK_READY, t, at);
        else if (k == FIT_WAIT) fit_note(fs, at + fs->rsize > top ? PICK_WAIT_GROW : PICK_WAIT, t, at);
        else fit_note(fs, PICK_SYNC, t, at);
        /* an extent partly tagged: the bytes outside the tags in the way serve at once, if the
         * request fits there */
        uint64_t blo = 0, bhi = 0;
        if (k != FIT_READY && blocking_span(pool, t, fs->stream, &blo, &bhi)) {
            uint64_t alt = end - bhi >= fs->rsize ? bhi : blo - t->addr >= fs->rsize ? blo - fs->rsize : at;
            if (alt != at && fit_kind(pool, t, alt, alt + fs->rsize, fs->stream, NULL) == FIT_READY)
                fit_note(fs, alt + fs->rsize > top ? PICK_READY_GROW : PICK_READY, t, alt);
        }
        if (fs->pick[PICK_READY].b) return true;
        if (blocked != MSH_STREAM_COMPLETED && fs->nblocked < 4) {
            fs->blocked_size[fs->nblocked] = t->size;
            fs->blocked[fs->nblocked++] = blocked;
        }
        if (++fs->seen >= FIT_LOOK) return true;
        t = t->kid[TS][1];
    }
    return false;
}

/* Pages a block of rsize bytes placed on fresh memory maps, and whether that stays under the
 * limit (and far from the device's capacity) without reclaiming anything. */
static bool fresh_fits(const struct msh_pool *pool, uint64_t rsize)
{
    size_t need = (size_t)((rsize + pool->gran - 1) / pool->gran) + 1;
    size_t cap = cap_pages(pool);
    if (pool->driver_oom) return false;
    if (cap != SIZE_MAX) return pool->held + need <= cap;
    return !pool->device_total || (pool->held + need) * pool->gran < pool->device_total / 4 * 3;
}

/* Memory no stream has used: the open end of a region's VA line, above every page ever mapped
 * (no tags, no handle to split). NULL with *rc = ENOSPC when no region of the area has room. */
static struct blk *place_fresh(struct msh_pool *pool, int area, uint64_t rsize, int *rc)
{
    for (struct region *r = pool->areas[area]; r; r = r->next) {
        uint64_t end = r->base + r->size;
        struct blk *b = atreap_floor(pool->atree[area], end - 1);
        if (!b || b->reg != r || b->addr + b->size != end) continue;
        uint64_t at = page_va(pool, r, r->hi_page);
        if (at < b->addr) at = b->addr;
        if (at + rsize > end) continue;
        struct blk *c = carve_at(pool, b, at, rsize);
        if (!c) *rc = ENOMEM;
        return c;
    }
    *rc = ENOSPC;
    return NULL;
}

/* Best fit by (size, address) among the extents that serve `stream` without a synchronize, or
 * where the learned step says. When every fitting extent would need one (memory freed on another
 * stream without an event, not yet known complete), fresh memory is mapped instead if that fits
 * without reclaim, and the streams in the way are asked for events at their frees (want_events); otherwise the
 * best fit is used after a synchronize (host-synchronous callers, and tight limits). During a
 * capture a synchronize is never an option. NULL with *rc = ENOSPC when the area needs another
 * region, ENOMEM when the pool's own memory ran out. */
static struct blk *place(struct msh_pool *pool, int area, uint64_t rsize, uint64_t stream, int *rc)
{
    struct blk *b = pool->step ? plan_place(pool, rsize) : NULL;
    if (b) return b;
    struct fit_search fs = {.rsize = rsize, .stream = stream, .room = fresh_fits(pool, rsize)};
    fit_visit(pool, pool->tree[area], &fs);
    /* At once on mapped pages if possible; else a stream wait (no host blocking) on mapped pages
     * rather than growing the pool; then the same on new pages, while they fit without reclaim
     * (else a synchronize and the mapped extent cost less than a reclaim: below). A
     * host-synchronous user (cudaMalloc) takes the synchronize over new pages: growing for each of
     * them took a soak over the real traces to the pool's whole room (60 GiB for 7 GiB live),
     * where streams ask for events and stop needing either. */
    uint64_t at = 0;
    bool host = stream == MSH_STREAM_COMPLETED;
    bool grow = (fs.room && !host) || capturing(pool);
    static const int order[] = {PICK_READY, PICK_WAIT, PICK_READY_GROW, PICK_WAIT_GROW};
    for (int i = 0; i < 4 && !b; i++)
        if (fs.pick[order[i]].b && (i < 2 || grow || !fs.pick[PICK_SYNC].b)) {
            b = fs.pick[order[i]].b;
            at = fs.pick[order[i]].at;
        }
    /* Streams whose missing events kept a better fit from this request: events at their frees
     * from now on, so that the next requests can have that memory (a hand-off between streams,
     * not same-stream traffic). */
    for (int i = 0; i < fs.nblocked; i++)
        if (!b || fs.blocked_size[i] < b->size) want_events(pool, fs.blocked[i]);
    if (!b && fs.pick[PICK_SYNC].b) {
        if (grow) {
            pool->st.fresh_placements++;
            return place_fresh(pool, area, rsize, rc);
        }
        b = fs.pick[PICK_SYNC].b;
        at = fs.pick[PICK_SYNC].at;
    }
    if (!b) {
        *rc = ENOSPC;
        return NULL;
    }
    b = carve_at(pool, b, at, rsize);
    if (!b) *rc = ENOMEM;
    return b;
}

/* ---- streams of a reused extent ------------------------------------------------------------------ */

/* Before a free extent is handed out on `stream`: work of other streams that last used it must
 * come first. The new stream waits on the event recorded when the extent was freed on each of
 * them (no host blocking, no waiting for their later work), unless a query finds it complete;
 * tags known complete cost nothing. No event is ever recorded here: an old stream's later work
 * must not hold up the new one. An extent with a tag that has no event (and is not known
 * complete), and every dirty extent handed to a host-synchronous user (MSH_STREAM_COMPLETED), get
 * a device synchronize. Nothing is dropped from b: if the allocation fails, the extent goes back
 * with its tags. */
static void streams_plan(struct msh_pool *pool, struct blk *b, uint64_t stream, bool fresh, struct job *j)
{
    if (fresh || blk_clean(pool, b)) return;
    j->stream = stream;
    j->sync_gen = pool->free_gen;
    if (fit_kind(pool, b, b->addr, b->addr + b->size, stream, NULL) == FIT_SYNC) {
        j->sync = j->host_sync = true;
        return;
    }
    bool foreign = false;
    for (int i = 0; i < b->ns; i++) {
        const struct sref *t = &b->s[i];
        if (t->stream == stream || tag_done(pool, t)) continue;
        foreign = true;
        uint32_t e = tag_event(pool, t);
        struct ewait *w = &j->waits[j->nwaits++];
        *w = (struct ewait){.stream = t->stream, .ev = e, .h = pool->evs[e].h};
        ev_ref(pool, e);
    }
    j->foreign = foreign;
}

/* ---- allocation ----------------------------------------------------------------------------------- */

static void step_note_alloc(struct msh_pool *pool, struct blk *b);
static void step_note_free(struct msh_pool *pool, struct blk *b);
static void step_destroy(struct msh_pool *pool);
static void step_stop(struct msh_pool *pool);
static void step_create(struct msh_pool *pool);
static void step_before_alloc(struct msh_pool *pool, uint64_t rsize);
static void step_drop(struct msh_pool *pool);

/* One try at placing and backing a block. reclaim_only: the driver said it is full, so the pool
 * holds no more handles than it does now (it reclaims cached ones instead). While the device
 * captures a CUDA graph, a placement that would need a synchronize, an unmap or a release
 * (reclaim, a split handle) is given up for fresh memory, and failing that the request fails
 * (*capture_blocked). */
static int try_alloc(struct msh_pool *pool, uint64_t rsize, uint64_t req, uint64_t stream, uint64_t *addr,
                     bool reclaim_only, bool *reclaimed, bool *driver_enomem, bool *capture_blocked)
{
    int area = area_of(pool, rsize);
    bool fresh_only = false;
    struct blk *b;
    int rc;
    struct job j;
    job_init(&j);
    for (;;) {
        rc = 0;
        while (!(b = fresh_only ? place_fresh(pool, area, rsize, &rc) : place(pool, area, rsize, stream, &rc))) {
            if (rc != ENOSPC || !region_add(pool, area, rsize)) return ENOMEM;
        }
        bool fresh = b->addr >= page_va(pool, b->reg, b->reg->hi_page);
        if (!fresh && capturing(pool) && fit_kind(pool, b, b->addr, b->addr + b->size, stream, NULL) == FIT_SYNC) {
            rc = ECAPTURE; /* the learned step's address needs a synchronize */
        } else {
            for (;;) {
                size_t cap = cap_pages(pool);
                if (reclaim_only && pool->held < cap) cap = pool->held;
                rc = claim_pages(pool, b, &j, cap);
                if (rc != EAGAIN) break;
                /* another thread maps or unmaps one of our pages: wait for it to publish */
                pool->st.lock_waits++;
                pool->waiters++;
                pthread_cond_wait(&pool->cv, &pool->lock);
                pool->waiters--;
            }
        }
        if (rc == ECAPTURE) {
            job_fini(pool, &j);
            if (pool->step && step_want(pool->step, b->addr)) step_drop(pool);
            blk_make_free(pool, b);
            pool->st.capture_deferrals++;
            if (!fresh_only && !fresh) {
                fresh_only = true;
                continue;
            }
            *capture_blocked = true;
            return ENOMEM;
        }
        break;
    }
    if (rc) {
        job_fini(pool, &j);
        blk_make_free(pool, b);
        return rc;
    }
    bool fresh = b->addr >= page_va(pool, b->reg, b->reg->hi_page);
    streams_plan(pool, b, stream, fresh, &j);
    rc = job_do(pool, &j);
    if (j.nvic && !rc) *reclaimed = true;
    if (j.driver_enomem) *driver_enomem = true;
    job_fini(pool, &j);
    if (!rc && pool->hcount >= pool->hcap && hash_grow(pool)) rc = ENOMEM;
    if (rc) {
        block_untouch(pool, b);
        b->claimed = 0;
        blk_make_free(pool, b);
        return rc;
    }
    sref_clear(pool, b); /* the waits are enqueued: the new stream owns the extent */
    b->claimed = 0;
    b->state = B_LIVE;
    b->req = req;
    b->tag = msh_pool_tags.next;
    b->s[0] = (struct sref){.stream = stream, .ev = NO_EV}; /* [0]: the allocation stream */
    b->ns = 1;
    hash_insert(pool, b);
    *addr = b->addr;
    return 0;
}

/* The driver ran out (no limit set, or other allocators hold the device): reclaim instead. */
static int try_alloc_all(struct msh_pool *pool, uint64_t rsize, uint64_t req, uint64_t stream, uint64_t *addr,
                         bool *reclaimed, bool *capture_blocked)
{
    bool denomem = false;
    int rc = try_alloc(pool, rsize, req, stream, addr, false, reclaimed, &denomem, capture_blocked);
    if (rc == ENOMEM && denomem && pool->prm.defrag && pool->cached && !capturing(pool))
        rc = try_alloc(pool, rsize, req, stream, addr, true, reclaimed, &denomem, capture_blocked);
    return rc;
}

/* ---- public API ------------------------------------------------------------------------------- */

void msh_pool_params_default(struct msh_pool_params *p)
{
    memset(p, 0, sizeof *p);
    p->small_max = MSH_MiB;
    p->defrag = true;
}

int msh_pool_create(struct msh_device *dev, const struct msh_pool_params *params,
                    struct msh_pool **out)
{
    struct msh_pool *pool = raw_alloc(sizeof *pool);
    if (!pool) return ENOMEM;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->dev = dev;
    if (params) pool->prm = *params;
    else msh_pool_params_default(&pool->prm);
    pool->rng = 0x2545F491u;
    pool->evfree = NO_EV;
    pool->t0_ns = msh_now_ns();
    int rc = dev->ops->granularity(dev, &pool->gran);
    if (rc || !pool->gran) {
        pthread_cond_destroy(&pool->cv);
        pthread_mutex_destroy(&pool->lock);
        raw_free(pool, sizeof *pool);
        return rc ? rc : EIO;
    }
    size_t free_b = 0, total = 0;
    if (dev->ops->mem_info(dev, &free_b, &total) == 0) pool->device_total = total;
    if (pool->prm.share) pool->prm.limit_bytes = 0; /* the share's limit applies (limit_now) */
    pool->limit = pool->prm.limit_bytes ? round_up(pool->prm.limit_bytes, pool->gran) : 0;
    if (pool->prm.limit_bytes && pool->limit > pool->prm.limit_bytes)
        pool->limit -= pool->gran; /* a cap is a cap: round down to whole pages */
    pool->limit_pages = (uint32_t)(pool->limit / pool->gran < UINT32_MAX ? pool->limit / pool->gran : UINT32_MAX);
    uint64_t mh = pool->prm.max_handle_bytes ? pool->prm.max_handle_bytes / pool->gran : MAX_REGION_PAGES;
    pool->max_handle_pages = (uint32_t)(mh < 1 ? 1 : mh > MAX_REGION_PAGES ? MAX_REGION_PAGES : mh);
    if (!pool->prm.release_quiet_ms) pool->prm.release_quiet_ms = 1000;
    size_t ahead = pool->prm.ahead_bytes ? pool->prm.ahead_bytes : 20 * MSH_MiB;
    pool->chunk_pages = (uint32_t)(ahead / pool->gran ? (ahead / pool->gran < MAX_REGION_PAGES ? ahead / pool->gran : MAX_REGION_PAGES) : 1);
    if (!pool->prm.va_bytes) {
        uint64_t base = limit_now(pool) ? limit_now(pool) : (total ? total : 64 * MSH_GiB);
        pool->prm.va_bytes = base * 4;
    }
    pool->prm.va_bytes = round_up(pool->prm.va_bytes < MSH_GiB ? MSH_GiB : pool->prm.va_bytes, pool->gran);
    uint64_t max_va = (uint64_t)pool->gran * MAX_REGION_PAGES;
    if (pool->prm.va_bytes > max_va) pool->prm.va_bytes = max_va;
    if (!pool->prm.no_learn) step_create(pool);
    *out = pool;
    return 0;
}

void msh_pool_destroy(struct msh_pool *pool)
{
    if (!pool) return;
    step_stop(pool);
    dev_synchronize(pool);
    for (int a = 0; a < NAREAS; a++) {
        struct region *r = pool->areas[a];
        while (r) {
            bool stuck = false;
            for (uint32_t p = 0; p < r->hi_page; p++) {
                struct page *pg = &r->pages[p];
                if (pg_head(pg) != p) continue;
                size_t bytes = (size_t)pg->npages * pool->gran;
                if (dev_unmap(pool, page_va(pool, r, p), bytes)) {
                    stuck = true; /* a mapped handle must not be released nor its range freed */
                    continue;
                }
                if (dev_release(pool, pg->handle, bytes) == 0) held_sub(pool, pg->npages);
                else if (pool->norphans < 64) {
                    pool->orphans[pool->norphans].h = pg->handle;
                    pool->orphans[pool->norphans++].pages = pg->npages;
                }
            }
            if (!stuck) dev_unreserve(pool, r->base, r->size);
            else msh_warn("pool: unmap failed at shutdown; leaving a reserved range to the driver");
            struct region *nx = r->next;
            raw_free(r->pages, (size_t)r->npages * sizeof *r->pages);
            raw_free(r, sizeof *r);
            r = nx;
        }
    }
    for (int i = 0; i < pool->norphans; i++) /* a second chance for handles whose release failed */
        dev_release(pool, pool->orphans[i].h, (size_t)pool->orphans[i].pages * pool->gran);
    for (uint32_t i = 0; i < pool->nevs; i++)
        if (pool->evs[i].h) ev_destroy(pool, pool->evs[i].h);
    raw_free(pool->evs, (size_t)pool->capevs * sizeof *pool->evs);
    step_destroy(pool);
    raw_free(pool->htab, pool->hcap * sizeof *pool->htab);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->lock);
    /* Block slabs are not tracked individually; they are reclaimed with the process. */
    raw_free(pool, sizeof *pool);
}

static void fill_oom(struct msh_pool *pool, size_t req, size_t dev_free, size_t dev_total);

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One timed call: the total, the histogram behind the reports' latency percentiles, the max. */
static inline void lat_note(uint64_t *hist, uint64_t *total, uint64_t *max, uint64_t ns, uint32_t w)
{
    *total += ns * w; /* a timed call stands for w calls (hotclock.h) */
    hist[msh_lat_bucket(ns)] += w;
    if (ns > *max) *max = ns;
}

static void note_alloc(struct msh_pool *pool, uint64_t req, bool reclaimed)
{
    struct msh_pool_stats *st = &pool->st;
    st->allocs++;
    st->live_bytes += req;
    st->live_blocks++;
    if (st->live_bytes > st->peak_live_bytes) st->peak_live_bytes = st->live_bytes;
    if (st->live_bytes > st->run_peak_live_bytes) st->run_peak_live_bytes = st->live_bytes;
    size_t touched = pool->touched * pool->gran;
    if (touched > st->peak_touched_bytes) st->peak_touched_bytes = touched;
    if (reclaimed) st->rescue_reclaim++;
    int bucket = 0;
    for (uint64_t s = req >> 9; s && bucket < 23; s >>= 1) bucket++;
    st->hist[bucket]++;
}

static void settle_locked(struct msh_pool *pool);

/* Query up to 8 recorded events not yet seen complete (each stream's latest first, then round robin over the
 * table), as PyTorch's process_events does at each allocation: a complete one covers its stream's
 * earlier tags, so memory freed there serves other streams without a wait. Called with the lock
 * held; drops it for the queries. Only while some event is outstanding, every 16 allocations or
 * right after an event was recorded for a stream another one waits on. */
static void events_poll(struct msh_pool *pool)
{
    uint32_t slot[8];
    uint64_t h[8];
    int n = 0, rcs[8];
    for (uint32_t i = 0; i < MAX_KSTREAMS && n < 8; i++) {
        uint32_t e = pool->ks[i].latest;
        if (pool->ks[i].used && e != NO_EV && pool->evs[e].state == EV_RECORDED && pool->evs[e].h) slot[n++] = e;
    }
    for (uint32_t scan = 0; scan < 64 && scan < pool->nevs && n < 8; scan++) {
        uint32_t e = (pool->poll_cursor + scan) % pool->nevs;
        bool dup = false;
        for (int k = 0; k < n && !dup; k++) dup = slot[k] == e;
        if (!dup && pool->evs[e].state == EV_RECORDED && pool->evs[e].refs && pool->evs[e].h) slot[n++] = e;
    }
    if (pool->nevs) pool->poll_cursor = (pool->poll_cursor + 64) % pool->nevs;
    if (!n) return;
    for (int k = 0; k < n; k++) {
        ev_ref(pool, slot[k]); /* held across the unlocked queries */
        h[k] = pool->evs[slot[k]].h;
    }
    pool->jobs++;
    pthread_mutex_unlock(&pool->lock);
    for (int k = 0; k < n; k++) rcs[k] = dev_event_query(pool, h[k]);
    pthread_mutex_lock(&pool->lock);
    pool->jobs--;
    for (int k = 0; k < n; k++) {
        if (rcs[k] == 0) ev_done(pool, slot[k]);
        ev_put(pool, slot[k]);
    }
}

int msh_pool_alloc(struct msh_pool *pool, size_t size, uint64_t stream, uint64_t *addr)
{
    if (size > MAX_SIZE) return EINVAL;
    uint64_t rsize = round_up(size ? size : 1, BLOCK_ALIGN);
    uint32_t lw = pool->timing ? msh_lat_sample() : 0;
    uint64_t t0 = lw ? now_ns() : 0;
    pthread_mutex_lock(&pool->lock);
    ks_get(pool, stream);
    if (MSH_UNLIKELY(pool->parked || pool->empty_deferred) && !capturing(pool)) settle_locked(pool);
    if (pool->nrecorded && (pool->poll_soon || ++pool->poll_tick >= 16)) {
        pool->poll_tick = 0;
        pool->poll_soon = false;
        events_poll(pool);
    }
    if (pool->step) step_before_alloc(pool, rsize);
    size_t held0 = pool->held; /* issue 8: a failed request gives back what it created */
    bool reclaimed = false, capture_blocked = false;
    int rc = try_alloc_all(pool, rsize, size, stream, addr, &reclaimed, &capture_blocked);
    if (rc == ENOMEM && pool->gc_fn) {
        msh_pool_gc_fn fn = pool->gc_fn;
        void *arg = pool->gc_arg;
        pthread_mutex_unlock(&pool->lock);
        fn(arg); /* may free blocks through msh_pool_free */
        pthread_mutex_lock(&pool->lock);
        rc = try_alloc_all(pool, rsize, size, stream, addr, &reclaimed, &capture_blocked);
        if (rc == 0) pool->st.rescue_gc++;
    }
    if (rc == ENOMEM && pool->cached && (pool->driver_oom || !pool->prm.defrag) && !pool->prm.no_release_on_oom &&
        !capturing(pool)) {
        pool->driver_oom = false;
        /* Cached pages were already candidates for reclaim; giving them back helps when the
         * driver itself ran out (other allocators in the process hold the rest), and when reclaim
         * is off (MEMSHIM_DEFRAG=0: under a limit new pages can be created only after these go). */
        release_cached(pool, 0, 0);
        rc = try_alloc_all(pool, rsize, size, stream, addr, &reclaimed, &capture_blocked);
        if (rc == 0) pool->st.rescue_empty_cache++;
    }
    if (rc == 0) {
        note_alloc(pool, size, reclaimed);
        struct blk *b = hash_find(pool, *addr);
        if (pool->step && b) step_note_alloc(pool, b);
        if (lw) lat_note(pool->st.alloc_lat, &pool->st.alloc_ns_total, &pool->st.alloc_ns_max, now_ns() - t0, lw);
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    /* Pages this request created and could not use are given back: the memory a failed request
     * leaves held is what it found (cudaMemGetInfo's answer counts on that, issue 8). */
    if (pool->held > held0)
        release_cached(pool, (pool->cached > pool->held - held0 ? pool->cached - (pool->held - held0) : 0) * pool->gran, 0);
    pool->st.alloc_fail++;
    pool->st.oom_events++;
    pthread_mutex_unlock(&pool->lock);
    size_t df = 0, dt = 0;
    if (pool->dev->ops->mem_info(pool->dev, &df, &dt)) df = dt = 0;
    pthread_mutex_lock(&pool->lock);
    fill_oom(pool, size, df, dt);
    pool->oom.capture = capture_blocked || (capturing(pool) && pool->cached);
    struct msh_pool_oom o = pool->oom;
    pthread_mutex_unlock(&pool->lock);
    msh_warn("out of memory on device %d: requested %zu bytes; live %zu, reserved %zu, limit %zu, "
             "device free %zu of %zu, largest usable free extent %zu: %s%s",
             pool->dev->ordinal, o.requested, o.live_bytes, o.mapped_bytes, o.limit_bytes,
             o.device_free, o.device_total, o.largest_free,
             o.fragmentation ? "fragmentation (enough bytes are free, but not in usable pages)"
                             : "capacity (the live set does not fit)",
             o.capture ? "; a CUDA-graph capture was in progress, during which memshim cannot reclaim or "
                         "release cached memory" : "");
    return rc == ENOMEM ? ENOMEM : rc;
}

/* MEMSHIM_EMPTY_CACHE=threshold: cached bytes above the threshold go back to the driver once they
 * have not been reused for the quiet period, so a loop whose cache hovers around the threshold
 * keeps its pages (it reuses them every iteration) and an idle one gives them back. */
static size_t trim_cached(struct msh_pool *pool)
{
    size_t thr = pool->prm.release_threshold;
    if (!thr || pool->cached * pool->gran <= thr) return 0;
    size_t n = release_cached(pool, thr, pool->prm.release_quiet_ms);
    if (n) { /* the reports count these as empty-cache runs, whichever thread made them */
        pool->st.trim_runs++;
        pool->st.trim_bytes += n;
    }
    return n;
}

/* The tags of a block freed on `stream`: the free's own stream needs no event (stream order
 * covers a reuse there; a reuse elsewhere waits for a later event of that stream), while
 * every other stream the block was used on (its allocation stream, record_stream's) gets an
 * event recorded now, so that a reuse elsewhere waits for exactly the work queued before the
 * free: PyTorch's allocator records such events too (record_stream), and none for a block used
 * on its own stream only. While another stream wants this one's memory (want_events), the free's
 * own stream gets an event too. The
 * block is in no structure meanwhile (B_FREEING), and the lock is dropped while recording. An
 * event the driver refused: that stream is synchronized instead (it may belong to another
 * device's context, which a synchronize of this device would not cover), else the extent needs
 * a synchronize before reuse elsewhere. `used`: the block's streams (from its live tags). */
static void free_tags(struct msh_pool *pool, struct blk *b, uint64_t stream, const uint64_t *used, int nused, bool overflow)
{
    uint64_t rec[MAX_STREAMS + 1];
    int n = 0;
    for (int i = 0; i < nused; i++) {
        bool dup = used[i] == stream || used[i] == MSH_STREAM_COMPLETED;
        for (int k = 0; k < n && !dup; k++) dup = rec[k] == used[i];
        if (!dup && n < MAX_STREAMS) rec[n++] = used[i];
        else if (!dup) overflow = true;
    }
    struct kstream *kf = ks_get(pool, stream);
    bool own_ev = kf && kf->demand; /* this free's own event, for the stream waiting (last) */
    if (kf) kf->frees++;
    if (own_ev) {
        if (kf->window < DEMAND_MAX && --kf->demand == 0) kf->ran_out = kf->frees;
        rec[n++] = stream;
    }
    uint64_t seq = ++pool->evseq; /* the free: every event recorded below comes after it */
    b->ns = 0;
    b->sync_needed = 0;
    b->free_gen = 0;
    if (n) {
        /* in no structure from here on: asking for a stream's context drops the lock too */
        b->state = B_FREEING;
        ks_resolve_homes(pool, rec, n);
        uint32_t slot[MAX_STREAMS + 1];
        uint64_t h[MAX_STREAMS + 1], home[MAX_STREAMS + 1], evseq[MAX_STREAMS + 1];
        int rcs[MAX_STREAMS + 1];
        bool created[MAX_STREAMS + 1], synced[MAX_STREAMS + 1];
        for (int k = 0; k < n; k++) {
            home[k] = ks_home(pool, rec[k]);
            slot[k] = ev_get(pool, home[k]);
            h[k] = slot[k] != NO_EV ? pool->evs[slot[k]].h : 0;
            created[k] = synced[k] = false;
            /* numbered before the record is made, under the lock: a free numbered later may have
             * queued its work after the record, so only tags numbered earlier are covered */
            evseq[k] = ++pool->evseq;
        }
        b->state = B_FREEING;
        pool->jobs++;
        pthread_mutex_unlock(&pool->lock);
        for (int k = 0; k < n; k++) {
            rcs[k] = slot[k] == NO_EV ? ENOMEM : 0;
            if (!rcs[k] && !h[k]) {
                rcs[k] = dev_event_create(pool, home[k], &h[k]);
                created[k] = !rcs[k];
            }
            if (!rcs[k]) rcs[k] = dev_event_record(pool, h[k], rec[k]);
            if (rcs[k] && !(own_ev && k == n - 1) && pool->dev->ops->stream_sync)
                synced[k] = pool->dev->ops->stream_sync(pool->dev, rec[k]) == 0;
        }
        pthread_mutex_lock(&pool->lock);
        pool->jobs--;
        for (int k = 0; k < n; k++) {
            if (created[k]) pool->evs[slot[k]].h = h[k];
            bool is_own = own_ev && k == n - 1;
            if (rcs[k]) {
                ev_put(pool, slot[k]);
                if (!is_own && !synced[k]) b->sync_needed = 1;
                continue;
            }
            struct pev *ev = &pool->evs[slot[k]];
            ev->stream = rec[k];
            ev->seq = evseq[k];
            ev->state = EV_RECORDED;
            pool->nrecorded++;
            pool->st.free_event_records++;
            struct kstream *kl = ks_find(pool, rec[k]);
            if (kl && (kl->latest == NO_EV || pool->evs[kl->latest].seq < ev->seq)) {
                ev_put(pool, kl->latest);
                kl->latest = slot[k];
                ev_ref(pool, slot[k]);
            }
            if (is_own) {
                pool->poll_soon = 1;
                pool->st.demand_records++;
            }
            sref_add(pool, b, &(struct sref){.stream = rec[k], .seq = seq, .ev = slot[k]});
        }
    }
    bool own = false;
    for (int i = 0; i < b->ns; i++) own |= b->s[i].stream == stream;
    if (stream != MSH_STREAM_COMPLETED && !own) sref_add(pool, b, &(struct sref){.stream = stream, .seq = seq, .ev = NO_EV});
    for (int i = 0; i < b->ns; i++) {
        b->s[i].lo = b->addr;
        b->s[i].hi = b->addr + b->size;
    }
    if (overflow) b->sync_needed = 1;
    if (b->sync_needed) {
        b->slo = b->addr;
        b->shi = b->addr + b->size;
    }
    if (b->ns || b->sync_needed) b->free_gen = ++pool->free_gen;
}

int msh_pool_free(struct msh_pool *pool, uint64_t addr, uint64_t stream)
{
    uint32_t lw = pool->timing ? msh_lat_sample() : 0;
    uint64_t t0 = lw ? now_ns() : 0;
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_remove(pool, addr);
    if (!b) {
        pthread_mutex_unlock(&pool->lock);
        return EINVAL;
    }
    msh_pool_tags = (struct msh_pool_tags){msh_pool_tags.next, b->tag, b->req};
    pool->st.frees++;
    pool->st.live_bytes -= b->req;
    pool->st.live_blocks--;
    if (pool->step) step_note_free(pool, b);
    ks_get(pool, stream);
    /* A free known complete (MSH_STREAM_COMPLETED: cudaFree synchronized) leaves no tag at all;
     * otherwise the streams the block was used on, beside the free's own, need events. */
    uint64_t used[MAX_STREAMS];
    int nused = 0;
    for (int i = 0; i < b->ns && stream != MSH_STREAM_COMPLETED; i++)
        if (b->s[i].stream != stream && b->s[i].stream != MSH_STREAM_COMPLETED) used[nused++] = b->s[i].stream;
    bool overflow = b->sync_needed && stream != MSH_STREAM_COMPLETED;
    if (nused && capturing(pool)) {
        /* Recording those events now would put them where a capture can see them (querying an
         * event recorded in a capture invalidates it): PyTorch defers such frees until no
         * capture is underway (needs_events_deferred_until_no_capture), and so does the pool. */
        b->state = B_PARKED;
        b->fstream = stream;
        b->hnext = pool->parked;
        pool->parked = b;
        pool->st.parked_frees++;
        pool->st.capture_deferrals++;
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    b->ns = 0;
    free_tags(pool, b, stream, used, nused, overflow);
    block_untouch(pool, b);
    blk_make_free(pool, b);
    trim_cached(pool);
    if (lw) lat_note(pool->st.free_lat, &pool->st.free_ns_total, &pool->st.free_ns_max, now_ns() - t0, lw);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

static void events_trim(struct msh_pool *pool, bool at_exit);

/* After the device's last capture (or at the next call that finds none): the frees the capture
 * parked record their events now, and a deferred empty-cache runs. Called with the lock held. */
static void settle_locked(struct msh_pool *pool)
{
    while (pool->parked && !capturing(pool)) {
        struct blk *b = pool->parked;
        pool->parked = b->hnext;
        b->hnext = NULL;
        uint64_t used[MAX_STREAMS];
        int nused = 0;
        for (int i = 0; i < b->ns; i++)
            if (b->s[i].stream != b->fstream && b->s[i].stream != MSH_STREAM_COMPLETED) used[nused++] = b->s[i].stream;
        bool overflow = b->sync_needed;
        b->ns = 0;
        free_tags(pool, b, b->fstream, used, nused, overflow);
        block_untouch(pool, b);
        blk_make_free(pool, b);
    }
    if (pool->empty_deferred && !capturing(pool)) {
        pool->empty_deferred = false;
        release_cached(pool, 0, 0);
        events_trim(pool, false);
    }
}

void msh_pool_after_capture(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    settle_locked(pool);
    pthread_mutex_unlock(&pool->lock);
}

__thread struct msh_pool_tags msh_pool_tags;

void msh_pool_block_tags(struct msh_pool *pool, const uint64_t *addrs, uint32_t *tags, size_t n)
{
    pthread_mutex_lock(&pool->lock);
    for (size_t i = 0; i < n; i++) {
        struct blk *b = hash_find(pool, addrs[i]);
        tags[i] = b ? b->tag : 0;
    }
    pthread_mutex_unlock(&pool->lock);
}

size_t msh_pool_block_size(struct msh_pool *pool, uint64_t addr)
{
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_find(pool, addr);
    size_t s = b ? b->req : 0;
    pthread_mutex_unlock(&pool->lock);
    return s;
}

bool msh_pool_owns(struct msh_pool *pool, uint64_t addr)
{
    pthread_mutex_lock(&pool->lock);
    bool own = hash_find(pool, addr) != NULL;
    pthread_mutex_unlock(&pool->lock);
    return own;
}

int msh_pool_record_stream(struct msh_pool *pool, uint64_t addr, uint64_t stream)
{
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_find(pool, addr);
    int rc = EINVAL;
    if (b) {
        rc = 0;
        ks_get(pool, stream);
        bool seen = stream == MSH_STREAM_COMPLETED;
        for (int i = 0; i < b->ns; i++) seen |= b->s[i].stream == stream;
        if (!seen) {
            if (b->ns < MAX_STREAMS) b->s[b->ns++] = (struct sref){.stream = stream, .ev = NO_EV};
            else b->sync_needed = 1; /* too many streams to track: synchronize before reuse */
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}

/* Empty-cache gives back the pool's idle events too (as PyTorch's emptyCache synchronizes and
 * frees its events): after a synchronize no queued work can touch a free extent, so their stream
 * tags are dropped and every event no extent refers to is destroyed (its slot stays, to be
 * created again when needed). Called with the lock held; destroys without it. */
static void events_trim(struct msh_pool *pool, bool at_exit)
{
    if (capturing(pool) && !at_exit) {
        pool->empty_deferred = true; /* its synchronize would invalidate the capture */
        return;
    }
    if (pool->free_gen > pool->synced_gen) {
        struct job j;
        job_init(&j);
        job_need_settle(pool, &j);
        job_do(pool, &j);
        job_fini(pool, &j);
    }
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (struct blk *b = r->first; b; b = b->next)
                if (b->state == B_FREE && (b->ns || b->sync_needed) && (blk_clean(pool, b) || at_exit))
                    sref_clear(pool, b); /* at exit nothing is reused: an event still pending may go too */
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++) /* complete after the synchronize */
        if (pool->ks[i].used && (pool->free_gen <= pool->synced_gen || at_exit)) {
            ev_put(pool, pool->ks[i].latest);
            pool->ks[i].latest = NO_EV;
        }
    uint64_t h[64];
    for (;;) {
        int n = 0;
        for (uint32_t e = 0; e < pool->nevs && n < 64; e++)
            if (!pool->evs[e].refs && pool->evs[e].h) {
                h[n++] = pool->evs[e].h;
                pool->evs[e].h = 0;
            }
        if (!n) break;
        pthread_mutex_unlock(&pool->lock);
        for (int i = 0; i < n; i++) ev_destroy(pool, h[i]);
        pthread_mutex_lock(&pool->lock);
    }
}

void msh_pool_release_events(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    events_trim(pool, true);
    pthread_mutex_unlock(&pool->lock);
}

size_t msh_pool_empty_cache(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    size_t n = release_cached(pool, 0, 0);
    events_trim(pool, false);
    pthread_mutex_unlock(&pool->lock);
    return n;
}

size_t msh_pool_trim(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    size_t n = trim_cached(pool);
    pthread_mutex_unlock(&pool->lock);
    return n;
}

void msh_pool_set_gc(struct msh_pool *pool, msh_pool_gc_fn fn, void *arg)
{
    pthread_mutex_lock(&pool->lock);
    pool->gc_fn = fn;
    pool->gc_arg = arg;
    pthread_mutex_unlock(&pool->lock);
}

void msh_pool_set_timing(struct msh_pool *pool, bool on)
{
    pthread_mutex_lock(&pool->lock);
    pool->timing = on;
    pthread_mutex_unlock(&pool->lock);
}

/* Free bytes that could be handed out now without mapping anything, and the largest such run. */
static void scan_free(struct msh_pool *pool, size_t *free_bytes, size_t *largest)
{
    size_t total = 0, best = 0;
    for (int a = 0; a < NAREAS; a++) {
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            uint64_t hi = page_va(pool, r, r->hi_page);
            size_t run = 0;
            for (struct blk *x = r->first; x && x->addr < hi; x = x->next) {
                if (x->state != B_FREE) {
                    run = 0;
                    continue;
                }
                uint64_t end = x->addr + x->size < hi ? x->addr + x->size : hi;
                for (uint64_t a0 = x->addr; a0 < end;) {
                    uint32_t p = (uint32_t)((a0 - r->base) / pool->gran);
                    uint64_t pend = page_va(pool, r, p + 1);
                    if (pend > end) pend = end;
                    uint32_t h = pg_head(&r->pages[p]);
                    if (h != NO_PAGE && r->pages[h].state == PG_MAPPED) {
                        run += pend - a0;
                        total += pend - a0;
                        if (run > best) best = run;
                    } else {
                        run = 0;
                    }
                    a0 = pend;
                }
            }
        }
    }
    *free_bytes = total;
    *largest = best;
}

size_t msh_pool_mapped_bytes(struct msh_pool *pool)
{
    return __atomic_load_n(&pool->held, __ATOMIC_RELAXED) * pool->gran;
}

void msh_pool_get_stats(struct msh_pool *pool, struct msh_pool_stats *out)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.mapped_bytes = pool->held * pool->gran;
    pool->st.handle_bytes = pool->held * pool->gran;
    pool->st.touched_bytes = pool->touched * pool->gran;
    pool->st.handles = pool->nhandles;
    scan_free(pool, &pool->st.free_bytes, &pool->st.largest_free);
    *out = pool->st;
    out->peak_mapped_bytes = __atomic_load_n(&pool->drv_peak_epoch, __ATOMIC_RELAXED);
    out->run_peak_mapped_bytes = __atomic_load_n(&pool->drv_peak_run, __ATOMIC_RELAXED);
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        out->drv_calls[k] = __atomic_load_n(&pool->st.drv_calls[k], __ATOMIC_RELAXED);
        out->drv_bytes[k] = __atomic_load_n(&pool->st.drv_bytes[k], __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&pool->lock);
}

void msh_pool_reset_peaks(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.peak_live_bytes = pool->st.live_bytes;
    __atomic_store_n(&pool->drv_peak_epoch, __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    pool->st.peak_touched_bytes = pool->touched * pool->gran;
    pthread_mutex_unlock(&pool->lock);
}

static void fill_oom(struct msh_pool *pool, size_t req, size_t dev_free, size_t dev_total)
{
    struct msh_pool_oom *o = &pool->oom;
    memset(o, 0, sizeof *o);
    o->requested = req;
    o->device_free = dev_free;
    o->device_total = dev_total;
    o->live_bytes = pool->st.live_bytes;
    o->mapped_bytes = pool->held * pool->gran;
    o->limit_bytes = limit_now(pool);
    size_t fb = 0;
    scan_free(pool, &fb, &o->largest_free);
    size_t cap = o->limit_bytes ? o->limit_bytes : (o->mapped_bytes + o->device_free);
    o->fragmentation = o->live_bytes + req <= cap;
    for (size_t i = 0; i < pool->hcap; i++) {
        for (struct blk *b = pool->htab[i]; b; b = b->hnext) {
            int k = o->ntop;
            if (k < 5) o->ntop++;
            else if (b->req <= o->top[4].size) continue;
            else k = 4;
            while (k > 0 && o->top[k - 1].size < b->req) {
                o->top[k] = o->top[k - 1];
                k--;
            }
            o->top[k].addr = b->addr;
            o->top[k].size = b->req;
        }
    }
}

void msh_pool_last_oom(struct msh_pool *pool, struct msh_pool_oom *out)
{
    pthread_mutex_lock(&pool->lock);
    *out = pool->oom;
    pthread_mutex_unlock(&pool->lock);
}

void msh_pool_for_each_live(struct msh_pool *pool,
                            void (*fn)(void *arg, uint64_t addr, size_t size, uint64_t stream),
                            void *arg)
{
    pthread_mutex_lock(&pool->lock);
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b; b = b->hnext)
            fn(arg, b->addr, b->req, b->ns ? b->s[0].stream : MSH_STREAM_COMPLETED);
    pthread_mutex_unlock(&pool->lock);
}

/* ---- learning the step (docs/pool.md, "Steady state at tight capacity") ------------------------
 * Training repeats one step. The pool logs every allocation and free, and keeps a hash of the
 * live set (XOR over live blocks of their address and size). When an allocation starts from a
 * live set seen before, with the same size as the allocation that followed it then, the events
 * in between are a candidate step. If that step had to remap (unmap_ops grew during it: it does
 * not fit in what the pool may hold when placed best-fit online), the pool packs the step's
 * blocks offline, knowing every lifetime (greedy, lowest address first, three orders tried),
 * keeps blocks that outlive the step where they are, and, when the packed step needs no more
 * pages than the pool may hold, places the next steps' allocations where the plan says. Each
 * allocation checks the plan: another size, or a planned range that is not free, drops the plan
 * and placement goes back to best fit (the step changed). Pages the plan uses are reclaimed
 * last. The packing runs without the lock, on a copy of the log. */

#define STEP_LOG (1u << 18)     /* events kept: steps up to this many events can be learned */
#define STEP_ANCHORS (1u << 14)
#define STEP_MIN_ALLOCS 16      /* shorter repeats are loops the cache already serves */
#define STEP_MAX_MOVABLE 40000  /* the packing is quadratic in the blocks it moves */

struct slog {
    uint64_t addr, size; /* where the block was placed, its VA bytes */
    uint64_t ref;        /* alloc: unused; free: serial of the allocation freed */
    uint8_t op;          /* 0 alloc, 1 free */
    uint8_t pad[7];
};

struct anchor {
    uint64_t h, serial, reclaims, size;
};

struct pent {
    uint64_t addr, size;
    int area;
};

struct fprun {
    struct region *r;
    uint32_t p0, p1;
};

struct step {
    struct slog *log;
    uint64_t n;            /* events logged: the next serial */
    uint64_t hstate;       /* hash of the live set */
    struct anchor *anchors;
    struct pent *plan;     /* the learned step: where each of its allocations goes */
    size_t nplan, capplan;
    uint64_t plan_h;       /* live-set hash at the step's start */
    size_t cursor;         /* next plan entry (nplan: the step is complete) */
    bool active;
    /* The plan was dropped at its own boundary (it had placed its whole step, and what came next
     * was not its step again: a pass of the replay ended, an evaluation step ran...): it is
     * resumed when its boundary comes back (the live set it starts from and its first size). */
    bool resumable;
    uint64_t plan_pages;   /* its footprint, checked against the limit on resuming */
    bool want;             /* the allocation being served has a planned address */
    uint64_t want_addr;
    int want_area;
    struct fprun *fp;      /* the plan's footprint, to clear its page flags */
    size_t nfp, capfp;
    uint64_t quiet_until;  /* no packing before this serial: one try per step length */
    /* A step of about this length did not pack into this budget: steps of about the same length
     * wait 64, 128... step lengths (up to 1024) before the next try, unless the budget changes
     * (the packing of a step hardly depends on where its blocks were). Other steps are tried. */
    uint32_t fails;
    uint64_t fail_len, fail_budget, fail_until;
    /* The planner: a thread of the pool's own, started when the first step is worth packing,
     * packs a snapshot taken under the lock while allocations go on; the plan is switched to at
     * the next step boundary (plan_install). Every field below is read and written under the
     * pool lock, except the snapshot while the job runs (the planner's alone). */
    int job;                 /* PJ_IDLE, PJ_QUEUED, PJ_RUNNING, PJ_DONE (a plan waits for a boundary) */
    struct psnap *snap;      /* queued or running: the planner's input */
    struct pinput *res;      /* done: the packed step */
    uint64_t res_pages;      /* its footprint */
    uint64_t res_h0, res_first; /* its boundary: the live-set hash, the size of the first allocation */
    uint64_t res_until;      /* a boundary that has not come by this serial will not: the step changed */
    pthread_t worker;
    bool worker_on, worker_failed, stop;
    pthread_cond_t wake;     /* the planner waits for a job */
};
enum { PJ_IDLE = 0, PJ_QUEUED, PJ_RUNNING, PJ_DONE };

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static inline uint64_t blk_hash(uint64_t addr, uint64_t size)
{
    return mix64(addr * 0x9E3779B97F4A7C15ull + size);
}

static void step_create(struct msh_pool *pool)
{
    struct step *s = raw_alloc(sizeof *s);
    if (!s) return;
    s->log = raw_alloc((size_t)STEP_LOG * sizeof *s->log);
    s->anchors = raw_alloc((size_t)STEP_ANCHORS * sizeof *s->anchors);
    if (!s->log || !s->anchors) {
        raw_free(s->log, (size_t)STEP_LOG * sizeof *s->log);
        raw_free(s->anchors, (size_t)STEP_ANCHORS * sizeof *s->anchors);
        raw_free(s, sizeof *s);
        return;
    }
    pthread_cond_init(&s->wake, NULL);
    pool->step = s;
}

static void snap_free(struct psnap *sn);
static void pin_free(struct pinput *in);

/* Stop the planner (it ends the packing under way first) and wait for it. Without the lock. */
static void step_stop(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (!s) return;
    pthread_mutex_lock(&pool->lock);
    s->stop = true;
    pthread_cond_broadcast(&s->wake);
    bool on = s->worker_on;
    s->worker_on = false;
    pthread_mutex_unlock(&pool->lock);
    if (on) pthread_join(s->worker, NULL);
}

static void step_destroy(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (!s) return;
    raw_free(s->log, (size_t)STEP_LOG * sizeof *s->log);
    raw_free(s->anchors, (size_t)STEP_ANCHORS * sizeof *s->anchors);
    raw_free(s->plan, s->capplan * sizeof *s->plan);
    raw_free(s->fp, s->capfp * sizeof *s->fp);
    snap_free(s->snap);
    pin_free(s->res);
    pthread_cond_destroy(&s->wake);
    raw_free(s, sizeof *s);
    pool->step = NULL;
}

/* A step of about this length (within 1/64) already failed to pack into this budget lately. */
static bool step_failed_before(const struct step *s, uint64_t len, size_t budget)
{
    uint64_t d = len > s->fail_len ? len - s->fail_len : s->fail_len - len;
    return s->fails && d <= s->fail_len / 64 && budget == s->fail_budget && s->n < s->fail_until;
}

static bool step_want(const struct step *s, uint64_t addr)
{
    return s->want && s->want_addr == addr;
}

static void step_drop(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (s->active) pool->st.plan_dropped++;
    if (s->active) msh_debug("pool: learned step dropped at event %llu (allocation %zu of %zu)", (unsigned long long)s->n, s->cursor, s->nplan);
    s->resumable = s->active && s->cursor == s->nplan;
    s->active = false;
    s->want = false;
}

static void step_note_alloc(struct msh_pool *pool, struct blk *b)
{
    struct step *s = pool->step;
    b->serial = s->n + 1; /* 0: not logged */
    s->log[s->n % STEP_LOG] = (struct slog){.addr = b->addr, .size = b->size, .op = 0};
    s->n++;
    s->hstate ^= blk_hash(b->addr, b->size);
    if (s->want) {
        if (b->addr == s->want_addr) pool->st.plan_placed++;
        s->want = false;
        s->cursor++;
    }
}

static void step_note_free(struct msh_pool *pool, struct blk *b)
{
    struct step *s = pool->step;
    s->log[s->n % STEP_LOG] = (struct slog){.addr = b->addr, .size = b->size, .ref = b->serial, .op = 1};
    s->n++;
    s->hstate ^= blk_hash(b->addr, b->size);
}

/* The plan's address for this allocation, when a plan is active and it matches. */
static struct blk *plan_place(struct msh_pool *pool, uint64_t rsize)
{
    struct step *s = pool->step;
    if (!s->want) return NULL;
    /* the plan's area: a plan packed across areas may put a block in the other area's pages */
    struct blk *b = atreap_floor(pool->atree[s->want_area], s->want_addr);
    if (!b || b->addr + b->size < s->want_addr + rsize) {
        step_drop(pool); /* the planned range is not free: the step changed */
        return NULL;
    }
    struct blk *c = carve_at(pool, b, s->want_addr, rsize);
    if (!c) step_drop(pool);
    return c;
}

/* ---- the packing (no lock held; works on a copy) ---- */

struct pitem {
    uint64_t addr, size;  /* planned (movable) or fixed address */
    uint64_t prev;        /* where the last step had it; 0: nowhere mapped now */
    uint32_t t0, t1;      /* alive over events [t0, t1) of the step */
    int32_t reg;          /* index into the region table */
    uint8_t fixed;
    uint8_t hole;         /* unmapped pages kept out of the plan (not part of its footprint) */
    uint32_t order;       /* allocation order within the step (movable and pinned), or UINT32_MAX */
};

struct pregion {
    uint64_t base, size;
    struct region *r;
    int sr;               /* its index in the snapshot */
};

struct pinput {
    struct pitem *it;
    size_t n, cap;
    struct pregion reg[64];
    int nreg;
    uint32_t len;         /* events in the step */
    size_t nalloc;        /* allocations in the step (plan entries) */
    uint64_t gran;
    uint64_t budget;      /* pages the plan may use */
    bool prefer_prev;     /* a block goes back where it was when that is still free */
    bool keep_mapped;     /* blocks in mapped pages stay (fixed): few are packed */
    bool across;          /* every region is one line: a block may go to another area's pages */
    bool search;          /* when the fixed orders miss the budget, try perturbed size orders (pack_search) */
    uint64_t work;        /* placement steps done by pack_region (bounds the search) */
};

static int cmp_u64pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

/* Pages touched by the items of region g (planned addresses), counted once each. */
static uint64_t footprint_pages(const struct pinput *in, int g, uint64_t (*iv)[2])
{
    size_t k = 0;
    for (size_t i = 0; i < in->n; i++) {
        if (in->it[i].reg != g || in->it[i].hole) continue;
        iv[k][0] = (in->it[i].addr - in->reg[g].base) / in->gran;
        iv[k][1] = (in->it[i].addr + in->it[i].size - 1 - in->reg[g].base) / in->gran;
        k++;
    }
    qsort(iv, k, sizeof *iv, cmp_u64pair);
    uint64_t pages = 0, hi = 0;
    bool any = false;
    for (size_t i = 0; i < k; i++) {
        uint64_t a = iv[i][0], e = iv[i][1];
        if (any && a <= hi) {
            if (e > hi) {
                pages += e - hi;
                hi = e;
            }
        } else {
            pages += e - a + 1;
            hi = e;
            any = true;
        }
    }
    return pages;
}

struct sort_ctx {
    const struct pitem *items;
    int key;
    const uint64_t *pkey; /* key 3: a perturbed size per item */
};

/* Packing orders, largest first: by size, by size x lifetime, by lifetime. (qsort_r: two pools
 * may pack at once.) */
static int cmp_order(const void *a, const void *b, void *arg)
{
    const struct sort_ctx *c = arg;
    const struct pitem *x = &c->items[*(const uint32_t *)a], *y = &c->items[*(const uint32_t *)b];
    uint64_t kx, ky;
    if (c->key == 0) kx = x->size, ky = y->size;
    else if (c->key == 1) kx = x->size * (x->t1 - x->t0), ky = y->size * (y->t1 - y->t0);
    else if (c->key == 2) kx = x->t1 - x->t0, ky = y->t1 - y->t0;
    else kx = c->pkey[x - c->items], ky = c->pkey[y - c->items];
    if (kx != ky) return kx > ky ? -1 : 1;
    if (x->t0 != y->t0) return x->t0 < y->t0 ? -1 : 1;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static int cmp_addr(const void *a, const void *b, void *arg)
{
    const struct pitem *it = arg;
    uint64_t x = it[*(const uint32_t *)a].addr, y = it[*(const uint32_t *)b].addr;
    return x < y ? -1 : x > y;
}

/* Greedy packing of the movable items of region g (g < 0: of every region, which then form one
 * line in address order, an item going to whichever region has room) in the given order: each at
 * the lowest address where it overlaps no placed item alive at the same time (with prefer_prev:
 * where it was, when that is still free). Placed items are kept sorted by address, so a search
 * stops at the first gap and an insertion is a binary search and a move. Returns the footprint in
 * pages, or UINT64_MAX when an item does not fit. */
static uint64_t pack_region(struct pinput *in, int g, const uint32_t *order, size_t nmov, uint32_t *placed,
                            uint64_t (*tmp)[2])
{
    struct pitem *it = in->it;
    size_t np = 0;
    for (size_t i = 0; i < in->n; i++)
        if ((g < 0 || it[i].reg == g) && it[i].fixed) placed[np++] = (uint32_t)i;
    qsort_r(placed, np, sizeof *placed, cmp_addr, it);
    int line[64], nl = 0; /* the regions of the line, by address */
    for (int i = 0; i < in->nreg; i++) {
        if (g >= 0 && i != g) continue;
        int k = nl++;
        for (; k > 0 && in->reg[line[k - 1]].base > in->reg[i].base; k--) line[k] = line[k - 1];
        line[k] = i;
    }
    if (!nl) return nmov ? UINT64_MAX : 0;
    for (size_t k = 0; k < nmov; k++) {
        struct pitem *x = &it[order[k]];
        int li = 0;
        uint64_t cand = in->reg[line[0]].base;
        bool at_prev = false;
        if (in->prefer_prev && x->prev) {
            bool clash = false;
            for (size_t q = 0; q < np && !clash && it[placed[q]].addr < x->prev + x->size; q++) {
                const struct pitem *y = &it[placed[q]];
                clash = y->addr + y->size > x->prev && y->t0 < x->t1 && x->t0 < y->t1;
            }
            for (int i = 0; !clash && i < nl; i++)
                if (x->prev >= in->reg[line[i]].base && x->prev < in->reg[line[i]].base + in->reg[line[i]].size) {
                    cand = x->prev;
                    li = i;
                    at_prev = true;
                }
        }
        for (size_t q = 0; !at_prev;) {
            const struct pregion *rg = &in->reg[line[li]];
            if (cand + x->size > rg->base + rg->size) { /* past this region's end: the next one */
                if (++li == nl) return UINT64_MAX;
                cand = in->reg[line[li]].base;
                continue;
            }
            if (q == np) break;
            const struct pitem *y = &it[placed[q]];
            if (y->addr >= cand + x->size) break; /* sorted by address: the gap is free of the rest */
            q++;
            in->work++;
            if (y->t0 >= x->t1 || x->t0 >= y->t1 || y->addr + y->size <= cand) continue;
            cand = y->addr + y->size;
        }
        x->addr = cand;
        x->reg = line[li];
        size_t lo = 0, hi = np; /* insert after every item at or below cand */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (it[placed[mid]].addr <= cand) lo = mid + 1;
            else hi = mid;
        }
        memmove(&placed[lo + 1], &placed[lo], (np - lo) * sizeof *placed);
        placed[lo] = order[k];
        np++;
        in->work += 1 + (np - lo) / 16;
    }
    uint64_t pages = 0;
    for (int i = 0; i < nl; i++) pages += footprint_pages(in, line[i], tmp);
    in->work += np * 16; /* the sorts of the footprint and of the order */
    return pages;
}

#define SEARCH_TRIES 256         /* perturbed orders tried per region at most */
#define SEARCH_WORK (1ull << 27)  /* and placement steps (pack_region's in->work) per region */
#define SEARCH_PATIENCE 32       /* and tries in a row that do not lower the pages */
#define SEARCH_MAX_ALLOCS 1024   /* steps of more allocations are not searched (see pack_search) */

/* The movable items of region g (g < 0: of every region) into order; their count. */
static size_t pack_movable(const struct pinput *in, int g, uint32_t *order)
{
    size_t nmov = 0;
    for (size_t i = 0; i < in->n; i++)
        if ((g < 0 || in->it[i].reg == g) && !in->it[i].fixed) order[nmov++] = (uint32_t)i;
    return nmov;
}

/* The greedy packing of a step is a heuristic for an NP-hard problem (dynamic storage
 * allocation), and its three fixed orders can miss a budget that an order close to them meets:
 * on the synthetic offload traces (docs/benchmarks.md) the best fixed order needs 2% to 7% more
 * pages than the limit allows at C+1%, while some order fits. So, when the last packing (anew,
 * anywhere) misses the budget with its fixed orders too, the size order is perturbed (each size scaled by a factor in
 * [0.7, 1.3] drawn from a fixed-seed generator: the same step always packs the same way) and
 * region g is packed again, keeping the best, until the whole step fits, SEARCH_PATIENCE tries in
 * a row win nothing, or SEARCH_TRIES / SEARCH_WORK run out. Only steps of at most
 * SEARCH_MAX_ALLOCS allocations are searched: each try is a full packing (quadratic in the
 * blocks), and on the real traces' steps of 1500 to 8000 allocations the tries found a fit on
 * two only (at C), where the switch to the plan then cost more in pass 2 than best fit did
 * (docs/pool.md). *pages (region g's best) and *total (every region) are updated. */
static void pack_search(struct pinput *in, int g, uint32_t *order, uint32_t *placed, uint64_t (*tmp)[2],
                        uint64_t *best, int32_t *best_reg, uint64_t *pkey, uint64_t *pages, uint64_t *total)
{
    size_t nmov = pack_movable(in, g, order);
    if (!nmov) return;
    uint64_t rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)nmov, w0 = in->work, once = 0;
    for (size_t i = 0; i < nmov; i++) {
        best[order[i]] = in->it[order[i]].addr;
        best_reg[order[i]] = in->it[order[i]].reg;
    }
    for (int k = 0, since = 0; k < SEARCH_TRIES && since < SEARCH_PATIENCE && *total > in->budget; k++, since++) {
        if (in->work - w0 + once > SEARCH_WORK) break; /* the next try would pass the bound */
        uint64_t w1 = in->work;
        for (size_t i = 0; i < nmov; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            pkey[order[i]] = in->it[order[i]].size / 1000 * (700 + rng % 601);
        }
        struct sort_ctx ctx = {.items = in->it, .key = 3, .pkey = pkey};
        qsort_r(order, nmov, sizeof *order, cmp_order, &ctx);
        uint64_t p = pack_region(in, g, order, nmov, placed, tmp);
        if (in->work - w1 > once) once = in->work - w1;
        if (p < *pages) {
            since = -1;
            *total -= *pages - p;
            *pages = p;
            for (size_t i = 0; i < nmov; i++) {
                best[order[i]] = in->it[order[i]].addr;
                best_reg[order[i]] = in->it[order[i]].reg;
            }
        }
    }
    for (size_t i = 0; i < nmov; i++) {
        in->it[order[i]].addr = best[order[i]];
        in->it[order[i]].reg = best_reg[order[i]];
    }
}

/* Pack every region with up to three orders and keep the best per region (with one region, or
 * with every region as one line, the first order that fits the budget ends the search); with
 * in->search, then perturbed orders while the total misses the budget (pack_search). Returns the
 * total pages, or UINT64_MAX when something does not fit. */
static uint64_t pack_all(struct pinput *in)
{
    size_t n = in->n;
    uint32_t *order = raw_alloc((n + 1) * sizeof *order);
    uint32_t *placed = raw_alloc((n + 1) * sizeof *placed);
    uint64_t (*tmp)[2] = raw_alloc((n + 1) * sizeof *tmp);
    uint64_t *best = raw_alloc((n + 1) * sizeof *best);
    int32_t *best_reg = raw_alloc((n + 1) * sizeof *best_reg);
    uint64_t regp[64];
    uint64_t total = 0;
    if (!order || !placed || !tmp || !best || !best_reg) {
        total = UINT64_MAX;
        goto out;
    }
    int g0 = in->across ? -1 : 0, g1 = in->across ? 0 : in->nreg;
    for (int g = g0; g < g1 && total != UINT64_MAX; g++) {
        size_t nmov = pack_movable(in, g, order);
        if (nmov > STEP_MAX_MOVABLE) {
            total = UINT64_MAX;
            break;
        }
        uint64_t bestp = UINT64_MAX;
        /* packings that keep blocks near where they were try the size order only */
        int nkeys = in->prefer_prev || in->keep_mapped ? 1 : 3;
        for (int key = 0; key < nkeys; key++) {
            struct sort_ctx ctx = {.items = in->it, .key = key};
            qsort_r(order, nmov, sizeof *order, cmp_order, &ctx);
            uint64_t p = pack_region(in, g, order, nmov, placed, tmp);
            if (p < bestp) {
                bestp = p;
                for (size_t i = 0; i < nmov; i++) {
                    best[order[i]] = in->it[order[i]].addr;
                    best_reg[order[i]] = in->it[order[i]].reg;
                }
            }
            if ((in->nreg == 1 || g < 0) && bestp <= in->budget) break; /* fits: the other orders only cost time */
        }
        if (bestp == UINT64_MAX) {
            total = UINT64_MAX;
            break;
        }
        for (size_t k = 0; k < nmov; k++) {
            in->it[order[k]].addr = best[order[k]];
            in->it[order[k]].reg = best_reg[order[k]];
        }
        regp[g < 0 ? 0 : g] = bestp;
        total += bestp;
    }
    if (in->search && total != UINT64_MAX && total > in->budget) {
        uint64_t *pkey = raw_alloc((n + 1) * sizeof *pkey);
        bool done[64] = {false};
        /* the region needing the most pages first: it holds nearly all the slack there is to win */
        for (int r = g0; pkey && r < g1 && total > in->budget; r++) {
            int g = -1;
            if (!in->across)
                for (int i = 0; i < in->nreg; i++)
                    if (!done[i] && (g < 0 || regp[i] > regp[g])) g = i;
            if (g >= 0) done[g] = true;
            pack_search(in, g, order, placed, tmp, best, best_reg, pkey, &regp[g < 0 ? 0 : g], &total);
        }
        raw_free(pkey, (n + 1) * sizeof *pkey);
    }
out:
    raw_free(order, (n + 1) * sizeof *order);
    raw_free(placed, (n + 1) * sizeof *placed);
    raw_free(tmp, (n + 1) * sizeof *tmp);
    raw_free(best, (n + 1) * sizeof *best);
    raw_free(best_reg, (n + 1) * sizeof *best_reg);
    return total;
}

static bool pin_push(struct pinput *in, struct pitem it)
{
    if (in->n == in->cap) {
        void *v = in->it;
        uint32_t cap = (uint32_t)in->cap;
        if (!arr_grow(&v, &cap, sizeof *in->it, NULL)) return false;
        in->it = v;
        in->cap = cap;
    }
    in->it[in->n++] = it;
    return true;
}

/* What the planner packs, copied under the lock at a step boundary so that the packing needs
 * neither the lock nor the pool: the step's events, the live set, and which pages are mapped. */
struct psreg {
    uint64_t base, size;
    struct region *r;    /* regions live as long as the pool: plan_mark() uses it under the lock */
    uint32_t hi_page;
    const uint8_t *mapped; /* [hi_page]: 1 where a handle is mapped */
};

struct psnap {
    uint64_t t0, t1, h0;  /* the step's events [t0, t1); the live-set hash at its start */
    uint64_t gran, budget;
    size_t cap;           /* cap_pages() then (SIZE_MAX: no limit), for the back-off after a failure */
    struct slog *ev;      /* [t1 - t0] */
    struct pent *live;    /* the live set at the boundary (address, VA size) */
    size_t nlive;
    struct psreg reg[64];
    int nreg;
    uint8_t *maps;        /* every region's mapped[] */
    size_t nmaps;
};

static void snap_free(struct psnap *sn)
{
    if (!sn) return;
    raw_free(sn->ev, (size_t)(sn->t1 - sn->t0) * sizeof *sn->ev);
    raw_free(sn->live, (sn->nlive + 1) * sizeof *sn->live);
    raw_free(sn->maps, sn->nmaps + 1);
    raw_free(sn, sizeof *sn);
}

static void pin_free(struct pinput *in)
{
    if (!in) return;
    raw_free(in->it, in->cap * sizeof *in->it);
    raw_free(in, sizeof *in);
}

/* Under the lock: copy what the planner needs (O(step events + live blocks + pages mapped so far);
 * no packing). NULL when memory ran out. */
static struct psnap *snap_take(struct msh_pool *pool, uint64_t t0, uint64_t t1, uint64_t h0, uint64_t budget)
{
    struct step *s = pool->step;
    struct psnap *sn = raw_alloc(sizeof *sn);
    if (!sn) return NULL;
    *sn = (struct psnap){.t0 = t0, .t1 = t1, .h0 = h0, .gran = pool->gran, .budget = budget, .nlive = pool->hcount};
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            if (sn->nreg < 64) {
                sn->reg[sn->nreg++] = (struct psreg){.base = r->base, .size = r->size, .r = r, .hi_page = r->hi_page};
                sn->nmaps += r->hi_page;
            }
    sn->ev = raw_alloc((size_t)(t1 - t0) * sizeof *sn->ev);
    sn->live = raw_alloc((sn->nlive + 1) * sizeof *sn->live);
    sn->maps = raw_alloc(sn->nmaps + 1);
    if (!sn->ev || !sn->live || !sn->maps) {
        snap_free(sn);
        return NULL;
    }
    /* the window is contiguous in the ring but for one wrap */
    uint64_t k0 = t0 % STEP_LOG, n = t1 - t0, first = n < STEP_LOG - k0 ? n : STEP_LOG - k0;
    memcpy(sn->ev, &s->log[k0], first * sizeof *sn->ev);
    memcpy(sn->ev + first, s->log, (n - first) * sizeof *sn->ev);
    size_t k = 0;
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b && k < sn->nlive; b = b->hnext) sn->live[k++] = (struct pent){.addr = b->addr, .size = b->size};
    sn->nlive = k;
    uint8_t *m = sn->maps;
    for (int g = 0; g < sn->nreg; g++) {
        const struct region *r = sn->reg[g].r;
        for (uint32_t p = 0; p < sn->reg[g].hi_page; p++) m[p] = r->pages[p].hd != 0;
        sn->reg[g].mapped = m;
        m += sn->reg[g].hi_page;
    }
    return sn;
}

static int region_index(const struct psnap *sn, struct pinput *in, uint64_t addr)
{
    for (int g = 0; g < in->nreg; g++)
        if (addr >= in->reg[g].base && addr < in->reg[g].base + in->reg[g].size) return g;
    for (int i = 0; i < sn->nreg; i++)
        if (addr >= sn->reg[i].base && addr < sn->reg[i].base + sn->reg[i].size && in->nreg < 64) {
            in->reg[in->nreg] = (struct pregion){.base = sn->reg[i].base, .size = sn->reg[i].size, .r = sn->reg[i].r, .sr = i};
            return in->nreg++;
        }
    return -1;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Whether every page of [addr, addr + size) in region g was mapped at the snapshot. */
static bool range_mapped(const struct psnap *sn, const struct pinput *in, int g, uint64_t addr, uint64_t size)
{
    const struct psreg *r = &sn->reg[in->reg[g].sr];
    uint64_t p0 = (addr - r->base) / sn->gran, p1 = (addr + size - 1 - r->base) / sn->gran;
    for (uint64_t p = p0; p <= p1; p++)
        if (p >= r->hi_page || !r->mapped[p]) return false;
    return true;
}

/* The step's blocks with their lifetimes, from the snapshot's events and live set (which is the
 * step's starting live set); no lock needed. With keep, the blocks the last step placed in pages
 * that were mapped stay where they were. With holes, unmapped pages below the top of each region
 * are obstacles, so that blocks are packed into mapped free space first and the first planned
 * step maps little; with holes > 1 every unmapped page is (the plan maps nothing), and every
 * region of the pool is part of the line (a block may go to mapped pages of the other area: at the
 * end of a step under pressure one area often holds most of the mapped pages). */
static bool plan_input(const struct psnap *sn, bool keep, int holes, struct pinput *in)
{
    uint32_t len = (uint32_t)(sn->t1 - sn->t0);
    uint32_t *idx = raw_alloc((size_t)len * sizeof *idx);
    uint64_t *prefree = raw_alloc((size_t)len * sizeof *prefree);
    size_t npre = 0;
    bool ok = idx && prefree;
    in->len = len;
    in->gran = sn->gran;
    in->budget = sn->budget;
    in->across = holes > 1;
    for (int i = 0; in->across && i < sn->nreg; i++) region_index(sn, in, sn->reg[i].base);
    for (uint32_t t = 0; ok && t < len; t++) {
        const struct slog *e = &sn->ev[t];
        if (e->op == 0) {
            int g = region_index(sn, in, e->addr);
            idx[t] = (uint32_t)in->n;
            ok = g >= 0 && pin_push(in, (struct pitem){.addr = e->addr, .size = e->size, .t0 = t, .t1 = len,
                                                       .reg = g, .order = (uint32_t)in->nalloc});
            in->nalloc++;
        } else if (e->ref > sn->t0 && e->ref <= sn->t1) { /* freed inside the step: movable */
            uint32_t ai = idx[e->ref - 1 - sn->t0];
            in->it[ai].t1 = t;
        } else { /* alive when the step began, freed during it */
            int g = region_index(sn, in, e->addr);
            ok = g >= 0 && pin_push(in, (struct pitem){.addr = e->addr, .size = e->size, .t0 = 0, .t1 = t,
                                                       .reg = g, .fixed = 1, .order = UINT32_MAX});
            prefree[npre++] = e->addr;
        }
    }
    for (size_t i = 0; ok && i < in->n; i++)
        if (!in->it[i].fixed && range_mapped(sn, in, in->it[i].reg, in->it[i].addr, in->it[i].size))
            in->it[i].prev = in->it[i].addr;
    /* allocations still alive at the end keep their place (they are the next step's start) */
    for (size_t i = 0; ok && i < in->n; i++)
        if (!in->it[i].fixed && (in->it[i].t1 == len || (keep && in->it[i].prev)))
            in->it[i].fixed = 1;
    for (int g = 0; ok && holes && g < in->nreg; g++) {
        const struct psreg *r = &sn->reg[in->reg[g].sr];
        for (uint32_t p = 0; ok && p < r->hi_page;) {
            if (r->mapped[p]) {
                p++;
                continue;
            }
            uint32_t e = p;
            while (e < r->hi_page && !r->mapped[e]) e++;
            ok = pin_push(in, (struct pitem){.addr = r->base + (uint64_t)p * sn->gran, .size = (uint64_t)(e - p) * sn->gran,
                                             .t0 = 0, .t1 = len, .reg = g, .fixed = 1, .hole = 1, .order = UINT32_MAX});
            p = e;
        }
        uint64_t top = r->base + (uint64_t)r->hi_page * sn->gran;
        if (ok && holes > 1 && top < r->base + r->size)
            ok = pin_push(in, (struct pitem){.addr = top, .size = r->base + r->size - top, .t0 = 0, .t1 = len,
                                             .reg = g, .fixed = 1, .hole = 1, .order = UINT32_MAX});
    }
    /* live blocks not freed during the step sit there throughout */
    qsort(prefree, npre, sizeof *prefree, cmp_u64);
    for (size_t i = 0; ok && i < sn->nlive; i++) {
        if (bsearch(&sn->live[i].addr, prefree, npre, sizeof *prefree, cmp_u64)) continue;
        int g = region_index(sn, in, sn->live[i].addr);
        if (g < 0) continue;
        ok = pin_push(in, (struct pitem){.addr = sn->live[i].addr, .size = sn->live[i].size, .t0 = 0, .t1 = len, .reg = g,
                                         .fixed = 1, .order = UINT32_MAX});
    }
    raw_free(idx, (size_t)len * sizeof *idx);
    raw_free(prefree, (size_t)len * sizeof *prefree);
    return ok;
}

/* Mark the plan's footprint (PLAN_PAGE) and move cached handles to the list they now belong to. */
static void fp_add(struct msh_pool *pool, struct region *r, uint32_t p0, uint32_t p1)
{
    struct step *s = pool->step;
    if (s->nfp == s->capfp) {
        void *v = s->fp;
        uint32_t cap = (uint32_t)s->capfp;
        if (!arr_grow(&v, &cap, sizeof *s->fp, NULL)) return; /* not in the footprint: only reclaimed sooner */
        s->fp = v;
        s->capfp = cap;
    }
    for (uint32_t p = p0; p <= p1; p++) r->pages[p].plan |= PLAN_PAGE;
    s->fp[s->nfp++] = (struct fprun){.r = r, .p0 = p0, .p1 = p1};
}

static void plan_mark(struct msh_pool *pool, const struct pinput *in, uint64_t pages)
{
    struct step *s = pool->step;
    for (size_t i = 0; i < s->nfp; i++)
        for (uint32_t p = s->fp[i].p0; p <= s->fp[i].p1; p++) s->fp[i].r->pages[p].plan &= ~PLAN_PAGE;
    s->nfp = 0;
    for (size_t i = 0; i < in->n; i++) {
        const struct pitem *x = &in->it[i];
        if (x->hole) continue;
        struct region *r = in->reg[x->reg].r;
        fp_add(pool, r, (uint32_t)((x->addr - r->base) / pool->gran), (uint32_t)((x->addr + x->size - 1 - r->base) / pool->gran));
    }
    /* A mapped handle partly in the footprint would be re-partitioned (unmapped and mapped again)
     * the first time a planned block touches it: when the budget allows, its other pages join the
     * footprint, and the handle is used as it is. */
    uint64_t extra = 0;
    for (int pass = 0; pass < 2 && (!pass || (extra && pages + extra <= in->budget)); pass++)
        for (int a = 0; a < NAREAS; a++)
            for (struct region *r = pool->areas[a]; r; r = r->next)
                for (uint32_t p = 0; p < r->hi_page;) {
                    const struct page *hp = &r->pages[p];
                    if (pg_head(hp) != p) {
                        p++;
                        continue;
                    }
                    uint32_t m = 0;
                    for (uint32_t q = p; q < p + hp->npages; q++) m += (r->pages[q].plan & PLAN_PAGE) != 0;
                    if (m && m < hp->npages) {
                        if (!pass) extra += hp->npages - m;
                        else fp_add(pool, r, p, p + hp->npages - 1);
                    }
                    p += hp->npages;
                }
    /* re-file cached handles: in the footprint if any of their pages is */
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (int l = 0; l < 2; l++) {
                uint32_t h = r->chead[l];
                while (h != NO_PAGE) {
                    uint32_t nx = r->pages[h].cnext;
                    uint8_t want = 0;
                    for (uint32_t q = h; q < h + r->pages[h].npages; q++) want |= r->pages[q].plan & PLAN_PAGE;
                    if ((want != 0) != (l == 1)) {
                        uint32_t ct = r->pages[h].ctime;
                        cache_remove(pool, r, h);
                        r->pages[h].plan = (uint8_t)((r->pages[h].plan & PLAN_PAGE) | (want ? PLAN_LIST : 0));
                        cache_add(pool, r, h);
                        r->pages[h].ctime = ct;
                    }
                    h = nx;
                }
            }
}

/* ---- the planner ---- */

/* Packings tried in turn, the smallest change first: in mapped pages only (the switch maps
 * nothing): keep every block that sits in mapped pages, or pack the whole step anew; then with
 * unmapped pages above the top of each region allowed: keep, put blocks back where they were when
 * still free, pack anew; last, pack anew anywhere. The first that fits wins (the greedy packings
 * are heuristics: one that keeps blocks where they are sometimes fits where packing anew does not). */
static const struct { bool keep; int holes; bool near; const char *what; } plan_ways[] = {
    {true, 2, false, "keeping what is mapped, in mapped pages only"},
    {false, 2, false, "anew, in mapped pages only"},
    {true, 1, false, "keeping what is mapped"},
    {false, 1, true, "near the last step, in mapped pages"},
    {false, 1, false, "anew, in mapped pages"},
    {false, 0, false, "anew"},
};
enum { NWAYS = sizeof plan_ways / sizeof plan_ways[0] };

/* Pack a snapshot (no lock, no pool): the packed input, or NULL with *failed when no packing fits
 * the budget (NULL alone: too short a step, or memory ran out). */
static struct pinput *plan_pack(const struct psnap *sn, uint64_t *pages, bool *failed)
{
    for (int w = 0; w < NWAYS; w++) {
        struct pinput *in = raw_alloc(sizeof *in);
        if (!in) return NULL;
        memset(in, 0, sizeof *in);
        if (!plan_input(sn, plan_ways[w].keep, plan_ways[w].holes, in) || in->nalloc < STEP_MIN_ALLOCS) {
            pin_free(in);
            return NULL;
        }
        in->prefer_prev = plan_ways[w].near;
        in->keep_mapped = plan_ways[w].keep;
        /* the last resort (anew, anywhere) goes on to perturbed orders (pack_search) when its
         * fixed orders miss the budget too, on steps short enough for the extra packings to cost
         * milliseconds; whenever a fixed order fits, the plan is the one it was without them */
        bool search = w == NWAYS - 1 && in->nalloc <= SEARCH_MAX_ALLOCS;
        in->search = search;
        *pages = pack_all(in);
        msh_debug("pool: step of %zu allocations packed %s%s: %llu pages of %llu", in->nalloc, plan_ways[w].what,
                  search ? " (perturbed orders allowed)" : "", (unsigned long long)*pages, (unsigned long long)in->budget);
        if (*pages <= in->budget) return in;
        pin_free(in);
    }
    *failed = true;
    return NULL;
}

/* Run the queued job: the lock is held on entry and on return, and dropped for the packing. */
static void planner_run(struct msh_pool *pool)
{
    struct step *s = pool->step;
    struct psnap *sn = s->snap;
    s->job = PJ_RUNNING;
    pthread_mutex_unlock(&pool->lock);
    if (pool->prm.planner_hook) pool->prm.planner_hook(pool->prm.planner_hook_arg);
    uint64_t t = msh_now_ns(), pages = UINT64_MAX, t0 = sn->t0, t1 = sn->t1;
    size_t capn = sn->cap;
    bool failed = false;
    struct pinput *in = plan_pack(sn, &pages, &failed);
    t = msh_now_ns() - t;
    msh_debug("pool: step of %llu events from %llu: %s in %.3f s", (unsigned long long)(t1 - t0),
              (unsigned long long)t0, in ? "packed" : failed ? "does not fit" : "not packed", (double)t / 1e9);
    uint64_t first = 0, h0 = sn->h0;
    for (size_t i = 0; in && i < in->n; i++)
        if (in->it[i].order == 0) first = in->it[i].size;
    snap_free(sn);
    pthread_mutex_lock(&pool->lock);
    s->snap = NULL;
    pool->st.plan_pack_ns += t;
    s->job = PJ_IDLE;
    if (in && !s->stop) {
        s->res = in;
        s->res_pages = pages;
        s->res_h0 = h0;
        s->res_first = first;
        s->res_until = s->n + 2 * (t1 - t0);
        s->job = PJ_DONE;
    } else {
        pin_free(in);
    }
    if (failed) { /* the same step at the same budget will not pack next time either */
        if (!step_failed_before(s, t1 - t0, capn + 1) || s->fail_budget != capn) s->fails = 0;
        s->fail_len = t1 - t0;
        s->fail_budget = capn;
        s->fail_until = t1 + ((t1 - t0) << (6 + (s->fails < 4 ? s->fails : 4)));
        s->fails++;
    }
}

static void *planner_main(void *arg)
{
    struct msh_pool *pool = arg;
    struct step *s = pool->step;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!s->stop && s->job != PJ_QUEUED) pthread_cond_wait(&s->wake, &pool->lock);
        if (s->stop) break;
        planner_run(pool);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

/* Start the planner thread (once per pool). The lock is held on entry and on return; it is
 * dropped while the thread is created (thread creation may use the host's malloc). False when
 * the thread cannot start: the caller packs on its own thread, as the pool did before. */
static bool planner_start(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (s->worker_on) return true; /* running, or being started by another thread */
    if (s->worker_failed) return false;
    s->worker_on = true;
    pthread_mutex_unlock(&pool->lock);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the job's signals are never delivered to the planner */
    int rc = pthread_create(&s->worker, NULL, planner_main, pool);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_mutex_lock(&pool->lock);
    if (rc) {
        s->worker_on = false;
        s->worker_failed = true;
        msh_warn("pool: cannot start the planner thread (error %d): steps are packed on the allocating thread", rc);
    }
    return !rc;
}

/* At a step boundary of the packed step (the live set it started from, and the size of its first
 * allocation), switch to its plan. The lock is held. */
static void plan_install(struct msh_pool *pool, uint64_t rsize)
{
    struct step *s = pool->step;
    if (s->active || s->job != PJ_DONE || s->hstate != s->res_h0 || s->res_first != rsize) return;
    struct pinput *in = s->res;
    s->res = NULL;
    s->job = PJ_IDLE;
    size_t capn = cap_pages(pool);
    if (capn != SIZE_MAX && s->res_pages > capn) { /* the limit went down meanwhile */
        pin_free(in);
        return;
    }
    if (s->capplan < in->nalloc) {
        s->resumable = false; /* the plan it would resume is freed here */
        raw_free(s->plan, s->capplan * sizeof *s->plan);
        s->capplan = in->nalloc;
        s->plan = raw_alloc(s->capplan * sizeof *s->plan);
        if (!s->plan) {
            s->capplan = 0;
            pin_free(in);
            return;
        }
    }
    for (size_t i = 0; i < in->n; i++)
        if (in->it[i].order != UINT32_MAX)
            s->plan[in->it[i].order] = (struct pent){.addr = in->it[i].addr, .size = in->it[i].size,
                                                     .area = in->reg[in->it[i].reg].r->area};
    s->nplan = in->nalloc;
    s->fails = 0;
    s->plan_h = s->res_h0;
    s->cursor = 0;
    s->active = true;
    s->resumable = false;
    s->plan_pages = s->res_pages;
    pool->st.plans_built++;
    msh_debug("pool: learned step of %zu allocations in use from event %llu", s->nplan, (unsigned long long)s->n);
    plan_mark(pool, in, s->res_pages);
    pin_free(in);
}

/* Before an allocation of rsize bytes: follow the plan, switch to one the planner has packed, or
 * hand the planner a step to pack. Called with the lock held; packs only with plan_sync
 * (deterministic replays) or when the planner thread cannot start. */
static void step_before_alloc(struct msh_pool *pool, uint64_t rsize)
{
    struct step *s = pool->step;
    s->want = false;
    if (s->active && s->cursor == s->nplan) { /* the step is over: does the next one begin? */
        if (s->hstate == s->plan_h && s->plan[0].size == rsize) s->cursor = 0;
        else step_drop(pool);
    }
    if (s->job == PJ_DONE) plan_install(pool, rsize);
    if (!s->active && s->resumable && s->job == PJ_IDLE && s->hstate == s->plan_h && s->plan[0].size == rsize) {
        size_t capn = cap_pages(pool);
        s->resumable = false;
        if (capn == SIZE_MAX || s->plan_pages <= capn) { /* the limit did not go down meanwhile */
            s->cursor = 0;
            s->active = true;
            pool->st.plans_built++; /* a plan switched to again: plan_dropped stays at most plans_built */
            msh_debug("pool: learned step of %zu allocations resumed at event %llu", s->nplan, (unsigned long long)s->n);
        }
    }
    if (s->job == PJ_DONE && s->n > s->res_until) { /* its boundary did not come back: the step changed */
        pin_free(s->res);
        s->res = NULL;
        s->job = PJ_IDLE;
    }
    struct anchor *an = &s->anchors[mix64(s->hstate) & (STEP_ANCHORS - 1)];
    bool candidate = !s->active && s->job == PJ_IDLE && an->h == s->hstate && an->size == rsize &&
                     an->serial < s->n && s->n - an->serial <= STEP_LOG && pool->pressure_reclaims > an->reclaims &&
                     s->n >= s->quiet_until && !step_failed_before(s, s->n - an->serial, cap_pages(pool));
    uint64_t t0 = an->serial, t1 = s->n, h0 = s->hstate;
    *an = (struct anchor){.h = s->hstate, .serial = s->n, .reclaims = pool->pressure_reclaims, .size = rsize};
    if (candidate) {
        /* Every allocation of a repeated step starts a window of the same length: try once per
         * step length, not at each of them. */
        s->quiet_until = t1 + (t1 - t0);
        size_t capn = cap_pages(pool);
        struct psnap *sn = snap_take(pool, t0, t1, h0, capn != SIZE_MAX ? capn : pool->held);
        if (sn) {
            sn->cap = capn;
            s->snap = sn;
            s->job = PJ_QUEUED;
            /* plan_sync (a deterministic replay): packed here, at this boundary, as if the
             * planner had been instant; otherwise by the planner thread (or here when it cannot
             * start), and used from a later boundary */
            if (pool->prm.plan_sync || !planner_start(pool)) {
                if (s->job == PJ_QUEUED) planner_run(pool);
            } else {
                pthread_cond_signal(&s->wake);
            }
            plan_install(pool, rsize); /* when it is ready already and this is still its boundary */
        }
    }
    if (s->active) {
        if (s->plan[s->cursor].size != rsize) {
            step_drop(pool);
        } else {
            s->want = true;
            s->want_addr = s->plan[s->cursor].addr;
            s->want_area = s->plan[s->cursor].area;
        }
    }
}

/* ---- issue 8's entry points: streams that go away, blocks by interior address, release on free -- */

/* Drop `stream` from b's tags (its event reference too); true when it was there. */
static bool sref_drop(struct msh_pool *pool, struct blk *b, uint64_t stream)
{
    int k = 0;
    bool found = false;
    for (int i = 0; i < b->ns; i++) {
        if (b->s[i].stream == stream) {
            found = true;
            ev_put(pool, b->s[i].ev);
            if (b->state == B_FREE) { /* its bytes need the synchronize now */
                if (!b->sync_needed || b->s[i].lo < b->slo) b->slo = b->s[i].lo;
                if (!b->sync_needed || b->s[i].hi > b->shi) b->shi = b->s[i].hi;
                b->sync_needed = 1;
            }
        } else {
            b->s[k++] = b->s[i];
        }
    }
    b->ns = (uint8_t)k;
    return found;
}

/* A destroyed stream's handle is undefined from then on (the driver may give the value to a new
 * stream), so no tag may name it afterwards: no event is ever recorded on it, and "same stream"
 * never matches it. Tagged blocks, live or free, trade the tag for sync_needed: whoever reuses
 * them elsewhere first waits for the whole device. No device call here. */
int msh_pool_forget_stream(struct msh_pool *pool, uint64_t stream)
{
    if (stream == MSH_STREAM_COMPLETED) return 0;
    pthread_mutex_lock(&pool->lock);
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b; b = b->hnext)
            if (sref_drop(pool, b, stream)) b->sync_needed = 1;
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (struct blk *b = r->first; b; b = b->next)
                if ((b->state == B_FREE && !blk_clean(pool, b)) || b->state == B_PARKED)
                    if (sref_drop(pool, b, stream)) b->sync_needed = 1;
    struct kstream *k = ks_find(pool, stream);
    if (k) { /* its handle value may come back for a new stream: nothing of the old one stays */
        ev_put(pool, k->latest);
        memset(k, 0, sizeof *k);
    }
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

static struct region *region_of(struct msh_pool *pool, uint64_t addr)
{
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            if (addr >= r->base && addr - r->base < r->size) return r;
    return NULL;
}

/* The live block whose requested bytes contain addr. An exact start is one hash probe; an
 * interior address walks its region's blocks in address order (callers are rare: buffer
 * registration by NCCL or an MPI library, not every allocation). */
int msh_pool_block_containing(struct msh_pool *pool, uint64_t addr, uint64_t *base, size_t *size)
{
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_find(pool, addr);
    if (!b) {
        struct region *r = region_of(pool, addr);
        for (struct blk *x = r ? r->first : NULL; x && x->addr <= addr; x = x->next)
            if (x->state == B_LIVE && addr - x->addr < (x->req ? x->req : 1)) b = x;
    }
    if (b) {
        *base = b->addr;
        *size = b->req ? b->req : 1;
    }
    pthread_mutex_unlock(&pool->lock);
    return b ? 0 : EINVAL;
}

bool msh_pool_covers_fast(struct msh_pool *pool, uint64_t addr)
{
    int n = __atomic_load_n(&pool->nvr, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++)
        if (addr >= pool->vr[i].base && addr < pool->vr[i].end) return true;
    if (n < (int)(sizeof pool->vr / sizeof pool->vr[0])) return false;
    return msh_pool_covers(pool, addr);
}

bool msh_pool_covers(struct msh_pool *pool, uint64_t addr)
{
    pthread_mutex_lock(&pool->lock);
    bool in = region_of(pool, addr) != NULL;
    pthread_mutex_unlock(&pool->lock);
    return in;
}

/* A peer gained access (the backend's descriptors include it already, so mappings made from now
 * on grant it): grant it on every handle mapped now. Requests doing driver work are waited for
 * first, so that none of them granted access before the backend changed and publishes a mapping
 * this walk does not see. One call per handle, without the lock: a handle unmapped meanwhile
 * makes only its own call fail, and it gets the grant when it is mapped again. */
int msh_pool_regrant_access(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    while (pool->jobs) {
        pool->waiters++;
        pthread_cond_wait(&pool->cv, &pool->lock);
        pool->waiters--;
    }
    size_t n = 0, cap = 0;
    uint64_t (*runs)[2] = NULL;
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (uint32_t p = 0; p < r->hi_page; p++) {
                const struct page *pg = &r->pages[p];
                if (pg_head(pg) != p || pg->state != PG_MAPPED || !pg->handle) continue;
                if (n == cap) {
                    size_t ncap = cap ? cap * 2 : 256;
                    uint64_t (*nr)[2] = raw_alloc(ncap * sizeof *nr);
                    if (!nr) break;
                    if (n) memcpy(nr, runs, n * sizeof *nr);
                    raw_free(runs, cap * sizeof *runs);
                    runs = nr;
                    cap = ncap;
                }
                runs[n][0] = page_va(pool, r, p);
                runs[n][1] = (uint64_t)pg->npages * pool->gran;
                n++;
            }
    pthread_mutex_unlock(&pool->lock);
    int first = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = dev_set_access(pool, runs[i][0], runs[i][1]);
        if (rc && !first) first = rc;
    }
    raw_free(runs, cap * sizeof *runs);
    return first;
}

void msh_pool_counters(struct msh_pool *pool, struct msh_pool_counters *out)
{
    pthread_mutex_lock(&pool->lock);
    out->gran = pool->gran;
    out->limit = limit_now(pool);
    out->handles = pool->held;
    out->cached_pages = pool->cached;
    out->touched_pages = pool->touched;
    out->live_bytes = pool->st.live_bytes;
    out->defrag = pool->prm.defrag;
    out->release_on_oom = !pool->prm.no_release_on_oom;
    pthread_mutex_unlock(&pool->lock);
}

/* Free a block, then return to the driver the cached handles on the pages it touched (a handle
 * is released whole: its other pages are untouched too, or it would not be cached). DESIGN.md 3:
 * a cudaFree in segment mode is PyTorch giving memory back. */
int msh_pool_free_release(struct msh_pool *pool, uint64_t addr, uint64_t stream, size_t *released)
{
    if (released) *released = 0;
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_find(pool, addr);
    struct region *r = b ? b->reg : NULL;
    uint32_t p0 = 0, p1 = 0;
    if (b) page_range(pool, b, &p0, &p1);
    pthread_mutex_unlock(&pool->lock);
    if (!b) return EINVAL;
    int rc = msh_pool_free(pool, addr, stream);
    if (rc) return rc;
    /* another thread may have placed a block on these pages meanwhile: those stay (live) */
    pthread_mutex_lock(&pool->lock);
    if (capturing(pool)) { /* the release waits: the pages stay cached */
        pool->st.capture_deferrals++;
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    struct job j;
    job_init(&j);
    size_t before = pool->st.released_pages;
    for (uint32_t p = p0; p <= p1 && p < r->hi_page;) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h == NO_PAGE) {
            p++;
            continue;
        }
        struct page *hp = &r->pages[h];
        uint32_t next = h + hp->npages;
        if (hp->state == PG_MAPPED && !hp->nlive) {
            if (!take_victim(pool, &j, r, h, V_RELEASE)) break;
            held_sub(pool, hp->npages);
        }
        p = next;
    }
    job_do(pool, &j);
    job_fini(pool, &j);
    size_t n = (pool->st.released_pages - before) * pool->gran;
    pthread_mutex_unlock(&pool->lock);
    if (released) *released = n;
    return 0;
}

/* ---- invariant checker (msh_pool_check, pool.h) ------------------------------------------------ */

#define CHECK_FAIL(...)                                                                            \
    do {                                                                                           \
        if (why && whylen) snprintf(why, whylen, __VA_ARGS__);                                     \
        rc = EFAULT;                                                                               \
        goto out;                                                                                  \
    } while (0)

/* What treap_walk finds wrong, per tree. */
static const char *const treap_err[2][5] = {
    {"treap deeper than 4096 (a cycle?)", "treap heap order broken", "a block that is not free is in the free treap",
     "a free treap holds a block of another area", "treap keys out of (size, addr) order"},
    {"address treap deeper than 4096 (a cycle?)", "address treap heap order broken",
     "a block that is not free is in the address treap", "an address treap holds a block of another area",
     "address treap keys out of order"},
};

/* Walk a free treap (tt: TS by (size, addr), TA by addr): in-order keys strictly increase,
 * children's priorities never exceed their parent's, every node is a free block of `area`.
 * Counts nodes into *n. Recursion depth is the treap's height (expected O(log n)); a corrupt
 * tree deeper than 4096 is reported, not followed. */
static const char *treap_walk(int tt, const struct blk *t, int area, const struct blk **prev, size_t *n, int depth)
{
    if (!t) return NULL;
    if (depth > 4096) return treap_err[tt][0];
    for (int side = 0; side < 2; side++)
        if (t->kid[tt][side] && t->kid[tt][side]->prio > t->prio) return treap_err[tt][1];
    const char *e = treap_walk(tt, t->kid[tt][0], area, prev, n, depth + 1);
    if (e) return e;
    if (t->state != B_FREE) return treap_err[tt][2];
    if (!t->reg || t->reg->area != area) return treap_err[tt][3];
    if (*prev && !tkey_less(tt, *prev, t)) return treap_err[tt][4];
    *prev = t;
    (*n)++;
    return treap_walk(tt, t->kid[tt][1], area, prev, n, depth + 1);
}

int msh_pool_check(struct msh_pool *pool, char *why, size_t whylen)
{
    int rc = 0;
    int32_t *live_count = NULL;
    size_t live_count_bytes = 0;
    uint32_t *evrefs = NULL;
    size_t evrefs_bytes = 0;
    if (why && whylen) why[0] = 0;
    pthread_mutex_lock(&pool->lock);
    /* Requests doing driver work hold claims (pending blocks, pages in progress) that the rest of
     * the pool accounts for only once they publish: the exact checks need a quiet pool. */
    bool quiet = pool->jobs == 0 && pool->waiters == 0; /* a waiter holds a pending block too */
    size_t nfree[NAREAS] = {0}, nlive = 0, live_bytes = 0, mapped = 0, touched = 0, cached = 0, heads = 0, nparked = 0;
    size_t va = 0;
    if (pool->nevs) {
        evrefs_bytes = round_up((size_t)pool->nevs * sizeof *evrefs, 4096);
        evrefs = raw_alloc(evrefs_bytes);
        if (!evrefs) CHECK_FAIL("cannot map %zu bytes for the check", evrefs_bytes);
    }
    for (int a = 0; a < NAREAS; a++) {
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            va += r->size;
            if (r->area != a) CHECK_FAIL("region %#llx sits in area %d's list but says area %d",
                                         (unsigned long long)r->base, a, r->area);
            if (r->hi_page > r->npages) CHECK_FAIL("region %#llx: hi_page %u > npages %u",
                                                   (unsigned long long)r->base, r->hi_page, r->npages);
            /* 1. the blocks tile the region in address order */
            uint64_t expect = r->base;
            const struct blk *prev = NULL;
            if (!r->first || r->first->prev) CHECK_FAIL("region %#llx: bad first block", (unsigned long long)r->base);
            size_t need = (size_t)r->hi_page * sizeof *live_count;
            if (need > live_count_bytes) {
                raw_free(live_count, live_count_bytes);
                live_count_bytes = round_up(need ? need : 1, 4096);
                live_count = raw_alloc(live_count_bytes);
                if (!live_count) {
                    live_count_bytes = 0;
                    CHECK_FAIL("cannot map %zu bytes for the check", need);
                }
            }
            if (need) memset(live_count, 0, need);
            for (const struct blk *b = r->first; b; b = b->next) {
                if (b->prev != prev) CHECK_FAIL("block %#llx: prev link broken", (unsigned long long)b->addr);
                if (b->reg != r) CHECK_FAIL("block %#llx: wrong region", (unsigned long long)b->addr);
                if (b->addr != expect) CHECK_FAIL("region %#llx: gap or overlap at %#llx (block starts at %#llx)",
                                                  (unsigned long long)r->base, (unsigned long long)expect,
                                                  (unsigned long long)b->addr);
                if (!b->size || b->size % BLOCK_ALIGN) CHECK_FAIL("block %#llx: size %llu not a positive multiple of %d",
                                                                  (unsigned long long)b->addr, (unsigned long long)b->size, BLOCK_ALIGN);
                if (b->addr + b->size > r->base + r->size) CHECK_FAIL("block %#llx runs past its region", (unsigned long long)b->addr);
                if (b->ns > MAX_STREAMS) CHECK_FAIL("block %#llx: %u stream tags", (unsigned long long)b->addr, b->ns);
                for (int i = 0; i < b->ns; i++)
                    for (int k = i + 1; k < b->ns; k++)
                        if (b->s[i].stream == b->s[k].stream)
                            CHECK_FAIL("block %#llx: stream %#llx tagged twice", (unsigned long long)b->addr,
                                       (unsigned long long)b->s[i].stream);
                if (b->state == B_FREE) {
                    if (prev && prev->state == B_FREE) CHECK_FAIL("free neighbours %#llx and %#llx were not merged",
                                                                  (unsigned long long)prev->addr, (unsigned long long)b->addr);
                    for (int i = 0; i < b->ns; i++)
                        if (!(b->s[i].lo >= b->addr && b->s[i].lo < b->s[i].hi && b->s[i].hi <= b->addr + b->size))
                            CHECK_FAIL("free block %#llx: a tag is about [%#llx, %#llx), outside it", (unsigned long long)b->addr,
                                       (unsigned long long)b->s[i].lo, (unsigned long long)b->s[i].hi);
                    if (b->sync_needed && !(b->slo >= b->addr && b->slo < b->shi && b->shi <= b->addr + b->size))
                        CHECK_FAIL("free block %#llx: its synchronize is about [%#llx, %#llx), outside it", (unsigned long long)b->addr,
                                   (unsigned long long)b->slo, (unsigned long long)b->shi);
                    if ((b->ns || b->sync_needed) && !b->free_gen)
                        CHECK_FAIL("free block %#llx has stream tags but no free generation", (unsigned long long)b->addr);
                    for (int i = 0; i < b->ns; i++) {
                        uint32_t e = b->s[i].ev;
                        if (e == NO_EV) continue;
                        if (e >= pool->nevs) CHECK_FAIL("free block %#llx: event slot %u of %u", (unsigned long long)b->addr, e, pool->nevs);
                        if (!pool->evs[e].h) CHECK_FAIL("free block %#llx waits on event slot %u that was never created",
                                                        (unsigned long long)b->addr, e);
                        if (pool->evs[e].stream != b->s[i].stream)
                            CHECK_FAIL("free block %#llx: event slot %u was recorded on another stream", (unsigned long long)b->addr, e);
                        if (pool->evs[e].state == EV_IDLE || pool->evs[e].seq <= b->s[i].seq)
                            CHECK_FAIL("free block %#llx: event slot %u does not cover its tag (state %u, recorded at %llu, tag %llu)",
                                       (unsigned long long)b->addr, e, pool->evs[e].state,
                                       (unsigned long long)pool->evs[e].seq, (unsigned long long)b->s[i].seq);
                        evrefs[e]++;
                    }
                    nfree[a]++;
                } else if (b->state == B_LIVE) {
                    nlive++;
                    live_bytes += b->req;
                    if (b->req > b->size) CHECK_FAIL("block %#llx: requested %llu > extent %llu", (unsigned long long)b->addr,
                                                     (unsigned long long)b->req, (unsigned long long)b->size);
                    if (hash_find(pool, b->addr) != b) CHECK_FAIL("live block %#llx is not in the hash", (unsigned long long)b->addr);
                    for (int i = 0; i < b->ns; i++)
                        if (b->s[i].ev != NO_EV) CHECK_FAIL("live block %#llx holds an event", (unsigned long long)b->addr);
                } else if ((b->state == B_PENDING || b->state == B_FREEING) && !quiet) {
                    /* in flight: its pages are claimed */
                } else if (b->state == B_PARKED) {
                    nparked++;
                    for (int i = 0; i < b->ns; i++)
                        if (b->s[i].ev != NO_EV) CHECK_FAIL("parked block %#llx holds an event", (unsigned long long)b->addr);
                } else {
                    CHECK_FAIL("block %#llx in state %u with no request in flight", (unsigned long long)b->addr, b->state);
                }
                if (b->state != B_FREE && !(b->state == B_PENDING && !b->claimed)) {
                    uint32_t p0, p1;
                    page_range(pool, b, &p0, &p1);
                    if (p1 >= r->hi_page) CHECK_FAIL("block %#llx touches page %u above hi_page %u",
                                                     (unsigned long long)b->addr, p1, r->hi_page);
                    for (uint32_t p = p0; p <= p1; p++) live_count[p]++;
                }
                expect = b->addr + b->size;
                prev = b;
            }
            if (expect != r->base + r->size) CHECK_FAIL("region %#llx: blocks end at %#llx, not at its end",
                                                        (unsigned long long)r->base, (unsigned long long)expect);
            /* 2. pages and handles: live counts, the page runs of each handle */
            size_t ncached_here = 0;
            for (uint32_t p = 0; p < r->hi_page; p++) {
                const struct page *pg = &r->pages[p];
                if (pg->live != live_count[p]) CHECK_FAIL("region %#llx page %u: live count %d, but %d live blocks touch it",
                                                          (unsigned long long)r->base, p, pg->live, live_count[p]);
                uint32_t h = pg_head(pg);
                if (pg->live && h == NO_PAGE) CHECK_FAIL("region %#llx page %u: touched by a live block but not mapped",
                                                         (unsigned long long)r->base, p);
                if (pg->live) touched++;
                if (h == NO_PAGE) continue;
                if (h > p) CHECK_FAIL("region %#llx page %u: its handle starts after it, at %u", (unsigned long long)r->base, p, h);
                const struct page *hp = &r->pages[h];
                if (!hp->npages || h + hp->npages > r->hi_page || p >= h + hp->npages)
                    CHECK_FAIL("region %#llx page %u: outside its handle's %u pages at %u", (unsigned long long)r->base, p,
                               hp->npages, h);
                if (h != p) continue;
                /* a head: the handle's own fields */
                heads++;
                mapped += hp->npages;
                uint32_t nl = 0;
                for (uint32_t q = p; q < p + hp->npages; q++) {
                    if (pg_head(&r->pages[q]) != p) CHECK_FAIL("region %#llx page %u: inside the handle at %u but points at %u",
                                                               (unsigned long long)r->base, q, p, pg_head(&r->pages[q]));
                    nl += r->pages[q].live > 0;
                }
                if (nl != hp->nlive) CHECK_FAIL("region %#llx handle at %u: %u pages touched, count says %u",
                                                (unsigned long long)r->base, p, nl, hp->nlive);
                /* a handle of several pages is in use by one block covering all of it, or cached
                 * (or all its pages belong to the learned step) */
                bool all_planned = handle_planned(r, p);
                if (quiet && limit_now(pool) && hp->npages > 1 && nl && nl != hp->npages && !all_planned)
                    CHECK_FAIL("region %#llx handle at %u: %u of its %u pages in use (partly used handles cannot be reclaimed)",
                               (unsigned long long)r->base, p, nl, hp->npages);
                for (uint32_t q = p; quiet && limit_now(pool) && hp->npages > 1 && !all_planned && q < p + hp->npages; q++)
                    if (r->pages[q].live > 1)
                        CHECK_FAIL("region %#llx page %u of a %u-page handle is shared by %d blocks", (unsigned long long)r->base, q,
                                   hp->npages, r->pages[q].live);
                if (quiet && (hp->state != PG_MAPPED || !hp->handle))
                    CHECK_FAIL("region %#llx handle at %u: state %u, handle %#llx with no request in flight",
                               (unsigned long long)r->base, p, hp->state, (unsigned long long)hp->handle);
                uint8_t want = 0;
                for (uint32_t q = p; q < p + hp->npages; q++) want |= r->pages[q].plan & PLAN_PAGE;
                if (hp->state == PG_MAPPED && !hp->nlive) {
                    ncached_here += hp->npages;
                    if (((hp->plan & PLAN_LIST) != 0) != (want != 0))
                        CHECK_FAIL("region %#llx cached handle at %u is on the %s list", (unsigned long long)r->base, p,
                                   want ? "unplanned" : "planned");
                }
            }
            for (uint32_t p = r->hi_page; p < r->npages && p < r->hi_page + 1; p++)
                if (r->pages[p].hd || r->pages[p].live) CHECK_FAIL("region %#llx page %u above hi_page is in use",
                                                                   (unsigned long long)r->base, p);
            /* 3. the cached lists hold exactly the mapped handles no block touches */
            size_t walked = 0;
            for (int l = 0; l < 2; l++) {
                uint32_t prevp = NO_PAGE;
                size_t steps = 0;
                for (uint32_t p = r->chead[l]; p != NO_PAGE; p = r->pages[p].cnext) {
                    if (p >= r->hi_page) CHECK_FAIL("region %#llx: cached handle %u is above hi_page", (unsigned long long)r->base, p);
                    const struct page *hp = &r->pages[p];
                    if (pg_head(hp) != p) CHECK_FAIL("region %#llx: cached list entry %u is not a handle's first page",
                                                     (unsigned long long)r->base, p);
                    if (hp->cprev != prevp) CHECK_FAIL("region %#llx: cached list back link broken at page %u",
                                                       (unsigned long long)r->base, p);
                    if (hp->nlive || hp->state != PG_MAPPED) CHECK_FAIL("region %#llx: cached handle %u is %s",
                                                                        (unsigned long long)r->base, p,
                                                                        hp->nlive ? "touched by a live block" : "not mapped");
                    if (((hp->plan & PLAN_LIST) != 0) != (l == 1))
                        CHECK_FAIL("region %#llx: cached handle %u is on list %d but flagged otherwise", (unsigned long long)r->base, p, l);
                    if (++steps > r->hi_page) CHECK_FAIL("region %#llx: cached list has a cycle", (unsigned long long)r->base);
                    walked += hp->npages;
                    prevp = p;
                }
                if (r->ctail[l] != prevp) CHECK_FAIL("region %#llx: cached list %d tail is %u, the walk ends at %u",
                                                     (unsigned long long)r->base, l, r->ctail[l], prevp);
            }
            if (walked != ncached_here || r->ncached != ncached_here)
                CHECK_FAIL("region %#llx: %zu pages of mapped handles without a live block, %zu on the cached lists, count says %zu",
                           (unsigned long long)r->base, ncached_here, walked, r->ncached);
            cached += ncached_here;
        }
    }
    /* 4. the free treaps hold exactly the free blocks */
    for (int a = 0; a < NAREAS; a++) {
        const struct blk *prev = NULL;
        size_t n = 0;
        const char *e = treap_walk(TS, pool->tree[a], a, &prev, &n, 0);
        if (e) CHECK_FAIL("area %d: %s", a, e);
        if (n != nfree[a]) CHECK_FAIL("area %d: %zu free blocks in the regions, %zu in the treap", a, nfree[a], n);
        prev = NULL;
        n = 0;
        e = treap_walk(TA, pool->atree[a], a, &prev, &n, 0);
        if (e) CHECK_FAIL("area %d: %s", a, e);
        if (n != nfree[a]) CHECK_FAIL("area %d: %zu free blocks in the regions, %zu in the address treap", a, nfree[a], n);
    }
    /* 5. the hash holds exactly the live blocks */
    size_t nhash = 0;
    for (size_t i = 0; i < pool->hcap; i++)
        for (const struct blk *b = pool->htab[i]; b; b = b->hnext) {
            if (b->state != B_LIVE) CHECK_FAIL("a block %#llx that is not live is in the live hash", (unsigned long long)b->addr);
            if (hash_addr(b->addr, pool->hcap) != i) CHECK_FAIL("live block %#llx is in the wrong hash bucket", (unsigned long long)b->addr);
            if (++nhash > nlive) break;
        }
    if (nhash != nlive || pool->hcount != nlive)
        CHECK_FAIL("%zu live blocks in the regions, %zu in the hash, hash count %zu", nlive, nhash, pool->hcount);
    /* the parked list holds exactly the parked blocks */
    {
        size_t np = 0;
        for (const struct blk *b = pool->parked; b && np <= nparked; b = b->hnext, np++)
            if (b->state != B_PARKED) CHECK_FAIL("block %#llx on the parked list is in state %u", (unsigned long long)b->addr, b->state);
        if (np != nparked) CHECK_FAIL("%zu parked blocks in the regions, %zu on the parked list", nparked, np);
    }
    /* the known streams: one entry per stream, its latest event recorded on it */
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++) {
        const struct kstream *k = &pool->ks[i];
        if (!k->used) continue;
        for (uint32_t q = i + 1; q < MAX_KSTREAMS; q++)
            if (pool->ks[q].used && pool->ks[q].stream == k->stream)
                CHECK_FAIL("stream %#llx is known twice", (unsigned long long)k->stream);
        if (k->latest != NO_EV) {
            if (k->latest >= pool->nevs || pool->evs[k->latest].stream != k->stream || pool->evs[k->latest].state == EV_IDLE)
                CHECK_FAIL("stream %#llx: its latest event (slot %u) is not a recorded event of it", (unsigned long long)k->stream, k->latest);
            if (evrefs) evrefs[k->latest]++;
        }
    }
    {
        uint32_t nrec = 0;
        for (uint32_t e = 0; e < pool->nevs; e++) nrec += pool->evs[e].state == EV_RECORDED;
        if (quiet && nrec != pool->nrecorded) CHECK_FAIL("%u events recorded and pending, count says %u", nrec, pool->nrecorded);
    }
    /* 6. pooled events: references are exactly the free extents' tags and the streams' latest events,
     * the free list the rest */
    if (quiet) {
        size_t nfreelist = 0;
        for (uint32_t e = pool->evfree; e != NO_EV; e = pool->evs[e].next) {
            if (e >= pool->nevs) CHECK_FAIL("event free list points at slot %u of %u", e, pool->nevs);
            if (pool->evs[e].refs) CHECK_FAIL("event slot %u is on the free list with %u references", e, pool->evs[e].refs);
            if (++nfreelist > pool->nevs) CHECK_FAIL("event free list has a cycle");
        }
        size_t inuse = 0;
        for (uint32_t e = 0; e < pool->nevs; e++) {
            if (pool->evs[e].refs != evrefs[e])
                CHECK_FAIL("event slot %u: %u references, %u free extents and streams hold it", e, pool->evs[e].refs, evrefs[e]);
            if (!pool->evs[e].refs && pool->evs[e].state != EV_IDLE)
                CHECK_FAIL("event slot %u: no reference but state %u", e, pool->evs[e].state);
            inuse += pool->evs[e].refs > 0;
        }
        if (inuse + nfreelist != pool->nevs) CHECK_FAIL("event slots: %zu in use + %zu free != %u", inuse, nfreelist, pool->nevs);
    }
    /* 7. handles and the counters behind the stats */
    size_t orphan_pages = 0;
    for (int i = 0; i < pool->norphans; i++) orphan_pages += pool->orphans[i].pages;
    if (quiet && pool->held != mapped + orphan_pages)
        CHECK_FAIL("pages of handles held %zu != mapped %zu + orphaned %zu", pool->held, mapped, orphan_pages);
    if (quiet && pool->nhandles != heads) CHECK_FAIL("handles %zu, recount %zu", pool->nhandles, heads);
    if (pool->touched != touched) CHECK_FAIL("touched pages %zu, recount %zu", pool->touched, touched);
    if (pool->cached != cached) CHECK_FAIL("cached pages %zu, recount %zu", pool->cached, cached);
    if (pool->st.live_bytes != live_bytes) CHECK_FAIL("live bytes %zu, recount %zu", pool->st.live_bytes, live_bytes);
    if (pool->st.live_blocks != nlive) CHECK_FAIL("live blocks %zu, recount %zu", pool->st.live_blocks, nlive);
    if (pool->st.va_bytes != va) CHECK_FAIL("reserved VA %zu, recount %zu", pool->st.va_bytes, va);
    if (pool->st.peak_live_bytes < live_bytes || pool->st.run_peak_live_bytes < pool->st.peak_live_bytes)
        CHECK_FAIL("live peaks (epoch %zu, run %zu) below the current %zu", pool->st.peak_live_bytes,
                   pool->st.run_peak_live_bytes, live_bytes);
    size_t dheld = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    size_t dpe = __atomic_load_n(&pool->drv_peak_epoch, __ATOMIC_RELAXED);
    size_t dpr = __atomic_load_n(&pool->drv_peak_run, __ATOMIC_RELAXED);
    if (dpe < dheld || dpr < dpe)
        CHECK_FAIL("reserved peaks (epoch %zu, run %zu) below the current %zu the driver holds", dpe, dpr, dheld);
    /* Quiet, every page counted against the budget is a handle the driver holds (more only for
     * handles whose release failed past the orphan list, left to the driver). */
    if (quiet && dheld < pool->held * pool->gran)
        CHECK_FAIL("the pool counts %zu bytes of handles, the driver holds %zu", pool->held * pool->gran, dheld);
    if (pool->st.allocs < pool->st.frees || pool->st.allocs - pool->st.frees != nlive)
        CHECK_FAIL("allocs %llu - frees %llu != live blocks %zu", (unsigned long long)pool->st.allocs,
                   (unsigned long long)pool->st.frees, nlive);
    /* Orphans (handles the driver refused to take back) are counted as held but are not the
     * pool's to use: what the pool maps stays within the limit. */
    if (pool->limit && (pool->held - orphan_pages) * pool->gran > pool->limit)
        CHECK_FAIL("maps %zu bytes of handles over the limit %zu", (pool->held - orphan_pages) * pool->gran, pool->limit);
    if (pool->synced_gen > pool->free_gen) CHECK_FAIL("synchronized up to free %llu of %llu",
                                                      (unsigned long long)pool->synced_gen, (unsigned long long)pool->free_gen);
    if (pool->step && pool->step->active && (pool->step->cursor > pool->step->nplan || !pool->step->nplan))
        CHECK_FAIL("learned step: cursor %zu of %zu entries", pool->step->cursor, pool->step->nplan);
    if (pool->step) {
        const struct step *s = pool->step;
        /* the planner's job: a snapshot exactly while it is queued or running, a packed step
         * exactly while it waits for its boundary, and none of them while a plan is in use */
        if (s->job < PJ_IDLE || s->job > PJ_DONE) CHECK_FAIL("learned step: planner job state %d", s->job);
        if ((s->snap != NULL) != (s->job == PJ_QUEUED || s->job == PJ_RUNNING))
            CHECK_FAIL("learned step: planner job %d with%s a snapshot", s->job, s->snap ? "" : "out");
        if ((s->res != NULL) != (s->job == PJ_DONE))
            CHECK_FAIL("learned step: planner job %d with%s a packed step", s->job, s->res ? "" : "out");
        if (s->active && s->job != PJ_IDLE) CHECK_FAIL("learned step: a plan in use while the planner has job %d", s->job);
        /* the footprint flags are exactly the pages of the footprint's runs */
        for (int a = 0; a < NAREAS; a++)
            for (struct region *r = pool->areas[a]; r; r = r->next) {
                uint32_t top = r->hi_page;
                for (size_t i = 0; i < s->nfp; i++)
                    if (s->fp[i].r == r && s->fp[i].p1 + 1 > top) top = s->fp[i].p1 + 1;
                if (!top) continue;
                size_t need = (size_t)top * sizeof *live_count;
                if (need > live_count_bytes) {
                    raw_free(live_count, live_count_bytes);
                    live_count_bytes = round_up(need, 4096);
                    live_count = raw_alloc(live_count_bytes);
                    if (!live_count) {
                        live_count_bytes = 0;
                        CHECK_FAIL("cannot map %zu bytes for the check", need);
                    }
                }
                memset(live_count, 0, need);
                for (size_t i = 0; i < s->nfp; i++)
                    if (s->fp[i].r == r)
                        for (uint32_t p = s->fp[i].p0; p <= s->fp[i].p1; p++) live_count[p] = 1;
                for (uint32_t p = 0; p < top; p++)
                    if (live_count[p] != ((r->pages[p].plan & PLAN_PAGE) != 0))
                        CHECK_FAIL("region %#llx page %u: %sin the learned step's footprint, but its flag says %s",
                                   (unsigned long long)r->base, p, live_count[p] ? "" : "not ",
                                   live_count[p] ? "not" : "it is");
            }
    }
out:
    pthread_mutex_unlock(&pool->lock);
    raw_free(live_count, live_count_bytes);
    raw_free(evrefs, evrefs_bytes);
    return rc;
}
