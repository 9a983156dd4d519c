/*
 * fuzz_drvcost.c: libFuzzer target for the driver cost table reader (policy/drvcost.c,
 * `memshim-replay --driver-costs FILE`). The input is the file's content. A table that is read
 * must hold only finite, non-negative times; written back with msh_drvcost_write() it must read
 * back to the same values (to the writer's six significant digits). A refusal must leave the
 * table untouched and say why. Build and run: tests/fuzz/run_fuzz.sh fuzz_drvcost. It keeps no
 * state between inputs.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drvcost.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct msh_drvcost t, back;
    memset(&t, 0x5a, sizeof t);
    struct msh_drvcost before = t;
    char err[512];
    int rc = msh_drvcost_parse((const char *)data, size, "fuzz", &t, err, sizeof err);
    if (rc) {
        if (memcmp(&t, &before, sizeof t) || !err[0] || strncmp(err, "fuzz", 4)) abort();
        return 0;
    }
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        if (!isfinite(t.per_call_s[k]) || !isfinite(t.per_mib_s[k]) || !isfinite(t.per_mapping_s[k]) ||
            t.per_call_s[k] < 0 || t.per_mib_s[k] < 0 || t.per_mapping_s[k] < 0)
            abort();
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return 0;
    msh_drvcost_write(f, &t);
    fclose(f);
    if (msh_drvcost_parse(buf, len, "written", &back, err, sizeof err)) abort();
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        if (fabs(back.per_call_s[k] - t.per_call_s[k]) > 1e-5 * t.per_call_s[k] + 1e-300 ||
            fabs(back.per_mib_s[k] - t.per_mib_s[k]) > 1e-5 * t.per_mib_s[k] + 1e-300 ||
            fabs(back.per_mapping_s[k] - t.per_mapping_s[k]) > 1e-5 * t.per_mapping_s[k] + 1e-300)
            abort();
    free(buf);
    return 0;
}
