/*
 * fuzz_text.c: libFuzzer entry point for memshim's text trace reader (textfmt.c): any bytes go
 * through msh_trace_load_text_mem; what loads is written back out with msh_trace_write_text and
 * must load again with the same events. Built only by hand with clang -fsanitize=fuzzer (see
 * docs/trace-format.md); never part of libmemshim_trace.a, and it must never keep state between
 * inputs.
 */
#include "trace.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    struct msh_trace_set *s = NULL;
    char err[256];
    if (msh_trace_load_text_mem(buf, size, &s, err, sizeof err) == 0) {
        char *out = NULL;
        size_t outlen = 0;
        FILE *f = open_memstream(&out, &outlen);
        if (f) {
            int rc = msh_trace_write_text(f, s);
            fclose(f);
            struct msh_trace_set *back = NULL;
            if (rc == 0 && msh_trace_load_text_mem(out, outlen, &back, err, sizeof err) != 0) abort();
            if (back) {
                if (back->ndev != s->ndev) abort();
                for (size_t d = 0; d < s->ndev; d++) {
                    if (back->dev[d].n != s->dev[d].n || back->dev[d].warnings != 0 ||
                        back->dev[d].peak_live_bytes != s->dev[d].peak_live_bytes)
                        abort();
                    for (size_t i = 0; i < s->dev[d].n; i++)
                        if (back->dev[d].ev[i].addr != s->dev[d].ev[i].addr ||
                            back->dev[d].ev[i].size != s->dev[d].ev[i].size ||
                            back->dev[d].ev[i].op != s->dev[d].ev[i].op ||
                            back->dev[d].ev[i].prefix != s->dev[d].ev[i].prefix)
                            abort();
                }
            }
            msh_trace_set_free(back);
            free(out);
        }
        msh_trace_set_free(s);
    } else if (s || !err[0]) {
        abort();
    }
    free(buf);
    return 0;
}
