/*
 * streams.c: streams and events (docs/pool.md "Streams").
 *
 * Owns the pooled events (created once, recorded at frees, shared by the extents split from one
 * free), the known streams with what each has completed and whether another stream wants its
 * memory, the stream tags of free extents (which stream's queued work may still touch which
 * bytes, and the event that covers it), and the rules a reuse follows: ready, wait on an event,
 * or synchronize (fit_kind, streams_plan).
 *
 * Must never record or wait on an event with the pool lock held (the records are planned under
 * the lock and run by pages.c's driver work), never take an event as covering work queued after
 * its record, and never record during a CUDA-graph capture.
 */
#include "internal.h"

/* ---- pooled events ------------------------------------------------------------------------------ */

/* A slot with one reference for an event of context `home`, or NO_EV when the table cannot grow.
 * Its event may not exist yet (h == 0): whoever records it creates it first, without the lock.
 * Slots keep their event when released, for the next record in the same context. */
uint32_t ev_get(struct msh_pool *pool, uint64_t home)
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

void ev_put(struct msh_pool *pool, uint32_t i)
{
    if (i == NO_EV) return;
    if (--pool->evs[i].refs) return;
    if (pool->evs[i].state == EV_RECORDED) pool->nrecorded--;
    pool->evs[i].state = EV_IDLE;
    pool->evs[i].next = pool->evfree;
    pool->evfree = i;
}

/* Destroy an event (without the lock). A destroy the driver refused is tried once more, so that
 * one failed call does not leak the event (docs/reliability.md). */
void ev_destroy(struct msh_pool *pool, uint64_t h)
{
    if (pool->dev->ops->event_release(pool->dev, h)) pool->dev->ops->event_release(pool->dev, h);
}

int dev_event_create(struct msh_pool *pool, uint64_t home, uint64_t *h)
{
    if (home && pool->dev->ops->event_create_on) return pool->dev->ops->event_create_on(pool->dev, home, h);
    return pool->dev->ops->event_create(pool->dev, h);
}

/* 0: complete; EBUSY: not yet; other: cannot tell. */
int dev_event_query(struct msh_pool *pool, uint64_t h)
{
    __atomic_fetch_add(&pool->st.event_queries, 1, __ATOMIC_RELAXED);
    return pool->dev->ops->event_query(pool->dev, h);
}

static inline uint32_t ks_slot_of(uint64_t stream)
{
    return (uint32_t)(((stream >> 4) * 0x9E3779B97F4A7C15ull) >> 58); /* 64 slots */
}

/* The stream's entry: the last one found, else a direct-mapped index of 64 slots (a stream's
 * handle is a pointer: its low bits are alignment), else the table (issue 30: a linear scan of
 * the 32 entries at every look cost more than the rest of the lookup). */
struct kstream *ks_find(struct msh_pool *pool, uint64_t stream)
{
    if (stream == MSH_STREAM_COMPLETED) return NULL;
    struct kstream *k = &pool->ks[pool->ks_last];
    if (k->used && k->stream == stream) return k;
    uint32_t h = ks_slot_of(stream), x = pool->ks_idx[h];
    if (x && pool->ks[x - 1].used && pool->ks[x - 1].stream == stream) {
        pool->ks_last = x - 1;
        return &pool->ks[x - 1];
    }
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++)
        if (pool->ks[i].used && pool->ks[i].stream == stream) {
            pool->ks_last = i;
            pool->ks_idx[h] = (uint8_t)(i + 1);
            return &pool->ks[i];
        }
    return NULL;
}

/* ---- one stream (issue 30) ---------------------------------------------------------------------
 * A stream tag is about other users: a reuse on the tag's own stream is ready by stream order, and
 * only another stream, or a host-synchronous user (MSH_STREAM_COMPLETED), has to wait for it.
 * While the pool has seen one stream alone, its frees leave no tag (their cost was a fifth of the
 * pool path's instructions): each free extent keeps the span of its untagged frees (qlo, qhi) and
 * the latest of their numbers and generations (qseq, qgen), merged, copied and clipped with it as
 * tags are, and the pool-wide free count still rises at each free, so an unmap still synchronizes
 * first (pages.c job_need_settle). The first other user ends the regime for good, before it
 * places anything: each span becomes the tag its frees would have left (that stream, the latest
 * free's number, no event; the generation, so that a synchronize since covers it), as merged tags
 * of one stream are. Bytes freed as complete (MSH_STREAM_COMPLETED) or never used stay clean; a
 * request in progress keeps its extent's span (if it gives the extent back, the tag stays). */
void solo_end(struct msh_pool *pool)
{
    uint8_t was = pool->solo;
    pool->solo = SOLO_OFF;
    if (was != SOLO_ONE) return;
    pool->st.solo_ends++;
    struct sref t = {.stream = pool->solo_stream, .ev = NO_EV};
    for (int a = 0; a < NAREAS; a++)
        for (struct region *r = pool->areas[a]; r; r = r->next) {
            for (struct blk *b = r->first; b; b = b->next) {
                if (b->qlo >= b->qhi) continue;
                t.lo = b->qlo;
                t.hi = b->qhi;
                t.seq = b->qseq;
                uint64_t gen = b->qgen;
                b->qlo = b->qhi = 0;
                b->qseq = b->qgen = 0;
                if (b->state != B_FREE && b->state != B_PENDING) continue;
                sref_add(pool, b, &t);
                if (gen > b->free_gen) b->free_gen = gen;
            }
        }
}

/* A stream not seen before: the first one starts the one-stream regime, a second ends it. */
static void solo_see(struct msh_pool *pool, uint64_t stream)
{
    if (pool->solo == SOLO_NONE) {
        pool->solo = SOLO_ONE;
        pool->solo_stream = stream;
    } else if (pool->solo == SOLO_ONE && stream != pool->solo_stream) {
        solo_end(pool);
    }
}

/* The stream's entry, made when first seen. NULL when the table is full: tags naming such a
 * stream are never known complete before a synchronize (correct, only slower). */
struct kstream *ks_get_slow(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = ks_find(pool, stream);
    if (k || stream == MSH_STREAM_COMPLETED) return k;
    if (MSH_UNLIKELY(pool->solo)) solo_see(pool, stream);
    for (uint32_t i = 0; i < MAX_KSTREAMS; i++)
        if (!pool->ks[i].used) {
            pool->ks[i] = (struct kstream){.stream = stream, .latest = NO_EV, .used = 1};
            pool->ks_last = i;
            pool->ks_idx[ks_slot_of(stream)] = (uint8_t)(i + 1);
            return &pool->ks[i];
        }
    return NULL;
}

/* An event seen complete: the work queued on its stream before it is done, which covers every
 * tag of that stream numbered before the record. */
void ev_done(struct msh_pool *pool, uint32_t e)
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
void ks_resolve_homes(struct msh_pool *pool, const uint64_t *streams, int n)
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
    msh_unlock(&pool->lock);
    for (int i = 0; i < nw; i++)
        if (pool->dev->ops->stream_home(pool->dev, want[i], &home[i])) home[i] = 0;
    msh_lock(&pool->lock);
    pool->jobs--;
    for (int i = 0; i < nw; i++) {
        struct kstream *k = ks_find(pool, want[i]);
        if (k && !k->home_known) {
            k->home = home[i];
            k->home_known = 1;
        }
    }
}

uint64_t ks_home(struct msh_pool *pool, uint64_t stream)
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
bool blk_clean(struct msh_pool *pool, const struct blk *b)
{
    if (!b->ns && !b->sync_needed) return true;
    if (b->free_gen && b->free_gen <= pool->synced_gen) return true;
    if (b->sync_needed) return false;
    for (int i = 0; i < b->ns; i++)
        if (!tag_done(pool, &b->s[i])) return false;
    return true;
}

void sref_put_events(struct msh_pool *pool, struct blk *b)
{
    for (int i = 0; i < b->ns; i++) ev_put(pool, b->s[i].ev);
}

static inline bool range_meets(uint64_t alo, uint64_t ahi, uint64_t blo, uint64_t bhi)
{
    return alo < bhi && blo < ahi;
}

/* Drop the tags known complete (their event references too). */
static void sref_prune(struct msh_pool *pool, struct blk *b)
{
    if (blk_untagged(b)) return;
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
    if (blk_untagged(b)) b->free_gen = 0;
}

/* Add a tag to b, taking over the reference on its event. One tag per stream: the bytes of both,
 * the later free's number, and an event only if it was recorded after both (an earlier event does
 * not cover the later work). A fifth stream makes the extent need a synchronize before reuse
 * elsewhere (over the tag's bytes). */
void sref_add(struct msh_pool *pool, struct blk *b, const struct sref *n)
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
void streams_merge_tags(struct msh_pool *pool, struct blk *into, struct blk *from)
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
    if (blk_untagged(into)) into->free_gen = 0;
}

/* Copy of b's tags onto a piece split from it (one more reference on each event). */
void streams_copy_tags(struct msh_pool *pool, struct blk *to, const struct blk *from)
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
void streams_clip_tags(struct msh_pool *pool, struct blk *b)
{
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
    if (blk_untagged(b)) b->free_gen = 0;
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
int fit_kind(struct msh_pool *pool, const struct blk *b, uint64_t lo, uint64_t hi, uint64_t stream,
                    uint64_t *blocked)
{
    if (blk_untagged(b) || (b->free_gen && b->free_gen <= pool->synced_gen)) return FIT_READY;
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
bool blocking_span(struct msh_pool *pool, const struct blk *b, uint64_t stream, uint64_t *lo, uint64_t *hi)
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
void want_events(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = ks_find(pool, stream);
    if (!k) return;
    if (!k->window) k->window = DEMAND_FREES;
    if (!k->demand && k->ran_out && k->frees - k->ran_out < k->window && k->window < DEMAND_MAX) k->window *= 2;
    k->demand = k->window;
    pool->front.hand_off = true; /* its binned blocks go to the VA line, with an event (pool.c) */
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
void streams_plan_tags(struct msh_pool *pool, struct blk *b, uint64_t stream, struct job *j)
{
    if (blk_clean(pool, b)) return;
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
