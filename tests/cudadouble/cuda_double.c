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

#include "cudbl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
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
    X(cuGetErrorString) X(cuGetErrorName)

#define FN_ENUM(n) FN_##n,
#define FN_NAME(n) #n,
enum { CUDBL_FUNCS(FN_ENUM) FN_COUNT };
static const char *const fn_names[FN_COUNT] = { CUDBL_FUNCS(FN_NAME) };

#define MAX_DEVICES 16
#define DEFAULT_CAPACITY (8ull << 30)
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
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
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

struct ctx {
    uint32_t magic;
    int device;
    int is_primary, destroyed;
    int primary_refs;
    unsigned int flags;
    struct stream *legacy;      /* the NULL / CU_STREAM_LEGACY stream of this context */
    struct ctx *next;
};
#define CTX_MAGIC 0xC7C7C7C7u

enum item_kind { IT_FN, IT_WAIT, IT_FREE, IT_NOP };
struct item {
    enum item_kind kind;
    void (*fn)(void *);
    void *arg;
    struct stream *wait_s;      /* IT_WAIT: done once wait_s->completed >= wait_pos */
    uint64_t wait_pos;
    CUdeviceptr free_ptr;       /* IT_FREE */
    struct item *next;
};

enum stream_kind { SK_USER, SK_LEGACY, SK_PER_THREAD };
struct stream {
    uint64_t id;
    struct ctx *ctx;
    enum stream_kind kind;
    unsigned int flags;
    int destroyed, busy, refs;
    uint64_t enqueued, completed;   /* items ever queued / completed, FIFO: item k done iff completed > k */
    struct item *head, *tail;
    struct stream *prev, *next;
};

struct event {
    unsigned int flags;
    int recorded;
    struct stream *s;           /* holds a reference while recorded */
    uint64_t pos;
    struct timespec when;
};

struct phys {
    uint64_t id;
    int device;
    size_t size;
    off_t off;                  /* offset in the backing memfd */
    int refs;                   /* handle references: create + retains - releases */
    int maps;
};

struct vmap {
    CUdeviceptr va;
    size_t size;
    struct phys *p;
    unsigned long long access;  /* CUmemAccess_flags granted by cuMemSetAccess */
    struct vmap *next;          /* sorted by va */
};

struct resv {
    CUdeviceptr base;
    size_t size;
    struct vmap *maps;
    struct resv *next;
};

struct dalloc {
    CUdeviceptr ptr;
    size_t size, charged;
    int device;
    int free_pending;
};

struct config { int devices; size_t capacity, granularity; };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;  /* work queued or completed */
static atomic_int g_inited;
static int g_configured_by_api;
static struct config g_cfg = {1, DEFAULT_CAPACITY, DEFAULT_GRANULARITY};
static size_t g_dev_used[MAX_DEVICES];
static struct ctx *g_primary[MAX_DEVICES];
static struct ctx *g_ctxs;
static struct stream *g_streams;    /* every stream not yet freed, in creation order */
static uint64_t g_next_stream_id = 1;
static struct htab g_stream_tab, g_event_tab, g_handle_tab, g_alloc_tab;
static struct resv *g_resvs;
static uint64_t g_next_handle = 0x1000;
static int g_memfd = -1;
static off_t g_memfd_size, g_memfd_next;
static struct cudbl_counts g_counts;

static atomic_long g_calls[FN_COUNT];

/* async "GPU" thread */
static atomic_int g_async;
static int g_gpu_started, g_gpu_stop;
static pthread_t g_gpu_thread;
static unsigned g_async_delay_us = 200;

/* per-thread context stack and per-thread default streams */
#define CTX_STACK_MAX 32
static __thread struct ctx *tls_ctx_stack[CTX_STACK_MAX];
static __thread int tls_ctx_depth;
#define PT_STREAMS_MAX 8
static __thread struct { struct ctx *ctx; struct stream *s; } tls_pt_streams[PT_STREAMS_MAX];

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
    if ((v = getenv("CUDBL_GRANULARITY")) && *v) {
        if (parse_size(v, &sz) || !valid_granularity(sz))
            warn("CUDBL_GRANULARITY=%s is not a power of two >= page size; using %s", v, "2M");
        else g_cfg.granularity = sz;
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

/* Every exported driver function starts here: count the call, inject a fault, check cuInit. */
static CUresult enter(int fn, int need_init)
{
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
 * always be checked. */
static int ctx_valid_locked(struct ctx *c)
{
    for (struct ctx *x = g_ctxs; x; x = x->next)
        if (x == c) return !c->destroyed;
    return 0;
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
    s->ctx = c;
    s->kind = kind;
    s->flags = flags;
    if (ht_put(&g_stream_tab, (uint64_t)(uintptr_t)s, s)) { free(s); return NULL; }
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
    ht_del(&g_stream_tab, (uint64_t)(uintptr_t)s);
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
    if (!s || s->destroyed || s->kind != SK_USER || s->ctx->destroyed)
        return CUDA_ERROR_INVALID_HANDLE;
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

/* Queue an item, adding the implicit waits of the legacy default stream: work on the legacy
 * stream waits for all earlier work on the context's blocking streams, and work on a blocking
 * stream waits for earlier work on the legacy stream (CUDA's "NULL stream semantics"). */
static CUresult enqueue_locked(struct stream *s, struct item *it)
{
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

/* Run the head item of s (runnable). A host function runs without the lock, with the stream
 * marked busy so nobody else starts its next item. */
static void run_head_locked(struct stream *s)
{
    struct item *it = s->head;
    if (it->kind == IT_FN) {
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
static void sync_streams_locked(struct ctx *c, int dev)
{
    size_t n = 0;
    for (struct stream *s = g_streams; s; s = s->next) n++;
    if (!n) return;
    struct { struct stream *s; uint64_t pos; } *snap = calloc(n, sizeof *snap);
    size_t k = 0;
    for (struct stream *s = g_streams; s && snap; s = s->next) {
        if (c ? s->ctx != c : (dev >= 0 && s->ctx->device != dev)) continue;
        if (s->completed >= s->enqueued) continue;
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
    g_counts.bytes_in_use += bytes;
    return 0;
}

static void uncharge_locked(int dev, size_t bytes)
{
    g_dev_used[dev] -= bytes;
    g_counts.bytes_in_use -= bytes;
}

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
    if (fallocate(g_memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, p->off, (off_t)p->size))
        warn("hole punch failed: %s%s", strerror(errno), "");
    uncharge_locked(p->device, p->size);
    g_counts.handles--;
    free(p);
}

static struct resv *resv_containing_locked(CUdeviceptr va, size_t size)
{
    for (struct resv *r = g_resvs; r; r = r->next)
        if (va >= r->base && size <= r->size && va - r->base <= r->size - size) return r;
    return NULL;
}

static struct vmap *vmap_containing_locked(CUdeviceptr va)
{
    for (struct resv *r = g_resvs; r; r = r->next) {
        if (va < r->base || va - r->base >= r->size) continue;
        for (struct vmap *m = r->maps; m; m = m->next)
            if (va >= m->va && va - m->va < m->size) return m;
        return NULL;
    }
    return NULL;
}

/* Bytes of [va, va+size) covered by mappings of r; *partial set when a mapping sticks out. */
static size_t covered_locked(struct resv *r, CUdeviceptr va, size_t size, int *partial)
{
    size_t covered = 0;
    *partial = 0;
    for (struct vmap *m = r->maps; m; m = m->next) {
        CUdeviceptr lo = m->va > va ? m->va : va;
        CUdeviceptr hi = m->va + m->size < va + size ? m->va + m->size : va + size;
        if (lo >= hi) continue;
        covered += hi - lo;
        if (m->va < va || m->va + m->size > va + size) *partial = 1;
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
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 0; break;
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
    struct ctx *c = (struct ctx *)ctx;
    pthread_mutex_lock(&g_lock);
    if (!c || !ctx_valid_locked(c) || c->is_primary) {
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
    int ok = ctx_valid_locked(c);
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
    int ok = c && ctx_valid_locked(c);
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

CUresult CUDAAPI cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked();
    if (c) sync_streams_locked(c, -1);
    pthread_mutex_unlock(&g_lock);
    return c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
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
    CUresult rc = c ? dalloc_new_locked(dptr, bytesize, c->device) : CUDA_ERROR_INVALID_CONTEXT;
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
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (a && !a->free_pending) {
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

CUresult CUDAAPI cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    ENTER(cuMemGetAddressRange);
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_alloc_tab.cap && rc != CUDA_SUCCESS; i++) {
        if (g_alloc_tab.keys[i] <= HT_TOMB) continue;
        struct dalloc *a = g_alloc_tab.vals[i];
        if (dptr >= a->ptr && dptr - a->ptr < a->size) {
            if (pbase) *pbase = a->ptr;
            if (psize) *psize = a->size;
            rc = CUDA_SUCCESS;
        }
    }
    struct vmap *m = rc == CUDA_SUCCESS ? NULL : vmap_containing_locked(dptr);
    if (m) {
        if (pbase) *pbase = m->va;
        if (psize) *psize = m->size;
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Copies and sets are synchronous: they wait for the device, then touch host memory directly
 * (an address without access faults, as a bad device address would). */
static void device_sync_all(void)
{
    pthread_mutex_lock(&g_lock);
    struct ctx *c = ctx_current_locked();
    sync_streams_locked(NULL, c ? c->device : -1);
    pthread_mutex_unlock(&g_lock);
}

CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    ENTER(cuMemcpyHtoD);
    device_sync_all();
    if (n) memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoH);
    device_sync_all();
    if (n) memcpy(dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    ENTER(cuMemcpyDtoD);
    device_sync_all();
    if (n) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n)
{
    ENTER(cuMemsetD8);
    device_sync_all();
    if (n) memset((void *)(uintptr_t)dst, uc, n);
    return CUDA_SUCCESS;
}

/* ---- virtual memory management --------------------------------------------------------------- */

static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_valid(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
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

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags)
{
    ENTER(cuMemCreate);
    if (!handle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop);
    if (rc != CUDA_SUCCESS) return rc;
    if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_NOT_SUPPORTED;
    if (size == 0 || size % g_cfg.granularity) return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.id;
    struct phys *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    if (charge_locked(dev, size)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (memfd_take_locked(size, &p->off) || ht_put(&g_handle_tab, g_next_handle, p)) {
        uncharge_locked(dev, size);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        p->id = g_next_handle++;
        p->device = dev;
        p->size = size;
        p->refs = 1;
        g_counts.handles++;
        *handle = p->id;
    }
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) free(p);
    return rc;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemRelease);
    pthread_mutex_lock(&g_lock);
    struct phys *p = ht_get(&g_handle_tab, handle);
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
    pthread_mutex_unlock(&g_lock);
    *ptr = r->base;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemAddressFree);
    pthread_mutex_lock(&g_lock);
    struct resv **pp = &g_resvs;
    while (*pp && !((*pp)->base == ptr && (*pp)->size == size)) pp = &(*pp)->next;
    struct resv *r = *pp;
    /* the whole reservation, and nothing may still be mapped in it */
    CUresult rc = !r || r->maps ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        *pp = r->next;
        g_counts.reservations--;
        munmap((void *)(uintptr_t)r->base, r->size);
        free(r);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    ENTER(cuMemMap);
    size_t g = g_cfg.granularity;
    if (!ptr || !size || offset != 0 || flags != 0 || ptr % g || size % g)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    struct phys *p = ht_get(&g_handle_tab, handle);
    struct resv *r = resv_containing_locked(ptr, size);
    struct vmap *m = NULL;
    int partial;
    if (!p || p->size != size || !r) rc = CUDA_ERROR_INVALID_VALUE;
    else if (covered_locked(r, ptr, size, &partial)) rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    else if (!(m = calloc(1, sizeof *m))) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, g_memfd, p->off)
             == MAP_FAILED)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        m->va = ptr;
        m->size = size;
        m->p = p;
        struct vmap **pp = &r->maps;
        while (*pp && (*pp)->va < ptr) pp = &(*pp)->next;
        m->next = *pp;
        *pp = m;
        p->maps++;
        g_counts.mappings++;
    } else {
        free(m);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The range must consist of whole mappings: the driver cannot unmap part of a cuMemMap. */
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemUnmap);
    if (!ptr || !size) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct resv *r = resv_containing_locked(ptr, size);
    int partial = 0;
    CUresult rc = CUDA_SUCCESS;
    if (!r || covered_locked(r, ptr, size, &partial) != size || partial) rc = CUDA_ERROR_INVALID_VALUE;
    for (struct vmap **pp = r && rc == CUDA_SUCCESS ? &r->maps : NULL; pp && *pp;) {
        struct vmap *m = *pp;
        if (m->va < ptr || m->va >= ptr + size) { pp = &m->next; continue; }
        /* back to an inaccessible reservation; the memfd keeps the data */
        mmap((void *)(uintptr_t)m->va, m->size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        *pp = m->next;
        m->p->maps--;
        g_counts.mappings--;
        phys_maybe_free_locked(m->p);
        free(m);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    ENTER(cuMemSetAccess);
    if (!ptr || !size || !desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    unsigned long long flags = 0;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
        if (!dev_valid(desc[i].location.id)) return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        flags |= desc[i].flags;
    }
    pthread_mutex_lock(&g_lock);
    struct resv *r = resv_containing_locked(ptr, size);
    int partial;
    CUresult rc = CUDA_SUCCESS;
    if (!r || covered_locked(r, ptr, size, &partial) != size) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        int prot = PROT_NONE;
        if (flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
        else if (flags == CU_MEM_ACCESS_FLAGS_PROT_READ) prot = PROT_READ;
        if (mprotect((void *)(uintptr_t)ptr, size, prot)) rc = CUDA_ERROR_INVALID_VALUE;
        for (struct vmap *m = r->maps; m && rc == CUDA_SUCCESS; m = m->next)
            if (m->va < ptr + size && m->va + m->size > ptr) m->access = flags;
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
    if (m) *flags = m->access;
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
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = p->device;
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
    *ph = (CUstream)s;
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

/* Like the driver, destroying a stream with queued work returns at once; the work still runs. */
CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream)
{
    ENTER(cuStreamDestroy);
    if (hStream == NULL || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
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
    if (rc == CUDA_SUCCESS) {
        settle_locked(s);
        if (s->completed < s->enqueued) rc = CUDA_ERROR_NOT_READY;
    }
    pthread_mutex_unlock(&g_lock);
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
    pthread_mutex_lock(&g_lock);
    struct stream *s;
    CUresult rc = stream_resolve_locked(hStream, &s);
    if (rc == CUDA_SUCCESS) rc = enqueue_locked(s, it);
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) free(it);
    return rc;
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    ENTER(cuLaunchHostFunc);
    return enqueue_fn(hStream, fn, userData);
}

/* ---- events ---------------------------------------------------------------------------------- */

static struct event *event_get_locked(CUevent h)
{
    return h ? ht_get(&g_event_tab, (uint64_t)(uintptr_t)h) : NULL;
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
    CUresult rc = ctx_current_locked() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (rc == CUDA_SUCCESS && ht_put(&g_event_tab, (uint64_t)(uintptr_t)e, e))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) g_counts.events++;
    pthread_mutex_unlock(&g_lock);
    if (rc != CUDA_SUCCESS) { free(e); return rc; }
    *phEvent = (CUevent)e;
    return CUDA_SUCCESS;
}

/* An event is a position in a stream: recording it queues a marker (so the legacy stream's
 * implicit waits apply to it too) and remembers how many items must complete. */
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream)
{
    ENTER(cuEventRecord);
    struct item *marker = calloc(1, sizeof *marker);
    if (!marker) return CUDA_ERROR_OUT_OF_MEMORY;
    marker->kind = IT_NOP;
    pthread_mutex_lock(&g_lock);
    struct event *e = event_get_locked(hEvent);
    struct stream *s = NULL;
    CUresult rc = e ? stream_resolve_locked(hStream, &s) : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS) {
        s->refs++;          /* before enqueue: settling may pop the marker at once */
        rc = enqueue_locked(s, marker);
        if (rc != CUDA_SUCCESS) {
            stream_unref_locked(s);
        } else {
            marker = NULL;
            if (e->recorded) stream_unref_locked(e->s);
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

CUresult CUDAAPI cuEventQuery(CUevent hEvent)
{
    ENTER(cuEventQuery);
    pthread_mutex_lock(&g_lock);
    struct event *e = event_get_locked(hEvent);
    CUresult rc = !e ? CUDA_ERROR_INVALID_HANDLE : event_done_locked(e) ? CUDA_SUCCESS
                                                                         : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent)
{
    ENTER(cuEventSynchronize);
    pthread_mutex_lock(&g_lock);
    struct event *e = event_get_locked(hEvent);
    if (e && e->recorded) advance_locked(e->s, e->pos);
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuEventDestroy_v2(CUevent hEvent)
{
    ENTER(cuEventDestroy);
    pthread_mutex_lock(&g_lock);
    struct event *e = event_get_locked(hEvent);
    if (e) {
        ht_del(&g_event_tab, (uint64_t)(uintptr_t)e);
        if (e->recorded) stream_unref_locked(e->s);
        g_counts.events--;
        free(e);
    }
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Host time between the two records, once both events completed. */
CUresult CUDAAPI cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    ENTER(cuEventElapsedTime);
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct event *a = event_get_locked(hStart), *b = event_get_locked(hEnd);
    CUresult rc = CUDA_SUCCESS;
    if (!a || !b || !a->recorded || !b->recorded || (a->flags & CU_EVENT_DISABLE_TIMING) ||
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

/* Work queued on hStream from now on waits until everything before the event's record ran. */
CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    ENTER(cuStreamWaitEvent);
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    struct item *w = calloc(1, sizeof *w);
    if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    struct event *e = event_get_locked(hEvent);
    struct stream *s = NULL;
    CUresult rc = e ? stream_resolve_locked(hStream, &s) : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS && !event_done_locked(e)) {
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

/* One row per ABI version of a base name: the newest row whose version is <= the caller's
 * cudaVersion wins. ptsz is what CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM returns. */
struct proc_entry { const char *name; int version; void *fn; void *ptsz; };

CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus);
CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

#define P(name, ver, fn) {name, ver, (void *)fn, NULL}
#define PS(name, ver, fn) {name, ver, (void *)fn, (void *)fn##_ptsz}
static const struct proc_entry proc_table[] = {
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    P("cuCtxCreate", 3020, cuCtxCreate_v2),
    P("cuCtxCreate", 12050, cuCtxCreate_v4),
    P("cuCtxDestroy", 2000, cuCtxDestroy),
    P("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxPushCurrent", 2000, cuCtxPushCurrent),
    P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 2000, cuCtxPopCurrent),
    P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemFree", 3020, cuMemFree_v2),
    PS("cuMemAllocAsync", 11020, cuMemAllocAsync),
    PS("cuMemFreeAsync", 11020, cuMemFreeAsync),
    P("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    P("cuMemsetD8", 3020, cuMemsetD8_v2),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuMemGetAccess", 10020, cuMemGetAccess),
    P("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    P("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    P("cuStreamDestroy", 2000, cuStreamDestroy),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    PS("cuStreamSynchronize", 2000, cuStreamSynchronize),
    PS("cuStreamQuery", 2000, cuStreamQuery),
    PS("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    PS("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    P("cuEventCreate", 2000, cuEventCreate),
    PS("cuEventRecord", 2000, cuEventRecord),
    P("cuEventQuery", 2000, cuEventQuery),
    P("cuEventSynchronize", 2000, cuEventSynchronize),
    P("cuEventDestroy", 2000, cuEventDestroy),
    P("cuEventDestroy", 4000, cuEventDestroy_v2),
    P("cuEventElapsedTime", 2000, cuEventElapsedTime),
    P("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    P("cuGetProcAddress", 11030, cuGetProcAddress),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    P("cuGetErrorString", 6000, cuGetErrorString),
    P("cuGetErrorName", 6000, cuGetErrorName),
};
#undef P
#undef PS

static CUresult proc_lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    const struct proc_entry *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof proc_table / sizeof proc_table[0]; i++) {
        const struct proc_entry *e = &proc_table[i];
        if (strcmp(e->name, symbol) != 0) continue;
        known = 1;
        if (e->version <= cudaVersion && (!best || e->version > best->version)) best = e;
    }
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
    *pfn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz
                                                                                  : best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
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

void cudbl_get_counts(struct cudbl_counts *out)
{
    if (!out) return;
    pthread_mutex_lock(&g_lock);
    *out = g_counts;
    pthread_mutex_unlock(&g_lock);
}

int cudbl_stream_enqueue(CUstream s, void (*fn)(void *), void *arg)
{
    if (!atomic_load(&g_inited)) return CUDA_ERROR_NOT_INITIALIZED;
    return enqueue_fn(s, fn, arg);
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

long cudbl_call_count(const char *name)
{
    int fn = fn_index(name);
    return fn < 0 ? -1 : atomic_load(&g_calls[fn]);
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
                         "allocs=%ld events=%ld bytes=%zu\n", c.handles, c.mappings, c.reservations, c.allocs,
                         c.events, c.bytes_in_use);
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
