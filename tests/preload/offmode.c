/*
 * offmode.c: with MEMSHIM_MODE=off the preloaded library is exact pass-through: no pool is ever
 * created, runtime and driver allocations come from the driver itself, and the results are the
 * driver's. (lookups.c checks, in the same mode, that every lookup is untouched.)
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

typedef int (*stats_fn)(int, struct memshim_stats *);

TEST(cudamalloc_comes_from_the_driver)
{
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 1 << 20) == cudaSuccess);
    cudbl_get_counts(&c1);
    CHECKF(c1.allocs == c0.allocs + 1, "allocs %ld -> %ld", c0.allocs, c1.allocs);
    memset(p, 3, 1 << 20);
    stats_fn stats = (stats_fn)dlsym(RTLD_DEFAULT, "memshim_get_stats");
    REQUIRE(stats != NULL);
    struct memshim_stats st;
    CHECK(stats(0, &st) == ENODEV);
    CHECK(cudaFree(p) == cudaSuccess);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs);
    CHECK(c1.handles == 0 && c1.mappings == 0); /* no VMM pool behind anything */
}

TEST(driver_and_runtime_answers_are_the_drivers)
{
    CUdeviceptr d = 0;
    CHECK(cuMemAlloc(&d, 8192) == CUDA_SUCCESS);
    CHECK(cuMemFree(d) == CUDA_SUCCESS);
    CHECK(cuMemFree(d) != CUDA_SUCCESS);
    CHECK(cudaMalloc(NULL, 16) != cudaSuccess);
    CHECK(cudaFree(NULL) == cudaSuccess);
    size_t f = 0, t = 0, rf = 0, rt = 0;
    CHECK(cudaMemGetInfo(&f, &t) == cudaSuccess);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    CUresult (*real)(size_t *, size_t *) = h ? (CUresult(*)(size_t *, size_t *))dlsym(h, "cuMemGetInfo_v2") : NULL;
    REQUIRE(real != NULL);
    CHECK(real(&rf, &rt) == CUDA_SUCCESS);
    CHECK(t == rt);
    stats_fn stats = (stats_fn)dlsym(RTLD_DEFAULT, "memshim_get_stats");
    struct memshim_stats st;
    CHECK(stats && stats(0, &st) == ENODEV);
}

TEST_MAIN()
