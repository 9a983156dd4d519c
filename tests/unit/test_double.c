/*
 * test_double.c: unit tests of the CUDA driver double (build/double/libcuda.so.1) and, briefly,
 * of the runtime double, against the real API's rules: VMM granularity, reserve/map/access/unmap/
 * free rules, data surviving a remap, physical memory outliving its released handle while mapped,
 * capacity and cuMemGetInfo, deferred stream and event completion with cross-stream ordering,
 * cuGetProcAddress, fault injection and leak counts. If the double breaks one of these rules,
 * memshim's own tests would pass on it and fail on a GPU. Tests run in order in one process and
 * each cleans up after itself (the last one checks nothing leaked).
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include "cudadouble/cudbl.h"
#include "harness.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#define CU_OK(expr)                                                                             \
    do {                                                                                        \
        CUresult cu_ok_r_ = (expr);                                                             \
        CHECKF(cu_ok_r_ == CUDA_SUCCESS, "%s returned %d", #expr, (int)cu_ok_r_);               \
    } while (0)
#define CU_IS(expr, want)                                                                       \
    do {                                                                                        \
        CUresult cu_is_r_ = (expr);                                                             \
        CHECKF(cu_is_r_ == (want), "%s returned %d, want %d", #expr, (int)cu_is_r_, (int)(want)); \
    } while (0)

/* expr must be reported as misuse (counted, not aborted) and fail with `want` */
static long misuse_count(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.misuse;
}
#define CU_MISUSE(expr, want)                                                                   \
    do {                                                                                        \
        cudbl_set_misuse_abort(0);                                                              \
        long cu_mis_before_ = misuse_count();                                                   \
        CU_IS(expr, want);                                                                      \
        CHECKF(misuse_count() == cu_mis_before_ + 1, "%s was not reported as misuse", #expr);   \
        cudbl_set_misuse_abort(1);                                                              \
    } while (0)

/* ABI names cuda.h only declares for the driver's own build */
CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);

static CUcontext g_ctx;

/* Every test starts with the "GPU" idle (CUDBL_ASYNC=1 would start its thread at cuInit): the
 * deferral checks need work to stay queued until they drive it. */
static int setup(void)
{
    cudbl_set_async(0);
    if (!g_ctx) {
        if (cuInit(0) != CUDA_SUCCESS) return -1;
        if (cuDevicePrimaryCtxRetain(&g_ctx, 0) != CUDA_SUCCESS) return -1;
    }
    return cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS ? 0 : -1;
}

static CUmemAllocationProp prop_on(int dev)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

static size_t gran(void)
{
    CUmemAllocationProp p = prop_on(0);
    size_t g = 0;
    cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    return g;
}

static CUmemGenericAllocationHandle create(size_t size)
{
    CUmemAllocationProp p = prop_on(0);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = cuMemCreate(&h, size, &p, 0);
    return r == CUDA_SUCCESS ? h : 0;
}

static CUdeviceptr reserve(size_t size)
{
    CUdeviceptr va = 0;
    return cuMemAddressReserve(&va, size, 0, 0, 0) == CUDA_SUCCESS ? va : 0;
}

static CUresult grant(CUdeviceptr va, size_t size)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = 0;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return cuMemSetAccess(va, size, &d, 1);
}

static int counts_zero(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return !c.handles && !c.mappings && !c.reservations && !c.allocs && !c.events && !c.streams &&
           !c.bytes_in_use;
}

/* ---- initialization and devices -------------------------------------------------------------- */

TEST(not_initialized_before_cuInit)
{
    int n = -1, v = 0;
    CU_IS(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CU_OK(cuDriverGetVersion(&v));      /* works before cuInit, like the real one */
    CHECK(v == 13020);
    CU_IS(cuInit(1), CUDA_ERROR_INVALID_VALUE);
}

TEST(fail_init_env_emulates_no_gpu)
{
    setenv("CUDBL_FAIL_INIT", "1", 1);
    CU_IS(cuInit(0), CUDA_ERROR_NO_DEVICE);
    unsetenv("CUDBL_FAIL_INIT");
    CU_OK(cuInit(0));
}

TEST(devices_and_attributes)
{
    REQUIRE(setup() == 0);
    int n = 0, v = -1;
    char name[64];
    size_t total = 0;
    CUdevice d;
    CU_OK(cuDeviceGetCount(&n));
    CHECK(n >= 1);
    CU_OK(cuDeviceGet(&d, 0));
    CU_IS(cuDeviceGet(&d, n), CUDA_ERROR_INVALID_DEVICE);
    CU_OK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(strcmp(name, "memshim test double") == 0);
    CU_OK(cuDeviceTotalMem(&total, 0));
    size_t free_b = 0, total2 = 0;
    CU_OK(cuMemGetInfo(&free_b, &total2));
    CHECK(total == total2 && free_b == total);
    CU_OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CHECK(v == 1);
    CU_OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    CHECK(v == 9);
    CU_OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    CHECK(v == 0);
    CU_IS(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, n), CUDA_ERROR_INVALID_DEVICE);
}

TEST(context_stack)
{
    REQUIRE(setup() == 0);
    CUcontext cur = NULL, c2 = NULL, popped = NULL;
    CUdevice dev = -1;
    CU_OK(cuCtxGetCurrent(&cur));
    CHECK(cur == g_ctx);
    CU_OK(cuCtxCreate_v2(&c2, 0, 0));       /* creates and pushes */
    CU_OK(cuCtxGetCurrent(&cur));
    CHECK(cur == c2 && c2 != g_ctx);
    CU_OK(cuCtxGetDevice(&dev));
    CHECK(dev == 0);
    CU_OK(cuCtxPopCurrent(&popped));
    CHECK(popped == c2);
    CU_OK(cuCtxGetCurrent(&cur));
    CHECK(cur == g_ctx);
    CU_OK(cuCtxPushCurrent(c2));
    CU_OK(cuCtxDestroy(c2));                /* pops it when current */
    CU_OK(cuCtxGetCurrent(&cur));
    CHECK(cur == g_ctx);
    CU_IS(cuCtxPushCurrent(c2), CUDA_ERROR_INVALID_CONTEXT);
    CU_IS(cuCtxDestroy(g_ctx), CUDA_ERROR_INVALID_CONTEXT);  /* primary: release, not destroy */
    /* a thread with an empty stack: pop fails, context-bound calls fail */
    CU_OK(cuCtxPopCurrent(&popped));
    CU_IS(cuCtxPopCurrent(&popped), CUDA_ERROR_INVALID_CONTEXT);
    size_t f, t;
    CU_IS(cuMemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
    CU_OK(cuCtxSetCurrent(g_ctx));
}

/* ---- VMM rules ------------------------------------------------------------------------------- */

TEST(granularity)
{
    REQUIRE(setup() == 0);
    CUmemAllocationProp p = prop_on(0);
    size_t min = 0, rec = 0;
    CU_OK(cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CU_OK(cuMemGetAllocationGranularity(&rec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(min == rec);
    const char *env = getenv("CUDBL_GRANULARITY");
    if (!env || !*env) CHECK(min == 2u << 20);
    p.type = CU_MEM_ALLOCATION_TYPE_INVALID;
    CU_IS(cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          CUDA_ERROR_INVALID_VALUE);
    p = prop_on(99);
    CU_IS(cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          CUDA_ERROR_INVALID_DEVICE);
}

TEST(create_rules)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUmemAllocationProp p = prop_on(0);
    CUmemGenericAllocationHandle h = 0;
    CU_IS(cuMemCreate(&h, g + 4096, &p, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemCreate(&h, g / 2, &p, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemCreate(&h, 0, &p, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemCreate(&h, g, &p, 1), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemCreate(&h, g, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    p.location.id = 7;
    CU_IS(cuMemCreate(&h, g, &p, 0), CUDA_ERROR_INVALID_DEVICE);
    p = prop_on(0);
    p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT; /* refused, as documented */
    CU_IS(cuMemCreate(&h, g, &p, 0), CUDA_ERROR_INVALID_VALUE);
    p.location.type = CU_MEM_LOCATION_TYPE_HOST; /* host memory is not IPC capable */
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CU_IS(cuMemCreate(&h, g, &p, 0), CUDA_ERROR_INVALID_VALUE);
    p = prop_on(0);
    CU_OK(cuMemCreate(&h, 2 * g, &p, 0));
    CUmemAllocationProp got;
    CU_OK(cuMemGetAllocationPropertiesFromHandle(&got, h));
    CHECK(got.type == CU_MEM_ALLOCATION_TYPE_PINNED && got.location.id == 0);
    CU_OK(cuMemRelease(h));
    CU_IS(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);       /* double release */
    CU_IS(cuMemRelease(0xdeadbeef), CUDA_ERROR_INVALID_VALUE);
    CHECK(counts_zero());
}

TEST(reserve_and_free_rules)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = 0;
    CU_IS(cuMemAddressReserve(&va, g + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemAddressReserve(&va, 0, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemAddressReserve(&va, g, 3 * g, 0, 0), CUDA_ERROR_INVALID_VALUE);  /* not pow2 */
    /* alignment is honoured */
    size_t align = 64 * g;
    CU_OK(cuMemAddressReserve(&va, 4 * g, align, 0, 0));
    CHECK(va && va % align == 0);
    /* only the whole reservation can be freed */
    CU_IS(cuMemAddressFree(va, 2 * g), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemAddressFree(va + g, 3 * g), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemAddressFree(va, 4 * g));
    CU_IS(cuMemAddressFree(va, 4 * g), CUDA_ERROR_INVALID_VALUE);
    /* the hint is honoured when the range is free */
    CUdeviceptr again = 0;
    CU_OK(cuMemAddressReserve(&again, 4 * g, 0, va, 0));
    CHECK(again == va);
    CU_OK(cuMemAddressFree(again, 4 * g));
    CHECK(counts_zero());
}

TEST(map_rules)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(4 * g);
    CUmemGenericAllocationHandle h = create(g), h2 = create(2 * g);
    REQUIRE(va && h && h2);
    CU_IS(cuMemMap(va, g, g, h, 0), CUDA_ERROR_NOT_SUPPORTED);          /* offset must be 0 */
    /* ... also inside the handle: part of a handle cannot be mapped ("currently must be zero",
     * cuda.h 13.0), and the real driver says so with NOT_SUPPORTED (the GPU check's map_offset on
     * an H200, driver 580, 2026-12-06) */
    CU_IS(cuMemMap(va, g, g, h2, 0), CUDA_ERROR_NOT_SUPPORTED);
    CU_IS(cuMemMap(va, g, 0, h, 1), CUDA_ERROR_INVALID_VALUE);          /* flags must be 0 */
    CU_IS(cuMemMap(va + 4096, g, 0, h, 0), CUDA_ERROR_INVALID_VALUE);   /* unaligned va */
    CU_IS(cuMemMap(va, 2 * g, 0, h, 0), CUDA_ERROR_INVALID_VALUE);      /* size != handle size */
    CU_IS(cuMemMap(va + 3 * g, 2 * g, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* past the end */
    CU_IS(cuMemMap(va + 8 * g, g, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  /* outside */
    CU_IS(cuMemMap(va, g, 0, 0x12345, 0), CUDA_ERROR_INVALID_VALUE);    /* bad handle */
    CU_OK(cuMemMap(va, g, 0, h, 0));
    CU_IS(cuMemMap(va, g, 0, h, 0), CUDA_ERROR_INVALID_VALUE);          /* double map */
    CU_IS(cuMemMap(va, 2 * g, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);     /* overlaps */
    CU_OK(cuMemMap(va + 2 * g, 2 * g, 0, h2, 0));
    CU_OK(cuMemMap(va + g, g, 0, h, 0));    /* one handle may be mapped twice */
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.mappings == 3 && c.handles == 2 && c.reservations == 1);
    /* a released handle cannot be mapped again */
    CUmemGenericAllocationHandle h3 = create(g);
    CU_OK(cuMemRelease(h3));
    CU_IS(cuMemMap(va + g, g, 0, h3, 0), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemUnmap(va, 4 * g));           /* several whole mappings at once */
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemRelease(h2));
    CU_OK(cuMemAddressFree(va, 4 * g));
    CHECK(counts_zero());
}

TEST(unmap_rules)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(8 * g);
    CUmemGenericAllocationHandle h = create(2 * g);
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, 2 * g, 0, h, 0));
    CU_IS(cuMemUnmap(va, g), CUDA_ERROR_INVALID_VALUE);             /* part of a mapping */
    CU_IS(cuMemUnmap(va + g, g), CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemUnmap(va, 3 * g), CUDA_ERROR_INVALID_VALUE);         /* runs into unmapped VA */
    CU_IS(cuMemUnmap(va + 4 * g, 2 * g), CUDA_ERROR_INVALID_VALUE); /* nothing mapped there */
    CU_IS(cuMemUnmap(va + 16 * g, 2 * g), CUDA_ERROR_INVALID_VALUE); /* not reserved */
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.mappings == 1);                 /* failed unmaps changed nothing */
    /* freeing a reservation that still has mappings is refused */
    CU_IS(cuMemAddressFree(va, 8 * g), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_IS(cuMemUnmap(va, 2 * g), CUDA_ERROR_INVALID_VALUE);         /* already unmapped */
    CU_OK(cuMemAddressFree(va, 8 * g));
    CU_OK(cuMemRelease(h));
    CHECK(counts_zero());
}

TEST(set_access_rules)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(4 * g);
    CUmemGenericAllocationHandle h = create(2 * g);
    REQUIRE(va && h);
    CU_IS(grant(va, 2 * g), CUDA_ERROR_INVALID_VALUE);      /* nothing mapped yet */
    CU_OK(cuMemMap(va, 2 * g, 0, h, 0));
    CU_IS(grant(va, 4 * g), CUDA_ERROR_INVALID_VALUE);      /* part of the range unmapped */
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = 5;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_IS(cuMemSetAccess(va, 2 * g, &d, 1), CUDA_ERROR_INVALID_DEVICE);
    CU_IS(cuMemSetAccess(va, 2 * g, &d, 0), CUDA_ERROR_INVALID_VALUE);
    unsigned long long flags = 99;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CU_OK(cuMemGetAccess(&flags, &loc, va));
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CU_OK(grant(va, 2 * g));
    CU_OK(cuMemGetAccess(&flags, &loc, va + g + 100));
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    memset((void *)(uintptr_t)va, 0x5a, 2 * g);             /* really writable now */
    CHECK(((unsigned char *)(uintptr_t)va)[2 * g - 1] == 0x5a);
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_IS(cuMemGetAccess(&flags, &loc, va), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, 4 * g));
    CHECK(counts_zero());
}

static sigjmp_buf fault_jmp;
static void on_fault(int sig)
{
    (void)sig;
    siglongjmp(fault_jmp, 1);
}

/* Probe whether a read of p faults (the double keeps a mapping PROT_NONE until cuMemSetAccess). */
static int read_faults(const volatile unsigned char *p)
{
    struct sigaction sa, old_segv, old_bus;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fault;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
    volatile int faulted = 0;
    if (sigsetjmp(fault_jmp, 1) == 0) {
        unsigned char v = *p;
        (void)v;
    } else {
        faulted = 1;
    }
    sigaction(SIGSEGV, &old_segv, NULL);
    sigaction(SIGBUS, &old_bus, NULL);
    return faulted;
}

TEST(access_required_after_map)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(g);
    CUmemGenericAllocationHandle h = create(g);
    REQUIRE(va && h);
    CHECK(read_faults((const unsigned char *)(uintptr_t)va));   /* reserved only */
    CU_OK(cuMemMap(va, g, 0, h, 0));
    CHECK(read_faults((const unsigned char *)(uintptr_t)va));   /* mapped, no access */
    CU_OK(grant(va, g));
    CHECK(!read_faults((const unsigned char *)(uintptr_t)va));
    CU_OK(cuMemUnmap(va, g));
    CHECK(read_faults((const unsigned char *)(uintptr_t)va));   /* unmapped again */
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, g));
}

TEST(data_survives_unmap_and_remap_elsewhere)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr a = reserve(4 * g), b = reserve(8 * g);
    CUmemGenericAllocationHandle h = create(2 * g);
    REQUIRE(a && b && h);
    CU_OK(cuMemMap(a, 2 * g, 0, h, 0));
    CU_OK(grant(a, 2 * g));
    uint32_t *pa = (uint32_t *)(uintptr_t)a;
    for (size_t i = 0; i < 2 * g / 4; i += 1021) pa[i] = (uint32_t)(i * 2654435761u);
    CU_OK(cuMemUnmap(a, 2 * g));
    CU_OK(cuMemMap(b + 4 * g, 2 * g, 0, h, 0));     /* another reservation, another offset */
    CU_OK(grant(b + 4 * g, 2 * g));
    uint32_t *pb = (uint32_t *)(uintptr_t)(b + 4 * g);
    int bad = 0;
    for (size_t i = 0; i < 2 * g / 4; i += 1021) bad += pb[i] != (uint32_t)(i * 2654435761u);
    CHECK(bad == 0);
    /* two live mappings of one handle alias the same memory */
    CU_OK(cuMemMap(a, 2 * g, 0, h, 0));
    CU_OK(grant(a, 2 * g));
    pb[7] = 0xfeedface;
    CHECK(pa[7] == 0xfeedface);
    CU_OK(cuMemUnmap(a, 2 * g));
    CU_OK(cuMemUnmap(b + 4 * g, 2 * g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(a, 4 * g));
    CU_OK(cuMemAddressFree(b, 8 * g));
    CHECK(counts_zero());
}

/* cudbl_call_bytes: what each VMM call covered, refused calls included (as callers count them) */
TEST(call_bytes_count_what_each_vmm_call_covered)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    static const char *const fns[] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
                                      "cuMemAddressReserve", "cuMemAddressFree"};
    long long b0[7];
    for (int i = 0; i < 7; i++) b0[i] = cudbl_call_bytes(fns[i]);
    long grants0 = cudbl_access_grants(0);
    CUdeviceptr va = reserve(4 * g);
    CUmemGenericAllocationHandle h1 = create(g), h3 = create(3 * g);
    REQUIRE(va && h1 && h3);
    CU_OK(cuMemMap(va, g, 0, h1, 0));
    CU_OK(cuMemMap(va + g, 3 * g, 0, h3, 0));
    CU_IS(cuMemMap(va, g, 0, h1, 0), CUDA_ERROR_INVALID_VALUE); /* refused: counted all the same */
    CU_OK(grant(va, 4 * g));                                     /* one grant over two mappings */
    CHECK(cudbl_access_grants(0) == grants0 + 2);
    CU_OK(cuMemUnmap(va, 4 * g));
    CU_OK(cuMemRelease(h1));
    CU_OK(cuMemRelease(h3));
    CU_OK(cuMemAddressFree(va, 4 * g));
    long long want[7] = {4 * (long long)g, 5 * (long long)g, 4 * (long long)g, 4 * (long long)g, 4 * (long long)g,
                         4 * (long long)g, 4 * (long long)g};
    for (int i = 0; i < 7; i++)
        CHECKF(cudbl_call_bytes(fns[i]) - b0[i] == want[i], "%s: %lld", fns[i], cudbl_call_bytes(fns[i]) - b0[i]);
    CHECK(cudbl_call_bytes("cuInit") == 0 && cudbl_call_bytes("cuNoSuchFunction") == -1);
    CHECK(counts_zero());
}

TEST(release_while_mapped_keeps_memory_until_unmap)
{
    REQUIRE(setup() == 0);
    size_t g = gran(), free0, free1, total;
    CU_OK(cuMemGetInfo(&free0, &total));
    CUdeviceptr va = reserve(2 * g);
    CUmemGenericAllocationHandle h = create(2 * g);
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, 2 * g, 0, h, 0));
    CU_OK(grant(va, 2 * g));
    ((char *)(uintptr_t)va)[123] = 42;
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemGetInfo(&free1, &total));
    CHECK(free1 == free0 - 2 * g);          /* still charged */
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.handles == 1 && c.bytes_in_use == 2 * g);
    CHECK(((char *)(uintptr_t)va)[123] == 42);
    CU_IS(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);   /* the handle itself is gone */
    CU_OK(cuMemUnmap(va, 2 * g));           /* last mapping: now freed */
    CU_OK(cuMemGetInfo(&free1, &total));
    CHECK(free1 == free0);
    CU_OK(cuMemAddressFree(va, 2 * g));
    CHECK(counts_zero());
}

TEST(retain_allocation_handle)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(4 * g);
    CUmemGenericAllocationHandle h = create(2 * g), r = 0, r2 = 0;
    REQUIRE(va && h);
    CU_OK(cuMemMap(va + 2 * g, 2 * g, 0, h, 0));
    CU_IS(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)va), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + 3 * g + 17)));
    CHECK(r == h);
    CU_OK(cuMemRelease(h));                 /* drops the create reference ... */
    CU_OK(cuMemUnmap(va + 2 * g, 2 * g));
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.handles == 1);                  /* ... the retained one keeps it */
    CU_OK(cuMemMap(va, 2 * g, 0, r, 0));
    /* retaining from a handle released while mapped brings the handle back */
    CU_OK(cuMemRelease(r));
    CU_OK(cuMemRetainAllocationHandle(&r2, (void *)(uintptr_t)va));
    CHECK(r2 == h);
    CU_OK(cuMemUnmap(va, 2 * g));
    cudbl_get_counts(&c);
    CHECK(c.handles == 1);
    CU_OK(cuMemRelease(r2));
    CU_OK(cuMemAddressFree(va, 4 * g));
    CHECK(counts_zero());
}

/* ---- capacity ---------------------------------------------------------------------------------- */

TEST(capacity_oom_and_meminfo)
{
    REQUIRE(setup() == 0);
    size_t g = gran(), orig = 0, f = 0, t = 0;
    CU_OK(cuDeviceTotalMem(&orig, 0));
    REQUIRE(cudbl_configure(0, 8 * g, 0) == CUDA_SUCCESS);
    CU_OK(cuMemGetInfo(&f, &t));
    CHECK(f == 8 * g && t == 8 * g);
    CUmemGenericAllocationHandle h[3];
    for (int i = 0; i < 3; i++) h[i] = create(2 * g);
    CHECK(h[0] && h[1] && h[2]);
    CU_OK(cuMemGetInfo(&f, &t));
    CHECK(f == 2 * g);
    CUmemAllocationProp p = prop_on(0);
    CUmemGenericAllocationHandle x;
    CU_IS(cuMemCreate(&x, 4 * g, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CUdeviceptr d = 0, d2 = 0;
    CU_IS(cuMemAlloc(&d, 3 * g), CUDA_ERROR_OUT_OF_MEMORY);     /* plain allocs share capacity */
    CU_OK(cuMemAlloc(&d, g));
    CU_OK(cuMemGetInfo(&f, &t));
    CHECK(f == g);
    CU_IS(cuMemAllocAsync(&d2, g + 1, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    /* configuring while memory is held is refused */
    CHECK(cudbl_configure(0, 16 * g, 0) == CUDA_ERROR_NOT_PERMITTED);
    CU_OK(cuMemFree(d));
    for (int i = 0; i < 3; i++) CU_OK(cuMemRelease(h[i]));
    CU_OK(cuMemGetInfo(&f, &t));
    CHECK(f == t);
    CHECK(counts_zero());
    CHECK(cudbl_configure(0, orig, 0) == CUDA_SUCCESS);
}

TEST(mem_alloc_and_free)
{
    REQUIRE(setup() == 0);
    CUdeviceptr d[8];
    for (int i = 0; i < 8; i++) {
        CU_OK(cuMemAlloc(&d[i], 100 + (size_t)i * 1000));
        CHECK(d[i] % 256 == 0);
        memset((void *)(uintptr_t)d[i], i, 100);
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    CU_OK(cuMemGetAddressRange(&base, &size, d[3] + 50));
    CHECK(base == d[3] && size == 3100);
    CU_IS(cuMemAlloc(&d[0], 0), CUDA_ERROR_INVALID_VALUE);
    for (int i = 0; i < 8; i++) CU_OK(cuMemFree(d[i]));
    CU_IS(cuMemFree(d[2]), CUDA_ERROR_INVALID_VALUE);       /* double free */
    CU_IS(cuMemFree(12345), CUDA_ERROR_INVALID_VALUE);
    CHECK(counts_zero());
}

/* ---- streams and events ------------------------------------------------------------------------ */

struct log { pthread_mutex_t mu; char buf[64]; int n; };
struct log_item { struct log *log; char c; };

static void log_append(void *arg)
{
    struct log_item *it = arg;
    pthread_mutex_lock(&it->log->mu);
    if (it->log->n < (int)sizeof it->log->buf - 1) it->log->buf[it->log->n++] = it->c;
    pthread_mutex_unlock(&it->log->mu);
}

static void set_flag(void *arg)
{
    *(volatile int *)arg = 1;
}

TEST(deferred_completion)
{
    REQUIRE(setup() == 0);
    CUstream s;
    CUevent e, never;
    volatile int ran = 0;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_OK(cuEventCreate(&e, CU_EVENT_DEFAULT));
    CU_OK(cuEventCreate(&never, CU_EVENT_DISABLE_TIMING));
    CU_OK(cuEventQuery(never));             /* never recorded: complete */
    CU_OK(cuStreamQuery(s));                /* idle */
    CHECK(cudbl_stream_enqueue(s, set_flag, (void *)&ran) == CUDA_SUCCESS);
    CU_OK(cuEventRecord(e, s));
    CHECK(ran == 0);                        /* nothing runs by itself */
    CU_IS(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    CU_IS(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK(cudbl_stream_pending(s) == 2);
    CU_OK(cuEventSynchronize(e));
    CHECK(ran == 1);
    CU_OK(cuEventQuery(e));
    CU_OK(cuStreamQuery(s));
    /* cudbl_progress and cuStreamSynchronize also drive the queue */
    ran = 0;
    CU_OK(cuLaunchHostFunc(s, set_flag, (void *)&ran));
    CHECK(ran == 0);
    CHECK(cudbl_progress(10) == 1);
    CHECK(ran == 1);
    ran = 0;
    CU_OK(cuLaunchHostFunc(s, set_flag, (void *)&ran));
    CU_OK(cuStreamSynchronize(s));
    CHECK(ran == 1);
    float ms = -1;
    CU_OK(cuEventElapsedTime(&ms, e, e));
    CHECK(ms == 0.0f);
    CU_IS(cuEventElapsedTime(&ms, e, never), CUDA_ERROR_INVALID_HANDLE);
    CU_OK(cuEventDestroy(e));
    CU_OK(cuEventDestroy(never));
    /* a destroyed handle is poisoned: using it again is misuse, not a clean error */
    CU_MISUSE(cuEventDestroy(never), CUDA_ERROR_INVALID_HANDLE);
    CU_MISUSE(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
    CU_OK(cuStreamDestroy(s));
    CU_MISUSE(cuStreamDestroy(s), CUDA_ERROR_INVALID_HANDLE);
    CU_MISUSE(cuLaunchHostFunc(s, set_flag, (void *)&ran), CUDA_ERROR_INVALID_HANDLE);
    CU_IS(cuStreamQuery((CUstream)(uintptr_t)0x1234560), CUDA_ERROR_INVALID_HANDLE); /* never a handle */
    CHECK(counts_zero());
}

TEST(cross_stream_wait_orders_work)
{
    REQUIRE(setup() == 0);
    struct log lg = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};
    struct log_item a = {&lg, 'A'}, b = {&lg, 'B'}, c = {&lg, 'C'}, d = {&lg, 'D'};
    CUstream s, t;
    CUevent e;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_OK(cuStreamCreate(&t, CU_STREAM_NON_BLOCKING));
    CU_OK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    CU_OK(cuLaunchHostFunc(t, log_append, &d));     /* before the wait: free to run */
    CU_OK(cuLaunchHostFunc(s, log_append, &a));
    CU_OK(cuEventRecord(e, s));
    CU_OK(cuLaunchHostFunc(s, log_append, &c));     /* after the record: not waited for */
    CU_OK(cuStreamWaitEvent(t, e, 0));
    CU_OK(cuLaunchHostFunc(t, log_append, &b));
    /* drive one item at a time: B must never run before A */
    while (cudbl_progress(1) == 1) {
        pthread_mutex_lock(&lg.mu);
        const char *pa = memchr(lg.buf, 'A', (size_t)lg.n), *pb = memchr(lg.buf, 'B', (size_t)lg.n);
        CHECK(!pb || (pa && pa < pb));
        pthread_mutex_unlock(&lg.mu);
    }
    CHECK(lg.n == 4);
    /* synchronizing the waiting stream runs what it waits for, and nothing more */
    lg.n = 0;
    CU_OK(cuLaunchHostFunc(s, log_append, &a));
    CU_OK(cuEventRecord(e, s));
    CU_OK(cuLaunchHostFunc(s, log_append, &c));
    CU_OK(cuStreamWaitEvent(t, e, 0));
    CU_OK(cuLaunchHostFunc(t, log_append, &b));
    CU_OK(cuStreamSynchronize(t));
    CHECK(lg.n == 2 && memcmp(lg.buf, "AB", 2) == 0);
    CHECK(cudbl_stream_pending(s) == 1);    /* C still queued */
    /* the wait uses the record at the time of the call; re-recording later changes nothing */
    CU_OK(cuStreamSynchronize(s));
    CU_OK(cuEventDestroy(e));
    CU_OK(cuStreamDestroy(s));
    CU_OK(cuStreamDestroy(t));
    CHECK(counts_zero());
}

TEST(legacy_default_stream_synchronizes)
{
    REQUIRE(setup() == 0);
    struct log lg = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};
    struct log_item x = {&lg, 'x'}, n = {&lg, 'n'}, l = {&lg, 'l'}, y = {&lg, 'y'};
    CUstream blocking, nonblocking;
    CU_OK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
    CU_OK(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING));
    CU_OK(cuLaunchHostFunc(blocking, log_append, &x));
    CU_OK(cuLaunchHostFunc(nonblocking, log_append, &n));
    CU_OK(cuLaunchHostFunc(NULL, log_append, &l));          /* waits for x, not for n */
    CU_OK(cuLaunchHostFunc(blocking, log_append, &y));      /* waits for l */
    CU_OK(cuStreamSynchronize(NULL));
    CHECK(lg.n == 2 && memcmp(lg.buf, "xl", 2) == 0);
    CU_OK(cuStreamSynchronize(blocking));
    CHECK(lg.n == 3 && lg.buf[2] == 'y');
    CU_OK(cuCtxSynchronize());
    CHECK(lg.n == 4 && lg.buf[3] == 'n');
    CU_OK(cuStreamDestroy(blocking));
    CU_OK(cuStreamDestroy(nonblocking));
    CHECK(counts_zero());
}

TEST(free_async_happens_in_stream_order)
{
    REQUIRE(setup() == 0);
    CUstream s;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr d = 0;
    CU_OK(cuMemAllocAsync(&d, 4096, s));
    volatile int ran = 0;
    CU_OK(cuLaunchHostFunc(s, set_flag, (void *)&ran));
    CU_OK(cuMemFreeAsync(d, s));
    CU_IS(cuMemFreeAsync(d, s), CUDA_ERROR_INVALID_VALUE);  /* already being freed */
    CU_IS(cuMemFree(d), CUDA_ERROR_INVALID_VALUE);
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.allocs == 1);                   /* the free waits behind the kernel */
    ((char *)(uintptr_t)d)[0] = 1;          /* still valid memory until then */
    CU_OK(cuStreamSynchronize(s));
    CHECK(ran == 1);
    cudbl_get_counts(&c);
    CHECK(c.allocs == 0);
    /* a stream destroyed with queued work still runs it */
    ran = 0;
    CU_OK(cuLaunchHostFunc(s, set_flag, (void *)&ran));
    CU_OK(cuStreamDestroy(s));
    CHECK(ran == 0);
    CU_OK(cuCtxSynchronize());
    CHECK(ran == 1);
    CHECK(counts_zero());
}

/* Async "GPU" thread with several host threads enqueuing and synchronizing at once. */
struct worker { int id; int errors; };
struct seq_item { int *last; int want; int *errors; };

static void check_seq(void *arg)
{
    struct seq_item *it = arg;
    if (*it->last != it->want - 1) (*it->errors)++;
    *it->last = it->want;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    if (cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS) { w->errors++; return NULL; }
    CUstream s, t;
    CUevent e;
    if (cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) || cuStreamCreate(&t, CU_STREAM_NON_BLOCKING) ||
        cuEventCreate(&e, CU_EVENT_DISABLE_TIMING)) {
        w->errors++;
        return NULL;
    }
    enum { N = 200 };
    static __thread struct seq_item items[N];
    int last = 0;
    for (int round = 0; round < 4; round++) {
        last = 0;
        for (int i = 0; i < N; i++) {
            items[i] = (struct seq_item){&last, i + 1, &w->errors};
            /* alternate streams, chained by events: a single order across both */
            CUstream on = i % 2 ? t : s, other = i % 2 ? s : t;
            if (cuLaunchHostFunc(on, check_seq, &items[i]) || cuEventRecord(e, on) ||
                cuStreamWaitEvent(other, e, 0))
                w->errors++;
        }
        if (cuStreamSynchronize(round % 2 ? s : t) || cuStreamSynchronize(round % 2 ? t : s))
            w->errors++;
        if (last != N) w->errors++;
    }
    cuEventDestroy(e);
    cuStreamDestroy(s);
    cuStreamDestroy(t);
    return NULL;
}

TEST(async_gpu_thread_and_concurrent_hosts)
{
    REQUIRE(setup() == 0);
    cudbl_set_async(1);
    enum { T = 4 };
    pthread_t th[T];
    struct worker w[T];
    for (int i = 0; i < T; i++) {
        w[i] = (struct worker){i, 0};
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        CHECKF(w[i].errors == 0, "worker %d: %d errors", i, w[i].errors);
    }
    /* the GPU thread completes work nobody waits for */
    volatile int ran = 0;
    CU_OK(cuLaunchHostFunc(NULL, set_flag, (void *)&ran));
    for (int i = 0; i < 2000 && cuStreamQuery(NULL) == CUDA_ERROR_NOT_READY; i++) usleep(1000);
    CU_OK(cuStreamQuery(NULL));
    CU_OK(cuStreamSynchronize(NULL));
    CHECK(ran == 1);
    cudbl_set_async(0);
    CHECK(counts_zero());
}

static void *vmm_worker(void *arg)
{
    int *errors = arg;
    size_t g = gran();
    for (int i = 0; i < 50; i++) {
        CUdeviceptr va = reserve(2 * g);
        CUmemGenericAllocationHandle h = create(g);
        if (!va || !h || cuMemMap(va + g, g, 0, h, 0) || grant(va + g, g)) { (*errors)++; continue; }
        *(volatile int *)(uintptr_t)(va + g) = i;
        if (cuMemUnmap(va + g, g) || cuMemRelease(h) || cuMemAddressFree(va, 2 * g)) (*errors)++;
    }
    return NULL;
}

TEST(concurrent_vmm_calls)
{
    REQUIRE(setup() == 0);
    pthread_t th[4];
    int errors[4] = {0};
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, vmm_worker, &errors[i]);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(errors[i] == 0);
    }
    CHECK(counts_zero());
}

/* ---- proc address and errors ------------------------------------------------------------------- */

#undef cuGetProcAddress
CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

TEST(proc_address_lookups)
{
    REQUIRE(setup() == 0);
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CU_OK(cuGetProcAddress_v2("cuMemAlloc", &p, 13000, 0, &st));
    CHECK(p == (void *)cuMemAlloc_v2 && st == CU_GET_PROC_ADDRESS_SUCCESS);
    CU_OK(cuGetProcAddress_v2("cuMemFree", &p, 12000, 0, &st));
    CHECK(p == (void *)cuMemFree_v2);
    CU_OK(cuGetProcAddress_v2("cuMemGetInfo", &p, 13000, 0, &st));
    CHECK(p == (void *)cuMemGetInfo_v2);
    CU_OK(cuGetProcAddress_v2("cuEventDestroy", &p, 13000, 0, &st));
    CHECK(p == (void *)cuEventDestroy_v2);
    CU_OK(cuGetProcAddress_v2("cuCtxPushCurrent", &p, 13000, 0, &st));
    CHECK(p == (void *)cuCtxPushCurrent_v2);
    CU_OK(cuGetProcAddress_v2("cuMemCreate", &p, 13000, 0, &st));
    CHECK(p == (void *)cuMemCreate);
    CU_OK(cuGetProcAddress_v2("cuGetProcAddress", &p, 13000, 0, &st));
    CHECK(p == (void *)cuGetProcAddress_v2);
    CU_OK(cuGetProcAddress_v2("cuGetProcAddress", &p, 11030, 0, &st));
    CHECK(p == (void *)cuGetProcAddress);
    /* an old ABI: cuEventDestroy before 4.0 is the unversioned symbol */
    CU_OK(cuGetProcAddress_v2("cuEventDestroy", &p, 3000, 0, &st));
    CHECK(p == dlsym(RTLD_DEFAULT, "cuEventDestroy"));
    /* per-thread default stream flavour */
    CU_OK(cuGetProcAddress_v2("cuStreamSynchronize", &p, 13000,
                              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    CHECK(p && p == dlsym(RTLD_DEFAULT, "cuStreamSynchronize_ptsz"));
    /* too old for the symbol, and unknown */
    CU_IS(cuGetProcAddress_v2("cuMemCreate", &p, 10010, 0, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && p == NULL);
    CU_IS(cuGetProcAddress_v2("cuNoSuchFunction", &p, 13000, 0, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && p == NULL);
    CU_IS(cuGetProcAddress("cuNoSuchFunction", &p, 13000, 0), CUDA_ERROR_NOT_FOUND);
    CU_OK(cuGetProcAddress("cuMemAlloc", &p, 13000, 0));
    CHECK(p == (void *)cuMemAlloc_v2);
}

/* Every ABI that changed in CUDA 12 and 13 for a name the double serves, looked up at each version
 * and held in cudaTypedefs.h's type for that version (an assignment the compiler checks against
 * the lookup's documented signature), then called the way a caller at that version calls it. */
static void *lookup_at(const char *name, int version, cuuint64_t flags)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = cuGetProcAddress_v2(name, &p, version, flags, &st);
    return r == CUDA_SUCCESS && st == CU_GET_PROC_ADDRESS_SUCCESS ? p : NULL;
}

static void count_host_fn(void *arg) { (*(volatile int *)arg)++; }

TEST(proc_address_cuda13_signatures)
{
    REQUIRE(setup() == 0);
    const cuuint64_t legacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                     pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    CUdevice dev = -1;

    /* cuCtxGetDevice: (CUdevice *) up to 12.9, cuCtxGetDevice_v2(CUdevice *, CUcontext) from 13.0 */
    PFN_cuCtxGetDevice_v2000 get_dev_v1 = (PFN_cuCtxGetDevice_v2000)lookup_at("cuCtxGetDevice", 12090, legacy);
    PFN_cuCtxGetDevice_v13000 get_dev = (PFN_cuCtxGetDevice_v13000)lookup_at("cuCtxGetDevice", 13000, legacy);
    REQUIRE(get_dev_v1 && get_dev);
    CHECK((void *)get_dev_v1 == dlsym(RTLD_DEFAULT, "cuCtxGetDevice"));
    CHECK((void *)get_dev == dlsym(RTLD_DEFAULT, "cuCtxGetDevice_v2"));
    CU_OK(get_dev_v1(&dev));
    CHECK(dev == 0);
    dev = -1;
    CU_OK(get_dev(&dev, NULL));             /* NULL: the current context */
    CHECK(dev == 0);
    dev = -1;
    CU_OK(get_dev(&dev, g_ctx));
    CHECK(dev == 0);
    CU_IS(get_dev(NULL, g_ctx), CUDA_ERROR_INVALID_VALUE);
    /* a value that is not a context: what the old signature's caller passes (a stale register) */
    CU_MISUSE(get_dev(&dev, (CUcontext)&dev), CUDA_ERROR_INVALID_CONTEXT);
    CUcontext gone = NULL, popped = NULL;
    CU_OK(cuCtxCreate_v2(&gone, 0, 0));
    CU_OK(cuCtxDestroy(gone));
    CU_IS(get_dev(&dev, gone), CUDA_ERROR_INVALID_CONTEXT);   /* destroyed: a clean error */
    CU_OK(cuCtxSetCurrent(g_ctx));
    /* with two devices the argument, not the current context, decides */
    if (cudbl_configure(2, 0, 0) == CUDA_SUCCESS) {
        CUcontext c1 = NULL;
        CU_OK(cuDevicePrimaryCtxRetain(&c1, 1));
        CU_OK(get_dev(&dev, c1));
        CHECK(dev == 1);
        CU_OK(cuCtxPushCurrent(c1));
        CU_OK(get_dev(&dev, g_ctx));
        CHECK(dev == 0);
        CU_OK(get_dev(&dev, NULL));
        CHECK(dev == 1);
        CU_OK(cuCtxPopCurrent(&popped));
        CU_OK(cuDevicePrimaryCtxRelease(1));
    }

    /* cuCtxSynchronize: (void) up to 12.9, cuCtxSynchronize_v2(CUcontext) from 13.0 */
    PFN_cuCtxSynchronize_v2000 sync_v1 = (PFN_cuCtxSynchronize_v2000)lookup_at("cuCtxSynchronize", 12090, legacy);
    PFN_cuCtxSynchronize_v13000 sync_ctx = (PFN_cuCtxSynchronize_v13000)lookup_at("cuCtxSynchronize", 13000, legacy);
    REQUIRE(sync_v1 && sync_ctx);
    CHECK((void *)sync_ctx == dlsym(RTLD_DEFAULT, "cuCtxSynchronize_v2"));
    CUstream s;
    volatile int ran = 0;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_OK(cuLaunchHostFunc(s, count_host_fn, (void *)&ran));
    CHECK(ran == 0);
    CU_OK(sync_ctx(g_ctx));                 /* waits for the context's streams */
    CHECK(ran == 1);
    CU_OK(cuLaunchHostFunc(s, count_host_fn, (void *)&ran));
    CU_OK(sync_ctx(NULL));
    CHECK(ran == 2);
    CU_OK(cuLaunchHostFunc(s, count_host_fn, (void *)&ran));
    CU_OK(sync_v1());
    CHECK(ran == 3);
    CU_MISUSE(sync_ctx((CUcontext)(uintptr_t)0x7f0012345678ull), CUDA_ERROR_INVALID_CONTEXT);
    CU_IS(sync_ctx(gone), CUDA_ERROR_INVALID_CONTEXT);

    /* cuStreamGetCtx: (CUstream, CUcontext *) up to 12.4, cuStreamGetCtx_v2 with a green context
     * out-argument from 12.5; both have per-thread forms */
    PFN_cuStreamGetCtx_v9020 stream_ctx_v1 = (PFN_cuStreamGetCtx_v9020)lookup_at("cuStreamGetCtx", 12040, legacy);
    PFN_cuStreamGetCtx_v12050 stream_ctx = (PFN_cuStreamGetCtx_v12050)lookup_at("cuStreamGetCtx", 13000, legacy);
    PFN_cuStreamGetCtx_v12050_ptsz stream_ctx_pt =
        (PFN_cuStreamGetCtx_v12050_ptsz)lookup_at("cuStreamGetCtx", 13000, pt);
    REQUIRE(stream_ctx_v1 && stream_ctx && stream_ctx_pt);
    CHECK((void *)stream_ctx == dlsym(RTLD_DEFAULT, "cuStreamGetCtx_v2"));
    CHECK((void *)stream_ctx_pt == dlsym(RTLD_DEFAULT, "cuStreamGetCtx_v2_ptsz"));
    CHECK(lookup_at("cuStreamGetCtx", 12040, pt) == dlsym(RTLD_DEFAULT, "cuStreamGetCtx_ptsz"));
    CUcontext sc = NULL;
    CUgreenCtx green = (CUgreenCtx)(uintptr_t)1;
    CU_OK(stream_ctx_v1(s, &sc));
    CHECK(sc == g_ctx);
    sc = NULL;
    CU_OK(stream_ctx(s, &sc, &green));
    CHECK(sc == g_ctx && green == NULL);
    sc = NULL;
    CU_OK(stream_ctx_pt(NULL, &sc, &green));  /* the thread's default stream */
    CHECK(sc == g_ctx);
    CU_IS(stream_ctx(s, &sc, NULL), CUDA_ERROR_INVALID_VALUE);

    /* cuLaunchHostFunc_v2 (13.1): a sync mode, 0 or 1 */
    PFN_cuLaunchHostFunc_v13010 host_fn = (PFN_cuLaunchHostFunc_v13010)lookup_at("cuLaunchHostFunc", 13010, legacy);
    REQUIRE(host_fn);
    CHECK(lookup_at("cuLaunchHostFunc", 13000, legacy) == dlsym(RTLD_DEFAULT, "cuLaunchHostFunc"));
    CHECK(lookup_at("cuLaunchHostFunc", 13010, pt) == dlsym(RTLD_DEFAULT, "cuLaunchHostFunc_v2_ptsz"));
    CU_OK(host_fn(s, count_host_fn, (void *)&ran, 1));
    CU_IS(host_fn(s, count_host_fn, (void *)&ran, 2), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuStreamSynchronize(s));
    CHECK(ran == 4);
    CU_OK(cuStreamDestroy(s));

    /* cuCtxCreate: _v2 (3.2), _v3 with execution affinity (11.4), _v4 with CUctxCreateParams (12.5) */
    PFN_cuCtxCreate_v11040 create_v3 = (PFN_cuCtxCreate_v11040)lookup_at("cuCtxCreate", 12040, legacy);
    PFN_cuCtxCreate_v12050 create_v4 = (PFN_cuCtxCreate_v12050)lookup_at("cuCtxCreate", 13000, legacy);
    REQUIRE(create_v3 && create_v4);
    CHECK(lookup_at("cuCtxCreate", 11030, legacy) == dlsym(RTLD_DEFAULT, "cuCtxCreate_v2"));
    CUcontext made = NULL;
    CU_OK(create_v3(&made, NULL, 0, 0, 0));
    CU_OK(cuCtxDestroy(made));
    CUexecAffinityParam aff;
    memset(&aff, 0, sizeof aff);
    CU_IS(create_v3(&made, &aff, 1, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    CU_OK(create_v4(&made, NULL, 0, 0));
    CU_OK(cuCtxDestroy(made));
    CU_OK(cuCtxSetCurrent(g_ctx));

    /* cuGraphInstantiate means cuGraphInstantiateWithFlags from 12.0; the 5-argument form before it
     * is not served (a caller at 11.4 must not get a 3-argument function) */
    PFN_cuGraphInstantiateWithFlags_v11040 inst =
        (PFN_cuGraphInstantiateWithFlags_v11040)lookup_at("cuGraphInstantiate", 12000, legacy);
    CHECK(inst && (void *)inst == dlsym(RTLD_DEFAULT, "cuGraphInstantiateWithFlags"));
    CHECK(lookup_at("cuGraphInstantiate", 11040, legacy) == NULL);

    /* per-thread forms appear at their own versions: cuEventRecord_ptsz at 7.0, and the
     * synchronous copies' _ptds */
    CHECK(lookup_at("cuEventRecord", 6050, pt) == dlsym(RTLD_DEFAULT, "cuEventRecord"));
    CHECK(lookup_at("cuEventRecord", 7000, pt) == dlsym(RTLD_DEFAULT, "cuEventRecord_ptsz"));
    PFN_cuMemcpyHtoD_v7000_ptds htod_pt = (PFN_cuMemcpyHtoD_v7000_ptds)lookup_at("cuMemcpyHtoD", 13000, pt);
    CHECK((void *)htod_pt == dlsym(RTLD_DEFAULT, "cuMemcpyHtoD_v2_ptds"));
    CUdeviceptr d = 0;
    CU_OK(cuMemAlloc(&d, 64));
    char in[64] = "per-thread copy", out[64] = {0};
    REQUIRE(htod_pt);
    CU_OK(htod_pt(d, in, sizeof in));
    CU_OK(cuMemcpyDtoH(out, d, sizeof out));
    CHECK(strcmp(out, in) == 0);
    CU_OK(cuMemFree(d));
    CHECK(counts_zero());
}

/* Every context-taking call refuses a value that never was a context as misuse (a real driver
 * dereferences it), and a destroyed context with CUDA_ERROR_INVALID_CONTEXT. */
TEST(context_arguments_that_are_not_contexts)
{
    REQUIRE(setup() == 0);
    CUcontext junk = (CUcontext)(uintptr_t)0x7f00deadbe00ull;
    CU_MISUSE(cuCtxSetCurrent(junk), CUDA_ERROR_INVALID_CONTEXT);
    CU_MISUSE(cuCtxPushCurrent(junk), CUDA_ERROR_INVALID_CONTEXT);
    CU_MISUSE(cuCtxDestroy(junk), CUDA_ERROR_INVALID_CONTEXT);
    CU_MISUSE(cuCtxEnablePeerAccess(junk, 0), CUDA_ERROR_INVALID_CONTEXT);
    CU_MISUSE(cuCtxGetDevice_v2(&(CUdevice){0}, junk), CUDA_ERROR_INVALID_CONTEXT);
    CU_MISUSE(cuCtxSynchronize_v2(junk), CUDA_ERROR_INVALID_CONTEXT);
    CUcontext cur = NULL;
    CU_OK(cuCtxGetCurrent(&cur));
    CHECK(cur == g_ctx);                    /* nothing changed */
}

TEST(error_names)
{
    const char *s = NULL;
    CU_OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    CHECK(s && strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    CU_OK(cuGetErrorString(CUDA_ERROR_NOT_READY, &s));
    CHECK(s && strcmp(s, "device not ready") == 0);
    static const CUresult used[] = {
        CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE,
        CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_FOUND,
        CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_UNKNOWN,
    };
    for (size_t i = 0; i < sizeof used / sizeof used[0]; i++) {
        s = NULL;
        CU_OK(cuGetErrorName(used[i], &s));
        CHECK(s && strncmp(s, "CUDA_", 5) == 0);
        s = NULL;
        CU_OK(cuGetErrorString(used[i], &s));
        CHECK(s && *s);
    }
    CU_IS(cuGetErrorName((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    CHECK(s == NULL);
}

/* ---- fault injection --------------------------------------------------------------------------- */

TEST(fault_injection_nth_call)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    long c0 = cudbl_call_count("cuMemCreate");
    CHECK(c0 >= 0);
    cudbl_fail_nth("cuMemCreate", 2, CUDA_ERROR_OUT_OF_MEMORY);
    CUmemAllocationProp p = prop_on(0);
    CUmemGenericAllocationHandle h[3] = {0};
    CU_OK(cuMemCreate(&h[0], g, &p, 0));
    CU_IS(cuMemCreate(&h[1], g, &p, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CU_OK(cuMemCreate(&h[2], g, &p, 0));
    CHECK(cudbl_call_count("cuMemCreate") == c0 + 3);
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.handles == 2);                  /* the failed call had no effect */
    /* default error and a chosen error, by versioned name too */
    CUdeviceptr va = reserve(g);
    cudbl_fail_nth("cuMemMap", 1, CUDA_SUCCESS);
    CU_IS(cuMemMap(va, g, 0, h[0], 0), CUDA_ERROR_UNKNOWN);
    CU_OK(cuMemMap(va, g, 0, h[0], 0));
    CUdeviceptr d;
    cudbl_fail_nth("cuMemAlloc_v2", 1, CUDA_SUCCESS);
    CU_IS(cuMemAlloc(&d, 100), CUDA_ERROR_OUT_OF_MEMORY);
    cudbl_fail_nth("cuMemUnmap", 1, CUDA_ERROR_INVALID_VALUE);
    CU_IS(cuMemUnmap(va, g), CUDA_ERROR_INVALID_VALUE);
    cudbl_fail_nth("cuMemUnmap", 1, CUDA_ERROR_INVALID_VALUE);
    cudbl_fail_clear();
    CU_OK(cuMemUnmap(va, g));
    CHECK(cudbl_call_count("cuNoSuchFunction") == -1);
    CHECK(cudbl_call_count("cuMemAlloc") == cudbl_call_count("cuMemAlloc_v2"));
    CU_OK(cuMemRelease(h[0]));
    CU_OK(cuMemRelease(h[2]));
    CU_OK(cuMemAddressFree(va, g));
    CHECK(counts_zero());
}

static unsigned long long fail_pattern(unsigned long long seed)
{
    unsigned long long bits = 0;
    int n;
    cudbl_fail_prob("cuDeviceGetCount", 0.3, seed, CUDA_ERROR_NOT_PERMITTED);
    for (int i = 0; i < 64; i++)
        if (cuDeviceGetCount(&n) == CUDA_ERROR_NOT_PERMITTED) bits |= 1ull << i;
    cudbl_fail_clear();
    return bits;
}

TEST(fault_injection_probability_is_deterministic)
{
    REQUIRE(setup() == 0);
    unsigned long long a = fail_pattern(42), b = fail_pattern(42), c = fail_pattern(43);
    CHECK(a == b);
    CHECK(a != c);
    int ones = __builtin_popcountll(a);
    CHECKF(ones > 5 && ones < 40, "%d of 64 failed at p=0.3", ones);
    int n;
    CU_OK(cuDeviceGetCount(&n));
}

/* ---- several devices --------------------------------------------------------------------------- */

TEST(multi_device)
{
    REQUIRE(setup() == 0);
    int n0 = 0, n = 0;
    CU_OK(cuDeviceGetCount(&n0));
    REQUIRE(cudbl_configure(2, 0, 0) == CUDA_SUCCESS);
    CU_OK(cuDeviceGetCount(&n));
    CHECK(n == 2);
    CUdevice d1;
    CU_OK(cuDeviceGet(&d1, 1));
    CU_IS(cuDeviceGet(&d1, 2), CUDA_ERROR_INVALID_DEVICE);
    CUcontext c1;
    CU_OK(cuDevicePrimaryCtxRetain(&c1, 1));
    CHECK(c1 != g_ctx);
    size_t g = gran(), f0a, f0b, f1a, f1b, t;
    CU_OK(cuMemGetInfo(&f0a, &t));
    CU_OK(cuCtxPushCurrent(c1));
    CU_OK(cuMemGetInfo(&f1a, &t));
    CUmemAllocationProp p = prop_on(1);
    CUmemGenericAllocationHandle h;
    CU_OK(cuMemCreate(&h, 2 * g, &p, 0));
    CUdeviceptr d;
    CU_OK(cuMemAlloc(&d, 4096));            /* on the current context's device: 1 */
    CU_OK(cuMemGetInfo(&f1b, &t));
    CHECK(f1b == f1a - 2 * g - 4096);
    CUdevice dev;
    CU_OK(cuCtxGetDevice(&dev));
    CHECK(dev == 1);
    CUcontext popped;
    CU_OK(cuCtxPopCurrent(&popped));
    CHECK(popped == c1);
    CU_OK(cuMemGetInfo(&f0b, &t));
    CHECK(f0b == f0a);                      /* device 0 untouched */
    /* access can be granted to device 1 */
    CUdeviceptr va = reserve(2 * g);
    CU_OK(cuMemMap(va, 2 * g, 0, h, 0));
    CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, 1}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CU_OK(cuMemSetAccess(va, 2 * g, &desc, 1));
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_OK(cuMemAddressFree(va, 2 * g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemFree(d));
    CU_OK(cuDevicePrimaryCtxRelease(1));
    CHECK(counts_zero());
    CHECK(cudbl_configure(n0, 0, 0) == CUDA_SUCCESS);
}

/* ---- strict rules: per-device access, peers, contexts, poisoned handles ------------------------ */

static CUcontext ctx_of(int dev)
{
    CUcontext c = NULL;
    cuDevicePrimaryCtxRetain(&c, dev);
    return c;
}

static CUresult grant_dev(CUdeviceptr va, size_t size, int dev, unsigned flags)
{
    CUmemAccessDesc d = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, (CUmemAccess_flags)flags};
    return cuMemSetAccess(va, size, &d, 1);
}

static void note_kernel(void *arg) { (*(volatile int *)arg)++; }

TEST(access_is_per_device)
{
    REQUIRE(setup() == 0);
    int n0 = 0;
    CU_OK(cuDeviceGetCount(&n0));
    REQUIRE(cudbl_configure(2, 0, 0) == CUDA_SUCCESS);
    size_t g = gran();
    CUdeviceptr va = reserve(2 * g);
    CUmemGenericAllocationHandle h = create(g);     /* device 0's memory */
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, g, 0, h, 0));
    CU_OK(grant_dev(va, g, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    unsigned long long f = 99;
    CUmemLocation l0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0}, l1 = {CU_MEM_LOCATION_TYPE_DEVICE, 1};
    CU_OK(cuMemGetAccess(&f, &l0, va));
    CHECK(f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CU_OK(cuMemGetAccess(&f, &l1, va));
    CHECK(f == CU_MEM_ACCESS_FLAGS_PROT_NONE);       /* answered per location */
    CHECK(cudbl_check_access(0, va, 64, 1) == CUDA_SUCCESS);
    CHECK(cudbl_check_access(1, va, 64, 0) == CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK(cudbl_check_access(0, va + g, 64, 0) == CUDA_ERROR_ILLEGAL_ADDRESS);  /* not mapped */
    /* a copy runs on the current context's device: device 1 may not touch it yet */
    CUcontext c1 = ctx_of(1);
    char buf[64] = "peer";
    CU_OK(cuCtxPushCurrent(c1));
    CU_MISUSE(cuMemcpyHtoD(va, buf, sizeof buf), CUDA_ERROR_ILLEGAL_ADDRESS);
    /* read-only access: reads pass, writes fault */
    CU_OK(grant_dev(va, g, 1, CU_MEM_ACCESS_FLAGS_PROT_READ));
    CU_OK(cuMemcpyDtoH(buf, va, sizeof buf));
    CU_MISUSE(cuMemcpyHtoD(va, buf, sizeof buf), CUDA_ERROR_ILLEGAL_ADDRESS);
    CU_OK(grant_dev(va, g, 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU_OK(cuMemcpyHtoD(va, "peer", 5));
    CU_OK(cuMemGetAccess(&f, &l0, va));
    CHECK(f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);  /* device 0 keeps its own */
    /* an emulated kernel on device 1 touching it: allowed now; checked when it runs */
    volatile int ran = 0;
    CHECK(cudbl_launch(NULL, va, 64, 1, note_kernel, (void *)&ran) == CUDA_SUCCESS);
    CU_OK(cuCtxSynchronize());
    CHECK(ran == 1);
    CU_OK(grant_dev(va, g, 1, CU_MEM_ACCESS_FLAGS_PROT_NONE));
    cudbl_set_misuse_abort(0);
    long m0 = misuse_count();
    CHECK(cudbl_launch(NULL, va, 64, 0, note_kernel, (void *)&ran) == CUDA_SUCCESS);
    CU_OK(cuCtxSynchronize());
    CHECK(ran == 1 && misuse_count() == m0 + 1);     /* faulted: it did not run */
    cudbl_set_misuse_abort(1);
    /* a launch needs its stream's context current */
    CUstream s0;
    CU_OK(cuCtxPopCurrent(NULL));
    CU_OK(cuStreamCreate(&s0, CU_STREAM_NON_BLOCKING));
    CU_OK(cuCtxPushCurrent(c1));
    CHECK(cudbl_launch(s0, va, 64, 0, note_kernel, (void *)&ran) == CUDA_ERROR_INVALID_HANDLE);
    CU_OK(cuCtxPopCurrent(NULL));
    CU_OK(cuStreamDestroy(s0));
    /* device-only arguments that are host memory are a clean error */
    CU_IS(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)buf, buf, 8), CUDA_ERROR_INVALID_VALUE);
    char other[8];
    CU_OK(cuMemcpyDtoH(buf, va, 5));                 /* what device 1 wrote */
    CU_OK(cuMemcpy((CUdeviceptr)(uintptr_t)other, (CUdeviceptr)(uintptr_t)buf, 5));  /* host to host */
    CHECK(memcmp(other, "peer", 5) == 0);
    CU_OK(cuMemUnmap(va, g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, 2 * g));
    CU_OK(cuDevicePrimaryCtxRelease(1));
    CHECK(counts_zero());
    CHECK(cudbl_configure(n0, 0, 0) == CUDA_SUCCESS);
}

/* Host memory through VMM (issue 20): cuMemCreate with a HOST_NUMA or HOST location where the
 * device attributes say the driver has it, charged to the host and never to the device, no IPC,
 * mapped into the device's address space and reached by any device once granted (no peer rule:
 * it is not another device's memory), its data kept through every remap. */
TEST(host_located_handles)
{
    REQUIRE(setup() == 0);
    int n0 = 0;
    CU_OK(cuDeviceGetCount(&n0));
    REQUIRE(cudbl_configure(2, 0, 0) == CUDA_SUCCESS);
    REQUIRE(cudbl_set_peer(0, 1, 0) == 0); /* no P2P: host memory is reached anyway */
    size_t g = gran();
    int numa = -1, host = -1, nid = -1;
    CU_OK(cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CU_OK(cuDeviceGetAttribute(&host, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CU_OK(cuDeviceGetAttribute(&nid, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, 0));
    CHECK(numa == 1 && host == 1 && nid == 0);
    CUmemAllocationProp hp = prop_on(0);
    hp.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    hp.location.id = 0;
    size_t hg = 0;
    CU_OK(cuMemGetAllocationGranularity(&hg, &hp, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(hg == g);
    hp.location.id = 3; /* no such NUMA node */
    CUmemGenericAllocationHandle hh = 0;
    CU_IS(cuMemCreate(&hh, g, &hp, 0), CUDA_ERROR_INVALID_VALUE);
    hp.location.id = 0;
    size_t free0 = 0, total = 0, free1 = 0;
    CU_OK(cuMemGetInfo(&free0, &total));
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    CU_OK(cuMemCreate(&hh, 2 * g, &hp, 0));
    CU_OK(cuMemGetInfo(&free1, &total));
    cudbl_get_counts(&c1);
    CHECK(free1 == free0);                       /* not device memory */
    CHECK(c1.bytes_in_use == c0.bytes_in_use && c1.host_bytes_in_use == c0.host_bytes_in_use + 2 * g &&
          c1.host_handles == c0.host_handles + 1 && c1.handles == c0.handles + 1);
    CUmemAllocationProp got;
    CU_OK(cuMemGetAllocationPropertiesFromHandle(&got, hh));
    CHECK(got.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA && got.requestedHandleTypes == 0);
    int fd = -1;
    CU_IS(cuMemExportToShareableHandle(&fd, hh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          CUDA_ERROR_INVALID_VALUE);
    /* the move a spill makes: device data copied into the host handle, then the host handle
     * mapped where the device handle was */
    CUdeviceptr va = reserve(2 * g), scratch = reserve(2 * g);
    CUmemGenericAllocationHandle dh = create(2 * g);
    REQUIRE(va && scratch && dh);
    CU_OK(cuMemMap(va, 2 * g, 0, dh, 0));
    CU_OK(grant(va, 2 * g));
    uint32_t *pv = (uint32_t *)(uintptr_t)va;
    for (size_t i = 0; i < 2 * g / 4; i += 509) pv[i] = (uint32_t)(i * 2654435761u);
    CU_OK(cuMemMap(scratch, 2 * g, 0, hh, 0));
    CU_OK(grant(scratch, 2 * g));
    CU_OK(cuMemcpyDtoD(scratch, va, 2 * g));
    CU_OK(cuMemUnmap(scratch, 2 * g));
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_OK(cuMemMap(va, 2 * g, 0, hh, 0));
    CU_OK(grant(va, 2 * g));
    CU_OK(cuMemRelease(dh));
    int bad = 0;
    for (size_t i = 0; i < 2 * g / 4; i += 509) bad += pv[i] != (uint32_t)(i * 2654435761u);
    CHECK(bad == 0);
    CHECK(cudbl_check_access(0, va, 64, 1) == CUDA_SUCCESS);
    /* device 1 is not peer capable with device 0, yet may be granted host memory */
    CU_OK(grant_dev(va, 2 * g, 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CHECK(cudbl_check_access(1, va + g, 64, 1) == CUDA_SUCCESS);
    /* the host's own access may be named for host memory, never for device memory */
    CUmemAccessDesc hd;
    memset(&hd, 0, sizeof hd);
    hd.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    hd.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(cuMemSetAccess(va, 2 * g, &hd, 1));
    CUdeviceptr va2 = reserve(g);
    CUmemGenericAllocationHandle d2 = create(g);
    REQUIRE(va2 && d2);
    CU_OK(cuMemMap(va2, g, 0, d2, 0));
    CU_IS(cuMemSetAccess(va2, g, &hd, 1), CUDA_ERROR_INVALID_VALUE);
    CU_OK(cuMemUnmap(va2, g));
    CU_OK(cuMemRelease(d2));
    CU_OK(cuMemAddressFree(va2, g));
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_OK(cuMemRelease(hh));
    CHECK(cudbl_host_peak() >= 2 * g);
    /* the host's capacity, and a driver without host VMM */
    REQUIRE(cudbl_set_host(-1, g) == CUDA_SUCCESS);
    CU_IS(cuMemCreate(&hh, 2 * g, &hp, 0), CUDA_ERROR_OUT_OF_MEMORY);
    REQUIRE(cudbl_set_host(CUDBL_HOST_VMM_HOST, 64 * g) == CUDA_SUCCESS);
    CU_OK(cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CHECK(numa == 0);
    CU_IS(cuMemCreate(&hh, g, &hp, 0), CUDA_ERROR_NOT_SUPPORTED);
    hp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CU_OK(cuMemCreate(&hh, g, &hp, 0));
    CHECK(cudbl_set_host(0, 0) == CUDA_ERROR_NOT_PERMITTED); /* not while host handles live */
    CU_OK(cuMemRelease(hh));
    REQUIRE(cudbl_set_host(0, 0) == CUDA_SUCCESS);
    CU_OK(cuDeviceGetAttribute(&host, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CHECK(host == 0);
    CU_IS(cuMemCreate(&hh, g, &hp, 0), CUDA_ERROR_NOT_SUPPORTED);
    REQUIRE(cudbl_set_host(CUDBL_HOST_VMM_NUMA | CUDBL_HOST_VMM_HOST, 64ull << 30) == CUDA_SUCCESS);
    CU_OK(cuMemAddressFree(va, 2 * g));
    CU_OK(cuMemAddressFree(scratch, 2 * g));
    REQUIRE(cudbl_set_peer(0, 1, 1) == 0);
    CHECK(counts_zero());
    CHECK(cudbl_configure(n0, 0, 0) == CUDA_SUCCESS);
}

TEST(peer_capability)
{
    REQUIRE(setup() == 0);
    int n0 = 0, can = -1;
    CU_OK(cuDeviceGetCount(&n0));
    REQUIRE(cudbl_configure(3, 0, 0) == CUDA_SUCCESS);
    CU_OK(cuDeviceCanAccessPeer(&can, 0, 1));
    CHECK(can == 1);                                 /* default: every pair */
    CU_OK(cuDeviceCanAccessPeer(&can, 0, 0));
    CHECK(can == 0);
    CU_IS(cuDeviceCanAccessPeer(&can, 0, 3), CUDA_ERROR_INVALID_DEVICE);
    REQUIRE(cudbl_set_peer(0, 2, 0) == CUDA_SUCCESS);
    CU_OK(cuDeviceCanAccessPeer(&can, 2, 0));
    CHECK(can == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(g);
    CUmemGenericAllocationHandle h = create(g);
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, g, 0, h, 0));
    /* device 2 cannot reach device 0: no access can be granted, and nothing changes */
    CUmemAccessDesc two[2] = {{{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE},
                              {{CU_MEM_LOCATION_TYPE_DEVICE, 2}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
    CU_IS(cuMemSetAccess(va, g, two, 2), CUDA_ERROR_INVALID_DEVICE);
    unsigned long long f = 99;
    CUmemLocation l0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CU_OK(cuMemGetAccess(&f, &l0, va));
    CHECK(f == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    two[1].location.id = 1;
    CU_OK(cuMemSetAccess(va, g, two, 2));
    CHECK(cudbl_check_access(1, va, g, 1) == CUDA_SUCCESS);
    /* from device 2 (no P2P with 0) a copy is staged through the owner; a kernel cannot be */
    unsigned char tmp[16];
    CU_OK(cuCtxPushCurrent(ctx_of(2)));
    CU_OK(cuMemcpyDtoH(tmp, va, sizeof tmp));
    volatile int k2 = 0;
    CU_MISUSE((cudbl_launch(NULL, va, 16, 0, note_kernel, (void *)&k2), cuCtxSynchronize()), CUDA_SUCCESS);
    CHECK(k2 == 0);
    CU_OK(cuCtxPopCurrent(NULL));
    CU_OK(cuDevicePrimaryCtxRelease(2));
    /* cuCtxEnablePeerAccess: for cuMemAlloc memory only (kernels); VMM needs cuMemSetAccess */
    CUcontext c0 = ctx_of(0), c1 = ctx_of(1), c2 = ctx_of(2);
    CUdeviceptr d1 = 0;
    CU_OK(cuCtxPushCurrent(c1));
    CU_OK(cuMemAlloc(&d1, 4096));
    CU_OK(cuCtxPopCurrent(NULL));
    volatile int ran = 0;
    CU_MISUSE((cudbl_launch(NULL, d1, 64, 1, note_kernel, (void *)&ran), cuCtxSynchronize()), CUDA_SUCCESS);
    CHECK(ran == 0);
    CU_OK(cuCtxEnablePeerAccess(c1, 0));
    CU_IS(cuCtxEnablePeerAccess(c1, 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    CU_IS(cuCtxEnablePeerAccess(c0, 0), CUDA_ERROR_INVALID_DEVICE);
    CU_IS(cuCtxEnablePeerAccess(c2, 0), CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    CHECK(cudbl_launch(NULL, d1, 64, 1, note_kernel, (void *)&ran) == CUDA_SUCCESS);
    CU_OK(cuCtxSynchronize());
    CHECK(ran == 1);
    CU_OK(cuCtxDisablePeerAccess(c1));
    CU_IS(cuCtxDisablePeerAccess(c1), CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    /* a peer copy: each side by its own context's device */
    CUdeviceptr d0 = 0;
    CU_OK(cuMemAlloc(&d0, 4096));
    CU_OK(cuMemsetD8(d0, 0x3c, 4096));
    CU_OK(cuMemcpyPeer(d1, c1, d0, c0, 4096));
    unsigned char back = 0;
    CU_OK(cuMemcpyDtoH(&back, d1 + 4095, 1));
    CHECK(back == 0x3c);
    CU_OK(cuMemFree(d0));
    CU_OK(cuMemFree(d1));
    CU_OK(cuMemUnmap(va, g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, g));
    cudbl_set_peer(0, 2, 1);
    for (int d = 0; d < 3; d++) CU_OK(cuDevicePrimaryCtxRelease(d));
    CHECK(counts_zero());
    CHECK(cudbl_configure(n0, 0, 0) == CUDA_SUCCESS);
}

TEST(events_and_streams_belong_to_a_context)
{
    REQUIRE(setup() == 0);
    CUcontext other;
    CU_OK(cuCtxCreate_v2(&other, 0, 0));    /* current now */
    CUevent e;
    CU_OK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    CU_OK(cuCtxPopCurrent(NULL));
    CUstream s;
    CU_OK(cuStreamCreate(&s, 0));
    CU_IS(cuEventRecord(e, s), CUDA_ERROR_INVALID_HANDLE);      /* different contexts */
    CU_IS(cuEventRecord(e, NULL), CUDA_ERROR_INVALID_HANDLE);
    CUcontext sc = NULL;
    CU_OK(cuStreamGetCtx(s, &sc));
    CHECK(sc == g_ctx);
    CU_OK(cuEventDestroy(e));
    CU_OK(cuStreamDestroy(s));
    /* the streams of a destroyed context are dead handles */
    CU_OK(cuCtxPushCurrent(other));
    CU_OK(cuStreamCreate(&s, 0));
    CU_OK(cuCtxDestroy(other));
    CU_MISUSE(cuStreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
    REQUIRE(setup() == 0);
    CHECK(counts_zero());
}

TEST(vmm_calls_need_no_context_but_queries_do)
{
    /* cuda.h lists CUDA_ERROR_INVALID_CONTEXT for none of the VMM calls, and for
     * cuMemGetAddressRange, cuPointerGetAttribute and cuIpcGetMemHandle */
    REQUIRE(setup() == 0);
    CU_OK(cuCtxSetCurrent(NULL));
    size_t g = gran();
    CUdeviceptr va = reserve(g), base = 0;
    CUmemGenericAllocationHandle h = create(g);
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, g, 0, h, 0));
    CU_OK(grant(va, g));
    size_t sz = 0;
    CU_IS(cuMemGetAddressRange(&base, &sz, va), CUDA_ERROR_INVALID_CONTEXT);
    CU_IS(cuPointerGetAttribute(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, va), CUDA_ERROR_INVALID_CONTEXT);
    REQUIRE(setup() == 0);
    CU_OK(cuMemGetAddressRange(&base, &sz, va + 100));
    CHECK(base == va && sz == g);
    CU_OK(cuMemUnmap(va, g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, g));
    CHECK(counts_zero());
}

TEST(pointer_attributes_describe_one_allocation)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(4 * g);
    CUmemGenericAllocationHandle h1 = create(g), h2 = create(g);
    REQUIRE(va && h1 && h2);
    CU_OK(cuMemMap(va, g, 0, h1, 0));
    CU_OK(cuMemMap(va + g, g, 0, h2, 0));
    CU_OK(grant(va, 2 * g));
    /* two adjacent mappings are two ranges, whatever a caller placed across them */
    CUdeviceptr start = 0;
    size_t size = 0;
    int ipc = -1, ord = -1;
    CU_OK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, va + g + 10));
    CU_OK(cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, va + g + 10));
    CHECK(start == va + g && size == g);
    CU_OK(cuPointerGetAttribute(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, va));
    CHECK(ipc == 0);
    CUdeviceptr d = 0;
    CU_OK(cuMemAlloc(&d, 10000));
    CU_OK(cuPointerGetAttribute(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, d + 7));
    CU_OK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 7));
    CU_OK(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d + 7));
    CHECK(ipc == 1 && start == d && ord == 0);
    char host[16];
    CU_IS(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)host),
          CUDA_ERROR_INVALID_VALUE);
    unsigned int type = 99;
    CUpointer_attribute at[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void *out[2] = {&type, &size};
    CU_OK(cuPointerGetAttributes(2, at, out, (CUdeviceptr)(uintptr_t)host));  /* not an error */
    CHECK(type == 0 && size == 0);
    CU_OK(cuPointerGetAttributes(2, at, out, d));
    CHECK(type == CU_MEMORYTYPE_DEVICE && size == 10000);
    CU_OK(cuMemFree(d));
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_OK(cuMemRelease(h1));
    CU_OK(cuMemRelease(h2));
    CU_OK(cuMemAddressFree(va, 4 * g));
    CHECK(counts_zero());
}

TEST(legacy_ipc_refuses_vmm_memory)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    CUdeviceptr va = reserve(g), d = 0, opened = 0;
    CUmemGenericAllocationHandle h = create(g);
    REQUIRE(va && h);
    CU_OK(cuMemMap(va, g, 0, h, 0));
    CU_OK(grant(va, g));
    CUipcMemHandle ih;
    CU_IS(cuIpcGetMemHandle(&ih, va), CUDA_ERROR_INVALID_VALUE);    /* VMM memory */
    CU_OK(cuMemAlloc(&d, 4096));
    CU_IS(cuIpcGetMemHandle(&ih, d + 512), CUDA_ERROR_INVALID_VALUE); /* not the base */
    CU_OK(cuIpcGetMemHandle(&ih, d));
    CU_IS(cuIpcOpenMemHandle(&opened, ih, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_CONTEXT);
    CU_OK(cuMemFree(d));
    CU_OK(cuMemUnmap(va, g));
    CU_OK(cuMemRelease(h));
    CU_OK(cuMemAddressFree(va, g));
    CHECK(counts_zero());
}

TEST(shareable_handles_export_and_import)
{
    REQUIRE(setup() == 0);
    size_t g = gran();
    int v = 0;
    CU_OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
    CHECK(v == 1);
    CUmemAllocationProp p = prop_on(0);
    CUmemGenericAllocationHandle plain = create(g), sh = 0, imp = 0;
    int fd = -1;
    REQUIRE(plain);
    CU_IS(cuMemExportToShareableHandle(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          CUDA_ERROR_INVALID_VALUE);                 /* not created shareable */
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    CU_IS(cuMemCreate(&sh, g, &p, 0), CUDA_ERROR_NOT_SUPPORTED);
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CU_OK(cuMemCreate(&sh, g, &p, 0));
    CU_OK(cuMemExportToShareableHandle(&fd, sh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CHECK(fd >= 0);
    CU_OK(cuMemImportFromShareableHandle(&imp, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CHECK(imp == sh);                                /* same process: the same allocation */
    CUdeviceptr va = reserve(2 * g);
    CU_OK(cuMemMap(va, g, 0, sh, 0));
    CU_OK(cuMemMap(va + g, g, 0, imp, 0));
    CU_OK(grant(va, 2 * g));
    ((volatile char *)(uintptr_t)va)[9] = 'x';
    CHECK(((volatile char *)(uintptr_t)(va + g))[9] == 'x');
    unsigned long long types = 0;
    CU_OK(cuPointerGetAttribute(&types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, va));
    CHECK(types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CU_OK(cuMemUnmap(va, 2 * g));
    CU_OK(cuMemRelease(sh));
    CU_OK(cuMemRelease(imp));
    CU_OK(cuMemRelease(plain));
    CU_OK(cuMemAddressFree(va, 2 * g));
    close(fd);
    CHECK(counts_zero());
}

/* ---- stream capture ---------------------------------------------------------------------------- */

static void count_up(void *arg) { __atomic_fetch_add((int *)arg, 1, __ATOMIC_RELAXED); }

struct other_thread { CUstreamCaptureMode mode; CUstream s; CUresult r; };
static void *unsafe_from_other_thread(void *arg)
{
    struct other_thread *o = arg;
    cuCtxSetCurrent(g_ctx);
    CUstreamCaptureMode m = o->mode;
    cuThreadExchangeStreamCaptureMode(&m);
    CUdeviceptr d = 0;
    o->r = o->s ? cuStreamEndCapture(o->s, &(CUgraph){0}) : cuMemAlloc(&d, 4096);
    if (d) cuMemFree(d);
    return NULL;
}

static CUresult run_other(CUstreamCaptureMode mode, CUstream end)
{
    struct other_thread o = {mode, end, CUDA_SUCCESS};
    pthread_t t;
    pthread_create(&t, NULL, unsafe_from_other_thread, &o);
    pthread_join(t, NULL);
    return o.r;
}

TEST(stream_capture_records_and_replays)
{
    REQUIRE(setup() == 0);
    CUstream s, t;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_OK(cuStreamCreate(&t, CU_STREAM_NON_BLOCKING));
    CUevent fork, join;
    CU_OK(cuEventCreate(&fork, CU_EVENT_DISABLE_TIMING));
    CU_OK(cuEventCreate(&join, CU_EVENT_DISABLE_TIMING));
    CU_IS(cuStreamBeginCapture(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_IS(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_ILLEGAL_STATE);
    int n = 0;
    CU_OK(cuLaunchHostFunc(s, count_up, &n));
    CU_OK(cuEventRecord(fork, s));
    CU_OK(cuStreamWaitEvent(t, fork, 0));            /* t joins the capture */
    CUstreamCaptureStatus st;
    cuuint64_t id1 = 0, id2 = 0;
    CU_OK(cuStreamIsCapturing(t, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CU_OK(cuStreamGetCaptureInfo(s, &st, &id1, NULL, NULL, NULL, NULL));
    CU_OK(cuStreamGetCaptureInfo(t, &st, &id2, NULL, NULL, NULL, NULL));
    CHECK(id1 && id1 == id2);
    CU_OK(cuLaunchHostFunc(t, count_up, &n));
    CU_OK(cuEventRecord(join, t));
    CU_OK(cuStreamWaitEvent(s, join, 0));            /* joined back */
    CHECK(n == 0);                                   /* captured, not run */
    CU_IS(cuEventQuery(join), CUDA_ERROR_CAPTURED_EVENT);   /* ... and that invalidates */
    CUgraph gr = (CUgraph)1;
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(gr == NULL);
    CU_OK(cuStreamIsCapturing(t, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);      /* the whole sequence ended */
    /* again, properly */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_OK(cuLaunchHostFunc(s, count_up, &n));
    CU_OK(cuEventRecord(fork, s));
    CU_OK(cuStreamWaitEvent(t, fork, 0));
    CU_OK(cuLaunchHostFunc(t, count_up, &n));
    CU_OK(cuEventRecord(join, t));
    CU_OK(cuStreamWaitEvent(s, join, 0));
    CU_OK(cuStreamEndCapture(s, &gr));
    CHECK(gr != NULL && n == 0);
    CUgraphExec ex;
    CU_OK(cuGraphInstantiate(&ex, gr, 0));
    CU_OK(cuGraphLaunch(ex, s));
    CU_OK(cuGraphLaunch(ex, s));
    CU_OK(cuStreamSynchronize(s));
    CHECK(n == 4);
    CU_OK(cuGraphExecDestroy(ex));
    CU_OK(cuGraphDestroy(gr));
    CU_MISUSE(cuGraphDestroy(gr), CUDA_ERROR_INVALID_VALUE);
    /* a fork that is not joined back */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_OK(cuEventRecord(fork, s));
    CU_OK(cuStreamWaitEvent(t, fork, 0));
    CU_OK(cuLaunchHostFunc(t, count_up, &n));
    CU_IS(cuStreamEndCapture(t, &gr), CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_OK(cuEventRecord(fork, s));
    CU_OK(cuStreamWaitEvent(t, fork, 0));
    CU_OK(cuLaunchHostFunc(t, count_up, &n));
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
    CU_OK(cuEventDestroy(fork));
    CU_OK(cuEventDestroy(join));
    CU_OK(cuStreamDestroy(s));
    CU_OK(cuStreamDestroy(t));
    CHECK(counts_zero());
}

static int capture_sink; /* host functions run later: their argument must outlive the call */

TEST(stream_capture_refuses_unsafe_calls)
{
    REQUIRE(setup() == 0);
    CUstream s, other;
    CU_OK(cuStreamCreate(&s, 0));                    /* blocking */
    CU_OK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CUdeviceptr d = 0;
    CUgraph gr = NULL;
    CUstreamCaptureStatus st;
    /* synchronizing what captures */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_IS(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CU_OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CU_IS(cuLaunchHostFunc(s, count_up, &capture_sink), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_IS(cuCtxSynchronize(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* the legacy stream while a blocking stream captures */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_IS(cuStreamIsCapturing(NULL, &st), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);  /* not invalidating */
    CU_OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CU_IS(cuLaunchHostFunc(NULL, count_up, &capture_sink), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* potentially unsafe calls, by capture mode */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_IS(cuMemAlloc(&d, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
    CU_OK(cuThreadExchangeStreamCaptureMode(&m));    /* as PyTorch does around cudaMalloc */
    CHECK(m == CU_STREAM_CAPTURE_MODE_GLOBAL);
    CU_OK(cuMemAlloc(&d, 4096));
    CU_OK(cuThreadExchangeStreamCaptureMode(&m));
    /* another thread: prohibited in global mode, not in thread-local mode */
    CHECK(run_other(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, NULL) == CUDA_SUCCESS);
    CU_OK(cuStreamIsCapturing(s, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CHECK(run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, s) == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    CHECK(run_other(CU_STREAM_CAPTURE_MODE_GLOBAL, NULL) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* waiting on work outside the capture */
    CUevent e;
    CU_OK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    CU_IS(cuStreamWaitEvent(other, e, CU_EVENT_WAIT_EXTERNAL), CUDA_ERROR_INVALID_VALUE);  /* not capturing */
    CU_OK(cuLaunchHostFunc(other, count_up, &capture_sink));
    CU_OK(cuEventRecord(e, other));
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CU_OK(cuStreamWaitEvent(s, e, CU_EVENT_WAIT_EXTERNAL));
    CU_IS(cuStreamWaitEvent(s, e, 0), CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    CU_IS(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* nothing captured runs; allocation nodes are not emulated */
    CU_OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CUdeviceptr a2 = 0;
    CU_IS(cuMemAllocAsync(&a2, 4096, s), CUDA_ERROR_NOT_SUPPORTED);
    CU_OK(cuStreamEndCapture(s, &gr));
    CU_OK(cuGraphDestroy(gr));
    CU_OK(cuCtxSynchronize());
    CU_OK(cuMemFree(d));
    CU_OK(cuEventDestroy(e));
    CU_OK(cuStreamDestroy(s));
    CU_OK(cuStreamDestroy(other));
    CHECK(counts_zero());
}

/* ---- the runtime double ------------------------------------------------------------------------ */

TEST(runtime_double)
{
    REQUIRE(setup() == 0);
    char exe[PATH_MAX], path[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    REQUIRE(n > 0);
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    REQUIRE(slash);
    *slash = 0;
    snprintf(path, sizeof path, "%s/../double/libcudart.so.13", exe);
    void *rt = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!rt) SKIP("cannot open ../double/libcudart.so.13: %.200s", dlerror());
    cudaError_t (*rMalloc)(void **, size_t) = (cudaError_t (*)(void **, size_t))dlsym(rt, "cudaMalloc");
    cudaError_t (*rFree)(void *) = (cudaError_t (*)(void *))dlsym(rt, "cudaFree");
    cudaError_t (*rInfo)(size_t *, size_t *) = (cudaError_t (*)(size_t *, size_t *))dlsym(rt, "cudaMemGetInfo");
    cudaError_t (*rLast)(void) = (cudaError_t (*)(void))dlsym(rt, "cudaGetLastError");
    cudaError_t (*rMemcpy)(void *, const void *, size_t, enum cudaMemcpyKind) =
        (cudaError_t (*)(void *, const void *, size_t, enum cudaMemcpyKind))dlsym(rt, "cudaMemcpy");
    cudaError_t (*rEntry)(const char *, void **, unsigned long long, enum cudaDriverEntryPointQueryResult *) =
        (cudaError_t (*)(const char *, void **, unsigned long long,
                         enum cudaDriverEntryPointQueryResult *))dlsym(rt, "cudaGetDriverEntryPoint");
    cudaError_t (*rMallocAsync)(void **, size_t, cudaStream_t) =
        (cudaError_t (*)(void **, size_t, cudaStream_t))dlsym(rt, "cudaMallocAsync_ptsz");
    cudaError_t (*rFreeAsync)(void *, cudaStream_t) =
        (cudaError_t (*)(void *, cudaStream_t))dlsym(rt, "cudaFreeAsync");
    cudaError_t (*rDevSync)(void) = (cudaError_t (*)(void))dlsym(rt, "cudaDeviceSynchronize");
    REQUIRE(rMalloc && rFree && rInfo && rLast && rMemcpy && rEntry && rMallocAsync && rFreeAsync &&
            rDevSync);
    long gpa0 = cudbl_call_count("cuGetProcAddress");
    CHECK(rFree(NULL) == cudaSuccess);      /* initializes */
    CHECK(cudbl_call_count("cuGetProcAddress") > gpa0);  /* the runtime resolved through it */
    size_t f0, f1, t;
    CHECK(rInfo(&f0, &t) == cudaSuccess);
    void *p = NULL;
    CHECK(rMalloc(&p, 1 << 20) == cudaSuccess && p);
    CHECK(rInfo(&f1, &t) == cudaSuccess && f1 == f0 - (1 << 20));
    char src[64] = "through the runtime double", dst[64] = {0};
    CHECK(rMemcpy(p, src, sizeof src, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(rMemcpy(dst, p, sizeof dst, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(strcmp(dst, src) == 0);
    CHECK(rFree(p) == cudaSuccess);
    CHECK(rFree(p) == cudaErrorInvalidValue);
    CHECK(rLast() == cudaErrorInvalidValue && rLast() == cudaSuccess);
    CHECK(rMalloc(&p, (size_t)1 << 50) == cudaErrorMemoryAllocation);
    CHECK(rLast() == cudaErrorMemoryAllocation);
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult st;
    CHECK(rEntry("cuMemAlloc", &fn, cudaEnableDefault, &st) == cudaSuccess);
    CHECK(fn == (void *)cuMemAlloc_v2 && st == cudaDriverEntryPointSuccess);
    CHECK(rEntry("cuNoSuchFunction", &fn, cudaEnableDefault, &st) == cudaSuccess);
    CHECK(fn == NULL && st == cudaDriverEntryPointSymbolNotFound);
    CHECK(rMallocAsync(&p, 4096, NULL) == cudaSuccess);
    CHECK(rFreeAsync(p, cudaStreamPerThread) == cudaSuccess);
    CHECK(rDevSync() == cudaSuccess);
    CHECK(rInfo(&f1, &t) == cudaSuccess && f1 == f0);
    dlclose(rt);
    CHECK(counts_zero());
}

/* ---- leak report at exit ----------------------------------------------------------------------- */

/* Runs for real only in the child that exit_report_counts_leaks starts. */
TEST(exit_report_child)
{
    if (!getenv("CUDBL_TEST_CHILD")) return;
    REQUIRE(setup() == 0);
    REQUIRE(create(gran()) != 0);           /* leaked on purpose */
    REQUIRE(reserve(gran()) != 0);
    exit(0);
}

TEST(exit_report_counts_leaks)
{
    extern char **environ;
    size_t nenv = 0;
    while (environ[nenv]) nenv++;
    char **envp = calloc(nenv + 3, sizeof *envp);   /* built before fork: the child only execs */
    REQUIRE(envp);
    size_t k = 0;
    for (size_t i = 0; i < nenv; i++)
        if (strncmp(environ[i], "CUDBL_", 6) != 0) envp[k++] = environ[i];
    envp[k++] = "CUDBL_TEST_CHILD=1";
    envp[k++] = "CUDBL_REPORT_AT_EXIT=1";
    char *argv[] = {"test_double", "exit_report_child", NULL};
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        execve("/proc/self/exe", argv, envp);
        _exit(127);
    }
    free(envp);
    close(fds[1]);
    char buf[8192];
    size_t len = 0;
    ssize_t r;
    while (len < sizeof buf - 1 && (r = read(fds[0], buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)r;
    buf[len] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECKF(strstr(buf, "cudbl: exit handles=1 mappings=0 reservations=1 allocs=0 events=0 misuse=0 bytes=2097152\n"),
           "child stderr: %s", buf);
}

TEST(nothing_leaked)
{
    REQUIRE(setup() == 0);
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECKF(counts_zero(), "handles=%ld mappings=%ld reservations=%ld allocs=%ld events=%ld "
           "streams=%ld bytes=%zu", c.handles, c.mappings, c.reservations, c.allocs, c.events,
           c.streams, c.bytes_in_use);
}

TEST_MAIN()
