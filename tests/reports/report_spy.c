/*
 * report_spy.c: libreport-spy.so, the ground-truth side of tests/reports/test_report_truth.py.
 * Preloaded next to libmemshim.so over the driver double, it wraps rename(): memshim writes every
 * report to a temp file and renames it into place, so right after a report named memshim-*.json
 * appears it reads the DOUBLE's own figures (cudbl_get_bytes, cudbl_get_counts, call counts and the
 * bytes they covered, access grants) and
 * appends one line "NAME key=value ..." to $REPORT_SPY_LOG. An epoch report also starts a new
 * peak window, so *_mark_peak is the driver's own peak over exactly that epoch; OOM and summary
 * reports leave the window alone. memshim's figures in a report can then be held against what
 * the driver saw at the same moment, computed by code that shares nothing with memshim.
 * It must never change what rename() or the program does.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudbl.h"

static const char *const calls[] = {"cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
                                    "cuStreamWaitEvent", "cuEventRecord", "cuCtxSynchronize", "cuMemAddressReserve",
                                    "cuMemAddressFree", "cuMemAlloc", "cuMemFree", "cuEventQuery",
                                    "cuStreamSynchronize", "cuEventSynchronize", "cuMemGetInfo"};

struct mapbuf { char *s; size_t n, cap; };

/* One "va:size" entry per mapping, comma separated, into a growing buffer (called under the
 * double's lock: plain memory work only). */
static void add_mapping(void *arg, CUdeviceptr va, size_t size)
{
    struct mapbuf *b = arg;
    if (!b->s) return;
    if (b->cap - b->n < 64) {
        char *s = realloc(b->s, b->cap * 2);
        if (!s) { free(b->s); b->s = NULL; return; }
        b->s = s;
        b->cap *= 2;
    }
    b->n += (size_t)snprintf(b->s + b->n, b->cap - b->n, "%s%llx:%zu", b->n ? "," : "", (unsigned long long)va, size);
}

static void record(const char *path)
{
    const char *log = getenv("REPORT_SPY_LOG");
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(base);
    if (!log || !*log || strncmp(base, "memshim-", 8) != 0 || n < 5 || strcmp(base + n - 5, ".json") != 0) return;
    struct cudbl_bytes b;
    struct cudbl_counts c;
    cudbl_get_bytes(&b, strstr(base, "-epoch") != NULL);
    cudbl_get_counts(&c);
    char line[4096];
    int k = snprintf(line, sizeof line,
                     "%s handle=%zu handle_mark_peak=%zu handle_peak=%zu mapped=%zu mapped_mark_peak=%zu "
                     "mapped_peak=%zu va=%zu bytes_in_use=%zu allocs=%ld handles=%ld mappings=%ld unmapped_total=%zu "
                     "released_total=%zu",
                     base, b.handle_bytes, b.handle_mark_peak, b.handle_peak, b.mapped_bytes, b.mapped_mark_peak,
                     b.mapped_peak, b.reserved_va_bytes, c.bytes_in_use, c.allocs, c.handles, c.mappings,
                     b.unmapped_total, b.released_total);
    for (size_t i = 0; i < sizeof calls / sizeof calls[0] && k > 0 && (size_t)k < sizeof line; i++)
        k += snprintf(line + k, sizeof line - (size_t)k, " calls_%s=%ld bytes_%s=%lld", calls[i],
                      cudbl_call_count(calls[i]), calls[i], cudbl_call_bytes(calls[i]));
    /* the mappings cuMemSetAccess granted device 0 (what the cost model prices per mapping) */
    if (k > 0 && (size_t)k < sizeof line)
        k += snprintf(line + k, sizeof line - (size_t)k, " access_grants=%ld", cudbl_access_grants(0));
    if (k <= 0 || (size_t)k >= sizeof line - 1) return;
    /* the mappings held now (each one whole handle), so the test can tell a handle no live block
     * touches (the pool could give it back) from free pages inside a handle still in use */
    struct mapbuf mb = {malloc(4096), 0, 4096};
    cudbl_foreach_mapping(add_mapping, &mb);
    if (!mb.s) return;
    int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        /* one write per line: O_APPEND keeps lines whole */
        size_t total = (size_t)k + 6 + mb.n + 1;
        char *all = malloc(total + 1);
        if (all) {
            int m = snprintf(all, total + 1, "%.*s maps=%s\n", k, line, mb.n ? mb.s : "-");
            ssize_t w = write(fd, all, (size_t)m);
            (void)w;
            free(all);
        }
        close(fd);
    }
    free(mb.s);
}

int rename(const char *oldpath, const char *newpath)
{
    static int (*real)(const char *, const char *);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "rename");
    if (!real) return -1;
    int rc = real(oldpath, newpath);
    if (rc == 0) record(newpath);
    return rc;
}
