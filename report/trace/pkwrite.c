/*
 * pkwrite.c: a pickle protocol 4 writer for plain containers (see pkwrite.h for the opcode set
 * and why it is that set). Containers are written as EMPTY_DICT/EMPTY_LIST, then MARK, items,
 * SETITEMS/APPENDS in batches of at most BATCH items, as CPython's own pickler does. It never
 * executes or names a Python global, so what it writes loads with an unpickler that refuses every
 * class (the safe way to read a snapshot). Must never be called with a memshim lock held.
 */
#include "pkwrite.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define BATCH 1000
#define MAX_OPEN ((int)(sizeof ((struct pkw *)0)->open / sizeof ((struct pkw *)0)->open[0]))

void pkw_init(struct pkw *w)
{
    memset(w, 0, sizeof *w);
}

void pkw_free(struct pkw *w)
{
    free(w->buf);
    memset(w, 0, sizeof *w);
}

static void put(struct pkw *w, const void *p, size_t n)
{
    if (w->err) return;
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 64 * 1024;
        while (cap < w->len + n) cap *= 2;
        unsigned char *b = realloc(w->buf, cap);
        if (!b) {
            w->err = ENOMEM;
            return;
        }
        w->buf = b;
        w->cap = cap;
    }
    memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static void op(struct pkw *w, unsigned char c)
{
    put(w, &c, 1);
}

static void put_le(struct pkw *w, uint64_t v, int n)
{
    unsigned char b[8];
    for (int i = 0; i < n; i++) b[i] = (unsigned char)(v >> (8 * i));
    put(w, b, (size_t)n);
}

/* One more item in the innermost container: a new MARK after each full batch. */
static void item(struct pkw *w)
{
    if (w->nopen == 0) return;
    int k = w->nopen - 1;
    if (w->open[k].pending == BATCH * (w->open[k].kind == 'd' ? 2u : 1u)) {
        op(w, w->open[k].kind == 'd' ? 'u' : 'e'); /* SETITEMS / APPENDS */
        op(w, '(');                               /* MARK */
        w->open[k].pending = 0;
    }
    w->open[k].pending++;
}

void pkw_begin(struct pkw *w)
{
    op(w, 0x80);
    op(w, 4);
}

void pkw_end(struct pkw *w)
{
    op(w, '.');
}

void pkw_none(struct pkw *w)
{
    item(w);
    op(w, 'N');
}

void pkw_bool(struct pkw *w, int v)
{
    item(w);
    op(w, v ? 0x88 : 0x89);
}

static void int_raw(struct pkw *w, int64_t v)
{
    if (v >= 0 && v < 256) {
        op(w, 'K');
        op(w, (unsigned char)v);
    } else if (v >= 0 && v < 65536) {
        op(w, 'M');
        put_le(w, (uint64_t)v, 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
        op(w, 'J');
        put_le(w, (uint64_t)(uint32_t)(int32_t)v, 4);
    } else {
        /* LONG1: little-endian two's complement, as few bytes as keep the sign */
        int n = 8;
        while (n > 1) {
            int64_t top = v >> (8 * (n - 1) - 1);
            if (top != 0 && top != -1) break;
            n--;
        }
        op(w, 0x8a);
        op(w, (unsigned char)n);
        put_le(w, (uint64_t)v, n);
    }
}

void pkw_int(struct pkw *w, int64_t v)
{
    item(w);
    int_raw(w, v);
}

void pkw_uint(struct pkw *w, uint64_t v)
{
    if (v <= (uint64_t)INT64_MAX) {
        pkw_int(w, (int64_t)v);
        return;
    }
    item(w);
    op(w, 0x8a); /* 9 bytes: the value and a zero sign byte */
    op(w, 9);
    put_le(w, v, 8);
    op(w, 0);
}

void pkw_float(struct pkw *w, double v)
{
    item(w);
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(u >> (56 - 8 * i)); /* big-endian */
    op(w, 'G');
    put(w, b, 8);
}

void pkw_strn(struct pkw *w, const char *s, size_t n)
{
    item(w);
    if (n > 0xffffffffu) n = 0xffffffffu;
    if (n < 256) {
        op(w, 0x8c);
        op(w, (unsigned char)n);
    } else {
        op(w, 'X');
        put_le(w, n, 4);
    }
    put(w, s, n);
}

void pkw_str(struct pkw *w, const char *s)
{
    pkw_strn(w, s ? s : "", s ? strlen(s) : 0);
}

static void open_container(struct pkw *w, char kind)
{
    item(w);
    op(w, kind == 'd' ? '}' : ']');
    if (w->nopen == MAX_OPEN) {
        w->err = EINVAL;
        return;
    }
    w->open[w->nopen].kind = kind;
    w->open[w->nopen].pending = 0;
    w->nopen++;
    op(w, '(');
}

void pkw_dict(struct pkw *w)
{
    open_container(w, 'd');
}

void pkw_list(struct pkw *w)
{
    open_container(w, 'l');
}

void pkw_close(struct pkw *w)
{
    if (w->nopen == 0) {
        w->err = EINVAL;
        return;
    }
    w->nopen--;
    op(w, w->open[w->nopen].kind == 'd' ? 'u' : 'e');
}

void pkw_tuple2_int(struct pkw *w, int64_t a, int64_t b)
{
    item(w);
    int_raw(w, a);
    int_raw(w, b);
    op(w, 0x86); /* TUPLE2 */
}

uint32_t pkw_memoize(struct pkw *w)
{
    op(w, 0x94);
    return w->memo++;
}

void pkw_get(struct pkw *w, uint32_t idx)
{
    item(w);
    if (idx < 256) {
        op(w, 'h');
        op(w, (unsigned char)idx);
    } else {
        op(w, 'j');
        put_le(w, idx, 4);
    }
}

void pkw_str_memo(struct pkw *w, const char *s, uint32_t *slot)
{
    if (*slot) {
        pkw_get(w, *slot - 1);
        return;
    }
    pkw_str(w, s);
    *slot = pkw_memoize(w) + 1;
}
