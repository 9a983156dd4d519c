/*
 * trace.h: allocation streams read from trace files, ready to replay through the pool.
 *
 * Readers: PyTorch memory snapshots (pickles from torch.cuda.memory._dump_snapshot(), read by a
 * pickle subset parser that never executes anything), memshim's own text trace format
 * (docs/trace-format.md) and torch.profiler Chrome/Kineto JSON traces recorded with
 * profile_memory=True (their "[memory]" events); any of them may be gzip-compressed. A reader
 * fills one msh_trace per device trace. Blocks that were live before recording began are
 * reconstructed and appear as allocations at the start of the stream (prefix events, flagged).
 * Readers never abort: malformed input returns EINVAL with a reason.
 *
 * Invariant of every loaded trace (every reader normalises to it and counts what it had to fix in
 * `warnings`): prefix allocations come first; an alloc never names an address that is live; a
 * free always names a live address. A duplicate alloc of a live address is preceded by a
 * synthesised free of the old block; a free of an address that is not live is dropped (except in
 * a snapshot or a profiler trace, where a free of a block never seen before is the sign of a
 * prefix block).
 */
#ifndef MSH_TRACE_H
#define MSH_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum msh_trace_op { MSH_OP_ALLOC = 0, MSH_OP_FREE = 1 };

struct msh_trace_event {
    uint64_t addr;    /* address in the original run: the identity of the block */
    uint64_t size;    /* requested bytes (for a free: the size of the block freed) */
    uint64_t stream;  /* original stream value (0 = default stream) */
    uint64_t time_us; /* 0 when the trace has no times */
    uint8_t op;       /* enum msh_trace_op */
    uint8_t prefix;   /* 1: reconstructed allocation of a block live before recording */
};

struct msh_trace {
    int device;
    struct msh_trace_event *ev;
    size_t n, cap;
    size_t nprefix;             /* leading prefix allocations */
    uint64_t peak_live_bytes;   /* computed by msh_trace_analyze() */
    uint64_t final_live_bytes;
    size_t nallocs;             /* allocs in the recorded window, prefix excluded */
    size_t warnings;            /* counted oddities (duplicate alloc, free of unknown block...) */
    /* what the recording allocator did, when the file says (0 = unknown) */
    uint64_t recorded_peak_reserved;
    uint64_t recorded_final_reserved;
    size_t nraw_events;         /* events in the source for this device (snapshot: every action,
                                 * segment and oom events included; text: a/f/p lines) */
};

struct msh_trace_set {
    char *path;
    char *format;            /* "pytorch-snapshot", "memshim-trace" or "pytorch-profiler" */
    struct msh_trace *dev;   /* one per device trace, in device order */
    size_t ndev;
    char *allocator_conf;    /* snapshot allocator_settings.PYTORCH_CUDA_ALLOC_CONF, else NULL */
};

/* Read any supported file (format detected from content). Returns 0, or an errno with a one-line
 * reason in err. */
int msh_trace_load(const char *path, struct msh_trace_set **out, char *err, size_t errlen);
int msh_trace_load_snapshot_mem(const unsigned char *buf, size_t len, struct msh_trace_set **out,
                                char *err, size_t errlen);
int msh_trace_load_text_mem(const char *buf, size_t len, struct msh_trace_set **out, char *err,
                            size_t errlen);
/* A torch.profiler JSON trace (export_chrome_trace / tensorboard_trace_handler): its "[memory]"
 * events on CUDA devices, one msh_trace per CUDA device id (report/trace/profiler.c). Errors
 * name the byte offset, line and column. */
int msh_trace_load_profiler_mem(const char *buf, size_t len, struct msh_trace_set **out, char *err,
                                size_t errlen);
/* As msh_trace_load_text_mem, with `name` leading every error message ("name:17: ..."). */
int msh_trace_load_text_named(const char *buf, size_t len, const char *name,
                              struct msh_trace_set **out, char *err, size_t errlen);
/* Write a set in memshim's text format (docs/trace-format.md). Returns 0 or EIO. */
int msh_trace_write_text(FILE *f, const struct msh_trace_set *s);
void msh_trace_set_free(struct msh_trace_set *s);
/* Peak and final live requested bytes over the stream, prefix included. */
void msh_trace_analyze(struct msh_trace *t);
/* Append one event to t->ev (growing it). Returns 0 or ENOMEM. */
int msh_trace_push(struct msh_trace *t, const struct msh_trace_event *e);

/* Largest trace file msh_trace_load() reads, and the most a gzip file may inflate to. */
#define MSH_TRACE_MAX_FILE ((uint64_t)4 << 30)
/* Largest block a trace may carry (256 TiB: no device has more; beyond is corruption). Readers
 * reject larger sizes, so sums and roundings downstream stay far from 64-bit overflow. */
#define MSH_TRACE_MAX_BLOCK ((uint64_t)1 << 48)
/* Inflating gzip: at most MSH_GZIP_MAX_RATIO times the compressed size (a zip bomb is refused),
 * but never less than MSH_GZIP_MIN_LIMIT, and never more than MSH_TRACE_MAX_FILE. */
#define MSH_GZIP_MAX_RATIO 256
#define MSH_GZIP_MIN_LIMIT ((uint64_t)64 << 20)
/* Inflate a whole gzip file (one or more members, zero padding allowed after them) into a new
 * NUL-terminated buffer (*out, free() it; *outlen excludes the NUL). Returns 0, EINVAL (not gzip,
 * corrupt, truncated, trailing garbage), EFBIG (over the limits above) or ENOMEM, with a reason. */
int msh_trace_gunzip(const unsigned char *in, size_t inlen, unsigned char **out, size_t *outlen, char *err,
                     size_t errlen);

/* ---- a map from block address to state, shared by the readers, analysis and tests -------------
 * Open addressing, entries are never removed (a freed block keeps its entry with live = 0). */
struct msh_addrmap_ent {
    uint64_t addr, size, stream;
    uint32_t pending; /* snapshot reader: free_completed events still owed for this address */
    uint8_t used, live, seen;
    uint8_t mark; /* scratch for the caller */
};
struct msh_addrmap {
    struct msh_addrmap_ent *e;
    size_t cap, n;
};
int msh_addrmap_init(struct msh_addrmap *m, size_t expect); /* 0 or ENOMEM */
/* The entry for addr; with create, a new zeroed one (NULL only on ENOMEM); without, NULL if none. */
struct msh_addrmap_ent *msh_addrmap_get(struct msh_addrmap *m, uint64_t addr, int create);
void msh_addrmap_free(struct msh_addrmap *m);

#endif
