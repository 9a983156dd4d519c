/*
 * drvcost.c: the driver cost table that turns counted driver calls into modelled seconds
 * (drvcost.h), its defaults and the reader of `memshim-replay --driver-costs FILE`.
 *
 * The defaults are fitted to the H200's measured VMM calls (the GPU check of 2026-12-04, DESIGN.md
 * section 10; scripts/fit_drvcost.py prints the fit and its residuals, docs/benchmarks.md "Driver
 * cost table" has both and the source of every other row). A model is only as good as its table:
 * every figure computed from it is labelled "modelled", and `memshim-replay --device` times the
 * calls on the driver present so the table can be checked. This file never calls the driver and
 * never allocates on a hot path; the reader refuses a bad file with the file name and line, it
 * never guesses.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drvcost.h"

#define US 1e-6

/* [H] The H200 run of 2026-12-04 (NVIDIA H200, driver 580; tests/gpu/vmm_cost.c): p50 per call at
 * handles of 2 MiB, 64 MiB and 2 GiB, and cuMemSetAccess over 8 mappings at once. Fitted by
 * least squares of the relative residuals, terms >= 0 (scripts/fit_drvcost.py): per call, per
 * MiB the call covers, and for cuMemSetAccess per mapping the range covers (171 us over 8 mappings
 * of 2 MiB against 21 us over one: the grant costs per mapping, not per call). Each residual is
 * within 27% (docs/benchmarks.md). Reserve and address-free were measured as ranges over the
 * sizes (0.5-19 us, 0.4-5.5 us): the top of each is taken. */
#define CREATE_CALL (7.807 * US)
#define CREATE_MIB (0.04234 * US)
#define MAP_CALL (0.6616 * US)
#define MAP_MIB (0.00118 * US)
#define ACCESS_CALL (2.784 * US)
#define ACCESS_MIB (0.04994 * US)
#define ACCESS_MAPPING (21.27 * US)
#define UNMAP_CALL (15.98 * US)
#define UNMAP_MIB (0.01398 * US)
#define RELEASE_CALL (8.899 * US)
#define RELEASE_MIB (0.4966 * US)
#define RESERVE_CALL (19.0 * US)
#define UNRESERVE_CALL (5.5 * US)

/* cuMemGetInfo: p50 3.84 us over 300 calls on the H200 of 2026-12-06 (driver 580.159.04,
 * tests/gpu/vmm_cost.c's mem_info). Public figures through torch.cuda.mem_get_info, the runtime
 * and Python included, were 7.3-11.9 us on driver 580 ([M]); 9 us was taken until measured. */
#define MEM_INFO_CALL (3.84 * US)

/* Rows no H200 figure exists for yet (docs/benchmarks.md): [V] velox PR 6096: an event record
 * plus a stream wait between two streams, about 3 us on device (RTX 3080). [C] Cytnx PR 850: a
 * direct cudaFree of a small buffer on an idle device, 14 us (GTX 1660 SUPER / RTX 2080 Ti), the
 * implied synchronize included. cudaMalloc and cudaFree are modelled as the VMM steps they stand
 * for, host memory as device memory. */
static const struct msh_drvcost default_table = {
    .per_call_s = {
        [MSH_DRV_CREATE] = CREATE_CALL,
        [MSH_DRV_RELEASE] = RELEASE_CALL,
        [MSH_DRV_MAP] = MAP_CALL,
        [MSH_DRV_UNMAP] = UNMAP_CALL,
        [MSH_DRV_SET_ACCESS] = ACCESS_CALL,
        [MSH_DRV_EVENT_RECORD] = 1.5 * US,    /* [V] half of record + wait */
        [MSH_DRV_STREAM_WAIT] = 1.5 * US,     /* [V] half of record + wait */
        [MSH_DRV_SYNCHRONIZE] = 10.0 * US,    /* idle device; bounded by [C]'s 14 us cudaFree */
        /* reserve + create + map + one mapping's access grant */
        [MSH_DRV_MALLOC] = RESERVE_CALL + CREATE_CALL + MAP_CALL + ACCESS_CALL + ACCESS_MAPPING,
        [MSH_DRV_FREE] = UNMAP_CALL + RELEASE_CALL + UNRESERVE_CALL, /* unmap + release + unreserve */
        [MSH_DRV_RESERVE] = RESERVE_CALL,
        [MSH_DRV_UNRESERVE] = UNRESERVE_CALL,
        [MSH_DRV_HOST_CREATE] = CREATE_CALL,  /* none measured for host memory: taken equal to create */
        [MSH_DRV_COPY_D2H] = 10.0 * US,       /* a synchronous copy's fixed cost: taken as a synchronize */
        [MSH_DRV_COPY_H2D] = 10.0 * US,
        [MSH_DRV_MEM_INFO] = MEM_INFO_CALL,   /* H200, 2026-12-06 */
    },
    /* Spill copies over PCIe Gen5 x16 (the H100/H200 PCIe link): device to host 52.8 GB/s [N24],
     * host to device 57.0 GB/s [N6] (measured, nvbandwidth). Grace Hopper's NVLink-C2C instead:
     * msh_drvcost_link(MSH_LINK_C2C). Sources: docs/benchmarks.md, "Driver cost table". */
    .per_mib_s = {
        [MSH_DRV_CREATE] = CREATE_MIB,
        [MSH_DRV_RELEASE] = RELEASE_MIB,
        [MSH_DRV_MAP] = MAP_MIB,
        [MSH_DRV_UNMAP] = UNMAP_MIB,
        [MSH_DRV_SET_ACCESS] = ACCESS_MIB,
        [MSH_DRV_MALLOC] = CREATE_MIB + MAP_MIB + ACCESS_MIB,
        [MSH_DRV_FREE] = UNMAP_MIB + RELEASE_MIB,
        [MSH_DRV_HOST_CREATE] = CREATE_MIB,
        [MSH_DRV_COPY_D2H] = 1048576.0 / 52.8e9,
        [MSH_DRV_COPY_H2D] = 1048576.0 / 57.0e9,
    },
    .per_mapping_s = {
        [MSH_DRV_SET_ACCESS] = ACCESS_MAPPING,
    },
};

void msh_drvcost_link(struct msh_drvcost *t, int link)
{
    if (link == MSH_LINK_C2C) { /* GH200 bandwidthTest, pinned 32 MB: D2H 291.6, H2D 335.3 GB/s [G] */
        t->per_mib_s[MSH_DRV_COPY_D2H] = 1048576.0 / 291.6e9;
        t->per_mib_s[MSH_DRV_COPY_H2D] = 1048576.0 / 335.3e9;
    } else {
        t->per_mib_s[MSH_DRV_COPY_D2H] = 1048576.0 / 52.8e9;
        t->per_mib_s[MSH_DRV_COPY_H2D] = 1048576.0 / 57.0e9;
    }
}

const struct msh_drvcost *msh_drvcost_default(void) { return &default_table; }

int msh_drvcost_kind(const char *name, enum msh_drv_call *k)
{
    for (int i = 0; i < MSH_DRV_NKINDS; i++)
        if (name && !strcmp(name, msh_drv_call_names[i])) {
            *k = (enum msh_drv_call)i;
            return 0;
        }
    return EINVAL;
}

double msh_drvcost_seconds(const struct msh_drvcost *c, const uint64_t calls[MSH_DRV_NKINDS],
                           const uint64_t bytes[MSH_DRV_NKINDS], const uint64_t maps[MSH_DRV_NKINDS])
{
    double s = 0;
    for (int i = 0; i < MSH_DRV_NKINDS; i++) {
        s += (double)calls[i] * c->per_call_s[i];
        if (bytes) s += (double)bytes[i] / (1024.0 * 1024.0) * c->per_mib_s[i];
        s += (double)(maps ? maps[i] : calls[i]) * c->per_mapping_s[i];
    }
    return s;
}

double msh_drvcost_call(const struct msh_drvcost *c, enum msh_drv_call k, double mib, double maps)
{
    return c->per_call_s[k] + mib * c->per_mib_s[k] + maps * c->per_mapping_s[k];
}

/* A time: a number, then nothing or one of s, ms, us, ns. */
static int parse_time(const char *tok, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(tok, &end);
    if (end == tok || errno == ERANGE || !isfinite(v)) return EINVAL;
    double scale = 1;
    if (!strcmp(end, "") || !strcmp(end, "s")) scale = 1;
    else if (!strcmp(end, "ms")) scale = 1e-3;
    else if (!strcmp(end, "us")) scale = 1e-6;
    else if (!strcmp(end, "ns")) scale = 1e-9;
    else return EINVAL;
    *out = v * scale;
    return 0;
}

static int fail(char *err, size_t errlen, const char *name, size_t line, const char *fmt, const char *arg)
{
    if (err && errlen) {
        char why[256];
        snprintf(why, sizeof why, fmt, arg ? arg : "");
        if (line) snprintf(err, errlen, "%s:%zu: %s", name, line, why);
        else snprintf(err, errlen, "%s: %s", name, why);
    }
    return EINVAL;
}

int msh_drvcost_parse(const char *text, size_t len, const char *name, struct msh_drvcost *out, char *err,
                      size_t errlen)
{
    if (err && errlen) err[0] = 0;
    if (!name) name = "driver costs";
    struct msh_drvcost t = default_table;
    bool seen[MSH_DRV_NKINDS] = {false};
    size_t entries = 0, lineno = 0, pos = 0;
    char buf[512];
    while (pos < len) {
        size_t eol = pos;
        while (eol < len && text[eol] != '\n') eol++;
        lineno++;
        size_t n = eol - pos;
        if (n >= sizeof buf) return fail(err, errlen, name, lineno, "line longer than %s511 bytes", "");
        memcpy(buf, text + pos, n);
        buf[n] = 0;
        pos = eol + 1;
        if (memchr(buf, 0, n)) return fail(err, errlen, name, lineno, "a NUL byte%s", "");
        char *hash = strchr(buf, '#');
        if (hash) *hash = 0;
        char *tok[4];
        int nt = 0;
        char *save = NULL;
        for (char *w = strtok_r(buf, " \t\r\v\f", &save); w; w = strtok_r(NULL, " \t\r\v\f", &save)) {
            if (nt == 4) return fail(err, errlen, name, lineno, "too many fields after '%s' (expected KIND PER_CALL [PER_MIB [PER_MAPPING]])", tok[3]);
            tok[nt++] = w;
        }
        if (!nt) continue;
        enum msh_drv_call k;
        if (msh_drvcost_kind(tok[0], &k)) {
            char known[256] = "";
            for (int i = 0; i < MSH_DRV_NKINDS; i++) {
                strncat(known, i ? ", " : "", sizeof known - strlen(known) - 1);
                strncat(known, msh_drv_call_names[i], sizeof known - strlen(known) - 1);
            }
            char why[320];
            snprintf(why, sizeof why, "unknown call kind '%.40s' (known: %s)", tok[0], known);
            return fail(err, errlen, name, lineno, "%s", why);
        }
        if (seen[k]) return fail(err, errlen, name, lineno, "'%s' is given twice", tok[0]);
        if (nt < 2) return fail(err, errlen, name, lineno, "'%s' has no time per call (expected KIND PER_CALL [PER_MIB [PER_MAPPING]])", tok[0]);
        double call = 0, mib = 0, mapping = 0;
        if (parse_time(tok[1], &call))
            return fail(err, errlen, name, lineno, "'%.60s' is not a time (e.g. 8us, 0.5ms, 2e-6)", tok[1]);
        if (nt >= 3 && parse_time(tok[2], &mib))
            return fail(err, errlen, name, lineno, "'%.60s' is not a time per MiB (e.g. 0.05us, 0)", tok[2]);
        if (nt == 4 && parse_time(tok[3], &mapping))
            return fail(err, errlen, name, lineno, "'%.60s' is not a time per mapping (e.g. 21us, 0)", tok[3]);
        if (call < 0 || mib < 0 || mapping < 0) return fail(err, errlen, name, lineno, "negative time for '%s'", tok[0]);
        if (call > 3600 || mib > 3600 || mapping > 3600)
            return fail(err, errlen, name, lineno, "more than an hour per call for '%s'", tok[0]);
        t.per_call_s[k] = call;
        t.per_mib_s[k] = mib;
        t.per_mapping_s[k] = mapping;
        seen[k] = true;
        entries++;
    }
    if (!entries) return fail(err, errlen, name, 0, "no cost lines (expected KIND PER_CALL [PER_MIB [PER_MAPPING]], e.g. 'create 8us')%s", "");
    *out = t;
    return 0;
}

int msh_drvcost_load(const char *path, struct msh_drvcost *out, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno ? errno : EIO;
        if (err && errlen) snprintf(err, errlen, "%s: cannot open: %s", path, strerror(e));
        return e;
    }
    enum { CAP = 1 << 20 };
    char *buf = malloc(CAP + 1);
    if (!buf) {
        fclose(f);
        if (err && errlen) snprintf(err, errlen, "%s: out of memory", path);
        return ENOMEM;
    }
    size_t n = fread(buf, 1, CAP + 1, f);
    int rerr = ferror(f);
    fclose(f);
    int rc;
    if (rerr) {
        if (err && errlen) snprintf(err, errlen, "%s: cannot read", path);
        rc = EIO;
    } else if (n > CAP) {
        if (err && errlen) snprintf(err, errlen, "%s: larger than 1 MiB: not a cost table", path);
        rc = EINVAL;
    } else {
        rc = msh_drvcost_parse(buf, n, path, out, err, errlen);
    }
    free(buf);
    return rc;
}

/* Shortest unit that keeps the figure readable; parse_time() reads every one back. */
static void fmt_time(char *b, size_t n, double s)
{
    if (s == 0) snprintf(b, n, "0");
    else if (s < 1e-6) snprintf(b, n, "%.9gns", s * 1e9);
    else if (s < 1e-3) snprintf(b, n, "%.9gus", s * 1e6);
    else if (s < 1) snprintf(b, n, "%.9gms", s * 1e3);
    else snprintf(b, n, "%.9gs", s);
}

void msh_drvcost_write(FILE *f, const struct msh_drvcost *c)
{
    fprintf(f, "# memshim driver cost table: KIND PER_CALL [PER_MIB [PER_MAPPING]] (memshim-replay --driver-costs)\n");
    for (int i = 0; i < MSH_DRV_NKINDS; i++) {
        char a[32], b[32], m[32];
        fmt_time(a, sizeof a, c->per_call_s[i]);
        fmt_time(b, sizeof b, c->per_mib_s[i]);
        fmt_time(m, sizeof m, c->per_mapping_s[i]);
        fprintf(f, "%-13s %-12s %-12s %s\n", msh_drv_call_names[i], a, b, m);
    }
}

const char *msh_drvcost_function(enum msh_drv_call k)
{
    static const char *const fn[MSH_DRV_NKINDS] = {
        [MSH_DRV_CREATE] = "cuMemCreate",
        [MSH_DRV_RELEASE] = "cuMemRelease",
        [MSH_DRV_MAP] = "cuMemMap",
        [MSH_DRV_UNMAP] = "cuMemUnmap",
        [MSH_DRV_SET_ACCESS] = "cuMemSetAccess",
        [MSH_DRV_EVENT_RECORD] = "cuEventRecord",
        [MSH_DRV_STREAM_WAIT] = "cuStreamWaitEvent",
        [MSH_DRV_SYNCHRONIZE] = "cuCtxSynchronize",
        [MSH_DRV_MALLOC] = "cudaMalloc",
        [MSH_DRV_FREE] = "cudaFree",
        [MSH_DRV_RESERVE] = "cuMemAddressReserve",
        [MSH_DRV_UNRESERVE] = "cuMemAddressFree",
        [MSH_DRV_HOST_CREATE] = "cuMemCreate (host memory)",
        [MSH_DRV_COPY_D2H] = "cuMemcpy (device to host)",
        [MSH_DRV_COPY_H2D] = "cuMemcpy (host to device)",
        [MSH_DRV_MEM_INFO] = "cuMemGetInfo",
    };
    return (unsigned)k < MSH_DRV_NKINDS ? fn[k] : "?";
}

void msh_drvcost_json(FILE *f, const struct msh_drvcost *c)
{
    fprintf(f, "{");
    for (int i = 0; i < MSH_DRV_NKINDS; i++)
        fprintf(f, "%s\n \"%s\": {\"kind\": \"%s\", \"per_call_us\": %.9g, \"per_mib_us\": %.9g, \"per_mapping_us\": %.9g}",
                i ? "," : "", msh_drvcost_function((enum msh_drv_call)i), msh_drv_call_names[i], c->per_call_s[i] * 1e6,
                c->per_mib_s[i] * 1e6, c->per_mapping_s[i] * 1e6);
    fprintf(f, "\n}\n");
}
