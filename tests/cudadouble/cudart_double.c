/*
 * cudart_double.c: a small test double of the CUDA runtime (built as libcudart.so.13) for test
 * programs run on the driver double. Like the real libcudart 13 it does not link libcuda: it
 * dlopens libcuda.so.1, looks up only cuGetProcAddress_v2 with dlsym on that handle, and gets
 * every other driver function through it, which is how the real runtime bypasses a driver symbol
 * that an LD_PRELOADed library exports (memshim must hook cuGetProcAddress to see these calls).
 * It keeps the runtime's habits that matter to an allocator: a per-device primary context made
 * current on first use, cudaFree that synchronizes the device, stream-ordered cudaMallocAsync,
 * a per-thread last error. It must never call a driver function it did not get from
 * cuGetProcAddress_v2, never link or dlsym other libcuda symbols, and never emulate device
 * memory itself (the driver, real or double, owns every byte).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cudbl.h" /* only for cudaTypedefs.h and the typedefs of ABIs newer than the headers */

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RUNTIME_VERSION 13000
#define MAX_DEVICES 16

/* The driver functions the runtime takes through cuGetProcAddress_v2 at RUNTIME_VERSION: (field,
 * base name, version), where version is the newest cudaTypedefs.h PFN_<name>_v<version> at or below
 * RUNTIME_VERSION, so each field has the type of what the driver returns for that name at that
 * version (tests/cudadouble/test_abi.py checks the versions against the header). At 13000
 * cuCtxGetDevice is cuCtxGetDevice_v2(CUdevice *, CUcontext) and cuCtxSynchronize is
 * cuCtxSynchronize_v2(CUcontext): calling them with their old signatures passed a stale register
 * as the context, which crashed the real driver (DESIGN.md 10). Field names avoid cuda.h's
 * macros. cuGraphInstantiateWithFlags is asked for by that name: "cuGraphInstantiate" means it
 * only from 12000 (cuda.h's #define) and has no PFN typedef of its own there. */
#define DRIVER_FUNCS(X)                                                                         \
    X(init, cuInit, 2000)                                                                       \
    X(driverGetVersion, cuDriverGetVersion, 2020)                                               \
    X(deviceGetCount, cuDeviceGetCount, 2000)                                                   \
    X(deviceGetAttribute, cuDeviceGetAttribute, 2000)                                           \
    X(primaryCtxRetain, cuDevicePrimaryCtxRetain, 7000)                                         \
    X(ctxGetCurrent, cuCtxGetCurrent, 4000)                                                     \
    X(ctxSetCurrent, cuCtxSetCurrent, 4000)                                                     \
    X(ctxGetDevice, cuCtxGetDevice, 13000)                                                      \
    X(ctxSynchronize, cuCtxSynchronize, 13000)                                                  \
    X(memGetInfo, cuMemGetInfo, 3020)                                                           \
    X(memAlloc, cuMemAlloc, 3020)                                                               \
    X(memFree, cuMemFree, 3020)                                                                 \
    X(memAllocAsync, cuMemAllocAsync, 11020)                                                    \
    X(memFreeAsync, cuMemFreeAsync, 11020)                                                      \
    X(streamCreate, cuStreamCreate, 2000)                                                       \
    X(streamDestroy, cuStreamDestroy, 4000)                                                     \
    X(streamSynchronize, cuStreamSynchronize, 2000)                                             \
    X(streamQuery, cuStreamQuery, 2000)                                                         \
    X(streamWaitEvent, cuStreamWaitEvent, 3020)                                                 \
    X(launchHostFunc, cuLaunchHostFunc, 10000)                                                  \
    X(eventCreate, cuEventCreate, 2000)                                                         \
    X(eventRecord, cuEventRecord, 2000)                                                         \
    X(eventQuery, cuEventQuery, 2000)                                                           \
    X(eventSynchronize, cuEventSynchronize, 2000)                                               \
    X(eventDestroy, cuEventDestroy, 4000)                                                       \
    X(eventElapsedTime, cuEventElapsedTime, 12080)                                              \
    X(memcpy_, cuMemcpy, 4000)                                                                  \
    X(memcpyAsync, cuMemcpyAsync, 4000)                                                         \
    X(memsetD8, cuMemsetD8, 3020)                                                               \
    X(memsetD8Async, cuMemsetD8Async, 3020)                                                     \
    X(memcpyPeer, cuMemcpyPeer, 4000)                                                           \
    X(memcpyPeerAsync, cuMemcpyPeerAsync, 4000)                                                 \
    X(canAccessPeer, cuDeviceCanAccessPeer, 4000)                                               \
    X(ctxEnablePeerAccess, cuCtxEnablePeerAccess, 4000)                                         \
    X(ctxDisablePeerAccess, cuCtxDisablePeerAccess, 4000)                                       \
    X(ipcGetMemHandle, cuIpcGetMemHandle, 4010)                                                 \
    X(ipcOpenMemHandle, cuIpcOpenMemHandle, 11000)                                              \
    X(ipcCloseMemHandle, cuIpcCloseMemHandle, 4010)                                             \
    X(pointerGetAttributes, cuPointerGetAttributes, 7000)                                       \
    X(streamBeginCapture, cuStreamBeginCapture, 10010)                                          \
    X(streamBeginCaptureToGraph, cuStreamBeginCaptureToGraph, 12030)                            \
    X(graphCreate, cuGraphCreate, 10000)                                                        \
    X(streamEndCapture, cuStreamEndCapture, 10000)                                              \
    X(streamIsCapturing, cuStreamIsCapturing, 10000)                                            \
    X(streamGetCaptureInfo, cuStreamGetCaptureInfo, 12030)                                      \
    X(threadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode, 10010)                \
    X(graphInstantiate, cuGraphInstantiateWithFlags, 11040)                                     \
    X(graphLaunch, cuGraphLaunch, 10000)                                                        \
    X(graphExecDestroy, cuGraphExecDestroy, 10000)                                              \
    X(graphDestroy, cuGraphDestroy, 10000)

#define DRIVER_FIELD(field, name, ver) PFN_##name##_v##ver field;
static struct {
    DRIVER_FUNCS(DRIVER_FIELD)
    PFN_cuGetProcAddress_v12000 getProcAddress; /* cuGetProcAddress_v2, the one dlsym */
} drv;
#undef DRIVER_FIELD

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static cudaError_t init_error = cudaErrorInitializationError;
static int device_count;
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;
static void rt_fork_prepare(void) { pthread_mutex_lock(&primary_lock); }
static void rt_fork_release(void) { pthread_mutex_unlock(&primary_lock); }
__attribute__((constructor)) static void rt_register_fork_handlers(void)
{
    pthread_atfork(rt_fork_prepare, rt_fork_release, rt_fork_release);
}
static CUcontext primary[MAX_DEVICES];

static __thread cudaError_t tls_last_error;
static __thread int tls_device;     /* used when no context is current */

static cudaError_t map_error(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUDA_ERROR_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case CUDA_ERROR_NOT_INITIALIZED: return cudaErrorInitializationError;
    case CUDA_ERROR_DEINITIALIZED: return cudaErrorCudartUnloading;
    case CUDA_ERROR_NO_DEVICE: return cudaErrorNoDevice;
    case CUDA_ERROR_INVALID_DEVICE: return cudaErrorInvalidDevice;
    case CUDA_ERROR_INVALID_CONTEXT: return cudaErrorDeviceUninitialized;
    case CUDA_ERROR_INVALID_HANDLE: return cudaErrorInvalidResourceHandle;
    case CUDA_ERROR_NOT_FOUND: return cudaErrorSymbolNotFound;
    case CUDA_ERROR_NOT_READY: return cudaErrorNotReady;
    case CUDA_ERROR_ILLEGAL_ADDRESS: return cudaErrorIllegalAddress;
    case CUDA_ERROR_NOT_PERMITTED: return cudaErrorNotPermitted;
    case CUDA_ERROR_NOT_SUPPORTED: return cudaErrorNotSupported;
    case CUDA_ERROR_CONTEXT_IS_DESTROYED: return cudaErrorContextIsDestroyed;
    case CUDA_ERROR_TIMEOUT: return cudaErrorTimeout;
    case CUDA_ERROR_ILLEGAL_STATE: return cudaErrorIllegalState;
    case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: return cudaErrorPeerAccessUnsupported;
    case CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: return cudaErrorPeerAccessAlreadyEnabled;
    case CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: return cudaErrorPeerAccessNotEnabled;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return cudaErrorStreamCaptureUnsupported;
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return cudaErrorStreamCaptureInvalidated;
    case CUDA_ERROR_STREAM_CAPTURE_MERGE: return cudaErrorStreamCaptureMerge;
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: return cudaErrorStreamCaptureUnmatched;
    case CUDA_ERROR_STREAM_CAPTURE_UNJOINED: return cudaErrorStreamCaptureUnjoined;
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION: return cudaErrorStreamCaptureIsolation;
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return cudaErrorStreamCaptureImplicit;
    case CUDA_ERROR_CAPTURED_EVENT: return cudaErrorCapturedEvent;
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: return cudaErrorStreamCaptureWrongThread;
    default: return cudaErrorUnknown;
    }
}

/* Every API returns through here: the per-thread last error keeps the latest failure
 * (cudaErrorNotReady is a status, not an error, as in the real runtime). */
static cudaError_t ret(cudaError_t e)
{
    if (e != cudaSuccess && e != cudaErrorNotReady) tls_last_error = e;
    return e;
}

static cudaError_t ret_cu(CUresult r)
{
    return ret(map_error(r));
}

static int resolve(const char *name, void **slot)
{
    CUdriverProcAddressQueryResult status;
    return drv.getProcAddress(name, slot, RUNTIME_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status) ==
               CUDA_SUCCESS && *slot;
}

static void load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) { init_error = cudaErrorInsufficientDriver; return; }
    /* the only symbol taken by name; the rest come through it, like the real runtime */
    *(void **)&drv.getProcAddress = dlsym(h, "cuGetProcAddress_v2");
    if (!drv.getProcAddress) { init_error = cudaErrorInsufficientDriver; return; }
    int ok = 1;
#define RESOLVE(field, name, ver) ok &= resolve(#name, (void **)&drv.field);
    DRIVER_FUNCS(RESOLVE)
#undef RESOLVE
    if (!ok) { init_error = cudaErrorInsufficientDriver; return; }
    CUresult r = drv.init(0);
    if (r != CUDA_SUCCESS) { init_error = map_error(r); return; }
    r = drv.deviceGetCount(&device_count);
    if (r != CUDA_SUCCESS) { init_error = map_error(r); return; }
    if (device_count <= 0) { init_error = cudaErrorNoDevice; return; }
    if (device_count > MAX_DEVICES) device_count = MAX_DEVICES;
    init_error = cudaSuccess;
}

static cudaError_t rt_init(void)
{
    pthread_once(&init_once, load_driver);
    return init_error;
}

static cudaError_t primary_of(int dev, CUcontext *out)
{
    pthread_mutex_lock(&primary_lock);
    CUresult r = CUDA_SUCCESS;
    if (!primary[dev]) r = drv.primaryCtxRetain(&primary[dev], dev);
    *out = primary[dev];
    pthread_mutex_unlock(&primary_lock);
    return map_error(r);
}

/* Initialize the runtime and make sure the calling thread has a current context: the one
 * already current (set through the driver API, say), else the primary context of this thread's
 * device, made current as the real runtime does on first use. */
static cudaError_t ensure_context(void)
{
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return e;
    CUcontext c = NULL;
    if (drv.ctxGetCurrent(&c) == CUDA_SUCCESS && c) return cudaSuccess;
    e = primary_of(tls_device, &c);
    if (e != cudaSuccess) return e;
    return map_error(drv.ctxSetCurrent(c));
}

#define NEED_CONTEXT()                                                                          \
    do {                                                                                        \
        cudaError_t need_e_ = ensure_context();                                                 \
        if (need_e_ != cudaSuccess) return ret(need_e_);                                        \
    } while (0)

/* ---- devices --------------------------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaGetDeviceCount(int *count)
{
    if (!count) return ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    if (e != cudaSuccess) { *count = 0; return ret(e); }
    *count = device_count;
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device)
{
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    if (device < 0 || device >= device_count) return ret(cudaErrorInvalidDevice);
    CUcontext c;
    e = primary_of(device, &c);
    if (e != cudaSuccess) return ret(e);
    e = map_error(drv.ctxSetCurrent(c));
    if (e == cudaSuccess) tls_device = device;
    return ret(e);
}

cudaError_t CUDARTAPI cudaGetDevice(int *device)
{
    if (!device) return ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    CUcontext c = NULL;
    CUdevice d;
    if (drv.ctxGetCurrent(&c) == CUDA_SUCCESS && c && drv.ctxGetDevice(&d, c) == CUDA_SUCCESS)
        *device = d;
    else
        *device = tls_device;
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.deviceGetAttribute(value, (CUdevice_attribute)attr, device));
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void)
{
    NEED_CONTEXT();
    return ret_cu(drv.ctxSynchronize(NULL)); /* NULL: the current context */
}

cudaError_t CUDARTAPI cudaRuntimeGetVersion(int *runtimeVersion)
{
    if (!runtimeVersion) return ret(cudaErrorInvalidValue);
    *runtimeVersion = RUNTIME_VERSION;
    return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDriverGetVersion(int *driverVersion)
{
    if (!driverVersion) return ret(cudaErrorInvalidValue);
    if (rt_init() != cudaSuccess && !drv.driverGetVersion) { *driverVersion = 0; return cudaSuccess; }
    return ret_cu(drv.driverGetVersion(driverVersion));
}

/* ---- memory ---------------------------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    NEED_CONTEXT();
    return ret_cu(drv.memGetInfo(free_bytes, total));
}

cudaError_t CUDARTAPI cudaMalloc(void **devPtr, size_t size)
{
    if (!devPtr) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    if (size == 0) { *devPtr = NULL; return cudaSuccess; }
    CUdeviceptr p = 0;
    CUresult r = drv.memAlloc(&p, size);
    if (r == CUDA_SUCCESS) *devPtr = (void *)(uintptr_t)p;
    return ret_cu(r);
}

/* cudaFree(NULL) only initializes; a real free waits for the device first. */
cudaError_t CUDARTAPI cudaFree(void *devPtr)
{
    NEED_CONTEXT();
    if (!devPtr) return cudaSuccess;
    CUresult r = drv.ctxSynchronize(NULL);
    if (r == CUDA_SUCCESS) r = drv.memFree((CUdeviceptr)(uintptr_t)devPtr);
    return ret_cu(r);
}

static cudaError_t malloc_async(void **devPtr, size_t size, cudaStream_t stream)
{
    if (!devPtr) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    if (size == 0) { *devPtr = NULL; return cudaSuccess; }
    CUdeviceptr p = 0;
    CUresult r = drv.memAllocAsync(&p, size, (CUstream)stream);
    if (r == CUDA_SUCCESS) *devPtr = (void *)(uintptr_t)p;
    return ret_cu(r);
}

static cudaError_t free_async(void *devPtr, cudaStream_t stream)
{
    NEED_CONTEXT();
    if (!devPtr) return cudaSuccess;
    return ret_cu(drv.memFreeAsync((CUdeviceptr)(uintptr_t)devPtr, (CUstream)stream));
}

cudaError_t CUDARTAPI cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream)
{
    return malloc_async(devPtr, size, hStream);
}

cudaError_t CUDARTAPI cudaFreeAsync(void *devPtr, cudaStream_t hStream)
{
    return free_async(devPtr, hStream);
}

/* _ptsz: the entry points of code built with per-thread default streams (NULL = per-thread). */
#define PTSZ_STREAM(s) ((s) == NULL ? cudaStreamPerThread : (s))
cudaError_t CUDARTAPI cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t CUDARTAPI cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream)
{
    return malloc_async(devPtr, size, PTSZ_STREAM(hStream));
}

cudaError_t CUDARTAPI cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream);
cudaError_t CUDARTAPI cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream)
{
    return free_async(devPtr, PTSZ_STREAM(hStream));
}

/* Copies and sets go through the driver, which decides what each device may touch (the current
 * device for synchronous ones, the stream's device for asynchronous ones). The copy kind is
 * checked, then unified addressing decides, as in the real runtime with cudaMemcpyDefault. */
#define DPTR(p) ((CUdeviceptr)(uintptr_t)(p))

cudaError_t CUDARTAPI cudaMemset(void *devPtr, int value, size_t count)
{
    NEED_CONTEXT();
    return ret_cu(drv.memsetD8(DPTR(devPtr), (unsigned char)value, count));
}

cudaError_t CUDARTAPI cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    if ((unsigned)kind > cudaMemcpyDefault) return ret(cudaErrorInvalidMemcpyDirection);
    NEED_CONTEXT();
    return ret_cu(drv.memcpy_(DPTR(dst), DPTR(src), count));
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                      enum cudaMemcpyKind kind, cudaStream_t stream)
{
    if ((unsigned)kind > cudaMemcpyDefault) return ret(cudaErrorInvalidMemcpyDirection);
    NEED_CONTEXT();
    return ret_cu(drv.memcpyAsync(DPTR(dst), DPTR(src), count, (CUstream)stream));
}

cudaError_t CUDARTAPI cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.memsetD8Async(DPTR(devPtr), (unsigned char)value, count, (CUstream)stream));
}

static int device_ok(int d) { return d >= 0 && d < device_count; }

cudaError_t CUDARTAPI cudaMemcpyPeer(void *dst, int dstDevice, const void *src, int srcDevice, size_t count)
{
    NEED_CONTEXT();
    if (!device_ok(dstDevice) || !device_ok(srcDevice)) return ret(cudaErrorInvalidDevice);
    CUcontext dc, sc;
    cudaError_t e = primary_of(dstDevice, &dc);
    if (e == cudaSuccess) e = primary_of(srcDevice, &sc);
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.memcpyPeer(DPTR(dst), dc, DPTR(src), sc, count));
}

cudaError_t CUDARTAPI cudaMemcpyPeerAsync(void *dst, int dstDevice, const void *src, int srcDevice,
                                          size_t count, cudaStream_t stream)
{
    NEED_CONTEXT();
    if (!device_ok(dstDevice) || !device_ok(srcDevice)) return ret(cudaErrorInvalidDevice);
    CUcontext dc, sc;
    cudaError_t e = primary_of(dstDevice, &dc);
    if (e == cudaSuccess) e = primary_of(srcDevice, &sc);
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.memcpyPeerAsync(DPTR(dst), dc, DPTR(src), sc, count, (CUstream)stream));
}

/* ---- peers, IPC, pointer attributes -------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaDeviceCanAccessPeer(int *canAccessPeer, int device, int peerDevice)
{
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.canAccessPeer(canAccessPeer, device, peerDevice));
}

cudaError_t CUDARTAPI cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags)
{
    NEED_CONTEXT();
    if (!device_ok(peerDevice)) return ret(cudaErrorInvalidDevice);
    CUcontext pc;
    cudaError_t e = primary_of(peerDevice, &pc);
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.ctxEnablePeerAccess(pc, flags));
}

cudaError_t CUDARTAPI cudaDeviceDisablePeerAccess(int peerDevice)
{
    NEED_CONTEXT();
    if (!device_ok(peerDevice)) return ret(cudaErrorInvalidDevice);
    CUcontext pc;
    cudaError_t e = primary_of(peerDevice, &pc);
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.ctxDisablePeerAccess(pc));
}

cudaError_t CUDARTAPI cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr)
{
    if (!handle) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    return ret_cu(drv.ipcGetMemHandle((CUipcMemHandle *)handle, DPTR(devPtr)));
}

cudaError_t CUDARTAPI cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags)
{
    if (!devPtr) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    CUipcMemHandle h;
    memcpy(&h, &handle, sizeof h);
    CUdeviceptr p = 0;
    CUresult r = drv.ipcOpenMemHandle(&p, h, flags);
    if (r == CUDA_SUCCESS) *devPtr = (void *)(uintptr_t)p;
    return ret_cu(r);
}

cudaError_t CUDARTAPI cudaIpcCloseMemHandle(void *devPtr)
{
    NEED_CONTEXT();
    return ret_cu(drv.ipcCloseMemHandle(DPTR(devPtr)));
}

/* Unregistered host memory is not an error (CUDA 11 and later): type cudaMemoryTypeUnregistered. */
cudaError_t CUDARTAPI cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr)
{
    if (!attributes) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    unsigned int type = 0;
    int ordinal = -2;
    CUdeviceptr dp = 0;
    CUpointer_attribute which[3] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                    CU_POINTER_ATTRIBUTE_DEVICE_POINTER};
    void *out[3] = {&type, &ordinal, &dp};
    CUresult r = drv.pointerGetAttributes(3, which, out, DPTR(ptr));
    if (r != CUDA_SUCCESS) return ret_cu(r);
    memset(attributes, 0, sizeof *attributes);
    if (type == CU_MEMORYTYPE_DEVICE) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = ordinal;
        attributes->devicePointer = (void *)(uintptr_t)dp;
    } else {
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
        attributes->hostPointer = (void *)ptr;
    }
    return cudaSuccess;
}

/* ---- stream capture and graphs -------------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamBeginCapture((CUstream)stream, (CUstreamCaptureMode)mode));
}

cudaError_t CUDARTAPI cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamEndCapture((CUstream)stream, (CUgraph *)pGraph));
}

/* CUDA 12.3: a capture that appends to an existing graph (the driver's, through the table). */
cudaError_t CUDARTAPI cudaStreamBeginCaptureToGraph(cudaStream_t stream, cudaGraph_t graph,
                                                    const cudaGraphNode_t *dependencies,
                                                    const cudaGraphEdgeData *dependencyData, size_t numDependencies,
                                                    enum cudaStreamCaptureMode mode)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamBeginCaptureToGraph((CUstream)stream, (CUgraph)graph, (const CUgraphNode *)dependencies,
                                                (const CUgraphEdgeData *)dependencyData, numDependencies,
                                                (CUstreamCaptureMode)mode));
}

/* The per-thread default stream forms of the capture calls (libcudart 13 exports them): NULL is the
 * calling thread's default stream, handed to the driver as CU_STREAM_PER_THREAD. */
cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    return cudaStreamBeginCapture(PTSZ_STREAM(stream), mode);
}

cudaError_t CUDARTAPI cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t stream, cudaGraph_t graph,
                                                         const cudaGraphNode_t *dependencies,
                                                         const cudaGraphEdgeData *dependencyData,
                                                         size_t numDependencies, enum cudaStreamCaptureMode mode);
cudaError_t CUDARTAPI cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t stream, cudaGraph_t graph,
                                                         const cudaGraphNode_t *dependencies,
                                                         const cudaGraphEdgeData *dependencyData,
                                                         size_t numDependencies, enum cudaStreamCaptureMode mode)
{
    return cudaStreamBeginCaptureToGraph(PTSZ_STREAM(stream), graph, dependencies, dependencyData, numDependencies,
                                         mode);
}

cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph);
cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph)
{
    return cudaStreamEndCapture(PTSZ_STREAM(stream), pGraph);
}

cudaError_t CUDARTAPI cudaGraphCreate(cudaGraph_t *pGraph, unsigned int flags)
{
    NEED_CONTEXT();
    return ret_cu(drv.graphCreate((CUgraph *)pGraph, flags));
}

cudaError_t CUDARTAPI cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *pCaptureStatus)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamIsCapturing((CUstream)stream, (CUstreamCaptureStatus *)pCaptureStatus));
}

cudaError_t CUDARTAPI cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus *status,
                                               unsigned long long *id, cudaGraph_t *graph,
                                               const cudaGraphNode_t **deps, const cudaGraphEdgeData **edges,
                                               size_t *ndeps)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamGetCaptureInfo((CUstream)stream, (CUstreamCaptureStatus *)status, (cuuint64_t *)id,
                                           (CUgraph *)graph, (const CUgraphNode **)deps,
                                           (const CUgraphEdgeData **)edges, ndeps));
}

cudaError_t CUDARTAPI cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode)
{
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    return ret_cu(drv.threadExchangeStreamCaptureMode((CUstreamCaptureMode *)mode));
}

cudaError_t CUDARTAPI cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph, unsigned long long flags)
{
    NEED_CONTEXT();
    return ret_cu(drv.graphInstantiate((CUgraphExec *)pGraphExec, (CUgraph)graph, flags));
}

cudaError_t CUDARTAPI cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.graphLaunch((CUgraphExec)graphExec, (CUstream)stream));
}

cudaError_t CUDARTAPI cudaGraphExecDestroy(cudaGraphExec_t graphExec)
{
    NEED_CONTEXT();
    return ret_cu(drv.graphExecDestroy((CUgraphExec)graphExec));
}

cudaError_t CUDARTAPI cudaGraphDestroy(cudaGraph_t graph)
{
    NEED_CONTEXT();
    return ret_cu(drv.graphDestroy((CUgraph)graph));
}

cudaError_t CUDARTAPI cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData)
{
    NEED_CONTEXT();
    return ret_cu(drv.launchHostFunc((CUstream)stream, fn, userData));
}

/* ---- streams and events ---------------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags)
{
    if (!pStream) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    return ret_cu(drv.streamCreate((CUstream *)pStream, flags));
}

cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t *pStream)
{
    return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamDestroy((CUstream)stream));
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamSynchronize((CUstream)stream));
}

cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamQuery((CUstream)stream));
}

cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
    NEED_CONTEXT();
    return ret_cu(drv.streamWaitEvent((CUstream)stream, (CUevent)event, flags));
}

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    if (!event) return ret(cudaErrorInvalidValue);
    NEED_CONTEXT();
    return ret_cu(drv.eventCreate((CUevent *)event, flags));
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t *event)
{
    return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    NEED_CONTEXT();
    return ret_cu(drv.eventRecord((CUevent)event, (CUstream)stream));
}

cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event)
{
    NEED_CONTEXT();
    return ret_cu(drv.eventQuery((CUevent)event));
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event)
{
    NEED_CONTEXT();
    return ret_cu(drv.eventSynchronize((CUevent)event));
}

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event)
{
    NEED_CONTEXT();
    return ret_cu(drv.eventDestroy((CUevent)event));
}

cudaError_t CUDARTAPI cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    NEED_CONTEXT();
    return ret_cu(drv.eventElapsedTime(ms, (CUevent)start, (CUevent)end));
}

/* ---- driver entry points --------------------------------------------------------------------- */

static cudaError_t entry_point(const char *symbol, void **funcPtr, int version,
                               unsigned long long flags, enum cudaDriverEntryPointQueryResult *st)
{
    if (!symbol || !funcPtr) return ret(cudaErrorInvalidValue);
    if (flags & ~(unsigned long long)(cudaEnableLegacyStream | cudaEnablePerThreadDefaultStream))
        return ret(cudaErrorInvalidValue);
    cudaError_t e = rt_init();
    if (e != cudaSuccess) return ret(e);
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *funcPtr = NULL;
    CUresult r = drv.getProcAddress(symbol, funcPtr, version, (cuuint64_t)flags, &status);
    if (r != CUDA_SUCCESS) *funcPtr = NULL;
    /* like the real runtime: a symbol that is not found is cudaSuccess with a NULL pointer */
    if (st) *st = (enum cudaDriverEntryPointQueryResult)status;
    return r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_FOUND ? cudaSuccess : ret_cu(r);
}

cudaError_t CUDARTAPI cudaGetDriverEntryPoint(const char *symbol, void **funcPtr,
                                              unsigned long long flags,
                                              enum cudaDriverEntryPointQueryResult *driverStatus)
{
    return entry_point(symbol, funcPtr, RUNTIME_VERSION, flags, driverStatus);
}

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr,
                                                       unsigned int cudaVersion,
                                                       unsigned long long flags,
                                                       enum cudaDriverEntryPointQueryResult *driverStatus)
{
    return entry_point(symbol, funcPtr, (int)cudaVersion, flags, driverStatus);
}

/* cudaEnableDefault means per-thread for code built with per-thread default streams. */
static unsigned long long ptsz_flags(unsigned long long flags)
{
    return flags == cudaEnableDefault ? cudaEnablePerThreadDefaultStream : flags;
}

cudaError_t CUDARTAPI cudaGetDriverEntryPoint_ptsz(const char *symbol, void **funcPtr,
                                                   unsigned long long flags,
                                                   enum cudaDriverEntryPointQueryResult *driverStatus);
cudaError_t CUDARTAPI cudaGetDriverEntryPoint_ptsz(const char *symbol, void **funcPtr,
                                                   unsigned long long flags,
                                                   enum cudaDriverEntryPointQueryResult *driverStatus)
{
    return entry_point(symbol, funcPtr, RUNTIME_VERSION, ptsz_flags(flags), driverStatus);
}

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion_ptsz(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus);
cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion_ptsz(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus)
{
    return entry_point(symbol, funcPtr, (int)cudaVersion, ptsz_flags(flags), driverStatus);
}

/* ---- errors ---------------------------------------------------------------------------------- */

cudaError_t CUDARTAPI cudaGetLastError(void)
{
    cudaError_t e = tls_last_error;
    tls_last_error = cudaSuccess;
    return e;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void)
{
    return tls_last_error;
}

struct rt_err { cudaError_t code; const char *name, *text; };
static const struct rt_err rt_errors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorCudartUnloading, "cudaErrorCudartUnloading", "driver shutting down"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorDeviceUninitialized, "cudaErrorDeviceUninitialized", "invalid device context"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorSymbolNotFound, "cudaErrorSymbolNotFound", "named symbol not found"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorContextIsDestroyed, "cudaErrorContextIsDestroyed", "context is destroyed"},
    {cudaErrorNotPermitted, "cudaErrorNotPermitted", "operation not permitted"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorTimeout, "cudaErrorTimeout", "wait operation timed out"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation is not permitted in the current state"},
    {cudaErrorPeerAccessUnsupported, "cudaErrorPeerAccessUnsupported",
     "peer access is not supported between these two devices"},
    {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled", "peer access is already enabled"},
    {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureMerge, "cudaErrorStreamCaptureMerge",
     "operation would result in a merge of separate capture sequences"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorCapturedEvent, "cudaErrorCapturedEvent",
     "operation not permitted on an event last recorded in a capturing stream"},
    {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

static const struct rt_err *rt_err_find(cudaError_t e)
{
    for (size_t i = 0; i < sizeof rt_errors / sizeof rt_errors[0]; i++)
        if (rt_errors[i].code == e) return &rt_errors[i];
    return NULL;
}

const char *CUDARTAPI cudaGetErrorName(cudaError_t error)
{
    const struct rt_err *e = rt_err_find(error);
    return e ? e->name : "cudaErrorUnknown";
}

const char *CUDARTAPI cudaGetErrorString(cudaError_t error)
{
    const struct rt_err *e = rt_err_find(error);
    return e ? e->text : "unrecognized error code";
}
