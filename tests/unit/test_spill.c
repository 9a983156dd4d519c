/*
 * test_spill.c: spill to host memory (policy/pool/spill.c, docs/pool.md "Spill") through the
 * real-driver backend (policy/dev_cuda.c) over the CUDA driver double, whose host-located VMM
 * handles follow the driver's rules (docs/test-double.md) and keep their bytes through every remap.
 *
 * Each test writes a pattern over whole blocks (every byte: page and block edges included), spills
 * by allocating past the limit, and checks the bytes from the host after every move, with
 * msh_pool_check after every step. The first test holds the device's own peak (cudbl_device_peak,
 * the most device bytes the double ever charged in this process) to the limit, so it runs first
 * and every later test stays at or below its limit.
 */
#include "harness.h"
#include "msh.h"
#include "pool.h"
#include "../cudadouble/cudbl.h"

#include <cuda.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "on_double.h"

#define MiB MSH_MiB
#define PAGE (2 * MiB)
#define LIMIT (16 * MiB) /* 8 pages: the most any test here lets the pool hold on the device */

__attribute__((constructor)) static void spill_env(void)
{
    setenv("CUDBL_CAPACITY", "1G", 0);
    setenv("CUDBL_GRANULARITY", "2M", 0);
    msh_log_level = MSH_LOG_ERROR;
}

static struct msh_pool *pool_new(size_t limit, bool spill, size_t spill_max)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = limit;
    p.spill = spill;
    p.spill_max_bytes = spill_max;
    p.no_learn = true; /* the marks here are explicit (msh_pool_mark_step) */
    p.va_bytes = 4ull << 30;
    struct msh_pool *pool = NULL;
    if (msh_pool_create(&g_dev, &p, &pool)) return NULL;
    return pool;
}

/* byte i of block `tag` */
static inline uint8_t pat(uint32_t tag, size_t i) { return (uint8_t)((i * 131u) ^ (i >> 9) ^ (tag * 29u)); }

static void fill(uint64_t addr, size_t n, uint32_t tag)
{
    uint8_t *b = (uint8_t *)(uintptr_t)addr;
    for (size_t i = 0; i < n; i++) b[i] = pat(tag, i);
}

/* the first byte that differs, or -1 */
static long bad_byte(uint64_t addr, size_t n, uint32_t tag)
{
    const uint8_t *b = (const uint8_t *)(uintptr_t)addr;
    for (size_t i = 0; i < n; i++)
        if (b[i] != pat(tag, i)) return (long)i;
    return -1;
}

struct blkrec {
    uint64_t addr;
    size_t size;
    uint32_t tag;
};

static int verify_all(const struct blkrec *v, int n)
{
    int bad = 0;
    for (int i = 0; i < n; i++) {
        if (!v[i].addr) continue;
        long at = bad_byte(v[i].addr, v[i].size, v[i].tag);
        if (at >= 0) {
            fprintf(stderr, "    block %d (%zu bytes at %#llx): byte %ld differs\n", i, v[i].size,
                    (unsigned long long)v[i].addr, at);
            bad++;
        }
    }
    return bad;
}

static int pool_ok(struct msh_pool *pool)
{
    char why[512];
    if (msh_pool_check(pool, why, sizeof why) == 0) return 1;
    fprintf(stderr, "    msh_pool_check: %s\n", why);
    return 0;
}

static int alloc_fill(struct msh_pool *pool, struct blkrec *r, size_t size, uint32_t tag)
{
    r->size = size;
    r->tag = tag;
    r->addr = 0;
    int rc = msh_pool_alloc(pool, size, MSH_STREAM_COMPLETED, &r->addr);
    if (rc == 0) fill(r->addr, size, tag);
    else r->addr = 0;
    return rc;
}

/* Sizes that put block edges everywhere inside and across pages (512-byte multiples and not). */
static const size_t WEIGHTS[] = {PAGE - 512, 3 * PAGE / 2 + 7, 512, PAGE + PAGE / 4, 4096 + 3, PAGE * 2 - 1000};
#define NW (int)(sizeof WEIGHTS / sizeof WEIGHTS[0])

TEST(device_never_above_the_limit_data_intact_through_spill_and_return)
{
    if (!device_up()) SKIP("the driver double did not start (cuInit or VMM unavailable)");
    struct cudbl_counts c0;
    cudbl_get_counts(&c0);
    REQUIRE(c0.bytes_in_use == 0);
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec w[NW], a[8];
    memset(a, 0, sizeof a);
    size_t wbytes = 0;
    for (int i = 0; i < NW; i++) {
        CHECK(alloc_fill(pool, &w[i], WEIGHTS[i], 100 + (uint32_t)i) == 0);
        wbytes += WEIGHTS[i];
    }
    msh_pool_mark_step(pool); /* the weights are now cold */
    CHECK(pool_ok(pool));
    /* a step that needs more than the limit leaves: activations of 3 MiB */
    int served = 0;
    for (int i = 0; i < 8; i++)
        if (alloc_fill(pool, &a[i], 3 * MiB, 200 + (uint32_t)i) == 0) served++;
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    printf("    weights %zu bytes, activations served %d of 8 (3 MiB each) at a limit of %zu: spilled %zu bytes "
           "(%llu pages out), device peak %zu\n",
           wbytes, served, (size_t)LIMIT, st.spilled_bytes, (unsigned long long)st.spill_out_pages, cudbl_device_peak(0));
    CHECK(served >= 3);
    CHECK(st.spilled_bytes > 0 && st.spill_out_pages > 0 && st.rescue_spill > 0);
    CHECK(verify_all(w, NW) == 0);
    CHECK(verify_all(a, 8) == 0);
    CHECK(pool_ok(pool));
    struct cudbl_counts c1;
    cudbl_get_counts(&c1);
    CHECK(c1.host_handles > 0 && c1.host_bytes_in_use == st.spilled_bytes);
    CHECKF(cudbl_device_peak(0) <= LIMIT, "device peak %zu over the limit %zu", cudbl_device_peak(0), (size_t)LIMIT);
    /* the step ends: its activations go, and at the mark the weights come back to the device */
    for (int i = 0; i < 8; i++)
        if (a[i].addr) CHECK(msh_pool_free(pool, a[i].addr, MSH_STREAM_COMPLETED) == 0);
    memset(a, 0, sizeof a);
    size_t back = msh_pool_mark_step(pool);
    msh_pool_get_stats(pool, &st);
    printf("    after the step: %zu bytes back on the device, %zu still spilled, %llu pages in\n", back, st.spilled_bytes,
           (unsigned long long)st.spill_in_pages);
    CHECK(back > 0 && st.spill_in_pages > 0);
    CHECK(st.spilled_bytes == 0); /* 10 MiB of weights fit under 15/16 of the limit */
    CHECK(verify_all(w, NW) == 0);
    CHECK(pool_ok(pool));
    cudbl_get_counts(&c1);
    CHECK(c1.host_handles == 0 && c1.host_bytes_in_use == 0);
    CHECKF(cudbl_device_peak(0) <= LIMIT, "device peak %zu over the limit %zu", cudbl_device_peak(0), (size_t)LIMIT);
    for (int i = 0; i < NW; i++) CHECK(msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
}

TEST(a_live_set_of_1_5x_the_limit_is_served)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    /* four steps, each leaving 6 MiB live (layers' weights, optimizer state): 24 MiB = 1.5 x 16 */
    struct blkrec v[4];
    for (int s = 0; s < 4; s++) {
        CHECKF(alloc_fill(pool, &v[s], 6 * MiB, 300 + (uint32_t)s) == 0, "step %d's 6 MiB not served", s);
        msh_pool_mark_step(pool);
        CHECK(pool_ok(pool));
    }
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    printf("    24 MiB live at a 16 MiB limit: %zu bytes spilled, device holds %zu\n", st.spilled_bytes, st.mapped_bytes);
    CHECK(st.spilled_bytes >= 8 * MiB);
    CHECK(st.mapped_bytes <= LIMIT);
    CHECK(verify_all(v, 4) == 0);
    CHECKF(cudbl_device_peak(0) <= LIMIT, "device peak %zu", cudbl_device_peak(0));
    for (int s = 0; s < 4; s++) CHECK(msh_pool_free(pool, v[s].addr, MSH_STREAM_COMPLETED) == 0);
    msh_pool_mark_step(pool); /* idle host pages go back */
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.host_handles == 0);
    CHECK(pool_ok(pool));
    msh_pool_destroy(pool);
}

/* The same program three ways: spill capped at 4 MiB (a clear OOM past it), spill off (today's
 * OOM at the same request), and a driver without host VMM (warned, then as off). */
static int run_program(struct msh_pool *pool, struct blkrec *v, int *failed_at)
{
    *failed_at = -1;
    for (int s = 0; s < 5; s++) {
        if (alloc_fill(pool, &v[s], 6 * MiB, 400 + (uint32_t)s)) {
            *failed_at = s;
            return ENOMEM;
        }
        msh_pool_mark_step(pool);
    }
    return 0;
}

TEST(past_spill_max_a_clear_oom_off_is_todays_oom)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct blkrec v[5];
    int at_capped, at_off, at_novmm;
    struct msh_pool *pool = pool_new(LIMIT, true, 4 * MiB);
    REQUIRE(pool);
    memset(v, 0, sizeof v);
    CHECK(run_program(pool, v, &at_capped) == ENOMEM);
    struct msh_pool_oom o;
    msh_pool_last_oom(pool, &o);
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    printf("    MEMSHIM_SPILL_MAX=4M: failed at step %d with %zu bytes spilled (%s)\n", at_capped, o.spilled_bytes,
           o.spill_stop ? o.spill_stop : "-");
    CHECK(o.spill_stop && !strcmp(o.spill_stop, "spill_max"));
    CHECK(o.spilled_bytes <= 4 * MiB && st.spilled_bytes <= 4 * MiB);
    CHECK(st.spill_refused == 1);
    CHECK(verify_all(v, 5) == 0);
    CHECK(pool_ok(pool));
    for (int s = 0; s < 5; s++)
        if (v[s].addr) msh_pool_free(pool, v[s].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);

    pool = pool_new(LIMIT, false, 0);
    REQUIRE(pool);
    memset(v, 0, sizeof v);
    CHECK(run_program(pool, v, &at_off) == ENOMEM);
    msh_pool_last_oom(pool, &o);
    msh_pool_get_stats(pool, &st);
    CHECK(o.spill_stop == NULL && o.spilled_bytes == 0 && st.spill_out_pages == 0);
    printf("    spill off: failed at step %d\n", at_off);
    CHECK(at_off == 2); /* 6 + 6 MiB fit in 16, the third does not */
    CHECK(at_capped > at_off);
    for (int s = 0; s < 5; s++)
        if (v[s].addr) msh_pool_free(pool, v[s].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);

    REQUIRE(cudbl_set_host(0, 0) == 0); /* the driver has no host memory through VMM: the backend */
    struct msh_device dev2;                /* reads the device attributes when it starts */
    REQUIRE(msh_dev_cuda_init(&dev2, 0) == 0);
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = LIMIT;
    p.spill = true;
    p.no_learn = true;
    REQUIRE(msh_pool_create(&dev2, &p, &pool) == 0);
    memset(v, 0, sizeof v);
    CHECK(run_program(pool, v, &at_novmm) == ENOMEM);
    msh_pool_last_oom(pool, &o);
    printf("    no host VMM: failed at step %d (%s)\n", at_novmm, o.spill_stop ? o.spill_stop : "-");
    CHECK(at_novmm == at_off);
    CHECK(o.spill_stop && !strcmp(o.spill_stop, "no host memory through VMM"));
    struct cudbl_counts c;
    cudbl_get_counts(&c);
    CHECK(c.host_handles == 0);
    CHECK(pool_ok(pool));
    for (int s = 0; s < 5; s++)
        if (v[s].addr) msh_pool_free(pool, v[s].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
    msh_dev_cuda_fini(&dev2);
    cudbl_set_host(CUDBL_HOST_VMM_NUMA | CUDBL_HOST_VMM_HOST, 0);
}

TEST(nothing_of_the_current_step_spills_nor_during_a_capture)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec v[3];
    memset(v, 0, sizeof v);
    /* no mark, nothing freed: everything is the current step */
    CHECK(alloc_fill(pool, &v[0], 6 * MiB, 500) == 0);
    CHECK(alloc_fill(pool, &v[1], 6 * MiB, 501) == 0);
    CHECK(alloc_fill(pool, &v[2], 6 * MiB, 502) == ENOMEM);
    struct msh_pool_oom o;
    msh_pool_last_oom(pool, &o);
    CHECK(o.spill_stop && !strcmp(o.spill_stop, "nothing cold"));
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    CHECK(st.spill_out_pages == 0);
    CHECK(verify_all(v, 2) == 0);
    for (int i = 0; i < 2; i++) msh_pool_free(pool, v[i].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);

    /* a capture in progress: the synchronize a spill needs would invalidate it */
    static int capturing = 0;
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = LIMIT;
    p.spill = true;
    p.no_learn = true;
    p.capturing = &capturing;
    REQUIRE(msh_pool_create(&g_dev, &p, &pool) == 0);
    memset(v, 0, sizeof v);
    CHECK(alloc_fill(pool, &v[0], 6 * MiB, 510) == 0);
    CHECK(alloc_fill(pool, &v[1], 6 * MiB, 511) == 0);
    msh_pool_mark_step(pool);
    __atomic_store_n(&capturing, 1, __ATOMIC_RELAXED);
    long sync0 = cudbl_call_count("cuCtxSynchronize");
    CHECK(alloc_fill(pool, &v[2], 6 * MiB, 512) == ENOMEM);
    CHECK(cudbl_call_count("cuCtxSynchronize") == sync0);
    msh_pool_get_stats(pool, &st);
    CHECK(st.spill_out_pages == 0);
    __atomic_store_n(&capturing, 0, __ATOMIC_RELAXED);
    msh_pool_after_capture(pool);
    CHECK(alloc_fill(pool, &v[2], 6 * MiB, 512) == 0); /* after the capture it spills */
    CHECK(verify_all(v, 3) == 0);
    CHECK(pool_ok(pool));
    for (int i = 0; i < 3; i++) msh_pool_free(pool, v[i].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
}

/* A kernel still queued on a cold block when the spill comes (the double in async mode runs it on
 * its "GPU" thread up to 20 ms later): its writes must land in the bytes that end up on the host.
 * The pool synchronizes the device before it copies (unmap is not stream-ordered either). */
struct late_write {
    uint64_t addr;
    size_t n;
    uint32_t tag;
};

static void late_write_fn(void *arg)
{
    struct late_write *w = arg;
    usleep(20000);
    fill(w->addr, w->n, w->tag);
}

TEST(a_kernel_queued_on_a_cold_block_finishes_before_its_pages_move)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    CUstream s;
    REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    struct blkrec w[2], a[2];
    memset(a, 0, sizeof a);
    CHECK(alloc_fill(pool, &w[0], 6 * MiB, 800) == 0);
    CHECK(alloc_fill(pool, &w[1], 6 * MiB, 801) == 0);
    msh_pool_mark_step(pool);
    cudbl_set_async(1);
    /* the optimizer's update of the weights, still running when the next step allocates */
    static struct late_write lw[2];
    for (int i = 0; i < 2; i++) {
        lw[i] = (struct late_write){w[i].addr, w[i].size, 900 + (uint32_t)i};
        w[i].tag = 900 + (uint32_t)i;
        CHECK(cudbl_launch(s, w[i].addr, w[i].size, 1, late_write_fn, &lw[i]) == CUDA_SUCCESS);
    }
    CHECK(alloc_fill(pool, &a[0], 6 * MiB, 810) == 0); /* needs pages: the weights' go to the host */
    CHECK(alloc_fill(pool, &a[1], 6 * MiB, 811) == 0);
    cuStreamSynchronize(s);
    cudbl_set_async(0);
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    CHECK(st.spill_out_pages > 0);
    CHECKF(verify_all(w, 2) == 0, "the queued kernel's writes were lost by the move");
    CHECK(verify_all(a, 2) == 0);
    CHECK(pool_ok(pool));
    for (int i = 0; i < 2; i++) {
        msh_pool_free(pool, a[i].addr, MSH_STREAM_COMPLETED);
        msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED);
    }
    cuStreamDestroy(s);
    msh_pool_destroy(pool);
}

/* Coming back leaves room: at a step mark spilled pages return only while 1/16 of the limit (at
 * least a page) stays free, so the next step's first request does not spill them again. */
TEST(a_step_mark_brings_pages_back_but_leaves_room)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec w[2], a;
    CHECK(alloc_fill(pool, &w[0], 6 * MiB, 1000) == 0); /* 3 pages each */
    CHECK(alloc_fill(pool, &w[1], 6 * MiB, 1001) == 0);
    msh_pool_mark_step(pool);
    CHECK(alloc_fill(pool, &a, 8 * MiB, 1002) == 0); /* 4 pages: the weights' pages go to the host */
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    size_t out = st.spilled_bytes;
    CHECK(out >= 4 * MiB);
    msh_pool_mark_step(pool); /* the 8 MiB block stays live: 4 pages of room, one kept free */
    msh_pool_get_stats(pool, &st);
    printf("    spilled %zu MiB; after the mark %zu MiB on the host, the device holds %zu of %zu MiB\n", out >> 20,
           st.spilled_bytes >> 20, st.mapped_bytes >> 20, (size_t)LIMIT >> 20);
    CHECKF(st.mapped_bytes <= LIMIT - PAGE, "the mark filled the device to %zu of %zu bytes", st.mapped_bytes,
           (size_t)LIMIT);
    CHECK(st.spill_in_pages > 0 && st.spilled_bytes < out);
    CHECK(verify_all(w, 2) == 0);
    struct blkrec one;
    CHECK(alloc_fill(pool, &one, PAGE, 1003) == 0); /* the next step's first page: no spill needed */
    struct msh_pool_stats st2;
    msh_pool_get_stats(pool, &st2);
    CHECK(st2.spill_out_pages == st.spill_out_pages);
    CHECK(pool_ok(pool));
    msh_pool_free(pool, one.addr, MSH_STREAM_COMPLETED);
    msh_pool_free(pool, a.addr, MSH_STREAM_COMPLETED);
    for (int i = 0; i < 2; i++) msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
}

/* Threads allocating and freeing at the limit at once: the weights' pages move to the host under
 * them and come back at the step marks between rounds (handles being moved are waited for, never
 * handed out), every byte stays. Each round is a step: the marks come when no worker holds a block,
 * as in a job whose steps end with the optimizer (a block of a step in progress is never cold; a
 * cold block in use by another thread during a move is outside what spill supports: pool.md). */
#define ROUNDS 40
static pthread_barrier_t g_round;

struct worker {
    struct msh_pool *pool;
    uint32_t id;
    int bad, served, refused;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    for (int round = 0; round < ROUNDS; round++) {
        pthread_barrier_wait(&g_round); /* the step begins */
        struct blkrec b[2];
        memset(b, 0, sizeof b);
        for (int i = 0; i < 2; i++) {
            if (alloc_fill(w->pool, &b[i], (size_t)(1 + (round + i + w->id) % 3) * MiB + 512 * (w->id + 1),
                           2000 + w->id * 100 + (uint32_t)(round % 50))) {
                w->refused++;
                b[i].addr = 0;
            } else {
                w->served++;
            }
        }
        w->bad += verify_all(b, 2);
        for (int i = 0; i < 2; i++)
            if (b[i].addr) msh_pool_free(w->pool, b[i].addr, MSH_STREAM_COMPLETED);
        pthread_barrier_wait(&g_round); /* the step ends */
    }
    return NULL;
}

TEST(threads_at_the_limit_while_steps_are_marked)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec w[3];
    for (int i = 0; i < 3; i++) CHECK(alloc_fill(pool, &w[i], 3 * MiB, 1900 + (uint32_t)i) == 0);
    msh_pool_mark_step(pool);
    struct worker ws[3];
    pthread_t th[3];
    REQUIRE(pthread_barrier_init(&g_round, NULL, 4) == 0);
    for (int i = 0; i < 3; i++) {
        ws[i] = (struct worker){.pool = pool, .id = (uint32_t)i};
        REQUIRE(pthread_create(&th[i], NULL, worker_main, &ws[i]) == 0);
    }
    for (int k = 0; k < ROUNDS; k++) {
        pthread_barrier_wait(&g_round);
        for (int c = 0; c < 3; c++) { /* checks while the workers allocate and moves are in flight */
            char why[512];
            int rc = msh_pool_check(pool, why, sizeof why);
            CHECKF(rc == 0, "%s", why);
            usleep(500);
        }
        pthread_barrier_wait(&g_round);
        msh_pool_mark_step(pool); /* the step boundary, from the main thread */
    }
    int bad = 0, served = 0, refused = 0;
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        bad += ws[i].bad;
        served += ws[i].served;
        refused += ws[i].refused;
    }
    pthread_barrier_destroy(&g_round);
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    printf("    3 threads at a 16 MiB limit, 40 steps: %d served, %d refused; %llu pages to the host, %llu back\n",
           served, refused, (unsigned long long)st.spill_out_pages, (unsigned long long)st.spill_in_pages);
    CHECK(bad == 0);
    CHECK(verify_all(w, 3) == 0);
    CHECK(st.spill_out_pages > 0);
    CHECK(pool_ok(pool));
    CHECKF(cudbl_device_peak(0) <= LIMIT, "device peak %zu", cudbl_device_peak(0));
    for (int i = 0; i < 3; i++) msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
}

/* Marks while other threads allocate (without touching the memory: a block of theirs may turn cold
 * at the mark): pages coming back to the device count against the limit from the moment they are
 * chosen, so another thread's request cannot take the same room meanwhile (the device's own peak
 * stays at the limit). */
static atomic_int g_stop;

static void *alloc_only_main(void *arg)
{
    struct msh_pool *pool = arg;
    while (!atomic_load(&g_stop)) {
        uint64_t a = 0;
        if (msh_pool_alloc(pool, 3 * MiB, MSH_STREAM_COMPLETED, &a) == 0) msh_pool_free(pool, a, MSH_STREAM_COMPLETED);
    }
    return NULL;
}

TEST(returns_count_against_the_limit_while_other_threads_allocate)
{
    if (!device_up()) SKIP("the driver double did not start");
    size_t peak0 = cudbl_device_peak(0);
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec w[4];
    for (int i = 0; i < 4; i++) CHECK(alloc_fill(pool, &w[i], 3 * MiB, 2500 + (uint32_t)i) == 0);
    msh_pool_mark_step(pool);
    atomic_store(&g_stop, 0);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) REQUIRE(pthread_create(&th[i], NULL, alloc_only_main, pool) == 0);
    struct blkrec a[3];
    memset(a, 0, sizeof a);
    for (int k = 0; k < 60; k++) {
        for (int i = 0; i < 3; i++) { /* a step that needs the weights' room */
            if (alloc_fill(pool, &a[i], 2 * MiB, 2600 + (uint32_t)i)) a[i].addr = 0;
        }
        for (int i = 0; i < 3; i++)
            if (a[i].addr) msh_pool_free(pool, a[i].addr, MSH_STREAM_COMPLETED);
        msh_pool_mark_step(pool); /* returns run while the other threads allocate */
    }
    atomic_store(&g_stop, 1);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    printf("    60 steps with 2 threads allocating throughout: %llu pages to the host, %llu back; device peak %zu of %zu\n",
           (unsigned long long)st.spill_out_pages, (unsigned long long)st.spill_in_pages, cudbl_device_peak(0),
           (size_t)LIMIT);
    CHECK(st.spill_in_pages > 0);
    CHECKF(cudbl_device_peak(0) <= LIMIT || cudbl_device_peak(0) == peak0, "device peak %zu over the limit %zu",
           cudbl_device_peak(0), (size_t)LIMIT);
    CHECK(verify_all(w, 4) == 0);
    CHECK(pool_ok(pool));
    for (int i = 0; i < 4; i++) msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
}

/* A new block never lands on a spilled page: the free bytes beside a cold block on the host are
 * not handed out (a block of the current step would live on host memory, and the next return
 * would copy it while it is in use). */
struct find_addr {
    uint64_t addr;
    int found;
};

static void find_spilled(void *arg, uint64_t addr, size_t size, size_t host_bytes)
{
    (void)size;
    (void)host_bytes;
    struct find_addr *f = arg;
    if (addr == f->addr) f->found = 1;
}

TEST(a_new_block_never_lands_on_a_spilled_page)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool *pool = pool_new(LIMIT, true, 0);
    REQUIRE(pool);
    struct blkrec w, y, big[2], small;
    CHECK(alloc_fill(pool, &w, MiB, 3000) == 0); /* two cold blocks share the first page */
    CHECK(alloc_fill(pool, &y, MiB, 3004) == 0);
    msh_pool_mark_step(pool);
    CHECK(alloc_fill(pool, &big[0], 7 * MiB + MiB / 2, 3001) == 0);
    CHECK(alloc_fill(pool, &big[1], 7 * MiB + MiB / 2, 3002) == 0); /* 17 MiB: the first page goes to the host */
    struct msh_pool_stats st;
    msh_pool_get_stats(pool, &st);
    CHECKF(st.spilled_bytes == PAGE, "%zu bytes spilled", st.spilled_bytes);
    msh_pool_free(pool, y.addr, MSH_STREAM_COMPLETED); /* 1 MiB free on the spilled page */
    msh_pool_free(pool, big[1].addr, MSH_STREAM_COMPLETED); /* and room on the device */
    CHECK(alloc_fill(pool, &small, 512 * 1024, 3003) == 0); /* fits beside the weight: must not go there */
    struct find_addr f = {small.addr, 0};
    msh_pool_for_each_spilled(pool, find_spilled, &f);
    CHECKF(!f.found, "the new block at %#llx is on a spilled page", (unsigned long long)small.addr);
    f = (struct find_addr){w.addr, 0};
    msh_pool_for_each_spilled(pool, find_spilled, &f);
    CHECK(f.found); /* (the walk does see the cold one) */
    CHECK(verify_all(&w, 1) == 0 && verify_all(&small, 1) == 0);
    CHECK(pool_ok(pool));
    msh_pool_free(pool, small.addr, MSH_STREAM_COMPLETED);
    msh_pool_free(pool, big[0].addr, MSH_STREAM_COMPLETED);
    msh_pool_free(pool, w.addr, MSH_STREAM_COMPLETED);
    msh_pool_destroy(pool);
}

/* Every driver call of the spill sequence (and of the return), failed at each of its first
 * occurrences: the request is served or refused cleanly, no byte is lost, the pool is consistent,
 * and the device stays under the limit. */
TEST(fault_injection_on_every_call_of_spill_and_return)
{
    if (!device_up()) SKIP("the driver double did not start");
    static const char *calls[] = {"cuMemCreate",  "cuMemAddressReserve", "cuMemMap",         "cuMemSetAccess",
                                  "cuMemcpyDtoD", "cuMemUnmap",          "cuMemRelease",     "cuMemAddressFree",
                                  "cuCtxSynchronize"};
    int runs = 0, served = 0, refused = 0;
    for (size_t k = 0; k < sizeof calls / sizeof calls[0]; k++)
        for (long nth = 1; nth <= 6; nth++)
            for (int phase = 0; phase < 2; phase++) { /* 0: fail in the spill, 1: in the return */
                struct msh_pool *pool = pool_new(LIMIT, true, 0);
                REQUIRE(pool);
                struct blkrec w[NW], a[2];
                memset(a, 0, sizeof a);
                for (int i = 0; i < NW; i++) CHECK(alloc_fill(pool, &w[i], WEIGHTS[i], 600 + (uint32_t)i) == 0);
                msh_pool_mark_step(pool);
                if (phase == 0) cudbl_fail_nth(calls[k], nth, CUDA_ERROR_UNKNOWN);
                int rc0 = alloc_fill(pool, &a[0], 5 * MiB, 700);
                int rc1 = alloc_fill(pool, &a[1], 5 * MiB, 701);
                served += (rc0 == 0) + (rc1 == 0);
                refused += (rc0 != 0) + (rc1 != 0);
                cudbl_fail_clear();
                int bad = verify_all(w, NW) + verify_all(a, 2);
                CHECKF(bad == 0, "%s failed at call %ld (%s): %d blocks damaged", calls[k], nth, phase ? "return" : "spill", bad);
                CHECKF(pool_ok(pool), "%s failed at call %ld (%s)", calls[k], nth, phase ? "return" : "spill");
                for (int i = 0; i < 2; i++)
                    if (a[i].addr) msh_pool_free(pool, a[i].addr, MSH_STREAM_COMPLETED);
                if (phase == 1) cudbl_fail_nth(calls[k], nth, CUDA_ERROR_UNKNOWN);
                msh_pool_mark_step(pool);
                cudbl_fail_clear();
                CHECKF(verify_all(w, NW) == 0, "%s failed at call %ld (return): data damaged", calls[k], nth);
                CHECKF(pool_ok(pool), "%s failed at call %ld (return)", calls[k], nth);
                for (int i = 0; i < NW; i++) CHECK(msh_pool_free(pool, w[i].addr, MSH_STREAM_COMPLETED) == 0);
                msh_pool_destroy(pool);
                runs++;
            }
    printf("    %d runs with one failed driver call each: %d requests served, %d refused; data and pool intact\n", runs,
           served, refused);
    CHECKF(cudbl_device_peak(0) <= LIMIT, "device peak %zu", cudbl_device_peak(0));
}

TEST_MAIN()
