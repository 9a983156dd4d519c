/*
 * test_torch.c: shim/torch.c's entry points (what PyTorch's pluggable-allocator hooks call) on the
 * CUDA driver double: CUDA-graph capture pools (memory allocated into one is never handed to an
 * allocation outside it until it is released and its blocks are freed), the backstop for
 * allocations on a capturing stream, one limit shared by a device's pools, PyTorch-named
 * statistics with peaks that reset, the memory fraction, and the OOM message.
 *
 * One process, one memshim start-up: the tests run in order and each leaves the device as it
 * found it (everything freed, capture pools released). The capture query is replaced by the
 * test's (the double has no stream capture), through msh_torch_set_capture_query.
 */
#include "harness.h"
#include "memshim.h"
#include "msh.h"
#include "torch.h"
#include "capture.h"

#include "cudadouble/cudbl.h"
#include <stdbool.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MiB MSH_MiB
#define S_CAPTURING ((void *)0x5000) /* a stream the test says is capturing */
#define S_OTHER ((void *)0x6000)

static int fake_capturing(void *stream)
{
    return stream == S_CAPTURING;
}

static long long stat_of(int device, const char *name)
{
    int n = memshim_torch_stats(device, NULL, 0);
    long long *v = calloc((size_t)n, sizeof *v);
    memshim_torch_stats(device, v, n);
    long long r = -12345;
    for (int i = 0; i < n; i++)
        if (!strcmp(memshim_torch_stat_name(i), name)) r = v[i];
    free(v);
    return r;
}

static long handles(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.handles;
}

static bool overlaps(uintptr_t a, size_t as, uintptr_t b, size_t bs)
{
    return a < b + bs && b < a + as;
}

TEST(capture_pool_memory_stays_in_its_pool)
{
    memshim_torch_begin_allocate_to_pool(0, 7, 0, NULL);
    void *a = memshim_torch_alloc_in_pool(4 * MiB, 0, S_CAPTURING, 7, 0);
    void *b = memshim_torch_alloc_in_pool(1000, 0, S_CAPTURING, 7, 0);
    REQUIRE(a && b);
    memshim_torch_end_allocate_to_pool(0, 7, 0);
    memshim_torch_free(a, 4 * MiB, 0, S_CAPTURING); /* freed, but the graph may replay into it */
    /* Outside the pool: never a byte of a. And with the pool alive but no capture open (a job that
     * replays its graph), an allocation asks the driver nothing: no capture-mode exchange (issue
     * 24: two per allocation while any capture pool existed). */
    long x0 = cudbl_call_count("cuThreadExchangeStreamCaptureMode");
    void *m[8];
    for (int i = 0; i < 8; i++) {
        m[i] = memshim_torch_alloc(4 * MiB, 0, S_OTHER);
        REQUIRE(m[i]);
        CHECKF(!overlaps((uintptr_t)m[i], 4 * MiB, (uintptr_t)a, 4 * MiB), "main alloc %p reuses capture block %p",
               m[i], a);
    }
    CHECKF(cudbl_call_count("cuThreadExchangeStreamCaptureMode") == x0, "%ld capture-mode exchanges for 8 allocations "
           "with a capture pool alive and no capture open", cudbl_call_count("cuThreadExchangeStreamCaptureMode") - x0);
    /* Inside the pool (the next capture into it): reused. */
    memshim_torch_begin_allocate_to_pool(0, 7, 0, NULL);
    void *a2 = memshim_torch_alloc_in_pool(4 * MiB, 0, S_CAPTURING, 7, 0);
    CHECK(a2 == a);
    memshim_torch_end_allocate_to_pool(0, 7, 0);
    for (int i = 0; i < 8; i++) memshim_torch_free(m[i], 4 * MiB, 0, S_OTHER);
    memshim_empty_cache();
    long before_release = handles();
    /* Two graphs were captured into pool 7 (two begins): PyTorch's use count is 2, and one release
     * (one graph destroyed) leaves the other graph's memory where it replays. */
    CHECK(memshim_torch_pool_uses(0, 7, 0) == 2);
    memshim_torch_release_pool(0, 7, 0);
    CHECK(memshim_torch_pool_uses(0, 7, 0) == 1);
    CHECK(handles() == before_release);
    void *m2 = memshim_torch_alloc(4 * MiB, 0, S_OTHER);
    CHECK(m2 && !overlaps((uintptr_t)m2, 4 * MiB, (uintptr_t)a2, 4 * MiB));
    memshim_torch_free(m2, 4 * MiB, 0, S_OTHER);
    memshim_torch_free(a2, 4 * MiB, 0, S_CAPTURING);
    memshim_torch_free(b, 1000, 0, S_CAPTURING); /* every block freed, one use left: the pool stays */
    memshim_empty_cache();
    CHECKF(handles() == before_release, "handles %ld, before the release %ld", handles(), before_release);
    memshim_torch_release_pool(0, 7, 0); /* the last use: the pool goes, pages and all */
    memshim_empty_cache();
    CHECKF(handles() < before_release, "handles %ld, before the release %ld", handles(), before_release);
    CHECK(memshim_torch_pool_uses(0, 7, 0) == 0);
}

/* Inside a capture pool a freed block is reused only on its own stream: reuse on another one
 * would need an event recorded outside the capture and waited on inside it, which the driver
 * refuses while capturing (PyTorch's private pools match streams the same way). */
TEST(capture_pool_reuse_stays_on_its_stream)
{
    memshim_torch_begin_allocate_to_pool(0, 12, 0, NULL);
    void *a = memshim_torch_alloc_in_pool(2 * MiB, 0, S_CAPTURING, 12, 0);
    REQUIRE(a);
    memshim_torch_free(a, 2 * MiB, 0, S_CAPTURING);
    void *b = memshim_torch_alloc_in_pool(2 * MiB, 0, S_OTHER, 12, 0);
    REQUIRE(b);
    CHECK(!overlaps((uintptr_t)a, 2 * MiB, (uintptr_t)b, 2 * MiB));
    void *a2 = memshim_torch_alloc_in_pool(2 * MiB, 0, S_CAPTURING, 12, 0);
    CHECK(a2 == a);
    memshim_torch_end_allocate_to_pool(0, 12, 0);
    memshim_torch_free(b, 2 * MiB, 0, S_OTHER);
    memshim_torch_free(a2, 2 * MiB, 0, S_CAPTURING);
    long h = handles();
    memshim_torch_release_pool(0, 12, 0); /* both streams' pools go */
    CHECK(handles() <= h - 2);
}

TEST(capture_pool_pages_are_never_remapped_or_released)
{
    memshim_torch_begin_allocate_to_pool(0, 8, 0, NULL);
    void *a = memshim_torch_alloc_in_pool(8 * MiB, 0, S_CAPTURING, 8, 0);
    REQUIRE(a);
    memshim_torch_free(a, 8 * MiB, 0, S_CAPTURING);
    memshim_torch_end_allocate_to_pool(0, 8, 0);
    long h = handles();
    memshim_empty_cache(); /* torch.cuda.empty_cache(): only the main pool's cached pages */
    CHECK(handles() == h);
    /* Writing through the freed block still works: its pages are mapped. */
    memset(a, 0x5a, 8 * MiB);
    memshim_torch_release_pool(0, 8, 0); /* no live block: destroyed now */
    CHECK(handles() < h);
}

TEST(backstop_takes_allocations_on_a_capturing_stream)
{
    msh_torch_set_capture_query(fake_capturing);
    /* no pool begun: the capture-only backstop pool */
    void *c = memshim_torch_alloc(2 * MiB, 0, S_CAPTURING);
    REQUIRE(c);
    memshim_torch_free(c, 2 * MiB, 0, S_CAPTURING);
    void *m = memshim_torch_alloc(2 * MiB, 0, S_OTHER);
    CHECK(m && !overlaps((uintptr_t)m, 2 * MiB, (uintptr_t)c, 2 * MiB));
    void *c2 = memshim_torch_alloc(2 * MiB, 0, S_CAPTURING);
    CHECK(c2 == c); /* reused only by another capturing allocation */
    memshim_torch_free(c2, 2 * MiB, 0, S_CAPTURING);
    /* a begun pool wins over the backstop */
    memshim_torch_begin_allocate_to_pool(0, 9, 1, NULL);
    void *p = memshim_torch_alloc(2 * MiB, 0, S_CAPTURING);
    REQUIRE(p);
    CHECK(p != c);
    memshim_torch_end_allocate_to_pool(0, 9, 1);
    memshim_torch_free(p, 2 * MiB, 0, S_CAPTURING);
    memshim_torch_release_pool(0, 9, 1);
    memshim_torch_free(m, 2 * MiB, 0, S_OTHER);
    msh_torch_set_capture_query(NULL);
}

/* With a driver (double) that captures streams: the default query (cuStreamIsCapturing) sends an
 * allocation on a capturing stream to a capture pool, and nothing memshim does during the capture
 * invalidates it. Skipped where the double has no stream capture yet. */
TEST(real_capture_goes_to_a_capture_pool)
{
    CUresult (*begin)(CUstream, CUstreamCaptureMode);
    CUresult (*end)(CUstream, CUgraph *);
    CUresult (*create)(CUstream *, unsigned int);
    CUresult (*destroy)(CUstream);
    CUresult (*graph_destroy)(CUgraph);
    *(void **)&begin = dlsym(RTLD_DEFAULT, "cuStreamBeginCapture_v2");
    *(void **)&end = dlsym(RTLD_DEFAULT, "cuStreamEndCapture");
    *(void **)&create = dlsym(RTLD_DEFAULT, "cuStreamCreate");
    *(void **)&destroy = dlsym(RTLD_DEFAULT, "cuStreamDestroy_v2");
    *(void **)&graph_destroy = dlsym(RTLD_DEFAULT, "cuGraphDestroy");
    if (!begin || !end || !create || !destroy || !dlsym(RTLD_DEFAULT, "cuStreamIsCapturing"))
        SKIP("the driver double has no stream capture yet");
    msh_torch_set_capture_query(NULL);
    CUdevice dev;
    CUcontext ctx;
    REQUIRE(cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    REQUIRE(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
    CUstream s;
    REQUIRE(create(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    /* issue 24: with no capture open anywhere, an allocation on a side stream asks the driver
     * nothing (it called cuStreamIsCapturing every time) */
    long q0 = cudbl_call_count("cuStreamIsCapturing");
    void *m = memshim_torch_alloc(2 * MiB, 0, s); /* not capturing: the main pool */
    REQUIRE(m);
    memshim_torch_free(m, 2 * MiB, 0, s);
    for (int i = 0; i < 100; i++) memshim_torch_free(memshim_torch_alloc(2 * MiB, 0, s), 2 * MiB, 0, s);
    CHECKF(cudbl_call_count("cuStreamIsCapturing") == q0, "%ld cuStreamIsCapturing for 101 side-stream allocations "
           "with no capture open", cudbl_call_count("cuStreamIsCapturing") - q0);
    /* under LD_PRELOAD memshim's cuStreamBeginCapture hook opens the window (hooks/driver.c; this
     * binary has the core without the hooks, so the test opens it as the hook does):
     * tests/preload/capture_reuse.c runs the same through the hooks */
    msh_capture_open(0, MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)s);
    REQUIRE(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
    void *c = memshim_torch_alloc(2 * MiB, 0, s);
    CUgraph g = NULL;
    CUresult er = end(s, &g);
    msh_capture_close(MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)s);
    CHECKF(er == CUDA_SUCCESS && g, "the capture was invalidated (%d)", (int)er);
    REQUIRE(c);
    CHECK(!overlaps((uintptr_t)c, 2 * MiB, (uintptr_t)m, 2 * MiB)); /* not the main pool's freed block */
    memshim_torch_free(c, 2 * MiB, 0, s);
    void *m2 = memshim_torch_alloc(2 * MiB, 0, s);
    CHECK(m2 && !overlaps((uintptr_t)m2, 2 * MiB, (uintptr_t)c, 2 * MiB));
    memshim_torch_free(m2, 2 * MiB, 0, s);
    if (g && graph_destroy) graph_destroy(g);
    /* s stays: freed blocks still name it, and this test calls the double directly, not through
     * memshim's cuStreamDestroy hook that would tell the pools. */
    (void)destroy;
}

/* ---- issue 15: capture pools as PyTorch drives them, on the double's stream capture -------------- */

struct capdrv {
    CUresult (*begin)(CUstream, CUstreamCaptureMode);
    CUresult (*end)(CUstream, CUgraph *);
    CUresult (*instantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*launch)(CUgraphExec, CUstream);
    CUresult (*exec_destroy)(CUgraphExec);
    CUresult (*graph_destroy)(CUgraph);
    CUstream s, s2;
    bool ok;
};

static void noop_kernel(void *arg) { (void)arg; }

static bool capdrv_up(struct capdrv *c)
{
    memset(c, 0, sizeof *c);
    *(void **)&c->begin = dlsym(RTLD_DEFAULT, "cuStreamBeginCapture_v2");
    *(void **)&c->end = dlsym(RTLD_DEFAULT, "cuStreamEndCapture");
    *(void **)&c->instantiate = dlsym(RTLD_DEFAULT, "cuGraphInstantiateWithFlags");
    *(void **)&c->launch = dlsym(RTLD_DEFAULT, "cuGraphLaunch");
    *(void **)&c->exec_destroy = dlsym(RTLD_DEFAULT, "cuGraphExecDestroy");
    *(void **)&c->graph_destroy = dlsym(RTLD_DEFAULT, "cuGraphDestroy");
    if (!c->begin || !c->end || !c->instantiate || !c->launch || !c->exec_destroy || !c->graph_destroy) return false;
    msh_torch_set_capture_query(NULL);
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS) return false;
    if (cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return false;
    if (cuStreamCreate(&c->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return false;
    if (cuStreamCreate(&c->s2, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return false;
    c->ok = true;
    return true;
}

/* The stream capture's begin and end as memshim's hooks make them (hooks/driver.c): the capture is
 * counted open before the driver's begin, closed once its end returns. This binary has the core
 * without the hooks (tests/preload/capture_routes.c runs every route through them). */
static CUresult hooked_begin(struct capdrv *c, CUstream s)
{
    msh_capture_open(0, MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)s);
    CUresult r = c->begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (r != CUDA_SUCCESS) msh_capture_close(MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)s);
    return r;
}

static CUresult hooked_end(struct capdrv *c, CUstream s, CUgraph *g)
{
    CUresult r = c->end(s, g);
    msh_capture_close(MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)s);
    return r;
}

/* One graph captured into pool (id0, 0) as torch.cuda.graph does it: begin_allocate_to_pool, then
 * the stream capture; a block allocated on the capturing stream (routed to the pool) and a
 * captured kernel that writes it; the end of the capture, then end_allocate_to_pool. */
static CUgraph capture_one(struct capdrv *c, unsigned long long id0, size_t size, void **out)
{
    memshim_torch_begin_allocate_to_pool(0, id0, 0, NULL);
    CUgraph g = NULL;
    *out = NULL;
    if (hooked_begin(c, c->s) == CUDA_SUCCESS) {
        *out = memshim_torch_alloc((ssize_t)size, 0, c->s);
        if (*out) cudbl_launch(c->s, (CUdeviceptr)(uintptr_t)*out, size, 1, noop_kernel, NULL);
        if (hooked_end(c, c->s, &g) != CUDA_SUCCESS) g = NULL;
    }
    memshim_torch_end_allocate_to_pool(0, id0, 0);
    return g;
}

static long misuse_now(void)
{
    struct cudbl_counts k;
    cudbl_get_counts(&k);
    return k.misuse;
}

/* Item 1: two graphs share pool 21 (torch.cuda.graph(g2, pool=g1.pool())); destroying the first
 * (one release) must leave the second one's memory mapped, even once both outputs are freed:
 * the second graph replays into it. */
TEST(a_shared_capture_pool_outlives_its_first_release)
{
    struct capdrv c;
    if (!capdrv_up(&c)) SKIP("the driver double has no stream capture");
    cudbl_set_misuse_abort(0);
    long mis0 = misuse_now();
    void *a, *b;
    CUgraph g1 = capture_one(&c, 21, 2 * MiB, &a);
    CUgraph g2 = capture_one(&c, 21, 2 * MiB, &b);
    REQUIRE(g1 && g2 && a && b);
    CHECK(memshim_torch_pool_uses(0, 21, 0) == 2);
    memshim_torch_free(a, 2 * MiB, 0, c.s); /* the outputs go out of scope ... */
    memshim_torch_free(b, 2 * MiB, 0, c.s);
    c.graph_destroy(g1);
    memshim_torch_release_pool(0, 21, 0); /* ... and g1 is destroyed */
    memshim_empty_cache();
    CUgraphExec x = NULL;
    REQUIRE(c.instantiate(&x, g2, 0) == CUDA_SUCCESS);
    CHECK(c.launch(x, c.s2) == CUDA_SUCCESS);
    cuStreamSynchronize(c.s2);
    CHECKF(misuse_now() == mis0, "g2's replay touched memory that is gone (%ld faults)", misuse_now() - mis0);
    CHECK(cudbl_check_access(0, (CUdeviceptr)(uintptr_t)b, 2 * MiB, 1) == CUDA_SUCCESS);
    void *m = memshim_torch_alloc(2 * MiB, 0, c.s2); /* never on g2's memory */
    CHECK(m && !overlaps((uintptr_t)m, 2 * MiB, (uintptr_t)b, 2 * MiB));
    memshim_torch_free(m, 2 * MiB, 0, c.s2);
    /* a later capture with the live id joins the pool: it reuses the freed memory */
    void *b2;
    CUgraph g3 = capture_one(&c, 21, 2 * MiB, &b2);
    CHECK(g3 && b2 && (b2 == a || b2 == b));
    CHECK(memshim_torch_pool_uses(0, 21, 0) == 2);
    memshim_torch_free(b2, 2 * MiB, 0, c.s);
    long h = handles();
    c.exec_destroy(x);
    c.graph_destroy(g2);
    c.graph_destroy(g3);
    memshim_torch_release_pool(0, 21, 0);
    memshim_torch_release_pool(0, 21, 0); /* the last use: the pool goes */
    CHECK(memshim_torch_pool_uses(0, 21, 0) == 0);
    CHECKF(handles() < h, "handles %ld, before the last release %ld", handles(), h);
    cudbl_set_misuse_abort(1);
}

/* Item 2: the re-capture loop (g = CUDAGraph(); with torch.cuda.graph(g): out = model(x)) drops the
 * old graph's output inside the next capture. Freeing the last block of the released pool must not
 * synchronize or unmap there (the driver invalidates the capture: cuStreamEndCapture 901); the
 * pool goes once the capture has ended. */
TEST(freeing_a_released_pool_inside_the_next_capture_keeps_it_valid)
{
    struct capdrv c;
    if (!capdrv_up(&c)) SKIP("the driver double has no stream capture");
    void *out1, *out2 = NULL;
    CUgraph g1 = capture_one(&c, 31, 4 * MiB, &out1);
    REQUIRE(g1 && out1);
    c.graph_destroy(g1);
    memshim_torch_release_pool(0, 31, 0); /* g rebound: the old graph is gone, out1 still held */
    uint64_t destroyed0 = 0, deferred0 = 0;
    msh_torch_capture_counts(&destroyed0, &deferred0, NULL);
    long h0 = handles();
    memshim_torch_begin_allocate_to_pool(0, 32, 0, NULL);
    REQUIRE(hooked_begin(&c, c.s) == CUDA_SUCCESS);
    memshim_torch_free(out1, 4 * MiB, 0, c.s); /* `out = ...` drops the old output, mid-capture */
    out2 = memshim_torch_alloc(4 * MiB, 0, c.s);
    CHECK(out2 != NULL);
    if (out2) cudbl_launch(c.s, (CUdeviceptr)(uintptr_t)out2, 4 * MiB, 1, noop_kernel, NULL);
    uint64_t destroyed1 = 0, deferred1 = 0;
    msh_torch_capture_counts(&destroyed1, &deferred1, NULL);
    CHECK(destroyed1 == destroyed0 && deferred1 == deferred0 + 1);
    CHECK(handles() >= h0); /* nothing of pool 31 was given back during the capture */
    CUgraph g2 = NULL;
    CUresult er = hooked_end(&c, c.s, &g2); /* the capture is over: pool 31 goes now */
    CHECKF(er == CUDA_SUCCESS && g2, "the capture was invalidated (%d)", (int)er);
    msh_torch_capture_counts(&destroyed1, &deferred1, NULL);
    CHECK(destroyed1 == destroyed0 + 1);
    memshim_torch_end_allocate_to_pool(0, 32, 0);
    memshim_torch_free(out2, 4 * MiB, 0, c.s);
    if (g2) c.graph_destroy(g2);
    memshim_torch_release_pool(0, 32, 0);
}

/* Item 2, the main pool: an empty_cache() (the reset hook) during a capture, and a free that needs
 * events (a block used on a second stream), neither synchronize, unmap nor record during the
 * capture; both happen after it. */
TEST(the_main_pool_defers_its_driver_work_during_a_capture)
{
    struct capdrv c;
    if (!capdrv_up(&c)) SKIP("the driver double has no stream capture");
    void *m = memshim_torch_alloc(8 * MiB, 0, c.s2);
    void *r = memshim_torch_alloc(2 * MiB, 0, c.s2);
    REQUIRE(m && r);
    memshim_torch_record_stream(r, c.s); /* used on the capture stream before the capture */
    memshim_torch_free(m, 8 * MiB, 0, c.s2); /* cached */
    cuCtxSynchronize();
    long unmaps0 = cudbl_call_count("cuMemUnmap"), syncs0 = cudbl_call_count("cuCtxSynchronize");
    long rec0 = cudbl_call_count("cuEventRecord");
    memshim_torch_begin_allocate_to_pool(0, 41, 0, NULL);
    REQUIRE(hooked_begin(&c, c.s) == CUDA_SUCCESS);
    memshim_empty_cache();
    memshim_torch_free(r, 2 * MiB, 0, c.s2); /* its free needs an event on c.s: parked */
    CHECK(cudbl_call_count("cuMemUnmap") == unmaps0 && cudbl_call_count("cuCtxSynchronize") == syncs0);
    CHECK(cudbl_call_count("cuEventRecord") == rec0);
    CUgraph g = NULL;
    CUresult er = hooked_end(&c, c.s, &g);
    CHECKF(er == CUDA_SUCCESS && g, "the capture was invalidated (%d)", (int)er);
    memshim_torch_end_allocate_to_pool(0, 41, 0);
    CHECK(cudbl_call_count("cuMemUnmap") > unmaps0);     /* the deferred empty-cache ran */
    CHECK(cudbl_call_count("cuEventRecord") == rec0 + 1); /* the parked free's event, now */
    if (g) c.graph_destroy(g);
    memshim_torch_release_pool(0, 41, 0);
}

/* Item 4: with capture pools alive, frees of main-pool memory never take the capture pools' lock. */
TEST(main_pool_frees_do_not_contend_with_capture_pools)
{
    memshim_torch_begin_allocate_to_pool(0, 51, 0, NULL);
    void *c = memshim_torch_alloc_in_pool(MiB, 0, S_CAPTURING, 51, 0);
    memshim_torch_end_allocate_to_pool(0, 51, 0);
    REQUIRE(c);
    uint64_t takes0 = msh_torch_capture_lock_takes();
    for (int i = 0; i < 1000; i++) {
        void *m = memshim_torch_alloc(64 * 1024, 0, S_OTHER);
        REQUIRE(m);
        memshim_torch_free(m, 64 * 1024, 0, S_OTHER);
    }
    uint64_t takes = msh_torch_capture_lock_takes() - takes0;
    CHECKF(takes == 0, "1000 main-pool frees took the capture pools' lock %llu times", (unsigned long long)takes);
    memshim_torch_free(c, MiB, 0, S_CAPTURING);
    memshim_torch_release_pool(0, 51, 0);
}

TEST(torch_named_stats_peaks_and_resets)
{
    memshim_torch_reset_accumulated(0);
    memshim_torch_reset_peak(0);
    long long base = stat_of(0, "allocated_bytes.all.current");
    void *a = memshim_torch_alloc(3 * MiB, 0, NULL);
    void *b = memshim_torch_alloc(100, 0, NULL); /* small pool; 512-byte blocks */
    REQUIRE(a && b);
    CHECK(stat_of(0, "allocated_bytes.all.current") == base + 3 * (long long)MiB + 512);
    CHECK(stat_of(0, "requested_bytes.all.current") - stat_of(0, "requested_bytes.all.freed") >= 0);
    CHECK(stat_of(0, "allocated_bytes.small_pool.allocated") == 512);
    CHECK(stat_of(0, "allocated_bytes.large_pool.allocated") == 3 * (long long)MiB);
    CHECK(stat_of(0, "allocation.all.allocated") == 2);
    CHECK(stat_of(0, "reserved_bytes.all.current") >= 4 * (long long)MiB);
    CHECK(stat_of(0, "max_split_size") == -1);
    memshim_torch_free(a, 3 * MiB, 0, NULL);
    CHECK(stat_of(0, "allocated_bytes.all.current") == base + 512);
    CHECK(stat_of(0, "allocated_bytes.all.peak") == base + 3 * (long long)MiB + 512);
    CHECK(stat_of(0, "allocated_bytes.all.freed") == 3 * (long long)MiB);
    memshim_torch_reset_peak(0);
    CHECK(stat_of(0, "allocated_bytes.all.peak") == base + 512);
    memshim_torch_reset_accumulated(0);
    CHECK(stat_of(0, "allocated_bytes.all.allocated") == 0 && stat_of(0, "allocated_bytes.all.freed") == 0);
    CHECK(stat_of(0, "allocated_bytes.all.current") == base + 512);
    memshim_torch_free(b, 100, 0, NULL);
    CHECK(memshim_torch_stat_name(memshim_torch_stats(0, NULL, 0)) == NULL);
}

TEST(one_limit_for_the_main_and_capture_pools)
{
    /* capacity 1 GiB, fraction 0.25: 256 MiB for every pool of device 0 together */
    memshim_torch_set_memory_fraction(0.25, 0);
    CHECK(memshim_torch_get_memory_fraction(0) == 0.25);
    CHECK(msh_torch_limit(0) == 256 * MiB);
    void *m = memshim_torch_alloc(160 * MiB, 0, NULL);
    REQUIRE(m);
    memshim_torch_begin_allocate_to_pool(0, 11, 0, NULL);
    msh_capture_open(0, MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)S_CAPTURING); /* as the begin hook does */
    void *c = memshim_torch_alloc_in_pool(160 * MiB, 0, S_CAPTURING, 11, 0);
    CHECK(c == NULL); /* 320 MiB together: over the shared limit */
    char msg[1024];
    memshim_torch_oom_message(0, 160 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "CUDA out of memory. Tried to allocate 160.00 MiB") == msg && strstr(msg, "capture pool") &&
               strstr(msg, "limit 256.00 MiB"),
           "%s", msg);
    CHECK(stat_of(0, "num_ooms") >= 1);
    /* Freed, m's pages stay cached in the main pool. While the capture is open they cannot be
     * released (an unmap, or the synchronize before it, would invalidate the capture): the
     * request fails and says why. */
    memshim_torch_free(m, 160 * MiB, 0, NULL);
    c = memshim_torch_alloc_in_pool(160 * MiB, 0, S_CAPTURING, 11, 0);
    CHECK(c == NULL);
    memshim_torch_oom_message(0, 160 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "capture was in progress"), "%s", msg);
    msh_capture_close(MSH_CAPTURE_STREAM, (uint64_t)(uintptr_t)S_CAPTURING);
    memshim_torch_end_allocate_to_pool(0, 11, 0);
    /* The next capture into the pool gets them: the main pool's cache goes back outside captures */
    memshim_empty_cache();
    memshim_torch_begin_allocate_to_pool(0, 11, 0, NULL);
    c = memshim_torch_alloc_in_pool(160 * MiB, 0, S_CAPTURING, 11, 0);
    CHECK(c != NULL);
    memshim_torch_end_allocate_to_pool(0, 11, 0);
    memshim_torch_release_pool(0, 11, 0); /* two begins, two uses */
    memshim_torch_free(c, 160 * MiB, 0, S_CAPTURING);
    memshim_torch_release_pool(0, 11, 0);
    memshim_torch_set_memory_fraction(1.0, 0);
    CHECK(msh_torch_limit(0) == 0); /* the whole device: no limit (issue 31) */
    memshim_torch_set_memory_fraction(1.5, 0); /* refused: the limit is unchanged */
    CHECK(msh_torch_limit(0) == 0);
    memshim_torch_set_memory_fraction(0.5, 0);
    CHECK(msh_torch_limit(0) == 512 * MiB);
    memshim_torch_set_memory_fraction(1.0, 0);
}

/* ---- issue 31 item 2: the OOM rescue sees every pool of the device ------------------------------ */

#define DEAD_GRAPH_BYTES (200 * MiB)
static void *dead_graph_out;   /* a dropped graph's output, still referenced from a cycle */
static int dead_graph_gcs;

/* What gc.collect() does for a graph dropped in a reference cycle: the output tensor goes, and
 * the CUDAGraph's destructor releases its pool. */
static size_t collect_dead_graph(void *arg)
{
    (void)arg;
    dead_graph_gcs++;
    if (!dead_graph_out) return 0;
    memshim_torch_free(dead_graph_out, DEAD_GRAPH_BYTES, 0, S_CAPTURING);
    dead_graph_out = NULL;
    memshim_torch_release_pool(0, 61, 0);
    return 1;
}

/* Under one limit for the device (256 MiB), a dead graph's capture pool holds 200 MiB that only
 * a collection gives back; the main pool holds 8 MiB (or nothing) and asks for 160 MiB. The gc
 * step must run: what it can free is the capture pool's, not the main pool's (the gate counted the
 * requesting pool's room only: 8 + 48 MiB, so it skipped the collection, failed the request and
 * said freeing every tensor would not make room; with nothing live in the main pool it did not
 * even look). */
static void dead_graph_case(size_t small_bytes)
{
    memshim_torch_set_memory_fraction(0.25, 0);
    REQUIRE(msh_torch_limit(0) == 256 * MiB);
    void *small = small_bytes ? memshim_torch_alloc((ssize_t)small_bytes, 0, NULL) : NULL;
    REQUIRE(small || !small_bytes);
    memshim_torch_begin_allocate_to_pool(0, 61, 0, NULL);
    dead_graph_out = memshim_torch_alloc_in_pool(DEAD_GRAPH_BYTES, 0, S_CAPTURING, 61, 0);
    memshim_torch_end_allocate_to_pool(0, 61, 0);
    REQUIRE(dead_graph_out);
    dead_graph_gcs = 0;
    memshim_set_gc_callback(collect_dead_graph, NULL);
    void *m = memshim_torch_alloc(160 * MiB, 0, NULL);
    char msg[2048] = "";
    if (!m) memshim_torch_oom_message(0, 160 * MiB, msg, sizeof msg);
    printf("    160 MiB beside a dead graph's 200 MiB capture pool, %zu MiB live in the main pool: %s, %d "
           "collection(s)\n", small_bytes / MiB, m ? "served" : "refused", dead_graph_gcs);
    CHECKF(m != NULL, "the request failed: %s", msg);
    CHECK(dead_graph_gcs == 1);
    CHECK(memshim_torch_pool_uses(0, 61, 0) == 0 && dead_graph_out == NULL);
    CHECKF(!strstr(msg, "freeing every tensor would not make room"), "%s", msg);
    memshim_set_gc_callback(NULL, NULL);
    if (m) memshim_torch_free(m, 160 * MiB, 0, NULL);
    if (small) memshim_torch_free(small, (ssize_t)small_bytes, 0, NULL);
    if (dead_graph_out) collect_dead_graph(NULL);
    memshim_empty_cache();
    memshim_torch_set_memory_fraction(1.0, 0);
}

TEST(gc_frees_a_dead_graphs_capture_pool_for_the_main_pool)
{
    dead_graph_case(8 * MiB);
    dead_graph_case(0);
}

/* The empty-cache decision for a capture pool's request: the main pool's cache goes back to the
 * driver when it covers what the request lacks under the shared limit, and stays when it cannot
 * (before, any failed capture-pool request emptied it, helping or not). */
TEST(the_main_pools_cache_goes_back_for_a_capture_pool_only_when_it_makes_room)
{
    memshim_torch_set_memory_fraction(0.25, 0); /* 256 MiB for the device's pools together */
    void *keep = memshim_torch_alloc(96 * MiB, 0, NULL);
    void *gone = memshim_torch_alloc(64 * MiB, 0, NULL);
    REQUIRE(keep && gone);
    memshim_torch_free(gone, 64 * MiB, 0, NULL); /* 64 MiB cached in the main pool, 96 MiB of room */
    memshim_torch_begin_allocate_to_pool(0, 71, 0, NULL);
    long h0 = handles();
    void *c1 = memshim_torch_alloc_in_pool(200 * MiB, 0, S_CAPTURING, 71, 0); /* lacks 104 MiB > 64 */
    long h1 = handles();
    printf("    200 MiB in a capture pool: %s; main pool's handles %ld -> %ld\n", c1 ? "served" : "refused", h0, h1);
    CHECK(c1 == NULL);
    CHECKF(h1 == h0, "the main pool's cache went back though it could not make room (%ld -> %ld handles)", h0, h1);
    void *c2 = memshim_torch_alloc_in_pool(150 * MiB, 0, S_CAPTURING, 71, 0); /* lacks 54 MiB <= 64 */
    CHECKF(c2 != NULL, "the main pool's cache would have made room");
    memshim_torch_end_allocate_to_pool(0, 71, 0);
    if (c2) memshim_torch_free(c2, 150 * MiB, 0, S_CAPTURING);
    memshim_torch_release_pool(0, 71, 0);
    memshim_torch_free(keep, 96 * MiB, 0, NULL);
    memshim_empty_cache();
    memshim_torch_set_memory_fraction(1.0, 0);
}

/* Issue 31: a request refused under a limit is not one "no memory could ever hold": the message
 * names the limit, what set it, and the knob that raises it; the device's own case keeps saying
 * that nothing on this GPU could hold it. */
TEST(oom_message_names_the_limit_and_what_set_it)
{
    memshim_torch_set_memory_fraction(0.25, 0); /* 256 MiB of the 1 GiB device */
    char msg[2048];
    CHECK(memshim_torch_alloc(300 * MiB, 0, NULL) == NULL); /* larger than the limit alone */
    memshim_torch_oom_message(0, 300 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "larger than the limit (256.00 MiB) set by set_per_process_memory_fraction(0.25)") &&
               strstr(msg, "before any driver work") && strstr(msg, "raise the memory fraction") &&
               !strstr(msg, "could ever hold") && !strstr(msg, "MEMSHIM_LIMIT"),
           "%s", msg);
    void *m = memshim_torch_alloc(200 * MiB, 0, NULL);
    REQUIRE(m);
    CHECK(memshim_torch_alloc(100 * MiB, 0, NULL) == NULL); /* fits the limit, not what is left of it */
    memshim_torch_oom_message(0, 100 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "does not fit now") && strstr(msg, "limit 256.00 MiB (set by set_per_process_memory_fraction(0.25))"),
           "%s", msg);
    memshim_torch_free(m, 200 * MiB, 0, NULL);
    memshim_torch_set_memory_fraction(1.0, 0);
    CHECK(memshim_torch_alloc(2048 * MiB, 0, NULL) == NULL); /* larger than the device */
    memshim_torch_oom_message(0, 2048 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "larger than the device (1.00 GiB): no memory on this GPU could ever hold it") &&
               !strstr(msg, "set by"),
           "%s", msg);
}

TEST(base_allocation_of_an_interior_pointer)
{
    void *a = memshim_torch_alloc(6 * MiB, 0, NULL);
    REQUIRE(a);
    size_t sz = 0;
    CHECK(memshim_torch_base_alloc(a, &sz) == a && sz == 6 * MiB);
    sz = 0;
    CHECK(memshim_torch_base_alloc((char *)a + 12345, &sz) == a && sz == 6 * MiB);
    int x;
    sz = 77;
    CHECK(memshim_torch_base_alloc(&x, &sz) == &x && sz == 77);
    memshim_torch_free(a, 6 * MiB, 0, NULL);
}

TEST(epoch_reasons_are_checked)
{
    CHECK(memshim_epoch_from("no such reason") == EINVAL);
    CHECK(memshim_epoch_from(NULL) == EINVAL);
    CHECK(memshim_epoch_from("dataloader") == 0);
    CHECK(memshim_torch_setting("started") == 1);
    CHECK(memshim_torch_setting("nonsense") == -1);
}

int main(int argc, char **argv)
{
    setenv("CUDBL_CAPACITY", "1G", 1);
    unsetenv("MEMSHIM_LIMIT");
    setenv("MEMSHIM_LOG", "error", 1);
    return th_main(__FILE__, argc, argv);
}
