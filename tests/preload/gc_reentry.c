/*
 * gc_reentry.c: the GC step runs user code that frees and allocates through the hooks. That code
 * must be served like any caller (found by review: the re-entry guard made a cudaFree of a pool
 * block inside the GC callback go to the real runtime, so the block leaked and the retry failed).
 * Run under LD_PRELOAD=libmemshim.so with MEMSHIM_LIMIT=8M on the driver double.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

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

TEST(cudafree_inside_the_gc_callback_returns_the_block_to_the_pool)
{
    void (*setgc)(memshim_gc_fn, void *) =
        (void (*)(memshim_gc_fn, void *))dlsym(RTLD_DEFAULT, "memshim_set_gc_callback");
    int (*stats)(int, struct memshim_stats *) =
        (int (*)(int, struct memshim_stats *))dlsym(RTLD_DEFAULT, "memshim_get_stats");
    REQUIRE(setgc && stats);
    setgc(gc_cb, NULL);
    void *a = NULL, *b = NULL;
    REQUIRE(cudaMalloc(&a, 6 << 20) == cudaSuccess);
    victim = a;
    cudaError_t r = cudaMalloc(&b, 6 << 20); /* 12 MiB > 8 MiB limit: only the GC step can help */
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    printf("    GC callback ran %d time(s); its cudaFree returned %d; retry returned %d; live %zu bytes\n", calls,
           free_rc, r, st.live_bytes);
    CHECK(calls >= 1);
    CHECK(free_rc == cudaSuccess);
    CHECK(r == cudaSuccess);
    CHECK(st.live_bytes == (6u << 20));
    if (b) cudaFree(b);
    setgc(NULL, NULL);
}

TEST_MAIN()
