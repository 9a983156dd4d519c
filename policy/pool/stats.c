/*
 * stats.c: what the pool counts and lets its callers read (pool.h): the statistics and their
 * peaks, the callers' counters (PyTorch's memory_stats: plain fields under the pool lock, counted
 * at every allocation and free, issue 30), the latency of timed calls and the threads they came
 * from, the last OOM's figures, and the page counters cudaMemGetInfo reads.
 *
 * Must never call the driver, and never read a figure without the pool lock but those documented
 * as racy reads (msh_pool_mapped_bytes).
 */
#include "internal.h"

/* The threads whose calls were timed, this epoch and over the run (the reports' share of the
 * allocating threads' time: several threads' paths add up to more than the wall time). A
 * thread remembers the last pools it was counted for, with their epoch. */
static __thread struct {
    const struct msh_pool *pool;
    uint64_t gen;
} tl_timed[4];
static __thread unsigned tl_timed_next;

static void lat_thread(struct msh_pool *pool)
{
    for (int i = 0; i < 4; i++)
        if (tl_timed[i].pool == pool) {
            if (tl_timed[i].gen != pool->lat_gen) {
                tl_timed[i].gen = pool->lat_gen;
                pool->st.timed_threads++;
            }
            return;
        }
    unsigned i = tl_timed_next++ % 4;
    tl_timed[i].pool = pool;
    tl_timed[i].gen = pool->lat_gen;
    pool->st.timed_threads++;
    pool->st.timed_threads_run++; /* a thread evicted from the four and back counts again: rare */
}

/* One timed call: the total, the histogram behind the reports' latency percentiles, the max. */
static inline void lat_note(uint64_t *hist, uint64_t *total, uint64_t *max, uint64_t ns, uint32_t w)
{
    *total += ns * w; /* a timed call stands for w calls (hotclock.h) */
    hist[msh_lat_bucket(ns)] += w;
    if (ns > *max) *max = ns;
}





/* Free bytes that could be handed out now without mapping anything, and the largest such run. */
void scan_free(struct msh_pool *pool, size_t *free_bytes, size_t *largest)
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

uint64_t msh_pool_activity(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    uint64_t n = pool->st.allocs + pool->st.frees;
    msh_unlock(&pool->lock);
    return n;
}

size_t msh_pool_mapped_bytes(struct msh_pool *pool)
{
    return __atomic_load_n(&pool->held, __ATOMIC_RELAXED) * pool->gran;
}

void msh_pool_get_stats(struct msh_pool *pool, struct msh_pool_stats *out)
{
    msh_lock(&pool->lock);
    pool->st.mapped_bytes = pool->held * pool->gran;
    pool->st.handle_bytes = pool->held * pool->gran;
    pool->st.touched_bytes = pool->touched * pool->gran;
    pool->st.handles = pool->nhandles;
    scan_free(pool, &pool->st.free_bytes, &pool->st.largest_free);
    pool->st.binned_bytes = pool->front.bytes;
    pool->st.binned_blocks = pool->front.blocks;
    pool->st.front_grown_aside = pool->front.grown_aside * pool->gran;
    pool->st.front_state = front_state(pool);
    *out = pool->st;
    out->peak_mapped_bytes = __atomic_load_n(&pool->drv_peak_epoch, __ATOMIC_RELAXED);
    out->run_peak_mapped_bytes = __atomic_load_n(&pool->drv_peak_run, __ATOMIC_RELAXED);
    out->at_peak_mapped_bytes = pool->at_peak_held;
    out->at_peak_live_bytes = pool->at_peak_live;
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        out->drv_calls[k] = __atomic_load_n(&pool->st.drv_calls[k], __ATOMIC_RELAXED);
        out->drv_bytes[k] = __atomic_load_n(&pool->st.drv_bytes[k], __ATOMIC_RELAXED);
        out->drv_maps[k] = __atomic_load_n(&pool->st.drv_maps[k], __ATOMIC_RELAXED);
    }
    msh_unlock(&pool->lock);
}

void msh_pool_reset_peaks(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    pool->st.peak_live_bytes = pool->st.live_bytes;
    pool->st.peak_binned_bytes = pool->front.bytes;
    pool->lat_gen++; /* the threads timed in the next epoch are counted again */
    pool->st.timed_threads = 0;
    __atomic_store_n(&pool->drv_peak_epoch, __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    pool->st.peak_touched_bytes = pool->touched * pool->gran;
    pool->st.peak_spilled_bytes = pool->spill_pages * pool->gran;
    pool->at_peak_held = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    pool->at_peak_live = pool->st.live_bytes;
    pool->step_peak_live = pool->st.live_bytes;
    __atomic_store_n(&pool->drv_peak_step, pool->at_peak_held, __ATOMIC_RELAXED);
    msh_unlock(&pool->lock);
}

void msh_pool_take_step_peaks(struct msh_pool *pool, size_t *live, size_t *reserved)
{
    msh_lock(&pool->lock);
    size_t held = __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    *live = pool->step_peak_live;
    *reserved = __atomic_exchange_n(&pool->drv_peak_step, held, __ATOMIC_RELAXED);
    pool->step_peak_live = pool->st.live_bytes;
    msh_unlock(&pool->lock);
}

const char *msh_oom_case_name(int kind)
{
    return kind == MSH_OOM_DEVICE ? "larger_than_device" : kind == MSH_OOM_LIMIT ? "larger_than_limit"
                                                                                  : "does_not_fit_now";
}

const char *msh_oom_case_text(int kind)
{
    return kind == MSH_OOM_DEVICE ? "larger than the device" : kind == MSH_OOM_LIMIT ? "larger than the limit"
                                                                                      : "does not fit now";
}

void msh_pool_last_oom(struct msh_pool *pool, struct msh_pool_oom *out)
{
    msh_lock(&pool->lock);
    *out = pool->oom;
    msh_unlock(&pool->lock);
}

void lat_record(struct msh_pool *pool, bool alloc, uint64_t ns, uint32_t weight)
{
    lat_thread(pool);
    if (alloc) lat_note(pool->st.alloc_lat, &pool->st.alloc_ns_total, &pool->st.alloc_ns_max, ns, weight);
    else lat_note(pool->st.free_lat, &pool->st.free_ns_total, &pool->st.free_ns_max, ns, weight);
}

void msh_pool_note_latency(struct msh_pool *pool, bool alloc, uint64_t ns, uint32_t weight)
{
    msh_lock(&pool->lock);
    lat_record(pool, alloc, ns, weight);
    msh_unlock(&pool->lock);
}

void msh_pool_caller_stats(struct msh_pool *pool, struct msh_pool_caller *out)
{
    msh_lock(&pool->lock);
    caller_reserved(pool);
    *out = pool->caller;
    msh_unlock(&pool->lock);
}

void msh_pool_caller_note(struct msh_pool *pool, size_t size, bool alloc)
{
    msh_lock(&pool->lock);
    caller_count(pool, size, alloc);
    uint64_t d[3] = {round_block(size), size, 1};
    for (int k = 0; k < 3; k++) pool->caller_ext[k] = alloc ? pool->caller_ext[k] + d[k] : pool->caller_ext[k] > d[k] ? pool->caller_ext[k] - d[k] : 0;
    caller_reserved(pool);
    msh_unlock(&pool->lock);
}

void msh_pool_caller_reset(struct msh_pool *pool, bool peaks, bool accumulated)
{
    msh_lock(&pool->lock);
    struct msh_caller_count *all[3] = {pool->caller.bytes, pool->caller.req, pool->caller.count};
    for (int k = 0; k < 3; k++)
        for (int sp = 0; sp < 3; sp++) {
            if (peaks) all[k][sp].peak = all[k][sp].cur;
            if (accumulated) all[k][sp].allocated = all[k][sp].freed = 0;
        }
    if (peaks) {
        pool->caller.reserved_peak = 0;
        caller_reserved(pool);
    }
    msh_unlock(&pool->lock);
}

void msh_pool_counters(struct msh_pool *pool, struct msh_pool_counters *out)
{
    msh_lock(&pool->lock);
    out->gran = pool->gran;
    out->limit = limit_now(pool);
    out->handles = pool->held;
    out->cached_pages = pool->cached;
    out->touched_pages = pool->touched;
    out->live_bytes = pool->st.live_bytes;
    out->defrag = pool->prm.defrag;
    out->release_on_oom = !pool->prm.no_release_on_oom;
    msh_unlock(&pool->lock);
}
