/*
 * gc_reentry.c: the GC callback (memshim_set_gc_callback) runs under the same rules as memshim's
 * own gc.collect() step (issue 8): from memshim_malloc (tensor mode) when a request is out of
 * room, never inside the cudaMalloc hook, where PyTorch's caching allocator is mid-call and a
 * callback pointing at gc.collect() would re-enter it. Where it runs, the user code it calls frees
 * and allocates through the hooks and must be served like any caller (found by review: the
 * re-entry guard made a cudaFree of a pool block inside the callback go to the real runtime, so
 * the block leaked and the retry failed). Run under LD_PRELOAD=libmemshim.so with MEMSHIM_LIMIT=8M
 * on the driver double.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "harness.h"
#include "memshim.h"

static void *victim;
static cudaError_t free_rc = (cudaError_t)-1;
static int calls;

static size_t gc_cb(void *arg)
{
    (void)arg;
    calls++;
    if (victim) {
        free_rc = cudaFree(victim);
        if (free_rc == cudaSuccess) victim = NULL;
    }
    return 1;
}

static void (*setgc)(memshim_gc_fn, void *);
static int (*stats)(int, struct memshim_stats *);
static void *(*ms_malloc)(ssize_t, int, memshim_stream_t);
static void (*ms_free)(void *, ssize_t, int, memshim_stream_t);

static int resolve(void)
{
    *(void **)&setgc = dlsym(RTLD_DEFAULT, "memshim_set_gc_callback");
    *(void **)&stats = dlsym(RTLD_DEFAULT, "memshim_get_stats");
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    return setgc && stats && ms_malloc && ms_free;
}

TEST(gc_callback_is_not_called_inside_the_cudamalloc_hook)
{
    REQUIRE(resolve());
    calls = 0;
    setgc(gc_cb, NULL);
    void *a = NULL, *b = NULL;
    REQUIRE(cudaMalloc(&a, 6 << 20) == cudaSuccess);
    victim = NULL; /* the callback must not even be entered */
    cudaError_t r = cudaMalloc(&b, 6 << 20); /* 12 MiB > 8 MiB limit */
    printf("    cudaMalloc over the limit returned %d; GC callback calls: %d\n", r, calls);
    CHECK(r == cudaErrorMemoryAllocation);
    CHECK(calls == 0);
    if (r == cudaSuccess) cudaFree(b);
    cudaFree(a);
    setgc(NULL, NULL);
}

TEST(cudafree_inside_the_gc_callback_returns_the_block_to_the_pool)
{
    REQUIRE(resolve());
    calls = 0;
    free_rc = (cudaError_t)-1;
    setgc(gc_cb, NULL);
    void *a = NULL;
    REQUIRE(cudaMalloc(&a, 6 << 20) == cudaSuccess);
    victim = a;
    /* tensor mode's entry point: only the GC step can make room */
    void *b = ms_malloc(6 << 20, 0, NULL);
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    printf("    GC callback ran %d time(s); its cudaFree returned %d; memshim_malloc %s; live %zu bytes\n", calls,
           free_rc, b ? "succeeded" : "failed", st.live_bytes);
    CHECK(calls >= 1);
    CHECK(free_rc == cudaSuccess);
    CHECK(b != NULL);
    CHECK(st.live_bytes == (6u << 20));
    if (b) ms_free(b, 6 << 20, 0, NULL);
    if (victim) cudaFree(victim);
    setgc(NULL, NULL);
}

TEST_MAIN()
