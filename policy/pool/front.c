/*
 * front.c: the pool's front end (issue 30, docs/pool.md "The front end").
 *
 * A training step allocates the same sizes on the same streams step after step: on the real
 * traces half to nearly all of the allocations (median 81%) reuse a size that was freed on their
 * own stream. A freed block that was used on its own stream only is kept whole in a bin keyed by
 * (stream, size) instead of going back to the VA line, and the next request of that size on that
 * stream gets it back: no search, no page work, no event (stream order covers a reuse on the same
 * stream, as in PyTorch's caching allocator). A binned block stays in the live hash in state
 * B_BINNED, so that a free tells a binned block from a live one (a double free is refused) and
 * its size and stream come from the block itself; its pages stay touched. It counts as reserved
 * and inactive, never as allocated: the statistics treat a put as a free and a hit as an
 * allocation.
 *
 * Nothing may be lost to the bins. They are drained (their blocks freed into the VA line as the
 * free they stood for) before any driver work a drain could spare (a create, map, reclaim or
 * synchronize for a request: pool.c try_alloc), as the first step of the OOM rescue, on
 * empty-cache and trim, when a stream's memory is wanted by another (it must be handed over with
 * events, which binning skips), when a stream is forgotten, before a learned plan places blocks
 * and under pressure at the cap (the front end steps aside for a quiet period), before the pool
 * is destroyed, and at step marks for bins that were not used since the last one. Their bytes
 * are bounded by a depth per bin and a share of the cap.
 *
 * Everything here runs under the pool lock; nothing here calls the driver (a drain frees through
 * pool.c, whose free may record an event without the lock).
 */
#include "internal.h"

/* Under a limit, whether the job has shown it leaves the limit room: FRONT_STEPS step marks since
 * the limit was set, the pool holding at most 31/32 of it at the peak of each. A limit near the
 * job's peak (where the learned step places every block, and bins would only be drained at each
 * request) never qualifies; a job that never marks steps stays on the pool's path under a limit. */
static bool limit_has_room(const struct front *f, size_t lim)
{
    return f->clean_steps >= FRONT_STEPS && f->peak_held <= lim - lim / 32;
}

/* The front end is on: enabled for this pool, no learned plan in the way, not out for churn, and
 * under a limit, room shown and no pressure seen at it (docs/pool.md "The front end"). */
bool front_on(struct msh_pool *pool)
{
    struct front *f = &pool->front;
    if (!f->enabled) return false;
    size_t lim = limit_now(pool);
    if (lim != f->lim_seen) { /* a new limit: what was seen at the old one says nothing */
        f->lim_seen = lim;
        f->aside = false;
        f->clean_steps = 0;
        f->peak_held = 0;
    }
    if (f->aside || pool->st.allocs < f->cool_until || (lim && !limit_has_room(f, lim))) return false;
    const struct step *s = pool->step;
    return !s || (!s->active && s->job == PJ_IDLE && !s->resumable);
}

void front_step(struct msh_pool *pool)
{
    struct front *f = &pool->front;
    size_t pk = __atomic_load_n(&pool->drv_peak_step, __ATOMIC_RELAXED); /* this step's reserved peak */
    if (pk > f->peak_held) f->peak_held = pk;
    f->clean_steps++;
    if (f->bins) front_drain(pool, FRONT_DRAIN_IDLE, 0);
    front_churn(pool, 0, true);
}

static inline uint32_t bin_hash(uint64_t stream, uint64_t rsize)
{
    uint64_t h = (stream ^ (stream >> 29)) * 0x9E3779B97F4A7C15ull ^ (rsize >> 9) * 0xC2B2AE3D27D4EB4Full;
    return (uint32_t)(h >> 40) & (FRONT_BINS - 1);
}

/* The bin of (stream, rsize), or NULL. Linear probing; slots are never emptied but by a
 * rebuild, so a search ends at the first slot never used. */
static struct bin *bin_find(struct front *f, uint64_t stream, uint64_t rsize)
{
    for (uint32_t i = bin_hash(stream, rsize), n = 0; n < FRONT_BINS; i = (i + 1) & (FRONT_BINS - 1), n++) {
        struct bin *bn = &f->bins[i];
        if (!bn->rsize) return NULL;
        if (bn->rsize == rsize && bn->stream == stream) return bn;
    }
    return NULL;
}

/* The bin of (stream, rsize), made when missing while the table is at most 3/4 full. */
static struct bin *bin_get(struct msh_pool *pool, uint64_t stream, uint64_t rsize)
{
    struct front *f = &pool->front;
    if (!f->bins) {
        f->bins = raw_alloc(FRONT_BINS * sizeof *f->bins);
        if (!f->bins) {
            f->enabled = false; /* no memory for the table: the pool works without it */
            return NULL;
        }
    }
    uint32_t i = bin_hash(stream, rsize);
    for (uint32_t n = 0; n < FRONT_BINS; i = (i + 1) & (FRONT_BINS - 1), n++) {
        struct bin *bn = &f->bins[i];
        if (bn->rsize == rsize && bn->stream == stream) return bn;
        if (!bn->rsize) break;
    }
    if (f->slots >= FRONT_BINS / 4 * 3) { /* too many sizes: the stale ones go at the next miss */
        f->evict = true;
        return NULL;
    }
    struct kstream *k = ks_find(pool, stream);
    if (!k) return NULL; /* a stream the pool cannot track gets no bin (its events could not be asked) */
    f->slots++;
    f->bins[i] = (struct bin){.stream = stream, .rsize = rsize, .ks = k};
    return &f->bins[i];
}

struct blk *front_take(struct msh_pool *pool, uint64_t stream, uint64_t rsize)
{
    struct front *f = &pool->front;
    struct bin *bn = bin_find(f, stream, rsize);
    if (!bn || !bn->head) return NULL;
    struct blk *b = bn->head;
    bn->head = b->bnext;
    bn->depth--;
    bn->last = ++f->tick;
    b->bnext = NULL;
    b->state = B_LIVE;
    f->blocks--;
    f->bytes -= b->size;
    return b;
}

bool front_put(struct msh_pool *pool, struct blk *b, uint64_t stream)
{
    struct front *f = &pool->front;
    /* Only a block whose every use was on the stream it is freed on: its reuse there needs no
     * event. record_stream's blocks (ns > 1), blocks whose streams were forgotten or overflowed
     * (sync_needed), host-synchronous frees (MSH_STREAM_COMPLETED: segment mode's cudaFree gives
     * memory back) and any block while spilled pages exist go the general way. */
    if (!f->serving || stream == MSH_STREAM_COMPLETED || b->ns != 1 || b->s[0].stream != stream || b->sync_needed ||
        pool->spill_pages || f->bytes + b->size > f->max_bytes)
        return false;
    struct bin *bn = bin_get(pool, stream, b->size);
    /* a stream another one waits for records an event at each free (want_events): not binned */
    if (!bn || bn->depth >= FRONT_DEPTH || bn->ks->demand) return false;
    b->state = B_BINNED;
    b->bnext = bn->head;
    bn->head = b;
    bn->depth++;
    bn->last = ++f->tick;
    f->blocks++;
    f->bytes += b->size;
    if (f->bytes > pool->st.peak_binned_bytes) pool->st.peak_binned_bytes = f->bytes;
    return true;
}

/* Take blocks out of bin bn onto *list (bnext), keeping `keep` of them. */
static void bin_take(struct front *f, struct bin *bn, uint32_t keep, struct blk **list, size_t *n)
{
    while (bn->depth > keep) {
        struct blk *b = bn->head;
        bn->head = b->bnext;
        bn->depth--;
        f->blocks--;
        f->bytes -= b->size;
        b->bnext = *list;
        *list = b;
        (*n)++;
    }
}

/* Empty slots that no search needs any more: the table again with only the bins that hold
 * blocks (after a full drain, none: the table starts over). */
static void bins_rebuild(struct front *f)
{
    struct bin keep[FRONT_BINS / 4 * 3];
    uint32_t n = 0;
    for (uint32_t i = 0; i < FRONT_BINS && n < sizeof keep / sizeof *keep; i++)
        if (f->bins[i].rsize && f->bins[i].head) keep[n++] = f->bins[i];
    memset(f->bins, 0, FRONT_BINS * sizeof *f->bins);
    f->slots = n;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = bin_hash(keep[k].stream, keep[k].rsize);
        while (f->bins[i].rsize) i = (i + 1) & (FRONT_BINS - 1);
        f->bins[i] = keep[k];
    }
}

size_t front_drain(struct msh_pool *pool, int what, uint64_t stream)
{
    struct front *f = &pool->front;
    if (!f->bins) return 0;
    struct blk *list = NULL;
    size_t n = 0;
    /* A step mark trims the bins a stream did not use over the last two steps, on the streams
     * that ran in the last (one of their bins used since the mark before): a stream whose thread
     * was off the CPU meanwhile (a job's optimizer marks steps on one thread; another feeds its
     * own stream) tells nothing about its sizes, and its blocks stay; two steps, because such a
     * thread's own steps need not match the marks (at half their pace, a size it uses every step
     * of its own is unused over one of them; 4 threads on 4 streams on 2 CPUs drained and missed
     * that way, tests/bench/bench_front.c). */
    if (what == FRONT_DRAIN_IDLE)
        for (uint32_t i = 0; i < FRONT_BINS; i++)
            if (f->bins[i].rsize && f->bins[i].last > f->mark) f->bins[i].ks->front_seen = f->tick;
    for (uint32_t i = 0; i < FRONT_BINS; i++) {
        struct bin *bn = &f->bins[i];
        if (!bn->rsize) continue;
        if (what == FRONT_DRAIN_ALL || what == FRONT_DRAIN_GONE ||
            (what == FRONT_DRAIN_STREAM && bn->stream == stream) ||
            (what == FRONT_DRAIN_DEMAND && bn->ks->demand))
            bin_take(f, bn, 0, &list, &n);
        else if (what == FRONT_DRAIN_IDLE && bn->last <= f->mark_prev && bn->ks->front_seen == f->tick &&
                 f->tick > f->mark) /* not used since the mark before last: most goes */
            bin_take(f, bn, bn->depth / 4, &list, &n);
        else if (what == FRONT_DRAIN_STALE && bn->last + FRONT_BINS / 2 <= f->tick) /* not used lately */
            bin_take(f, bn, 0, &list, &n);
    }
    if (what == FRONT_DRAIN_IDLE) {
        f->mark_prev = f->mark;
        f->mark = f->tick;
    }
    if (what == FRONT_DRAIN_STALE) f->evict = false;
    /* A forgotten stream's bins must go too (its handle may come back for a new stream); empty
     * bins stay otherwise (the next put of their size finds them), until the table fills. */
    if (what == FRONT_DRAIN_STREAM || what == FRONT_DRAIN_STALE || (what == FRONT_DRAIN_ALL && f->slots >= FRONT_BINS / 2) ||
        (what == FRONT_DRAIN_IDLE && f->slots >= FRONT_BINS / 2))
        bins_rebuild(f);
    if (!n) return 0;
    pool->st.front_drains++;
    pool->st.front_drained += n;
    /* blocks a step left unused, and the stale ones a full table evicts, count against the bins
     * as blocks drained for other sizes do: sizes that do not come back (a varying sequence
     * length, random sizes) are churn too (front_churn) */
    if (what == FRONT_DRAIN_IDLE || what == FRONT_DRAIN_STALE) {
        f->win_drained += n;
        f->step_trimmed += n;
    }
    size_t bytes = 0;
    /* The blocks are in no bin now; each is freed as the free it stood for, with one event per
     * stream (free_binned may drop the lock to record it: these blocks are in no structure
     * another thread walks). */
    struct sref tags[8];
    int ntags = 0;
    /* A drain records one event per stream whenever the pool knows another stream, a step's
     * trim of unused bins included (one record per stream and step at most). Freed plainly
     * instead, the blocks a step trims are memory the other streams can have only after they ask
     * for events (want_events), and their asking stops that stream's bins: four threads on four
     * streams paid 300,000 driver calls over 1,000 steps that way (tests/bench/bench_front.c,
     * hit side none 4). With one stream known, an event has no one to order: a trim, a stale
     * bin's or a forgotten stream's drain frees plainly, as the frees they stood for did (a
     * stream that comes later asks for events the usual way). */
    uint32_t nks = 0;
    for (uint32_t i = 0; i < MAX_KSTREAMS && nks < 2; i++) nks += pool->ks[i].used;
    bool handing = what != FRONT_DRAIN_GONE && (what == FRONT_DRAIN_ALL || what == FRONT_DRAIN_DEMAND || nks > 1);
    /* a full drain for a request: the requester's own stream takes its blocks back in stream
     * order, no event needed (seq 1, no event: free_binned's plain free) */
    if (what == FRONT_DRAIN_ALL && stream != MSH_STREAM_COMPLETED)
        tags[ntags++] = (struct sref){.stream = stream, .seq = 1, .ev = NO_EV};
    while (list) {
        struct blk *b = list;
        list = b->bnext;
        b->bnext = NULL;
        bytes += b->size;
        struct sref *t = NULL;
        for (int i = 0; i < ntags && !t && handing; i++)
            if (tags[i].stream == b->s[0].stream) t = &tags[i];
        if (!t && ntags < 8 && handing) {
            t = &tags[ntags++];
            *t = (struct sref){.stream = b->s[0].stream, .ev = NO_EV};
        }
        free_binned(pool, b, t);
    }
    for (int i = 0; i < ntags; i++) free_binned_done(pool, &tags[i]);
    return bytes;
}

bool front_drain_fit(struct msh_pool *pool, uint64_t stream, uint64_t rsize)
{
    struct front *f = &pool->front;
    if (!f->bins || !f->blocks) return false;
    int area = area_of(pool, rsize);
    struct bin *best = NULL;
    for (uint32_t i = 0; i < FRONT_BINS; i++) {
        struct bin *bn = &f->bins[i];
        if (!bn->head || bn->stream != stream || bn->rsize < rsize || area_of(pool, bn->rsize) != area) continue;
        if (!best || bn->rsize < best->rsize || (bn->rsize == best->rsize && bn->last < best->last)) best = bn;
    }
    if (!best) return false;
    struct blk *list = NULL;
    size_t n = 0;
    bin_take(f, best, best->depth - 1, &list, &n);
    pool->st.front_drains++;
    pool->st.front_drained += n;
    list->bnext = NULL;
    free_binned(pool, list, NULL); /* its own stream asks: no event needed */
    return true;
}

static void front_cool(struct msh_pool *pool)
{
    struct front *f = &pool->front;
    f->cool_until = pool->st.allocs + FRONT_COOL;
    f->serving = false;
    pool->st.front_cooled++;
    if (f->blocks) front_drain(pool, FRONT_DRAIN_ALL, MSH_STREAM_COMPLETED);
}

void front_churn(struct msh_pool *pool, size_t drained, bool at_step)
{
    struct front *f = &pool->front;
    f->win_drained += drained;
    /* At a step mark (of 32 puts or more since the last): more blocks of sizes that did not come
     * back (trimmed at the mark, evicted stale) than hits over the step, and under half the
     * step's puts hit. A job whose sizes vary step to step (sequence lengths) is out by its third
     * step; judged only over longer windows, the bins it kept meanwhile shaped the pool's layout,
     * and the demo (make demo) held 1.112x its live peak against 1.017x without them (its steps:
     * 29% hits). Drains for a request (growth, a reclaim) are not in this count: four threads on
     * four streams warming up drain for growth more than they hit at first, and hit every size
     * after; nor is a step whose puts mostly hit (there, the marking thread's step is short next
     * to the others' time slices, and the trim takes their bins: 96% hits, 118-207 trimmed). */
    if (at_step) {
        uint64_t sputs = pool->st.front_puts - f->step_puts, shits = pool->st.front_hits - f->step_hits;
        if (sputs >= 32) {
            if (f->step_trimmed > shits && shits * 2 < sputs) front_cool(pool);
            f->step_puts = pool->st.front_puts;
            f->step_hits = pool->st.front_hits;
            f->step_trimmed = 0;
        }
    }
    /* Windows of FRONT_WINDOW puts: more of what it kept went back than served its own (the
     * trims, and drains for a reclaim, a synchronize or a failing request: what the bins cost the
     * job), and it served under a quarter of what it was given. Drains instead of growth only
     * hand the pool its own pages back: a growing first step drains its temporaries for the next
     * activation's pages more often than they come back, yet they do come back, and four threads
     * warming up on four streams drain for each other's growth; counted, the front end went out
     * for 32768 allocations, past the whole run on 4 of the 16 replays (0% of the allocations of
     * passes 2-3 served; now 50-100%, median 92%), and 1 warm-up in 4 of the 4-thread bench. */
    uint64_t puts = pool->st.front_puts - f->win_puts;
    if (puts < FRONT_WINDOW) return;
    uint64_t hits = pool->st.front_hits - f->win_hits;
    if (f->win_drained > hits && hits * 4 < puts && f->serving) front_cool(pool);
    f->win_puts = pool->st.front_puts;
    f->win_hits = pool->st.front_hits;
    f->win_drained = 0;
}

void front_aside(struct msh_pool *pool)
{
    pool->front.aside = true;
    pool->front.serving = false;
    pool->front.lim_seen = limit_now(pool);
    if (pool->front.blocks) front_drain(pool, FRONT_DRAIN_ALL, MSH_STREAM_COMPLETED);
}

int front_state(struct msh_pool *pool)
{
    struct front *f = &pool->front;
    if (!f->enabled) return MSH_FRONT_OFF;
    if (front_on(pool)) return MSH_FRONT_ON;
    if (f->aside) return MSH_FRONT_ASIDE;
    if (pool->st.allocs < f->cool_until) return MSH_FRONT_CHURN;
    if (f->lim_seen && !limit_has_room(f, f->lim_seen)) return MSH_FRONT_WAITING;
    return MSH_FRONT_ASIDE; /* a learned plan in use or being packed: the same regime */
}

const char *msh_front_state_name(int state)
{
    static const char *const names[] = {"on", "off", "waiting", "aside", "churn"};
    return state >= 0 && state <= MSH_FRONT_CHURN ? names[state] : "unknown";
}

void front_init(struct msh_pool *pool)
{
    struct front *f = &pool->front;
    f->enabled = pool->prm.front;
    f->lim_seen = limit_now(pool);
    /* Binned blocks sit on pages the pool holds already: they never make it reserve more (a
     * request that needs memory drains them first, and at pressure the front end steps aside).
     * With no limit they are bounded to a quarter of the device, what another process sees taken
     * beyond the live set at most; under a limit by the limit (a training step frees most of what
     * it allocated before the next one allocates it again: the bins hold up to its live peak). */
    f->max_bytes = limit_now(pool) ? limit_now(pool) : pool->device_total ? pool->device_total / 4 : SIZE_MAX;
}

void front_destroy(struct msh_pool *pool)
{
    raw_free(pool->front.bins, FRONT_BINS * sizeof *pool->front.bins);
    pool->front.bins = NULL;
}

int front_check(struct msh_pool *pool, size_t nbinned, size_t binned_bytes, char *why, size_t whylen)
{
    const struct front *f = &pool->front;
    size_t n = 0, bytes = 0, slots = 0;
    for (uint32_t i = 0; f->bins && i < FRONT_BINS; i++) {
        const struct bin *bn = &f->bins[i];
        if (!bn->rsize) continue;
        slots++;
        uint32_t depth = 0;
        for (const struct blk *b = bn->head; b; b = b->bnext) {
            if (b->state != B_BINNED || b->size != bn->rsize || b->ns != 1 || b->s[0].stream != bn->stream) {
                snprintf(why, whylen, "bin (stream %#llx, %llu bytes) holds block %#llx in state %u of %llu bytes on stream %#llx",
                         (unsigned long long)bn->stream, (unsigned long long)bn->rsize, (unsigned long long)b->addr, b->state,
                         (unsigned long long)b->size, (unsigned long long)(b->ns ? b->s[0].stream : 0));
                return EFAULT;
            }
            if (++depth > FRONT_DEPTH) {
                snprintf(why, whylen, "bin (stream %#llx, %llu bytes) holds more than %d blocks (a cycle?)",
                         (unsigned long long)bn->stream, (unsigned long long)bn->rsize, FRONT_DEPTH);
                return EFAULT;
            }
            bytes += b->size;
        }
        if (depth != bn->depth) {
            snprintf(why, whylen, "bin (stream %#llx, %llu bytes): %u blocks, its count says %u", (unsigned long long)bn->stream,
                     (unsigned long long)bn->rsize, depth, bn->depth);
            return EFAULT;
        }
        n += depth;
    }
    if (slots != f->slots || n != f->blocks || bytes != f->bytes || n != nbinned || bytes != binned_bytes) {
        snprintf(why, whylen,
                 "front end: %zu slots (count %u), %zu blocks of %zu bytes in the bins (counts %zu, %zu), %zu of %zu bytes in the regions",
                 slots, f->slots, n, bytes, f->blocks, f->bytes, nbinned, binned_bytes);
        return EFAULT;
    }
    return 0;
}
