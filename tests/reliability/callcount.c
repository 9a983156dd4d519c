/*
 * callcount.c: libreli-callcount.so, a helper preloaded next to libmemshim.so by the reliability
 * suite. At process exit (a library destructor, so after every atexit handler, memshim's summary
 * included) it prints how many times each driver function of the CUDA driver double was called,
 * one line "reli-calls NAME N" per function with N > 0, when RELI_CALLCOUNT=1. The fault-injection
 * suite uses these counts to know every N worth failing. It only reads counters of the double
 * (tests/cudadouble/cudbl.h) and must never change what the program does.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudbl.h"

static const char *const names[] = {
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName",
    "cuDeviceTotalMem", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxGetState", "cuCtxCreate", "cuCtxDestroy",
    "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxGetDevice",
    "cuCtxSynchronize", "cuMemGetInfo", "cuMemAlloc", "cuMemFree", "cuMemAllocAsync",
    "cuMemFreeAsync", "cuMemGetAddressRange", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemcpyDtoD",
    "cuMemsetD8", "cuMemGetAllocationGranularity", "cuMemCreate", "cuMemRelease",
    "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
    "cuMemGetAccess", "cuMemRetainAllocationHandle", "cuMemGetAllocationPropertiesFromHandle",
    "cuStreamCreate", "cuStreamCreateWithPriority", "cuStreamDestroy", "cuStreamSynchronize",
    "cuStreamQuery", "cuStreamWaitEvent", "cuLaunchHostFunc", "cuEventCreate", "cuEventRecord",
    "cuEventQuery", "cuEventSynchronize", "cuEventDestroy", "cuEventElapsedTime",
    "cuGetProcAddress", "cuGetErrorString", "cuGetErrorName",
    /* added with the strict double (issue 8) */
    "cuDeviceCanAccessPeer", "cuCtxEnablePeerAccess", "cuCtxDisablePeerAccess", "cuMemcpy",
    "cuMemcpyAsync", "cuMemcpyPeer", "cuMemcpyPeerAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync", "cuMemsetD8Async", "cuPointerGetAttribute", "cuPointerGetAttributes",
    "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuIpcCloseMemHandle", "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle", "cuStreamBeginCapture", "cuStreamEndCapture", "cuStreamGetCaptureInfo",
    "cuStreamIsCapturing", "cuThreadExchangeStreamCaptureMode", "cuGraphInstantiate", "cuGraphLaunch",
    "cuGraphExecDestroy", "cuGraphDestroy", "cuStreamGetCtx",
};

__attribute__((destructor)) static void reli_print_calls(void)
{
    const char *on = getenv("RELI_CALLCOUNT");
    if (!on || strcmp(on, "1") != 0) return;
    char buf[8192];
    size_t n = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        long c = cudbl_call_count(names[i]);
        if (c <= 0) continue;
        int k = snprintf(buf + n, sizeof buf - n, "reli-calls %s %ld\n", names[i], c);
        if (k < 0 || (size_t)k >= sizeof buf - n) break;
        n += (size_t)k;
    }
    ssize_t w = write(2, buf, n);
    (void)w;
}
