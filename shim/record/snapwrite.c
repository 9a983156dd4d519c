/*
 * snapwrite.c: memshim's state and history as a PyTorch memory snapshot: the pickled dict
 * torch.cuda.memory._dump_snapshot() writes (`segments`, `device_traces`, `allocator_settings`,
 * `external_annotations`), read by torch.cuda._memory_viz, pytorch.org/memory_viz and
 * memshim-replay. Field names and shapes follow PyTorch 2.15 (torch/csrc/cuda/Module.cpp and
 * memory_snapshot.cpp; docs/reports.md lists them).
 *
 * memshim's pool as PyTorch segments: each run of contiguous mapped pages (within one VA
 * reservation) is an expandable segment; its blocks are the live blocks in it (active_allocated,
 * size rounded to 512 bytes as the pool rounds) and the free gaps between them (inactive), so the
 * blocks tile the segment exactly. Page maps and unmaps are `segment_map`/`segment_unmap` events.
 *
 * State and history are copied consistently per device: the live blocks under the pool lock
 * (msh_pool_for_each_live) and, inside that same walk, the history's events and mapped pages.
 * Alloc and free events are recorded outside the pool lock, so the newest few may lag the state;
 * a pass that replays the events backwards from the state, as the viewer does, starts the window
 * after the last event that would leave a live block outside its segment (the viewer would fail
 * on it). Nothing here runs with a memshim lock held except the copies in the walk; the file is
 * written to a temp file and renamed.
 */
#include "history.h"

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "memshim.h"
#include "msh.h"
#include "pkwrite.h"
#include "pool.h"
#include "report.h"
#include "sites.h"

struct lblk { uint64_t addr, req, size; uint32_t stack; };
struct sblk { uint64_t size, req; uint32_t stack; uint8_t active; };
struct seg {
    uint64_t va, size, allocated, requested;
    size_t b0, nb; /* its blocks in dev->sb */
    bool small;
};
struct devsnap {
    int device;
    struct seg *segs;
    size_t nsegs;
    struct sblk *sb;
    size_t nsb;
    struct msh_hist_event *ev;
    size_t ev0, nev; /* events [ev0, nev) are written */
    size_t dropped_blocks;
};

static uint64_t round512(uint64_t req)
{
    return ((req ? req : 1) + 511) & ~(uint64_t)511;
}

static int cmp_range(const void *a, const void *b)
{
    uint64_t x = ((const struct msh_hist_range *)a)->va, y = ((const struct msh_hist_range *)b)->va;
    return x < y ? -1 : x > y;
}

static int cmp_lblk(const void *a, const void *b)
{
    uint64_t x = ((const struct lblk *)a)->addr, y = ((const struct lblk *)b)->addr;
    return x < y ? -1 : x > y;
}

/* ---- a small map of uint64 keys (the consistency pass) --------------------------------------------- */

struct u64map { uint64_t *k; int64_t *v; size_t cap, used; };
#define UM_EMPTY 0
#define UM_DEL 1
static inline size_t umix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return (size_t)(x ^ (x >> 33));
}
static int um_init(struct u64map *m, size_t n)
{
    m->cap = 64;
    while (m->cap < n * 2 + 16) m->cap *= 2;
    m->k = calloc(m->cap, sizeof *m->k);
    m->v = calloc(m->cap, sizeof *m->v);
    m->used = 0;
    return m->k && m->v ? 0 : ENOMEM;
}
static void um_free(struct u64map *m)
{
    free(m->k);
    free(m->v);
}
/* Keys are page or block addresses + 2 so that 0 and 1 stay free for empty/deleted. */
static int64_t *um_slot(struct u64map *m, uint64_t key, bool create)
{
    key += 2;
    size_t j = umix(key) & (m->cap - 1), del = SIZE_MAX;
    for (;; j = (j + 1) & (m->cap - 1)) {
        if (m->k[j] == key) return &m->v[j];
        if (m->k[j] == UM_DEL && del == SIZE_MAX) del = j;
        if (m->k[j] == UM_EMPTY) break;
    }
    if (!create) return NULL;
    if (del != SIZE_MAX) j = del;
    else if (++m->used * 2 > m->cap) { /* grow and retry */
        struct u64map n;
        if (um_init(&n, m->cap)) return NULL;
        for (size_t i = 0; i < m->cap; i++)
            if (m->k[i] > UM_DEL) *um_slot(&n, m->k[i] - 2, true) = m->v[i];
        um_free(m);
        *m = n;
        return um_slot(m, key - 2, true);
    }
    m->k[j] = key;
    m->v[j] = 0;
    return &m->v[j];
}
static void um_del(struct u64map *m, uint64_t key)
{
    key += 2;
    for (size_t j = umix(key) & (m->cap - 1); m->k[j] != UM_EMPTY; j = (j + 1) & (m->cap - 1))
        if (m->k[j] == key) {
            m->k[j] = UM_DEL;
            return;
        }
}

/* ---- consistency: the first event the viewer can replay back to ------------------------------------ */

struct pass {
    struct u64map live;   /* block addr -> rounded size, live in the state being rewound */
    struct u64map mapped; /* page -> 1 */
    struct u64map evpage; /* pages named by map/unmap events in the window -> live blocks on them */
    uint64_t gran;
};

/* Add (+1) or remove (-1) a live block's claim on the event pages it touches. */
static void claim(struct pass *ps, uint64_t addr, uint64_t size, int d)
{
    uint64_t p0 = addr / ps->gran, p1 = (addr + size - 1) / ps->gran;
    for (uint64_t p = p0; p <= p1; p++) {
        int64_t *c = um_slot(&ps->evpage, p, false);
        if (c) *c += d;
    }
}

static bool covered(struct pass *ps, uint64_t addr, uint64_t size)
{
    uint64_t p0 = addr / ps->gran, p1 = (addr + size - 1) / ps->gran;
    for (uint64_t p = p0; p <= p1; p++)
        if (!um_slot(&ps->mapped, p, false)) return false;
    return true;
}

/* Index of the first event to keep. */
static size_t consistent_start(struct devsnap *ds, const struct msh_hist_range *mapped, size_t nmapped, uint64_t gran,
                               const struct lblk *live, size_t nlive)
{
    if (!ds->nev || !gran || gran == UINT64_MAX) return 0; /* irregular maps: nothing to check against */
    struct pass ps = {.gran = gran};
    size_t start = 0;
    if (um_init(&ps.live, nlive + 64) || um_init(&ps.mapped, nmapped + 64) || um_init(&ps.evpage, 256)) goto out;
    for (size_t i = 0; i < ds->nev; i++) {
        const struct msh_hist_event *e = &ds->ev[i];
        if (e->action != MSH_H_SEGMENT_MAP && e->action != MSH_H_SEGMENT_UNMAP) continue;
        for (uint64_t p = e->addr / gran; p <= (e->addr + e->size - 1) / gran; p++) um_slot(&ps.evpage, p, true);
    }
    for (size_t i = 0; i < nmapped; i++)
        for (uint64_t p = mapped[i].va / gran; p <= (mapped[i].va + mapped[i].size - 1) / gran; p++)
            um_slot(&ps.mapped, p, true);
    for (size_t i = 0; i < nlive; i++) {
        *um_slot(&ps.live, live[i].addr, true) = (int64_t)live[i].size;
        claim(&ps, live[i].addr, live[i].size, +1);
    }
    for (size_t i = ds->nev; i-- > 0;) {
        const struct msh_hist_event *e = &ds->ev[i];
        bool bad = false;
        switch (e->action) {
        case MSH_H_ALLOC: {
            int64_t *s = um_slot(&ps.live, e->addr, false);
            if (s) {
                claim(&ps, e->addr, (uint64_t)*s, -1);
                um_del(&ps.live, e->addr);
            }
            break;
        }
        case MSH_H_FREE_COMPLETED: {
            uint64_t size = round512(e->size);
            int64_t *s = um_slot(&ps.live, e->addr, false);
            if (s) claim(&ps, e->addr, (uint64_t)*s, -1);
            *um_slot(&ps.live, e->addr, true) = (int64_t)size;
            claim(&ps, e->addr, size, +1);
            bad = !covered(&ps, e->addr, size);
            break;
        }
        case MSH_H_SEGMENT_MAP:
            for (uint64_t p = e->addr / gran; p <= (e->addr + e->size - 1) / gran && !bad; p++) {
                int64_t *c = um_slot(&ps.evpage, p, false);
                bad = !um_slot(&ps.mapped, p, false) || (c && *c > 0);
                um_del(&ps.mapped, p);
            }
            break;
        case MSH_H_SEGMENT_UNMAP:
            for (uint64_t p = e->addr / gran; p <= (e->addr + e->size - 1) / gran && !bad; p++) {
                bad = um_slot(&ps.mapped, p, false) != NULL;
                um_slot(&ps.mapped, p, true);
            }
            break;
        default:
            break;
        }
        if (bad) {
            start = i + 1;
            break;
        }
    }
out:
    um_free(&ps.live);
    um_free(&ps.mapped);
    um_free(&ps.evpage);
    /* never start between a free's two halves */
    if (start < ds->nev && ds->ev[start].action == MSH_H_FREE_COMPLETED && start > 0 &&
        ds->ev[start - 1].action == MSH_H_FREE_REQUESTED)
        start++;
    return start;
}

/* ---- the state of one device ------------------------------------------------------------------------ */

struct walk {
    int device;
    struct lblk *b;
    size_t n, cap;
    bool overflow, copied;
    int copy_rc;
    struct msh_hist_copy hc;
    size_t evcap, mapcap, rescap;
};

static void walk_cb(void *arg, uint64_t addr, size_t size, uint64_t stream)
{
    (void)stream;
    struct walk *w = arg;
    if (!w->copied) { /* under the pool lock: no map or unmap of this device can happen meanwhile */
        w->copy_rc = msh_history_copy(w->device, &w->hc, w->evcap, w->mapcap, w->rescap);
        w->copied = true;
    }
    if (w->n == w->cap) {
        w->overflow = true;
        return;
    }
    w->b[w->n++] = (struct lblk){addr, size, round512(size), 0};
}

static void walk_free(struct walk *w)
{
    free(w->b);
    free(w->hc.mapped);
    free(w->hc.reserved);
    w->b = NULL;
    w->hc.mapped = w->hc.reserved = NULL;
}

static int device_state(int device, struct msh_pool *p, struct devsnap *ds)
{
    struct walk w;
    int rc = EAGAIN;
    msh_history_mark_snapshot(device);
    for (int attempt = 0; attempt < 4 && rc == EAGAIN; attempt++) {
        memset(&w, 0, sizeof w);
        struct msh_pool_stats st;
        msh_pool_get_stats(p, &st);
        size_t nev, nmap, nres;
        msh_history_sizes(device, &nev, &nmap, &nres);
        w.device = device;
        w.cap = (st.live_blocks << attempt) + st.live_blocks / 4 + 256;
        w.evcap = nev + 1024;
        w.mapcap = (nmap << attempt) * 2 + 1024;
        w.rescap = nres + 64;
        w.b = malloc(w.cap * sizeof *w.b);
        w.hc.ev = malloc(w.evcap * sizeof *w.hc.ev);
        w.hc.mapped = malloc(w.mapcap * sizeof *w.hc.mapped);
        w.hc.reserved = malloc(w.rescap * sizeof *w.hc.reserved);
        if (!w.b || !w.hc.ev || !w.hc.mapped || !w.hc.reserved) {
            free(w.hc.ev);
            walk_free(&w);
            return ENOMEM;
        }
        msh_pool_for_each_live(p, walk_cb, &w);
        if (!w.copied) w.copy_rc = msh_history_copy(device, &w.hc, w.evcap, w.mapcap, w.rescap);
        if (w.overflow || w.copy_rc == ENOSPC) {
            free(w.hc.ev);
            walk_free(&w);
            continue;
        }
        rc = w.copy_rc;
    }
    if (rc) return rc == EAGAIN ? EBUSY : rc;

    /* runs of contiguous mapped pages, split at reservation boundaries */
    qsort(w.hc.mapped, w.hc.nmapped, sizeof *w.hc.mapped, cmp_range);
    qsort(w.hc.reserved, w.hc.nreserved, sizeof *w.hc.reserved, cmp_range);
    qsort(w.b, w.n, sizeof *w.b, cmp_lblk);
    struct seg *segs = calloc(w.hc.nmapped + 1, sizeof *segs);
    struct sblk *sb = malloc((2 * w.n + w.hc.nmapped + 1) * sizeof *sb);
    struct lblk *kept = malloc((w.n + 1) * sizeof *kept);
    if (!segs || !sb || !kept) {
        free(segs);
        free(sb);
        free(kept);
        free(w.hc.ev);
        walk_free(&w);
        return ENOMEM;
    }
    size_t nsegs = 0, r = 0;
    for (size_t i = 0; i < w.hc.nmapped; i++) {
        uint64_t va = w.hc.mapped[i].va, sz = w.hc.mapped[i].size;
        while (r < w.hc.nreserved && w.hc.reserved[r].va + w.hc.reserved[r].size <= va) r++;
        bool in_res = r < w.hc.nreserved && w.hc.reserved[r].va <= va;
        bool join = nsegs && segs[nsegs - 1].va + segs[nsegs - 1].size == va &&
                    (!in_res || segs[nsegs - 1].va >= w.hc.reserved[r].va);
        if (join) segs[nsegs - 1].size += sz;
        else segs[nsegs++] = (struct seg){.va = va, .size = sz};
    }
    /* tile each segment with its live blocks and the gaps between them */
    size_t nsb = 0, nkept = 0, k = 0;
    for (size_t s = 0; s < nsegs; s++) {
        struct seg *g = &segs[s];
        uint64_t cur = g->va, end = g->va + g->size;
        g->b0 = nsb;
        for (; k < w.n && w.b[k].addr < end; k++) {
            struct lblk *b = &w.b[k];
            if (b->addr < cur || b->addr + b->size > end) { /* outside the segment: newer than the copy */
                ds->dropped_blocks++;
                continue;
            }
            if (b->addr > cur) sb[nsb++] = (struct sblk){b->addr - cur, 0, 0, 0};
            sb[nsb++] = (struct sblk){b->size, b->req, 0, 1};
            g->allocated += b->size;
            g->requested += b->req;
            g->small |= b->size <= msh_cfg.small_max;
            kept[nkept++] = *b;
            cur = b->addr + b->size;
        }
        if (cur < end) sb[nsb++] = (struct sblk){end - cur, 0, 0, 0};
        g->nb = nsb - g->b0;
    }
    ds->dropped_blocks += w.n - k;
    /* blocks' frames from the sites */
    uint64_t *addrs = malloc((nkept + 1) * sizeof *addrs);
    uint32_t *stacks = malloc((nkept + 1) * sizeof *stacks);
    if (addrs && stacks) {
        for (size_t i = 0; i < nkept; i++) addrs[i] = kept[i].addr;
        msh_sites_block_stacks(p, addrs, stacks, nkept);
        size_t i = 0;
        for (size_t j = 0; j < nsb; j++)
            if (sb[j].active) sb[j].stack = stacks[i++];
    }
    free(addrs);
    free(stacks);
    ds->device = device;
    ds->segs = segs;
    ds->nsegs = nsegs;
    ds->sb = sb;
    ds->nsb = nsb;
    ds->ev = w.hc.ev;
    ds->nev = w.hc.nev;
    ds->ev0 = consistent_start(ds, w.hc.mapped, w.hc.nmapped, w.hc.gran, kept, nkept);
    free(kept);
    walk_free(&w);
    return 0;
}

/* ---- the pickle ------------------------------------------------------------------------------------- */

enum key {
    K_SEGMENTS, K_DEVICE_TRACES, K_ALLOCATOR_SETTINGS, K_EXTERNAL_ANNOTATIONS, K_DEVICE, K_ADDRESS,
    K_TOTAL_SIZE, K_ALLOCATED_SIZE, K_ACTIVE_SIZE, K_REQUESTED_SIZE, K_STREAM, K_SEGMENT_TYPE,
    K_SEGMENT_POOL_ID, K_IS_EXPANDABLE, K_FRAMES, K_BLOCKS, K_SIZE, K_STATE, K_ACTION, K_ADDR,
    K_DEVICE_FREE, K_TIME_US, K_COMPILE_CONTEXT, K_USER_METADATA, K_FILENAME, K_LINE, K_NAME,
    K_LARGE, K_SMALL, K_ACTIVE_ALLOCATED, K_INACTIVE, K_EMPTY, K_A_ALLOC, K_A_FREE_REQUESTED,
    K_A_FREE_COMPLETED, K_A_SEGMENT_MAP, K_A_SEGMENT_UNMAP, K_A_OOM, K_A_SNAPSHOT, K_NKEYS
};
static const char *const key_text[K_NKEYS] = {
    "segments", "device_traces", "allocator_settings", "external_annotations", "device", "address",
    "total_size", "allocated_size", "active_size", "requested_size", "stream", "segment_type",
    "segment_pool_id", "is_expandable", "frames", "blocks", "size", "state", "action", "addr",
    "device_free", "time_us", "compile_context", "user_metadata", "filename", "line", "name",
    "large", "small", "active_allocated", "inactive", "", "alloc", "free_requested",
    "free_completed", "segment_map", "segment_unmap", "oom", "snapshot",
};

struct emit {
    struct pkw w;
    uint32_t key_memo[K_NKEYS];
    uint32_t *stack_memo; /* stack id -> memo index + 1 of its frames list */
    size_t nstack_memo;
    struct u64map str_memo; /* interned string pointer -> memo index */
};

static void key(struct emit *e, enum key k)
{
    pkw_str_memo(&e->w, key_text[k], &e->key_memo[k]);
}

/* Interned site strings are unique per text: memoize by pointer. */
static void istr(struct emit *e, const char *s)
{
    int64_t *slot = um_slot(&e->str_memo, (uint64_t)(uintptr_t)s, true);
    if (!slot) {
        pkw_str(&e->w, s);
        return;
    }
    uint32_t m = (uint32_t)*slot;
    pkw_str_memo(&e->w, s, &m);
    *slot = m;
}

static void frames(struct emit *e, uint32_t stack)
{
    if (stack < e->nstack_memo && e->stack_memo[stack]) {
        pkw_get(&e->w, e->stack_memo[stack] - 1);
        return;
    }
    struct msh_site_frame f[MSH_SITE_MAX_FRAMES];
    int n = stack == MSH_STACK_NONE ? 0 : msh_sites_stack_frames(stack, f, MSH_SITE_MAX_FRAMES);
    pkw_list(&e->w);
    for (int i = 0; i < n; i++) {
        pkw_dict(&e->w);
        key(e, K_FILENAME);
        istr(e, f[i].filename);
        key(e, K_LINE);
        pkw_int(&e->w, f[i].line);
        key(e, K_NAME);
        istr(e, f[i].name);
        pkw_close(&e->w);
    }
    pkw_close(&e->w);
    uint32_t m = pkw_memoize(&e->w);
    if (stack < e->nstack_memo) e->stack_memo[stack] = m + 1;
}

static void emit_segments(struct emit *e, const struct devsnap *ds)
{
    for (size_t s = 0; s < ds->nsegs; s++) {
        const struct seg *g = &ds->segs[s];
        pkw_dict(&e->w);
        key(e, K_DEVICE);
        pkw_int(&e->w, ds->device);
        key(e, K_ADDRESS);
        pkw_uint(&e->w, g->va);
        key(e, K_TOTAL_SIZE);
        pkw_uint(&e->w, g->size);
        key(e, K_ALLOCATED_SIZE);
        pkw_uint(&e->w, g->allocated);
        key(e, K_ACTIVE_SIZE);
        pkw_uint(&e->w, g->allocated);
        key(e, K_REQUESTED_SIZE);
        pkw_uint(&e->w, g->requested);
        key(e, K_STREAM);
        pkw_int(&e->w, 0);
        key(e, K_SEGMENT_TYPE);
        key(e, g->small && g->allocated ? K_SMALL : K_LARGE);
        key(e, K_SEGMENT_POOL_ID);
        pkw_tuple2_int(&e->w, 0, 0);
        key(e, K_IS_EXPANDABLE);
        pkw_bool(&e->w, 1);
        key(e, K_FRAMES);
        frames(e, MSH_STACK_NONE);
        key(e, K_BLOCKS);
        pkw_list(&e->w);
        uint64_t addr = g->va;
        for (size_t i = g->b0; i < g->b0 + g->nb; i++) {
            const struct sblk *b = &ds->sb[i];
            pkw_dict(&e->w);
            key(e, K_ADDRESS);
            pkw_uint(&e->w, addr);
            key(e, K_SIZE);
            pkw_uint(&e->w, b->size);
            key(e, K_REQUESTED_SIZE);
            pkw_uint(&e->w, b->req);
            key(e, K_STATE);
            key(e, b->active ? K_ACTIVE_ALLOCATED : K_INACTIVE);
            key(e, K_FRAMES);
            frames(e, b->active ? b->stack : MSH_STACK_NONE);
            pkw_close(&e->w);
            addr += b->size;
        }
        pkw_close(&e->w);
        pkw_close(&e->w);
    }
}

static void emit_events(struct emit *e, const struct devsnap *ds)
{
    pkw_list(&e->w);
    for (size_t i = ds ? ds->ev0 : 0; ds && i < ds->nev; i++) {
        const struct msh_hist_event *v = &ds->ev[i];
        static const enum key act[] = {K_A_ALLOC, K_A_FREE_REQUESTED, K_A_FREE_COMPLETED, K_A_SEGMENT_MAP,
                                       K_A_SEGMENT_UNMAP, K_A_OOM, K_A_SNAPSHOT};
        pkw_dict(&e->w);
        key(e, K_ACTION);
        key(e, act[v->action]);
        key(e, v->action == MSH_H_OOM ? K_DEVICE_FREE : K_ADDR);
        pkw_uint(&e->w, v->addr);
        key(e, K_SIZE);
        pkw_uint(&e->w, v->size);
        key(e, K_STREAM);
        pkw_int(&e->w, (int64_t)v->stream);
        key(e, K_COMPILE_CONTEXT);
        key(e, K_EMPTY);
        key(e, K_USER_METADATA);
        key(e, K_EMPTY);
        key(e, K_FRAMES);
        frames(e, v->stack);
        key(e, K_TIME_US);
        pkw_uint(&e->w, v->time_us);
        pkw_close(&e->w);
    }
    pkw_close(&e->w);
}

/* What PyTorch writes about its own allocator; in tensor mode PyTorch's caching allocator is not
 * in use, so these are its defaults (and the job's PYTORCH_CUDA_ALLOC_CONF, for segment mode).
 * memshim's own settings go under "memshim". */
static void emit_settings(struct emit *e)
{
    struct pkw *w = &e->w;
    pkw_dict(w);
    const char *conf = getenv("PYTORCH_CUDA_ALLOC_CONF");
    pkw_str(w, "PYTORCH_CUDA_ALLOC_CONF");
    pkw_str(w, conf ? conf : "");
    pkw_str(w, "max_split_size");
    pkw_int(w, -1);
    pkw_str(w, "garbage_collection_threshold");
    pkw_float(w, 0.0);
    pkw_str(w, "expandable_segments");
    pkw_bool(w, 0);
    pkw_str(w, "pinned_num_register_threads");
    pkw_int(w, 1);
    pkw_str(w, "release_lock_on_cudamalloc");
    pkw_bool(w, 0);
    pkw_str(w, "pinned_use_cuda_host_register");
    pkw_bool(w, 0);
    pkw_str(w, "graph_capture_record_stream_reuse");
    pkw_bool(w, 0);
    pkw_str(w, "roundup_power2_divisions");
    pkw_dict(w);
    for (unsigned k = 1; k <= 32768; k *= 2) {
        char buf[16];
        snprintf(buf, sizeof buf, "%u", k);
        pkw_str(w, buf);
        pkw_int(w, 0);
    }
    pkw_close(w);
    pkw_str(w, "memshim");
    pkw_dict(w);
    pkw_str(w, "version");
    pkw_str(w, MEMSHIM_VERSION);
    char val[512];
    const char *name, *source;
    for (int i = 0; msh_config_iter(i, &name, val, sizeof val, &source); i++) {
        pkw_str(w, name);
        pkw_str(w, val);
    }
    pkw_close(w);
    pkw_close(w);
}

int msh_snapshot_build(unsigned char **out, size_t *len)
{
    *out = NULL;
    *len = 0;
    struct devsnap *ds = calloc(MSH_MAX_DEVICES, sizeof *ds);
    if (!ds) return ENOMEM;
    int maxdev = -1, rc = 0;
    for (int d = 0; d < MSH_MAX_DEVICES && !rc; d++) {
        struct msh_pool *p = msh_core_pool_get(d);
        if (!p) continue;
        /* blocks in the front end's bins were freed: back on the VA line first, so that the
         * segments show them as the inactive bytes they are (pool.h msh_pool_drain_front) */
        msh_pool_drain_front(p);
        rc = device_state(d, p, &ds[d]);
        if (!rc) maxdev = d;
    }
    struct emit e;
    memset(&e, 0, sizeof e);
    pkw_init(&e.w);
    e.nstack_memo = (size_t)1 << 17;
    e.stack_memo = calloc(e.nstack_memo, sizeof *e.stack_memo);
    if (!rc && (!e.stack_memo || um_init(&e.str_memo, 1024))) rc = ENOMEM;
    if (!rc) {
        pkw_begin(&e.w);
        pkw_dict(&e.w);
        key(&e, K_SEGMENTS);
        pkw_list(&e.w);
        for (int d = 0; d <= maxdev; d++) emit_segments(&e, &ds[d]);
        pkw_close(&e.w);
        key(&e, K_DEVICE_TRACES);
        pkw_list(&e.w);
        for (int d = 0; d <= (maxdev < 0 ? 0 : maxdev); d++) emit_events(&e, maxdev < 0 ? NULL : &ds[d]);
        pkw_close(&e.w);
        key(&e, K_ALLOCATOR_SETTINGS);
        emit_settings(&e);
        key(&e, K_EXTERNAL_ANNOTATIONS);
        pkw_list(&e.w);
        pkw_close(&e.w);
        pkw_close(&e.w);
        pkw_end(&e.w);
        rc = e.w.err;
    }
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        free(ds[d].segs);
        free(ds[d].sb);
        free(ds[d].ev);
    }
    free(ds);
    free(e.stack_memo);
    um_free(&e.str_memo);
    if (rc) {
        pkw_free(&e.w);
        return rc;
    }
    *out = e.w.buf;
    *len = e.w.len;
    return 0;
}

int msh_snapshot_write(const char *path)
{
    unsigned char *buf;
    size_t len;
    int rc = msh_snapshot_build(&buf, &len);
    if (rc) return rc;
    rc = msh_write_file_atomic(path, buf, len, 0600);
    free(buf);
    return rc;
}
