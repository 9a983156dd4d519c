/*
 * pickle.c: a bounds-checked, iterative reader for the plain-container subset of Python pickle
 * (what CPython's pickle writes, protocols 2-5, for dict/list/tuple/set/str/bytes/int/float/bool/
 * None), used to read PyTorch memory snapshots. It must never execute, import or look up
 * anything: any opcode outside the subset is refused with its name and offset. It must never
 * trust a length field (each is checked against the bytes that remain before anything is
 * allocated), never recurse on input structure (the opcode loop is flat and the document is
 * freed chunk by chunk), and never let memory grow faster than the input: every node comes from
 * one capped arena, the stack, mark and memo tables are capped, and a memo index beyond the
 * input length is refused.
 */
#include "pickle.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ------------------------------------------------------------------------------------ */

struct pk_chunk {
    struct pk_chunk *next;
    size_t cap, used;
    unsigned char data[];
};

struct msh_pk_doc {
    struct pk_chunk *chunks; /* newest first; only the newest is allocated from */
    size_t total, limit;
    int over_limit;
    struct msh_pk *root;
};

#define PK_CHUNK_MIN ((size_t)64 << 10)
#define PK_CHUNK_MAX ((size_t)1 << 20)

static void *arena_alloc(struct msh_pk_doc *d, size_t n)
{
    n = (n + 7) & ~(size_t)7;
    struct pk_chunk *c = d->chunks;
    if (c && c->cap - c->used >= n) {
        void *p = c->data + c->used;
        c->used += n;
        return p;
    }
    size_t want = c ? c->cap * 2 : PK_CHUNK_MIN;
    if (want > PK_CHUNK_MAX) want = PK_CHUNK_MAX;
    if (want < n) want = n;
    if (want > d->limit || d->total > d->limit - want) {
        d->over_limit = 1;
        return NULL;
    }
    c = malloc(sizeof *c + want);
    if (!c) return NULL;
    c->cap = want;
    c->used = n;
    c->next = d->chunks;
    d->chunks = c;
    d->total += want;
    return c->data;
}

/* Grow the arena block p (old bytes) to new bytes, in place when it is the newest allocation. */
static void *arena_grow(struct msh_pk_doc *d, void *p, size_t old, size_t new)
{
    old = (old + 7) & ~(size_t)7;
    size_t n = (new + 7) & ~(size_t)7;
    struct pk_chunk *c = d->chunks;
    if (p && c && (unsigned char *)p + old == c->data + c->used && c->cap - c->used >= n - old) {
        c->used += n - old;
        return p;
    }
    void *q = arena_alloc(d, n);
    if (q && p && old) memcpy(q, p, old);
    return q;
}

void msh_pk_free(struct msh_pk_doc *d)
{
    if (!d) return;
    struct pk_chunk *c = d->chunks;
    while (c) {
        struct pk_chunk *next = c->next;
        free(c);
        c = next;
    }
    free(d);
}

const struct msh_pk *msh_pk_root(const struct msh_pk_doc *d) { return d ? d->root : NULL; }
size_t msh_pk_arena_bytes(const struct msh_pk_doc *d) { return d ? d->total : 0; }

/* ---- opcodes ---------------------------------------------------------------------------------- */

enum {
    OP_MARK = 0x28, OP_STOP = 0x2e, OP_POP = 0x30, OP_POP_MARK = 0x31, OP_DUP = 0x32,
    OP_BININT = 0x4a, OP_BININT1 = 0x4b, OP_BININT2 = 0x4d, OP_NONE = 0x4e, OP_BINFLOAT = 0x47,
    OP_BINBYTES = 0x42, OP_SHORT_BINBYTES = 0x43, OP_UNICODE = 0x56, OP_BINUNICODE = 0x58,
    OP_EMPTY_LIST = 0x5d, OP_APPEND = 0x61, OP_DICT = 0x64, OP_APPENDS = 0x65, OP_BINGET = 0x68,
    OP_LONG_BINGET = 0x6a, OP_LIST = 0x6c, OP_BINPUT = 0x71, OP_LONG_BINPUT = 0x72,
    OP_SETITEM = 0x73, OP_TUPLE = 0x74, OP_EMPTY_TUPLE = 0x29, OP_SETITEMS = 0x75,
    OP_EMPTY_DICT = 0x7d, OP_PROTO = 0x80, OP_TUPLE1 = 0x85, OP_TUPLE2 = 0x86, OP_TUPLE3 = 0x87,
    OP_NEWTRUE = 0x88, OP_NEWFALSE = 0x89, OP_LONG1 = 0x8a, OP_LONG4 = 0x8b,
    OP_SHORT_BINUNICODE = 0x8c, OP_BINUNICODE8 = 0x8d, OP_BINBYTES8 = 0x8e, OP_EMPTY_SET = 0x8f,
    OP_ADDITEMS = 0x90, OP_FROZENSET = 0x91, OP_MEMOIZE = 0x94, OP_FRAME = 0x95,
};

const char *msh_pk_opcode_name(unsigned char op)
{
    switch (op) {
    case 0x28: return "MARK";            case 0x2e: return "STOP";
    case 0x30: return "POP";             case 0x31: return "POP_MARK";
    case 0x32: return "DUP";             case 0x46: return "FLOAT";
    case 0x49: return "INT";             case 0x4a: return "BININT";
    case 0x4b: return "BININT1";         case 0x4c: return "LONG";
    case 0x4d: return "BININT2";         case 0x4e: return "NONE";
    case 0x50: return "PERSID";          case 0x51: return "BINPERSID";
    case 0x52: return "REDUCE";          case 0x53: return "STRING";
    case 0x54: return "BINSTRING";       case 0x55: return "SHORT_BINSTRING";
    case 0x56: return "UNICODE";         case 0x58: return "BINUNICODE";
    case 0x61: return "APPEND";          case 0x62: return "BUILD";
    case 0x63: return "GLOBAL";          case 0x64: return "DICT";
    case 0x7d: return "EMPTY_DICT";      case 0x65: return "APPENDS";
    case 0x67: return "GET";             case 0x68: return "BINGET";
    case 0x69: return "INST";            case 0x6a: return "LONG_BINGET";
    case 0x6c: return "LIST";            case 0x5d: return "EMPTY_LIST";
    case 0x6f: return "OBJ";             case 0x70: return "PUT";
    case 0x71: return "BINPUT";          case 0x72: return "LONG_BINPUT";
    case 0x73: return "SETITEM";         case 0x74: return "TUPLE";
    case 0x29: return "EMPTY_TUPLE";     case 0x75: return "SETITEMS";
    case 0x47: return "BINFLOAT";        case 0x80: return "PROTO";
    case 0x81: return "NEWOBJ";          case 0x82: return "EXT1";
    case 0x83: return "EXT2";            case 0x84: return "EXT4";
    case 0x85: return "TUPLE1";          case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";          case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";        case 0x8a: return "LONG1";
    case 0x8b: return "LONG4";           case 0x42: return "BINBYTES";
    case 0x43: return "SHORT_BINBYTES";  case 0x8c: return "SHORT_BINUNICODE";
    case 0x8d: return "BINUNICODE8";     case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET";       case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";       case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL";    case 0x94: return "MEMOIZE";
    case 0x95: return "FRAME";           case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";     case 0x98: return "READONLY_BUFFER";
    default: return NULL;
    }
}

const char *msh_pk_kind_name(int kind)
{
    static const char *const names[] = {"None", "bool", "int",   "float", "str",      "bytes",
                                        "tuple", "list", "dict", "set",   "frozenset"};
    return kind >= 0 && kind < (int)(sizeof names / sizeof names[0]) ? names[kind] : "?";
}

/* ---- parser ----------------------------------------------------------------------------------- */

struct pk_parser {
    const unsigned char *b;
    size_t len, pos, at; /* at: offset of the opcode being executed */
    unsigned char op;
    struct msh_pk_doc *doc;
    struct msh_pk_limits lim;
    struct msh_pk **stack;
    size_t sp, scap;
    size_t *marks;
    size_t nmarks, mcap;
    struct msh_pk **memo;
    size_t memocap, nmemo;
    struct msh_pk *none, *yes, *no;
    char *err;
    size_t errlen;
};

__attribute__((format(printf, 2, 3))) static int fail(struct pk_parser *p, const char *fmt, ...)
{
    if (p->err && p->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err, p->errlen, fmt, ap);
        va_end(ap);
    }
    return EINVAL;
}

static int fail_op(struct pk_parser *p, const char *what)
{
    return fail(p, "pickle opcode 0x%02x %s at offset %zu: %s", p->op, msh_pk_opcode_name(p->op),
                p->at, what);
}

static int nomem(struct pk_parser *p)
{
    if (p->doc->over_limit)
        return fail(p, "pickle needs more than %zu bytes of nodes (limit) at offset %zu",
                    p->lim.max_arena_bytes, p->at);
    fail(p, "out of memory reading pickle at offset %zu", p->at);
    return ENOMEM;
}

/* Checks that n bytes of operand follow the opcode. */
static int need(struct pk_parser *p, size_t n)
{
    if (p->len - p->pos < n)
        return fail(p, "truncated pickle: opcode 0x%02x %s at offset %zu needs %zu bytes, %zu left",
                    p->op, msh_pk_opcode_name(p->op), p->at, n, p->len - p->pos);
    return 0;
}

static uint64_t rd_le(const unsigned char *q, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)q[i] << (8 * i);
    return v;
}

static struct msh_pk *node(struct pk_parser *p, int kind)
{
    /* Scalars get a shortened node: nothing reads past the member their kind selects. */
    size_t hdr = offsetof(struct msh_pk, i);
    size_t sz = kind == MSH_PK_STR || kind == MSH_PK_BYTES ? hdr + 2 * sizeof(size_t)
                : kind >= MSH_PK_TUPLE                     ? sizeof(struct msh_pk)
                                                           : hdr + sizeof(uint64_t);
    struct msh_pk *n = arena_alloc(p->doc, sz);
    if (!n) return NULL;
    memset(n, 0, sz);
    n->kind = (uint8_t)kind;
    n->depth = kind >= MSH_PK_TUPLE ? 1 : 0;
    return n;
}

static size_t stack_base(const struct pk_parser *p) { return p->nmarks ? p->marks[p->nmarks - 1] : 0; }

static int push(struct pk_parser *p, struct msh_pk *v)
{
    if (!v) return nomem(p);
    if (p->sp == p->scap) {
        if (p->scap >= p->lim.max_stack)
            return fail(p, "pickle stack deeper than %zu values at offset %zu", p->lim.max_stack, p->at);
        size_t nc = p->scap ? p->scap * 2 : 256;
        if (nc > p->lim.max_stack) nc = p->lim.max_stack;
        struct msh_pk **ns = realloc(p->stack, nc * sizeof *ns);
        if (!ns) return nomem(p);
        p->stack = ns;
        p->scap = nc;
    }
    p->stack[p->sp++] = v;
    return 0;
}

static int need_stack(struct pk_parser *p, size_t n)
{
    if (p->sp - stack_base(p) < n) return fail_op(p, "stack underflow");
    return 0;
}

/* Pops the topmost mark; the values above it are stack[*from .. sp). */
static int pop_mark(struct pk_parser *p, size_t *from)
{
    if (!p->nmarks) return fail_op(p, "no MARK to pop");
    *from = p->marks[--p->nmarks];
    return 0;
}

/* Adds k values to container c (dict: k counts keys and values). */
static int seq_add(struct pk_parser *p, struct msh_pk *c, struct msh_pk *const *vals, size_t k)
{
    size_t have = c->kind == MSH_PK_DICT ? 2 * c->seq.n : c->seq.n;
    size_t cap = c->kind == MSH_PK_DICT ? 2 * c->seq.cap : c->seq.cap;
    if (k > cap - have) {
        size_t nc = cap ? cap * 2 : 4;
        if (nc < have + k) nc = have + k;
        if (c->kind == MSH_PK_DICT) nc += nc & 1;
        struct msh_pk **nv = arena_grow(p->doc, c->seq.v, cap * sizeof *nv, nc * sizeof *nv);
        if (!nv) return nomem(p);
        c->seq.v = nv;
        c->seq.cap = c->kind == MSH_PK_DICT ? nc / 2 : nc;
    }
    for (size_t i = 0; i < k; i++) {
        const struct msh_pk *v = vals[i];
        if (v->kind >= MSH_PK_TUPLE && v->depth + 1 > c->depth) {
            if ((size_t)v->depth + 1 > p->lim.max_depth)
                return fail(p, "pickle containers nested deeper than %zu at offset %zu",
                            p->lim.max_depth, p->at);
            c->depth = v->depth + 1;
        }
    }
    memcpy(c->seq.v + have, vals, k * sizeof *vals);
    c->seq.n += c->kind == MSH_PK_DICT ? k / 2 : k;
    return 0;
}

static int make_seq(struct pk_parser *p, int kind, size_t from)
{
    size_t k = p->sp - from;
    if (kind == MSH_PK_DICT && (k & 1)) return fail_op(p, "odd number of keys and values");
    struct msh_pk *c = node(p, kind);
    if (!c) return nomem(p);
    int rc = k ? seq_add(p, c, p->stack + from, k) : 0;
    if (rc) return rc;
    p->sp = from;
    return push(p, c);
}

/* APPENDS / SETITEMS / ADDITEMS: the target sits just below the mark. */
static int add_to_marked(struct pk_parser *p, int kind)
{
    size_t from = 0;
    int rc = pop_mark(p, &from);
    if (rc) return rc;
    if (from == 0 || from - 1 < stack_base(p)) return fail_op(p, "stack underflow");
    struct msh_pk *c = p->stack[from - 1];
    if (c->kind != kind) {
        char what[80];
        snprintf(what, sizeof what, "target is a %s, expected a %s", msh_pk_kind_name(c->kind),
                 msh_pk_kind_name(kind));
        return fail_op(p, what);
    }
    size_t k = p->sp - from;
    if (kind == MSH_PK_DICT && (k & 1)) return fail_op(p, "odd number of keys and values");
    rc = k ? seq_add(p, c, p->stack + from, k) : 0;
    p->sp = from;
    return rc;
}

static int add_top(struct pk_parser *p, int kind, size_t k)
{
    int rc = need_stack(p, k + 1);
    if (rc) return rc;
    struct msh_pk *c = p->stack[p->sp - k - 1];
    if (c->kind != kind) {
        char what[80];
        snprintf(what, sizeof what, "target is a %s, expected a %s", msh_pk_kind_name(c->kind),
                 msh_pk_kind_name(kind));
        return fail_op(p, what);
    }
    rc = seq_add(p, c, p->stack + p->sp - k, k);
    p->sp -= k;
    return rc;
}

static int memo_put(struct pk_parser *p, uint64_t idx)
{
    int rc = need_stack(p, 1);
    if (rc) return rc;
    if (idx >= p->lim.max_memo || idx >= p->len) {
        char what[96];
        snprintf(what, sizeof what, "memo index %llu beyond the limit", (unsigned long long)idx);
        return fail_op(p, what);
    }
    if (idx >= p->memocap) {
        size_t nc = p->memocap ? p->memocap : 256;
        while (nc <= idx) nc *= 2;
        if (nc > p->lim.max_memo) nc = p->lim.max_memo;
        struct msh_pk **nm = realloc(p->memo, nc * sizeof *nm);
        if (!nm) return nomem(p);
        memset(nm + p->memocap, 0, (nc - p->memocap) * sizeof *nm);
        p->memo = nm;
        p->memocap = nc;
    }
    if (!p->memo[idx]) p->nmemo++;
    p->memo[idx] = p->stack[p->sp - 1];
    return 0;
}

static int memo_get(struct pk_parser *p, uint64_t idx)
{
    if (idx >= p->memocap || !p->memo[idx]) {
        char what[64];
        snprintf(what, sizeof what, "memo key %llu not found", (unsigned long long)idx);
        return fail_op(p, what);
    }
    return push(p, p->memo[idx]);
}

static int push_str(struct pk_parser *p, int kind, size_t lenbytes)
{
    int rc = need(p, lenbytes);
    if (rc) return rc;
    uint64_t n = rd_le(p->b + p->pos, lenbytes);
    p->pos += lenbytes;
    if (n > p->len - p->pos)
        return fail(p, "pickle opcode 0x%02x %s at offset %zu: length %llu exceeds the %zu bytes "
                       "left in the input",
                    p->op, msh_pk_opcode_name(p->op), p->at, (unsigned long long)n, p->len - p->pos);
    struct msh_pk *v = node(p, kind);
    if (!v) return nomem(p);
    v->s.p = (const char *)p->b + p->pos;
    v->s.len = (size_t)n;
    p->pos += (size_t)n;
    return push(p, v);
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static size_t put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | cp >> 18); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Protocol 0 UNICODE: raw-unicode-escape text up to a newline, decoded to UTF-8 in the arena. */
static int push_unicode0(struct pk_parser *p)
{
    const unsigned char *s = p->b + p->pos;
    const unsigned char *nl = memchr(s, '\n', p->len - p->pos);
    if (!nl) return fail(p, "truncated pickle: UNICODE at offset %zu has no terminating newline", p->at);
    size_t n = (size_t)(nl - s);
    if (n > (SIZE_MAX - 1) / 2) return nomem(p);
    char *out = arena_alloc(p->doc, 2 * n + 1);
    if (!out) return nomem(p);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t digits = 0;
        if (s[i] == '\\' && i + 1 < n) digits = s[i + 1] == 'u' ? 4 : s[i + 1] == 'U' ? 8 : 0;
        if (digits) {
            if (n - i - 2 < digits) return fail_op(p, "truncated \\u escape");
            uint32_t cp = 0;
            for (size_t k = 0; k < digits; k++) {
                int h = hexval(s[i + 2 + k]);
                if (h < 0) return fail_op(p, "bad \\u escape");
                cp = cp << 4 | (uint32_t)h;
            }
            if (cp > 0x10ffff) return fail_op(p, "code point beyond U+10FFFF");
            o += put_utf8(out + o, cp);
            i += 2 + digits;
        } else {
            o += put_utf8(out + o, s[i]);
            i++;
        }
    }
    out[o] = 0;
    p->pos += n + 1;
    struct msh_pk *v = node(p, MSH_PK_STR);
    if (!v) return nomem(p);
    v->s.p = out;
    v->s.len = o;
    return push(p, v);
}

/* LONG1 / LONG4: little-endian two's complement; anything beyond 64 bits is refused. */
static int push_long(struct pk_parser *p, size_t lenbytes)
{
    int rc = need(p, lenbytes);
    if (rc) return rc;
    uint64_t n = rd_le(p->b + p->pos, lenbytes);
    if (lenbytes == 4 && (n & 0x80000000u)) return fail_op(p, "negative length");
    p->pos += lenbytes;
    if (n > p->len - p->pos)
        return fail(p, "pickle opcode 0x%02x %s at offset %zu: length %llu exceeds the %zu bytes "
                       "left in the input",
                    p->op, msh_pk_opcode_name(p->op), p->at, (unsigned long long)n, p->len - p->pos);
    const unsigned char *q = p->b + p->pos;
    struct msh_pk *v = node(p, MSH_PK_INT);
    if (!v) return nomem(p);
    /* Longer than 8 bytes is fine when the extra bytes only extend the sign: 0x00 bytes above a
     * value up to 2^64-1 (CPython writes 9 bytes from 2^63 on), 0xff bytes above a negative
     * int64. */
    size_t extra = n > 8 ? (size_t)n - 8 : 0;
    unsigned char ext = extra && (q[n - 1] & 0x80) ? 0xff : 0x00;
    size_t same = 0;
    while (same < extra && q[8 + same] == ext) same++;
    if (n <= 8) {
        uint64_t u = rd_le(q, (size_t)n);
        if (n && n < 8 && (q[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
        v->i = (int64_t)u;
    } else if (same == extra && ext == 0x00) {
        v->u = rd_le(q, 8);
        v->big = (q[7] & 0x80) != 0; /* 2^63 .. 2^64-1 */
    } else if (same == extra && (q[7] & 0x80)) {
        v->i = (int64_t)rd_le(q, 8);
    } else {
        char what[96];
        snprintf(what, sizeof what, "integer of %llu bytes does not fit in 64 bits",
                 (unsigned long long)n);
        return fail_op(p, what);
    }
    p->pos += (size_t)n;
    return push(p, v);
}

static int refuse(struct pk_parser *p)
{
    const char *name = msh_pk_opcode_name(p->op);
    if (!name) return fail(p, "byte 0x%02x at offset %zu is not a pickle opcode", p->op, p->at);
    return fail(p, "pickle opcode 0x%02x %s at offset %zu is outside the plain-container subset; "
                   "refusing to load (memshim never executes pickle code)",
                p->op, name, p->at);
}

static int step(struct pk_parser *p, int *done)
{
    int rc = 0;
    size_t from = 0;
    struct msh_pk *v;
    switch (p->op) {
    case OP_PROTO:
        if ((rc = need(p, 1))) return rc;
        if (p->b[p->pos] > 5) return fail(p, "unsupported pickle protocol %u at offset %zu", p->b[p->pos], p->at);
        p->pos++;
        return 0;
    case OP_FRAME: {
        if ((rc = need(p, 8))) return rc;
        uint64_t n = rd_le(p->b + p->pos, 8);
        p->pos += 8;
        if (n > p->len - p->pos)
            return fail(p, "pickle FRAME at offset %zu: length %llu exceeds the %zu bytes left",
                        p->at, (unsigned long long)n, p->len - p->pos);
        return 0;
    }
    case OP_STOP:
        if ((rc = need_stack(p, 1))) return rc;
        p->doc->root = p->stack[p->sp - 1];
        *done = 1;
        return 0;
    case OP_MARK:
        if (p->nmarks == p->mcap) {
            if (p->mcap >= p->lim.max_depth)
                return fail(p, "pickle MARKs nested deeper than %zu at offset %zu", p->lim.max_depth, p->at);
            size_t nc = p->mcap ? p->mcap * 2 : 64;
            if (nc > p->lim.max_depth) nc = p->lim.max_depth;
            size_t *nm = realloc(p->marks, nc * sizeof *nm);
            if (!nm) return nomem(p);
            p->marks = nm;
            p->mcap = nc;
        }
        p->marks[p->nmarks++] = p->sp;
        return 0;
    case OP_POP:
        if (p->sp > stack_base(p)) p->sp--;
        else if ((rc = pop_mark(p, &from))) return rc;
        return 0;
    case OP_POP_MARK:
        if ((rc = pop_mark(p, &from))) return rc;
        p->sp = from;
        return 0;
    case OP_DUP:
        if ((rc = need_stack(p, 1))) return rc;
        return push(p, p->stack[p->sp - 1]);
    case OP_EMPTY_DICT: return push(p, node(p, MSH_PK_DICT));
    case OP_EMPTY_LIST: return push(p, node(p, MSH_PK_LIST));
    case OP_EMPTY_TUPLE: return push(p, node(p, MSH_PK_TUPLE));
    case OP_EMPTY_SET: return push(p, node(p, MSH_PK_SET));
    case OP_TUPLE:
        if ((rc = pop_mark(p, &from))) return rc;
        return make_seq(p, MSH_PK_TUPLE, from);
    case OP_LIST:
        if ((rc = pop_mark(p, &from))) return rc;
        return make_seq(p, MSH_PK_LIST, from);
    case OP_DICT:
        if ((rc = pop_mark(p, &from))) return rc;
        return make_seq(p, MSH_PK_DICT, from);
    case OP_FROZENSET:
        if ((rc = pop_mark(p, &from))) return rc;
        return make_seq(p, MSH_PK_FROZENSET, from);
    case OP_TUPLE1: case OP_TUPLE2: case OP_TUPLE3: {
        size_t k = (size_t)(p->op - OP_TUPLE1 + 1);
        if ((rc = need_stack(p, k))) return rc;
        return make_seq(p, MSH_PK_TUPLE, p->sp - k);
    }
    case OP_APPEND: return add_top(p, MSH_PK_LIST, 1);
    case OP_SETITEM: return add_top(p, MSH_PK_DICT, 2);
    case OP_APPENDS: return add_to_marked(p, MSH_PK_LIST);
    case OP_SETITEMS: return add_to_marked(p, MSH_PK_DICT);
    case OP_ADDITEMS: return add_to_marked(p, MSH_PK_SET);
    case OP_BINUNICODE: return push_str(p, MSH_PK_STR, 4);
    case OP_SHORT_BINUNICODE: return push_str(p, MSH_PK_STR, 1);
    case OP_BINUNICODE8: return push_str(p, MSH_PK_STR, 8);
    case OP_BINBYTES: return push_str(p, MSH_PK_BYTES, 4);
    case OP_SHORT_BINBYTES: return push_str(p, MSH_PK_BYTES, 1);
    case OP_BINBYTES8: return push_str(p, MSH_PK_BYTES, 8);
    case OP_UNICODE: return push_unicode0(p);
    case OP_BININT: case OP_BININT1: case OP_BININT2: {
        size_t n = p->op == OP_BININT ? 4 : p->op == OP_BININT1 ? 1 : 2;
        if ((rc = need(p, n))) return rc;
        uint64_t u = rd_le(p->b + p->pos, n);
        p->pos += n;
        if (!(v = node(p, MSH_PK_INT))) return nomem(p);
        v->i = p->op == OP_BININT ? (int64_t)(int32_t)(uint32_t)u : (int64_t)u;
        return push(p, v);
    }
    case OP_LONG1: return push_long(p, 1);
    case OP_LONG4: return push_long(p, 4);
    case OP_BINFLOAT: {
        if ((rc = need(p, 8))) return rc;
        uint64_t u = 0;
        for (int k = 0; k < 8; k++) u = u << 8 | p->b[p->pos + k];
        p->pos += 8;
        if (!(v = node(p, MSH_PK_FLOAT))) return nomem(p);
        memcpy(&v->f, &u, sizeof u);
        return push(p, v);
    }
    case OP_NEWTRUE: return push(p, p->yes);
    case OP_NEWFALSE: return push(p, p->no);
    case OP_NONE: return push(p, p->none);
    case OP_MEMOIZE: return memo_put(p, p->nmemo);
    case OP_BINPUT:
        if ((rc = need(p, 1))) return rc;
        return memo_put(p, p->b[p->pos++]);
    case OP_LONG_BINPUT:
        if ((rc = need(p, 4))) return rc;
        p->pos += 4;
        return memo_put(p, rd_le(p->b + p->pos - 4, 4));
    case OP_BINGET:
        if ((rc = need(p, 1))) return rc;
        return memo_get(p, p->b[p->pos++]);
    case OP_LONG_BINGET:
        if ((rc = need(p, 4))) return rc;
        p->pos += 4;
        return memo_get(p, rd_le(p->b + p->pos - 4, 4));
    default:
        return refuse(p);
    }
}

int msh_pk_parse(const unsigned char *buf, size_t len, const struct msh_pk_limits *lim,
                 struct msh_pk_doc **out, char *err, size_t errlen)
{
    struct pk_parser p = {.b = buf, .len = len, .err = err, .errlen = errlen};
    *out = NULL;
    if (err && errlen) err[0] = 0;
    if (lim) p.lim = *lim;
    if (!p.lim.max_depth) p.lim.max_depth = 10000;
    if (!p.lim.max_stack) p.lim.max_stack = (size_t)1 << 24;
    if (!p.lim.max_memo) p.lim.max_memo = (size_t)1 << 24;
    if (!p.lim.max_arena_bytes)
        p.lim.max_arena_bytes = len > (SIZE_MAX - ((size_t)1 << 20)) / 64 ? SIZE_MAX : 64 * len + ((size_t)1 << 20);
    if (!buf && len) return fail(&p, "no input");
    p.doc = calloc(1, sizeof *p.doc);
    if (!p.doc) return fail(&p, "out of memory"), ENOMEM;
    p.doc->limit = p.lim.max_arena_bytes;
    int rc = 0;
    if (!(p.none = node(&p, MSH_PK_NONE)) || !(p.yes = node(&p, MSH_PK_BOOL)) ||
        !(p.no = node(&p, MSH_PK_BOOL)))
        rc = nomem(&p);
    else
        p.yes->i = 1;
    int done = 0;
    while (!rc && !done) {
        if (p.pos >= p.len) {
            rc = fail(&p, "truncated pickle: no STOP opcode before the end of the input (%zu bytes)", p.len);
            break;
        }
        p.at = p.pos;
        p.op = p.b[p.pos++];
        rc = step(&p, &done);
    }
    free(p.stack);
    free(p.marks);
    free(p.memo);
    if (rc) {
        msh_pk_free(p.doc);
        return rc;
    }
    *out = p.doc;
    return 0;
}

/* ---- walking helpers -------------------------------------------------------------------------- */

int msh_pk_is_str(const struct msh_pk *v, const char *s)
{
    if (!v || v->kind != MSH_PK_STR) return 0;
    size_t n = strlen(s);
    return v->s.len == n && memcmp(v->s.p, s, n) == 0;
}

const struct msh_pk *msh_pk_dict_get(const struct msh_pk *d, const char *key)
{
    if (!d || d->kind != MSH_PK_DICT) return NULL;
    size_t n = strlen(key);
    for (size_t i = d->seq.n; i-- > 0;) {
        const struct msh_pk *k = d->seq.v[2 * i];
        if (k->kind == MSH_PK_STR && k->s.len == n && memcmp(k->s.p, key, n) == 0)
            return d->seq.v[2 * i + 1];
    }
    return NULL;
}

int msh_pk_get_i64(const struct msh_pk *v, int64_t *out)
{
    if (!v || (v->kind != MSH_PK_INT && v->kind != MSH_PK_BOOL)) return EINVAL;
    if (v->big) return ERANGE;
    *out = v->i;
    return 0;
}

int msh_pk_get_u64(const struct msh_pk *v, uint64_t *out)
{
    if (!v || (v->kind != MSH_PK_INT && v->kind != MSH_PK_BOOL)) return EINVAL;
    if (!v->big && v->i < 0) return ERANGE;
    *out = v->u;
    return 0;
}

size_t msh_pk_len(const struct msh_pk *v)
{
    return v && v->kind >= MSH_PK_TUPLE ? v->seq.n : 0;
}

const struct msh_pk *msh_pk_item(const struct msh_pk *v, size_t i)
{
    if (!v || v->kind < MSH_PK_TUPLE || v->kind == MSH_PK_DICT || i >= v->seq.n) return NULL;
    return v->seq.v[i];
}
