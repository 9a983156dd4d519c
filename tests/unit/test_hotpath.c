/*
 * test_hotpath.c: the cheap allocation path behind reports, allocation sites and the snapshot
 * ring (docs/benchmarks.md, issue 11's cost): msh_ticks() stamps that convert to wall-clock
 * time; sampled latency timing (exact with
 * MEMSHIM_LATENCY_SAMPLE=1 and for a thread's first calls, unbiased and not aliased with a
 * periodic pattern otherwise); the marks
 * the pool keeps on memshim_malloc's blocks; and the per-thread history rings: one history in
 * causal order across threads, events kept when their thread exits, more threads than rings,
 * and a reader racing a writer never taking a torn entry for a whole one.
 */
#include "harness.h"
#include "core.h"
#include "history.h"
#include "hotclock.h"
#include "memshim.h"
#include "msh.h"
#include "pool.h"
#include "sites.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MiB MSH_MiB

__attribute__((constructor)) static void env(void)
{
    setenv("CUDBL_CAPACITY", "4G", 0);
    setenv("CUDBL_GRANULARITY", "2M", 0);
    setenv("MEMSHIM_LOG", "error", 1);
}

static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static struct msh_pool *pool0(void)
{
    void *x = memshim_malloc(MiB, 0, NULL); /* starts memshim and device 0's pool */
    if (x) memshim_free(x, MiB, 0, NULL);
    return msh_core_pool_get(0);
}

/* ---- ticks ------------------------------------------------------------------------------------ */

/* Stamps become PyTorch's time_us: the conversion lands where the wall clock was. (They do not
 * order events across threads: two CPUs' counters can disagree by tens of ns; the ring numbers
 * its events from a shared counter for that, checked below.) */
TEST(ticks_convert_to_wall_clock)
{
    msh_hotclock_init();
    uint64_t before = wall_us(), t = msh_ticks(), after = wall_us();
    struct msh_ticks_wall w;
    msh_ticks_wall_init(&w);
    uint64_t us = msh_ticks_wall_us(&w, t);
    CHECKF(us + 2000 >= before && us <= after + 2000, "stamp at %llu us, taken between %llu and %llu",
           (unsigned long long)us, (unsigned long long)before, (unsigned long long)after);
    double npt = msh_ticks_ns_per_tick();
    CHECKF(npt > 0.01 && npt < 100.0, "%.4f ns per tick", npt);
    uint64_t prev = msh_ticks(), back = 0;
    for (int i = 0; i < 100000; i++) {
        uint64_t now = msh_ticks();
        back += now < prev;
        prev = now;
    }
    CHECKF(back == 0, "%llu of 100000 stamps on one thread went back", (unsigned long long)back);
}

/* ---- sampled latency timing ------------------------------------------------------------------- */

static uint64_t hist_sum(const uint64_t *h)
{
    uint64_t n = 0;
    for (int b = 0; b < MSH_LAT_BUCKETS; b++) n += h[b];
    return n;
}

static void pairs(struct msh_pool *p, int n)
{
    for (int i = 0; i < n; i++) {
        uint64_t a = 0;
        if (msh_pool_alloc(p, (size_t)(4096 + 512 * (i % 64)), 0, &a) == 0) msh_pool_free(p, a, 0);
    }
}

TEST(latency_timing_exact_at_1_and_unbiased_at_64)
{
    struct msh_pool *p = pool0();
    REQUIRE(p);
    msh_pool_set_timing(p, true);
    struct msh_pool_stats s0, s1;
    msh_lat_set_every(1);
    msh_pool_get_stats(p, &s0);
    pairs(p, 3000);
    msh_pool_get_stats(p, &s1);
    CHECKF(hist_sum(s1.alloc_lat) - hist_sum(s0.alloc_lat) == 3000, "%llu allocs timed of 3000",
           (unsigned long long)(hist_sum(s1.alloc_lat) - hist_sum(s0.alloc_lat)));
    CHECK(hist_sum(s1.free_lat) - hist_sum(s0.free_lat) == 3000);
    CHECK(s1.alloc_ns_total > s0.alloc_ns_total);
    /* one call in 64 timed, each counting 64: about 2000 timed of 128000 (sd 45: 5 sd is 11%) */
    msh_lat_set_every(64);
    msh_pool_get_stats(p, &s0);
    pairs(p, 128000);
    msh_pool_get_stats(p, &s1);
    uint64_t na = hist_sum(s1.alloc_lat) - hist_sum(s0.alloc_lat), nf = hist_sum(s1.free_lat) - hist_sum(s0.free_lat);
    CHECKF(na % 64 == 0 && na > 128000 * 0.88 && na < 128000 * 1.12, "allocs estimated %llu of 128000",
           (unsigned long long)na);
    CHECKF(nf % 64 == 0 && nf > 128000 * 0.88 && nf < 128000 * 1.12, "frees estimated %llu of 128000",
           (unsigned long long)nf);
    /* the estimated total time over the estimated count: a mean of a cached call, not 64x one */
    double mean = (double)(s1.alloc_ns_total - s0.alloc_ns_total) / (double)(na ? na : 1);
    CHECKF(mean > 5 && mean < 100000, "mean alloc %.0f ns", mean);
    msh_pool_set_timing(p, false);
    msh_lat_set_every(1);
}

static struct msh_pool *exact_pool;
static void *exact_thread(void *arg)
{
    (void)arg;
    pairs(exact_pool, 1000); /* 2000 calls: within a new thread's first MSH_LAT_EXACT */
    return NULL;
}

/* Short runs (and tests) get exact figures: a thread's first MSH_LAT_EXACT calls are all timed,
 * each counting once, whatever MEMSHIM_LATENCY_SAMPLE says. */
TEST(latency_timing_exact_for_a_threads_first_calls)
{
    struct msh_pool *p = pool0();
    REQUIRE(p);
    exact_pool = p;
    msh_pool_set_timing(p, true);
    msh_lat_set_every(64);
    struct msh_pool_stats s0, s1;
    msh_pool_get_stats(p, &s0);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, exact_thread, NULL) == 0);
    pthread_join(t, NULL);
    msh_pool_get_stats(p, &s1);
    CHECKF(hist_sum(s1.alloc_lat) - hist_sum(s0.alloc_lat) == 1000, "%llu allocs counted of 1000",
           (unsigned long long)(hist_sum(s1.alloc_lat) - hist_sum(s0.alloc_lat)));
    CHECK(hist_sum(s1.free_lat) - hist_sum(s0.free_lat) == 1000);
    msh_pool_set_timing(p, false);
    msh_lat_set_every(1);
}

/* Training steps repeat: calls timed at a fixed period could always (or never) hit the same
 * call of the step. Random gaps time every position of a period equally often. */
TEST(latency_sampling_does_not_alias_with_a_period)
{
    msh_lat_set_every(64);
    uint64_t timed = 0, at_zero = 0, gaps = 0, prev = 0;
    for (uint64_t i = 0; i < 1280000; i++) {
        if (!msh_lat_sample()) continue;
        timed++;
        at_zero += i % 64 == 0;
        gaps += i - prev;
        prev = i;
    }
    msh_lat_set_every(1);
    CHECKF(timed > 20000 * 0.95 && timed < 20000 * 1.05, "%llu timed of 1280000 (expected 20000)",
           (unsigned long long)timed);
    double share = (double)at_zero / (double)timed; /* 1/64 = 0.0156; sd about 0.0009 */
    CHECKF(share > 0.011 && share < 0.021, "%.4f of the timed calls at position 0 of 64", share);
    CHECK(gaps > 0);
}

/* ---- marks on pool blocks --------------------------------------------------------------------- */

TEST(pool_marks_follow_their_blocks)
{
    struct msh_pool *p = pool0();
    REQUIRE(p);
    uint64_t a = 0, b = 0, c = 0;
    msh_pool_tags.next = 77;
    REQUIRE(msh_pool_alloc(p, 3 * MiB, 0, &a) == 0);
    msh_pool_tags.next = 0;
    REQUIRE(msh_pool_alloc(p, MiB, 0, &b) == 0);
    uint64_t addrs[3] = {a, b, 12345 * 512};
    uint32_t tags[3] = {1, 1, 1};
    msh_pool_block_tags(p, addrs, tags, 3);
    CHECK(tags[0] == 77 && tags[1] == 0 && tags[2] == 0);
    msh_pool_tags.freed = 0;
    REQUIRE(msh_pool_free(p, a, 0) == 0);
    CHECK(msh_pool_tags.freed == 77 && msh_pool_tags.freed_req == 3 * MiB);
    /* the same place again, unmarked: the old mark must not come back with it */
    REQUIRE(msh_pool_alloc(p, 3 * MiB, 0, &c) == 0);
    msh_pool_block_tags(p, &c, tags, 1);
    CHECK(tags[0] == 0);
    REQUIRE(msh_pool_free(p, c, 0) == 0);
    CHECK(msh_pool_tags.freed == 0 && msh_pool_tags.freed_req == 3 * MiB);
    msh_pool_tags.freed = 99;
    /* freed already (it waits in the front end's bin): a double free, refused, nothing reported */
    CHECK(msh_pool_free(p, c, 0) == EALREADY);
    CHECK(msh_pool_tags.freed == 99);
    CHECK(msh_pool_free(p, 12345 * 512, 0) == EINVAL); /* never the pool's */
    CHECK(msh_pool_tags.freed == 99);
    REQUIRE(msh_pool_free(p, b, 0) == 0);
}

/* ---- the history rings ------------------------------------------------------------------------ */

struct copy {
    struct msh_hist_copy hc;
    size_t evcap;
};

static int take(struct copy *c)
{
    size_t nev, nmap, nres;
    msh_history_sizes(0, &nev, &nmap, &nres);
    memset(c, 0, sizeof *c);
    c->evcap = nev + 4096;
    c->hc.ev = malloc(c->evcap * sizeof *c->hc.ev);
    c->hc.mapped = malloc((nmap + 4096) * sizeof *c->hc.mapped);
    c->hc.reserved = malloc((nres + 64) * sizeof *c->hc.reserved);
    if (!c->hc.ev || !c->hc.mapped || !c->hc.reserved) return ENOMEM;
    return msh_history_copy(0, &c->hc, c->evcap, nmap + 4096, nres + 64);
}

static void drop(struct copy *c)
{
    free(c->hc.ev);
    free(c->hc.mapped);
    free(c->hc.reserved);
}

/* Replays the events: no address is allocated while live, every free_requested is followed by its
 * free_completed, times never go back. Returns the number of problems (and prints the first). */
static int replay_problems(const struct msh_hist_copy *hc, size_t *nalloc, size_t *nfree)
{
    size_t cap = 1 << 16, bad = 0;
    uint64_t *live = calloc(cap, sizeof *live); /* open addressing: addr, 1 = deleted */
    *nalloc = *nfree = 0;
    for (size_t i = 0; i < hc->nev; i++) {
        const struct msh_hist_event *e = &hc->ev[i];
        if (i && e->time_us < hc->ev[i - 1].time_us && !bad++)
            fprintf(stderr, "    event %zu goes back in time\n", i);
        if (e->action != MSH_H_ALLOC && e->action != MSH_H_FREE_REQUESTED) continue;
        size_t j = (e->addr >> 9) * 0x9E3779B97F4A7C15ull >> 48 & (cap - 1), hole = SIZE_MAX;
        while (live[j] && live[j] != e->addr) {
            if (live[j] == 1 && hole == SIZE_MAX) hole = j;
            j = (j + 1) & (cap - 1);
        }
        bool is_live = live[j] == e->addr;
        if (e->action == MSH_H_ALLOC) {
            ++*nalloc;
            if (is_live && !bad++) fprintf(stderr, "    event %zu allocates 0x%llx while it is live\n", i, (unsigned long long)e->addr);
            if (!is_live) live[hole != SIZE_MAX ? hole : j] = e->addr;
        } else {
            ++*nfree;
            bool pair = i + 1 < hc->nev && hc->ev[i + 1].action == MSH_H_FREE_COMPLETED && hc->ev[i + 1].addr == e->addr;
            if (!pair && !bad++) fprintf(stderr, "    event %zu: a free_requested without its free_completed\n", i);
            if (!is_live && *nalloc && !bad++) /* a window may start after the alloc; later frees need one */
                fprintf(stderr, "    event %zu frees 0x%llx, not live\n", i, (unsigned long long)e->addr);
            if (is_live) live[j] = 1;
        }
    }
    free(live);
    return (int)bad;
}

#define T_ITERS 3000
static pthread_barrier_t churn_start, churn_end;
static void *churn(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    pthread_barrier_wait(&churn_start); /* all four alive at once: four rings to merge */
    void *held[8] = {0};
    size_t hsz[8] = {0};
    for (int i = 0; i < T_ITERS; i++) {
        int k = (int)(rand_r(&seed) % 8);
        if (held[k]) memshim_free(held[k], (ssize_t)hsz[k], 0, NULL);
        hsz[k] = (size_t)(512 * (1 + rand_r(&seed) % 4096));
        held[k] = memshim_malloc((ssize_t)hsz[k], 0, NULL);
    }
    for (int k = 0; k < 8; k++)
        if (held[k]) memshim_free(held[k], (ssize_t)hsz[k], 0, NULL);
    pthread_barrier_wait(&churn_end); /* no ring is handed on to another of the four */
    return NULL;
}

/* Four threads share one pool, so an address one thread frees is soon another's: the merged
 * history must show every free before the reuse. */
TEST(ring_orders_events_across_threads)
{
    REQUIRE(pool0());
    REQUIRE(memshim_history_record(2, 1 << 20, 1, 0) == 0);
    uint64_t before = wall_us();
    pthread_t th[4];
    pthread_barrier_init(&churn_start, NULL, 4);
    pthread_barrier_init(&churn_end, NULL, 4);
    for (int t = 0; t < 4; t++) REQUIRE(pthread_create(&th[t], NULL, churn, (void *)(uintptr_t)(t + 1)) == 0);
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&churn_start);
    pthread_barrier_destroy(&churn_end);
    uint64_t after = wall_us();
    struct copy c;
    REQUIRE(take(&c) == 0);
    size_t na, nf;
    int bad = replay_problems(&c.hc, &na, &nf);
    CHECKF(bad == 0, "%d problems in %zu events", bad, c.hc.nev);
    CHECKF(na == 4 * T_ITERS && nf == 4 * T_ITERS, "%zu allocs and %zu frees of %d each", na, nf, 4 * T_ITERS);
    bool in_time = c.hc.nev > 0 && c.hc.ev[0].time_us + 2000 >= before && c.hc.ev[c.hc.nev - 1].time_us <= after + 2000;
    CHECKF(in_time, "events from %llu to %llu us, run from %llu to %llu", (unsigned long long)(c.hc.nev ? c.hc.ev[0].time_us : 0),
           (unsigned long long)(c.hc.nev ? c.hc.ev[c.hc.nev - 1].time_us : 0), (unsigned long long)before,
           (unsigned long long)after);
    drop(&c);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

static pthread_barrier_t wave_barrier;
static void *wave(void *arg)
{
    pthread_barrier_wait(&wave_barrier); /* all alive at once: more threads than rings */
    for (int i = 0; i < 20; i++) {
        size_t n = 512 * (size_t)(1 + (i * 37 + (int)(uintptr_t)arg) % 700);
        void *p = memshim_malloc((ssize_t)n, 0, NULL);
        if (p) memshim_free(p, (ssize_t)n, 0, NULL);
    }
    return NULL;
}

/* 2 waves of 100 threads alive at once, each exiting: 64 rings serve them (the rest share one),
 * rings of exited threads go to the next wave, and no event is lost. */
TEST(ring_keeps_events_of_exited_threads_and_of_more_threads_than_rings)
{
    REQUIRE(pool0());
    REQUIRE(memshim_history_record(2, 1 << 20, 1, 0) == 0);
    for (int w = 0; w < 2; w++) {
        pthread_t th[100];
        pthread_barrier_init(&wave_barrier, NULL, 100);
        for (int t = 0; t < 100; t++) REQUIRE(pthread_create(&th[t], NULL, wave, (void *)(uintptr_t)t) == 0);
        for (int t = 0; t < 100; t++) pthread_join(th[t], NULL);
        pthread_barrier_destroy(&wave_barrier);
    }
    struct copy c;
    REQUIRE(take(&c) == 0);
    size_t na, nf;
    int bad = replay_problems(&c.hc, &na, &nf);
    CHECKF(bad == 0, "%d problems", bad);
    CHECKF(na == 4000 && nf == 4000, "%zu allocs and %zu frees of 4000", na, nf);
    drop(&c);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

/* A writer fills a 256-event ring over and over while a reader copies it: each alloc carries its
 * sequence number (as its stack) and the writer logs what it allocated under that number, so an
 * entry mixing two events, or one the writer overwrote while it was read, shows. */
#define W_EVENTS 400000
static uint64_t wlog_addr[W_EVENTS + 1], wlog_size[W_EVENTS + 1];
static int writer_done, writer_go;

static void *ring_writer(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&writer_go, __ATOMIC_ACQUIRE)) {
    }
    for (uint32_t k = 1; k <= W_EVENTS; k++) {
        size_t n = 512 * (size_t)(1 + (k * 7919u) % 2048);
        __atomic_store_n(&wlog_size[k], n, __ATOMIC_RELAXED);
        msh_sites_last_stack = k; /* what the ring records as this alloc's stack */
        void *p = memshim_malloc((ssize_t)n, 0, NULL);
        __atomic_store_n(&wlog_addr[k], (uint64_t)(uintptr_t)p, __ATOMIC_RELAXED);
        if (p) memshim_free(p, (ssize_t)n, 0, NULL);
    }
    __atomic_store_n(&writer_done, 1, __ATOMIC_RELEASE);
    return NULL;
}

TEST(ring_reader_never_takes_a_torn_entry)
{
    REQUIRE(pool0());
    REQUIRE(memshim_history_record(2, 256, 1, 1) == 0);
    pthread_t w;
    REQUIRE(pthread_create(&w, NULL, ring_writer, NULL) == 0);
    struct msh_hist_copy hc = {0};
    static struct msh_hist_event ev[512];
    static struct msh_hist_range mapped[1 << 14], reserved[256];
    hc.ev = ev;
    hc.mapped = mapped;
    hc.reserved = reserved;
    size_t copies = 0, checked = 0, torn = 0, over = 0;
    __atomic_store_n(&writer_go, 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&writer_done, __ATOMIC_ACQUIRE)) {
        if (msh_history_copy(0, &hc, 512, 1 << 14, 256)) continue;
        copies++;
        over += hc.nev > 256;
        uint32_t last = 0;
        for (size_t j = 0; j < hc.nev; j++) {
            const struct msh_hist_event *e = &hc.ev[j];
            if (e->action != MSH_H_ALLOC) continue;
            checked++;
            uint64_t a = e->stack <= W_EVENTS ? __atomic_load_n(&wlog_addr[e->stack], __ATOMIC_RELAXED) : 0;
            uint64_t n = e->stack <= W_EVENTS ? __atomic_load_n(&wlog_size[e->stack], __ATOMIC_RELAXED) : 0;
            /* the log's address lands just after the event: not yet there is no verdict */
            bool ok = e->stack >= 1 && e->stack <= W_EVENTS && e->stack > last && e->size == n && (!a || a == e->addr);
            if (!ok && !torn)
                fprintf(stderr, "    copy %zu entry %zu: seq %u (after %u) addr 0x%llx size %llu; logged 0x%llx %llu\n",
                        copies, j, e->stack, last, (unsigned long long)e->addr, (unsigned long long)e->size,
                        (unsigned long long)a, (unsigned long long)n);
            torn += !ok;
            last = e->stack;
        }
    }
    pthread_join(w, NULL);
    CHECKF(copies >= 100, "only %zu copies during the run", copies);
    CHECKF(checked > 0 && torn == 0, "%zu of %zu alloc entries torn or out of order", torn, checked);
    CHECKF(over == 0, "%zu copies longer than the ring's 256 events", over);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

TEST_MAIN()
