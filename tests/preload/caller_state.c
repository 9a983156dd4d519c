/*
 * caller_state.c: memshim's entry points leave the caller's CUDA state as they found it (issue 27
 * item 1, in part). PyTorch, NCCL and user code call memshim from threads whose current device and
 * context they chose; memshim does its own driver work with the owning device's context pushed,
 * and must pop it, restore the capture mode it relaxed, and leave the runtime's last error alone.
 * A WITH_CTX that pushed and did not pop would send a multi-GPU job's next kernels to the wrong
 * device after a cross-device free.
 *
 * A table of calls, each run on a fresh thread in each of four states: device 0's primary context
 * current, device 1's, no context at all, and a context the thread created itself (device 1's, not
 * the primary one). Before the call the thread plants a runtime error (cudaSetDevice of a device
 * that does not exist) and sets its capture mode to thread-local; after it, the runtime's current
 * device, the driver's current context, the context stack's depth (the double's), the capture mode
 * and cudaPeekAtLastError must all be as before. The calls: memshim's own entries (memshim_malloc
 * and _free on the other device, the tensor-mode entries, record_stream, empty-cache, stats) and
 * the driver hooks (cuMemFree_v2 of another device's block, cuMemGetInfo_v2, cuMemAlloc_v2),
 * whose real counterparts change none of it; and the runtime hooks (cudaMalloc, cudaFree of
 * another device's block, cudaMemGetInfo) where a context is current, where the runtime's contract
 * changes none of it either (with no context it would make the device's primary one current: not
 * held here). Each call also runs with a capture open elsewhere in the process, where memshim
 * relaxes the thread's capture mode around its driver work: a real stream capture, begun through
 * the runtime's hook on a third device in relaxed mode (so that it prohibits nothing the calls do
 * on devices 0 and 1; PyTorch's pool window alone is no capture since issue 31). Run with
 * CUDBL_DEVICES=3.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

#define MiB ((size_t)1 << 20)

static void *(*ms_malloc)(ssize_t, int, memshim_stream_t);
static void (*ms_free)(void *, ssize_t, int, memshim_stream_t);
static void *(*t_alloc)(ssize_t, int, memshim_stream_t);
static void (*t_free)(void *, ssize_t, int, memshim_stream_t);
static void (*t_record)(void *, memshim_stream_t);
static void (*empty)(void);
static int (*stats)(int, struct memshim_stats *);
static void (*begin_pool)(int, unsigned long long, unsigned long long, void *);
static void (*end_pool)(int, unsigned long long, unsigned long long);

enum { ST_DEV0, ST_DEV1, ST_NONE, ST_OWN, NSTATES };
static const char *const state_name[NSTATES] = {"device 0 current", "device 1 current", "no context",
                                                "its own context"};

struct snap {
    int device;
    CUcontext ctx;
    int depth;
    CUstreamCaptureMode mode;
    cudaError_t last;
};

static void take(struct snap *s)
{
    s->device = -1;
    /* cudaGetDevice does not create a context and does not touch the last error */
    cudaGetDevice(&s->device);
    s->ctx = NULL;
    cuCtxGetCurrent(&s->ctx);
    s->depth = cudbl_ctx_depth();
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_GLOBAL;
    cuThreadExchangeStreamCaptureMode(&m); /* read it ... */
    s->mode = m;
    cuThreadExchangeStreamCaptureMode(&m); /* ... and put it back */
    s->last = cudaPeekAtLastError();
}

/* The blocks of device 1 made by the main thread, freed by the calls across devices. */
static void *d1_block_rt, *d1_block_drv;

typedef int (*call_fn)(void);

static int c_memshim_malloc_other_device(void)
{
    void *p = ms_malloc(3 * MiB, 1, NULL);
    if (!p) return -1;
    ms_free(p, 3 * MiB, 1, NULL);
    return 0;
}

static int c_torch_alloc_other_device(void)
{
    void *p = t_alloc(5 * MiB, 1, NULL);
    if (!p) return -1;
    t_record(p, NULL);
    t_free(p, 5 * MiB, 1, NULL);
    return 0;
}

static int c_empty_cache(void)
{
    empty();
    return 0;
}

static int c_stats(void)
{
    struct memshim_stats st;
    return stats(1, &st);
}

static int c_cumemfree_other_device(void)
{
    void *p = ms_malloc(2 * MiB, 1, NULL); /* a device 1 pool block, freed through the driver hook */
    if (!p) return -1;
    return cuMemFree_v2((CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS ? 0 : -1;
}

static int c_cumemgetinfo(void)
{
    size_t f, t;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    return r == CUDA_SUCCESS || r == CUDA_ERROR_INVALID_CONTEXT ? 0 : -1; /* no context: the driver's answer */
}

static int c_cudamalloc_free(void)
{
    void *p = NULL;
    if (cudaMalloc(&p, 7 * MiB) != cudaSuccess) return -1;
    return cudaFree(p) == cudaSuccess ? 0 : -1;
}

static int c_cudafree_other_device(void)
{
    void *p = ms_malloc(4 * MiB, 1, NULL);
    if (!p) return -1;
    return cudaFree(p) == cudaSuccess ? 0 : -1;
}

static int c_cudamemgetinfo(void)
{
    size_t f, t;
    return cudaMemGetInfo(&f, &t) == cudaSuccess ? 0 : -1;
}

static const struct call {
    const char *name;
    call_fn fn;
    bool needs_ctx; /* a runtime call: its contract makes a context current when none is */
} CALLS[] = {
    {"memshim_malloc/free on device 1", c_memshim_malloc_other_device, false},
    {"memshim_torch_alloc/record_stream/free on device 1", c_torch_alloc_other_device, false},
    {"memshim_empty_cache", c_empty_cache, false},
    {"memshim_get_stats(1)", c_stats, false},
    {"cuMemFree_v2 of a device 1 block", c_cumemfree_other_device, false},
    {"cuMemGetInfo_v2", c_cumemgetinfo, false},
    {"cudaMalloc + cudaFree", c_cudamalloc_free, true},
    {"cudaFree of a device 1 block", c_cudafree_other_device, true},
    {"cudaMemGetInfo", c_cudamemgetinfo, true},
};
#define NCALLS (sizeof CALLS / sizeof *CALLS)

struct job {
    int state;
    const struct call *call;
    char why[512];
    int ran;
};

static void *run_job(void *arg)
{
    struct job *j = arg;
    CUcontext own = NULL;
    switch (j->state) {
    case ST_DEV0:
    case ST_DEV1:
        cudaSetDevice(j->state == ST_DEV0 ? 0 : 1);
        cudaFree(NULL); /* the device's primary context current */
        break;
    case ST_OWN: {
        CUdevice d;
        cuDeviceGet(&d, 1);
        /* CUDA 13's header names cuCtxCreate_v4; the double keeps the v2 form too */
        CUresult (*create)(CUcontext *, unsigned int, CUdevice);
        *(void **)&create = dlsym(RTLD_DEFAULT, "cuCtxCreate_v2");
        if (!create || create(&own, 0, d) != CUDA_SUCCESS) {
            snprintf(j->why, sizeof j->why, "cuCtxCreate failed");
            return NULL;
        }
        break;
    }
    default:
        break;
    }
    if (j->call->needs_ctx && j->state == ST_NONE) return NULL;
    /* a runtime error left for the program to read, and a capture mode the program chose */
    cudaSetDevice(99);
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    cuThreadExchangeStreamCaptureMode(&m);
    struct snap before, after;
    take(&before);
    int rc = j->call->fn();
    take(&after);
    j->ran = 1;
    size_t o = 0;
#define DIFF(cond, ...)                                                                              \
    do {                                                                                             \
        if ((cond) && o < sizeof j->why) o += (size_t)snprintf(j->why + o, sizeof j->why - o, __VA_ARGS__); \
    } while (0)
    DIFF(rc != 0, "the call failed; ");
    DIFF(after.device != before.device, "current device %d -> %d; ", before.device, after.device);
    DIFF(after.ctx != before.ctx, "current context %p -> %p; ", (void *)before.ctx, (void *)after.ctx);
    DIFF(after.depth != before.depth, "context stack %d -> %d deep; ", before.depth, after.depth);
    DIFF(after.mode != before.mode, "capture mode %d -> %d; ", (int)before.mode, (int)after.mode);
    DIFF(after.last != before.last, "cudaPeekAtLastError %d -> %d; ", (int)before.last, (int)after.last);
    DIFF(before.last != cudaErrorInvalidDevice, "the planted error did not read back (%d); ", (int)before.last);
    cudaGetLastError();
    if (own) cuCtxDestroy(own);
    return NULL;
}

static int run_table(const char *when)
{
    int bad = 0, ran = 0;
    for (size_t c = 0; c < NCALLS; c++)
        for (int s = 0; s < NSTATES; s++) {
            struct job j = {.state = s, .call = &CALLS[c]};
            pthread_t th;
            if (pthread_create(&th, NULL, run_job, &j) != 0) return -1;
            pthread_join(th, NULL);
            ran += j.ran;
            if (j.why[0]) {
                bad++;
                printf("    %s, %s, %s: %s\n", when, CALLS[c].name, state_name[s], j.why);
            }
        }
    printf("    %s: %d calls in %d states compared, %d changed the caller's state\n", when, ran, NSTATES, bad);
    return bad;
}

static bool resolve(void)
{
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&t_alloc = dlsym(RTLD_DEFAULT, "memshim_torch_alloc");
    *(void **)&t_free = dlsym(RTLD_DEFAULT, "memshim_torch_free");
    *(void **)&t_record = dlsym(RTLD_DEFAULT, "memshim_torch_record_stream");
    *(void **)&empty = dlsym(RTLD_DEFAULT, "memshim_empty_cache");
    *(void **)&stats = dlsym(RTLD_DEFAULT, "memshim_get_stats");
    *(void **)&begin_pool = dlsym(RTLD_DEFAULT, "memshim_torch_begin_allocate_to_pool");
    *(void **)&end_pool = dlsym(RTLD_DEFAULT, "memshim_torch_end_allocate_to_pool");
    return ms_malloc && ms_free && t_alloc && t_free && t_record && empty && stats && begin_pool && end_pool;
}

TEST(every_entry_leaves_the_callers_cuda_state_as_it_was)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 3) SKIP("needs CUDBL_DEVICES=3");
    REQUIRE(resolve());
    /* both devices' pools exist (the main thread ends on device 0) */
    REQUIRE(cudaSetDevice(1) == cudaSuccess && cudaMalloc(&d1_block_rt, MiB) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess && cudaMalloc(&d1_block_drv, MiB) == cudaSuccess);
    CHECK(run_table("no capture open") == 0);
    /* a capture open elsewhere (device 2's stream, with PyTorch's pool window open as during
     * torch.cuda.graph): memshim relaxes the capture mode around its driver work, and must give
     * the thread its own mode back */
    cudaStream_t cs;
    cudaGraph_t g = NULL;
    REQUIRE(cudaSetDevice(2) == cudaSuccess && cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) == cudaSuccess);
    begin_pool(0, 77, 0, NULL);
    REQUIRE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    CHECK(run_table("a capture open") == 0);
    CHECK(cudaSetDevice(2) == cudaSuccess && cudaStreamEndCapture(cs, &g) == cudaSuccess && g);
    end_pool(0, 77, 0);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(cs);
    cudaSetDevice(0);
    cudaFree(d1_block_rt);
    cudaFree(d1_block_drv);
}

TEST_MAIN()
