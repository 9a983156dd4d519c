/*
 * fi_workload.c: reli-workload, the small end-to-end workload of the fault-injection suite
 * (tests/reliability/fault_injection.py). Run under LD_PRELOAD=libmemshim.so on the CUDA doubles,
 * it mixes what a PyTorch job does to the allocator: cudaMalloc/cudaFree (segment mode) and
 * memshim_malloc/memshim_free on two streams (tensor mode), record_stream, empty_cache, epochs
 * and cudaMemGetInfo, under a MEMSHIM_LIMIT small enough that pages are reclaimed and remapped.
 * Every live block carries a pattern on each of its host pages, checked before it is freed and
 * every few operations, so a block handed out twice or a page lost in a remap is seen at once.
 *
 * Every call's failure is one the CUDA APIs document (cudaErrorMemoryAllocation, a NULL from
 * memshim_malloc, a cudaFree that returns a sticky error and keeps its block): the workload
 * counts them and goes on, as a training job's retry logic would. At the end it frees what is
 * left, calls memshim_empty_cache() twice and reads the double's live handles and mappings.
 *
 * Exit status: 0 done; 3 the job itself could not start (cudaSetDevice or a stream failed: a
 * documented runtime error); 4 a pattern was corrupted; 5 handles or mappings were left after
 * everything was freed and the cache emptied; 6 a block could never be freed. The last stdout
 * line is "reli-workload: key=value ..." with the counts. Exit or a signal is all the caller
 * checks besides that line.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "cudbl.h"

#define MiB ((size_t)1 << 20)
#define LIVE 16

static void *(*ms_malloc)(ssize_t, int, void *);
static void (*ms_free)(void *, ssize_t, int, void *);
static void (*ms_record)(void *, void *);
static void (*ms_empty)(void);
static void (*ms_epoch)(void);

struct blk {
    unsigned char *p;
    size_t n;
    cudaStream_t stream;
    int pluggable;
    uint32_t tag;
};

static struct {
    long allocs, pool_null, rt_oom, rt_err, free_err, corrupt, verified;
} c;

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static unsigned char pat(const struct blk *b, size_t i)
{
    return (unsigned char)(b->tag * 131u + (uint32_t)(i >> 16) * 7u + 1u);
}

static void put(const struct blk *b)
{
    for (size_t i = 0; i < b->n; i += 65536) b->p[i] = pat(b, i);
    b->p[b->n - 1] = (unsigned char)~b->tag;
}

static int ok(const struct blk *b)
{
    for (size_t i = 0; i < b->n; i += 65536)
        if (b->p[i] != pat(b, i)) return 0;
    return b->p[b->n - 1] == (unsigned char)~b->tag;
}

static void check(const struct blk *b, const char *when)
{
    c.verified++;
    if (ok(b)) return;
    c.corrupt++;
    fprintf(stderr, "reli-workload: CORRUPT block %p (%zu bytes, tag %u) %s\n", (void *)b->p, b->n,
            b->tag, when);
}

static size_t pick_size(uint32_t x)
{
    switch (x % 20) {
    case 0: case 1: case 2: return 8 * MiB + (x >> 5) % (12 * MiB); /* large */
    case 3: case 4: case 5: case 6: case 7: case 8: case 9:
        return MiB + (x >> 5) % (5 * MiB); /* medium */
    default: return 1 + (x >> 5) % (256 * 1024); /* small */
    }
}

static int blk_free(struct blk *b)
{
    check(b, "before free");
    if (b->pluggable) {
        ms_free(b->p, (ssize_t)b->n, 0, b->stream);
    } else {
        cudaError_t e = cudaFree(b->p);
        if (e != cudaSuccess) { /* documented: the sticky error is returned, the block stays */
            c.free_err++;
            return 1;
        }
    }
    b->p = NULL;
    return 0;
}

/* A thread with no current context (PyTorch's autograd threads are like this): memshim must push
 * the device's context for its driver calls and leave the thread as it found it. */
static void *side_thread(void *arg)
{
    (void)arg;
    struct blk b = {NULL, 3 * MiB + 4321, 0, 1, 0xA5A5u};
    b.p = ms_malloc((ssize_t)b.n, 0, NULL);
    if (!b.p) {
        c.pool_null++;
        return NULL;
    }
    c.allocs++;
    put(&b);
    check(&b, "on the side thread");
    ms_free(b.p, (ssize_t)b.n, 0, NULL);
    ms_empty();
    return NULL;
}

int main(int argc, char **argv)
{
    int ops = 240;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ops") && i + 1 < argc) ops = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--ops N]\n", argv[0]);
            return 2;
        }
    }
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&ms_record = dlsym(RTLD_DEFAULT, "memshim_record_stream");
    *(void **)&ms_empty = dlsym(RTLD_DEFAULT, "memshim_empty_cache");
    *(void **)&ms_epoch = dlsym(RTLD_DEFAULT, "memshim_epoch");
    int have_ms = ms_malloc && ms_free && ms_record && ms_empty && ms_epoch;

    cudaError_t e = cudaSetDevice(0);
    if (e == cudaSuccess) e = cudaFree(NULL);
    cudaStream_t s[2] = {0, 0};
    if (e == cudaSuccess) e = cudaStreamCreate(&s[0]);
    if (e == cudaSuccess) e = cudaStreamCreate(&s[1]);
    if (e != cudaSuccess) {
        printf("reli-workload: setup failed: %s\n", cudaGetErrorName(e));
        return 3;
    }

    struct blk live[LIVE];
    memset(live, 0, sizeof live);
    uint32_t tag = 1;
    for (int op = 0; op < ops; op++) {
        uint32_t x = next_rand();
        struct blk *b = &live[x % LIVE];
        if (b->p) {
            blk_free(b);
        } else {
            size_t n = pick_size(x >> 4);
            b->n = n;
            b->tag = tag++;
            b->pluggable = have_ms && (x >> 3) % 5 >= 2;
            b->stream = b->pluggable ? s[(x >> 9) & 1] : 0;
            void *p = NULL;
            if (b->pluggable) {
                p = ms_malloc((ssize_t)n, 0, b->stream);
                if (!p) c.pool_null++;
            } else {
                e = cudaMalloc(&p, n);
                if (e == cudaErrorMemoryAllocation) c.rt_oom++;
                else if (e != cudaSuccess) c.rt_err++;
                if (e != cudaSuccess) p = NULL;
            }
            if (p) {
                b->p = p;
                c.allocs++;
                put(b);
                if (b->pluggable && (x >> 12) % 8 == 0) ms_record(b->p, s[!((x >> 9) & 1)]);
            }
        }
        if (op % 25 == 24)
            for (int i = 0; i < LIVE; i++)
                if (live[i].p) check(&live[i], "in a periodic check");
        if (have_ms && op % 50 == 49) ms_empty();
        if (have_ms && op % 80 == 79) ms_epoch();
        if (have_ms && op % 40 == 39) {
            pthread_t th;
            if (pthread_create(&th, NULL, side_thread, NULL) == 0) pthread_join(th, NULL);
        }
        if (op % 30 == 29) {
            size_t f = 0, t = 0;
            if (cudaMemGetInfo(&f, &t) != cudaSuccess) c.rt_err++;
        }
    }
    /* Free everything; a cudaFree that failed on a sticky error is tried once more. */
    int stuck = 0;
    for (int i = 0; i < LIVE; i++)
        if (live[i].p && blk_free(&live[i]) && blk_free(&live[i])) stuck++;
    cudaDeviceSynchronize();
    if (have_ms) {
        ms_empty();
        ms_empty(); /* a driver error injected into the first one leaves pages cached, not lost */
    }
    struct cudbl_counts k;
    cudbl_get_counts(&k);
    printf("reli-workload: ops=%d allocs=%ld pool_null=%ld rt_oom=%ld rt_err=%ld free_err=%ld "
           "verified=%ld corrupt=%ld stuck=%d handles=%ld mappings=%ld dev_allocs=%ld events=%ld\n",
           ops, c.allocs, c.pool_null, c.rt_oom, c.rt_err, c.free_err, c.verified, c.corrupt, stuck,
           k.handles, k.mappings, k.allocs, k.events);
    fflush(stdout);
    cudaStreamDestroy(s[0]);
    cudaStreamDestroy(s[1]);
    if (c.corrupt) return 4;
    if (stuck) return 6;
    if (have_ms && (k.handles || k.mappings || k.allocs)) return 5;
    return 0;
}
