/*
 * fuzz_profiler.c: libFuzzer entry point for the torch.profiler trace reader (profiler.c) and
 * gzip input (msh_trace_gunzip in trace.c): any bytes go through msh_trace_load_profiler_mem
 * (and, when they start with the gzip magic, through msh_trace_gunzip and then the reader).
 * What loads must obey trace.h's invariant, which the text format checks for us: written out
 * with msh_trace_write_text it must load again with the same events and no warning. Built by
 * tests/fuzz/run_fuzz.sh with clang -fsanitize=fuzzer; never part of libmemshim_trace.a, and it
 * must never keep state between inputs.
 */
#include "trace.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_set(const struct msh_trace_set *s)
{
    char *out = NULL;
    size_t outlen = 0;
    char err[256];
    if (s->ndev == 0) abort(); /* a loaded profiler trace has at least one CUDA device */
    for (size_t d = 0; d < s->ndev; d++) {
        const struct msh_trace *t = &s->dev[d];
        if (t->nprefix > t->n || (d && s->dev[d - 1].device >= t->device)) abort();
        for (size_t i = 0; i < t->n; i++) {
            if ((i < t->nprefix) != (t->ev[i].prefix == 1) || t->ev[i].stream != 0) abort();
            if (t->ev[i].size > ((uint64_t)1 << 48)) abort();
            if (i > t->nprefix && t->ev[i].time_us < t->ev[i - 1].time_us) abort(); /* time order */
        }
    }
    FILE *f = open_memstream(&out, &outlen);
    if (!f) return;
    int rc = msh_trace_write_text(f, s);
    fclose(f);
    struct msh_trace_set *back = NULL;
    if (rc == 0 && msh_trace_load_text_mem(out, outlen, &back, err, sizeof err) != 0) abort();
    if (back) {
        if (back->ndev != s->ndev) abort();
        for (size_t d = 0; d < s->ndev; d++) {
            const struct msh_trace *a = &s->dev[d], *b = &back->dev[d];
            if (a->n != b->n || b->warnings != 0 || a->peak_live_bytes != b->peak_live_bytes ||
                a->recorded_peak_reserved != b->recorded_peak_reserved)
                abort();
            for (size_t i = 0; i < a->n; i++)
                if (a->ev[i].addr != b->ev[i].addr || a->ev[i].size != b->ev[i].size ||
                    a->ev[i].op != b->ev[i].op || a->ev[i].prefix != b->ev[i].prefix)
                    abort();
        }
    }
    msh_trace_set_free(back);
    free(out);
}

static void one(const char *buf, size_t size)
{
    struct msh_trace_set *s = NULL;
    char err[512];
    err[0] = 0;
    if (msh_trace_load_profiler_mem(buf, size, &s, err, sizeof err) == 0) {
        if (!s) abort();
        check_set(s);
        msh_trace_set_free(s);
    } else if (s || !err[0]) {
        abort(); /* an error must leave no set behind and must say why */
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size heap copy, so a read past the end is a report, not a silent hit on slack */
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    else buf[0] = 0;
    one(buf, size);
    if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) {
        unsigned char *in = NULL;
        size_t inlen = 0;
        char err[512];
        err[0] = 0;
        if (msh_trace_gunzip(data, size, &in, &inlen, err, sizeof err) == 0) {
            if (!in || in[inlen] != 0) abort();
            one((const char *)in, inlen);
            free(in);
        } else if (in || !err[0]) {
            abort();
        }
    }
    free(buf);
    return 0;
}
