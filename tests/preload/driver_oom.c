/*
 * driver_oom.c: the driver running out of memory while the pool maps a page is memory pressure:
 * the pool's rescue chain retries (here the retry succeeds, the failure being a single injected
 * one), and the request never goes to the real allocator, which is only for pool errors other
 * than "no room" (policy/base/msh.h's errno convention: the driver's CUDA_ERROR_OUT_OF_MEMORY is ENOMEM,
 * never EIO). A mutant that read the driver's OOM as an I/O error passed every other suite
 * (docs/testing.md): its cudaMalloc went to cuMemAlloc. Run under LD_PRELOAD=libmemshim.so on the
 * driver double.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "cudbl.h"
#include "harness.h"

TEST(driver_oom_while_mapping_is_pressure_not_a_pass_through)
{
    void *warm = NULL, *p = NULL, *q = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&warm, 1 << 20) == cudaSuccess);
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    cudbl_fail_nth("cuMemMap", 1, CUDA_ERROR_OUT_OF_MEMORY); /* the next map: the device is full */
    cudaError_t e = cudaMalloc(&p, 64 << 20);                /* needs new pages */
    cudbl_get_counts(&c1);
    cudbl_fail_clear();
    cudaGetLastError();
    printf("    cudaMalloc with the driver out of memory on the next map -> %d (%s); cuMemAlloc blocks %ld -> %ld\n",
           e, cudaGetErrorName(e), c0.allocs, c1.allocs);
    CHECK(e == cudaSuccess || e == cudaErrorMemoryAllocation);
    CHECK(c1.allocs == c0.allocs); /* nothing went to the real allocator */
    if (e == cudaSuccess) cudaFree(p);
    /* the error is not sticky: the next request is served by the pool */
    CHECK(cudaMalloc(&q, 64 << 20) == cudaSuccess);
    cudaFree(q);
    cudaFree(warm);
}

TEST_MAIN()
