/*
 * pool.c: the defragmenting pool (DESIGN.md 4).
 *
 * Virtual address space is plentiful and physical pages can be remapped, so fragmentation is a
 * physical-page problem. The pool keeps one long VA line per area (small requests and large
 * requests live in separate areas so a long-lived small block never pins a page in the middle of
 * large traffic), places blocks best-fit by (size, address) along it, and maps a physical page
 * (one granularity-sized handle) only where a live block touches it. Neighbours share pages,
 * so the physical memory held approaches the peak of live bytes. A page no live block touches
 * stays mapped as a cached page; under pressure cached pages are unmapped (after their last use
 * is known complete: unmap is not stream-ordered) and their handles remapped where a new block
 * needs them. In a steady loop the same placements recur, so no map or unmap happens at all.
 *
 * It must never call a CUDA hook, never allocate with malloc (its memory comes from mmap), never
 * call the GC callback while holding its lock, and never hand out a byte that a live block or
 * queued GPU work still uses.
 */
#include "pool.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "msh.h"

#define BLOCK_ALIGN 512 /* what PyTorch promises its callers */
#define MAX_SIZE ((uint64_t)1 << 48)
#define NO_PAGE UINT32_MAX
#define MAX_STREAMS 4
/* Pages per region: its page table (24 bytes a page, touched lazily) stays under 100 MiB of
 * address space and page indices fit 32 bits. 8 TiB of VA per region at 2 MiB pages. */
#define MAX_REGION_PAGES ((uint64_t)1 << 22)
#define NAREAS 2 /* 0: small requests, 1: large */

struct region;

/* One extent of a region's VA line: live or free. Every byte of a region belongs to exactly one
 * block, kept in address order, so freeing coalesces with neighbours in O(1). */
struct blk {
    uint64_t addr, size; /* size: VA bytes, a multiple of BLOCK_ALIGN */
    uint64_t req;        /* requested bytes while live */
    struct blk *prev, *next;
    struct region *reg;
    struct blk *tl, *tr; /* free-treap children */
    struct blk *hnext;   /* live hash chain, or the spare list */
    uint64_t streams[MAX_STREAMS]; /* live: [0] alloc stream + recorded; free: last-use streams */
    uint32_t prio;
    uint32_t sync_epoch; /* pool->sync_count when it was freed */
    uint8_t free, nstreams, sync_needed;
};

struct page {
    uint64_t handle;      /* 0: not mapped */
    int32_t live;         /* live blocks touching this page */
    uint32_t cprev, cnext; /* cached-page LRU list (mapped, live == 0) */
};

struct region {
    uint64_t base, size;
    uint32_t npages, hi_page; /* hi_page: one past the highest page ever mapped */
    struct page *pages;
    uint32_t chead, ctail;
    size_t ncached;
    struct region *next;
    struct blk *first; /* the block at base: merging never removes it */
    int area;
};

struct msh_pool {
    pthread_mutex_t lock;
    struct msh_device *dev;
    struct msh_pool_params prm;
    size_t gran, limit, device_total;
    struct region *areas[NAREAS];
    struct blk *tree[NAREAS];
    struct blk **htab;
    size_t hcap, hcount;
    struct blk *spare;
    size_t handles, touched, cached;
    bool dirty;           /* a free with unfinished stream work since the last synchronize */
    bool driver_oom;      /* the driver itself refused a create since the last empty-cache */
    uint64_t orphans[64]; /* unmapped handles whose release failed: retried, never forgotten */
    int norphans;
    uint32_t sync_count;
    uint32_t rng;
    bool timing;
    msh_pool_gc_fn gc_fn;
    void *gc_arg;
    struct msh_pool_stats st;
    struct msh_pool_oom oom;
};

/* ---- device calls, counted by kind (drvcost.h) ------------------------------------------------ */

const char *const msh_drv_call_names[MSH_DRV_NKINDS] = {
#define MSH_DRV_NAME_(e, s) s,
    MSH_DRV_CALLS(MSH_DRV_NAME_)
#undef MSH_DRV_NAME_
};

static inline void drv_count(struct msh_pool *pool, enum msh_drv_call k, uint64_t bytes)
{
    pool->st.drv_calls[k]++;
    pool->st.drv_bytes[k] += bytes;
}

static int dev_create(struct msh_pool *pool, size_t size, uint64_t *h)
{
    drv_count(pool, MSH_DRV_CREATE, size);
    return pool->dev->ops->create(pool->dev, size, h);
}

static int dev_release(struct msh_pool *pool, uint64_t h)
{
    drv_count(pool, MSH_DRV_RELEASE, pool->gran);
    return pool->dev->ops->release(pool->dev, h);
}

static int dev_map(struct msh_pool *pool, uint64_t va, size_t size, uint64_t h)
{
    drv_count(pool, MSH_DRV_MAP, size);
    drv_count(pool, MSH_DRV_SET_ACCESS, size);
    return pool->dev->ops->map(pool->dev, va, size, h);
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

static int dev_event_record(struct msh_pool *pool, uint64_t stream, uint64_t *ev)
{
    drv_count(pool, MSH_DRV_EVENT_RECORD, 0);
    return pool->dev->ops->event_record(pool->dev, stream, ev);
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

/* Claim one page under a shared limit (struct msh_pool_share): claimed before the create, so
 * pools racing on other threads can never go over it together. */
static bool share_claim(struct msh_pool *pool)
{
    struct msh_pool_share *sh = pool->prm.share;
    if (!sh) return !pool->limit || (pool->handles + 1) * pool->gran <= pool->limit;
    size_t lim = __atomic_load_n(&sh->limit_bytes, __ATOMIC_RELAXED) / pool->gran * pool->gran;
    size_t prev = __atomic_fetch_add(&sh->handle_bytes, pool->gran, __ATOMIC_RELAXED);
    if (!lim || prev + pool->gran <= lim) return true;
    __atomic_fetch_sub(&sh->handle_bytes, pool->gran, __ATOMIC_RELAXED);
    return false;
}

static void share_unclaim(struct msh_pool *pool)
{
    if (pool->prm.share) __atomic_fetch_sub(&pool->prm.share->handle_bytes, pool->gran, __ATOMIC_RELAXED);
}

static size_t limit_now(const struct msh_pool *pool)
{
    if (!pool->prm.share) return pool->limit;
    return __atomic_load_n(&pool->prm.share->limit_bytes, __ATOMIC_RELAXED) / pool->gran * pool->gran;
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

/* ---- free treap keyed by (size, addr): best fit is a lower bound ----------------------------- */

static inline bool key_less(const struct blk *a, const struct blk *b)
{
    return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

static void treap_split(struct blk *t, const struct blk *key, struct blk **l, struct blk **r)
{
    if (!t) {
        *l = *r = NULL;
    } else if (key_less(t, key)) {
        treap_split(t->tr, key, &t->tr, r);
        *l = t;
    } else {
        treap_split(t->tl, key, l, &t->tl);
        *r = t;
    }
}

static struct blk *treap_merge(struct blk *a, struct blk *b)
{
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->tr = treap_merge(a->tr, b);
        return a;
    }
    b->tl = treap_merge(a, b->tl);
    return b;
}

static void treap_insert(struct blk **root, struct blk *n)
{
    n->tl = n->tr = NULL;
    struct blk **t = root;
    while (*t && (*t)->prio >= n->prio) t = key_less(n, *t) ? &(*t)->tl : &(*t)->tr;
    treap_split(*t, n, &n->tl, &n->tr);
    *t = n;
}

static void treap_remove(struct blk **root, struct blk *n)
{
    struct blk **t = root;
    while (*t && *t != n) t = key_less(n, *t) ? &(*t)->tl : &(*t)->tr;
    if (*t) *t = treap_merge(n->tl, n->tr);
    n->tl = n->tr = NULL;
}

static struct blk *treap_lower_bound(struct blk *t, uint64_t size)
{
    struct blk *best = NULL;
    while (t) {
        if (t->size >= size) {
            best = t;
            t = t->tl;
        } else {
            t = t->tr;
        }
    }
    return best;
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

/* ---- cached pages (mapped, touched by no live block), oldest first -------------------------- */

static void cache_add(struct msh_pool *pool, struct region *r, uint32_t p)
{
    struct page *pg = &r->pages[p];
    pg->cnext = NO_PAGE;
    pg->cprev = r->ctail;
    if (r->ctail != NO_PAGE) r->pages[r->ctail].cnext = p;
    else r->chead = p;
    r->ctail = p;
    r->ncached++;
    pool->cached++;
}

static void cache_remove(struct msh_pool *pool, struct region *r, uint32_t p)
{
    struct page *pg = &r->pages[p];
    if (pg->cprev != NO_PAGE) r->pages[pg->cprev].cnext = pg->cnext;
    else r->chead = pg->cnext;
    if (pg->cnext != NO_PAGE) r->pages[pg->cnext].cprev = pg->cprev;
    else r->ctail = pg->cprev;
    pg->cprev = pg->cnext = NO_PAGE;
    r->ncached--;
    pool->cached--;
}

/* Unmapping is not stream-ordered: before a cached page is unmapped, every piece of work that
 * may still touch it must have finished. One device synchronize covers all of them. */
static int settle_before_unmap(struct msh_pool *pool)
{
    if (!pool->dirty) return 0;
    int rc = dev_synchronize(pool);
    if (rc) return rc;
    pool->dirty = false;
    pool->sync_count++;
    return 0;
}

/* Release a handle that is no longer mapped. A failure keeps it on the orphan list (it still
 * counts as held) so it is retried later instead of leaking. */
static void handle_release(struct msh_pool *pool, uint64_t h)
{
    pool->st.release_ops++;
    if (dev_release(pool, h) == 0) {
        __atomic_fetch_sub(&pool->handles, 1, __ATOMIC_RELAXED);
        share_unclaim(pool);
        return;
    }
    if (pool->norphans < (int)(sizeof pool->orphans / sizeof pool->orphans[0])) {
        pool->orphans[pool->norphans++] = h;
    } else {
        msh_warn("pool: the driver refused to release %d handles; one more is left to the driver",
                 pool->norphans);
        __atomic_fetch_sub(&pool->handles, 1, __ATOMIC_RELAXED);
        share_unclaim(pool);
    }
}

static void orphans_retry(struct msh_pool *pool)
{
    int n = pool->norphans;
    pool->norphans = 0;
    for (int i = 0; i < n; i++) handle_release(pool, pool->orphans[i]);
}

/* ---- regions ----------------------------------------------------------------------------------- */

static size_t round_up(size_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

static struct region *region_add(struct msh_pool *pool, int area, uint64_t min_bytes)
{
    uint64_t size = pool->prm.va_bytes;
    if (size < min_bytes) size = min_bytes;
    size = round_up(size, pool->gran);
    if (size / pool->gran > MAX_REGION_PAGES) return NULL;
    uint64_t va = 0;
    int rc = dev_reserve(pool, size, &va);
    if (rc) {
        msh_warn("pool: cannot reserve %llu bytes of virtual address space (error %d)",
                 (unsigned long long)size, rc);
        return NULL;
    }
    struct region *r = raw_alloc(sizeof *r);
    struct blk *b = blk_new(pool);
    uint32_t npages = (uint32_t)(size / pool->gran);
    struct page *pages = raw_alloc((size_t)npages * sizeof *pages);
    if (!r || !b || !pages) {
        raw_free(r, sizeof *r);
        raw_free(pages, (size_t)npages * sizeof *pages);
        if (b) blk_put(pool, b);
        dev_unreserve(pool, va, size);
        return NULL;
    }
    r->base = va;
    r->size = size;
    r->npages = npages;
    r->pages = pages;
    r->chead = r->ctail = NO_PAGE;
    r->first = b;
    r->area = area;
    r->next = pool->areas[area];
    pool->areas[area] = r;
    pool->st.va_bytes += size;
    b->addr = va;
    b->size = size;
    b->reg = r;
    b->free = 1;
    treap_insert(&pool->tree[area], b);
    return r;
}

/* ---- physical pages ---------------------------------------------------------------------------- */

/* A handle for one page: a new one while the limit and the device allow, else (defrag) the
 * oldest cached page, unmapped from where it sits. */
static int page_handle_get(struct msh_pool *pool, uint64_t *h, bool *reclaimed)
{
    if (share_claim(pool)) {
        int rc = dev_create(pool, pool->gran, h);
        if (rc) share_unclaim(pool);
        if (rc == 0) {
            __atomic_fetch_add(&pool->handles, 1, __ATOMIC_RELAXED);
            pool->st.create_ops++;
            /* The peak follows the handles themselves: an allocation that fails later still
             * leaves the pages it mapped on the way as cached pages, and reserved memory must
             * never read above its own peak. */
            size_t held = pool->handles * pool->gran;
            if (held > pool->st.peak_mapped_bytes) pool->st.peak_mapped_bytes = held;
            if (held > pool->st.run_peak_mapped_bytes) pool->st.run_peak_mapped_bytes = held;
            return 0;
        }
        if (rc == ENOMEM) pool->driver_oom = true;
        else msh_debug("pool: create failed (error %d); trying to reclaim", rc);
    }
    if (!pool->prm.defrag || !pool->cached) return ENOMEM;
    for (int a = 0; a < NAREAS; a++) {
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            if (r->chead == NO_PAGE) continue;
            int rc = settle_before_unmap(pool);
            if (rc) return rc;
            uint32_t p = r->chead;
            struct page *pg = &r->pages[p];
            rc = dev_unmap(pool, r->base + (uint64_t)p * pool->gran, pool->gran);
            if (rc) return rc;
            pool->st.unmap_ops++;
            pool->st.reclaimed_pages++;
            cache_remove(pool, r, p);
            *h = pg->handle;
            pg->handle = 0;
            *reclaimed = true;
            return 0;
        }
    }
    return ENOMEM;
}

static void page_range(const struct msh_pool *pool, const struct blk *b, uint32_t *p0, uint32_t *p1)
{
    *p0 = (uint32_t)((b->addr - b->reg->base) / pool->gran);
    *p1 = (uint32_t)((b->addr + b->size - 1 - b->reg->base) / pool->gran);
}

static void pages_release(struct msh_pool *pool, struct blk *b)
{
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    struct region *r = b->reg;
    for (uint32_t p = p0; p <= p1; p++) {
        struct page *pg = &r->pages[p];
        if (--pg->live == 0) {
            pool->touched--;
            if (pg->handle) cache_add(pool, r, p);
        }
    }
}

/* Make every page the block touches mapped. On failure nothing the block claimed stays claimed
 * (pages mapped on the way remain as cached pages: no handle leaks). */
static int pages_commit(struct msh_pool *pool, struct blk *b, bool *used_new, bool *reclaimed)
{
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    struct region *r = b->reg;
    uint32_t missing = 0;
    /* First claim what is already mapped, so reclaim below can never steal our own pages. */
    for (uint32_t p = p0; p <= p1; p++) {
        struct page *pg = &r->pages[p];
        if (pg->live++ == 0) {
            pool->touched++;
            if (pg->handle) cache_remove(pool, r, p);
            else missing++;
        }
    }
    if (!missing) return 0;
    *used_new = true;
    for (uint32_t p = p0; p <= p1; p++) {
        struct page *pg = &r->pages[p];
        if (pg->handle) continue;
        uint64_t h = 0;
        int rc = page_handle_get(pool, &h, reclaimed);
        if (rc == 0) {
            rc = dev_map(pool, r->base + (uint64_t)p * pool->gran, pool->gran, h);
            if (rc) handle_release(pool, h);
        }
        if (rc) {
            pages_release(pool, b);
            return rc == ENOMEM ? ENOMEM : rc;
        }
        pool->st.map_ops++;
        pg->handle = h;
        if (p + 1 > r->hi_page) r->hi_page = p + 1;
    }
    return 0;
}

/* Give cached pages back to the driver: all of them (max_keep = 0) or down to max_keep bytes. */
static size_t release_cached(struct msh_pool *pool, size_t max_keep)
{
    size_t released = 0;
    if (pool->norphans) orphans_retry(pool);
    for (int a = 0; a < NAREAS; a++) {
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            while (r->chead != NO_PAGE && pool->cached * pool->gran > max_keep) {
                if (settle_before_unmap(pool)) return released;
                uint32_t p = r->chead;
                struct page *pg = &r->pages[p];
                if (dev_unmap(pool, r->base + (uint64_t)p * pool->gran, pool->gran)) return released;
                pool->st.unmap_ops++;
                cache_remove(pool, r, p);
                handle_release(pool, pg->handle);
                pg->handle = 0;
                pool->st.released_pages++;
                released += pool->gran;
            }
        }
    }
    return released;
}

/* ---- streams ------------------------------------------------------------------------------------ */

static bool blk_clean(const struct msh_pool *pool, const struct blk *b)
{
    return (!b->nstreams && !b->sync_needed) || b->sync_epoch < pool->sync_count;
}

/* Free neighbours merge: the merged extent must wait for the work of both. */
static void streams_merge(const struct msh_pool *pool, struct blk *into, const struct blk *from)
{
    if (blk_clean(pool, from)) return;
    if (blk_clean(pool, into)) {
        memcpy(into->streams, from->streams, sizeof into->streams);
        into->nstreams = from->nstreams;
        into->sync_needed = from->sync_needed;
        into->sync_epoch = from->sync_epoch;
        return;
    }
    into->sync_needed |= from->sync_needed;
    for (int i = 0; i < from->nstreams; i++) {
        bool seen = false;
        for (int j = 0; j < into->nstreams; j++) seen |= into->streams[j] == from->streams[i];
        if (seen) continue;
        if (into->nstreams < MAX_STREAMS) into->streams[into->nstreams++] = from->streams[i];
        else into->sync_needed = 1;
    }
    if (from->sync_epoch > into->sync_epoch) into->sync_epoch = from->sync_epoch;
}

/* Before a free extent is handed out on `stream`: work of other streams that last used it must
 * come first. The new stream waits on an event recorded now on each of them (no host blocking);
 * host-synchronous users (MSH_STREAM_COMPLETED) get a device synchronize instead. */
static int streams_settle_for(struct msh_pool *pool, struct blk *b, uint64_t stream)
{
    if (blk_clean(pool, b)) return 0;
    /* VA above every page ever mapped was never touched by the GPU: no work to wait for, even
     * though coalescing into the open end of the line copied a stream tag onto it. */
    if (b->addr >= b->reg->base + (uint64_t)b->reg->hi_page * pool->gran) return 0;
    if (b->sync_needed || stream == MSH_STREAM_COMPLETED) {
        int rc = dev_synchronize(pool);
        if (rc) return rc;
        pool->dirty = false;
        pool->sync_count++;
        return 0;
    }
    for (int i = 0; i < b->nstreams; i++) {
        if (b->streams[i] == stream) continue;
        uint64_t ev = 0;
        int rc = dev_event_record(pool, b->streams[i], &ev);
        if (rc == 0) {
            rc = dev_stream_wait(pool, stream, ev);
            /* a failed destroy is retried once; the driver reclaims events at exit anyway */
            if (pool->dev->ops->event_release(pool->dev, ev)) pool->dev->ops->event_release(pool->dev, ev);
        }
        if (rc) { /* cannot order the streams: fall back to waiting for everything */
            rc = dev_synchronize(pool);
            if (rc) return rc;
            pool->dirty = false;
            pool->sync_count++;
            return 0;
        }
        pool->st.cross_stream_waits++;
    }
    return 0;
}

/* ---- carving and coalescing ---------------------------------------------------------------------- */

static int area_of(const struct msh_pool *pool, uint64_t rsize)
{
    return rsize <= pool->prm.small_max ? 0 : 1;
}

/* Return a block to its area's free treap, merging free neighbours. */
static void blk_make_free(struct msh_pool *pool, struct blk *b, int area)
{
    b->free = 1;
    struct blk *n = b->next;
    if (n && n->free) {
        treap_remove(&pool->tree[area], n);
        streams_merge(pool, b, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        blk_put(pool, n);
    }
    struct blk *p = b->prev;
    if (p && p->free) {
        treap_remove(&pool->tree[area], p);
        streams_merge(pool, p, b);
        p->size += b->size;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        blk_put(pool, b);
        b = p;
    }
    treap_insert(&pool->tree[area], b);
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

static int try_alloc(struct msh_pool *pool, uint64_t rsize, uint64_t req, uint64_t stream,
                     uint64_t *addr, bool *reclaimed)
{
    int area = area_of(pool, rsize);
    struct blk *b = treap_lower_bound(pool->tree[area], rsize);
    if (!b) {
        if (!region_add(pool, area, rsize)) return ENOMEM;
        b = treap_lower_bound(pool->tree[area], rsize);
        if (!b) return ENOMEM;
    }
    treap_remove(&pool->tree[area], b);
    if (b->size > rsize) {
        struct blk *rest = blk_new(pool);
        if (!rest) {
            treap_insert(&pool->tree[area], b);
            return ENOMEM;
        }
        rest->reg = b->reg;
        rest->free = 1;
        memcpy(rest->streams, b->streams, sizeof rest->streams);
        rest->nstreams = b->nstreams;
        rest->sync_needed = b->sync_needed;
        rest->sync_epoch = b->sync_epoch;
        if (place_high(pool, b, rsize)) {
            /* rest takes the low part, the block the high part */
            rest->addr = b->addr;
            rest->size = b->size - rsize;
            rest->prev = b->prev;
            rest->next = b;
            if (b->prev) b->prev->next = rest;
            else b->reg->first = rest;
            b->prev = rest;
            b->addr += rest->size;
        } else {
            rest->addr = b->addr + rsize;
            rest->size = b->size - rsize;
            rest->prev = b;
            rest->next = b->next;
            if (b->next) b->next->prev = rest;
            b->next = rest;
        }
        b->size = rsize;
        treap_insert(&pool->tree[area], rest);
    }
    bool used_new = false;
    int rc = pages_commit(pool, b, &used_new, reclaimed);
    if (rc) {
        blk_make_free(pool, b, area);
        return rc;
    }
    rc = streams_settle_for(pool, b, stream);
    if (rc) {
        pages_release(pool, b);
        blk_make_free(pool, b, area);
        return rc;
    }
    if (pool->hcount >= pool->hcap && hash_grow(pool)) {
        pages_release(pool, b);
        blk_make_free(pool, b, area);
        return ENOMEM;
    }
    b->free = 0;
    b->req = req;
    b->streams[0] = stream;
    b->nstreams = stream == MSH_STREAM_COMPLETED ? 0 : 1;
    b->sync_needed = 0;
    hash_insert(pool, b);
    *addr = b->addr;
    return 0;
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
    pool->dev = dev;
    if (params) pool->prm = *params;
    else msh_pool_params_default(&pool->prm);
    pool->rng = 0x2545F491u;
    int rc = dev->ops->granularity(dev, &pool->gran);
    if (rc || !pool->gran) {
        raw_free(pool, sizeof *pool);
        return rc ? rc : EIO;
    }
    size_t free_b = 0, total = 0;
    if (dev->ops->mem_info(dev, &free_b, &total) == 0) pool->device_total = total;
    if (pool->prm.share) pool->prm.limit_bytes = 0; /* the share's limit applies (limit_now) */
    pool->limit = pool->prm.limit_bytes ? round_up(pool->prm.limit_bytes, pool->gran) : 0;
    if (pool->prm.limit_bytes && pool->limit > pool->prm.limit_bytes)
        pool->limit -= pool->gran; /* a cap is a cap: round down to whole pages */
    if (!pool->prm.va_bytes) {
        uint64_t base = pool->limit ? pool->limit : (total ? total : 64 * MSH_GiB);
        pool->prm.va_bytes = base * 4;
    }
    pool->prm.va_bytes = round_up(pool->prm.va_bytes < MSH_GiB ? MSH_GiB : pool->prm.va_bytes, pool->gran);
    uint64_t max_va = (uint64_t)pool->gran * MAX_REGION_PAGES;
    if (pool->prm.va_bytes > max_va) pool->prm.va_bytes = max_va;
    *out = pool;
    return 0;
}

void msh_pool_destroy(struct msh_pool *pool)
{
    if (!pool) return;
    dev_synchronize(pool);
    for (int a = 0; a < NAREAS; a++) {
        struct region *r = pool->areas[a];
        while (r) {
            bool stuck = false;
            for (uint32_t p = 0; p < r->hi_page; p++) {
                struct page *pg = &r->pages[p];
                if (!pg->handle) continue;
                if (dev_unmap(pool, r->base + (uint64_t)p * pool->gran, pool->gran)) {
                    stuck = true; /* a mapped handle must not be released nor its range freed */
                    continue;
                }
                handle_release(pool, pg->handle);
                pg->handle = 0;
            }
            if (!stuck) dev_unreserve(pool, r->base, r->size);
            else msh_warn("pool: unmap failed at shutdown; leaving a reserved range to the driver");
            struct region *nx = r->next;
            raw_free(r->pages, (size_t)r->npages * sizeof *r->pages);
            raw_free(r, sizeof *r);
            r = nx;
        }
    }
    orphans_retry(pool); /* a second chance for handles whose release failed before */
    raw_free(pool->htab, pool->hcap * sizeof *pool->htab);
    pthread_mutex_destroy(&pool->lock);
    /* Block slabs are not tracked individually; they are reclaimed with the process. */
    raw_free(pool, sizeof *pool);
}

static void fill_oom(struct msh_pool *pool, size_t req);

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One timed call: the total, the histogram behind the reports' latency percentiles, the max. */
static inline void lat_note(uint64_t *hist, uint64_t *total, uint64_t *max, uint64_t ns)
{
    *total += ns;
    hist[msh_lat_bucket(ns)]++;
    if (ns > *max) *max = ns;
}

static void note_alloc(struct msh_pool *pool, uint64_t req, bool used_new, bool reclaimed)
{
    struct msh_pool_stats *st = &pool->st;
    st->allocs++;
    st->live_bytes += req;
    st->live_blocks++;
    if (st->live_bytes > st->peak_live_bytes) st->peak_live_bytes = st->live_bytes;
    if (st->live_bytes > st->run_peak_live_bytes) st->run_peak_live_bytes = st->live_bytes;
    size_t mapped = pool->handles * pool->gran;
    if (mapped > st->peak_mapped_bytes) st->peak_mapped_bytes = mapped;
    if (mapped > st->run_peak_mapped_bytes) st->run_peak_mapped_bytes = mapped;
    size_t touched = pool->touched * pool->gran;
    if (touched > st->peak_touched_bytes) st->peak_touched_bytes = touched;
    if (reclaimed) st->rescue_reclaim++;
    (void)used_new;
    int bucket = 0;
    for (uint64_t s = req >> 9; s && bucket < 23; s >>= 1) bucket++;
    st->hist[bucket]++;
}

int msh_pool_alloc(struct msh_pool *pool, size_t size, uint64_t stream, uint64_t *addr)
{
    if (size > MAX_SIZE) return EINVAL;
    uint64_t rsize = round_up(size ? size : 1, BLOCK_ALIGN);
    uint64_t t0 = pool->timing ? now_ns() : 0;
    pthread_mutex_lock(&pool->lock);
    size_t handles0 = pool->handles; /* issue 8: a failed request gives back what it created */
    bool reclaimed = false;
    int rc = try_alloc(pool, rsize, size, stream, addr, &reclaimed);
    if (rc == ENOMEM && pool->gc_fn) {
        msh_pool_gc_fn fn = pool->gc_fn;
        void *arg = pool->gc_arg;
        pthread_mutex_unlock(&pool->lock);
        fn(arg); /* may free blocks through msh_pool_free */
        pthread_mutex_lock(&pool->lock);
        rc = try_alloc(pool, rsize, size, stream, addr, &reclaimed);
        if (rc == 0) pool->st.rescue_gc++;
    }
    if (rc == ENOMEM && pool->cached && (pool->driver_oom || !pool->prm.defrag) && !pool->prm.no_release_on_oom) {
        pool->driver_oom = false;
        /* Cached pages were already candidates for reclaim; giving them back helps when the
         * driver itself ran out (other allocators in the process hold the rest), and when reclaim
         * is off (MEMSHIM_DEFRAG=0: under a limit new pages can be created only after these go). */
        release_cached(pool, 0);
        rc = try_alloc(pool, rsize, size, stream, addr, &reclaimed);
        if (rc == 0) pool->st.rescue_empty_cache++;
    }
    if (rc == 0) {
        note_alloc(pool, size, false, reclaimed);
        if (pool->timing) lat_note(pool->st.alloc_lat, &pool->st.alloc_ns_total, &pool->st.alloc_ns_max, now_ns() - t0);
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    /* Pages this request created and could not use are given back: the memory a failed request
     * leaves held is what it found (cudaMemGetInfo's answer counts on that, issue 8). */
    if (pool->handles > handles0)
        release_cached(pool, (pool->cached > pool->handles - handles0 ? pool->cached - (pool->handles - handles0) : 0) *
                                 pool->gran);
    pool->st.alloc_fail++;
    pool->st.oom_events++;
    fill_oom(pool, size);
    struct msh_pool_oom o = pool->oom;
    pthread_mutex_unlock(&pool->lock);
    msh_warn("out of memory on device %d: requested %zu bytes; live %zu, reserved %zu, limit %zu, "
             "device free %zu of %zu, largest usable free extent %zu: %s",
             pool->dev->ordinal, o.requested, o.live_bytes, o.mapped_bytes, o.limit_bytes,
             o.device_free, o.device_total, o.largest_free,
             o.fragmentation ? "fragmentation (enough bytes are free, but not in usable pages)"
                             : "capacity (the live set does not fit)");
    return rc == ENOMEM ? ENOMEM : rc;
}

int msh_pool_free(struct msh_pool *pool, uint64_t addr, uint64_t stream)
{
    uint64_t t0 = pool->timing ? now_ns() : 0;
    pthread_mutex_lock(&pool->lock);
    struct blk *b = hash_remove(pool, addr);
    if (!b) {
        pthread_mutex_unlock(&pool->lock);
        return EINVAL;
    }
    pool->st.frees++;
    pool->st.live_bytes -= b->req;
    pool->st.live_blocks--;
    pages_release(pool, b);
    /* The freed extent remembers which streams' queued work may still touch it. */
    if (stream == MSH_STREAM_COMPLETED) {
        b->nstreams = 0;
        b->sync_needed = 0;
    } else {
        /* The free's stream plus every stream the block was used on (its allocation stream and
         * those added by record_stream), without duplicates. */
        int n = b->nstreams;
        uint64_t s[MAX_STREAMS];
        memcpy(s, b->streams, sizeof s);
        b->streams[0] = stream;
        b->nstreams = 1;
        for (int i = 0; i < n; i++) {
            bool seen = false;
            for (int j = 0; j < b->nstreams; j++) seen |= b->streams[j] == s[i];
            if (seen) continue;
            if (b->nstreams < MAX_STREAMS) b->streams[b->nstreams++] = s[i];
            else b->sync_needed = 1;
        }
        b->sync_epoch = pool->sync_count;
        pool->dirty = true;
    }
    blk_make_free(pool, b, b->reg->area);
    if (pool->prm.release_threshold && pool->cached * pool->gran > pool->prm.release_threshold)
        release_cached(pool, pool->prm.release_threshold);
    if (pool->timing) lat_note(pool->st.free_lat, &pool->st.free_ns_total, &pool->st.free_ns_max, now_ns() - t0);
    pthread_mutex_unlock(&pool->lock);
    return 0;
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
        bool seen = false;
        for (int i = 0; i < b->nstreams; i++) seen |= b->streams[i] == stream;
        if (!seen) {
            if (b->nstreams < MAX_STREAMS) b->streams[b->nstreams++] = stream;
            else b->sync_needed = 1; /* too many streams to track: synchronize before reuse */
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}

size_t msh_pool_empty_cache(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    size_t n = release_cached(pool, 0);
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
            uint64_t hi = r->base + (uint64_t)r->hi_page * pool->gran;
            struct blk *first = r->first;
            size_t run = 0;
            for (struct blk *x = first; x && x->addr < hi; x = x->next) {
                if (!x->free) {
                    run = 0;
                    continue;
                }
                uint64_t end = x->addr + x->size < hi ? x->addr + x->size : hi;
                for (uint64_t a0 = x->addr; a0 < end;) {
                    uint32_t p = (uint32_t)((a0 - r->base) / pool->gran);
                    uint64_t pend = r->base + (uint64_t)(p + 1) * pool->gran;
                    if (pend > end) pend = end;
                    if (r->pages[p].handle) {
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
    return __atomic_load_n(&pool->handles, __ATOMIC_RELAXED) * pool->gran;
}

void msh_pool_get_stats(struct msh_pool *pool, struct msh_pool_stats *out)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.mapped_bytes = pool->handles * pool->gran;
    pool->st.handle_bytes = pool->handles * pool->gran;
    pool->st.touched_bytes = pool->touched * pool->gran;
    scan_free(pool, &pool->st.free_bytes, &pool->st.largest_free);
    *out = pool->st;
    pthread_mutex_unlock(&pool->lock);
}

void msh_pool_reset_peaks(struct msh_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.peak_live_bytes = pool->st.live_bytes;
    pool->st.peak_mapped_bytes = pool->handles * pool->gran;
    pool->st.peak_touched_bytes = pool->touched * pool->gran;
    pthread_mutex_unlock(&pool->lock);
}

static void fill_oom(struct msh_pool *pool, size_t req)
{
    struct msh_pool_oom *o = &pool->oom;
    memset(o, 0, sizeof *o);
    o->requested = req;
    size_t f = 0, t = 0;
    if (pool->dev->ops->mem_info(pool->dev, &f, &t) == 0) {
        o->device_free = f;
        o->device_total = t;
    }
    o->live_bytes = pool->st.live_bytes;
    o->mapped_bytes = pool->handles * pool->gran;
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
        for (struct blk *b = pool->htab[i]; b; b = b->hnext) fn(arg, b->addr, b->req, b->streams[0]);
    pthread_mutex_unlock(&pool->lock);
}

/* ---- issue 8: streams that go away, blocks by interior address, pages released with a block -- */

/* Drop `stream` from the first *n entries of list; true when it was there. */
static bool streams_drop(uint64_t *list, uint8_t *n, uint64_t stream)
{
    int k = 0;
    bool found = false;
    for (int i = 0; i < *n; i++) {
        if (list[i] == stream) found = true;
        else list[k++] = list[i];
    }
    *n = (uint8_t)k;
    return found;
}

/* A destroyed stream's handle is undefined from then on (the driver may give the value to a new
 * stream), so no tag may name it afterwards. Tagged blocks, live or free, trade the tag for
 * sync_needed: whoever reuses them elsewhere first waits for the whole device, which covers the
 * stream's last work whether or not it has finished. No device call here. */
int msh_pool_forget_stream(struct msh_pool *pool, uint64_t stream)
{
    if (stream == MSH_STREAM_COMPLETED) return 0;
    pthread_mutex_lock(&pool->lock);
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b; b = b->hnext)
            if (streams_drop(b->streams, &b->nstreams, stream)) b->sync_needed = 1;
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (struct blk *b = r->first; b; b = b->next)
                if (b->free && !blk_clean(pool, b) && streams_drop(b->streams, &b->nstreams, stream))
                    b->sync_needed = 1;
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
            if (!x->free && addr - x->addr < (x->req ? x->req : 1)) b = x;
    }
    if (b) {
        *base = b->addr;
        *size = b->req ? b->req : 1;
    }
    pthread_mutex_unlock(&pool->lock);
    return b ? 0 : EINVAL;
}

bool msh_pool_covers(struct msh_pool *pool, uint64_t addr)
{
    pthread_mutex_lock(&pool->lock);
    bool in = region_of(pool, addr) != NULL;
    pthread_mutex_unlock(&pool->lock);
    return in;
}

void msh_pool_counters(struct msh_pool *pool, struct msh_pool_counters *out)
{
    pthread_mutex_lock(&pool->lock);
    out->gran = pool->gran;
    out->limit = pool->limit;
    out->handles = pool->handles;
    out->cached_pages = pool->cached;
    out->touched_pages = pool->touched;
    out->live_bytes = pool->st.live_bytes;
    out->defrag = pool->prm.defrag;
    out->release_on_oom = !pool->prm.no_release_on_oom;
    pthread_mutex_unlock(&pool->lock);
}

/* Give back to the driver the cached pages of [p0, p1] in r (pages no live block touches). */
static size_t release_range_locked(struct msh_pool *pool, struct region *r, uint32_t p0, uint32_t p1)
{
    size_t released = 0;
    for (uint32_t p = p0; p <= p1 && p < r->hi_page; p++) {
        struct page *pg = &r->pages[p];
        if (!pg->handle || pg->live) continue;
        if (settle_before_unmap(pool)) break;
        if (dev_unmap(pool, r->base + (uint64_t)p * pool->gran, pool->gran)) break;
        pool->st.unmap_ops++;
        cache_remove(pool, r, p);
        handle_release(pool, pg->handle);
        pg->handle = 0;
        pool->st.released_pages++;
        released += pool->gran;
    }
    return released;
}

/* Free a block, then return to the driver the pages it touched that no live block touches any
 * more (DESIGN.md 3: a cudaFree in segment mode is PyTorch giving memory back). */
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
    if (pool->norphans) orphans_retry(pool);
    size_t n = release_range_locked(pool, r, p0, p1);
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

/* Walk the treap: in-order keys strictly increase, children's priorities never exceed their
 * parent's, every node is a free block of `area`. Counts nodes into *n. Recursion depth is the
 * treap's height (expected O(log n)); a corrupt tree deeper than 4096 is reported, not followed. */
static const char *treap_walk(const struct blk *t, int area, const struct blk **prev, size_t *n, int depth)
{
    if (!t) return NULL;
    if (depth > 4096) return "treap deeper than 4096 (a cycle?)";
    if (t->tl && t->tl->prio > t->prio) return "treap heap order broken (left child)";
    if (t->tr && t->tr->prio > t->prio) return "treap heap order broken (right child)";
    const char *e = treap_walk(t->tl, area, prev, n, depth + 1);
    if (e) return e;
    if (!t->free) return "a live block is in the free treap";
    if (!t->reg || t->reg->area != area) return "a free treap holds a block of another area";
    if (*prev && !key_less(*prev, t)) return "treap keys out of (size, addr) order";
    *prev = t;
    (*n)++;
    return treap_walk(t->tr, area, prev, n, depth + 1);
}

int msh_pool_check(struct msh_pool *pool, char *why, size_t whylen)
{
    int rc = 0;
    int32_t *live_count = NULL;
    size_t live_count_bytes = 0;
    if (why && whylen) why[0] = 0;
    pthread_mutex_lock(&pool->lock);
    size_t nfree[NAREAS] = {0}, nlive = 0, live_bytes = 0, mapped = 0, touched = 0, cached = 0;
    size_t va = 0;
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
                if (b->free) {
                    if (prev && prev->free) CHECK_FAIL("free neighbours %#llx and %#llx were not merged",
                                                       (unsigned long long)prev->addr, (unsigned long long)b->addr);
                    nfree[a]++;
                } else {
                    nlive++;
                    live_bytes += b->req;
                    if (b->req > b->size) CHECK_FAIL("block %#llx: requested %llu > extent %llu", (unsigned long long)b->addr,
                                                     (unsigned long long)b->req, (unsigned long long)b->size);
                    if (hash_find(pool, b->addr) != b) CHECK_FAIL("live block %#llx is not in the hash", (unsigned long long)b->addr);
                    uint32_t p0, p1;
                    page_range(pool, b, &p0, &p1);
                    if (p1 >= r->hi_page) CHECK_FAIL("live block %#llx touches page %u above hi_page %u",
                                                     (unsigned long long)b->addr, p1, r->hi_page);
                    for (uint32_t p = p0; p <= p1; p++) live_count[p]++;
                }
                expect = b->addr + b->size;
                prev = b;
            }
            if (expect != r->base + r->size) CHECK_FAIL("region %#llx: blocks end at %#llx, not at its end",
                                                        (unsigned long long)r->base, (unsigned long long)expect);
            /* 2. pages: live counts, mappings, the cached list */
            size_t ncached_here = 0;
            for (uint32_t p = 0; p < r->hi_page; p++) {
                const struct page *pg = &r->pages[p];
                if (pg->live != live_count[p]) CHECK_FAIL("region %#llx page %u: live count %d, but %d live blocks touch it",
                                                          (unsigned long long)r->base, p, pg->live, live_count[p]);
                if (pg->live && !pg->handle) CHECK_FAIL("region %#llx page %u: touched by a live block but not mapped",
                                                        (unsigned long long)r->base, p);
                if (pg->handle) mapped++;
                if (pg->live) touched++;
                if (pg->handle && !pg->live) ncached_here++;
            }
            for (uint32_t p = r->hi_page; p < r->npages && p < r->hi_page + 1; p++)
                if (r->pages[p].handle || r->pages[p].live) CHECK_FAIL("region %#llx page %u above hi_page is in use",
                                                                      (unsigned long long)r->base, p);
            size_t walked = 0;
            uint32_t prevp = NO_PAGE;
            for (uint32_t p = r->chead; p != NO_PAGE; p = r->pages[p].cnext) {
                if (p >= r->hi_page) CHECK_FAIL("region %#llx: cached page %u is above hi_page", (unsigned long long)r->base, p);
                if (r->pages[p].cprev != prevp) CHECK_FAIL("region %#llx: cached list back link broken at page %u",
                                                           (unsigned long long)r->base, p);
                if (!r->pages[p].handle || r->pages[p].live) CHECK_FAIL("region %#llx: cached page %u is %s",
                                                                        (unsigned long long)r->base, p,
                                                                        r->pages[p].handle ? "touched by a live block" : "not mapped");
                if (++walked > r->hi_page) CHECK_FAIL("region %#llx: cached list has a cycle", (unsigned long long)r->base);
                prevp = p;
            }
            if (r->ctail != prevp) CHECK_FAIL("region %#llx: cached list tail is %u, the walk ends at %u",
                                              (unsigned long long)r->base, r->ctail, prevp);
            if (walked != ncached_here || r->ncached != ncached_here)
                CHECK_FAIL("region %#llx: %zu mapped pages without a live block, %zu on the cached list, count says %zu",
                           (unsigned long long)r->base, ncached_here, walked, r->ncached);
            cached += ncached_here;
        }
    }
    /* 3. the free treaps hold exactly the free blocks */
    for (int a = 0; a < NAREAS; a++) {
        const struct blk *prev = NULL;
        size_t n = 0;
        const char *e = treap_walk(pool->tree[a], a, &prev, &n, 0);
        if (e) CHECK_FAIL("area %d: %s", a, e);
        if (n != nfree[a]) CHECK_FAIL("area %d: %zu free blocks in the regions, %zu in the treap", a, nfree[a], n);
    }
    /* 4. the hash holds exactly the live blocks */
    size_t nhash = 0;
    for (size_t i = 0; i < pool->hcap; i++)
        for (const struct blk *b = pool->htab[i]; b; b = b->hnext) {
            if (b->free) CHECK_FAIL("a free block %#llx is in the live hash", (unsigned long long)b->addr);
            if (hash_addr(b->addr, pool->hcap) != i) CHECK_FAIL("live block %#llx is in the wrong hash bucket", (unsigned long long)b->addr);
            if (++nhash > nlive) break;
        }
    if (nhash != nlive || pool->hcount != nlive)
        CHECK_FAIL("%zu live blocks in the regions, %zu in the hash, hash count %zu", nlive, nhash, pool->hcount);
    /* 5. handles and the counters behind the stats */
    if (pool->handles != mapped + (size_t)pool->norphans)
        CHECK_FAIL("handles held %zu != mapped pages %zu + orphans %d", pool->handles, mapped, pool->norphans);
    if (pool->touched != touched) CHECK_FAIL("touched pages %zu, recount %zu", pool->touched, touched);
    if (pool->cached != cached) CHECK_FAIL("cached pages %zu, recount %zu", pool->cached, cached);
    if (pool->st.live_bytes != live_bytes) CHECK_FAIL("live bytes %zu, recount %zu", pool->st.live_bytes, live_bytes);
    if (pool->st.live_blocks != nlive) CHECK_FAIL("live blocks %zu, recount %zu", pool->st.live_blocks, nlive);
    if (pool->st.va_bytes != va) CHECK_FAIL("reserved VA %zu, recount %zu", pool->st.va_bytes, va);
    if (pool->st.peak_live_bytes < live_bytes || pool->st.run_peak_live_bytes < pool->st.peak_live_bytes)
        CHECK_FAIL("live peaks (epoch %zu, run %zu) below the current %zu", pool->st.peak_live_bytes,
                   pool->st.run_peak_live_bytes, live_bytes);
    if (pool->st.peak_mapped_bytes < mapped * pool->gran || pool->st.run_peak_mapped_bytes < pool->st.peak_mapped_bytes)
        CHECK_FAIL("reserved peaks (epoch %zu, run %zu) below the current %zu", pool->st.peak_mapped_bytes,
                   pool->st.run_peak_mapped_bytes, mapped * pool->gran);
    if (pool->st.allocs < pool->st.frees || pool->st.allocs - pool->st.frees != nlive)
        CHECK_FAIL("allocs %llu - frees %llu != live blocks %zu", (unsigned long long)pool->st.allocs,
                   (unsigned long long)pool->st.frees, nlive);
    if (pool->limit && pool->handles * pool->gran > pool->limit)
        CHECK_FAIL("holds %zu bytes of handles over the limit %zu", pool->handles * pool->gran, pool->limit);
out:
    pthread_mutex_unlock(&pool->lock);
    raw_free(live_count, live_count_bytes);
    return rc;
}
