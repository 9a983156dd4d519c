/*
 * extents.c: the pool's VA line (docs/pool.md "Placement").
 *
 * Owns every extent of every region: the blocks in address order (each byte belongs to exactly
 * one), the free treaps by (size, address) and by address, the live hash (address -> block),
 * regions and the areas they belong to, carving a block out of a free extent, coalescing a freed
 * one with its neighbours, and best-fit placement (with the stream checks that say whether a
 * free extent can be used now, streams.c); and the memory for all of these, taken from mmap.
 *
 * Must never call the driver or map a page (pages.c backs what is placed here), never allocate
 * with malloc, and never touch an extent without the pool lock held.
 */
#include "internal.h"

/* ---- memory for the pool's own structures (mmap, never malloc) ------------------------------ */

void *raw_alloc(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void raw_free(void *p, size_t bytes)
{
    if (p) munmap(p, bytes);
}

/* Grow an array kept in raw memory (or in `inl`, its first storage) to hold one more element. */
bool arr_grow(void **v, uint32_t *cap, size_t elem, const void *inl)
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
    zero_head(b, offsetof(struct blk, s)); /* s[] is read only below ns (0) */
    pool->rng = pool->rng * 1103515245u + 12345u;
    b->prio = pool->rng ^ (pool->rng >> 16);
    return b;
}

static void blk_put(struct msh_pool *pool, struct blk *b)
{
    b->hnext = pool->spare;
    pool->spare = b;
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

static inline bool skey_less(uint64_t as, uint64_t aa, uint64_t bs, uint64_t ba)
{
    return as < bs || (as == bs && aa < ba);
}

/* Free block n of the tree by size gets the extent [addr, addr + size): it keeps its node where
 * the new key still lies between its neighbours in (size, address) order (most carves and merges
 * of the largest extents: one walk down instead of taking it out and putting it in), else it is
 * moved. */
static void ts_resize(struct blk **root, struct blk *n, uint64_t addr, uint64_t size)
{
    const struct blk *pred = NULL, *succ = NULL, *t = *root;
    while (t && t != n) {
        if (key_less(n, t)) {
            succ = t;
            t = t->kid[TS][0];
        } else {
            pred = t;
            t = t->kid[TS][1];
        }
    }
    bool stays = t != NULL;
    if (stays && n->kid[TS][0])
        for (pred = n->kid[TS][0]; pred->kid[TS][1];) pred = pred->kid[TS][1];
    if (stays && n->kid[TS][1])
        for (succ = n->kid[TS][1]; succ->kid[TS][0];) succ = succ->kid[TS][0];
    stays = stays && (!pred || skey_less(pred->size, pred->addr, size, addr)) &&
            (!succ || skey_less(size, addr, succ->size, succ->addr));
    if (!stays) treap_remove(TS, root, n);
    n->addr = addr;
    n->size = size;
    if (!stays) treap_insert(TS, root, n);
}

/* The free block with the highest address <= addr, or NULL. */
struct blk *atreap_floor(struct blk *t, uint64_t addr)
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

int hash_grow(struct msh_pool *pool)
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

struct blk *hash_find(struct msh_pool *pool, uint64_t addr)
{
    struct blk **pp = hash_slot(pool, addr);
    return pp ? *pp : NULL;
}

void hash_insert(struct msh_pool *pool, struct blk *b)
{
    size_t h = hash_addr(b->addr, pool->hcap);
    b->hnext = pool->htab[h];
    pool->htab[h] = b;
    pool->hcount++;
}

struct blk *hash_remove(struct msh_pool *pool, uint64_t addr)
{
    struct blk **pp = hash_slot(pool, addr);
    if (!pp) return NULL;
    struct blk *b = *pp;
    hash_unlink(pool, pp);
    return b;
}

/* ---- regions ----------------------------------------------------------------------------------- */

size_t round_up(size_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

/* Reserve a new VA range for `area` (called with the lock held; the reservation is made without
 * it). Returns false when the driver or memory refused. */
bool region_add(struct msh_pool *pool, int area, uint64_t min_bytes)
{
    uint64_t size = pool->prm.va_bytes;
    if (size < min_bytes) size = min_bytes;
    size = round_up(size, pool->gran);
    if (size / pool->gran > MAX_REGION_PAGES) return false;
    uint32_t npages = (uint32_t)(size / pool->gran);
    msh_unlock(&pool->lock);
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
    msh_lock(&pool->lock);
    if (!r) return false;
    struct blk *b = blk_new(pool);
    if (!b) {
        msh_unlock(&pool->lock);
        raw_free(r, sizeof *r);
        raw_free(pages, (size_t)npages * sizeof *pages);
        dev_unreserve(pool, va, size);
        msh_lock(&pool->lock);
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

int area_of(const struct msh_pool *pool, uint64_t rsize)
{
    return rsize <= pool->prm.small_max ? 0 : 1;
}

/* Return a block (in no treap) to its area's free treaps, merging free neighbours; their tags
 * stay exact (streams_merge). A free neighbour's node takes b's bytes in: the order by address
 * of the free extents cannot change (b lies between it and the next free one), so only the tree
 * by size moves it (issue 30: half the treap work of taking b out and putting it in again). */
void blk_make_free(struct msh_pool *pool, struct blk *b)
{
    b->state = B_FREE;
    struct blk *n = b->next, *p = b->prev;
    bool nf = n && n->state == B_FREE, pf = p && p->state == B_FREE;
    struct blk **ts = &pool->tree[b->reg->area];
    if (pf) { /* p takes b (and n) in: its address stays */
        if (nf) {
            free_remove(pool, n);
            streams_merge(pool, b, n);
            b->size += n->size;
            b->next = n->next;
            if (n->next) n->next->prev = b;
            blk_put(pool, n);
        }
        streams_merge(pool, p, b);
        p->next = b->next;
        if (b->next) b->next->prev = p;
        ts_resize(ts, p, p->addr, p->size + b->size);
        blk_put(pool, b);
    } else if (nf) { /* n takes b in: it starts at b's address, still after every free extent before it */
        streams_merge(pool, n, b);
        n->prev = p;
        if (p) p->next = n;
        else n->reg->first = n;
        ts_resize(ts, n, b->addr, n->size + b->size);
        blk_put(pool, b);
    } else {
        free_insert(pool, b);
    }
}

/* Make [at, at + rsize) of the free block b a pending block (returned); the rest stays free and
 * keeps b's stream tags. NULL when the pool's own memory ran out (b unchanged). */
struct blk *carve_at(struct msh_pool *pool, struct blk *b, uint64_t at, uint64_t rsize)
{
    uint64_t end = b->addr + b->size;
    if ((at > b->addr) != (at + rsize < end)) {
        /* One end: the rest stays free in b's node, whose place by address holds (the tree by
         * size moves it), and the block is a new node (issue 30: no work in the tree by address). */
        struct blk *c = blk_new(pool);
        if (!c) return NULL;
        c->reg = b->reg;
        c->state = B_PENDING;
        c->addr = at;
        c->size = rsize;
        streams_copy(pool, c, b);
        if (at == b->addr) { /* the low end: c before b */
            c->prev = b->prev;
            c->next = b;
            if (b->prev) b->prev->next = c;
            else b->reg->first = c;
            b->prev = c;
            ts_resize(&pool->tree[b->reg->area], b, at + rsize, end - (at + rsize));
        } else { /* the high end: c after b */
            c->prev = b;
            c->next = b->next;
            if (b->next) b->next->prev = c;
            b->next = c;
            ts_resize(&pool->tree[b->reg->area], b, b->addr, at - b->addr);
        }
        streams_clip(pool, b);
        streams_clip(pool, c);
        return c;
    }
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
    uint64_t p0 = pg_div(pool, a - r->base), p1 = pg_div(pool, a + size - 1 - r->base);
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
    if (cap != SIZE_MAX) return pool->held + pool->releasing + need <= cap;
    return !pool->device_total || (pool->held + need) * pool->gran < pool->device_total / 4 * 3;
}

/* Memory no stream has used: the open end of a region's VA line, above every page ever mapped
 * (no tags, no handle to split). NULL with *rc = ENOSPC when no region of the area has room. */
struct blk *place_fresh(struct msh_pool *pool, int area, uint64_t rsize, int *rc)
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
struct blk *place(struct msh_pool *pool, int area, uint64_t rsize, uint64_t stream, int *rc)
{
    struct blk *b = pool->step ? plan_place(pool, rsize) : NULL;
    if (b) return b;
    struct fit_search fs; /* (blocked[] is read below nblocked only) */
    fs.rsize = rsize;
    fs.stream = stream;
    memset(fs.pick, 0, sizeof fs.pick);
    fs.seen = fs.nblocked = 0;
    fit_visit(pool, pool->tree[area], &fs);
    /* At once on mapped pages if possible; else a stream wait (no host blocking) on mapped pages
     * rather than growing the pool; then the same on new pages, while they fit without reclaim
     * (else a synchronize and the mapped extent cost less than a reclaim: below). A
     * host-synchronous user (cudaMalloc) takes the synchronize over new pages: growing for each of
     * them took a soak over the real traces to the pool's whole room (60 GiB for 7 GiB live),
     * where streams ask for events and stop needing either. */
    uint64_t at = 0;
    bool host = stream == MSH_STREAM_COMPLETED;
    /* (asked only when no extent serves on mapped pages: most requests find one) */
    bool grow = !fs.pick[PICK_READY].b && !fs.pick[PICK_WAIT].b &&
                ((!host && fresh_fits(pool, rsize)) || capturing(pool));
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
