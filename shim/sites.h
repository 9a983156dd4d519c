/*
 * sites.h: allocation sites (shim/sites.c). For the blocks memshim places in tensor mode it
 * records the Python call site (the first frame outside torch and memshim's own package, with a
 * few frames around it), interned once, and keeps live bytes per site and device: at the epoch's
 * peak, and at each epoch's end for the leak verdict. The snapshot writer (shim/record/) reads
 * the interned stacks for PyTorch's `frames`.
 *
 * Never called with a pool lock held; never calls a CUDA hook. CPython is resolved at run time
 * (dlsym), never linked; a process without CPython gets no sites and one note.
 */
#ifndef MSH_SITES_H
#define MSH_SITES_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "report.h"

/* Stack ids. 0: none. The pseudo stacks stand for allocations whose Python stack was not read. */
#define MSH_STACK_NONE 0u
#define MSH_STACK_BACKWARD 1u     /* a thread with no Python state: autograd's backward workers */
#define MSH_STACK_UNATTRIBUTED 2u /* a Python thread whose stack was not read (GIL busy, tables full) */

/* The stack captured by the last msh_sites_tag() on this thread; the history ring takes it
 * (and clears it) when it records the allocation. */
extern __thread uint32_t msh_sites_last_stack;

struct msh_pool;

/* Reads MEMSHIM_SITES / MEMSHIM_SITES_SAMPLE; `wanted`: reports or history are on. Idempotent. */
void msh_sites_init(bool wanted);
/* Capture every allocation's stack (no sampling) while the history ring records. */
void msh_sites_set_capture_all(bool on);

/* memshim_malloc is about to place `size` bytes: the mark the pool keeps on the block
 * (msh_pool_tags.next), 0 for a block whose site is not read (sampled out, or sites off). The
 * stack is read here, before any pool lock is taken. */
uint32_t msh_sites_tag_slow(size_t size);
extern _Atomic bool msh_sites_active; /* sites are read and accounted (a load on the hot path) */
static inline uint32_t msh_sites_tag(size_t size)
{
    return atomic_load_explicit(&msh_sites_active, memory_order_relaxed) ? msh_sites_tag_slow(size) : 0;
}
/* memshim_malloc placed `size` bytes with mark `tag` on `device` / memshim_free freed a block of
 * `size` requested bytes with mark `tag` (what msh_pool_free left in msh_pool_tags). Cheap when
 * off; a few ns for an untracked block. */
void msh_sites_alloc_slow(int device, uint32_t tag, size_t size);
void msh_sites_free_slow(int device, uint32_t tag, size_t size);
static inline void msh_sites_alloc(int device, uint32_t tag, size_t size)
{
    if (atomic_load_explicit(&msh_sites_active, memory_order_relaxed)) msh_sites_alloc_slow(device, tag, size);
}
static inline void msh_sites_free(int device, uint32_t tag, size_t size)
{
    if (atomic_load_explicit(&msh_sites_active, memory_order_relaxed)) msh_sites_free_slow(device, tag, size);
}

/* Epoch boundary: record each site's live bytes as the epoch's end (before the report is
 * built), then restart the peak tracking (after it). */
void msh_sites_epoch_end(void);
void msh_sites_epoch_reset(void);

/* Add a path prefix whose frames are library frames, never a site (the torch package, memshim's
 * Python package). Returns 0, EINVAL or ENOSPC. */
int msh_sites_add_internal_prefix(const char *prefix);

/* ---- for reports (the rows are report.h's: shim/report_feed.c hands them to the report) ---- */
/* Top sites of `device` by live bytes at the current epoch's peak, largest first. */
int msh_sites_top(int device, struct msh_site_row *rows, int max);
/* Sites whose live bytes at the end of each recorded epoch grew at every boundary (at least two
 * boundaries, each by at least 4 KiB or the sampling interval if larger), largest growth first. */
int msh_sites_growing(int device, struct msh_site_growth *rows, int max);
/* Why `sites` is empty or estimated, or NULL when there is nothing to say. */
const char *msh_sites_note(void);
/* Bytes below which allocations are sampled (0: every allocation is attributed exactly). */
uint64_t msh_sites_sample_bytes(void);

/* ---- for the snapshot writer ------------------------------------------------------------- */
struct msh_site_frame {
    const char *filename, *name;
    int line;
};
/* Frames of an interned stack, innermost first. Returns how many were written (0 for none). */
int msh_sites_stack_frames(uint32_t stack, struct msh_site_frame *out, int max);
#define MSH_SITE_MAX_FRAMES 16
/* The stacks of the live blocks at addrs[0..n) of `pool` (0 where unknown), in one lock hold
 * (the pool's: never call it with that lock held). */
void msh_sites_block_stacks(struct msh_pool *pool, const uint64_t *addrs, uint32_t *stacks, size_t n);
/* MEMSHIM_SPILL=host: the sites of the live blocks that have pages on host memory now, by host
 * bytes (rows' bytes: host bytes, count: blocks), largest first; *unattributed: host bytes of
 * blocks with no known site. Takes the pool's lock (never call it with that lock held). */
int msh_sites_spilled(struct msh_pool *pool, struct msh_site_row *rows, int max, uint64_t *unattributed);


#endif
