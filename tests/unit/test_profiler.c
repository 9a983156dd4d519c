/*
 * test_profiler.c: unit tests of the torch.profiler trace reader (report/trace/profiler.c) and
 * of gzip input (msh_trace_gunzip, msh_trace_load). Every trace here is synthetic JSON built in
 * the test, in the shape PyTorch's profiler writes ([memory] instant events whose args carry
 * Device Type, Device Id, Addr, Bytes, Total Allocated, Total Reserved): alloc/free pairs, frees
 * of unknown blocks (prefix), CPU events, several CUDA devices, time order, repairs, malformed,
 * truncated and hostile documents (every error names its byte offset), deep nesting, numbers out
 * of range, and gzip round trips, bombs and corruption. Temporary files go to /tmp only.
 */
#include "harness.h"
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* ---- helpers ---------------------------------------------------------------------------------- */

struct sb {
    char *p;
    size_t n, cap;
};

__attribute__((format(printf, 2, 3))) static void sbf(struct sb *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->n;
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? room : 0, fmt, ap);
        va_end(ap);
        if (k < 0) abort();
        if (b->p && (size_t)k < room) {
            b->n += (size_t)k;
            return;
        }
        size_t nc = (b->cap ? b->cap * 2 : 256) + (size_t)k + 1;
        char *np = realloc(b->p, nc);
        if (!np) abort();
        b->p = np;
        b->cap = nc;
    }
}

/* one [memory] event; dev_type 1 = CUDA; reserved < 0: no Total Reserved */
static void mem(struct sb *b, int dev_type, int dev, uint64_t addr, int64_t bytes, const char *ts, int64_t reserved)
{
    sbf(b, "%s\n  {\"ph\": \"i\", \"cat\": \"cpu_instant_event\", \"s\": \"t\", \"name\": \"[memory]\", "
           "\"pid\": 7, \"tid\": 9, \"ts\": %s, \"args\": {\"Device Type\": %d, \"Device Id\": %d, "
           "\"Addr\": %" PRIu64 ", \"Bytes\": %" PRId64 ", \"Total Allocated\": 0",
        b->n && b->p[b->n - 1] != '[' ? "," : "", ts, dev_type, dev, addr, bytes);
    if (reserved >= 0) sbf(b, ", \"Total Reserved\": %" PRId64, reserved);
    sbf(b, "}}");
}

static void begin(struct sb *b)
{
    b->n = 0;
    sbf(b, "{\n  \"schemaVersion\": 1, \"deviceProperties\": [{\"id\": 0, \"name\": \"GPU\"}],\n"
           "  \"traceEvents\": [\n  {\"ph\": \"X\", \"cat\": \"cpu_op\", \"name\": \"aten::empty\", \"pid\": 7, "
           "\"tid\": 9, \"ts\": 1.000, \"dur\": 2.500, \"args\": {\"Input Dims\": [[2, 3], []], "
           "\"Device Type\": 1, \"Bytes\": 99}}");
}

static void end(struct sb *b)
{
    sbf(b, ",\n  {\"name\": \"Record Window End\", \"ph\": \"i\", \"s\": \"g\", \"pid\": \"\", \"tid\": \"\", "
           "\"ts\": 99999.000}\n  ],\n  \"traceName\": \"synthetic\"\n}");
}

/* Loads from an exact-size heap copy, so ASan sees any read past the end. */
static int load(const char *doc, size_t n, struct msh_trace_set **s, char *err, size_t errlen)
{
    char *b = malloc(n ? n : 1);
    if (!b) abort();
    memcpy(b, doc, n);
    int rc = msh_trace_load_profiler_mem(b, n, s, err, errlen);
    free(b);
    return rc;
}

static int loads(const char *doc, struct msh_trace_set **s, char *err, size_t errlen)
{
    return load(doc, strlen(doc), s, err, errlen);
}

static int ev_is(const struct msh_trace_event *e, int op, uint64_t addr, uint64_t size, int prefix)
{
    return e->op == op && e->addr == addr && e->size == size && e->prefix == prefix && e->stream == 0;
}

static int write_tmp(char *path, const char *suffix, const void *b, size_t n)
{
    snprintf(path, 96, "/tmp/msh_test_prof_XXXXXX%s", suffix);
    int fd = mkstemps(path, (int)strlen(suffix));
    if (fd < 0) return -1;
    int ok = write(fd, b, n) == (ssize_t)n;
    close(fd);
    return ok ? 0 : -1;
}

/* gzip (one member) of b with zlib */
static unsigned char *gz(const void *b, size_t n, size_t *outlen)
{
    z_stream z;
    memset(&z, 0, sizeof z);
    if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) abort();
    size_t cap = deflateBound(&z, (uLong)n) + 64;
    unsigned char *out = malloc(cap);
    z.next_in = (Bytef *)(uintptr_t)b;
    z.avail_in = (uInt)n;
    z.next_out = out;
    z.avail_out = (uInt)cap;
    if (deflate(&z, Z_FINISH) != Z_STREAM_END) abort();
    *outlen = cap - z.avail_out;
    deflateEnd(&z);
    return out;
}

static int same_streams(const struct msh_trace_set *a, const struct msh_trace_set *b)
{
    if (a->ndev != b->ndev) return 0;
    for (size_t d = 0; d < a->ndev; d++) {
        const struct msh_trace *x = &a->dev[d], *y = &b->dev[d];
        if (x->device != y->device || x->n != y->n || x->nprefix != y->nprefix ||
            x->peak_live_bytes != y->peak_live_bytes)
            return 0;
        for (size_t i = 0; i < x->n; i++)
            if (x->ev[i].op != y->ev[i].op || x->ev[i].addr != y->ev[i].addr || x->ev[i].size != y->ev[i].size ||
                x->ev[i].prefix != y->ev[i].prefix)
                return 0;
    }
    return 1;
}

/* ---- streams ---------------------------------------------------------------------------------- */

TEST(profiler_alloc_free_pairs)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0x7f0000000000, 4096, "10.500", 2097152);
    mem(&b, 1, 0, 0x7f0000001000, 1048576, "11.000", 4194304);
    mem(&b, 1, 0, 0x7f0000000000, -4096, "12.999", 4194304);
    mem(&b, 1, 0, 0x7f0000000000, 512, "13", 4194304);
    mem(&b, 1, 0, 0x7f0000001000, -1048576, "14.25", 2097152);
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    int rc = load(b.p, b.n, &s, err, sizeof err);
    REQUIRE(rc == 0 || !fprintf(stderr, "    %s\n", err));
    CHECK(strcmp(s->format, "pytorch-profiler") == 0 && !s->allocator_conf && !s->path);
    REQUIRE(s->ndev == 1);
    const struct msh_trace *t = &s->dev[0];
    CHECK(t->device == 0 && t->n == 5 && t->nprefix == 0 && t->warnings == 0 && t->nraw_events == 5);
    CHECK(ev_is(&t->ev[0], MSH_OP_ALLOC, 0x7f0000000000, 4096, 0) && t->ev[0].time_us == 10);
    CHECK(ev_is(&t->ev[1], MSH_OP_ALLOC, 0x7f0000001000, 1048576, 0) && t->ev[1].time_us == 11);
    CHECK(ev_is(&t->ev[2], MSH_OP_FREE, 0x7f0000000000, 4096, 0) && t->ev[2].time_us == 12);
    CHECK(ev_is(&t->ev[3], MSH_OP_ALLOC, 0x7f0000000000, 512, 0) && t->ev[3].time_us == 13);
    CHECK(ev_is(&t->ev[4], MSH_OP_FREE, 0x7f0000001000, 1048576, 0) && t->ev[4].time_us == 14);
    CHECK(t->peak_live_bytes == 4096 + 1048576 && t->final_live_bytes == 512 && t->nallocs == 3);
    CHECK(t->recorded_peak_reserved == 4194304 && t->recorded_final_reserved == 2097152);
    msh_trace_set_free(s);
    free(b.p);
}

TEST(profiler_unknown_frees_are_prefix_blocks)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0x9000, 100, "50", -1);
    mem(&b, 1, 0, 0x5000, -2048, "51", -1);  /* live before recording: prefix of 2048 */
    mem(&b, 1, 0, 0x3000, -512, "52", -1);   /* another, lower address: first in the prefix */
    mem(&b, 1, 0, 0x5000, -2048, "53", -1);  /* second free: dropped, one warning */
    mem(&b, 1, 0, 0x5000, 64, "54", -1);     /* the address reused */
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    REQUIRE(load(b.p, b.n, &s, err, sizeof err) == 0);
    REQUIRE(s->ndev == 1);
    const struct msh_trace *t = &s->dev[0];
    REQUIRE(t->n == 6 && t->nprefix == 2);
    CHECK(ev_is(&t->ev[0], MSH_OP_ALLOC, 0x3000, 512, 1) && t->ev[0].time_us == 50);
    CHECK(ev_is(&t->ev[1], MSH_OP_ALLOC, 0x5000, 2048, 1) && t->ev[1].time_us == 50);
    CHECK(ev_is(&t->ev[2], MSH_OP_ALLOC, 0x9000, 100, 0));
    CHECK(ev_is(&t->ev[3], MSH_OP_FREE, 0x5000, 2048, 0));
    CHECK(ev_is(&t->ev[4], MSH_OP_FREE, 0x3000, 512, 0));
    CHECK(ev_is(&t->ev[5], MSH_OP_ALLOC, 0x5000, 64, 0));
    CHECK(t->warnings == 1 && t->nallocs == 2 && t->nraw_events == 5);
    CHECK(t->peak_live_bytes == 2048 + 512 + 100 && t->final_live_bytes == 164);
    CHECK(t->recorded_peak_reserved == 0 && t->recorded_final_reserved == 0);
    msh_trace_set_free(s);
    free(b.p);
}

TEST(profiler_cpu_and_other_events_ignored)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 0, -1, 0x1000, 64, "1", 0);             /* CPU */
    mem(&b, 0, -1, 0x1000, -64, "2", 0);
    mem(&b, 13, 0, 0x2000, 64, "3", 0);             /* some other device type */
    mem(&b, 1, 0, 0x3000, 256, "4", 1024);
    sbf(&b, ",\n  {\"name\": \"[OutOfMemory]\", \"ph\": \"i\", \"ts\": 5, \"args\": {\"Device Type\": 1, "
            "\"Device Id\": 0, \"Bytes\": 99999, \"Total Allocated\": 1, \"Total Reserved\": 2}}");
    /* a [memory] name deeper down, and memory-like args on another event: neither counts */
    sbf(&b, ",\n  {\"name\": \"aten::add\", \"ph\": \"X\", \"ts\": 6, \"args\": {\"Device Type\": 1, "
            "\"Device Id\": 0, \"Addr\": 12288, \"Bytes\": -256, \"nested\": {\"name\": \"[memory]\"}}}");
    sbf(&b, ",\n  {\"name\": \"[memory]x\", \"ts\": 6, \"args\": {\"Device Type\": 1, \"Device Id\": 0, "
            "\"Addr\": 12288, \"Bytes\": -256}}");
    /* a CPU event that would be malformed as a CUDA one: not looked at past Device Type */
    sbf(&b, ",\n  {\"name\": \"[memory]\", \"ts\": \"x\", \"args\": {\"Device Type\": 0, \"Bytes\": 1.5}}");
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    int rc = load(b.p, b.n, &s, err, sizeof err);
    REQUIRE(rc == 0 || !fprintf(stderr, "    %s\n", err));
    REQUIRE(s->ndev == 1);
    CHECK(s->dev[0].n == 1 && ev_is(&s->dev[0].ev[0], MSH_OP_ALLOC, 0x3000, 256, 0));
    CHECK(s->dev[0].nraw_events == 1 && s->dev[0].warnings == 0 && s->dev[0].recorded_peak_reserved == 1024);
    msh_trace_set_free(s);

    /* only CPU events: a clear error */
    begin(&b);
    mem(&b, 0, -1, 0x1000, 64, "1", 0);
    end(&b);
    CHECK(load(b.p, b.n, &s, err, sizeof err) == EINVAL && !s);
    CHECKF(strstr(err, "all on the CPU"), "%s", err);
    free(b.p);
}

TEST(profiler_multiple_cuda_devices)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 3, 0x1000, 300, "1", 3000);
    mem(&b, 1, 0, 0x1000, 100, "2", 1000);
    mem(&b, 1, 1, 0x1000, 200, "3", 2000);
    mem(&b, 1, 3, 0x1000, -300, "4", 3500);
    mem(&b, 1, 0, 0x2000, 50, "5", 1000);
    mem(&b, 1, 1, 0x1000, -200, "6", 2000);
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    REQUIRE(load(b.p, b.n, &s, err, sizeof err) == 0);
    REQUIRE(s->ndev == 3);
    CHECK(s->dev[0].device == 0 && s->dev[1].device == 1 && s->dev[2].device == 3);
    CHECK(s->dev[0].n == 2 && s->dev[0].peak_live_bytes == 150 && s->dev[0].final_live_bytes == 150);
    CHECK(s->dev[1].n == 2 && s->dev[1].peak_live_bytes == 200 && s->dev[1].final_live_bytes == 0);
    CHECK(s->dev[2].n == 2 && s->dev[2].peak_live_bytes == 300 && s->dev[2].final_live_bytes == 0);
    CHECK(s->dev[2].recorded_peak_reserved == 3500 && s->dev[1].recorded_peak_reserved == 2000);
    for (size_t d = 0; d < 3; d++) CHECK(s->dev[d].nraw_events == 2 && s->dev[d].warnings == 0);
    msh_trace_set_free(s);
    free(b.p);
}

TEST(profiler_events_in_time_order)
{
    /* PyTorch writes each thread's allocations as a group: file order is not time order */
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0xa000, 10, "100.002", -1);  /* thread 1 */
    mem(&b, 1, 0, 0xa000, -10, "100.004", -1);
    mem(&b, 1, 0, 0xb000, 20, "100.001", -1);  /* thread 2 */
    mem(&b, 1, 0, 0xb000, -20, "100.003", -1);
    mem(&b, 1, 0, 0xc000, 30, "1.00005e2", -1); /* 100.005, written with an exponent */
    mem(&b, 1, 0, 0xc000, -30, "100.005", -1); /* same time: file order kept */
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    REQUIRE(load(b.p, b.n, &s, err, sizeof err) == 0);
    const struct msh_trace *t = &s->dev[0];
    REQUIRE(t->n == 6);
    CHECK(ev_is(&t->ev[0], MSH_OP_ALLOC, 0xb000, 20, 0));
    CHECK(ev_is(&t->ev[1], MSH_OP_ALLOC, 0xa000, 10, 0));
    CHECK(ev_is(&t->ev[2], MSH_OP_FREE, 0xb000, 20, 0));
    CHECK(ev_is(&t->ev[3], MSH_OP_FREE, 0xa000, 10, 0));
    CHECK(ev_is(&t->ev[4], MSH_OP_ALLOC, 0xc000, 30, 0));
    CHECK(ev_is(&t->ev[5], MSH_OP_FREE, 0xc000, 30, 0));
    CHECK(t->peak_live_bytes == 30 && t->warnings == 0 && t->nprefix == 0);
    for (size_t i = 0; i < 6; i++) CHECK(t->ev[i].time_us == 100);
    msh_trace_set_free(s);
    free(b.p);
}

TEST(profiler_repairs_are_counted)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0x1000, 100, "1", 4096);
    mem(&b, 1, 0, 0x1000, 200, "2", 4096);   /* duplicate alloc: old block freed first */
    mem(&b, 1, 0, 0x1000, -300, "3", 4096);  /* size differs from the alloc's */
    mem(&b, 1, 0, 0x2000, 0, "4", 4096);     /* Bytes 0: dropped */
    mem(&b, 1, 0, 0x3000, 8192, "5", 4096);  /* more than Total Reserved: kept */
    sbf(&b, ",\n  {\"name\": \"[memory]\", \"ts\": 6, \"args\": {\"Device Type\": 1, \"Device Id\": 0, "
            "\"Bytes\": 64}}");                  /* no Addr: dropped */
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    REQUIRE(load(b.p, b.n, &s, err, sizeof err) == 0);
    const struct msh_trace *t = &s->dev[0];
    REQUIRE(t->n == 5);
    CHECK(ev_is(&t->ev[0], MSH_OP_ALLOC, 0x1000, 100, 0));
    CHECK(ev_is(&t->ev[1], MSH_OP_FREE, 0x1000, 100, 0));
    CHECK(ev_is(&t->ev[2], MSH_OP_ALLOC, 0x1000, 200, 0));
    CHECK(ev_is(&t->ev[3], MSH_OP_FREE, 0x1000, 200, 0));
    CHECK(ev_is(&t->ev[4], MSH_OP_ALLOC, 0x3000, 8192, 0));
    CHECKF(t->warnings == 5, "%zu warnings", t->warnings);
    CHECK(t->nraw_events == 6);
    msh_trace_set_free(s);

    /* no event has an Addr (an older PyTorch): nothing can be matched, a clear error */
    begin(&b);
    sbf(&b, ",{\"name\": \"[memory]\", \"ts\": 6, \"args\": {\"Device Type\": 1, \"Device Id\": 0, \"Bytes\": 64}}");
    end(&b);
    CHECK(load(b.p, b.n, &s, err, sizeof err) == EINVAL && !s);
    CHECKF(strstr(err, "no 'Addr'"), "%s", err);
    free(b.p);
}

TEST(profiler_json_variants)
{
    struct msh_trace_set *s = NULL;
    char err[512];
    /* args before name, escaped keys and name, BOM, top-level array (Chrome's array format),
     * integer and exponent ts, negative Addr (intptr_t), duplicate keys (the last one counts),
     * a second args object, no whitespace at all */
    static const char *const ok[] = {
        "{\"traceEvents\":[{\"args\":{\"Bytes\":8,\"Addr\":16,\"Device Id\":0,\"Device Type\":1},\"ts\":5,"
        "\"name\":\"[memory]\"}]}",
        "\xef\xbb\xbf \r\n\t{\"traceEvents\": [{\"name\": \"\\u005bmemory]\", \"ts\": 5e0, \"args\": "
        "{\"\\u0044evice Type\": 1, \"Device\\u0020Id\": 0, \"\\u0041ddr\": 16, \"Bytes\": 8}}]}\n",
        "[{\"name\": \"[memory]\", \"ts\": 5, \"args\": {\"Device Type\": 1, \"Device Id\": 0, \"Addr\": 16, "
        "\"Bytes\": 8}}]",
        "{\"traceEvents\": [{\"name\": \"x\", \"name\": \"[memory]\", \"ts\": 5, \"args\": {\"Device Type\": 1, "
        "\"Device Id\": 0, \"Addr\": 99, \"Addr\": 16, \"Bytes\": 8}}]}",
        "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 5, \"args\": {\"Device Type\": 1, \"Addr\": 3}, "
        "\"args\": {\"Device Type\": 1, \"Device Id\": 0, \"Addr\": 16, \"Bytes\": 8}}]}",
        "{\"a\": {\"traceEvents\": 5}, \"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 0.5e1, \"args\": {\"Device Type\": 1, "
        "\"Device Id\": 0, \"Addr\": 16, \"Bytes\": 8, \"x\": [1, -2.5e-3, true, false, null, \"\\\"\\\\\\/\\b\\f\\n\\r\\t\"]}}]}",
    };
    for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
        int rc = loads(ok[k], &s, err, sizeof err);
        CHECKF(rc == 0, "case %zu: %s", k, err);
        if (rc) continue;
        CHECKF(s->ndev == 1 && s->dev[0].n == 1 && ev_is(&s->dev[0].ev[0], MSH_OP_ALLOC, 16, 8, 0) &&
                   s->dev[0].ev[0].time_us == 5, "case %zu", k);
        msh_trace_set_free(s);
    }
    /* the last 'name' counts, whatever its type */
    CHECK(loads("{\"traceEvents\": [{\"name\": \"[memory]\", \"name\": [\"[memory]\"], \"ts\": 1, \"args\": {"
                "\"Device Type\": 1, \"Device Id\": 0, \"Addr\": 1, \"Bytes\": 1}}]}", &s, err, sizeof err) == EINVAL);
    CHECKF(strstr(err, "no [memory] event"), "%s", err);
    /* a negative Addr keeps its bits; a fractional ts truncates; ts below 0 is time 0 */
    CHECK(loads("{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": -3.5, \"args\": {\"Device Type\": 1, "
                "\"Device Id\": 2, \"Addr\": -4096, \"Bytes\": -8}}]}", &s, err, sizeof err) == 0);
    if (s) {
        CHECK(s->ndev == 1 && s->dev[0].device == 2 && s->dev[0].n == 2 && s->dev[0].nprefix == 1);
        CHECK(s->dev[0].ev[0].addr == (uint64_t)-4096 && s->dev[0].ev[1].time_us == 0);
        msh_trace_set_free(s);
    }
    /* the largest values that are accepted */
    CHECK(loads("{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 9223372036854775.807, \"args\": {\"Device Type\": 1, "
                "\"Device Id\": 1023, \"Addr\": 18446744073709551615, \"Bytes\": 281474976710656, "
                "\"Total Reserved\": 18446744073709551615}}]}", &s, err, sizeof err) == 0);
    if (s) {
        CHECK(s->dev[0].device == 1023 && s->dev[0].ev[0].addr == UINT64_MAX && s->dev[0].ev[0].size == (1ull << 48));
        CHECK(s->dev[0].ev[0].time_us == 9223372036854775ull && s->dev[0].recorded_peak_reserved == UINT64_MAX);
        msh_trace_set_free(s);
    }
}

/* ---- errors ----------------------------------------------------------------------------------- */

/* "{"traceEvents": [" + the event + "]}": the event starts at offset 17 */
#define EV(args, ts) "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": " ts ", \"args\": {" args "}}]}"
#define CUDA "\"Device Type\": 1, \"Device Id\": 0, "

TEST(profiler_errors_name_the_offset)
{
    static const struct { const char *doc; const char *msg; const char *at; } cases[] = {
        /* at: where the error must point (the first occurrence in doc; "$": its end; NULL: no offset) */
        {"", "empty", NULL},
        {"{", "ends inside an object (1 levels deep)", "$"},
        {"{\"traceEvents\": [", "ends where a value was expected (2 levels deep)", "$"},
        {"{\"traceEvents\": [{\"name\": \"[memory]\"", "ends inside an object (3 levels deep)", "$"},
        {"{\"traceEvents\": [{\"name\": \"[mem", "string not terminated", "\"[mem"},
        {"{\"traceEvents\": [{\"name\": \"a\tb\"}]}", "control character 0x09", "\tb"},
        {"{\"traceEvents\": [{\"name\": \"a\\qb\"}]}", "invalid escape", "\\q"},
        {"{\"traceEvents\": [{\"name\": \"a\\u12g4\"}]}", "4 hex digits", "\\u12g4"},
        {"{\"traceEvents\": [{\"name\": \"a\\u12", "cut by the end", "\\u12"},
        {"{\"traceEvents\": [{\"name\" \"x\"}]}", "expected ':'", "\"x\""},
        {"{\"traceEvents\": [{name: 1}]}", "expected a string key", "name"},
        {"{\"traceEvents\": [{\"a\": 1,}]}", "expected a string key in an object, got '}'", "}]"},
        {"{\"traceEvents\": [{\"a\": 1},]}", "expected a JSON value, got ']'", "]}"},
        {"{\"traceEvents\": [{\"a\": 1} {\"b\": 2}]}", "expected ',' or ']' after a value in an array, got '{'", "{\"b"},
        {"{\"traceEvents\": [{\"a\": tru}]}", "invalid literal (expected true)", "tru"},
        {"{\"traceEvents\": [{\"a\": nan}]}", "invalid literal (expected null)", "nan"},
        {"{\"traceEvents\": [{\"a\": +1}]}", "expected a JSON value, got '+'", "+"},
        {"{\"traceEvents\": [{\"a\": 01}]}", "expected ',' or '}'", "1}"},
        {"{\"traceEvents\": [{\"a\": 1.}]}", "after the decimal point", "}]"},
        {"{\"traceEvents\": [{\"a\": 1e}]}", "in the exponent", "}]"},
        {"{\"traceEvents\": [{\"a\": -}]}", "expected a digit in a number, got '}'", "}]"},
        {"{\"traceEvents\": []} x", "after the end of the JSON document", "x"},
        {"{\"traceEvents\": []}{}", "unexpected '{' after the end of the JSON document", "{}"},
        {"{\"traceEvents\": {}}", "'traceEvents' is not an array", "{}"},
        {"{\"traceEvents\": [1]}", "traceEvents item is not an object (got '1')", "1]"},
        {"[[]]", "traceEvents item is not an object", "[]"},
        {"\"traceEvents\"", "expected '{' or '['", "\""},
        {"{\"segments\": []}", "unrecognised trace format", NULL},
        {"{\"traceEvents\": []}", "the trace has 0 events and no [memory] event", NULL},
        {"{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1}]}", "without 'args'", "{\"name"},
        {"{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1, \"args\": [1]}]}", "'args' is an array", "[1]"},
        {EV("\"Device Id\": 0, \"Addr\": 1, \"Bytes\": 1", "1"), "without args 'Device Type'", "{\"name"},
        {EV("\"Device Type\": \"1\", \"Device Id\": 0, \"Addr\": 1, \"Bytes\": 1", "1"), "'Device Type' is a string", "\"1\""},
        {EV("\"Device Type\": 1, \"Addr\": 1, \"Bytes\": 1", "1"), "without args 'Device Id'", "{\"name"},
        {EV("\"Device Type\": 1, \"Device Id\": 1024, \"Addr\": 1, \"Bytes\": 1", "1"), "out of range (0 to 1023)", "1024"},
        {EV("\"Device Type\": 1, \"Device Id\": -1, \"Addr\": 1, \"Bytes\": 1", "1"), "'Device Id' -1 out of range", "-1"},
        {EV(CUDA "\"Addr\": 1", "1"), "without args 'Bytes'", "{\"name"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1.5", "1"), "'Bytes' 1.5 is not an integer", "1.5"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1e3", "1"), "is not an integer", "1e3"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": null", "1"), "'Bytes' is null", "null"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": {}", "1"), "'Bytes' is an object", "{}"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 281474976710657", "1"), "out of range (|Bytes| at most 2^48)", "281474976710657"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": -1152921504606846976", "1"), "'Bytes' -1152921504606846976 out of range", "-1152921504606846976"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 18446744073709551616", "1"), "'Bytes' 18446744073709551616 does not fit in 64 bits", "18446744073709551616"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1000000000000000000000000000000000000000000000000000000000000000000000000", "1"),
         "'Bytes' 1000000000000000000000000000000000000000... does not fit in 64 bits", "1000000000"},
        {EV(CUDA "\"Addr\": -9223372036854775809, \"Bytes\": 1", "1"), "'Addr' -9223372036854775809 out of range", "-9223372036854775809"},
        {EV(CUDA "\"Addr\": true, \"Bytes\": 1", "1"), "'Addr' is a boolean", "true"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1, \"Total Reserved\": -5", "1"), "'Total Reserved' is negative", "-5"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1, \"Total Reserved\": 0.5", "1"), "'Total Reserved' 0.5 is not an integer", "0.5"},
        {"{\"traceEvents\": [{\"name\": \"[memory]\", \"args\": {" CUDA "\"Addr\": 1, \"Bytes\": 1}}]}", "without 'ts'", "{\"name"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1", "\"1\""), "'ts' is a string", "\"1\""},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1", "1e30"), "'ts' 1e30 is out of range", "1e30"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1", "-9223372036854776"), "'ts' -9223372036854776 is out of range", "-9223372036854776"},
        {EV(CUDA "\"Addr\": 1, \"Bytes\": 1", "1e999999999999999999999"), "'ts' 1e999999999999999999999 is out of range", "1e999"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct msh_trace_set *s = NULL;
        char err[512] = "";
        int rc = loads(cases[k].doc, &s, err, sizeof err);
        CHECKF(rc == EINVAL && !s, "case %zu: rc %d", k, rc);
        CHECKF(strstr(err, cases[k].msg), "case %zu: '%s' lacks '%s'", k, err, cases[k].msg);
        if (cases[k].at) {
            const char *at = strcmp(cases[k].at, "$") ? strstr(cases[k].doc, cases[k].at) : strchr(cases[k].doc, 0);
            REQUIRE(at);
            long off = (long)(at - cases[k].doc);
            char want[64];
            snprintf(want, sizeof want, "offset %ld (line 1, column %ld): ", off, off + 1);
            CHECKF(strncmp(err, want, strlen(want)) == 0, "case %zu: '%s' does not start with '%s'", k, err, want);
        }
        msh_trace_set_free(s);
    }
    /* the line and column count newlines */
    struct msh_trace_set *s = NULL;
    char err[512];
    CHECK(loads("{\n  \"traceEvents\": [\n    {\"a\": ?}]}", &s, err, sizeof err) == EINVAL);
    CHECKF(strncmp(err, "offset 31 (line 3, column 11): expected a JSON value, got '?'", 61) == 0, "%s", err);
    /* a NUL byte and a byte >= 0x80 outside strings */
    CHECK(load("{\"traceEvents\": [\0]}", 20, &s, err, sizeof err) == EINVAL && strstr(err, "got 0x00"));
    CHECK(loads("{\"traceEvents\": [\xff]}", &s, err, sizeof err) == EINVAL && strstr(err, "got 0xff"));
    /* ...and inside strings, not checked as UTF-8 */
    CHECK(loads("{\"traceEvents\": [{\"name\": \"\xff\xfe\"}], \"x\": 1}", &s, err, sizeof err) == EINVAL);
    CHECKF(strstr(err, "no [memory] event"), "%s", err);
    CHECK(msh_trace_load_profiler_mem(NULL, 0, &s, err, sizeof err) == EINVAL && !s);
    CHECK(msh_trace_load_profiler_mem("{]", 2, &s, NULL, 0) == EINVAL && !s);
}

static char *small_doc(size_t *len)
{
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0x1000, 512, "1.5", 2097152);
    mem(&b, 1, 1, 0x2000, -1024, "2.5", 2097152);
    mem(&b, 0, -1, 0x3000, 64, "3", 0);
    mem(&b, 1, 0, 0x1000, -512, "4", 2097152);
    end(&b);
    *len = b.n;
    return b.p;
}

TEST(profiler_truncated_at_every_offset)
{
    size_t len;
    char *doc = small_doc(&len);
    struct msh_trace_set *s = NULL;
    char err[512];
    REQUIRE(load(doc, len, &s, err, sizeof err) == 0);
    msh_trace_set_free(s);
    for (size_t n = 0; n < len; n++) {
        int rc = load(doc, n, &s, err, sizeof err);
        CHECKF(rc == EINVAL && !s && err[0], "cut at %zu: rc %d", n, rc);
        msh_trace_set_free(s);
        s = NULL;
    }
    free(doc);
}

TEST(profiler_byte_mutations_do_not_crash)
{
    size_t len, ok = 0;
    char *doc = small_doc(&len);
    static const unsigned char vals[] = {0x00, '"', ',', '-', '0', '9', ':', '[', '\\', ']', 'e', '{', '}', 0xff};
    char *b = malloc(len);
    for (size_t i = 0; i < len; i++) {
        for (size_t v = 0; v < sizeof vals; v++) {
            memcpy(b, doc, len);
            b[i] = (char)vals[v];
            struct msh_trace_set *s = NULL;
            char err[512] = "";
            int rc = msh_trace_load_profiler_mem(b, len, &s, err, sizeof err);
            CHECK(rc == 0 ? s != NULL : (s == NULL && err[0]));
            ok += rc == 0;
            msh_trace_set_free(s);
        }
    }
    free(b);
    free(doc);
    CHECK(ok > 0);
}

TEST(profiler_deep_nesting)
{
    struct msh_trace_set *s = NULL;
    char err[512];
    /* 200000 '[': refused at depth 1000, nothing recursed */
    size_t n = 200000;
    char *b = malloc(n);
    memcpy(b, "{\"x\": ", 6);
    memset(b + 6, '[', n - 6);
    CHECK(load(b, n, &s, err, sizeof err) == EINVAL && !s);
    /* '{' and 999 '[' open; the next '[', at 6 + 999, is one too many */
    CHECKF(strstr(err, "offset 1005 (line 1, column 1006): JSON nested deeper than 1000 levels"), "%s", err);
    memset(b, '[', n); /* as the root: the second '[' is a traceEvents item that is not an object */
    CHECK(load(b, n, &s, err, sizeof err) == EINVAL && strstr(err, "offset 1 "));
    /* '{"a":' repeated */
    struct sb d = {0};
    for (int i = 0; i < 50000; i++) sbf(&d, "{\"a\":");
    CHECK(load(d.p, d.n, &s, err, sizeof err) == EINVAL && strstr(err, "nested deeper than 1000"));
    /* 990 levels inside a memory event's args: fine */
    d.n = 0;
    sbf(&d, "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1, \"args\": {\"x\": ");
    for (int i = 0; i < 990; i++) sbf(&d, "[");
    for (int i = 0; i < 990; i++) sbf(&d, "]");
    sbf(&d, ", " CUDA "\"Addr\": 1, \"Bytes\": 2}}]}");
    int rc = load(d.p, d.n, &s, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    CHECK(s && s->dev[0].n == 1);
    msh_trace_set_free(s);
    free(d.p);
    free(b);
}

TEST(profiler_numbers_are_bounded)
{
    struct msh_trace_set *s = NULL;
    char err[512];
    /* a 1 MB number and a 1 MB string in an event nobody replays: scanned, not converted */
    struct sb d = {0};
    sbf(&d, "{\"traceEvents\": [{\"name\": \"k\", \"ts\": 1");
    for (int i = 0; i < 1000000; i++) sbf(&d, "9");
    sbf(&d, ".5e-99999999999999999999, \"s\": \"");
    for (int i = 0; i < 100000; i++) sbf(&d, "\\u0041bcdefghi");
    sbf(&d, "\"}, {\"name\": \"[memory]\", \"ts\": 0.");
    for (int i = 0; i < 100000; i++) sbf(&d, "0");
    sbf(&d, "1e100003, \"args\": {" CUDA "\"Addr\": 1, \"Bytes\": 2}}]}"); /* 0.000...1e100003 = 100 us */
    int rc = load(d.p, d.n, &s, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    CHECK(s && s->dev[0].n == 1 && s->dev[0].ev[0].time_us == 100);
    msh_trace_set_free(s);
    /* a 1 MB ts on a memory event: out of range, message cut short */
    d.n = 0;
    sbf(&d, "{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1");
    for (int i = 0; i < 1000000; i++) sbf(&d, "0");
    sbf(&d, ", \"args\": {" CUDA "\"Addr\": 1, \"Bytes\": 2}}]}");
    CHECK(load(d.p, d.n, &s, err, sizeof err) == EINVAL && strstr(err, "... is out of range") && strlen(err) < 200);
    free(d.p);
}

TEST(profiler_ten_gigabyte_bytes_are_data_not_memory)
{
    /* A 10 GB block is a legal event (a number in the stream: the reader allocates nothing for
     * it); above the event's Total Reserved it is a counted warning; beyond 2^48 an error. */
    struct msh_trace_set *s = NULL;
    char err[512];
    struct sb b = {0};
    begin(&b);
    mem(&b, 1, 0, 0x1000, 10737418240ll, "1", 12884901888ll);
    mem(&b, 1, 0, 0x1000, -10737418240ll, "2", 12884901888ll);
    mem(&b, 1, 0, 0x2000, 10737418240ll, "3", 2147483648ll); /* above Total Reserved: warning */
    end(&b);
    REQUIRE(load(b.p, b.n, &s, err, sizeof err) == 0);
    CHECK(s->dev[0].n == 3 && s->dev[0].ev[0].size == 10737418240ull && s->dev[0].peak_live_bytes == 10737418240ull);
    CHECK(s->dev[0].warnings == 1);
    msh_trace_set_free(s);
    begin(&b);
    mem(&b, 1, 0, 0x1000, 1ll << 60, "1", -1);
    end(&b);
    CHECK(load(b.p, b.n, &s, err, sizeof err) == EINVAL && !s && strstr(err, "'Bytes' 1152921504606846976 out of range"));
    free(b.p);
}

/* ---- gzip ------------------------------------------------------------------------------------- */

TEST(gzip_round_trip_through_load)
{
    size_t len, zlen;
    char *doc = small_doc(&len);
    unsigned char *z = gz(doc, len, &zlen);
    char path[96], err[512];
    struct msh_trace_set *plain = NULL, *s = NULL;
    REQUIRE(load(doc, len, &plain, err, sizeof err) == 0);
    REQUIRE(write_tmp(path, ".pt.trace.json.gz", z, zlen) == 0);
    int rc = msh_trace_load(path, &s, err, sizeof err);
    CHECKF(rc == 0, "%s", err);
    if (s) {
        CHECK(strcmp(s->format, "pytorch-profiler") == 0 && strcmp(s->path, path) == 0);
        CHECK(same_streams(plain, s) && s->ndev == 2);
        msh_trace_set_free(s);
    }
    unlink(path);
    /* the plain file too */
    REQUIRE(write_tmp(path, ".json", doc, len) == 0);
    CHECK(msh_trace_load(path, &s, err, sizeof err) == 0 && same_streams(plain, s));
    msh_trace_set_free(s);
    unlink(path);
    /* two members (cat a.gz b.gz) and zero padding after them */
    size_t l1, l2;
    unsigned char *z1 = gz(doc, len / 2, &l1), *z2 = gz(doc + len / 2, len - len / 2, &l2);
    unsigned char *cat = calloc(1, l1 + l2 + 100);
    memcpy(cat, z1, l1);
    memcpy(cat + l1, z2, l2);
    REQUIRE(write_tmp(path, ".gz", cat, l1 + l2 + 100) == 0);
    rc = msh_trace_load(path, &s, err, sizeof err);
    CHECKF(rc == 0 && same_streams(plain, s), "%s", err);
    msh_trace_set_free(s);
    unlink(path);
    /* an error inside inflated JSON names the file and says so */
    unsigned char *zb = gz("{\"traceEvents\": [}", 18, &zlen);
    REQUIRE(write_tmp(path, ".gz", zb, zlen) == 0);
    CHECK(msh_trace_load(path, &s, err, sizeof err) == EINVAL && !s);
    char want[200];
    snprintf(want, sizeof want, "%s (inflated): offset 17 (line 1, column 18): expected a JSON value, got '}'", path);
    CHECKF(strncmp(err, want, strlen(want)) == 0, "%s", err);
    unlink(path);
    free(zb);
    /* other formats inside gzip load too */
    const char *txt = "# memshim-trace 1\na 0 0 0x10 5\n";
    zb = gz(txt, strlen(txt), &zlen);
    REQUIRE(write_tmp(path, ".gz", zb, zlen) == 0);
    CHECK(msh_trace_load(path, &s, err, sizeof err) == 0 && s && strcmp(s->format, "memshim-trace") == 0);
    msh_trace_set_free(s);
    unlink(path);
    /* gzip inside gzip is refused */
    unsigned char *zz = gz(zb, zlen, &l1);
    REQUIRE(write_tmp(path, ".gz", zz, l1) == 0);
    CHECK(msh_trace_load(path, &s, err, sizeof err) == EINVAL && strstr(err, "gzip data inside gzip"));
    unlink(path);
    free(zz);
    free(zb);
    free(cat);
    free(z1);
    free(z2);
    free(z);
    free(doc);
    msh_trace_set_free(plain);
}

TEST(gzip_corrupt_truncated_and_bombs)
{
    size_t len, zlen, olen;
    char *doc = small_doc(&len);
    unsigned char *z = gz(doc, len, &zlen), *out = NULL;
    char err[512];
    /* whole */
    CHECK(msh_trace_gunzip(z, zlen, &out, &olen, err, sizeof err) == 0 && olen == len && memcmp(out, doc, len) == 0);
    CHECK(out && out[olen] == 0);
    free(out);
    /* cut at every length: an error, never a crash */
    for (size_t n = 0; n < zlen; n++) {
        unsigned char *c = malloc(n ? n : 1);
        memcpy(c, z, n);
        out = NULL;
        int rc = msh_trace_gunzip(c, n, &out, &olen, err, sizeof err);
        CHECKF(rc == EINVAL && !out && err[0], "cut at %zu: rc %d", n, rc);
        free(c);
    }
    /* every byte flipped: an error or the right bytes (the CRC catches the rest) */
    unsigned char *c = malloc(zlen);
    for (size_t i = 0; i < zlen; i++) {
        memcpy(c, z, zlen);
        c[i] ^= 0x55;
        out = NULL;
        int rc = msh_trace_gunzip(c, zlen, &out, &olen, err, sizeof err);
        CHECK(rc == 0 ? (out != NULL) : (out == NULL && err[0]));
        free(out);
    }
    free(c);
    /* garbage after the member */
    c = malloc(zlen + 3);
    memcpy(c, z, zlen);
    memcpy(c + zlen, "abc", 3);
    CHECK(msh_trace_gunzip(c, zlen + 3, &out, &olen, err, sizeof err) == EINVAL && strstr(err, "unexpected bytes after"));
    free(c);
    CHECK(msh_trace_gunzip((const unsigned char *)"ab", 2, &out, &olen, err, sizeof err) == EINVAL &&
          strstr(err, "not gzip"));
    /* a bomb: 300 MiB of zeros compress to about 300 KiB, far beyond 256 times that: refused
     * once 256 times the compressed size came out, without inflating the rest */
    size_t big = (size_t)300 << 20;
    unsigned char *zeros = calloc(1, big);
    REQUIRE(zeros);
    unsigned char *bomb = gz(zeros, big, &zlen);
    free(zeros);
    CHECKF(zlen < ((size_t)1 << 20), "%zu", zlen);
    out = NULL;
    CHECK(msh_trace_gunzip(bomb, zlen, &out, &olen, err, sizeof err) == EFBIG && !out);
    char want[160];
    snprintf(want, sizeof want, "more than %zu bytes (the limit is 256 times the %zu compressed bytes, and at "
             "least 67108864): refusing what looks like a zip bomb", zlen * 256, zlen);
    CHECKF(strstr(err, want), "%s", err);
    /* a small bomb is held to the 64 MiB floor */
    zeros = calloc(1, (size_t)80 << 20);
    REQUIRE(zeros);
    unsigned char *small_bomb = gz(zeros, (size_t)80 << 20, &olen);
    free(zeros);
    unsigned char *o2 = NULL;
    size_t o2len;
    CHECK(msh_trace_gunzip(small_bomb, olen, &o2, &o2len, err, sizeof err) == EFBIG && !o2);
    CHECKF(strstr(err, "more than 67108864 bytes"), "%s", err);
    free(small_bomb);
    char path[96];
    REQUIRE(write_tmp(path, ".gz", bomb, zlen) == 0);
    struct msh_trace_set *s = NULL;
    CHECK(msh_trace_load(path, &s, err, sizeof err) == EFBIG && !s && strstr(err, "zip bomb"));
    unlink(path);
    free(bomb);
    /* the ratio scales with the compressed size: 256 x 300 KiB of real data is allowed, so a
     * well-compressing trace of 16 MiB inflates fine */
    struct sb b = {0};
    begin(&b);
    for (int i = 0; b.n < ((size_t)16 << 20); i++) mem(&b, 1, 0, 0x10000 + (uint64_t)i * 512, 512, "1", -1);
    end(&b);
    bomb = gz(b.p, b.n, &zlen);
    CHECK(msh_trace_gunzip(bomb, zlen, &out, &olen, err, sizeof err) == 0 && olen == b.n);
    free(out);
    free(bomb);
    free(b.p);
    free(z);
    free(doc);
}

TEST(profiler_text_round_trip)
{
    size_t len;
    char *doc = small_doc(&len);
    struct msh_trace_set *s = NULL, *back = NULL;
    char err[512];
    REQUIRE(load(doc, len, &s, err, sizeof err) == 0);
    char *txt = NULL;
    size_t tlen = 0;
    FILE *f = open_memstream(&txt, &tlen);
    REQUIRE(f);
    CHECK(msh_trace_write_text(f, s) == 0);
    fclose(f);
    CHECKF(strstr(txt, "# converted from a pytorch-profiler"), "%s", txt);
    CHECK(msh_trace_load_text_mem(txt, tlen, &back, err, sizeof err) == 0);
    CHECK(back && same_streams(s, back));
    for (size_t d = 0; back && d < back->ndev; d++)
        CHECK(back->dev[d].warnings == 0 && back->dev[d].recorded_peak_reserved == s->dev[d].recorded_peak_reserved);
    msh_trace_set_free(back);
    msh_trace_set_free(s);
    free(txt);
    free(doc);
}

TEST(profiler_large_trace_two_threads)
{
    /* 200000 memory events written as two per-thread groups plus kernel noise: time order is
     * restored and the live total never goes negative; the reader keeps 40 bytes an event */
    struct sb b = {0};
    begin(&b);
    for (int th = 0; th < 2; th++) {
        for (int i = 0; i < 50000; i++) {
            char ts[32];
            uint64_t a = 0x7f0000000000ull + ((uint64_t)th << 32) + (uint64_t)i * 4096;
            snprintf(ts, sizeof ts, "%d.%03d", 1000 + 2 * i + th, th);
            mem(&b, 1, 0, a, 4096, ts, 1 << 30);
            snprintf(ts, sizeof ts, "%d.%03d", 1000 + 2 * i + th + 1, th);
            mem(&b, 1, 0, a, -4096, ts, 1 << 30);
            if (i % 8 == 0)
                sbf(&b, ",\n  {\"ph\": \"X\", \"cat\": \"kernel\", \"name\": \"void at::native::kernel<float>(int)\", "
                        "\"pid\": 0, \"tid\": 7, \"ts\": %d.5, \"dur\": 3.2, \"args\": {\"grid\": [1, 2, 3], "
                        "\"block\": [128, 1, 1], \"stream\": 7}}", i);
        }
    }
    end(&b);
    struct msh_trace_set *s = NULL;
    char err[512];
    clock_t t0 = clock();
    int rc = load(b.p, b.n, &s, err, sizeof err);
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    REQUIRE(rc == 0 || !fprintf(stderr, "    %s\n", err));
    fprintf(stderr, "    %.1f MB in %.3f s\n", (double)b.n / 1e6, secs);
    const struct msh_trace *t = &s->dev[0];
    CHECK(t->n == 200000 && t->warnings == 0 && t->nprefix == 0 && t->nallocs == 100000);
    /* each thread's block lives 1 us, the other thread's overlaps it: at most 2 live at a time */
    CHECKF(t->peak_live_bytes == 2 * 4096, "%" PRIu64, t->peak_live_bytes);
    CHECK(t->final_live_bytes == 0);
    for (size_t i = 1; i < t->n; i++)
        if (t->ev[i].time_us < t->ev[i - 1].time_us) {
            CHECKF(0, "event %zu out of time order", i);
            break;
        }
    msh_trace_set_free(s);
    free(b.p);
}

TEST(replay_tool_end_to_end)
{
    /* build/memshim-replay --capacity auto --json on a gzip-compressed profiler trace */
    char self[4096], tool[4200], path[96], cmd[8600];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    REQUIRE(k > 0);
    self[k] = 0;
    char *slash = strrchr(self, '/');
    REQUIRE(slash);
    *slash = 0; /* build/tests */
    snprintf(tool, sizeof tool, "%s/../memshim-replay", self);
    if (access(tool, X_OK) != 0) SKIP("build/memshim-replay not built");
    struct sb b = {0};
    begin(&b);
    for (int i = 0; i < 64; i++) {
        char ts[32];
        snprintf(ts, sizeof ts, "%d", 10 + i);
        mem(&b, 1, 0, 0x7f0000000000ull + (uint64_t)(i / 2 % 8) * (4u << 20), i % 2 ? -(3 << 20) : 3 << 20, ts, 64 << 20);
    }
    end(&b);
    size_t zlen;
    unsigned char *z = gz(b.p, b.n, &zlen);
    REQUIRE(write_tmp(path, ".pt.trace.json.gz", z, zlen) == 0);
    snprintf(cmd, sizeof cmd, "'%s' --capacity auto --json '%s' 2>&1", tool, path);
    FILE *p = popen(cmd, "r");
    REQUIRE(p);
    char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    CHECKF(st == 0, "exit status %d: %s", st, out);
    CHECKF(strstr(out, "\"format\":\"pytorch-profiler\"") && strstr(out, "\"device\":0"), "%s", out);
    unlink(path);
    free(z);
    free(b.p);
}

TEST_MAIN()
