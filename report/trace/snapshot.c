/*
 * snapshot.c: turns a PyTorch memory snapshot (the dict torch.cuda.memory._dump_snapshot()
 * pickles: `segments` and `device_traces`) into replayable allocation streams, one per device.
 * It reconstructs the blocks that were live before the ring buffer started recording (a free
 * with no earlier alloc, and a block active at dump time with no alloc) as prefix allocations,
 * so that replaying a stream ends exactly at the dump's set of active blocks, and it recovers
 * the reserved bytes the recording allocator held over the window. It reads the pickle only
 * through pickle.c and must never trust the document's shape: every field is type-checked,
 * every oddity is either an error with its position or a counted warning, never a crash.
 *
 * Definitions (they reproduce ../shared/traces/README.md's reference figures exactly):
 *  - replayed events: `alloc`, and `free_requested`; a `free_completed` is skipped when a
 *    free_requested for that address is still owed its completion. In a trace that has no
 *    free_requested at all, free_completed is the free. In a trace that has both, a stray
 *    free_completed (its free_requested fell off the ring buffer) is ignored.
 *  - prefix blocks: a free of an address never seen before in the trace (size: the free's size,
 *    stream: its stream), and each active_allocated / active_pending_free block at dump time
 *    that the replay does not leave live (size: requested_size, else size; stream: its
 *    segment's). Prefix allocations come first, in address order, stamped with the time of the
 *    first timed event of the trace.
 *  - a snapshot with no device_traces (allocator state only) gives, per device with segments,
 *    a stream made only of the prefix allocations of its active blocks.
 *  - recorded_final_reserved: sum of total_size of the device's segments at dump time;
 *    recorded_peak_reserved: walking back from the dump, reserved before a segment_alloc/
 *    segment_map of s is (after - s), before a segment_free/segment_unmap (after + s); the
 *    largest value over the window.
 *  - for the allocator models (msh_snapshot_load_extra(), policy.h), also: each segment event
 *    with the index of the stream event it preceded, the dump's segments and blocks, and the
 *    recorded allocator_settings (max_split_size, roundup_power2_divisions,
 *    garbage_collection_threshold, expandable_segments).
 */
#include "pickle.h"
#include "policy.h"
#include "trace.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SNAP_MAX_DEVICES 1024

struct snap_ctx {
    char *err;
    size_t errlen;
    /* Work allowed, in dict entries and list items visited. Memo sharing lets a small pickle
     * name one big list or dict many times (one segment's blocks in every segment, one event
     * list for every device, one huge dict for every event); charging each visit against the
     * input length (4 units a byte) keeps the work linear in the file's size. A real snapshot
     * never shares these nodes: the ones in ../shared/traces use 0.04 to 0.2 units a byte. */
    size_t budget;
};

__attribute__((format(printf, 2, 3))) static int snap_fail(struct snap_ctx *c, const char *fmt, ...)
{
    if (c->err && c->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    return EINVAL;
}

static int charge(struct snap_ctx *c, const struct msh_pk *v)
{
    size_t cost = 1 + (v && v->kind == MSH_PK_DICT ? v->seq.n : 0);
    if (cost > c->budget)
        return snap_fail(c, "the snapshot names the same data too many times (memo references): "
                            "more work than its size allows; refusing it");
    c->budget -= cost;
    return 0;
}

static int snap_nomem(struct snap_ctx *c)
{
    snap_fail(c, "out of memory converting the snapshot");
    return ENOMEM;
}

/* An int field: 0 when present and a non-negative int; 1 when absent (or None); EINVAL else. */
static int field_u64(const struct msh_pk *d, const char *key, uint64_t *out)
{
    const struct msh_pk *v = msh_pk_dict_get(d, key);
    if (!v || v->kind == MSH_PK_NONE) return 1;
    return msh_pk_get_u64(v, out) ? EINVAL : 0;
}

/* Stream values are kept raw: a negative int is stored as its two's complement. */
static int field_raw(const struct msh_pk *d, const char *key, uint64_t *out)
{
    const struct msh_pk *v = msh_pk_dict_get(d, key);
    if (!v || v->kind == MSH_PK_NONE) return 1;
    if (v->kind != MSH_PK_INT && v->kind != MSH_PK_BOOL) return EINVAL;
    *out = v->u;
    return 0;
}

static int by_addr(const void *a, const void *b)
{
    const struct msh_trace_event *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

struct dev_build {
    int dev;
    struct msh_trace rec;    /* recorded events, normalised */
    struct msh_trace prefix; /* reconstructed blocks */
    struct msh_addrmap map;
    size_t nlive;            /* blocks live after the recorded events */
    size_t matched;          /* of those, listed active in the dump */
    size_t nraw;
    uint64_t first_time, reserved;
    int64_t net_end, net_max;
    struct msh_snap_dev *x; /* extra output for the models, or NULL */
    size_t capev, capseg, capblk;
};

#define GROW(ptr, n, cap)                                                                       \
    ((n) < (cap) ? 0 : grow_arr((void **)&(ptr), &(cap), sizeof *(ptr)))
static int grow_arr(void **p, size_t *cap, size_t elem)
{
    size_t nc = *cap ? *cap * 2 : 64;
    void *n = realloc(*p, nc * elem);
    if (!n) return ENOMEM;
    *p = n;
    *cap = nc;
    return 0;
}

static int push_ev(struct snap_ctx *c, struct msh_trace *t, uint8_t op, uint64_t addr, uint64_t size,
                   uint64_t stream, uint64_t time_us, uint8_t prefix)
{
    struct msh_trace_event e = {.addr = addr, .size = size, .stream = stream, .time_us = time_us,
                                .op = op, .prefix = prefix};
    return msh_trace_push(t, &e) ? snap_nomem(c) : 0;
}

static int do_free(struct snap_ctx *c, struct dev_build *b, uint64_t addr, uint64_t size,
                   uint64_t stream, uint64_t time_us)
{
    struct msh_addrmap_ent *ent = msh_addrmap_get(&b->map, addr, 1);
    if (!ent) return snap_nomem(c);
    if (ent->live) {
        if (size != ent->size) b->rec.warnings++;
        ent->live = 0;
        b->nlive--;
        return push_ev(c, &b->rec, MSH_OP_FREE, addr, ent->size, ent->stream, time_us, 0);
    }
    if (!ent->seen) { /* live since before recording began */
        ent->seen = 1;
        ent->size = size;
        ent->stream = stream;
        int rc = push_ev(c, &b->prefix, MSH_OP_ALLOC, addr, size, stream, 0, 1);
        return rc ? rc : push_ev(c, &b->rec, MSH_OP_FREE, addr, size, stream, time_us, 0);
    }
    b->rec.warnings++; /* a second free of a block: dropped */
    return 0;
}

/* Walks one device's event list. */
static int walk_events(struct snap_ctx *c, struct dev_build *b, const struct msh_pk *list, int dev,
                       uint64_t *first_time, int64_t *net_end, int64_t *net_max)
{
    size_t n = msh_pk_len(list);
    int has_free_requested = 0;
    for (size_t i = 0; i < n && !has_free_requested; i++) {
        const struct msh_pk *e = msh_pk_item(list, i);
        if (charge(c, e)) return EINVAL;
        has_free_requested = msh_pk_is_str(msh_pk_dict_get(e, "action"), "free_requested");
    }
    int64_t net = 0, maxnet = 0;
    *first_time = 0;
    for (size_t i = 0; i < n; i++) {
        const struct msh_pk *e = msh_pk_item(list, i);
        if (charge(c, e)) return EINVAL;
        if (e->kind != MSH_PK_DICT)
            return snap_fail(c, "device_traces[%d][%zu] is a %s, expected a dict", dev, i,
                             msh_pk_kind_name(e->kind));
        const struct msh_pk *a = msh_pk_dict_get(e, "action");
        if (!a || a->kind != MSH_PK_STR)
            return snap_fail(c, "device_traces[%d][%zu] has no 'action' string", dev, i);
        enum { A_OTHER, A_ALLOC, A_FREE_REQ, A_FREE_DONE, A_SEG_GROW, A_SEG_SHRINK } act = A_OTHER;
        if (msh_pk_is_str(a, "alloc")) act = A_ALLOC;
        else if (msh_pk_is_str(a, "free_requested")) act = A_FREE_REQ;
        else if (msh_pk_is_str(a, "free_completed")) act = A_FREE_DONE;
        else if (msh_pk_is_str(a, "segment_alloc") || msh_pk_is_str(a, "segment_map")) act = A_SEG_GROW;
        else if (msh_pk_is_str(a, "segment_free") || msh_pk_is_str(a, "segment_unmap")) act = A_SEG_SHRINK;
        uint64_t time_us = 0;
        if (field_u64(e, "time_us", &time_us) == 0 && !*first_time) *first_time = time_us;
        if (act == A_OTHER) continue; /* oom, snapshot, and actions newer than this reader */
        uint64_t addr = 0, size = 0, stream = 0;
        if (field_u64(e, "size", &size) != 0)
            return snap_fail(c, "device_traces[%d][%zu] (%.*s): 'size' missing or not a "
                                "non-negative int", dev, i, (int)(a->s.len < 32 ? a->s.len : 32), a->s.p);
        if (size > MSH_TRACE_MAX_BLOCK)
            return snap_fail(c, "device_traces[%d][%zu]: size %llu is larger than 2^48 bytes", dev, i,
                             (unsigned long long)size);
        if (act == A_SEG_GROW || act == A_SEG_SHRINK) {
            if (size > INT64_MAX / 4)
                return snap_fail(c, "device_traces[%d][%zu]: segment size %llu out of range", dev, i,
                                 (unsigned long long)size);
            net += act == A_SEG_GROW ? (int64_t)size : -(int64_t)size;
            if (net > INT64_MAX / 2 || net < -(INT64_MAX / 2))
                return snap_fail(c, "device_traces[%d][%zu]: segment sizes out of range", dev, i);
            if (net > maxnet) maxnet = net;
            if (b->x) {
                uint64_t saddr = 0, sstream = 0;
                field_u64(e, "addr", &saddr);
                field_raw(e, "stream", &sstream);
                if (GROW(b->x->ev, b->x->nev, b->capev)) return snap_nomem(c);
                uint8_t op = msh_pk_is_str(a, "segment_alloc") ? MSH_SEG_ALLOC
                             : msh_pk_is_str(a, "segment_free") ? MSH_SEG_FREE
                             : msh_pk_is_str(a, "segment_map") ? MSH_SEG_MAP : MSH_SEG_UNMAP;
                b->x->ev[b->x->nev++] = (struct msh_segev){.addr = saddr, .size = size, .stream = sstream,
                                                           .at = b->rec.n, .op = op};
            }
            continue;
        }
        if (field_u64(e, "addr", &addr) != 0)
            return snap_fail(c, "device_traces[%d][%zu] (%.*s): 'addr' missing or not a "
                                "non-negative int", dev, i, (int)(a->s.len < 32 ? a->s.len : 32), a->s.p);
        if (field_raw(e, "stream", &stream) == EINVAL)
            return snap_fail(c, "device_traces[%d][%zu]: 'stream' is not an int", dev, i);
        int rc = 0;
        struct msh_addrmap_ent *ent;
        switch (act) {
        case A_ALLOC:
            if (!(ent = msh_addrmap_get(&b->map, addr, 1))) return snap_nomem(c);
            if (ent->live) { /* duplicate alloc: free the old block first */
                b->rec.warnings++;
                if ((rc = push_ev(c, &b->rec, MSH_OP_FREE, addr, ent->size, ent->stream, time_us, 0)))
                    return rc;
                b->nlive--;
            }
            ent->live = ent->seen = 1;
            ent->size = size;
            ent->stream = stream;
            b->nlive++;
            rc = push_ev(c, &b->rec, MSH_OP_ALLOC, addr, size, stream, time_us, 0);
            break;
        case A_FREE_REQ:
            rc = do_free(c, b, addr, size, stream, time_us);
            if (!rc && (ent = msh_addrmap_get(&b->map, addr, 0)) && ent->pending < UINT32_MAX)
                ent->pending++;
            break;
        case A_FREE_DONE:
            ent = msh_addrmap_get(&b->map, addr, 0);
            if (ent && ent->pending) {
                ent->pending--;
            } else if (!has_free_requested) {
                rc = do_free(c, b, addr, size, stream, time_us);
            } else if (ent && ent->live) { /* completion without a request: still a free */
                b->rec.warnings++;
                rc = do_free(c, b, addr, size, stream, time_us);
            } /* else its free_requested is older than the ring buffer: nothing was live */
            break;
        default:
            break;
        }
        if (rc) return rc;
    }
    *net_end = net;
    *net_max = maxnet;
    return 0;
}

/* One block of a segment: active at dump time and not left live by the replay -> prefix. */
static int dump_block(struct snap_ctx *c, struct dev_build *b, uint64_t addr, uint64_t req, uint64_t stream)
{
    struct msh_addrmap_ent *ent = msh_addrmap_get(&b->map, addr, 1);
    if (!ent) return snap_nomem(c);
    if (ent->mark) { /* the dump lists this block twice */
        b->rec.warnings++;
        return 0;
    }
    ent->mark = 1;
    if (ent->live) {
        b->matched++;
        if (ent->size != req) b->rec.warnings++;
        return 0;
    }
    if (ent->seen) { /* freed in the trace, never reallocated, yet active at dump */
        b->rec.warnings++;
        return 0;
    }
    ent->seen = ent->live = 1;
    ent->size = req;
    ent->stream = stream;
    return push_ev(c, &b->prefix, MSH_OP_ALLOC, addr, req, stream, 0, 1);
}

/* The allocator state at dump time, one pass over all segments: reserved bytes per device and
 * the active blocks that become prefix allocations. */
static int walk_segments(struct snap_ctx *c, struct dev_build **by_dev, const struct msh_pk *segs)
{
    for (size_t i = 0; i < msh_pk_len(segs); i++) {
        const struct msh_pk *sg = msh_pk_item(segs, i);
        uint64_t sdev = 0, saddr = 0, total = 0, stream = 0;
        if (charge(c, sg)) return EINVAL;
        /* the device list was built from these same segments: by_dev[sdev] exists */
        if (sg->kind != MSH_PK_DICT || field_u64(sg, "device", &sdev) == EINVAL || sdev >= SNAP_MAX_DEVICES ||
            !by_dev[sdev])
            return snap_fail(c, "segments[%zu] is not a segment dict", i);
        struct dev_build *b = by_dev[sdev];
        if (field_u64(sg, "address", &saddr) == EINVAL || field_u64(sg, "total_size", &total) == EINVAL)
            return snap_fail(c, "segments[%zu]: 'address' or 'total_size' is not a non-negative int", i);
        if (field_raw(sg, "stream", &stream) == EINVAL)
            return snap_fail(c, "segments[%zu]: 'stream' is not an int", i);
        if (total > UINT64_MAX - b->reserved)
            return snap_fail(c, "segments[%zu]: total_size overflows", i);
        b->reserved += total;
        if (b->x) {
            if (GROW(b->x->seg, b->x->nseg, b->capseg)) return snap_nomem(c);
            const struct msh_pk *ty = msh_pk_dict_get(sg, "segment_type");
            const struct msh_pk *ex = msh_pk_dict_get(sg, "is_expandable");
            b->x->seg[b->x->nseg++] = (struct msh_snap_seg){
                .addr = saddr, .size = total, .stream = stream,
                .small = ty ? (uint8_t)msh_pk_is_str(ty, "small") : (uint8_t)(total == (2u << 20)),
                .expandable = (uint8_t)(ex && (ex->kind == MSH_PK_BOOL || ex->kind == MSH_PK_INT) && ex->i)};
        }
        const struct msh_pk *blocks = msh_pk_dict_get(sg, "blocks");
        if (!blocks || blocks->kind == MSH_PK_NONE) continue;
        if (blocks->kind != MSH_PK_LIST && blocks->kind != MSH_PK_TUPLE)
            return snap_fail(c, "segments[%zu]: 'blocks' is a %s, expected a list", i,
                             msh_pk_kind_name(blocks->kind));
        uint64_t at = saddr; /* older snapshots give blocks no address: they tile the segment */
        for (size_t j = 0; j < msh_pk_len(blocks); j++) {
            const struct msh_pk *bl = msh_pk_item(blocks, j);
            uint64_t baddr = at, bsize = 0, req = 0;
            if (charge(c, bl)) return EINVAL;
            if (bl->kind != MSH_PK_DICT)
                return snap_fail(c, "segments[%zu].blocks[%zu] is a %s, expected a dict", i, j,
                                 msh_pk_kind_name(bl->kind));
            if (field_u64(bl, "address", &baddr) == EINVAL || field_u64(bl, "size", &bsize) == EINVAL ||
                field_u64(bl, "requested_size", &req) == EINVAL)
                return snap_fail(c, "segments[%zu].blocks[%zu]: 'address', 'size' or "
                                    "'requested_size' is not a non-negative int", i, j);
            if (bsize > MSH_TRACE_MAX_BLOCK || req > MSH_TRACE_MAX_BLOCK)
                return snap_fail(c, "segments[%zu].blocks[%zu]: size larger than 2^48 bytes", i, j);
            at = baddr + bsize;
            const struct msh_pk *st = msh_pk_dict_get(bl, "state");
            if (b->x) {
                if (GROW(b->x->blk, b->x->nblk, b->capblk)) return snap_nomem(c);
                b->x->blk[b->x->nblk++] = (struct msh_snap_blk){
                    .addr = baddr, .size = bsize, .req = req,
                    .active = (uint8_t)(msh_pk_is_str(st, "active_allocated") || msh_pk_is_str(st, "active_pending_free"))};
            }
            if (!msh_pk_is_str(st, "active_allocated") && !msh_pk_is_str(st, "active_pending_free"))
                continue;
            int rc = dump_block(c, b, baddr, req ? req : bsize, stream);
            if (rc) return rc;
        }
    }
    return 0;
}

static int by_seg_addr(const void *a, const void *b)
{
    const struct msh_snap_seg *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}
static int by_blk_addr(const void *a, const void *b)
{
    const struct msh_snap_blk *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* allocator_settings -> struct msh_torch_conf (the resolved values PyTorch records). */
static void read_settings(const struct msh_pk *as, struct msh_snap_extra *x)
{
    msh_torch_conf_default(&x->conf);
    if (!as || as->kind != MSH_PK_DICT) return;
    x->has_settings = true;
    int64_t v;
    const struct msh_pk *f = msh_pk_dict_get(as, "max_split_size");
    if (f && msh_pk_get_i64(f, &v) == 0 && v > 0) x->conf.max_split_size = (uint64_t)v;
    else if (f && f->kind == MSH_PK_INT && f->big) x->conf.max_split_size = UINT64_MAX;
    f = msh_pk_dict_get(as, "garbage_collection_threshold");
    if (f && f->kind == MSH_PK_FLOAT && f->f > 0 && f->f < 1) x->conf.gc_threshold = f->f;
    f = msh_pk_dict_get(as, "expandable_segments");
    if (f && msh_pk_get_i64(f, &v) == 0) x->conf.expandable = v != 0;
    f = msh_pk_dict_get(as, "roundup_power2_divisions");
    if (f && f->kind == MSH_PK_DICT) {
        for (size_t k = 0; k < f->seq.n; k++) {
            const struct msh_pk *key = f->seq.v[2 * k], *val = f->seq.v[2 * k + 1];
            if (!key || key->kind != MSH_PK_STR || key->s.len == 0 || key->s.len > 12) continue;
            char kb[16];
            memcpy(kb, key->s.p, key->s.len);
            kb[key->s.len] = 0;
            unsigned long long mb = strtoull(kb, NULL, 10);
            if (!mb || (mb & (mb - 1)) || msh_pk_get_i64(val, &v) || v < 0 || v > 1 << 20) continue;
            unsigned idx = 63u - (unsigned)__builtin_clzll(mb);
            if (idx < MSH_TORCH_DIVS) x->conf.divisions[idx] = (unsigned)v;
        }
    }
}

/* Prefix (in address order) then recorded events, into out. */
static int finish_device(struct snap_ctx *c, struct dev_build *b, int have_segments, struct msh_trace *out)
{
    if (have_segments && b->nlive > b->matched) b->rec.warnings += b->nlive - b->matched;
    if (b->prefix.n > SIZE_MAX / sizeof(struct msh_trace_event) - b->rec.n - 1) return snap_nomem(c);
    size_t n = b->prefix.n + b->rec.n;
    memset(out, 0, sizeof *out);
    out->device = b->dev;
    out->ev = malloc((n ? n : 1) * sizeof *out->ev);
    if (!out->ev) return snap_nomem(c);
    if (b->prefix.n) qsort(b->prefix.ev, b->prefix.n, sizeof *b->prefix.ev, by_addr);
    for (size_t i = 0; i < b->prefix.n; i++) b->prefix.ev[i].time_us = b->first_time;
    if (b->prefix.n) memcpy(out->ev, b->prefix.ev, b->prefix.n * sizeof *out->ev);
    if (b->rec.n) memcpy(out->ev + b->prefix.n, b->rec.ev, b->rec.n * sizeof *out->ev);
    out->n = out->cap = n;
    out->nprefix = b->prefix.n;
    out->warnings = b->rec.warnings;
    out->nraw_events = b->nraw;
    out->recorded_final_reserved = b->reserved;
    /* reserved when the window opened, plus the largest net growth within it */
    int64_t before = (int64_t)(b->reserved > INT64_MAX / 2 ? INT64_MAX / 2 : b->reserved) - b->net_end;
    int64_t peak = before + b->net_max;
    out->recorded_peak_reserved = peak > 0 ? (uint64_t)peak : 0;
    msh_trace_analyze(out);
    if (b->x) {
        b->x->device = b->dev;
        for (size_t i = 0; i < b->x->nev; i++) b->x->ev[i].at += b->prefix.n;
        if (b->x->nseg) qsort(b->x->seg, b->x->nseg, sizeof *b->x->seg, by_seg_addr);
        if (b->x->nblk) qsort(b->x->blk, b->x->nblk, sizeof *b->x->blk, by_blk_addr);
    }
    return 0;
}

static int convert(struct snap_ctx *c, const struct msh_pk *root, struct msh_trace_set *s,
                   struct msh_snap_extra *x)
{
    const struct msh_pk *segs = NULL, *traces = NULL;
    if (root->kind == MSH_PK_LIST) { /* torch.cuda.memory_snapshot(): the segment list alone */
        segs = root;
    } else if (root->kind == MSH_PK_DICT) {
        segs = msh_pk_dict_get(root, "segments");
        traces = msh_pk_dict_get(root, "device_traces");
        if (!segs && !traces)
            return snap_fail(c, "not a PyTorch memory snapshot: the dict has no 'segments' or "
                                "'device_traces'");
        const struct msh_pk *as = msh_pk_dict_get(root, "allocator_settings");
        if (x) read_settings(as, x);
        const struct msh_pk *conf = msh_pk_dict_get(as, "PYTORCH_CUDA_ALLOC_CONF");
        if (conf && conf->kind == MSH_PK_STR && !(s->allocator_conf = strndup(conf->s.p, conf->s.len)))
            return snap_nomem(c);
    } else {
        return snap_fail(c, "not a PyTorch memory snapshot: the pickle holds a %s, expected a dict",
                         msh_pk_kind_name(root->kind));
    }
    if (segs && segs->kind == MSH_PK_NONE) segs = NULL;
    if (traces && traces->kind == MSH_PK_NONE) traces = NULL;
    if (segs && segs->kind != MSH_PK_LIST)
        return snap_fail(c, "'segments' is a %s, expected a list", msh_pk_kind_name(segs->kind));
    if (traces && traces->kind != MSH_PK_LIST)
        return snap_fail(c, "'device_traces' is a %s, expected a list", msh_pk_kind_name(traces->kind));

    /* Which devices: those with events, and those with segments. */
    struct dev_build **by_dev = calloc(SNAP_MAX_DEVICES, sizeof *by_dev);
    struct dev_build *builds = NULL;
    if (!by_dev) return snap_nomem(c);
    int rc = 0;
    char *want = (char *)calloc(SNAP_MAX_DEVICES, 1);
    if (!want) rc = snap_nomem(c);
    for (size_t d = 0; d < msh_pk_len(traces) && !rc; d++) {
        const struct msh_pk *t = msh_pk_item(traces, d);
        if ((rc = charge(c, t))) break;
        if (t->kind != MSH_PK_LIST)
            rc = snap_fail(c, "device_traces[%zu] is a %s, expected a list", d, msh_pk_kind_name(t->kind));
        else if (msh_pk_len(t) && d >= SNAP_MAX_DEVICES)
            rc = snap_fail(c, "device_traces[%zu]: more than %d devices", d, SNAP_MAX_DEVICES);
        else if (msh_pk_len(t))
            want[d] = 1;
    }
    for (size_t i = 0; i < msh_pk_len(segs) && !rc; i++) {
        uint64_t dev = 0;
        const struct msh_pk *sg = msh_pk_item(segs, i);
        if ((rc = charge(c, sg))) break;
        if (sg->kind != MSH_PK_DICT)
            rc = snap_fail(c, "segments[%zu] is a %s, expected a dict", i, msh_pk_kind_name(sg->kind));
        else if (field_u64(sg, "device", &dev) == EINVAL || dev >= SNAP_MAX_DEVICES)
            rc = snap_fail(c, "segments[%zu]: 'device' is not a device number below %d", i, SNAP_MAX_DEVICES);
        else
            want[dev] = 1;
    }
    size_t ndev = 0;
    for (int d = 0; !rc && d < SNAP_MAX_DEVICES; d++) ndev += want[d] != 0;
    if (!rc && ndev && (!(builds = calloc(ndev, sizeof *builds)) || !(s->dev = calloc(ndev, sizeof *s->dev))))
        rc = snap_nomem(c);
    if (!rc && x && ndev && !(x->dev = calloc(ndev, sizeof *x->dev))) rc = snap_nomem(c);
    size_t nb = 0;
    for (int d = 0; !rc && d < SNAP_MAX_DEVICES; d++) {
        if (!want[d]) continue;
        struct dev_build *b = &builds[nb++];
        by_dev[d] = b;
        b->dev = d;
        if (x) {
            b->x = &x->dev[nb - 1];
            x->ndev = nb;
        }
        const struct msh_pk *ev = (size_t)d < msh_pk_len(traces) ? msh_pk_item(traces, (size_t)d) : NULL;
        b->nraw = msh_pk_len(ev);
        if (msh_addrmap_init(&b->map, b->nraw / 2 + 64)) rc = snap_nomem(c);
        else if (ev) rc = walk_events(c, b, ev, d, &b->first_time, &b->net_end, &b->net_max);
    }
    if (!rc) rc = walk_segments(c, by_dev, segs);
    for (size_t i = 0; !rc && i < nb; i++) {
        rc = finish_device(c, &builds[i], segs != NULL, &s->dev[s->ndev]);
        if (!rc) s->ndev++;
    }
    for (size_t i = 0; i < nb; i++) {
        free(builds[i].rec.ev);
        free(builds[i].prefix.ev);
        msh_addrmap_free(&builds[i].map);
    }
    free(builds);
    free(want);
    free(by_dev);
    return rc;
}

static int load_snapshot(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                         struct msh_snap_extra *x, char *err, size_t errlen);

int msh_trace_load_snapshot_mem(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                                char *err, size_t errlen)
{
    return load_snapshot(buf, len, out, NULL, err, errlen);
}

void msh_snap_extra_free(struct msh_snap_extra *x)
{
    if (!x) return;
    for (size_t i = 0; i < x->ndev; i++) {
        free(x->dev[i].ev);
        free(x->dev[i].seg);
        free(x->dev[i].blk);
    }
    free(x->dev);
    free(x);
}

int msh_snapshot_load_extra(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                            struct msh_snap_extra **xo, char *err, size_t errlen)
{
    *xo = NULL;
    struct msh_snap_extra *x = calloc(1, sizeof *x);
    if (!x) return ENOMEM;
    msh_torch_conf_default(&x->conf);
    int rc = load_snapshot(buf, len, out, x, err, errlen);
    if (rc) {
        msh_snap_extra_free(x);
        return rc;
    }
    *xo = x;
    return 0;
}

static int load_snapshot(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                         struct msh_snap_extra *x, char *err, size_t errlen)
{
    struct snap_ctx c = {.err = err, .errlen = errlen,
                         .budget = len > SIZE_MAX / 8 ? SIZE_MAX : 4 * len + 65536};
    *out = NULL;
    if (err && errlen) err[0] = 0;
    struct msh_pk_doc *doc = NULL;
    int rc = msh_pk_parse(buf, len, NULL, &doc, err, errlen);
    if (rc) return rc;
    struct msh_trace_set *s = calloc(1, sizeof *s);
    if (!s || !(s->format = strdup("pytorch-snapshot"))) {
        free(s);
        msh_pk_free(doc);
        return snap_nomem(&c);
    }
    rc = convert(&c, msh_pk_root(doc), s, x);
    msh_pk_free(doc);
    if (rc) {
        msh_trace_set_free(s);
        return rc;
    }
    *out = s;
    return 0;
}
