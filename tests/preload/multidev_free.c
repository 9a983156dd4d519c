/*
 * multidev_free.c: cuMemFree_v2 of a pool block must wait for the work of the device that owns
 * the block, not of whatever context is current (found by review: with device 1 current, device
 * 0's queued kernel still read the block after it had been handed to a new owner). Run under
 * LD_PRELOAD=libmemshim.so with CUDBL_DEVICES=2 on the driver double.
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

TEST(cumemfree_waits_for_the_owning_device)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) SKIP("needs CUDBL_DEVICES=2");
    void *a = NULL, *b = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&a, 1 << 20) == cudaSuccess);
    memset(a, 0xAA, 1 << 20);
    cudbl_stream_enqueue(0, read_block, a); /* device 0 work that reads the block later */
    cudaSetDevice(1);
    cudaFree(NULL); /* device 1's context is current now */
    CUresult fr = cuMemFree_v2((CUdeviceptr)(uintptr_t)a);
    cudaSetDevice(0);
    long pending = cudbl_stream_pending(0);
    REQUIRE(cudaMalloc(&b, 1 << 20) == cudaSuccess);
    memset(b, 0x55, 1 << 20); /* the next owner writes */
    cudaDeviceSynchronize();
    printf("    cuMemFree_v2 -> %d, device-0 work pending after it: %ld, the queued read saw 0x%02x\n", fr, pending,
           seen);
    CHECK(fr == CUDA_SUCCESS);
    CHECK(pending == 0);
    CHECK(seen == 0xAA);
    cudaFree(b);
}

TEST_MAIN()
