/*
 * gc_threshold_cost.c: MEMSHIM_GC=threshold without a byte limit compares what the pool holds with
 * the device's capacity, which does not change: it must not ask the driver on every allocation
 * (issue 8: it called cuMemGetInfo, with a context push and pop, per cudaMalloc). Counts the
 * driver double's cuMemGetInfo calls over 500 allocations. Run under LD_PRELOAD=libmemshim.so
 * with MEMSHIM_GC=threshold.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>

#include "cudbl.h"
#include "harness.h"

TEST(threshold_gc_does_not_query_the_device_per_allocation)
{
    enum { N = 500 };
    static void *p[N];
    REQUIRE(cudaMalloc(&p[0], 4096) == cudaSuccess); /* the pool exists from here on */
    long before = cudbl_call_count("cuMemGetInfo");
    int ok = 1;
    for (int i = 1; i < N; i++) ok &= cudaMalloc(&p[i], 4096) == cudaSuccess;
    long calls = cudbl_call_count("cuMemGetInfo") - before;
    printf("    %d allocations, %ld cuMemGetInfo calls\n", N - 1, calls);
    CHECK(ok);
    CHECK(calls < 5);
    for (int i = 0; i < N; i++) cudaFree(p[i]);
}

TEST_MAIN()
