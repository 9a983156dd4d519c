/*
 * model_expandable.c: PyTorch's caching allocator with expandable_segments:True, as in
 * c10/cuda/CUDACachingAllocator.cpp (Note [Expandable Segments]), on model_torch.c's blocks.
 *
 * Reproduced, by PyTorch function:
 *  - find_expandable_block(): per (stream, pool) the lowest-address unmapped range whose free
 *    predecessor plus following free/unmapped space holds the request; else a new
 *    ExpandableSegment: a virtual range of 1 1/8 times the device memory (the capacity; 64 TiB
 *    when unlimited), mapped in pages of 2 MiB (small pool) or 20 MiB (large pool);
 *  - map_block(): maps the pages covering the request at the start of an unmapped range
 *    (SEGMENT_MAP), merging with free mapped neighbours; fails past the capacity;
 *  - try_allocate_expandable_block(): maps until the candidate is large enough;
 *  - get_free_block()'s expandable rule (a free block followed by unmapped space counts as that
 *    much larger for best fit) and should_split()'s 512-byte rule for every pool are in
 *    model_torch.c;
 *  - unmap_block() / release_blocks(): on emptyCache and on the OOM retry, every page wholly
 *    inside a free block is unmapped (SEGMENT_UNMAP); a segment left with no mapped page is
 *    released (release_expandable_segment()).
 * "Reserved" is the bytes mapped, as PyTorch counts it.
 */
#include "model_torch.h"

#include <stdlib.h>
#include <string.h>

static bool allocatable(const struct tm_block *b) { return b && !b->allocated; }

static bool has_space(const struct tm_block *b, uint64_t size)
{
    uint64_t bytes = 0;
    while (bytes < size && allocatable(b)) {
        bytes += b->size;
        b = b->next;
    }
    return bytes >= size;
}

static struct tm_block *find_expandable_block(struct tm_model *m, struct tm_pool *p, uint64_t stream, uint64_t size)
{
    struct tm_block key = {.stream = stream, .addr = 0};
    for (struct tm_block *it = tm_set_lower_bound(&p->unmapped, &key); it && it->stream == stream;
         it = tm_set_upper_bound(&p->unmapped, it)) {
        struct tm_block *c = it;
        if (allocatable(c->prev)) c = c->prev;
        if (has_space(c, size)) return c;
    }
    uint64_t page = p->small ? TM_SMALL_BUFFER : TM_LARGE_BUFFER;
    /* the reserved range only has to exceed any real capacity; clamping keeps the VA arithmetic
     * far from 64-bit overflow for absurd --capacity values */
    uint64_t total = m->capacity && m->capacity < (64ull << 40) ? m->capacity : (64ull << 40);
    uint64_t space = total + total / 8;
    space = (space + page - 1) / page * page;
    struct tm_xseg *es = calloc(1, sizeof *es);
    struct tm_block *c = tm_block_new(m);
    if (!es || !c) {
        free(es);
        if (c) tm_block_put(m, c);
        return NULL;
    }
    if (m->nxs == m->capxs) {
        size_t nc = m->capxs ? m->capxs * 2 : 8;
        struct tm_xseg **n = realloc(m->xs, nc * sizeof *n);
        if (!n) {
            free(es);
            tm_block_put(m, c);
            return NULL;
        }
        m->xs = n;
        m->capxs = nc;
    }
    /* virtual addresses of the model's own, aligned to the page */
    uint64_t base = (m->next_va + page - 1) / page * page;
    m->next_va = base + space;
    *es = (struct tm_xseg){.base = base, .size = space, .page = page, .stream = stream, .small = p->small};
    m->xs[m->nxs++] = es;
    tm_drv(m, MSH_DRV_RESERVE, 1, space); /* the ExpandableSegment constructor */
    c->addr = base;
    c->size = space;
    c->stream = stream;
    c->small = p->small;
    c->mapped = 0;
    c->es = es;
    tm_set_insert(&p->unmapped, c, (uint32_t)(base >> 21) * 2654435761u);
    return c;
}

static bool map_block(struct tm_model *m, struct tm_block *to_map, uint64_t size)
{
    struct tm_pool *p = tm_pool_of(m, to_map);
    uint64_t page = to_map->es->page;
    uint64_t bytes = (size + page - 1) / page * page; /* to_map starts on a page */
    if (bytes > to_map->size) bytes = to_map->size;
    if (!bytes) return false;
    if (m->capacity && m->st.reserved + bytes > m->capacity) {
        /* ExpandableSegment::map(): cuMemCreate page by page until one fails, then the pages it
         * created are released */
        uint64_t room = m->capacity > m->st.reserved ? (m->capacity - m->st.reserved) / page : 0;
        tm_drv(m, MSH_DRV_CREATE, room + 1, room * page);
        tm_drv(m, MSH_DRV_RELEASE, room, room * page);
        return false;
    }
    tm_set_erase(&p->unmapped, to_map);
    to_map->mapped = 1;
    if (bytes < to_map->size) {
        struct tm_block *rem = tm_block_new(m);
        if (!rem) return false;
        *rem = (struct tm_block){.addr = to_map->addr + bytes, .size = to_map->size - bytes, .stream = to_map->stream,
                                 .small = to_map->small, .mapped = 0, .es = to_map->es};
        rem->prev = to_map;
        rem->next = to_map->next;
        if (rem->next) rem->next->prev = rem;
        to_map->next = rem;
        tm_set_insert(&p->unmapped, rem, (uint32_t)(rem->addr >> 21) * 2654435761u + 1);
        to_map->size = bytes;
    }
    uint64_t at = to_map->addr;
    tm_try_merge(m, to_map, to_map->prev, p);
    tm_try_merge(m, to_map, to_map->next, p);
    tm_pool_insert(m, p, to_map);
    tm_reserve_add(m, bytes);
    /* mapAndSetAccess(): one cuMemCreate and one cuMemMap per page, then one cuMemSetAccess over
     * the whole range (no peers in the model) */
    tm_drv(m, MSH_DRV_CREATE, bytes / page, bytes);
    tm_drv(m, MSH_DRV_MAP, bytes / page, bytes);
    tm_drv(m, MSH_DRV_SET_ACCESS, 1, bytes);
    m->st.drv_maps[MSH_DRV_SET_ACCESS] += bytes / page - 1; /* the one grant covers every page's mapping */
    m->st.map_ops++;
    m->st.bytes_created += bytes;
    tm_log(m, MSH_SEG_MAP, at, bytes, to_map->stream);
    return true;
}

struct tm_block *tm_try_allocate_expandable(struct tm_model *m, struct tm_pool *p, uint64_t size, uint64_t stream)
{
    struct tm_block *c = find_expandable_block(m, p, stream, size);
    if (!c) return NULL;
    if (!c->mapped && !map_block(m, c, c->size < size ? c->size : size)) return NULL;
    while (c->size < size) {
        /* invariant: free -> unmapped -> ...; mapping the next range merges it into c */
        uint64_t rem = size - c->size;
        struct tm_block *nc = c->next;
        if (!nc || !map_block(m, nc, rem < nc->size ? rem : nc->size)) return NULL;
        c = nc;
    }
    tm_set_erase(&p->blocks, c);
    return c;
}

static void unmap_block(struct tm_model *m, struct tm_block *b)
{
    struct tm_pool *p = tm_pool_of(m, b);
    struct tm_xseg *es = b->es;
    uint64_t page = es->page;
    uint64_t begin = es->base + (b->addr - es->base + page - 1) / page * page;
    uint64_t end = es->base + (b->addr + b->size - es->base) / page * page;
    if (end <= begin) return;
    tm_set_erase(&p->blocks, b);
    if (begin > b->addr) {
        struct tm_block *bf = tm_block_new(m);
        if (!bf) return;
        *bf = (struct tm_block){.addr = b->addr, .size = begin - b->addr, .stream = b->stream, .small = b->small,
                                .mapped = 1, .es = es};
        bf->prev = b->prev;
        if (bf->prev) bf->prev->next = bf;
        bf->next = b;
        b->prev = bf;
        tm_pool_insert(m, p, bf);
    }
    if (b->addr + b->size > end) {
        struct tm_block *af = tm_block_new(m);
        if (!af) return;
        *af = (struct tm_block){.addr = end, .size = b->addr + b->size - end, .stream = b->stream, .small = b->small,
                                .mapped = 1, .es = es};
        af->next = b->next;
        if (af->next) af->next->prev = af;
        af->prev = b;
        b->next = af;
        tm_pool_insert(m, p, af);
    }
    b->addr = begin;
    b->size = end - begin;
    b->mapped = 0;
    tm_try_merge(m, b, b->prev, p);
    tm_try_merge(m, b, b->next, p);
    tm_set_insert(&p->unmapped, b, (uint32_t)(b->addr >> 21) * 2654435761u + 3);
    m->st.reserved -= end - begin;
    /* unmapHandles(): a stream synchronize, then cuMemUnmap and cuMemRelease per page */
    tm_drv(m, MSH_DRV_SYNCHRONIZE, 1, 0);
    tm_drv(m, MSH_DRV_UNMAP, (end - begin) / page, end - begin);
    tm_drv(m, MSH_DRV_RELEASE, (end - begin) / page, end - begin);
    m->st.unmap_ops++;
    m->st.bytes_freed += end - begin;
    tm_log(m, MSH_SEG_UNMAP, begin, end - begin, b->stream);
}

void tm_release_expandable_blocks(struct tm_model *m, struct tm_block **blocks, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct tm_block *b = blocks[i];
        unmap_block(m, b);
        if (!b->prev && !b->next && !b->mapped) { /* release_expandable_segment() */
            struct tm_pool *p = tm_pool_of(m, b);
            tm_set_erase(&p->unmapped, b);
            tm_drv(m, MSH_DRV_UNRESERVE, 1, b->es->size); /* ~ExpandableSegment: cuMemAddressFree */
            for (size_t j = 0; j < m->nxs; j++)
                if (m->xs[j] == b->es) {
                    free(m->xs[j]);
                    m->xs[j] = m->xs[--m->nxs];
                    break;
                }
            tm_block_put(m, b);
        }
    }
}

void tm_expandable_destroy(struct tm_model *m)
{
    for (size_t i = 0; i < m->nxs; i++) free(m->xs[i]);
    free(m->xs);
    m->xs = NULL;
    m->nxs = m->capxs = 0;
}
