/*
 * cuda_double.c: a test double of the CUDA driver (built as libcuda.so.1) that emulates, on the
 * host, the subset of the driver API memshim and its tests use: devices, contexts, plain and
 * stream-ordered allocations, the virtual memory management (VMM) API with the real driver's
 * rules, and streams and events whose work completes later (deferred), so that tests catch
 * memory reused before the GPU is done with it. "Device" memory is real host memory (one sparse
 * memfd for physical allocations, mmap for address ranges) so tests can write through device
 * pointers. It also counts calls, injects failures and reports leaks (cudbl.h). It must never
 * pretend to succeed where the real driver would fail (a test that passes here must not rely on
 * a rule the driver does not keep), never run queued work out of stream order, never call user
 * callbacks while holding its lock, and never be shipped or loaded outside tests.
 */
#include <cuda.h>

#include "cudbl.h" /* cudaTypedefs.h, and the typedefs of ABIs newer than the headers */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef FALLOC_FL_PUNCH_HOLE
#include <linux/falloc.h>
#endif

/* ---- the functions the double knows, by base name (counting and fault injection) ----------- */

#define CUDBL_FUNCS(X)                                                                          \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)       \
    X(cuDeviceTotalMem) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain)                     \
    X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxGetState) X(cuCtxCreate) X(cuCtxDestroy)   \
    X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxPushCurrent) X(cuCtxPopCurrent)                \
    X(cuCtxGetDevice) X(cuCtxSynchronize) X(cuMemGetInfo) X(cuMemAlloc) X(cuMemFree)            \
    X(cuMemAllocAsync) X(cuMemFreeAsync) X(cuMemGetAddressRange) X(cuMemcpyHtoD)                \
    X(cuMemcpyDtoH) X(cuMemcpyDtoD) X(cuMemsetD8) X(cuMemGetAllocationGranularity)              \
    X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap)       \
    X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAccess) X(cuMemRetainAllocationHandle)            \
    X(cuMemGetAllocationPropertiesFromHandle) X(cuStreamCreate) X(cuStreamCreateWithPriority)   \
    X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent)             \
    X(cuLaunchHostFunc) X(cuEventCreate) X(cuEventRecord) X(cuEventQuery)                       \
    X(cuEventSynchronize) X(cuEventDestroy) X(cuEventElapsedTime) X(cuGetProcAddress)           \
    X(cuGetErrorString) X(cuGetErrorName) X(cuDeviceCanAccessPeer) X(cuCtxEnablePeerAccess)     \
    X(cuCtxDisablePeerAccess) X(cuMemcpy) X(cuMemcpyAsync) X(cuMemcpyPeer) X(cuMemcpyPeerAsync) \
    X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async)           \
    X(cuPointerGetAttribute) X(cuPointerGetAttributes) X(cuIpcGetMemHandle)                     \
    X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) X(cuMemExportToShareableHandle)                \
    X(cuMemImportFromShareableHandle) X(cuStreamBeginCapture) X(cuStreamEndCapture)             \
    X(cuStreamGetCaptureInfo) X(cuStreamIsCapturing) X(cuThreadExchangeStreamCaptureMode)       \
    X(cuGraphInstantiate) X(cuGraphLaunch) X(cuGraphExecDestroy) X(cuGraphDestroy)              \
    X(cuStreamGetCtx) X(cuStreamBeginCaptureToGraph) X(cuGraphCreate)

#define FN_ENUM(n) FN_##n,
#define FN_NAME(n) #n,
enum { CUDBL_FUNCS(FN_ENUM) FN_COUNT };
static const char *const fn_names[FN_COUNT] = { CUDBL_FUNCS(FN_NAME) };

#define MAX_DEVICES 16
#define DEFAULT_CAPACITY (8ull << 30)
#define DEFAULT_HOST_CAPACITY (64ull << 30)
#define DEFAULT_GRANULARITY (2ull << 20)
#define DRIVER_VERSION 13020 /* CUDA 13.2: the newest runtime in the PyPI wheels checks for it */


/* ---- error names ----------------------------------------------------------------------------- */

struct err_entry { CUresult code; const char *name, *text; };
static const struct err_entry err_table[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_PROFILER_DISABLED, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_DEVICE_NOT_LICENSED, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device not licensed"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
     "context already current"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_UNMAP_FAILED, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_ECC_UNCORRECTABLE, "CUDA_ERROR_ECC_UNCORRECTABLE",
     "uncorrectable ECC error encountered"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation is not permitted"
     " when the object is in its current state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
     "peer access is not supported between these two devices"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED",
     "context is destroyed"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
     "peer access has not been enabled"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_MERGE, "CUDA_ERROR_STREAM_CAPTURE_MERGE",
     "operation would result in a merge of separate capture sequences"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
     "capture was not ended in the same stream as it began"},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
     "capturing stream has unjoined work"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "dependency created on uncaptured work in another stream"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const struct err_entry *err_find(CUresult code)
{
    for (size_t i = 0; i < sizeof err_table / sizeof err_table[0]; i++)
        if (err_table[i].code == code) return &err_table[i];
    return NULL;
}

/* ---- a small hash table: uint64 key -> pointer (keys 0 and 1 are reserved) ------------------ */

struct htab { uint64_t *keys; void **vals; size_t cap, used, live; };
#define HT_EMPTY 0u
#define HT_TOMB 1u

static size_t ht_slot(uint64_t k, size_t cap)
{
    k ^= k >> 33; k *= 0xff51afd7ed558ccdull; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return (size_t)k & (cap - 1);
}

static void *ht_get(const struct htab *t, uint64_t k)
{
    if (!t->cap) return NULL;
    for (size_t i = ht_slot(k, t->cap);; i = (i + 1) & (t->cap - 1)) {
        if (t->keys[i] == k) return t->vals[i];
        if (t->keys[i] == HT_EMPTY) return NULL;
    }
}

static int ht_put(struct htab *t, uint64_t k, void *v);

static int ht_grow(struct htab *t)
{
    struct htab n = {0};
    n.cap = t->cap ? (t->live * 4 > t->cap ? t->cap * 2 : t->cap) : 64;
    n.keys = calloc(n.cap, sizeof *n.keys);
    n.vals = calloc(n.cap, sizeof *n.vals);
    if (!n.keys || !n.vals) { free(n.keys); free(n.vals); return -1; }
    for (size_t i = 0; i < t->cap; i++)
        if (t->keys[i] > HT_TOMB) ht_put(&n, t->keys[i], t->vals[i]);
    free(t->keys);
    free(t->vals);
    *t = n;
    return 0;
}

static int ht_put(struct htab *t, uint64_t k, void *v)
{
    if ((t->used + 1) * 2 > t->cap && ht_grow(t)) return -1;
    size_t i = ht_slot(k, t->cap);
    for (; t->keys[i] > HT_TOMB; i = (i + 1) & (t->cap - 1))
        if (t->keys[i] == k) { t->vals[i] = v; return 0; }
    if (t->keys[i] == HT_EMPTY) t->used++;
    t->keys[i] = k;
    t->vals[i] = v;
    t->live++;
    return 0;
}

static void ht_del(struct htab *t, uint64_t k)
{
    if (!t->cap) return;
    for (size_t i = ht_slot(k, t->cap);; i = (i + 1) & (t->cap - 1)) {
        if (t->keys[i] == k) { t->keys[i] = HT_TOMB; t->vals[i] = NULL; t->live--; return; }
        if (t->keys[i] == HT_EMPTY) return;
    }
}

/* ---- state ----------------------------------------------------------------------------------- */

struct stream;
struct capture;

struct ctx {
    uint32_t magic;
    int device;
    int is_primary, destroyed;
    int primary_refs;
    unsigned int flags;
    uint32_t peer_mask;         /* devices whose cuMemAlloc memory this context may touch */
    struct stream *legacy;      /* the NULL / CU_STREAM_LEGACY stream of this context */
    struct ctx *next;
};
#define CTX_MAGIC 0xC7C7C7C7u

/* Work items. IT_COPY, IT_SET and IT_KERNEL touch device memory from the device of the stream
 * they run on: the double checks that device's access when they run (docs/test-double.md). */
enum item_kind { IT_FN, IT_WAIT, IT_FREE, IT_NOP, IT_COPY, IT_SET, IT_KERNEL };
struct item {
    enum item_kind kind;
    void (*fn)(void *);
    void *arg;
    struct stream *wait_s;      /* IT_WAIT: done once wait_s->completed >= wait_pos */
    uint64_t wait_pos;
    CUdeviceptr free_ptr;       /* IT_FREE */
    CUdeviceptr dst, src;       /* IT_COPY / IT_SET / IT_KERNEL (dst is the range touched) */
    size_t n;
    int value, write;           /* IT_SET byte; IT_KERNEL writes (else only reads) */
    int chk_dst, chk_src;       /* IT_COPY / IT_SET: that side is device memory, checked when run */
    struct item *next;
};

enum stream_kind { SK_USER, SK_LEGACY, SK_PER_THREAD };
struct stream {
    uint64_t id;
    CUstream handle;            /* what the API hands out (never a pointer: see handle_of) */
    struct ctx *ctx;
    enum stream_kind kind;
    unsigned int flags;
    int destroyed, busy, refs;
    uint64_t enqueued, completed;   /* items ever queued / completed, FIFO: item k done iff completed > k */
    struct item *head, *tail;
    struct stream *prev, *next;
    struct capture *cap;        /* the capture sequence this stream is part of, or NULL */
    uint64_t cap_items;         /* items this stream added to cap */
    uint64_t cap_joined;        /* cap_items when another stream of cap last waited on it */
};

struct event {
    uint64_t id;
    CUevent handle;
    struct ctx *ctx;            /* the context it was created in */
    unsigned int flags;
    int recorded;
    struct stream *s;           /* holds a reference while recorded */
    uint64_t pos;
    struct timespec when;
    struct capture *cap;        /* last recorded inside this capture (then s is NULL) */
    struct stream *cap_s;       /* ... on this stream, after its cap_pos-th captured item */
    uint64_t cap_pos;
};

/* A stream capture sequence (cuStreamBeginCapture .. cuStreamEndCapture). Captures are never
 * freed, so an event recorded inside one can always be recognised. */
struct capture {
    uint64_t id;
    struct stream *origin;
    CUstreamCaptureMode mode;
    uint64_t thread;            /* tls_thread_id of the thread that began it */
    int active, invalidated;
    struct item *head, *tail;   /* the captured work, in capture order */
    struct graph *into;         /* cuStreamBeginCaptureToGraph: the graph the work goes to */
    struct capture *next;
};

/* A graph is the captured work, replayed in capture order by cuGraphLaunch. */
struct graph {
    uint64_t id;
    int is_exec;
    struct item *head;
    struct graph *next;
};

struct phys {
    uint64_t id;
    int device;
    size_t size;
    off_t off;                  /* offset in the backing memfd */
    int fd;                     /* shareable handles: a memfd of their own (off is 0), else -1 */
    int charged;                /* counted against the device's capacity (imports are not) */
    int loc;                    /* CUmemLocationType: DEVICE, or HOST / HOST_NUMA memory that
                                 * devices reach over the bus (charged to the host, not `device`) */
    unsigned long long handle_types;    /* requested CUmemAllocationHandleType bits */
    dev_t fd_dev;
    ino_t fd_ino;
    int refs;                   /* handle references: create + retains + imports - releases */
    int maps;
};

static inline int phys_on_host(const struct phys *p)
{
    return p->loc == CU_MEM_LOCATION_TYPE_HOST || p->loc == CU_MEM_LOCATION_TYPE_HOST_NUMA;
}

struct vmap {
    CUdeviceptr va;
    size_t size;
    struct phys *p;
    unsigned char access[MAX_DEVICES];   /* CUmemAccess_flags per device, granted by cuMemSetAccess */
};

/* The mappings inside a reservation are found through g_page_tab, never a list: a pool maps
 * tens of thousands of pages, and each VMM call then costs O(pages it names), not O(mappings). */
struct resv {
    CUdeviceptr base;
    size_t size;
    long nmaps;
    struct resv *next;
};

struct dalloc {
    CUdeviceptr ptr;
    size_t size, charged;
    int device;
    int free_pending;
};

/* host_vmm: which host locations cuMemCreate takes (HOST_VMM_NUMA: CU_MEM_LOCATION_TYPE_HOST_NUMA,
 * HOST_VMM_HOST: CU_MEM_LOCATION_TYPE_HOST), with the device attributes that say so;
 * host_capacity: the host memory such handles may take in all. */
enum { HOST_VMM_NUMA = 1, HOST_VMM_HOST = 2 };
struct config { int devices; size_t capacity, granularity; int host_vmm; size_t host_capacity; };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_grants[MAX_DEVICES]; /* cuMemSetAccess: mappings granted to each device, cumulative */
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;  /* work queued or completed */
static atomic_int g_inited;
static int g_configured_by_api;
static struct config g_cfg = {1, DEFAULT_CAPACITY, DEFAULT_GRANULARITY, HOST_VMM_NUMA | HOST_VMM_HOST,
                               DEFAULT_HOST_CAPACITY};
static size_t g_dev_used[MAX_DEVICES];
static size_t g_dev_peak[MAX_DEVICES]; /* the most g_dev_used has been */
static size_t g_dev_mark_peak[MAX_DEVICES]; /* ...since the last cudbl_device_mark_peak(d, 1) */
static size_t g_host_used, g_host_peak; /* host-located handles */
static struct ctx *g_primary[MAX_DEVICES];
static struct ctx *g_ctxs;
static struct stream *g_streams;    /* every stream not yet freed, in creation order */
static uint64_t g_next_stream_id = 1, g_next_event_id = 1, g_next_graph_id = 1, g_next_capture_id = 1;
static struct htab g_stream_tab, g_event_tab, g_handle_tab, g_alloc_tab, g_page_tab, g_graph_tab;
static struct capture *g_captures;
static struct resv *g_resvs;
static uint64_t g_next_handle = 0x1000;
static int g_memfd = -1;
static off_t g_memfd_size, g_memfd_next;
static struct cudbl_counts g_counts;
static struct cudbl_bytes g_bytes; /* cudbl_get_bytes (issue 12), under g_lock */
/* peer capability (cuDeviceCanAccessPeer): g_peer[a][b] = devices a and b reach each other */
static unsigned char g_peer[MAX_DEVICES][MAX_DEVICES];
static int g_peer_configured;

static atomic_long g_calls[FN_COUNT];
/* Bytes the VMM calls named (cudbl_call_bytes): counted as the call is made, as g_calls is, so
 * that a caller counting its own calls by bytes (memshim's cost model) can be held to them. */
static _Atomic unsigned long long g_call_bytes[FN_COUNT];
#define CALL_BYTES(fn, n) atomic_fetch_add(&g_call_bytes[FN_##fn], (unsigned long long)(n))
static atomic_long g_misuse;
static atomic_int g_misuse_abort = 1;

/* async "GPU" thread */
static atomic_int g_async;
static int g_gpu_started, g_gpu_stop;
static pthread_t g_gpu_thread;
static unsigned g_async_delay_us = 200;

/* per-thread context stack, per-thread default streams, capture mode and identity */
#define CTX_STACK_MAX 32
static __thread struct ctx *tls_ctx_stack[CTX_STACK_MAX];
static __thread int tls_ctx_depth;
#define PT_STREAMS_MAX 8
static __thread struct { struct ctx *ctx; struct stream *s; } tls_pt_streams[PT_STREAMS_MAX];
static __thread CUstreamCaptureMode tls_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static __thread uint64_t tls_thread_id;
static atomic_ullong g_next_thread_id = 1;

static uint64_t thread_id(void)
{
    if (!tls_thread_id) tls_thread_id = atomic_fetch_add(&g_next_thread_id, 1);
    return tls_thread_id;
}

/* Streams, events and graphs are handed out as synthetic handles base + id * 16 with ids that are
 * never reused, so a handle that was destroyed is recognised forever (a real driver may hand the
 * same value to a new object; using a destroyed handle is undefined behaviour there). */
#define STREAM_HANDLE_BASE 0x00005d0000000000ull
#define EVENT_HANDLE_BASE  0x00005e0000000000ull
#define GRAPH_HANDLE_BASE  0x00005f0000000000ull
#define HANDLE_SPAN        0x0000010000000000ull

static uint64_t handle_of(uint64_t base, uint64_t id) { return base + id * 16; }

/* The id a handle value encodes, or 0 when it is not one of ours below `next`. */
static uint64_t id_of(const void *h, uint64_t base, uint64_t next)
{
    uint64_t v = (uint64_t)(uintptr_t)h;
    if (v < base || v >= base + HANDLE_SPAN || (v - base) % 16) return 0;
    uint64_t id = (v - base) / 16;
    return id && id < next ? id : 0;
}

static void warn(const char *fmt, const char *a, const char *b);

/* Misuse: something a real driver leaves undefined (a destroyed handle used again, a device
 * touching memory it has no access to). By default the process aborts with a message, so any
 * suite that does it fails; CUDBL_MISUSE=count (or cudbl_set_misuse_abort(0)) counts it in
 * cudbl_counts.misuse instead and the call fails with `err`. */
static __thread const char *tls_api = "cudbl";

__attribute__((format(printf, 2, 3))) static CUresult misuse(CUresult err, const char *fmt, ...)
{
    char what[200], buf[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    int n = snprintf(buf, sizeof buf, "cudbl: MISUSE in %s: %s\n", tls_api, what);
    if (n > (int)sizeof buf - 1) n = (int)sizeof buf - 1;
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
    atomic_fetch_add(&g_misuse, 1);
    if (atomic_load(&g_misuse_abort)) {
        static const char tail[] = "cudbl: aborting (CUDBL_MISUSE=count counts misuse instead)\n";
        w = write(2, tail, sizeof tail - 1);
        abort();
    }
    return err;
}

static void warn(const char *fmt, const char *a, const char *b)
{
    char buf[256];
    int n = snprintf(buf, sizeof buf, "cudbl: warning: ");
    n += snprintf(buf + n, sizeof buf - (size_t)n, fmt, a, b);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

/* ---- configuration from the environment ---------------------------------------------------- */

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno) return -1;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
    }
    if (shift && (*end == 'i' || *end == 'I')) end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return -1;
    if (shift && v > (ULLONG_MAX >> shift)) return -1;
    *out = (size_t)(v << shift);
    return 0;
}

static int valid_granularity(size_t g)
{
    return g >= (size_t)sysconf(_SC_PAGESIZE) && (g & (g - 1)) == 0;
}

static void config_from_env(void)
{
    const char *v;
    size_t sz;
    if ((v = getenv("CUDBL_DEVICES")) && *v) {
        char *end;
        long n = strtol(v, &end, 10);
        if (*end || n < 1 || n > MAX_DEVICES) warn("CUDBL_DEVICES=%s is not 1..16; using %s", v, "1");
        else g_cfg.devices = (int)n;
    }
    if ((v = getenv("CUDBL_CAPACITY")) && *v) {
        if (parse_size(v, &sz) || sz == 0) warn("CUDBL_CAPACITY=%s is not a size; using %s", v, "8G");
        else g_cfg.capacity = sz;
    }
    if ((v = getenv("CUDBL_HOST_CAPACITY")) && *v) {
        if (parse_size(v, &sz)) warn("CUDBL_HOST_CAPACITY=%s is not a size; using %s", v, "64G");
        else g_cfg.host_capacity = sz;
    }
    if ((v = getenv("CUDBL_HOST_VMM")) && *v) {
        if (strcmp(v, "all") == 0) g_cfg.host_vmm = HOST_VMM_NUMA | HOST_VMM_HOST;
        else if (strcmp(v, "numa") == 0) g_cfg.host_vmm = HOST_VMM_NUMA;
        else if (strcmp(v, "host") == 0) g_cfg.host_vmm = HOST_VMM_HOST;
        else if (strcmp(v, "none") == 0) g_cfg.host_vmm = 0;
        else warn("CUDBL_HOST_VMM=%s is not all, numa, host or none; using %s", v, "all");
    }
    if ((v = getenv("CUDBL_GRANULARITY")) && *v) {
        if (parse_size(v, &sz) || !valid_granularity(sz))
            warn("CUDBL_GRANULARITY=%s is not a power of two >= page size; using %s", v, "2M");
        else g_cfg.granularity = sz;
    }
}

/* CUDBL_PEER: which devices can reach each other's memory (cuDeviceCanAccessPeer). "all" (the
 * default: an NVLink machine), "none" (PCIe without P2P), or pairs "0-1,2-3" (symmetric). */
static int parse_peer(const char *v, unsigned char out[MAX_DEVICES][MAX_DEVICES])
{
    memset(out, 0, sizeof(unsigned char[MAX_DEVICES][MAX_DEVICES]));
    if (strcmp(v, "none") == 0) return 0;
    if (strcmp(v, "all") == 0) {
        for (int a = 0; a < MAX_DEVICES; a++)
            for (int b = 0; b < MAX_DEVICES; b++) out[a][b] = a != b;
        return 0;
    }
    const char *q = v;
    while (*q) {
        char *end;
        long a = strtol(q, &end, 10);
        if (end == q || *end != '-') return -1;
        q = end + 1;
        long b = strtol(q, &end, 10);
        if (end == q || a < 0 || b < 0 || a >= MAX_DEVICES || b >= MAX_DEVICES || a == b) return -1;
        out[a][b] = out[b][a] = 1;
        q = end;
        if (*q == ',') q++;
        else if (*q) return -1;
    }
    return 0;
}

static void peer_from_env(void)
{
    const char *v = getenv("CUDBL_PEER");
    if (parse_peer(v && *v ? v : "all", g_peer)) {
        warn("CUDBL_PEER=%s is not all, none or pairs like 0-1,2-3; using %s", v, "all");
        parse_peer("all", g_peer);
    }
}

/* ---- fault injection ------------------------------------------------------------------------- */

struct fault_rule {
    int fn;
    long nth;                   /* absolute call number to fail; 0 for a probability rule */
    double prob;
    uint64_t rng;
    CUresult err;
};
#define MAX_RULES 64
static pthread_mutex_t g_fault_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fault_rule g_rules[MAX_RULES];
static atomic_int g_nrules;
static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;

/* Fork safety: hold the double's locks across fork() so a child never inherits one locked by
 * another thread; the background "GPU" thread does not exist in the child and is restarted on
 * demand. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&g_fault_lock);
    pthread_mutex_lock(&g_lock);
}
static void fork_parent(void)
{
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_unlock(&g_fault_lock);
}
static void fork_child(void);
__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int fn_index(const char *name)
{
    if (!name) return -1;
    size_t len = strlen(name);
    /* accept ABI names: cuMemAlloc_v2, cuStreamSynchronize_ptsz, cuEventDestroy_v2 ... */
    const char *us = strchr(name, '_');
    if (us) len = (size_t)(us - name);
    for (int i = 0; i < FN_COUNT; i++)
        if (strlen(fn_names[i]) == len && strncmp(fn_names[i], name, len) == 0) return i;
    return -1;
}

static CUresult default_fault(int fn)
{
    switch (fn) {
    case FN_cuMemCreate: case FN_cuMemAlloc: case FN_cuMemAllocAsync: case FN_cuMemAddressReserve:
        return CUDA_ERROR_OUT_OF_MEMORY;
    default:
        return CUDA_ERROR_UNKNOWN;
    }
}

static int parse_err(const char *s, CUresult *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end != s && !*end) { *out = (CUresult)v; return 0; }
    for (size_t i = 0; i < sizeof err_table / sizeof err_table[0]; i++)
        if (strcmp(err_table[i].name, s) == 0) { *out = err_table[i].code; return 0; }
    return -1;
}

static void add_rule(const struct fault_rule *r)
{
    pthread_mutex_lock(&g_fault_lock);
    int n = atomic_load(&g_nrules);
    if (n < MAX_RULES) {
        g_rules[n] = *r;
        atomic_store(&g_nrules, n + 1);
    }
    pthread_mutex_unlock(&g_fault_lock);
}

/* One entry "name:A:B[:ERR]" of CUDBL_FAIL (A = N) or CUDBL_FAIL_PROB (A = p, B = seed). */
static void parse_fault_entry(char *entry, int prob_mode, const char *var)
{
    char *fields[4] = {0};
    int nf = 0;
    for (char *save = NULL, *f = strtok_r(entry, ":", &save); f && nf < 4;
         f = strtok_r(NULL, ":", &save))
        fields[nf++] = f;
    struct fault_rule r = {0};
    r.fn = fn_index(fields[0]);
    int need = prob_mode ? 3 : 2;
    if (r.fn < 0 || nf < need) { warn("%s: ignoring '%s'", var, fields[0] ? fields[0] : ""); return; }
    char *end;
    if (prob_mode) {
        r.prob = strtod(fields[1], &end);
        if (*end || r.prob < 0 || r.prob > 1) { warn("%s: bad probability '%s'", var, fields[1]); return; }
        r.rng = strtoull(fields[2], &end, 0);
        if (*end) { warn("%s: bad seed '%s'", var, fields[2]); return; }
    } else {
        r.nth = strtol(fields[1], &end, 10);
        if (*end || r.nth < 1) { warn("%s: bad call number '%s'", var, fields[1]); return; }
    }
    r.err = default_fault(r.fn);
    if (nf > need && parse_err(fields[need], &r.err)) {
        warn("%s: unknown error '%s'", var, fields[need]);
        return;
    }
    add_rule(&r);
}

static void parse_fault_var(const char *var, int prob_mode)
{
    const char *v = getenv(var);
    if (!v || !*v) return;
    char *copy = strdup(v);
    if (!copy) return;
    for (char *save = NULL, *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save))
        parse_fault_entry(e, prob_mode, var);
    free(copy);
}

static void env_once(void)
{
    const char *m = getenv("CUDBL_MISUSE");
    if (m && *m) {
        if (strcmp(m, "count") == 0) atomic_store(&g_misuse_abort, 0);
        else if (strcmp(m, "abort") != 0) warn("CUDBL_MISUSE=%s is not abort or count; using %s", m, "abort");
    }
    parse_fault_var("CUDBL_FAIL", 0);
    parse_fault_var("CUDBL_FAIL_PROB", 1);
    const char *v = getenv("CUDBL_ASYNC_DELAY_US");
    if (v && *v) g_async_delay_us = (unsigned)strtoul(v, NULL, 10);
}

static CUresult fault_check(int fn, long callno)
{
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_fault_lock);
    int n = atomic_load(&g_nrules);
    for (int i = 0; i < n && r == CUDA_SUCCESS; i++) {
        struct fault_rule *f = &g_rules[i];
        if (f->fn != fn) continue;
        if (f->nth) {
            if (f->nth == callno) r = f->err;
        } else {
            double u = (double)(splitmix64(&f->rng) >> 11) * 0x1.0p-53;
            if (u < f->prob) r = f->err;
        }
    }
    pthread_mutex_unlock(&g_fault_lock);
    return r;
}

/* tls_api: the API function the calling thread is in (for misuse messages). */

/* Every exported driver function starts here: count the call, inject a fault, check cuInit. */
static CUresult enter(int fn, int need_init)
{
    tls_api = fn_names[fn];
    pthread_once(&g_env_once, env_once);
    long callno = atomic_fetch_add(&g_calls[fn], 1) + 1;
    if (atomic_load(&g_nrules)) {
        CUresult r = fault_check(fn, callno);
        if (r != CUDA_SUCCESS) return r;
    }
    if (need_init && !atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

/* FN_##fn pastes the base name before cuda.h's #define (cuMemAlloc -> cuMemAlloc_v2) applies. */
#define ENTER_(idx, need_init)                                                                  \
    do {                                                                                        \
        CUresult enter_rc_ = enter(idx, need_init);                                             \
        if (enter_rc_ != CUDA_SUCCESS) return enter_rc_;                                        \
    } while (0)
#define ENTER(fn) ENTER_(FN_##fn, 1)
#define ENTER_NOINIT(fn) ENTER_(FN_##fn, 0)

/* ---- contexts -------------------------------------------------------------------------------- */

static struct stream *stream_new_locked(struct ctx *c, enum stream_kind kind, unsigned flags);

static struct ctx *ctx_new_locked(int device, int primary)
{
    struct ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->magic = CTX_MAGIC;
    c->device = device;
    c->is_primary = primary;
    c->legacy = stream_new_locked(c, SK_LEGACY, 0);
    if (!c->legacy) { free(c); return NULL; }
    c->next = g_ctxs;
    g_ctxs = c;
    return c;
}

/* Contexts are never freed (a destroyed one keeps its memory, marked), so a stale CUcontext can
 * always be checked; the list is searched by address, so a value that is not a context is never
 * dereferenced. */
static int ctx_known_locked(const struct ctx *c)
{
    for (struct ctx *x = g_ctxs; x; x = x->next)
        if (x == c) return 1;
    return 0;
}

static int ctx_valid_locked(struct ctx *c)
{
    return ctx_known_locked(c) && !c->destroyed;
}

/* A context argument: a live context, else NULL (CUDA_ERROR_INVALID_CONTEXT to the caller). A
 * destroyed context is that clean error; a non-NULL value the double never handed out as a context
 * is misuse: a real driver dereferences it. That is what a caller does that looks a CUDA 13 _v2
 * function up (cuCtxGetDevice_v2, cuCtxSynchronize_v2 take a context) and calls it with the old
 * signature: the context argument is whatever sits in the register, and the driver crashes
 * (DESIGN.md 10: the C demo's SIGSEGV on an H200). */
static struct ctx *ctx_arg_locked(CUcontext h)
{
    struct ctx *c = (struct ctx *)h;
    if (!c) return NULL;
    if (!ctx_known_locked(c)) {
        misuse(CUDA_ERROR_INVALID_CONTEXT, "%p is not a context (a stale register where a context "
               "argument belongs? cuda.h 13: cuCtxGetDevice_v2, cuCtxSynchronize_v2)", (void *)h);
        return NULL;
    }
    return c->destroyed ? NULL : c;
}

static struct ctx *ctx_current(void)
{
    return tls_ctx_depth ? tls_ctx_stack[tls_ctx_depth - 1] : NULL;
}

static int dev_valid(CUdevice d)
{
    return d >= 0 && d < g_cfg.devices;
}

/* ---- streams and the queue ------------------------------------------------------------------- */

static struct stream *stream_new_locked(struct ctx *c, enum stream_kind kind, unsigned flags)
{
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->id = g_next_stream_id++;
    s->handle = (CUstream)(uintptr_t)handle_of(STREAM_HANDLE_BASE, s->id);
    s->ctx = c;
    s->kind = kind;
    s->flags = flags;
    if (ht_put(&g_stream_tab, (uint64_t)(uintptr_t)s->handle, s)) { free(s); return NULL; }
    /* append: creation order keeps cudbl_progress's round robin stable */
    if (!g_streams) {
        g_streams = s;
        s->prev = s->next = NULL;
    } else {
        struct stream *t = g_streams;
        while (t->next) t = t->next;
        t->next = s;
        s->prev = t;
    }
    return s;
}

static void stream_maybe_free_locked(struct stream *s)
{
    if (!s->destroyed || s->refs || s->head || s->busy) return;
    if (s->prev) s->prev->next = s->next; else g_streams = s->next;
    if (s->next) s->next->prev = s->prev;
    ht_del(&g_stream_tab, (uint64_t)(uintptr_t)s->handle);
    free(s);
}

static void stream_unref_locked(struct stream *s)
{
    s->refs--;
    stream_maybe_free_locked(s);
}

static int stream_blocking(const struct stream *s)
{
    return s->kind != SK_LEGACY && !(s->flags & CU_STREAM_NON_BLOCKING);
}

/* Map a CUstream handle to a stream: 0 and CU_STREAM_LEGACY are the current context's legacy
 * stream, CU_STREAM_PER_THREAD this thread's default stream of the current context. */
static CUresult stream_resolve_locked(CUstream h, struct stream **out)
{
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct ctx *c = ctx_current();
        if (!c || !ctx_valid_locked(c)) return CUDA_ERROR_INVALID_CONTEXT;
        if (h != CU_STREAM_PER_THREAD) { *out = c->legacy; return CUDA_SUCCESS; }
        int free_slot = -1;
        for (int i = 0; i < PT_STREAMS_MAX; i++) {
            if (tls_pt_streams[i].ctx == c) { *out = tls_pt_streams[i].s; return CUDA_SUCCESS; }
            if (!tls_pt_streams[i].ctx && free_slot < 0) free_slot = i;
        }
        if (free_slot < 0) return CUDA_ERROR_NOT_SUPPORTED;
        struct stream *s = stream_new_locked(c, SK_PER_THREAD, 0);
        if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
        s->refs++;      /* the thread's slot holds it; never released (threads are few) */
        tls_pt_streams[free_slot].ctx = c;
        tls_pt_streams[free_slot].s = s;
        *out = s;
        return CUDA_SUCCESS;
    }
    struct stream *s = ht_get(&g_stream_tab, (uint64_t)(uintptr_t)h);
    if (s && s->kind != SK_USER) s = NULL;
    if ((!s && id_of(h, STREAM_HANDLE_BASE, g_next_stream_id)) || (s && s->destroyed))
        return misuse(CUDA_ERROR_INVALID_HANDLE, "stream %p was destroyed", (void *)h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    *out = s;
    return CUDA_SUCCESS;
}

static void push_item_locked(struct stream *s, struct item *it)
{
    it->next = NULL;
    if (s->tail) s->tail->next = it; else s->head = it;
    s->tail = it;
    s->enqueued++;
}

static int push_wait_locked(struct stream *s, struct stream *on, uint64_t pos)
{
    struct item *w = calloc(1, sizeof *w);
    if (!w) return -1;
    w->kind = IT_WAIT;
    w->wait_s = on;
    w->wait_pos = pos;
    on->refs++;
    push_item_locked(s, w);
    return 0;
}

static void settle_locked(struct stream *s);

/* ---- stream capture ---------------------------------------------------------------------------
 * A capturing stream does not run what is queued on it: the work is appended to its capture
 * sequence and replayed by cuGraphLaunch. The rules (cuda.h, cuThreadExchangeStreamCaptureMode):
 * synchronizing or querying a capturing stream or an event recorded in a capture fails and
 * invalidates the capture; the legacy stream cannot be used while a blocking stream of its context
 * captures; "potentially unsafe" calls (cuMemAlloc, cuMemFree, synchronous copies) fail while the
 * calling thread's mode prohibits them. */

/* Captures in context c (blocking streams only when `blocking_only`), optionally invalidated. */
static int ctx_captures_locked(struct ctx *c, int blocking_only, int invalidate)
{
    int found = 0;
    for (struct stream *b = g_streams; b; b = b->next) {
        if (b->ctx != c || !b->cap || !b->cap->active) continue;
        if (blocking_only && b->kind != SK_PER_THREAD && (b->flags & CU_STREAM_NON_BLOCKING)) continue;
        found = 1;
        if (invalidate) b->cap->invalidated = 1;
    }
    return found;
}

/* A potentially unsafe call (it may synchronize implicitly, or is not captured): refused while
 * the calling thread's capture mode prohibits it, invalidating the captures responsible. */
static CUresult capture_unsafe_locked(void)
{
    if (tls_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
    uint64_t me = thread_id();
    int prohibited = 0;
    for (struct capture *c = g_captures; c; c = c->next) {
        if (!c->active) continue;
        int own = c->thread == me && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED;
        int other = tls_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL && c->thread != me &&
                    c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
        if (own || other) {
            c->invalidated = 1;
            prohibited = 1;
        }
    }
    return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* Unmapping [va, va + size) while captures are in progress: cuMemUnmap is potentially unsafe (the
 * calling thread's capture mode decides, as for cuMemFree), and memory that captured work touches
 * cannot be unmapped under a capture in any mode: the graph would replay into nothing. Both
 * invalidate the captures concerned (docs/test-double.md). */
static int item_touches(const struct item *it, CUdeviceptr va, size_t size)
{
    int touches = 0;
    if (it->kind == IT_KERNEL || ((it->kind == IT_SET || it->kind == IT_COPY) && it->chk_dst))
        touches = it->dst < va + size && va < it->dst + it->n;
    if (it->kind == IT_COPY && it->chk_src) touches |= it->src < va + size && va < it->src + it->n;
    return touches;
}

static CUresult capture_unmap_conflict_locked(CUdeviceptr va, size_t size)
{
    CUresult rc = capture_unsafe_locked();
    for (struct capture *c = g_captures; c; c = c->next) {
        if (!c->active) continue;
        for (struct item *it = c->head; it; it = it->next) {
            if (item_touches(it, va, size)) {
                c->invalidated = 1;
                rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
                break;
            }
        }
    }
    return rc;
}

/* Synchronizing or querying s: impossible while it captures, and for the legacy stream while a
 * blocking stream of its context captures. Both invalidate the capture. */
static CUresult capture_sync_conflict_locked(struct stream *s)
{
    if (s->cap) {
        s->cap->invalidated = 1;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (s->kind == SK_LEGACY && ctx_captures_locked(s->ctx, 1, 1)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    return CUDA_SUCCESS;
}

/* Queue an item, adding the implicit waits of the legacy default stream: work on the legacy
 * stream waits for all earlier work on the context's blocking streams, and work on a blocking
 * stream waits for earlier work on the legacy stream (CUDA's "NULL stream semantics"). On a
 * capturing stream the item is captured instead. */
static CUresult enqueue_locked(struct stream *s, struct item *it)
{
    if (s->cap) {
        if (s->cap->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        it->next = NULL;
        if (s->cap->tail) s->cap->tail->next = it; else s->cap->head = it;
        s->cap->tail = it;
        s->cap_items++;
        return CUDA_SUCCESS;
    }
    if (s->kind == SK_LEGACY && ctx_captures_locked(s->ctx, 1, 1)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    if (s->kind == SK_LEGACY) {
        for (struct stream *b = g_streams; b; b = b->next)
            if (b != s && b->ctx == s->ctx && stream_blocking(b) && b->enqueued > b->completed)
                if (push_wait_locked(s, b, b->enqueued)) return CUDA_ERROR_OUT_OF_MEMORY;
    } else if (stream_blocking(s)) {
        struct stream *l = s->ctx->legacy;
        if (l->enqueued > l->completed && push_wait_locked(s, l, l->enqueued))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    push_item_locked(s, it);
    settle_locked(s);
    pthread_cond_broadcast(&g_cond);
    return CUDA_SUCCESS;
}

static void dalloc_destroy_locked(struct dalloc *a);

/* Remove the (finished) head item of s and account for it. */
static void pop_head_locked(struct stream *s)
{
    struct item *it = s->head;
    s->head = it->next;
    if (!s->head) s->tail = NULL;
    s->completed++;
    if (it->kind == IT_WAIT) stream_unref_locked(it->wait_s);
    free(it);
    pthread_cond_broadcast(&g_cond);
}

/* Items that need no execution complete as soon as they reach the head: markers, and waits
 * whose event has completed. */
static void settle_locked(struct stream *s)
{
    while (s->head && !s->busy) {
        struct item *it = s->head;
        if (it->kind == IT_NOP) {
            pop_head_locked(s);
        } else if (it->kind == IT_WAIT) {
            /* satisfied first: only an unsatisfied wait sends us to the other stream, which
             * cannot wait back on us (positions only grow), so this recursion ends */
            struct stream *w = it->wait_s;
            if (w->completed < it->wait_pos && w != s) settle_locked(w);
            if (w->completed < it->wait_pos) return;
            pop_head_locked(s);
        } else {
            return;
        }
    }
}

static int head_runnable_locked(const struct stream *s)
{
    if (!s->head || s->busy) return 0;
    if (s->head->kind == IT_WAIT) return s->head->wait_s->completed >= s->head->wait_pos;
    return 1;
}

static int device_access_locked(int dev, CUdeviceptr p, size_t n, int write, int kernel,
                                struct ctx *c, char *why, size_t whylen);

/* Run the head item of s (runnable). A host function, copy, set or kernel runs without the lock,
 * with the stream marked busy so nobody else starts its next item. Work that touches device
 * memory is checked first against the access of the stream's device: a violation is a device
 * fault (misuse) and the work does not run. */
static void run_head_locked(struct stream *s)
{
    struct item *it = s->head;
    if (it->kind == IT_COPY || it->kind == IT_SET || it->kind == IT_KERNEL) {
        char why[200];
        int dev = s->ctx->device, bad = 0;
        if (it->kind == IT_KERNEL) {
            bad = device_access_locked(dev, it->dst, it->n, it->write, 1, s->ctx, why, sizeof why);
        } else {
            if (it->chk_dst) bad = device_access_locked(dev, it->dst, it->n, 1, 0, s->ctx, why, sizeof why);
            if (!bad && it->chk_src)
                bad = device_access_locked(dev, it->src, it->n, 0, 0, s->ctx, why, sizeof why);
        }
        if (bad) {
            tls_api = it->kind == IT_KERNEL ? "an emulated kernel" : "a queued copy or set";
            misuse(CUDA_ERROR_ILLEGAL_ADDRESS, "%s", why);
        } else {
            s->busy = 1;
            pthread_mutex_unlock(&g_lock);
            if (it->kind == IT_COPY) memmove((void *)(uintptr_t)it->dst, (const void *)(uintptr_t)it->src, it->n);
            else if (it->kind == IT_SET) memset((void *)(uintptr_t)it->dst, it->value, it->n);
            else it->fn(it->arg);
            pthread_mutex_lock(&g_lock);
            s->busy = 0;
        }
    } else if (it->kind == IT_FN) {
        s->busy = 1;
        pthread_mutex_unlock(&g_lock);
        it->fn(it->arg);
        pthread_mutex_lock(&g_lock);
        s->busy = 0;
    } else if (it->kind == IT_FREE) {
        struct dalloc *a = ht_get(&g_alloc_tab, it->free_ptr);
        if (a) dalloc_destroy_locked(a);
    }
    pop_head_locked(s);
    settle_locked(s);
}

/* Make s complete its first pos items, running what they depend on first (cross-stream waits
 * are followed to the stream that must make progress). */
static void advance_locked(struct stream *s, uint64_t pos)
{
    s->refs++;
    while (s->completed < pos) {
        if (s->busy) { pthread_cond_wait(&g_cond, &g_lock); continue; }
        struct item *it = s->head;
        if (it->kind == IT_WAIT && it->wait_s->completed < it->wait_pos) {
            advance_locked(it->wait_s, it->wait_pos);
            continue;
        }
        run_head_locked(s);
    }
    stream_unref_locked(s);
}

/* Synchronize every stream of ctx c (all contexts of device dev when c is NULL; everything
 * when dev < 0 too), up to the work queued when called. */
static void sync_streams_snap_locked(struct ctx *c, int dev, int blocking_only);
static void sync_streams_locked(struct ctx *c, int dev) { sync_streams_snap_locked(c, dev, 0); }

/* blocking_only: the streams a synchronous copy on the legacy default stream waits for (the
 * context's legacy and per-thread streams and its blocking streams, never one created with
 * CU_STREAM_NON_BLOCKING: CUDA's "NULL stream semantics") */
static void sync_streams_snap_locked(struct ctx *c, int dev, int blocking_only)
{
    size_t n = 0;
    for (struct stream *s = g_streams; s; s = s->next) n++;
    if (!n) return;
    struct { struct stream *s; uint64_t pos; } *snap = calloc(n, sizeof *snap);
    size_t k = 0;
    for (struct stream *s = g_streams; s && snap; s = s->next) {
        if (c ? s->ctx != c : (dev >= 0 && s->ctx->device != dev)) continue;
        if (s->completed >= s->enqueued) continue;
        if (blocking_only && s->kind == SK_USER && (s->flags & CU_STREAM_NON_BLOCKING)) continue;
        s->refs++;
        snap[k].s = s;
        snap[k].pos = s->enqueued;
        k++;
    }
    if (!snap) {        /* no memory for a snapshot: drain everything, which is also correct */
        for (int again = 1; again;) {
            again = 0;
            for (struct stream *s = g_streams; s; s = s->next)
                if (s->completed < s->enqueued) { advance_locked(s, s->enqueued); again = 1; break; }
        }
        return;
    }
    for (size_t i = 0; i < k; i++) {
        advance_locked(snap[i].s, snap[i].pos);
        stream_unref_locked(snap[i].s);
    }
    free(snap);
}

/* The next ready stream after the one with id `after` (round robin by creation order). */
static struct stream *pick_runnable_locked(uint64_t after)
{
    struct stream *first = NULL, *found = NULL;
    for (struct stream *s = g_streams, *next; s && !found; s = next) {
        s->refs++;      /* settling may free other streams, never one we hold */
        settle_locked(s);
        next = s->next;
        if (head_runnable_locked(s)) {
            if (s->id > after) found = s;
            else if (!first) first = s;
        }
        s->refs--;      /* a runnable stream has a head, so it is not freed here */
        if (s != found && s != first) stream_maybe_free_locked(s);
    }
    return found ? found : first;
}

static void *gpu_thread_main(void *unused)
{
    (void)unused;
    uint64_t rng = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)&rng;
    uint64_t last = 0;
    pthread_mutex_lock(&g_lock);
    while (!g_gpu_stop) {
        struct stream *s = atomic_load(&g_async) ? pick_runnable_locked(last) : NULL;
        if (!s) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 2000000;
            if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
            pthread_cond_timedwait(&g_cond, &g_lock, &ts);
            continue;
        }
        last = s->id;
        s->refs++;
        unsigned delay = g_async_delay_us ? (unsigned)(splitmix64(&rng) % (g_async_delay_us + 1)) : 0;
        pthread_mutex_unlock(&g_lock);
        if (delay) usleep(delay);
        pthread_mutex_lock(&g_lock);
        if (head_runnable_locked(s)) run_head_locked(s);
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

static void gpu_thread_start_locked(void)
{
    if (g_gpu_started) return;
    if (pthread_create(&g_gpu_thread, NULL, gpu_thread_main, NULL) == 0) g_gpu_started = 1;
}

/* ---- memory bookkeeping ---------------------------------------------------------------------- */

static size_t round_up(size_t v, size_t a)
{
    return (v + a - 1) / a * a;
}

static int charge_locked(int dev, size_t bytes)
{
    if (bytes > g_cfg.capacity || g_dev_used[dev] > g_cfg.capacity - bytes) return -1;
    g_dev_used[dev] += bytes;
    if (g_dev_used[dev] > g_dev_peak[dev]) g_dev_peak[dev] = g_dev_used[dev];
    if (g_dev_used[dev] > g_dev_mark_peak[dev]) g_dev_mark_peak[dev] = g_dev_used[dev];
    g_counts.bytes_in_use += bytes;
    return 0;
}

static void uncharge_locked(int dev, size_t bytes)
{
    g_dev_used[dev] -= bytes;
    g_counts.bytes_in_use -= bytes;
}

/* Host-located handles are charged to the host, never to a device (cuMemGetInfo does not see them). */
static int host_charge_locked(size_t bytes)
{
    if (bytes > g_cfg.host_capacity || g_host_used > g_cfg.host_capacity - bytes) return -1;
    g_host_used += bytes;
    if (g_host_used > g_host_peak) g_host_peak = g_host_used;
    g_counts.host_bytes_in_use += bytes;
    g_counts.host_handles++;
    return 0;
}

static void host_uncharge_locked(size_t bytes)
{
    g_host_used -= bytes;
    g_counts.host_bytes_in_use -= bytes;
    g_counts.host_handles--;
}

/* cudbl_get_bytes: a current figure changed by delta; its two peaks follow it up. */
static void bytes_move_locked(size_t *cur, size_t *peak, size_t *mark_peak, size_t delta, int up)
{
    if (up) *cur += delta;
    else *cur -= delta;
    if (*cur > *peak) *peak = *cur;
    if (*cur > *mark_peak) *mark_peak = *cur;
}
#define HANDLE_BYTES(d, up) bytes_move_locked(&g_bytes.handle_bytes, &g_bytes.handle_peak, &g_bytes.handle_mark_peak, d, up)
#define MAPPED_BYTES(d, up) bytes_move_locked(&g_bytes.mapped_bytes, &g_bytes.mapped_peak, &g_bytes.mapped_mark_peak, d, up)

/* Physical memory: one sparse memfd for the whole process; each cuMemCreate takes a fresh range
 * (offsets are never reused) and gives its pages back with a hole punch. One fd, not one per
 * handle, so a job with thousands of handles does not run out of descriptors. */
static int memfd_take_locked(size_t size, off_t *off)
{
    if (g_memfd < 0) {
        g_memfd = memfd_create("cudbl-device-memory", MFD_CLOEXEC);
        if (g_memfd < 0) return -1;
    }
    if (g_memfd_next + (off_t)size > g_memfd_size) {
        off_t want = g_memfd_size ? g_memfd_size * 2 : (off_t)1 << 40;
        while (want < g_memfd_next + (off_t)size) want *= 2;
        if (ftruncate(g_memfd, want)) return -1;
        g_memfd_size = want;
    }
    *off = g_memfd_next;
    g_memfd_next += (off_t)size;
    return 0;
}

/* Like the driver: physical memory goes away only once the handle is released and no mapping
 * uses it any more. */
static void phys_maybe_free_locked(struct phys *p)
{
    if (p->refs > 0 || p->maps > 0) return;
    if (p->fd >= 0) close(p->fd);   /* a shareable handle: an exported fd keeps its pages alive */
    else if (fallocate(g_memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, p->off, (off_t)p->size))
        warn("hole punch failed: %s%s", strerror(errno), "");
    if (p->charged && phys_on_host(p)) {
        host_uncharge_locked(p->size);
    } else if (p->charged) {
        uncharge_locked(p->device, p->size);
        HANDLE_BYTES(p->size, 0); /* counted where it was charged: cuMemCreate */
        g_bytes.released_total += p->size;
    }
    g_counts.handles--;
    free(p);
}

static struct resv *resv_containing_locked(CUdeviceptr va, size_t size)
{
    for (struct resv *r = g_resvs; r; r = r->next)
        if (va >= r->base && size <= r->size && va - r->base <= r->size - size) return r;
    return NULL;
}

/* Every granularity page of every mapping is in g_page_tab (page address -> mapping), so finding
 * the mapping behind an address is O(1) however many mappings exist. */
static struct vmap *vmap_containing_locked(CUdeviceptr va)
{
    return ht_get(&g_page_tab, (uint64_t)(va & ~(CUdeviceptr)(g_cfg.granularity - 1)));
}

static int pages_index_locked(struct vmap *m)
{
    for (size_t off = 0; off < m->size; off += g_cfg.granularity)
        if (ht_put(&g_page_tab, (uint64_t)(m->va + off), m)) {
            for (size_t o = 0; o < off; o += g_cfg.granularity) ht_del(&g_page_tab, (uint64_t)(m->va + o));
            return -1;
        }
    return 0;
}

static void pages_unindex_locked(struct vmap *m)
{
    for (size_t off = 0; off < m->size; off += g_cfg.granularity) ht_del(&g_page_tab, (uint64_t)(m->va + off));
}

static struct resv *resv_of_locked(CUdeviceptr p)
{
    for (struct resv *r = g_resvs; r; r = r->next)
        if (p >= r->base && p - r->base < r->size) return r;
    return NULL;
}

/* The cuMemAlloc block containing p (a scan: plain allocations are few in tests). */
static struct dalloc *dalloc_containing_locked(CUdeviceptr p)
{
    for (size_t i = 0; i < g_alloc_tab.cap; i++) {
        if (g_alloc_tab.keys[i] <= HT_TOMB) continue;
        struct dalloc *a = g_alloc_tab.vals[i];
        if (p >= a->ptr && p - a->ptr < a->size) return a;
    }
    return NULL;
}

static int is_device_memory_locked(CUdeviceptr p)
{
    return resv_of_locked(p) || dalloc_containing_locked(p);
}

/* May device `dev` touch [p, p + n) (for writing when `write`)? This is how the double decides
 * what a device may do (docs/test-double.md): VMM memory needs a mapping of every page with
 * access granted to `dev` (cuMemSetAccess, per device), except that a copy (not a kernel) of
 * memory owned by a device that is not peer capable with `dev` is staged, so the owner's access
 * counts; cuMemAlloc memory must contain the whole range, and a kernel running in context c on
 * another device needs peer access enabled from c. Returns 0, or 1 with the reason in why. */
static int device_access_locked(int dev, CUdeviceptr p, size_t n, int write, int kernel,
                                struct ctx *c, char *why, size_t whylen)
{
    if (!n) return 0;
    if (p + n < p) {
        snprintf(why, whylen, "range at %#llx wraps around", (unsigned long long)p);
        return 1;
    }
    if (resv_of_locked(p)) {
        size_t g = g_cfg.granularity;
        for (CUdeviceptr a = p & ~(CUdeviceptr)(g - 1); a < p + n; a += g) {
            struct vmap *m = ht_get(&g_page_tab, (uint64_t)a);
            CUdeviceptr at = a < p ? p : a;
            if (!m) {
                snprintf(why, whylen, "device %d touched %#llx: reserved but not mapped", dev,
                         (unsigned long long)at);
                return 1;
            }
            /* a copy between devices that cannot reach each other is staged by the driver: the
             * owner touches its own memory; between peers the copying device does */
            int who = dev, owner = m->p->device;
            if (phys_on_host(m->p)) owner = dev; /* host memory: over the bus */
            if (!kernel && owner != dev && !g_peer[dev][owner]) who = owner;
            unsigned f = m->access[who];
            if (f == CU_MEM_ACCESS_FLAGS_PROT_NONE || (write && f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
                snprintf(why, whylen, "device %d %s %#llx (memory of device %d) without %s access "
                         "(cuMemSetAccess grants it per device)", who, write ? "wrote" : "read",
                         (unsigned long long)at, owner, write ? "read-write" : "read");
                return 1;
            }
        }
        return 0;
    }
    struct dalloc *d = dalloc_containing_locked(p);
    if (!d) {
        snprintf(why, whylen, "device %d touched %#llx, which is not device memory", dev,
                 (unsigned long long)p);
        return 1;
    }
    if (p + n > d->ptr + d->size) {
        snprintf(why, whylen, "device %d touched [%#llx, +%zu), past the end of the allocation at %#llx",
                 dev, (unsigned long long)p, n, (unsigned long long)d->ptr);
        return 1;
    }
    if (kernel && d->device != dev && !(c && (c->peer_mask & (1u << d->device)))) {
        snprintf(why, whylen, "a kernel on device %d touched %#llx (cuMemAlloc memory of device %d) "
                 "without peer access", dev, (unsigned long long)p, d->device);
        return 1;
    }
    return 0;
}

/* The next mapping at or after address *a within [*a, end), or NULL; *a moves past it. */
static struct vmap *next_map_locked(CUdeviceptr *a, CUdeviceptr end)
{
    size_t g = g_cfg.granularity;
    for (CUdeviceptr x = *a & ~(CUdeviceptr)(g - 1); x < end; x += g) {
        struct vmap *m = ht_get(&g_page_tab, (uint64_t)x);
        if (m) {
            *a = m->va + m->size;
            return m;
        }
    }
    *a = end;
    return NULL;
}

/* Bytes of [va, va+size) covered by mappings; *partial set when a mapping sticks out. */
static size_t covered_locked(CUdeviceptr va, size_t size, int *partial)
{
    size_t covered = 0;
    CUdeviceptr end = va + size;
    *partial = 0;
    for (CUdeviceptr a = va; a < end;) {
        struct vmap *m = next_map_locked(&a, end);
        if (!m) break;
        CUdeviceptr lo = m->va > va ? m->va : va;
        CUdeviceptr hi = m->va + m->size < end ? m->va + m->size : end;
        covered += hi - lo;
        if (m->va < va || m->va + m->size > end) *partial = 1;
    }
    return covered;
}

static void dalloc_destroy_locked(struct dalloc *a)
{
    munmap((void *)(uintptr_t)a->ptr, round_up(a->size, (size_t)sysconf(_SC_PAGESIZE)));
    uncharge_locked(a->device, a->charged);
    ht_del(&g_alloc_tab, a->ptr);
    g_counts.allocs--;
    free(a);
}

static CUresult dalloc_new_locked(CUdeviceptr *dptr, size_t size, int dev)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t charged = round_up(size, page);
    if (charge_locked(dev, charged)) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = mmap(NULL, charged, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    struct dalloc *a = p == MAP_FAILED ? NULL : calloc(1, sizeof *a);
    if (!a || ht_put(&g_alloc_tab, (uint64_t)(uintptr_t)p, a)) {
        if (p != MAP_FAILED) munmap(p, charged);
        free(a);
        uncharge_locked(dev, charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->ptr = (CUdeviceptr)(uintptr_t)p;
    a->size = size;
    a->charged = charged;
    a->device = dev;
    g_counts.allocs++;
    *dptr = a->ptr;
    return CUDA_SUCCESS;
}

/* ---- initialization and devices -------------------------------------------------------------- */

CUresult CUDAAPI cuInit(unsigned int flags)
{
    ENTER_NOINIT(cuInit);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    const char *f = getenv("CUDBL_FAIL_INIT");
    if (f && *f && strcmp(f, "0") != 0) return CUDA_ERROR_NO_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (!atomic_load(&g_inited)) {
        if (!g_configured_by_api) config_from_env();
        if (!g_peer_configured) peer_from_env();
        for (int d = 0; d < MAX_DEVICES; d++) {
            g_primary[d] = ctx_new_locked(d, 1);
            if (!g_primary[d]) { pthread_mutex_unlock(&g_lock); return CUDA_ERROR_OUT_OF_MEMORY; }
        }
        const char *a = getenv("CUDBL_ASYNC");
        if (a && *a && strcmp(a, "0") != 0) atomic_store(&g_async, 1);
        if (atomic_load(&g_async)) gpu_thread_start_locked();
        atomic_store(&g_inited, 1);
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int *driverVersion)
{
    ENTER_NOINIT(cuDriverGetVersion);
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int *count)
{
    ENTER(cuDeviceGetCount);
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_cfg.devices;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal)
{
    ENTER(cuDeviceGet);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev)
{
    ENTER(cuDeviceGetName);
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "memshim test double");
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENTER(cuDeviceTotalMem);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = g_cfg.capacity;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    ENTER(cuDeviceGetAttribute);
    if (!pi || (int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    int v = 0;
    switch (attrib) {   /* an H100-like device; anything not listed reads 0 */
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50 << 20; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = dev + 1; break;
    case CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED: v = 0; break;
    /* host memory through VMM (CUDBL_HOST_VMM); one host NUMA node, 0; no IPC of it */
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = !!(g_cfg.host_vmm & HOST_VMM_NUMA); break;
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = !!(g_cfg.host_vmm & HOST_VMM_HOST); break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: v = 0; break;
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* ---- contexts -------------------------------------------------------------------------------- */

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRetain);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    g_primary[dev]->primary_refs++;
    *pctx = (CUcontext)g_primary[dev];
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRelease);
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_primary[dev]->primary_refs <= 0) rc = CUDA_ERROR_INVALID_CONTEXT;
    else g_primary[dev]->primary_refs--;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    ENTER(cuDevicePrimaryCtxGetState);
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    *flags = g_primary[dev]->flags;
    *active = g_primary[dev]->primary_refs > 0;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (tls_ctx_depth >= CTX_STACK_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_new_locked(dev, 0);
    if (c) c->flags = flags;
    pthread_mutex_unlock(&g_lock);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    tls_ctx_stack[tls_ctx_depth++] = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ENTER(cuCtxCreate);
    return ctx_create(pctx, flags, dev);
}

/* CUDA 11.4's form ("cuCtxCreate" from version 11040 until 12050): execution affinity, which
 * the double does not emulate, is refused. */
CUresult CUDAAPI cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                unsigned int flags, CUdevice dev);
CUresult CUDAAPI cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                unsigned int flags, CUdevice dev)
{
    ENTER(cuCtxCreate);
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    if (numParams > 0) return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_create(pctx, flags, dev);
}

CUresult CUDAAPI cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                CUdevice dev)
{
    ENTER(cuCtxCreate);
    if (params && (params->execAffinityParams || params->cigParams)) return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_create(pctx, flags, dev);
}

CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx)
{
    ENTER(cuCtxDestroy);
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_arg_locked(ctx);
    if (!c || c->is_primary) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    sync_streams_locked(c, -1);
    for (struct stream *s = g_streams, *n; s; s = n) {
        n = s->next;
        if (s->ctx != c || s->destroyed) continue;
        if (s->kind == SK_USER) g_counts.streams--;
        s->destroyed = 1;
        stream_maybe_free_locked(s);
    }
    c->legacy = NULL;
    c->destroyed = 1;
    pthread_mutex_unlock(&g_lock);
    /* the driver pops it if current to the calling thread */
    if (ctx_current() == c) tls_ctx_depth--;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx)
{
    ENTER(cuCtxGetCurrent);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)ctx_current();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx)
{
    ENTER(cuCtxSetCurrent);
    struct ctx *c = (struct ctx *)ctx;
    if (!c) {
        if (tls_ctx_depth) tls_ctx_depth--;
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&g_lock);
    int ok = ctx_arg_locked(ctx) != NULL;
    pthread_mutex_unlock(&g_lock);
    if (!ok) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_ctx_depth) tls_ctx_stack[tls_ctx_depth - 1] = c;
    else tls_ctx_stack[tls_ctx_depth++] = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent_v2(CUcontext ctx)
{
    ENTER(cuCtxPushCurrent);
    struct ctx *c = (struct ctx *)ctx;
    pthread_mutex_lock(&g_lock);
    int ok = ctx_arg_locked(ctx) != NULL;
    pthread_mutex_unlock(&g_lock);
    if (!ok) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_ctx_depth >= CTX_STACK_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    tls_ctx_stack[tls_ctx_depth++] = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent_v2(CUcontext *pctx)
{
    ENTER(cuCtxPopCurrent);
    if (!tls_ctx_depth) return CUDA_ERROR_INVALID_CONTEXT;
    struct ctx *c = tls_ctx_stack[--tls_ctx_depth];
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device)
{
    ENTER(cuCtxGetDevice);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    struct ctx *c = ctx_current();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->device;
    return CUDA_SUCCESS;
}

/* The current context, validated, under the lock; NULL means CUDA_ERROR_INVALID_CONTEXT. */
static struct ctx *ctx_current_locked(void)
{
    struct ctx *c = ctx_current();
    return c && ctx_valid_locked(c) ? c : NULL;
}

/* CUDA 13's form (what cuGetProcAddress returns for "cuCtxGetDevice" from version 13000): the
 * device of `ctx`, of the current context when ctx is NULL. */
CUresult CUDAAPI cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    ENTER(cuCtxGetDevice);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx ? ctx_arg_locked(ctx) : ctx_current_locked();
    if (c) *device = c->device;
    pthread_mutex_unlock(&g_lock);
    return c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* Waiting for a context whose stream captures cannot end: refused, and the captures are
 * invalidated (as cuCtxRecordEvent documents for a context with a capturing stream). */
static CUresult ctx_synchronize_locked(struct ctx *c)
{
    CUresult rc = !c ? CUDA_ERROR_INVALID_CONTEXT
                : ctx_captures_locked(c, 0, 1) ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) sync_streams_locked(c, -1);
    return rc;
}

CUresult CUDAAPI cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    pthread_mutex_lock(&g_lock);
    CUresult rc = ctx_synchronize_locked(ctx_current_locked());
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* CUDA 13's form ("cuCtxSynchronize" from version 13000): `ctx`, the current context when NULL. */
CUresult CUDAAPI cuCtxSynchronize_v2(CUcontext ctx)
{
    ENTER(cuCtxSynchronize);
    pthread_mutex_lock(&g_lock);
    CUresult rc = ctx_synchronize_locked(ctx ? ctx_arg_locked(ctx) : ctx_current_locked());
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- peers --------------------------------------------------------------------------------------
 * Capability is CUDBL_PEER (default: every pair). Enabling peer access lets kernels of the current
 * context touch cuMemAlloc memory of the peer context's device; it does not cover VMM mappings,
 * which need cuMemSetAccess for each device (as on a GPU). */
CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    ENTER(cuDeviceCanAccessPeer);
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(dev) || !dev_valid(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    *canAccessPeer = dev != peerDev && g_peer[dev][peerDev];
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    ENTER(cuCtxEnablePeerAccess);
    if (Flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked(), *p = ctx_arg_locked(peerContext);
    CUresult rc = !c || !p ? CUDA_ERROR_INVALID_CONTEXT
                : p->device == c->device ? CUDA_ERROR_INVALID_DEVICE
                : !g_peer[c->device][p->device] ? CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
                : (c->peer_mask & (1u << p->device)) ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                                                     : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) c->peer_mask |= 1u << p->device;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext peerContext)
{
    ENTER(cuCtxDisablePeerAccess);
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked(), *p = ctx_arg_locked(peerContext);
    CUresult rc = !c || !p ? CUDA_ERROR_INVALID_CONTEXT
                : !(c->peer_mask & (1u << p->device)) ? CUDA_ERROR_PEER_ACCESS_NOT_ENABLED : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) c->peer_mask &= ~(1u << p->device);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- plain allocations ----------------------------------------------------------------------- */

CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    ENTER(cuMemGetInfo);
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked();
    if (c) {
        *free_bytes = g_cfg.capacity - g_dev_used[c->device];
        *total = g_cfg.capacity;
    }
    pthread_mutex_unlock(&g_lock);
    return c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENTER(cuMemAlloc);
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked();
    CUresult rc = c ? capture_unsafe_locked() : CUDA_ERROR_INVALID_CONTEXT;
    if (rc == CUDA_SUCCESS) rc = dalloc_new_locked(dptr, bytesize, c->device);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* cuMemFree waits for the device like the real one, so memory freed this way is never still in
 * use by queued work. */
CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree);
    if (dptr == 0) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct dalloc *a = ht_get(&g_alloc_tab, dptr);
    CUresult rc = capture_unsafe_locked();
    if (rc == CUDA_SUCCESS) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_ERROR_INVALID_VALUE && a && !a->free_pending) {
        a->free_pending = 1;
        sync_streams_locked(NULL, a->device);
        dalloc_destroy_locked(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTER(cuMemAllocAsync);
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    /* allocation nodes in captured graphs are not emulated */
    if (rc == CUDA_SUCCESS && s->cap) rc = CUDA_ERROR_NOT_SUPPORTED;
    if (rc == CUDA_SUCCESS) rc = dalloc_new_locked(dptr, bytesize, s->ctx->device);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The free itself is queued: the block is unmapped only when the stream reaches it. */
CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync);
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    struct dalloc *a = rc == CUDA_SUCCESS ? ht_get(&g_alloc_tab, dptr) : NULL;
    if (rc == CUDA_SUCCESS && s->cap) rc = CUDA_ERROR_NOT_SUPPORTED; /* no free nodes in graphs */
    if (rc == CUDA_SUCCESS && (!a || a->free_pending)) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        struct item *it = calloc(1, sizeof *it);
        if (!it) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            it->kind = IT_FREE;
            it->free_ptr = dptr;
            a->free_pending = 1;
            rc = enqueue_locked(s, it);
            if (rc != CUDA_SUCCESS) { a->free_pending = 0; free(it); }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The allocation containing dptr: a cuMemAlloc block, or the one mapping (cuMemMap) it lies in.
 * Like the driver, each cuMemMap is its own range, whatever was mapped next to it. */
CUresult CUDAAPI cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    ENTER(cuMemGetAddressRange);
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&g_lock);
    if (!ctx_current_locked()) rc = CUDA_ERROR_INVALID_CONTEXT;
    struct dalloc *a = rc == CUDA_ERROR_NOT_FOUND ? dalloc_containing_locked(dptr) : NULL;
    struct vmap *m = rc == CUDA_ERROR_NOT_FOUND && !a ? vmap_containing_locked(dptr) : NULL;
    if (a || m) {
        if (pbase) *pbase = a ? a->ptr : m->va;
        if (psize) *psize = a ? a->size : m->size;
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- pointer attributes ------------------------------------------------------------------------
 * Answered per allocation as the driver does: a cuMemAlloc block, or the single mapping an address
 * lies in (RANGE_START_ADDR/RANGE_SIZE describe that mapping, not what was mapped beside it).
 * Needs a current context (CUDA_ERROR_INVALID_CONTEXT). */
static CUresult pointer_attr_locked(void *data, CUpointer_attribute attr, CUdeviceptr ptr, int lenient)
{
    struct ctx *cur = ctx_current_locked();
    struct dalloc *a = dalloc_containing_locked(ptr);
    struct vmap *m = a ? NULL : vmap_containing_locked(ptr);
    if (!a && !m) {
        if (!lenient) return CUDA_ERROR_INVALID_VALUE;
        /* cuPointerGetAttributes: not a CUDA pointer gives zero values and success */
        size_t sz = attr == CU_POINTER_ATTRIBUTE_CONTEXT ? sizeof(CUcontext)
                    : attr == CU_POINTER_ATTRIBUTE_MEMORY_TYPE || attr == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL ||
                              attr == CU_POINTER_ATTRIBUTE_IS_MANAGED || attr == CU_POINTER_ATTRIBUTE_MAPPED ||
                              attr == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
                        ? sizeof(int)
                        : sizeof(unsigned long long);
        if (attr == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) *(int *)data = -2;
        else memset(data, 0, sz);
        return CUDA_SUCCESS;
    }
    int dev = a ? a->device : m->p->device;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)g_primary[dev]; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: return CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = dev; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *(unsigned long long *)data = a ? (unsigned long long)a->ptr : (unsigned long long)m->va;
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = a ? a->ptr : m->va; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = a ? a->size : m->size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = a != NULL; break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned long long *)data = a ? 0 : m->p->handle_types;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        if (!cur) return CUDA_ERROR_INVALID_CONTEXT;
        *(unsigned int *)data = a ? (a->device == cur->device ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
                                                               : CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE)
                                  : m->access[cur->device] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                                        ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
                                  : m->access[cur->device] ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ
                                                           : CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
        break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    ENTER(cuPointerGetAttribute);
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = ctx_current_locked() ? pointer_attr_locked(data, attribute, ptr, 0) : CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr ptr)
{
    ENTER(cuPointerGetAttributes);
    if (!n || !attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = ctx_current_locked() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    for (unsigned i = 0; i < n && rc == CUDA_SUCCESS; i++)
        rc = data[i] ? pointer_attr_locked(data[i], attributes[i], ptr, 1) : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- legacy IPC ---------------------------------------------------------------------------------
 * Only the base of a cuMemAlloc block can be exported (cuda.h: "an existing device memory
 * allocation created with cuMemAlloc"): VMM memory is refused, as on a GPU. Opening a handle in
 * the process that exported it is refused too; other processes cannot be emulated. */
#define IPC_MAGIC 0x4344424c49504331ull /* "CDBLIPC1" */

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    ENTER(cuIpcGetMemHandle);
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = ctx_current_locked() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    struct dalloc *a = rc == CUDA_SUCCESS ? ht_get(&g_alloc_tab, dptr) : NULL;
    if (rc == CUDA_SUCCESS && (!a || a->free_pending)) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        uint64_t words[4] = {IPC_MAGIC, (uint64_t)getpid(), (uint64_t)dptr, (uint64_t)a->size};
        memset(pHandle, 0, sizeof *pHandle);
        memcpy(pHandle->reserved, words, sizeof words);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    ENTER(cuIpcOpenMemHandle);
    if (!pdptr || (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t words[4];
    memcpy(words, handle.reserved, sizeof words);
    if (words[0] != IPC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    if (words[1] == (uint64_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* same process */
    return CUDA_ERROR_NOT_SUPPORTED;    /* another process's memory: beyond the double */
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    ENTER(cuIpcCloseMemHandle);
    (void)dptr;
    return CUDA_ERROR_INVALID_VALUE;    /* nothing can have been opened */
}

/* ---- copies and sets ---------------------------------------------------------------------------
 * Which device touches memory (docs/test-double.md): a synchronous copy or set runs on the device
 * of the calling thread's current context, an asynchronous one (and cudbl_launch) on the device of
 * its stream, cuMemcpyPeer reads with the source context's device and writes with the destination
 * context's. Arguments that must be device memory and are not fail with CUDA_ERROR_INVALID_VALUE;
 * device memory the device may not touch is a device fault: misuse (CUDA_ERROR_ILLEGAL_ADDRESS when
 * misuse is only counted). Synchronous ones wait for the device first, as the driver's do, and
 * are potentially unsafe during stream capture. */

enum { ARG_HOST_OK = 0, ARG_DEVICE = 1 };

/* Check one argument of a copy: `need` ARG_DEVICE for a device-only argument. Host memory is
 * fine where host memory is allowed (cuMemcpy decides per pointer, with unified addressing). */
static CUresult copy_arg_locked(int dev, struct ctx *c, CUdeviceptr p, size_t n, int write, int need)
{
    if (!n) return CUDA_SUCCESS;
    if (!is_device_memory_locked(p)) return need == ARG_DEVICE ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    char why[200];
    if (device_access_locked(dev, p, n, write, 0, c, why, sizeof why))
        return misuse(CUDA_ERROR_ILLEGAL_ADDRESS, "%s", why);
    return CUDA_SUCCESS;
}

/* A synchronous copy (src may be 0 for a set) from the current context: wait for the device,
 * then check and do it on host memory. per_thread: the _ptds form (the default stream is the
 * calling thread's). */
static CUresult copy_sync_on(int per_thread, CUdeviceptr dst, int dst_need, CUdeviceptr src, int src_need,
                             size_t n, int set, int value)
{
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current();
    CUresult rc = c && ctx_valid_locked(c) ? capture_unsafe_locked() : CUDA_ERROR_INVALID_CONTEXT;
    struct stream *pt = NULL;
    if (rc == CUDA_SUCCESS && per_thread) rc = stream_resolve_locked(CU_STREAM_PER_THREAD, &pt);
    if (rc == CUDA_SUCCESS) {
        if (pt) {
            /* on the per-thread default stream: it waits for that stream's work and, the stream
             * being a blocking one, for the legacy stream's, not for other streams' */
            uint64_t legacy_pos = c->legacy->enqueued, pt_pos = pt->enqueued;
            advance_locked(c->legacy, legacy_pos);
            advance_locked(pt, pt_pos);
        } else {
            /* a synchronous copy runs on the legacy default stream: it waits for what that stream
             * waits for, not for non-blocking streams (their work may still be running) */
            sync_streams_snap_locked(c, c->device, 1);
        }
        rc = copy_arg_locked(c->device, c, dst, n, 1, dst_need);
        if (rc == CUDA_SUCCESS && !set) rc = copy_arg_locked(c->device, c, src, n, 0, src_need);
    }
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS || !n) return rc;
    if (set) memset((void *)(uintptr_t)dst, value, n);
    else memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

static CUresult copy_sync(CUdeviceptr dst, int dst_need, CUdeviceptr src, int src_need, size_t n,
                          int set, int value)
{
    return copy_sync_on(0, dst, dst_need, src, src_need, n, set, value);
}

CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    ENTER(cuMemcpyHtoD);
    return copy_sync(dst, ARG_DEVICE, (CUdeviceptr)(uintptr_t)src, ARG_HOST_OK, n, 0, 0);
}

CUresult CUDAAPI cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoH);
    return copy_sync((CUdeviceptr)(uintptr_t)dst, ARG_HOST_OK, src, ARG_DEVICE, n, 0, 0);
}

CUresult CUDAAPI cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoD);
    return copy_sync(dst, ARG_DEVICE, src, ARG_DEVICE, n, 0, 0);
}

CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n)
{
    ENTER(cuMemsetD8);
    return copy_sync(dst, ARG_DEVICE, 0, ARG_HOST_OK, n, 1, uc);
}

/* Unified addressing: each pointer is device or host memory by where it lies. */
static CUresult copy_peer(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n);
CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpy);
    return copy_sync(dst, ARG_HOST_OK, src, ARG_HOST_OK, n, 0, 0);
}

/* The per-thread default stream forms of the synchronous ones (_ptds: what cuGetProcAddress gives
 * with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM from version 7000). */
CUresult CUDAAPI cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n);
CUresult CUDAAPI cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    ENTER(cuMemcpyHtoD);
    return copy_sync_on(1, dst, ARG_DEVICE, (CUdeviceptr)(uintptr_t)src, ARG_HOST_OK, n, 0, 0);
}
CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n);
CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoH);
    return copy_sync_on(1, (CUdeviceptr)(uintptr_t)dst, ARG_HOST_OK, src, ARG_DEVICE, n, 0, 0);
}
CUresult CUDAAPI cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult CUDAAPI cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoD);
    return copy_sync_on(1, dst, ARG_DEVICE, src, ARG_DEVICE, n, 0, 0);
}
CUresult CUDAAPI cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n);
CUresult CUDAAPI cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n)
{
    ENTER(cuMemsetD8);
    return copy_sync_on(1, dst, ARG_DEVICE, 0, ARG_HOST_OK, n, 1, uc);
}
CUresult CUDAAPI cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult CUDAAPI cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpy);
    return copy_sync_on(1, dst, ARG_HOST_OK, src, ARG_HOST_OK, n, 0, 0);
}

/* Each side is touched by the device of its own context (the copy may be staged). */
CUresult CUDAAPI cuMemcpyPeer(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n)
{
    ENTER(cuMemcpyPeer);
    return copy_peer(dst, dstCtx, src, srcCtx, n);
}

/* The per-thread form: the double's peer copy already waits for both devices, which covers the
 * thread's default stream too. */
CUresult CUDAAPI cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n);
CUresult CUDAAPI cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n)
{
    ENTER(cuMemcpyPeer);
    return copy_peer(dst, dstCtx, src, srcCtx, n);
}

static CUresult copy_peer(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n)
{
    pthread_mutex_lock(&g_lock);
    struct ctx *dc = ctx_arg_locked(dstCtx), *sc = ctx_arg_locked(srcCtx);
    CUresult rc = dc && sc ? capture_unsafe_locked() : CUDA_ERROR_INVALID_CONTEXT;
    if (rc == CUDA_SUCCESS) {
        sync_streams_locked(NULL, dc->device);
        sync_streams_locked(NULL, sc->device);
        rc = copy_arg_locked(dc->device, dc, dst, n, 1, ARG_DEVICE);
        if (rc == CUDA_SUCCESS) rc = copy_arg_locked(sc->device, sc, src, n, 0, ARG_DEVICE);
    }
    pthread_mutex_unlock(&g_lock);
    if (rc == CUDA_SUCCESS && n) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return rc;
}

/* Asynchronous copies and sets are queued; the device of the stream touches the memory when
 * the item runs (run_head_locked checks). Device-only arguments are checked at once. */
static CUresult copy_async(CUstream h, CUdeviceptr dst, int dst_need, CUdeviceptr src, int src_need,
                           size_t n, int set, int value)
{
    struct item *it = calloc(1, sizeof *it);
    if (!it) return CUDA_ERROR_OUT_OF_MEMORY;
    it->kind = set ? IT_SET : IT_COPY;
    it->dst = dst;
    it->src = src;
    it->n = n;
    it->value = value;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(h, &s);
    if (rc == CUDA_SUCCESS && n) {
        if (dst_need == ARG_DEVICE && !is_device_memory_locked(dst)) rc = CUDA_ERROR_INVALID_VALUE;
        if (!set && src_need == ARG_DEVICE && !is_device_memory_locked(src)) rc = CUDA_ERROR_INVALID_VALUE;
        /* host memory on one side: only the device side is checked when the copy runs */
        it->chk_dst = is_device_memory_locked(dst);
        it->chk_src = !set && is_device_memory_locked(src);
    }
    if (rc == CUDA_SUCCESS && n) rc = enqueue_locked(s, it);
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS || !n) free(it);
    return rc;
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    ENTER(cuMemcpyAsync);
    return copy_async(s, dst, ARG_HOST_OK, src, ARG_HOST_OK, n, 0, 0);
}

CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    ENTER(cuMemcpyHtoDAsync);
    return copy_async(s, dst, ARG_DEVICE, (CUdeviceptr)(uintptr_t)src, ARG_HOST_OK, n, 0, 0);
}

CUresult CUDAAPI cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    ENTER(cuMemcpyDtoHAsync);
    return copy_async(s, (CUdeviceptr)(uintptr_t)dst, ARG_HOST_OK, src, ARG_DEVICE, n, 0, 0);
}

CUresult CUDAAPI cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    ENTER(cuMemcpyDtoDAsync);
    return copy_async(s, dst, ARG_DEVICE, src, ARG_DEVICE, n, 0, 0);
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s)
{
    ENTER(cuMemsetD8Async);
    return copy_async(s, dst, ARG_DEVICE, 0, ARG_HOST_OK, n, 1, uc);
}

/* Queued on the stream; the stream's device touches both sides (peer contexts must be valid). */
CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx,
                                   size_t n, CUstream s)
{
    ENTER(cuMemcpyPeerAsync);
    pthread_mutex_lock(&g_lock);
    int ok = ctx_arg_locked(dstCtx) && ctx_arg_locked(srcCtx);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return CUDA_ERROR_INVALID_CONTEXT;
    return copy_async(s, dst, ARG_DEVICE, src, ARG_DEVICE, n, 0, 0);
}

/* ---- virtual memory management --------------------------------------------------------------- */

/* A location cuMemCreate takes: a device, or host memory where the device attributes say the
 * driver has it (HOST_NUMA with the node's id, 0 here; HOST, whose id is ignored).
 * HOST_NUMA_CURRENT is refused, as cuMemCreate's documentation says. */
static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return dev_valid(prop->location.id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (!(g_cfg.host_vmm & HOST_VMM_NUMA)) return CUDA_ERROR_NOT_SUPPORTED;
        return prop->location.id == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST:
        return (g_cfg.host_vmm & HOST_VMM_HOST) ? CUDA_SUCCESS : CUDA_ERROR_NOT_SUPPORTED;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    ENTER(cuMemGetAllocationGranularity);
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop);
    if (rc != CUDA_SUCCESS) return rc;
    *granularity = g_cfg.granularity;
    return CUDA_SUCCESS;
}

/* A shareable handle (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) gets a memfd of its own, named
 * after its device so an importing process can tell where it lives; other handles share one. */
static int shareable_fd_new(int dev, size_t size)
{
    char name[32];
    snprintf(name, sizeof name, "cudbl-dev%d", dev);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)size)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags)
{
    CALL_BYTES(cuMemCreate, size);
    ENTER(cuMemCreate);
    if (!handle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop);
    if (rc != CUDA_SUCCESS) return rc;
    int host = prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE;
    /* host allocations are not IPC capable: requestedHandleTypes must be 0 (the driver's rule for
     * HOST; this double has no multi-node IPC of HOST_NUMA memory either) */
    if (host && prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_INVALID_VALUE;
    if (prop->requestedHandleTypes & ~(unsigned long long)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (size == 0 || size % g_cfg.granularity) return CUDA_ERROR_INVALID_VALUE;
    int dev = host ? 0 : prop->location.id;
    struct phys *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->fd = -1;
    int shareable = prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE;
    pthread_mutex_lock(&g_lock);
    if (host ? host_charge_locked(size) : charge_locked(dev, size)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if ((shareable ? (p->fd = shareable_fd_new(dev, size)) < 0 : memfd_take_locked(size, &p->off)) ||
               ht_put(&g_handle_tab, g_next_handle, p)) {
        if (host) host_uncharge_locked(size);
        else uncharge_locked(dev, size);
        if (p->fd >= 0) close(p->fd);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        struct stat st;
        if (p->fd >= 0 && fstat(p->fd, &st) == 0) {
            p->fd_dev = st.st_dev;
            p->fd_ino = st.st_ino;
        }
        p->id = g_next_handle++;
        p->device = dev;
        p->loc = prop->location.type;
        p->size = size;
        p->refs = 1;
        p->charged = 1;
        p->handle_types = prop->requestedHandleTypes;
        g_counts.handles++;
        if (!host) HANDLE_BYTES(size, 1);
        *handle = p->id;
    }
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) free(p);
    return rc;
}

/* Export works only for a type the handle was created with (requestedHandleTypes). The caller
 * owns the returned descriptor. */
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType type, unsigned long long flags)
{
    ENTER(cuMemExportToShareableHandle);
    if (!shareableHandle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    struct phys *p = ht_get(&g_handle_tab, handle);
    CUresult rc = CUDA_SUCCESS;
    if (!p || !(p->handle_types & (unsigned long long)type) || p->fd < 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
        else *(int *)shareableHandle = fd;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The device a shareable fd belongs to, from the name shareable_fd_new gave it. */
static int shareable_fd_device(int fd)
{
    char path[64], target[128];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) return -1;
    target[n] = 0;
    const char *d = strstr(target, "cudbl-dev");
    return d ? atoi(d + 9) : -1;
}

/* Importing a handle of this process gives another reference to the same allocation; a handle
 * of another process (an fd received over a socket) becomes a handle here, not charged to this
 * process's capacity. */
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                CUmemAllocationHandleType type)
{
    ENTER(cuMemImportFromShareableHandle);
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)osHandle;
    struct stat st;
    int dev = fd >= 0 ? shareable_fd_device(fd) : -1;
    if (fd < 0 || fstat(fd, &st) || dev < 0 || !dev_valid(dev) || st.st_size <= 0 ||
        (size_t)st.st_size % g_cfg.granularity)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct phys *found = NULL;
    for (size_t i = 0; i < g_handle_tab.cap && !found; i++) {
        if (g_handle_tab.keys[i] <= HT_TOMB) continue;
        struct phys *p = g_handle_tab.vals[i];
        if (p->fd >= 0 && p->fd_dev == st.st_dev && p->fd_ino == st.st_ino) found = p;
    }
    if (found) {
        found->refs++;
        *handle = found->id;
    } else {
        struct phys *p = calloc(1, sizeof *p);
        int nfd = p ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
        if (!p || nfd < 0 || ht_put(&g_handle_tab, g_next_handle, p)) {
            if (nfd >= 0) close(nfd);
            free(p);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            p->fd = nfd;
            p->fd_dev = st.st_dev;
            p->fd_ino = st.st_ino;
            p->id = g_next_handle++;
            p->device = dev;
            p->size = (size_t)st.st_size;
            p->refs = 1;
            p->handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            g_counts.handles++;
            *handle = p->id;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    pthread_mutex_lock(&g_lock);
    struct phys *p = ht_get(&g_handle_tab, handle);
    if (p) CALL_BYTES(cuMemRelease, p->size); /* the handle's size, known before any refusal */
    pthread_mutex_unlock(&g_lock);
    ENTER(cuMemRelease);
    pthread_mutex_lock(&g_lock);
    p = ht_get(&g_handle_tab, handle);
    if (p) {
        if (--p->refs == 0) ht_del(&g_handle_tab, handle);
        phys_maybe_free_locked(p);
    }
    pthread_mutex_unlock(&g_lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags)
{
    CALL_BYTES(cuMemAddressReserve, size);
    ENTER(cuMemAddressReserve);
    size_t g = g_cfg.granularity;
    if (!ptr || size == 0 || flags != 0 || size % g) return CUDA_ERROR_INVALID_VALUE;
    if (alignment & (alignment - 1)) return CUDA_ERROR_INVALID_VALUE;
    if (alignment < g) alignment = g;
    if (size > SIZE_MAX - alignment) return CUDA_ERROR_OUT_OF_MEMORY;
    struct resv *r = calloc(1, sizeof *r);
    if (!r) return CUDA_ERROR_OUT_OF_MEMORY;
    const int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *base = MAP_FAILED;
    if (addr && addr % alignment == 0) {    /* the hint is honoured when that range is free */
        base = mmap((void *)(uintptr_t)addr, size, PROT_NONE, mflags | MAP_FIXED_NOREPLACE, -1, 0);
        if (base != MAP_FAILED && (CUdeviceptr)(uintptr_t)base != addr) {
            munmap(base, size);     /* a kernel without MAP_FIXED_NOREPLACE took it as a hint */
            base = MAP_FAILED;
        }
    }
    if (base == MAP_FAILED) {
        char *raw = mmap(NULL, size + alignment, PROT_NONE, mflags, -1, 0);
        if (raw == MAP_FAILED) { free(r); return CUDA_ERROR_OUT_OF_MEMORY; }
        uintptr_t a = round_up((uintptr_t)raw, alignment);
        if (a > (uintptr_t)raw) munmap(raw, a - (uintptr_t)raw);
        size_t tail = (size_t)((uintptr_t)raw + size + alignment - (a + size));
        if (tail) munmap((void *)(a + size), tail);
        base = (void *)a;
    }
    r->base = (CUdeviceptr)(uintptr_t)base;
    r->size = size;
    pthread_mutex_lock(&g_lock);
    r->next = g_resvs;
    g_resvs = r;
    g_counts.reservations++;
    g_bytes.reserved_va_bytes += size;
    pthread_mutex_unlock(&g_lock);
    *ptr = r->base;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CALL_BYTES(cuMemAddressFree, size);
    ENTER(cuMemAddressFree);
    pthread_mutex_lock(&g_lock);
    struct resv **pp = &g_resvs;
    while (*pp && !((*pp)->base == ptr && (*pp)->size == size)) pp = &(*pp)->next;
    struct resv *r = *pp;
    /* the whole reservation, and nothing may still be mapped in it */
    CUresult rc = !r || r->nmaps ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        *pp = r->next;
        g_counts.reservations--;
        g_bytes.reserved_va_bytes -= r->size;
        munmap((void *)(uintptr_t)r->base, r->size);
        free(r);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CALL_BYTES(cuMemMap, size);
    ENTER(cuMemMap);
    size_t g = g_cfg.granularity;
    if (!ptr || !size || flags != 0 || ptr % g || size % g)
        return CUDA_ERROR_INVALID_VALUE;
    /* "currently must be zero" (cuda.h 13.0): an H200 on driver 580 answers a map of a two-page
     * handle's second page CUDA_ERROR_NOT_SUPPORTED (the GPU check's map_offset, 2026-12-06) */
    if (offset != 0) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct phys *p = ht_get(&g_handle_tab, handle);
    struct resv *r = resv_containing_locked(ptr, size);
    struct vmap *m = NULL;
    int partial;
    if (!p || p->size != size || !r) rc = CUDA_ERROR_INVALID_VALUE;
    else if (covered_locked(ptr, size, &partial)) rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    else if (!(m = calloc(1, sizeof *m))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        m->va = ptr;
        m->size = size;
        m->p = p;
        if (pages_index_locked(m)) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS &&
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd >= 0 ? p->fd : g_memfd,
             p->fd >= 0 ? 0 : p->off) == MAP_FAILED) {
        pages_unindex_locked(m);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        r->nmaps++;
        p->maps++;
        g_counts.mappings++;
        MAPPED_BYTES(size, 1);
    } else {
        free(m);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The range must consist of whole mappings: the driver cannot unmap part of a cuMemMap. */
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CALL_BYTES(cuMemUnmap, size);
    ENTER(cuMemUnmap);
    if (!ptr || !size) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct resv *r = resv_containing_locked(ptr, size);
    int partial = 0;
    CUresult rc = CUDA_SUCCESS;
    if (!r || covered_locked(ptr, size, &partial) != size || partial) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) rc = capture_unmap_conflict_locked(ptr, size);
    /* cuMemUnmap is not stream-ordered: unmapping memory that queued or running work still
     * touches is undefined (a device fault, or the work landing in whatever is mapped there
     * next). The double takes it as misuse: synchronize (or wait on the work) first. */
    for (struct stream *s = g_streams; rc == CUDA_SUCCESS && s; s = s->next)
        for (struct item *it = s->head; it; it = it->next) {
            if (item_touches(it, ptr, size)) {
                rc = misuse(CUDA_ERROR_INVALID_VALUE, "unmapping [%#llx, +%zu) while work queued on stream %llu still "
                            "touches it (unmap is not stream-ordered: synchronize first)",
                            (unsigned long long)ptr, size, (unsigned long long)s->id);
                break;
            }
        }
    for (CUdeviceptr a = ptr; rc == CUDA_SUCCESS && a < ptr + size;) {
        struct vmap *m = next_map_locked(&a, ptr + size);
        if (!m) break;
        /* back to an inaccessible reservation; the memfd keeps the data */
        mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        r->nmaps--;
        pages_unindex_locked(m);
        m->p->maps--;
        g_counts.mappings--;
        MAPPED_BYTES(m->size, 0);
        g_bytes.unmapped_total += m->size;
        phys_maybe_free_locked(m->p);
        free(m);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Access is per device (location): each mapping keeps the flags of every device. A device may be
 * granted access to memory of another device only if the two are peer capable (CUDBL_PEER). The
 * host protection is the union of all devices' access, so a test can still write through a
 * device pointer from the host once some device may. */
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CALL_BYTES(cuMemSetAccess, size);
    ENTER(cuMemSetAccess);
    if (!ptr || !size || !desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    int host_desc = 0; /* a descriptor for the host's own access (HOST_NUMA), only for host memory */
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
            host_desc = 1;
            continue;
        }
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
        if (!dev_valid(desc[i].location.id)) return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_lock);
    struct resv *r = resv_containing_locked(ptr, size);
    int partial;
    CUresult rc = CUDA_SUCCESS;
    if (!r || covered_locked(ptr, size, &partial) != size) rc = CUDA_ERROR_INVALID_VALUE;
    /* every device named must be able to reach every mapping's memory: checked before any change */
    for (CUdeviceptr a = ptr; rc == CUDA_SUCCESS && a < ptr + size;) {
        struct vmap *m = next_map_locked(&a, ptr + size);
        if (!m) break;
        /* "Users cannot specify HOST_NUMA accessibility for allocations created with other
         * location types"; host memory is reached by any device, peer capable or not */
        if (host_desc && !phys_on_host(m->p)) rc = CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; i < count && rc == CUDA_SUCCESS; i++) {
            if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) continue;
            int d = desc[i].location.id;
            if (!phys_on_host(m->p) && d != m->p->device && !g_peer[d][m->p->device] &&
                desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
                rc = CUDA_ERROR_INVALID_DEVICE;
        }
    }
    for (CUdeviceptr a = ptr; rc == CUDA_SUCCESS && a < ptr + size;) {
        struct vmap *m = next_map_locked(&a, ptr + size);
        if (!m) break;
        unsigned char access[MAX_DEVICES];
        memcpy(access, m->access, sizeof access);
        for (size_t i = 0; i < count; i++) {
            if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) continue; /* the host reaches it anyway */
            int d = desc[i].location.id;
            if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE) g_grants[d]++; /* (mapping, device) grants */
            access[d] = (unsigned char)desc[i].flags;
        }
        unsigned any = 0;
        for (int d = 0; d < MAX_DEVICES; d++) any |= access[d];
        /* READWRITE (3) includes READ (1): bit 2 means some device may write */
        int prot = (any & 2) ? PROT_READ | PROT_WRITE : any ? PROT_READ : PROT_NONE;
        if (mprotect((void *)(uintptr_t)m->va, m->size, prot)) rc = CUDA_ERROR_INVALID_VALUE;
        else memcpy(m->access, access, sizeof access);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr)
{
    ENTER(cuMemGetAccess);
    if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(location->id)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    struct vmap *m = vmap_containing_locked(ptr);
    if (m) *flags = m->access[location->id];
    pthread_mutex_unlock(&g_lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    ENTER(cuMemRetainAllocationHandle);
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct vmap *m = vmap_containing_locked((CUdeviceptr)(uintptr_t)addr);
    CUresult rc = m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (m) {
        /* a handle released while mapped becomes valid again */
        if (m->p->refs++ == 0 && ht_put(&g_handle_tab, m->p->id, m->p)) {
            m->p->refs--;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (rc == CUDA_SUCCESS) *handle = m->p->id;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                        CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemGetAllocationPropertiesFromHandle);
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct phys *p = ht_get(&g_handle_tab, handle);
    if (p) {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->location.type = phys_on_host(p) ? (CUmemLocationType)p->loc : CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = p->loc == CU_MEM_LOCATION_TYPE_HOST ? 0 : p->device;
        prop->requestedHandleTypes = (CUmemAllocationHandleType)p->handle_types;
    }
    pthread_mutex_unlock(&g_lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- streams --------------------------------------------------------------------------------- */

static CUresult stream_create(CUstream *ph, unsigned int flags)
{
    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked();
    struct stream *s = c ? stream_new_locked(c, SK_USER, flags) : NULL;
    if (s) g_counts.streams++;
    pthread_mutex_unlock(&g_lock);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    *ph = s->handle;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    ENTER(cuStreamCreate);
    return stream_create(phStream, Flags);
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags,
                                            int priority __attribute__((unused)))
{
    ENTER(cuStreamCreateWithPriority);
    return stream_create(phStream, flags);
}

/* Like the driver, destroying a stream with queued work returns at once; the work still runs.
 * The handle is dead from now on: any later use is misuse. */
CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream)
{
    ENTER(cuStreamDestroy);
    if (hStream == NULL || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS && s->cap) { /* a stream must leave its capture first */
        s->cap->invalidated = 1;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (rc == CUDA_SUCCESS) {
        s->destroyed = 1;
        g_counts.streams--;
        stream_maybe_free_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream hStream)
{
    ENTER(cuStreamSynchronize);
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS) rc = capture_sync_conflict_locked(s);
    if (rc == CUDA_SUCCESS) advance_locked(s, s->enqueued);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuStreamQuery(CUstream hStream)
{
    ENTER(cuStreamQuery);
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS) rc = capture_sync_conflict_locked(s);
    if (rc == CUDA_SUCCESS) {
        settle_locked(s);
        if (s->completed < s->enqueued) rc = CUDA_ERROR_NOT_READY;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    ENTER(cuStreamGetCtx);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS) *pctx = (CUcontext)s->ctx;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* CUDA 12.5's form ("cuStreamGetCtx" from version 12050): also the stream's green context, always
 * NULL here (the double has no green contexts). Both out-pointers are required (cuda.h names no
 * NULL case; refusing is the side a test can trust). */
CUresult CUDAAPI cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    ENTER(cuStreamGetCtx);
    if (!pCtx || !pGreenCtx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS) {
        *pCtx = (CUcontext)s->ctx;
        *pGreenCtx = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult enqueue_item(CUstream hStream, struct item *it, int kernel)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    /* an emulated kernel, like a launch, runs in the current context: its stream must be of it */
    if (rc == CUDA_SUCCESS && kernel && s->ctx != ctx_current_locked()) rc = CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS) rc = enqueue_locked(s, it);
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) free(it);
    return rc;
}

static CUresult enqueue_fn(CUstream hStream, void (*fn)(void *), void *arg)
{
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    struct item *it = calloc(1, sizeof *it);
    if (!it) return CUDA_ERROR_OUT_OF_MEMORY;
    it->kind = IT_FN;
    it->fn = fn;
    it->arg = arg;
    return enqueue_item(hStream, it, 0);
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    ENTER(cuLaunchHostFunc);
    return enqueue_fn(hStream, fn, userData);
}

/* CUDA 13.1's form ("cuLaunchHostFunc" from version 13010): syncMode is how the driver's thread
 * waits for host tasks, CU_HOST_TASK_BLOCKING (0) or CU_HOST_TASK_SPINWAIT (1); the double runs the
 * function the same way under either. */
CUresult CUDAAPI cuLaunchHostFunc_v2(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode)
{
    ENTER(cuLaunchHostFunc);
    if (syncMode > 1) return CUDA_ERROR_INVALID_VALUE;
    return enqueue_fn(hStream, fn, userData);
}

/* ---- stream capture and graphs ----------------------------------------------------------------- */

/* A capture sequence begins on hStream. into: the graph a ToGraph capture appends to (its end
 * returns that graph), or NULL for a new one. */
static CUresult begin_capture(CUstream hStream, CUstreamCaptureMode mode, struct graph *into)
{
    if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
        mode != CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    struct capture *c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS && s->kind == SK_LEGACY) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (rc == CUDA_SUCCESS && s->cap) rc = CUDA_ERROR_ILLEGAL_STATE;   /* already capturing */
    if (rc == CUDA_SUCCESS) {
        c->id = g_next_capture_id++;
        c->origin = s;
        c->mode = mode;
        c->thread = thread_id();
        c->active = 1;
        c->into = into;
        c->next = g_captures;
        g_captures = c;
        s->cap = c;
        s->cap_items = s->cap_joined = 0;
        c = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    free(c);
    return rc;
}

CUresult CUDAAPI cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    ENTER(cuStreamBeginCapture);
    return begin_capture(hStream, mode, NULL);
}

static struct graph *graph_get_locked(CUgraph h, int want_exec, CUresult *rc);

/* cuStreamBeginCaptureToGraph (CUDA 12.3): the capture appends to an existing graph, after the
 * given nodes. The double exposes no graph nodes (nothing can name one: cuStreamGetCaptureInfo
 * returns none), so a capture after nodes is refused as the driver refuses nodes that are not in
 * the graph; the graph must be a graph, not an executable one, and not already being captured
 * into. The end of the capture returns that same graph. */
CUresult CUDAAPI cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,
                                             const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                             CUstreamCaptureMode mode)
{
    ENTER(cuStreamBeginCaptureToGraph);
    if (numDependencies && !dependencies) return CUDA_ERROR_INVALID_VALUE;
    if (numDependencies) return CUDA_ERROR_INVALID_VALUE; /* no node of the double's graphs can be named */
    (void)dependencyData;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct graph *g = graph_get_locked(hGraph, 0, &rc);
    for (struct capture *c = g_captures; g && c; c = c->next)
        if (c->active && c->into == g) rc = CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_unlock(&g_lock);
    if (!g || rc != CUDA_SUCCESS) return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_INVALID_VALUE;
    return begin_capture(hStream, mode, g);
}

/* CUDA 10.0's form, before capture modes (CUDA 10.1): what a program built then calls, and what
 * cuGetProcAddress gives for "cuStreamBeginCapture" below version 10010. It captures in the global
 * mode, the one that behaves as 10.0 did (cuda.h: the mode "potentially unsafe API calls are
 * prohibited" from any thread, as 10.0 prohibited them). */
#undef cuStreamBeginCapture
CUresult CUDAAPI cuStreamBeginCapture(CUstream hStream);
CUresult CUDAAPI cuStreamBeginCapture(CUstream hStream)
{
    ENTER(cuStreamBeginCapture);
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, NULL);
}

/* An empty graph (cuGraphCreate; flags must be 0). */
static struct graph *graph_new_locked(struct item *items, int is_exec);
CUresult CUDAAPI cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    ENTER(cuGraphCreate);
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct graph *g = graph_new_locked(NULL, 0);
    if (g) *phGraph = (CUgraph)(uintptr_t)handle_of(GRAPH_HANDLE_BASE, g->id);
    pthread_mutex_unlock(&g_lock);
    return g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static void items_free(struct item *it)
{
    while (it) {
        struct item *n = it->next;
        free(it);
        it = n;
    }
}

static struct graph *graph_get_locked(CUgraph h, int want_exec, CUresult *rc)
{
    struct graph *g = ht_get(&g_graph_tab, (uint64_t)(uintptr_t)h);
    if (!g && id_of(h, GRAPH_HANDLE_BASE, g_next_graph_id)) {
        *rc = misuse(CUDA_ERROR_INVALID_VALUE, "graph %p was destroyed", (void *)h);
        return NULL;
    }
    if (!g || g->is_exec != want_exec) {
        *rc = CUDA_ERROR_INVALID_VALUE;
        return NULL;
    }
    return g;
}

static struct graph *graph_new_locked(struct item *items, int is_exec)
{
    struct graph *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->id = g_next_graph_id++;
    g->is_exec = is_exec;
    g->head = items;
    if (ht_put(&g_graph_tab, handle_of(GRAPH_HANDLE_BASE, g->id), g)) {
        free(g);
        return NULL;
    }
    return g;
}

/* Ends the sequence for every stream in it. A capture that was invalidated, or whose forked
 * streams were not joined back into the origin, yields no graph. */
CUresult CUDAAPI cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    ENTER(cuStreamEndCapture);
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    struct capture *c = rc == CUDA_SUCCESS ? s->cap : NULL;
    if (rc == CUDA_SUCCESS && !c) rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS && c->origin != s) {
        c->invalidated = 1;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
    }
    if (rc == CUDA_SUCCESS && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && c->thread != thread_id())
        rc = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    if (rc == CUDA_SUCCESS) {
        int unjoined = 0;
        for (struct stream *t = g_streams; t; t = t->next) {
            if (t->cap != c) continue;
            if (t != s && t->cap_items > t->cap_joined) unjoined = 1;
            t->cap = NULL;
        }
        c->active = 0;
        struct item *items = c->head;
        c->head = c->tail = NULL;
        *phGraph = NULL;
        struct graph *into = c->into;
        c->into = NULL;
        if (c->invalidated || unjoined) {
            items_free(items);
            rc = c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
        } else if (into) { /* a ToGraph capture: its work joins the graph, which is returned */
            struct item **tail = &into->head;
            while (*tail) tail = &(*tail)->next;
            *tail = items;
            *phGraph = (CUgraph)(uintptr_t)handle_of(GRAPH_HANDLE_BASE, into->id);
        } else {
            struct graph *g = graph_new_locked(items, 0);
            if (!g) {
                items_free(items);
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            } else {
                *phGraph = (CUgraph)(uintptr_t)handle_of(GRAPH_HANDLE_BASE, g->id);
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult capture_status_locked(CUstream h, CUstreamCaptureStatus *st, struct capture **cap)
{
    struct stream *s;
    CUresult rc = stream_resolve_locked(h, &s);
    if (rc != CUDA_SUCCESS) return rc;
    /* the legacy stream cannot be queried while a blocking stream captures (not invalidated) */
    if (s->kind == SK_LEGACY && ctx_captures_locked(s->ctx, 1, 0)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    *cap = s->cap;
    *st = !s->cap ? CU_STREAM_CAPTURE_STATUS_NONE
          : s->cap->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    ENTER(cuStreamIsCapturing);
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    struct capture *c;
    pthread_mutex_lock(&g_lock);
    CUresult rc = capture_status_locked(hStream, captureStatus, &c);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The graph being captured and the dependency set are not exposed (NULL and 0). */
CUresult CUDAAPI cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *status, cuuint64_t *id,
                                           CUgraph *graph, const CUgraphNode **deps,
                                           const CUgraphEdgeData **edges, size_t *ndeps)
{
    ENTER(cuStreamGetCaptureInfo);
    if (!status || (edges && !deps)) return CUDA_ERROR_INVALID_VALUE;
    struct capture *c = NULL;
    pthread_mutex_lock(&g_lock);
    CUresult rc = capture_status_locked(hStream, status, &c);
    pthread_mutex_unlock(&g_lock);
    if (rc == CUDA_SUCCESS && *status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        if (id) *id = c->id;
        if (graph) *graph = NULL;
        if (deps) *deps = NULL;
        if (edges) *edges = NULL;
        if (ndeps) *ndeps = 0;
    }
    return rc;
}

CUresult CUDAAPI cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *status, cuuint64_t *id,
                                           CUgraph *graph, const CUgraphNode **deps, size_t *ndeps)
{
    return cuStreamGetCaptureInfo_v3(hStream, status, id, graph, deps, NULL, ndeps);
}

CUresult CUDAAPI cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    ENTER(cuThreadExchangeStreamCaptureMode);
    if (!mode || (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
                  *mode != CU_STREAM_CAPTURE_MODE_RELAXED))
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = tls_capture_mode;
    tls_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

static struct item *items_copy(const struct item *it)
{
    struct item *head = NULL, **tail = &head;
    for (; it; it = it->next) {
        struct item *c = malloc(sizeof *c);
        if (!c) {
            items_free(head);
            return (struct item *)-1;
        }
        *c = *it;
        c->next = NULL;
        *tail = c;
        tail = &c->next;
    }
    return head;
}

CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    ENTER(cuGraphInstantiate);
    if (!phGraphExec || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct graph *g = graph_get_locked(hGraph, 0, &rc);
    if (g) {
        struct item *items = items_copy(g->head);
        struct graph *e = items == (struct item *)-1 ? NULL : graph_new_locked(items, 1);
        if (!e) {
            if (items != (struct item *)-1) items_free(items);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            *phGraphExec = (CUgraphExec)(uintptr_t)handle_of(GRAPH_HANDLE_BASE, e->id);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The graph's work is queued on the stream in capture order (dependencies between captured
 * streams become one order). */
CUresult CUDAAPI cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    ENTER(cuGraphLaunch);
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct graph *e = graph_get_locked((CUgraph)hGraphExec, 1, &rc);
    struct stream *s = NULL;
    if (e) rc = stream_resolve_locked(hStream, &s);
    if (e && rc == CUDA_SUCCESS && s->cap) rc = CUDA_ERROR_NOT_SUPPORTED; /* child graphs: not emulated */
    for (const struct item *it = e && rc == CUDA_SUCCESS ? e->head : NULL; it && rc == CUDA_SUCCESS; it = it->next) {
        struct item *c = malloc(sizeof *c);
        if (!c) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        *c = *it;
        c->next = NULL;
        rc = enqueue_locked(s, c);
        if (rc != CUDA_SUCCESS) free(c);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult graph_destroy(CUgraph h, int is_exec)
{
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct graph *g = graph_get_locked(h, is_exec, &rc);
    for (struct capture *c = g_captures; g && c; c = c->next)
        if (c->active && c->into == g) { /* a capture still appends to it */
            rc = CUDA_ERROR_ILLEGAL_STATE;
            g = NULL;
        }
    if (g) {
        ht_del(&g_graph_tab, handle_of(GRAPH_HANDLE_BASE, g->id));
        items_free(g->head);
        free(g);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    ENTER(cuGraphExecDestroy);
    return graph_destroy((CUgraph)hGraphExec, 1);
}

CUresult CUDAAPI cuGraphDestroy(CUgraph hGraph)
{
    ENTER(cuGraphDestroy);
    return graph_destroy(hGraph, 0);
}

/* ---- events ---------------------------------------------------------------------------------- */

/* The event behind a handle; a destroyed one is misuse (its handle value is never reused). */
static CUresult event_lookup_locked(CUevent h, struct event **out)
{
    struct event *e = h ? ht_get(&g_event_tab, (uint64_t)(uintptr_t)h) : NULL;
    if (!e && id_of(h, EVENT_HANDLE_BASE, g_next_event_id))
        return misuse(CUDA_ERROR_INVALID_HANDLE, "event %p was destroyed", (void *)h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    *out = e;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    ENTER(cuEventCreate);
    const unsigned ok = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~ok)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    struct event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = Flags;
    pthread_mutex_lock(&g_lock);
    e->ctx = ctx_current_locked();
    CUresult rc = e->ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (rc == CUDA_SUCCESS) {
        e->id = g_next_event_id++;
        e->handle = (CUevent)(uintptr_t)handle_of(EVENT_HANDLE_BASE, e->id);
        if (ht_put(&g_event_tab, (uint64_t)(uintptr_t)e->handle, e)) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) g_counts.events++;
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) { free(e); return rc; }
    *phEvent = e->handle;
    return CUDA_SUCCESS;
}

static void event_forget_record_locked(struct event *e)
{
    if (e->recorded) stream_unref_locked(e->s);
    e->recorded = 0;
    e->s = NULL;
    e->cap = NULL;
    e->cap_s = NULL;
}

/* An event is a position in a stream: recording it queues a marker (so the legacy stream's
 * implicit waits apply to it too) and remembers how many items must complete. The event and
 * the stream must belong to the same context (cuda.h: else CUDA_ERROR_INVALID_HANDLE). In a
 * capturing stream it marks a point of the capture instead. */
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream)
{
    ENTER(cuEventRecord);
    struct item *marker = calloc(1, sizeof *marker);
    if (!marker) return CUDA_ERROR_OUT_OF_MEMORY;
    marker->kind = IT_NOP;
    pthread_mutex_lock(&g_lock);
    struct event *e = NULL;
    struct stream *s = NULL;
    CUresult rc = event_lookup_locked(hEvent, &e);
    if (rc == CUDA_SUCCESS) rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS && e->ctx != s->ctx) rc = CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS && s->cap) {
        if (s->cap->invalidated) {
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            event_forget_record_locked(e);
            e->cap = s->cap;
            e->cap_s = s;
            e->cap_pos = s->cap_items;
        }
    } else if (rc == CUDA_SUCCESS) {
        s->refs++;          /* before enqueue: settling may pop the marker at once */
        rc = enqueue_locked(s, marker);
        if (rc != CUDA_SUCCESS) {
            stream_unref_locked(s);
        } else {
            marker = NULL;
            event_forget_record_locked(e);
            e->recorded = 1;
            e->s = s;
            e->pos = s->enqueued;
            clock_gettime(CLOCK_MONOTONIC, &e->when);
        }
    }
    pthread_mutex_unlock(&g_lock);
    free(marker);
    return rc;
}

static int event_done_locked(struct event *e)
{
    if (!e->recorded) return 1;
    settle_locked(e->s);
    return e->s->completed >= e->pos;
}

/* Waiting for or querying an event last recorded inside a capture is impossible: it fails with
 * CUDA_ERROR_CAPTURED_EVENT and invalidates that capture if it is still going on. */
static CUresult event_captured_locked(struct event *e)
{
    if (!e->cap) return CUDA_SUCCESS;
    if (e->cap->active) e->cap->invalidated = 1;
    return CUDA_ERROR_CAPTURED_EVENT;
}

CUresult CUDAAPI cuEventQuery(CUevent hEvent)
{
    ENTER(cuEventQuery);
    pthread_mutex_lock(&g_lock);
    struct event *e = NULL;
    CUresult rc = event_lookup_locked(hEvent, &e);
    if (rc == CUDA_SUCCESS) rc = event_captured_locked(e);
    if (rc == CUDA_SUCCESS && !event_done_locked(e)) rc = CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent)
{
    ENTER(cuEventSynchronize);
    pthread_mutex_lock(&g_lock);
    struct event *e = NULL;
    CUresult rc = event_lookup_locked(hEvent, &e);
    if (rc == CUDA_SUCCESS) rc = event_captured_locked(e);
    if (rc == CUDA_SUCCESS && e->recorded) advance_locked(e->s, e->pos);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Destroying is allowed before completion; the handle is dead from now on. */
CUresult CUDAAPI cuEventDestroy_v2(CUevent hEvent)
{
    ENTER(cuEventDestroy);
    pthread_mutex_lock(&g_lock);
    struct event *e = NULL;
    CUresult rc = event_lookup_locked(hEvent, &e);
    if (rc == CUDA_SUCCESS) {
        ht_del(&g_event_tab, (uint64_t)(uintptr_t)e->handle);
        if (e->recorded) stream_unref_locked(e->s);
        g_counts.events--;
        free(e);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Host time between the two records, once both events completed. */
CUresult CUDAAPI cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    ENTER(cuEventElapsedTime);
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct event *a = NULL, *b = NULL;
    CUresult rc = event_lookup_locked(hStart, &a);
    if (rc == CUDA_SUCCESS) rc = event_lookup_locked(hEnd, &b);
    if (rc == CUDA_SUCCESS) rc = event_captured_locked(a);
    if (rc == CUDA_SUCCESS) rc = event_captured_locked(b);
    if (rc != CUDA_SUCCESS)
        ;
    else if (!a->recorded || !b->recorded || (a->flags & CU_EVENT_DISABLE_TIMING) ||
             (b->flags & CU_EVENT_DISABLE_TIMING))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (!event_done_locked(a) || !event_done_locked(b))
        rc = CUDA_ERROR_NOT_READY;
    else
        *pMilliseconds = (float)((double)(b->when.tv_sec - a->when.tv_sec) * 1e3 +
                                 (double)(b->when.tv_nsec - a->when.tv_nsec) / 1e6);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A wait that involves a capture: joining a capture (a stream that waits on an event recorded in
 * one becomes part of it), joining back (the dependency on a forked stream's work), merging two
 * captures (refused) or depending on work outside the capture (refused unless
 * CU_EVENT_WAIT_EXTERNAL, as the CUDA programming guide says). */
static CUresult capture_wait_locked(struct stream *s, struct event *e, unsigned int flags)
{
    struct capture *ec = e->cap && e->cap->active ? e->cap : NULL;
    if (s->cap && s->cap->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    if (ec) {
        if (s->kind == SK_LEGACY) {
            ec->invalidated = 1;
            return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        }
        if (s->cap && s->cap != ec) {
            s->cap->invalidated = ec->invalidated = 1;
            return CUDA_ERROR_STREAM_CAPTURE_MERGE;
        }
        if (!s->cap) {
            s->cap = ec;
            s->cap_items = s->cap_joined = 0;
        }
        if (e->cap_s != s && e->cap_pos > e->cap_s->cap_joined) e->cap_s->cap_joined = e->cap_pos;
        return CUDA_SUCCESS;
    }
    /* s captures; the event is not part of this capture */
    if (e->cap) {
        s->cap->invalidated = 1;
        return CUDA_ERROR_CAPTURED_EVENT;     /* recorded in a capture that has ended */
    }
    if (e->recorded && !(flags & CU_EVENT_WAIT_EXTERNAL)) {
        s->cap->invalidated = 1;
        return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    }
    return CUDA_SUCCESS;
}

/* Work queued on hStream from now on waits until everything before the event's record ran. */
CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    ENTER(cuStreamWaitEvent);
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    struct item *w = calloc(1, sizeof *w);
    if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    struct event *e = NULL;
    struct stream *s = NULL;
    CUresult rc = event_lookup_locked(hEvent, &e);
    if (rc == CUDA_SUCCESS) rc = stream_resolve_locked(hStream, &s);
    /* CU_EVENT_WAIT_EXTERNAL "is invalid outside of stream capture" (cuda.h) */
    if (rc == CUDA_SUCCESS && (Flags & CU_EVENT_WAIT_EXTERNAL) && !s->cap) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && (s->cap || (e->cap && e->cap->active))) {
        rc = capture_wait_locked(s, e, Flags);
    } else if (rc == CUDA_SUCCESS && e->cap) {
        rc = CUDA_ERROR_CAPTURED_EVENT;
    } else if (rc == CUDA_SUCCESS && !event_done_locked(e)) {
        w->kind = IT_WAIT;
        w->wait_s = e->s;
        w->wait_pos = e->pos;
        e->s->refs++;
        rc = enqueue_locked(s, w);
        if (rc != CUDA_SUCCESS) stream_unref_locked(e->s);
        else w = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    free(w);
    return rc;
}

/* ---- per-thread default stream variants (NULL stream = CU_STREAM_PER_THREAD) ---------------- */

#define PTSZ(h) ((h) == NULL ? CU_STREAM_PER_THREAD : (h))
CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream hStream);
CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream hStream) { return cuStreamSynchronize(PTSZ(hStream)); }
CUresult CUDAAPI cuStreamQuery_ptsz(CUstream hStream);
CUresult CUDAAPI cuStreamQuery_ptsz(CUstream hStream) { return cuStreamQuery(PTSZ(hStream)); }
CUresult CUDAAPI cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult CUDAAPI cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return cuStreamWaitEvent(PTSZ(hStream), hEvent, Flags);
}
CUresult CUDAAPI cuEventRecord_ptsz(CUevent hEvent, CUstream hStream);
CUresult CUDAAPI cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return cuEventRecord(hEvent, PTSZ(hStream));
}
CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return cuMemAllocAsync(dptr, bytesize, PTSZ(hStream));
}
CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return cuMemFreeAsync(dptr, PTSZ(hStream));
}
CUresult CUDAAPI cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData);
CUresult CUDAAPI cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    return cuLaunchHostFunc(PTSZ(hStream), fn, userData);
}
CUresult CUDAAPI cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
CUresult CUDAAPI cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyAsync(dst, src, n, PTSZ(s));
}
CUresult CUDAAPI cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s);
CUresult CUDAAPI cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    return cuMemcpyHtoDAsync_v2(dst, src, n, PTSZ(s));
}
CUresult CUDAAPI cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s);
CUresult CUDAAPI cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyDtoHAsync_v2(dst, src, n, PTSZ(s));
}
CUresult CUDAAPI cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
CUresult CUDAAPI cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return cuMemcpyDtoDAsync_v2(dst, src, n, PTSZ(s));
}
CUresult CUDAAPI cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s);
CUresult CUDAAPI cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s)
{
    return cuMemsetD8Async(dst, uc, n, PTSZ(s));
}
CUresult CUDAAPI cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                        CUstream s);
CUresult CUDAAPI cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                        CUstream s)
{
    return cuMemcpyPeerAsync(dst, dc, src, sc, n, PTSZ(s));
}
CUresult CUDAAPI cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode);
CUresult CUDAAPI cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return cuStreamBeginCapture_v2(PTSZ(hStream), mode);
}
CUresult CUDAAPI cuStreamBeginCapture_ptsz(CUstream hStream);
CUresult CUDAAPI cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return cuStreamBeginCapture(PTSZ(hStream));
}
CUresult CUDAAPI cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode *deps,
                                                  const CUgraphEdgeData *data, size_t ndeps, CUstreamCaptureMode mode);
CUresult CUDAAPI cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode *deps,
                                                  const CUgraphEdgeData *data, size_t ndeps, CUstreamCaptureMode mode)
{
    return cuStreamBeginCaptureToGraph(PTSZ(hStream), hGraph, deps, data, ndeps, mode);
}
CUresult CUDAAPI cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);
CUresult CUDAAPI cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return cuStreamEndCapture(PTSZ(hStream), phGraph);
}
CUresult CUDAAPI cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *st);
CUresult CUDAAPI cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *st)
{
    return cuStreamIsCapturing(PTSZ(hStream), st);
}
CUresult CUDAAPI cuStreamGetCaptureInfo_v2_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                const CUgraphNode **d, size_t *n);
CUresult CUDAAPI cuStreamGetCaptureInfo_v2_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                const CUgraphNode **d, size_t *n)
{
    return cuStreamGetCaptureInfo_v2(PTSZ(h), st, id, g, d, n);
}
CUresult CUDAAPI cuStreamGetCaptureInfo_v3_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                const CUgraphNode **d, const CUgraphEdgeData **e, size_t *n);
CUresult CUDAAPI cuStreamGetCaptureInfo_v3_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                                const CUgraphNode **d, const CUgraphEdgeData **e, size_t *n)
{
    return cuStreamGetCaptureInfo_v3(PTSZ(h), st, id, g, d, e, n);
}
CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec exec, CUstream hStream);
CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec exec, CUstream hStream)
{
    return cuGraphLaunch(exec, PTSZ(hStream));
}
CUresult CUDAAPI cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx);
CUresult CUDAAPI cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx)
{
    return cuStreamGetCtx(PTSZ(hStream), pctx);
}
CUresult CUDAAPI cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx);
CUresult CUDAAPI cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    return cuStreamGetCtx_v2(PTSZ(hStream), pCtx, pGreenCtx);
}
CUresult CUDAAPI cuLaunchHostFunc_v2_ptsz(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode);
CUresult CUDAAPI cuLaunchHostFunc_v2_ptsz(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode)
{
    return cuLaunchHostFunc_v2(PTSZ(hStream), fn, userData, syncMode);
}

/* ---- errors ---------------------------------------------------------------------------------- */

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    ENTER_NOINIT(cuGetErrorString);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const struct err_entry *e = err_find(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    ENTER_NOINIT(cuGetErrorName);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const struct err_entry *e = err_find(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- unversioned ABI names whose v1 has the same signature as the versioned one ------------- */

#undef cuCtxDestroy
#undef cuCtxPushCurrent
#undef cuCtxPopCurrent
#undef cuStreamDestroy
#undef cuEventDestroy
#undef cuEventElapsedTime
#undef cuDevicePrimaryCtxRelease
#undef cuGetProcAddress
CUresult CUDAAPI cuCtxDestroy(CUcontext ctx);
CUresult CUDAAPI cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }
CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx);
CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }
CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx);
CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }
CUresult CUDAAPI cuStreamDestroy(CUstream hStream);
CUresult CUDAAPI cuStreamDestroy(CUstream hStream) { return cuStreamDestroy_v2(hStream); }
CUresult CUDAAPI cuEventDestroy(CUevent hEvent);
CUresult CUDAAPI cuEventDestroy(CUevent hEvent) { return cuEventDestroy_v2(hEvent); }
CUresult CUDAAPI cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult CUDAAPI cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    return cuEventElapsedTime_v2(ms, a, b);
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

/* ---- cuGetProcAddress ------------------------------------------------------------------------ */

/* One row per ABI of a base name: the version it appeared in (N in cudaTypedefs.h's
 * PFN_<name>_vN) and the function. A lookup gets the newest row whose version is <= the caller's
 * cudaVersion; with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM the newest per-thread row
 * (PFN_<name>_vN_ptsz or _ptds) first. Every row is typed: _Generic refuses to compile a row whose
 * function is not exactly of the header's PFN type for that name and version, or a row for a
 * version the header has no typedef for, so a caller at version V gets the signature the real
 * driver gives at V (docs/test-double.md has the table; tests/cudadouble/test_abi.py checks that no
 * header version is missing between a name's first row and DRIVER_VERSION). A lookup below a
 * name's first row finds nothing (VERSION_NOT_SUFFICIENT): the double does not serve the old ABIs
 * (32-bit sizes, the 5-argument cuGraphInstantiate). */
struct proc_entry { const char *name; int version; void *fn; int per_thread; };

CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus);
CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

/* ABIs whose typedefs cudaTypedefs.h keeps for the driver's own build (__CUDA_API_VERSION_INTERNAL,
 * which also changes cuda.h, so it cannot be defined here): the unversioned symbols, written as the
 * header writes them (test_abi.py compares them with the header's text). */
typedef CUresult (CUDAAPI *PFN_cuCtxDestroy_v2000)(CUcontext ctx);
typedef CUresult (CUDAAPI *PFN_cuCtxPopCurrent_v2000)(CUcontext *pctx);
typedef CUresult (CUDAAPI *PFN_cuCtxPushCurrent_v2000)(CUcontext ctx);
typedef CUresult (CUDAAPI *PFN_cuStreamDestroy_v2000)(CUstream hStream);
typedef CUresult (CUDAAPI *PFN_cuEventDestroy_v2000)(CUevent hEvent);
typedef CUresult (CUDAAPI *PFN_cuDevicePrimaryCtxRelease_v7000)(CUdevice_v1 dev);
typedef CUresult (CUDAAPI *PFN_cuStreamBeginCapture_v10000)(CUstream hStream);
typedef CUresult (CUDAAPI *PFN_cuStreamBeginCapture_v10000_ptsz)(CUstream hStream);

#define ROW_(str, ver, pfn, fn, pt) {str, ver, _Generic((fn), pfn: (void *)(fn)), pt}
#define P(name, ver, fn) ROW_(#name, ver, PFN_##name##_v##ver, fn, 0)
#define PTSZ_ROW(name, ver, fn) ROW_(#name, ver, PFN_##name##_v##ver##_ptsz, fn, 1)
#define PTDS_ROW(name, ver, fn) ROW_(#name, ver, PFN_##name##_v##ver##_ptds, fn, 1)
/* a function and its _ptsz twin, both new at `ver` */
#define PS(name, ver, fn) \
    ROW_(#name, ver, PFN_##name##_v##ver, fn, 0), ROW_(#name, ver, PFN_##name##_v##ver##_ptsz, fn##_ptsz, 1)
static const struct proc_entry proc_table[] = {
    P(cuInit, 2000, cuInit),
    P(cuDriverGetVersion, 2020, cuDriverGetVersion),
    P(cuDeviceGet, 2000, cuDeviceGet),
    P(cuDeviceGetCount, 2000, cuDeviceGetCount),
    P(cuDeviceGetName, 2000, cuDeviceGetName),
    P(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2),
    P(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    P(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    P(cuDevicePrimaryCtxRelease, 7000, cuDevicePrimaryCtxRelease),
    P(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2),
    P(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState),
    P(cuCtxCreate, 3020, cuCtxCreate_v2),
    P(cuCtxCreate, 11040, cuCtxCreate_v3),
    P(cuCtxCreate, 12050, cuCtxCreate_v4),
    P(cuCtxDestroy, 2000, cuCtxDestroy),
    P(cuCtxDestroy, 4000, cuCtxDestroy_v2),
    P(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    P(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    P(cuCtxPushCurrent, 2000, cuCtxPushCurrent),
    P(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2),
    P(cuCtxPopCurrent, 2000, cuCtxPopCurrent),
    P(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2),
    P(cuCtxGetDevice, 2000, cuCtxGetDevice),
    P(cuCtxGetDevice, 13000, cuCtxGetDevice_v2),       /* (CUdevice *, CUcontext) */
    P(cuCtxSynchronize, 2000, cuCtxSynchronize),
    P(cuCtxSynchronize, 13000, cuCtxSynchronize_v2),   /* (CUcontext) */
    P(cuMemGetInfo, 3020, cuMemGetInfo_v2),
    P(cuMemAlloc, 3020, cuMemAlloc_v2),
    P(cuMemFree, 3020, cuMemFree_v2),
    PS(cuMemAllocAsync, 11020, cuMemAllocAsync),
    PS(cuMemFreeAsync, 11020, cuMemFreeAsync),
    P(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2),
    P(cuMemcpyHtoD, 3020, cuMemcpyHtoD_v2),
    PTDS_ROW(cuMemcpyHtoD, 7000, cuMemcpyHtoD_v2_ptds),
    P(cuMemcpyDtoH, 3020, cuMemcpyDtoH_v2),
    PTDS_ROW(cuMemcpyDtoH, 7000, cuMemcpyDtoH_v2_ptds),
    P(cuMemcpyDtoD, 3020, cuMemcpyDtoD_v2),
    PTDS_ROW(cuMemcpyDtoD, 7000, cuMemcpyDtoD_v2_ptds),
    P(cuMemsetD8, 3020, cuMemsetD8_v2),
    PTDS_ROW(cuMemsetD8, 7000, cuMemsetD8_v2_ptds),
    P(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity),
    P(cuMemCreate, 10020, cuMemCreate),
    P(cuMemRelease, 10020, cuMemRelease),
    P(cuMemAddressReserve, 10020, cuMemAddressReserve),
    P(cuMemAddressFree, 10020, cuMemAddressFree),
    P(cuMemMap, 10020, cuMemMap),
    P(cuMemUnmap, 10020, cuMemUnmap),
    P(cuMemSetAccess, 10020, cuMemSetAccess),
    P(cuMemGetAccess, 10020, cuMemGetAccess),
    P(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle),
    P(cuMemGetAllocationPropertiesFromHandle, 10020, cuMemGetAllocationPropertiesFromHandle),
    P(cuStreamCreate, 2000, cuStreamCreate),
    P(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority),
    P(cuStreamDestroy, 2000, cuStreamDestroy),
    P(cuStreamDestroy, 4000, cuStreamDestroy_v2),
    P(cuStreamSynchronize, 2000, cuStreamSynchronize),
    PTSZ_ROW(cuStreamSynchronize, 7000, cuStreamSynchronize_ptsz),
    P(cuStreamQuery, 2000, cuStreamQuery),
    PTSZ_ROW(cuStreamQuery, 7000, cuStreamQuery_ptsz),
    P(cuStreamWaitEvent, 3020, cuStreamWaitEvent),
    PTSZ_ROW(cuStreamWaitEvent, 7000, cuStreamWaitEvent_ptsz),
    PS(cuLaunchHostFunc, 10000, cuLaunchHostFunc),
    PS(cuLaunchHostFunc, 13010, cuLaunchHostFunc_v2),   /* + unsigned int syncMode */
    P(cuEventCreate, 2000, cuEventCreate),
    P(cuEventRecord, 2000, cuEventRecord),
    PTSZ_ROW(cuEventRecord, 7000, cuEventRecord_ptsz),
    P(cuEventQuery, 2000, cuEventQuery),
    P(cuEventSynchronize, 2000, cuEventSynchronize),
    P(cuEventDestroy, 2000, cuEventDestroy),
    P(cuEventDestroy, 4000, cuEventDestroy_v2),
    P(cuEventElapsedTime, 2000, cuEventElapsedTime),
    P(cuEventElapsedTime, 12080, cuEventElapsedTime_v2),
    P(cuGetProcAddress, 11030, cuGetProcAddress),
    P(cuGetProcAddress, 12000, cuGetProcAddress_v2),
    P(cuGetErrorString, 6000, cuGetErrorString),
    P(cuGetErrorName, 6000, cuGetErrorName),
    P(cuDeviceCanAccessPeer, 4000, cuDeviceCanAccessPeer),
    P(cuCtxEnablePeerAccess, 4000, cuCtxEnablePeerAccess),
    P(cuCtxDisablePeerAccess, 4000, cuCtxDisablePeerAccess),
    P(cuMemcpy, 4000, cuMemcpy),
    PTDS_ROW(cuMemcpy, 7000, cuMemcpy_ptds),
    P(cuMemcpyAsync, 4000, cuMemcpyAsync),
    PTSZ_ROW(cuMemcpyAsync, 7000, cuMemcpyAsync_ptsz),
    P(cuMemcpyPeer, 4000, cuMemcpyPeer),
    PTDS_ROW(cuMemcpyPeer, 7000, cuMemcpyPeer_ptds),
    P(cuMemcpyPeerAsync, 4000, cuMemcpyPeerAsync),
    PTSZ_ROW(cuMemcpyPeerAsync, 7000, cuMemcpyPeerAsync_ptsz),
    P(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync_v2),
    PTSZ_ROW(cuMemcpyHtoDAsync, 7000, cuMemcpyHtoDAsync_v2_ptsz),
    P(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync_v2),
    PTSZ_ROW(cuMemcpyDtoHAsync, 7000, cuMemcpyDtoHAsync_v2_ptsz),
    P(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync_v2),
    PTSZ_ROW(cuMemcpyDtoDAsync, 7000, cuMemcpyDtoDAsync_v2_ptsz),
    P(cuMemsetD8Async, 3020, cuMemsetD8Async),
    PTSZ_ROW(cuMemsetD8Async, 7000, cuMemsetD8Async_ptsz),
    P(cuPointerGetAttribute, 4000, cuPointerGetAttribute),
    P(cuPointerGetAttributes, 7000, cuPointerGetAttributes),
    P(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle),
    P(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle_v2),
    P(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle),
    P(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle),
    P(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle),
    PS(cuStreamBeginCapture, 10000, cuStreamBeginCapture),  /* (CUstream): CUDA 10.0, no mode */
    PS(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2),
    PS(cuStreamBeginCaptureToGraph, 12030, cuStreamBeginCaptureToGraph),
    PS(cuStreamEndCapture, 10000, cuStreamEndCapture),
    PS(cuStreamIsCapturing, 10000, cuStreamIsCapturing),
    PS(cuStreamGetCaptureInfo, 11030, cuStreamGetCaptureInfo_v2),
    PS(cuStreamGetCaptureInfo, 12030, cuStreamGetCaptureInfo_v3),
    P(cuThreadExchangeStreamCaptureMode, 10010, cuThreadExchangeStreamCaptureMode),
    /* cuda.h 12.0 and later #define cuGraphInstantiate as cuGraphInstantiateWithFlags; before 12.0
     * the name meant the 5-argument form (PFN_cuGraphInstantiate_v11000), not served here */
    ROW_("cuGraphInstantiate", 12000, PFN_cuGraphInstantiateWithFlags_v11040, cuGraphInstantiateWithFlags, 0),
    P(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags),
    PS(cuGraphLaunch, 10000, cuGraphLaunch),
    P(cuGraphExecDestroy, 10000, cuGraphExecDestroy),
    P(cuGraphDestroy, 10000, cuGraphDestroy),
    P(cuGraphCreate, 10000, cuGraphCreate),
    PS(cuStreamGetCtx, 9020, cuStreamGetCtx),
    PS(cuStreamGetCtx, 12050, cuStreamGetCtx_v2),     /* + CUgreenCtx * */
};
#undef P
#undef PS
#undef PTSZ_ROW
#undef PTDS_ROW
#undef ROW_

static CUresult proc_lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    const struct proc_entry *best = NULL, *best_pt = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof proc_table / sizeof proc_table[0]; i++) {
        const struct proc_entry *e = &proc_table[i];
        if (strcmp(e->name, symbol) != 0) continue;
        known = 1;
        if (e->version > cudaVersion) continue;
        const struct proc_entry **slot = e->per_thread ? &best_pt : &best;
        if (!*slot || e->version > (*slot)->version) *slot = e;
    }
    if (best_pt && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) best = best_pt;
    *pfn = NULL;
    if (!best) {
        /* CUDBL_TRACE_LOOKUPS=1 names what a program wanted that the double lacks. (The real
         * libcudart cannot run over the double: it needs the driver's private cuGetExportTable.) */
        if (getenv("CUDBL_TRACE_LOOKUPS")) fprintf(stderr, "cudbl: lookup of %s (version %d) not found\n", symbol, cudaVersion);
        if (status)
            *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

/* The table, for tests (cudbl.h): row i's name, version and per-thread flag; 0 past the end. */
int cudbl_proc_row(int i, const char **name, int *version, int *per_thread)
{
    if (i < 0 || (size_t)i >= sizeof proc_table / sizeof proc_table[0]) return 0;
    *name = proc_table[i].name;
    *version = proc_table[i].version;
    *per_thread = proc_table[i].per_thread;
    return 1;
}

CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    ENTER_NOINIT(cuGetProcAddress);
    return proc_lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ENTER_NOINIT(cuGetProcAddress);
    return proc_lookup(symbol, pfn, cudaVersion, flags, NULL);
}

/* ---- the test API (cudbl.h) ------------------------------------------------------------------ */

size_t cudbl_device_peak(int device)
{
    if (device < 0 || device >= MAX_DEVICES) return 0;
    pthread_mutex_lock(&g_lock);
    size_t v = g_dev_peak[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

size_t cudbl_device_mark_peak(int device, int new_window, size_t *used_now)
{
    if (device < 0 || device >= MAX_DEVICES) return 0;
    pthread_mutex_lock(&g_lock);
    size_t v = g_dev_mark_peak[device];
    if (used_now) *used_now = g_dev_used[device];
    if (new_window) g_dev_mark_peak[device] = g_dev_used[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

int cudbl_set_host(int vmm, size_t capacity)
{
    if (vmm < -1 || vmm > (HOST_VMM_NUMA | HOST_VMM_HOST)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int rc = CUDA_SUCCESS;
    if (g_counts.host_handles) {
        rc = CUDA_ERROR_NOT_PERMITTED;
    } else {
        if (!atomic_load(&g_inited) && !g_configured_by_api) config_from_env();
        g_configured_by_api = 1;
        if (vmm >= 0) g_cfg.host_vmm = vmm;
        if (capacity) g_cfg.host_capacity = capacity;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

size_t cudbl_host_peak(void)
{
    pthread_mutex_lock(&g_lock);
    size_t v = g_host_peak;
    pthread_mutex_unlock(&g_lock);
    return v;
}

void cudbl_get_counts(struct cudbl_counts *out)
{
    if (!out) return;
    pthread_mutex_lock(&g_lock);
    *out = g_counts;
    out->misuse = atomic_load(&g_misuse);
    pthread_mutex_unlock(&g_lock);
}

void cudbl_get_bytes(struct cudbl_bytes *out, int new_window)
{
    if (!out) return;
    pthread_mutex_lock(&g_lock);
    *out = g_bytes;
    if (new_window) {
        g_bytes.handle_mark_peak = g_bytes.handle_bytes;
        g_bytes.mapped_mark_peak = g_bytes.mapped_bytes;
    }
    pthread_mutex_unlock(&g_lock);
}

long cudbl_foreach_mapping(void (*fn)(void *arg, CUdeviceptr va, size_t size), void *arg)
{
    long n = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_page_tab.cap; i++) { /* a mapping is listed under each of its pages */
        if (g_page_tab.keys[i] <= HT_TOMB) continue;
        struct vmap *m = g_page_tab.vals[i];
        if (m->va != (CUdeviceptr)g_page_tab.keys[i]) continue; /* once: at its first page */
        if (fn) fn(arg, m->va, m->size);
        n++;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

int cudbl_stream_enqueue(CUstream s, void (*fn)(void *), void *arg)
{
    if (!atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED;
    tls_api = "cudbl_stream_enqueue";
    return enqueue_fn(s, fn, arg);
}

int cudbl_launch(CUstream s, CUdeviceptr p, size_t n, int write, void (*fn)(void *), void *arg)
{
    if (!atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!fn || !n) return CUDA_ERROR_INVALID_VALUE;
    tls_api = "cudbl_launch";
    struct item *it = calloc(1, sizeof *it);
    if (!it) return CUDA_ERROR_OUT_OF_MEMORY;
    it->kind = IT_KERNEL;
    it->fn = fn;
    it->arg = arg;
    it->dst = p;
    it->n = n;
    it->write = write != 0;
    return enqueue_item(s, it, 1);
}

int cudbl_check_access(int device, CUdeviceptr p, size_t n, int write)
{
    if (!atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev_valid(device)) return CUDA_ERROR_INVALID_DEVICE;
    char why[200];
    pthread_mutex_lock(&g_lock);
    int bad = device_access_locked(device, p, n, write, 1, NULL, why, sizeof why); /* directly, as a kernel */
    pthread_mutex_unlock(&g_lock);
    return bad ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

void cudbl_set_misuse_abort(int on)
{
    pthread_once(&g_env_once, env_once);
    atomic_store(&g_misuse_abort, on ? 1 : 0);
}

int cudbl_set_peer(int a, int b, int can)
{
    if (a < 0 || b < 0 || a >= MAX_DEVICES || b >= MAX_DEVICES || a == b) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (!g_peer_configured && !atomic_load(&g_inited)) peer_from_env();
    g_peer_configured = 1;
    g_peer[a][b] = g_peer[b][a] = can != 0;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

int cudbl_progress(int max_items)
{
    int ran = 0;
    uint64_t last = 0;
    pthread_mutex_lock(&g_lock);
    while (ran < max_items) {
        struct stream *s = pick_runnable_locked(last);
        if (!s) break;
        last = s->id;
        s->refs++;
        run_head_locked(s);
        stream_unref_locked(s);
        ran++;
    }
    pthread_mutex_unlock(&g_lock);
    return ran;
}

long cudbl_stream_pending(CUstream h)
{
    if (!atomic_load(&g_inited)) return -1;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    long n = -1;
    if (stream_resolve_locked(h, &s) == CUDA_SUCCESS) {
        settle_locked(s);
        n = (long)(s->enqueued - s->completed);
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

void cudbl_set_async(int on)
{
    pthread_once(&g_env_once, env_once);
    pthread_mutex_lock(&g_lock);
    atomic_store(&g_async, on ? 1 : 0);
    if (on) gpu_thread_start_locked();
    pthread_cond_broadcast(&g_cond);
    pthread_mutex_unlock(&g_lock);
}

void cudbl_fail_nth(const char *name, long n, CUresult err)
{
    pthread_once(&g_env_once, env_once);
    int fn = fn_index(name);
    if (fn < 0 || n < 1) return;
    struct fault_rule r = {0};
    r.fn = fn;
    r.nth = atomic_load(&g_calls[fn]) + n;
    r.err = err != CUDA_SUCCESS ? err : default_fault(fn);
    add_rule(&r);
}

void cudbl_fail_prob(const char *name, double p, unsigned long long seed, CUresult err)
{
    pthread_once(&g_env_once, env_once);
    int fn = fn_index(name);
    if (fn < 0 || p < 0 || p > 1) return;
    struct fault_rule r = {0};
    r.fn = fn;
    r.prob = p;
    r.rng = seed;
    r.err = err != CUDA_SUCCESS ? err : default_fault(fn);
    add_rule(&r);
}

void cudbl_fail_clear(void)
{
    pthread_once(&g_env_once, env_once);
    pthread_mutex_lock(&g_fault_lock);
    atomic_store(&g_nrules, 0);
    pthread_mutex_unlock(&g_fault_lock);
}

int cudbl_ctx_depth(void)
{
    return tls_ctx_depth;
}

long cudbl_call_count(const char *name)
{
    int fn = fn_index(name);
    return fn < 0 ? -1 : atomic_load(&g_calls[fn]);
}

long long cudbl_call_bytes(const char *name)
{
    int fn = fn_index(name);
    return fn < 0 ? -1 : (long long)atomic_load(&g_call_bytes[fn]);
}

int cudbl_configure(int devices, size_t capacity, size_t granularity)
{
    if (devices < 0 || devices > MAX_DEVICES) return CUDA_ERROR_INVALID_VALUE;
    if (granularity && !valid_granularity(granularity)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int rc = CUDA_SUCCESS;
    if (g_counts.handles || g_counts.allocs || g_counts.reservations) {
        rc = CUDA_ERROR_NOT_PERMITTED;
    } else {
        if (!atomic_load(&g_inited) && !g_configured_by_api) config_from_env();
        g_configured_by_api = 1;
        if (devices) g_cfg.devices = devices;
        if (capacity) g_cfg.capacity = capacity;
        if (granularity) g_cfg.granularity = granularity;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

__attribute__((destructor)) static void cudbl_at_exit(void)
{
    pthread_mutex_lock(&g_lock);
    int started = g_gpu_started;
    g_gpu_stop = 1;
    pthread_cond_broadcast(&g_cond);
    pthread_mutex_unlock(&g_lock);
    if (started) pthread_join(g_gpu_thread, NULL);
    const char *v = getenv("CUDBL_REPORT_AT_EXIT");
    if (v && *v && strcmp(v, "0") != 0) {
        struct cudbl_counts c;
        cudbl_get_counts(&c);
        char buf[240];
        int n = snprintf(buf, sizeof buf, "cudbl: exit handles=%ld mappings=%ld reservations=%ld "
                         "allocs=%ld events=%ld misuse=%ld bytes=%zu\n", c.handles, c.mappings, c.reservations,
                         c.allocs, c.events, c.misuse, c.bytes_in_use);
        if (n > 0) {
            ssize_t w = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
            (void)w;
        }
    }
}

static void fork_child(void)
{
    g_gpu_started = 0;
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_unlock(&g_fault_lock);
}

long cudbl_access_grants(int device)
{
    if (device < 0 || device >= MAX_DEVICES) return -1;
    pthread_mutex_lock(&g_lock);
    long n = g_grants[device];
    pthread_mutex_unlock(&g_lock);
    return n;
}

long cudbl_mappings_accessible(int device)
{
    if (device < 0 || device >= MAX_DEVICES) return -1;
    long n = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_page_tab.cap; i++) {
        if (g_page_tab.keys[i] == HT_EMPTY || g_page_tab.keys[i] == HT_TOMB) continue;
        struct vmap *m = g_page_tab.vals[i];
        if (m && m->va == (CUdeviceptr)(g_page_tab.keys[i]) && m->access[device] != CU_MEM_ACCESS_FLAGS_PROT_NONE) n++;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}
