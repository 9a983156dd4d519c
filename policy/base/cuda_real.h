/*
 * cuda_real.h: the real CUDA driver, resolved at run time (never linked).
 *
 * libmemshim.so must not have libcuda or libcudart as NEEDED (a preloaded library with a missing
 * dependency kills the host with exit 127). The driver is opened with dlopen("libcuda.so.1") and
 * each function is looked up by its versioned ABI name (cuMemAlloc_v2, ...) with a handle-based
 * dlsym, which never returns memshim's own exported hooks; each field has the type of the ABI its
 * symbol names (checked against cudaTypedefs.h, MSH_ABI_ASSERT). msh_cu is filled once; a function
 * the driver lacks stays NULL and its user falls back. The pool and the hooks call the driver
 * only through this table.
 *
 * policy/base/ is the ground floor every folder may use (msh.h says what it holds); it includes
 * nothing of memshim's outside policy/base.
 */
#ifndef MSH_CUDA_REAL_H
#define MSH_CUDA_REAL_H

#include <cuda.h>
#include <stdbool.h>

/* cuStreamBeginCaptureToGraph and its edge data came with CUDA 12.3: built against older headers,
 * memshim neither hooks nor calls it (a driver that has it is then not seen through that route). */
#define MSH_HAVE_TO_GRAPH (CUDA_VERSION >= 12030)

struct msh_cuda_driver {
    void *handle;
    bool loaded;
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);           /* _v2 */
    CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);                /* _v2 */
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxPushCurrent)(CUcontext);                    /* _v2 */
    CUresult (*cuCtxPopCurrent)(CUcontext *);                   /* _v2 */
    CUresult (*cuCtxGetDevice)(CUdevice *);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemGetInfo)(size_t *, size_t *);               /* _v2 */
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);              /* _v2 */
    CUresult (*cuMemFree)(CUdeviceptr);                         /* _v2 */
    CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
    CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                            unsigned long long);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                         unsigned long long);
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
    CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                              CUmemAllocationGranularity_flags);
    CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventDestroy)(CUevent);                        /* _v2 */
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*cuGetProcAddress)(const char *, void **, int, cuuint64_t,
                                 CUdriverProcAddressQueryResult *); /* _v2 */
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*cuStreamDestroy)(CUstream);                      /* _v2 */
    CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr); /* _v2 */
    CUresult (*cuPointerGetAttribute)(void *, CUpointer_attribute, CUdeviceptr);
    CUresult (*cuPointerGetAttributes)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr);
    CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*cuStreamIsCapturing)(CUstream, CUstreamCaptureStatus *);
    CUresult (*cuThreadExchangeStreamCaptureMode)(CUstreamCaptureMode *);
    CUresult (*cuStreamGetCtx)(CUstream, CUcontext *);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
    CUresult (*cuStreamBeginCapture)(CUstream, CUstreamCaptureMode);      /* _v2 */
    CUresult (*cuStreamBeginCapture_ptsz)(CUstream, CUstreamCaptureMode); /* _v2_ptsz */
    CUresult (*cuStreamBeginCapture_v1)(CUstream);                        /* CUDA 10.0: no mode */
    CUresult (*cuStreamBeginCapture_v1_ptsz)(CUstream);
#if MSH_HAVE_TO_GRAPH
    CUresult (*cuStreamBeginCaptureToGraph)(CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *,
                                            size_t, CUstreamCaptureMode);
    CUresult (*cuStreamBeginCaptureToGraph_ptsz)(CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *,
                                                 size_t, CUstreamCaptureMode);
#endif
    CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
    CUresult (*cuStreamEndCapture_ptsz)(CUstream, CUgraph *);
    CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);          /* _v2 */
};

extern struct msh_cuda_driver msh_cu;

/* MSH_ABI_ASSERT(fnptr, PFN, what): a build error when `fnptr` (a function pointer memshim calls
 * or hands out) is not of type PFN, cudaTypedefs.h's type of the ABI it is resolved as
 * (PFN_<name>_v<version>[_ptsz]). A driver symbol or a lookup at a version stands for one
 * signature: cuCtxGetDevice is (CUdevice *), what cuGetProcAddress gives for "cuCtxGetDevice" at
 * 13000 is cuCtxGetDevice_v2 (CUdevice *, CUcontext). Without cudaTypedefs.h (not every header set
 * has it) nothing is checked; the doubles' build always has it (docs/test-double.md). */
#if defined(__has_include)
#if __has_include(<cudaTypedefs.h>)
#include <cudaTypedefs.h>
#define MSH_HAVE_CUDA_TYPEDEFS 1
#endif
#endif
/* CUDA 10.0's cuStreamBeginCapture (no capture mode): cudaTypedefs.h declares its type only for the
 * driver's own build (__CUDA_API_VERSION_INTERNAL); written here as the header writes it (C11
 * allows the same typedef twice, should a header declare it too). */
typedef CUresult (CUDAAPI *PFN_cuStreamBeginCapture_v10000)(CUstream hStream);
typedef CUresult (CUDAAPI *PFN_cuStreamBeginCapture_v10000_ptsz)(CUstream hStream);

#ifdef MSH_HAVE_CUDA_TYPEDEFS
#define MSH_ABI_ASSERT(fnptr, pfn, what)                                                        \
    _Static_assert(__builtin_types_compatible_p(__typeof__(fnptr), pfn),                         \
                   what ": not the signature of cudaTypedefs.h's " #pfn)
#else
#define MSH_ABI_ASSERT(fnptr, pfn, what) _Static_assert(1, what)
#endif

/* Open the driver and fill msh_cu (once, thread-safe). Returns 0, or ENODEV when libcuda.so.1
 * cannot be opened or cuInit fails (a CPU-only process): the caller then passes through. */
int msh_cuda_load(void);
/* A short name for a CUresult ("CUDA_ERROR_OUT_OF_MEMORY"), usable before the driver loads. */
const char *msh_cuda_errname(CUresult r);

#endif
