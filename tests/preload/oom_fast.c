/*
 * oom_fast.c: segment mode's impossible requests (issue 25) under LD_PRELOAD=libmemshim.so on the
 * driver double's 8 GiB device. A cudaMalloc larger than the device, or than what the device has
 * free beside another allocator's memory, fails with cudaErrorMemoryAllocation before any
 * cuMemCreate, and the device's free memory (what another process would get) never falls while
 * it is refused; cuMemAlloc, which memshim passes to the driver, is refused by the driver alone.
 * Before issue 25 the 16 GiB cudaMalloc made about 20,000 cuMemCreate calls and filled the device.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "cudbl.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

struct watch {
    long creates;
    size_t used0, rise;
    double us;
};

static void watch_begin(struct watch *w)
{
    w->creates = cudbl_call_count("cuMemCreate");
    cudbl_device_mark_peak(0, 1, &w->used0);
    w->us = now_us();
}

static void watch_end(struct watch *w)
{
    w->us = now_us() - w->us;
    size_t peak = cudbl_device_mark_peak(0, 1, NULL);
    w->rise = peak > w->used0 ? peak - w->used0 : 0;
    w->creates = cudbl_call_count("cuMemCreate") - w->creates;
}

TEST(cudamalloc_larger_than_the_device_fails_at_once)
{
    void *warm = NULL, *p = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&warm, 64 * MiB) == cudaSuccess);
    struct watch w;
    watch_begin(&w);
    cudaError_t e = cudaMalloc(&p, 16 * GiB);
    watch_end(&w);
    cudaGetLastError();
    printf("    cudaMalloc(16 GiB) on 8 GiB -> %s in %.0f us, cuMemCreate %ld, device charge rose %zu MiB\n",
           cudaGetErrorName(e), w.us, w.creates, w.rise / MiB);
    CHECK(e == cudaErrorMemoryAllocation);
    CHECK(w.creates == 0 && w.rise == 0);
    /* what fits is served as before */
    CHECK(cudaMalloc(&p, GiB) == cudaSuccess && cudaFree(p) == cudaSuccess);
    CHECK(cudaFree(warm) == cudaSuccess);
}

TEST(cumemalloc_larger_than_the_device_is_the_drivers_refusal)
{
    CUdeviceptr d = 0;
    struct watch w;
    watch_begin(&w);
    CUresult r = cuMemAlloc(&d, 16 * GiB);
    watch_end(&w);
    printf("    cuMemAlloc(16 GiB) -> %d in %.0f us, cuMemCreate %ld, device charge rose %zu MiB\n", (int)r, w.us,
           w.creates, w.rise / MiB);
    CHECK(r == CUDA_ERROR_OUT_OF_MEMORY && w.creates == 0 && w.rise == 0);
}

TEST(cudamalloc_of_more_than_the_device_has_free_fails_at_once_and_leaves_it_free)
{
    CUdeviceptr other = 0;
    void *live = NULL, *p = NULL;
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cuMemAlloc(&other, 5 * GiB) == CUDA_SUCCESS); /* another allocator's memory */
    REQUIRE(cudaMalloc(&live, GiB) == cudaSuccess);
    size_t fr = 0, tot = 0;
    REQUIRE(cuMemGetInfo(&fr, &tot) == CUDA_SUCCESS);
    struct watch w;
    watch_begin(&w);
    cudaError_t e = cudaMalloc(&p, fr + 512 * MiB);
    watch_end(&w);
    cudaGetLastError();
    printf("    cudaMalloc(free + 512 MiB = %zu MiB) beside 5 GiB of another allocator -> %s in %.0f us, "
           "cuMemCreate %ld, device charge rose %zu MiB\n", (fr + 512 * MiB) / MiB, cudaGetErrorName(e), w.us, w.creates,
           w.rise / MiB);
    CHECK(e == cudaErrorMemoryAllocation);
    CHECK(w.creates == 0 && w.rise == 0);
    /* free - 64 MiB fits: served, and the device falls by no more than it */
    size_t want = fr - 64 * MiB;
    watch_begin(&w);
    e = cudaMalloc(&p, want);
    watch_end(&w);
    printf("    cudaMalloc(free - 64 MiB) -> %s, device charge rose %zu MiB\n", cudaGetErrorName(e), w.rise / MiB);
    CHECK(e == cudaSuccess && w.rise <= want + 2 * MiB);
    if (e == cudaSuccess) CHECK(cudaFree(p) == cudaSuccess);
    CHECK(cudaFree(live) == cudaSuccess);
    cuMemFree(other);
}

TEST_MAIN()
