/*
 * step.c: the learned step (docs/pool.md "Steady state at tight capacity: the learned step").
 *
 * Owns the step log (every allocation and free, a ring), the live-set hash that finds a repeating
 * step, the plan in force (where each allocation of the step goes), when a plan is followed,
 * restarted, dropped, kept or resumed, and the planner thread that packs a step found (pack.c)
 * and installs the plan.
 *
 * Must never change where a block goes except through the plan it installed (a planned range
 * that is not free drops the plan; placement is extents.c's best fit again), never pack with the
 * pool lock held, and never let a plan need more pages than the limit allows.
 */
#include "internal.h"

/* The live sets seen, by hash, one slot each (direct-mapped: the newest state wins a slot). A step
 * is found only if the anchor of its first boundary survives the step's allocations, each of
 * which writes one slot: with A allocations per step, about exp(-A / STEP_ANCHORS) of steps are
 * found. At 2^14 slots a 6 800-allocation step was found about two times in three, and which ones
 * depended on addresses (held-out-like ctx512 fullstep with varying sizes: learned at one
 * capacity, never at the next page up); at 2^17 (4 MiB of host memory per pool) 95%. */
#define STEP_ANCHORS (1u << 17)
#define STEP_MIN_ALLOCS 16      /* shorter repeats are loops the cache already serves */

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

void step_create(struct msh_pool *pool)
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
    msh_cond_init(&s->wake);
    pool->step = s;
}

/* Stop the planner (it ends the packing under way first) and wait for it. Without the lock. */
void step_stop(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (!s) return;
    msh_lock(&pool->lock);
    s->stop = true;
    msh_cond_broadcast(&s->wake);
    bool on = s->worker_on;
    s->worker_on = false;
    msh_unlock(&pool->lock);
    if (on) pthread_join(s->worker, NULL);
}

void step_destroy(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (!s) return;
    raw_free(s->log, (size_t)STEP_LOG * sizeof *s->log);
    raw_free(s->anchors, (size_t)STEP_ANCHORS * sizeof *s->anchors);
    raw_free(s->plan, s->capplan * sizeof *s->plan);
    raw_free(s->fp, s->capfp * sizeof *s->fp);
    snap_free(s->snap);
    pin_free(s->res);
    raw_free(s, sizeof *s);
    pool->step = NULL;
}

/* Sizes that vary from step to step (a sequence length per batch): a step is the same step when
 * each allocation is within 1/8 of the size it had, and a plan places a block in its planned range
 * when it is no larger than the planned size (a block smaller than planned leaves the rest of its
 * range free; a larger one leaves the plan, and the step may be learned again with its sizes). */
static inline bool size_near(uint64_t a, uint64_t b)
{
    return a <= b + b / 8 && b <= a + a / 8;
}
static inline bool size_fits(uint64_t planned, uint64_t rsize)
{
    return rsize <= planned && size_near(planned, rsize);
}

/* The failure of a step of about this length (within 1/64) at this budget, if one is kept. */
static struct step_fail *step_failure(struct step *s, uint64_t len, size_t budget)
{
    for (int i = 0; i < STEP_FAILS; i++) {
        struct step_fail *f = &s->fail[i];
        uint64_t d = len > f->len ? len - f->len : f->len - len;
        if (f->n && d <= f->len / 64 && budget == f->budget) return f;
    }
    return NULL;
}

/* ... and its back-off has not run out: not worth a packing yet. */
static bool step_failed_before(struct step *s, uint64_t len, size_t budget)
{
    const struct step_fail *f = step_failure(s, len, budget);
    return f && s->n < f->until;
}

/* why: what the request did that the plan did not foresee (the debug log says it); keep: the plan
 * may be resumed */
bool step_want(const struct step *s, uint64_t addr)
{
    return s->want && s->want_addr == addr;
}
void step_drop(struct msh_pool *pool, const char *why, uint64_t rsize, bool keep)
{
    struct step *s = pool->step;
    if (s->active) pool->st.plan_dropped++;
    if (s->active)
        msh_debug("pool: learned step dropped at event %llu (allocation %zu of %zu): %s (%llu bytes, planned %llu)",
                  (unsigned long long)s->n, s->cursor, s->nplan, why, (unsigned long long)rsize,
                  (unsigned long long)(s->cursor < s->nplan ? s->plan[s->cursor].size : s->plan[0].size));
    /* a plan given up is kept, and resumed when its start comes back (step_before_alloc), unless
     * the stream proved its lifetimes wrong: resumed, a plan whose planned range was still in use
     * places its first blocks where they get in the way again, and best fit does worse after it
     * (SYNTHETIC 4-stream offload seed 6, frees that vary per step: minimum capacity 1344 pages
     * resumed, 1339 not) */
    if (s->active) s->dropped_at = s->cursor == s->nplan ? s->n : 0;
    s->resumable = (s->active && keep) || s->resumable;
    s->active = false;
    s->want = false;
    s->quiet_until = 0; /* the stream left the plan: what repeats now may be learned at once */
}

void step_turn_on(struct msh_pool *pool)
{
    struct step *s = pool->step;
    s->hstate = 0; /* the live set now: every block in the hash, binned ones included */
    for (size_t i = 0; i < pool->hcap; i++)
        for (struct blk *b = pool->htab[i]; b; b = b->hnext) s->hstate ^= blk_hash(b->addr, b->size);
    s->valid_from = s->n;
    s->on = true;
}

void step_note_alloc(struct msh_pool *pool, struct blk *b)
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

void step_note_free(struct msh_pool *pool, struct blk *b)
{
    struct step *s = pool->step;
    s->log[s->n % STEP_LOG] = (struct slog){.addr = b->addr, .size = b->size, .ref = b->serial, .op = 1};
    s->n++;
    s->hstate ^= blk_hash(b->addr, b->size);
}

/* The plan's address for this allocation, when a plan is active and it matches. */
struct blk *plan_place(struct msh_pool *pool, uint64_t rsize)
{
    struct step *s = pool->step;
    if (!s->want) return NULL;
    /* the plan's area: a plan packed across areas may put a block in the other area's pages */
    struct blk *b = atreap_floor(pool->atree[s->want_area], s->want_addr);
    if (!b || b->addr + b->size < s->want_addr + rsize) {
        step_drop(pool, "its planned range is not free", rsize, false); /* the step changed */
        return NULL;
    }
    struct blk *c = carve_at(pool, b, s->want_addr, rsize);
    if (!c) step_drop(pool, "out of memory for the pool's own structures", rsize, true);
    return c;
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
        if (sn->mapped_only && plan_ways[w].holes < 2) return NULL; /* not a failure: tried in full later */
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
    msh_unlock(&pool->lock);
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
    msh_lock(&pool->lock);
    s->snap = NULL;
    pool->st.plan_pack_ns += t;
    s->job = PJ_IDLE;
    if (in && !s->stop) {
        s->res = in;
        s->res_pages = pages;
        s->res_h0 = h0;
        s->res_first = first;
        s->res_until = s->n + 2 * (t1 - t0);
        s->res_events = t1 - t0;
        s->job = PJ_DONE;
    } else {
        pin_free(in);
    }
    if (failed) { /* the same step at the same budget will not pack next time either */
        pool->st.plan_failed++;
        /* the quiet period kept other steps from being tried meanwhile: the back-off below now
         * keeps this one from being tried again, so the others may be */
        if (s->quiet_until == t1 + (t1 - t0)) s->quiet_until = 0;
        /* the same step failing again at the same budget doubles the wait (its back-off ran out:
         * that is why it was tried); another step or another budget starts from 64 lengths, in a
         * free entry or in place of the one whose wait ends first */
        struct step_fail *f = step_failure(s, t1 - t0, capn);
        if (!f) {
            f = &s->fail[0];
            for (int i = 0; i < STEP_FAILS && f->n; i++)
                if (!s->fail[i].n || s->fail[i].until < f->until) f = &s->fail[i];
            *f = (struct step_fail){.budget = capn};
        }
        f->len = t1 - t0;
        f->until = t1 + ((t1 - t0) << (6 + (f->n < 4 ? f->n : 4)));
        f->n++;
    }
}

static void *planner_main(void *arg)
{
    struct msh_pool *pool = arg;
    struct step *s = pool->step;
    msh_lock(&pool->lock);
    for (;;) {
        while (!s->stop && s->job != PJ_QUEUED) msh_cond_wait(&s->wake, &pool->lock);
        if (s->stop) break;
        planner_run(pool);
    }
    msh_unlock(&pool->lock);
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
    msh_unlock(&pool->lock);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the job's signals are never delivered to the planner */
    int rc = pthread_create(&s->worker, NULL, planner_main, pool);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    msh_lock(&pool->lock);
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
    if (s->active || s->job != PJ_DONE || s->hstate != s->res_h0 || !size_near(s->res_first, rsize)) return;
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
    s->plan_h = s->res_h0;
    s->cursor = 0;
    s->active = true;
    s->resumable = false;
    s->plan_pages = s->res_pages;
    s->plan_events = s->res_events;
    pool->st.plans_built++;
    msh_debug("pool: learned step of %zu allocations in use from event %llu", s->nplan, (unsigned long long)s->n);
    plan_mark(pool, in, s->res_pages);
    pin_free(in);
}

/* Before an allocation of rsize bytes: follow the plan, switch to one the planner has packed, or
 * hand the planner a step to pack. Called with the lock held; packs only with plan_sync
 * (deterministic replays) or when the planner thread cannot start. */
void step_before_alloc(struct msh_pool *pool, uint64_t rsize)
{
    struct step *s = pool->step;
    s->want = false;
    /* the plan's start: the live set it starts from, and its first size */
    bool at_start = s->nplan && s->hstate == s->plan_h && size_near(s->plan[0].size, rsize);
    if (s->active && s->cursor == s->nplan) { /* the step is over: does the next one begin? */
        if (at_start) {
            s->cursor = 0;
            spill_note_step(pool); /* the steps before left what they hold: cold from now */
        }
        else step_drop(pool, s->hstate != s->plan_h ? "the step ended and the live set is not its start" : "the step ended and another size comes", rsize, true);
    } else if (s->active && s->cursor && at_start && !size_fits(s->plan[s->cursor].size, rsize)) {
        /* the step began again before its end (a step cut short: an evaluation that runs the
         * forward part of the step, a shorter last batch): from its start again */
        msh_debug("pool: learned step begins again at event %llu (after %zu of its %zu allocations)",
                  (unsigned long long)s->n, s->cursor, s->nplan);
        s->cursor = 0;
    }
    if (s->job == PJ_DONE) plan_install(pool, rsize);
    if (!s->active && s->resumable && s->job == PJ_IDLE && at_start) {
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
    /* a window of L events between two equal live sets holds L / 2 allocations: a shorter one is
     * not worth a snapshot of the live set and the page tables */
    /* A plan given up at the end of its step (it had placed the whole step) has one step's length
     * to come back: meanwhile another is learned only if switching to it maps nothing (packed
     * into mapped pages). A pass of the replay that releases the live set, a warm-up or an
     * evaluation between its steps is otherwise learned with them as a longer step (the whole
     * pass), whose switch maps where the plan resumed would map nothing (SYNTHETIC offload seed 1:
     * 52 map+unmap in pass 2 at C+0.5%). A plan given up in mid-step has no such grace: it may be
     * a wrong period. */
    bool grace = s->resumable && s->dropped_at && s->n - s->dropped_at < s->plan_events;
    bool candidate = !s->active && s->job == PJ_IDLE && an->h == s->hstate && size_near(an->size, rsize) &&
                     an->serial >= s->valid_from && an->serial + 2 * STEP_MIN_ALLOCS <= s->n && s->n - an->serial <= STEP_LOG &&
                     pool->pressure_reclaims > an->reclaims &&
                     s->n >= s->quiet_until && !step_failed_before(s, s->n - an->serial, cap_pages(pool));
    uint64_t t0 = an->serial, t1 = s->n, h0 = s->hstate;
    *an = (struct anchor){.h = s->hstate, .serial = s->n, .reclaims = pool->pressure_reclaims, .size = rsize};
    if (candidate) {
        msh_debug("pool: a step of %llu events repeats at event %llu (the live set and the size of event %llu)",
                  (unsigned long long)(t1 - t0), (unsigned long long)t1, (unsigned long long)t0);
        /* Every allocation of a repeated step starts a window of the same length: try once per
         * step length, not at each of them. */
        s->quiet_until = t1 + (t1 - t0);
        size_t capn = cap_pages(pool);
        struct psnap *sn = snap_take(pool, t0, t1, h0, capn != SIZE_MAX ? capn : pool->held);
        if (sn) {
            sn->cap = capn;
            sn->mapped_only = grace;
            if (grace) s->quiet_until = s->dropped_at + s->plan_events; /* in full once the grace is over */
            s->snap = sn;
            s->job = PJ_QUEUED;
            /* plan_sync (a deterministic replay): packed here, at this boundary, as if the
             * planner had been instant; otherwise by the planner thread (or here when it cannot
             * start), and used from a later boundary */
            if (pool->prm.plan_sync || !planner_start(pool)) {
                if (s->job == PJ_QUEUED) planner_run(pool);
            } else {
                msh_cond_signal(&s->wake);
            }
            plan_install(pool, rsize); /* when it is ready already and this is still its boundary */
        }
    }
    if (s->active) {
        uint64_t ps = s->plan[s->cursor].size;
        if (!size_fits(ps, rsize)) {
            /* larger than planned but the same step: not resumed, so that this step, with its
             * sizes, is learned at its end */
            bool larger = rsize > ps && size_near(ps, rsize);
            step_drop(pool, larger ? "a larger size than planned" : "another size", rsize, !larger);
        } else {
            s->want = true;
            s->want_addr = s->plan[s->cursor].addr;
            s->want_area = s->plan[s->cursor].area;
        }
    }
}
