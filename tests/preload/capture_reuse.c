/*
 * capture_reuse.c: tensor-mode allocation during CUDA graph capture. PyTorch captures on a side
 * stream; a block freed earlier on another stream S and handed to the capturing stream must be
 * ordered after S's work without making the capture depend on work outside it: a capturing
 * stream that waits on an event recorded outside the capture invalidates the capture
 * (CUDA_ERROR_STREAM_CAPTURE_ISOLATION; the driver double enforces it). Found with the strict
 * double (issue 8). Run under LD_PRELOAD=libmemshim.so.
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

#define SZ (1u << 20)

static unsigned char seen;
static void read_block(void *p) { seen = *(volatile unsigned char *)p; }

TEST(reuse_on_a_capturing_stream_keeps_the_capture_valid)
{
    void *(*ms_malloc)(ssize_t, int, memshim_stream_t) =
        (void *(*)(ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_malloc");
    void (*ms_free)(void *, ssize_t, int, memshim_stream_t) =
        (void (*)(void *, ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_free");
    REQUIRE(ms_malloc && ms_free && cudaFree(NULL) == cudaSuccess);
    cudaStream_t s, cap;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking) == cudaSuccess);
    unsigned char *p = ms_malloc(SZ, 0, s);
    REQUIRE(p);
    memset(p, 0xC3, SZ);
    seen = 0;
    cudbl_stream_enqueue((CUstream)s, read_block, p); /* S's last use, still queued */
    ms_free(p, SZ, 0, s);
    REQUIRE(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal) == cudaSuccess);
    unsigned char *q = ms_malloc(SZ, 0, cap);
    cudaGraph_t g = NULL;
    cudaError_t end = cudaStreamEndCapture(cap, &g);
    printf("    allocation during capture %s (%s); end of capture %d; S's read saw 0x%02x\n", q ? "ok" : "failed",
           q == p ? "the block S freed" : "another block", end, seen);
    CHECK(q != NULL);
    CHECK(end == cudaSuccess && g != NULL);
    CHECK(q != p || seen == 0xC3); /* S's read ran before the block changed hands */
    if (g) cudaGraphDestroy(g);
    if (q) ms_free(q, SZ, 0, cap);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    cudaStreamDestroy(cap);
}

/* Through memshim's hooks, as PyTorch's glue calls it: with no capture open, an allocation on a side
 * stream asks the driver nothing (issue 24: every one called cuStreamIsCapturing); once the runtime
 * begins a capture on that stream (the hook opens the window), an allocation there goes to a
 * capture pool, not to the block the main pool just took back, and the capture stays valid. */
TEST(side_stream_allocations_ask_the_driver_nothing_until_a_capture_begins)
{
    void *(*t_alloc)(ssize_t, int, memshim_stream_t) =
        (void *(*)(ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_torch_alloc");
    void (*t_free)(void *, ssize_t, int, memshim_stream_t) =
        (void (*)(void *, ssize_t, int, memshim_stream_t))dlsym(RTLD_DEFAULT, "memshim_torch_free");
    REQUIRE(t_alloc && t_free && cudaFree(NULL) == cudaSuccess);
    cudaStream_t s;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    long q0 = cudbl_call_count("cuStreamIsCapturing");
    void *m = NULL;
    for (int i = 0; i < 200; i++) {
        m = t_alloc(SZ, 0, s);
        REQUIRE(m);
        t_free(m, SZ, 0, s);
    }
    long q = cudbl_call_count("cuStreamIsCapturing") - q0;
    printf("    200 side-stream alloc+free pairs with no capture open: %ld cuStreamIsCapturing\n", q);
    CHECK(q == 0);
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    void *c = t_alloc(SZ, 0, s);
    cudaGraph_t g = NULL;
    cudaError_t end = cudaStreamEndCapture(s, &g);
    CHECK(c != NULL && c != m); /* m: the main pool's freed block, which it would hand out again */
    CHECK(end == cudaSuccess && g != NULL);
    if (g) cudaGraphDestroy(g);
    if (c) t_free(c, SZ, 0, s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
}

TEST_MAIN()
