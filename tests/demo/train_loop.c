/*
 * train_loop.c: memshim-train-demo, a program that allocates GPU memory the way a training loop
 * does, through the CUDA runtime API only. It is the README's main job: run under
 * LD_PRELOAD=libmemshim.so it shows what the pool does; without memshim it runs on the plain
 * runtime. It never needs a GPU (the driver double serves it), and on a GPU machine it uses the
 * real driver unchanged.
 *
 * Shape of the workload: parameters and optimizer state allocated once with cudaMalloc (what
 * PyTorch's caching allocator asks for in segment mode); per step, activations of a transformer-
 * like stack whose sizes follow a varying sequence length, allocated in forward order and freed
 * in backward order, with gradient temporaries in between; a second stream carries a share of
 * the activations (through memshim's pluggable entry points, as PyTorch does in tensor mode,
 * when memshim is preloaded); an epoch boundary every --steps steps is told to memshim.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

typedef void *(*malloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);
struct stats {
    size_t live_bytes, peak_live_bytes, reserved_bytes, peak_reserved_bytes;
    size_t map_ops, unmap_ops, reclaimed_pages, allocs, frees, ooms;
};
typedef int (*stats_fn)(int, struct stats *);

static struct {
    malloc_fn m;
    free_fn f;
    void (*epoch)(void);
    void (*step)(void);
    stats_fn stats;
} ms;

#define MiB ((size_t)1 << 20)
#define LAYERS 12

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

struct blk { void *p; size_t n; void *stream; int pluggable; };

/* Every CUDA call's result is checked: a failure other than the out-of-memory the workload
 * expects ends the demo with the call, the error's name and text, and exit status 1 (on a GPU,
 * an error ignored here would surface later as a crash far from its cause). */
static void check(const char *what, cudaError_t e)
{
    if (e == cudaSuccess) return;
    fprintf(stderr, "train-demo: %s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
    exit(1);
}

/* 0, or 1 when the device is out of memory (counted by the caller: the workload may run into its
 * limit on purpose). */
static int dev_alloc(struct blk *b, size_t n, void *stream, int pluggable)
{
    b->n = n;
    b->stream = stream;
    b->pluggable = pluggable && ms.m;
    if (b->pluggable) {
        b->p = ms.m((ssize_t)n, 0, stream);
        return b->p ? 0 : 1;
    }
    cudaError_t e = cudaMalloc(&b->p, n);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* the expected failure is handled: clear the sticky last error */
        b->p = NULL;
        return 1;
    }
    check("cudaMalloc", e);
    return 0;
}

static void dev_free(struct blk *b)
{
    if (!b->p) return;
    if (b->pluggable) ms.f(b->p, (ssize_t)b->n, 0, b->stream);
    else check("cudaFree", cudaFree(b->p));
    b->p = NULL;
}

int main(int argc, char **argv)
{
    int epochs = 3, steps = 20;
    double scale = 1.0, pause = 0, quiet = 0;
    int leak_mib = 0; /* --leak: memory kept every epoch, to show the reports' trend verdict */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--epochs") && i + 1 < argc) epochs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scale") && i + 1 < argc) scale = atof(argv[++i]);
        else if (!strcmp(argv[i], "--pause") && i + 1 < argc) pause = atof(argv[++i]);
        else if (!strcmp(argv[i], "--quiet") && i + 1 < argc) quiet = atof(argv[++i]);
        else if (!strcmp(argv[i], "--leak") && i + 1 < argc) leak_mib = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--epochs N] [--steps N] [--scale X] [--pause SECONDS] [--quiet SECONDS] [--leak MIB]\n", argv[0]);
            return 2;
        }
    }
    if (epochs < 1 || steps < 1 || scale <= 0 || scale > 64 || pause < 0 || pause > 3600 || quiet < 0 || quiet > 3600 || leak_mib < 0 ||
        leak_mib > 4096) {
        fprintf(stderr, "train-demo: bad arguments\n");
        return 2;
    }
    *(void **)&ms.m = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms.f = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&ms.epoch = dlsym(RTLD_DEFAULT, "memshim_epoch");
    *(void **)&ms.step = dlsym(RTLD_DEFAULT, "memshim_step");
    *(void **)&ms.stats = dlsym(RTLD_DEFAULT, "memshim_get_stats");
    printf("train-demo: %d epochs x %d steps, scale %.2f, memshim %s\n", epochs, steps, scale,
           ms.m ? "preloaded" : "not loaded (plain CUDA runtime)");

    check("cudaSetDevice", cudaSetDevice(0));
    cudaStream_t side;
    check("cudaStreamCreate", cudaStreamCreate(&side));

    /* Parameters and two optimizer moments: live for the whole run. */
    static const size_t param_sizes[] = {96, 12, 12, 36, 48, 48, 3, 1};
    struct blk params[LAYERS * 8 * 3];
    int np = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int k = 0; k < 8; k++)
            for (int copy = 0; copy < 3; copy++) {
                size_t n = (size_t)(param_sizes[k] * scale * MiB / 8) + 4096 * (size_t)k;
                if (dev_alloc(&params[np], n, NULL, 0)) {
                    fprintf(stderr, "train-demo: cannot allocate parameters (%zu bytes)\n", n);
                    return 1;
                }
                check("cudaMemset", cudaMemset(params[np].p, copy, n < 4096 ? n : 4096));
                np++;
            }

    struct blk act[LAYERS * 6];
    int ooms = 0, syncs = 0; /* syncs: the demo's own device synchronizes (reports count memshim's apart) */
    for (int ep = 0; ep < epochs; ep++) {
        for (int st = 0; st < steps; st++) {
            size_t seq = 128 + (next_rand() % 4) * 128; /* 128..512 tokens */
            int na = 0;
            /* forward: activations kept for backward, mixed sizes, a third on the side stream */
            for (int l = 0; l < LAYERS; l++) {
                size_t sizes[6] = {seq * 4096, seq * 12288, seq * 16384, seq * 64, seq * 4096 * 3,
                                   seq * seq * 16};
                for (int k = 0; k < 6; k++) {
                    size_t n = (size_t)(sizes[k] * scale) + 512 * (next_rand() % 8);
                    void *stream = (k % 3 == 2) ? (void *)side : NULL;
                    if (dev_alloc(&act[na], n, stream, 1)) {
                        ooms++;
                        act[na].p = NULL;
                    }
                    na++;
                }
                /* a short-lived workspace per layer */
                struct blk ws;
                if (dev_alloc(&ws, (size_t)(seq * 8192 * scale), NULL, 1) == 0) dev_free(&ws);
            }
            /* backward: gradients of each layer, then its activations go */
            for (int l = LAYERS - 1; l >= 0; l--) {
                struct blk grad;
                if (dev_alloc(&grad, (size_t)(seq * 12288 * scale), NULL, 1)) {
                    ooms++;
                    grad.p = NULL;
                }
                for (int k = 5; k >= 0; k--) dev_free(&act[l * 6 + k]);
                dev_free(&grad);
            }
            if (ms.step) ms.step();
        }
        if (leak_mib) { /* a tensor kept alive by mistake, every epoch */
            struct blk leaked;
            if (dev_alloc(&leaked, (size_t)leak_mib * MiB, NULL, 1) != 0) ooms++;
        }
        check("cudaDeviceSynchronize", cudaDeviceSynchronize());
        syncs++;
        if (quiet > 0) { /* idle before the epoch ends (a validation pass on the host): timed policies act */
            struct timespec ts = {(time_t)quiet, (long)((quiet - (double)(time_t)quiet) * 1e9)};
            nanosleep(&ts, NULL);
        }
        if (ms.stats) {
            struct stats s;
            if (ms.stats(0, &s) == 0)
                printf("epoch %d: peak live %7.1f MiB, reserved %7.1f MiB (peak %7.1f MiB, %.3fx live), "
                       "maps %zu, unmaps %zu, reclaimed pages %zu, OOMs %zu\n",
                       ep, s.peak_live_bytes / 1048576.0, s.reserved_bytes / 1048576.0,
                       s.peak_reserved_bytes / 1048576.0,
                       s.peak_live_bytes ? (double)s.peak_reserved_bytes / (double)s.peak_live_bytes : 0.0,
                       s.map_ops, s.unmap_ops, s.reclaimed_pages, s.ooms);
        } else {
            printf("epoch %d done\n", ep);
        }
        if (ms.epoch) ms.epoch();
        if (pause > 0) { /* an evaluation or checkpoint phase: no allocations for a while */
            struct timespec ts = {(time_t)pause, (long)((pause - (double)(time_t)pause) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    for (int i = 0; i < np; i++) dev_free(&params[i]);
    check("cudaStreamDestroy", cudaStreamDestroy(side));
    printf("train-demo: finished, %d failed allocations, %d device synchronizes of its own\n", ooms, syncs);
    return 0;
}
