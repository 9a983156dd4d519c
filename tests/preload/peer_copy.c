/*
 * peer_copy.c: single-process multi-GPU work on pool memory (issue 8, item 1; issue 15 item 4).
 * Peer access enabled with cudaDeviceEnablePeerAccess does not cover VMM mappings by itself: every
 * device that touches a pool page needs its own access grant, which memshim gives to a peer once
 * the program enables it (as PyTorch does before copying between devices). Two devices of the
 * driver double, each enabled to reach the other, copy into each other's blocks (synchronous and
 * stream-ordered copies, an emulated kernel) and must neither fault (misuse, counted here) nor
 * lose data. Run under LD_PRELOAD=libmemshim.so with CUDBL_DEVICES=2 (peer-capable, as on NVLink).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"

#define N (3u << 20) /* spans pages, so more than one mapping per block */

static long misuse(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.misuse;
}

static void kernel_wrote(void *arg) { (*(volatile int *)arg)++; }

TEST(two_devices_copy_into_each_others_blocks)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) SKIP("needs CUDBL_DEVICES=2");
    cudbl_set_misuse_abort(0); /* count faults instead of aborting, to report them here */
    long m0 = misuse();
    void *a0 = NULL, *a1 = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&a0, N) == cudaSuccess);
    REQUIRE(cudaSetDevice(1) == cudaSuccess && cudaMalloc(&a1, N) == cudaSuccess);
    int can = 0;
    REQUIRE(cudaDeviceCanAccessPeer(&can, 0, 1) == cudaSuccess && can == 1);
    /* what a job does first: enable peer access, both ways (memshim follows it for VMM memory) */
    cudaSetDevice(0);
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
    cudaSetDevice(1);
    CHECK(cudaDeviceEnablePeerAccess(0, 0) == cudaSuccess);
    cudaSetDevice(0);
    CHECK(cudaMemset(a0, 0x11, N) == cudaSuccess);
    /* device 0 writes device 1's block, device 1 writes device 0's block */
    cudaError_t c01 = cudaMemcpy(a1, a0, N, cudaMemcpyDeviceToDevice);
    cudaSetDevice(1);
    CHECK(cudaMemset((char *)a1 + N / 2, 0x22, N / 2) == cudaSuccess);
    cudaError_t c10 = cudaMemcpy(a0, a1, N, cudaMemcpyDeviceToDevice);
    /* stream-ordered, and an emulated kernel of device 1 writing device 0's block */
    cudaStream_t s1;
    REQUIRE(cudaStreamCreate(&s1) == cudaSuccess);
    cudaError_t a10 = cudaMemcpyAsync(a0, a1, N, cudaMemcpyDeviceToDevice, s1);
    volatile int ran = 0;
    int kr = cudbl_launch((CUstream)s1, (CUdeviceptr)(uintptr_t)a0, N, 1, kernel_wrote, (void *)&ran);
    cudaStreamSynchronize(s1);
    cudaError_t peer = cudaMemcpyPeer(a0, 0, a1, 1, N);
    const unsigned char *p0 = a0;
    printf("    copies: 0->1 %d, 1->0 %d, async 1->0 %d, kernel %d (ran %d), peer %d; faults %ld\n", c01, c10, a10,
           kr, ran, peer, misuse() - m0);
    CHECK(c01 == cudaSuccess && c10 == cudaSuccess && a10 == cudaSuccess && peer == cudaSuccess);
    CHECK(kr == CUDA_SUCCESS && ran == 1);
    CHECK(misuse() == m0);
    CHECK(p0[0] == 0x11 && p0[N - 1] == 0x22);
    cudaStreamDestroy(s1);
    cudaSetDevice(0);
    cudaFree(a0);
    cudaSetDevice(1);
    cudaFree(a1);
    cudbl_set_misuse_abort(1);
}

TEST(pages_mapped_later_are_granted_too)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) SKIP("needs CUDBL_DEVICES=2");
    /* a block placed after the first ones, on pages mapped now */
    void *b0 = NULL;
    cudaSetDevice(0);
    REQUIRE(cudaMalloc(&b0, 5u << 20) == cudaSuccess);
    for (size_t off = 0; off < (5u << 20); off += 1 << 20)
        CHECKF(cudbl_check_access(1, (CUdeviceptr)(uintptr_t)b0 + off, 1 << 20, 1) == CUDA_SUCCESS,
               "device 1 cannot write device 0's block at +%zu", off);
    cudaFree(b0);
}

TEST_MAIN()
