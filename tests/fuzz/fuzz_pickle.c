/*
 * fuzz_pickle.c: libFuzzer entry point for the PyTorch snapshot reader (pickle.c + snapshot.c):
 * any bytes go through msh_trace_load_snapshot_mem and back out through msh_trace_set_free.
 * Built only by hand with clang -fsanitize=fuzzer (see docs/trace-format.md); never part of
 * libmemshim_trace.a, and it must never keep state between inputs.
 */
#include "trace.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size heap copy, so a read past the end is a report, not a silent hit on slack */
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    struct msh_trace_set *s = NULL;
    char err[256];
    if (msh_trace_load_snapshot_mem(buf, size, &s, err, sizeof err) == 0) {
        for (size_t d = 0; d < s->ndev; d++) msh_trace_analyze(&s->dev[d]);
        msh_trace_set_free(s);
    } else if (s || !err[0]) {
        abort(); /* an error must leave no set behind and must say why */
    }
    free(buf);
    return 0;
}
