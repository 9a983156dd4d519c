/*
 * textfmt.c: memshim's own text trace format (docs/trace-format.md): one event per line, easy to
 * write from C with one fprintf per event, easy to read and to stream. Reader and writer live
 * here so they cannot drift apart. The reader must never crash or allocate on the word of a
 * number in the file: every number is bounded, every error names file:line:column and the
 * offending token, and the streams it returns satisfy trace.h's invariant (a duplicate alloc
 * gets a synthesised free, a free of an unknown block is dropped; both are counted warnings).
 */
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TEXT_MAX_DEVICES 1024
#define TEXT_VERSION 1

struct tdev {
    struct msh_trace t;
    struct msh_addrmap map;
    int recorded; /* an a/f line was seen: p lines are no longer allowed */
};

struct tparse {
    const char *buf;
    size_t len;
    const char *name;
    size_t lineno;
    const char *line, *eol; /* current line, without its newline (and a trailing CR) */
    const char *cur;        /* next character to scan */
    struct tdev *dev[TEXT_MAX_DEVICES];
    char *err;
    size_t errlen;
};

__attribute__((format(printf, 3, 4))) static int tfail(struct tparse *p, const char *at, const char *fmt, ...)
{
    if (!p->err || !p->errlen) return EINVAL;
    int n = snprintf(p->err, p->errlen, "%s:%zu:%zu: ", p->name, p->lineno,
                     (size_t)((at ? at : p->cur) - p->line) + 1);
    if (n >= 0 && (size_t)n < p->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return EINVAL;
}

/* Next whitespace-separated token of the line, or an empty one at the end (or at a comment). */
static void token(struct tparse *p, const char **s, size_t *n)
{
    while (p->cur < p->eol && (*p->cur == ' ' || *p->cur == '\t')) p->cur++;
    *s = p->cur;
    if (p->cur < p->eol && *p->cur == '#') { /* trailing comment: the rest of the line */
        *n = 0;
        p->cur = p->eol;
        return;
    }
    while (p->cur < p->eol && *p->cur != ' ' && *p->cur != '\t') p->cur++;
    *n = (size_t)(p->cur - *s);
}

/* The token quoted for an error message: printable, at most 40 characters. */
static const char *quote(const char *s, size_t n, char *out, size_t outlen)
{
    size_t k = 0;
    for (size_t i = 0; i < n && k + 4 < outlen; i++) {
        if (i == 40) {
            memcpy(out + k, "...", 3);
            k += 3;
            break;
        }
        unsigned char ch = (unsigned char)s[i];
        out[k++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
    }
    out[k] = 0;
    return out;
}

static int parse_dec(struct tparse *p, const char *what, uint64_t max, uint64_t *out)
{
    const char *s;
    size_t n;
    char q[48];
    token(p, &s, &n);
    if (!n) return tfail(p, s, "expected %s, got the end of the line", what);
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return tfail(p, s, "expected %s, got '%s'", what, quote(s, n, q, sizeof q));
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10) return tfail(p, s, "%s '%s' is out of range (at most %" PRIu64 ")", what,
                                             quote(s, n, q, sizeof q), max);
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

static int parse_hex(struct tparse *p, const char *what, uint64_t *out)
{
    const char *s;
    size_t n;
    char q[48];
    token(p, &s, &n);
    if (!n) return tfail(p, s, "expected %s, got the end of the line", what);
    size_t i = n > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') ? 2 : 0;
    if (n - i > 16) return tfail(p, s, "%s '%s' is longer than 64 bits", what, quote(s, n, q, sizeof q));
    uint64_t v = 0;
    for (; i < n; i++) {
        int c = s[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return tfail(p, s, "expected %s, got '%s'", what, quote(s, n, q, sizeof q));
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

static int end_of_line(struct tparse *p)
{
    const char *s;
    size_t n;
    char q[48];
    token(p, &s, &n);
    if (n) return tfail(p, s, "unexpected '%s' after the last field", quote(s, n, q, sizeof q));
    return 0;
}

static int nomem(struct tparse *p)
{
    tfail(p, p->line, "out of memory");
    return ENOMEM;
}

static struct tdev *get_dev(struct tparse *p, uint64_t d)
{
    if (!p->dev[d]) {
        struct tdev *td = calloc(1, sizeof *td);
        if (!td) return NULL;
        if (msh_addrmap_init(&td->map, 16)) {
            free(td);
            return NULL;
        }
        td->t.device = (int)d;
        p->dev[d] = td;
    }
    return p->dev[d];
}

static int push(struct tparse *p, struct tdev *td, uint8_t op, uint8_t prefix, uint64_t stream,
                uint64_t addr, uint64_t size, uint64_t time_us)
{
    struct msh_trace_event e = {.addr = addr, .size = size, .stream = stream, .time_us = time_us,
                                .op = op, .prefix = prefix};
    return msh_trace_push(&td->t, &e) ? nomem(p) : 0;
}

static int event_line(struct tparse *p, char op)
{
    uint64_t d, stream, addr, size, time_us = 0;
    const char *at = p->line;
    int rc;
    if ((rc = parse_dec(p, "a device number", TEXT_MAX_DEVICES - 1, &d)) ||
        (rc = parse_hex(p, "a hex stream", &stream)) || (rc = parse_hex(p, "a hex address", &addr)) ||
        (rc = parse_dec(p, "a size in bytes", MSH_TRACE_MAX_BLOCK, &size)))
        return rc;
    const char *save = p->cur, *s;
    size_t n;
    token(p, &s, &n);
    p->cur = save;
    if (n && (rc = parse_dec(p, "a time in microseconds", UINT64_MAX, &time_us))) return rc;
    if ((rc = end_of_line(p))) return rc;
    struct tdev *td = get_dev(p, d);
    if (!td) return nomem(p);
    td->t.nraw_events++;
    struct msh_addrmap_ent *ent = msh_addrmap_get(&td->map, addr, 1);
    if (!ent) return nomem(p);
    if (op == 'p') {
        if (td->recorded)
            return tfail(p, at, "prefix allocation after the first recorded event of device %d "
                                "('p' lines come first)", td->t.device);
        if (ent->live) return tfail(p, at, "prefix block 0x%" PRIx64 " is listed twice", addr);
        td->t.nprefix++;
    } else {
        td->recorded = 1;
    }
    if (op == 'f') {
        if (!ent->live) { /* free of a block that is not live: dropped */
            td->t.warnings++;
            return 0;
        }
        if (ent->size != size) td->t.warnings++;
        ent->live = 0;
        return push(p, td, MSH_OP_FREE, 0, stream, addr, ent->size, time_us);
    }
    if (ent->live) { /* duplicate alloc: free the old block first */
        td->t.warnings++;
        if ((rc = push(p, td, MSH_OP_FREE, 0, ent->stream, addr, ent->size, time_us))) return rc;
    }
    ent->live = 1;
    ent->size = size;
    ent->stream = stream;
    return push(p, td, MSH_OP_ALLOC, op == 'p', stream, addr, size, time_us);
}

static int reserved_line(struct tparse *p)
{
    uint64_t d, peak, fin;
    int rc;
    if ((rc = parse_dec(p, "a device number", TEXT_MAX_DEVICES - 1, &d)) ||
        (rc = parse_dec(p, "the peak reserved bytes", UINT64_MAX, &peak)) ||
        (rc = parse_dec(p, "the final reserved bytes", UINT64_MAX, &fin)) || (rc = end_of_line(p)))
        return rc;
    struct tdev *td = get_dev(p, d);
    if (!td) return nomem(p);
    td->t.recorded_peak_reserved = peak;
    td->t.recorded_final_reserved = fin;
    return 0;
}

static int header_line(struct tparse *p)
{
    static const char magic[] = "# memshim-trace";
    size_t n = (size_t)(p->eol - p->line);
    if (n < sizeof magic - 1 || memcmp(p->line, magic, sizeof magic - 1) != 0)
        return tfail(p, p->line, "not a memshim trace: the first line must be '# memshim-trace %d'",
                     TEXT_VERSION);
    p->cur = p->line + sizeof magic - 1;
    if (p->cur < p->eol && *p->cur != ' ' && *p->cur != '\t')
        return tfail(p, p->line, "not a memshim trace: the first line must be '# memshim-trace %d'",
                     TEXT_VERSION);
    uint64_t v;
    int rc = parse_dec(p, "the format version", UINT32_MAX, &v);
    if (rc) return rc;
    if (v != TEXT_VERSION)
        return tfail(p, p->line, "memshim-trace version %" PRIu64 " is not supported (this reader "
                                 "knows version %d)", v, TEXT_VERSION);
    return end_of_line(p);
}

static int parse_all(struct tparse *p)
{
    size_t pos = 0;
    while (pos < p->len) {
        const char *line = p->buf + pos;
        const char *nl = memchr(line, '\n', p->len - pos);
        const char *eol = nl ? nl : p->buf + p->len;
        pos = (size_t)(eol - p->buf) + (nl ? 1 : 0);
        if (eol > line && eol[-1] == '\r') eol--;
        p->lineno++;
        p->line = p->cur = line;
        p->eol = eol;
        int rc;
        if (p->lineno == 1) {
            if ((rc = header_line(p))) return rc;
            continue;
        }
        const char *s;
        size_t n;
        char q[48];
        token(p, &s, &n);
        if (!n) continue; /* blank line or comment */
        if (n == 1 && (*s == 'a' || *s == 'f' || *s == 'p')) {
            rc = event_line(p, *s);
        } else if (n == 1 && *s == 'r') {
            rc = reserved_line(p);
        } else if (n == 1 && *s == 'e') {
            uint64_t epoch;
            rc = parse_dec(p, "an epoch number", UINT64_MAX, &epoch);
            if (!rc) rc = end_of_line(p);
        } else {
            rc = tfail(p, s, "unknown record '%s' (expected a, f, p, r, e, a comment or a blank line)",
                       quote(s, n, q, sizeof q));
        }
        if (rc) return rc;
    }
    if (p->lineno == 0) {
        p->line = p->cur = p->eol = p->buf;
        p->lineno = 1;
        return tfail(p, p->line, "empty file: expected '# memshim-trace %d'", TEXT_VERSION);
    }
    return 0;
}

int msh_trace_load_text_named(const char *buf, size_t len, const char *name,
                              struct msh_trace_set **out, char *err, size_t errlen)
{
    struct tparse *p = calloc(1, sizeof *p);
    *out = NULL;
    if (err && errlen) err[0] = 0;
    if (!p) {
        if (err && errlen) snprintf(err, errlen, "%s: out of memory", name ? name : "<memory>");
        return ENOMEM;
    }
    p->buf = buf ? buf : "";
    p->len = buf ? len : 0;
    p->name = name ? name : "<memory>";
    p->err = err;
    p->errlen = errlen;
    int rc = parse_all(p);
    struct msh_trace_set *s = NULL;
    size_t ndev = 0;
    for (int d = 0; d < TEXT_MAX_DEVICES; d++) ndev += p->dev[d] != NULL;
    if (!rc) {
        s = calloc(1, sizeof *s);
        if (!s || !(s->format = strdup("memshim-trace")) || (ndev && !(s->dev = calloc(ndev, sizeof *s->dev)))) {
            if (s) free(s->format);
            free(s);
            s = NULL;
            if (err && errlen) snprintf(err, errlen, "%s: out of memory", p->name);
            rc = ENOMEM;
        }
    }
    for (int d = 0; d < TEXT_MAX_DEVICES; d++) {
        struct tdev *td = p->dev[d];
        if (!td) continue;
        msh_addrmap_free(&td->map);
        if (s) {
            msh_trace_analyze(&td->t);
            s->dev[s->ndev++] = td->t;
        } else {
            free(td->t.ev);
        }
        free(td);
    }
    free(p);
    if (!rc) *out = s;
    return rc;
}

int msh_trace_load_text_mem(const char *buf, size_t len, struct msh_trace_set **out, char *err,
                            size_t errlen)
{
    return msh_trace_load_text_named(buf, len, "<memory>", out, err, errlen);
}

int msh_trace_write_text(FILE *f, const struct msh_trace_set *s)
{
    fprintf(f, "# memshim-trace %d\n", TEXT_VERSION);
    if (s->format) fprintf(f, "# converted from a %s\n", s->format);
    for (size_t i = 0; i < s->ndev; i++) {
        const struct msh_trace *t = &s->dev[i];
        fprintf(f, "# device %d: %zu events, %zu prefix, peak live %" PRIu64 " bytes\n", t->device,
                t->n, t->nprefix, t->peak_live_bytes);
        /* always written: it also keeps a device without events in the set */
        fprintf(f, "r %d %" PRIu64 " %" PRIu64 "\n", t->device, t->recorded_peak_reserved,
                t->recorded_final_reserved);
        for (size_t k = 0; k < t->n; k++) {
            const struct msh_trace_event *e = &t->ev[k];
            char op = e->op == MSH_OP_FREE ? 'f' : e->prefix ? 'p' : 'a';
            if (e->time_us)
                fprintf(f, "%c %d 0x%" PRIx64 " 0x%" PRIx64 " %" PRIu64 " %" PRIu64 "\n", op, t->device,
                        e->stream, e->addr, e->size, e->time_us);
            else
                fprintf(f, "%c %d 0x%" PRIx64 " 0x%" PRIx64 " %" PRIu64 "\n", op, t->device, e->stream,
                        e->addr, e->size);
        }
    }
    fflush(f);
    return ferror(f) ? EIO : 0;
}
