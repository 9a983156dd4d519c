/*
 * intercept.c: under LD_PRELOAD=libmemshim.so (segment mode), cudaMalloc is served by memshim's
 * pool, the memory is usable through the pointer and keeps its contents while other blocks come
 * and go, cudaFree returns it, and the runtime's edge cases (NULL, size 0, a pointer that is not
 * the start of a block) answer as the real runtime does. Run by run_preload.sh.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

typedef int (*stats_fn)(int, struct memshim_stats *);

static stats_fn get_stats(void)
{
    return (stats_fn)dlsym(RTLD_DEFAULT, "memshim_get_stats");
}

static void fill(void *p, size_t n, unsigned seed)
{
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 31u + seed);
}

static int check(const void *p, size_t n, unsigned seed)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)(i * 31u + seed)) return 0;
    return 1;
}

TEST(cudamalloc_is_served_by_the_pool)
{
    stats_fn stats = get_stats();
    REQUIRE(stats != NULL);
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 1 << 20) == cudaSuccess);
    REQUIRE(p != NULL);
    CHECK(((uintptr_t)p & 511) == 0);
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    CHECK(st.allocs >= 1);
    CHECK(st.live_bytes >= (size_t)1 << 20);
    cudbl_get_counts(&c1);
    CHECKF(c1.allocs == c0.allocs, "double's cuMemAlloc blocks went %ld -> %ld", c0.allocs, c1.allocs);
    CHECK(c1.handles > 0); /* the pool maps VMM handles */
    fill(p, 1 << 20, 7);
    CHECK(check(p, 1 << 20, 7));
    uint64_t frees0 = st.frees;
    CHECK(cudaFree(p) == cudaSuccess);
    REQUIRE(stats(0, &st) == 0);
    CHECK(st.frees == frees0 + 1);
}

TEST(data_survives_other_blocks)
{
    enum { N = 64 };
    void *keep = NULL, *tmp[N];
    REQUIRE(cudaMalloc(&keep, 3 << 20) == cudaSuccess);
    fill(keep, 3 << 20, 99);
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < N; i++) {
            size_t sz = (size_t)(i + 1) * 37 * 1024;
            tmp[i] = NULL;
            CHECK(cudaMalloc(&tmp[i], sz) == cudaSuccess);
            if (tmp[i]) fill(tmp[i], sz, (unsigned)i);
        }
        for (int i = 0; i < N; i++) {
            size_t sz = (size_t)(i + 1) * 37 * 1024;
            if (tmp[i]) CHECK(check(tmp[i], sz, (unsigned)i));
            if (i % 2 == round % 2 || round == 3) CHECK(cudaFree(tmp[i]) == cudaSuccess);
        }
        for (int i = 0; i < N; i++)
            if (!(i % 2 == round % 2 || round == 3)) CHECK(cudaFree(tmp[i]) == cudaSuccess);
    }
    CHECK(check(keep, 3 << 20, 99));
    CHECK(cudaFree(keep) == cudaSuccess);
}

TEST(runtime_edge_cases)
{
    CHECK(cudaFree(NULL) == cudaSuccess);
    CHECK(cudaMalloc(NULL, 4096) != cudaSuccess);
    void *p = (void *)0x1;
    CHECK(cudaMalloc(&p, 0) == cudaSuccess);
    CHECK(p == NULL);
    void *q = NULL;
    REQUIRE(cudaMalloc(&q, 8192) == cudaSuccess);
    CHECK(cudaFree((char *)q + 512) != cudaSuccess); /* not the start of a block */
    CHECK(cudaFree(q) == cudaSuccess);
}

TEST(free_of_pool_pointer_through_driver_api)
{
    stats_fn stats = get_stats();
    REQUIRE(stats != NULL);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 65536) == cudaSuccess);
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    uint64_t frees0 = st.frees;
    CHECK(cuMemFree((CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS);
    REQUIRE(stats(0, &st) == 0);
    CHECK(st.frees == frees0 + 1);
}

TEST(meminfo_is_sane)
{
    size_t f = 0, t = 0;
    CHECK(cudaMemGetInfo(&f, &t) == cudaSuccess);
    CHECK(t > 0 && f <= t);
    size_t f2 = 0, t2 = 0;
    CHECK(cuMemGetInfo(&f2, &t2) == CUDA_SUCCESS);
    CHECK(t2 == t);
}

TEST_MAIN()
