/*
 * threads.c: 8 threads x 1000 cudaMalloc/cudaFree through memshim, each block filled with a
 * pattern unique to its thread and operation and checked before it is freed, with several
 * blocks live per thread so blocks of different threads sit side by side in the pool.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "memshim.h"

enum { THREADS = 8, OPS = 1000, LIVE = 8 };
static atomic_long errors, corrupt;

struct blk { unsigned char *p; size_t n; unsigned tag; };

static void put(struct blk *b)
{
    for (size_t i = 0; i + 1 < b->n; i += 64) b->p[i] = (unsigned char)(b->tag + i / 64);
    b->p[b->n - 1] = (unsigned char)~b->tag;
}

static int ok(const struct blk *b)
{
    for (size_t i = 0; i + 1 < b->n; i += 64)
        if (b->p[i] != (unsigned char)(b->tag + i / 64)) return 0;
    return b->p[b->n - 1] == (unsigned char)~b->tag;
}

static void *worker(void *arg)
{
    unsigned id = (unsigned)(uintptr_t)arg, seed = id * 2654435761u + 1;
    struct blk live[LIVE];
    memset(live, 0, sizeof live);
    for (int op = 0; op < OPS; op++) {
        int slot = op % LIVE;
        if (live[slot].p) {
            if (!ok(&live[slot])) atomic_fetch_add(&corrupt, 1);
            if (cudaFree(live[slot].p) != cudaSuccess) atomic_fetch_add(&errors, 1);
            live[slot].p = NULL;
        }
        seed = seed * 1103515245u + 12345u;
        size_t n = 1 + (seed >> 8) % (seed & 1 ? 4096 : 3u << 20);
        void *p = NULL;
        if (cudaMalloc(&p, n) != cudaSuccess || !p) { atomic_fetch_add(&errors, 1); continue; }
        live[slot] = (struct blk){p, n, id * 131u + (unsigned)op};
        put(&live[slot]);
    }
    for (int s = 0; s < LIVE; s++) {
        if (!live[s].p) continue;
        if (!ok(&live[s])) atomic_fetch_add(&corrupt, 1);
        if (cudaFree(live[s].p) != cudaSuccess) atomic_fetch_add(&errors, 1);
    }
    return NULL;
}

TEST(eight_threads_thousand_ops)
{
    int (*stats)(int, struct memshim_stats *) =
        (int (*)(int, struct memshim_stats *))dlsym(RTLD_DEFAULT, "memshim_get_stats");
    REQUIRE(stats != NULL);
    REQUIRE(cudaFree(NULL) == cudaSuccess);
    pthread_t th[THREADS];
    for (int i = 0; i < THREADS; i++)
        REQUIRE(pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)(i + 1)) == 0);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    CHECKF(atomic_load(&errors) == 0, "%ld failed calls", atomic_load(&errors));
    CHECKF(atomic_load(&corrupt) == 0, "%ld corrupted blocks", atomic_load(&corrupt));
    struct memshim_stats st;
    REQUIRE(stats(0, &st) == 0);
    CHECKF(st.allocs >= (size_t)THREADS * OPS, "pool allocs %zu", st.allocs);
    CHECK(st.allocs == st.frees);
    CHECK(st.live_bytes == 0);
}

TEST_MAIN()
