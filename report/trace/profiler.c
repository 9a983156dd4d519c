/*
 * profiler.c: torch.profiler traces (the Chrome/Kineto JSON that prof.export_chrome_trace() and
 * torch.profiler.tensorboard_trace_handler write) turned into replayable allocation streams.
 * With profile_memory=True the trace holds one instant event per allocator call:
 *
 *   {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": 2,
 *    "ts": 1234.567, "args": {"Device Type": 1, "Device Id": 0, "Addr": 139872346112,
 *    "Bytes": 4096, "Total Allocated": 8192, "Total Reserved": 2097152}}
 *
 * (PyTorch's AddGenericMetadata for ExtraFields<Allocation>; kineto's handleGenericInstantEvent;
 * Bytes is the caching allocator's block size, negative on free; Device Type 1 is CUDA).
 *
 * The scanner is this file's own, not jansson: a trace of hundreds of MB is mostly kernel and
 * operator events the replay never needs, and a DOM of it would cost several times the file.
 * This one makes one pass over the bytes, keeps no tree, recurses nowhere (an explicit stack of
 * at most PROF_MAX_DEPTH containers), validates the whole document as strict JSON (RFC 8259,
 * except that bytes >= 0x80 inside strings are not checked as UTF-8), and keeps only what the
 * [memory] events say: 40 bytes per event. Every error names the byte offset (and line and
 * column) where it was found; no number in the file sizes any allocation.
 *
 * Streams: events are put in time order (ts, then file order: PyTorch writes each thread's
 * allocations as a group, so file order is not time order), one stream per CUDA device id, stream
 * value 0. A free of an address the trace never allocated is a block live before recording: a
 * prefix allocation of |Bytes| (as the snapshot reader does). Repairs, each one counted warning:
 * an alloc of a live address (the old block is freed first), a second free (dropped), a free
 * whose |Bytes| differs from the alloc's, Bytes 0 (dropped), |Bytes| above the event's Total
 * Reserved (kept), a CUDA [memory] event without Addr (dropped; older PyTorch).
 */
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROF_MAX_DEPTH 1000
#define PROF_MAX_DEVICES 1024
#define PROF_MAX_BYTES ((uint64_t)1 << 48) /* 256 TiB: no device has more; beyond is corruption */
#define PROF_DEVICE_CUDA 1                 /* c10::DeviceType::CUDA */

enum role { R_NONE, R_ROOT, R_EVLIST, R_EVENT, R_ARGS };
enum key {
    K_OTHER, K_TRACE_EVENTS, K_NAME, K_TS, K_ARGS,
    K_DEVTYPE, K_DEVID, K_ADDR, K_BYTES, K_TRES, /* args fields, in this order */
    K_COUNT
};
#define NARGF (K_COUNT - K_DEVTYPE)
enum jkind { J_ABSENT, J_NUM, J_STR, J_TRUE, J_FALSE, J_NULL, J_OBJ, J_ARR };

struct jval {
    uint8_t kind;
    size_t off, len; /* numbers: the literal */
};

/* what one traceEvents item said, as far as the replay cares */
struct evrec {
    size_t off;
    uint8_t is_mem;
    struct jval ts, args;
    struct jval f[NARGF];
};

/* one extracted [memory] event on a CUDA device */
struct pev {
    uint64_t addr;
    int64_t bytes;
    int64_t ts_ns;
    uint64_t reserved;
    uint32_t seq;       /* file order */
    uint16_t dev;
    uint8_t has_reserved, no_addr;
};

struct frame {
    uint8_t is_obj, role;
};

struct pparse {
    const unsigned char *b;
    size_t len, pos;
    struct frame st[PROF_MAX_DEPTH];
    int depth;
    struct evrec cur;
    struct pev *ev;
    size_t n, cap;
    size_t nmem, nmem_cuda, nmem_noaddr, nevents;
    int seen_evlist;
    char *err;
    size_t errlen;
};

/* ---- errors ----------------------------------------------------------------------------------- */

__attribute__((format(printf, 3, 4))) static int pfail(struct pparse *p, size_t off, const char *fmt, ...)
{
    if (!p->err || !p->errlen) return EINVAL;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < off && i < p->len; i++) {
        if (p->b[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    int n = snprintf(p->err, p->errlen, "offset %zu (line %zu, column %zu): ", off, line, col);
    if (n >= 0 && (size_t)n < p->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return EINVAL;
}

static int pnomem(struct pparse *p)
{
    if (p->err && p->errlen) snprintf(p->err, p->errlen, "out of memory reading the profiler trace");
    return ENOMEM;
}

/* The byte at off, printable, for a message. */
static const char *show(struct pparse *p, size_t off, char out[8])
{
    if (off >= p->len) return "the end of the input";
    unsigned c = p->b[off];
    if (c >= 0x20 && c < 0x7f) snprintf(out, 8, "'%c'", (char)c);
    else snprintf(out, 8, "0x%02x", c);
    return out;
}

static const char *kind_name(int k)
{
    switch (k) {
    case J_NUM: return "a number";
    case J_STR: return "a string";
    case J_TRUE: case J_FALSE: return "a boolean";
    case J_NULL: return "null";
    case J_OBJ: return "an object";
    case J_ARR: return "an array";
    default: return "missing";
    }
}

/* ---- lexical scanning ------------------------------------------------------------------------- */

static void skip_ws(struct pparse *p)
{
    while (p->pos < p->len) {
        unsigned char c = p->b[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int hexval(unsigned char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A string at p->pos (its '"'): validated, p->pos after the closing quote; [*s, *e) the raw
 * contents; *esc when it holds escapes. */
static int scan_string(struct pparse *p, size_t *s, size_t *e, int *esc)
{
    size_t start = p->pos++;
    *esc = 0;
    *s = p->pos;
    for (;;) {
        if (p->pos >= p->len) return pfail(p, start, "string not terminated before the end of the input");
        unsigned char c = p->b[p->pos];
        if (c == '"') break;
        if (c < 0x20) return pfail(p, p->pos, "control character 0x%02x inside a string", c);
        if (c != '\\') {
            p->pos++;
            continue;
        }
        *esc = 1;
        if (p->pos + 1 >= p->len) return pfail(p, p->pos, "escape cut by the end of the input");
        unsigned char x = p->b[p->pos + 1];
        if (x == 'u') {
            if (p->len - p->pos < 6) return pfail(p, p->pos, "\\u escape cut by the end of the input");
            for (int i = 2; i < 6; i++)
                if (hexval(p->b[p->pos + (size_t)i]) < 0)
                    return pfail(p, p->pos, "\\u escape needs 4 hex digits");
            p->pos += 6;
        } else if (strchr("\"\\/bfnrt", x) && x) {
            p->pos += 2;
        } else {
            char q[8];
            return pfail(p, p->pos, "invalid escape '\\' followed by %s", show(p, p->pos + 1, q));
        }
    }
    *e = p->pos++;
    return 0;
}

/* The contents of a validated string, unescaped, into out (NUL-terminated). Returns the length,
 * or -1 when it does not fit (then it is no key or name this reader looks for). */
static int unescape(struct pparse *p, size_t s, size_t e, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = s; i < e;) {
        unsigned c = p->b[i];
        if (c == '\\') {
            unsigned x = p->b[i + 1];
            if (x == 'u') {
                unsigned v = 0;
                for (int j = 2; j < 6; j++) v = v << 4 | (unsigned)hexval(p->b[i + (size_t)j]);
                i += 6;
                if (v < 0x80) {
                    c = v;
                } else { /* not ASCII: never part of a name we look for; keep a placeholder */
                    c = 0x80;
                }
            } else {
                c = x == 'b' ? '\b' : x == 'f' ? '\f' : x == 'n' ? '\n' : x == 'r' ? '\r' : x == 't' ? '\t' : x;
                i += 2;
            }
        } else {
            i++;
        }
        if (k + 1 >= cap) return -1;
        out[k++] = (char)c;
    }
    out[k] = 0;
    return (int)k;
}

/* A number at p->pos, by JSON's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int scan_number(struct pparse *p)
{
    size_t i = p->pos;
    char q[8];
    if (i < p->len && p->b[i] == '-') i++;
    if (i >= p->len || p->b[i] < '0' || p->b[i] > '9')
        return pfail(p, i, "expected a digit in a number, got %s", show(p, i, q));
    if (p->b[i] == '0') {
        i++;
    } else {
        while (i < p->len && p->b[i] >= '0' && p->b[i] <= '9') i++;
    }
    if (i < p->len && p->b[i] == '.') {
        i++;
        if (i >= p->len || p->b[i] < '0' || p->b[i] > '9')
            return pfail(p, i, "expected a digit after the decimal point, got %s", show(p, i, q));
        while (i < p->len && p->b[i] >= '0' && p->b[i] <= '9') i++;
    }
    if (i < p->len && (p->b[i] == 'e' || p->b[i] == 'E')) {
        i++;
        if (i < p->len && (p->b[i] == '+' || p->b[i] == '-')) i++;
        if (i >= p->len || p->b[i] < '0' || p->b[i] > '9')
            return pfail(p, i, "expected a digit in the exponent, got %s", show(p, i, q));
        while (i < p->len && p->b[i] >= '0' && p->b[i] <= '9') i++;
    }
    p->pos = i;
    return 0;
}

/* ---- numbers of interest ---------------------------------------------------------------------- */

enum { N_OK, N_NOTINT, N_RANGE };

/* An integer literal: its sign and magnitude. */
static int conv_int(const unsigned char *s, size_t n, int *neg, uint64_t *mag)
{
    size_t i = 0;
    *neg = 0;
    if (n && s[0] == '-') {
        *neg = 1;
        i = 1;
    }
    uint64_t v = 0;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return N_NOTINT;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10) {
            for (; i < n; i++)
                if (s[i] < '0' || s[i] > '9') return N_NOTINT; /* a float is "not an integer" first */
            return N_RANGE;
        }
        v = v * 10 + d;
    }
    *mag = v;
    return N_OK;
}

/* A number of microseconds (any JSON number: 1234, 1234.567, 1.2e3) as nanoseconds, truncated
 * toward zero; N_RANGE beyond +-2^63 ns. */
static int conv_ns(const unsigned char *s, size_t n, int64_t *out)
{
    size_t i = 0, fraclen = 0;
    int neg = 0;
    if (n && s[0] == '-') {
        neg = 1;
        i = 1;
    }
    size_t mant_s = i, mant_e = i;
    while (mant_e < n && s[mant_e] != 'e' && s[mant_e] != 'E') mant_e++;
    int64_t ex = 0;
    if (mant_e < n) { /* exponent, saturated well beyond anything that can fit */
        size_t k = mant_e + 1;
        int eneg = 0;
        if (k < n && (s[k] == '+' || s[k] == '-')) eneg = s[k++] == '-';
        for (; k < n; k++)
            if (ex < 1000000) ex = ex * 10 + (s[k] - '0');
        if (eneg) ex = -ex;
    }
    int seen_point = 0;
    for (size_t k = mant_s; k < mant_e; k++) {
        if (s[k] == '.') seen_point = 1;
        else if (seen_point) fraclen++;
    }
    /* significant digits: skip leading zeros (across the point) */
    size_t k = mant_s, nsig = 0;
    while (k < mant_e && (s[k] == '0' || s[k] == '.')) k++;
    size_t sig_s = k;
    for (; k < mant_e; k++) nsig += s[k] != '.';
    if (!nsig) {
        *out = 0;
        return N_OK;
    }
    /* value = sig * 10^e10, where e10 = ex + 3 (us -> ns) - fraclen */
    int64_t e10 = ex + 3 - (int64_t)fraclen;
    int64_t keep = (int64_t)nsig + (e10 < 0 ? e10 : 0); /* digits left of the point */
    if (keep <= 0) {
        *out = 0;
        return N_OK;
    }
    if (keep + (e10 > 0 ? e10 : 0) > 19) return N_RANGE;
    uint64_t v = 0;
    int64_t took = 0;
    for (k = sig_s; k < mant_e && took < keep; k++) {
        if (s[k] == '.') continue;
        v = v * 10 + (uint64_t)(s[k] - '0');
        took++;
    }
    for (int64_t j = 0; j < e10; j++) v *= 10; /* at most 19 digits in all: no overflow */
    if (v > (uint64_t)INT64_MAX) return N_RANGE;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return N_OK;
}

/* ---- the document walk ------------------------------------------------------------------------ */

static enum key key_of(int role, const char *k, int n)
{
    if (n < 0) return K_OTHER;
    static const struct { const char *s; int role; enum key k; } keys[] = {
        {"traceEvents", R_ROOT, K_TRACE_EVENTS}, {"name", R_EVENT, K_NAME},
        {"ts", R_EVENT, K_TS},                   {"args", R_EVENT, K_ARGS},
        {"Device Type", R_ARGS, K_DEVTYPE},      {"Device Id", R_ARGS, K_DEVID},
        {"Addr", R_ARGS, K_ADDR},                {"Bytes", R_ARGS, K_BYTES},
        {"Total Reserved", R_ARGS, K_TRES},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (keys[i].role == role && strlen(keys[i].s) == (size_t)n && memcmp(keys[i].s, k, (size_t)n) == 0)
            return keys[i].k;
    return K_OTHER;
}

static int push_pev(struct pparse *p, const struct pev *e)
{
    if (p->n == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 1024;
        if (nc > SIZE_MAX / sizeof *p->ev) return pnomem(p);
        struct pev *ne = realloc(p->ev, nc * sizeof *ne);
        if (!ne) return pnomem(p);
        p->ev = ne;
        p->cap = nc;
    }
    p->ev[p->n++] = *e;
    return 0;
}

static const char *const field_names[NARGF] = {"Device Type", "Device Id", "Addr", "Bytes", "Total Reserved"};

/* An integer args field of a [memory] event: present, an integer literal, in range. */
static int int_field(struct pparse *p, const struct evrec *r, enum key k, int required, int *neg, uint64_t *mag)
{
    const struct jval *v = &r->f[k - K_DEVTYPE];
    const char *name = field_names[k - K_DEVTYPE];
    if (v->kind == J_ABSENT) {
        if (required) return pfail(p, r->off, "[memory] event without args '%s'", name);
        return 1;
    }
    if (v->kind != J_NUM)
        return pfail(p, v->off, "[memory] event: '%s' is %s, expected an integer", name, kind_name(v->kind));
    int rc = conv_int(p->b + v->off, v->len, neg, mag);
    if (rc == N_NOTINT)
        return pfail(p, v->off, "[memory] event: '%s' %.*s is not an integer", name, (int)(v->len < 40 ? v->len : 40),
                     (const char *)p->b + v->off);
    if (rc == N_RANGE)
        return pfail(p, v->off, "[memory] event: '%s' %.*s%s does not fit in 64 bits", name,
                     (int)(v->len < 40 ? v->len : 40), (const char *)p->b + v->off, v->len > 40 ? "..." : "");
    return 0;
}

/* The end of one traceEvents item: keep it when it is a [memory] event on a CUDA device. */
static int end_event(struct pparse *p)
{
    struct evrec *r = &p->cur;
    p->nevents++;
    if (!r->is_mem) return 0;
    p->nmem++;
    if (r->args.kind == J_ABSENT) return pfail(p, r->off, "[memory] event without 'args'");
    if (r->args.kind != J_OBJ)
        return pfail(p, r->args.off, "[memory] event: 'args' is %s, expected an object", kind_name(r->args.kind));
    int neg, rc;
    uint64_t type, id, addr = 0, bytes, res = 0;
    if ((rc = int_field(p, r, K_DEVTYPE, 1, &neg, &type))) return rc;
    if (neg || type != PROF_DEVICE_CUDA) return 0; /* CPU and other devices: not replayed */
    p->nmem_cuda++;
    if ((rc = int_field(p, r, K_DEVID, 1, &neg, &id))) return rc;
    if (neg || id >= PROF_MAX_DEVICES)
        return pfail(p, r->f[K_DEVID - K_DEVTYPE].off, "[memory] event: CUDA 'Device Id' %s%" PRIu64
                     " out of range (0 to %d)", neg ? "-" : "", id, PROF_MAX_DEVICES - 1);
    if ((rc = int_field(p, r, K_BYTES, 1, &neg, &bytes))) return rc;
    if (bytes > PROF_MAX_BYTES)
        return pfail(p, r->f[K_BYTES - K_DEVTYPE].off, "[memory] event: 'Bytes' %s%" PRIu64 " out of range "
                     "(|Bytes| at most 2^48)", neg ? "-" : "", bytes);
    struct pev e = {.dev = (uint16_t)id, .bytes = neg ? -(int64_t)bytes : (int64_t)bytes};
    int absent = int_field(p, r, K_ADDR, 0, &neg, &addr);
    if (absent > 1) return absent;
    if (absent) {
        p->nmem_noaddr++;
        e.no_addr = 1;
    } else if (neg) {
        if (addr > (uint64_t)1 << 63)
            return pfail(p, r->f[K_ADDR - K_DEVTYPE].off, "[memory] event: 'Addr' -%" PRIu64 " out of range", addr);
        addr = (uint64_t)0 - addr; /* intptr_t written signed: keep the bits */
    }
    e.addr = addr;
    int nores = int_field(p, r, K_TRES, 0, &neg, &res);
    if (nores > 1) return nores;
    if (!nores) {
        if (neg)
            return pfail(p, r->f[K_TRES - K_DEVTYPE].off, "[memory] event: 'Total Reserved' is negative");
        e.reserved = res;
        e.has_reserved = 1;
    }
    if (r->ts.kind == J_ABSENT) return pfail(p, r->off, "[memory] event without 'ts'");
    if (r->ts.kind != J_NUM)
        return pfail(p, r->ts.off, "[memory] event: 'ts' is %s, expected a number", kind_name(r->ts.kind));
    if (conv_ns(p->b + r->ts.off, r->ts.len, &e.ts_ns) != N_OK)
        return pfail(p, r->ts.off, "[memory] event: 'ts' %.*s%s is out of range",
                     (int)(r->ts.len < 40 ? r->ts.len : 40), (const char *)p->b + r->ts.off,
                     r->ts.len > 40 ? "..." : "");
    if (p->n >= UINT32_MAX) return pfail(p, r->off, "more than 2^32 [memory] events");
    e.seq = (uint32_t)p->n;
    return push_pev(p, &e);
}

/* Records a scalar or container value met at `role`'s child `k` (for the fields kept). */
static void note_value(struct pparse *p, int parent_role, enum key k, int kind, size_t off, size_t len)
{
    struct jval v = {.kind = (uint8_t)kind, .off = off, .len = len};
    if (parent_role == R_EVENT) {
        if (k == K_TS) p->cur.ts = v;
        else if (k == K_ARGS) p->cur.args = v;
    } else if (parent_role == R_ARGS && k >= K_DEVTYPE && k < K_COUNT) {
        p->cur.f[k - K_DEVTYPE] = v;
    }
}

static int walk(struct pparse *p)
{
    enum { S_VALUE, S_FIRST_VALUE, S_AFTER, S_KEY, S_FIRST_KEY } state = S_VALUE;
    enum key k = K_OTHER; /* the key of the value about to be read */
    char q[8];
    skip_ws(p);
    if (p->pos >= p->len) return pfail(p, p->pos, "empty JSON document");
    if (p->b[p->pos] != '{' && p->b[p->pos] != '[')
        return pfail(p, p->pos, "expected '{' or '[' to open the trace, got %s", show(p, p->pos, q));
    for (;;) {
        skip_ws(p);
        if (state == S_AFTER) {
            if (p->depth == 0) break;
            struct frame *top = &p->st[p->depth - 1];
            if (p->pos >= p->len)
                return pfail(p, p->pos, "the input ends inside %s (%d levels deep): truncated file?",
                             top->is_obj ? "an object" : "an array", p->depth);
            unsigned char c = p->b[p->pos];
            if (c == ',') {
                p->pos++;
                state = top->is_obj ? S_KEY : S_VALUE;
                k = K_OTHER;
                continue;
            }
            if (c != (top->is_obj ? '}' : ']'))
                return pfail(p, p->pos, "expected ',' or '%c' after a value in %s, got %s", top->is_obj ? '}' : ']',
                             top->is_obj ? "an object" : "an array", show(p, p->pos, q));
            p->pos++;
            p->depth--;
            if (top->role == R_EVENT) {
                int rc = end_event(p);
                if (rc) return rc;
            }
            continue;
        }
        if (state == S_KEY || state == S_FIRST_KEY) {
            struct frame *top = &p->st[p->depth - 1];
            if (p->pos >= p->len)
                return pfail(p, p->pos, "the input ends inside an object (%d levels deep): truncated file?", p->depth);
            if (state == S_FIRST_KEY && p->b[p->pos] == '}') {
                state = S_AFTER;
                continue; /* closed by S_AFTER */
            }
            if (p->b[p->pos] != '"')
                return pfail(p, p->pos, "expected a string key in an object, got %s", show(p, p->pos, q));
            size_t s, e;
            int esc, rc;
            if ((rc = scan_string(p, &s, &e, &esc))) return rc;
            k = K_OTHER;
            if (top->role == R_ROOT || top->role == R_EVENT || top->role == R_ARGS) {
                char kb[32];
                if (esc) {
                    k = key_of(top->role, kb, unescape(p, s, e, kb, sizeof kb));
                } else {
                    k = key_of(top->role, (const char *)p->b + s, e - s < 32 ? (int)(e - s) : -1);
                }
            }
            skip_ws(p);
            if (p->pos >= p->len || p->b[p->pos] != ':')
                return pfail(p, p->pos, "expected ':' after an object key, got %s", show(p, p->pos, q));
            p->pos++;
            state = S_VALUE;
            continue;
        }
        /* S_VALUE / S_FIRST_VALUE */
        int parent = p->depth ? p->st[p->depth - 1].role : R_NONE;
        if (p->pos >= p->len) {
            if (!p->depth) return pfail(p, p->pos, "empty JSON document");
            return pfail(p, p->pos, "the input ends where a value was expected (%d levels deep): truncated file?",
                         p->depth);
        }
        unsigned char c = p->b[p->pos];
        if (state == S_FIRST_VALUE && c == ']') {
            state = S_AFTER;
            continue;
        }
        int role = R_NONE;
        if (!p->depth) role = c == '[' ? R_EVLIST : R_ROOT;
        else if (parent == R_ROOT && k == K_TRACE_EVENTS) role = R_EVLIST;
        else if (parent == R_EVLIST) role = R_EVENT;
        else if (parent == R_EVENT && k == K_ARGS) role = R_ARGS;
        if (role == R_EVLIST) p->seen_evlist = 1;
        if (!strchr("{[\"-0123456789tfn", c) || !c)
            return pfail(p, p->pos, "expected a JSON value, got %s", show(p, p->pos, q));
        if (role == R_EVLIST && c != '[')
            return pfail(p, p->pos, "'traceEvents' is not an array (got %s)", show(p, p->pos, q));
        if (role == R_EVENT && c != '{')
            return pfail(p, p->pos, "a traceEvents item is not an object (got %s)", show(p, p->pos, q));
        size_t off = p->pos;
        if (c == '{' || c == '[') {
            if (p->depth >= PROF_MAX_DEPTH)
                return pfail(p, p->pos, "JSON nested deeper than %d levels", PROF_MAX_DEPTH);
            note_value(p, parent, k, c == '{' ? J_OBJ : J_ARR, off, 0);
            if (parent == R_EVENT && k == K_NAME) p->cur.is_mem = 0; /* the last 'name' counts */
            if (role == R_EVENT) {
                memset(&p->cur, 0, sizeof p->cur);
                p->cur.off = off;
            }
            if (role == R_ARGS) /* a second 'args': only its fields count */
                memset(p->cur.f, 0, sizeof p->cur.f);
            p->st[p->depth++] = (struct frame){.is_obj = c == '{', .role = (uint8_t)role};
            p->pos++;
            state = c == '{' ? S_FIRST_KEY : S_FIRST_VALUE;
            k = K_OTHER;
            continue;
        }
        int rc = 0;
        if (c == '"') {
            size_t s, e;
            int esc;
            if ((rc = scan_string(p, &s, &e, &esc))) return rc;
            note_value(p, parent, k, J_STR, off, 0);
            if (parent == R_EVENT && k == K_NAME) {
                char nb[16];
                int n = esc ? unescape(p, s, e, nb, sizeof nb) : (e - s < sizeof nb ? (int)(e - s) : -1);
                const char *nm = esc ? nb : (const char *)p->b + s;
                p->cur.is_mem = n == 8 && memcmp(nm, "[memory]", 8) == 0;
            }
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if ((rc = scan_number(p))) return rc;
            note_value(p, parent, k, J_NUM, off, p->pos - off);
        } else if (c == 't' || c == 'f' || c == 'n') {
            const char *lit = c == 't' ? "true" : c == 'f' ? "false" : "null";
            size_t ln = strlen(lit);
            if (p->len - p->pos < ln || memcmp(p->b + p->pos, lit, ln) != 0)
                return pfail(p, p->pos, "invalid literal (expected %s)", lit);
            p->pos += ln;
            note_value(p, parent, k, c == 't' ? J_TRUE : c == 'f' ? J_FALSE : J_NULL, off, 0);
        } else {
            return pfail(p, p->pos, "expected a JSON value, got %s", show(p, p->pos, q));
        }
        if (parent == R_EVENT && k == K_NAME && c != '"') p->cur.is_mem = 0;
        state = S_AFTER;
    }
    skip_ws(p);
    if (p->pos < p->len)
        return pfail(p, p->pos, "unexpected %s after the end of the JSON document", show(p, p->pos, q));
    return 0;
}

/* ---- events to streams ------------------------------------------------------------------------ */

static int by_time(const void *a, const void *b)
{
    const struct pev *x = a, *y = b;
    if (x->ts_ns != y->ts_ns) return x->ts_ns < y->ts_ns ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static int by_addr(const void *a, const void *b)
{
    const struct msh_trace_event *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

struct pdev {
    struct msh_trace rec, prefix;
    struct msh_addrmap map;
    size_t nev;
    uint64_t first_time;
    int has_time;
};

static int pushe(struct msh_trace *t, uint8_t op, uint64_t addr, uint64_t size, uint64_t time_us, uint8_t prefix)
{
    struct msh_trace_event e = {.addr = addr, .size = size, .time_us = time_us, .op = op, .prefix = prefix};
    return msh_trace_push(t, &e);
}

static int replay_event(struct pdev *d, const struct pev *e)
{
    struct msh_trace *t = &d->rec;
    t->nraw_events++;
    if (e->has_reserved) {
        if (e->reserved > t->recorded_peak_reserved) t->recorded_peak_reserved = e->reserved;
        t->recorded_final_reserved = e->reserved;
    }
    uint64_t time_us = e->ts_ns > 0 ? (uint64_t)e->ts_ns / 1000 : 0;
    if (!d->has_time) {
        d->has_time = 1;
        d->first_time = time_us;
    }
    if (e->no_addr || e->bytes == 0) { /* nothing to replay */
        t->warnings++;
        return 0;
    }
    uint64_t size = e->bytes > 0 ? (uint64_t)e->bytes : (uint64_t)-e->bytes;
    if (e->has_reserved && e->reserved && size > e->reserved) t->warnings++;
    struct msh_addrmap_ent *ent = msh_addrmap_get(&d->map, e->addr, 1);
    if (!ent) return ENOMEM;
    if (e->bytes > 0) {
        if (ent->live) { /* duplicate alloc: free the old block first */
            t->warnings++;
            if (pushe(t, MSH_OP_FREE, e->addr, ent->size, time_us, 0)) return ENOMEM;
        }
        ent->live = ent->seen = 1;
        ent->size = size;
        return pushe(t, MSH_OP_ALLOC, e->addr, size, time_us, 0) ? ENOMEM : 0;
    }
    if (ent->live) {
        if (ent->size != size) t->warnings++;
        ent->live = 0;
        return pushe(t, MSH_OP_FREE, e->addr, ent->size, time_us, 0) ? ENOMEM : 0;
    }
    if (!ent->seen) { /* live since before recording began */
        ent->seen = 1;
        ent->size = size;
        if (pushe(&d->prefix, MSH_OP_ALLOC, e->addr, size, 0, 1)) return ENOMEM;
        return pushe(t, MSH_OP_FREE, e->addr, size, time_us, 0) ? ENOMEM : 0;
    }
    t->warnings++; /* a second free of a block: dropped */
    return 0;
}

/* Prefix (in address order, stamped with the first time) then the recorded events, into out. */
static int finish(struct pdev *d, int dev, struct msh_trace *out)
{
    if (d->prefix.n > SIZE_MAX / sizeof(struct msh_trace_event) - d->rec.n - 1) return ENOMEM;
    size_t n = d->prefix.n + d->rec.n;
    /* the recorded events' vector becomes the stream, grown in place for the prefix */
    struct msh_trace_event *ev = realloc(d->rec.ev, (n ? n : 1) * sizeof *ev);
    if (!ev) return ENOMEM;
    d->rec.ev = NULL;
    *out = d->rec;
    out->device = dev;
    out->ev = ev;
    if (d->prefix.n) {
        qsort(d->prefix.ev, d->prefix.n, sizeof *d->prefix.ev, by_addr);
        for (size_t i = 0; i < d->prefix.n; i++) d->prefix.ev[i].time_us = d->first_time;
        memmove(ev + d->prefix.n, ev, d->rec.n * sizeof *ev);
        memcpy(ev, d->prefix.ev, d->prefix.n * sizeof *ev);
    }
    out->n = out->cap = n;
    out->nprefix = d->prefix.n;
    msh_trace_analyze(out);
    return 0;
}

static int build(struct pparse *p, struct msh_trace_set *s)
{
    int sorted = 1;
    for (size_t i = 1; i < p->n && sorted; i++) sorted = p->ev[i - 1].ts_ns <= p->ev[i].ts_ns;
    if (!sorted) qsort(p->ev, p->n, sizeof *p->ev, by_time);
    struct pdev **by_dev = calloc(PROF_MAX_DEVICES, sizeof *by_dev);
    if (!by_dev) return pnomem(p);
    size_t ndev = 0;
    for (size_t i = 0; i < p->n; i++) {
        if (!by_dev[p->ev[i].dev]) {
            if (!(by_dev[p->ev[i].dev] = calloc(1, sizeof **by_dev))) break;
            ndev++;
        }
        by_dev[p->ev[i].dev]->nev++;
    }
    int rc = 0;
    for (int d = 0; d < PROF_MAX_DEVICES && !rc; d++)
        if (by_dev[d] && msh_addrmap_init(&by_dev[d]->map, by_dev[d]->nev / 2 + 16)) rc = ENOMEM;
    size_t counted = 0;
    for (int d = 0; d < PROF_MAX_DEVICES; d++) counted += by_dev[d] ? by_dev[d]->nev : 0;
    if (counted != p->n) rc = ENOMEM; /* a calloc above failed */
    for (size_t i = 0; i < p->n && !rc; i++) rc = replay_event(by_dev[p->ev[i].dev], &p->ev[i]);
    free(p->ev); /* the streams are built: the extracted events are no longer needed */
    p->ev = NULL;
    p->n = p->cap = 0;
    if (!rc && !(s->dev = calloc(ndev ? ndev : 1, sizeof *s->dev))) rc = ENOMEM;
    for (int d = 0; d < PROF_MAX_DEVICES; d++) {
        struct pdev *b = by_dev[d];
        if (!b) continue;
        if (!rc) rc = finish(b, d, &s->dev[s->ndev]);
        if (!rc) s->ndev++;
        free(b->rec.ev);
        free(b->prefix.ev);
        msh_addrmap_free(&b->map);
        free(b);
    }
    free(by_dev);
    return rc ? pnomem(p) : 0;
}

int msh_trace_load_profiler_mem(const char *buf, size_t len, struct msh_trace_set **out, char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen) err[0] = 0;
    struct pparse *p = calloc(1, sizeof *p);
    if (!p) {
        if (err && errlen) snprintf(err, errlen, "out of memory reading the profiler trace");
        return ENOMEM;
    }
    p->b = (const unsigned char *)(buf ? buf : "");
    p->len = buf ? len : 0;
    p->err = err;
    p->errlen = errlen;
    if (p->len >= 3 && memcmp(p->b, "\xef\xbb\xbf", 3) == 0) p->pos = 3; /* a UTF-8 byte order mark */
    int rc = walk(p);
    if (!rc && !p->seen_evlist) {
        if (err && errlen)
            snprintf(err, errlen, "unrecognised trace format: a JSON document without a 'traceEvents' array "
                                  "(expected a torch.profiler / Chrome trace)");
        rc = EINVAL;
    } else if (!rc && !p->nmem) {
        if (err && errlen)
            snprintf(err, errlen, "the trace has %zu events and no [memory] event: record it with "
                                  "torch.profiler.profile(profile_memory=True)", p->nevents);
        rc = EINVAL;
    } else if (!rc && !p->nmem_cuda) {
        if (err && errlen)
            snprintf(err, errlen, "the trace's %zu [memory] events are all on the CPU or other non-CUDA "
                                  "devices: nothing to replay", p->nmem);
        rc = EINVAL;
    } else if (!rc && p->nmem_noaddr == p->nmem_cuda) {
        if (err && errlen)
            snprintf(err, errlen, "the trace's %zu CUDA [memory] events have no 'Addr' (written by an older "
                                  "PyTorch): allocations cannot be matched to frees", p->nmem_cuda);
        rc = EINVAL;
    }
    struct msh_trace_set *s = NULL;
    if (!rc) {
        s = calloc(1, sizeof *s);
        if (!s || !(s->format = strdup("pytorch-profiler"))) {
            free(s);
            s = NULL;
            rc = pnomem(p);
        } else if ((rc = build(p, s))) {
            msh_trace_set_free(s);
            s = NULL;
        }
    }
    free(p->ev);
    free(p);
    if (!rc) *out = s;
    return rc;
}
