/*
 * history.h: memshim's allocation history for PyTorch memory snapshots (shim/record/history.c)
 * and the snapshot writer that turns it into PyTorch's pickle (shim/record/snapwrite.c).
 *
 * The history is a bounded ring of the last N events (alloc, free_requested, free_completed,
 * segment_map, segment_unmap, oom, snapshot), recorded when MEMSHIM_SNAPSHOT is set or when
 * Python turns it on (torch.cuda.memory._record_memory_history() through
 * hooks/python/memshim/_history.py). The pages each pool has mapped are always tracked (a
 * wrapper around the device backend's map/unmap), so a snapshot's `segments` are exact even when
 * recording starts late. Recording happens under the pool lock (map/unmap) or with no lock held
 * (alloc/free); the history lock is a leaf: nothing is called while holding it.
 *
 * shim/record/ is what records, kept with the shim it records for: it reads the pools through
 * core.h and the allocation sites through sites.h, and writes PyTorch's pickle with the trace
 * formats' writer (report/trace/pkwrite.h), a floor below. Nothing under report/ calls into it.
 */
#ifndef MSH_HISTORY_H
#define MSH_HISTORY_H

#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"

enum msh_hist_action {
    MSH_H_ALLOC, MSH_H_FREE_REQUESTED, MSH_H_FREE_COMPLETED, MSH_H_SEGMENT_MAP,
    MSH_H_SEGMENT_UNMAP, MSH_H_OOM, MSH_H_SNAPSHOT
};

struct msh_hist_event {
    uint64_t addr;    /* MSH_H_OOM: the device's free bytes */
    uint64_t size;    /* requested bytes (alloc/free), mapped bytes (map/unmap), requested (oom) */
    uint64_t stream;
    uint64_t time_us; /* wall clock, microseconds since 1970 (as PyTorch writes time_us) */
    uint32_t stack;   /* sites.h stack id (0: no frames) */
    uint8_t action, device;
};

/* Start-up: MEMSHIM_SNAPSHOT turns recording on with MEMSHIM_SNAPSHOT_EVENTS entries. */
void msh_history_init(bool reports_on);
extern _Atomic int msh_history_on; /* what msh_history_recording reads (a load on the hot path) */
static inline bool msh_history_recording(void)
{
    return atomic_load_explicit(&msh_history_on, memory_order_relaxed) != 0;
}
/* Called from msh_core_trace: op 'a' (alloc, after the pool placed it) or 'f' (free, before the
 * pool frees it); `size` is the requested size. */
void msh_history_note(char op, int device, uint64_t stream, uint64_t addr, uint64_t size);
/* A request failed after the whole rescue chain: its `oom` event in the history (a few stores,
 * on the failing thread); then the OOM snapshot file's number, claimed at once (-1: no
 * MEMSHIM_SNAPSHOT, or 16 written already), and the file, written by whichever thread the caller
 * chooses (shim/core.c: the watcher, for a request refused before any driver work). */
void msh_history_oom_event(int device);
int msh_history_oom_claim(void);
void msh_history_oom_write(int index);
/* Put the map/unmap/reserve wrappers around a device backend (before the pool uses it). */
void msh_history_wrap_device(struct msh_device *d);
/* Process exit: write MEMSHIM_SNAPSHOT. */
void msh_history_exit(void);

/* ---- for the snapshot writer ----------------------------------------------------------------- */
struct msh_hist_range { uint64_t va, size; };
struct msh_hist_copy {
    struct msh_hist_event *ev; /* this device's events, oldest first */
    size_t nev;
    struct msh_hist_range *mapped; /* mapped ranges (one per map call), unordered */
    size_t nmapped;
    struct msh_hist_range *reserved; /* reserved VA ranges */
    size_t nreserved;
    uint64_t gran; /* size of the device's map calls (0: none yet; UINT64_MAX: they differ) */
};
/* Copy device `device`'s events and mapped/reserved ranges into caller-allocated arrays of the
 * given capacities (the newest events when more exist). Returns 0, or ENOSPC when the mapped or
 * reserved ranges did not fit (nothing is copied then). */
int msh_history_copy(int device, struct msh_hist_copy *c, size_t evcap, size_t mapcap, size_t rescap);
/* Current sizes, to allocate the arrays for msh_history_copy (racy: add slack). */
void msh_history_sizes(int device, size_t *nev, size_t *nmapped, size_t *nreserved);
/* Append a `snapshot` event for `device` (when recording). */
void msh_history_mark_snapshot(int device);

/* snapwrite.c: the whole snapshot as pickle bytes (malloc'd; free() them). 0 or an errno. Must
 * not be called with a pool lock held. */
int msh_snapshot_build(unsigned char **out, size_t *len);
/* Build and write atomically (temp file + rename, mode 0600) to `path`. */
int msh_snapshot_write(const char *path);

#endif
