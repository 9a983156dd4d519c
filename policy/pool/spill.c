/*
 * spill.c: spill cold pages to host memory behind the same addresses (MEMSHIM_SPILL=host, opt-in;
 * docs/pool.md "Spill").
 *
 * Owns the last step of the rescue chain and its return: when nothing else serves a request
 * under the limit or the device's capacity, the handles of cold pages (touched only by live blocks
 * allocated before the latest step mark, least recently allocated first, whole handles) are
 * moved, each in one sequence: host memory created through VMM, mapped at a scratch address, the
 * page's contents copied there with the device synchronized, the device handle unmapped, the host
 * handle mapped at the same address with the device's access, the device handle released. Kernels
 * keep reaching the addresses (over the host link, slower). At a step mark the reverse brings
 * pages back while the device has room with a margin, and idle host handles are given back.
 *
 * Must never move a page touched by a block of the current step, a pending or freeing block, or
 * during a CUDA-graph capture (a synchronize would invalidate it); never call the driver with the
 * pool lock held (the handles being moved are PG_MOVING meanwhile, so other threads wait for them);
 * never leave an address unmapped or its bytes lost when a call fails (each step is undone in
 * reverse); never count host memory against the device's limit, nor let host bytes pass
 * spill_max_bytes.
 */
#include "internal.h"

/* A spilled page comes back only while the pool would still hold 1/16 of its cap (at least a page)
 * free after it:
 * a job that spills at the limit does not bring its pages back at once to spill them again. */
#define RETURN_MARGIN_SHIFT 4

struct cand {
    struct region *r;
    uint32_t h, n;
    uint64_t age; /* the youngest block touching it (born): smaller is colder */
};

/* Append to a raw_alloc'd array of candidates (doubling); false when memory ran out. */
static bool cand_push(struct cand **c, size_t *n, size_t *cap, struct cand x)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 64;
        struct cand *g = raw_alloc(ncap * sizeof *g);
        if (!g) return false;
        if (*c) {
            memcpy(g, *c, *n * sizeof **c);
            raw_free(*c, *cap * sizeof **c);
        }
        *c = g;
        *cap = ncap;
    }
    (*c)[(*n)++] = x;
    return true;
}

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->age != y->age) return x->age < y->age ? -1 : 1;
    if (x->r->base != y->r->base) return x->r->base < y->r->base ? -1 : 1;
    return x->h < y->h ? -1 : x->h > y->h;
}

static bool spill_usable(struct msh_pool *pool)
{
    if (!pool->prm.spill || pool->spill_state < 0) return false;
    if (!pool->dev->ops->host_create || !pool->dev->ops->copy) {
        pool->spill_state = -1;
        msh_warn("MEMSHIM_SPILL=host: the %s backend has no host memory through VMM; spilling is off",
                 pool->dev->ops->name);
        return false;
    }
    return true;
}

static void spill_stats(struct msh_pool *pool)
{
    size_t b = pool->spill_pages * pool->gran;
    pool->st.spilled_bytes = b;
    if (b > pool->st.peak_spilled_bytes) pool->st.peak_spilled_bytes = b;
    if (b > pool->st.run_peak_spilled_bytes) pool->st.run_peak_spilled_bytes = b;
}

/* Move the handle `old` of `bytes` at va to new memory (host when to_host, else the device), its
 * contents copied; the device is synchronized by the caller. 0 and *nh, or the first error with
 * everything as it was (the old handle still mapped at va with access), or EIO when even that
 * could not be restored (*lost: the address may be unusable; logged). */
static int move_handle(struct msh_pool *pool, uint64_t va, size_t bytes, uint64_t old, bool to_host, uint64_t *nh,
                       bool *old_kept)
{
    uint64_t h = 0, tmp = 0;
    *old_kept = false;
    int rc = to_host ? dev_host_create(pool, bytes, &h) : dev_create_counted(pool, bytes, &h);
    if (rc) return rc;
    if ((rc = dev_reserve(pool, bytes, &tmp))) goto release_new;
    if ((rc = dev_map_counted(pool, tmp, bytes, h))) goto unreserve;
    if ((rc = dev_set_access(pool, tmp, bytes)) || (rc = dev_copy(pool, tmp, va, bytes, to_host))) {
        dev_unmap(pool, tmp, bytes);
        goto unreserve;
    }
    if ((rc = dev_unmap(pool, tmp, bytes)) && (rc = dev_unmap(pool, tmp, bytes))) {
        /* twice refused: the new handle stays mapped at the scratch address and cannot be released */
        msh_warn("pool: spill: unmapping the scratch copy failed (%d); %zu bytes of %s memory leak", rc, bytes,
                 to_host ? "host" : "device");
        return rc;
    }
    dev_unreserve(pool, tmp, bytes);
    tmp = 0;
    if ((rc = dev_unmap(pool, va, bytes))) goto release_new; /* the old mapping is untouched */
    if ((rc = dev_map_counted(pool, va, bytes, h))) goto remap_old;
    if ((rc = dev_set_access(pool, va, bytes))) {
        dev_unmap(pool, va, bytes);
        goto remap_old;
    }
    int rel = to_host ? dev_release(pool, old, bytes) : dev_host_release(pool, old, bytes);
    *old_kept = rel != 0; /* the caller keeps it as an orphan */
    *nh = h;
    return 0;
remap_old:
    if (dev_map_counted(pool, va, bytes, old) || dev_set_access(pool, va, bytes)) {
        /* the old backing cannot come back: the new one holds the same bytes, try it once more */
        dev_unmap(pool, va, bytes);
        if (!dev_map_counted(pool, va, bytes, h) && !dev_set_access(pool, va, bytes)) {
            int rel = to_host ? dev_release(pool, old, bytes) : dev_host_release(pool, old, bytes);
            *old_kept = rel != 0;
            *nh = h;
            return 0;
        }
        msh_error("pool: spill: %#llx (%zu bytes) could not be mapped again after a failed move (%d): its "
                  "blocks are unusable", (unsigned long long)va, bytes, rc);
        return EIO;
    }
    goto release_new;
unreserve:
    if (tmp) dev_unreserve(pool, tmp, bytes);
release_new:
    if (to_host) dev_host_release(pool, h, bytes);
    else dev_release(pool, h, bytes);
    return rc;
}

/* Move the chosen handles (PG_MOVING, the lock held on entry and on return, dropped between).
 * Returns how many pages moved. */
static size_t move_all(struct msh_pool *pool, struct cand *c, size_t n, bool to_host)
{
    size_t reserved = 0; /* a return creates device handles: their pages count from now on, so that
                          * no other thread's claim takes them meanwhile */
    for (size_t i = 0; i < n; i++) {
        c[i].r->pages[c[i].h].state = PG_MOVING;
        if (!to_host) reserved += c[i].n;
    }
    if (reserved) held_add(pool, reserved);
    pool->jobs++;
    msh_unlock(&pool->lock);
    uint64_t t0 = msh_now_ns();
    int rc = dev_synchronize(pool); /* no kernel may touch a page while it is copied and remapped */
    uint64_t *nh = raw_alloc(n * sizeof *nh);
    uint8_t *res = raw_alloc(n); /* 0 moved, 1 moved with the old handle kept, 2 not moved, 3 lost */
    bool stop = rc != 0 || !nh || !res;
    for (size_t i = 0; i < n && !stop; i++) {
        struct page *hp = &c[i].r->pages[c[i].h];
        bool kept = false;
        int m = move_handle(pool, page_va(pool, c[i].r, c[i].h), (size_t)c[i].n * pool->gran, hp->handle, to_host,
                            &nh[i], &kept);
        res[i] = m == 0 ? (kept ? 1 : 0) : (m == EIO ? 3 : 2);
        if (m == ENOTSUP && to_host) {
            pool->spill_state = -1;
            msh_warn("MEMSHIM_SPILL=host: the driver gives no host memory through VMM on device %d; spilling is off",
                     pool->dev->ordinal);
        }
        if (m) {
            for (size_t k = i + 1; k < n; k++) res[k] = 2;
            if (m == ENOMEM && to_host) pool->oom.spill_stop = "host refused";
            break;
        }
    }
    if (stop && res)
        for (size_t i = 0; i < n; i++) res[i] = 2;
    uint64_t dt = msh_now_ns() - t0;
    msh_lock(&pool->lock);
    size_t moved = 0;
    for (size_t i = 0; i < n; i++) {
        struct region *r = c[i].r;
        struct page *hp = &r->pages[c[i].h];
        uint32_t np = c[i].n;
        int x = res ? res[i] : 2;
        if (x == 0 || x == 1) {
            uint64_t old = hp->handle;
            hp->handle = nh[i];
            hp->host = to_host;
            moved += np;
            if (to_host) {
                if (x == 0) held_sub(pool, np);
                else if (pool->norphans < 64) { /* the device handle stays counted until released */
                    pool->orphans[pool->norphans].h = old;
                    pool->orphans[pool->norphans++].pages = np;
                } else held_sub(pool, np);
                pool->nhandles--;
                pool->nhost++;
                pool->spill_pages += np;
                pool->st.spill_out_pages += np;
                pool->st.spill_out_bytes += (uint64_t)np * pool->gran;
                if (!hp->nlive) pool->spill_idle += np;
            } else {
                reserved -= np; /* counted since the start */
                pool->nhandles++;
                pool->nhost--;
                pool->spill_pages -= np;
                pool->st.spill_in_pages += np;
                pool->st.spill_in_bytes += (uint64_t)np * pool->gran;
                /* a host handle the device cannot give back is leaked (no orphan list for it) */
            }
        } else if (!to_host && !hp->nlive) {
            pool->spill_idle += np; /* still host memory, and its last block went meanwhile */
        }
        hp->state = PG_MAPPED;
        if (!hp->host && !hp->nlive) cache_add(pool, r, c[i].h);
    }
    if (reserved) held_sub(pool, reserved); /* the returns that did not happen */
    pool->st.spill_ns += dt;
    spill_stats(pool);
    pool->jobs--;
    msh_cond_broadcast(&pool->cv);
    if (nh) raw_free(nh, n * sizeof *nh);
    if (res) raw_free(res, n);
    return moved;
}

/* Candidates to spill: whole device handles in use, every page of which only cold live blocks
 * touch. Returns them sorted coldest first (raw_alloc'd, *nc entries), or NULL. */
static struct cand *pick_cold(struct msh_pool *pool, size_t *nc, size_t *capp)
{
    size_t cap = 0, n = 0;
    struct cand *c = NULL;
    *nc = 0;
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            if (!r->hi_page) continue;
            size_t bytes = (size_t)r->hi_page * (sizeof(uint64_t) + 1);
            uint64_t *young = raw_alloc(bytes);
            if (!young) continue;
            uint8_t *hot = (uint8_t *)(young + r->hi_page);
            for (struct blk *b = r->first; b; b = b->next) {
                if (b->state == B_FREE) continue;
                uint32_t p0, p1;
                page_range(pool, b, &p0, &p1);
                bool cold = b->state == B_LIVE && b->born < pool->spill_mark;
                for (uint32_t p = p0; p <= p1 && p < r->hi_page; p++) {
                    if (!cold) hot[p] = 1;
                    else if (b->born + 1 > young[p]) young[p] = b->born + 1;
                }
            }
            for (uint32_t p = 0; p < r->hi_page;) {
                struct page *hp = &r->pages[p];
                if (pg_head(hp) != p) {
                    p++;
                    continue;
                }
                uint32_t np = hp->npages ? hp->npages : 1;
                bool ok = hp->state == PG_MAPPED && !hp->host && hp->nlive && hp->handle;
                uint64_t age = 0;
                for (uint32_t q = p; ok && q < p + np; q++) {
                    if (hot[q]) ok = false;
                    if (young[q] > age) age = young[q];
                }
                if (ok && !cand_push(&c, &n, &cap, (struct cand){.r = r, .h = p, .n = np, .age = age})) break;
                p += np;
            }
            raw_free(young, bytes);
        }
    if (!n) {
        if (c) raw_free(c, cap * sizeof *c);
        return NULL;
    }
    qsort(c, n, sizeof *c, cand_cmp);
    *nc = n;
    *capp = cap; /* raw_free needs the size it was given */
    return c;
}

/* The rescue chain's last step (msh_pool_alloc): spill enough cold pages for a request of rsize
 * bytes (more at each later round). True when pages moved (the caller tries again). */
bool spill_rescue(struct msh_pool *pool, uint64_t rsize, int round)
{
    if (!spill_usable(pool) || capturing(pool)) return false;
    if (!pool->spill_marked && !pool->first_free_seen) {
        pool->oom.spill_stop = "nothing cold";
        return false; /* nothing was ever freed and no step marked: everything is the current step */
    }
    size_t want = (size_t)((rsize + pool->gran - 1) / pool->gran) + 2;
    want <<= round; /* placement may need more than the request's pages: each round doubles */
    size_t nc = 0, cap = 0;
    struct cand *c = pick_cold(pool, &nc, &cap);
    if (!c) {
        pool->oom.spill_stop = "nothing cold";
        return false;
    }
    size_t take = 0, pages = 0;
    bool capped = false;
    while (take < nc && pages < want) {
        if (pool->spill_max_pages && pool->spill_pages + pages + c[take].n > pool->spill_max_pages) {
            capped = true;
            break;
        }
        pages += c[take++].n;
    }
    size_t moved = take ? move_all(pool, c, take, true) : 0;
    raw_free(c, cap * sizeof *c);
    if (!moved && capped) pool->oom.spill_stop = "spill_max";
    else if (!moved && !pool->oom.spill_stop) pool->oom.spill_stop = take ? "host refused" : "nothing cold";
    if (moved && pool->spill_state == 0) pool->spill_state = 1;
    return moved > 0;
}

/* Give back idle host handles and bring spilled ones back while the device has room. */
static size_t unspill_locked(struct msh_pool *pool, bool all)
{
    if (!pool->spill_pages || capturing(pool)) return 0;
    size_t cap = cap_pages(pool);
    if (cap == SIZE_MAX && pool->device_total) cap = pool->device_total / pool->gran;
    size_t margin = all || cap == SIZE_MAX ? 0 : (cap >> RETURN_MARGIN_SHIFT ? cap >> RETURN_MARGIN_SHIFT : 1);
    size_t n = 0, ccap = 0, idle = 0;
    struct cand *c = NULL;
    /* idle host handles first: nothing to copy, they are only given back */
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next)
            for (uint32_t p = 0; p < r->hi_page;) {
                struct page *hp = &r->pages[p];
                uint32_t np = pg_head(hp) == p && hp->npages ? hp->npages : 1;
                /* age: idle ones first (0), then those in use */
                if (pg_head(hp) == p && hp->host && hp->state == PG_MAPPED &&
                    !cand_push(&c, &n, &ccap, (struct cand){.r = r, .h = p, .n = np, .age = hp->nlive ? 1 : 0}))
                    goto done_scan;
                p += np;
            }
done_scan:
    if (!n) return 0;
    qsort(c, n, sizeof *c, cand_cmp);
    size_t back = 0;
    /* idle: unmap and give back, no copy */
    size_t k = 0;
    while (k < n && c[k].age == 0) k++;
    if (k) {
        for (size_t i = 0; i < k; i++) c[i].r->pages[c[i].h].state = PG_MOVING;
        pool->jobs++;
        msh_unlock(&pool->lock);
        int *ok = raw_alloc(k * sizeof *ok);
        /* the device must be done with them before the unmap (unmap is not stream-ordered) */
        int sync = dev_synchronize(pool);
        for (size_t i = 0; i < k && ok; i++) {
            struct page *hp = &c[i].r->pages[c[i].h];
            size_t bytes = (size_t)c[i].n * pool->gran;
            ok[i] = !sync && !dev_unmap(pool, page_va(pool, c[i].r, c[i].h), bytes);
            if (ok[i] && dev_host_release(pool, hp->handle, bytes))
                msh_debug("pool: spill: releasing %zu bytes of idle host memory failed (leaked)", bytes);
        }
        msh_lock(&pool->lock);
        for (size_t i = 0; i < k; i++) {
            struct region *r = c[i].r;
            struct page *hp = &r->pages[c[i].h];
            hp->state = PG_MAPPED; /* PG_MOVING kept every claim away: still idle */
            if (!ok || !ok[i]) continue;
            for (uint32_t q = c[i].h; q < c[i].h + c[i].n; q++) r->pages[q].hd = 0;
            hp->handle = 0;
            hp->npages = 0;
            hp->host = 0;
            pool->nhost--;
            pool->spill_pages -= c[i].n;
            pool->spill_idle -= c[i].n;
            idle += c[i].n;
        }
        pool->jobs--;
        msh_cond_broadcast(&pool->cv);
        if (ok) raw_free(ok, k * sizeof *ok);
    }
    /* in use: back to the device while it has room (with the margin), counting cached device
     * pages as room: they are given back first, as many as the return needs */
    size_t take = k, pages = 0;
    size_t room = cap == SIZE_MAX ? SIZE_MAX : (cap > pool->held - pool->cached + margin ? cap - (pool->held - pool->cached) - margin : 0);
    while (take < n) {
        struct page *hp = &c[take].r->pages[c[take].h];
        if (hp->state != PG_MAPPED || !hp->host || !hp->nlive) break; /* changed while unlocked */
        if (room != SIZE_MAX && pages + c[take].n > room) break;
        pages += c[take++].n;
    }
    /* pages other threads are releasing are still on the device until they publish (releasing) */
    if (pages && cap != SIZE_MAX && pool->held + pool->releasing + pages > cap) {
        size_t over = pool->held + pool->releasing + pages - cap; /* cached pages to give back first */
        release_cached(pool, pool->cached > over ? (pool->cached - over) * pool->gran : 0, 0);
        while (take > k && pool->held + pool->releasing + pages > cap) pages -= c[--take].n; /* what could not be freed */
    }
    if (take > k) back = move_all(pool, c + k, take - k, false);
    raw_free(c, ccap * sizeof *c);
    spill_stats(pool);
    (void)idle;
    return back * pool->gran;
}

void msh_pool_set_spill(struct msh_pool *pool, bool on, size_t max_bytes)
{
    msh_lock(&pool->lock);
    pool->prm.spill = on;
    pool->prm.spill_max_bytes = max_bytes;
    pool->spill_max_pages = max_bytes ? (max_bytes / pool->gran ? max_bytes / pool->gran : 1) : 0;
    msh_unlock(&pool->lock);
}

size_t msh_pool_unspill(struct msh_pool *pool, bool all)
{
    msh_lock(&pool->lock);
    size_t n = unspill_locked(pool, all);
    msh_unlock(&pool->lock);
    return n;
}

size_t msh_pool_mark_step(struct msh_pool *pool)
{
    msh_lock(&pool->lock);
    pool->spill_mark = pool->nborn;
    pool->spill_marked = true;
    size_t n = unspill_locked(pool, false);
    msh_unlock(&pool->lock);
    return n;
}

/* The pool's first free: with no step marked, what was allocated before it is cold (weights and
 * optimizer state, allocated before the first step frees anything). */
void spill_note_free(struct msh_pool *pool)
{
    if (pool->first_free_seen) return;
    pool->first_free_seen = true;
    if (!pool->spill_marked) pool->spill_mark = pool->nborn;
}

/* The learned step begins again (step.c): the blocks of the steps before are cold. */
void spill_note_step(struct msh_pool *pool)
{
    pool->spill_mark = pool->nborn;
    pool->spill_marked = true;
}

void msh_pool_for_each_spilled(struct msh_pool *pool, void (*fn)(void *arg, uint64_t addr, size_t size, size_t host_bytes),
                               void *arg)
{
    msh_lock(&pool->lock);
    if (pool->spill_pages)
        for (int a = 0; a < NAREAS; a++)
            for (struct region *r = pool->areas[a]; r; r = r->next)
                for (struct blk *b = r->first; b; b = b->next) {
                    if (b->state != B_LIVE) continue;
                    uint32_t p0, p1;
                    page_range(pool, b, &p0, &p1);
                    size_t hb = 0;
                    for (uint32_t p = p0; p <= p1; p++) {
                        uint32_t h = pg_head(&r->pages[p]);
                        if (h != NO_PAGE && r->pages[h].host) {
                            uint64_t lo = page_va(pool, r, p), hi = lo + pool->gran;
                            uint64_t s = b->addr > lo ? b->addr : lo, e = b->addr + b->size < hi ? b->addr + b->size : hi;
                            hb += e - s;
                        }
                    }
                    if (hb) fn(arg, b->addr, b->req, hb);
                }
    msh_unlock(&pool->lock);
}
