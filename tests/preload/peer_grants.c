/*
 * peer_grants.c: issue 15 item 4. Pool pages are granted to their own device only, and to a peer
 * once the program enables access to that device from the peer: through the runtime
 * (cudaDeviceEnablePeerAccess, what PyTorch calls before its first copy between two devices), the
 * driver (cuCtxEnablePeerAccess) or a driver entry point looked up at run time. The grant covers
 * the pages mapped before the enable and those mapped after. The double counts grants per device
 * (cudbl_access_grants, cudbl_mappings_accessible). And record_stream with a stream of another
 * device: the event is made in that stream's context (the driver refuses one of another context),
 * so the block is not reused while the other device still reads it. Run under LD_PRELOAD with
 * CUDBL_DEVICES=3 and MEMSHIM_LIMIT set (so that a freed block is reused, not replaced).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cudbl.h"
#include "harness.h"
#include <dlfcn.h>
#include <sys/types.h>

#define MiB (1u << 20)

static long misuse(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.misuse;
}

TEST(pages_are_granted_to_the_owner_only_until_a_peer_is_enabled)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 3) SKIP("needs CUDBL_DEVICES=3");
    void *a = NULL, *b = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&a, 6 * MiB) == cudaSuccess);
    long g1 = cudbl_access_grants(1), g2 = cudbl_access_grants(2);
    CHECKF(g1 == 0 && g2 == 0, "device 0's pages granted to device 1 %ld times, device 2 %ld times", g1, g2);
    CHECK(cudbl_check_access(1, (CUdeviceptr)(uintptr_t)a, 6 * MiB, 1) == CUDA_ERROR_ILLEGAL_ADDRESS);
    long own = cudbl_mappings_accessible(0);
    CHECK(own > 0);
    /* device 1 may reach device 0 from now on: what is mapped now, and what is mapped later */
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaDeviceEnablePeerAccess(0, 0) == cudaSuccess);
    CHECK(cudbl_check_access(1, (CUdeviceptr)(uintptr_t)a, 6 * MiB, 1) == CUDA_SUCCESS);
    CHECK(cudbl_mappings_accessible(1) >= own);
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&b, 10 * MiB) == cudaSuccess);
    CHECK(cudbl_check_access(1, (CUdeviceptr)(uintptr_t)b, 10 * MiB, 1) == CUDA_SUCCESS);
    /* device 2 never asked: still nothing */
    CHECK(cudbl_access_grants(2) == 0);
    CHECK(cudbl_check_access(2, (CUdeviceptr)(uintptr_t)b, 10 * MiB, 0) == CUDA_ERROR_ILLEGAL_ADDRESS);
    /* a second enable of the same pair changes nothing (the runtime says "already enabled") */
    long before = cudbl_access_grants(1);
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    cudaDeviceEnablePeerAccess(0, 0);
    CHECK(cudbl_access_grants(1) == before);
    cudaSetDevice(0);
    cudaFree(a);
    cudaFree(b);
}

TEST(the_driver_call_and_its_entry_point_grant_too)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 3) SKIP("needs CUDBL_DEVICES=3");
    void *a = NULL;
    REQUIRE(cudaSetDevice(1) == cudaSuccess && cudaMalloc(&a, 4 * MiB) == cudaSuccess);
    CHECK(cudbl_check_access(2, (CUdeviceptr)(uintptr_t)a, 4 * MiB, 1) == CUDA_ERROR_ILLEGAL_ADDRESS);
    CUdevice d1, d2;
    CUcontext c1, c2;
    REQUIRE(cuDeviceGet(&d1, 1) == CUDA_SUCCESS && cuDeviceGet(&d2, 2) == CUDA_SUCCESS);
    REQUIRE(cuDevicePrimaryCtxRetain(&c1, d1) == CUDA_SUCCESS && cuDevicePrimaryCtxRetain(&c2, d2) == CUDA_SUCCESS);
    /* looked up at run time, as NCCL and PyTorch's expandable segments reach the driver */
    CUresult (*enable)(CUcontext, unsigned int) = NULL;
    CUdriverProcAddressQueryResult st;
    REQUIRE(cuGetProcAddress("cuCtxEnablePeerAccess", (void **)&enable, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) ==
            CUDA_SUCCESS && enable);
    REQUIRE(cuCtxSetCurrent(c2) == CUDA_SUCCESS);
    CHECK(enable(c1, 0) == CUDA_SUCCESS); /* device 2 may reach device 1 */
    CHECK(cudbl_check_access(2, (CUdeviceptr)(uintptr_t)a, 4 * MiB, 1) == CUDA_SUCCESS);
    cudaSetDevice(1);
    cudaFree(a);
}

/* A block of device 0 read by a kernel on a stream of device 1 (record_stream with that stream),
 * then freed on device 0's stream and reused there: the new use must wait for device 1's read. */
static volatile int read_ok = -1;
static void reader(void *arg) { read_ok = *(volatile unsigned char *)arg == 0xAB; }
static void writer(void *arg) { memset(arg, 0xCD, MiB); }

TEST(record_stream_with_a_stream_of_another_device)
{
    void *(*memshim_malloc)(ssize_t, int, void *);
    void (*memshim_free)(void *, ssize_t, int, void *);
    void (*memshim_record_stream)(void *, void *);
    *(void **)&memshim_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&memshim_free = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&memshim_record_stream = dlsym(RTLD_DEFAULT, "memshim_record_stream");
    if (!memshim_malloc || !memshim_free || !memshim_record_stream) SKIP("libmemshim.so is not preloaded");
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 3) SKIP("needs CUDBL_DEVICES=3");
    cudbl_set_async(0); /* queued work runs only when a stream is synchronized */
    cudbl_set_misuse_abort(0);
    long m0 = misuse();
    cudaStream_t s0, s1;
    REQUIRE(cudaSetDevice(1) == cudaSuccess && cudaStreamCreate(&s1) == cudaSuccess);
    REQUIRE(cudaDeviceEnablePeerAccess(0, 0) == cudaSuccess || cudaGetLastError() == cudaErrorPeerAccessAlreadyEnabled);
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaStreamCreate(&s0) == cudaSuccess);
    void *x = memshim_malloc(8 * MiB, 0, s0);
    REQUIRE(x);
    memset(x, 0xAB, MiB);
    long rec0 = cudbl_call_count("cuEventRecord");
    /* device 1 reads x later (its stream is behind) */
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    REQUIRE(cudbl_launch((CUstream)s1, (CUdeviceptr)(uintptr_t)x, MiB, 0, reader, x) == CUDA_SUCCESS);
    memshim_record_stream(x, s1);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    long sync0 = cudbl_call_count("cuStreamSynchronize") + cudbl_call_count("cuCtxSynchronize");
    memshim_free(x, 8 * MiB, 0, s0);
    void *y = memshim_malloc(8 * MiB, 0, s0); /* at the limit: x's memory */
    CHECK(y == x);
    /* the event came from device 1's context, so recording it worked: the pool had no reason to
     * fall back to synchronizing device 1's stream from the host */
    long syncs = cudbl_call_count("cuStreamSynchronize") + cudbl_call_count("cuCtxSynchronize") - sync0;
    CHECKF(syncs == 0, "%ld host synchronizes between the free and the reuse", syncs);
    if (y) REQUIRE(cudbl_launch((CUstream)s0, (CUdeviceptr)(uintptr_t)y, MiB, 1, writer, y) == CUDA_SUCCESS);
    cudaStreamSynchronize(s0); /* runs device 1's read first, if s0 was made to wait for it */
    cudaSetDevice(1);
    cudaStreamSynchronize(s1);
    printf("    events recorded %ld, read saw the old data: %d, faults %ld\n", cudbl_call_count("cuEventRecord") - rec0,
           read_ok, misuse() - m0);
    CHECK(cudbl_call_count("cuEventRecord") - rec0 == 1);
    CHECKF(read_ok == 1, "device 1's read ran after the block was reused on device 0");
    CHECK(misuse() == m0);
    cudaSetDevice(0);
    memshim_free(y, 8 * MiB, 0, s0);
    cudaStreamDestroy(s0);
    cudaSetDevice(1);
    cudaStreamDestroy(s1);
    cudbl_set_misuse_abort(1);
}

TEST_MAIN()
