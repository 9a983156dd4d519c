/*
 * pages.c: pages and handles, and the driver work that backs them (docs/pool.md "Handles",
 * "Pressure and the OOM rescue chain").
 *
 * Owns the page tables of the regions: which handle is mapped at each page, how many live blocks
 * touch it, the cached handles (mapped, touched by no live block) oldest first and their reclaim
 * under pressure, the budget of pages held against the limit, and the driver work itself: a
 * request claims its pages under the lock, creates, maps and sets access (or unmaps and
 * releases) without it, and publishes the result under the lock again. Every device call is
 * counted by kind here (drvcost.h).
 *
 * Must never call the driver with the pool lock held, never unmap a page whose last use may
 * still run on a stream (streams.c says what to wait for), never unmap or synchronize while the
 * device captures a CUDA graph (ECAPTURE), and never leave a multi-page handle partly in use.
 */
#include "internal.h"

/* ---- device calls, counted by kind (drvcost.h) ------------------------------------------------
 * Called without the pool lock, from any thread: the counters are atomic. */

const char *const msh_drv_call_names[MSH_DRV_NKINDS] = {
#define MSH_DRV_NAME_(e, s) s,
    MSH_DRV_CALLS(MSH_DRV_NAME_)
#undef MSH_DRV_NAME_
};

/* maps: the mappings (handles) the call covers; one for every call but an access grant over a
 * span of several (dev_set_access_span), which the driver pays per mapping (drvcost.h). */
static inline void drv_count_maps(struct msh_pool *pool, enum msh_drv_call k, uint64_t bytes, uint64_t maps)
{
    __atomic_fetch_add(&pool->st.drv_calls[k], 1, __ATOMIC_RELAXED);
    if (bytes) __atomic_fetch_add(&pool->st.drv_bytes[k], bytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&pool->st.drv_maps[k], maps, __ATOMIC_RELAXED);
}

static inline void drv_count(struct msh_pool *pool, enum msh_drv_call k, uint64_t bytes)
{
    drv_count_maps(pool, k, bytes, 1);
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
        /* held first, then the peaks: a check in between (it holds the lock, this does not)
         * would see a peak below what is held; it sees in != out and leaves the peaks alone */
        __atomic_fetch_add(&pool->drv_creates_in, 1, __ATOMIC_SEQ_CST);
        size_t now = __atomic_add_fetch(&pool->drv_held, size, __ATOMIC_SEQ_CST);
        peak_raise(&pool->drv_peak_epoch, now);
        peak_raise(&pool->drv_peak_run, now);
        peak_raise(&pool->drv_peak_step, now);
        __atomic_fetch_add(&pool->drv_creates_out, 1, __ATOMIC_SEQ_CST);
    }
    return rc;
}

int dev_release(struct msh_pool *pool, uint64_t h, size_t size)
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

int dev_set_access(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_SET_ACCESS, size);
    return pool->dev->ops->set_access(pool->dev, va, size);
}

/* One grant over a span of `maps` adjacent mappings (CUDA allows it; the cost is per mapping). */
static int dev_set_access_span(struct msh_pool *pool, uint64_t va, size_t size, uint32_t maps)
{
    drv_count_maps(pool, MSH_DRV_SET_ACCESS, size, maps);
    return pool->dev->ops->set_access(pool->dev, va, size);
}

int dev_unmap(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_UNMAP, size);
    return pool->dev->ops->unmap(pool->dev, va, size);
}

/* Spill (spill.c): host memory, the copies between the two, and giving host memory back (not
 * device memory: drv_held counts the device's bytes only). */
int dev_host_create(struct msh_pool *pool, size_t size, uint64_t *h)
{
    drv_count(pool, MSH_DRV_HOST_CREATE, size);
    return pool->dev->ops->host_create(pool->dev, size, h);
}

int dev_host_release(struct msh_pool *pool, uint64_t h, size_t size)
{
    drv_count(pool, MSH_DRV_RELEASE, size);
    return pool->dev->ops->release(pool->dev, h, size);
}

int dev_copy(struct msh_pool *pool, uint64_t dst, uint64_t src, size_t size, bool to_host)
{
    drv_count(pool, to_host ? MSH_DRV_COPY_D2H : MSH_DRV_COPY_H2D, size);
    return pool->dev->ops->copy(pool->dev, dst, src, size);
}

int dev_create_counted(struct msh_pool *pool, size_t size, uint64_t *h)
{
    return dev_create(pool, size, h);
}

int dev_map_counted(struct msh_pool *pool, uint64_t va, size_t size, uint64_t h)
{
    return dev_map(pool, va, size, h);
}

int dev_mem_info(struct msh_pool *pool, size_t *free_b, size_t *total)
{
    drv_count(pool, MSH_DRV_MEM_INFO, 0);
    return pool->dev->ops->mem_info(pool->dev, free_b, total);
}

int dev_synchronize(struct msh_pool *pool)
{
    drv_count(pool, MSH_DRV_SYNCHRONIZE, 0);
    return pool->dev->ops->synchronize(pool->dev);
}

int dev_event_record(struct msh_pool *pool, uint64_t ev, uint64_t stream)
{
    drv_count(pool, MSH_DRV_EVENT_RECORD, 0);
    return pool->dev->ops->event_record(pool->dev, ev, stream);
}

static int dev_stream_wait(struct msh_pool *pool, uint64_t stream, uint64_t ev)
{
    drv_count(pool, MSH_DRV_STREAM_WAIT, 0);
    return pool->dev->ops->stream_wait(pool->dev, stream, ev);
}

int dev_reserve(struct msh_pool *pool, size_t size, uint64_t *va)
{
    drv_count(pool, MSH_DRV_RESERVE, size);
    return pool->dev->ops->reserve(pool->dev, size, pool->gran, va);
}

int dev_unreserve(struct msh_pool *pool, uint64_t va, size_t size)
{
    drv_count(pool, MSH_DRV_UNRESERVE, size);
    return pool->dev->ops->unreserve(pool->dev, va, size);
}

/* ---- cached handles (mapped, touched by no live block), oldest first ---------------------------
 * Two lists per region: handles inside the learned step's footprint (page.plan) are reclaimed
 * last, so that a step that fits keeps its pages mapped. */

static inline uint32_t now_ms(const struct msh_pool *pool)
{
    return (uint32_t)((msh_now_ns() - pool->t0_ns) / 1000000u);
}

void cache_add(struct msh_pool *pool, struct region *r, uint32_t h)
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

void cache_remove(struct msh_pool *pool, struct region *r, uint32_t h)
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
    if (h->nlive++ == 0 && h->state == PG_MAPPED) {
        if (h->host) pool->spill_idle -= h->npages; /* host memory is never cached (spill.c) */
        else cache_remove(pool, r, hp);
    }
}

static void page_untouch(struct msh_pool *pool, struct region *r, uint32_t p)
{
    struct page *pg = &r->pages[p];
    if (--pg->live != 0) return;
    pool->touched--;
    uint32_t hp = pg_head(pg);
    if (hp == NO_PAGE) return;
    struct page *h = &r->pages[hp];
    if (--h->nlive == 0 && h->state == PG_MAPPED) {
        if (h->host) pool->spill_idle += h->npages; /* given back at the next step mark */
        else cache_add(pool, r, hp);
    }
}

void block_untouch(struct msh_pool *pool, struct blk *b)
{
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    for (uint32_t p = p0; p <= p1; p++) page_untouch(pool, b->reg, p);
}
enum { RUN_NONE = 0, RUN_RELEASED, RUN_ORPHANED };

void job_init(struct job *j)
{
    zero_head(j, offsetof(struct job, waits)); /* the arrays after it are read below their counts */
    j->runs = j->runs_inl;
    j->vic = j->vic_inl;
    j->capruns = j->capvic = JOB_INL;
}

void job_fini(struct msh_pool *pool, struct job *j)
{
    job_released(pool, j); /* a job never run gives its victims' pages back as room (none today) */
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

static bool job_add_run(struct job *j, uint32_t p0, uint32_t n)
{
    if (j->nruns == j->capruns) {
        void *v = j->runs;
        if (!arr_grow(&v, &j->capruns, sizeof *j->runs, j->runs_inl)) return false;
        j->runs = v;
    }
    j->runs[j->nruns++] = (struct run){.p0 = p0, .n = n, .vic = -1, .of = -1};
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

/* Whether the device, as the request asked it, is too full to call the pool far from any limit:
 * everyone's use (other processes' included) plus `pages` more would reach 3/4 of the device. */
static bool device_crowded(const struct msh_pool *pool, const struct room *rm, size_t pages)
{
    size_t total = pool->device_total, used = total > rm->dev_free ? total - rm->dev_free : 0;
    return used + pages * pool->gran >= total / 4 * 3;
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
void job_need_settle(struct msh_pool *pool, struct job *j)
{
    if (pool->free_gen > pool->synced_gen) {
        j->sync = true;
        j->sync_gen = pool->free_gen;
    }
}

/* Detach the cached handle at r's page h as a victim of job j. */
bool take_victim(struct msh_pool *pool, struct job *j, struct region *r, uint32_t h, int kind)
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


/* The pages a split handle keeps beside the block (runs [piece0, nruns) of j, pages no block
 * touches) are cached pages like any other: one page per handle, the pool could reclaim each of
 * them for the block that split it. So when the block cannot be backed otherwise (the rest of the
 * cache is too small), `short_by` of those pages are left unmapped instead, the farthest from the
 * block first; before, the split kept them all and the request failed (issue 15: a synthetic
 * offload trace needed 8 more pages than with one handle per page). Only then: while the cache
 * suffices, reclaiming its oldest handles keeps what a repeated pattern needs next. No run of j
 * maps a victim yet, so runs can be cut and removed. *need drops by the pages left out. */
static bool split_drop(struct msh_pool *pool, struct job *j, uint32_t piece0, size_t short_by, size_t *need)
{
    for (uint32_t i = j->nruns; short_by && i-- > piece0;) {
        struct run *ru = &j->runs[i];
        struct victim *v = &j->vic[ru->of];
        uint32_t cut = ru->n < short_by ? ru->n : (uint32_t)short_by;
        if (ru->p0 == v->head) ru->p0 += cut; /* the piece before the block: drop its low end */
        ru->n -= cut;
        v->dropped += cut;
        short_by -= cut;
        *need -= cut;
        pool->pressure_reclaims++;
        if (!ru->n) {
            memmove(ru, ru + 1, (size_t)(j->nruns - i - 1) * sizeof *ru);
            j->nruns--;
        }
    }
    return !short_by;
}

/* Claim the pages block b touches: existing mappings are shared (a cached handle stops being
 * cached), missing pages become runs to map, one handle per run: a page b only partly covers
 * (which a neighbour may share) gets a handle of its own, the pages b covers whole one handle
 * together. A multi-page handle is therefore only ever touched by one block that covers all of
 * it; a cached one that b would cover only in part is split (unmapped, released, and b's part
 * mapped anew), so that no handle is ever partly in use and every page no block touches can be
 * reclaimed. Within `cap` pages of handles held; beyond it (defrag) cached handles are taken
 * back, oldest first, and a victim of the right size is mapped again instead of being released.
 * EAGAIN: another thread is mapping or unmapping one of these pages, or is releasing the handles
 * whose room this claim needs (nothing claimed: wait for its publish and claim again); ENOMEM:
 * not enough memory even after reclaim (nothing claimed). */
int claim_pages(struct msh_pool *pool, struct blk *b, struct job *j, size_t cap)
{
    struct region *r = b->reg;
    int err = ENOMEM;
    /* during a capture nothing may be unmapped (split or reclaimed): ECAPTURE instead */
    bool cap_now = capturing(pool);
    uint32_t p0, p1;
    page_range(pool, b, &p0, &p1);
    bool edge_lo = b->addr > page_va(pool, r, p0);
    bool edge_hi = b->addr + b->size < page_va(pool, r, p1) + pool->gran;
    int64_t q0 = (int64_t)p0 + edge_lo, q1 = (int64_t)p1 - edge_hi; /* pages b covers whole */
    /* Handle by handle: one another thread maps or unmaps makes this claim wait; and whether the
     * claim is only touching pages (all mapped, and no cached handle that b covers in part, which
     * a claim under a limit splits below) */
    bool touch_only = true;
    for (uint32_t p = p0; p <= p1;) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h == NO_PAGE) {
            touch_only = false;
            p++;
            continue;
        }
        const struct page *hp = &r->pages[h];
        if (hp->state != PG_MAPPED) return EAGAIN;
        uint32_t next = h + hp->npages;
        if (hp->npages > 1 && !hp->nlive && !hp->host && !((int64_t)h >= q0 && (int64_t)next - 1 <= q1))
            touch_only = false;
        p = next;
    }
    for (uint32_t p = p0; pool->spill_pages && p <= p1; p++) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h != NO_PAGE && r->pages[h].host) return EHOSTPAGE;
    }
    j->r = r;
    if (touch_only) { /* issue 30: most claims; what the path below ends with when it needs nothing */
        for (uint32_t p = p0; p <= p1; p++) page_touch(pool, r, p);
        b->claimed = 1;
        return 0;
    }
    /* Far from any limit (none set, no driver refusal, under 3/4 of the device), handles save
     * driver calls: the pages b covers whole share one, and (relaxed) a handle may span several
     * blocks, a chunk mapped ahead at the open end of the line. Otherwise every page must stay
     * reclaimable: handles b would cover in part are split, and new ones are one page each. The
     * device's 3/4 counts every process's use once the request has asked (issue 31: beside a
     * co-tenant holding most of the card a request took its 20 MiB chunk too); a job claimed far
     * before asking is given up if the answer says otherwise (job_lacks_room). */
    uint32_t far_pages = (p1 - p0 + 1) + pool->chunk_pages;
    bool far = !limit_now(pool) && !pool->driver_oom &&
               (pool->held + far_pages) * pool->gran < pool->device_total / 4 * 3;
    if (far && j->room && j->room->asked && device_crowded(pool, j->room, far_pages)) far = false;
    j->far = far;
    j->far_pages = far_pages;
    bool relaxed = far && pool->chunk_pages > 1;
    /* At the limit, one handle per page (issue 15): a handle goes back to the driver whole, so a
     * page can be reclaimed alone only if it is a handle alone. Multi-page handles under a limit
     * cost capacity however they are cut: a split keeps pieces that need room (split_drop), and
     * the learned step had to share handles across blocks to switch to its plan without
     * re-partitioning them, so that a plan given up in mid-step left free pages pinned by one
     * live page (SYNTHETIC 10-stream offload traces: up to 3.8% above the page model's minimum
     * capacity); re-partitioning instead cost thousands of map+unmap in the pass that switched
     * (cs336 medium_1024: 4794 at C+0.5%), because the first pass had cut its handles for
     * best-fit blocks. With pages, the plan switches mapping nothing, as the page model does,
     * and the minimum capacity is the page model's. Far from any limit the savings stay. */
    uint32_t maxh = far ? pool->max_handle_pages : 1;
    uint32_t hi0 = r->hi_page;
    for (uint32_t p = p0; p <= p1 && !relaxed;) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h == NO_PAGE) {
            p++;
            continue;
        }
        struct page *hp = &r->pages[h];
        uint32_t next = h + hp->npages;
        if (hp->npages > 1 && !((int64_t)h >= q0 && (int64_t)next - 1 <= q1) && !hp->nlive && !hp->host) {
            if (cap_now) {
                err = ECAPTURE;
                goto fail;
            }
            if (!take_victim(pool, j, r, h, V_SPLIT)) goto fail;
            victim_unheld(pool, j, hp->npages);
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
            while ((int64_t)(p + n) <= q1 && MISSING_(p + n) && n < maxh) n++;
        if (relaxed && p + n - 1 >= p1 - 1 && p + n >= hi0) {
            /* the run reaches the open end of the line: map up to the next chunk boundary, the
             * pages after b that the next blocks placed there will use */
            uint32_t end = p1 + 1;
            while (end % pool->chunk_pages && end < r->npages && end >= hi0) end++;
            if (end % pool->chunk_pages == 0 && end > p + n && end - p <= pool->max_handle_pages) {
                j->ahead += end - (p + n);
                n = end - p;
            }
        }
        if (!job_add_run(j, p, n)) goto fail_touched;
        need += n;
        p += n;
    }
#undef MISSING_
    /* a split handle keeps its other pages mapped, as handles of their own (before and after b):
     * they stay cached, and the next time the same blocks come the handles fit them */
    uint32_t piece0 = j->nruns;
    size_t pieces = 0;
    for (uint32_t i = 0, nsplit = j->nvic; i < nsplit; i++) {
        const struct victim *v = &j->vic[i];
        if (v->head < p0) {
            if (!job_add_run(j, v->head, p0 - v->head)) goto fail_touched;
            j->runs[j->nruns - 1].of = (int32_t)i;
            pieces += p0 - v->head;
        }
        if (v->head + v->n - 1 > p1) {
            if (!job_add_run(j, p1 + 1, v->head + v->n - 1 - p1)) goto fail_touched;
            j->runs[j->nruns - 1].of = (int32_t)i;
            pieces += v->head + v->n - 1 - p1;
        }
    }
    need += pieces;
    if (!need) return 0;
    /* pages other jobs are releasing without the lock are still on the device: not room yet */
    size_t others = pool->releasing - j->releasing;
    size_t avail = cap == SIZE_MAX ? SIZE_MAX : (cap > pool->held + others ? cap - pool->held - others : 0);
    if (avail < need && others && cap != SIZE_MAX && cap > pool->held && cap - pool->held >= need) {
        err = EAGAIN; /* room once those releases are published: wait for them, never fail for it */
        goto fail_touched;
    }
    if (avail < need) {
        if (!pool->prm.defrag || avail + pool->cached + pieces < need) goto fail_touched;
        if (cap_now) {
            err = ECAPTURE;
            goto fail_touched;
        }
        if (avail + pool->cached < need && !split_drop(pool, j, piece0, need - avail - pool->cached, &need))
            goto fail_touched;
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
                victim_unheld(pool, j, v->n);
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
    /* the mappings one grant over the span covers: the runs and the handles mapped between them */
    j->acc_maps = 0;
    for (uint32_t p = j->acc_p0; j->nruns && p <= j->acc_p1;) {
        uint32_t h = pg_head(&r->pages[p]);
        if (h == NO_PAGE || h + r->pages[h].npages <= p) {
            p++;
            continue;
        }
        j->acc_maps++;
        p = h + r->pages[h].npages;
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
        if (v->run < 0) victim_reheld(pool, j, v->n);
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
                    victim_unheld(pool, j, r->pages[h].npages);
                }
    for (int i = 0; i < pool->norphans; i++) {
        j->orph[j->norph].h = pool->orphans[i].h;
        j->orph[j->norph].pages = pool->orphans[i].pages;
        /* not released until job_run says so: a job that stops before (a synchronize refused)
         * puts it back on the pool's list instead of counting it released */
        j->orph[j->norph].rc = EAGAIN;
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

/* Issue 25: before the first create of a request, ask the device (once per request) whether it has
 * room for what this job creates, after what it releases first. When it has not, the job is given
 * up before any driver work (every run and victim fails with ENOROOM, which job_publish undoes as a
 * failed unmap: the victims stay mapped where they were) and the request knows the device's room:
 * a request larger than what the device can give never maps page after page until the driver
 * refuses, filling the device that other processes use. A capture in progress is not asked (the
 * creates run as before: a refusal still ends them at once). */
static bool job_lacks_room(struct msh_pool *pool, struct job *j)
{
    struct room *rm = j->room;
    if (!rm || rm->asked || capturing(pool)) return false;
    size_t create = 0, freed = 0, gran = pool->gran, handles = 0;
    for (uint32_t i = 0; i < j->nruns; i++)
        if (j->runs[i].vic < 0) {
            create += j->runs[i].n;
            handles++;
        }
    for (uint32_t i = 0; i < j->nvic; i++)
        if (j->vic[i].run < 0) freed += j->vic[i].n;
    for (int i = 0; i < j->norph; i++) freed += j->orph[i].pages;
    if (create <= freed) return false; /* no new memory (a handle cut anew): nothing to ask */
    /* Asked only when the answer can change what the job does (issue 31; cuMemGetInfo is in the
     * cost table): one handle of exactly the block's pages is answered by its own create (a
     * refusal ends the job at once, nothing else taken, and the request learns the room). Several
     * creates could fill the device one by one before a refusal, and a chunk ahead is taken only
     * if the device is not crowded: those ask. */
    if (handles < 2 && !j->ahead) return false;
    size_t f = 0, t = 0;
    if (dev_mem_info(pool, &f, &t)) return false; /* no answer: the creates will tell */
    rm->asked = true;
    rm->dev_free = f;
    rm->drv_held = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    size_t cap = rm->drv_held / gran + f / gran;
    if (cap < rm->dev_cap) rm->dev_cap = cap;
    /* claimed far, but the device's other users make it crowded: placed again, not far (the
     * request retries at once, now knowing the room: try_alloc_all) */
    bool crowded = j->far && device_crowded(pool, rm, j->far_pages);
    if (!crowded && create <= f / gran + freed) return false;
    for (uint32_t i = 0; i < j->nvic; i++) j->vic[i].rc = ENOROOM;
    for (uint32_t i = 0; i < j->nruns; i++) j->runs[i].rc = ENOROOM;
    for (int i = 0; i < j->norph; i++) j->orph[i].rc = ENOROOM;
    j->sync = false; /* nothing was synchronized */
    return true;
}

/* The driver work, without the lock. Order matters: a synchronize before any unmap; unmaps and
 * releases before creates, so that the device never holds more than the limit; access once over
 * the whole span just mapped; stream waits last. The first create the driver refuses for memory
 * ends the creates: those made before it are unmapped and released (the request gives back what
 * it made, and another process gets that memory at once), and nothing more is asked. */
static void job_run(struct msh_pool *pool, struct job *j)
{
    size_t gran = pool->gran;
    if (job_lacks_room(pool, j)) return;
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
    bool ok = true, refused = false;
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
        } else if (refused) {
            ru->rc = ENOMEM; /* never asked: the driver has just refused one */
            continue;
        } else {
            ru->rc = dev_create(pool, bytes, &h);
            if (ru->rc) {
                if (ru->rc == ENOMEM) {
                    j->driver_enomem = refused = true;
                    if (j->room) { /* the device holds no more for this pool than it does now */
                        size_t cap = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED) / gran;
                        if (cap < j->room->dev_cap) j->room->dev_cap = cap;
                    }
                }
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
    for (uint32_t i = 0; refused && i < j->nruns; i++) /* give back what this job created */
        if (j->runs[i].vic < 0 && !j->runs[i].rc) run_undo(pool, j, &j->runs[i], ENOMEM);
    /* Access: one call over the whole span (every page between the runs is mapped already).
     * When a run failed, each mapped run gets its own call: it stays mapped, as a cached handle,
     * and must be usable when a block takes it later. A run whose access cannot be granted is
     * unmapped and released. */
    if (j->nruns && ok) {
        int rc = dev_set_access_span(pool, page_va(pool, j->r, j->acc_p0), (size_t)(j->acc_p1 - j->acc_p0 + 1) * gran,
                                     j->acc_maps);
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
    job_released(pool, j);
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
        else pool->st.reclaimed_pages += v->dropped;
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
    if (pool->waiters) msh_cond_broadcast(&pool->cv);
    return rc;
}

/* Run a job without the lock (the caller holds it) and publish it. */
int job_do(struct msh_pool *pool, struct job *j)
{
    if (!job_has_work(j)) return 0;
    pool->jobs++;
    msh_unlock(&pool->lock);
    job_run(pool, j);
    msh_lock(&pool->lock);
    pool->jobs--;
    return job_publish(pool, j);
}

/* A claimed job given up before any driver work (the front end drains first: pool.c try_alloc):
 * undone as a job the device had no room for (job_lacks_room), its victims mapped where they
 * were, its runs never created. The caller undoes the block's claim (job_fini, block_untouch). */
void job_cancel(struct msh_pool *pool, struct job *j)
{
    for (uint32_t i = 0; i < j->nvic; i++) j->vic[i].rc = ENOROOM;
    for (uint32_t i = 0; i < j->nruns; i++) j->runs[i].rc = ENOROOM;
    for (int i = 0; i < j->norph; i++) j->orph[i].rc = ENOROOM;
    j->sync = false;
    job_publish(pool, j);
}

/* Give cached handles back to the driver (all of them with max_keep = 0, or down to max_keep
 * bytes; with quiet_ms only those not reused for that long). Returns the bytes released. */
size_t release_cached(struct msh_pool *pool, size_t max_keep, uint32_t quiet_ms)
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
