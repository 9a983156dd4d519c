/*
 * core.h: process-wide state of libmemshim.so (shim/core.c): start-up, the per-device pools,
 * epochs, accounting of memory memshim does not serve, and shutdown. The hooks (hooks/) call
 * only this and the pool; nothing here calls a hook.
 */
#ifndef MSH_CORE_H
#define MSH_CORE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "msh.h"
#include "pool.h"

/* The shim's per-thread state on the allocation path, in one block (issue 30): with TLS
 * descriptors each thread-local variable a function touches costs a call to find it, and the
 * tensor-mode entry touched three. */
struct msh_core_tls {
    int in_hook;          /* msh_in_hook: the re-entry guard, set while a hook or memshim itself is
                           * working on this thread; a hook that finds it set passes straight
                           * through to the real function */
    int tensor_alloc;     /* core.c in_tensor_alloc: inside msh_core_alloc (a GC threshold may collect there) */
    int64_t tick_left;    /* msh_tick_left */
};
extern __thread struct msh_core_tls msh_core_tls;
/* The address of a thread-local, found once: GCC otherwise recomputes it (a TLS descriptor call)
 * at every use rather than keep it in a register; the empty asm makes the value opaque. */
#define MSH_TLS_ADDR(var) ({ __typeof__(&(var)) a_ = &(var); __asm__("" : "+r"(a_)); a_; })
#define msh_in_hook (msh_core_tls.in_hook)

/* Idempotent and thread-safe. Reads the configuration, opens the log, registers atexit/atfork.
 * Returns true when memshim may serve memory (mode is not off and a driver is usable). */
bool msh_core_init(void);
/* True once start-up has run and memshim serves memory; never starts it (no driver call). */
bool msh_core_started(void);
/* MEMSHIM_EPOCH=auto with neither MEMSHIM_EPOCH_STEPS nor _SECONDS: epochs come from the Python
 * detector (hooks/python/memshim/_epochs.py). False until start-up. */
bool msh_core_epoch_detect(void);
/* Close the current epoch with `reason` (a static string: manual, dataloader, ...), where the GC
 * step may run (the caller holds the GIL or is not Python). */
void msh_core_epoch(const char *reason);
/* The device behind device's pool (for more pools on the same device), or NULL without a pool. */
struct msh_device *msh_core_device(int device);
/* The effective mode after start-up (enum msh_mode; AUTO resolves to SEGMENT or TENSOR). */
int msh_core_mode(void);

/* The pool of `device`, created on first use (the caller has made a context current for that
 * device, as the CUDA runtime does). NULL when no pool can exist: the caller passes through. */
struct msh_pool *msh_core_pool(int device);
/* The pool of `device` if it exists (never creates one), or NULL. */
struct msh_pool *msh_core_pool_get(int device);
/* The pool that handed out `addr`, or NULL; *device gets its ordinal. */
struct msh_pool *msh_core_pool_owning(uint64_t addr, int *device);

/* Wait for all work on `device` (its primary context, whatever context is current). 0 or an
 * errno; ENODEV when memshim has no pool there. */
int msh_core_sync_device(int device);

/* Memory that memshim does not serve but accounts ("other" in reports). */
enum msh_ext_kind { MSH_EXT_MALLOC, MSH_EXT_ASYNC, MSH_EXT_VMM, MSH_EXT_NKINDS };
void msh_core_note_external(int device, int kind, int64_t delta_bytes);
/* Append one event to MEMSHIM_TRACE_FILE (op 'a' alloc, 'f' free) and to the snapshot's history
 * ring; two loads when neither is on. */
void msh_core_trace_slow(char op, int device, uint64_t stream, uint64_t addr, uint64_t size);
extern _Atomic bool msh_core_tracing_on;
extern _Atomic int msh_history_on;
static inline void msh_core_trace(char op, int device, uint64_t stream, uint64_t addr, uint64_t size)
{
    if (MSH_UNLIKELY(atomic_load_explicit(&msh_core_tracing_on, memory_order_relaxed) ||
                     atomic_load_explicit(&msh_history_on, memory_order_relaxed)))
        msh_core_trace_slow(op, device, stream, addr, size);
}
/* Whether MEMSHIM_TRACE_FILE is being written (callers skip trace-only work when not). */
bool msh_core_tracing(void);
/* A request failed after the whole rescue chain: an OOM report (capped) and MEMSHIM_SNAPSHOT's OOM
 * snapshot. Written on this thread, except for a request refused before any driver work (larger
 * than the device or the limit alone): the watcher thread writes its files (issue 31). */
void msh_core_note_oom(int device);
/* The watcher's side of it: OOM report `index` and OOM snapshot `snap` (-1: none) of a failure on
 * `device`, the report showing `o` as its last_oom. */
void msh_core_write_oom(int device, int index, int snap, const struct msh_pool_oom *o);
/* What runs now and then on the allocation path, not per call (issue 30): a due time or
 * signal epoch closed between two allocations, the GC threshold checked. The allocating threads
 * reach it through msh_core_count: a per-thread countdown of bytes (each call counts
 * MSH_TICK_CALL_BYTES more, so that small requests get there too), or at once when the watcher
 * thread raised msh_watch_flag (an epoch is due). No clock and no shared counter per call. */
void msh_core_tick(void);
#define MSH_TICK_BYTES ((int64_t)64 << 20)
#define MSH_TICK_CALL_BYTES ((int64_t)64 << 10)
#define msh_tick_left (msh_core_tls.tick_left)
extern _Atomic int msh_watch_flag;
static inline void msh_core_count_at(struct msh_core_tls *tl, size_t bytes) /* tl: &msh_core_tls */
{
    tl->tick_left -= (int64_t)bytes + MSH_TICK_CALL_BYTES;
    if (MSH_UNLIKELY(tl->tick_left <= 0 || atomic_load_explicit(&msh_watch_flag, memory_order_relaxed)))
        msh_core_tick();
}
static inline void msh_core_count(size_t bytes)
{
    msh_core_count_at(&msh_core_tls, bytes);
}
/* Tensor mode's allocation (memshim_malloc; memshim_torch_alloc with counted: PyTorch's
 * memory_allocated() counts it). */
void *msh_core_alloc(ssize_t size, int device, void *stream, bool counted);
/* Close the current epoch with `reason` (a static string) from memshim's watcher thread
 * (seconds, signal): nothing once memshim has not started or the run is ending. */
void msh_core_close_epoch(const char *reason);
/* The end of the run, once per process: `interrupted` by signal `signo` (a signal, or Python's
 * uncaught KeyboardInterrupt), the epoch in progress is written as an epoch with reason
 * `interrupted` when it saw a step or an allocation; then the trace is flushed, the summary
 * (reason `exit` or `interrupted`) and MEMSHIM_SNAPSHOT are written. A second caller waits for
 * the first (a few seconds at most) and returns. */
void msh_core_finish(bool interrupted, int signo);

/* (shim/report_feed.c) Fill in what a report shows besides the pools' figures: the versions,
 * each device's name, allocation sites and PyTorch's memory_stats(); just before it is written,
 * never with a pool lock held. */
struct msh_report;
void msh_report_feed(struct msh_report *r);

#endif
