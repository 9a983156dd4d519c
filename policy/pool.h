/*
 * pool.h: the defragmenting pool (DESIGN.md 4). One pool per device.
 *
 * The pool reserves large virtual ranges and maps physical pages (granularity-sized handles) only
 * where live blocks touch them, so the physical memory a job needs approaches its peak live
 * bytes. It is pure C over struct msh_device; it never calls a CUDA hook and never logs while
 * holding its lock except through the lock-free logger.
 */
#ifndef MSH_POOL_H
#define MSH_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "drvcost.h"

/* Latency histogram buckets: 4 per power of two (25% wide) from 1 ns to 2^36 ns; larger values
 * land in the last bucket. Bucket b holds [msh_lat_lower(b), msh_lat_upper(b)]. */
#define MSH_LAT_BUCKETS 144
static inline int msh_lat_bucket(uint64_t ns)
{
    if (ns < 4) return (int)ns;
    int e = 63 - __builtin_clzll(ns);
    int b = (e - 1) * 4 + (int)((ns >> (e - 2)) & 3);
    return b < MSH_LAT_BUCKETS ? b : MSH_LAT_BUCKETS - 1;
}
static inline uint64_t msh_lat_upper(int b)
{
    if (b < 4) return (uint64_t)b;
    int e = b / 4 + 1;
    return ((uint64_t)(5 + b % 4) << (e - 2)) - 1;
}

/* Pseudo-stream for frees whose last use is already known complete (cudaFree synchronizes). */
#define MSH_STREAM_COMPLETED UINT64_MAX

struct msh_pool;

/* The learned step is packed by a planner thread (plan_sync, planner_hook below). */
#define MSH_POOL_PLANNER 1

struct msh_pool_params {
    size_t limit_bytes;        /* cap on physical bytes held; 0 = device memory is the only cap */
    size_t small_max;          /* requests up to this many bytes go to the small region */
    bool defrag;               /* reclaim and remap wholly free pages under pressure */
    size_t va_bytes;           /* size of each reserved VA range (0 = 4x device memory) */
    size_t release_threshold;  /* give cached bytes above this back to the driver (0 = off)... */
    unsigned release_quiet_ms; /* ...once they have not been reused for this long (0 = 1000 ms) */
    bool no_release_on_oom;    /* MEMSHIM_EMPTY_CACHE=never: the rescue chain skips empty-cache */
    size_t max_handle_bytes;   /* largest physical handle (0 = no cap beyond the block's interior) */
    size_t ahead_bytes;        /* far from any limit, map the open end of the VA line in chunks of
                                * this many bytes (0 = 20 MiB; one page or less = never) */
    bool no_learn;             /* never place by the learned step (today's placement only) */
    /* The learned step is packed by a planner thread of the pool's own while allocations go on,
     * and used from the next step boundary once ready. plan_sync: the allocation that finds the
     * step packs it itself and uses the plan at once, no thread (memshim-replay: results that do
     * not depend on thread timing). planner_hook (tests): called before each packing, on the
     * thread that packs. */
    bool plan_sync;
    void (*planner_hook)(void *arg);
    void *planner_hook_arg;
    /* Several pools of one device (PyTorch's CUDA-graph capture pools beside the main pool,
     * shim/torch.c) under one limit: when set, limit_bytes is ignored and share->limit_bytes
     * (0 = none, changeable at any time) caps the handle bytes all sharing pools hold together. */
    struct msh_pool_share *share;
    /* The device's count of CUDA-graph captures in progress (shim/capture.h; read atomically),
     * or NULL. While it is above zero the pool never synchronizes the device, unmaps or releases
     * (a synchronize invalidates the capture, and the capture may use the memory): reclaim, split
     * handles, empty-cache and trims wait, frees that need events are parked, and an allocation
     * that needs any of these fails over to fresh memory or fails (msh_pool_oom.capture). The
     * deferred work runs at msh_pool_after_capture, or at the next call that finds none. */
    const int *capturing;
    /* Spill to host memory (MEMSHIM_SPILL=host, docs/pool.md "Spill"): when the rescue chain
     * cannot serve a request under the limit or the device's capacity, the backing of cold pages
     * moves to host memory mapped at the same addresses (kernels still reach it, slower), and
     * comes back at msh_pool_mark_step when device memory allows. Needs the backend's
     * host_create and copy; without them the pool warns once and behaves as without spill.
     * spill_max_bytes caps host bytes (0: what the host gives). */
    bool spill;
    size_t spill_max_bytes;
    /* The front end (docs/pool.md "The front end"): a freed block used on its own stream only is
     * kept in a bin of its (stream, size) and handed to the next request of that size on that
     * stream, without search, page work or event; drained before any driver work it could spare,
     * first in the OOM rescue, on empty-cache and trim, at step marks for bins not used since
     * the last. Off for capture pools (an allocation on a capturing stream never touches it). */
    bool front;
};
/* Read and written with __atomic builtins by every pool that shares it. */
struct msh_pool_share {
    size_t handle_bytes; /* handles held by all sharing pools */
    size_t limit_bytes;  /* 0 = no limit */
};
void msh_pool_params_default(struct msh_pool_params *p);

/* Counters. Every field is cumulative unless it says current/peak. */
struct msh_pool_stats {
    size_t live_bytes, peak_live_bytes;          /* requested bytes */
    size_t run_peak_live_bytes, run_peak_mapped_bytes; /* peaks since creation (never reset) */
    size_t live_blocks;
    size_t mapped_bytes, peak_mapped_bytes;      /* physical bytes mapped (reserved) */
    size_t handle_bytes;                         /* physical bytes held as handles */
    size_t touched_bytes, peak_touched_bytes;    /* bytes of pages that live blocks touch */
    size_t va_bytes;                             /* reserved virtual bytes */
    size_t free_bytes, largest_free;             /* inside mapped pages, usable now */
    uint64_t allocs, frees, alloc_fail;
    uint64_t map_ops, unmap_ops, create_ops, release_ops;
    uint64_t reclaimed_pages;                    /* pages unmapped to be remapped elsewhere */
    uint64_t released_pages;                     /* pages given back to the driver */
    uint64_t trim_runs, trim_bytes;              /* MEMSHIM_EMPTY_CACHE=threshold: releases and bytes */
    uint64_t cross_stream_waits;                 /* stream waits issued when another stream reuses memory */
    uint64_t rescue_reclaim, rescue_gc, rescue_empty_cache; /* OOM rescue steps that succeeded */
    uint64_t oom_events;                         /* requests that failed after the whole chain */
    uint64_t hist[24];                           /* allocation sizes: bucket i = [2^(9+i-1), 2^(9+i)) */
    uint64_t alloc_ns_total, free_ns_total;      /* time in alloc/free (when timing is on) */
    /* Latency of each timed alloc/free: a log-linear histogram (msh_lat_bucket) and the maximum. */
    uint64_t alloc_lat[MSH_LAT_BUCKETS], free_lat[MSH_LAT_BUCKETS];
    uint64_t alloc_ns_max, free_ns_max;
    /* Every call the pool made to its device backend, by kind (drvcost.h), and the bytes those
     * calls covered (create/release/map/unmap/set_access/reserve/unreserve). A handle may
     * cover several pages; set_access is counted once per block mapped, over its span, and
     * drv_maps counts the mappings (handles) each call covered: the span's, for set_access. */
    uint64_t drv_calls[MSH_DRV_NKINDS], drv_bytes[MSH_DRV_NKINDS], drv_maps[MSH_DRV_NKINDS];
    /* Streams (docs/pool.md "Streams"): reuses of memory whose last use was on another stream;
     * events recorded at frees (on the other streams a block was used on, and markers); records
     * at reuse time, which the pool no longer makes (always 0, kept for readers of older
     * reports); queries of recorded events (a complete one costs no wait); events recorded at
     * frees because another stream wanted that stream's memory (part of free_event_records);
     * placements on fresh memory because every fitting extent would have needed a synchronize. */
    uint64_t cross_stream_reuses, free_event_records, reuse_event_records;
    uint64_t event_queries, demand_records, fresh_placements;
    /* CUDA-graph captures: work deferred because a capture was in progress (reclaims, releases,
     * empty-caches, frees needing events), and frees parked until the capture ended. */
    uint64_t capture_deferrals, parked_frees;
    size_t handles;                              /* physical handles held now (a handle spans >= 1 page) */
    /* The learned step (docs/pool.md): steps learned, allocations placed where the plan said,
     * plans dropped because the stream of requests left them, and steps found that no packing
     * fitted into the budget (each a packing tried and given up). */
    uint64_t plans_built, plan_placed, plan_dropped, plan_failed;
    uint64_t plan_pack_ns;                       /* time spent packing steps (on the planner thread) */
    uint64_t lock_waits;                         /* allocations that waited for another thread's mapping */
    /* Spill (docs/pool.md "Spill"): bytes of host memory behind the pool's addresses now (in use
     * or idle until the next step mark), their peaks (since the last reset_peaks, since
     * creation); pages moved to the host and back, and their bytes; time spent moving (the
     * device synchronized, copies, remaps); requests served after a spill; requests that still
     * failed with spill on (nothing cold enough, spill_max_bytes, or the host refused). */
    size_t spilled_bytes, peak_spilled_bytes, run_peak_spilled_bytes;
    uint64_t spill_out_pages, spill_in_pages, spill_out_bytes, spill_in_bytes;
    uint64_t spill_ns;
    uint64_t rescue_spill, spill_refused;
    /* The reserved (handles the driver holds) and live bytes at the first allocation that saw the
     * epoch's highest reserved figure, since the last reset_peaks: reserved minus allocated at the
     * reserved peak (fragmentation.reserved_minus_allocated_at_peak_bytes). */
    size_t at_peak_mapped_bytes, at_peak_live_bytes;
    /* The front end: allocations served from a bin (hits) and by the general path while the
     * front end was on (misses); frees kept in a bin (puts); drains and the blocks they gave back
     * to the VA line (a drain of one block counts one); bytes and blocks binned now (reserved and
     * inactive) and the most binned;
     * frees of a block that was already freed (refused: EALREADY). */
    uint64_t front_hits, front_misses, front_puts, front_drains, front_drained;
    size_t binned_bytes, binned_blocks, peak_binned_bytes;
    /* bytes the pool grew by for requests while blocks were binned, without draining them (two
     * sizes taking turns in one place): at most 1/16 of what it holds plus two chunks (2 x 20 MiB
     * far from a limit) */
    size_t front_grown_aside;
    uint64_t front_kept;          /* requests that did driver work with blocks binned, within that allowance */
    uint64_t front_cooled;        /* times the front end stepped out for churn */
    int front_state;              /* enum msh_front_state: what the front end does now */
    /* Threads with a timed call (the latency figures) since the last reset_peaks, and over the
     * pool's life: memshim_overhead.share_of_wall divides by the threads' wall time. */
    uint64_t timed_threads, timed_threads_run;
    uint64_t double_frees;
    /* The pool saw a second stream, or a host-synchronous request (MSH_STREAM_COMPLETED), after
     * one stream alone (0 or 1): from then on every free leaves its stream tag (docs/pool.md
     * "Streams"). */
    uint64_t solo_ends;
};

/* The front end now (msh_pool_stats.front_state): serving; off (params.front false:
 * MEMSHIM_FRONT=0, a capture pool); waiting (under a limit, until two step marks showed the pool
 * holding at most 31/32 of it); aside
 * (the pool had to reclaim at this limit, or a learned step is in use or being packed: the
 * learned step's regime); churn (the bins' blocks went back for other sizes more than they served
 * their own: out for 32768 allocations, then it tries again). */
enum msh_front_state { MSH_FRONT_ON = 0, MSH_FRONT_OFF, MSH_FRONT_WAITING, MSH_FRONT_ASIDE, MSH_FRONT_CHURN };
const char *msh_front_state_name(int state);

/* The callers' counters: what PyTorch's memory_allocated() and memory_stats() count, for every
 * allocation and free of the pool, front end or not, as plain fields under the pool lock (no
 * atomics, exact). [0] all, [1] large (over 1 MiB, PyTorch's large pool), [2] small. bytes: the
 * requested size rounded to the pool's 512-byte blocks; req: as requested; count: blocks.
 * Allocations other pools of the device serve (CUDA-graph capture pools, shim/torch.c) are
 * counted into the device's main pool with msh_pool_caller_note. */
struct msh_caller_count {
    uint64_t cur, peak, allocated, freed;
};
struct msh_pool_caller {
    struct msh_caller_count bytes[3], req[3], count[3];
    size_t reserved_peak; /* handle bytes of every pool sharing the limit (or this one), at their most */
};

/* Why the last request failed (filled on every failure, read by the report). */
struct msh_pool_oom {
    size_t requested, device_total, device_free, live_bytes, mapped_bytes, limit_bytes;
    size_t largest_free;
    bool fragmentation;           /* true: enough free bytes existed, but not in usable pages */
    bool capture;                 /* a CUDA-graph capture was in progress: nothing could be
                                   * reclaimed or released (msh_pool_params.capturing) */
    struct { uint64_t addr; size_t size; } top[5]; /* largest live blocks */
    int ntop;
    /* spill on: bytes on the host when the request failed, and why more could not go there
     * (NULL: spill off or never tried; "spill_max": MEMSHIM_SPILL_MAX reached; "nothing cold":
     * every page left is touched by a block of the current step; "host refused": the driver
     * gave no more host memory; "no host memory through VMM": the driver has none) */
    size_t spilled_bytes;
    const char *spill_stop;
    /* Which case it was (issue 25, docs/pool.md "Pressure and the OOM rescue chain"): the request
     * alone is larger than the device or than the limit (refused before any driver work: no step
     * can change that), or it does not fit now (device_free, cached_bytes, live_bytes and
     * largest_free say why). steps: the rescue steps that ran (each only when the pool's figures
     * said it could make the request fit). */
    int kind;                     /* enum msh_oom_case */
    size_t cached_bytes;          /* mapped pages no live block touches */
    unsigned steps;               /* MSH_OOM_STEP_* */
    /* Issue 31: the other pools of the device under the limit this one shares (CUDA-graph capture
     * pools and the main pool, struct msh_pool_share): the bytes of handles they hold (a
     * collection may free them: the gc step runs when freeing every pool's blocks would make
     * room), and at least how much room the request still lacked after every step, beyond what
     * this pool could reach (0: none lacked as far as its figures tell, or the case is not
     * MSH_OOM_NOW): what another pool giving its cache back must free for it to fit. */
    size_t others_bytes, short_bytes;
};
enum msh_oom_case { MSH_OOM_NOW = 0, MSH_OOM_DEVICE, MSH_OOM_LIMIT };
#define MSH_OOM_STEP_GC 1u          /* the GC callback (gc.collect() in a Python job) */
#define MSH_OOM_STEP_EMPTY_CACHE 2u /* cached handles given back to the driver */
#define MSH_OOM_STEP_SPILL 4u       /* cold pages moved to host memory (MEMSHIM_SPILL=host) */
/* "larger_than_device", "larger_than_limit", "does_not_fit_now" (the reports' last_oom.case), and
 * the same in words for messages. */
const char *msh_oom_case_name(int kind);
const char *msh_oom_case_text(int kind);

/* GC callback: may free blocks (through msh_pool_free from the same thread); returns bytes it
 * believes it released. Called without the pool lock held. */
typedef size_t (*msh_pool_gc_fn)(void *arg);

int msh_pool_create(struct msh_device *dev, const struct msh_pool_params *params,
                    struct msh_pool **out);
/* Unmap and release everything. Live blocks are lost; the caller ensures the device is idle. */
void msh_pool_destroy(struct msh_pool *pool);

/* Allocate `size` bytes (0 gives a distinct minimal block) for use on `stream`
 * (MSH_STREAM_COMPLETED: the caller uses the memory from the host at once, as after cudaMalloc).
 * Returns 0 and *addr (512-byte aligned); ENOMEM after the rescue chain; EINVAL for an absurd
 * size; EIO when the driver failed otherwise (a map or synchronize error): callers may fall
 * back to another allocator. */
int msh_pool_alloc(struct msh_pool *pool, size_t size, uint64_t stream, uint64_t *addr);
/* The same with flags: MSH_PA_COUNTED, counted in the callers' counters (struct
 * msh_pool_caller) until it is freed (the tensor-mode entry's allocations: PyTorch's
 * memory_allocated counts those only); MSH_PA_TIMED, the caller times the call itself (from its
 * own entry to its return, msh_pool_note_latency) and the pool does not. */
#define MSH_PA_COUNTED 1u
#define MSH_PA_TIMED 2u
int msh_pool_alloc_ex(struct msh_pool *pool, size_t size, uint64_t stream, unsigned flags, uint64_t *addr);
int msh_pool_free_ex(struct msh_pool *pool, uint64_t addr, uint64_t stream, unsigned flags);
/* Free a block. `stream` is where its last use was enqueued (MSH_STREAM_COMPLETED when known
 * done). Returns EINVAL for an address the pool did not hand out, EALREADY for a block freed
 * already and not handed out again (a double free): nothing changes, the caller warns. */
int msh_pool_free(struct msh_pool *pool, uint64_t addr, uint64_t stream);
/* Marks on live blocks (memshim_malloc's allocation sites, shim/sites.c): a block placed while
 * this thread's msh_pool_tags.next is set keeps that value; a successful msh_pool_free leaves the
 * freed block's mark and requested size in .freed and .freed_req. */
struct msh_pool_tags {
    uint32_t next, freed;
    uint64_t freed_req;
};
extern __thread struct msh_pool_tags msh_pool_tags;
/* The marks of the live blocks at addrs[0..n) (0 where none), in one lock hold. */
void msh_pool_block_tags(struct msh_pool *pool, const uint64_t *addrs, uint32_t *tags, size_t n);
/* Requested size of the live block at addr, or 0 when addr is not a live block of this pool. */
size_t msh_pool_block_size(struct msh_pool *pool, uint64_t addr);
bool msh_pool_owns(struct msh_pool *pool, uint64_t addr);
int msh_pool_record_stream(struct msh_pool *pool, uint64_t addr, uint64_t stream);
/* Give every wholly free page back to the driver; returns the bytes released. */
size_t msh_pool_empty_cache(struct msh_pool *pool);
/* At exit: wait for the device, drop every stream tag and destroy every pooled event (the
 * pool keeps its events for reuse while it runs). Mappings stay. */
void msh_pool_release_events(struct msh_pool *pool);
/* MEMSHIM_EMPTY_CACHE=threshold from a background thread: release cached bytes above the
 * threshold that have not been reused for the quiet period. Returns the bytes released. */
size_t msh_pool_trim(struct msh_pool *pool);
void msh_pool_set_gc(struct msh_pool *pool, msh_pool_gc_fn fn, void *arg);
/* Allocations and frees served so far (under the lock): whether the job is busy (idle release). */
uint64_t msh_pool_activity(struct msh_pool *pool);
/* Physical bytes held now, without the lock (a racy but cheap read for policies). */
size_t msh_pool_mapped_bytes(struct msh_pool *pool);
void msh_pool_get_stats(struct msh_pool *pool, struct msh_pool_stats *out);
/* Reset the peak counters to the current values (called at each epoch boundary). */
void msh_pool_reset_peaks(struct msh_pool *pool);
/* The peak live and peak reserved bytes since the last call (or reset_peaks), then both restart
 * at the current values: one optimizer step's peaks when called at each step mark (the reports'
 * fragmentation.step_allocated_over_reserved). */
void msh_pool_take_step_peaks(struct msh_pool *pool, size_t *live, size_t *reserved);
void msh_pool_last_oom(struct msh_pool *pool, struct msh_pool_oom *out);
/* Walk live blocks (for reports and tests), without the lock released between calls. */
void msh_pool_for_each_live(struct msh_pool *pool,
                            void (*fn)(void *arg, uint64_t addr, size_t size, uint64_t stream),
                            void *arg);
/* Turn on per-call latency accounting inside the pool (two CPU-counter reads per sampled call). */
void msh_pool_set_timing(struct msh_pool *pool, bool on);
/* A call timed by its caller, from its entry to its return (tensor mode times memshim's whole
 * path, shim/core.c): `ns` of one call standing for `weight` calls (hotclock.h). */
void msh_pool_note_latency(struct msh_pool *pool, bool alloc, uint64_t ns, uint32_t weight);

/* The callers' counters (struct msh_pool_caller), read under the lock. */
void msh_pool_caller_stats(struct msh_pool *pool, struct msh_pool_caller *out);
/* An allocation (bytes > 0: `size` requested) or a free (alloc false) another pool of the device
 * served, counted here; also raises reserved_peak to the shared handle bytes. */
void msh_pool_caller_note(struct msh_pool *pool, size_t size, bool alloc);
/* reset_peak_memory_stats: peaks to the current values. reset_accumulated: allocated and freed to 0. */
void msh_pool_caller_reset(struct msh_pool *pool, bool peaks, bool accumulated);

/* An optimizer step ended: bins of the front end that served nothing since the last step give
 * most of their blocks back to the VA line (sizes that stopped recurring stop pinning pages). */
void msh_pool_step(struct msh_pool *pool);
/* Give every binned block back to the VA line now (what a snapshot of the pool wants to see);
 * returns the bytes drained. */
size_t msh_pool_drain_front(struct msh_pool *pool);

/* ---- issue 8's entry points (their semantics, re-implemented over this pool's handles) ---- */

/* The caller is about to destroy `stream`: afterwards the pool names it nowhere (blocks that
 * were tagged with it are reused elsewhere only after a device synchronize). O(blocks), no
 * device call. Returns 0. */
int msh_pool_forget_stream(struct msh_pool *pool, uint64_t stream);

/* The live block containing addr (its start or any byte of its requested size): 0 with its base
 * and requested size (at least 1), or EINVAL. O(1) for a block start, else O(blocks in the region). */
int msh_pool_block_containing(struct msh_pool *pool, uint64_t addr, uint64_t *base, size_t *size);
/* Whether addr lies in the pool's reserved virtual ranges (live block or not). */
bool msh_pool_covers(struct msh_pool *pool, uint64_t addr);
/* The same, without the lock (frees use it to tell the main pool's memory from a capture
 * pool's): exact for the pool's first 16 regions; beyond them, the locked walk. */
bool msh_pool_covers_fast(struct msh_pool *pool, uint64_t addr);

/* The device's last CUDA-graph capture ended: run what the pool deferred (parked frees, an
 * empty-cache). Harmless when nothing was deferred or a capture is still in progress. */
void msh_pool_after_capture(struct msh_pool *pool);

/* The backend grants one more device access to this device's memory (a peer the program enabled,
 * device.h add_access): grant it on every page mapped now; pages mapped later get it from the
 * backend. Waits for requests doing driver work to finish first. Returns 0, or the first error
 * of a grant (the rest are still tried). */
int msh_pool_regrant_access(struct msh_pool *pool);

/* The pool's page counters, read under its lock in O(1) (cudaMemGetInfo under MEMSHIM_LIMIT). */
struct msh_pool_counters {
    size_t gran, limit;          /* page size; cap on handles' bytes (0 = none) */
    size_t handles;              /* pages held (mapped + orphaned) */
    size_t cached_pages;         /* mapped pages no live block touches */
    size_t touched_pages;        /* pages live blocks touch */
    size_t live_bytes;
    bool defrag, release_on_oom; /* cached pages can be reclaimed / given back under pressure */
};
void msh_pool_counters(struct msh_pool *pool, struct msh_pool_counters *out);

/* msh_pool_free, then give the driver back the handles on the pages the block touched that no
 * live block touches any more (*released: bytes). EINVAL for an address that is not a live block
 * start. */
int msh_pool_free_release(struct msh_pool *pool, uint64_t addr, uint64_t stream, size_t *released);

/* ---- spill to host memory (docs/pool.md "Spill") ---- */
/* A step or epoch boundary (the caller's: an optimizer step, an epoch): blocks allocated before it
 * count as cold from now on, and spilled pages come back if the device has room for them with a
 * margin (1/16 of the limit or capacity, at least a page: no ping-pong), idle host pages are given back. A safe
 * point: never during a capture (then it only sets the mark). Returns bytes brought back. */
size_t msh_pool_mark_step(struct msh_pool *pool);
/* Turn spilling on or off (params.spill, spill_max_bytes) for requests from now on: memshim turns
 * it on at the first tensor-mode allocation (in segment mode PyTorch's cache reuses every segment,
 * so no memory is cold). Spilled pages stay where they are until a step mark. */
void msh_pool_set_spill(struct msh_pool *pool, bool on, size_t max_bytes);
/* Bring spilled pages back now, as far as device memory allows with the margin (`all`: without
 * the margin, up to the cap). Returns bytes brought back. */
size_t msh_pool_unspill(struct msh_pool *pool, bool all);
/* Walk live blocks that touch host memory now: `host_bytes` of the block's pages are spilled. */
void msh_pool_for_each_spilled(struct msh_pool *pool, void (*fn)(void *arg, uint64_t addr, size_t size, size_t host_bytes),
                               void *arg);

/* Verify every structural invariant of the pool under its lock (tests, memshim-replay --check):
 * each region is tiled by its blocks in address order with no two free neighbours; free blocks
 * are exactly the treap's (ordered by (size, addr), heap-ordered by priority), live blocks exactly
 * the hash's; each page's live count equals the live blocks touching it; mapped pages plus
 * orphaned handles equal the handles held; the cached list is exactly the mapped pages with no
 * live block; and every counter behind msh_pool_get_stats()/memshim_get_stats() equals a recount.
 * Returns 0, or EFAULT with the first violation described in `why` (may be NULL). Costs
 * O(blocks + pages mapped so far); never calls the device. */
int msh_pool_check(struct msh_pool *pool, char *why, size_t whylen);

#endif
