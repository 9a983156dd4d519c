/*
 * entry.c: the driver entry-point lookups (cuGetProcAddress v1 and _v2, exported here) and the
 * substitution every lookup hook applies, including the runtime's cudaGetDriverEntryPoint*.
 *
 * PyTorch (expandable segments) and NCCL obtain cuMemCreate/cuMemMap/... through these lookups,
 * not by symbol, so hooking the symbols alone would miss them (DESIGN.md 2). A lookup hook calls
 * the real lookup and, when the pointer it returns is the real address of a driver function
 * memshim hooks, hands back memshim's hook instead. Comparing addresses rather than names makes
 * the driver's own version resolution decide: "cuMemAlloc" at version >= 3020 yields
 * cuMemAlloc_v2 (hooked), at an older version the 32-bit v1 (left alone). Every other lookup is
 * returned untouched, and in MEMSHIM_MODE=off all of them are. This file never interposes dlsym
 * (see docs/interposition.md) and never changes what a lookup reports in its status argument.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>

#include "core.h"
#include "cuda_real.h"
#include "drvlog.h"
#include "hooks.h"
#include "msh.h"

/* cuda.h maps cuGetProcAddress to cuGetProcAddress_v2; the v1 ABI symbol (no status argument)
 * still exists in the driver and programs built against CUDA 11 reference it. */
#undef cuGetProcAddress /* (so msh_cu's field, declared under the macro, is cuGetProcAddress_v2) */
typedef CUresult (*lookup_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*lookup_v2_fn)(const char *, void **, int, cuuint64_t,
                                 CUdriverProcAddressQueryResult *);

static CUresult hk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags);
static CUresult hk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status);

/* ---- the real lookups ----------------------------------------------------------------------
 * Resolved from a handle of our own, without cuInit: a program may look functions up before it
 * initializes the driver, and in off mode memshim must not initialize it for them. */
static lookup_v1_fn real_lookup_v1;
static lookup_v2_fn real_lookup_v2;
static pthread_once_t lookup_once = PTHREAD_ONCE_INIT;

static void resolve_lookups(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    *(void **)&real_lookup_v2 = dlsym(h, "cuGetProcAddress_v2");
    *(void **)&real_lookup_v1 = dlsym(h, "cuGetProcAddress");
}

/* ---- the substitution table ----------------------------------------------------------------
 * Built once, after the driver is loaded, then read-only. Each hooked function contributes the
 * address of its exported symbol in the driver and also what the driver's own lookup returns
 * for it, in case a driver hands out addresses other than its exported symbols. */
#define SUBST_MAX 128
/* cap: what the capture-only substitution hands out for `real` (hooks/dlsym.c: the driver
 * reached through the program's own handle), NULL when that route leaves it alone: the capture
 * calls map to the same hooks, the lookups to lookups that substitute captures only. */
static struct subst { void *real, *hook, *cap; } subst[SUBST_MAX];
static int nsubst;
static pthread_once_t subst_once = PTHREAD_ONCE_INIT;

static CUresult cap_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
static CUresult cap_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *status);

static bool is_capture_hook(const void *hook)
{
    return hook == msh_hk_cuStreamBeginCapture_v2 || hook == msh_hk_cuStreamBeginCapture_v2_ptsz ||
           hook == msh_hk_cuStreamBeginCapture || hook == msh_hk_cuStreamBeginCapture_ptsz ||
           (hook && (hook == msh_hk_cuStreamBeginCaptureToGraph || hook == msh_hk_cuStreamBeginCaptureToGraph_ptsz)) ||
           hook == msh_hk_cuStreamEndCapture || hook == msh_hk_cuStreamEndCapture_ptsz;
}

static void subst_add(void *real, void *hook)
{
    if (!real || !hook || real == hook) return;
    for (int i = 0; i < nsubst; i++)
        if (subst[i].real == real) return; /* first mapping wins */
    void *cap = is_capture_hook(hook) ? hook
                : hook == (void *)hk_cuGetProcAddress_v2 ? (void *)cap_cuGetProcAddress_v2
                : hook == (void *)hk_cuGetProcAddress    ? (void *)cap_cuGetProcAddress
                                                         : NULL;
    if (nsubst < SUBST_MAX) subst[nsubst++] = (struct subst){real, hook, cap};
}

static void build_subst(void)
{
    if (msh_cuda_load() != 0 || !msh_cu.handle) return;
    void *h = msh_cu.handle;
    void *hk_v1 = (void *)hk_cuGetProcAddress, *hk_v2 = (void *)hk_cuGetProcAddress_v2;

    subst_add((void *)msh_cu.cuMemAlloc, msh_hk_cuMemAlloc_v2);
    subst_add((void *)msh_cu.cuMemFree, msh_hk_cuMemFree_v2);
    subst_add((void *)msh_cu.cuMemGetInfo, msh_hk_cuMemGetInfo_v2);
    subst_add((void *)msh_cu.cuMemAllocAsync, msh_hk_cuMemAllocAsync);
    subst_add((void *)msh_cu.cuMemFreeAsync, msh_hk_cuMemFreeAsync);
    subst_add(dlsym(h, "cuMemAllocAsync_ptsz"), msh_hk_cuMemAllocAsync_ptsz);
    subst_add(dlsym(h, "cuMemFreeAsync_ptsz"), msh_hk_cuMemFreeAsync_ptsz);
    subst_add((void *)msh_cu.cuMemCreate, msh_hk_cuMemCreate);
    subst_add((void *)msh_cu.cuMemRelease, msh_hk_cuMemRelease);
    subst_add((void *)msh_cu.cuMemMap, msh_hk_cuMemMap);
    subst_add((void *)msh_cu.cuMemUnmap, msh_hk_cuMemUnmap);
    subst_add((void *)msh_cu.cuStreamDestroy, msh_hk_cuStreamDestroy_v2);
    subst_add(dlsym(h, "cuStreamDestroy"), msh_hk_cuStreamDestroy_v2); /* v1: same signature */
    subst_add((void *)msh_cu.cuMemGetAddressRange, msh_hk_cuMemGetAddressRange_v2);
    subst_add((void *)msh_cu.cuPointerGetAttribute, msh_hk_cuPointerGetAttribute);
    subst_add((void *)msh_cu.cuPointerGetAttributes, msh_hk_cuPointerGetAttributes);
    subst_add((void *)msh_cu.cuIpcGetMemHandle, msh_hk_cuIpcGetMemHandle);
    subst_add((void *)msh_cu.cuCtxEnablePeerAccess, msh_hk_cuCtxEnablePeerAccess);
    subst_add((void *)msh_cu.cuStreamBeginCapture, msh_hk_cuStreamBeginCapture_v2);
    subst_add((void *)msh_cu.cuStreamBeginCapture_ptsz, msh_hk_cuStreamBeginCapture_v2_ptsz);
    subst_add((void *)msh_cu.cuStreamEndCapture, msh_hk_cuStreamEndCapture);
    subst_add((void *)msh_cu.cuStreamEndCapture_ptsz, msh_hk_cuStreamEndCapture_ptsz);
    subst_add((void *)msh_cu.cuStreamBeginCapture_v1, msh_hk_cuStreamBeginCapture);
    subst_add((void *)msh_cu.cuStreamBeginCapture_v1_ptsz, msh_hk_cuStreamBeginCapture_ptsz);
#if MSH_HAVE_TO_GRAPH
    subst_add((void *)msh_cu.cuStreamBeginCaptureToGraph, msh_hk_cuStreamBeginCaptureToGraph);
    subst_add((void *)msh_cu.cuStreamBeginCaptureToGraph_ptsz, msh_hk_cuStreamBeginCaptureToGraph_ptsz);
#endif
    subst_add((void *)msh_cu.cuGetProcAddress_v2, hk_v2);
    subst_add(dlsym(h, "cuGetProcAddress"), hk_v1);
    /* A runtime whose driver table came through dlsym holds the capture-only lookups (hooks/dlsym.c):
     * what it answers memshim's cudaGetDriverEntryPoint hook for "cuGetProcAddress" must become the
     * full one here, as the driver's own would. */
    subst_add((void *)cap_cuGetProcAddress_v2, hk_v2);
    subst_add((void *)cap_cuGetProcAddress, hk_v1);

    lookup_v2_fn lookup = (lookup_v2_fn)msh_cu.cuGetProcAddress_v2;
    int ver = 0;
    if (!lookup || !msh_cu.cuDriverGetVersion || MSH_DRV(cuDriverGetVersion, &ver) != CUDA_SUCCESS)
        return;
    /* Each hook with the ABI it stands in for (hooks/driver.c checks each hook's type against
     * cudaTypedefs.h's for that ABI): the name asked for at that ABI's version returns exactly that
     * function. Asking at the driver's own version would, once a driver adds a newer ABI under the
     * same name (as CUDA 13.0 did for cuCtxGetDevice and cuCtxSynchronize), map the new function's
     * address to a hook with the old signature. A driver older than the version may answer with an
     * older ABI: skipped. */
    MSH_ABI_ASSERT(&hk_cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000, "hk_cuGetProcAddress_v2");
    MSH_ABI_ASSERT(&hk_cuGetProcAddress, PFN_cuGetProcAddress_v11030, "hk_cuGetProcAddress");
    const cuuint64_t legacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                     per_thread = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    const struct { const char *name; int version; cuuint64_t flags; void *hook; } q[] = {
        {"cuMemAlloc", 3020, legacy, msh_hk_cuMemAlloc_v2},
        {"cuMemFree", 3020, legacy, msh_hk_cuMemFree_v2},
        {"cuMemGetInfo", 3020, legacy, msh_hk_cuMemGetInfo_v2},
        {"cuMemAllocAsync", 11020, legacy, msh_hk_cuMemAllocAsync},
        {"cuMemFreeAsync", 11020, legacy, msh_hk_cuMemFreeAsync},
        {"cuMemAllocAsync", 11020, per_thread, msh_hk_cuMemAllocAsync_ptsz},
        {"cuMemFreeAsync", 11020, per_thread, msh_hk_cuMemFreeAsync_ptsz},
        {"cuMemCreate", 10020, legacy, msh_hk_cuMemCreate},
        {"cuMemRelease", 10020, legacy, msh_hk_cuMemRelease},
        {"cuMemMap", 10020, legacy, msh_hk_cuMemMap},
        {"cuMemUnmap", 10020, legacy, msh_hk_cuMemUnmap},
        {"cuGetProcAddress", 12000, legacy, hk_v2},
        {"cuGetProcAddress", 11030, legacy, hk_v1},
        {"cuStreamDestroy", 4000, legacy, msh_hk_cuStreamDestroy_v2},
        {"cuMemGetAddressRange", 3020, legacy, msh_hk_cuMemGetAddressRange_v2},
        {"cuPointerGetAttribute", 4000, legacy, msh_hk_cuPointerGetAttribute},
        {"cuPointerGetAttributes", 7000, legacy, msh_hk_cuPointerGetAttributes},
        {"cuIpcGetMemHandle", 4010, legacy, msh_hk_cuIpcGetMemHandle},
        {"cuCtxEnablePeerAccess", 4000, legacy, msh_hk_cuCtxEnablePeerAccess},
        {"cuStreamBeginCapture", 10010, legacy, msh_hk_cuStreamBeginCapture_v2},
        {"cuStreamBeginCapture", 10010, per_thread, msh_hk_cuStreamBeginCapture_v2_ptsz},
        {"cuStreamEndCapture", 10000, legacy, msh_hk_cuStreamEndCapture},
        {"cuStreamEndCapture", 10000, per_thread, msh_hk_cuStreamEndCapture_ptsz},
        {"cuStreamBeginCapture", 10000, legacy, msh_hk_cuStreamBeginCapture},
        {"cuStreamBeginCapture", 10000, per_thread, msh_hk_cuStreamBeginCapture_ptsz},
        {"cuStreamBeginCaptureToGraph", 12030, legacy, msh_hk_cuStreamBeginCaptureToGraph},
        {"cuStreamBeginCaptureToGraph", 12030, per_thread, msh_hk_cuStreamBeginCaptureToGraph_ptsz},
    };
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        if (ver < q[i].version || !q[i].hook) continue;
        void *p = NULL;
        CUdriverProcAddressQueryResult st;
        if (lookup(q[i].name, &p, q[i].version, q[i].flags, &st) == CUDA_SUCCESS &&
            st == CU_GET_PROC_ADDRESS_SUCCESS)
            subst_add(p, q[i].hook);
    }
    msh_debug("entry-point substitution: %d driver addresses map to memshim hooks", nsubst);
}

void msh_entry_substitute(void **pfn)
{
    if (!pfn || !*pfn || !msh_hooks_serving()) return;
    pthread_once(&subst_once, build_subst);
    for (int i = 0; i < nsubst; i++) {
        if (subst[i].real == *pfn) {
            *pfn = subst[i].hook;
            return;
        }
    }
}

bool msh_entry_substitute_capture(void **pfn)
{
    /* Also inside memshim's own hooks: a runtime that starts inside one (memshim's cudaMalloc
     * calling the real one first) builds its driver table there. But not while memshim itself
     * starts on this thread (msh_core_init would wait for itself). */
    if (msh_in_hook && !msh_core_started()) return false;
    if (!pfn || !*pfn || !msh_hooks_serving()) return false;
    pthread_once(&subst_once, build_subst);
    for (int i = 0; i < nsubst; i++) {
        if (subst[i].real == *pfn) {
            if (!subst[i].cap) return false;
            *pfn = subst[i].cap;
            return true;
        }
    }
    return false;
}

/* ---- hooks --------------------------------------------------------------------------------- */

static CUresult hk_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    pthread_once(&lookup_once, resolve_lookups);
    if (!real_lookup_v2) MSH_DRV_MISSING("cuGetProcAddress_v2");
    if (msh_in_hook) return real_lookup_v2(symbol, pfn, cudaVersion, flags, status);
    msh_in_hook = 1;
    CUresult r = real_lookup_v2(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS) msh_entry_substitute(pfn);
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags)
{
    pthread_once(&lookup_once, resolve_lookups);
    if (!real_lookup_v1 && !real_lookup_v2) MSH_DRV_MISSING("cuGetProcAddress");
    if (msh_in_hook)
        return real_lookup_v1 ? real_lookup_v1(symbol, pfn, cudaVersion, flags)
                              : real_lookup_v2(symbol, pfn, cudaVersion, flags, NULL);
    msh_in_hook = 1;
    CUresult r = real_lookup_v1 ? real_lookup_v1(symbol, pfn, cudaVersion, flags)
                                : real_lookup_v2(symbol, pfn, cudaVersion, flags, NULL);
    if (r == CUDA_SUCCESS) msh_entry_substitute(pfn);
    msh_in_hook = 0;
    return r;
}

/* The lookups handed to a program that found the driver's own cuGetProcAddress with dlsym on its
 * handle (libcudart 13, NCCL, cuda-python: hooks/dlsym.c): the same lookup, but only the capture
 * calls (and the lookups themselves, so chained lookups stay covered) come back as memshim's; every
 * other function stays the driver's, as that route always gave it (docs/interposition.md). */
static CUresult cap_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *status)
{
    pthread_once(&lookup_once, resolve_lookups);
    if (!real_lookup_v2) MSH_DRV_MISSING("cuGetProcAddress_v2");
    CUresult r = real_lookup_v2(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS) msh_entry_substitute_capture(pfn);
    return r;
}

static CUresult cap_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    pthread_once(&lookup_once, resolve_lookups);
    if (!real_lookup_v1 && !real_lookup_v2) MSH_DRV_MISSING("cuGetProcAddress");
    CUresult r = real_lookup_v1 ? real_lookup_v1(symbol, pfn, cudaVersion, flags)
                                : real_lookup_v2(symbol, pfn, cudaVersion, flags, NULL);
    if (r == CUDA_SUCCESS) msh_entry_substitute_capture(pfn);
    return r;
}
MSH_ABI_ASSERT(&cap_cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000, "cap_cuGetProcAddress_v2");
MSH_ABI_ASSERT(&cap_cuGetProcAddress, PFN_cuGetProcAddress_v11030, "cap_cuGetProcAddress");

MSH_EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                        CUdriverProcAddressQueryResult *)
    __attribute__((alias("hk_cuGetProcAddress_v2")));
MSH_EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t)
    __attribute__((alias("hk_cuGetProcAddress")));
