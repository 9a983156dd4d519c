/*
 * meminfo_limit.c: with MEMSHIM_LIMIT set, cudaMemGetInfo and cuMemGetInfo_v2 report the limit
 * as total and the limit minus the pool's live bytes as free, once the pool serves the device;
 * before that they report the driver's values. run_preload.sh runs it with MEMSHIM_LIMIT and
 * EXPECT_TOTAL_MIB (the total the limit should produce on the double's device 0).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdlib.h>

#include "harness.h"

typedef CUresult (*meminfo_fn)(size_t *, size_t *);

/* The double's own cuMemGetInfo_v2, bypassing memshim. */
static meminfo_fn real_meminfo(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? (meminfo_fn)dlsym(h, "cuMemGetInfo_v2") : NULL;
}

TEST(before_any_pool_values_are_real)
{
    meminfo_fn real = real_meminfo();
    REQUIRE(real != NULL);
    REQUIRE(cudaFree(NULL) == cudaSuccess); /* context, but no allocation yet */
    size_t f = 0, t = 0, rf = 0, rt = 0;
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    REQUIRE(real(&rf, &rt) == CUDA_SUCCESS);
    CHECKF(t == rt, "total %zu, driver says %zu", t, rt);
}

TEST(limit_applies_once_the_pool_serves)
{
    const char *e = getenv("EXPECT_TOTAL_MIB");
    if (!e) SKIP("EXPECT_TOTAL_MIB not set (run through run_preload.sh)");
    size_t expect = (size_t)strtoull(e, NULL, 10) << 20;
    void *p = NULL;
    size_t live = (size_t)64 << 20;
    REQUIRE(cudaMalloc(&p, live) == cudaSuccess);
    size_t f = 0, t = 0;
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    CHECKF(t == expect, "total %zu, expected %zu", t, expect);
    CHECKF(f == expect - live, "free %zu, expected %zu", f, expect - live);
    size_t f2 = 0, t2 = 0;
    REQUIRE(cuMemGetInfo(&f2, &t2) == CUDA_SUCCESS);
    CHECK(t2 == t && f2 == f);
    CHECK(cudaFree(p) == cudaSuccess);
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    CHECKF(f == expect, "free after cudaFree %zu, expected %zu", f, expect);
    CHECK(cudaMemGetInfo(NULL, &t) != cudaSuccess || 1); /* must not crash */
}

TEST_MAIN()
