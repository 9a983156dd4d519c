/*
 * sync_ledger.c: memshim_overhead.synchronizes against the driver double's own counts (issue 31,
 * item 4). The program never synchronizes itself, so every cuCtxSynchronize, cuStreamSynchronize
 * and cuEventSynchronize the double receives while it runs is memshim's, whichever road it took:
 * the driver straight (the pool, cuMemFree's hook) or the runtime (cudaFree of pool memory keeps
 * the runtime's guarantee with cudaDeviceSynchronize, which the runtime turns into a
 * cuCtxSynchronize). 50 cudaMalloc/cudaFree pairs and 10 blocks freed with cuMemFree, then one
 * epoch report (covering the run so far): its synchronizes must be the double's counts, each kind
 * timed. Run twice by run_preload.sh: segment mode (plain preloading) and tensor mode
 * (TENSOR_MODE=1: one memshim_malloc first, as PyTorch's pluggable allocator would make it).
 * Needs MEMSHIM_REPORT_DIR (an empty directory) and MEMSHIM_REPORT_FORMAT=json.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)

/* The text of the newest epoch report in dir (malloc'ed), or NULL. */
static char *read_epoch_report(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return NULL;
    char best[512] = "";
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, "-epoch") && strstr(e->d_name, ".json") && strcmp(e->d_name, best) > 0)
            snprintf(best, sizeof best, "%s", e->d_name);
    closedir(d);
    if (!best[0]) return NULL;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, best);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (buf) buf[n] = 0;
    return buf;
}

/* {"count": N, "seconds": S} of `key` inside the object that follows `section` in json. */
static int find_cs(const char *json, const char *section, const char *key, long *count, double *seconds)
{
    const char *s = strstr(json, section);
    if (!s) return -1;
    char k[64];
    snprintf(k, sizeof k, "\"%s\"", key);
    const char *p = strstr(s, k); /* the section's own member: the keys come after it */
    if (!p) return -1;
    const char *c = strstr(p, "\"count\":"), *t = strstr(p, "\"seconds\":");
    if (!c || !t) return -1;
    *count = strtol(c + 8, NULL, 10);
    *seconds = strtod(t + 10, NULL);
    return 0;
}

TEST(memshim_overhead_synchronizes_are_the_doubles_counts)
{
    const char *dir = getenv("MEMSHIM_REPORT_DIR");
    REQUIRE(dir && *dir);
    void (*epoch)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memshim_epoch");
    REQUIRE(epoch);
    int tensor = getenv("TENSOR_MODE") != NULL;
    if (tensor) {
        void *(*ms_malloc)(ssize_t, int, void *) = (void *(*)(ssize_t, int, void *))dlsym(RTLD_DEFAULT, "memshim_malloc");
        void (*ms_free)(void *, ssize_t, int, void *) = (void (*)(void *, ssize_t, int, void *))dlsym(RTLD_DEFAULT, "memshim_free");
        REQUIRE(ms_malloc && ms_free);
        void *t = ms_malloc(4096, 0, NULL);
        REQUIRE(t);
        ms_free(t, 4096, 0, NULL);
    }
    for (int i = 0; i < 50; i++) {
        void *p = NULL;
        REQUIRE(cudaMalloc(&p, (size_t)(1 + i % 5) * MiB) == cudaSuccess);
        REQUIRE(cudaFree(p) == cudaSuccess);
    }
    for (int i = 0; i < 10; i++) { /* pool blocks given back through the driver's entry point */
        void *p = NULL;
        REQUIRE(cudaMalloc(&p, 3 * MiB) == cudaSuccess);
        REQUIRE(cuMemFree((CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS);
    }
    epoch();
    long ctx = cudbl_call_count("cuCtxSynchronize"), st = cudbl_call_count("cuStreamSynchronize"),
         ev = cudbl_call_count("cuEventSynchronize");
    char *json = read_epoch_report(dir);
    REQUIRE(json);
    long n[4] = {-1, -1, -1, -1};
    double s[4] = {0, 0, 0, 0};
    static const char *const kinds[4] = {"device", "context", "stream", "event"};
    for (int k = 0; k < 4; k++)
        CHECKF(find_cs(json, "\"synchronizes\"", kinds[k], &n[k], &s[k]) == 0, "no synchronizes.%s", kinds[k]);
    printf("    %s mode: the double received %ld cuCtxSynchronize, %ld cuStreamSynchronize, %ld cuEventSynchronize; "
           "memshim_overhead.synchronizes: device %ld (%.3f ms), context %ld (%.3f ms), stream %ld, event %ld\n",
           tensor ? "tensor" : "segment", ctx, st, ev, n[0], s[0] * 1e3, n[1], s[1] * 1e3, n[2], n[3]);
    /* a runtime device synchronize reaches the driver as one context synchronize */
    CHECKF(n[0] + n[1] == ctx, "device %ld + context %ld synchronizes, the double received %ld", n[0], n[1], ctx);
    CHECKF(n[2] == st, "stream %ld, the double received %ld", n[2], st);
    CHECKF(n[3] == ev, "event %ld, the double received %ld", n[3], ev);
    /* not a vacuous match: each cudaFree of pool memory synchronized the device, each cuMemFree
     * the block's context; and each kind that was called was timed */
    CHECKF(n[0] == 50, "%ld device synchronizes for 50 cudaFree calls", n[0]);
    CHECKF(n[1] >= 10, "%ld context synchronizes for 10 cuMemFree calls", n[1]);
    for (int k = 0; k < 4; k++)
        CHECKF(!n[k] || s[k] > 0, "%ld %s synchronizes and no time", n[k], kinds[k]);
    /* the device kind is a function of the ledger like the others: in driver_calls too */
    long dc = -1;
    double ds = 0;
    CHECKF(find_cs(json, "\"driver_calls\"", "cudaDeviceSynchronize", &dc, &ds) == 0 && dc == n[0],
           "driver_calls.cudaDeviceSynchronize %ld, synchronizes.device %ld", dc, n[0]);
    free(json);
}

TEST_MAIN()
