/*
 * ptsz.c: the per-thread-default-stream (_ptsz) entry points that programs built with
 * --default-stream per-thread call are exported by memshim and behave like their plain twins:
 * stream-ordered runtime and driver allocation pass through (accounted), a pool pointer freed
 * with cudaFreeAsync_ptsz goes back to the pool, and the _ptsz lookups substitute.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

cudaError_t cudaMallocAsync_ptsz(void **, size_t, cudaStream_t);
cudaError_t cudaFreeAsync_ptsz(void *, cudaStream_t);
cudaError_t cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long,
                                         enum cudaDriverEntryPointQueryResult *);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);

static int in_memshim(const char *sym)
{
    Dl_info di;
    void *p = dlsym(RTLD_DEFAULT, sym);
    return p && dladdr(p, &di) && di.dli_fname && strstr(di.dli_fname, "libmemshim");
}

TEST(ptsz_symbols_are_memshims)
{
    static const char *const syms[] = {
        "cudaMallocAsync_ptsz", "cudaFreeAsync_ptsz", "cudaGetDriverEntryPoint_ptsz",
        "cudaGetDriverEntryPointByVersion_ptsz", "cuMemAllocAsync_ptsz", "cuMemFreeAsync_ptsz"};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) CHECKF(in_memshim(syms[i]), "%s", syms[i]);
}

TEST(runtime_async_ptsz_passes_through)
{
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    void *p = NULL;
    REQUIRE(cudaMallocAsync_ptsz(&p, 1 << 20, 0) == cudaSuccess);
    REQUIRE(p != NULL);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs + 1);
    CHECK(cudaFreeAsync_ptsz(p, 0) == cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs);
}

TEST(driver_async_ptsz_passes_through)
{
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    CUdeviceptr d = 0;
    REQUIRE(cuMemAllocAsync_ptsz(&d, 1 << 20, 0) == CUDA_SUCCESS);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs + 1);
    CHECK(cuMemFreeAsync_ptsz(d, 0) == CUDA_SUCCESS);
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS);
    cudbl_get_counts(&c1);
    CHECK(c1.allocs == c0.allocs);
}

TEST(pool_pointer_freed_async_ptsz_returns_to_pool)
{
    int (*stats)(int, struct memshim_stats *) =
        (int (*)(int, struct memshim_stats *))dlsym(RTLD_DEFAULT, "memshim_get_stats");
    REQUIRE(stats != NULL);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 1 << 16) == cudaSuccess);
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    uint64_t frees0 = st.frees;
    CHECK(cudaFreeAsync_ptsz(p, 0) == cudaSuccess);
    REQUIRE(stats(0, &st) == 0);
    CHECK(st.frees == frees0 + 1);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

TEST(entry_point_ptsz_substitutes)
{
    void *fn = NULL;
    CHECK(cudaGetDriverEntryPoint_ptsz("cuMemCreate", &fn, cudaEnableDefault, NULL) == cudaSuccess);
    CHECK(fn == dlsym(RTLD_DEFAULT, "cuMemCreate"));
    fn = NULL;
    CHECK(cudaGetDriverEntryPoint_ptsz("cuMemFreeAsync", &fn, cudaEnablePerThreadDefaultStream, NULL) ==
          cudaSuccess);
    CHECK(fn == dlsym(RTLD_DEFAULT, "cuMemFreeAsync_ptsz"));
}

TEST_MAIN()
