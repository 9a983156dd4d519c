/*
 * test_limits.c: what a limit costs the driver, through PyTorch's entry points (shim/torch.c) on
 * the CUDA driver double (issue 31 item 3). A limit at or above the device is no limit:
 * set_per_process_memory_fraction(1.0), what jobs and the GPU bench call to reset a cap, must
 * cost the driver what no limit costs (it switched the pool to one 2 MiB handle per page: 40
 * allocations of 30 MiB made 602 creates and maps instead of 40). "Far from any limit" counts the
 * device's other users as the request asked them, so beside a co-tenant holding most of the card
 * a request takes itself plus rounding, not its 20 MiB chunk ahead. And cuMemGetInfo, now in the
 * cost table, is asked only where its answer can change what the pool does, each ask counted.
 *
 * The figures come from the double (cudbl_call_count, cudbl_device_mark_peak), not from the pool.
 * Another process's memory is played by cuMemAlloc, which the double charges to the same device.
 * One process: the tests run in order, each leaving the device as it found it.
 */
#include "harness.h"
#include "core.h"
#include "memshim.h"
#include "msh.h"
#include "pool.h"
#include "torch.h"

#include "cudadouble/cudbl.h"
#include <cuda.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#define MiB MSH_MiB
#define GiB MSH_GiB
#define N 40
#define SZ (30 * MiB)

struct drv_counts { long creates, maps, infos; };

static struct drv_counts counts(void)
{
    return (struct drv_counts){cudbl_call_count("cuMemCreate"), cudbl_call_count("cuMemMap"),
                               cudbl_call_count("cuMemGetInfo")};
}

/* 40 live allocations of 30 MiB, then all freed and the cache given back: the creates and maps. */
static struct drv_counts forty_of_30(void)
{
    void *p[N] = {NULL};
    struct drv_counts c0 = counts();
    int served = 0;
    for (int i = 0; i < N; i++) served += (p[i] = memshim_torch_alloc(SZ, 0, NULL)) != NULL;
    struct drv_counts c1 = counts();
    CHECKF(served == N, "%d of %d served", served, N);
    for (int i = 0; i < N; i++)
        if (p[i]) memshim_torch_free(p[i], SZ, 0, NULL);
    memshim_empty_cache();
    return (struct drv_counts){c1.creates - c0.creates, c1.maps - c0.maps, c1.infos - c0.infos};
}

/* Beside another process holding 1.7 GiB of the 2 GiB card, a request takes itself plus rounding
 * to pages: the device's free memory (what the other process gets next) falls by no more. And the
 * pool is not far from anything there: one handle per page, each reclaimable alone, as near a
 * limit. First, while no limit was ever set (before issue 31 a fraction of 1.0 was a limit, and
 * page mode). */
TEST(beside_a_co_tenant_a_request_takes_itself_plus_rounding)
{
    CUdeviceptr other = 0;
    CUdevice d;
    CUcontext ctx;
    REQUIRE(cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&d, 0) == CUDA_SUCCESS);
    REQUIRE(cuDevicePrimaryCtxRetain(&ctx, d) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    REQUIRE(cuMemAlloc(&other, 1700 * MiB) == CUDA_SUCCESS);
    static const size_t sizes[] = {30 * MiB, 31 * MiB, 3 * MiB};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t used0 = 0;
        cudbl_device_mark_peak(0, 1, &used0);
        long c0 = cudbl_call_count("cuMemCreate");
        void *p = memshim_torch_alloc((ssize_t)sizes[i], 0, NULL);
        long creates = cudbl_call_count("cuMemCreate") - c0;
        size_t peak = cudbl_device_mark_peak(0, 1, NULL);
        size_t rise = peak - used0, allowed = (sizes[i] + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
        printf("    %zu MiB beside 1.7 GiB of another process: the device's use rose by %zu MiB, %ld creates\n",
               sizes[i] / MiB, rise / MiB, creates);
        CHECK(p != NULL);
        CHECKF(rise <= allowed, "%zu MiB for a %zu MiB request (its pages: %zu MiB)", rise / MiB, sizes[i] / MiB,
               allowed / MiB);
        CHECKF(creates == (long)(allowed / (2 * MiB)), "%ld creates for %zu pages", creates, allowed / (2 * MiB));
        if (p) memshim_torch_free(p, (ssize_t)sizes[i], 0, NULL);
        memshim_empty_cache();
    }
    cuMemFree(other);
}

TEST(a_fraction_of_one_costs_the_driver_what_no_limit_costs)
{
    struct drv_counts none = forty_of_30();
    memshim_torch_set_memory_fraction(1.0, 0);
    size_t lim = msh_torch_limit(0);
    struct drv_counts one = forty_of_30();
    printf("    40 x 30 MiB: no limit %ld creates, %ld maps; fraction 1.0 (limit %zu) %ld creates, %ld maps\n",
           none.creates, none.maps, lim, one.creates, one.maps);
    CHECK(lim == 0); /* at or above the device: no limit */
    CHECK(none.creates > 0 && one.creates == none.creates && one.maps == none.maps);
    CHECKF(none.creates <= 2 * N, "no limit made %ld creates for %d requests", none.creates, N);
    CHECK(memshim_torch_get_memory_fraction(0) == 1.0);
}

/* The pool's own rule, whoever creates it (MEMSHIM_LIMIT in segment mode, memshim-replay): a limit
 * of the device's whole memory is none. */
TEST(a_pool_limit_of_the_whole_device_is_none)
{
    struct msh_device *dev = msh_core_device(0);
    REQUIRE(dev);
    long c[2];
    for (int lim = 0; lim < 2; lim++) {
        struct msh_pool_params prm;
        msh_pool_params_default(&prm);
        prm.limit_bytes = lim ? 2 * GiB : 0;
        prm.no_learn = true;
        struct msh_pool *pool = NULL;
        REQUIRE(msh_pool_create(dev, &prm, &pool) == 0);
        uint64_t a[N];
        long c0 = cudbl_call_count("cuMemCreate");
        for (int i = 0; i < N; i++) REQUIRE(msh_pool_alloc(pool, SZ, MSH_STREAM_COMPLETED, &a[i]) == 0);
        c[lim] = cudbl_call_count("cuMemCreate") - c0;
        for (int i = 0; i < N; i++) msh_pool_free(pool, a[i], MSH_STREAM_COMPLETED);
        msh_pool_destroy(pool);
    }
    printf("    a pool's 40 x 30 MiB: %ld creates with no limit, %ld with a limit of the whole device\n", c[0], c[1]);
    CHECK(c[0] > 0 && c[1] == c[0]);
}

/* cuMemGetInfo: asked by a request only when its answer can change what the job does (several
 * creates, or a chunk ahead), and every ask counted where the cost model sees it (the pool's
 * mem_info calls). Under a limit, small requests that each need one new page ask nothing; a
 * 30 MiB one (15 pages, 15 creates) asks once. */
TEST(the_device_is_asked_only_when_the_answer_can_change_the_job)
{
    struct msh_pool *pool = msh_core_pool_get(0);
    REQUIRE(pool);
    memshim_torch_set_memory_fraction(0.5, 0);
    struct msh_pool_stats st0, st1;
    msh_pool_get_stats(pool, &st0);
    long i0 = cudbl_call_count("cuMemGetInfo"), c0 = cudbl_call_count("cuMemCreate");
    void *p[64];
    for (int i = 0; i < 64; i++) {
        p[i] = memshim_torch_alloc(2 * MiB, 0, NULL); /* one new page each, one create */
        REQUIRE(p[i]);
    }
    long i1 = cudbl_call_count("cuMemGetInfo"), c1 = cudbl_call_count("cuMemCreate");
    void *big = memshim_torch_alloc(SZ, 0, NULL);
    long i2 = cudbl_call_count("cuMemGetInfo"), c2 = cudbl_call_count("cuMemCreate");
    msh_pool_get_stats(pool, &st1);
    printf("    64 one-page requests under a limit: %ld creates, %ld cuMemGetInfo; one of 30 MiB: %ld creates, %ld "
           "cuMemGetInfo\n", c1 - c0, i1 - i0, c2 - c1, i2 - i1);
    CHECK(big != NULL);
    CHECK(c1 - c0 == 64 && i1 - i0 == 0);
    CHECK(c2 - c1 == 15 && i2 - i1 == 1);
    CHECKF((long)(st1.drv_calls[MSH_DRV_MEM_INFO] - st0.drv_calls[MSH_DRV_MEM_INFO]) == i2 - i0,
           "the pool counted %llu cuMemGetInfo, the driver saw %ld",
           (unsigned long long)(st1.drv_calls[MSH_DRV_MEM_INFO] - st0.drv_calls[MSH_DRV_MEM_INFO]), i2 - i0);
    for (int i = 0; i < 64; i++) memshim_torch_free(p[i], 2 * MiB, 0, NULL);
    if (big) memshim_torch_free(big, SZ, 0, NULL);
    memshim_empty_cache();
    memshim_torch_set_memory_fraction(1.0, 0);
}

int main(int argc, char **argv)
{
    setenv("CUDBL_CAPACITY", "2G", 1);
    setenv("CUDBL_GRANULARITY", "2M", 1);
    unsetenv("MEMSHIM_LIMIT");
    setenv("MEMSHIM_LOG", "error", 1);
    return th_main(__FILE__, argc, argv);
}
