/*
 * runtime.c: memshim's exported CUDA runtime hooks (cudaMalloc, cudaFree, cudaMemGetInfo, the
 * stream-ordered cudaMallocAsync/cudaFreeAsync and the driver entry-point lookups, each with its
 * _ptsz twin that per-thread-default-stream builds call).
 *
 * This is where a PyTorch segment (segment mode) or any other library's cudaMalloc enters the
 * pool: hook, then msh_core_pool, then msh_pool_alloc. memshim never links libcudart: the real
 * runtime functions are found with dlsym(RTLD_NEXT) (and, when the program's libcudart was
 * dlopen'ed locally so RTLD_NEXT cannot see it, in the already-loaded libcudart). A hook must
 * never fail a call that the real runtime could serve because of memshim: any pool error other
 * than "no room" falls back to the real allocator, and a missing real function makes only the
 * hook that needs it return cudaErrorInitializationError, with one warning naming it.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "core.h"
#include "cuda_real.h"
#include "drvlog.h"
#include "hooks.h"
#include "msh.h"
#include "pool.h"

/* The per-thread-default-stream twins exported by libcudart 13; cuda_runtime_api.h declares them
 * only when CUDA_API_PER_THREAD_DEFAULT_STREAM renames the plain names, which we must not do. */
cudaError_t CUDARTAPI cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t CUDARTAPI cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream);
cudaError_t CUDARTAPI cudaGetDriverEntryPoint_ptsz(const char *symbol, void **funcPtr,
                                                   unsigned long long flags,
                                                   enum cudaDriverEntryPointQueryResult *driverStatus);
cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph);
#if CUDART_VERSION >= 12030
cudaError_t CUDARTAPI cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t stream, cudaGraph_t graph,
                                                         const cudaGraphNode_t *dependencies,
                                                         const cudaGraphEdgeData *dependencyData,
                                                         size_t numDependencies, enum cudaStreamCaptureMode mode);
#define RT_TO_GRAPH(X) X(cudaStreamBeginCaptureToGraph) X(cudaStreamBeginCaptureToGraph_ptsz)
#else
#define RT_TO_GRAPH(X)
#endif
cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion_ptsz(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus);

/* ---- the real runtime ---------------------------------------------------------------------- */
#define RT_FUNCS(X)                                                                         \
    X(cudaMalloc) X(cudaFree) X(cudaMemGetInfo) X(cudaMallocAsync) X(cudaFreeAsync)         \
    X(cudaMallocAsync_ptsz) X(cudaFreeAsync_ptsz) X(cudaGetDriverEntryPoint)                \
    X(cudaGetDriverEntryPoint_ptsz) X(cudaGetDriverEntryPointByVersion)                     \
    X(cudaGetDriverEntryPointByVersion_ptsz) X(cudaGetDevice) X(cudaSetDevice)              \
    X(cudaDeviceSynchronize) X(cudaStreamDestroy) X(cudaPointerGetAttributes)                \
    X(cudaIpcGetMemHandle) X(cudaDeviceEnablePeerAccess) X(cudaStreamBeginCapture)           \
    X(cudaStreamBeginCapture_ptsz) X(cudaStreamEndCapture) X(cudaStreamEndCapture_ptsz)        \
    RT_TO_GRAPH(X)

enum rt_fn {
#define X(name) RT_##name,
    RT_FUNCS(X)
#undef X
    RT_NFUNCS
};
static const char *const rt_names[RT_NFUNCS] = {
#define X(name) #name,
    RT_FUNCS(X)
#undef X
};
static _Atomic(void *) rt_ptr[RT_NFUNCS];
static _Atomic int rt_reported[RT_NFUNCS];
static pthread_once_t rt_once = PTHREAD_ONCE_INIT;

struct cudart_find { char path[4096]; };

static int find_cudart(struct dl_phdr_info *info, size_t size MSH_UNUSED, void *arg)
{
    struct cudart_find *f = arg;
    const char *name = info->dlpi_name, *base;
    if (!name || !*name) return 0;
    base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, "libcudart.so", 12) != 0) return 0;
    size_t n = strlen(name);
    if (n >= sizeof f->path) return 0;
    memcpy(f->path, name, n + 1);
    return 1;
}

/* A real runtime function: the next definition after memshim in the global scope, else the one
 * in a libcudart that is loaded but not global (Python extensions are dlopen'ed RTLD_LOCAL).
 * RTLD_NOLOAD: memshim never loads a runtime itself. */
static void *rt_lookup(const char *name)
{
    void *p = dlsym(RTLD_NEXT, name);
    if (p) return p;
    struct cudart_find f = {{0}};
    if (!dl_iterate_phdr(find_cudart, &f)) return NULL;
    void *h = dlopen(f.path, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return NULL;
    p = dlsym(h, name);
    dlclose(h); /* the program's own reference keeps it loaded */
    return p;
}

static void rt_resolve_all(void)
{
    for (int i = 0; i < RT_NFUNCS; i++)
        atomic_store_explicit(&rt_ptr[i], rt_lookup(rt_names[i]), memory_order_release);
}

/* The real function `i`, or NULL after one warning naming it. A function not found at the
 * first attempt is looked up again later: the runtime may be dlopen'ed after memshim starts. */
static void *rt_get(int i)
{
    void *p = atomic_load_explicit(&rt_ptr[i], memory_order_acquire);
    if (MSH_LIKELY(p != NULL)) return p;
    int saved = msh_in_hook;
    msh_in_hook = 1; /* dlsym may allocate; nothing it reaches may come back through a hook */
    pthread_once(&rt_once, rt_resolve_all);
    p = atomic_load_explicit(&rt_ptr[i], memory_order_acquire);
    if (!p && (p = rt_lookup(rt_names[i])) != NULL)
        atomic_store_explicit(&rt_ptr[i], p, memory_order_release);
    msh_in_hook = saved;
    if (!p && !atomic_exchange(&rt_reported[i], 1))
        msh_warn("the CUDA runtime function %s was not found (no libcudart loaded?); "
                 "returning cudaErrorInitializationError", rt_names[i]);
    return p;
}

#define REAL_RT(name, type)                                                                 \
    type real = (type)rt_get(RT_##name);                                                    \
    if (MSH_UNLIKELY(!real)) return cudaErrorInitializationError

typedef cudaError_t (*malloc_fn)(void **, size_t);
typedef cudaError_t (*free_fn)(void *);
typedef cudaError_t (*getdev_fn)(int *);
typedef cudaError_t (*sync_fn)(void);
typedef cudaError_t (*meminfo_fn)(size_t *, size_t *);
typedef cudaError_t (*malloc_async_fn)(void **, size_t, cudaStream_t);
typedef cudaError_t (*free_async_fn)(void *, cudaStream_t);
typedef cudaError_t (*entry_fn)(const char *, void **, unsigned long long,
                                enum cudaDriverEntryPointQueryResult *);
typedef cudaError_t (*entry_ver_fn)(const char *, void **, unsigned int, unsigned long long,
                                    enum cudaDriverEntryPointQueryResult *);

/* ---- helpers (called with msh_in_hook set) ------------------------------------------------- */

static int rt_current_device(void)
{
    getdev_fn get = (getdev_fn)rt_get(RT_cudaGetDevice);
    int dev = -1;
    if (!get || MSH_RT(cudaGetDevice, get(&dev)) != cudaSuccess) return -1;
    return dev;
}

/* Every runtime call the hooks stand in for makes a context current when the thread has none: the
 * primary context of the thread's device, as the runtime does on first use. A hook that serves the
 * call itself must leave the thread so too (a caller's next kernel launch relies on it), and must
 * ask the driver each time: the program may have popped or replaced the context since (a cache of
 * "bound on this thread" went stale and left such a thread without a context: issue 32).
 * cudaFree(NULL) is the documented idiom that creates and binds it. */
static bool rt_bind_context(int dev)
{
    if (dev < 0) return false;
    CUcontext cur = NULL;
    if (msh_cu.cuCtxGetCurrent && MSH_DRV(cuCtxGetCurrent, &cur) == CUDA_SUCCESS && cur) return true;
    free_fn real_free = (free_fn)rt_get(RT_cudaFree);
    return real_free && MSH_RT(cudaFree, real_free(NULL)) == cudaSuccess;
}

/* cudaFree's guarantee (DESIGN.md 2): the device is synchronized before the memory can be reused.
 * The block may belong to another device than the current one: that device is synchronized with
 * its context pushed and popped (shim/core.c), never by switching the runtime's current device,
 * which would replace a context the caller made current itself (issue 32). Like the runtime's
 * cudaFree, the caller's own device gets its context bound when the thread has none. The
 * runtime's synchronize is counted and timed in memshim's ledger
 * (memshim_overhead.synchronizes.device) like every wait memshim makes. */
static cudaError_t rt_sync_device(int dev)
{
    sync_fn sync = (sync_fn)rt_get(RT_cudaDeviceSynchronize);
    if (!sync) return cudaErrorInitializationError;
    int cur = rt_current_device();
    if (cur == dev || dev < 0) return MSH_RT(cudaDeviceSynchronize, sync());
    if (cur >= 0) rt_bind_context(cur);
    return msh_core_sync_device(dev) == 0 ? cudaSuccess : cudaErrorUnknown;
}

static cudaError_t rt_passthrough_alloc(malloc_fn real, void **devPtr, size_t size, int dev,
                                        int kind)
{
    cudaError_t r = real(devPtr, size);
    if (r == cudaSuccess && *devPtr)
        msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)(uintptr_t)*devPtr, size, dev, kind);
    return r;
}

/* Free a pointer memshim did not serve, keeping "other" accounting right. */
static cudaError_t rt_passthrough_free(void *devPtr, cudaError_t (*call)(void *, void *),
                                       void *ctx)
{
    size_t size;
    int dev, kind;
    uint64_t key = (uint64_t)(uintptr_t)devPtr;
    bool tracked = msh_ext_untrack(MSH_EXT_TABLE_PTR, key, &size, &dev, &kind);
    cudaError_t r = call(devPtr, ctx);
    if (r != cudaSuccess && tracked) msh_ext_track(MSH_EXT_TABLE_PTR, key, size, dev, kind);
    return r;
}

static cudaError_t call_free(void *p, void *ctx) { return ((free_fn)ctx)(p); }

struct async_free_ctx { free_async_fn fn; cudaStream_t stream; };
static cudaError_t call_free_async(void *p, void *ctx)
{
    struct async_free_ctx *c = ctx;
    return c->fn(p, c->stream);
}

/* ---- cudaMalloc / cudaFree ----------------------------------------------------------------- */

MSH_EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    REAL_RT(cudaMalloc, malloc_fn);
    if (msh_in_hook || !msh_hooks_serving()) return real(devPtr, size);
    if (!devPtr) return cudaErrorInvalidValue;
    if (size == 0) return real(devPtr, 0); /* the runtime answers cudaSuccess and NULL */

    msh_in_hook = 1;
    cudaError_t r;
    int dev = rt_current_device();
    struct msh_pool *pool = NULL;
    if (dev >= 0 && rt_bind_context(dev)) pool = msh_core_pool(dev);
    uint64_t addr = 0;
    /* cudaMalloc memory is usable from the host and any stream as soon as it returns: the pool
     * must hand out only memory no queued work still touches (MSH_STREAM_COMPLETED). */
    int rc = pool ? msh_pool_alloc(pool, size, MSH_STREAM_COMPLETED, &addr) : ENODEV;
    if (rc == 0) {
        *devPtr = (void *)(uintptr_t)addr;
        r = cudaSuccess;
        msh_core_trace('a', dev, 0, addr, size);
    } else if (rc == ENOMEM) {
        /* The pool ran its whole rescue chain (and logged the diagnosis): the device or the
         * MEMSHIM_LIMIT has no room. Like the runtime's OOM this is not a sticky error. */
        r = cudaErrorMemoryAllocation;
        msh_core_note_oom(dev);
    } else {
        /* No pool for this device, or the pool failed for another reason: the real allocator
         * serves it and the bytes are accounted as "other". */
        r = rt_passthrough_alloc(real, devPtr, size, dev, MSH_EXT_MALLOC);
    }
    msh_core_count(size);
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaFree(void *devPtr)
{
    REAL_RT(cudaFree, free_fn);
    /* cudaFree(NULL) initializes the context and returns success: always the runtime's. */
    if (msh_in_hook || !devPtr || !msh_hooks_serving()) return real(devPtr);
    msh_in_hook = 1;
    cudaError_t r;
    int dev = -1;
    struct msh_pool *pool = msh_core_pool_owning((uint64_t)(uintptr_t)devPtr, &dev);
    if (pool) {
        r = rt_sync_device(dev);
        /* A failed synchronization (a sticky error from earlier work) is returned as the real
         * cudaFree would; the block stays live since the GPU may still be using it. The trace
         * line goes first so no other thread's reuse of the block can precede it. */
        if (r == cudaSuccess && msh_core_tracing())
            msh_core_trace('f', dev, 0, (uint64_t)(uintptr_t)devPtr,
                           msh_pool_block_size(pool, (uint64_t)(uintptr_t)devPtr));
        if (r == cudaSuccess && msh_hooks_pool_free_host(pool, (uint64_t)(uintptr_t)devPtr) != 0)
            r = cudaErrorInvalidValue; /* not the start of a live block, as the runtime says */
    } else {
        r = rt_passthrough_free(devPtr, call_free, (void *)real);
    }
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    REAL_RT(cudaMemGetInfo, meminfo_fn);
    if (msh_in_hook || !msh_hooks_serving()) return real(free_b, total_b);
    msh_in_hook = 1;
    cudaError_t r = real(free_b, total_b);
    if (r == cudaSuccess && free_b && total_b)
        msh_hooks_adjust_meminfo(rt_current_device(), free_b, total_b);
    msh_in_hook = 0;
    return r;
}

/* ---- stream-ordered allocation ---------------------------------------------------------------
 * Passed through and accounted as "other": the runtime's memory pools have semantics memshim
 * does not emulate yet (cudaMemPool attributes and reuse policies, IPC export, allocation nodes
 * in captured graphs), so serving cudaMallocAsync from our pool is future work. A pool pointer
 * freed with cudaFreeAsync (a program mixing APIs) is returned to our pool, ordered on the
 * stream, which the pool supports natively. */

static cudaError_t rt_malloc_async(malloc_async_fn real, void **devPtr, size_t size,
                                   cudaStream_t stream)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(devPtr, size, stream);
    msh_in_hook = 1;
    cudaError_t r = real(devPtr, size, stream);
    if (r == cudaSuccess && devPtr && *devPtr)
        msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)(uintptr_t)*devPtr, size,
                      rt_current_device(), MSH_EXT_ASYNC);
    msh_core_count(size);
    msh_in_hook = 0;
    return r;
}

static cudaError_t rt_free_async(free_async_fn real, void *devPtr, cudaStream_t stream,
                                 cudaStream_t null_means)
{
    if (msh_in_hook || !devPtr || !msh_hooks_serving()) return real(devPtr, stream);
    msh_in_hook = 1;
    cudaError_t r;
    int dev = -1;
    struct msh_pool *pool = msh_core_pool_owning((uint64_t)(uintptr_t)devPtr, &dev);
    if (pool) {
        cudaStream_t s = stream ? stream : null_means;
        r = msh_pool_free(pool, (uint64_t)(uintptr_t)devPtr, (uint64_t)(uintptr_t)s) == 0
                ? cudaSuccess
                : cudaErrorInvalidValue;
    } else {
        struct async_free_ctx c = {real, stream};
        r = rt_passthrough_free(devPtr, call_free_async, &c);
    }
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream)
{
    REAL_RT(cudaMallocAsync, malloc_async_fn);
    return rt_malloc_async(real, devPtr, size, hStream);
}

MSH_EXPORT cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream)
{
    REAL_RT(cudaMallocAsync_ptsz, malloc_async_fn);
    return rt_malloc_async(real, devPtr, size, hStream);
}

MSH_EXPORT cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream)
{
    REAL_RT(cudaFreeAsync, free_async_fn);
    return rt_free_async(real, devPtr, hStream, (cudaStream_t)0);
}

MSH_EXPORT cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream)
{
    REAL_RT(cudaFreeAsync_ptsz, free_async_fn);
    /* In a _ptsz call, stream 0 is the calling thread's default stream. */
    return rt_free_async(real, devPtr, hStream, cudaStreamPerThread);
}

/* ---- driver entry-point lookups -------------------------------------------------------------
 * The runtime asks its own (handle-resolved) driver; hooks/entry.c swaps in memshim's driver
 * hooks for the functions it manages and leaves everything else untouched. */

static cudaError_t rt_entry(entry_fn real, const char *symbol, void **funcPtr,
                            unsigned long long flags, enum cudaDriverEntryPointQueryResult *st)
{
    if (msh_in_hook) return real(symbol, funcPtr, flags, st);
    msh_in_hook = 1;
    cudaError_t r = real(symbol, funcPtr, flags, st);
    if (r == cudaSuccess && funcPtr) msh_entry_substitute(funcPtr);
    msh_in_hook = 0;
    return r;
}

static cudaError_t rt_entry_ver(entry_ver_fn real, const char *symbol, void **funcPtr,
                                unsigned int ver, unsigned long long flags,
                                enum cudaDriverEntryPointQueryResult *st)
{
    if (msh_in_hook) return real(symbol, funcPtr, ver, flags, st);
    msh_in_hook = 1;
    cudaError_t r = real(symbol, funcPtr, ver, flags, st);
    if (r == cudaSuccess && funcPtr) msh_entry_substitute(funcPtr);
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr,
                                               unsigned long long flags,
                                               enum cudaDriverEntryPointQueryResult *driverStatus)
{
    REAL_RT(cudaGetDriverEntryPoint, entry_fn);
    return rt_entry(real, symbol, funcPtr, flags, driverStatus);
}

MSH_EXPORT cudaError_t cudaGetDriverEntryPoint_ptsz(
    const char *symbol, void **funcPtr, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus)
{
    REAL_RT(cudaGetDriverEntryPoint_ptsz, entry_fn);
    return rt_entry(real, symbol, funcPtr, flags, driverStatus);
}

MSH_EXPORT cudaError_t cudaGetDriverEntryPointByVersion(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus)
{
    REAL_RT(cudaGetDriverEntryPointByVersion, entry_ver_fn);
    return rt_entry_ver(real, symbol, funcPtr, cudaVersion, flags, driverStatus);
}

MSH_EXPORT cudaError_t cudaGetDriverEntryPointByVersion_ptsz(
    const char *symbol, void **funcPtr, unsigned int cudaVersion, unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus)
{
    REAL_RT(cudaGetDriverEntryPointByVersion_ptsz, entry_ver_fn);
    return rt_entry_ver(real, symbol, funcPtr, cudaVersion, flags, driverStatus);
}

/* ---- streams that go away, pointer attributes, legacy IPC (issue 8) ---------------------------
 * The runtime reaches its own driver functions through its private lookup, so the driver hooks
 * never see these calls: the runtime entry points are hooked too. (There is no _ptsz form of
 * cudaStreamDestroy, cudaPointerGetAttributes or cudaIpcGetMemHandle.) */

typedef cudaError_t (*stream_destroy_fn)(cudaStream_t);
typedef cudaError_t (*ptr_attr_fn)(struct cudaPointerAttributes *, const void *);
typedef cudaError_t (*ipc_get_fn)(cudaIpcMemHandle_t *, void *);

MSH_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    REAL_RT(cudaStreamDestroy, stream_destroy_fn);
    if (msh_in_hook || !msh_hooks_serving()) return real(stream);
    msh_in_hook = 1;
    if (stream && stream != cudaStreamLegacy && stream != cudaStreamPerThread)
        msh_hooks_forget_stream((uint64_t)(uintptr_t)stream);
    cudaError_t r = real(stream);
    msh_in_hook = 0;
    return r;
}

/* Pool memory is device memory of the pool's device, whatever page an address falls in. */
MSH_EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr)
{
    REAL_RT(cudaPointerGetAttributes, ptr_attr_fn);
    if (msh_in_hook || !attributes || !msh_hooks_serving()) return real(attributes, ptr);
    msh_in_hook = 1;
    uint64_t base = 0;
    size_t size = 0;
    int dev = -1;
    cudaError_t r;
    if (msh_hooks_pool_range((uint64_t)(uintptr_t)ptr, &base, &size, &dev) > 0) {
        rt_bind_context(rt_current_device()); /* the runtime's call would have (issue 32) */
        memset(attributes, 0, sizeof *attributes);
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = dev;
        attributes->devicePointer = (void *)ptr;
        attributes->hostPointer = NULL;
        r = cudaSuccess;
    } else {
        r = real(attributes, ptr);
    }
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr)
{
    REAL_RT(cudaIpcGetMemHandle, ipc_get_fn);
    if (msh_in_hook || !msh_hooks_serving()) return real(handle, devPtr);
    msh_in_hook = 1;
    uint64_t base = 0;
    size_t size = 0;
    int dev = -1;
    cudaError_t r;
    if (msh_hooks_pool_range((uint64_t)(uintptr_t)devPtr, &base, &size, &dev)) {
        rt_bind_context(rt_current_device()); /* the runtime's call would have (issue 32) */
        msh_hooks_ipc_refused("cudaIpcGetMemHandle", (uint64_t)(uintptr_t)devPtr, dev);
        r = cudaErrorNotSupported;
    } else {
        r = real(handle, devPtr);
    }
    msh_in_hook = 0;
    return r;
}

/* ---- captures and peers (issue 15) -----------------------------------------------------------
 * While a stream captures a CUDA graph, memshim's pools must not synchronize or unmap (either
 * invalidates the capture): the capture calls tell shim/capture.c when one is open, including
 * captures PyTorch does not make. PyTorch enables peer access with the runtime call before its
 * first copy between two devices: from then on the peer is granted the owner's pool pages
 * (policy/dev_cuda.c "Peer access"). Each forwards to the real runtime first and never changes
 * what it returns. */

typedef cudaError_t (*peer_fn)(int, unsigned int);
typedef cudaError_t (*cap_begin_fn)(cudaStream_t, enum cudaStreamCaptureMode);
typedef cudaError_t (*cap_end_fn)(cudaStream_t, cudaGraph_t *);

MSH_EXPORT cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags)
{
    REAL_RT(cudaDeviceEnablePeerAccess, peer_fn);
    if (msh_in_hook || !msh_hooks_serving()) return real(peerDevice, flags);
    msh_in_hook = 1;
    cudaError_t r = real(peerDevice, flags);
    if (r == cudaSuccess || r == cudaErrorPeerAccessAlreadyEnabled) {
        int cur = rt_current_device();
        if (cur >= 0) msh_hooks_peer_enabled(cur, peerDevice);
    }
    msh_in_hook = 0;
    return r;
}

static cudaError_t rt_begin_capture(cap_begin_fn real, cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(stream, mode);
    msh_in_hook = 1;
    /* open first: a synchronize must not slip in between the begin and the bookkeeping */
    msh_hooks_capture_open(rt_current_device(), (uint64_t)(uintptr_t)stream);
    cudaError_t r = real(stream, mode);
    if (r != cudaSuccess) msh_hooks_capture_close((uint64_t)(uintptr_t)stream, true);
    msh_in_hook = 0;
    return r;
}

static cudaError_t rt_end_capture(cap_end_fn real, cudaStream_t stream, cudaGraph_t *g)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(stream, g);
    msh_in_hook = 1;
    cudaError_t r = real(stream, g);
    msh_hooks_capture_close((uint64_t)(uintptr_t)stream, false); /* closed if the stream stopped capturing */
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    REAL_RT(cudaStreamBeginCapture, cap_begin_fn);
    return rt_begin_capture(real, stream, mode);
}

MSH_EXPORT cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    REAL_RT(cudaStreamBeginCapture_ptsz, cap_begin_fn);
    return rt_begin_capture(real, stream ? stream : cudaStreamPerThread, mode);
}

#if CUDART_VERSION >= 12030
/* CUDA 12.3: a capture into an existing graph; the stream captures as with cudaStreamBeginCapture. */
typedef cudaError_t (*cap_to_graph_fn)(cudaStream_t, cudaGraph_t, const cudaGraphNode_t *, const cudaGraphEdgeData *,
                                       size_t, enum cudaStreamCaptureMode);

static cudaError_t rt_begin_to_graph(cap_to_graph_fn real, cudaStream_t stream, cudaGraph_t graph,
                                     const cudaGraphNode_t *deps, const cudaGraphEdgeData *data, size_t n,
                                     enum cudaStreamCaptureMode mode)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(stream, graph, deps, data, n, mode);
    msh_in_hook = 1;
    msh_hooks_capture_open(rt_current_device(), (uint64_t)(uintptr_t)stream);
    cudaError_t r = real(stream, graph, deps, data, n, mode);
    if (r != cudaSuccess) msh_hooks_capture_close((uint64_t)(uintptr_t)stream, true);
    msh_in_hook = 0;
    return r;
}

MSH_EXPORT cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t stream, cudaGraph_t graph,
                                                     const cudaGraphNode_t *dependencies,
                                                     const cudaGraphEdgeData *dependencyData, size_t numDependencies,
                                                     enum cudaStreamCaptureMode mode)
{
    REAL_RT(cudaStreamBeginCaptureToGraph, cap_to_graph_fn);
    return rt_begin_to_graph(real, stream, graph, dependencies, dependencyData, numDependencies, mode);
}

MSH_EXPORT cudaError_t cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t stream, cudaGraph_t graph,
                                                          const cudaGraphNode_t *dependencies,
                                                          const cudaGraphEdgeData *dependencyData,
                                                          size_t numDependencies, enum cudaStreamCaptureMode mode)
{
    REAL_RT(cudaStreamBeginCaptureToGraph_ptsz, cap_to_graph_fn);
    return rt_begin_to_graph(real, stream ? stream : cudaStreamPerThread, graph, dependencies, dependencyData,
                             numDependencies, mode);
}
#endif

MSH_EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph)
{
    REAL_RT(cudaStreamEndCapture, cap_end_fn);
    return rt_end_capture(real, stream, pGraph);
}

MSH_EXPORT cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph)
{
    REAL_RT(cudaStreamEndCapture_ptsz, cap_end_fn);
    return rt_end_capture(real, stream ? stream : cudaStreamPerThread, pGraph);
}
