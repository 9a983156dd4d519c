/*
 * internal.h: what the pool's files share (policy/pool/, docs/pool.md "Where the code is"), and
 * nothing its callers see: they include pool.h, whose API this folder implements.
 *
 * Owns the pool's data structures (blocks, pages and handles, regions, pooled events, known
 * streams, struct msh_pool itself), the constants they are sized by, the small inline helpers
 * every file uses, and the declarations each file offers the others (grouped by file, below).
 * Must never be included from outside policy/pool/: a caller that needs a field asks pool.h for
 * it, so that the structures can change without touching shim/, hooks/ or report/.
 */

#ifndef MSH_POOL_INTERNAL_H
#define MSH_POOL_INTERNAL_H

#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "hotclock.h" /* msh_lat_sample: which calls are timed */
#include "lock.h"     /* the pool's lock and conditions */
#include "msh.h"

#define BLOCK_ALIGN 512 /* what PyTorch promises its callers */
#define MAX_SIZE ((uint64_t)1 << 48)
#define NO_PAGE UINT32_MAX
#define NO_EV UINT32_MAX
#define MAX_STREAMS 4
/* Pages per region: its page table (40 bytes a page, touched lazily) stays under 160 MiB of
 * address space and page indices fit 32 bits. 8 TiB of VA per region at 2 MiB pages. */
#define MAX_REGION_PAGES ((uint64_t)1 << 22)
#define NAREAS 2 /* 0: small requests, 1: large */

struct region;

/* B_PARKED: freed during a CUDA-graph capture while its free needs events (recorded once the
 * capture ends, docs/pool.md "Captures"); in no structure, its pages still touched.
 * B_BINNED: freed into the front end's bin of its stream and size (front.c): still in the live
 * hash, its pages still touched, counted as reserved and inactive. */
enum { B_FREE = 1, B_LIVE, B_PENDING, B_FREEING, B_PARKED, B_BINNED };
enum { SOLO_OFF, SOLO_NONE, SOLO_ONE };

/* claim_pages: the request needs a synchronize, an unmap or a release, which a capture in
 * progress on the device forbids; the caller places it where none is needed, or fails. */
#define ECAPTURE ECANCELED
/* claim_pages: the block would touch a page of host memory (spill.c); the caller places it on
 * fresh memory instead: a new block never lands on spilled pages, which only cold blocks hold */
#define EHOSTPAGE EREMOTE
/* job_run: the device has no room for the job's new handles (its free memory, asked once per
 * request, is less than the job would create after its releases): nothing was done, nothing is
 * asked of the driver; the caller decides what can still help (issue 25, pool.c "rescue"). */
#define ENOROOM EDQUOT
/* try_alloc: the request would need driver work (a create, map, reclaim or synchronize) while the
 * front end holds binned blocks that a drain may make unnecessary: nothing was done; the caller
 * drains and places the request again (front.c). */
#define EDRAIN EBADSLT
/* PG_MOVING: spill.c moves the handle between device and host memory (docs/pool.md "Spill"). */
enum { PG_MAPPED = 0, PG_MAPPING, PG_UNMAPPING, PG_MOVING };

/* A stream whose queued work may touch an extent: the pool's sequence number when that work was
 * last queued (the free), and the event recorded on the stream then (NO_EV: none; a reuse on the
 * same stream needs none, and a reuse elsewhere waits until some later event of that stream is
 * known complete). */
struct sref {
    uint64_t stream;
    uint64_t seq;
    uint64_t lo, hi; /* free extents: the bytes the tag is about (a merged extent holds clean
                      * bytes too, and the tags of each part) */
    uint32_t ev;
    uint32_t pad;
};

/* One extent of a region's VA line: live, free, or in a state between (pending: carved for an
 * allocation whose pages are being mapped; freeing: events being recorded for its free). Every
 * byte of a region belongs to exactly one block, kept in address order, so freeing coalesces
 * with neighbours in O(1). */
struct blk {
    uint64_t addr, size; /* size: VA bytes, a multiple of BLOCK_ALIGN */
    uint64_t req;        /* requested bytes while live */
    struct blk *prev, *next;
    struct region *reg;
    struct blk *kid[2][2]; /* the free treaps' children ([tree][0] left, [1] right): tree TS by
                            * (size, addr), TA by addr (the learned step places at given addresses) */
    struct blk *hnext;   /* live hash chain, or the spare list */
    struct blk *bnext;   /* binned: the next block of its bin */
    uint64_t free_gen;   /* pool->free_gen when freed on a stream (work may still be queued) */
    uint64_t serial;     /* live: the allocation's number in the step log */
    uint64_t fstream;    /* parked: the stream of its free */
    uint64_t slo, shi;   /* free, sync_needed: the bytes that need the synchronize */
    uint64_t qlo, qhi;   /* free or pending, the one-stream regime: the bytes its frees left
                          * without a tag (streams.c solo_end); empty when qlo >= qhi */
    uint64_t qseq, qgen; /* and the latest of those frees' numbers (pool->evseq) and generations
                          * (pool->free_gen): what their tags would have carried */
    uint32_t prio;
    uint8_t state, ns, sync_needed;
    uint8_t claimed;     /* pending: counted on its pages (a pending block waiting for another
                          * thread's pages has not claimed them yet) */
    uint32_t tag;        /* live: msh_pool_tags.next when it was placed (the caller's mark) */
    uint8_t counted;     /* live: counted in the callers' counters (msh_pool_alloc_counted) */
    uint64_t born;       /* live: pool->nborn when it was placed (spill.c: how cold it is) */
    /* last: read only below ns, so a new block clears the fields above only (extents.c blk_new) */
    struct sref s[MAX_STREAMS]; /* live: [0] alloc stream + recorded; free: last-use streams */
};

/* Clear the n bytes at p, n a constant multiple of 8: plain 16-byte stores. GCC makes a memset of
 * a block's or a job's head (136-192 bytes) a `rep stos`, whose start-up costs more than the
 * stores themselves, on every allocation. */
static inline __attribute__((always_inline)) void zero_head(void *p, size_t n)
{
    typedef uint64_t v2 __attribute__((vector_size(16), may_alias, aligned(8)));
    typedef uint64_t u1 __attribute__((may_alias));
    v2 *v = p;
#pragma GCC unroll 16
    for (size_t i = 0; i < n / 16; i++) v[i] = (v2){0, 0};
    if (n % 16) *(u1 *)((char *)p + n - 8) = 0;
}

/* One granularity-sized page of a region. A handle covers a run of pages; its first page (the
 * head) holds the handle's fields, the others point at it. */
struct page {
    uint64_t handle;       /* head: the driver's handle (0 while it is being created) */
    int32_t live;          /* live (or pending) blocks touching this page */
    uint32_t hd;           /* 1 + first page of the handle mapped here; 0: nothing mapped (so that
                            * a fresh, zero-filled page table needs no initialisation) */
    uint32_t npages;       /* head: pages the handle covers */
    uint32_t nlive;        /* head: its pages with live > 0 */
    uint32_t cprev, cnext; /* head: cached-handle list (mapped, nlive == 0), oldest first */
    uint32_t ctime;        /* head: when it became cached (ms since the pool was created) */
    uint8_t state;         /* head: PG_MAPPED, or a driver call in progress */
    uint8_t plan;          /* PLAN_PAGE: inside the learned step's footprint; PLAN_LIST (head):
                            * kept on the region's second cached list, reclaimed last */
    uint8_t host;          /* head: the handle is host memory (spilled, spill.c): counted in
                            * spill_pages, not in held; never on a cached list */
};
#define PLAN_PAGE 1
#define PLAN_LIST 2

/* The head page of the handle mapped at pg, or NO_PAGE (hd - 1 wraps to it). */
static inline uint32_t pg_head(const struct page *pg) { return pg->hd - 1u; }

struct region {
    uint64_t base, size;
    uint32_t npages, hi_page; /* hi_page: one past the highest page ever mapped */
    struct page *pages;
    uint32_t chead[2], ctail[2]; /* cached handles outside [0] and inside [1] the learned step */
    size_t ncached;              /* pages of cached handles */
    struct region *next;
    struct blk *first; /* the block at base: merging never removes it */
    int area;
};

/* A pooled event: created once, recorded at frees, shared by the extents split from one free. */
struct pev {
    uint64_t h;       /* device event; 0 until created */
    uint64_t stream;  /* where it was last recorded */
    uint64_t seq;     /* pool->evseq at that record: it covers the work queued there before it */
    uint64_t home;    /* the context it was created in (0: the device's own; a stream of another
                       * device needs an event of its own context, device.h stream_home) */
    uint32_t refs;    /* extents, known streams (their latest event) and in-flight waits holding it */
    uint32_t next;    /* free list */
    uint8_t state;    /* EV_IDLE, EV_RECORDED, EV_DONE (seen complete by a query) */
};
enum { EV_IDLE = 0, EV_RECORDED, EV_DONE };

/* A stream the pool has seen, what it knows of its completed work, and whether another stream
 * wants its memory: then, for a while (the stream's next `window` frees, counted again at each
 * such want; the window doubles when the wants come back soon after it ran out, as they do for
 * two streams that trade memory every step, and at DEMAND_MAX it no longer runs out: a gap of
 * frees without events is memory the other stream cannot have, which makes the pool grow), each
 * of its frees records an
 * event, so that the other stream can take that memory after a wait on exactly the work queued
 * before the free (or none, once a query finds it complete). A stream nobody else wants memory of
 * records nothing, as in PyTorch's allocator. */
#define DEMAND_FREES 256
#define DEMAND_MAX 4096
#define MAX_KSTREAMS 32
struct kstream {
    uint64_t stream;
    uint64_t done;        /* all work queued on it before pool->evseq reached `done` has completed */
    uint64_t home;        /* its context (stream_home), once known */
    uint32_t demand;      /* frees left that record their own event (another stream wants them) */
    uint32_t window;      /* what a want sets demand to (DEMAND_FREES .. DEMAND_MAX) */
    uint64_t frees, ran_out; /* its frees so far; their count when demand last reached 0 */
    uint32_t latest;      /* the latest event recorded on it (a reference), or NO_EV: a tag of it
                           * without an event, numbered before, may wait on this one */
    uint8_t used, home_known;
    uint64_t front_seen;  /* the front end's tick at the latest step mark that found one of its
                           * bins used since the mark before (front_drain, FRONT_DRAIN_IDLE) */
};

struct step;

/* ---- the front end (front.c): bins of freed blocks by (stream, size) ------------------------- */
#define FRONT_BINS 1024     /* slots of the bin table (a power of two; at most 3/4 used) */
#define FRONT_DEPTH 128     /* blocks one bin keeps */
#define FRONT_STEPS 2        /* under a limit: step marks with room before the front end serves */
#define FRONT_WINDOW 256     /* puts over which hits and drains are compared (churn) */
#define FRONT_COOL 32768     /* allocations the front end stays out after churn */
struct bin {
    uint64_t stream, rsize;   /* rsize 0: a slot never used */
    struct blk *head;         /* binned blocks, the latest first (bnext) */
    struct kstream *ks;       /* the stream's entry: while another stream wants its memory, its
                               * frees record events and are not binned */
    uint32_t depth;
    uint64_t last;            /* front.tick at its last hit or put */
};
struct front {
    struct bin *bins;         /* FRONT_BINS slots (raw memory, made at the first put) */
    uint32_t slots;           /* slots in use */
    size_t blocks, bytes;     /* binned now: blocks and their VA bytes */
    size_t max_bytes;         /* the most binned bytes (a share of the cap) */
    bool aside;               /* pressure at the limit: the front end stays aside while it holds */
    size_t lim_seen;          /* the limit (limit_now) the fields around are about */
    uint32_t clean_steps;     /* step marks seen under it */
    size_t peak_held;         /* the most the pool held at those steps (bytes the driver held) */
    uint64_t tick;            /* hits and puts so far: the bins' clock */
    size_t grown_aside;       /* pages the pool grew by for requests with blocks binned, no drain */
    /* Churn: the bins' blocks given back rather than reused (sizes that come once: a step's
     * trim, a full table's stale bins; a step that frees what the next different size needs:
     * drained for a reclaim or a synchronize, not for growth), judged at each step mark and over
     * windows of FRONT_WINDOW puts (front_churn); when they cost more than they serve the front
     * end stays out for FRONT_COOL allocations (the pool path alone, as before it) and then tries
     * again. */
    uint64_t win_puts, win_hits, win_drained;
    uint64_t step_puts, step_hits, step_trimmed; /* the same since the last step mark (trims only) */
    uint64_t cool_until;      /* st.allocs before which the front end stays out (churn) */
    uint64_t mark, mark_prev; /* tick at the last step mark and at the one before (bins not
                               * used since the one before give back) */
    bool evict;               /* the table is full: bins not used lately go at the next miss */
    bool enabled;             /* params.front */
    bool serving;             /* front_on(), as the last miss found it: what a put checks (the
                               * conditions change at misses, or stop it at once: front_aside,
                               * churn, a drain for a plan) */
    bool hand_off;            /* a stream's memory was wanted by another: drain its bins */
    uint64_t trim_act;        /* hits + puts at the trim thread's last look (msh_pool_trim) */
    uint32_t trim_ms;         /* when they last changed (ms since the pool was created) */
};
/* GONE: every bin, for a pool being destroyed (no event: nothing runs after) */
enum { FRONT_DRAIN_ALL = 0, FRONT_DRAIN_STREAM, FRONT_DRAIN_DEMAND, FRONT_DRAIN_IDLE, FRONT_DRAIN_STALE, FRONT_DRAIN_GONE };

struct msh_pool {
    struct msh_lock lock; /* base/lock.h: one compare-exchange when uncontended */
    struct msh_cond cv;   /* a mapping or unmapping another thread waits for was published */
    struct msh_device *dev;
    struct msh_pool_params prm;
    size_t gran, limit, device_total;
    size_t dev_top;       /* device_total rounded down to whole pages (limit_now) */
    unsigned gran_shift;  /* log2(gran) when gran is a power of two (pg_div), else 0 */
    uint32_t limit_pages, max_handle_pages, chunk_pages;
    struct region *areas[NAREAS];
    struct blk *tree[NAREAS], *atree[NAREAS];
    struct blk **htab;
    size_t hcap, hcount;
    struct blk *spare;
    size_t held;          /* pages of handles held, or being created (the budget against the limit) */
    /* pages taken off `held` by a job that releases their handles without the lock, until it
     * publishes: still on the device meanwhile, so no other claim may count them as room (the
     * device would hold more than the limit for a moment). Under the lock. */
    size_t releasing;
    /* Bytes the driver actually holds for this pool (created, not yet released; a handle whose
     * release failed stays counted) and their peaks: the reserved peaks of the reports follow the
     * driver, never a reservation whose create then failed. Atomics: the driver calls run
     * without the lock. */
    size_t drv_held, drv_peak_epoch, drv_peak_run;
    /* Creates begun and ended (dev_create): a create adds to drv_held before it raises the peaks,
     * so msh_pool_check compares peaks with drv_held only when none was halfway meanwhile. */
    uint64_t drv_creates_in, drv_creates_out;
    /* The reports' step and peak figures (msh_pool_take_step_peaks, note_alloc): the peaks since
     * the last step mark (drv_peak_step atomic, beside drv_peak_epoch; step_peak_live under the
     * lock), and the reserved and live bytes at the first allocation that saw the epoch's highest
     * reserved figure (under the lock). */
    size_t drv_peak_step, step_peak_live;
    size_t at_peak_held, at_peak_live;
    size_t nhandles, touched, cached;
    int jobs;             /* requests doing driver work right now (without the lock) */
    int waiters;
    uint64_t free_gen, synced_gen; /* frees with queued work; all of those up to synced_gen are done */
    bool driver_oom;      /* the driver itself refused a create since the last empty-cache */
    uint64_t pressure_reclaims; /* cached handles taken back because the pool was at its cap */
    struct kstream ks[MAX_KSTREAMS];
    uint32_t ks_last;     /* the last slot found (most calls name the same stream) */
    uint8_t ks_idx[64];   /* 1 + the slot of a stream hashed here (a hint: checked on use) */
    /* The one-stream regime (streams.c solo_end): SOLO_NONE until a stream is seen, SOLO_ONE
     * while solo_stream is the only one (its frees leave no tag), SOLO_OFF for good after. */
    uint8_t solo;
    uint64_t solo_stream;
    uint32_t poll_tick;   /* allocations since recorded events were last polled */
    struct blk *parked;   /* frees a capture deferred (hnext chain) */
    uint32_t nrecorded;   /* event slots recorded and not yet seen complete */
    uint32_t poll_cursor; /* where the next poll of recorded events starts */
    bool poll_soon;       /* an event was recorded for a waiting stream: poll at the next allocation */
    bool empty_deferred;  /* an empty-cache a capture deferred */
    /* The regions' address ranges, readable without the lock (msh_pool_covers_fast): written
     * once each, before nvr is raised with a release store. */
    struct { uint64_t base, end; } vr[16];
    int nvr;
    struct { uint64_t h; uint32_t pages; } orphans[64]; /* unmapped handles whose release failed */
    int norphans;
    struct pev *evs;
    uint32_t nevs, capevs, evfree;
    uint64_t evseq;
    uint32_t rng;
    bool timing;
    uint64_t lat_gen;     /* epochs of the timed-thread count (lat_thread: st.timed_threads) */
    uint64_t t0_ns;
    msh_pool_gc_fn gc_fn;
    void *gc_arg;
    struct step *step;    /* the step log and learned plan (NULL: learning off) */
    struct msh_pool_stats st;
    struct msh_pool_oom oom;
    /* Spill to host memory (spill.c, docs/pool.md "Spill"). */
    uint64_t nborn;       /* allocations placed so far (struct blk.born) */
    uint64_t spill_mark;  /* blocks born before it are cold: the latest step mark, else the first free */
    bool spill_marked;    /* a step mark came (msh_pool_mark_step or the learned step) */
    bool first_free_seen;
    int8_t spill_state;   /* 0: not tried yet, 1: host memory works, -1: none (warned once) */
    size_t spill_pages;   /* pages of host handles mapped (in use or idle) */
    size_t spill_idle;    /* of them, pages of host handles no live block touches */
    size_t nhost;         /* host handles */
    size_t spill_max_pages; /* MEMSHIM_SPILL_MAX in pages (0: the host's memory is the cap) */
    struct front front;   /* front.c */
    struct msh_pool_caller caller; /* the callers' counters (PyTorch's memory_stats), exact */
    uint64_t caller_ext[3];  /* of them, live allocations other pools served: bytes, requested, blocks */
};

/* ---- free treaps: by (size, addr), where best fit is a lower bound; and by addr ---------------- */

static inline bool key_less(const struct blk *a, const struct blk *b)
{
    return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

/* Two treaps over the same free blocks share one implementation: `tt` names the tree (its
 * children kid[tt]) and its order. */
enum { TS = 0, TA = 1 };

static inline bool tkey_less(int tt, const struct blk *a, const struct blk *b)
{
    return tt == TS ? key_less(a, b) : a->addr < b->addr;
}

/* ---- live-block hash (address -> block) ------------------------------------------------------ */

static inline size_t hash_addr(uint64_t a, size_t cap)
{
    return (size_t)(((a >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
}

/* The live hash's link that points at the block at addr, or NULL: one walk serves a find and the
 * removal after it (hash_unlink, while that link still points at the block). */
static inline struct blk **hash_slot(struct msh_pool *pool, uint64_t addr)
{
    if (!pool->hcap) return NULL;
    for (struct blk **pp = &pool->htab[hash_addr(addr, pool->hcap)]; *pp; pp = &(*pp)->hnext)
        if ((*pp)->addr == addr) return pp;
    return NULL;
}

static inline void hash_unlink(struct msh_pool *pool, struct blk **pp)
{
    struct blk *b = *pp;
    *pp = b->hnext;
    b->hnext = NULL;
    pool->hcount--;
}

static inline uint64_t page_va(const struct msh_pool *pool, const struct region *r, uint32_t p)
{
    return r->base + (uint64_t)p * pool->gran;
}

static inline void ev_ref(struct msh_pool *pool, uint32_t i)
{
    if (i != NO_EV) pool->evs[i].refs++;
}

/* ---- known streams ------------------------------------------------------------------------------ */

static inline bool capturing(const struct msh_pool *pool)
{
    return pool->prm.capturing && __atomic_load_n(pool->prm.capturing, __ATOMIC_ACQUIRE) > 0;
}

/* How a free extent can serve an allocation on `stream`: at once (clean, or its work is all on
 * that stream), after stream waits on recorded events (no host blocking), or only after a
 * synchronize (a tag without an event that is not known complete, too many streams, or a
 * host-synchronous caller). *blocked: a stream whose missing event made it FIT_SYNC. */
enum { FIT_READY = 0, FIT_WAIT, FIT_SYNC };

/* ---- driver work outside the lock: claim, run, publish ----------------------------------------
 * A job is what one request needs from the driver. Under the lock it claims pages (runs to map,
 * in state PG_MAPPING) and cached handles to take back (victims, PG_UNMAPPING) and copies the
 * events it will wait on; job_run() then calls the driver without the lock; job_publish() applies
 * the results under the lock and wakes threads waiting for those pages. Nobody waits while
 * holding a claim, so nobody waits forever. */

struct run {
    uint32_t p0, n;  /* pages [p0, p0 + n) of the job's region, one handle */
    uint64_t h;
    int32_t vic;     /* the victim whose handle it maps, or -1: a new handle */
    int32_t of;      /* claim only: the split victim whose pages beside the block it keeps, or -1 */
    int rc;
    uint8_t fate;    /* on failure: RUN_NONE no handle, RUN_RELEASED, RUN_ORPHANED */
};

struct victim {
    struct region *r;
    uint32_t head, n;
    uint64_t h;
    int32_t run;     /* the run that maps its handle next, or -1: released */
    uint32_t dropped; /* V_SPLIT: its pages beside the block left unmapped (no room for them) */
    int rc, rel_rc;  /* unmap and release results */
    uint8_t kind;    /* V_RECLAIM (pressure), V_SPLIT (re-partitioned), V_RELEASE (empty-cache) */
};
enum { V_RECLAIM = 0, V_SPLIT, V_RELEASE };

struct ewait {
    uint64_t stream; /* the old stream */
    uint64_t h;      /* its event (recorded at the free), copied under the lock */
    uint32_t ev;     /* pooled slot (one reference held by the job) */
    uint8_t done;    /* a query found it complete: no wait was needed */
};

/* What one request knows of the device's room (issue 25). The device is asked once, by the first
 * job of the request that must create handles (job_run: a request served from mapped pages never
 * asks), and a create the driver refuses lowers what is known. Under the request's allocation. */
struct room {
    bool asked;      /* cuMemGetInfo answered (dev_free is its answer) */
    size_t dev_free; /* bytes the device had free then */
    size_t drv_held; /* bytes the driver held for this pool then (pool->drv_held) */
    size_t dev_cap;  /* pages of handles the device lets this pool hold now (what it held when asked
                      * plus the free pages; after a refused create, what it held then); SIZE_MAX:
                      * not known */
    bool drained;    /* the front end was drained for this request: no second drain */
    bool needs_victims; /* the try the front end gave up needed reclaim, a split or a synchronize */
    struct blk *placed; /* the block a successful try placed */
};

#define JOB_INL 8
struct job {
    struct region *r;
    struct run *runs;
    struct victim *vic;
    uint32_t nruns, capruns, nvic, capvic;
    uint32_t acc_p0, acc_p1;    /* grant access to these pages (when runs were mapped) */
    uint32_t acc_maps;          /* the mappings (handles) in [acc_p0, acc_p1]: what the grant costs */
    bool sync;                  /* synchronize first: unmapping pages freed on streams, or host use */
    bool host_sync;             /* the synchronize is for a host-synchronous user */
    bool driver_enomem;         /* the driver refused a create */
    struct room *room;          /* the request's, or NULL (releases, spill): asked before creates */
    uint64_t sync_gen;
    int sync_rc, wait_rc;
    uint64_t stream;            /* the allocation's stream (waits are enqueued on it) */
    int nwaits;
    /* what the driver work did, counted into the stats when the job is published: a plan that
     * fails (or falls back to a synchronize) must not count waits that never happened */
    int waits_done;
    bool foreign;               /* the extent was last used on another stream */
    int norph;
    size_t releasing;           /* of pool->releasing, the pages this job's victims give back */
    /* Issue 31: the job was claimed far from any limit (multi-page handles; a chunk mapped ahead at
     * the open end), judged by what the pool held then; far_pages: the pages that judgement added
     * (the block's span and a chunk); ahead: pages mapped beyond the block (the chunk). */
    bool far;
    uint32_t far_pages, ahead;
    /* From here on, arrays read only below their counts, each entry written whole when added:
     * job_init clears the fields above only (issue 24: clearing these too cost a 1.1 KiB memset on
     * every allocation, cached ones included). */
    struct ewait waits[MAX_STREAMS];
    struct { uint64_t h; uint32_t pages; int rc; } orph[64]; /* orphans to retry */
    struct run runs_inl[JOB_INL];
    struct victim vic_inl[JOB_INL];
};

/* v / gran: a shift where the page is a power of two (the driver's always is: no division on the
 * allocation path) */
static inline uint64_t pg_div(const struct msh_pool *pool, uint64_t v)
{
    return pool->gran_shift ? v >> pool->gran_shift : v / pool->gran;
}

/* The limit in force (inline: asked several times per allocation): the pool's own, or the one it shares with other pools of the device
 * (struct msh_pool_share: PyTorch's capture pools beside the main pool, shim/torch.c). */
static inline size_t limit_now(const struct msh_pool *pool)
{
    if (!pool->prm.share) return pool->limit;
    size_t raw = __atomic_load_n(&pool->prm.share->limit_bytes, __ATOMIC_RELAXED);
    /* whole pages (no division where the page is a power of two, as the driver's always is) */
    size_t lim = (pool->gran & (pool->gran - 1)) ? raw / pool->gran * pool->gran : raw & ~(pool->gran - 1);
    /* a limit at or above the device is no limit (issue 31: set_per_process_memory_fraction(1.0)
     * would otherwise cost one handle per page) */
    return pool->device_total && lim >= pool->dev_top ? 0 : lim;
}

/* The most pages of handles this pool may hold now (SIZE_MAX: no limit). Under a shared limit:
 * what it holds plus what the sharing pools leave free. */
static inline size_t cap_pages(const struct msh_pool *pool)
{
    size_t lim = limit_now(pool);
    if (!lim) return SIZE_MAX;
    if (!pool->prm.share) return pool->limit_pages;
    size_t used = __atomic_load_n(&pool->prm.share->handle_bytes, __ATOMIC_RELAXED);
    return pool->held + (lim > used ? pg_div(pool, lim - used) : 0);
}

/* Pages of handles held change; a shared limit sees every change at once. */
static inline void held_add(struct msh_pool *pool, size_t pages)
{
    __atomic_fetch_add(&pool->held, pages, __ATOMIC_RELAXED);
    if (pool->prm.share) __atomic_fetch_add(&pool->prm.share->handle_bytes, pages * pool->gran, __ATOMIC_RELAXED);
}
static inline void held_sub(struct msh_pool *pool, size_t pages)
{
    __atomic_fetch_sub(&pool->held, pages, __ATOMIC_RELAXED);
    if (pool->prm.share) __atomic_fetch_sub(&pool->prm.share->handle_bytes, pages * pool->gran, __ATOMIC_RELAXED);
}
/* A victim whose handle this job releases: off the budget of this job's claim at once, but room
 * for other claims only once the job has published (pool->releasing). */
static inline void victim_unheld(struct msh_pool *pool, struct job *j, size_t pages)
{
    held_sub(pool, pages);
    pool->releasing += pages;
    j->releasing += pages;
}
static inline void victim_reheld(struct msh_pool *pool, struct job *j, size_t pages)
{
    held_add(pool, pages);
    pool->releasing -= pages;
    j->releasing -= pages;
}
/* Driver work for job_do: runs to map, victims to reclaim, a synchronize, waits, orphans. */
static inline bool job_has_work(const struct job *j)
{
    return j->nruns || j->nvic || j->sync || j->nwaits || j->norph;
}

/* A job with nothing to run and nothing to undo (job_do and job_fini would do nothing). */
static inline bool job_idle(const struct job *j)
{
    return !job_has_work(j) && !j->releasing && j->runs == j->runs_inl && j->vic == j->vic_inl;
}

/* The job's releases are done (or given up): their pages are no longer in flight. */
static inline void job_released(struct msh_pool *pool, struct job *j)
{
    pool->releasing -= j->releasing;
    j->releasing = 0;
}

/* ---- learning the step (docs/pool.md, "Steady state at tight capacity") ------------------------
 * Training repeats one step. The pool logs every allocation and free, and keeps a hash of the
 * live set (XOR over live blocks of their address and size). When an allocation starts from a
 * live set seen before, with the same size as the allocation that followed it then, the events
 * in between are a candidate step. If that step had to remap (unmap_ops grew during it: it does
 * not fit in what the pool may hold when placed best-fit online), the pool packs the step's
 * blocks offline, knowing every lifetime (greedy, lowest address first, three orders tried),
 * keeps blocks that outlive the step where they are, and, when the packed step needs no more
 * pages than the pool may hold, places the next steps' allocations where the plan says. Each
 * allocation checks the plan: another size, or a planned range that is not free, drops the plan
 * and placement goes back to best fit (the step changed). Pages the plan uses are reclaimed
 * last. The packing runs without the lock, on a copy of the log. */

#define STEP_FAILS 4        /* failed step lengths remembered (the back-off of each) */
#define STEP_LOG (1u << 18)     /* events kept: steps up to this many events can be learned */
#define STEP_MAX_MOVABLE 40000  /* the packing is quadratic in the blocks it moves */

struct slog {
    uint64_t addr, size; /* where the block was placed, its VA bytes */
    uint64_t ref;        /* alloc: unused; free: serial of the allocation freed */
    uint8_t op;          /* 0 alloc, 1 free */
    uint8_t pad[7];
};

struct anchor {
    uint64_t h, serial, reclaims, size;
};

struct pent {
    uint64_t addr, size;
    int area;
};

struct fprun {
    struct region *r;
    uint32_t p0, p1;
};

struct step {
    struct slog *log;
    bool on;               /* logging: under a limit, or once the pool met pressure at its cap
                            * (no limit far from the device's capacity: nothing to learn, and
                            * the log's cost stays off the allocation path) */
    uint64_t valid_from;   /* the log's first serial since it went on: no window starts before */
    uint64_t n;            /* events logged: the next serial */
    uint64_t hstate;       /* hash of the live set */
    struct anchor *anchors;
    struct pent *plan;     /* the learned step: where each of its allocations goes */
    size_t nplan, capplan;
    uint64_t plan_h;       /* live-set hash at the step's start */
    size_t cursor;         /* next plan entry (nplan: the step is complete) */
    bool active;
    /* The plan was dropped at its own boundary (it had placed its whole step, and what came next
     * was not its step again: a pass of the replay ended, an evaluation step ran...): it is
     * resumed when its boundary comes back (the live set it starts from and its first size). */
    bool resumable;
    uint64_t plan_pages;   /* its footprint, checked against the limit on resuming */
    bool want;             /* the allocation being served has a planned address */
    uint64_t want_addr;
    int want_area;
    struct fprun *fp;      /* the plan's footprint, to clear its page flags */
    size_t nfp, capfp;
    uint64_t quiet_until;  /* no packing before this serial: one try per step length */
    /* Steps that did not pack into a budget, the last STEP_FAILS lengths: a step of about one of
     * these lengths waits 64, 128... step lengths (up to 1024) before its next try, unless the
     * budget changes (the packing of a step hardly depends on where its blocks were). Other steps
     * are tried; several lengths are kept so that two steps that both fail (a whole pass and the
     * pass less its warm-up) do not take turns at being tried. A plan installed for another step
     * leaves them: it does not make them fit. */
    struct step_fail {
        uint64_t len, budget, until;
        uint32_t n; /* failures in a row (0: the entry is free) */
    } fail[STEP_FAILS];
    /* The planner: a thread of the pool's own, started when the first step is worth packing,
     * packs a snapshot taken under the lock while allocations go on; the plan is switched to at
     * the next step boundary (plan_install). Every field below is read and written under the
     * pool lock, except the snapshot while the job runs (the planner's alone). */
    int job;                 /* PJ_IDLE, PJ_QUEUED, PJ_RUNNING, PJ_DONE (a plan waits for a boundary) */
    struct psnap *snap;      /* queued or running: the planner's input */
    struct pinput *res;      /* done: the packed step */
    uint64_t res_pages;      /* its footprint */
    uint64_t res_h0, res_first; /* its boundary: the live-set hash, the size of the first allocation */
    uint64_t res_until;      /* a boundary that has not come by this serial will not: the step changed */
    uint64_t res_events;     /* the packed step's length in events */
    uint64_t plan_events;    /* the plan's step length in events, and when it was last given up at */
    uint64_t dropped_at;     /* the end of its step (0: in mid-step, or never) */
    pthread_t worker;
    bool worker_on, worker_failed, stop;
    struct msh_cond wake;    /* the planner waits for a job */
};
enum { PJ_IDLE = 0, PJ_QUEUED, PJ_RUNNING, PJ_DONE };

/* ---- the packing (no lock held; works on a copy) ---- */

struct pitem {
    uint64_t addr, size;  /* planned (movable) or fixed address */
    uint64_t prev;        /* where the last step had it; 0: nowhere mapped now */
    uint32_t t0, t1;      /* alive over events [t0, t1) of the step */
    int32_t reg;          /* index into the region table */
    uint8_t fixed;
    uint8_t hole;         /* unmapped pages kept out of the plan (not part of its footprint) */
    uint32_t order;       /* allocation order within the step (movable and pinned), or UINT32_MAX */
};

struct pregion {
    uint64_t base, size;
    struct region *r;
    int sr;               /* its index in the snapshot */
};

struct pinput {
    struct pitem *it;
    size_t n, cap;
    struct pregion reg[64];
    int nreg;
    uint32_t len;         /* events in the step */
    size_t nalloc;        /* allocations in the step (plan entries) */
    uint64_t gran;
    uint64_t budget;      /* pages the plan may use */
    bool prefer_prev;     /* a block goes back where it was when that is still free */
    bool keep_mapped;     /* blocks in mapped pages stay (fixed): few are packed */
    bool across;          /* every region is one line: a block may go to another area's pages */
    bool search;          /* when the fixed orders miss the budget, try perturbed size orders (pack_search) */
    uint64_t work;        /* placement steps done by pack_region (bounds the search) */
};
#define SEARCH_MAX_ALLOCS 1024   /* steps of more allocations are not searched (see pack_search) */

/* What the planner packs, copied under the lock at a step boundary so that the packing needs
 * neither the lock nor the pool: the step's events, the live set, and which pages are mapped. */
struct psreg {
    uint64_t base, size;
    struct region *r;    /* regions live as long as the pool: plan_mark() uses it under the lock */
    uint32_t hi_page;
    const uint8_t *mapped; /* [hi_page]: 1 where a handle is mapped */
};

struct psnap {
    uint64_t t0, t1, h0;  /* the step's events [t0, t1); the live-set hash at its start */
    uint64_t gran, budget;
    size_t cap;           /* cap_pages() then (SIZE_MAX: no limit), for the back-off after a failure */
    bool mapped_only;     /* only the packings into mapped pages (a proven plan may still come back) */
    struct slog *ev;      /* [t1 - t0] */
    struct pent *live;    /* the live set at the boundary (address, VA size) */
    size_t nlive;
    struct psreg reg[64];
    int nreg;
    uint8_t *maps;        /* every region's mapped[] */
    size_t nmaps;
};


/* ---- extents.c ------------------------------------------------------------------------- */
void *raw_alloc(size_t bytes);
void raw_free(void *p, size_t bytes);
bool arr_grow(void **v, uint32_t *cap, size_t elem, const void *inl);
struct blk *atreap_floor(struct blk *t, uint64_t addr);
int hash_grow(struct msh_pool *pool);
struct blk *hash_find(struct msh_pool *pool, uint64_t addr);
void hash_insert(struct msh_pool *pool, struct blk *b);
struct blk *hash_remove(struct msh_pool *pool, uint64_t addr);
size_t round_up(size_t v, size_t a);
bool region_add(struct msh_pool *pool, int area, uint64_t min_bytes);
int area_of(const struct msh_pool *pool, uint64_t rsize);
void blk_make_free(struct msh_pool *pool, struct blk *b);
struct blk *carve_at(struct msh_pool *pool, struct blk *b, uint64_t at, uint64_t rsize);
struct blk *place_fresh(struct msh_pool *pool, int area, uint64_t rsize, int *rc);
struct blk *place(struct msh_pool *pool, int area, uint64_t rsize, uint64_t stream, int *rc);


/* ---- pages.c --------------------------------------------------------------------------- */
int dev_host_create(struct msh_pool *pool, size_t size, uint64_t *h);
int dev_host_release(struct msh_pool *pool, uint64_t h, size_t size);
int dev_copy(struct msh_pool *pool, uint64_t dst, uint64_t src, size_t size, bool to_host);
int dev_create_counted(struct msh_pool *pool, size_t size, uint64_t *h);
int dev_map_counted(struct msh_pool *pool, uint64_t va, size_t size, uint64_t h);
int dev_release(struct msh_pool *pool, uint64_t h, size_t size);
int dev_set_access(struct msh_pool *pool, uint64_t va, size_t size);
int dev_unmap(struct msh_pool *pool, uint64_t va, size_t size);
int dev_synchronize(struct msh_pool *pool);
/* cuMemGetInfo through the backend, counted (MSH_DRV_MEM_INFO). */
int dev_mem_info(struct msh_pool *pool, size_t *free_b, size_t *total);
int dev_event_record(struct msh_pool *pool, uint64_t ev, uint64_t stream);
int dev_reserve(struct msh_pool *pool, size_t size, uint64_t *va);
int dev_unreserve(struct msh_pool *pool, uint64_t va, size_t size);
void cache_add(struct msh_pool *pool, struct region *r, uint32_t h);
void cache_remove(struct msh_pool *pool, struct region *r, uint32_t h);
/* The pages block b touches, first and last. */
static inline void page_range(const struct msh_pool *pool, const struct blk *b, uint32_t *p0, uint32_t *p1)
{
    *p0 = (uint32_t)pg_div(pool, b->addr - b->reg->base);
    *p1 = (uint32_t)pg_div(pool, b->addr + b->size - 1 - b->reg->base);
}
void block_untouch(struct msh_pool *pool, struct blk *b);
void job_init(struct job *j);
void job_fini(struct msh_pool *pool, struct job *j);
void job_need_settle(struct msh_pool *pool, struct job *j);
bool take_victim(struct msh_pool *pool, struct job *j, struct region *r, uint32_t h, int kind);
int claim_pages(struct msh_pool *pool, struct blk *b, struct job *j, size_t cap);
int job_do(struct msh_pool *pool, struct job *j);
void job_cancel(struct msh_pool *pool, struct job *j);
size_t release_cached(struct msh_pool *pool, size_t max_keep, uint32_t quiet_ms);


/* ---- streams.c ------------------------------------------------------------------------- */
uint32_t ev_get(struct msh_pool *pool, uint64_t home);
void ev_put(struct msh_pool *pool, uint32_t i);
void ev_destroy(struct msh_pool *pool, uint64_t h);
int dev_event_create(struct msh_pool *pool, uint64_t home, uint64_t *h);
int dev_event_query(struct msh_pool *pool, uint64_t h);
struct kstream *ks_find(struct msh_pool *pool, uint64_t stream);
struct kstream *ks_get_slow(struct msh_pool *pool, uint64_t stream);
/* The stream's entry, made when first seen (streams.c): the last one found, inline. */
static inline struct kstream *ks_get(struct msh_pool *pool, uint64_t stream)
{
    struct kstream *k = &pool->ks[pool->ks_last];
    return MSH_LIKELY(k->used && k->stream == stream) ? k : ks_get_slow(pool, stream);
}
void solo_end(struct msh_pool *pool);
void ev_done(struct msh_pool *pool, uint32_t e);
void ks_resolve_homes(struct msh_pool *pool, const uint64_t *streams, int n);
uint64_t ks_home(struct msh_pool *pool, uint64_t stream);
bool blk_clean(struct msh_pool *pool, const struct blk *b);
void sref_put_events(struct msh_pool *pool, struct blk *b);
void sref_add(struct msh_pool *pool, struct blk *b, const struct sref *n);
void streams_merge_tags(struct msh_pool *pool, struct blk *into, struct blk *from);
void streams_copy_tags(struct msh_pool *pool, struct blk *to, const struct blk *from);
void streams_clip_tags(struct msh_pool *pool, struct blk *b);

/* The stream tags as extents merge, split and shrink (streams.c), and the one-stream regime's
 * spans (solo_end) with them; inline for the untagged extents most carves and merges see. */
static inline bool blk_untagged(const struct blk *b)
{
    return !(b->ns | b->sync_needed);
}

/* A free of the one stream alone (streams.c solo_end), b's tags already dropped: no tag, the span
 * with the free's number and generation, and the pool-wide count of frees with queued work (an
 * unmap synchronizes first). */
static inline void solo_free(struct msh_pool *pool, struct blk *b, uint64_t seq)
{
    b->qlo = b->addr;
    b->qhi = b->addr + b->size;
    b->qseq = seq;
    b->qgen = ++pool->free_gen;
}

static inline void streams_merge(struct msh_pool *pool, struct blk *into, struct blk *from)
{
    if (from->qlo < from->qhi) { /* the spans' union, and the later free's number and generation */
        if (into->qlo >= into->qhi || from->qlo < into->qlo) into->qlo = from->qlo;
        if (from->qhi > into->qhi) into->qhi = from->qhi;
        if (from->qseq > into->qseq) into->qseq = from->qseq;
        if (from->qgen > into->qgen) into->qgen = from->qgen;
    }
    if (blk_untagged(into) && blk_untagged(from)) into->free_gen = 0;
    else streams_merge_tags(pool, into, from);
}

static inline void streams_copy(struct msh_pool *pool, struct blk *to, const struct blk *from)
{
    to->qlo = from->qlo;
    to->qhi = from->qhi;
    to->qseq = from->qseq;
    to->qgen = from->qgen;
    if (!blk_untagged(from)) {
        streams_copy_tags(pool, to, from);
        return;
    }
    to->ns = 0;
    to->sync_needed = 0;
    to->slo = from->slo;
    to->shi = from->shi;
    to->free_gen = from->free_gen;
}

/* Drop b's tags, their event references, and its one-stream span: the extent is clean. */
static inline void sref_clear(struct msh_pool *pool, struct blk *b)
{
    if (b->ns) sref_put_events(pool, b);
    b->ns = 0;
    b->sync_needed = 0;
    b->free_gen = 0;
    b->slo = b->shi = 0;
    b->qlo = b->qhi = 0;
    b->qseq = b->qgen = 0;
}

static inline void streams_clip(struct msh_pool *pool, struct blk *b)
{
    uint64_t lo = b->addr, hi = b->addr + b->size;
    if (b->qlo < b->qhi) {
        if (b->qlo < lo) b->qlo = lo;
        if (b->qhi > hi) b->qhi = hi;
        if (b->qlo >= b->qhi) b->qlo = b->qhi = b->qseq = b->qgen = 0;
    }
    if (!blk_untagged(b)) streams_clip_tags(pool, b);
}
int fit_kind(struct msh_pool *pool, const struct blk *b, uint64_t lo, uint64_t hi, uint64_t stream,
                    uint64_t *blocked);
bool blocking_span(struct msh_pool *pool, const struct blk *b, uint64_t stream, uint64_t *lo, uint64_t *hi);
void want_events(struct msh_pool *pool, uint64_t stream);
void streams_plan_tags(struct msh_pool *pool, struct blk *b, uint64_t stream, struct job *j);
/* What the job of a placement on `stream` must wait for or synchronize before b is used there:
 * nothing on fresh memory or an untagged extent (most placements, inline). */
static inline void streams_plan(struct msh_pool *pool, struct blk *b, uint64_t stream, bool fresh, struct job *j)
{
    if (fresh || blk_untagged(b)) return;
    streams_plan_tags(pool, b, stream, j);
}


/* ---- step.c ---------------------------------------------------------------------------- */
void step_create(struct msh_pool *pool);
void step_stop(struct msh_pool *pool);
void step_destroy(struct msh_pool *pool);
bool step_want(const struct step *s, uint64_t addr);
void step_drop(struct msh_pool *pool, const char *why, uint64_t rsize, bool keep);
void step_note_alloc(struct msh_pool *pool, struct blk *b);
void step_note_free(struct msh_pool *pool, struct blk *b);
struct blk *plan_place(struct msh_pool *pool, uint64_t rsize);
void step_before_alloc(struct msh_pool *pool, uint64_t rsize);
void step_turn_on(struct msh_pool *pool);
/* Whether the learned step logs this allocation: on once a limit or pressure appears (the live
 * set's hash is taken then, and windows start after it). */
static inline bool step_learning(struct msh_pool *pool)
{
    struct step *s = pool->step;
    if (!s) return false;
    if (MSH_UNLIKELY(!s->on) && (limit_now(pool) || pool->pressure_reclaims)) step_turn_on(pool);
    return s->on;
}


/* ---- pack.c ---------------------------------------------------------------------------- */
uint64_t pack_all(struct pinput *in);
void snap_free(struct psnap *sn);
void pin_free(struct pinput *in);
struct psnap *snap_take(struct msh_pool *pool, uint64_t t0, uint64_t t1, uint64_t h0, uint64_t budget);
bool plan_input(const struct psnap *sn, bool keep, int holes, struct pinput *in);
void plan_mark(struct msh_pool *pool, const struct pinput *in, uint64_t pages);



/* ---- the callers' counters (pool.c counts, stats.c reads) --------------------------------- */
static inline uint64_t round_block(uint64_t size)
{
    return ((size ? size : 1) + BLOCK_ALIGN - 1) & ~(uint64_t)(BLOCK_ALIGN - 1);
}

static inline void cc_add(struct msh_caller_count *c, uint64_t v)
{
    c->cur += v;
    c->allocated += v;
    if (c->cur > c->peak) c->peak = c->cur;
}

static inline void cc_sub(struct msh_caller_count *c, uint64_t v)
{
    c->cur -= v; /* exact: a block is uncounted with the size it was counted with (its own) */
    c->freed += v;
}

/* The callers' counters for one allocation (alloc) or free of `req` bytes: PyTorch's pools split
 * at 1 MiB, its blocks are counted at the pool's 512-byte rounding. */
static inline __attribute__((always_inline)) void caller_count(struct msh_pool *pool, uint64_t req, bool alloc)
{
    struct msh_pool_caller *c = &pool->caller;
    uint64_t rb = round_block(req);
    int sp = req <= MSH_MiB ? 2 : 1;
    if (alloc) {
        cc_add(&c->bytes[0], rb);
        cc_add(&c->bytes[sp], rb);
        cc_add(&c->req[0], req);
        cc_add(&c->req[sp], req);
        cc_add(&c->count[0], 1);
        cc_add(&c->count[sp], 1);
    } else {
        cc_sub(&c->bytes[0], rb);
        cc_sub(&c->bytes[sp], rb);
        cc_sub(&c->req[0], req);
        cc_sub(&c->req[sp], req);
        cc_sub(&c->count[0], 1);
        cc_sub(&c->count[sp], 1);
    }
}

/* The handle bytes the callers' reserved figure follows: every pool under the shared limit. */
static inline void caller_reserved(struct msh_pool *pool)
{
    size_t held = pool->prm.share ? __atomic_load_n(&pool->prm.share->handle_bytes, __ATOMIC_RELAXED)
                                  : __atomic_load_n(&pool->drv_held, __ATOMIC_RELAXED);
    if (held > pool->caller.reserved_peak) pool->caller.reserved_peak = held;
}


/* ---- stats.c ---------------------------------------------------------------------------- */
/* A timed call (ns standing for `weight` calls) and its thread, under the lock. */
void lat_record(struct msh_pool *pool, bool alloc, uint64_t ns, uint32_t weight);
/* Free bytes that could be handed out now without mapping anything, and the largest such run. */
void scan_free(struct msh_pool *pool, size_t *free_bytes, size_t *largest);


/* ---- front.c ---------------------------------------------------------------------------- */
void front_init(struct msh_pool *pool);
void front_destroy(struct msh_pool *pool);
bool front_on(struct msh_pool *pool);
int front_state(struct msh_pool *pool);
struct blk *front_take(struct msh_pool *pool, uint64_t stream, uint64_t rsize);
bool front_put(struct msh_pool *pool, struct blk *b, uint64_t stream);
/* Binned blocks back to the VA line: every one (FRONT_DRAIN_ALL; `stream`: a requester whose own
 * blocks need no event, or MSH_STREAM_COMPLETED), one stream's (_STREAM), those of streams another
 * wants memory of (_DEMAND), most of the bins unused since the last step mark (_IDLE), the bins
 * unused lately (_STALE). Returns the bytes. */
size_t front_drain(struct msh_pool *pool, int what, uint64_t stream);
/* One binned block of `stream`, the smallest that holds rsize bytes in rsize's area, back to the
 * VA line (a request that would otherwise need driver work takes it there); false: none. */
bool front_drain_fit(struct msh_pool *pool, uint64_t stream, uint64_t rsize);
void front_aside(struct msh_pool *pool);
/* A step mark (msh_pool_step): the limit's room, the bins unused since the last one. */
void front_step(struct msh_pool *pool);
/* `drained` binned blocks went back to the line for a request: the churn window (front.c). */
void front_churn(struct msh_pool *pool, size_t drained, bool at_step);
int front_check(struct msh_pool *pool, size_t nbinned, size_t binned_bytes, char *why, size_t whylen);
/* pool.c: a binned block freed as the free it stood for, sharing one event per stream per drain
 * (tag; the lock may be dropped meanwhile); then the drain's tags let go */
void free_binned(struct msh_pool *pool, struct blk *b, struct sref *tag);
void free_binned_done(struct msh_pool *pool, struct sref *tag);


/* ---- spill.c ---------------------------------------------------------------------------- */
bool spill_rescue(struct msh_pool *pool, uint64_t rsize, int round);
void spill_note_free(struct msh_pool *pool);
void spill_note_step(struct msh_pool *pool);

#endif
