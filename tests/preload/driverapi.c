/*
 * driverapi.c: driver-level allocations that memshim passes through (cuMemAlloc_v2,
 * cuMemAllocAsync, cuMemCreate by another library) work unchanged and are accounted as memory
 * "not served by memshim" in the epoch report, and their frees take the accounting back.
 * run_preload.sh runs it with MEMSHIM_REPORT_DIR set to an empty directory.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

/* Read `key` (an integer) from this process's newest epoch report of device 0; -1 if none. */
static long long report_value(const char *key)
{
    const char *dir = getenv("MEMSHIM_REPORT_DIR");
    if (!dir) return -1;
    void (*epoch)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memshim_epoch");
    if (!epoch) return -1;
    epoch();
    char pidpart[64], best[512] = "";
    snprintf(pidpart, sizeof pidpart, "-pid%d-dev0-epoch", (int)getpid());
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, pidpart) && strstr(e->d_name, ".json") && strcmp(e->d_name, best) > 0)
            snprintf(best, sizeof best, "%s", e->d_name);
    closedir(d);
    if (!best[0]) return -1;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, best);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char pat[128];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    char *p = strstr(buf, pat);
    if (!p) return -1;
    p += strlen(pat);
    while (*p == ' ' || *p == ':' || *p == '\t' || *p == '\n') p++;
    return strtoll(p, NULL, 10);
}

static int reports_on(void)
{
    return getenv("MEMSHIM_REPORT_DIR") && dlopen("libjansson.so.4", RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL) != NULL;
}

TEST(setup_pool)
{
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 4096) == cudaSuccess); /* the pool exists, so device 0 is reported */
    CHECK(cudaFree(p) == cudaSuccess);
}

TEST(cuMemAlloc_v2_passes_through_and_is_accounted)
{
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    CUdeviceptr d = 0;
    size_t sz = (size_t)3 << 20;
    REQUIRE(cuMemAlloc(&d, sz) == CUDA_SUCCESS);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs + 1); /* served by the driver, not by the pool */
    memset((void *)(uintptr_t)d, 0xa5, sz);
    CHECK(((unsigned char *)(uintptr_t)d)[sz - 1] == 0xa5);
    if (!reports_on()) {
        CHECK(cuMemFree(d) == CUDA_SUCCESS);
        SKIP("no reports (jansson missing or MEMSHIM_REPORT_DIR unset): accounting not checked");
    }
    long long v = report_value("cuda_malloc_passthrough_bytes");
    CHECKF(v == (long long)sz, "passthrough bytes %lld, want %zu", v, sz);
    CHECK(cuMemFree(d) == CUDA_SUCCESS);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs);
    v = report_value("cuda_malloc_passthrough_bytes");
    CHECKF(v == 0, "passthrough bytes after free %lld", v);
    CHECK(cuMemFree(d) != CUDA_SUCCESS); /* double free: the driver's answer */
}

TEST(cuMemAllocAsync_is_accounted)
{
    if (!reports_on()) SKIP("no reports");
    CUdeviceptr d = 0;
    REQUIRE(cuMemAllocAsync(&d, 1 << 20, 0) == CUDA_SUCCESS);
    long long v = report_value("async_pool_bytes");
    CHECKF(v == 1 << 20, "async bytes %lld", v);
    CHECK(cuMemFreeAsync(d, 0) == CUDA_SUCCESS);
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS);
    v = report_value("async_pool_bytes");
    CHECKF(v == 0, "async bytes after free %lld", v);
}

TEST(vmm_handles_of_others_are_accounted)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    REQUIRE(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);
    CUmemGenericAllocationHandle h = 0;
    REQUIRE(cuMemCreate(&h, 2 * gran, &prop, 0) == CUDA_SUCCESS);
    CUdeviceptr va = 0;
    REQUIRE(cuMemAddressReserve(&va, 2 * gran, 0, 0, 0) == CUDA_SUCCESS);
    CHECK(cuMemMap(va, 2 * gran, 0, h, 0) == CUDA_SUCCESS);
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cuMemSetAccess(va, 2 * gran, &acc, 1) == CUDA_SUCCESS);
    memset((void *)(uintptr_t)va, 1, 2 * gran);
    if (reports_on()) {
        long long v = report_value("vmm_by_others_bytes");
        CHECKF(v == (long long)(2 * gran), "vmm bytes %lld", v);
    }
    CHECK(cuMemUnmap(va, 2 * gran) == CUDA_SUCCESS);
    CHECK(cuMemRelease(h) == CUDA_SUCCESS);
    CHECK(cuMemAddressFree(va, 2 * gran) == CUDA_SUCCESS);
    if (reports_on()) {
        long long v = report_value("vmm_by_others_bytes");
        CHECKF(v == 0, "vmm bytes after release %lld", v);
    }
}

TEST_MAIN()
