/*
 * test_front.c: the pool's front end (policy/pool/front.c, issue 30) on the CUDA driver double,
 * held to its rules: a hit is the block freed on that stream with that size, with no driver call;
 * nothing crosses streams without an event; a double free is refused; binned bytes are reserved,
 * never allocated, and live + binned + free bytes tile every region (msh_pool_check); no driver
 * work that needs memory while binned blocks could have served the request; empty-cache, the
 * OOM rescue, step marks, forgetting a stream and destroying the pool leave nothing in the bins;
 * an impossible request is refused before any drain; a step mark trims the bins unused over two
 * steps on the streams that ran, and keeps a silent stream's; a claim given up to drain after a
 * wait keeps what other threads mapped meanwhile; drains for growth (a growing step, streams
 * warming up on each other's growth) are no churn, random sizes are; PyTorch's counters (through the tensor-mode
 * entry points) equal a reference model under random sequences with peak resets, on one thread
 * and on four; a capturing stream never gets a binned block; a fork child starts with nothing.
 */
#include "harness.h"
#include "memshim.h"
#include "msh.h"
#include "pool.h"
#include "torch.h"
#include "core.h"
#include "../cudadouble/cudbl.h"

#include <cuda.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "on_double.h"

#define MiB MSH_MiB
#define PAGE (2 * MiB)
#define SA 0x1000u /* stream handles: only names to the pool, never given to the driver here... */
#define SB 0x2000u

__attribute__((constructor)) static void front_env(void)
{
    setenv("CUDBL_CAPACITY", "4G", 0);
    setenv("CUDBL_GRANULARITY", "2M", 0);
    msh_log_level = MSH_LOG_ERROR;
}

/* Two real streams of the double: a free on them may record events (a hand-off). */
static uint64_t sa, sb;
static int streams_up(void)
{
    if (!device_up()) return 0;
    if (!sa) {
        CUstream a, b;
        if (cuStreamCreate(&a, CU_STREAM_NON_BLOCKING) || cuStreamCreate(&b, CU_STREAM_NON_BLOCKING)) return 0;
        sa = (uint64_t)(uintptr_t)a;
        sb = (uint64_t)(uintptr_t)b;
    }
    return 1;
}

static struct msh_pool *pool_new(size_t limit, bool front)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = limit;
    p.front = front;
    p.plan_sync = true;
    p.va_bytes = 8ull << 30;
    struct msh_pool *pool = NULL;
    if (msh_pool_create(&g_dev, &p, &pool)) return NULL;
    return pool;
}

static struct msh_pool_stats stats(struct msh_pool *p)
{
    struct msh_pool_stats st;
    msh_pool_get_stats(p, &st);
    return st;
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int pool_ok(struct msh_pool *p)
{
    char why[512];
    int rc = msh_pool_check(p, why, sizeof why);
    if (rc) fprintf(stderr, "    pool check: %s\n", why);
    return rc == 0;
}

/* The driver calls that need memory (or wait for the device), counted by the double. */
static const char *const MEMFNS[] = {"cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease", "cuMemSetAccess",
                                     "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"};
#define NMEM (sizeof MEMFNS / sizeof *MEMFNS)
static long mem_calls(void)
{
    long n = 0;
    for (size_t i = 0; i < NMEM; i++) n += cudbl_call_count(MEMFNS[i]);
    return n;
}
static long all_calls(void)
{
    return mem_calls() + cudbl_call_count("cuEventRecord") + cudbl_call_count("cuEventQuery") +
           cudbl_call_count("cuStreamWaitEvent") + cudbl_call_count("cuEventCreate");
}

TEST(a_hit_is_the_block_freed_on_that_stream_with_no_driver_call)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t a = 0, b = 0, c = 0;
    REQUIRE(msh_pool_alloc(p, 3 * MiB + 100, sa, &a) == 0);
    REQUIRE(msh_pool_alloc(p, 3 * MiB + 100, sa, &b) == 0); /* keeps a's pages from coalescing away */
    REQUIRE(msh_pool_free(p, a, sa) == 0);
    struct msh_pool_stats st = stats(p);
    CHECK(st.binned_blocks == 1 && st.binned_bytes == 3 * MiB + 512 && st.live_bytes == 3 * MiB + 100);
    long n0 = all_calls();
    REQUIRE(msh_pool_alloc(p, 3 * MiB + 1, sa, &c) == 0); /* same rounded size, same stream */
    CHECKF(c == a, "a hit gives the binned block back: %#llx, freed %#llx", (unsigned long long)c, (unsigned long long)a);
    CHECKF(all_calls() == n0, "%ld driver calls for a hit", all_calls() - n0);
    st = stats(p);
    CHECK(st.front_hits == 1 && st.binned_blocks == 0 && st.live_blocks == 2 && st.live_bytes == 6 * MiB + 101);
    CHECK(pool_ok(p));
    /* another size on the same stream, or the same size on another stream: not that bin */
    REQUIRE(msh_pool_free(p, c, sa) == 0);
    uint64_t d = 0, e = 0;
    REQUIRE(msh_pool_alloc(p, 3 * MiB + 100, sb, &d) == 0);
    CHECKF(d != a, "stream B got stream A's binned block %#llx", (unsigned long long)a);
    REQUIRE(msh_pool_alloc(p, 2 * MiB, sa, &e) == 0);
    CHECKF(e != a, "a 2 MiB request got a binned 3 MiB block");
    CHECK(stats(p).binned_blocks == 1);
    CHECK(pool_ok(p));
    msh_pool_free(p, b, sa);
    msh_pool_free(p, d, sb);
    msh_pool_free(p, e, sa);
    msh_pool_destroy(p);
}

TEST(a_block_used_on_another_stream_never_bins_and_records_its_event)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t a = 0, keep = 0;
    REQUIRE(msh_pool_alloc(p, 4 * MiB, sa, &a) == 0);
    REQUIRE(msh_pool_alloc(p, 4 * MiB, sa, &keep) == 0);
    REQUIRE(msh_pool_record_stream(p, a, sb) == 0); /* record_stream: used on B too */
    long rec = cudbl_call_count("cuEventRecord");
    REQUIRE(msh_pool_free(p, a, sa) == 0);
    CHECK(stats(p).binned_blocks == 0);
    CHECKF(cudbl_call_count("cuEventRecord") == rec + 1, "%ld events recorded at the free of a block used on two "
           "streams", cudbl_call_count("cuEventRecord") - rec);
    /* freed on another stream than its own: the general path too */
    uint64_t c = 0;
    REQUIRE(msh_pool_alloc(p, 4 * MiB, sa, &c) == 0);
    REQUIRE(msh_pool_free(p, c, sb) == 0);
    CHECK(stats(p).binned_blocks == 0);
    CHECK(pool_ok(p));
    msh_pool_free(p, keep, sa);
    msh_pool_destroy(p);
}

TEST(a_double_free_is_refused_and_the_block_handed_out_once)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t a = 0, b = 0, c = 0;
    REQUIRE(msh_pool_alloc(p, 5000, sa, &a) == 0);
    REQUIRE(msh_pool_free(p, a, sa) == 0);
    CHECK(msh_pool_free(p, a, sa) == EALREADY);
    CHECK(msh_pool_free(p, a, sb) == EALREADY);
    struct msh_pool_stats st = stats(p);
    CHECK(st.double_frees == 2 && st.frees == 1 && st.binned_blocks == 1 && st.live_blocks == 0);
    REQUIRE(msh_pool_alloc(p, 5000, sa, &b) == 0);
    REQUIRE(msh_pool_alloc(p, 5000, sa, &c) == 0);
    CHECK(b == a && c != a);
    CHECK(msh_pool_record_stream(p, a + 512, sb) == EINVAL);
    CHECK(pool_ok(p));
    msh_pool_free(p, b, sa);
    msh_pool_free(p, c, sa);
    CHECK(msh_pool_block_size(p, b) == 0 && !msh_pool_owns(p, b)); /* binned: not a live block */
    msh_pool_destroy(p);
}

/* Binned blocks cover the pages a request needs: the request is served by draining them, with
 * no create, map or reclaim. */
TEST(no_driver_work_while_binned_blocks_could_serve)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    enum { N = 12 };
    uint64_t v[N];
    for (int i = 0; i < N; i++) REQUIRE(msh_pool_alloc(p, 2 * MiB, sa, &v[i]) == 0);
    uint64_t top = 0;
    REQUIRE(msh_pool_alloc(p, 512, sa, &top) == 0); /* the line's top stays above them */
    for (int i = 0; i < N; i++) REQUIRE(msh_pool_free(p, v[i], sa) == 0);
    CHECK(stats(p).binned_blocks == N);
    /* use up whatever the pool mapped ahead beyond them */
    uint64_t fill[64];
    int nf = 0;
    long m0 = mem_calls();
    while (nf < 64 && mem_calls() == m0) {
        struct msh_pool_stats s0 = stats(p);
        uint64_t x = 0;
        REQUIRE(msh_pool_alloc(p, 1536 * 1024, sb, &x) == 0);
        fill[nf++] = x;
        if (stats(p).front_drains != s0.front_drains) break; /* the bins were needed already */
    }
    /* now: free the fillers (another stream's bins), and ask for 20 MiB on stream A */
    struct msh_pool_stats s1 = stats(p);
    long c0 = mem_calls();
    uint64_t big = 0;
    REQUIRE(msh_pool_alloc(p, 20 * MiB, sa, &big) == 0);
    struct msh_pool_stats s2 = stats(p);
    CHECKF(s1.binned_blocks == 0 || s2.front_drains > s1.front_drains || mem_calls() == c0,
           "%ld memory driver calls with %zu blocks binned and no drain first", mem_calls() - c0, s1.binned_blocks);
    if (s1.binned_blocks >= N) {
        CHECKF(mem_calls() == c0, "24 MiB binned on stream A, freed and coalesced, serve 20 MiB: %ld driver calls",
               mem_calls() - c0);
        CHECK(big >= v[0] && big < v[0] + N * 2 * MiB);
    }
    CHECK(pool_ok(p));
    msh_pool_free(p, big, sa);
    msh_pool_free(p, top, sa);
    for (int i = 0; i < nf; i++) msh_pool_free(p, fill[i], sb);
    msh_pool_destroy(p);
}

TEST(empty_cache_leaves_the_bins_empty_and_gives_their_pages_back)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct cudbl_counts c0;
    cudbl_get_counts(&c0);
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t v[8];
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_alloc(p, (size_t)(i + 1) * MiB, i % 2 ? sa : sb, &v[i]) == 0);
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_free(p, v[i], i % 2 ? sa : sb) == 0);
    CHECK(stats(p).binned_blocks == 8);
    size_t released = msh_pool_empty_cache(p);
    struct msh_pool_stats st = stats(p);
    CHECK(st.binned_blocks == 0 && st.binned_bytes == 0 && st.mapped_bytes == 0);
    CHECKF(released > 0, "empty-cache released %zu bytes", released);
    struct cudbl_counts c1;
    cudbl_get_counts(&c1);
    CHECKF(c1.handles == c0.handles, "%ld handles left on the device", c1.handles - c0.handles);
    CHECK(pool_ok(p));
    msh_pool_destroy(p);
}

TEST(an_impossible_request_is_refused_before_any_drain)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(64 * MiB, true);
    REQUIRE(p);
    /* under a limit the front end waits for two step marks with room */
    for (int i = 0; i < 3; i++) {
        uint64_t x = 0;
        REQUIRE(msh_pool_alloc(p, 4096, sa, &x) == 0);
        msh_pool_free(p, x, sa);
        msh_pool_step(p);
    }
    uint64_t a = 0;
    REQUIRE(msh_pool_alloc(p, 8 * MiB, sa, &a) == 0);
    REQUIRE(msh_pool_free(p, a, sa) == 0);
    struct msh_pool_stats s0 = stats(p);
    REQUIRE(s0.binned_blocks >= 1);
    long c0 = mem_calls();
    uint64_t x = 0;
    CHECK(msh_pool_alloc(p, 65 * MiB, sa, &x) == ENOMEM); /* larger than the limit */
    CHECK(msh_pool_alloc(p, 5ull << 30, sa, &x) == ENOMEM); /* larger than the device */
    struct msh_pool_stats s1 = stats(p);
    CHECK(s1.binned_blocks == s0.binned_blocks && s1.front_drains == s0.front_drains);
    CHECKF(mem_calls() == c0, "%ld driver calls for requests no memory could hold", mem_calls() - c0);
    /* one that fits only once the bins are drained: served, the drain first in the rescue */
    struct msh_pool_oom o;
    uint64_t big = 0;
    int rc = msh_pool_alloc(p, 60 * MiB, sa, &big);
    msh_pool_last_oom(p, &o);
    CHECKF(rc == 0, "60 MiB under a 64 MiB limit with 8 MiB binned: error %d", rc);
    CHECK(stats(p).binned_blocks == 0);
    CHECK(pool_ok(p));
    if (!rc) msh_pool_free(p, big, sa);
    msh_pool_destroy(p);
}

/* What the front end does, as the reports' front.state says it (issue 30): off with params.front
 * false; under a limit waiting until two step marks with the pool at most 31/32 of it, then on;
 * waiting again when a step's peak comes closer; aside for good at that limit after pressure, on
 * again at a new limit; out for churn when its blocks go back for other sizes more than they serve. */
static int state_of(struct msh_pool *p)
{
    return stats(p).front_state;
}

TEST(the_front_end_states_as_the_reports_name_them)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *off = pool_new(0, false);
    REQUIRE(off);
    CHECK(state_of(off) == MSH_FRONT_OFF && !strcmp(msh_front_state_name(MSH_FRONT_OFF), "off"));
    msh_pool_destroy(off);
    struct msh_pool *p = pool_new(64 * MiB, true);
    REQUIRE(p);
    uint64_t a = 0, b = 0;
    CHECK(state_of(p) == MSH_FRONT_WAITING && !strcmp(msh_front_state_name(MSH_FRONT_WAITING), "waiting"));
    REQUIRE(msh_pool_alloc(p, 8 * MiB, sa, &a) == 0);
    msh_pool_free(p, a, sa);
    msh_pool_step(p);
    CHECK(state_of(p) == MSH_FRONT_WAITING); /* one step is not two */
    msh_pool_step(p);
    CHECKF(state_of(p) == MSH_FRONT_ON && !strcmp(msh_front_state_name(MSH_FRONT_ON), "on"), "state %d after two "
           "steps holding 8 MiB of 64", state_of(p));
    /* a step whose peak comes within 1/32 of the limit: waiting again, its bins go back */
    REQUIRE(msh_pool_alloc(p, 63 * MiB, sa, &b) == 0);
    msh_pool_free(p, b, sa);
    msh_pool_step(p);
    CHECK(state_of(p) == MSH_FRONT_WAITING);
    msh_pool_destroy(p);
    /* pressure at the limit: aside for good there; a new limit starts over */
    p = pool_new(24 * MiB, true);
    REQUIRE(p);
    uint64_t v[4];
    for (int i = 0; i < 2; i++) {
        REQUIRE(msh_pool_alloc(p, 4 * MiB, sa, &v[0]) == 0);
        msh_pool_free(p, v[0], sa);
        msh_pool_step(p);
    }
    REQUIRE(state_of(p) == MSH_FRONT_ON);
    REQUIRE(msh_pool_alloc(p, 10 * MiB, sa, &v[0]) == 0);
    REQUIRE(msh_pool_alloc(p, 6 * MiB, sa, &v[1]) == 0);
    msh_pool_free(p, v[0], sa); /* binned: 10 MiB */
    REQUIRE(msh_pool_alloc(p, 16 * MiB, sb, &v[2]) == 0); /* on another stream: drained, then reclaimed at the cap */
    struct msh_pool_stats st = stats(p);
    CHECKF(st.front_state == MSH_FRONT_ASIDE && !strcmp(msh_front_state_name(MSH_FRONT_ASIDE), "aside"),
           "state %d after a request that reclaimed at the limit (reclaimed pages %llu)", st.front_state,
           (unsigned long long)st.reclaimed_pages);
    CHECK(st.binned_blocks == 0);
    msh_pool_free(p, v[1], sa);
    msh_pool_free(p, v[2], sb);
    msh_pool_destroy(p);
    /* churn: every step's sizes are new, and what they free is trimmed at the step marks */
    p = pool_new(0, true);
    REQUIRE(p);
    uint64_t seed = 99, keep = 0;
    REQUIRE(msh_pool_alloc(p, 512, sa, &keep) == 0);
    bool churned = false;
    for (int i = 0; i < 40000 && !churned; i++) {
        uint64_t x = 0, y = 0;
        REQUIRE(msh_pool_alloc(p, 1 + (size_t)(rnd(&seed) % (4 << 20)), sa, &x) == 0);
        REQUIRE(msh_pool_alloc(p, 1 + (size_t)(rnd(&seed) % (4 << 20)), sa, &y) == 0);
        msh_pool_free(p, x, sa);
        msh_pool_free(p, y, sa);
        if (i % 20 == 19) msh_pool_step(p); /* steps of 40 allocations */
        churned = state_of(p) == MSH_FRONT_CHURN;
    }
    CHECKF(churned && !strcmp(msh_front_state_name(MSH_FRONT_CHURN), "churn") && stats(p).front_cooled > 0,
           "random sizes never sent the front end out (state %d)", state_of(p));
    msh_pool_free(p, keep, sa);
    msh_pool_destroy(p);
}

TEST(a_bin_unused_for_two_steps_gives_most_back)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t hot[4], cold[8], other[2];
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_alloc(p, 700 * 1024, sa, &cold[i]) == 0);
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(p, 300 * 1024, sa, &hot[i]) == 0);
    for (int i = 0; i < 2; i++) REQUIRE(msh_pool_alloc(p, 900 * 1024, sb, &other[i]) == 0);
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_free(p, cold[i], sa) == 0);
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_free(p, hot[i], sa) == 0);
    for (int i = 0; i < 2; i++) REQUIRE(msh_pool_free(p, other[i], sb) == 0);
    msh_pool_step(p); /* every bin was used since the (no) last mark: all stay */
    CHECK(stats(p).binned_blocks == 14);
    for (int step = 0; step < 4; step++) { /* steps in which stream A runs its 300 KiB blocks only */
        for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(p, 300 * 1024, sa, &hot[i]) == 0);
        for (int i = 0; i < 4; i++) REQUIRE(msh_pool_free(p, hot[i], sa) == 0);
        msh_pool_step(p);
        /* the 700 KiB bin served nothing: after two such steps 3/4 of it goes (8 -> 2), the rest
         * at the next; stream B did not run (its thread was elsewhere): its bin tells nothing and
         * stays */
        struct msh_pool_stats st = stats(p);
        size_t want = 4 + (step == 0 ? 8 : step == 1 ? 2 : 0) + 2;
        CHECKF(st.binned_blocks == want, "step %d: %zu binned, want %zu", step, st.binned_blocks, want);
    }
    /* a step in which B ran, with another size: its 900 KiB bin goes (2 blocks: depth/4 = 0 kept) */
    REQUIRE(msh_pool_alloc(p, 100 * 1024, sb, &other[0]) == 0);
    REQUIRE(msh_pool_free(p, other[0], sb) == 0);
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(p, 300 * 1024, sa, &hot[i]) == 0);
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_free(p, hot[i], sa) == 0);
    msh_pool_step(p);
    CHECKF(stats(p).binned_blocks == 4 + 1, "%zu binned after a step in which B ran another size",
           stats(p).binned_blocks);
    /* a step mark with nothing run since the last one trims nothing (the trim thread's quiet
     * period, and empty-cache, give an idle job's bins back) */
    msh_pool_step(p);
    CHECK(stats(p).binned_blocks == 4 + 1);
    CHECK(pool_ok(p));
    msh_pool_destroy(p);
}

/* A trimmed block is handed to whoever asks: with another stream known, its free records one
 * event on its stream (the other waits on it, never synchronizes); with one stream alone there is
 * no one to order, and neither a trim nor destroying the pool records any. */
TEST(a_trim_records_an_event_only_when_another_stream_could_want_its_blocks)
{
    if (!streams_up()) SKIP("the driver double did not start");
    for (int two = 0; two < 2; two++) {
        struct msh_pool *p = pool_new(0, true);
        REQUIRE(p);
        uint64_t cold[4], hot = 0, x = 0;
        for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(p, 700 * 1024, sa, &cold[i]) == 0);
        for (int i = 0; i < 4; i++) REQUIRE(msh_pool_free(p, cold[i], sa) == 0);
        if (two) { /* stream B exists (its own block, freed on it) */
            REQUIRE(msh_pool_alloc(p, 5 * MiB, sb, &x) == 0);
            REQUIRE(msh_pool_free(p, x, sb) == 0);
        }
        long rec = cudbl_call_count("cuEventRecord");
        for (int step = 0; step < 3; step++) {
            REQUIRE(msh_pool_alloc(p, 300 * 1024, sa, &hot) == 0);
            REQUIRE(msh_pool_free(p, hot, sa) == 0);
            msh_pool_step(p);
        }
        CHECK(stats(p).binned_blocks < 4 + 1 + (size_t)two); /* the 700 KiB bin was trimmed */
        long n = cudbl_call_count("cuEventRecord") - rec;
        CHECKF(n == two, "%s: %ld events recorded by the trims", two ? "two streams" : "one stream", n);
        rec = cudbl_call_count("cuEventRecord");
        CHECK(pool_ok(p));
        msh_pool_destroy(p); /* binned blocks left: freed plainly */
        CHECKF(cudbl_call_count("cuEventRecord") == rec, "%ld events recorded by destroy",
               cudbl_call_count("cuEventRecord") - rec);
    }
}

/* A first step that grows: each temporary freed into a bin is drained when the next activation
 * needs pages (the pool's own pages, given back rather than grown past), and its size misses next
 * time; some come back before that (hits). Drained blocks outnumber hits, as in a varying job's
 * (the_front_end_states...), but the bins serve more than a quarter of what is put in them: not
 * churn. Judged by the drains alone, the front end went out for 32768 allocations, past the whole
 * run on 4 of the 16 replays. */
TEST(a_growing_step_whose_temporaries_come_back_keeps_the_front_end_on)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    enum { N = 110 };
    static uint64_t act[N];
    uint64_t t = 0;
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < 5; k++) { /* temporaries made and freed, the first size three times */
            REQUIRE(msh_pool_alloc(p, (size_t)(k < 3 ? 1 : k - 1) * MiB + 4096, sa, &t) == 0);
            REQUIRE(msh_pool_free(p, t, sa) == 0);
        }
        /* an activation kept, larger than the chunk mapped ahead: new pages each time */
        REQUIRE(msh_pool_alloc(p, 24 * MiB, sa, &act[i]) == 0);
    }
    struct msh_pool_stats st = stats(p);
    CHECKF(st.front_drains > 100, "%llu drains: the growth did not drain (the test no longer sets the case up)",
           (unsigned long long)st.front_drains);
    CHECKF(st.front_cooled == 0 && st.front_state == MSH_FRONT_ON, "state %s after %llu churn windows",
           msh_front_state_name(st.front_state), (unsigned long long)st.front_cooled);
    CHECK(pool_ok(p));
    for (int i = 0; i < N; i++) REQUIRE(msh_pool_free(p, act[i], sa) == 0);
    msh_pool_destroy(p);
}

/* Four streams warming up, as threads on their own streams do: each one's first step needs pages
 * while the others' blocks sit in their bins, and drains them (growth, no hit yet: 0 hits in the
 * first 400 puts). Those drains are not churn: once the four run their steps together, every
 * size comes back on its stream. Counted, the front end went out for 32768 allocations (1
 * warm-up in 4 of the 4-thread bench). */
TEST(streams_warming_up_on_each_others_growth_keep_the_front_end_on)
{
    if (!streams_up()) SKIP("the driver double did not start");
    CUstream s3, s4;
    REQUIRE(cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
            cuStreamCreate(&s4, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    uint64_t st4[4] = {sa, sb, (uint64_t)(uintptr_t)s3, (uint64_t)(uintptr_t)s4};
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    enum { N = 100 };
    static uint64_t b[4][N];
    /* round 0: each stream's first step alone (a thread that finished its step while the next one
     * grows); rounds 1-3: the four steps at once, as the threads run them */
    for (int k = 0; k < 4; k++) {
        for (int i = 0; i < N; i++)
            REQUIRE(msh_pool_alloc(p, (size_t)(k * N + i + 1) * 8192 + 1 * MiB, st4[k], &b[k][i]) == 0);
        for (int i = N - 1; i >= 0; i--) REQUIRE(msh_pool_free(p, b[k][i], st4[k]) == 0);
    }
    for (int round = 1; round < 4; round++) {
        for (int i = 0; i < N; i++)
            for (int k = 0; k < 4; k++)
                REQUIRE(msh_pool_alloc(p, (size_t)(k * N + i + 1) * 8192 + 1 * MiB, st4[k], &b[k][i]) == 0);
        for (int i = N - 1; i >= 0; i--)
            for (int k = 0; k < 4; k++) REQUIRE(msh_pool_free(p, b[k][i], st4[k]) == 0);
    }
    struct msh_pool_stats st = stats(p);
    CHECKF(st.front_drains > 0, "no drain: the warm-up did not drain the others' bins (the test no longer sets it up)");
    CHECKF(st.front_cooled == 0 && st.front_state == MSH_FRONT_ON && st.front_hits >= 2 * 4 * N / 2,
           "state %s, %llu churn windows, %llu hits",
           msh_front_state_name(st.front_state), (unsigned long long)st.front_cooled, (unsigned long long)st.front_hits);
    CHECK(pool_ok(p));
    msh_pool_destroy(p);
    cuStreamDestroy(s3);
    cuStreamDestroy(s4);
}

TEST(forgetting_a_stream_drains_its_bins)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    uint64_t a = 0, b = 0, c = 0;
    REQUIRE(msh_pool_alloc(p, 1 << 20, SA, &a) == 0);
    REQUIRE(msh_pool_alloc(p, 1 << 20, SB, &b) == 0);
    REQUIRE(msh_pool_free(p, a, SA) == 0);
    REQUIRE(msh_pool_free(p, b, SB) == 0);
    CHECK(stats(p).binned_blocks == 2);
    msh_pool_forget_stream(p, SA);
    CHECK(stats(p).binned_blocks == 1);
    /* the handle value comes back for a new stream: it must not find the old stream's block */
    REQUIRE(msh_pool_alloc(p, 1 << 20, SA, &c) == 0);
    CHECK(stats(p).front_hits == 0);
    CHECK(pool_ok(p));
    msh_pool_free(p, c, SA);
    msh_pool_destroy(p);
}

TEST(destroying_a_pool_with_binned_blocks_leaks_nothing)
{
    if (!streams_up()) SKIP("the driver double did not start");
    struct cudbl_counts c0;
    cudbl_get_counts(&c0);
    struct msh_pool *p = pool_new(0, true);
    REQUIRE(p);
    for (int i = 0; i < 16; i++) {
        uint64_t x = 0;
        REQUIRE(msh_pool_alloc(p, (size_t)(i % 5 + 1) * 300000, i % 2 ? sa : sb, &x) == 0);
        msh_pool_free(p, x, i % 2 ? sa : sb);
    }
    CHECK(stats(p).binned_blocks > 0);
    msh_pool_destroy(p);
    struct cudbl_counts c1;
    cudbl_get_counts(&c1);
    CHECKF(c1.handles == c0.handles && c1.mappings == c0.mappings && c1.reservations == c0.reservations,
           "left on the device: %ld handles, %ld mappings, %ld reservations", c1.handles - c0.handles,
           c1.mappings - c0.mappings, c1.reservations - c0.reservations);
}

/* ---- random sequences: the pool's invariants and its counters against a reference model ----- */

struct model {
    uint64_t cur[3][3], peak[3][3], alloc[3][3], freed[3][3]; /* [bytes, req, count][all, large, small] */
};

static void model_add(struct model *m, uint64_t req, bool alloc)
{
    uint64_t v[3] = {((req ? req : 1) + 511) / 512 * 512, req, 1};
    int sp = req <= MiB ? 2 : 1;
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 3; s += (s == 0 ? sp : 3)) {
            if (alloc) {
                m->cur[k][s] += v[k];
                m->alloc[k][s] += v[k];
                if (m->cur[k][s] > m->peak[k][s]) m->peak[k][s] = m->cur[k][s];
            } else {
                m->cur[k][s] -= v[k];
                m->freed[k][s] += v[k];
            }
        }
}

static int model_cmp(const struct model *m, const struct msh_pool_caller *c, bool exact_peak)
{
    const struct msh_caller_count *cc[3] = {c->bytes, c->req, c->count};
    int bad = 0;
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 3; s++) {
            const struct msh_caller_count *x = &cc[k][s];
            if (x->cur != m->cur[k][s] || x->allocated != m->alloc[k][s] || x->freed != m->freed[k][s] ||
                (exact_peak ? x->peak != m->peak[k][s] : x->peak < m->peak[k][s])) {
                if (!bad)
                    fprintf(stderr, "    counter %d/%d: cur %llu (model %llu) peak %llu (%llu) allocated %llu (%llu) freed %llu (%llu)\n",
                            k, s, (unsigned long long)x->cur, (unsigned long long)m->cur[k][s], (unsigned long long)x->peak,
                            (unsigned long long)m->peak[k][s], (unsigned long long)x->allocated,
                            (unsigned long long)m->alloc[k][s], (unsigned long long)x->freed,
                            (unsigned long long)m->freed[k][s]);
                bad++;
            }
        }
    return bad;
}


static size_t pick_size(uint64_t *s)
{
    static const size_t sizes[] = {512, 4096, 100000, 1 << 20, (1 << 20) + 1, 3 << 20, 7340033, 12 << 20};
    uint64_t r = rnd(s);
    return r % 4 ? sizes[r % 8] : 1 + (size_t)(r >> 8) % (6 << 20); /* mostly sizes that recur */
}

/* One random run: allocations and frees on two streams (counted and not), record_stream, peak
 * resets, step marks, empty-cache; after each call the drain rule and, now and then, the pool's
 * invariants and the counters against the model. */
static void random_run(size_t limit, uint64_t seed, int ops)
{
    struct msh_pool *p = pool_new(limit, true);
    REQUIRE(p);
    struct model m;
    memset(&m, 0, sizeof m);
    struct live {
        uint64_t addr, stream;
        size_t req;
        bool counted;
    } lv[256];
    int n = 0, violations = 0, bad = 0;
    uint64_t s = seed;
    for (int i = 0; i < ops && !bad; i++) {
        uint64_t r = rnd(&s) % 100;
        if (r < 50 && n < 256) {
            size_t req = pick_size(&s);
            uint64_t st = rnd(&s) % 3 ? sa : sb;
            bool counted = rnd(&s) % 4 != 0;
            struct msh_pool_stats s0 = stats(p);
            long c0 = mem_calls();
            uint64_t a = 0;
            int rc = msh_pool_alloc_ex(p, req, st, counted ? MSH_PA_COUNTED : 0, &a);
            struct msh_pool_stats s1 = stats(p);
            /* driver work that needs memory only with nothing binned, after a drain, or as growth
             * within the front end's allowance (1/16 of what the pool holds and two 20 MiB chunks) */
            if (mem_calls() != c0 && s0.binned_blocks && s1.front_drains == s0.front_drains &&
                !(s1.front_kept > s0.front_kept && s1.front_grown_aside <= s1.mapped_bytes / 16 + 40 * MiB + PAGE))
                violations++;
            if (rc == 0) {
                lv[n++] = (struct live){a, st, req, counted};
                if (counted) model_add(&m, req, true);
            }
        } else if (r < 88 && n) {
            int k = (int)(rnd(&s) % (uint64_t)n);
            uint64_t fs = rnd(&s) % 10 ? lv[k].stream : (lv[k].stream == sa ? sb : sa);
            if (msh_pool_free(p, lv[k].addr, fs)) bad++;
            if (lv[k].counted) model_add(&m, lv[k].req, false);
            lv[k] = lv[--n];
        } else if (r < 91 && n) {
            int k = (int)(rnd(&s) % (uint64_t)n);
            msh_pool_record_stream(p, lv[k].addr, lv[k].stream == sa ? sb : sa);
        } else if (r < 94) {
            bool acc = rnd(&s) % 2;
            msh_pool_caller_reset(p, true, acc);
            for (int k = 0; k < 3; k++)
                for (int q = 0; q < 3; q++) {
                    m.peak[k][q] = m.cur[k][q];
                    if (acc) m.alloc[k][q] = m.freed[k][q] = 0;
                }
        } else if (r < 98) {
            msh_pool_step(p);
        } else {
            msh_pool_empty_cache(p);
            if (stats(p).binned_blocks) bad++;
        }
        if (i % 64 == 0 || i == ops - 1) {
            struct msh_pool_caller c;
            msh_pool_caller_stats(p, &c);
            bad += model_cmp(&m, &c, true);
            if (!pool_ok(p)) bad++;
        }
    }
    CHECKF(!bad, "seed %llu, limit %zu: counters or invariants off", (unsigned long long)seed, limit);
    CHECKF(!violations, "seed %llu, limit %zu: %d requests made driver calls that need memory with blocks binned "
           "and no drain first", (unsigned long long)seed, limit, violations);
    CHECK(stats(p).front_hits > 0 || limit);
    for (int k = 0; k < n; k++) msh_pool_free(p, lv[k].addr, lv[k].stream);
    CHECK(pool_ok(p));
    msh_pool_destroy(p);
}

TEST(random_sequences_keep_the_invariants_and_the_counters)
{
    if (!streams_up()) SKIP("the driver double did not start");
    TH_SET_TIMEOUT(120);
    for (uint64_t seed = 1; seed <= 6; seed++) random_run(0, seed * 0x9E3779B97F4A7C15ull, 3000);
    for (uint64_t seed = 7; seed <= 9; seed++) random_run(400 * MiB, seed * 0x9E3779B97F4A7C15ull, 12000);
}

/* ---- PyTorch's counters through the tensor-mode entry points --------------------------------- */

static long long torch_stat(const char *name)
{
    static long long v[256];
    int n = memshim_torch_stats(0, NULL, 0);
    if (n > 256) return -1;
    memshim_torch_stats(0, v, n);
    for (int i = 0; i < n; i++)
        if (!strcmp(memshim_torch_stat_name(i), name)) return v[i];
    return -12345;
}

static int torch_cmp(const struct model *m, bool exact_peak)
{
    static const char *const kinds[3] = {"allocated_bytes", "requested_bytes", "allocation"};
    static const char *const pools[3] = {"all", "large_pool", "small_pool"};
    int bad = 0;
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 3; s++) {
            char name[96];
            uint64_t want[4] = {m->cur[k][s], m->peak[k][s], m->alloc[k][s], m->freed[k][s]};
            static const char *const f[4] = {"current", "peak", "allocated", "freed"};
            for (int j = 0; j < 4; j++) {
                snprintf(name, sizeof name, "%s.%s.%s", kinds[k], pools[s], f[j]);
                long long got = torch_stat(name);
                bool ok = j == 1 && !exact_peak ? (uint64_t)got >= want[j] : (uint64_t)got == want[j];
                if (!ok) {
                    if (bad < 3) fprintf(stderr, "    %s = %lld, model %llu\n", name, got, (unsigned long long)want[j]);
                    bad++;
                }
            }
        }
    return bad;
}

/* A training step through the tensor-mode entry points, repeated: from the second step on every
 * allocation is a hit, and no driver call is made. */
TEST(a_repeated_step_is_served_from_the_bins_with_no_driver_call)
{
    if (!streams_up()) SKIP("the driver double did not start");
    enum { N = 60 };
    size_t sz[N];
    uint64_t s = 7;
    for (int i = 0; i < N; i++) sz[i] = pick_size(&s);
    void *p[N];
    struct msh_pool *m = NULL;
    struct msh_pool_stats s0;
    long c0 = 0;
    for (int step = 0; step < 6; step++) {
        if (step == 2) { /* warm from here */
            m = msh_core_pool_get(0);
            REQUIRE(m);
            msh_pool_get_stats(m, &s0);
            c0 = all_calls();
        }
        for (int i = 0; i < N; i++) REQUIRE((p[i] = memshim_torch_alloc((ssize_t)sz[i], 0, (void *)(uintptr_t)sa)));
        for (int i = N - 1; i >= 0; i--) memshim_torch_free(p[i], (ssize_t)sz[i], 0, (void *)(uintptr_t)sa);
    }
    struct msh_pool_stats s1;
    msh_pool_get_stats(m, &s1);
    CHECKF(s1.front_hits - s0.front_hits == 4 * N, "%llu hits in 4 warm steps of %d allocations",
           (unsigned long long)(s1.front_hits - s0.front_hits), N);
    CHECKF(all_calls() == c0, "%ld driver calls in 4 warm steps", all_calls() - c0);
}

TEST(torch_counters_equal_a_model_under_random_sequences_with_peak_resets)
{
    if (!streams_up()) SKIP("the driver double did not start");
    memshim_torch_reset_accumulated(0);
    memshim_torch_reset_peak(0);
    struct model m;
    memset(&m, 0, sizeof m);
    struct {
        void *p;
        size_t req;
        void *stream;
    } lv[128];
    int n = 0, bad = 0;
    uint64_t s = 42;
    for (int i = 0; i < 6000 && bad < 5; i++) {
        uint64_t r = rnd(&s) % 100;
        if (r < 50 && n < 128) {
            size_t req = pick_size(&s);
            void *st = rnd(&s) % 2 ? (void *)(uintptr_t)sa : NULL;
            void *x = memshim_torch_alloc((ssize_t)req, 0, st);
            if (x) {
                lv[n].p = x;
                lv[n].req = req;
                lv[n++].stream = st;
                model_add(&m, req, true);
            }
        } else if (r < 96 && n) {
            int k = (int)(rnd(&s) % (uint64_t)n);
            memshim_torch_free(lv[k].p, (ssize_t)lv[k].req, 0, lv[k].stream);
            model_add(&m, lv[k].req, false);
            lv[k] = lv[--n];
        } else if (r < 98) {
            memshim_torch_reset_peak(0);
            for (int k = 0; k < 3; k++)
                for (int q = 0; q < 3; q++) m.peak[k][q] = m.cur[k][q];
        } else {
            memshim_torch_reset_accumulated(0);
            for (int k = 0; k < 3; k++)
                for (int q = 0; q < 3; q++) m.alloc[k][q] = m.freed[k][q] = 0;
        }
        if (i % 50 == 0) bad += torch_cmp(&m, true);
    }
    bad += torch_cmp(&m, true);
    for (int k = 0; k < n; k++) {
        memshim_torch_free(lv[k].p, (ssize_t)lv[k].req, 0, lv[k].stream);
        model_add(&m, lv[k].req, false);
    }
    bad += torch_cmp(&m, true);
    CHECK(bad == 0);
    struct msh_pool_stats st;
    msh_pool_get_stats(msh_core_pool_get(0), &st);
    CHECKF(st.front_hits > 0 && st.front_puts > 0, "the front end served nothing (%llu hits, %llu puts)",
           (unsigned long long)st.front_hits, (unsigned long long)st.front_puts);
}

/* Four threads, each its own stream and model: at every barrier the device's counters are the
 * sum of the four (current, allocated, freed exactly; the peak at least the sum of the currents
 * and at most the sum of the threads' own peaks). */
#define NT 4
static pthread_barrier_t tbar;
static struct model tm[NT];
static uint64_t tstream[NT];
static _Atomic int tbad;

static void *torch_thread(void *arg)
{
    int t = (int)(intptr_t)arg;
    struct {
        void *p;
        size_t req;
    } lv[64];
    int n = 0;
    uint64_t s = 1000 + (uint64_t)t;
    for (int round = 0; round < 8; round++) {
        for (int i = 0; i < 1500; i++) {
            if (rnd(&s) % 2 && n < 64) {
                size_t req = pick_size(&s);
                void *x = memshim_torch_alloc((ssize_t)req, 0, (void *)(uintptr_t)tstream[t]);
                if (!x) continue;
                lv[n].p = x;
                lv[n++].req = req;
                model_add(&tm[t], req, true);
            } else if (n) {
                int k = (int)(rnd(&s) % (uint64_t)n);
                memshim_torch_free(lv[k].p, (ssize_t)lv[k].req, 0, (void *)(uintptr_t)tstream[t]);
                model_add(&tm[t], lv[k].req, false);
                lv[k] = lv[--n];
            }
        }
        pthread_barrier_wait(&tbar); /* the main thread compares */
        pthread_barrier_wait(&tbar); /* ... and maybe resets the peaks */
        for (int k = 0; k < 3; k++)
            for (int q = 0; q < 3; q++) tm[t].peak[k][q] = tm[t].cur[k][q];
    }
    while (n) {
        n--;
        memshim_torch_free(lv[n].p, (ssize_t)lv[n].req, 0, (void *)(uintptr_t)tstream[t]);
        model_add(&tm[t], lv[n].req, false);
    }
    return NULL;
}

TEST(torch_counters_with_four_threads)
{
    if (!streams_up()) SKIP("the driver double did not start");
    memshim_torch_reset_accumulated(0);
    memshim_torch_reset_peak(0);
    /* the model starts from what is allocated now (nothing, after the test above) */
    memset(tm, 0, sizeof tm);
    for (int t = 0; t < NT; t++) {
        CUstream cs;
        REQUIRE(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
        tstream[t] = (uint64_t)(uintptr_t)cs;
    }
    pthread_barrier_init(&tbar, NULL, NT + 1);
    pthread_t th[NT];
    for (int t = 0; t < NT; t++) pthread_create(&th[t], NULL, torch_thread, (void *)(intptr_t)t);
    for (int round = 0; round < 8; round++) {
        pthread_barrier_wait(&tbar);
        struct model sum, peaks;
        memset(&sum, 0, sizeof sum);
        memset(&peaks, 0, sizeof peaks);
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 3; k++)
                for (int q = 0; q < 3; q++) {
                    sum.cur[k][q] += tm[t].cur[k][q];
                    sum.alloc[k][q] += tm[t].alloc[k][q];
                    sum.freed[k][q] += tm[t].freed[k][q];
                    peaks.peak[k][q] += tm[t].peak[k][q];
                }
        memcpy(sum.peak, sum.cur, sizeof sum.peak);
        if (torch_cmp(&sum, false)) tbad++;
        long long pk = torch_stat("allocated_bytes.all.peak");
        if ((uint64_t)pk > peaks.peak[0][0]) {
            fprintf(stderr, "    peak %lld above the sum of the threads' peaks %llu\n", pk,
                    (unsigned long long)peaks.peak[0][0]);
            tbad++;
        }
        memshim_torch_reset_peak(0);
        if (torch_stat("allocated_bytes.all.peak") != torch_stat("allocated_bytes.all.current")) tbad++;
        pthread_barrier_wait(&tbar);
    }
    for (int t = 0; t < NT; t++) pthread_join(th[t], NULL);
    CHECK(tbad == 0);
    CHECK(torch_stat("allocated_bytes.all.current") == 0 && torch_stat("allocation.all.current") == 0);
}

/* A block binned on a stream that later captures a graph is never handed to an allocation on
 * that stream while it captures (the allocation goes to a capture pool). */
static int capture_says(void *stream)
{
    return stream == (void *)(uintptr_t)sb;
}

TEST(a_capturing_stream_never_gets_a_binned_block)
{
    if (!streams_up()) SKIP("the driver double did not start");
    void *a = memshim_torch_alloc(3 * MiB, 0, (void *)(uintptr_t)sb);
    REQUIRE(a);
    memshim_torch_free(a, 3 * MiB, 0, (void *)(uintptr_t)sb);
    msh_torch_set_capture_query(capture_says);
    memshim_torch_begin_allocate_to_pool(0, 99, 0, NULL);
    void *c = memshim_torch_alloc_in_pool(3 * MiB, 0, (void *)(uintptr_t)sb, 99, 0);
    void *d = memshim_torch_alloc(3 * MiB, 0, (void *)(uintptr_t)sb); /* the backstop, if the window was missed */
    CHECK(c && c != a);
    CHECK(d && d != a);
    memshim_torch_end_allocate_to_pool(0, 99, 0);
    msh_torch_set_capture_query(NULL);
    memshim_torch_free(c, 3 * MiB, 0, (void *)(uintptr_t)sb);
    memshim_torch_free(d, 3 * MiB, 0, (void *)(uintptr_t)sb);
    memshim_torch_release_pool(0, 99, 0);
}

TEST(a_fork_child_starts_with_nothing_binned)
{
    if (!streams_up()) SKIP("the driver double did not start");
    void *a = memshim_torch_alloc(6 * MiB, 0, NULL);
    REQUIRE(a);
    memshim_torch_free(a, 6 * MiB, 0, NULL);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        /* CUDA does not survive fork: the child's memshim passes through, its pools gone */
        void *b = memshim_torch_alloc(6 * MiB, 0, NULL);
        _exit(b == a ? 3 : msh_core_pool_get(0) != NULL ? 4 : 0);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %d (3: got the parent's binned block, "
           "4: the parent's pool)", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    void *b = memshim_torch_alloc(6 * MiB, 0, NULL); /* the parent goes on */
    CHECK(b != NULL);
    memshim_torch_free(b, 6 * MiB, 0, NULL);
}

/* ---- a cancelled claim and other threads' claims (the wait in try_alloc drops the lock) ------- */

/* The double behind a gate: the first map after gate_arm() waits until gate_open(). */
static struct msh_device g_gated;
static struct msh_device_ops g_gated_ops;
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static int g_gate_armed, g_gate_held, g_gate_open;

static int gated_map(struct msh_device *d, uint64_t va, size_t size, uint64_t handle)
{
    pthread_mutex_lock(&g_gate_mu);
    if (g_gate_armed) {
        g_gate_armed = 0;
        g_gate_held = 1;
        pthread_cond_broadcast(&g_gate_cv);
        while (!g_gate_open) pthread_cond_wait(&g_gate_cv, &g_gate_mu);
    }
    pthread_mutex_unlock(&g_gate_mu);
    return g_dev.ops->map(d, va, size, handle);
}

static void gate_wait_held(void)
{
    pthread_mutex_lock(&g_gate_mu);
    while (!g_gate_held) pthread_cond_wait(&g_gate_cv, &g_gate_mu);
    pthread_mutex_unlock(&g_gate_mu);
}

static void gate_open(void)
{
    pthread_mutex_lock(&g_gate_mu);
    g_gate_open = 1;
    pthread_cond_broadcast(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
}

struct racer {
    struct msh_pool *p;
    size_t size;
    uint64_t stream, addr;
    int rc;
};

static void *racer_run(void *arg)
{
    struct racer *r = arg;
    cuCtxSetCurrent(g_ctx);
    r->rc = msh_pool_alloc(r->p, r->size, r->stream, &r->addr);
    return NULL;
}

/* A request that waited for another thread's mapping, then gave its claim up to drain the bins
 * (EDRAIN), put the line's top back where it stood before its wait: below the pages a third
 * thread had mapped meanwhile, which the next claim at the open end then mapped again (the double
 * refuses that, as the driver does: the request failed with gigabytes free, 1 run in 8 of the
 * 4-thread bench). The cancel restores what its own claim changed, and nothing the wait let others
 * change. Layout (2 MiB pages, chunks of 10 pages mapped ahead, no limit): a 512 MiB block binned
 * on stream B holds pages 0-255; on stream A, thread 1's 12 MiB (pages 256-261) maps 260-269 and
 * waits at the gate; thread 2's 30 MiB lands at page 262, in that run, and waits for it; the main
 * thread's 4 MiB at page 277 maps 277-279; the gate opens. */
TEST(a_claim_given_up_for_a_drain_keeps_what_other_threads_mapped_meanwhile)
{
    if (!streams_up()) SKIP("the driver double did not start");
    g_gated = g_dev;
    g_gated_ops = *g_dev.ops;
    g_gated_ops.map = gated_map;
    g_gated.ops = &g_gated_ops;
    struct msh_pool_params pp;
    msh_pool_params_default(&pp);
    pp.front = true;
    pp.va_bytes = 8ull << 30;
    struct msh_pool *p = NULL;
    REQUIRE(msh_pool_create(&g_gated, &pp, &p) == 0);
    uint64_t big = 0;
    REQUIRE(msh_pool_alloc(p, 512 * MiB, sb, &big) == 0);
    REQUIRE(msh_pool_free(p, big, sb) == 0);
    REQUIRE(stats(p).binned_blocks == 1);
    g_gate_armed = 1;
    struct racer r1 = {.p = p, .size = 12 * MiB, .stream = sa}, r2 = {.p = p, .size = 30 * MiB, .stream = sa};
    pthread_t t1, t2;
    REQUIRE(pthread_create(&t1, NULL, racer_run, &r1) == 0);
    gate_wait_held(); /* thread 1 maps its run without the lock */
    uint64_t waits0 = stats(p).lock_waits;
    REQUIRE(pthread_create(&t2, NULL, racer_run, &r2) == 0);
    for (int i = 0; i < 20000 && stats(p).lock_waits == waits0; i++) usleep(100); /* thread 2 waits for that run */
    CHECKF(stats(p).lock_waits > waits0, "thread 2 never waited for thread 1's pages (the layout moved: this test "
           "no longer sets the race up)");
    uint64_t c = 0;
    CHECK(msh_pool_alloc(p, 4 * MiB, sa, &c) == 0);
    gate_open();
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECKF(r1.rc == 0 && r2.rc == 0, "the racers: %d, %d", r1.rc, r2.rc);
    CHECK(pool_ok(p)); /* held = mapped pages below each region's top */
    /* and the next requests at the open end map only pages nobody mapped */
    uint64_t more[4] = {0};
    for (int i = 0; i < 4; i++) CHECKF(msh_pool_alloc(p, (size_t)(7 + i) * MiB, sa, &more[i]) == 0, "request %d failed", i);
    CHECK(pool_ok(p));
    for (int i = 0; i < 4; i++)
        if (more[i]) msh_pool_free(p, more[i], sa);
    if (c) msh_pool_free(p, c, sa);
    if (!r1.rc) msh_pool_free(p, r1.addr, sa);
    if (!r2.rc) msh_pool_free(p, r2.addr, sa);
    CHECK(pool_ok(p));
    msh_pool_destroy(p);
}

TEST_MAIN()
