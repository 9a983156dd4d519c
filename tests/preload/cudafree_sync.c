/*
 * cudafree_sync.c: cudaFree of a pool block keeps the runtime's guarantee (DESIGN.md 2): it
 * synchronizes the device before the memory can be handed out again, so work queued earlier that
 * still reads the block sees its old contents, never the next owner's (a hook that skipped the
 * synchronize passed every other suite: found by `make mutants`, docs/testing.md). With two
 * devices, the device that owns the block is the one synchronized, whatever device is current.
 * Run under LD_PRELOAD=libmemshim.so on the driver double (synchronous mode: queued work runs
 * only when something synchronizes), with CUDBL_DEVICES=2 for the second test.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"

static unsigned char seen;
static void read_block(void *p) { seen = *(volatile unsigned char *)p; }

/* Allocate on `owner`, queue a read of the block there, free it with `current` as the current
 * device, allocate again on `owner` and overwrite: the queued read must have run before. */
static void free_while_work_is_queued(int owner, int current)
{
    void *a = NULL, *b = NULL;
    seen = 0;
    REQUIRE(cudaSetDevice(owner) == cudaSuccess && cudaMalloc(&a, 1 << 20) == cudaSuccess);
    memset(a, 0xAA, 1 << 20);
    REQUIRE(cudbl_stream_enqueue(0, read_block, a) == CUDA_SUCCESS);
    REQUIRE(cudaSetDevice(current) == cudaSuccess);
    cudaFree(NULL);
    cudaError_t fr = cudaFree(a);
    REQUIRE(cudaSetDevice(owner) == cudaSuccess);
    long pending = cudbl_stream_pending(0);
    REQUIRE(cudaMalloc(&b, 1 << 20) == cudaSuccess);
    memset(b, 0x55, 1 << 20); /* the next owner writes (the pool hands the same block back) */
    cudaDeviceSynchronize();
    printf("    device %d block freed with device %d current: cudaFree -> %d, work pending after it %ld, "
           "the queued read saw 0x%02x (block %s)\n", owner, current, fr, pending, seen,
           a == b ? "reused" : "not reused");
    CHECK(fr == cudaSuccess);
    CHECK(pending == 0);
    CHECK(seen == 0xAA);
    cudaFree(b);
}

TEST(cudafree_waits_for_work_queued_on_the_block)
{
    free_while_work_is_queued(0, 0);
}

TEST(cudafree_waits_for_the_owning_device)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) SKIP("needs CUDBL_DEVICES=2");
    free_while_work_is_queued(0, 1);
}

TEST_MAIN()
