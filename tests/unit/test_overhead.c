/*
 * test_overhead.c: memshim's ledger of its own driver calls (policy/base/drvlog.h, issue 24 item 1)
 * against the driver double's own counts. In this process nothing but the pool calls the driver
 * while a workload runs (no runtime, no hooks), so for every function in the ledger the number of
 * calls the ledger adds up must be exactly the number the double received: a call site that
 * skips MSH_DRV, or one counted twice, fails here.
 */
#include "drvlog.h"
#include "harness.h"
#include "msh.h"
#include "pool.h"
#include "../cudadouble/cudbl.h"

#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "on_double.h"

#define MiB MSH_MiB

__attribute__((constructor)) static void overhead_env(void)
{
    setenv("CUDBL_CAPACITY", "1G", 1);
    setenv("CUDBL_GRANULARITY", "2M", 1);
    msh_log_level = MSH_LOG_ERROR;
}

static void double_counts(long *out)
{
    for (int f = 0; f < MSH_DL_N; f++) out[f] = cudbl_call_count(msh_drvlog_names[f]);
}

/* Allocations and frees on the completed stream and on two real streams (a block freed on one
 * and taken on another records an event that is queried or waited for), a limit that forces reclaim and remapping, an
 * empty-cache, a refused request and the pool's destruction. */
static void workload(CUstream s, CUstream s2)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = 64 * MiB;
    p.no_learn = true;
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&g_dev, &p, &pool) == 0);
    uint64_t a[16] = {0};
    uint32_t x = 12345;
    for (int round = 0; round < 40; round++) {
        for (int i = 0; i < 16; i++) {
            x = x * 1103515245u + 12345u;
            size_t sz = (size_t)(1 + (x >> 16) % 6) * MiB - (x % 3) * 4096;
            uint64_t st = i % 3 == 0 ? MSH_STREAM_COMPLETED : (uint64_t)(uintptr_t)(i % 3 == 1 ? s : s2);
            if (a[i]) {
                msh_pool_free(pool, a[i], st);
                a[i] = 0;
            } else if (msh_pool_alloc(pool, sz, st, &a[i]) != 0) {
                a[i] = 0;
            }
        }
        if (round == 20) msh_pool_empty_cache(pool);
    }
    uint64_t big = 0;
    CHECK(msh_pool_alloc(pool, 80 * MiB, MSH_STREAM_COMPLETED, &big) != 0); /* past the limit */
    for (int i = 0; i < 16; i++)
        if (a[i]) msh_pool_free(pool, a[i], i % 3 == 0 ? MSH_STREAM_COMPLETED : (uint64_t)(uintptr_t)(i % 3 == 1 ? s : s2));
    msh_pool_empty_cache(pool);
    msh_pool_destroy(pool);
}

TEST(the_ledger_counts_exactly_the_calls_the_driver_received)
{
    if (!device_up()) SKIP("the driver double did not start");
    CUstream s, s2;
    REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    REQUIRE(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    struct msh_drvlog_snap l0, l1;
    long d0[MSH_DL_N], d1[MSH_DL_N];
    msh_drvlog_read(&l0);
    double_counts(d0);
    workload(s, s2);
    msh_drvlog_read(&l1);
    double_counts(d1);
    int compared = 0, differ = 0;
    uint64_t total = 0;
    for (int f = 0; f < MSH_DL_N; f++) {
        if (d0[f] < 0) continue; /* a function the double does not have: nothing to compare with */
        long dd = d1[f] - d0[f];
        uint64_t dl = l1.count[f] - l0.count[f];
        compared++;
        total += dl;
        if ((uint64_t)dd != dl) {
            differ++;
            printf("    %s: the ledger counted %llu, the double received %ld\n", msh_drvlog_names[f],
                   (unsigned long long)dl, dd);
        }
        if (dl) printf("    %-34s %6llu calls, %.3f ms measured\n", msh_drvlog_names[f], (unsigned long long)dl,
                       (l1.seconds[f] - l0.seconds[f]) * 1e3);
    }
    CHECKF(differ == 0, "%d of %d functions counted differently", differ, compared);
    /* not a vacuous match: the workload made the pool's kinds of calls */
    CHECK(l1.count[MSH_DL_cuMemCreate] > l0.count[MSH_DL_cuMemCreate]);
    CHECK(l1.count[MSH_DL_cuMemUnmap] > l0.count[MSH_DL_cuMemUnmap]);
    CHECK(l1.count[MSH_DL_cuMemSetAccess] > l0.count[MSH_DL_cuMemSetAccess]);
    CHECK(l1.count[MSH_DL_cuEventRecord] > l0.count[MSH_DL_cuEventRecord]);
    CHECK(l1.count[MSH_DL_cuCtxGetCurrent] > l0.count[MSH_DL_cuCtxGetCurrent]);
    CHECK(total > 100);
    char line[256];
    struct msh_drvlog_snap d;
    msh_drvlog_diff(&l1, &l0, &d);
    for (int f = 0; f < MSH_DL_N; f++)
        CHECKF(d.count[f] || d.seconds[f] == 0, "%s: not called, yet %g s in the difference", msh_drvlog_names[f],
               d.seconds[f]);
    msh_drvlog_top3(&d, line, sizeof line);
    printf("    top 3: %s\n", line);
    CHECK(strstr(line, " calls ") != NULL);
    cuStreamDestroy(s);
    cuStreamDestroy(s2);
}

/* The three largest costs, largest first, at most three, none for an empty ledger. */
TEST(top3_names_the_largest_costs_in_order)
{
    struct msh_drvlog_snap s;
    memset(&s, 0, sizeof s);
    char line[256];
    msh_drvlog_top3(&s, line, sizeof line);
    CHECK(line[0] == 0);
    s.count[MSH_DL_cuMemCreate] = 10, s.seconds[MSH_DL_cuMemCreate] = 0.002;
    s.count[MSH_DL_cuMemUnmap] = 5, s.seconds[MSH_DL_cuMemUnmap] = 0.004;
    s.count[MSH_DL_cuEventQuery] = 100, s.seconds[MSH_DL_cuEventQuery] = 0.0001;
    s.count[MSH_DL_cuCtxSynchronize] = 1, s.seconds[MSH_DL_cuCtxSynchronize] = 0.003;
    msh_drvlog_top3(&s, line, sizeof line);
    printf("    %s\n", line);
    CHECK(!strcmp(line, "cuMemUnmap 5 calls 4.000 ms, cuCtxSynchronize 1 calls 3.000 ms, cuMemCreate 10 calls 2.000 ms"));
}

TEST_MAIN()
