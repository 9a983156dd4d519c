/*
 * vmm_cost.c: what each CUDA VMM call costs on the driver present, against the cost table memshim
 * models driver work with (policy/drvcost.c). Part of the GPU check (tests/gpu/run_gpu_checks.sh);
 * on the driver double it runs the same code in a second (--dry-run).
 *
 *   gpu-vmm-cost [--sizes-mib 2,20,64,512] [--iters N] [--budget-s S] [--overhead-gib G]
 *
 * It first probes that the calls work (device attribute, granularity, then one handle through
 * create, reserve, map, set-access, unmap, release, address-free) and prints {"vmm_ok": false,
 * "failed": CALL, "result": CODE} and exits 3 when one fails, before timing anything. Then for
 * each handle size: N rounds of cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess,
 * cuMemUnmap, cuMemRelease, cuMemAddressFree, each call timed alone (CLOCK_MONOTONIC), and one
 * cuMemSetAccess over a range of 8 mappings of that size; per call p50, p90, max and mean in us
 * beside the table's figure for that call and size (per call + per MiB + per mapping). Then
 * cuMemGetInfo timed the same way (`mem_info`: the pool asks it before creating several handles,
 * issue 31; the table's figure is not an H200 measurement yet). Then whether cuMemMap accepts a
 * non-zero offset into a handle on this driver (`map_offset`: cuda.h 13.0 says it "currently must
 * be zero"; a handle of two pages, its second page mapped alone at offset one page; when the
 * driver accepts it, a byte written through that mapping is read back through a mapping of the
 * whole handle, so "accepted" means the offset is honoured, not just not refused). Then what the
 * driver itself keeps per handle (`handle_overhead`): device memory used (cuMemGetInfo) by G GiB
 * (default 10) as handles of 2 MiB (5,120 at 10 GiB) against the same bytes as handles of 20 MiB
 * (512) and of 64 MiB (160), each set created, mapped side by side into one reserved range and
 * granted access, read after the creates and after the maps, and given back before the next: the
 * bytes used beyond the handles' own are the driver's (page tables, bookkeeping). At a 10 GiB cap
 * the card held 0.40 GB more under memshim (about 5,100 handles of 2 MiB) than under expandable
 * segments (about 512 of 20 MiB): this says how much of that is per handle. The two facts the
 * next design of the pool near a limit depends on (DESIGN.md 12). One JSON document on stdout.
 * The driver is loaded with dlopen, so the program NEEDs only glibc; it never leaves a handle or a
 * reservation behind on a path that returns.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "drvcost.h"

#define MiB (1024.0 * 1024.0)
#define MAX_ITERS 1000
#define MAX_SIZES 16

static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*attribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*mem_info)(size_t *, size_t *);
    /* optional: reading back through a mapping at a non-zero offset (map_offset) */
    CUresult (*memset8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*ctx_sync)(void);
} cu;

enum { C_CREATE, C_RESERVE, C_MAP, C_SET_ACCESS, C_UNMAP, C_RELEASE, C_ADDRESS_FREE, C_SET_ACCESS_8, NCALLS };
static const char *call_names[NCALLS] = {"cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
                                         "cuMemUnmap", "cuMemRelease", "cuMemAddressFree",
                                         "cuMemSetAccess (8 mappings)"};
static const int table_kind[NCALLS] = {MSH_DRV_CREATE, MSH_DRV_RESERVE, MSH_DRV_MAP, MSH_DRV_SET_ACCESS,
                                       MSH_DRV_UNMAP, MSH_DRV_RELEASE, MSH_DRV_UNRESERVE, MSH_DRV_SET_ACCESS};

/* drvcost.c reads the kinds' names from the pool (policy/pool/pages.c); this program has no pool. */
#define MSH_DRV_NAME_(e, s) s,
const char *const msh_drv_call_names[MSH_DRV_NKINDS] = {MSH_DRV_CALLS(MSH_DRV_NAME_)};
#undef MSH_DRV_NAME_

static CUmemAllocationProp prop;
static CUmemAccessDesc access_desc;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int load(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("{\"vmm_ok\": false, \"failed\": \"dlopen libcuda.so.1\", \"error\": \"%s\"}\n", dlerror());
        return -1;
    }
#define SYM(f, n)                                                                                  \
    if (!(*(void **)&cu.f = dlsym(h, n))) {                                                        \
        printf("{\"vmm_ok\": false, \"failed\": \"dlsym %s\"}\n", n);                              \
        return -1;                                                                                 \
    }
    SYM(init, "cuInit");
    SYM(device_get, "cuDeviceGet");
    SYM(attribute, "cuDeviceGetAttribute");
    SYM(primary_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(granularity, "cuMemGetAllocationGranularity");
    SYM(create, "cuMemCreate");
    SYM(release, "cuMemRelease");
    SYM(reserve, "cuMemAddressReserve");
    SYM(address_free, "cuMemAddressFree");
    SYM(map, "cuMemMap");
    SYM(unmap, "cuMemUnmap");
    SYM(set_access, "cuMemSetAccess");
    SYM(mem_info, "cuMemGetInfo_v2");
#undef SYM
    *(void **)&cu.memset8 = dlsym(h, "cuMemsetD8_v2");
    *(void **)&cu.dtoh = dlsym(h, "cuMemcpyDtoH_v2");
    *(void **)&cu.ctx_sync = dlsym(h, "cuCtxSynchronize");
    return 0;
}

#define PROBE(call, expr)                                                                          \
    do {                                                                                           \
        CUresult r_ = (expr);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            printf("{\"vmm_ok\": false, \"failed\": \"%s\", \"result\": %d}\n", call, (int)r_);    \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

/* One handle through every call, each checked: nothing is timed unless this passes. */
static int probe(size_t *gran)
{
    CUdevice dev;
    CUcontext ctx;
    int vmm = 0;
    PROBE("cuInit", cu.init(0));
    PROBE("cuDeviceGet", cu.device_get(&dev, 0));
    PROBE("cuDeviceGetAttribute", cu.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    if (!vmm) {
        printf("{\"vmm_ok\": false, \"failed\": \"CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0\"}\n");
        return -1;
    }
    PROBE("cuDevicePrimaryCtxRetain", cu.primary_retain(&ctx, dev));
    PROBE("cuCtxSetCurrent", cu.ctx_set(ctx));
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    access_desc.location = prop.location;
    access_desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    PROBE("cuMemGetAllocationGranularity", cu.granularity(gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle hd;
    CUdeviceptr va;
    PROBE("cuMemCreate", cu.create(&hd, *gran, &prop, 0));
    CUresult r = cu.reserve(&va, *gran, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        cu.release(hd);
        PROBE("cuMemAddressReserve", r);
    }
    r = cu.map(va, *gran, 0, hd, 0);
    if (r == CUDA_SUCCESS) r = cu.set_access(va, *gran, &access_desc, 1);
    const char *what = r == CUDA_SUCCESS ? NULL : "cuMemMap or cuMemSetAccess";
    cu.unmap(va, *gran);
    cu.address_free(va, *gran);
    cu.release(hd);
    if (what) PROBE(what, r);
    return 0;
}

struct timing {
    double t[NCALLS][MAX_ITERS];
    int n[NCALLS];
};

/* One round at `size`: every call timed alone. Returns 0, or the first failing call's index + 1. */
static int round_at(size_t size, struct timing *tm)
{
    CUmemGenericAllocationHandle hd[8];
    CUdeviceptr va;
    double t0;
#define TIMED(k, expr)                                                                             \
    (t0 = now_s(), r_ = (expr), tm->n[k] < MAX_ITERS ? (tm->t[k][tm->n[k]++] = now_s() - t0) : 0, r_)
    CUresult r_;
    if (TIMED(C_CREATE, cu.create(&hd[0], size, &prop, 0)) != CUDA_SUCCESS) return C_CREATE + 1;
    if (TIMED(C_RESERVE, cu.reserve(&va, size, 0, 0, 0)) != CUDA_SUCCESS) {
        cu.release(hd[0]);
        return C_RESERVE + 1;
    }
    int bad = 0;
    if (TIMED(C_MAP, cu.map(va, size, 0, hd[0], 0)) != CUDA_SUCCESS) bad = C_MAP + 1;
    else if (TIMED(C_SET_ACCESS, cu.set_access(va, size, &access_desc, 1)) != CUDA_SUCCESS) bad = C_SET_ACCESS + 1;
    if (!bad && TIMED(C_UNMAP, cu.unmap(va, size)) != CUDA_SUCCESS) bad = C_UNMAP + 1;
    if (bad) cu.unmap(va, size);
    if (TIMED(C_RELEASE, cu.release(hd[0])) != CUDA_SUCCESS && !bad) bad = C_RELEASE + 1;
    if (TIMED(C_ADDRESS_FREE, cu.address_free(va, size)) != CUDA_SUCCESS && !bad) bad = C_ADDRESS_FREE + 1;
    if (bad) return bad;
    /* one cuMemSetAccess over 8 neighbouring mappings (the pool grants access once per block) */
    if (cu.reserve(&va, 8 * size, 0, 0, 0) != CUDA_SUCCESS) return 0; /* not enough VA: skip this part */
    int made = 0;
    for (; made < 8; made++) {
        if (cu.create(&hd[made], size, &prop, 0) != CUDA_SUCCESS) break;
        if (cu.map(va + made * size, size, 0, hd[made], 0) != CUDA_SUCCESS) {
            cu.release(hd[made]);
            break;
        }
    }
    if (made == 8) (void)TIMED(C_SET_ACCESS_8, cu.set_access(va, 8 * size, &access_desc, 1));
    for (int i = 0; i < made; i++) {
        cu.unmap(va + i * size, size);
        cu.release(hd[i]);
    }
    cu.address_free(va, 8 * size);
#undef TIMED
    return 0;
}

static struct timing tm;

/* Device memory the driver uses for `n` handles of `size` bytes beyond their own bytes, created,
 * mapped into one reserved range and granted access: printed as one JSON object. Everything is
 * given back before it returns. */
static void overhead_of(int n, size_t size)
{
    size_t free0 = 0, free1 = 0, free2 = 0, free3 = 0, total = 0;
    CUmemGenericAllocationHandle *hd = calloc((size_t)n, sizeof *hd);
    CUdeviceptr va = 0;
    const char *failed = NULL;
    int made = 0, mapped = 0;
    double t0 = now_s();
    if (!hd) failed = "out of host memory";
    else if (cu.mem_info(&free0, &total) != CUDA_SUCCESS) failed = "cuMemGetInfo";
    else if (cu.reserve(&va, (size_t)n * size, 0, 0, 0) != CUDA_SUCCESS) failed = "cuMemAddressReserve";
    for (; !failed && made < n; made++)
        if (cu.create(&hd[made], size, &prop, 0) != CUDA_SUCCESS) failed = "cuMemCreate";
    if (failed && made) made--; /* the failed create made nothing */
    if (!failed && cu.mem_info(&free1, &total) != CUDA_SUCCESS) failed = "cuMemGetInfo";
    for (; !failed && mapped < n; mapped++)
        if (cu.map(va + (size_t)mapped * size, size, 0, hd[mapped], 0) != CUDA_SUCCESS) failed = "cuMemMap";
    if (failed && mapped && strcmp(failed, "cuMemMap") == 0) mapped--;
    if (!failed && cu.set_access(va, (size_t)n * size, &access_desc, 1) != CUDA_SUCCESS) failed = "cuMemSetAccess";
    if (!failed && cu.mem_info(&free2, &total) != CUDA_SUCCESS) failed = "cuMemGetInfo";
    for (int i = 0; i < mapped; i++) cu.unmap(va + (size_t)i * size, size);
    for (int i = 0; i < made; i++) cu.release(hd[i]);
    if (va) cu.address_free(va, (size_t)n * size);
    if (cu.mem_info(&free3, &total) != CUDA_SUCCESS) free3 = 0;
    free(hd);
    double bytes = (double)n * (double)size;
    printf("{\"handle_mib\": %.0f, \"handles\": %d, \"bytes\": %.0f, \"failed\": %s%s%s", size / MiB, n, bytes,
           failed ? "\"" : "", failed ? failed : "null", failed ? "\"" : "");
    if (!failed) {
        double created = (double)free0 - (double)free1, used = (double)free0 - (double)free2;
        printf(", \"used_after_create_bytes\": %.0f, \"used_after_map_bytes\": %.0f, \"beyond_bytes\": %.0f, "
               "\"beyond_per_handle_bytes\": %.0f, \"given_back_bytes\": %.0f",
               created, used, used - bytes, (used - bytes) / n, (double)free3 - (double)free2);
    }
    printf(", \"seconds\": %.3f}", now_s() - t0);
}

/* The same bytes as 2 MiB, as 20 MiB (PyTorch's expandable segments) and as 64 MiB handles (rounded
 * to the granularity), when they fit in what the device has free with 1 GiB to spare. */
static void handle_overhead(double gib, size_t gran)
{
    static const double mib[] = {2, 20, 64};
    size_t want = (size_t)(gib * 1024 * MiB), fr = 0, total = 0;
    printf(", \"handle_overhead\": ");
    if (cu.mem_info(&fr, &total) != CUDA_SUCCESS) {
        printf("{\"skipped\": \"cuMemGetInfo failed\"}");
        return;
    }
    size_t big = ((size_t)(mib[2] * MiB) + gran - 1) / gran * gran;
    if ((double)fr < (double)want + 1024 * MiB || want < big) {
        printf("{\"skipped\": \"%.1f GiB free, %.1f GiB wanted\", \"free_bytes\": %zu}", fr / 1024 / MiB, gib + 1, fr);
        return;
    }
    printf("{\"device_total_bytes\": %zu, \"free_before_bytes\": %zu, \"sets\": [", total, fr);
    for (size_t i = 0; i < sizeof mib / sizeof mib[0]; i++) {
        size_t size = ((size_t)(mib[i] * MiB) + gran - 1) / gran * gran;
        if (i) printf(", ");
        overhead_of((int)(want / size), size);
    }
    printf("]}");
}

/* cuMemGetInfo, each call timed alone, as the table's mem_info row prices it. */
static void mem_info_cost(int n)
{
    static double t[MAX_ITERS * 10];
    if (n > MAX_ITERS * 10) n = MAX_ITERS * 10;
    size_t f, tot;
    int done = 0;
    for (; done < n; done++) {
        double t0 = now_s();
        if (cu.mem_info(&f, &tot) != CUDA_SUCCESS) break;
        t[done] = now_s() - t0;
    }
    double model = msh_drvcost_call(msh_drvcost_default(), MSH_DRV_MEM_INFO, 0, 1);
    printf(", \"mem_info\": {\"call\": \"cuMemGetInfo\", \"n\": %d", done);
    if (done) {
        qsort(t, (size_t)done, sizeof t[0], cmp_double);
        double sum = 0;
        for (int i = 0; i < done; i++) sum += t[i];
        printf(", \"p50_us\": %.2f, \"p90_us\": %.2f, \"max_us\": %.2f, \"mean_us\": %.2f, \"table_us\": %.2f, "
               "\"p50_over_table\": %.3f",
               1e6 * t[done / 2], 1e6 * t[(done * 9) / 10], 1e6 * t[done - 1], 1e6 * sum / done, 1e6 * model,
               model > 0 ? t[done / 2] / model : 0.0);
    }
    printf("}");
}

/* Whether cuMemMap maps part of a handle: a handle of two pages, its second page alone at offset
 * one page. When the driver accepts, a byte written through the offset mapping must be what a
 * mapping of the whole handle shows at that page (honoured, not only not refused). */
static void map_offset(size_t gran)
{
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr whole = 0, part = 0;
    int have_h = 0, have_whole = 0, have_part = 0, mapped_whole = 0, mapped_part = 0;
    CUresult r = CUDA_ERROR_UNKNOWN;
    const char *failed = NULL, *same = "null";
    if (cu.create(&h, 2 * gran, &prop, 0) != CUDA_SUCCESS) failed = "cuMemCreate";
    else have_h = 1;
    if (!failed && cu.reserve(&whole, 2 * gran, 0, 0, 0) != CUDA_SUCCESS) failed = "cuMemAddressReserve";
    else if (!failed) have_whole = 1;
    if (!failed && cu.reserve(&part, gran, 0, 0, 0) != CUDA_SUCCESS) failed = "cuMemAddressReserve";
    else if (!failed) have_part = 1;
    if (!failed && cu.map(whole, 2 * gran, 0, h, 0) != CUDA_SUCCESS) failed = "cuMemMap of the whole handle";
    else if (!failed) mapped_whole = 1;
    if (!failed && cu.set_access(whole, 2 * gran, &access_desc, 1) != CUDA_SUCCESS) failed = "cuMemSetAccess";
    if (!failed) {
        r = cu.map(part, gran, gran, h, 0); /* the question */
        mapped_part = r == CUDA_SUCCESS;
    }
    if (mapped_part && cu.memset8 && cu.dtoh && cu.ctx_sync) {
        unsigned char back[2] = {0, 0};
        if (cu.set_access(part, gran, &access_desc, 1) == CUDA_SUCCESS && cu.memset8(whole, 0x11, 2 * gran) == CUDA_SUCCESS &&
            cu.memset8(part, 0x5A, gran) == CUDA_SUCCESS && cu.ctx_sync() == CUDA_SUCCESS &&
            cu.dtoh(&back[0], whole + gran, 1) == CUDA_SUCCESS && cu.dtoh(&back[1], whole, 1) == CUDA_SUCCESS)
            same = back[0] == 0x5A && back[1] == 0x11 ? "true" : "false";
    }
    if (mapped_part) cu.unmap(part, gran);
    if (mapped_whole) cu.unmap(whole, 2 * gran);
    if (have_part) cu.address_free(part, gran);
    if (have_whole) cu.address_free(whole, 2 * gran);
    if (have_h) cu.release(h);
    printf(", \"map_offset\": {\"handle_bytes\": %zu, \"offset_bytes\": %zu, \"size_bytes\": %zu, \"failed\": %s%s%s",
           2 * gran, gran, gran, failed ? "\"" : "", failed ? failed : "null", failed ? "\"" : "");
    if (!failed)
        printf(", \"result\": %d, \"accepted\": %s, \"offset_honoured\": %s", (int)r, mapped_part ? "true" : "false", same);
    printf("}");
}

int main(int argc, char **argv)
{
    double sizes[MAX_SIZES] = {2, 20, 64, 512};
    int nsizes = 4, iters = 30;
    double budget = 60, overhead_gib = 10;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sizes-mib") && i + 1 < argc) {
            nsizes = 0;
            for (char *s = strtok(argv[++i], ","); s && nsizes < MAX_SIZES; s = strtok(NULL, ","))
                if (atof(s) > 0) sizes[nsizes++] = atof(s);
        } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
            iters = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--budget-s") && i + 1 < argc) {
            budget = atof(argv[++i]);
        } else if (!strcmp(argv[i], "--overhead-gib") && i + 1 < argc) {
            overhead_gib = atof(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--sizes-mib 2,20,64,512] [--iters N] [--budget-s S] [--overhead-gib G]\n",
                    argv[0]);
            return 2;
        }
    }
    if (iters < 1 || iters > MAX_ITERS || nsizes < 1 || budget <= 0 || !(overhead_gib >= 0 && overhead_gib <= 4096)) {
        fprintf(stderr, "%s: --iters 1..%d, at least one size, a positive budget, --overhead-gib 0..4096 (0: skip)\n",
                argv[0], MAX_ITERS);
        return 2;
    }
    if (load()) return 3;
    size_t gran = 0;
    if (probe(&gran)) return 3;
    const struct msh_drvcost *tab = msh_drvcost_default();
    double start = now_s();
    printf("{\"vmm_ok\": true, \"granularity_bytes\": %zu, \"iters\": %d, \"sizes\": [", gran, iters);
    for (int s = 0; s < nsizes; s++) {
        size_t size = (size_t)(sizes[s] * MiB);
        size = (size + gran - 1) / gran * gran;
        memset(&tm, 0, sizeof tm);
        int failed = 0, done = 0;
        for (; done < iters && !failed && now_s() - start < budget; done++) failed = round_at(size, &tm);
        printf("%s\n {\"handle_mib\": %.1f, \"rounds\": %d, \"failed\": %s%s%s, \"calls\": {", s ? "," : "",
               size / MiB, done, failed ? "\"" : "", failed ? call_names[failed - 1] : "null", failed ? "\"" : "");
        int first = 1;
        for (int k = 0; k < NCALLS; k++) {
            int n = tm.n[k];
            if (!n) continue;
            qsort(tm.t[k], (size_t)n, sizeof(double), cmp_double);
            double sum = 0;
            for (int i = 0; i < n; i++) sum += tm.t[k][i];
            double maps = k == C_SET_ACCESS_8 ? 8 : 1, mib = maps * size / MiB;
            double model = msh_drvcost_call(tab, (enum msh_drv_call)table_kind[k], mib, maps);
            printf("%s\n  \"%s\": {\"n\": %d, \"p50_us\": %.2f, \"p90_us\": %.2f, \"max_us\": %.2f, \"mean_us\": %.2f, "
                   "\"table_us\": %.2f, \"p50_over_table\": %.3f}",
                   first ? "" : ",", call_names[k], n, 1e6 * tm.t[k][n / 2], 1e6 * tm.t[k][(n * 9) / 10],
                   1e6 * tm.t[k][n - 1], 1e6 * sum / n, 1e6 * model, model > 0 ? tm.t[k][n / 2] / model : 0.0);
            first = 0;
        }
        printf("}}");
    }
    printf("\n]");
    mem_info_cost(iters * 10);
    map_offset(gran);
    if (overhead_gib > 0) handle_overhead(overhead_gib, gran);
    printf(", \"elapsed_s\": %.2f, \"budget_s\": %.1f}\n", now_s() - start, budget);
    return 0;
}
