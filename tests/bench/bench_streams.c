/*
 * bench_streams.c: make bench section 7 (issue 15 item 3). Event records, stream waits, event
 * queries and device synchronizes that the pool makes per 1000 alloc/free pairs, on the CUDA
 * driver double, for the stream mix of a data-parallel job: the default (compute) stream D, an
 * NCCL-like stream N, and a copy stream C. Each scenario runs on a fresh pool and reports what
 * the double saw (cudbl_call_count), beside what PyTorch's caching allocator does for the same
 * sequence by its own rules (c10/cuda/CUDACachingAllocator.cpp: a block is reused on its
 * allocation stream only, and record_stream makes one event per extra stream at the free, which
 * is queried, never waited on, until it completes).
 *
 * Built by scripts/bench.sh against build/libmemshim_core.a and the double; it prints a markdown
 * table. The double runs queued work only when a stream is synchronized (here: at the end of each
 * step), so events recorded at frees are still pending at the next reuse: the worst case for waits.
 */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cudbl.h"
#include "device.h"
#include "msh.h"
#include "pool.h"

#define MiB ((size_t)1 << 20)

static struct msh_device dev;
static struct msh_pool *g_pool;
static CUstream D, N, C;

struct counts {
    long rec, wait, query, sync;
};

static void counts_now(struct counts *c)
{
    c->rec = cudbl_call_count("cuEventRecord");
    c->wait = cudbl_call_count("cuStreamWaitEvent");
    c->query = cudbl_call_count("cuEventQuery");
    c->sync = cudbl_call_count("cuCtxSynchronize") + cudbl_call_count("cuStreamSynchronize");
}

static struct msh_pool *pool_new(size_t limit)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = limit;
    p.no_learn = true; /* the streams alone: no learned step */
    struct msh_pool *pool = NULL;
    return msh_pool_create(&dev, &p, &pool) ? NULL : pool;
}

static uint64_t S(CUstream s) { return (uint64_t)(uintptr_t)s; }

static long own_syncs; /* the benchmark's own stream synchronizes, left out of the figures */

static void settle(void)
{
    own_syncs += 3;
    cuStreamSynchronize(D);
    cuStreamSynchronize(N);
    cuStreamSynchronize(C);
}

static size_t size_of(int i)
{
    static const size_t sizes[] = {64 * 1024, 512 * 1024, 3 * MiB, 8 * MiB};
    return sizes[i % 4];
}

/* Each scenario returns the number of pairs it made and the hand-offs among them. */
typedef void (*scenario_fn)(struct msh_pool *pool, long *pairs, long *handoffs);

/* 1000 pairs on the default stream alone. */
static void same_stream(struct msh_pool *pool, long *pairs, long *handoffs)
{
    for (int i = 0; i < 1000; i++) {
        uint64_t a;
        if (msh_pool_alloc(pool, size_of(i), S(D), &a) == 0) msh_pool_free(pool, a, S(D));
    }
    *pairs = 1000;
    *handoffs = 0;
}

/* The case: a block was used and freed on the side stream once, then pairs on each of D
 * and N (interleaved): 500 to warm up, not counted (when one stream could take memory the other
 * freed, the pool may ask for events at that stream's next frees: a window of 256), then 1000. */
static void pairs_on_d_and_n(int n)
{
    for (int i = 0; i < n; i++) {
        uint64_t a, b;
        int ra = msh_pool_alloc(g_pool, size_of(i), S(D), &a), rb = msh_pool_alloc(g_pool, size_of(i + 1), S(N), &b);
        if (!ra) msh_pool_free(g_pool, a, S(D));
        if (!rb) msh_pool_free(g_pool, b, S(N));
        if (i % 50 == 49) settle(); /* the GPU catches up now and then */
    }
}

static void warm_side_stream(struct msh_pool *pool)
{
    uint64_t s;
    g_pool = pool;
    if (msh_pool_alloc(pool, MiB, S(N), &s) == 0) {
        msh_pool_record_stream(pool, s, S(D));
        msh_pool_free(pool, s, S(N));
    }
    settle();
    pairs_on_d_and_n(500);
}

static void after_a_side_stream(struct msh_pool *pool, long *pairs, long *handoffs)
{
    (void)pool;
    for (int i = 0; i < 0; i++) {
    }
    pairs_on_d_and_n(1000);
    *pairs = 2000;
    *handoffs = 0;
}

/* Gradient buckets: allocated on D, handed to N for the all-reduce (record_stream), freed on D;
 * the next bucket reuses the memory on D. One hand-off per pair. */
static void bucket_handoffs(struct msh_pool *pool, long *pairs, long *handoffs)
{
    for (int i = 0; i < 1000; i++) {
        uint64_t a;
        if (msh_pool_alloc(pool, 25 * MiB, S(D), &a)) continue;
        msh_pool_record_stream(pool, a, S(N));
        msh_pool_free(pool, a, S(D));
        if (i % 10 == 9) settle();
    }
    *pairs = 1000;
    *handoffs = 1000;
}

/* Prefetch: weights copied in on C, used on D (record_stream), freed on C and reused there. */
static void prefetch_handoffs(struct msh_pool *pool, long *pairs, long *handoffs)
{
    for (int i = 0; i < 1000; i++) {
        uint64_t a;
        if (msh_pool_alloc(pool, 48 * MiB, S(C), &a)) continue;
        msh_pool_record_stream(pool, a, S(D));
        msh_pool_free(pool, a, S(C));
        if (i % 10 == 9) settle();
    }
    *pairs = 1000;
    *handoffs = 1000;
}

/* A DDP-like step, 100 times: 8 activations on D kept for backward, 2 buckets handed to N, one
 * prefetch on C handed to D, and N's own small workspace; at a tight limit so that memory moves
 * between streams (each free on another stream than the next use is a hand-off). */
static void ddp_mix(struct msh_pool *pool, long *pairs, long *handoffs)
{
    long np = 0, nh = 0;
    for (int step = 0; step < 100; step++) {
        uint64_t act[8], w;
        int na = 0;
        for (int k = 0; k < 8; k++)
            if (msh_pool_alloc(pool, (size_t)(4 + k) * MiB, S(D), &act[na]) == 0) na++;
        if (msh_pool_alloc(pool, 16 * MiB, S(C), &w) == 0) {
            msh_pool_record_stream(pool, w, S(D));
            msh_pool_free(pool, w, S(C));
            np++;
            nh++;
        }
        for (int b = 0; b < 2; b++) {
            uint64_t g, ws;
            if (msh_pool_alloc(pool, 12 * MiB, S(D), &g) == 0) {
                msh_pool_record_stream(pool, g, S(N));
                if (msh_pool_alloc(pool, 256 * 1024, S(N), &ws) == 0) {
                    msh_pool_free(pool, ws, S(N));
                    np++;
                }
                msh_pool_free(pool, g, S(D));
                np++;
                nh++;
            }
        }
        for (int k = na - 1; k >= 0; k--) msh_pool_free(pool, act[k], S(D));
        np += na;
        settle();
    }
    *pairs = np;
    *handoffs = nh;
}

int main(void)
{
    cudbl_set_async(0);
    if (cuInit(0) != CUDA_SUCCESS || msh_dev_cuda_init(&dev, 0)) {
        printf("(the driver double did not start: no stream figures)\n");
        return 0;
    }
    CUdevice d;
    CUcontext ctx;
    cuDeviceGet(&d, 0);
    cuDevicePrimaryCtxRetain(&ctx, d);
    cuCtxSetCurrent(ctx);
    cuStreamCreate(&D, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&N, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&C, CU_STREAM_NON_BLOCKING);
    static const struct {
        const char *what;
        scenario_fn fn;
        void (*warm)(struct msh_pool *); /* not counted */
        size_t limit;
        const char *torch; /* what PyTorch's allocator does, per 1000 pairs */
    } sc[] = {
        {"same stream: 1000 pairs on D", same_stream, NULL, 0, "0 / 0"},
        {"same stream: 2000 pairs on D and N, after one block was used on both (and 500 pairs of warm-up)",
         after_a_side_stream, warm_side_stream, 0, "0 / 0"},
        {"hand-off: gradient bucket on D, record_stream(N), freed on D (1000)", bucket_handoffs, NULL, 0,
         "1000 / 0 (+ queries)"},
        {"hand-off: prefetch on C, record_stream(D), freed on C (1000)", prefetch_handoffs, NULL, 0,
         "1000 / 0 (+ queries)"},
        {"DDP-like mix, 100 steps, limit 160 MiB (pairs and hand-offs counted)", ddp_mix, NULL, 160 * MiB,
         "1 per hand-off / 0 (+ queries)"},
    };
    printf("| scenario | pairs | record_stream hand-offs | reuses across streams | event records | stream waits | event queries | synchronizes | per 1000 pairs: records / waits | PyTorch's allocator, per 1000 pairs: records / waits |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
        struct msh_pool *pool = pool_new(sc[i].limit);
        if (!pool) {
            printf("| %s | (no pool) |\n", sc[i].what);
            continue;
        }
        if (sc[i].warm) sc[i].warm(pool);
        struct msh_pool_stats st0, st1;
        msh_pool_get_stats(pool, &st0);
        struct counts c0, c1;
        counts_now(&c0);
        own_syncs = 0;
        long pairs = 0, handoffs = 0;
        sc[i].fn(pool, &pairs, &handoffs);
        counts_now(&c1);
        c1.sync -= own_syncs;
        msh_pool_get_stats(pool, &st1);
        long xreuse = (long)(st1.cross_stream_reuses - st0.cross_stream_reuses);
        settle();
        msh_pool_destroy(pool);
        long rec = c1.rec - c0.rec, wait = c1.wait - c0.wait, q = c1.query - c0.query, sy = c1.sync - c0.sync;
        printf("| %s | %ld | %ld | %ld | %ld | %ld | %ld | %ld | %.1f / %.1f | %s |\n", sc[i].what, pairs, handoffs, xreuse, rec, wait, q, sy,
               pairs ? 1000.0 * (double)rec / (double)pairs : 0.0, pairs ? 1000.0 * (double)wait / (double)pairs : 0.0,
               sc[i].torch);
    }
    printf("\nSynchronizes: the pool's cuCtxSynchronize and cuStreamSynchronize calls (the benchmark's own, at the "
           "end of each step or every few pairs, left out).\n");
    return 0;
}
