/*
 * check.c: msh_pool_check (pool.h; docs/testing.md "The pool's invariants").
 *
 * Owns the invariants: blocks tile every region in address order, the free blocks are exactly
 * the treaps', the live blocks exactly the hash's, each page's live count equals the live blocks
 * touching it, mapped pages plus orphaned handles equal the handles held, the cached lists are
 * exactly the mapped pages with no live block, every multi-page handle is all in use or all
 * cached, and every counter behind memshim_get_stats() equals a recount.
 *
 * Must never change the pool: it only reads, under the pool's lock, and says what is wrong.
 */
#include "internal.h"

#include <sched.h>

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
    msh_lock(&pool->lock);
    /* Requests doing driver work hold claims (pending blocks, pages in progress) that the rest of
     * the pool accounts for only once they publish: the exact checks need a quiet pool. */
    bool quiet = pool->jobs == 0 && pool->waiters == 0; /* a waiter holds a pending block too */
    size_t nbinned = 0, binned_bytes = 0, nparked_bytes = 0, region_bytes = 0, free_bytes_all = 0, live_va = 0;
    uint64_t counted_bytes = 0, counted_req = 0, counted_n = 0;
    size_t nfree[NAREAS] = {0}, nlive = 0, live_bytes = 0, mapped = 0, touched = 0, cached = 0, heads = 0, nparked = 0;
    size_t host_heads = 0, host_pages = 0, host_idle = 0; /* spilled handles (spill.c) */
    size_t va = 0;
    if (pool->nevs) {
        evrefs_bytes = round_up((size_t)pool->nevs * sizeof *evrefs, 4096);
        evrefs = raw_alloc(evrefs_bytes);
        if (!evrefs) CHECK_FAIL("cannot map %zu bytes for the check", evrefs_bytes);
    }
    for (int a = 0; a < NAREAS; a++) {
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            va += r->size;
            region_bytes += r->size;
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
                if (b->qlo < b->qhi) { /* the one-stream regime's span of untagged frees */
                    if (pool->solo != SOLO_ONE)
                        CHECK_FAIL("block %#llx keeps an untagged span after the one-stream regime ended", (unsigned long long)b->addr);
                    if (b->state != B_FREE && b->state != B_PENDING)
                        CHECK_FAIL("block %#llx (state %d) keeps an untagged span", (unsigned long long)b->addr, b->state);
                    if (b->qlo < b->addr || b->qhi > b->addr + b->size)
                        CHECK_FAIL("block %#llx: its untagged span [%#llx, %#llx) is outside it", (unsigned long long)b->addr,
                                   (unsigned long long)b->qlo, (unsigned long long)b->qhi);
                }
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
                    free_bytes_all += b->size;
                } else if (b->state == B_LIVE || b->state == B_BINNED) {
                    if (b->state == B_LIVE) {
                        nlive++;
                        live_bytes += b->req;
                        live_va += b->size;
                        if (b->counted) {
                            counted_bytes += (b->req ? b->req : 1) + BLOCK_ALIGN - 1 - ((b->req ? b->req : 1) + BLOCK_ALIGN - 1) % BLOCK_ALIGN;
                            counted_req += b->req;
                            counted_n++;
                        }
                    } else {
                        nbinned++;
                        binned_bytes += b->size;
                        if (b->counted) CHECK_FAIL("binned block %#llx is still counted as allocated", (unsigned long long)b->addr);
                    }
                    if (b->req > b->size) CHECK_FAIL("block %#llx: requested %llu > extent %llu", (unsigned long long)b->addr,
                                                     (unsigned long long)b->req, (unsigned long long)b->size);
                    if (hash_find(pool, b->addr) != b) CHECK_FAIL("live block %#llx is not in the hash", (unsigned long long)b->addr);
                    for (int i = 0; i < b->ns; i++)
                        if (b->s[i].ev != NO_EV) CHECK_FAIL("live block %#llx holds an event", (unsigned long long)b->addr);
                } else if ((b->state == B_PENDING || b->state == B_FREEING) && !quiet) {
                    /* in flight: its pages are claimed */
                } else if (b->state == B_PARKED) {
                    nparked++;
                    nparked_bytes += b->size;
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
                if (hp->host) {
                    host_heads++;
                    host_pages += hp->npages;
                } else {
                    heads++;
                    mapped += hp->npages;
                }
                uint32_t nl = 0;
                for (uint32_t q = p; q < p + hp->npages; q++) {
                    if (pg_head(&r->pages[q]) != p) CHECK_FAIL("region %#llx page %u: inside the handle at %u but points at %u",
                                                               (unsigned long long)r->base, q, p, pg_head(&r->pages[q]));
                    nl += r->pages[q].live > 0;
                }
                if (nl != hp->nlive) CHECK_FAIL("region %#llx handle at %u: %u pages touched, count says %u",
                                                (unsigned long long)r->base, p, nl, hp->nlive);
                /* a handle of several pages is in use by one block covering all of it, or cached */
                if (hp->host && hp->state == PG_MAPPED && !nl) host_idle += hp->npages;
                if (quiet && limit_now(pool) && hp->npages > 1 && nl && nl != hp->npages && !hp->host)
                    CHECK_FAIL("region %#llx handle at %u: %u of its %u pages in use (partly used handles cannot be reclaimed)",
                               (unsigned long long)r->base, p, nl, hp->npages);
                for (uint32_t q = p; quiet && limit_now(pool) && hp->npages > 1 && !hp->host && q < p + hp->npages; q++)
                    if (r->pages[q].live > 1)
                        CHECK_FAIL("region %#llx page %u of a %u-page handle is shared by %d blocks", (unsigned long long)r->base, q,
                                   hp->npages, r->pages[q].live);
                if (quiet && (hp->state != PG_MAPPED || !hp->handle))
                    CHECK_FAIL("region %#llx handle at %u: state %u, handle %#llx with no request in flight",
                               (unsigned long long)r->base, p, hp->state, (unsigned long long)hp->handle);
                uint8_t want = 0;
                for (uint32_t q = p; q < p + hp->npages; q++) want |= r->pages[q].plan & PLAN_PAGE;
                if (hp->state == PG_MAPPED && !hp->nlive && !hp->host) {
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
            if (b->state != B_LIVE && b->state != B_BINNED)
                CHECK_FAIL("a block %#llx that is neither live nor binned is in the live hash", (unsigned long long)b->addr);
            if (hash_addr(b->addr, pool->hcap) != i) CHECK_FAIL("live block %#llx is in the wrong hash bucket", (unsigned long long)b->addr);
            if (++nhash > nlive + nbinned) break;
        }
    if (nhash != nlive + nbinned || pool->hcount != nlive + nbinned)
        CHECK_FAIL("%zu live and %zu binned blocks in the regions, %zu in the hash, hash count %zu", nlive, nbinned, nhash,
                   pool->hcount);
    /* the front end: its bins hold exactly the binned blocks, its counts are theirs */
    {
        char fw[200];
        if (front_check(pool, nbinned, binned_bytes, fw, sizeof fw)) CHECK_FAIL("%s", fw);
    }
    /* every byte of every region is live, binned, free or in flight: quiet, nothing is in flight */
    if (quiet && live_va + binned_bytes + free_bytes_all + nparked_bytes != region_bytes)
        CHECK_FAIL("live %zu + binned %zu + free %zu + parked %zu bytes != the regions' %zu", live_va, binned_bytes,
                   free_bytes_all, nparked_bytes, region_bytes);
    /* the callers' counters are the counted live blocks */
    counted_bytes += pool->caller_ext[0]; /* allocations other pools of the device served */
    counted_req += pool->caller_ext[1];
    counted_n += pool->caller_ext[2];
    if (pool->caller.bytes[0].cur != counted_bytes || pool->caller.req[0].cur != counted_req ||
        pool->caller.count[0].cur != counted_n)
        CHECK_FAIL("callers' counters: %llu bytes, %llu requested, %llu blocks allocated; counted live blocks: %llu, %llu, %llu",
                   (unsigned long long)pool->caller.bytes[0].cur, (unsigned long long)pool->caller.req[0].cur,
                   (unsigned long long)pool->caller.count[0].cur, (unsigned long long)counted_bytes,
                   (unsigned long long)counted_req, (unsigned long long)counted_n);
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
    if (quiet && pool->releasing)
        CHECK_FAIL("%zu pages counted as being released with no job in flight", pool->releasing);
    if (quiet && pool->nhandles != heads) CHECK_FAIL("handles %zu, recount %zu", pool->nhandles, heads);
    if (pool->touched != touched) CHECK_FAIL("touched pages %zu, recount %zu", pool->touched, touched);
    if (quiet && (pool->spill_pages != host_pages || pool->nhost != host_heads || pool->spill_idle != host_idle))
        CHECK_FAIL("spilled: %zu pages in %zu host handles (%zu idle), recount %zu in %zu (%zu idle)", pool->spill_pages,
                   pool->nhost, pool->spill_idle, host_pages, host_heads, host_idle);
    if (quiet && pool->st.spilled_bytes != pool->spill_pages * pool->gran)
        CHECK_FAIL("spilled_bytes %zu, host pages say %zu", pool->st.spilled_bytes, pool->spill_pages * pool->gran);
    if (pool->cached != cached) CHECK_FAIL("cached pages %zu, recount %zu", pool->cached, cached);
    if (pool->st.live_bytes != live_bytes) CHECK_FAIL("live bytes %zu, recount %zu", pool->st.live_bytes, live_bytes);
    if (pool->st.live_blocks != nlive) CHECK_FAIL("live blocks %zu, recount %zu", pool->st.live_blocks, nlive);
    if (pool->st.va_bytes != va) CHECK_FAIL("reserved VA %zu, recount %zu", pool->st.va_bytes, va);
    if (pool->st.peak_live_bytes < live_bytes || pool->st.run_peak_live_bytes < pool->st.peak_live_bytes)
        CHECK_FAIL("live peaks (epoch %zu, run %zu) below the current %zu", pool->st.peak_live_bytes,
                   pool->st.run_peak_live_bytes, live_bytes);
    /* The driver's bytes and their peaks, read while no create was halfway (dev_create adds to
     * drv_held, then raises the peaks, without the lock): a create that ended before `out` was
     * read has raised them; one begun and not ended shows as in != out, and the comparisons
     * with what is held wait for a read with none (a few tries, then they are left out). */
    size_t dheld = 0, dpe = 0, dpr = 0, dps = 0;
    bool settled = false;
    for (int t = 0; t < 64 && !settled; t++) {
        uint64_t out = __atomic_load_n(&pool->drv_creates_out, __ATOMIC_SEQ_CST);
        dheld = __atomic_load_n(&pool->drv_held, __ATOMIC_SEQ_CST);
        dpe = __atomic_load_n(&pool->drv_peak_epoch, __ATOMIC_SEQ_CST);
        dpr = __atomic_load_n(&pool->drv_peak_run, __ATOMIC_SEQ_CST);
        dps = __atomic_load_n(&pool->drv_peak_step, __ATOMIC_SEQ_CST);
        settled = __atomic_load_n(&pool->drv_creates_in, __ATOMIC_SEQ_CST) == out;
        if (!settled) sched_yield();
    }
    if (dpr < dpe || (settled && dpe < dheld))
        CHECK_FAIL("reserved peaks (epoch %zu, run %zu) below the current %zu the driver holds", dpe, dpr, dheld);
    if ((settled && (dps < dheld || dps > dpr)) || pool->step_peak_live < live_bytes)
        CHECK_FAIL("step peaks (reserved %zu, live %zu) below the current %zu, %zu or above the run's %zu", dps,
                   pool->step_peak_live, dheld, live_bytes, dpr);
    if (pool->at_peak_held > dpe || pool->at_peak_live > pool->st.peak_live_bytes)
        CHECK_FAIL("at the reserved peak: %zu reserved, %zu live, above the epoch's peaks %zu, %zu", pool->at_peak_held,
                   pool->at_peak_live, dpe, pool->st.peak_live_bytes);
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
    msh_unlock(&pool->lock);
    raw_free(live_count, live_count_bytes);
    raw_free(evrefs, evrefs_bytes);
    return rc;
}
