/*
 * free_release.c: in segment mode a cudaFree of a pool block is PyTorch giving memory back
 * (empty_cache, its OOM retry), so the block's pages that no live block still touches go back to
 * the driver at once, where other processes, NCCL and other allocators can use them (issue 8,
 * item 5; DESIGN.md 3). Pages a live neighbour shares stay. With EXPECT_KEEP=1 they stay cached:
 * run_preload.sh sets it with MEMSHIM_EMPTY_CACHE=never, and with TENSOR_MODE=1 (a cudaFree in
 * tensor mode comes from another library; the cache serves memshim's own reuse). Run under
 * LD_PRELOAD=libmemshim.so.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

#define MiB ((size_t)1 << 20)

static size_t reserved(void)
{
    int (*stats)(int, struct memshim_stats *) = (int (*)(int, struct memshim_stats *))dlsym(RTLD_DEFAULT,
                                                                                              "memshim_get_stats");
    struct memshim_stats st;
    return stats && stats(0, &st) == 0 ? st.reserved_bytes : (size_t)-1;
}

static void memshim_empty_cache_fn(void)
{
    void (*empty)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memshim_empty_cache");
    if (empty) empty();
}

static size_t driver_used(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.bytes_in_use;
}

TEST(cudafree_returns_the_pages)
{
    int keep = getenv("EXPECT_KEEP") != NULL;
    if (getenv("TENSOR_MODE")) { /* PyTorch calling memshim_malloc is what tensor mode is */
        void *(*ms_malloc)(ssize_t, int, void *) = (void *(*)(ssize_t, int, void *))dlsym(RTLD_DEFAULT, "memshim_malloc");
        void (*ms_free)(void *, ssize_t, int, void *) = (void (*)(void *, ssize_t, int, void *))dlsym(RTLD_DEFAULT, "memshim_free");
        REQUIRE(ms_malloc && ms_free);
        void *t = ms_malloc(4096, 0, NULL);
        REQUIRE(t);
        ms_free(t, 4096, 0, NULL);
        memshim_empty_cache_fn();
    }
    void *a = NULL, *b = NULL, *c = NULL;
    REQUIRE(cudaMalloc(&a, 64 * MiB) == cudaSuccess);
    size_t used0 = driver_used(), res0 = reserved();
    CHECK(cudaFree(a) == cudaSuccess);
    size_t res1 = reserved(), used1 = driver_used();
    printf("    64 MiB block: reserved %zu -> %zu MiB, driver holds %zu -> %zu MiB (%s)\n", res0 / MiB, res1 / MiB,
           used0 / MiB, used1 / MiB, keep ? "MEMSHIM_EMPTY_CACHE=never" : "default");
    if (keep) {
        CHECK(res1 == res0);
    } else {
        CHECK(res1 == 0);
        /* all of what the pool held for it goes back (with no limit that includes the rest of
         * the 20 MiB chunk the pool mapped ahead at the open end of its line: issue 10) */
        CHECK(used1 + res0 == used0 && res0 >= 64 * MiB);
    }
    /* neighbours sharing a page: freeing one keeps the page the other still touches */
    REQUIRE(cudaMalloc(&b, 3 * MiB) == cudaSuccess);
    REQUIRE(cudaMalloc(&c, 3 * MiB) == cudaSuccess);
    size_t res2 = reserved();
    CHECK(cuMemFree((CUdeviceptr)(uintptr_t)b) == CUDA_SUCCESS); /* the driver API path too */
    size_t res3 = reserved();
    printf("    two 3 MiB neighbours: reserved %zu MiB, after freeing the first %zu MiB\n", res2 / MiB, res3 / MiB);
    if (!keep) CHECK(res3 == res2 - 2 * MiB); /* b's first page only: its second is c's first */
    else CHECK(res3 == res2);
    CHECK(cudaFree(c) == cudaSuccess);
    if (!keep) CHECK(reserved() == 0);
}

TEST_MAIN()
