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

#include "cudadouble/cudbl.h"
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
    /* Outside the pool: never a byte of a. */
    void *m[8];
    for (int i = 0; i < 8; i++) {
        m[i] = memshim_torch_alloc(4 * MiB, 0, S_OTHER);
        REQUIRE(m[i]);
        CHECKF(!overlaps((uintptr_t)m[i], 4 * MiB, (uintptr_t)a, 4 * MiB), "main alloc %p reuses capture block %p",
               m[i], a);
    }
    /* Inside the pool (the next capture into it): reused. */
    memshim_torch_begin_allocate_to_pool(0, 7, 0, NULL);
    void *a2 = memshim_torch_alloc_in_pool(4 * MiB, 0, S_CAPTURING, 7, 0);
    CHECK(a2 == a);
    memshim_torch_end_allocate_to_pool(0, 7, 0);
    for (int i = 0; i < 8; i++) memshim_torch_free(m[i], 4 * MiB, 0, S_OTHER);
    memshim_empty_cache();
    long before_release = handles();
    memshim_torch_release_pool(0, 7, 0); /* b and a2 still live: the pool stays */
    CHECK(handles() == before_release);
    void *m2 = memshim_torch_alloc(4 * MiB, 0, S_OTHER);
    CHECK(m2 && !overlaps((uintptr_t)m2, 4 * MiB, (uintptr_t)a2, 4 * MiB));
    memshim_torch_free(m2, 4 * MiB, 0, S_OTHER);
    memshim_torch_free(a2, 4 * MiB, 0, S_CAPTURING);
    memshim_torch_free(b, 1000, 0, S_CAPTURING); /* the last block: the pool goes, pages and all */
    memshim_empty_cache();
    CHECKF(handles() < before_release, "handles %ld, before the release %ld", handles(), before_release);
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
    void *m = memshim_torch_alloc(2 * MiB, 0, s); /* not capturing: the main pool */
    REQUIRE(m);
    memshim_torch_free(m, 2 * MiB, 0, s);
    REQUIRE(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
    void *c = memshim_torch_alloc(2 * MiB, 0, s);
    CUgraph g = NULL;
    CUresult er = end(s, &g);
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
    void *c = memshim_torch_alloc_in_pool(160 * MiB, 0, S_CAPTURING, 11, 0);
    CHECK(c == NULL); /* 320 MiB together: over the shared limit */
    char msg[1024];
    memshim_torch_oom_message(0, 160 * MiB, msg, sizeof msg);
    CHECKF(strstr(msg, "CUDA out of memory. Tried to allocate 160.00 MiB") == msg && strstr(msg, "capture pool") &&
               strstr(msg, "limit 256.00 MiB"),
           "%s", msg);
    CHECK(stat_of(0, "num_ooms") >= 1);
    memshim_torch_free(m, 160 * MiB, 0, NULL); /* now cached in the main pool: the capture pool gets it */
    c = memshim_torch_alloc_in_pool(160 * MiB, 0, S_CAPTURING, 11, 0);
    CHECK(c != NULL);
    memshim_torch_end_allocate_to_pool(0, 11, 0);
    memshim_torch_free(c, 160 * MiB, 0, S_CAPTURING);
    memshim_torch_release_pool(0, 11, 0);
    memshim_torch_set_memory_fraction(1.0, 0);
    CHECK(msh_torch_limit(0) == 1024 * MiB);
    memshim_torch_set_memory_fraction(1.5, 0); /* refused: the limit is unchanged */
    CHECK(msh_torch_limit(0) == 1024 * MiB);
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
