/*
 * free_ordering.c: frees of pool blocks keep the ordering the CUDA runtime promises (each failed
 * to be caught by any suite before `make mutants`, docs/testing.md).
 *
 * cudaFree of a pool block keeps the runtime's guarantee (DESIGN.md 2): it
 * synchronizes the device before the memory can be handed out again, so work queued earlier that
 * still reads the block sees its old contents, never the next owner's. With two devices, the
 * device that owns the block is the one synchronized, whatever device is current.
 *
 * cudaFreeAsync_ptsz(p, 0) frees on the calling thread's default stream (stream 0 means
 * cudaStreamPerThread in a _ptsz call), not on the legacy stream: the block is then reused on that
 * same stream at once, with no cross-stream event (ordering it on the legacy stream is safe but
 * serializes the thread with every blocking stream).
 *
 * Run under LD_PRELOAD=libmemshim.so on the driver double (synchronous mode: queued work runs
 * only when something synchronizes), with CUDBL_DEVICES=2 for the device test.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <dlfcn.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"

/* libcudart 13 exports it; cuda_runtime_api.h declares it only for per-thread builds */
cudaError_t CUDARTAPI cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream);

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

TEST(free_async_ptsz_stream0_is_the_threads_own_stream)
{
    void *(*ms_malloc)(ssize_t, int, void *);
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    if (!ms_malloc) SKIP("memshim is not preloaded");
    void *a = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&a, 1 << 20) == cudaSuccess);
    REQUIRE(cudaFreeAsync_ptsz(a, 0) == cudaSuccess);
    long waits0 = cudbl_call_count("cuStreamWaitEvent");
    void *b = ms_malloc(1 << 20, 0, (void *)cudaStreamPerThread);
    long waits = cudbl_call_count("cuStreamWaitEvent") - waits0;
    printf("    freed with cudaFreeAsync_ptsz(p, 0), allocated again on cudaStreamPerThread: %s, %ld "
           "cross-stream waits\n", b == a ? "same block" : "another block", waits);
    REQUIRE(b != NULL);
    CHECK(b == a);
    CHECK(waits == 0);
    void (*ms_free)(void *, ssize_t, int, void *);
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    if (ms_free) ms_free(b, 1 << 20, 0, (void *)cudaStreamPerThread);
    cudaDeviceSynchronize();
}

TEST_MAIN()
