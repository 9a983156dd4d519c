/*
 * on_double.h: the real-driver backend (policy/dev_cuda.c) over the CUDA driver double, for unit
 * tests that hold the pool against the double's own figures (test_spill.c, test_oom.c). Test code
 * only; include it once, after cuda.h and the pool's headers.
 */
#ifndef MSH_TEST_ON_DOUBLE_H
#define MSH_TEST_ON_DOUBLE_H

static struct msh_device g_dev;
static CUcontext g_ctx;
static int g_ready;

/* Device 0 through policy/dev_cuda.c, its primary context current on the calling thread (the
 * tests read cuMemGetInfo and allocate "another process's" memory with cuMemAlloc). 0 when the
 * double did not start: the test skips. */
static int device_up(void)
{
    if (g_ready) return g_ready > 0;
    g_ready = -1;
    if (msh_dev_cuda_init(&g_dev, 0)) return 0;
    CUdevice d;
    if (cuDeviceGet(&d, 0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&g_ctx, d) != CUDA_SUCCESS) return 0;
    cuCtxSetCurrent(g_ctx);
    g_ready = 1;
    return 1;
}

#endif
