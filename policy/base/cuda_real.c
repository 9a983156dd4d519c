/*
 * cuda_real.c: open the real CUDA driver at run time and resolve the functions memshim calls.
 *
 * Must never be linked against libcuda (see cuda_real.h), never resolve through RTLD_DEFAULT or
 * RTLD_NEXT (that could return memshim's own hooks), and never call a hook. Resolution happens
 * once under pthread_once; a process without a driver (a CPU-only data loader worker that
 * inherited LD_PRELOAD) gets ENODEV and memshim stays out of the way.
 */
#include "cuda_real.h"
#include "drvlog.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include "msh.h"

struct msh_cuda_driver msh_cu;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_rc = ENODEV;

/* sym: the ABI symbol; pfn: cudaTypedefs.h's type of that ABI (the unversioned symbol is the
 * first version of a name, _v2 the second, ...: cuCtxGetDevice is PFN_cuCtxGetDevice_v2000, not
 * the _v13000 that a lookup of "cuCtxGetDevice" at 13000 returns) */
#define RESOLVE(field, sym, pfn)                                                                \
    do {                                                                                        \
        MSH_ABI_ASSERT(msh_cu.field, pfn, "msh_cu." #field " (" sym ")");                       \
        *(void **)&msh_cu.field = dlsym(msh_cu.handle, sym);                                    \
    } while (0)

static void load_driver(void)
{
    /* RTLD_LOCAL: the driver's symbols must not become visible to later global lookups. */
    msh_cu.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!msh_cu.handle) {
        msh_info("no CUDA driver in this process (libcuda.so.1: %s); passing through", dlerror());
        load_rc = ENODEV;
        return;
    }
    RESOLVE(cuInit, "cuInit", PFN_cuInit_v2000);
    RESOLVE(cuDriverGetVersion, "cuDriverGetVersion", PFN_cuDriverGetVersion_v2020);
    RESOLVE(cuDeviceGetCount, "cuDeviceGetCount", PFN_cuDeviceGetCount_v2000);
    RESOLVE(cuDeviceGet, "cuDeviceGet", PFN_cuDeviceGet_v2000);
    RESOLVE(cuDeviceGetName, "cuDeviceGetName", PFN_cuDeviceGetName_v2000);
    RESOLVE(cuDeviceTotalMem, "cuDeviceTotalMem_v2", PFN_cuDeviceTotalMem_v3020);
    RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute", PFN_cuDeviceGetAttribute_v2000);
    RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", PFN_cuDevicePrimaryCtxRetain_v7000);
    RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", PFN_cuDevicePrimaryCtxRelease_v11000);
    RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent", PFN_cuCtxGetCurrent_v4000);
    RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent", PFN_cuCtxSetCurrent_v4000);
    RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2", PFN_cuCtxPushCurrent_v4000);
    RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2", PFN_cuCtxPopCurrent_v4000);
    RESOLVE(cuCtxGetDevice, "cuCtxGetDevice", PFN_cuCtxGetDevice_v2000);
    RESOLVE(cuCtxSynchronize, "cuCtxSynchronize", PFN_cuCtxSynchronize_v2000);
    RESOLVE(cuMemGetInfo, "cuMemGetInfo_v2", PFN_cuMemGetInfo_v3020);
    RESOLVE(cuMemAlloc, "cuMemAlloc_v2", PFN_cuMemAlloc_v3020);
    RESOLVE(cuMemFree, "cuMemFree_v2", PFN_cuMemFree_v3020);
    RESOLVE(cuMemAllocAsync, "cuMemAllocAsync", PFN_cuMemAllocAsync_v11020);
    RESOLVE(cuMemFreeAsync, "cuMemFreeAsync", PFN_cuMemFreeAsync_v11020);
    RESOLVE(cuMemCreate, "cuMemCreate", PFN_cuMemCreate_v10020);
    RESOLVE(cuMemRelease, "cuMemRelease", PFN_cuMemRelease_v10020);
    RESOLVE(cuMemAddressReserve, "cuMemAddressReserve", PFN_cuMemAddressReserve_v10020);
    RESOLVE(cuMemAddressFree, "cuMemAddressFree", PFN_cuMemAddressFree_v10020);
    RESOLVE(cuMemMap, "cuMemMap", PFN_cuMemMap_v10020);
    RESOLVE(cuMemUnmap, "cuMemUnmap", PFN_cuMemUnmap_v10020);
    RESOLVE(cuMemSetAccess, "cuMemSetAccess", PFN_cuMemSetAccess_v10020);
    RESOLVE(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", PFN_cuMemGetAllocationGranularity_v10020);
    RESOLVE(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", PFN_cuMemRetainAllocationHandle_v11000);
    RESOLVE(cuEventCreate, "cuEventCreate", PFN_cuEventCreate_v2000);
    RESOLVE(cuEventRecord, "cuEventRecord", PFN_cuEventRecord_v2000);
    RESOLVE(cuEventQuery, "cuEventQuery", PFN_cuEventQuery_v2000);
    RESOLVE(cuEventSynchronize, "cuEventSynchronize", PFN_cuEventSynchronize_v2000);
    RESOLVE(cuEventDestroy, "cuEventDestroy_v2", PFN_cuEventDestroy_v4000);
    RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent", PFN_cuStreamWaitEvent_v3020);
    RESOLVE(cuGetProcAddress, "cuGetProcAddress_v2", PFN_cuGetProcAddress_v12000);
    RESOLVE(cuGetErrorString, "cuGetErrorString", PFN_cuGetErrorString_v6000);
    RESOLVE(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", PFN_cuDeviceCanAccessPeer_v4000);
    RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2", PFN_cuStreamDestroy_v4000);
    RESOLVE(cuMemGetAddressRange, "cuMemGetAddressRange_v2", PFN_cuMemGetAddressRange_v3020);
    RESOLVE(cuPointerGetAttribute, "cuPointerGetAttribute", PFN_cuPointerGetAttribute_v4000);
    RESOLVE(cuPointerGetAttributes, "cuPointerGetAttributes", PFN_cuPointerGetAttributes_v7000);
    RESOLVE(cuIpcGetMemHandle, "cuIpcGetMemHandle", PFN_cuIpcGetMemHandle_v4010);
    RESOLVE(cuStreamIsCapturing, "cuStreamIsCapturing", PFN_cuStreamIsCapturing_v10000);
    RESOLVE(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode",
            PFN_cuThreadExchangeStreamCaptureMode_v10010);
    RESOLVE(cuStreamGetCtx, "cuStreamGetCtx", PFN_cuStreamGetCtx_v9020);
    RESOLVE(cuStreamSynchronize, "cuStreamSynchronize", PFN_cuStreamSynchronize_v2000);
    RESOLVE(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", PFN_cuCtxEnablePeerAccess_v4000);
    RESOLVE(cuStreamBeginCapture, "cuStreamBeginCapture_v2", PFN_cuStreamBeginCapture_v10010);
    RESOLVE(cuStreamBeginCapture_ptsz, "cuStreamBeginCapture_v2_ptsz", PFN_cuStreamBeginCapture_v10010_ptsz);
    RESOLVE(cuStreamBeginCapture_v1, "cuStreamBeginCapture", PFN_cuStreamBeginCapture_v10000);
    RESOLVE(cuStreamBeginCapture_v1_ptsz, "cuStreamBeginCapture_ptsz", PFN_cuStreamBeginCapture_v10000_ptsz);
#if MSH_HAVE_TO_GRAPH
    RESOLVE(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", PFN_cuStreamBeginCaptureToGraph_v12030);
    RESOLVE(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph_ptsz",
            PFN_cuStreamBeginCaptureToGraph_v12030_ptsz);
#endif
    RESOLVE(cuStreamEndCapture, "cuStreamEndCapture", PFN_cuStreamEndCapture_v10000);
    RESOLVE(cuStreamEndCapture_ptsz, "cuStreamEndCapture_ptsz", PFN_cuStreamEndCapture_v10000_ptsz);
    RESOLVE(cuMemcpyDtoD, "cuMemcpyDtoD_v2", PFN_cuMemcpyDtoD_v3020);

    if (!msh_cu.cuInit || !msh_cu.cuCtxGetCurrent || !msh_cu.cuMemGetInfo) {
        msh_warn("libcuda.so.1 lacks cuInit/cuCtxGetCurrent/cuMemGetInfo_v2; passing through");
        load_rc = ENODEV;
        return;
    }
    CUresult r = MSH_DRV(cuInit, 0);
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
