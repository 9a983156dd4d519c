/*
 * stream_destroy.c: a stream destroyed while the pool still remembers it (issue 8, item 2). A
 * block freed on stream S is reusable on another stream only after S's work; once S is destroyed
 * its handle is undefined, so the pool must not record an event on it when it hands the block
 * to another stream. Destroying S through cudaStreamDestroy, cuStreamDestroy_v2 and an entry
 * point obtained by cudaGetDriverEntryPoint must settle what the pool holds for S first. The
 * double counts any use of a destroyed handle as misuse (CUDBL_MISUSE=count semantics via
 * cudbl_set_misuse_abort(0)); the block's last use on S must also complete before the new owner
 * writes. Run under LD_PRELOAD=libmemshim.so on the driver double.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"
#include "harness.h"
#include "memshim.h"

/* cudaGetDriverEntryPoint is deprecated in CUDA 13 but still called (PyTorch, NCCL): test it. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#define SZ (1u << 20)

static void *(*ms_malloc)(ssize_t, int, memshim_stream_t);
static void (*ms_free)(void *, ssize_t, int, memshim_stream_t);

static long misuse(void)
{
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    return c.misuse;
}

static unsigned char seen;
static void read_block(void *p) { seen = *(volatile unsigned char *)p; }

enum how { RUNTIME, DRIVER, ENTRY_POINT };

static void destroy_while_tagged(enum how how)
{
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    REQUIRE(ms_malloc && ms_free);
    REQUIRE(cudaFree(NULL) == cudaSuccess);
    cudbl_set_misuse_abort(0);
    long m0 = misuse();
    cudaStream_t s, t;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking) == cudaSuccess);
    unsigned char *p = ms_malloc(SZ, 0, s);
    REQUIRE(p);
    memset(p, 0xAB, SZ);
    seen = 0;
    cudbl_stream_enqueue((CUstream)s, read_block, p); /* S still reads the block later */
    ms_free(p, SZ, 0, s);
    cudaError_t dr = cudaErrorUnknown;
    if (how == RUNTIME) {
        dr = cudaStreamDestroy(s);
    } else if (how == DRIVER) {
        dr = cuStreamDestroy((CUstream)s) == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
    } else {
        CUresult (*destroy)(CUstream) = NULL;
        enum cudaDriverEntryPointQueryResult st;
        REQUIRE(cudaGetDriverEntryPoint("cuStreamDestroy", (void **)&destroy, cudaEnableDefault, &st) ==
                    cudaSuccess && destroy);
        dr = destroy((CUstream)s) == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
    }
    /* another stream gets the same extent: the pool must order it after S's work without S */
    unsigned char *q = ms_malloc(SZ, 0, t);
    REQUIRE(q);
    memset(q, 0x5A, SZ); /* the new owner writes from the host at once: S's read must be done */
    cudaDeviceSynchronize();
    printf("    destroy %d; reused %s; S's queued read saw 0x%02x; misuse %ld\n", dr, q == p ? "the same block" : "another block",
           seen, misuse() - m0);
    CHECK(dr == cudaSuccess);
    CHECK(misuse() == m0);
    CHECK(q != p || seen == 0xAB);
    ms_free(q, SZ, 0, t);
    cudaStreamDestroy(t);
    cudbl_set_misuse_abort(1);
}

TEST(cudaStreamDestroy_settles_the_pool_first) { destroy_while_tagged(RUNTIME); }
TEST(cuStreamDestroy_settles_the_pool_first) { destroy_while_tagged(DRIVER); }
TEST(cuStreamDestroy_from_an_entry_point_settles_the_pool_first) { destroy_while_tagged(ENTRY_POINT); }

TEST_MAIN()
