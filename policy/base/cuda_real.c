/*
 * cuda_real.c: open the real CUDA driver at run time and resolve the functions memshim calls.
 *
 * Must never be linked against libcuda (see cuda_real.h), never resolve through RTLD_DEFAULT or
 * RTLD_NEXT (that could return memshim's own hooks), and never call a hook. Resolution happens
 * once under pthread_once; a process without a driver (a CPU-only data loader worker that
 * inherited LD_PRELOAD) gets ENODEV and memshim stays out of the way.
 */
#include "cuda_real.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include "msh.h"

struct msh_cuda_driver msh_cu;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_rc = ENODEV;

#define RESOLVE(field, sym) (*(void **)&msh_cu.field = dlsym(msh_cu.handle, sym))

static void load_driver(void)
{
    /* RTLD_LOCAL: the driver's symbols must not become visible to later global lookups. */
    msh_cu.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!msh_cu.handle) {
        msh_info("no CUDA driver in this process (libcuda.so.1: %s); passing through", dlerror());
        load_rc = ENODEV;
        return;
    }
    RESOLVE(cuInit, "cuInit");
    RESOLVE(cuDriverGetVersion, "cuDriverGetVersion");
    RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
    RESOLVE(cuDeviceGet, "cuDeviceGet");
    RESOLVE(cuDeviceGetName, "cuDeviceGetName");
    RESOLVE(cuDeviceTotalMem, "cuDeviceTotalMem_v2");
    RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent");
    RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent");
    RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    RESOLVE(cuCtxGetDevice, "cuCtxGetDevice");
    RESOLVE(cuCtxSynchronize, "cuCtxSynchronize");
    RESOLVE(cuMemGetInfo, "cuMemGetInfo_v2");
    RESOLVE(cuMemAlloc, "cuMemAlloc_v2");
    RESOLVE(cuMemFree, "cuMemFree_v2");
    RESOLVE(cuMemAllocAsync, "cuMemAllocAsync");
    RESOLVE(cuMemFreeAsync, "cuMemFreeAsync");
    RESOLVE(cuMemCreate, "cuMemCreate");
    RESOLVE(cuMemRelease, "cuMemRelease");
    RESOLVE(cuMemAddressReserve, "cuMemAddressReserve");
    RESOLVE(cuMemAddressFree, "cuMemAddressFree");
    RESOLVE(cuMemMap, "cuMemMap");
    RESOLVE(cuMemUnmap, "cuMemUnmap");
    RESOLVE(cuMemSetAccess, "cuMemSetAccess");
    RESOLVE(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    RESOLVE(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
    RESOLVE(cuEventCreate, "cuEventCreate");
    RESOLVE(cuEventRecord, "cuEventRecord");
    RESOLVE(cuEventQuery, "cuEventQuery");
    RESOLVE(cuEventSynchronize, "cuEventSynchronize");
    RESOLVE(cuEventDestroy, "cuEventDestroy_v2");
    RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent");
    RESOLVE(cuGetProcAddress, "cuGetProcAddress_v2");
    RESOLVE(cuGetErrorString, "cuGetErrorString");
    RESOLVE(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2");
    RESOLVE(cuMemGetAddressRange, "cuMemGetAddressRange_v2");
    RESOLVE(cuPointerGetAttribute, "cuPointerGetAttribute");
    RESOLVE(cuPointerGetAttributes, "cuPointerGetAttributes");
    RESOLVE(cuIpcGetMemHandle, "cuIpcGetMemHandle");
    RESOLVE(cuStreamIsCapturing, "cuStreamIsCapturing");
    RESOLVE(cuStreamGetCtx, "cuStreamGetCtx");
    RESOLVE(cuStreamSynchronize, "cuStreamSynchronize");
    RESOLVE(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
    RESOLVE(cuStreamBeginCapture, "cuStreamBeginCapture_v2");
    RESOLVE(cuStreamBeginCapture_ptsz, "cuStreamBeginCapture_v2_ptsz");
    RESOLVE(cuStreamEndCapture, "cuStreamEndCapture");
    RESOLVE(cuStreamEndCapture_ptsz, "cuStreamEndCapture_ptsz");
    RESOLVE(cuMemcpyDtoD, "cuMemcpyDtoD_v2");

    if (!msh_cu.cuInit || !msh_cu.cuCtxGetCurrent || !msh_cu.cuMemGetInfo) {
        msh_warn("libcuda.so.1 lacks cuInit/cuCtxGetCurrent/cuMemGetInfo_v2; passing through");
        load_rc = ENODEV;
        return;
    }
    CUresult r = msh_cu.cuInit(0);
    if (r != CUDA_SUCCESS) {
        msh_info("cuInit failed (%s): no usable GPU in this process; passing through",
                 msh_cuda_errname(r));
        load_rc = ENODEV;
        return;
    }
    msh_cu.loaded = true;
    load_rc = 0;
}

int msh_cuda_load(void)
{
    pthread_once(&load_once, load_driver);
    return load_rc;
}

const char *msh_cuda_errname(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return "CUDA_ERROR_(other)";
    }
}
