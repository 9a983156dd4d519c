/*
 * caller_state.c: every function memshim exports or substitutes leaves the caller's CUDA state as
 * the real CUDA would (issue 27 item 1, finished in issue 32). PyTorch, NCCL and user code call
 * memshim from threads whose current device and context they chose; memshim does its own driver
 * work with the owning device's context pushed, and must pop it, restore the capture mode it
 * relaxed, and leave the runtime's last error alone. A WITH_CTX that pushed and did not pop would
 * send a multi-GPU job's next kernels to the wrong device after a cross-device free.
 *
 * A table of calls, each run on a fresh thread in each of the states a caller can be in: device
 * k's primary context current (every device), no context at all, a context the thread created
 * itself (the last device's, not the primary one), no context after the runtime had bound one
 * (the program popped it: a cache of "this thread is bound" would be stale), and device 1's
 * primary context pushed over device 0's. Before the call the thread plants a runtime error
 * (cudaSetDevice of a device that does not exist) and sets its capture mode to thread-local;
 * after it, the runtime's current device, the driver's current context (as which device's primary,
 * the thread's own, or none), the context stack's depth (the double's), the capture mode and
 * cudaPeekAtLastError are compared with what the real CUDA leaves: for a call memshim passes on
 * or serves in the runtime's or driver's name, the same call (or, where memshim serves a pointer
 * the real CUDA does not know, the same kind of call) made to the doubles' own functions, resolved
 * on their handles so memshim never sees it, in the same state on another fresh thread, and its
 * result code where memshim passes the call on; for memshim's own entries, the state as it was.
 * So with no context a runtime call binds the device's primary context, as the runtime does, and
 * nothing else changes anything.
 *
 * The calls: memshim's own entries (memshim_malloc/free and the tensor-mode entries on the last
 * device, record_stream, the glue's capture-pool entries begin, alloc_in_pool, end and release,
 * set_memory_fraction, empty-cache, stats); the driver hooks (cuMemAlloc_v2/cuMemFree_v2, cuMemFree
 * of a pool block of the last device, cuMemGetInfo_v2, cuMemAllocAsync/cuMemFreeAsync and their
 * _ptsz twins, cuMemCreate/cuMemMap/cuMemUnmap/cuMemRelease, cuMemGetAddressRange_v2 and
 * cuPointerGetAttribute[s] and cuIpcGetMemHandle of a pool block, cuStreamDestroy_v2, the peer hook
 * cuCtxEnablePeerAccess, the capture hooks cuStreamBeginCapture_v2/cuStreamEndCapture and _ptsz),
 * each reached by its symbol and again through every lookup that hands it out (cuGetProcAddress_v2
 * and v1, cudaGetDriverEntryPoint[ByVersion] and their _ptsz twins); and the runtime hooks
 * (cudaMalloc/cudaFree, cudaFree of pool blocks of device 0 and of the last device, cudaMemGetInfo,
 * cudaMallocAsync/cudaFreeAsync and _ptsz, cudaStreamBeginCapture/EndCapture and _ptsz,
 * cudaDeviceEnablePeerAccess, the entry-point lookups, cudaStreamDestroy,
 * cudaPointerGetAttributes and cudaIpcGetMemHandle of a pool block). All of it with no capture
 * open and again with a capture open beside PyTorch's capture window, where memshim relaxes the
 * thread's capture mode around its driver work (a real capture on a device of its own, begun
 * through the runtime's hook: the window alone is no capture since issue 31). run_preload.sh runs it with
 * CUDBL_DEVICES=3 and =4: the calls use two and three devices, the last one holds the capture.
 * docs/testing.md says what is left out and why.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* cudaGetDriverEntryPoint: still called */

#define MiB ((size_t)1 << 20)

#undef cuGetProcAddress
cudaError_t cudaMallocAsync_ptsz(void **, size_t, cudaStream_t);
cudaError_t cudaFreeAsync_ptsz(void *, cudaStream_t);
cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t, enum cudaStreamCaptureMode);
cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t, cudaGraph_t *);
cudaError_t cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long, enum cudaDriverEntryPointQueryResult *);
cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int, unsigned long long,
                                                  enum cudaDriverEntryPointQueryResult *);

static int ndev, last_dev;
static void *cu_h, *rt_h; /* the doubles, for their own definitions */
static CUcontext primary[8];

/* memshim's entries */
static void *(*ms_malloc)(ssize_t, int, memshim_stream_t);
static void (*ms_free)(void *, ssize_t, int, memshim_stream_t);
static void *(*t_alloc)(ssize_t, int, memshim_stream_t);
static void (*t_free)(void *, ssize_t, int, memshim_stream_t);
static void (*t_record)(void *, memshim_stream_t);
static void (*empty)(void);
static int (*stats)(int, struct memshim_stats *);
static void (*begin_pool)(int, unsigned long long, unsigned long long, void *);
static void (*end_pool)(int, unsigned long long, unsigned long long);
static void (*release_pool)(int, unsigned long long, unsigned long long);
static void *(*in_pool)(ssize_t, int, memshim_stream_t, unsigned long long, unsigned long long);
static void (*set_fraction)(double, int);

/* The driver functions a call makes: memshim's (by symbol or from a lookup) or the double's. */
struct drv {
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*info)(size_t *, size_t *);
    CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
    CUresult (*alloc_async_ptsz)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async_ptsz)(CUdeviceptr, CUstream);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*attr)(void *, CUpointer_attribute, CUdeviceptr);
    CUresult (*attrs)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr);
    CUresult (*ipc)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*peer)(CUcontext, unsigned int);
    CUresult (*cap_begin)(CUstream, CUstreamCaptureMode);
    CUresult (*cap_end)(CUstream, CUgraph *);
    CUresult (*cap_begin_ptsz)(CUstream, CUstreamCaptureMode);
    CUresult (*cap_end_ptsz)(CUstream, CUgraph *);
};
static struct drv D, R; /* what memshim hands out now (by symbol or a lookup); the double's own */

/* The driver functions no hook covers, always the double's */
static CUresult (*r_stream_create)(CUstream *, unsigned int);
static CUresult (*r_graph_destroy)(CUgraph);
static CUresult (*r_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*r_vafree)(CUdeviceptr, size_t);
static CUresult (*r_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*r_ctx_create)(CUcontext *, unsigned int, CUdevice);

/* The runtime's own functions */
static cudaError_t (*rr_malloc)(void **, size_t);
static cudaError_t (*rr_free)(void *);
static cudaError_t (*rr_info)(size_t *, size_t *);
static cudaError_t (*rr_malloc_async)(void **, size_t, cudaStream_t);
static cudaError_t (*rr_free_async)(void *, cudaStream_t);
static cudaError_t (*rr_malloc_async_ptsz)(void **, size_t, cudaStream_t);
static cudaError_t (*rr_free_async_ptsz)(void *, cudaStream_t);
static cudaError_t (*rr_cap_begin)(cudaStream_t, enum cudaStreamCaptureMode);
static cudaError_t (*rr_cap_end)(cudaStream_t, cudaGraph_t *);
static cudaError_t (*rr_cap_begin_ptsz)(cudaStream_t, enum cudaStreamCaptureMode);
static cudaError_t (*rr_cap_end_ptsz)(cudaStream_t, cudaGraph_t *);
static cudaError_t (*rr_peer)(int, unsigned int);
static cudaError_t (*rr_entry)(const char *, void **, unsigned long long, enum cudaDriverEntryPointQueryResult *);
static cudaError_t (*rr_entry_ptsz)(const char *, void **, unsigned long long, enum cudaDriverEntryPointQueryResult *);
static cudaError_t (*rr_entry_ver)(const char *, void **, unsigned int, unsigned long long,
                                   enum cudaDriverEntryPointQueryResult *);
static cudaError_t (*rr_entry_ver_ptsz)(const char *, void **, unsigned int, unsigned long long,
                                        enum cudaDriverEntryPointQueryResult *);
static cudaError_t (*rr_stream_destroy)(cudaStream_t);

enum { ST_DEV0, ST_DEV1, ST_DEV2, ST_NONE, ST_OWN, ST_POPPED, ST_STACKED, NSTATES };
static const char *const state_name[NSTATES] = {
    "device 0 current", "device 1 current", "device 2 current", "no context", "its own context",
    "no context after the runtime had bound one", "device 1 pushed over device 0"};

struct snap {
    int device;
    int ctx; /* -1 none, k: device k's primary, 100: the thread's own, 99: another */
    int depth;
    CUstreamCaptureMode mode;
    cudaError_t last;
};

static __thread CUcontext own_ctx;

static void take(struct snap *s)
{
    s->device = -1;
    cudaGetDevice(&s->device); /* creates no context and leaves the last error alone */
    CUcontext c = NULL;
    cuCtxGetCurrent(&c);
    s->ctx = c ? 99 : -1;
    if (c && c == own_ctx) s->ctx = 100;
    for (int d = 0; d < ndev; d++)
        if (c && c == primary[d]) s->ctx = d;
    s->depth = cudbl_ctx_depth();
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_GLOBAL;
    cuThreadExchangeStreamCaptureMode(&m); /* read it ... */
    s->mode = m;
    cuThreadExchangeStreamCaptureMode(&m); /* ... and put it back */
    s->last = cudaPeekAtLastError();
}

/* ---- the calls ------------------------------------------------------------------------------------- */

/* Each returns 0, or -1 when a call memshim serves failed; *rc: the result code compared with the
 * reference where memshim passes the call on. */
typedef int (*call_fn)(int *rc);
static unsigned long long pool_ids = 1000;
static pthread_mutex_t pool_ids_lock = PTHREAD_MUTEX_INITIALIZER;

static int other_device(void)
{
    int d = 0;
    cudaGetDevice(&d);
    return (d + 1) % ndev;
}

/* memshim's own entries: no real counterpart, so nothing may change */
static int m_malloc(int *rc)
{
    (void)rc;
    void *p = ms_malloc(3 * MiB, last_dev, NULL);
    if (!p) return -1;
    ms_free(p, 3 * MiB, last_dev, NULL);
    return 0;
}

static int m_torch(int *rc)
{
    (void)rc;
    void *p = t_alloc(5 * MiB, last_dev, NULL);
    if (!p) return -1;
    t_record(p, NULL);
    t_free(p, 5 * MiB, last_dev, NULL);
    return 0;
}

static int m_capture_pool(int *rc)
{
    (void)rc;
    pthread_mutex_lock(&pool_ids_lock);
    unsigned long long id = ++pool_ids;
    pthread_mutex_unlock(&pool_ids_lock);
    begin_pool(last_dev, id, 0, NULL);
    void *p = in_pool(MiB, last_dev, NULL, id, 0);
    end_pool(last_dev, id, 0);
    if (p) t_free(p, MiB, last_dev, NULL);
    release_pool(last_dev, id, 0);
    return p ? 0 : -1;
}

static int m_fraction(int *rc)
{
    (void)rc;
    set_fraction(1.0, last_dev);
    return 0;
}

static int m_empty(int *rc)
{
    (void)rc;
    empty();
    return 0;
}

static int m_stats(int *rc)
{
    (void)rc;
    struct memshim_stats st;
    return stats(last_dev, &st);
}

/* driver calls, through struct drv *T (memshim's: D; the double's: R) */
static const struct drv *T;

static int d_alloc_free(int *rc)
{
    CUdeviceptr p = 0;
    *rc = T->alloc(&p, 6 * MiB);
    if (*rc == CUDA_SUCCESS) *rc = T->free(p);
    return 0;
}

/* Pool memory the double does not know: its own functions would refuse it, and no driver call changes
 * the caller's state, so the reference is the state as it was. */
static int d_free_pool_block(int *rc)
{
    (void)rc;
    if (T == &R) return 0;
    void *p = ms_malloc(2 * MiB, last_dev, NULL);
    if (!p) return -1;
    return T->free((CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS ? 0 : -1;
}

static int d_info(int *rc)
{
    size_t f, t;
    *rc = T->info(&f, &t);
    return 0;
}

static int d_async(int *rc)
{
    CUdeviceptr p = 0;
    *rc = T->alloc_async(&p, 4 * MiB, NULL);
    if (*rc == CUDA_SUCCESS) *rc = T->free_async(p, NULL);
    if (*rc == CUDA_SUCCESS) *rc = T->alloc_async_ptsz(&p, 4 * MiB, NULL);
    if (*rc == CUDA_SUCCESS) *rc = T->free_async_ptsz(p, NULL);
    return 0;
}

static int d_vmm(int *rc)
{
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = last_dev}};
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    *rc = T->create(&h, 2 * MiB, &prop, 0);
    if (*rc != CUDA_SUCCESS) return 0;
    if (r_reserve(&va, 2 * MiB, 0, 0, 0) == CUDA_SUCCESS) {
        *rc = T->map(va, 2 * MiB, 0, h, 0);
        CUmemAccessDesc a = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if (*rc == CUDA_SUCCESS && r_set_access(va, 2 * MiB, &a, 1) == CUDA_SUCCESS) *rc = T->unmap(va, 2 * MiB);
        r_vafree(va, 2 * MiB);
    }
    CUresult r2 = T->release(h);
    if (*rc == CUDA_SUCCESS) *rc = r2;
    return 0;
}

static int d_pointer_queries(int *rc)
{
    (void)rc;
    if (T == &R) return 0;
    void *p = ms_malloc(3 * MiB, last_dev, NULL);
    if (!p) return -1;
    CUdeviceptr base = 0, dp = (CUdeviceptr)(uintptr_t)p + 4096;
    size_t size = 0;
    unsigned int type = 0;
    int ordinal = -1;
    CUpointer_attribute which[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    void *out[2] = {&type, &ordinal};
    CUipcMemHandle ih;
    /* the range queries memshim answers from the pool (each mapping is a range of its own to the
     * driver); the other attributes are the driver's, which wants a context */
    CUcontext c = NULL;
    cuCtxGetCurrent(&c);
    int bad = T->range(&base, &size, dp) != CUDA_SUCCESS || base != dp - 4096 ||
              T->attr(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, dp) != CUDA_SUCCESS ||
              (c && (T->attr(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp) != CUDA_SUCCESS ||
                     T->attrs(2, which, out, dp) != CUDA_SUCCESS || ordinal != last_dev)) ||
              T->ipc(&ih, dp - 4096) != CUDA_ERROR_NOT_SUPPORTED; /* legacy IPC cannot share pool memory */
    ms_free(p, 3 * MiB, last_dev, NULL);
    return bad ? -1 : 0;
}

static int d_stream_destroy(int *rc)
{
    CUstream s = NULL;
    *rc = r_stream_create(&s, CU_STREAM_NON_BLOCKING);
    if (*rc == CUDA_SUCCESS) *rc = T->stream_destroy(s);
    return 0;
}

static int d_peer(int *rc)
{
    (void)rc; /* enabled once already, or first from this context: either answer is the driver's */
    T->peer(primary[other_device()], 0);
    return 0;
}

static int d_capture(int *rc)
{
    CUstream s = NULL;
    CUgraph g = NULL;
    *rc = r_stream_create(&s, CU_STREAM_NON_BLOCKING);
    if (*rc != CUDA_SUCCESS) return 0;
    *rc = T->cap_begin(s, CU_STREAM_CAPTURE_MODE_RELAXED);
    if (*rc == CUDA_SUCCESS) *rc = T->cap_end(s, &g);
    if (g) r_graph_destroy(g), g = NULL;
    if (*rc == CUDA_SUCCESS) *rc = T->cap_begin_ptsz(s, CU_STREAM_CAPTURE_MODE_RELAXED);
    if (*rc == CUDA_SUCCESS) *rc = T->cap_end_ptsz(s, &g);
    if (g) r_graph_destroy(g);
    T->stream_destroy(s);
    return 0;
}

/* runtime calls: memshim's (the preloaded symbols) when `ref` is 0, else the runtime's own */
static int ref;

/* Freed after the state is taken (run_job): a cudaFree would bind a context by itself. */
static __thread void *to_free;

static int r_malloc(int *rc)
{
    *rc = ref ? rr_malloc(&to_free, 7 * MiB) : cudaMalloc(&to_free, 7 * MiB);
    return 0;
}

static int r_malloc_free(int *rc)
{
    void *p = NULL;
    *rc = ref ? rr_malloc(&p, 7 * MiB) : cudaMalloc(&p, 7 * MiB);
    if (*rc == cudaSuccess) *rc = ref ? rr_free(p) : cudaFree(p);
    return 0;
}

static int r_free_block(int dev, int *rc)
{
    if (ref) { /* the runtime does not know pool memory: the same call on NULL binds as it would */
        *rc = rr_free(NULL);
        return 0;
    }
    void *p = ms_malloc(4 * MiB, dev, NULL);
    if (!p) return -1;
    *rc = cudaFree(p);
    return 0;
}
static int r_free_block0(int *rc) { return r_free_block(0, rc); }
static int r_free_block_last(int *rc) { return r_free_block(last_dev, rc); }

static int r_info(int *rc)
{
    size_t f, t;
    *rc = ref ? rr_info(&f, &t) : cudaMemGetInfo(&f, &t);
    return 0;
}

static int r_async(int *rc)
{
    void *p = NULL;
    *rc = ref ? rr_malloc_async(&p, 4 * MiB, NULL) : cudaMallocAsync(&p, 4 * MiB, NULL);
    if (*rc == cudaSuccess) *rc = ref ? rr_free_async(p, NULL) : cudaFreeAsync(p, NULL);
    if (*rc == cudaSuccess) *rc = ref ? rr_malloc_async_ptsz(&p, 4 * MiB, NULL) : cudaMallocAsync_ptsz(&p, 4 * MiB, NULL);
    if (*rc == cudaSuccess) *rc = ref ? rr_free_async_ptsz(p, NULL) : cudaFreeAsync_ptsz(p, NULL);
    return 0;
}

static int r_capture(int *rc)
{
    cudaStream_t s = NULL;
    cudaGraph_t g = NULL;
    *rc = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); /* not hooked: the runtime's either way */
    if (*rc != cudaSuccess) return 0;
    *rc = ref ? rr_cap_begin(s, cudaStreamCaptureModeRelaxed) : cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
    if (*rc == cudaSuccess) *rc = ref ? rr_cap_end(s, &g) : cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g), g = NULL;
    if (*rc == cudaSuccess)
        *rc = ref ? rr_cap_begin_ptsz(s, cudaStreamCaptureModeRelaxed)
                  : cudaStreamBeginCapture_ptsz(s, cudaStreamCaptureModeRelaxed);
    if (*rc == cudaSuccess) *rc = ref ? rr_cap_end_ptsz(s, &g) : cudaStreamEndCapture_ptsz(s, &g);
    if (g) cudaGraphDestroy(g);
    ref ? rr_stream_destroy(s) : cudaStreamDestroy(s);
    return 0;
}

static int r_peer(int *rc)
{
    int peer = other_device(); /* enabled at the start: both answer "already enabled" */
    *rc = ref ? rr_peer(peer, 0) : cudaDeviceEnablePeerAccess(peer, 0);
    return 0;
}

static int r_entry(int *rc)
{
    void *f = NULL;
    enum cudaDriverEntryPointQueryResult st;
    *rc = ref ? rr_entry("cuMemAlloc", &f, cudaEnableDefault, &st) : cudaGetDriverEntryPoint("cuMemAlloc", &f, cudaEnableDefault, &st);
    if (*rc == cudaSuccess)
        *rc = ref ? rr_entry_ptsz("cuMemFreeAsync", &f, cudaEnableDefault, &st)
                  : cudaGetDriverEntryPoint_ptsz("cuMemFreeAsync", &f, cudaEnableDefault, &st);
    if (*rc == cudaSuccess)
        *rc = ref ? rr_entry_ver("cuMemGetInfo", &f, 12000, cudaEnableDefault, &st)
                  : cudaGetDriverEntryPointByVersion("cuMemGetInfo", &f, 12000, cudaEnableDefault, &st);
    if (*rc == cudaSuccess)
        *rc = ref ? rr_entry_ver_ptsz("cuMemAllocAsync", &f, 12000, cudaEnableDefault, &st)
                  : cudaGetDriverEntryPointByVersion_ptsz("cuMemAllocAsync", &f, 12000, cudaEnableDefault, &st);
    return 0;
}

static int r_stream_destroy(int *rc)
{
    cudaStream_t s = NULL;
    *rc = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (*rc == cudaSuccess) *rc = ref ? rr_stream_destroy(s) : cudaStreamDestroy(s);
    return 0;
}

static int r_pointer_attributes(int *rc)
{
    if (ref) {
        *rc = rr_free(NULL); /* binds as the runtime would; it does not know pool memory */
        return 0;
    }
    void *p = ms_malloc(3 * MiB, last_dev, NULL);
    if (!p) return -1;
    struct cudaPointerAttributes a;
    *rc = cudaPointerGetAttributes(&a, (char *)p + 100);
    int bad = *rc != cudaSuccess || a.type != cudaMemoryTypeDevice || a.device != last_dev;
    ms_free(p, 3 * MiB, last_dev, NULL);
    return bad ? -1 : 0;
}

static int r_ipc(int *rc)
{
    if (ref) {
        *rc = rr_free(NULL);
        return 0;
    }
    void *p = ms_malloc(3 * MiB, last_dev, NULL);
    if (!p) return -1;
    cudaIpcMemHandle_t h;
    int bad = cudaIpcGetMemHandle(&h, p) != cudaErrorNotSupported;
    ms_free(p, 3 * MiB, last_dev, NULL);
    *rc = 0;
    return bad ? -1 : 0;
}

enum kind { MEMSHIM, DRIVER, RUNTIME };
static const struct call {
    const char *name;
    call_fn fn;
    enum kind kind;
    bool cmp_rc;  /* memshim passes the call on: its result is the real one's */
    bool no_last; /* memshim refuses it itself: the runtime's last error is not set (docs/testing.md) */
} CALLS[] = {
    {"memshim_malloc/free on the last device", m_malloc, MEMSHIM, false, false},
    {"memshim_torch_alloc/record_stream/free on the last device", m_torch, MEMSHIM, false, false},
    {"the glue's capture pool: begin, alloc_in_pool, end, release", m_capture_pool, MEMSHIM, false, false},
    {"memshim_torch_set_memory_fraction", m_fraction, MEMSHIM, false, false},
    {"memshim_empty_cache", m_empty, MEMSHIM, false, false},
    {"memshim_get_stats", m_stats, MEMSHIM, false, false},
    {"cuMemAlloc_v2 + cuMemFree_v2", d_alloc_free, DRIVER, true, false},
    {"cuMemFree_v2 of a pool block of the last device", d_free_pool_block, DRIVER, false, false},
    {"cuMemGetInfo_v2", d_info, DRIVER, true, false},
    {"cuMemAllocAsync/cuMemFreeAsync and _ptsz", d_async, DRIVER, true, false},
    {"cuMemCreate/cuMemMap/cuMemUnmap/cuMemRelease", d_vmm, DRIVER, true, false},
    {"cuMemGetAddressRange_v2, cuPointerGetAttribute[s], cuIpcGetMemHandle of a pool block", d_pointer_queries,
     DRIVER, false, false},
    {"cuStreamDestroy_v2", d_stream_destroy, DRIVER, true, false},
    {"cuCtxEnablePeerAccess", d_peer, DRIVER, false, false},
    {"cuStreamBeginCapture_v2/cuStreamEndCapture and _ptsz", d_capture, DRIVER, true, false},
    {"cudaMalloc", r_malloc, RUNTIME, true, false},
    {"cudaMalloc + cudaFree", r_malloc_free, RUNTIME, true, false},
    {"cudaFree of a pool block of device 0", r_free_block0, RUNTIME, false, false},
    {"cudaFree of a pool block of the last device", r_free_block_last, RUNTIME, false, false},
    {"cudaMemGetInfo", r_info, RUNTIME, true, false},
    {"cudaMallocAsync/cudaFreeAsync and _ptsz", r_async, RUNTIME, true, false},
    {"cudaStreamBeginCapture/EndCapture and _ptsz", r_capture, RUNTIME, true, false},
    {"cudaDeviceEnablePeerAccess", r_peer, RUNTIME, true, false},
    {"cudaGetDriverEntryPoint[ByVersion] and _ptsz", r_entry, RUNTIME, true, false},
    {"cudaStreamDestroy", r_stream_destroy, RUNTIME, true, false},
    {"cudaPointerGetAttributes of a pool block", r_pointer_attributes, RUNTIME, false, false},
    {"cudaIpcGetMemHandle of a pool block", r_ipc, RUNTIME, false, true},
};
#define NCALLS (sizeof CALLS / sizeof *CALLS)

/* ---- one call in one state ----------------------------------------------------------------------------- */

struct job {
    int state;
    const struct call *call;
    const struct drv *table;
    int use_ref;
    struct snap before, after;
    int ret, rc;
    char why[160];
};

static void *run_job(void *arg)
{
    struct job *j = arg;
    own_ctx = NULL;
    switch (j->state) {
    case ST_DEV0:
    case ST_DEV1:
    case ST_DEV2:
        cudaSetDevice(j->state == ST_DEV0 ? 0 : j->state == ST_DEV1 ? 1 : 2);
        cudaFree(NULL); /* the device's primary context current */
        break;
    case ST_OWN: {
        CUdevice d;
        cuDeviceGet(&d, last_dev);
        if (r_ctx_create(&own_ctx, 0, d) != CUDA_SUCCESS) {
            snprintf(j->why, sizeof j->why, "cuCtxCreate failed");
            return NULL;
        }
        break;
    }
    case ST_POPPED: { /* a runtime call bound device 0's primary context; then the program popped it */
        void *p = NULL;
        cudaSetDevice(0);
        if (cudaMalloc(&p, MiB) == cudaSuccess) cudaFree(p);
        CUcontext c;
        while (cuCtxPopCurrent(&c) == CUDA_SUCCESS && c) {
        }
        break;
    }
    case ST_STACKED:
        cudaSetDevice(0);
        cudaFree(NULL);
        cuCtxPushCurrent(primary[1]);
        break;
    default:
        break;
    }
    /* a runtime error left for the program to read, and a capture mode the program chose */
    cudaSetDevice(99);
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    cuThreadExchangeStreamCaptureMode(&m);
    take(&j->before);
    T = j->table;
    ref = j->use_ref;
    j->rc = 0;
    j->ret = j->call->fn(&j->rc);
    take(&j->after);
    if (to_free) ref ? rr_free(to_free) : cudaFree(to_free);
    to_free = NULL;
    cudaGetLastError();
    CUcontext c;
    while (cuCtxPopCurrent(&c) == CUDA_SUCCESS && c) {
    }
    if (own_ctx) cuCtxDestroy(own_ctx);
    return NULL;
}

static void run_on_thread(struct job *j)
{
    pthread_t th;
    if (pthread_create(&th, NULL, run_job, j) == 0) pthread_join(th, NULL);
    else snprintf(j->why, sizeof j->why, "pthread_create failed");
}

static const char *ctx_name(int c, char *buf, size_t n)
{
    if (c == -1) return "none";
    if (c == 100) return "its own";
    if (c == 99) return "another";
    snprintf(buf, n, "device %d's primary", c);
    return buf;
}

/* 1 when memshim's call left another state than the real one (or the state as it was) */
static int compare(const char *when, const char *via, const struct call *c, int s)
{
    struct job m = {.state = s, .call = c, .table = &D}, r = {.state = s, .call = c, .table = &R, .use_ref = 1};
    run_on_thread(&m);
    const struct snap *want = &m.before;
    if (c->kind != MEMSHIM) {
        run_on_thread(&r);
        want = &r.after;
    }
    char why[768];
    size_t o = 0;
    char b1[32], b2[32];
#define DIFF(cond, ...)                                                                               \
    do {                                                                                              \
        if ((cond) && o < sizeof why) o += (size_t)snprintf(why + o, sizeof why - o, __VA_ARGS__);    \
    } while (0)
    DIFF(m.why[0], "%s; ", m.why);
    DIFF(r.why[0], "reference: %s; ", r.why);
    DIFF(m.ret != 0, "the call failed; ");
    DIFF(c->cmp_rc && m.rc != r.rc, "returned %d, the real call %d; ", m.rc, r.rc);
    DIFF(m.after.device != want->device, "current device %d, the real call leaves %d; ", m.after.device, want->device);
    DIFF(m.after.ctx != want->ctx, "current context %s, the real call leaves %s; ", ctx_name(m.after.ctx, b1, sizeof b1),
         ctx_name(want->ctx, b2, sizeof b2));
    DIFF(m.after.depth != want->depth, "context stack %d deep, the real call leaves %d; ", m.after.depth, want->depth);
    DIFF(m.after.mode != want->mode, "capture mode %d, the real call leaves %d; ", (int)m.after.mode, (int)want->mode);
    DIFF(!c->no_last && m.after.last != want->last, "cudaPeekAtLastError %d, the real call leaves %d; ",
         (int)m.after.last, (int)want->last);
    DIFF(m.before.last != cudaErrorInvalidDevice, "the planted error did not read back (%d); ", (int)m.before.last);
    if (!o) return 0;
    printf("    %s, %s%s, %s: %s\n", when, c->name, via, state_name[s], why);
    return 1;
}

/* ---- the lookups that hand out the driver hooks ---------------------------------------------------- */

typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);

enum via { BY_SYMBOL, BY_GPA_V2, BY_GPA_V1, BY_ENTRY, BY_ENTRY_PTSZ, BY_ENTRY_VER, BY_ENTRY_VER_PTSZ, NVIA };
static const char *const via_name[NVIA] = {
    "", " (from cuGetProcAddress_v2)", " (from cuGetProcAddress)", " (from cudaGetDriverEntryPoint)",
    " (from cudaGetDriverEntryPoint_ptsz)", " (from cudaGetDriverEntryPointByVersion)",
    " (from cudaGetDriverEntryPointByVersion_ptsz)"};

/* `name` as a program gets it through lookup `via` (per_thread: the per-thread-default-stream form);
 * NULL when that lookup does not hand it out. */
static void *lookup(enum via via, const char *name, const char *sym, int version, int per_thread)
{
    void *f = NULL;
    unsigned long long rtflags = per_thread ? cudaEnablePerThreadDefaultStream : cudaEnableLegacyStream;
    cuuint64_t flags = per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    CUdriverProcAddressQueryResult st;
    enum cudaDriverEntryPointQueryResult rst;
    switch (via) {
    case BY_SYMBOL:
        return dlsym(RTLD_DEFAULT, sym);
    case BY_GPA_V2:
        ((gpa_v2_fn)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"))(name, &f, version, flags, &st);
        return f;
    case BY_GPA_V1:
        ((gpa_v1_fn)dlsym(RTLD_DEFAULT, "cuGetProcAddress"))(name, &f, version, flags);
        return f;
    case BY_ENTRY: /* cudaEnableDefault: the legacy stream's form in a program built without _ptsz */
        cudaGetDriverEntryPoint(name, &f, per_thread ? rtflags : cudaEnableDefault, &rst);
        return f;
    case BY_ENTRY_PTSZ: /* ... and the per-thread form in one built with it */
        cudaGetDriverEntryPoint_ptsz(name, &f, per_thread ? cudaEnableDefault : rtflags, &rst);
        return f;
    case BY_ENTRY_VER:
        cudaGetDriverEntryPointByVersion(name, &f, (unsigned)version, rtflags, &rst);
        return f;
    case BY_ENTRY_VER_PTSZ:
        cudaGetDriverEntryPointByVersion_ptsz(name, &f, (unsigned)version, per_thread ? cudaEnableDefault : rtflags, &rst);
        return f;
    default:
        return NULL;
    }
}

static const struct entry {
    size_t off;
    const char *name, *sym;
    int version, per_thread;
} ENTRIES[] = {
    {offsetof(struct drv, alloc), "cuMemAlloc", "cuMemAlloc_v2", 3020, 0},
    {offsetof(struct drv, free), "cuMemFree", "cuMemFree_v2", 3020, 0},
    {offsetof(struct drv, info), "cuMemGetInfo", "cuMemGetInfo_v2", 3020, 0},
    {offsetof(struct drv, alloc_async), "cuMemAllocAsync", "cuMemAllocAsync", 11020, 0},
    {offsetof(struct drv, free_async), "cuMemFreeAsync", "cuMemFreeAsync", 11020, 0},
    {offsetof(struct drv, alloc_async_ptsz), "cuMemAllocAsync", "cuMemAllocAsync_ptsz", 11020, 1},
    {offsetof(struct drv, free_async_ptsz), "cuMemFreeAsync", "cuMemFreeAsync_ptsz", 11020, 1},
    {offsetof(struct drv, create), "cuMemCreate", "cuMemCreate", 10020, 0},
    {offsetof(struct drv, release), "cuMemRelease", "cuMemRelease", 10020, 0},
    {offsetof(struct drv, map), "cuMemMap", "cuMemMap", 10020, 0},
    {offsetof(struct drv, unmap), "cuMemUnmap", "cuMemUnmap", 10020, 0},
    {offsetof(struct drv, range), "cuMemGetAddressRange", "cuMemGetAddressRange_v2", 3020, 0},
    {offsetof(struct drv, attr), "cuPointerGetAttribute", "cuPointerGetAttribute", 4000, 0},
    {offsetof(struct drv, attrs), "cuPointerGetAttributes", "cuPointerGetAttributes", 7000, 0},
    {offsetof(struct drv, ipc), "cuIpcGetMemHandle", "cuIpcGetMemHandle", 4010, 0},
    {offsetof(struct drv, stream_destroy), "cuStreamDestroy", "cuStreamDestroy_v2", 4000, 0},
    {offsetof(struct drv, peer), "cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", 4000, 0},
    {offsetof(struct drv, cap_begin), "cuStreamBeginCapture", "cuStreamBeginCapture_v2", 10010, 0},
    {offsetof(struct drv, cap_end), "cuStreamEndCapture", "cuStreamEndCapture", 10000, 0},
    {offsetof(struct drv, cap_begin_ptsz), "cuStreamBeginCapture", "cuStreamBeginCapture_v2_ptsz", 10010, 1},
    {offsetof(struct drv, cap_end_ptsz), "cuStreamEndCapture", "cuStreamEndCapture_ptsz", 10000, 1},
};
#define NENTRIES (sizeof ENTRIES / sizeof *ENTRIES)

/* The double's own function by name: glibc's dlsym itself (memshim's dlsym hands out its hook for
 * the driver's capture functions, looked up on libcuda's handle, since issue 31). */
static void *glibc_dlsym(void *h, const char *name)
{
    static void *(*real)(void *, const char *);
    if (!real) *(void **)&real = dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
    if (!real) *(void **)&real = dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
    return real ? real(h, name) : NULL;
}

/* Fill D from lookup `via` (a lookup that does not hand a function out leaves memshim's symbol:
 * the call still runs, the lookup is simply not one of its ways in); every pointer it hands out
 * must be memshim's hook, never the double's own. */
static int fill_table(enum via via, char *why, size_t n)
{
    for (size_t i = 0; i < NENTRIES; i++) {
        const struct entry *e = &ENTRIES[i];
        void *f = lookup(via, e->name, e->sym, e->version, e->per_thread);
        void *mine = dlsym(RTLD_DEFAULT, e->sym), *theirs = glibc_dlsym(cu_h, e->sym);
        if (f && f == theirs) {
            snprintf(why, n, "%s%s hands out the driver's own %s", e->name, via_name[via], e->sym);
            return -1;
        }
        *(void **)((char *)&D + e->off) = f ? f : mine;
        *(void **)((char *)&R + e->off) = theirs;
        if (!mine || !theirs) {
            snprintf(why, n, "%s: not exported by memshim or the double", e->sym);
            return -1;
        }
    }
    return 0;
}

static int run_table(const char *when, int *ran)
{
    int bad = 0;
    char why[200];
    for (int via = 0; via < NVIA; via++) {
        if (fill_table((enum via)via, why, sizeof why)) {
            printf("    %s: %s\n", when, why);
            bad++;
            continue;
        }
        for (size_t c = 0; c < NCALLS; c++) {
            if (via != BY_SYMBOL && CALLS[c].kind != DRIVER) continue; /* the lookups hand out driver functions */
            for (int s = 0; s < NSTATES; s++) {
                if (s == ST_DEV2 && ndev < 3) continue;
                bad += compare(when, via_name[via], &CALLS[c], s);
                (*ran)++;
            }
        }
    }
    return bad;
}

#define RESOLVE(var, h, name) (*(void **)&(var) = dlsym((h), (name)))

static bool resolve(void)
{
    cudaFree(NULL); /* the runtime loads the driver (the test does not link it directly) */
    cu_h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    rt_h = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!cu_h || !rt_h) return false;
    RESOLVE(ms_malloc, RTLD_DEFAULT, "memshim_malloc");
    RESOLVE(ms_free, RTLD_DEFAULT, "memshim_free");
    RESOLVE(t_alloc, RTLD_DEFAULT, "memshim_torch_alloc");
    RESOLVE(t_free, RTLD_DEFAULT, "memshim_torch_free");
    RESOLVE(t_record, RTLD_DEFAULT, "memshim_torch_record_stream");
    RESOLVE(empty, RTLD_DEFAULT, "memshim_empty_cache");
    RESOLVE(stats, RTLD_DEFAULT, "memshim_get_stats");
    RESOLVE(begin_pool, RTLD_DEFAULT, "memshim_torch_begin_allocate_to_pool");
    RESOLVE(end_pool, RTLD_DEFAULT, "memshim_torch_end_allocate_to_pool");
    RESOLVE(release_pool, RTLD_DEFAULT, "memshim_torch_release_pool");
    RESOLVE(in_pool, RTLD_DEFAULT, "memshim_torch_alloc_in_pool");
    RESOLVE(set_fraction, RTLD_DEFAULT, "memshim_torch_set_memory_fraction");
    RESOLVE(r_stream_create, cu_h, "cuStreamCreate");
    RESOLVE(r_graph_destroy, cu_h, "cuGraphDestroy");
    RESOLVE(r_reserve, cu_h, "cuMemAddressReserve");
    RESOLVE(r_vafree, cu_h, "cuMemAddressFree");
    RESOLVE(r_set_access, cu_h, "cuMemSetAccess");
    RESOLVE(r_ctx_create, cu_h, "cuCtxCreate_v2"); /* CUDA 13's header names _v4; the double keeps v2 */
    RESOLVE(rr_malloc, rt_h, "cudaMalloc");
    RESOLVE(rr_free, rt_h, "cudaFree");
    RESOLVE(rr_info, rt_h, "cudaMemGetInfo");
    RESOLVE(rr_malloc_async, rt_h, "cudaMallocAsync");
    RESOLVE(rr_free_async, rt_h, "cudaFreeAsync");
    RESOLVE(rr_malloc_async_ptsz, rt_h, "cudaMallocAsync_ptsz");
    RESOLVE(rr_free_async_ptsz, rt_h, "cudaFreeAsync_ptsz");
    RESOLVE(rr_cap_begin, rt_h, "cudaStreamBeginCapture");
    RESOLVE(rr_cap_end, rt_h, "cudaStreamEndCapture");
    RESOLVE(rr_cap_begin_ptsz, rt_h, "cudaStreamBeginCapture_ptsz");
    RESOLVE(rr_cap_end_ptsz, rt_h, "cudaStreamEndCapture_ptsz");
    RESOLVE(rr_peer, rt_h, "cudaDeviceEnablePeerAccess");
    RESOLVE(rr_entry, rt_h, "cudaGetDriverEntryPoint");
    RESOLVE(rr_entry_ptsz, rt_h, "cudaGetDriverEntryPoint_ptsz");
    RESOLVE(rr_entry_ver, rt_h, "cudaGetDriverEntryPointByVersion");
    RESOLVE(rr_entry_ver_ptsz, rt_h, "cudaGetDriverEntryPointByVersion_ptsz");
    RESOLVE(rr_stream_destroy, rt_h, "cudaStreamDestroy");
    return ms_malloc && ms_free && t_alloc && t_free && t_record && empty && stats && begin_pool && end_pool &&
           release_pool && in_pool && set_fraction && r_stream_create && r_graph_destroy && r_reserve && r_vafree &&
           r_set_access && r_ctx_create && rr_malloc && rr_free && rr_info && rr_malloc_async && rr_free_async &&
           rr_malloc_async_ptsz && rr_free_async_ptsz && rr_cap_begin && rr_cap_end && rr_cap_begin_ptsz &&
           rr_cap_end_ptsz && rr_peer && rr_entry && rr_entry_ptsz && rr_entry_ver && rr_entry_ver_ptsz &&
           rr_stream_destroy;
}

TEST(every_entry_leaves_the_callers_cuda_state_as_the_real_cuda_would)
{
    int total = 0;
    if (cudaGetDeviceCount(&total) != cudaSuccess || total < 3)
        SKIP("needs CUDBL_DEVICES=3 or 4 (the last device holds the capture left open)");
    ndev = total - 1 > 3 ? 3 : total - 1; /* the devices the calls use */
    int cap_dev = total - 1;
    last_dev = ndev - 1;
    REQUIRE(resolve());
    CUresult (*retain)(CUcontext *, CUdevice);
    REQUIRE(RESOLVE(retain, cu_h, "cuDevicePrimaryCtxRetain"));
    void *keep[8];
    for (int d = 0; d < ndev; d++) {
        REQUIRE(retain(&primary[d], d) == CUDA_SUCCESS);
        /* every device's pool exists, and every pair of devices has peer access already (through
         * memshim's hook, which grants its pages), so enabling it again answers the same every time */
        REQUIRE(cudaSetDevice(d) == cudaSuccess && cudaMalloc(&keep[d], MiB) == cudaSuccess);
        for (int p = 0; p < ndev; p++)
            if (p != d) cudaDeviceEnablePeerAccess(p, 0);
    }
    cudaGetLastError();
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    int ran = 0;
    CHECK(run_table("no capture open", &ran) == 0);
    /* a capture open elsewhere: a real stream capture on the device no call uses, begun through
     * the runtime's hook in relaxed mode (it prohibits nothing the calls do), with PyTorch's pool
     * window open as during torch.cuda.graph (the window alone is no capture since issue 31):
     * memshim relaxes the capture mode around its driver work, and must give the thread its own
     * mode back */
    cudaStream_t cs;
    cudaGraph_t g = NULL;
    REQUIRE(cudaSetDevice(cap_dev) == cudaSuccess && cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) == cudaSuccess);
    begin_pool(0, 77, 0, NULL);
    REQUIRE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    CHECK(run_table("a capture open", &ran) == 0);
    CHECK(cudaSetDevice(cap_dev) == cudaSuccess && cudaStreamEndCapture(cs, &g) == cudaSuccess && g);
    end_pool(0, 77, 0);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(cs);
    cudaSetDevice(0);
    printf("    %d devices: %d calls x states compared, %zu calls, %d states\n", ndev, ran, NCALLS,
           NSTATES - (ndev < 3));
    for (int d = 0; d < ndev; d++) cudaFree(keep[d]);
}

TEST_MAIN()
