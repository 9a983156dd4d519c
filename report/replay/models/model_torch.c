/*
 * model_torch.c: a model of PyTorch's native CUDA caching allocator (DeviceCachingAllocator in
 * c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.x), written from its source for the replay.
 *
 * What it reproduces, by PyTorch function:
 *  - round_size(): requests round up to 512 bytes, or to a power-of-two division
 *    (roundup_power2_divisions, per size interval, as CUDAAllocatorConfig parses it);
 *  - get_pool(): requests up to 1 MiB use the small pool, larger ones the large pool;
 *  - get_allocation_size(): new segments are 2 MiB (small), 20 MiB (1-10 MiB requests), else the
 *    request rounded up to 2 MiB;
 *  - get_free_block(): best fit in a set ordered by (stream, size, address), so reuse is per
 *    stream; with max_split_size_mb, requests below it never take an oversize block and
 *    oversize requests take a cached block only within 20 MiB of their size;
 *  - should_split() / alloc_found_block(): the block is cut at its start; the remainder stays
 *    cached when it is at least 512 bytes (small pool) or more than 1 MiB (large pool, and only
 *    for requests below max_split_size);
 *  - free_block() / try_merge_blocks(): a freed block merges with free neighbours of its own
 *    segment only (segments never merge);
 *  - malloc()'s path when no cached block fits: garbage_collect_cached_blocks() (when a capacity
 *    and garbage_collection_threshold are set), alloc_block() (cudaMalloc: fails past the
 *    simulated capacity), release_available_cached_blocks() (oversize blocks, max_split_size
 *    only) and retry, release_cached_blocks() (every cached unsplit segment: emptyCache) and
 *    retry, else OOM;
 *  - release_block(): cudaFree of a whole segment.
 * Not modelled: streams' events (record_stream: frees here are complete at once), CUDA graph
 * private pools, free-memory callbacks, memory fractions other than --capacity (docs/models.md).
 * Expandable segments live in model_expandable.c and share these structures (model_torch.h).
 */
#include "model_torch.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TM_SYNTH_VA (1ull << 56) /* model-chosen segment addresses start here */

/* ---- settings ------------------------------------------------------------------------------ */
void msh_torch_conf_default(struct msh_torch_conf *c)
{
    memset(c, 0, sizeof *c);
    c->max_split_size = UINT64_MAX;
}

static bool is_pow2(uint64_t v) { return v && !(v & (v - 1)); }
static unsigned log2u(uint64_t v) { return 63u - (unsigned)__builtin_clzll(v); }

static int conf_fail(char *err, size_t errlen, const char *fmt, const char *a, const char *b)
{
    if (err && errlen) snprintf(err, errlen, fmt, a, b);
    return EINVAL;
}

/* One value token of the grammar: up to a ',' outside brackets. */
int msh_torch_conf_parse(const char *s, struct msh_torch_conf *c, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    if (!s) return 0;
    char *copy = strdup(s);
    if (!copy) return ENOMEM;
    int rc = 0;
    char *p = copy;
    while (*p && !rc) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        char *key = p;
        while (*p && *p != ':' && *p != ',') p++;
        if (*p != ':') {
            rc = conf_fail(err, errlen, "allocator setting '%s' has no ':value'%s", key, "");
            break;
        }
        *p++ = 0;
        char *val = p;
        if (*p == '[') {
            while (*p && *p != ']') p++;
            if (*p != ']') {
                rc = conf_fail(err, errlen, "allocator setting '%s': unterminated '['%s", key, "");
                break;
            }
            p++;
            if (*p && *p != ',') { /* "[...]x": text after the list is not a separator */
                rc = conf_fail(err, errlen, "allocator setting '%s': unexpected text after ']'%s", key, "");
                break;
            }
        } else {
            while (*p && *p != ',') p++;
        }
        if (*p) *p++ = 0;
        while (*key == ' ') key++;
        char *end = NULL;
        if (!strcmp(key, "max_split_size_mb")) {
            unsigned long long v = strtoull(val, &end, 10);
            if (end == val || *end) {
                rc = conf_fail(err, errlen, "max_split_size_mb '%s' is not a number of MiB%s", val, "");
                break;
            }
            if (v < TM_LARGE_BUFFER >> 20) v = TM_LARGE_BUFFER >> 20; /* PyTorch's floor: 20 MiB */
            c->max_split_size = v > (UINT64_MAX >> 20) ? UINT64_MAX : (uint64_t)v << 20;
        } else if (!strcmp(key, "garbage_collection_threshold")) {
            double v = strtod(val, &end);
            if (end == val || *end || !(v > 0.0 && v < 1.0)) {
                rc = conf_fail(err, errlen, "garbage_collection_threshold '%s' must be in (0, 1)%s", val, "");
                break;
            }
            c->gc_threshold = v;
        } else if (!strcmp(key, "expandable_segments")) {
            if (!strcmp(val, "True") || !strcmp(val, "true") || !strcmp(val, "1")) c->expandable = true;
            else if (!strcmp(val, "False") || !strcmp(val, "false") || !strcmp(val, "0")) c->expandable = false;
            else {
                rc = conf_fail(err, errlen, "expandable_segments '%s' must be True or False%s", val, "");
                break;
            }
        } else if (!strcmp(key, "roundup_power2_divisions")) {
            if (*val != '[') {
                unsigned long v = strtoul(val, &end, 10);
                if (end == val || *end || (v && !is_pow2(v)) || v > (1ul << 30)) {
                    rc = conf_fail(err, errlen, "roundup_power2_divisions '%s' must be a power of two%s", val, "");
                    break;
                }
                for (int i = 0; i < MSH_TORCH_DIVS; i++) c->divisions[i] = (unsigned)v;
            } else { /* [256:1,512:2,>:4]: keys are sizes in MiB (powers of two) or '>' */
                char *q = val + 1;
                size_t last = 0;
                bool first = true;
                while (*q && *q != ']' && !rc) {
                    char *k = q;
                    while (*q && *q != ':') q++;
                    if (*q != ':') {
                        rc = conf_fail(err, errlen, "roundup_power2_divisions '%s': expected key:value%s", val, "");
                        break;
                    }
                    *q++ = 0;
                    unsigned long d = strtoul(q, &end, 10);
                    if (end == q || (d && !is_pow2(d)) || d > (1ul << 30)) {
                        rc = conf_fail(err, errlen, "roundup_power2_divisions '%s': divisions must be powers of two%s", val, "");
                        break;
                    }
                    q = end;
                    if (*q == ',') q++;
                    if (!strcmp(k, ">")) {
                        for (size_t i = last; i < MSH_TORCH_DIVS; i++) c->divisions[i] = (unsigned)d;
                    } else {
                        unsigned long long mb = strtoull(k, &end, 10);
                        if (end == k || *end || !is_pow2(mb)) {
                            rc = conf_fail(err, errlen, "roundup_power2_divisions: '%s' is not a power-of-two size in MiB%s", k, "");
                            break;
                        }
                        size_t idx = log2u(mb);
                        if (idx > MSH_TORCH_DIVS - 1) idx = MSH_TORCH_DIVS - 1;
                        if (first)
                            for (size_t i = 0; i < idx; i++) c->divisions[i] = (unsigned)d;
                        c->divisions[idx] = (unsigned)d;
                        last = idx;
                        first = false;
                    }
                }
            }
        } else if (!strcmp(key, "backend") || !strncmp(key, "pinned_", 7) ||
                   !strcmp(key, "release_lock_on_cudamalloc") || !strcmp(key, "graph_capture_record_stream_reuse") ||
                   !strcmp(key, "per_process_memory_fraction")) {
            /* accepted, no effect on placement in the model */
        } else {
            rc = conf_fail(err, errlen,
                           "unknown allocator setting '%s' (known: max_split_size_mb, roundup_power2_divisions, "
                           "garbage_collection_threshold, expandable_segments)%s", key, "");
        }
    }
    free(copy);
    return rc;
}

void msh_torch_conf_format(const struct msh_torch_conf *c, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = 0;
#define APP(...) do { int w_ = snprintf(buf + o, o < len ? len - o : 0, __VA_ARGS__); if (w_ > 0) o += (size_t)w_; } while (0)
    if (c->max_split_size != UINT64_MAX) APP("%smax_split_size_mb:%llu", o ? "," : "", (unsigned long long)(c->max_split_size >> 20));
    bool anydiv = false;
    for (int i = 0; i < MSH_TORCH_DIVS; i++) anydiv |= c->divisions[i] > 1;
    if (anydiv) {
        APP("%sroundup_power2_divisions:[", o ? "," : "");
        for (int i = 0; i < MSH_TORCH_DIVS; i++) APP("%s%llu:%u", i ? "," : "", 1ull << i, c->divisions[i]);
        APP("]");
    }
    if (c->gc_threshold > 0) APP("%sgarbage_collection_threshold:%g", o ? "," : "", c->gc_threshold);
    if (c->expandable) APP("%sexpandable_segments:True", o ? "," : "");
#undef APP
    if (o >= len && len) buf[len - 1] = 0;
}

uint64_t msh_torch_round_size(const struct msh_torch_conf *c, uint64_t size)
{
    if (size < TM_MIN_BLOCK) return TM_MIN_BLOCK;
    unsigned lg = log2u(size);
    unsigned idx = lg > 20 ? lg - 20 : 0;
    if (idx > MSH_TORCH_DIVS - 1) idx = MSH_TORCH_DIVS - 1;
    unsigned div = c ? c->divisions[idx] : 0;
    if (div > 1 && size > TM_MIN_BLOCK * div) { /* roundup_power2_next_division() */
        if (is_pow2(size)) return size;
        uint64_t floor2 = 1ull << lg;
        uint64_t step = floor2 >> log2u(div);
        if (!step) return floor2 << 1;
        uint64_t f = size & ~(step - 1);
        return f == size ? size : f + step;
    }
    return (size + TM_MIN_BLOCK - 1) / TM_MIN_BLOCK * TM_MIN_BLOCK;
}

uint64_t msh_torch_allocation_size(uint64_t size)
{
    if (size <= TM_SMALL_SIZE) return TM_SMALL_BUFFER;
    if (size < TM_MIN_LARGE_ALLOC) return TM_LARGE_BUFFER;
    return (size + TM_ROUND_LARGE - 1) / TM_ROUND_LARGE * TM_ROUND_LARGE;
}

/* ---- blocks and ordered sets (a treap keyed by a comparator) ---------------------------------- */
#define TM_CHUNK 1024

struct tm_block *tm_block_new(struct tm_model *m)
{
    if (!m->freelist) {
        struct tm_block *c = calloc(TM_CHUNK, sizeof *c);
        if (!c) return NULL;
        if (m->nchunks == m->capchunks) {
            size_t nc = m->capchunks ? m->capchunks * 2 : 16;
            struct tm_block **n = realloc(m->chunks, nc * sizeof *n);
            if (!n) {
                free(c);
                return NULL;
            }
            m->chunks = n;
            m->capchunks = nc;
        }
        m->chunks[m->nchunks++] = c;
        for (int i = TM_CHUNK - 1; i >= 0; i--) {
            c[i].next = m->freelist;
            m->freelist = &c[i];
        }
    }
    struct tm_block *b = m->freelist;
    m->freelist = b->next;
    memset(b, 0, sizeof *b);
    b->mapped = 1;
    return b;
}

void tm_block_put(struct tm_model *m, struct tm_block *b)
{
    b->next = m->freelist;
    m->freelist = b;
}

static struct tm_block *tm_merge_t(struct tm_block *a, struct tm_block *b)
{
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->r = tm_merge_t(a->r, b);
        return a;
    }
    b->l = tm_merge_t(a, b->l);
    return b;
}

static void tm_split_t(struct tm_block *t, const struct tm_block *key, tm_cmp cmp, struct tm_block **l,
                       struct tm_block **r)
{
    if (!t) {
        *l = *r = NULL;
        return;
    }
    if (cmp(t, key) < 0) {
        tm_split_t(t->r, key, cmp, &t->r, r);
        *l = t;
    } else {
        tm_split_t(t->l, key, cmp, l, &t->l);
        *r = t;
    }
}

void tm_set_insert(struct tm_set *s, struct tm_block *b, uint32_t prio)
{
    struct tm_block *l, *r;
    b->l = b->r = NULL;
    b->prio = prio;
    tm_split_t(s->root, b, s->cmp, &l, &r);
    s->root = tm_merge_t(tm_merge_t(l, b), r);
    s->n++;
}

static struct tm_block *tm_erase_t(struct tm_block *t, const struct tm_block *b, tm_cmp cmp, bool *found)
{
    if (!t) return NULL;
    if (t == b) {
        *found = true;
        return tm_merge_t(t->l, t->r);
    }
    if (cmp(b, t) < 0) t->l = tm_erase_t(t->l, b, cmp, found);
    else t->r = tm_erase_t(t->r, b, cmp, found);
    return t;
}

void tm_set_erase(struct tm_set *s, struct tm_block *b)
{
    bool found = false;
    s->root = tm_erase_t(s->root, b, s->cmp, &found);
    if (found) s->n--;
    b->l = b->r = NULL;
}

struct tm_block *tm_set_lower_bound(const struct tm_set *s, const struct tm_block *key)
{
    struct tm_block *res = NULL, *t = s->root;
    while (t) {
        if (s->cmp(t, key) >= 0) {
            res = t;
            t = t->l;
        } else {
            t = t->r;
        }
    }
    return res;
}

struct tm_block *tm_set_upper_bound(const struct tm_set *s, const struct tm_block *key)
{
    struct tm_block *res = NULL, *t = s->root;
    while (t) {
        if (s->cmp(t, key) > 0) {
            res = t;
            t = t->l;
        } else {
            t = t->r;
        }
    }
    return res;
}

/* last element < key */
static struct tm_block *tm_set_pred(const struct tm_set *s, const struct tm_block *key)
{
    struct tm_block *res = NULL, *t = s->root;
    while (t) {
        if (s->cmp(t, key) < 0) {
            res = t;
            t = t->r;
        } else {
            t = t->l;
        }
    }
    return res;
}

static size_t collect_t(const struct tm_block *t, struct tm_block **out, size_t n)
{
    if (!t) return n;
    n = collect_t(t->l, out, n);
    if (out) out[n] = (struct tm_block *)t;
    n++;
    return collect_t(t->r, out, n);
}

size_t tm_set_collect(const struct tm_set *s, struct tm_block **out) { return collect_t(s->root, out, 0); }

static int cmp_u64(uint64_t a, uint64_t b) { return a < b ? -1 : a > b; }
static int cmp_size(const struct tm_block *a, const struct tm_block *b) /* BlockComparatorSize */
{
    int c = cmp_u64(a->stream, b->stream);
    if (!c) c = cmp_u64(a->size, b->size);
    if (!c) c = cmp_u64(a->addr, b->addr);
    return c;
}
static int cmp_addr(const struct tm_block *a, const struct tm_block *b) /* BlockComparatorAddress */
{
    int c = cmp_u64(a->stream, b->stream);
    if (!c) c = cmp_u64(a->addr, b->addr);
    return c;
}

static uint32_t tm_rand(struct tm_model *m)
{
    m->rng ^= m->rng << 13;
    m->rng ^= m->rng >> 17;
    m->rng ^= m->rng << 5;
    return m->rng;
}

void tm_pool_insert(struct tm_model *m, struct tm_pool *p, struct tm_block *b)
{
    b->gc_base = p->gc_calls;
    tm_set_insert(&p->blocks, b, tm_rand(m));
}

/* ---- live map, segment list ----------------------------------------------------------------- */
static size_t live_slot(const struct tm_model *m, uint64_t k)
{
    return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20) & (m->live_cap - 1);
}

static int live_grow(struct tm_model *m)
{
    size_t oc = m->live_cap, nc = oc ? oc * 2 : 4096;
    struct tm_live *old = m->live;
    m->live = calloc(nc, sizeof *m->live);
    if (!m->live) {
        m->live = old;
        return ENOMEM;
    }
    m->live_cap = nc;
    m->live_n = 0;
    for (size_t i = 0; i < oc; i++) {
        const struct tm_live *o = &old[i];
        if (!o->k) continue;
        size_t j = live_slot(m, o->k);
        while (m->live[j].k) j = (j + 1) & (m->live_cap - 1);
        m->live[j].k = o->k;
        m->live[j].v = o->v;
        m->live_n++;
    }
    free(old);
    return 0;
}

static int live_put(struct tm_model *m, struct tm_block *b)
{
    if ((m->live_n + 1) * 2 > m->live_cap && live_grow(m)) return ENOMEM;
    uint64_t k = b->addr + 1;
    size_t i = live_slot(m, k);
    while (m->live[i].k && m->live[i].k != k) i = (i + 1) & (m->live_cap - 1);
    if (!m->live[i].k) m->live_n++;
    m->live[i].k = k;
    m->live[i].v = b;
    return 0;
}

static struct tm_block *live_get(struct tm_model *m, uint64_t addr, bool del)
{
    if (!m->live_cap) return NULL;
    uint64_t k = addr + 1;
    size_t i = live_slot(m, k);
    while (m->live[i].k && m->live[i].k != k) i = (i + 1) & (m->live_cap - 1);
    if (!m->live[i].k) return NULL;
    struct tm_block *b = m->live[i].v;
    if (!del) return b;
    m->live[i].k = 0;
    m->live_n--;
    for (size_t j = (i + 1) & (m->live_cap - 1); m->live[j].k; j = (j + 1) & (m->live_cap - 1)) {
        size_t want = live_slot(m, m->live[j].k);
        if ((j > i && (want <= i || want > j)) || (j < i && (want <= i && want > j))) {
            m->live[i] = m->live[j];
            m->live[j].k = 0;
            i = j;
        }
    }
    return b;
}

/* index of the first segment with addr >= a */
static size_t seg_lb(const struct tm_model *m, uint64_t a)
{
    size_t lo = 0, hi = m->nsegs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (m->segs[mid].addr < a) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static bool seg_overlaps(const struct tm_model *m, uint64_t a, uint64_t size)
{
    size_t i = seg_lb(m, a);
    if (i < m->nsegs && m->segs[i].addr < a + size) return true;
    if (i > 0 && m->segs[i - 1].addr + m->segs[i - 1].size > a) return true;
    return false;
}

static int seg_add(struct tm_model *m, uint64_t a, uint64_t size, bool small)
{
    if (m->nsegs == m->capsegs) {
        size_t nc = m->capsegs ? m->capsegs * 2 : 256;
        struct tm_seg *n = realloc(m->segs, nc * sizeof *n);
        if (!n) return ENOMEM;
        m->segs = n;
        m->capsegs = nc;
    }
    size_t i = seg_lb(m, a);
    memmove(&m->segs[i + 1], &m->segs[i], (m->nsegs - i) * sizeof *m->segs);
    m->segs[i] = (struct tm_seg){a, size, small};
    m->nsegs++;
    return 0;
}

static void seg_del(struct tm_model *m, uint64_t a)
{
    size_t i = seg_lb(m, a);
    if (i >= m->nsegs || m->segs[i].addr != a) return;
    memmove(&m->segs[i], &m->segs[i + 1], (m->nsegs - i - 1) * sizeof *m->segs);
    m->nsegs--;
}

void tm_log(struct tm_model *m, uint8_t op, uint64_t addr, uint64_t size, uint64_t stream)
{
    if (!m->logging) return;
    if (m->nlog == m->caplog) {
        size_t nc = m->caplog ? m->caplog * 2 : 256;
        struct msh_segev *n = realloc(m->log, nc * sizeof *n);
        if (!n) return;
        m->log = n;
        m->caplog = nc;
    }
    m->log[m->nlog++] = (struct msh_segev){.addr = addr, .size = size, .stream = stream, .at = m->clock, .op = op};
}

void tm_reserve_add(struct tm_model *m, uint64_t bytes)
{
    m->st.reserved += bytes;
    if (m->st.reserved > m->st.peak_reserved) m->st.peak_reserved = m->st.reserved;
}

/* A block became live: the live peak, and the pair at the reserved peak (the first allocation that
 * saw the reserve at its highest, once it holds its block: memshim's pool measures it so too). */
static void tm_note_live(struct tm_model *m, uint64_t bytes)
{
    m->st.live_bytes += bytes;
    if (m->st.live_bytes > m->st.peak_live_bytes) m->st.peak_live_bytes = m->st.live_bytes;
    if (m->st.reserved > m->st.at_peak_reserved) {
        m->st.at_peak_reserved = m->st.reserved;
        m->st.at_peak_live = m->st.live_bytes;
    }
}

/* ---- the allocator ------------------------------------------------------------------------------ */
static struct tm_model *TM(struct msh_policy *p) { return (struct tm_model *)p; }

/* try_merge_blocks(): dst absorbs src when src is a free neighbour with the same mapped state. */
size_t tm_try_merge(struct tm_model *m, struct tm_block *dst, struct tm_block *src, struct tm_pool *p)
{
    if (!src || src->allocated || dst->mapped != src->mapped) return 0;
    if (dst->prev == src) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
    } else {
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    size_t sub = src->size;
    dst->size += sub;
    tm_set_erase(src->mapped ? &p->blocks : &p->unmapped, src);
    tm_block_put(m, src);
    return sub;
}

static uint64_t xsize(const struct tm_block *b)
{
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
}

/* get_free_block() */
static struct tm_block *get_free_block(struct tm_model *m, struct tm_pool *p, uint64_t size, uint64_t stream)
{
    if (m->capacity && m->conf.gc_threshold > 0) p->gc_calls++;
    struct tm_block key = {.stream = stream, .size = size, .addr = 0};
    struct tm_block *it = tm_set_lower_bound(&p->blocks, &key);
    if (!it || it->stream != stream) return NULL;
    if (it->es) {
        /* best fit counts the unmapped space right after a free block as part of it */
        struct tm_block *next = tm_set_upper_bound(&p->blocks, it);
        while (it->es && next && next->stream == stream && xsize(next) < xsize(it)) {
            it = next;
            next = tm_set_upper_bound(&p->blocks, it);
        }
    }
    uint64_t mss = m->conf.max_split_size;
    if (size < mss && it->size >= mss) return NULL;
    if (size >= mss && it->size >= size + TM_LARGE_BUFFER) return NULL;
    tm_set_erase(&p->blocks, it);
    return it;
}

static uint64_t pick_address(struct tm_model *m, uint64_t size)
{
    for (size_t j = m->hint_pos; j < m->nhints && j < m->hint_pos + 8; j++) {
        if (m->hints[j].size == size && !seg_overlaps(m, m->hints[j].addr, size)) {
            m->hint_pos = j + 1;
            return m->hints[j].addr;
        }
    }
    uint64_t a = m->next_va;
    m->next_va += (size + TM_ROUND_LARGE - 1) / TM_ROUND_LARGE * TM_ROUND_LARGE;
    return a;
}

/* alloc_block(): a new segment (cudaMalloc) or, with expandable segments, mapped pages. */
static struct tm_block *alloc_block(struct tm_model *m, struct tm_pool *p, uint64_t size, uint64_t alloc_size,
                                    uint64_t stream)
{
    /* a memory fraction (modelled as the capacity when GC is configured) caps reserved bytes */
    if (m->capacity && m->conf.gc_threshold > 0 && m->st.reserved + alloc_size > m->capacity) return NULL;
    if (m->conf.expandable) return tm_try_allocate_expandable(m, p, size, stream);
    if (m->capacity && m->st.reserved + alloc_size > m->capacity) { /* cudaMalloc OOM: a call all the same */
        tm_drv(m, MSH_DRV_MALLOC, 1, 0);
        return NULL;
    }
    struct tm_block *b = tm_block_new(m);
    uint64_t a = pick_address(m, alloc_size);
    if (!b || seg_add(m, a, alloc_size, p->small)) {
        if (b) tm_block_put(m, b);
        return NULL;
    }
    b->addr = a;
    b->size = alloc_size;
    b->stream = stream;
    b->small = p->small;
    tm_reserve_add(m, alloc_size);
    tm_drv(m, MSH_DRV_MALLOC, 1, alloc_size);
    m->st.segs_created++;
    m->st.bytes_created += alloc_size;
    tm_log(m, MSH_SEG_ALLOC, a, alloc_size, stream);
    return b;
}

/* release_block(): cudaFree of an unsplit cached segment. */
static void release_block(struct tm_model *m, struct tm_block *b)
{
    struct tm_pool *p = tm_pool_of(m, b);
    tm_log(m, MSH_SEG_FREE, b->addr, b->size, b->stream);
    m->st.reserved -= b->size;
    /* cudaFree synchronizes the device before it returns the memory */
    tm_drv(m, MSH_DRV_FREE, 1, b->size);
    tm_drv(m, MSH_DRV_SYNCHRONIZE, 1, 0);
    m->st.segs_freed++;
    m->st.bytes_freed += b->size;
    tm_set_erase(&p->blocks, b);
    seg_del(m, b->addr);
    tm_block_put(m, b);
}

/* release_available_cached_blocks(): only with max_split_size; frees oversize blocks. */
static bool release_available_cached_blocks(struct tm_model *m, struct tm_pool *p, uint64_t size, uint64_t stream)
{
    uint64_t mss = m->conf.max_split_size;
    if (mss == UINT64_MAX) return false;
    struct tm_block key = {.stream = stream, .size = size < mss ? mss : size, .addr = 0};
    struct tm_block *it = tm_set_lower_bound(&p->blocks, &key);
    if (!it || it->stream != stream) {
        struct tm_block *cur = tm_set_pred(&p->blocks, &key);
        if (!cur) return false;
        uint64_t total = 0;
        while (cur && total < key.size && cur->size >= mss && cur->stream == stream) {
            struct tm_block *prev = tm_set_pred(&p->blocks, cur);
            if (!cur->es && !cur->prev && !cur->next) {
                total += cur->size;
                release_block(m, cur);
            }
            cur = prev;
        }
        if (total < key.size) return false;
    } else {
        if (it->es || it->prev || it->next) return false;
        release_block(m, it);
    }
    return true;
}

/* release_blocks() of both pools: what emptyCache() and the last OOM retry do. */
static void release_cached_blocks(struct tm_model *m)
{
    struct tm_pool *pools[2] = {&m->large, &m->small};
    for (int i = 0; i < 2; i++) {
        struct tm_pool *p = pools[i];
        size_t n = p->blocks.n;
        if (!n) continue;
        struct tm_block **v = malloc(n * sizeof *v);
        if (!v) return;
        n = tm_set_collect(&p->blocks, v);
        size_t nx = 0;
        for (size_t j = 0; j < n; j++) {
            struct tm_block *b = v[j];
            if (b->es) v[nx++] = b; /* unmapping changes the set: gather them first */
            else if (!b->prev && !b->next) release_block(m, b);
        }
        if (nx) tm_release_expandable_blocks(m, v, nx);
        free(v);
    }
}

/* garbage_collect_cached_blocks(): with a capacity standing for the memory fraction. */
static void garbage_collect(struct tm_model *m)
{
    uint64_t thr = (uint64_t)(m->conf.gc_threshold * (double)m->capacity);
    if (m->st.reserved <= thr) return;
    uint64_t target = m->st.reserved - thr, got = 0;
    struct tm_pool *p = &m->large;
    size_t n = p->blocks.n;
    if (!n) return;
    struct tm_block **v = malloc(n * sizeof *v);
    if (!v) return;
    double total_age = 0;
    long cnt = 0;
    n = tm_set_collect(&p->blocks, v);
    for (size_t j = 0; j < n; j++)
        if (!v[j]->prev && !v[j]->next && !v[j]->es) {
            total_age += (double)(p->gc_calls - v[j]->gc_base);
            cnt++;
        }
    bool freed = true;
    while (got < target && freed && cnt > 0) {
        double thr_age = total_age / (double)cnt;
        freed = false;
        n = tm_set_collect(&p->blocks, v);
        for (size_t j = 0; j < n; j++) {
            struct tm_block *b = v[j];
            if (b->prev || b->next || b->es) continue;
            double age = (double)(p->gc_calls - b->gc_base);
            if (age >= thr_age) {
                freed = true;
                got += b->size;
                total_age -= age;
                cnt--;
                release_block(m, b);
            }
        }
    }
    free(v);
}

static bool should_split(const struct tm_model *m, const struct tm_block *b, uint64_t size)
{
    uint64_t rem = b->size - size;
    if (b->small || m->conf.expandable) return rem >= TM_MIN_BLOCK;
    return size < m->conf.max_split_size && rem > TM_SMALL_SIZE;
}

static int tm_alloc(struct msh_policy *pp, uint64_t orig, uint64_t stream, uint64_t *addr)
{
    struct tm_model *m = TM(pp);
    uint64_t size = msh_torch_round_size(&m->conf, orig);
    struct tm_pool *p = size <= TM_SMALL_SIZE ? &m->small : &m->large;
    uint64_t alloc_size = msh_torch_allocation_size(size);
    struct tm_block *b = get_free_block(m, p, size, stream);
    if (!b) {
        if (m->capacity && m->conf.gc_threshold > 0) garbage_collect(m);
        b = alloc_block(m, p, size, alloc_size, stream);
        if (!b && release_available_cached_blocks(m, p, size, stream)) b = alloc_block(m, p, size, alloc_size, stream);
        if (!b) {
            release_cached_blocks(m);
            b = alloc_block(m, p, size, alloc_size, stream);
        }
        if (!b) {
            m->st.ooms++;
            return ENOMEM;
        }
    }
    if (should_split(m, b, size)) { /* alloc_found_block(): the block takes the front */
        struct tm_block *nb = tm_block_new(m);
        if (!nb) return ENOMEM;
        nb->addr = b->addr;
        nb->size = size;
        nb->stream = stream;
        nb->small = b->small;
        nb->es = b->es;
        nb->prev = b->prev;
        if (nb->prev) nb->prev->next = nb;
        nb->next = b;
        b->prev = nb;
        b->addr += size;
        b->size -= size;
        tm_pool_insert(m, p, b);
        b = nb;
    }
    b->allocated = 1;
    b->req = orig;
    if (live_put(m, b)) return ENOMEM;
    tm_note_live(m, orig);
    *addr = b->addr;
    return 0;
}

static int tm_free(struct msh_policy *pp, uint64_t addr, uint64_t stream)
{
    struct tm_model *m = TM(pp);
    (void)stream; /* the block keeps its allocation stream; events are complete at once */
    struct tm_block *b = live_get(m, addr, true);
    if (!b) return EINVAL;
    b->allocated = 0;
    m->st.live_bytes -= b->req;
    struct tm_pool *p = tm_pool_of(m, b);
    tm_try_merge(m, b, b->prev, p); /* free_block() */
    tm_try_merge(m, b, b->next, p);
    tm_pool_insert(m, p, b);
    return 0;
}

static void tm_empty_cache(struct msh_policy *pp) { release_cached_blocks(TM(pp)); }

static void tm_stats(struct msh_policy *pp, struct msh_policy_stats *out) { *out = TM(pp)->st; }

static void tm_destroy(struct msh_policy *pp)
{
    struct tm_model *m = TM(pp);
    for (size_t i = 0; i < m->nchunks; i++) free(m->chunks[i]);
    free(m->chunks);
    tm_expandable_destroy(m);
    free(m->live);
    free(m->segs);
    free(m->log);
    free(m->hints_owned);
    free(m);
}

static void tm_reset_peaks(struct msh_policy *pp)
{
    struct msh_policy_stats *st = &TM(pp)->st;
    st->peak_reserved = st->at_peak_reserved = st->reserved;
    st->peak_live_bytes = st->at_peak_live = st->live_bytes;
}

static const struct msh_policy_ops tm_ops = {tm_alloc, tm_free, tm_empty_cache, tm_stats, tm_destroy, tm_reset_peaks};

static int tm_create(enum msh_policy_kind kind, uint64_t capacity, const struct msh_torch_conf *conf,
                     struct msh_policy **out)
{
    struct tm_model *m = calloc(1, sizeof *m);
    if (!m) return ENOMEM;
    m->base.ops = &tm_ops;
    if (conf) m->conf = *conf;
    else msh_torch_conf_default(&m->conf);
    if (kind == MSH_POLICY_TORCH_EXPANDABLE) m->conf.expandable = true;
    m->base.kind = m->conf.expandable ? MSH_POLICY_TORCH_EXPANDABLE : MSH_POLICY_TORCH;
    m->capacity = capacity;
    m->small = (struct tm_pool){.blocks = {.cmp = cmp_size}, .unmapped = {.cmp = cmp_addr}, .small = true};
    m->large = (struct tm_pool){.blocks = {.cmp = cmp_size}, .unmapped = {.cmp = cmp_addr}, .small = false};
    m->next_va = TM_SYNTH_VA;
    m->rng = 0x9E3779B9u;
    if (live_grow(m)) {
        free(m);
        return ENOMEM;
    }
    *out = &m->base;
    return 0;
}

/* ---- seeding, hints, log ------------------------------------------------------------------------ */
int msh_torch_seed_segment(struct msh_policy *pp, uint64_t addr, uint64_t size, uint64_t stream, bool small)
{
    struct tm_model *m = TM(pp);
    if (m->conf.expandable || !size || seg_overlaps(m, addr, size)) return EINVAL;
    struct tm_block *b = tm_block_new(m);
    if (!b) return ENOMEM;
    if (seg_add(m, addr, size, small)) {
        tm_block_put(m, b);
        return ENOMEM;
    }
    b->addr = addr;
    b->size = size;
    b->stream = stream;
    b->small = small;
    tm_reserve_add(m, size);
    /* the job paid a cudaMalloc for it before the recording began; memshim's replay pays for the
     * same memory when it allocates the prefix blocks, so the comparison charges both */
    tm_drv(m, MSH_DRV_MALLOC, 1, size);
    m->st.seeded_bytes += size;
    tm_pool_insert(m, tm_pool_of(m, b), b);
    return 0;
}

static struct tm_block *find_containing(struct tm_block *t, uint64_t a, uint64_t end)
{
    if (!t) return NULL;
    if (t->addr <= a && end <= t->addr + t->size) return t;
    struct tm_block *r = find_containing(t->l, a, end);
    return r ? r : find_containing(t->r, a, end);
}

int msh_torch_seed_block(struct msh_policy *pp, uint64_t addr, uint64_t bsize, uint64_t req, uint64_t stream)
{
    struct tm_model *m = TM(pp);
    size_t i = seg_lb(m, addr + 1);
    if (i == 0 || !bsize) return ENOENT;
    struct tm_seg *s = &m->segs[i - 1];
    if (addr + bsize > s->addr + s->size) return ENOENT;
    struct tm_pool *p = s->small ? &m->small : &m->large;
    struct tm_block *f = find_containing(p->blocks.root, addr, addr + bsize);
    if (!f) return ENOENT;
    tm_set_erase(&p->blocks, f);
    uint64_t before = addr - f->addr, after = f->addr + f->size - (addr + bsize);
    if (before) {
        struct tm_block *bf = tm_block_new(m);
        if (!bf) return ENOMEM;
        *bf = (struct tm_block){.addr = f->addr, .size = before, .stream = f->stream, .small = f->small, .mapped = 1};
        bf->prev = f->prev;
        if (bf->prev) bf->prev->next = bf;
        bf->next = f;
        f->prev = bf;
        tm_pool_insert(m, p, bf);
    }
    if (after) {
        struct tm_block *af = tm_block_new(m);
        if (!af) return ENOMEM;
        *af = (struct tm_block){.addr = addr + bsize, .size = after, .stream = f->stream, .small = f->small, .mapped = 1};
        af->next = f->next;
        if (af->next) af->next->prev = af;
        af->prev = f;
        f->next = af;
        tm_pool_insert(m, p, af);
    }
    f->addr = addr;
    f->size = bsize;
    f->allocated = 1;
    f->req = req;
    f->stream = stream;
    if (live_put(m, f)) return ENOMEM;
    tm_note_live(m, req);
    return 0;
}

void msh_torch_set_hints(struct msh_policy *pp, const struct msh_seg_hint *h, size_t n)
{
    struct tm_model *m = TM(pp);
    m->hints = h;
    m->nhints = n;
    m->hint_pos = 0;
}

void msh_torch_log_segments(struct msh_policy *pp, bool on) { TM(pp)->logging = on; }
void msh_torch_set_clock(struct msh_policy *pp, size_t at) { TM(pp)->clock = at; }
const struct msh_segev *msh_torch_segment_log(struct msh_policy *pp, size_t *n)
{
    *n = TM(pp)->nlog;
    return TM(pp)->log;
}

size_t msh_torch_segments(struct msh_policy *pp, struct msh_seg_info *out, size_t max)
{
    struct tm_model *m = TM(pp);
    if (!m->conf.expandable) {
        for (size_t i = 0; i < m->nsegs && i < max; i++)
            out[i] = (struct msh_seg_info){m->segs[i].addr, m->segs[i].size, m->segs[i].small};
        return m->nsegs;
    }
    /* expandable: one entry per expandable segment, its mapped bytes */
    size_t n = 0;
    for (size_t i = 0; i < m->nxs; i++) {
        if (n < max) out[n] = (struct msh_seg_info){m->xs[i]->base, 0, m->xs[i]->small};
        n++;
    }
    return n;
}

uint64_t msh_torch_block_size(struct msh_policy *pp, uint64_t addr)
{
    struct tm_block *b = live_get(TM(pp), addr, false);
    return b ? b->size : 0;
}

static uint64_t sum_t(const struct tm_block *t)
{
    return t ? t->size + sum_t(t->l) + sum_t(t->r) : 0;
}
uint64_t msh_torch_cached_bytes(struct msh_policy *pp)
{
    return sum_t(TM(pp)->small.blocks.root) + sum_t(TM(pp)->large.blocks.root);
}

/* ---- the common interface ------------------------------------------------------------------------ */
const char *msh_policy_name(enum msh_policy_kind k)
{
    switch (k) {
    case MSH_POLICY_MEMSHIM: return "memshim";
    case MSH_POLICY_TORCH: return "torch";
    case MSH_POLICY_TORCH_EXPANDABLE: return "torch-expandable";
    }
    return "?";
}

int msh_policy_parse(const char *s, enum msh_policy_kind *k)
{
    if (!strcmp(s, "memshim")) *k = MSH_POLICY_MEMSHIM;
    else if (!strcmp(s, "torch")) *k = MSH_POLICY_TORCH;
    else if (!strcmp(s, "torch-expandable")) *k = MSH_POLICY_TORCH_EXPANDABLE;
    else return EINVAL;
    return 0;
}

int msh_policy_create(enum msh_policy_kind kind, uint64_t capacity, const struct msh_torch_conf *conf,
                      uint64_t granularity, struct msh_policy **out)
{
    if (kind == MSH_POLICY_MEMSHIM) return msh_memshim_policy_create(capacity, granularity, 0, out);
    return tm_create(kind, capacity, conf, out);
}

/* ---- seeding from a snapshot ----------------------------------------------------------------------- */
struct seed_seg { uint64_t addr, size, stream; uint8_t small, live; };

static int by_seed_addr(const void *a, const void *b)
{
    const struct seed_seg *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static const struct msh_snap_blk *find_blk(const struct msh_snap_dev *d, uint64_t addr)
{
    size_t lo = 0, hi = d->nblk;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (d->blk[mid].addr < addr) lo = mid + 1;
        else hi = mid;
    }
    return lo < d->nblk && d->blk[lo].addr == addr ? &d->blk[lo] : NULL;
}

size_t msh_torch_seed_from_snapshot(struct msh_policy *pp, const struct msh_trace *t, const struct msh_snap_dev *d,
                                    const struct msh_torch_conf *conf, uint8_t *placed)
{
    struct tm_model *m = TM(pp);
    if (t->nprefix) memset(placed, 0, t->nprefix);
    if (m->conf.expandable || !d) return 0;
    for (size_t i = 0; i < d->nev; i++)
        if (d->ev[i].op == MSH_SEG_MAP || d->ev[i].op == MSH_SEG_UNMAP) return 0; /* an expandable recording */
    for (size_t i = 0; i < d->nseg; i++)
        if (d->seg[i].expandable) return 0;
    /* segments when recording began: the dump's, minus those the window allocated, plus those it freed */
    size_t cap = d->nseg + d->nev + 1, n = 0;
    struct seed_seg *s = calloc(cap, sizeof *s);
    struct msh_seg_hint *hints = calloc(d->nev + 1, sizeof *hints);
    if (!s || !hints) {
        free(s);
        free(hints);
        return 0;
    }
    for (size_t i = 0; i < d->nseg; i++)
        s[n++] = (struct seed_seg){d->seg[i].addr, d->seg[i].size, d->seg[i].stream, d->seg[i].small, 1};
    for (size_t k = d->nev; k-- > 0;) {
        const struct msh_segev *e = &d->ev[k];
        if (e->op == MSH_SEG_ALLOC) {
            for (size_t i = 0; i < n; i++)
                if (s[i].live && s[i].addr == e->addr) {
                    s[i].live = 0;
                    break;
                }
        } else if (e->op == MSH_SEG_FREE) {
            s[n++] = (struct seed_seg){e->addr, e->size, e->stream, e->size == TM_SMALL_BUFFER, 1};
        }
    }
    size_t w = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i].live) s[w++] = s[i];
    n = w;
    qsort(s, n, sizeof *s, by_seed_addr);
    for (size_t i = 0; i < n; i++) msh_torch_seed_segment(pp, s[i].addr, s[i].size, s[i].stream, s[i].small);
    /* prefix blocks: their size in the segment is the dump's when the block is still live at the
     * dump; else the rounded request, or the whole gap to the next live block when PyTorch would
     * not have split the remainder off */
    struct msh_addrmap first;
    size_t nplaced = 0;
    if (msh_addrmap_init(&first, t->n / 2 + 64) == 0) {
        for (size_t i = t->nprefix; i < t->n; i++) {
            struct msh_addrmap_ent *e = msh_addrmap_get(&first, t->ev[i].addr, 1);
            if (e && !e->seen) {
                e->seen = 1;
                e->mark = t->ev[i].op == MSH_OP_FREE ? 1 : 2;
            }
        }
        for (size_t i = 0; i < t->nprefix; i++) {
            const struct msh_trace_event *e = &t->ev[i];
            size_t j = 0;
            { /* containing initial segment */
                size_t lo = 0, hi = n;
                while (lo < hi) {
                    size_t mid = (lo + hi) / 2;
                    if (s[mid].addr <= e->addr) lo = mid + 1;
                    else hi = mid;
                }
                j = lo;
            }
            if (j == 0 || e->addr >= s[j - 1].addr + s[j - 1].size) continue;
            const struct seed_seg *sg = &s[j - 1];
            uint64_t seg_end = sg->addr + sg->size;
            uint64_t next = seg_end;
            if (i + 1 < t->nprefix && t->ev[i + 1].addr < seg_end) next = t->ev[i + 1].addr;
            uint64_t gap = next - e->addr, bsize;
            struct msh_addrmap_ent *fe = msh_addrmap_get(&first, e->addr, 0);
            const struct msh_snap_blk *db = find_blk(d, e->addr);
            if ((!fe || !fe->seen) && db && db->active && db->size <= gap) {
                bsize = db->size; /* live until the dump: its real size */
            } else {
                uint64_t r = msh_torch_round_size(conf, e->size);
                if (r > gap) r = gap;
                uint64_t rem = gap - r;
                bool split = sg->small ? rem >= TM_MIN_BLOCK
                                       : (r < (conf ? conf->max_split_size : UINT64_MAX) && rem > TM_SMALL_SIZE);
                bsize = split ? r : gap;
            }
            if (msh_torch_seed_block(pp, e->addr, bsize, e->size, e->stream) == 0) {
                placed[i] = 1;
                nplaced++;
            }
        }
        msh_addrmap_free(&first);
    }
    free(s);
    /* the recording's addresses for new segments, in order */
    size_t nh = 0;
    for (size_t i = 0; i < d->nev; i++)
        if (d->ev[i].op == MSH_SEG_ALLOC) hints[nh++] = (struct msh_seg_hint){d->ev[i].addr, d->ev[i].size};
    free(m->hints_owned);
    m->hints_owned = hints;
    msh_torch_set_hints(pp, hints, nh);
    return nplaced;
}
