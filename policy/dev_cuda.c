/*
 * dev_cuda.c: the device interface over the real CUDA driver (or the driver double, which is the
 * same code path with a different libcuda.so.1 on LD_LIBRARY_PATH).
 *
 * Every call runs with the device's primary context pushed, so it works from any host thread
 * (PyTorch's autograd threads included) and leaves the caller's current context as it was. It
 * must call the driver only through msh_cu (never a hook), and it translates CUresult to the
 * project's errno convention: CUDA_ERROR_OUT_OF_MEMORY becomes ENOMEM, the rest EIO (logged).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_real.h"
#include "drvlog.h"
#include "device.h"
#include "msh.h"

struct cuda_dev {
    CUdevice dev;
    CUcontext ctx;
    CUmemAllocationProp prop;
    CUmemAllocationProp host_prop; /* host memory through VMM (cu_host_init); location type 0: none */
    size_t gran;
    /* Who may touch this device's pages: itself, and each peer the program enabled (below).
     * Appended only, each entry written before naccess is raised (release); readers load naccess
     * (acquire) without a lock. */
    CUmemAccessDesc access[MSH_MAX_DEVICES];
    size_t naccess;
    pthread_mutex_t access_lock; /* serializes writers */
};

static struct cuda_dev *C(struct msh_device *d) { return d->impl; }

static int to_errno(CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS) return 0;
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return ENOMEM;
    if (r == CUDA_ERROR_NOT_READY) return EBUSY;
    msh_debug("%s failed: %s", what, msh_cuda_errname(r));
    return EIO;
}

/* Run a driver call with our context current, restoring the caller's afterwards. */
#define WITH_CTX(d, call, what)                                                     \
    ({                                                                              \
        CUcontext prev_ = NULL;                                                     \
        MSH_DRV(cuCtxGetCurrent, &prev_);                                             \
        bool push_ = prev_ != C(d)->ctx;                                            \
        /* a failed push must not be followed by a pop of the caller's context */   \
        if (push_ && MSH_DRV(cuCtxPushCurrent, C(d)->ctx) != CUDA_SUCCESS) push_ = false; \
        CUresult r_ = (call);                                                       \
        if (push_) MSH_DRV(cuCtxPopCurrent, &prev_);                                  \
        to_errno(r_, what);                                                         \
    })

static int cu_mem_info(struct msh_device *d, size_t *f, size_t *t)
{
    return WITH_CTX(d, MSH_DRV(cuMemGetInfo, f, t), "cuMemGetInfo");
}

static int cu_granularity(struct msh_device *d, size_t *g)
{
    *g = C(d)->gran;
    return 0;
}

static int cu_reserve(struct msh_device *d, size_t size, size_t align, uint64_t *va)
{
    CUdeviceptr p = 0;
    int rc = WITH_CTX(d, MSH_DRV(cuMemAddressReserve, &p, size, align, 0, 0), "cuMemAddressReserve");
    *va = (uint64_t)p;
    return rc;
}

static int cu_unreserve(struct msh_device *d, uint64_t va, size_t size)
{
    return WITH_CTX(d, MSH_DRV(cuMemAddressFree, (CUdeviceptr)va, size), "cuMemAddressFree");
}

static int cu_create(struct msh_device *d, size_t size, uint64_t *h)
{
    CUmemGenericAllocationHandle hh = 0;
    int rc = WITH_CTX(d, MSH_DRV(cuMemCreate, &hh, size, &C(d)->prop, 0), "cuMemCreate");
    *h = (uint64_t)hh;
    return rc;
}

static int cu_release(struct msh_device *d, uint64_t h, size_t size)
{
    (void)size;
    return WITH_CTX(d, MSH_DRV(cuMemRelease, (CUmemGenericAllocationHandle)h), "cuMemRelease");
}

/* Peer access (docs/pool.md "Peers"): cudaDeviceEnablePeerAccess / cuCtxEnablePeerAccess do not
 * cover VMM mappings; each device that may touch a mapping needs its own descriptor. A page is
 * granted to its own device only, and to a peer once the program enables access to this device
 * from that peer (hooks/: the runtime's and the driver's enable calls; PyTorch makes the runtime
 * one before its first copy between two devices): then the peer joins the list, every mapping
 * made from then on names it, and the pool grants it the pages already mapped
 * (msh_pool_regrant_access). A rank that never touches a peer maps its pages into one page table
 * only, so grants and unmaps do not grow with the number of devices on the node. */
static void cu_access_init(struct cuda_dev *c)
{
    memset(&c->access[0], 0, sizeof c->access[0]);
    c->access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->access[0].location.id = c->dev;
    c->access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    __atomic_store_n(&c->naccess, 1, __ATOMIC_RELEASE);
    pthread_mutex_init(&c->access_lock, NULL);
}

static int cu_add_access(struct msh_device *d, int peer)
{
    struct cuda_dev *c = C(d);
    if (peer < 0 || peer >= MSH_MAX_DEVICES) return EINVAL;
    if (peer == (int)c->dev) return EEXIST;
    int can = 0;
    if (!msh_cu.cuDeviceCanAccessPeer || MSH_DRV(cuDeviceCanAccessPeer, &can, peer, c->dev) != CUDA_SUCCESS || !can)
        return ENODEV;
    pthread_mutex_lock(&c->access_lock);
    size_t n = __atomic_load_n(&c->naccess, __ATOMIC_ACQUIRE);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++)
        if (c->access[i].location.id == peer) rc = EEXIST;
    if (!rc && n == MSH_MAX_DEVICES) rc = ENOSPC;
    if (!rc) {
        CUmemAccessDesc *a = &c->access[n];
        memset(a, 0, sizeof *a);
        a->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a->location.id = peer;
        a->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        __atomic_store_n(&c->naccess, n + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->access_lock);
    return rc;
}

/* The access descriptors every mapping of device d gets (the owner, then the enabled peers). */
static size_t cu_access_descs(struct msh_device *d, const CUmemAccessDesc **out)
{
    *out = C(d)->access;
    return __atomic_load_n(&C(d)->naccess, __ATOMIC_ACQUIRE);
}

static int cu_map(struct msh_device *d, uint64_t va, size_t size, uint64_t h)
{
    return WITH_CTX(d, MSH_DRV(cuMemMap, (CUdeviceptr)va, size, 0, (CUmemGenericAllocationHandle)h, 0), "cuMemMap");
}

/* A mapping is unusable until access is granted (CUDA VMM rule), to the owner and its peers (the
 * descriptors above). One call covers a run of adjacent mappings, so the pool grants access once
 * per block it maps, not once per handle. */
static int cu_set_access(struct msh_device *d, uint64_t va, size_t size)
{
    const CUmemAccessDesc *acc;
    size_t nacc = cu_access_descs(d, &acc);
    return WITH_CTX(d, MSH_DRV(cuMemSetAccess, (CUdeviceptr)va, size, acc, nacc), "cuMemSetAccess");
}

static int cu_unmap(struct msh_device *d, uint64_t va, size_t size)
{
    return WITH_CTX(d, MSH_DRV(cuMemUnmap, (CUdeviceptr)va, size), "cuMemUnmap");
}

/* The context a stream belongs to (0: this device's own). The default streams (NULL, legacy,
 * per-thread) mean the current context, which every call here makes this device's. */
static int cu_stream_home(struct msh_device *d, uint64_t stream, uint64_t *home)
{
    *home = 0;
    CUstream s = (CUstream)(uintptr_t)stream;
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD || !msh_cu.cuStreamGetCtx) return 0;
    CUcontext ctx = NULL;
    int rc = WITH_CTX(d, MSH_DRV(cuStreamGetCtx, s, &ctx), "cuStreamGetCtx");
    if (!rc && ctx && ctx != C(d)->ctx) *home = (uint64_t)(uintptr_t)ctx;
    return rc;
}

/* An event of another context (a stream of another device, record_stream across devices): the
 * driver refuses to record an event on a stream of another context. */
static int cu_event_create_on(struct msh_device *d, uint64_t home, uint64_t *ev)
{
    (void)d;
    CUevent e = NULL;
    CUcontext prev = NULL;
    if (MSH_DRV(cuCtxPushCurrent, (CUcontext)(uintptr_t)home) != CUDA_SUCCESS) return EIO;
    int rc = to_errno(MSH_DRV(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    MSH_DRV(cuCtxPopCurrent, &prev);
    *ev = (uint64_t)(uintptr_t)e;
    return rc;
}

static int cu_stream_sync(struct msh_device *d, uint64_t stream)
{
    if (!msh_cu.cuStreamSynchronize) return ENOSYS;
    return WITH_CTX(d, MSH_DRV(cuStreamSynchronize, (CUstream)(uintptr_t)stream), "cuStreamSynchronize");
}

static int cu_event_create(struct msh_device *d, uint64_t *ev)
{
    CUevent e = NULL;
    int rc = WITH_CTX(d, MSH_DRV(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    *ev = (uint64_t)(uintptr_t)e;
    return rc;
}

static int cu_event_record(struct msh_device *d, uint64_t ev, uint64_t stream)
{
    return WITH_CTX(d, MSH_DRV(cuEventRecord, (CUevent)(uintptr_t)ev, (CUstream)(uintptr_t)stream), "cuEventRecord");
}

static int cu_event_query(struct msh_device *d, uint64_t ev)
{
    return WITH_CTX(d, MSH_DRV(cuEventQuery, (CUevent)(uintptr_t)ev), "cuEventQuery");
}

static int cu_event_release(struct msh_device *d, uint64_t ev)
{
    return WITH_CTX(d, MSH_DRV(cuEventDestroy, (CUevent)(uintptr_t)ev), "cuEventDestroy");
}

/* A capturing stream (CUDA graph capture) cannot wait on an event recorded outside its capture:
 * the driver invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). The pool's events
 * mark other streams' last use of a block, so there the host waits for the event instead; the
 * graph then needs no dependency on work outside it, and the block is idle when it is handed over. */
static int cu_stream_wait(struct msh_device *d, uint64_t stream, uint64_t ev)
{
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (msh_cu.cuStreamIsCapturing && msh_cu.cuEventSynchronize &&
        WITH_CTX(d, MSH_DRV(cuStreamIsCapturing, (CUstream)(uintptr_t)stream, &st), "cuStreamIsCapturing") == 0 &&
        st != CU_STREAM_CAPTURE_STATUS_NONE)
        return WITH_CTX(d, MSH_DRV(cuEventSynchronize, (CUevent)(uintptr_t)ev), "cuEventSynchronize");
    return WITH_CTX(d, MSH_DRV(cuStreamWaitEvent, (CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)ev, 0),
                    "cuStreamWaitEvent");
}

static int cu_synchronize(struct msh_device *d)
{
    return WITH_CTX(d, MSH_DRV(cuCtxSynchronize), "cuCtxSynchronize");
}

/* Host memory through VMM (CUDA 12.2 and later drivers): a HOST_NUMA location on the device's
 * nearest NUMA node where the device says it has one, else a HOST location (newer drivers), else
 * none. The host granularity must divide the device's, so one page of the pool is one host handle. */
static void cu_host_init(struct cuda_dev *c)
{
    memset(&c->host_prop, 0, sizeof c->host_prop);
    int numa = 0, host = 0, node = -1;
    if (MSH_DRV(cuDeviceGetAttribute, &numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, c->dev) !=
        CUDA_SUCCESS)
        numa = 0; /* an older driver does not know the attribute */
    if (MSH_DRV(cuDeviceGetAttribute, &host, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, c->dev) !=
        CUDA_SUCCESS)
        host = 0;
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    if (numa) {
        if (MSH_DRV(cuDeviceGetAttribute, &node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, c->dev) != CUDA_SUCCESS || node < 0)
            node = 0; /* "on systems where NUMA is not available the id must be set to 0" */
        p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        p.location.id = node;
    } else if (host) {
        p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    } else {
        return;
    }
    size_t g = 0;
    if (MSH_DRV(cuMemGetAllocationGranularity, &g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g ||
        c->gran % g) {
        msh_debug("device %d: host memory through VMM has granularity %zu, which does not divide %zu: no spill",
                  (int)c->dev, g, c->gran);
        return;
    }
    c->host_prop = p;
}

static int cu_host_create(struct msh_device *d, size_t size, uint64_t *h)
{
    if (!C(d)->host_prop.location.type) return ENOTSUP;
    CUmemGenericAllocationHandle hh = 0;
    int rc = WITH_CTX(d, MSH_DRV(cuMemCreate, &hh, size, &C(d)->host_prop, 0), "cuMemCreate (host)");
    *h = (uint64_t)hh;
    return rc;
}

/* A copy on the legacy stream, then the device synchronized: done when this returns. */
static int cu_copy(struct msh_device *d, uint64_t dst, uint64_t src, size_t size)
{
    if (!msh_cu.cuMemcpyDtoD) return ENOTSUP;
    int rc = WITH_CTX(d, MSH_DRV(cuMemcpyDtoD, (CUdeviceptr)dst, (CUdeviceptr)src, size), "cuMemcpyDtoD");
    if (!rc) rc = cu_synchronize(d);
    return rc;
}

static const struct msh_device_ops cuda_ops = {
    .name = "cuda",
    .mem_info = cu_mem_info,
    .granularity = cu_granularity,
    .reserve = cu_reserve,
    .unreserve = cu_unreserve,
    .create = cu_create,
    .release = cu_release,
    .map = cu_map,
    .set_access = cu_set_access,
    .unmap = cu_unmap,
    .event_create = cu_event_create,
    .event_record = cu_event_record,
    .event_query = cu_event_query,
    .event_release = cu_event_release,
    .stream_wait = cu_stream_wait,
    .synchronize = cu_synchronize,
    .stream_home = cu_stream_home,
    .event_create_on = cu_event_create_on,
    .stream_sync = cu_stream_sync,
    .add_access = cu_add_access,
    .host_create = cu_host_create,
    .copy = cu_copy,
};

void msh_dev_cuda_fini(struct msh_device *d)
{
    struct cuda_dev *c = d && d->ops == &cuda_ops ? d->impl : NULL;
    if (!c) return;
    if (msh_cu.cuDevicePrimaryCtxRelease) MSH_DRV(cuDevicePrimaryCtxRelease, c->dev);
    free(c);
    d->impl = NULL;
    d->ops = NULL;
}

int msh_dev_cuda_init(struct msh_device *d, int ordinal)
{
    if (msh_cuda_load()) return ENODEV;
    if (!msh_cu.cuMemCreate || !msh_cu.cuMemMap || !msh_cu.cuMemSetAccess || !msh_cu.cuMemAddressReserve ||
        !msh_cu.cuDevicePrimaryCtxRetain || !msh_cu.cuCtxPushCurrent || !msh_cu.cuCtxPopCurrent) {
        msh_warn("the CUDA driver lacks the virtual memory management API; passing through");
        return ENODEV;
    }
    struct cuda_dev *c = calloc(1, sizeof *c);
    if (!c) return ENOMEM;
    CUresult r = MSH_DRV(cuDeviceGet, &c->dev, ordinal);
    int vmm = 0;
    if (r == CUDA_SUCCESS)
        r = MSH_DRV(cuDeviceGetAttribute, &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, c->dev);
    if (r == CUDA_SUCCESS && !vmm) {
        msh_warn("device %d does not support virtual memory management; passing through", ordinal);
        free(c);
        return ENODEV;
    }
    if (r == CUDA_SUCCESS) r = MSH_DRV(cuDevicePrimaryCtxRetain, &c->ctx, c->dev);
    if (r != CUDA_SUCCESS) {
        msh_warn("device %d: cannot use the driver (%s); passing through", ordinal, msh_cuda_errname(r));
        free(c);
        return ENODEV;
    }
    c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->prop.location.id = c->dev;
    cu_access_init(c);
    d->ops = &cuda_ops;
    d->ordinal = ordinal;
    d->impl = c;
    int rc = WITH_CTX(d, MSH_DRV(cuMemGetAllocationGranularity, &c->gran, &c->prop,
                                                               CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                      "cuMemGetAllocationGranularity");
    if (rc || !c->gran) {
        msh_warn("device %d: no allocation granularity (error %d); passing through", ordinal, rc);
        if (msh_cu.cuDevicePrimaryCtxRelease) MSH_DRV(cuDevicePrimaryCtxRelease, c->dev);
        free(c);
        d->impl = NULL;
        return ENODEV;
    }
    cu_host_init(c);
    return 0;
}
