/*
 * threads_share.c: memshim's share of the allocating threads' time, with several threads (issue 30).
 * THREADS threads (argument, default 4) each run training-like steps through the tensor-mode
 * entry points (memshim_torch_alloc / _free) on a stream of their own for about 0.3 s, as busy as
 * they can be, then the program exits and memshim writes its summary. run_preload.sh reads that
 * summary: memshim_overhead.threads is the number of threads that allocated, and share_of_wall
 * (path seconds over the wall time times the threads) stays within 0..1; path seconds over the
 * wall time alone, what the figure was before, is above 1 with four busy threads.
 *
 * Run under LD_PRELOAD=libmemshim.so with the driver double, MEMSHIM_REPORT_DIR set.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>

#include "harness.h"

static void *(*t_alloc)(ssize_t, int, void *);
static void (*t_free)(void *, ssize_t, int, void *);

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *worker(void *arg)
{
    CUstream s = NULL;
    if (cuCtxSetCurrent((CUcontext)arg) != CUDA_SUCCESS || cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        return (void *)1;
    size_t sizes[32];
    for (int i = 0; i < 32; i++) sizes[i] = 512 + (size_t)i * 70000;
    void *p[32];
    double end = now_s() + 0.3;
    while (now_s() < end) {
        for (int i = 0; i < 32; i++)
            if (!(p[i] = t_alloc((ssize_t)sizes[i], 0, s))) return (void *)1;
        for (int i = 31; i >= 0; i--) t_free(p[i], (ssize_t)sizes[i], 0, s);
    }
    return NULL;
}

TEST(several_threads_allocate)
{
    *(void **)&t_alloc = dlsym(RTLD_DEFAULT, "memshim_torch_alloc");
    *(void **)&t_free = dlsym(RTLD_DEFAULT, "memshim_torch_free");
    REQUIRE(t_alloc && t_free);
    const char *n = getenv("THREADS");
    int nt = n ? atoi(n) : 4;
    REQUIRE(nt >= 1 && nt <= 16);
    CUdevice d;
    CUcontext c;
    REQUIRE(cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&d, 0) == CUDA_SUCCESS);
    REQUIRE(cuDevicePrimaryCtxRetain(&c, d) == CUDA_SUCCESS && cuCtxSetCurrent(c) == CUDA_SUCCESS);
    pthread_t th[16];
    for (int t = 0; t < nt; t++) REQUIRE(pthread_create(&th[t], NULL, worker, c) == 0);
    int bad = 0;
    for (int t = 0; t < nt; t++) {
        void *rc = NULL;
        pthread_join(th[t], &rc);
        bad += rc != NULL;
    }
    CHECKF(bad == 0, "%d threads failed to allocate", bad);
}

TEST_MAIN()
