/*
 * policy.h: allocator policies the replay can run a recorded stream through, behind one interface.
 *
 *  - memshim: the real pool (policy/pool/) over the simulated device (policy_memshim.c);
 *  - torch: a model of PyTorch's native CUDA caching allocator (model_torch.c);
 *  - torch-expandable: the same allocator with expandable_segments:True (model_expandable.c).
 *
 * Every policy simulates a device of `capacity` bytes (0 = unlimited): an allocation that cannot be
 * served within it is an OOM (ENOMEM), counted, and the stream goes on. The torch models also
 * take the allocator settings PyTorch users set in PYTORCH_CUDA_ALLOC_CONF (struct msh_torch_conf)
 * and can be seeded with the segment layout a snapshot recorded (docs/models.md).
 *
 * This header also declares the snapshot reader's extra output for the models: the recorded
 * segment events, the segments and blocks at dump time, and the recorded allocator settings.
 *
 * report/replay/models/ lives beside the replay that runs it (report/replay/main.c): it reads the
 * trace formats (report/trace) and drives the pool (policy/), both below it; the pool never
 * knows it is being replayed.
 */
#ifndef MSH_POLICY_H
#define MSH_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "drvcost.h"
#include "trace.h"

enum msh_policy_kind { MSH_POLICY_MEMSHIM = 0, MSH_POLICY_TORCH = 1, MSH_POLICY_TORCH_EXPANDABLE = 2 };
const char *msh_policy_name(enum msh_policy_kind k);
/* "memshim", "torch", "torch-expandable": 0 and *k, or EINVAL. */
int msh_policy_parse(const char *s, enum msh_policy_kind *k);

/* ---- PyTorch allocator settings (CUDAAllocatorConfig) ----------------------------------------- */
#define MSH_TORCH_DIVS 16 /* roundup_power2_divisions intervals: [1MiB..64GiB) by powers of two */
struct msh_torch_conf {
    uint64_t max_split_size;         /* bytes; UINT64_MAX = unset (the default) */
    double gc_threshold;             /* garbage_collection_threshold; 0 = off */
    bool expandable;                 /* expandable_segments:True */
    unsigned divisions[MSH_TORCH_DIVS]; /* roundup_power2_divisions per interval; 0/1 = off */
};
void msh_torch_conf_default(struct msh_torch_conf *c);
/* Apply a PYTORCH_CUDA_ALLOC_CONF string ("max_split_size_mb:128,roundup_power2_divisions:[256:1,
 * >:4],garbage_collection_threshold:0.6,expandable_segments:True") on top of *c. Keys PyTorch has
 * that do not change placement (pinned_*, release_lock_on_cudamalloc...) are accepted and ignored.
 * Returns 0, or EINVAL with a one-line reason in err. */
int msh_torch_conf_parse(const char *s, struct msh_torch_conf *c, char *err, size_t errlen);
/* The settings as a PYTORCH_CUDA_ALLOC_CONF string (only what differs from the default). */
void msh_torch_conf_format(const struct msh_torch_conf *c, char *buf, size_t len);
/* PyTorch's round_size(): 512-byte rounding, or roundup_power2_divisions. */
uint64_t msh_torch_round_size(const struct msh_torch_conf *c, uint64_t size);
/* PyTorch's get_allocation_size(): the segment size cudaMalloc is asked for. */
uint64_t msh_torch_allocation_size(uint64_t rounded);

/* ---- the common interface ---------------------------------------------------------------------- */
struct msh_policy_stats {
    uint64_t reserved, peak_reserved;       /* bytes held from the device (segments / mapped pages) */
    uint64_t live_bytes, peak_live_bytes;   /* requested bytes of live blocks */
    uint64_t segs_created, segs_freed;      /* cudaMalloc / cudaFree (torch); create/release (memshim) */
    uint64_t bytes_created, bytes_freed;
    uint64_t map_ops, unmap_ops;            /* memshim: page maps; expandable: segment_map/unmap */
    uint64_t ooms;                          /* requests the policy could not serve */
    uint64_t seeded_bytes;                  /* torch: segments that existed before the stream */
    /* Driver calls by kind (drvcost.h) and the bytes they covered: memshim's pool counts its own;
     * the torch models count what PyTorch's allocator would call (docs/models.md). */
    uint64_t drv_calls[MSH_DRV_NKINDS], drv_bytes[MSH_DRV_NKINDS];
    uint64_t drv_maps[MSH_DRV_NKINDS];      /* the mappings those calls covered (drvcost.h) */
    /* reserved and live bytes at the first allocation that saw the reserved peak, once it holds
     * its block (docs/reports.md, fragmentation.reserved_minus_allocated_at_peak_bytes) */
    uint64_t at_peak_reserved, at_peak_live;
};

struct msh_policy;
struct msh_policy_ops {
    int (*alloc)(struct msh_policy *p, uint64_t size, uint64_t stream, uint64_t *addr);
    int (*free)(struct msh_policy *p, uint64_t addr, uint64_t stream);
    void (*empty_cache)(struct msh_policy *p);
    void (*stats)(struct msh_policy *p, struct msh_policy_stats *out);
    void (*destroy)(struct msh_policy *p);
    /* the peaks (and the pair at the reserved peak) restart at the current figures: the replay's
     * steps, one per pass */
    void (*reset_peaks)(struct msh_policy *p);
};
struct msh_policy {
    const struct msh_policy_ops *ops;
    enum msh_policy_kind kind;
};

/* conf: for the torch policies (NULL = defaults); kind TORCH with conf->expandable set behaves as
 * TORCH_EXPANDABLE. granularity: memshim's page size (0 = 2 MiB). Returns 0 or an errno. */
int msh_policy_create(enum msh_policy_kind kind, uint64_t capacity, const struct msh_torch_conf *conf,
                      uint64_t granularity, struct msh_policy **out);
static inline int msh_policy_alloc(struct msh_policy *p, uint64_t size, uint64_t stream, uint64_t *addr)
{
    return p->ops->alloc(p, size, stream, addr);
}
/* EINVAL for an address that is not a live block (nothing changes). */
static inline int msh_policy_free(struct msh_policy *p, uint64_t addr, uint64_t stream)
{
    return p->ops->free(p, addr, stream);
}
static inline void msh_policy_empty_cache(struct msh_policy *p) { p->ops->empty_cache(p); }
static inline void msh_policy_get_stats(struct msh_policy *p, struct msh_policy_stats *s) { p->ops->stats(p, s); }
static inline void msh_policy_reset_peaks(struct msh_policy *p) { p->ops->reset_peaks(p); }
static inline void msh_policy_destroy(struct msh_policy *p)
{
    if (p) p->ops->destroy(p);
}
/* va_hint: the live peak the pool's virtual ranges must hold (0: 8 GiB); see main.c's replay(). */
/* memshim's pool with its front end (the default, as in tensor mode); false: without it
 * (memshim-replay --no-front). */
extern bool msh_memshim_policy_front;
int msh_memshim_policy_create(uint64_t capacity, uint64_t granularity, uint64_t va_hint, struct msh_policy **out);

/* ---- torch models: seeding, address hints, the segment log --------------------------------------
 * Seeding reproduces the allocator state when a recording began: first every segment that existed
 * (each one free block), then the blocks that were live (carved out of those free blocks at their
 * recorded addresses). Address hints: the driver's choice of address for each new segment cannot
 * be modelled, so a model may take it from the recording (the hint whose turn it is, when its size
 * is the size the model asks for and it overlaps no segment the model holds); else it uses
 * addresses of its own above 2^56. */
int msh_torch_seed_segment(struct msh_policy *p, uint64_t addr, uint64_t size, uint64_t stream, bool small);
/* block_size: the block's size in its segment (>= the rounded request). ENOENT when no free
 * block of a seeded segment covers [addr, addr + block_size). */
int msh_torch_seed_block(struct msh_policy *p, uint64_t addr, uint64_t block_size, uint64_t requested,
                         uint64_t stream);
struct msh_seg_hint { uint64_t addr, size; };
void msh_torch_set_hints(struct msh_policy *p, const struct msh_seg_hint *h, size_t n);
enum msh_segev_op { MSH_SEG_ALLOC = 0, MSH_SEG_FREE = 1, MSH_SEG_MAP = 2, MSH_SEG_UNMAP = 3 };
struct msh_segev {
    uint64_t addr, size, stream;
    size_t at;  /* index of the stream event before which it happened */
    uint8_t op; /* enum msh_segev_op */
};
/* Record segment events from now on; `at` is taken from msh_torch_set_clock(). */
void msh_torch_log_segments(struct msh_policy *p, bool on);
void msh_torch_set_clock(struct msh_policy *p, size_t at);
const struct msh_segev *msh_torch_segment_log(struct msh_policy *p, size_t *n);
/* Segments held now (address order): fills up to max, returns how many there are. */
struct msh_seg_info { uint64_t addr, size; bool small; };
size_t msh_torch_segments(struct msh_policy *p, struct msh_seg_info *out, size_t max);
/* Size of the block at a live address (0 if none): for tests. */
uint64_t msh_torch_block_size(struct msh_policy *p, uint64_t addr);
/* Bytes of free, cached blocks (mapped, not allocated). */
uint64_t msh_torch_cached_bytes(struct msh_policy *p);

/* ---- the snapshot reader's extra output (snapshot.c) ------------------------------------------- */
struct msh_snap_seg { uint64_t addr, size, stream; uint8_t small, expandable; };
struct msh_snap_blk { uint64_t addr, size, req; uint8_t active; };
struct msh_snap_dev {
    int device;
    struct msh_segev *ev; size_t nev;    /* recorded segment_alloc/free/map/unmap; `at` indexes the
                                          * device's msh_trace ev[] (prefix included) */
    struct msh_snap_seg *seg; size_t nseg; /* segments at dump time, address order */
    struct msh_snap_blk *blk; size_t nblk; /* their blocks, address order */
};
struct msh_snap_extra {
    struct msh_snap_dev *dev; size_t ndev; /* same order as the set's devices */
    bool has_settings;                     /* the snapshot has allocator_settings */
    struct msh_torch_conf conf;            /* the recorded settings (defaults when absent) */
};
/* As msh_trace_load_snapshot_mem(), also returning the extra output (*x, freed by the caller). */
int msh_snapshot_load_extra(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                            struct msh_snap_extra **x, char *err, size_t errlen);
void msh_snap_extra_free(struct msh_snap_extra *x);

/* ---- seeding a torch model from a snapshot ------------------------------------------------------
 * The segments that existed when the recording began (dump-time segments, minus those the window
 * allocated, plus those it freed), with the prefix blocks of t placed in them. Also installs the
 * recorded segment addresses as hints. Returns the number of prefix blocks placed (the others are
 * left for the replay to allocate); *placed (t->nprefix entries) says which. */
size_t msh_torch_seed_from_snapshot(struct msh_policy *p, const struct msh_trace *t,
                                    const struct msh_snap_dev *d, const struct msh_torch_conf *conf,
                                    uint8_t *placed);

#endif
