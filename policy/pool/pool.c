/*
 * pool.c: the defragmenting pool (DESIGN.md 4, docs/pool.md), its public API (pool.h).
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
 * The pool is a folder of concerns, one per file, sharing internal.h:
 *   pool.c     this file: create and destroy, allocate (the front end's hit, then place, back,
 *              retry, the OOM rescue chain), free, empty-cache and trim, captures' deferred
 *              work, lookups by address, peers' access, the entry points of issue 8;
 *   front.c    the front end: bins of freed blocks by (stream, size), their drains;
 *   stats.c    the statistics, the callers' counters, latency, the OOM figures;
 *   extents.c  the VA line: regions, blocks, both free treaps, the live hash, carving,
 *              coalescing and best-fit placement; the pool's own memory (mmap);
 *   pages.c    pages and handles: claiming the pages a block touches, the driver work done
 *              outside the lock (claim, run, publish), cached handles and reclaim, the counted
 *              device calls;
 *   streams.c  streams and events: pooled events, known streams and what they have completed,
 *              the stream tags of free extents, what a reuse on another stream must wait for;
 *   step.c     the learned step: the event log, finding a repeating step, following its plan,
 *              the planner thread;
 *   pack.c     packing a step offline (no lock held, on a copy);
 *   spill.c    spill to host memory (MEMSHIM_SPILL=host): the rescue chain's last step and the
 *              return at step marks;
 *   check.c    msh_pool_check, the invariant checker.
 *
 * It must never call a CUDA hook, never allocate with malloc (its memory comes from mmap), never
 * call the GC callback or the device while holding its lock, and never hand out a byte that a
 * live block or queued GPU work still uses.
 */
#include "internal.h"

/* ---- allocation ----------------------------------------------------------------------------------- */

/* One try at placing and backing a block, within the limit and what the request knows of the
 * device's room (rm: once the device was asked, or refused a create, the pool reclaims cached
 * handles rather than create past it; the job asks the device before its first create). While the device
 * captures a CUDA graph, a placement that would need a synchronize, an unmap or a release
 * (reclaim, a split handle) is given up for fresh memory, and failing that the request fails
 * (*capture_blocked). */
static inline __attribute__((always_inline)) int try_alloc(struct msh_pool *pool, uint64_t rsize, uint64_t req,
                                                           uint64_t stream, uint64_t *addr, struct room *rm,
                                                           bool *reclaimed, bool *driver_enomem, bool *capture_blocked)
{
    int area = area_of(pool, rsize);
    bool fresh_only = false;
    struct blk *b;
    int rc;
    struct job j;
    job_init(&j);
    j.room = rm;
    uint64_t pressure0 = pool->pressure_reclaims;
    uint32_t hi0 = 0;
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
                if (rm->dev_cap < cap) cap = rm->dev_cap;
                /* what a cancel (EDRAIN below) restores, as of this claim: the wait below drops
                 * the lock, and other threads' claims meanwhile raise the line's top (a top
                 * lowered under pages they mapped ahead gets them mapped twice) */
                hi0 = b->reg->hi_page;
                pressure0 = pool->pressure_reclaims;
                rc = claim_pages(pool, b, &j, cap);
                if (rc != EAGAIN) break;
                /* another thread maps or unmaps one of our pages: wait for it to publish */
                pool->st.lock_waits++;
                pool->waiters++;
                msh_cond_wait(&pool->cv, &pool->lock);
                pool->waiters--;
            }
        }
        if (rc == ECAPTURE) {
            job_fini(pool, &j);
            if (pool->step && step_want(pool->step, b->addr))
                step_drop(pool, "its planned address would need a synchronize or an unmap during a capture", rsize, true);
            blk_make_free(pool, b);
            pool->st.capture_deferrals++;
            if (!fresh_only && !fresh) {
                fresh_only = true;
                continue;
            }
            *capture_blocked = true;
            return ENOMEM;
        }
        if (rc == EHOSTPAGE) { /* a spilled page: fresh memory instead (spill.c) */
            job_fini(pool, &j);
            if (pool->step && step_want(pool->step, b->addr))
                step_drop(pool, "its planned address is on a page spilled to host memory", rsize, true);
            blk_make_free(pool, b);
            if (!fresh_only && !fresh) {
                fresh_only = true;
                continue;
            }
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
    if (pool->front.blocks && !rm->drained && (j.nruns || j.nvic || j.sync)) {
        rm->needs_victims = j.nvic || j.sync; /* not mere growth: a drain first, whatever it costs */
        /* Driver work that needs memory (or a synchronize) while blocks sit in the front end's
         * bins: give this try up as if it never was (the line's top and the pressure count
         * included, so that the placement after the drain is the one the pool would have made),
         * drain, and place again (msh_pool_alloc). */
        job_cancel(pool, &j);
        job_fini(pool, &j);
        b->reg->hi_page = hi0;
        pool->pressure_reclaims = pressure0;
        block_untouch(pool, b);
        b->claimed = 0;
        blk_make_free(pool, b);
        return EDRAIN;
    }
    if (!job_idle(&j)) { /* (most placements touch mapped pages only: nothing to run or undo) */
        rc = job_do(pool, &j);
        if (j.nvic && !rc) *reclaimed = true;
        if (j.driver_enomem) *driver_enomem = true;
        job_fini(pool, &j);
    }
    if (!rc && pool->hcount >= pool->hcap && hash_grow(pool)) rc = ENOMEM;
    if (rc) {
        block_untouch(pool, b);
        b->claimed = 0;
        blk_make_free(pool, b);
        return rc == ENOROOM ? ENOMEM : rc; /* rm says what the device has */
    }
    sref_clear(pool, b); /* the waits are enqueued: the new stream owns the extent */
    b->claimed = 0;
    b->state = B_LIVE;
    b->req = req;
    b->tag = msh_pool_tags.next;
    b->born = pool->nborn++;
    b->bnext = NULL;
    b->s[0] = (struct sref){.stream = stream, .ev = NO_EV}; /* [0]: the allocation stream */
    b->ns = 1;
    hash_insert(pool, b);
    *addr = b->addr;
    rm->placed = b;
    return 0;
}

/* ---- the rescue chain's figures (issue 25) -------------------------------------------------------
 * Which rescue steps can help a request is decided from the pool's own figures, before any driver
 * call: a step runs only when what it could free at best would let the request fit. A request's
 * block covers at least floor(rsize / gran) - 1 whole pages (it may share a page with a live
 * neighbour at each end), which no live block touches: those must come from room under the cap
 * (the limit, and what the device gives once asked), from mapped pages no live block touches
 * (cached handles, pages beside a live block in a handle of several), or from what a step frees. */

static size_t pool_pages(const struct msh_pool *pool, uint64_t rsize)
{
    return (size_t)((rsize + pool->gran - 1) / pool->gran) + 1;
}

static size_t pages_at_least(const struct msh_pool *pool, uint64_t rsize)
{
    size_t whole = (size_t)(rsize / pool->gran);
    return whole ? whole - 1 : 0;
}

static size_t add_sat(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

/* Pages of handles the other pools of the device hold under the limit they share with this one
 * (shim/torch.c: CUDA-graph capture pools beside the main pool, the main pool beside a capture
 * pool): memory a collection may give back too, though this pool holds none of it (a dropped
 * graph's pool goes with its last block; issue 31). 0 without a share. */
static size_t others_pages(const struct msh_pool *pool)
{
    if (!pool->prm.share) return 0;
    size_t all = __atomic_load_n(&pool->prm.share->handle_bytes, __ATOMIC_RELAXED) / pool->gran;
    return all > pool->held ? all - pool->held : 0;
}

/* The most pages of that kind the request could have now (all: had a collection freed every live
 * block of every pool of the device: the whole limit, shared or not, and the device's room plus
 * what the other pools hold on it); SIZE_MAX when nothing bounds it yet (no limit, the device not
 * asked). */
static size_t room_pages(const struct msh_pool *pool, const struct room *rm, bool all)
{
    if (all) {
        size_t lim = limit_now(pool);
        size_t cap = !lim ? SIZE_MAX : pool->prm.share ? lim / pool->gran : cap_pages(pool);
        size_t dev = rm->dev_cap == SIZE_MAX ? SIZE_MAX : add_sat(rm->dev_cap, others_pages(pool));
        return dev < cap ? dev : cap;
    }
    size_t cap = cap_pages(pool);
    if (rm->dev_cap < cap) cap = rm->dev_cap;
    if (cap == SIZE_MAX) return cap;
    size_t host_used = pool->spill_pages - pool->spill_idle; /* touched, but not on the device */
    size_t touched = pool->touched > host_used ? pool->touched - host_used : 0;
    return (cap > pool->held ? cap - pool->held : 0) + (pool->held > touched ? pool->held - touched : 0);
}

/* Device pages spill could move to the host at best: those live blocks touch, within
 * MEMSHIM_SPILL_MAX (*capped: that is what bounds it). */
static size_t spill_room(const struct msh_pool *pool, bool *capped)
{
    size_t host_used = pool->spill_pages - pool->spill_idle;
    size_t on_dev = pool->touched > host_used ? pool->touched - host_used : 0;
    *capped = false;
    if (!pool->spill_max_pages) return on_dev;
    size_t left = pool->spill_max_pages > pool->spill_pages ? pool->spill_max_pages - pool->spill_pages : 0;
    *capped = left < on_dev;
    return left < on_dev ? left : on_dev;
}

/* Whether spilling could make room for `need` pages now; if not, why (the OOM's spill_stop). */
static bool spill_can_help(struct msh_pool *pool, const struct room *rm, size_t need)
{
    bool capped;
    size_t sp = spill_room(pool, &capped);
    /* spill moves this pool's own pages only: what the device's other pools hold stays theirs */
    size_t all = room_pages(pool, rm, true), others = others_pages(pool);
    size_t own_all = all == SIZE_MAX ? all : all > others ? all - others : 0;
    if (need > own_all)
        pool->oom.spill_stop = need <= all ? "the device's other pools hold the rest"
                                           : "the request needs more than the device can hold";
    else if (need > add_sat(room_pages(pool, rm, false), sp)) pool->oom.spill_stop = capped ? "spill_max" : "nothing cold";
    else return true;
    return false;
}

/* What no step can change: a block lives on device pages only (spill moves cold blocks, never a
 * new one), within the limit, so a request larger than the device or the limit is refused before
 * anything else; MSH_OOM_NOW: it may fit. */
static int oom_case_fixed(const struct msh_pool *pool, uint64_t rsize)
{
    if (pool->device_total && rsize > pool->device_total) return MSH_OOM_DEVICE;
    size_t lim = limit_now(pool);
    if (lim && rsize > lim) return MSH_OOM_LIMIT;
    return MSH_OOM_NOW;
}

/* The device had no room for the creates (asked once per request, job_run) or refused one: now
 * that its room is known, the request is placed again within it (cached handles reclaimed rather
 * than new ones created; no chunk mapped ahead past the room: the failed claim raised the line's
 * open end), when that can make it fit, cached pages or not. */
static int try_alloc_all(struct msh_pool *pool, uint64_t rsize, uint64_t req, uint64_t stream, uint64_t *addr,
                         struct room *rm, bool *reclaimed, bool *capture_blocked)
{
    bool denomem = false;
    size_t cap0 = rm->dev_cap;
    int rc;
    for (int k = 0;; k++) { /* (one call site: try_alloc is inlined here) */
        rc = try_alloc(pool, rsize, req, stream, addr, rm, reclaimed, &denomem, capture_blocked);
        if (k || rc != ENOMEM || !(rm->dev_cap < cap0 && !capturing(pool) &&
                                   pages_at_least(pool, rsize) <= room_pages(pool, rm, false)))
            return rc;
    }
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
    msh_lock_init(&pool->lock);
    msh_cond_init(&pool->cv);
    pool->dev = dev;
    if (params) pool->prm = *params;
    else msh_pool_params_default(&pool->prm);
    pool->rng = 0x2545F491u;
    pool->evfree = NO_EV;
    pool->solo = SOLO_NONE;
    pool->t0_ns = msh_now_ns();
    int rc = dev->ops->granularity(dev, &pool->gran);
    if (rc || !pool->gran) {
        raw_free(pool, sizeof *pool);
        return rc ? rc : EIO;
    }
    size_t free_b = 0, total = 0;
    if (dev_mem_info(pool, &free_b, &total) == 0) pool->device_total = total;
    pool->dev_top = pool->device_total / pool->gran * pool->gran;
    if (pool->gran > 1 && !(pool->gran & (pool->gran - 1))) pool->gran_shift = (unsigned)__builtin_ctzll(pool->gran);
    if (pool->prm.share) pool->prm.limit_bytes = 0; /* the share's limit applies (limit_now) */
    /* A limit at or above the device is no limit (issue 31): the device is the cap anyway, and a
     * limit would put the pool in page mode, one handle per page. */
    if (total && pool->prm.limit_bytes >= total) pool->prm.limit_bytes = 0;
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
    pool->spill_max_pages = pool->prm.spill_max_bytes / pool->gran;
    if (pool->prm.spill_max_bytes && !pool->spill_max_pages) pool->spill_max_pages = 1;
    if (!pool->prm.no_learn) step_create(pool);
    front_init(pool);
    *out = pool;
    return 0;
}

void msh_pool_destroy(struct msh_pool *pool)
{
    if (!pool) return;
    step_stop(pool);
    msh_lock(&pool->lock);
    /* its blocks go back as plain frees: the device is synchronized below, no one follows */
    front_drain(pool, FRONT_DRAIN_GONE, MSH_STREAM_COMPLETED);
    msh_unlock(&pool->lock);
    front_destroy(pool);
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
    /* Block slabs are not tracked individually; they are reclaimed with the process. */
    raw_free(pool, sizeof *pool);
}

static void fill_oom(struct msh_pool *pool, size_t req, size_t dev_free, size_t dev_total);

/* A sampled call's duration from two CPU-counter reads (hotclock.h): no clock_gettime. */
static inline uint64_t ticks_ns(uint64_t t0)
{
    return (uint64_t)((double)(msh_ticks() - t0) * msh_ticks_ns_per_tick());
}






/* The statistics of one allocation, from a bin or not: plain fields under the lock. */
static inline __attribute__((always_inline)) void count_alloc(struct msh_pool *pool, uint64_t req, bool counted)
{
    struct msh_pool_stats *st = &pool->st;
    st->allocs++;
    st->live_bytes += req;
    st->live_blocks++;
    if (st->live_bytes > st->peak_live_bytes) st->peak_live_bytes = st->live_bytes;
    if (st->live_bytes > st->run_peak_live_bytes) st->run_peak_live_bytes = st->live_bytes;
    if (st->live_bytes > pool->step_peak_live) pool->step_peak_live = st->live_bytes;
    /* bucket i holds [2^(9+i-1), 2^(9+i)): the bit length of req / 512, at most 23 */
    uint64_t q = req >> 9;
    int bucket = q ? 64 - __builtin_clzll(q) : 0;
    st->hist[bucket < 23 ? bucket : 23]++;
    if (counted) caller_count(pool, req, true);
}

static inline void count_free(struct msh_pool *pool, struct blk *b)
{
    pool->st.frees++;
    pool->st.live_bytes -= b->req;
    pool->st.live_blocks--;
    if (b->counted) caller_count(pool, b->req, false);
    b->counted = 0;
}


/* What a pool-path allocation adds to count_alloc: the reserve it may have grown. */
static void note_alloc(struct msh_pool *pool, bool reclaimed)
{
    struct msh_pool_stats *st = &pool->st;
    /* reserved minus allocated at the reserved peak: measured once the allocation that needed the
     * new peak holds its block (the reserve grows inside it, before its bytes count as live) */
    size_t held = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    if (held > pool->at_peak_held) {
        pool->at_peak_held = held;
        pool->at_peak_live = st->live_bytes;
    }
    size_t touched = pool->touched * pool->gran;
    if (touched > st->peak_touched_bytes) st->peak_touched_bytes = touched;
    if (reclaimed) st->rescue_reclaim++;
    caller_reserved(pool);
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
    msh_unlock(&pool->lock);
    for (int k = 0; k < n; k++) rcs[k] = dev_event_query(pool, h[k]);
    msh_lock(&pool->lock);
    pool->jobs--;
    for (int k = 0; k < n; k++) {
        if (rcs[k] == 0) ev_done(pool, slot[k]);
        ev_put(pool, slot[k]);
    }
}

static int pool_alloc_slow(struct msh_pool *pool, size_t size, uint64_t rsize, uint64_t stream, uint64_t *addr,
                           bool counted, uint32_t lw, uint64_t t0);

/* The front end's hit (front.c) under the one lock, else the general path. */
static int pool_alloc(struct msh_pool *pool, size_t size, uint64_t stream, uint64_t *addr, unsigned flags)
{
    if (size > MAX_SIZE) return EINVAL;
    bool counted = flags & MSH_PA_COUNTED;
    uint64_t rsize = round_block(size);
    uint32_t lw = pool->timing && !(flags & MSH_PA_TIMED) ? msh_lat_sample() : 0;
    uint64_t t0 = lw ? msh_ticks() : 0;
    msh_lock(&pool->lock);
    /* The front end: a block freed on this stream with this size, handed back as it is. */
    if (pool->front.blocks) {
        struct blk *b = front_take(pool, stream, rsize);
        if (b) {
            b->req = size;
            b->tag = msh_pool_tags.next;
            b->born = pool->nborn++;
            b->counted = counted;
            count_alloc(pool, size, counted);
            pool->st.front_hits++;
            if (lw) lat_record(pool, true, ticks_ns(t0), lw);
            msh_unlock(&pool->lock);
            *addr = b->addr;
            return 0;
        }
    }
    return pool_alloc_slow(pool, size, rsize, stream, addr, counted, lw, t0);
}

int msh_pool_alloc(struct msh_pool *pool, size_t size, uint64_t stream, uint64_t *addr)
{
    return pool_alloc(pool, size, stream, addr, 0);
}

int msh_pool_alloc_ex(struct msh_pool *pool, size_t size, uint64_t stream, unsigned flags, uint64_t *addr)
{
    return pool_alloc(pool, size, stream, addr, flags);
}

/* The general path (the lock held): place, back, retry, the rescue chain. */
static int pool_alloc_slow(struct msh_pool *pool, size_t size, uint64_t rsize, uint64_t stream, uint64_t *addr,
                           bool counted, uint32_t lw, uint64_t t0)
{
    if (pool->front.enabled) { /* what a put checks, as of this miss */
        pool->front.serving = front_on(pool);
        if (stream != MSH_STREAM_COMPLETED && pool->front.serving) pool->st.front_misses++;
    }
    if (MSH_UNLIKELY(pool->front.evict)) front_drain(pool, FRONT_DRAIN_STALE, 0); /* the bin table filled up */
    uint64_t pressure0 = pool->pressure_reclaims;
    ks_get(pool, stream);
    if (MSH_UNLIKELY(pool->solo == SOLO_ONE) && stream == MSH_STREAM_COMPLETED)
        solo_end(pool); /* a host-synchronous user waits for the one stream's tags */
    if (MSH_UNLIKELY(pool->parked || pool->empty_deferred) && !capturing(pool)) settle_locked(pool);
    if (pool->nrecorded && (pool->poll_soon || ++pool->poll_tick >= 16)) {
        pool->poll_tick = 0;
        pool->poll_soon = false;
        events_poll(pool);
    }
    if (step_learning(pool)) step_before_alloc(pool, rsize);
    if (pool->front.enabled && !(pool->front.serving = front_on(pool)) && pool->front.blocks)
        front_drain(pool, FRONT_DRAIN_ALL, stream); /* a plan places from here */
    size_t held0 = pool->held; /* issue 8: a failed request gives back what it created */
    bool reclaimed = false, capture_blocked = false;
    /* Issue 25: a request no step can serve fails before any driver work; each step below runs
     * only when the pool's figures say it can make the request fit (room_pages). */
    struct room rm = {.dev_cap = SIZE_MAX};
    int ocase = oom_case_fixed(pool, rsize);
    unsigned steps = 0;
    int rc = ocase == MSH_OOM_NOW ? try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked)
                                  : ENOMEM;
    /* Binned blocks first: before driver work they could spare (EDRAIN), and as the first step of
     * the rescue (a request refused above never drains: no drain could serve it). */
    /* First the smallest block binned on this stream that holds the request (its own bins: the
     * least taken from the front end, no event; a few times). Then the whole front end, unless
     * the requests' own pages the pool grew by instead of draining stay within 1/128 of what it
     * holds and a chunk, over the pool's life: two sizes that take turns in one place would
     * otherwise drain the bins at every step, where a page more ends it, and the bins never cost
     * more than that (1/16 and two chunks raised the replays' reserve with no limit from 1.016x
     * to 1.025x the live peak at the median, 1.076x to 1.096x at most). Before a request fails,
     * always (the rescue's first step). */
    bool grew_aside = false;
    size_t need = 0;
    if (MSH_UNLIKELY(rc != 0)) { /* (most requests are served by the first try) */
        size_t binned0 = pool->front.blocks;
        for (int k = 0; rc == EDRAIN && k < 4 && front_drain_fit(pool, stream, rsize); k++)
            rc = try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked);
        if (rc == EDRAIN || (rc == ENOMEM && ocase == MSH_OOM_NOW && pool->front.blocks)) {
            rm.drained = true;
            struct front *f = &pool->front;
            /* (a request may also map a chunk ahead, pages.c claim_pages: that serves the next
             * requests as it would with no bins, and is not counted) */
            grew_aside = rc == EDRAIN && !rm.needs_victims && !limit_now(pool) &&
                         f->grown_aside + pool_pages(pool, rsize) <= pool->held / 128 + pool->chunk_pages;
            if (!grew_aside) front_drain(pool, FRONT_DRAIN_ALL, stream);
            else pool->st.front_kept++;
            rc = try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked);
        }
        /* (drains for growth are not churn: front_churn) */
        if (binned0 > pool->front.blocks)
            front_churn(pool, rm.needs_victims || rc == ENOMEM ? binned0 - pool->front.blocks : 0, false);
        need = rc == ENOMEM ? pages_at_least(pool, rsize) : 0;
        if (rc == ENOMEM && ocase == MSH_OOM_NOW && pool->gc_fn && (pool->st.live_blocks || others_pages(pool)) &&
            need <= room_pages(pool, &rm, true)) {
            msh_pool_gc_fn fn = pool->gc_fn;
            void *arg = pool->gc_arg;
            steps |= MSH_OOM_STEP_GC;
            msh_unlock(&pool->lock);
            fn(arg); /* may free blocks through msh_pool_free */
            msh_lock(&pool->lock);
            rc = try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked);
            if (rc == 0) pool->st.rescue_gc++;
        }
        if (rc == ENOMEM && ocase == MSH_OOM_NOW && pool->cached && (pool->driver_oom || !pool->prm.defrag) &&
            !pool->prm.no_release_on_oom && !capturing(pool) && need <= room_pages(pool, &rm, false)) {
            pool->driver_oom = false;
            /* Cached pages were already candidates for reclaim; giving them back helps when the
             * driver itself ran out (other allocators in the process hold the rest), and when reclaim
             * is off (MEMSHIM_DEFRAG=0: under a limit new pages can be created only after these go).
             * Never for a request that would not fit even then (the job keeps its cache). */
            steps |= MSH_OOM_STEP_EMPTY_CACHE;
            release_cached(pool, 0, 0);
            rc = try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked);
            if (rc == 0) pool->st.rescue_empty_cache++;
        }
        /* the last step, opt-in: cold pages to host memory (spill.c), more at each round */
        if (rc == ENOMEM) pool->oom.spill_stop = NULL;
        for (int round = 0; rc == ENOMEM && ocase == MSH_OOM_NOW && pool->prm.spill && round < 8 &&
                            spill_can_help(pool, &rm, need);
             round++) {
            steps |= MSH_OOM_STEP_SPILL;
            if (!spill_rescue(pool, rsize, round)) break;
            rc = try_alloc_all(pool, rsize, size, stream, addr, &rm, &reclaimed, &capture_blocked);
            if (rc == 0) pool->st.rescue_spill++;
        }
    }
    /* Pressure at the cap: the front end steps aside while this cap holds. The pool is in the
     * regime of the learned step there, which places every block of a repeated step by its plan
     * (docs/pool.md "The front end"); binned blocks would only be drained at each request. */
    if (pool->pressure_reclaims != pressure0 && pool->front.enabled && !pool->front.aside) front_aside(pool);
    /* the request's own pages (a chunk mapped ahead serves the next requests, as without bins) */
    if (grew_aside && pool->held > held0) pool->front.grown_aside += pool_pages(pool, rsize);
    if (rc == 0) {
        struct blk *b = rm.placed; /* placed by the last try, after which the lock was held throughout */
        b->counted = counted;
        count_alloc(pool, size, counted);
        note_alloc(pool, reclaimed);
        if (step_learning(pool)) step_note_alloc(pool, b);
        if (pool->front.hand_off) { /* a stream's memory is wanted elsewhere: hand its bins over */
            pool->front.hand_off = false;
            front_drain(pool, FRONT_DRAIN_DEMAND, 0);
        }
        if (lw) lat_record(pool, true, ticks_ns(t0), lw);
        msh_unlock(&pool->lock);
        return 0;
    }
    /* Pages this request created and could not use are given back: the memory a failed request
     * leaves held is what it found (cudaMemGetInfo's answer counts on that, issue 8). */
    if (pool->held > held0)
        release_cached(pool, (pool->cached > pool->held - held0 ? pool->cached - (pool->held - held0) : 0) * pool->gran, 0);
    pool->st.alloc_fail++;
    pool->st.oom_events++;
    if (pool->prm.spill) pool->st.spill_refused++;
    const char *spill_stop = pool->oom.spill_stop;
    size_t df = 0, dt = pool->device_total;
    if (rm.asked) { /* one question to the device per request: its answer, less what the pool took since */
        size_t now = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
        df = rm.dev_free + rm.drv_held > now ? rm.dev_free + rm.drv_held - now : 0;
    } else { /* no job asked: this is the request's one question */
        msh_unlock(&pool->lock);
        if (dev_mem_info(pool, &df, &dt)) df = dt = 0;
        msh_lock(&pool->lock);
    }
    fill_oom(pool, size, df, dt);
    size_t room_now = room_pages(pool, &rm, false);
    pool->oom.short_bytes = ocase == MSH_OOM_NOW && need > room_now ? (need - room_now) * pool->gran : 0;
    pool->oom.kind = ocase;
    pool->oom.steps = steps;
    pool->oom.capture = capture_blocked || (capturing(pool) && pool->cached);
    pool->oom.spilled_bytes = pool->spill_pages * pool->gran;
    pool->oom.spill_stop = !pool->prm.spill || ocase != MSH_OOM_NOW ? NULL /* spill cannot change those cases */
                           : pool->spill_state < 0 ? "no host memory through VMM"
                           : spill_stop ? spill_stop : "nothing cold";
    struct msh_pool_oom o = pool->oom;
    msh_unlock(&pool->lock);
    if (o.kind != MSH_OOM_NOW) {
        msh_warn("out of memory on device %d: requested %zu bytes, %s (%zu bytes): refused before any driver work",
                 pool->dev->ordinal, o.requested, msh_oom_case_text(o.kind),
                 o.kind == MSH_OOM_DEVICE ? o.device_total : o.limit_bytes);
        return ENOMEM;
    }
    msh_warn("out of memory on device %d: requested %zu bytes, %s: device free %zu of %zu, cached %zu, live %zu, "
             "reserved %zu, limit %zu, largest usable free extent %zu: %s%s",
             pool->dev->ordinal, o.requested, msh_oom_case_text(o.kind), o.device_free, o.device_total,
             o.cached_bytes, o.live_bytes, o.mapped_bytes, o.limit_bytes, o.largest_free,
             o.fragmentation ? "fragmentation (enough bytes are free, but not in usable pages)"
                             : "capacity (the live set does not fit)",
             o.capture ? "; a CUDA-graph capture was in progress, during which memshim cannot reclaim or "
                         "release cached memory" : "");
    if (o.spill_stop)
        msh_warn("out of memory on device %d with MEMSHIM_SPILL=host: %zu bytes are spilled to host memory, and no more "
                 "could go (%s)", pool->dev->ordinal, o.spilled_bytes,
                 !strcmp(o.spill_stop, "spill_max") ? "MEMSHIM_SPILL_MAX reached"
                 : !strcmp(o.spill_stop, "nothing cold") ? "every page left is used by the current step"
                 : o.spill_stop);
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
        bool dup = false; /* `used` holds neither the free's stream nor MSH_STREAM_COMPLETED (callers) */
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
        msh_unlock(&pool->lock);
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
        msh_lock(&pool->lock);
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
    if (pool->solo == SOLO_ONE && stream == pool->solo_stream && !b->ns && !overflow) {
        solo_free(pool, b, seq); /* the one stream alone: no tag (streams.c solo_end) */
        return;
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

/* The free of a live block b (in the hash) on `stream`, after it was counted: its tags, its
 * pages, back on the VA line (or parked during a capture). */
static void free_block(struct msh_pool *pool, struct blk *b, uint64_t stream);

static int pool_free(struct msh_pool *pool, uint64_t addr, uint64_t stream, bool may_bin, bool timed)
{
    uint32_t lw = pool->timing && !timed ? msh_lat_sample() : 0;
    uint64_t t0 = lw ? msh_ticks() : 0;
    msh_lock(&pool->lock);
    struct blk **slot = hash_slot(pool, addr);
    struct blk *b = slot ? *slot : NULL;
    if (!b || b->state == B_BINNED) {
        if (b) pool->st.double_frees++; /* freed already: its bin keeps it, nothing changes */
        msh_unlock(&pool->lock);
        return b ? EALREADY : EINVAL;
    }
    msh_pool_tags = (struct msh_pool_tags){msh_pool_tags.next, b->tag, b->req};
    count_free(pool, b);
    if (MSH_UNLIKELY(!pool->first_free_seen)) spill_note_free(pool);
    if (may_bin && pool->front.serving && front_put(pool, b, stream)) {
        pool->st.front_puts++;
    } else {
        hash_unlink(pool, slot); /* (count_free and a put that failed change no chain: still b's link) */
        free_block(pool, b, stream);
    }
    if (lw) lat_record(pool, false, ticks_ns(t0), lw);
    msh_unlock(&pool->lock);
    return 0;
}

int msh_pool_free(struct msh_pool *pool, uint64_t addr, uint64_t stream)
{
    return pool_free(pool, addr, stream, true, false);
}

int msh_pool_free_ex(struct msh_pool *pool, uint64_t addr, uint64_t stream, unsigned flags)
{
    return pool_free(pool, addr, stream, true, flags & MSH_PA_TIMED);
}

/* A binned block freed as the free it stood for, on the line with an event: one event recorded
 * on its stream now covers every use of every block binned there before the drain (each was
 * freed there, its work queued before), so another stream takes their memory after a wait on it
 * rather than a synchronize, and the stream is not asked for events at its own frees
 * (want_events). The first block of a stream records it (*tag empty: it is filled, holding one
 * reference for the caller); the others share it. tag NULL, a capture in progress, or a record
 * the driver refused: the plain free (a tag without an event, as a free on its own stream). */
void free_binned(struct msh_pool *pool, struct blk *b, struct sref *tag)
{
    uint64_t stream = b->s[0].stream;
    hash_remove(pool, b->addr);
    b->state = B_LIVE;
    if (!tag || capturing(pool) || (tag->stream == stream && tag->ev == NO_EV && tag->seq)) {
        free_block(pool, b, stream);
        return;
    }
    if (pool->step && pool->step->on) step_note_free(pool, b);
    b->ns = 0;
    b->sync_needed = 0;
    b->free_gen = 0;
    if (tag->ev != NO_EV) { /* shared */
        struct sref t = *tag;
        t.lo = b->addr;
        t.hi = b->addr + b->size;
        ev_ref(pool, t.ev); /* sref_add takes this reference */
        sref_add(pool, b, &t);
        b->free_gen = ++pool->free_gen;
    } else { /* the first of its stream: record */
        uint64_t used[1] = {stream};
        ks_get(pool, stream);
        free_tags(pool, b, MSH_STREAM_COMPLETED, used, 1, false);
        *tag = (struct sref){.stream = stream, .seq = 1, .ev = NO_EV}; /* seq 1, ev none: refused */
        for (int i = 0; i < b->ns; i++)
            if (b->s[i].stream == stream && b->s[i].ev != NO_EV && !b->sync_needed) {
                *tag = b->s[i];
                ev_ref(pool, tag->ev); /* the caller's, until the drain ends */
            }
    }
    block_untouch(pool, b);
    blk_make_free(pool, b);
}

void free_binned_done(struct msh_pool *pool, struct sref *tag)
{
    if (tag->ev != NO_EV) ev_put(pool, tag->ev);
    trim_cached(pool);
}

static void free_block(struct msh_pool *pool, struct blk *b, uint64_t stream)
{
    if (pool->step && pool->step->on) step_note_free(pool, b);
    if (pool->solo == SOLO_ONE && stream == pool->solo_stream && b->ns == 1 && b->s[0].stream == stream &&
        !b->sync_needed) {
        /* the one stream alone, on its own block: none of free_tags' work (streams.c solo_end) */
        b->ns = 0;
        b->free_gen = 0;
        solo_free(pool, b, ++pool->evseq);
        block_untouch(pool, b);
        blk_make_free(pool, b);
        trim_cached(pool);
        return;
    }
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
        return;
    }
    b->ns = 0;
    free_tags(pool, b, stream, used, nused, overflow);
    block_untouch(pool, b);
    blk_make_free(pool, b);
    trim_cached(pool);
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
    msh_lock(&pool->lock);
    settle_locked(pool);
    msh_unlock(&pool->lock);
}

__thread struct msh_pool_tags msh_pool_tags;

/* The live block at addr (not a binned one: that one was freed), or NULL. */
static struct blk *live_find(struct msh_pool *pool, uint64_t addr)
{
    struct blk *b = hash_find(pool, addr);
    return b && b->state == B_LIVE ? b : NULL;
}

void msh_pool_block_tags(struct msh_pool *pool, const uint64_t *addrs, uint32_t *tags, size_t n)
{
    msh_lock(&pool->lock);
    for (size_t i = 0; i < n; i++) {
        struct blk *b = live_find(pool, addrs[i]);
        tags[i] = b ? b->tag : 0;
    }
    msh_unlock(&pool->lock);
}

size_t msh_pool_block_size(struct msh_pool *pool, uint64_t addr)
{
    msh_lock(&pool->lock);
    struct blk *b = live_find(pool, addr);
    size_t s = b ? b->req : 0;
    msh_unlock(&pool->lock);
    return s;
}

bool msh_pool_owns(struct msh_pool *pool, uint64_t addr)
{
    msh_lock(&pool->lock);
    bool own = live_find(pool, addr) != NULL;
    msh_unlock(&pool->lock);
    return own;
}

int msh_pool_record_stream(struct msh_pool *pool, uint64_t addr, uint64_t stream)
{
    msh_lock(&pool->lock);
    struct blk *b = live_find(pool, addr);
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
    msh_unlock(&pool->lock);
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
        msh_unlock(&pool->lock);
        for (int i = 0; i < n; i++) ev_destroy(pool, h[i]);
        msh_lock(&pool->lock);
    }
}

void msh_pool_release_events(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    events_trim(pool, true);
    msh_unlock(&pool->lock);
}

size_t msh_pool_empty_cache(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    front_drain(pool, FRONT_DRAIN_ALL, MSH_STREAM_COMPLETED); /* binned blocks hold pages too: nothing stays in the bins */
    size_t n = release_cached(pool, 0, 0);
    events_trim(pool, false);
    msh_unlock(&pool->lock);
    return n;
}

size_t msh_pool_trim(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    /* Binned bytes over the threshold that served nothing for the quiet period go as cached
     * bytes do (the front end's activity is its hits and puts since this thread's last look). */
    struct front *f = &pool->front;
    uint64_t act = pool->st.front_hits + pool->st.front_puts;
    uint32_t now = (uint32_t)((msh_now_ns() - pool->t0_ns) / 1000000);
    if (act != f->trim_act) {
        f->trim_act = act;
        f->trim_ms = now;
    } else if (f->blocks && pool->prm.release_threshold &&
               (pool->cached * pool->gran + f->bytes > pool->prm.release_threshold) &&
               now - f->trim_ms >= pool->prm.release_quiet_ms) {
        front_drain(pool, FRONT_DRAIN_ALL, MSH_STREAM_COMPLETED);
    }
    size_t n = trim_cached(pool);
    msh_unlock(&pool->lock);
    return n;
}

void msh_pool_set_gc(struct msh_pool *pool, msh_pool_gc_fn fn, void *arg)
{
    msh_lock(&pool->lock);
    pool->gc_fn = fn;
    pool->gc_arg = arg;
    msh_unlock(&pool->lock);
}

void msh_pool_set_timing(struct msh_pool *pool, bool on)
{
    msh_lock(&pool->lock);
    pool->timing = on;
    msh_unlock(&pool->lock);
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
    o->cached_bytes = pool->cached * pool->gran;
    o->limit_bytes = limit_now(pool);
    o->others_bytes = others_pages(pool) * pool->gran;
    size_t fb = 0;
    scan_free(pool, &fb, &o->largest_free);
    /* what the device's pools together may hold: a request fits that room only beside the other
     * pools' memory too (a capture pool's, under the limit the pools share) */
    size_t cap = o->limit_bytes ? o->limit_bytes : (o->mapped_bytes + o->others_bytes + o->device_free);
    o->fragmentation = o->live_bytes + o->others_bytes + req <= cap;
    for (size_t i = 0; i < pool->hcap; i++) {
        for (struct blk *b = pool->htab[i]; b; b = b->hnext) {
            if (b->state != B_LIVE) continue; /* binned: freed */
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




void msh_pool_for_each_live(struct msh_pool *pool,
                            void (*fn)(void *arg, uint64_t addr, size_t size, uint64_t stream),
                            void *arg)
{
    msh_lock(&pool->lock);
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b; b = b->hnext)
            if (b->state == B_LIVE) fn(arg, b->addr, b->req, b->ns ? b->s[0].stream : MSH_STREAM_COMPLETED);
    msh_unlock(&pool->lock);
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
    msh_lock(&pool->lock);
    front_drain(pool, FRONT_DRAIN_STREAM, stream); /* its bins name it: freed while it still exists */
    if (pool->solo == SOLO_ONE && stream == pool->solo_stream) solo_end(pool); /* its untagged frees get tags, traded below */
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
    msh_unlock(&pool->lock);
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
    msh_lock(&pool->lock);
    struct blk *b = live_find(pool, addr);
    if (!b) {
        struct region *r = region_of(pool, addr);
        for (struct blk *x = r ? r->first : NULL; x && x->addr <= addr; x = x->next)
            if (x->state == B_LIVE && addr - x->addr < (x->req ? x->req : 1)) b = x;
    }
    if (b) {
        *base = b->addr;
        *size = b->req ? b->req : 1;
    }
    msh_unlock(&pool->lock);
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
    msh_lock(&pool->lock);
    bool in = region_of(pool, addr) != NULL;
    msh_unlock(&pool->lock);
    return in;
}

/* A peer gained access (the backend's descriptors include it already, so mappings made from now
 * on grant it): grant it on every handle mapped now. Requests doing driver work are waited for
 * first, so that none of them granted access before the backend changed and publishes a mapping
 * this walk does not see. One call per handle, without the lock: a handle unmapped meanwhile
 * makes only its own call fail, and it gets the grant when it is mapped again. */
int msh_pool_regrant_access(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    while (pool->jobs) {
        pool->waiters++;
        msh_cond_wait(&pool->cv, &pool->lock);
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
    msh_unlock(&pool->lock);
    int first = 0;
    for (size_t i = 0; i < n; i++) {
        int rc = dev_set_access(pool, runs[i][0], runs[i][1]);
        if (rc && !first) first = rc;
    }
    raw_free(runs, cap * sizeof *runs);
    return first;
}





void msh_pool_step(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    front_step(pool);
    msh_unlock(&pool->lock);
}

size_t msh_pool_drain_front(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    size_t n = front_drain(pool, FRONT_DRAIN_ALL, MSH_STREAM_COMPLETED);
    msh_unlock(&pool->lock);
    return n;
}


/* Free a block, then return to the driver the cached handles on the pages it touched (a handle
 * is released whole: its other pages are untouched too, or it would not be cached). DESIGN.md 3:
 * a cudaFree in segment mode is PyTorch giving memory back. */
int msh_pool_free_release(struct msh_pool *pool, uint64_t addr, uint64_t stream, size_t *released)
{
    if (released) *released = 0;
    msh_lock(&pool->lock);
    struct blk *b = live_find(pool, addr);
    struct region *r = b ? b->reg : NULL;
    uint32_t p0 = 0, p1 = 0;
    if (b) page_range(pool, b, &p0, &p1);
    msh_unlock(&pool->lock);
    if (!b) return EINVAL;
    int rc = pool_free(pool, addr, stream, false, false); /* its pages go back: never binned */
    if (rc) return rc;
    /* another thread may have placed a block on these pages meanwhile: those stay (live) */
    msh_lock(&pool->lock);
    if (capturing(pool)) { /* the release waits: the pages stay cached */
        pool->st.capture_deferrals++;
        msh_unlock(&pool->lock);
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
        if (hp->state == PG_MAPPED && !hp->nlive && !hp->host) { /* idle host memory: at the next step mark */
            if (!take_victim(pool, &j, r, h, V_RELEASE)) break;
            victim_unheld(pool, &j, hp->npages);
        }
        p = next;
    }
    job_do(pool, &j);
    job_fini(pool, &j);
    size_t n = (pool->st.released_pages - before) * pool->gran;
    msh_unlock(&pool->lock);
    if (released) *released = n;
    return 0;
}
