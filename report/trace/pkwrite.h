/*
 * pkwrite.h: a writer for the plain-container subset of Python pickle protocol 4 that PyTorch's
 * memory snapshots use (dict, list, tuple, str, int, float, bool, None), emitting only the
 * opcodes that both CPython's unpickler and the JavaScript unpickler of PyTorch's memory viewer
 * (MemoryViz.js) read: PROTO, EMPTY_DICT/LIST/TUPLE, MARK, SETITEMS, APPENDS, TUPLE2, BININT1/2,
 * BININT, LONG1, BINFLOAT, SHORT_BINUNICODE, BINUNICODE, NONE, NEWTRUE/NEWFALSE, MEMOIZE,
 * BINGET, LONG_BINGET, STOP. Repeated values are written once and referenced through the memo.
 *
 * The buffer grows with realloc: never use it with a memshim lock held. An allocation failure is
 * sticky (pkw.err = ENOMEM) and every later call does nothing.
 */
#ifndef MSH_PKWRITE_H
#define MSH_PKWRITE_H

#include <stddef.h>
#include <stdint.h>

struct pkw {
    unsigned char *buf;
    size_t len, cap;
    int err;
    uint32_t memo; /* values memoized so far: the next MEMOIZE gets this index */
    struct { char kind; uint32_t pending; } open[64]; /* open containers, innermost last */
    int nopen;
};

void pkw_init(struct pkw *w);
void pkw_free(struct pkw *w);
void pkw_begin(struct pkw *w); /* PROTO 4 */
void pkw_end(struct pkw *w);   /* STOP */

void pkw_none(struct pkw *w);
void pkw_bool(struct pkw *w, int v);
void pkw_int(struct pkw *w, int64_t v);
void pkw_uint(struct pkw *w, uint64_t v);
void pkw_float(struct pkw *w, double v);
void pkw_str(struct pkw *w, const char *s);
void pkw_strn(struct pkw *w, const char *s, size_t n);

/* Containers: open one, write its items (a dict: key, value, key, value...), close it. Items are
 * flushed in batches so the unpickler's stack stays small. */
void pkw_dict(struct pkw *w);
void pkw_list(struct pkw *w);
void pkw_close(struct pkw *w); /* the innermost open dict or list */
void pkw_tuple2_int(struct pkw *w, int64_t a, int64_t b); /* (a, b) */

/* Memoize the value just completed; returns its memo index. pkw_get() writes it again. */
uint32_t pkw_memoize(struct pkw *w);
void pkw_get(struct pkw *w, uint32_t idx);

/* A string written once, then referenced: *slot holds the memo index + 1 (0: not yet written). */
void pkw_str_memo(struct pkw *w, const char *s, uint32_t *slot);

#endif
