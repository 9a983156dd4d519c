/*
 * trace.c: the front door of the trace readers. It reads a trace file (capped at
 * MSH_TRACE_MAX_FILE, read whole, never mapped from a file that could change underneath),
 * recognises its format from the first bytes (a pickle PROTO opcode: PyTorch snapshot; the line
 * "# memshim-trace": memshim text; '{' or '[' after optional whitespace: a torch.profiler JSON
 * trace), hands it to snapshot.c, textfmt.c or profiler.c, and owns what every reader shares:
 * freeing a set, the live-bytes analysis, the event vector and the address map. A gzip file
 * (magic 1f 8b) is inflated first, under a size cap and a ratio cap, and then recognised the same
 * way. It must never guess a format from a file name, never abort on bad input, and never size an
 * allocation from anything but the file's real length (or, inflating, the bytes produced so far).
 */
#include "trace.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

static const char TEXT_MAGIC[] = "# memshim-trace";

static int read_file(const char *path, unsigned char **out, size_t *outlen, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        snprintf(err, errlen, "%s: %s", path, strerror(e));
        return e;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        snprintf(err, errlen, "%s: %s", path, strerror(e));
        close(fd);
        return e;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        close(fd);
        return EINVAL;
    }
    if ((uint64_t)st.st_size > MSH_TRACE_MAX_FILE) {
        snprintf(err, errlen, "%s: %lld bytes, larger than the %llu-byte limit for trace files", path,
                 (long long)st.st_size, (unsigned long long)MSH_TRACE_MAX_FILE);
        close(fd);
        return EFBIG;
    }
    size_t cap = (size_t)st.st_size, len = 0;
    unsigned char *buf = malloc(cap + 1);
    if (!buf) {
        snprintf(err, errlen, "%s: out of memory for %zu bytes", path, cap);
        close(fd);
        return ENOMEM;
    }
    /* Read exactly the size fstat gave; a file that grows meanwhile is read up to that size. */
    while (len < cap) {
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            snprintf(err, errlen, "%s: read: %s", path, strerror(e));
            free(buf);
            close(fd);
            return e;
        }
        if (r == 0) break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = 0;
    *out = buf;
    *outlen = len;
    return 0;
}

int msh_trace_gunzip(const unsigned char *in, size_t inlen, unsigned char **out, size_t *outlen, char *err,
                     size_t errlen)
{
    char dummy[2];
    if (!err || !errlen) {
        err = dummy;
        errlen = sizeof dummy;
    }
    err[0] = 0;
    *out = NULL;
    *outlen = 0;
    uint64_t limit = (uint64_t)inlen * MSH_GZIP_MAX_RATIO;
    if (inlen > MSH_TRACE_MAX_FILE || limit > MSH_TRACE_MAX_FILE) limit = MSH_TRACE_MAX_FILE;
    if (limit < MSH_GZIP_MIN_LIMIT) limit = MSH_GZIP_MIN_LIMIT;
    if (inlen < 2 || in[0] != 0x1f || in[1] != 0x8b) {
        snprintf(err, errlen, "not gzip data (no 1f 8b magic)");
        return EINVAL;
    }
    z_stream z;
    memset(&z, 0, sizeof z);
    if (inflateInit2(&z, 15 + 16) != Z_OK) { /* 15-bit window, gzip wrapper only */
        snprintf(err, errlen, "out of memory starting zlib");
        return ENOMEM;
    }
    size_t cap = inlen < ((size_t)1 << 30) ? inlen * 4 : (size_t)1 << 32; /* bytes of output room */
    if (cap < 65536) cap = 65536;
    if (cap > limit) cap = (size_t)limit;
    unsigned char *buf = malloc(cap + 1);
    size_t inpos = 0, outpos = 0;
    int rc = 0;
    if (!buf) {
        snprintf(err, errlen, "out of memory for %zu bytes of inflated data", cap);
        rc = ENOMEM;
    }
    while (!rc) {
        if (outpos == cap) { /* output full: grow, up to the limit */
            if (cap >= limit) {
                if (limit == MSH_TRACE_MAX_FILE)
                    snprintf(err, errlen, "gzip data inflates to more than the %llu-byte limit for trace files",
                             (unsigned long long)MSH_TRACE_MAX_FILE);
                else
                    snprintf(err, errlen, "gzip data inflates to more than %llu bytes (the limit is %d times "
                                          "the %zu compressed bytes, and at least %llu): refusing what looks "
                                          "like a zip bomb", (unsigned long long)limit, MSH_GZIP_MAX_RATIO, inlen,
                             (unsigned long long)MSH_GZIP_MIN_LIMIT);
                rc = EFBIG;
                break;
            }
            size_t nc = cap > limit / 2 ? (size_t)limit : cap * 2;
            unsigned char *nb = realloc(buf, nc + 1);
            if (!nb) {
                snprintf(err, errlen, "out of memory for %zu bytes of inflated data", nc);
                rc = ENOMEM;
                break;
            }
            buf = nb;
            cap = nc;
        }
        size_t ain = inlen - inpos, aout = cap - outpos;
        z.next_in = (Bytef *)(uintptr_t)(in + inpos);
        z.avail_in = ain > UINT_MAX ? UINT_MAX : (uInt)ain;
        z.next_out = buf + outpos;
        z.avail_out = aout > UINT_MAX ? UINT_MAX : (uInt)aout;
        uInt in0 = z.avail_in, out0 = z.avail_out;
        int zr = inflate(&z, Z_NO_FLUSH);
        inpos += in0 - z.avail_in;
        outpos += out0 - z.avail_out;
        if (zr == Z_STREAM_END) {
            /* another gzip member follows (concatenated files), or zero padding, or the end */
            if (inlen - inpos >= 2 && in[inpos] == 0x1f && in[inpos + 1] == 0x8b) {
                inflateReset(&z);
                continue;
            }
            size_t i = inpos;
            while (i < inlen && in[i] == 0) i++;
            if (i < inlen) {
                snprintf(err, errlen, "unexpected bytes after the gzip data at offset %zu", inpos);
                rc = EINVAL;
            }
            break;
        }
        if (zr == Z_OK || zr == Z_BUF_ERROR) {
            if (outpos == cap) continue; /* room runs out: grow */
            if (inpos == inlen) {
                snprintf(err, errlen, "truncated gzip data: the file ends after %zu inflated bytes", outpos);
                rc = EINVAL;
                break;
            }
            if (in0 == z.avail_in && out0 == z.avail_out) { /* no progress: never spin */
                snprintf(err, errlen, "gzip stream stalled at offset %zu", inpos);
                rc = EINVAL;
            }
            continue;
        }
        snprintf(err, errlen, "corrupt gzip data near offset %zu: %s", inpos,
                 z.msg ? z.msg : zr == Z_MEM_ERROR ? "out of memory" : "zlib error");
        rc = zr == Z_MEM_ERROR ? ENOMEM : EINVAL;
    }
    inflateEnd(&z);
    if (rc) {
        free(buf);
        return rc;
    }
    if (cap - outpos > 65536) { /* give back the room the last doubling did not use */
        unsigned char *nb = realloc(buf, outpos + 1);
        if (nb) buf = nb;
    }
    buf[outpos] = 0;
    *out = buf;
    *outlen = outpos;
    return 0;
}

/* A JSON document: optional UTF-8 byte order mark and whitespace, then '{' or '['. */
static int looks_like_json(const unsigned char *b, size_t len)
{
    size_t i = len >= 3 && memcmp(b, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
    while (i < len && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r')) i++;
    return i < len && (b[i] == '{' || b[i] == '[');
}

int msh_trace_load(const char *path, struct msh_trace_set **out, char *err, size_t errlen)
{
    char dummy[2];
    if (!err || !errlen) {
        err = dummy;
        errlen = sizeof dummy;
    }
    err[0] = 0;
    *out = NULL;
    unsigned char *buf = NULL;
    size_t len = 0;
    int rc = read_file(path, &buf, &len, err, errlen);
    if (rc) return rc;
    struct msh_trace_set *s = NULL;
    int gz = len >= 2 && buf[0] == 0x1f && buf[1] == 0x8b;
    if (gz) {
        unsigned char *ib = NULL;
        size_t ilen = 0;
        char why[400];
        rc = msh_trace_gunzip(buf, len, &ib, &ilen, why, sizeof why);
        free(buf);
        if (rc) {
            snprintf(err, errlen, "%s: %s", path, why);
            return rc;
        }
        buf = ib;
        len = ilen;
    }
    if (gz && len >= 2 && buf[0] == 0x1f && buf[1] == 0x8b) {
        snprintf(err, errlen, "%s: gzip data inside gzip data is not read", path);
        rc = EINVAL;
    } else if (len >= 2 && buf[0] == 0x80) {
        char why[512];
        rc = msh_trace_load_snapshot_mem(buf, len, &s, why, sizeof why);
        if (rc) snprintf(err, errlen, "%s: %s", path, why);
    } else if (len >= sizeof TEXT_MAGIC - 1 && memcmp(buf, TEXT_MAGIC, sizeof TEXT_MAGIC - 1) == 0) {
        rc = msh_trace_load_text_named((const char *)buf, len, path, &s, err, errlen);
    } else if (looks_like_json(buf, len)) {
        char why[512];
        rc = msh_trace_load_profiler_mem((const char *)buf, len, &s, why, sizeof why);
        if (rc) snprintf(err, errlen, "%s%s: %s", path, gz ? " (inflated)" : "", why);
    } else {
        snprintf(err, errlen, "%s: unrecognised trace format (expected a PyTorch memory snapshot "
                              "pickle, a '# memshim-trace' text file or a torch.profiler JSON trace, "
                              "any of them optionally gzip-compressed)", path);
        rc = EINVAL;
    }
    free(buf);
    if (rc) return rc;
    if (!(s->path = strdup(path))) {
        msh_trace_set_free(s);
        snprintf(err, errlen, "%s: out of memory", path);
        return ENOMEM;
    }
    *out = s;
    return 0;
}

void msh_trace_set_free(struct msh_trace_set *s)
{
    if (!s) return;
    for (size_t i = 0; i < s->ndev; i++) free(s->dev[i].ev);
    free(s->dev);
    free(s->path);
    free(s->format);
    free(s->allocator_conf);
    free(s);
}

int msh_trace_push(struct msh_trace *t, const struct msh_trace_event *e)
{
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 256;
        if (nc < t->cap || nc > SIZE_MAX / sizeof *t->ev) return ENOMEM;
        struct msh_trace_event *ne = realloc(t->ev, nc * sizeof *ne);
        if (!ne) return ENOMEM;
        t->ev = ne;
        t->cap = nc;
    }
    t->ev[t->n++] = *e;
    return 0;
}

void msh_trace_analyze(struct msh_trace *t)
{
    /* Readers guarantee that frees name live blocks; still, frees are matched by address so a
     * hand-made trace cannot drive the live total below zero. */
    struct msh_addrmap m;
    uint64_t live = 0, peak = 0;
    size_t nallocs = 0;
    int have_map = msh_addrmap_init(&m, t->n / 2 + 16) == 0;
    for (size_t i = 0; i < t->n; i++) {
        const struct msh_trace_event *e = &t->ev[i];
        struct msh_addrmap_ent *ent = have_map ? msh_addrmap_get(&m, e->addr, e->op == MSH_OP_ALLOC) : NULL;
        if (e->op == MSH_OP_ALLOC) {
            if (!e->prefix) nallocs++;
            if (ent && ent->live) live -= ent->size;
            /* saturate: a hostile trace may sum past 2^64 (blocks are capped at 2^48 each) */
            live = e->size > UINT64_MAX - live ? UINT64_MAX : live + e->size;
            if (ent) {
                ent->live = 1;
                ent->size = e->size;
            }
        } else if (ent && ent->live) {
            live -= ent->size;
            ent->live = 0;
        } else if (!have_map) { /* no memory for the map: trust the invariant */
            live -= e->size <= live ? e->size : live;
        }
        if (live > peak) peak = live;
    }
    if (have_map) msh_addrmap_free(&m);
    t->peak_live_bytes = peak;
    t->final_live_bytes = live;
    t->nallocs = nallocs;
}

/* ---- address map ------------------------------------------------------------------------------ */

static size_t addr_hash(uint64_t a, size_t mask)
{
    a ^= a >> 33;
    a *= 0xff51afd7ed558ccdULL;
    a ^= a >> 33;
    return (size_t)a & mask;
}

int msh_addrmap_init(struct msh_addrmap *m, size_t expect)
{
    size_t cap = 64;
    while (cap < expect * 2 && cap < ((size_t)1 << 40)) cap *= 2;
    m->e = calloc(cap, sizeof *m->e);
    m->cap = m->e ? cap : 0;
    m->n = 0;
    return m->e ? 0 : ENOMEM;
}

static int addrmap_grow(struct msh_addrmap *m)
{
    size_t nc = m->cap * 2;
    if (nc < m->cap || nc > SIZE_MAX / sizeof *m->e) return ENOMEM;
    struct msh_addrmap_ent *ne = calloc(nc, sizeof *ne);
    if (!ne) return ENOMEM;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->e[i].used) continue;
        size_t j = addr_hash(m->e[i].addr, nc - 1);
        while (ne[j].used) j = (j + 1) & (nc - 1);
        ne[j] = m->e[i];
    }
    free(m->e);
    m->e = ne;
    m->cap = nc;
    return 0;
}

struct msh_addrmap_ent *msh_addrmap_get(struct msh_addrmap *m, uint64_t addr, int create)
{
    if (!m->e) return NULL;
    size_t mask = m->cap - 1, j = addr_hash(addr, mask);
    while (m->e[j].used) {
        if (m->e[j].addr == addr) return &m->e[j];
        j = (j + 1) & mask;
    }
    if (!create) return NULL;
    if ((m->n + 1) * 4 > m->cap * 3) { /* keep the load under 3/4 */
        if (addrmap_grow(m)) return NULL;
        return msh_addrmap_get(m, addr, create);
    }
    struct msh_addrmap_ent *e = &m->e[j];
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->addr = addr;
    m->n++;
    return e;
}

void msh_addrmap_free(struct msh_addrmap *m)
{
    free(m->e);
    m->e = NULL;
    m->cap = m->n = 0;
}
