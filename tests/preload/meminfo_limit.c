/*
 * meminfo_limit.c: with MEMSHIM_LIMIT set, cudaMemGetInfo and cuMemGetInfo_v2 report the limit
 * as total and, once the pool serves the device, as free what one cudaMalloc of that size can
 * actually get (issue 8, item 6): whole pages, since the small and large areas never share a page;
 * a failed request leaves no page mapped that the answer does not count; and the answer comes
 * from counters, without scanning blocks. Before the pool exists they report the driver's values.
 * run_preload.sh runs it with MEMSHIM_LIMIT and EXPECT_TOTAL_MIB (the total the limit should
 * produce on the double's device 0), or with EXPECT_NO_LIMIT=1 for a limit at or above the device,
 * which is none (issue 31): both calls then give the driver's own figures.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

#include "harness.h"
#include "memshim.h"

#define MiB ((size_t)1 << 20)

typedef CUresult (*meminfo_fn)(size_t *, size_t *);

/* The double's own cuMemGetInfo_v2, bypassing memshim. */
static meminfo_fn real_meminfo(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? (meminfo_fn)dlsym(h, "cuMemGetInfo_v2") : NULL;
}

static size_t expected_total(void)
{
    const char *e = getenv("EXPECT_TOTAL_MIB");
    return e ? (size_t)strtoull(e, NULL, 10) << 20 : 0;
}

static size_t reserved(void)
{
    int (*stats)(int, struct memshim_stats *) =
        (int (*)(int, struct memshim_stats *))dlsym(RTLD_DEFAULT, "memshim_get_stats");
    struct memshim_stats st;
    return stats && stats(0, &st) == 0 ? st.reserved_bytes : (size_t)-1;
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
    size_t expect = expected_total();
    if (!expect) SKIP("EXPECT_TOTAL_MIB not set (run through run_preload.sh)");
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
    /* a NULL argument is the driver's error, passed on (and nothing crashes) */
    size_t t3 = 12345;
    CHECK(cudaMemGetInfo(NULL, &t3) == cudaErrorInvalidValue && t3 == 12345);
    CHECK(cuMemGetInfo(&f2, NULL) == CUDA_ERROR_INVALID_VALUE);
}

/* MEMSHIM_LIMIT at or above the device (100G, or 1: the whole device) is no limit: with the pool
 * serving, cudaMemGetInfo and cuMemGetInfo are the driver's own answer (before issue 31 such a
 * limit was the device itself, and put the pool in page mode). */
TEST(a_limit_at_or_above_the_device_is_none)
{
    if (!getenv("EXPECT_NO_LIMIT")) SKIP("EXPECT_NO_LIMIT not set (run through run_preload.sh)");
    meminfo_fn real = real_meminfo();
    void *(*ms_malloc)(ssize_t, int, memshim_stream_t) =
        (void *(*)(ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_malloc");
    void (*ms_free)(void *, ssize_t, int, memshim_stream_t) =
        (void (*)(void *, ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_free");
    REQUIRE(real && ms_malloc && ms_free);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 64 * MiB) == cudaSuccess);
    void *c = ms_malloc(32 * MiB, 0, NULL); /* freed, its pages stay cached: a limit would count them */
    REQUIRE(c);
    ms_free(c, 32 * MiB, 0, NULL);
    size_t f = 0, t = 0, f2 = 0, t2 = 0, rf = 0, rt = 0;
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    REQUIRE(cuMemGetInfo(&f2, &t2) == CUDA_SUCCESS);
    REQUIRE(real(&rf, &rt) == CUDA_SUCCESS);
    CHECKF(f == rf && t == rt && f2 == rf && t2 == rt, "memshim says %zu of %zu (%zu of %zu), the driver %zu of %zu", f, t,
           f2, t2, rf, rt);
    CHECK(cudaFree(p) == cudaSuccess);
}

TEST(free_is_what_one_allocation_gets)
{
    if (!expected_total()) SKIP("EXPECT_TOTAL_MIB not set (run through run_preload.sh)");
    /* a small block pins a whole page of the small area: a large request cannot use the rest */
    void *small = NULL, *big = NULL;
    REQUIRE(cudaMalloc(&small, 512 << 10) == cudaSuccess);
    size_t f = 0, t = 0;
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    cudaError_t r = cudaMalloc(&big, f);
    printf("    after a 512 KiB block: free %zu MiB of %zu; cudaMalloc(free) -> %d\n", f / MiB, t / MiB, r);
    CHECK(r == cudaSuccess);
    CHECK(f % (2 * MiB) == 0);
    size_t f2 = 1;
    REQUIRE(cudaMemGetInfo(&f2, &t) == cudaSuccess);
    CHECKF(f2 == 0, "free %zu with the whole limit held", f2);
    if (r == cudaSuccess) cudaFree(big);
    cudaFree(small);
}

TEST(a_failed_request_leaves_nothing_the_answer_missed)
{
    if (!expected_total()) SKIP("EXPECT_TOTAL_MIB not set (run through run_preload.sh)");
    void *live = NULL, *big = NULL;
    void (*empty)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memshim_empty_cache");
    REQUIRE(empty);
    REQUIRE(cudaMalloc(&live, 64 * MiB) == cudaSuccess);
    empty(); /* start from the live block alone: no cached page */
    size_t f0 = 0, t = 0;
    REQUIRE(cudaMemGetInfo(&f0, &t) == cudaSuccess);
    size_t res0 = reserved();
    cudaError_t r = cudaMalloc(&big, t); /* more than is left: maps pages on the way, then fails */
    size_t f1 = 0, res1 = reserved();
    REQUIRE(cudaMemGetInfo(&f1, &t) == cudaSuccess);
    printf("    cudaMalloc(%zu MiB) -> %d; reserved %zu -> %zu MiB; free %zu -> %zu MiB\n", t / MiB, r, res0 / MiB,
           res1 / MiB, f0 / MiB, f1 / MiB);
    CHECK(r == cudaErrorMemoryAllocation);
    CHECK(res1 == res0);
    CHECK(f1 == f0);
    CHECK(cudaMalloc(&big, f1) == cudaSuccess);
    cudaFree(big);
    cudaFree(live);
}

/* Issue 25: a limit from a memory fraction (set_per_process_memory_fraction through its hook, or
 * per_process_memory_fraction in PyTorch's allocator settings) is what cudaMemGetInfo and
 * cuMemGetInfo report too, with or without MEMSHIM_LIMIT: a job that sizes its buffers from free
 * memory must see the cap, not the card (the answer followed MEMSHIM_LIMIT only). */
TEST(a_fraction_limit_is_what_meminfo_reports)
{
    meminfo_fn real = real_meminfo();
    REQUIRE(real != NULL);
    void (*set_fraction)(double, int) = (void (*)(double, int))dlsym(RTLD_DEFAULT, "memshim_torch_set_memory_fraction");
    int (*conf_fraction)(double) = (int (*)(double))dlsym(RTLD_DEFAULT, "memshim_torch_conf_memory_fraction");
    REQUIRE(set_fraction && conf_fraction);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 8 * MiB) == cudaSuccess); /* the pool serves device 0 */
    size_t rf = 0, rt = 0, f = 0, t = 0, f2 = 0, t2 = 0;
    REQUIRE(real(&rf, &rt) == CUDA_SUCCESS);
    size_t before = expected_total() ? expected_total() : rt;
    /* a quarter of whatever cap is in force now, in whole 2 MiB pages */
    size_t want = before / 4 / (2 * MiB) * (2 * MiB);
    set_fraction((double)want / (double)rt, 0);
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    REQUIRE(cuMemGetInfo(&f2, &t2) == CUDA_SUCCESS);
    CHECKF(t <= want && t + 2 * MiB > want, "total %zu with a fraction of %zu bytes (before %zu)", t, want, before);
    CHECKF(f <= t - 8 * MiB, "free %zu of %zu with 8 MiB live", f, t);
    CHECK(t2 == t && f2 == f);
    /* the settings' fraction does not override the program's own */
    CHECK(conf_fraction(0.99) == 0);
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    CHECKF(t <= want, "total %zu after a settings fraction; the program's fraction is %zu bytes", t, want);
    CHECK(conf_fraction(0.0) != 0 && conf_fraction(1.5) != 0); /* outside (0, 1]: refused */
    set_fraction(1.0, 0);
    REQUIRE(cudaMemGetInfo(&f, &t) == cudaSuccess);
    CHECKF(t == before, "total %zu after the fraction went back to 1, expected %zu", t, before);
    CHECK(cudaFree(p) == cudaSuccess);
}

static double meminfo_ns(int calls)
{
    double best = 1e30;
    for (int rep = 0; rep < 7; rep++) {
        struct timespec a, b;
        size_t f, t;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int i = 0; i < calls; i++) cudaMemGetInfo(&f, &t);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = ((double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec)) / calls;
        if (ns < best) best = ns;
    }
    return best;
}

/* The answer is read from counters under the pool lock, never a scan of blocks or pages: its cost
 * must not grow with the number of live blocks (the best of 7 batches, with a generous margin). */
TEST(the_answer_does_not_scan_blocks)
{
    if (!expected_total()) SKIP("EXPECT_TOTAL_MIB not set (run through run_preload.sh)");
    enum { N = 20000 };
    static void *blk[N];
    double few = meminfo_ns(200);
    int got = 0;
    for (; got < N; got++)
        if (cudaMalloc(&blk[got], 512) != cudaSuccess) break;
    double many = meminfo_ns(200);
    printf("    cudaMemGetInfo: %.0f ns with no live block, %.0f ns with %d\n", few, many, got);
    CHECK(got == N);
    CHECKF(many < 4 * few + 3000, "%.0f ns vs %.0f ns", many, few);
    for (int i = 0; i < got; i++) cudaFree(blk[i]);
}

TEST_MAIN()
