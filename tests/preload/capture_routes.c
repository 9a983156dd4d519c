/*
 * capture_routes.c: every route by which a program can begin a CUDA-graph capture is seen by
 * memshim before the next allocation on the capturing stream (issue 31 item 1), under LD_PRELOAD
 * on the driver double. Per route: a block the main pool just took back on stream S, then a
 * capture begun on S through that route, then an allocation on S as PyTorch's glue makes it
 * (memshim_torch_alloc): it must come from a capture pool, never the main pool's freed block (a
 * graph replays into every address its capture touched, and eager code would reuse that block);
 * the capture must stay valid; the end, through the same route, must close it (side-stream
 * allocations then ask the driver nothing again). The routes: the runtime's begin (plain, _ptsz,
 * ToGraph, ToGraph_ptsz), the driver's symbols (_v2, _v2_ptsz, CUDA 10.0's unversioned and _ptsz,
 * ToGraph, ToGraph_ptsz), memshim's cuGetProcAddress at every ABI (legacy and per-thread),
 * cudaGetDriverEntryPoint[ByVersion], and dlsym on the program's own handle to libcuda.so.1
 * (directly, and through the cuGetProcAddress_v2 it returns, chained). Also: a use_mem_pool-style
 * window (begin_allocate_to_pool with nothing captured) is no capture, and memshim's dlsym keeps
 * RTLD_NEXT meaning "after the caller" and hands out only capture functions of its own.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

/* The ABIs a program built against an older or per-thread cuda.h references by symbol. */
#undef cuStreamBeginCapture
CUresult CUDAAPI cuStreamBeginCapture(CUstream hStream);
CUresult CUDAAPI cuStreamBeginCapture_ptsz(CUstream hStream);
CUresult CUDAAPI cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode);
CUresult CUDAAPI cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode *deps,
                                                  const CUgraphEdgeData *data, size_t ndeps, CUstreamCaptureMode mode);
CUresult CUDAAPI cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);
cudaError_t CUDARTAPI cudaStreamBeginCapture_ptsz(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t CUDARTAPI cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t stream, cudaGraph_t graph,
                                                         const cudaGraphNode_t *dependencies,
                                                         const cudaGraphEdgeData *dependencyData,
                                                         size_t numDependencies, enum cudaStreamCaptureMode mode);
cudaError_t CUDARTAPI cudaStreamEndCapture_ptsz(cudaStream_t stream, cudaGraph_t *pGraph);
typedef CUresult (CUDAAPI *begin_v1_fn)(CUstream);

#define SZ (1u << 20)

static void *(*t_alloc)(ssize_t, int, memshim_stream_t);
static void (*t_free)(void *, ssize_t, int, memshim_stream_t);

static bool api(void)
{
    *(void **)&t_alloc = dlsym(RTLD_DEFAULT, "memshim_torch_alloc");
    *(void **)&t_free = dlsym(RTLD_DEFAULT, "memshim_torch_free");
    return t_alloc && t_free && cudaFree(NULL) == cudaSuccess;
}

static bool overlaps(uintptr_t a, size_t as, uintptr_t b, size_t bs)
{
    return a < b + bs && b < a + as;
}

/* How a route begins and ends: one of the begin forms, and an end. */
enum form { F_V2, F_V1, F_TOGRAPH, F_RT, F_RT_TOGRAPH };
struct route {
    enum form form;
    bool per_thread;       /* NULL stream = the calling thread's default stream */
    void *begin;           /* of the form's type */
    void *end;             /* PFN_cuStreamEndCapture_v10000 or cudaStreamEndCapture's type */
};

static CUresult do_begin(const struct route *r, CUstream s, CUgraph into)
{
    const CUstreamCaptureMode g = CU_STREAM_CAPTURE_MODE_GLOBAL;
    switch (r->form) {
    case F_V2: return ((PFN_cuStreamBeginCapture_v10010)r->begin)(s, g);
    case F_V1: return ((begin_v1_fn)r->begin)(s);
    case F_TOGRAPH: return ((PFN_cuStreamBeginCaptureToGraph_v12030)r->begin)(s, into, NULL, NULL, 0, g);
    case F_RT:
        return ((cudaError_t(*)(cudaStream_t, enum cudaStreamCaptureMode))r->begin)((cudaStream_t)s,
                                                                                   cudaStreamCaptureModeGlobal)
                   ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
    case F_RT_TOGRAPH:
        return ((cudaError_t(*)(cudaStream_t, cudaGraph_t, const cudaGraphNode_t *, const cudaGraphEdgeData *, size_t,
                                enum cudaStreamCaptureMode))r->begin)((cudaStream_t)s, (cudaGraph_t)into, NULL, NULL, 0,
                                                                      cudaStreamCaptureModeGlobal)
                   ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
    }
    return CUDA_ERROR_UNKNOWN;
}

static CUresult do_end(const struct route *r, CUstream s, CUgraph *g)
{
    if (r->form == F_RT || r->form == F_RT_TOGRAPH)
        return ((cudaError_t(*)(cudaStream_t, cudaGraph_t *))r->end)((cudaStream_t)s, (cudaGraph_t *)g)
                   ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
    return ((PFN_cuStreamEndCapture_v10000)r->end)(s, g);
}

/* The check every route gets. */
static void check_route(const char *what, const struct route *r)
{
    REQUIRE(r->begin && r->end);
    cudaStream_t own = NULL;
    if (!r->per_thread) REQUIRE(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) == cudaSuccess);
    /* where PyTorch's glue says the allocation is: the stream itself, or the per-thread stream */
    void *as = r->per_thread ? (void *)cudaStreamPerThread : (void *)own;
    CUgraph into = NULL;
    if (r->form == F_TOGRAPH || r->form == F_RT_TOGRAPH) REQUIRE(cuGraphCreate(&into, 0) == CUDA_SUCCESS);
    void *m = t_alloc(SZ, 0, as);
    REQUIRE(m);
    t_free(m, SZ, 0, as); /* the main pool holds it, free, tagged with this stream */
    CUresult b = do_begin(r, (CUstream)own, into);
    REQUIRE(b == CUDA_SUCCESS);
    void *c = t_alloc(SZ, 0, as);
    CUgraph g = NULL;
    CUresult e = do_end(r, (CUstream)own, &g);
    printf("    %s: allocation during the capture %s; end %d\n", what,
           !c ? "failed" : overlaps((uintptr_t)c, SZ, (uintptr_t)m, SZ) ? "got the main pool's freed block"
                                                                        : "came from a capture pool", (int)e);
    CHECKF(c && !overlaps((uintptr_t)c, SZ, (uintptr_t)m, SZ), "%s: not kept apart from the main pool", what);
    CHECKF(e == CUDA_SUCCESS && g && (!into || g == into), "%s: the capture was not valid (%d)", what, (int)e);
    /* the end was seen too: with no capture open, side-stream allocations ask the driver nothing */
    long q0 = cudbl_call_count("cuStreamIsCapturing");
    for (int i = 0; i < 20; i++) t_free(t_alloc(SZ, 0, as), SZ, 0, as);
    long q = cudbl_call_count("cuStreamIsCapturing") - q0;
    CHECKF(q == 0, "%s: %ld cuStreamIsCapturing after the end (the capture was left open)", what, q);
    if (c) t_free(c, SZ, 0, as);
    if (g) cuGraphDestroy(g);
    else if (into) cuGraphDestroy(into);
    cudaStreamSynchronize(r->per_thread ? cudaStreamPerThread : own);
    if (own) cudaStreamDestroy(own);
}

/* ---- the runtime ------------------------------------------------------------------------------- */

TEST(runtime_begin)
{
    REQUIRE(api());
    check_route("cudaStreamBeginCapture", &(struct route){F_RT, false, (void *)cudaStreamBeginCapture,
                                                          (void *)cudaStreamEndCapture});
}

TEST(runtime_begin_ptsz)
{
    REQUIRE(api());
    check_route("cudaStreamBeginCapture_ptsz", &(struct route){F_RT, true, (void *)cudaStreamBeginCapture_ptsz,
                                                               (void *)cudaStreamEndCapture_ptsz});
}

TEST(runtime_begin_to_graph)
{
    REQUIRE(api());
    check_route("cudaStreamBeginCaptureToGraph",
                &(struct route){F_RT_TOGRAPH, false, (void *)cudaStreamBeginCaptureToGraph, (void *)cudaStreamEndCapture});
}

TEST(runtime_begin_to_graph_ptsz)
{
    REQUIRE(api());
    check_route("cudaStreamBeginCaptureToGraph_ptsz",
                &(struct route){F_RT_TOGRAPH, true, (void *)cudaStreamBeginCaptureToGraph_ptsz,
                                (void *)cudaStreamEndCapture_ptsz});
}

/* ---- the driver's symbols (what the dynamic linker binds a program's references to) ------------- */

TEST(driver_symbol_v2)
{
    REQUIRE(api());
    check_route("cuStreamBeginCapture_v2", &(struct route){F_V2, false, (void *)cuStreamBeginCapture_v2,
                                                           (void *)cuStreamEndCapture});
}

TEST(driver_symbol_v2_ptsz)
{
    REQUIRE(api());
    check_route("cuStreamBeginCapture_v2_ptsz", &(struct route){F_V2, true, (void *)cuStreamBeginCapture_v2_ptsz,
                                                                (void *)cuStreamEndCapture_ptsz});
}

TEST(driver_symbol_v1)
{
    REQUIRE(api());
    check_route("cuStreamBeginCapture (CUDA 10.0)", &(struct route){F_V1, false, (void *)cuStreamBeginCapture,
                                                                    (void *)cuStreamEndCapture});
}

TEST(driver_symbol_v1_ptsz)
{
    REQUIRE(api());
    check_route("cuStreamBeginCapture_ptsz (CUDA 10.0)",
                &(struct route){F_V1, true, (void *)cuStreamBeginCapture_ptsz, (void *)cuStreamEndCapture_ptsz});
}

TEST(driver_symbol_to_graph)
{
    REQUIRE(api());
    check_route("cuStreamBeginCaptureToGraph", &(struct route){F_TOGRAPH, false, (void *)cuStreamBeginCaptureToGraph,
                                                               (void *)cuStreamEndCapture});
}

TEST(driver_symbol_to_graph_ptsz)
{
    REQUIRE(api());
    check_route("cuStreamBeginCaptureToGraph_ptsz",
                &(struct route){F_TOGRAPH, true, (void *)cuStreamBeginCaptureToGraph_ptsz,
                                (void *)cuStreamEndCapture_ptsz});
}

/* ---- entry-point lookups: memshim's cuGetProcAddress and the runtime's ---------------------------- */

static void *lookup(PFN_cuGetProcAddress_v12000 fn, const char *name, int version, bool per_thread)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    cuuint64_t fl = per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    return fn && fn(name, &p, version, fl, &st) == CUDA_SUCCESS && st == CU_GET_PROC_ADDRESS_SUCCESS ? p : NULL;
}

static void lookup_routes(const char *how, PFN_cuGetProcAddress_v12000 fn)
{
    char what[160];
    static const struct { const char *name; int version; enum form form; } q[] = {
        {"cuStreamBeginCapture", 12000, F_V2},
        {"cuStreamBeginCapture", 10000, F_V1},
        {"cuStreamBeginCaptureToGraph", 12030, F_TOGRAPH},
    };
    for (int pt = 0; pt < 2; pt++)
        for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
            snprintf(what, sizeof what, "%s(\"%s\", %d%s)", how, q[i].name, q[i].version, pt ? ", per-thread" : "");
            struct route r = {q[i].form, pt, lookup(fn, q[i].name, q[i].version, pt),
                              lookup(fn, "cuStreamEndCapture", 12000, pt)};
            CHECKF(r.begin && r.end, "%s: not found", what);
            if (r.begin && r.end) check_route(what, &r);
        }
}

TEST(driver_lookup)
{
    REQUIRE(api());
    lookup_routes("cuGetProcAddress", (PFN_cuGetProcAddress_v12000)cuGetProcAddress_v2);
}

/* cudaGetDriverEntryPoint is deprecated in CUDA 13 (ByVersion replaces it), not gone: programs
 * built against CUDA 12 call it, so it is a route to check. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(runtime_entry_points)
{
    REQUIRE(api());
    void *b = NULL, *e = NULL;
    enum cudaDriverEntryPointQueryResult st;
    REQUIRE(cudaGetDriverEntryPoint("cuStreamBeginCaptureToGraph", &b, cudaEnableDefault, &st) == cudaSuccess && b);
    REQUIRE(cudaGetDriverEntryPoint("cuStreamEndCapture", &e, cudaEnableDefault, &st) == cudaSuccess && e);
    check_route("cudaGetDriverEntryPoint(\"cuStreamBeginCaptureToGraph\")", &(struct route){F_TOGRAPH, false, b, e});
    b = NULL;
    REQUIRE(cudaGetDriverEntryPointByVersion("cuStreamBeginCapture", &b, 10000, cudaEnablePerThreadDefaultStream,
                                             &st) == cudaSuccess && b);
    REQUIRE(cudaGetDriverEntryPointByVersion("cuStreamEndCapture", &e, 10000, cudaEnablePerThreadDefaultStream,
                                             &st) == cudaSuccess && e);
    check_route("cudaGetDriverEntryPointByVersion(\"cuStreamBeginCapture\", 10000, per-thread)",
                &(struct route){F_V1, true, b, e});
}
#pragma GCC diagnostic pop

/* ---- dlsym on the program's own handle to the driver (cuda-python, Numba, cudart_static) --------- */

TEST(dlsym_on_a_driver_handle)
{
    REQUIRE(api());
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    REQUIRE(h);
    check_route("dlsym(libcuda, \"cuStreamBeginCapture_v2\")",
                &(struct route){F_V2, false, dlsym(h, "cuStreamBeginCapture_v2"), dlsym(h, "cuStreamEndCapture")});
    check_route("dlsym(libcuda, \"cuStreamBeginCaptureToGraph_ptsz\")",
                &(struct route){F_TOGRAPH, true, dlsym(h, "cuStreamBeginCaptureToGraph_ptsz"),
                                dlsym(h, "cuStreamEndCapture_ptsz")});
    check_route("dlsym(libcuda, \"cuStreamBeginCapture\")",
                &(struct route){F_V1, false, dlsym(h, "cuStreamBeginCapture"), dlsym(h, "cuStreamEndCapture")});
    /* what libcudart 13 and NCCL do: the lookup from dlsym, every other function through it */
    PFN_cuGetProcAddress_v12000 gpa = (PFN_cuGetProcAddress_v12000)dlsym(h, "cuGetProcAddress_v2");
    REQUIRE(gpa);
    lookup_routes("dlsym(libcuda, \"cuGetProcAddress_v2\")", gpa);
    /* a lookup of the lookup stays covered */
    PFN_cuGetProcAddress_v12000 chained = (PFN_cuGetProcAddress_v12000)lookup(gpa, "cuGetProcAddress", 12000, false);
    REQUIRE(chained);
    check_route("the cuGetProcAddress that dlsym's cuGetProcAddress_v2 returns",
                &(struct route){F_TOGRAPH, false, lookup(chained, "cuStreamBeginCaptureToGraph", 12030, false),
                                lookup(chained, "cuStreamEndCapture", 12000, false)});
    /* Only capture calls are handed out there: every other function stays the driver's own (this
     * route is not memshim's to serve; docs/interposition.md), and dlsym's RTLD_NEXT still means
     * "after the caller" (here: memshim, preloaded after the program) */
    void *drv_alloc = dlsym(h, "cuMemAlloc_v2");
    Dl_info di;
    CHECKF(drv_alloc && dladdr(drv_alloc, &di) && di.dli_fname && strstr(di.dli_fname, "double"),
           "dlsym(libcuda, \"cuMemAlloc_v2\") is not the driver's own (%s)", drv_alloc && dladdr(drv_alloc, &di) ? di.dli_fname : "?");
    CHECK(lookup(gpa, "cuMemAlloc", 12000, false) == drv_alloc);
    void *next = dlsym(RTLD_NEXT, "cudaMalloc"), *dflt = dlsym(RTLD_DEFAULT, "cudaMalloc");
    CHECKF(next && next == dflt, "RTLD_NEXT from the program found %s, not memshim's cudaMalloc",
           next && dladdr(next, &di) ? di.dli_fname : "nothing");
    dlclose(h);
}

/* ---- a window that captures nothing ---------------------------------------------------------------
 * torch.cuda.use_mem_pool (and _cuda_beginAllocateCurrentThreadToPool) opens PyTorch's pool window
 * with no stream capture: allocations are routed to the pool, and nothing may be deferred for it.
 * No capture-mode exchange per allocation, and empty_cache gives the main pool's cached pages back
 * at once (a capture would defer it). */
TEST(a_pool_window_without_a_capture_is_no_capture)
{
    REQUIRE(api());
    void (*begin_pool)(int, unsigned long long, unsigned long long, void *);
    void (*end_pool)(int, unsigned long long, unsigned long long);
    void (*release_pool)(int, unsigned long long, unsigned long long);
    void *(*in_pool)(ssize_t, int, memshim_stream_t, unsigned long long, unsigned long long);
    void (*empty)(void);
    *(void **)&begin_pool = dlsym(RTLD_DEFAULT, "memshim_torch_begin_allocate_to_pool");
    *(void **)&end_pool = dlsym(RTLD_DEFAULT, "memshim_torch_end_allocate_to_pool");
    *(void **)&release_pool = dlsym(RTLD_DEFAULT, "memshim_torch_release_pool");
    *(void **)&in_pool = dlsym(RTLD_DEFAULT, "memshim_torch_alloc_in_pool");
    *(void **)&empty = dlsym(RTLD_DEFAULT, "memshim_empty_cache");
    REQUIRE(begin_pool && end_pool && release_pool && in_pool && empty);
    cudaStream_t s;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    long x0 = cudbl_call_count("cuThreadExchangeStreamCaptureMode"), q0 = cudbl_call_count("cuStreamIsCapturing");
    begin_pool(0, 4242, 0, NULL);
    void *big = t_alloc(64 << 20, 0, s);
    REQUIRE(big);
    for (int i = 0; i < 50; i++) t_free(t_alloc(SZ, 0, s), SZ, 0, s);
    void *p = in_pool(SZ, 0, s, 4242, 0); /* what the glue does for an allocation the filter claims */
    CHECK(p != NULL);
    long x = cudbl_call_count("cuThreadExchangeStreamCaptureMode") - x0, q = cudbl_call_count("cuStreamIsCapturing") - q0;
    printf("    52 allocations in a pool window with nothing captured: %ld capture-mode exchanges, %ld capture queries\n",
           x, q);
    CHECK(x == 0 && q == 0);
    t_free(big, 64 << 20, 0, s);
    cudaStreamSynchronize(s);
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    empty();
    cudbl_get_counts(&c1);
    printf("    empty_cache in the window: %ld handles before, %ld after\n", c0.handles, c1.handles);
    CHECK(c1.handles < c0.handles); /* not deferred as for a capture */
    if (p) t_free(p, SZ, 0, s);
    end_pool(0, 4242, 0);
    release_pool(0, 4242, 0);
    cudaStreamDestroy(s);
}

TEST_MAIN()
