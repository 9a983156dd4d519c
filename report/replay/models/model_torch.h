/*
 * model_torch.h: internals shared by the two models of PyTorch's caching allocator
 * (model_torch.c: blocks, pools, best fit, splitting, merging, the OOM path; model_expandable.c:
 * expandable segments). Not a public interface: see policy.h.
 */
#ifndef MSH_MODEL_TORCH_H
#define MSH_MODEL_TORCH_H

#include "policy.h"

#define TM_MIN_BLOCK 512ull                 /* kMinBlockSize */
#define TM_SMALL_SIZE (1ull << 20)          /* kSmallSize */
#define TM_SMALL_BUFFER (2ull << 20)        /* kSmallBuffer */
#define TM_LARGE_BUFFER (20ull << 20)       /* kLargeBuffer */
#define TM_MIN_LARGE_ALLOC (10ull << 20)    /* kMinLargeAlloc */
#define TM_ROUND_LARGE (2ull << 20)         /* kRoundLarge */

struct tm_xseg;

struct tm_block {
    uint64_t addr, size, req, stream;
    struct tm_block *prev, *next; /* neighbours in the segment (PyTorch's split list) */
    struct tm_block *l, *r;       /* treap children (the block is in at most one set) */
    uint32_t prio;
    uint8_t allocated, mapped, small;
    int64_t gc_base;              /* gc_count_base */
    struct tm_xseg *es;           /* expandable segment, or NULL */
};

typedef int (*tm_cmp)(const struct tm_block *a, const struct tm_block *b);
struct tm_set {
    struct tm_block *root;
    tm_cmp cmp;
    size_t n;
};

struct tm_pool {
    struct tm_set blocks;   /* free mapped blocks, by (stream, size, addr): BlockComparatorSize */
    struct tm_set unmapped; /* unmapped ranges of expandable segments, by (stream, addr) */
    bool small;
    int64_t gc_calls;       /* get_free_blocks_call_count */
};

struct tm_xseg {
    uint64_t base, size, page, stream;
    bool small;
};

struct tm_seg { uint64_t addr, size; bool small; };

struct tm_model {
    struct msh_policy base;
    struct msh_torch_conf conf;
    uint64_t capacity;
    struct tm_pool small, large;
    /* live blocks by address (open addressing, backward-shift deletion) */
    struct tm_live { uint64_t k; struct tm_block *v; } *live;
    size_t live_cap, live_n;
    struct tm_seg *segs; size_t nsegs, capsegs; /* cudaMalloc'd segments, address order */
    struct tm_xseg **xs; size_t nxs, capxs;     /* expandable segments */
    const struct msh_seg_hint *hints; size_t nhints, hint_pos;
    struct msh_seg_hint *hints_owned;           /* hints installed by seeding */
    struct tm_block **chunks; size_t nchunks, capchunks; /* block storage */
    uint64_t next_va;
    bool logging; size_t clock;
    struct msh_segev *log; size_t nlog, caplog;
    struct msh_policy_stats st;
    struct tm_block *freelist;
    uint32_t rng;
};

/* model_torch.c */
struct tm_block *tm_block_new(struct tm_model *m);
void tm_block_put(struct tm_model *m, struct tm_block *b);
void tm_set_insert(struct tm_set *s, struct tm_block *b, uint32_t prio);
void tm_set_erase(struct tm_set *s, struct tm_block *b);
struct tm_block *tm_set_lower_bound(const struct tm_set *s, const struct tm_block *key);
struct tm_block *tm_set_upper_bound(const struct tm_set *s, const struct tm_block *key);
size_t tm_set_collect(const struct tm_set *s, struct tm_block **out);
void tm_pool_insert(struct tm_model *m, struct tm_pool *p, struct tm_block *b); /* insert_into_blocks */
size_t tm_try_merge(struct tm_model *m, struct tm_block *dst, struct tm_block *src, struct tm_pool *p);
void tm_log(struct tm_model *m, uint8_t op, uint64_t addr, uint64_t size, uint64_t stream);
void tm_reserve_add(struct tm_model *m, uint64_t bytes);
/* Count driver calls PyTorch's allocator would make (drvcost.h), each over one mapping. */
static inline void tm_drv(struct tm_model *m, enum msh_drv_call k, uint64_t calls, uint64_t bytes)
{
    m->st.drv_calls[k] += calls;
    m->st.drv_bytes[k] += bytes;
    m->st.drv_maps[k] += calls;
}
static inline struct tm_pool *tm_pool_of(struct tm_model *m, const struct tm_block *b)
{
    return b->small ? &m->small : &m->large;
}

/* model_expandable.c */
struct tm_block *tm_try_allocate_expandable(struct tm_model *m, struct tm_pool *p, uint64_t size,
                                            uint64_t stream);
void tm_release_expandable_blocks(struct tm_model *m, struct tm_block **blocks, size_t n);
void tm_expandable_destroy(struct tm_model *m);

#endif
