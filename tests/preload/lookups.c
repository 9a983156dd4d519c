/*
 * lookups.c: entry-point lookups hand out memshim's hooks for the driver functions memshim
 * manages and the driver's own pointers for everything else: cudaGetDriverEntryPoint[ByVersion]
 * (and their _ptsz twins) and cuGetProcAddress[_v2] reached through the preloaded symbol. With
 * MEMSHIM_MODE=off (run_preload.sh passes EXPECT_OFF=1) every lookup is untouched.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* cudaGetDriverEntryPoint is deprecated in CUDA 13 but still called (PyTorch, NCCL): test it. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#undef cuGetProcAddress
typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);
cudaError_t cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long,
                                         enum cudaDriverEntryPointQueryResult *);
cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int,
                                                  unsigned long long,
                                                  enum cudaDriverEntryPointQueryResult *);

static int off_mode(void) { return getenv("EXPECT_OFF") && !strcmp(getenv("EXPECT_OFF"), "1"); }

/* The double's own definition of `sym` (a handle lookup never sees the preloaded library). */
static void *own(const char *sym)
{
    static void *h;
    if (!h) {
        cudaFree(NULL); /* the runtime loads the driver (the test does not link it) */
        h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    }
    return h ? dlsym(h, sym) : NULL;
}

/* What a preloaded memshim exports under `sym`. */
static void *shim(const char *sym) { return dlsym(RTLD_DEFAULT, sym); }

static int in_memshim(void *p)
{
    Dl_info di;
    return p && dladdr(p, &di) && di.dli_fname && strstr(di.dli_fname, "libmemshim");
}

/* The pointer a lookup of a managed function must return: memshim's hook, or the driver's own
 * definition in off mode. */
static void *expect_managed(const char *abi_sym) { return off_mode() ? own(abi_sym) : shim(abi_sym); }

static const struct { const char *name, *abi; } managed[] = {
    {"cuMemAlloc", "cuMemAlloc_v2"}, {"cuMemFree", "cuMemFree_v2"},
    {"cuMemGetInfo", "cuMemGetInfo_v2"}, {"cuMemCreate", "cuMemCreate"},
    {"cuMemRelease", "cuMemRelease"}, {"cuMemMap", "cuMemMap"}, {"cuMemUnmap", "cuMemUnmap"},
    {"cuMemAllocAsync", "cuMemAllocAsync"}, {"cuMemFreeAsync", "cuMemFreeAsync"},
    {"cuGetProcAddress", "cuGetProcAddress_v2"},
};
/* functions memshim leaves alone, with the ABI a lookup at 13000 returns (CUDA 13.0 gave
 * cuCtxSynchronize a context argument: cuCtxSynchronize_v2) */
static const struct { const char *name, *abi; } unmanaged[] = {
    {"cuCtxSynchronize", "cuCtxSynchronize_v2"}, {"cuMemSetAccess", "cuMemSetAccess"},
    {"cuMemAddressReserve", "cuMemAddressReserve"}, {"cuStreamSynchronize", "cuStreamSynchronize"},
    {"cuInit", "cuInit"}};

/* A real libcuda hands out its own functions from cuGetProcAddress, whatever is preloaded. A
 * double linked without -Bsymbolic takes the addresses of its exported functions through the GOT,
 * so its lookups would return memshim's symbols and every check below would be meaningless. */
TEST(driver_double_lookups_are_its_own)
{
    gpa_v2_fn own_gpa = (gpa_v2_fn)own("cuGetProcAddress_v2");
    REQUIRE(own_gpa != NULL);
    void *fn = NULL;
    REQUIRE(own_gpa("cuMemAlloc", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, NULL) == CUDA_SUCCESS);
    CHECKF(fn == own("cuMemAlloc_v2"),
           "the driver double's cuGetProcAddress returns %s's cuMemAlloc_v2: link "
           "libcuda.so.1 with -Wl,-Bsymbolic, as a real driver behaves",
           in_memshim(fn) ? "memshim" : "another library");
}

TEST(preloaded_symbols_are_memshims)
{
    REQUIRE(cudaFree(NULL) == cudaSuccess);
    void *s = shim("cuMemAlloc_v2"), *o = own("cuMemAlloc_v2");
    REQUIRE(s && o);
    CHECK(s != o);
    CHECK(in_memshim(s));
    CHECK(in_memshim(shim("cuGetProcAddress_v2")));
    CHECK(in_memshim(shim("cudaGetDriverEntryPoint")));
}

TEST(cudaGetDriverEntryPoint_substitutes_managed_only)
{
    for (size_t i = 0; i < sizeof managed / sizeof managed[0]; i++) {
        void *fn = NULL;
        enum cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSymbolNotFound;
        CHECKF(cudaGetDriverEntryPoint(managed[i].name, &fn, cudaEnableDefault, &st) == cudaSuccess,
               "%s", managed[i].name);
        CHECK(st == cudaDriverEntryPointSuccess);
        CHECKF(fn == expect_managed(managed[i].abi), "%s: got %p, want %p", managed[i].name, fn,
               expect_managed(managed[i].abi));
        fn = NULL;
        CHECK(cudaGetDriverEntryPoint_ptsz(managed[i].name, &fn, cudaEnableLegacyStream, &st) == cudaSuccess);
        CHECKF(fn == expect_managed(managed[i].abi), "%s (_ptsz)", managed[i].name);
    }
    for (size_t i = 0; i < sizeof unmanaged / sizeof unmanaged[0]; i++) {
        void *fn = NULL;
        CHECK(cudaGetDriverEntryPoint(unmanaged[i].name, &fn, cudaEnableDefault, NULL) == cudaSuccess);
        CHECKF(fn == own(unmanaged[i].abi), "%s: got %p, own %s %p", unmanaged[i].name, fn,
               unmanaged[i].abi, own(unmanaged[i].abi));
        CHECK(!in_memshim(fn));
    }
    void *fn = (void *)0x1;
    enum cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSuccess;
    cudaGetDriverEntryPoint("cuNoSuchFunction", &fn, cudaEnableDefault, &st);
    CHECK(st == cudaDriverEntryPointSymbolNotFound);
}

TEST(byversion_substitutes_managed_only)
{
    for (size_t i = 0; i < sizeof managed / sizeof managed[0]; i++) {
        void *fn = NULL;
        enum cudaDriverEntryPointQueryResult st;
        CHECK(cudaGetDriverEntryPointByVersion(managed[i].name, &fn, 13000, cudaEnableDefault, &st) ==
              cudaSuccess);
        CHECKF(fn == expect_managed(managed[i].abi), "%s", managed[i].name);
        /* the _ptsz runtime defaults to per-thread lookups: async functions come back as their
         * _ptsz driver variants */
        char ptsz_abi[64];
        snprintf(ptsz_abi, sizeof ptsz_abi, "%s%s", managed[i].abi,
                 strstr(managed[i].name, "Async") ? "_ptsz" : "");
        fn = NULL;
        CHECK(cudaGetDriverEntryPointByVersion_ptsz(managed[i].name, &fn, 13000, cudaEnableDefault,
                                                    &st) == cudaSuccess);
        CHECKF(fn == expect_managed(ptsz_abi), "%s (_ptsz)", managed[i].name);
    }
    void *fn = NULL;
    CHECK(cudaGetDriverEntryPointByVersion("cuCtxSynchronize", &fn, 13000, cudaEnableDefault, NULL) ==
          cudaSuccess);
    CHECK(fn == own("cuCtxSynchronize_v2"));
    CHECK(cudaGetDriverEntryPointByVersion("cuCtxSynchronize", &fn, 12090, cudaEnableDefault, NULL) ==
          cudaSuccess);
    CHECK(fn == own("cuCtxSynchronize"));
}

TEST(cuGetProcAddress_v2_through_the_preloaded_symbol)
{
    gpa_v2_fn gpa = (gpa_v2_fn)shim("cuGetProcAddress_v2");
    REQUIRE(gpa != NULL);
    for (size_t i = 0; i < sizeof managed / sizeof managed[0]; i++) {
        void *fn = NULL;
        CUdriverProcAddressQueryResult st;
        CHECK(gpa(managed[i].name, &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st) == CUDA_SUCCESS);
        CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS);
        CHECKF(fn == expect_managed(managed[i].abi), "%s", managed[i].name);
    }
    /* a per-thread-default-stream lookup of an async function hands out the _ptsz hook */
    void *fn = NULL;
    CHECK(gpa("cuMemAllocAsync", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL) ==
          CUDA_SUCCESS);
    CHECK(fn == expect_managed("cuMemAllocAsync_ptsz"));
    for (size_t i = 0; i < sizeof unmanaged / sizeof unmanaged[0]; i++) {
        fn = NULL;
        CHECK(gpa(unmanaged[i].name, &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, NULL) == CUDA_SUCCESS);
        CHECKF(fn == own(unmanaged[i].abi), "%s", unmanaged[i].name);
    }
    /* the v1 ABI of cuMemAlloc (before 3.2: 32-bit) is never replaced */
    fn = NULL;
    if (gpa("cuMemAlloc", &fn, 3000, CU_GET_PROC_ADDRESS_DEFAULT, NULL) == CUDA_SUCCESS)
        CHECK(!in_memshim(fn));
}

TEST(cuGetProcAddress_v1)
{
    gpa_v1_fn gpa = (gpa_v1_fn)shim("cuGetProcAddress");
    REQUIRE(gpa != NULL);
    CHECK(off_mode() || in_memshim((void *)gpa));
    void *fn = NULL;
    CHECK(gpa("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT) == CUDA_SUCCESS);
    CHECK(fn == expect_managed("cuMemAlloc_v2"));
    fn = NULL;
    CHECK(gpa("cuCtxSynchronize", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT) == CUDA_SUCCESS);
    CHECK(fn == own("cuCtxSynchronize"));
}

TEST(looked_up_hooks_work)
{
    void *fn = NULL;
    REQUIRE(cudaGetDriverEntryPoint("cuMemAlloc", &fn, cudaEnableDefault, NULL) == cudaSuccess);
    void *ffn = NULL;
    REQUIRE(cudaGetDriverEntryPoint("cuMemFree", &ffn, cudaEnableDefault, NULL) == cudaSuccess);
    CUdeviceptr d = 0;
    CHECK(((CUresult(*)(CUdeviceptr *, size_t))fn)(&d, 4096) == CUDA_SUCCESS);
    CHECK(d != 0);
    if (d) {
        memset((void *)(uintptr_t)d, 0x5a, 4096);
        CHECK(((CUresult(*)(CUdeviceptr))ffn)(d) == CUDA_SUCCESS);
    }
}

TEST_MAIN()
