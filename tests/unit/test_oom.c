/*
 * test_oom.c: requests the pool cannot serve (issue 25, docs/pool.md "Pressure and the OOM rescue
 * chain"), through the real-driver backend (policy/dev_cuda.c) over the CUDA driver double.
 *
 * A request larger than the device, than the limit, or than what the device could give now (its
 * free memory, the pool's cached pages, what reclaim could free) is refused before any driver
 * work: no cuMemCreate, no map, nothing released, and the device's free memory (what another
 * process would get) does not move while it is refused. What fits is served as before. A
 * batch-size finder that doubles its batch until refused and then steps back up costs the driver
 * exactly what its successful requests cost. Before issue 25 an impossible request mapped page
 * after page until the driver refused, went on creating after the refusal, released the job's
 * whole cache and swept again: on the double's 8 GiB device a 16 GiB request made about 20,000
 * cuMemCreate calls and filled the device.
 *
 * The device's figures come from the double itself (cudbl_call_count, cudbl_device_mark_peak),
 * never from the pool. Another process's memory is played by cuMemAlloc, which the double charges
 * to the same device.
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
#include <string.h>
#include <time.h>

#include "on_double.h"

#define MiB MSH_MiB
#define GiB MSH_GiB
#define PAGE (2 * MiB)
#define CAPACITY (8 * GiB) /* the double's device, as in the reproduction */

__attribute__((constructor)) static void oom_env(void)
{
    setenv("CUDBL_CAPACITY", "8G", 1);
    setenv("CUDBL_GRANULARITY", "2M", 1);
    msh_log_level = MSH_LOG_ERROR; /* each refusal warns; the tests read the diagnosis instead */
}

static size_t gc_calls;
static size_t count_gc(void *arg)
{
    (void)arg;
    gc_calls++;
    return 0;
}

static bool g_no_defrag; /* MEMSHIM_DEFRAG=0 for the next pool_new */

static struct msh_pool *pool_new(size_t limit, bool spill)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.defrag = !g_no_defrag;
    p.limit_bytes = limit;
    p.spill = spill;
    p.spill_max_bytes = spill ? 4 * GiB : 0;
    p.no_learn = true;
    struct msh_pool *pool = NULL;
    if (msh_pool_create(&g_dev, &p, &pool)) return NULL;
    msh_pool_set_gc(pool, count_gc, NULL); /* as memshim sets it: gc.collect() in a Python job */
    return pool;
}

static int pool_ok(struct msh_pool *pool)
{
    char why[512];
    if (msh_pool_check(pool, why, sizeof why) == 0) return 1;
    fprintf(stderr, "    msh_pool_check: %s\n", why);
    return 0;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static size_t device_free(void)
{
    size_t f = 0, t = 0;
    cuMemGetInfo(&f, &t);
    return f;
}

/* What the driver did during one request, by the double's own counters. */
struct drv {
    long creates, maps, unmaps, releases;
    size_t used0;     /* device bytes charged when it started */
    size_t rise;      /* how far above used0 the device's charge went meanwhile */
    double us;
};

static void drv_begin(struct drv *d)
{
    d->creates = cudbl_call_count("cuMemCreate");
    d->maps = cudbl_call_count("cuMemMap");
    d->unmaps = cudbl_call_count("cuMemUnmap");
    d->releases = cudbl_call_count("cuMemRelease");
    cudbl_device_mark_peak(0, 1, &d->used0);
    d->us = now_us();
}

static void drv_end(struct drv *d)
{
    d->us = now_us() - d->us;
    size_t peak = cudbl_device_mark_peak(0, 1, NULL);
    d->rise = peak > d->used0 ? peak - d->used0 : 0;
    d->creates = cudbl_call_count("cuMemCreate") - d->creates;
    d->maps = cudbl_call_count("cuMemMap") - d->maps;
    d->unmaps = cudbl_call_count("cuMemUnmap") - d->unmaps;
    d->releases = cudbl_call_count("cuMemRelease") - d->releases;
}

static void drv_print(const char *what, size_t req, int rc, const struct drv *d)
{
    printf("    %s: %zu MiB -> %s in %.0f us; cuMemCreate %ld, cuMemMap %ld, cuMemUnmap %ld, cuMemRelease %ld; "
           "device charge rose %zu MiB\n",
           what, req / MiB, rc ? "refused" : "served", d->us, d->creates, d->maps, d->unmaps, d->releases,
           d->rise / MiB);
}

/* A job that already holds memory and has cached pages: `live` live, `cached` freed (kept). */
static void warm(struct msh_pool *pool, size_t live, size_t cached, uint64_t *keep)
{
    uint64_t tmp = 0;
    REQUIRE(msh_pool_alloc(pool, live, MSH_STREAM_COMPLETED, keep) == 0);
    if (cached) {
        REQUIRE(msh_pool_alloc(pool, cached, MSH_STREAM_COMPLETED, &tmp) == 0);
        REQUIRE(msh_pool_free(pool, tmp, MSH_STREAM_COMPLETED) == 0);
    }
}

/* A request the pool must refuse: ENOMEM, no driver work, the device's charge unmoved, the cache
 * kept (never released for a request that would still not fit), gc run `want_gc` times. */
static void check_refused(struct msh_pool *pool, size_t req, const char *what, size_t want_gc)
{
    uint64_t a = 0;
    struct msh_pool_stats s0, s1;
    msh_pool_get_stats(pool, &s0);
    gc_calls = 0;
    struct drv d;
    drv_begin(&d);
    int rc = msh_pool_alloc(pool, req, MSH_STREAM_COMPLETED, &a);
    drv_end(&d);
    drv_print(what, req, rc, &d);
    msh_pool_get_stats(pool, &s1);
    CHECK(rc == ENOMEM);
    CHECKF(d.creates == 0 && d.maps == 0 && d.unmaps == 0 && d.releases == 0,
           "driver work for a request that cannot fit: create %ld map %ld unmap %ld release %ld", d.creates, d.maps,
           d.unmaps, d.releases);
    CHECKF(d.rise == 0, "the device's charge rose by %zu MiB while refusing", d.rise / MiB);
    CHECKF(s1.released_pages == s0.released_pages && s1.mapped_bytes == s0.mapped_bytes,
           "the job's cache was released for a request that still would not fit (%zu -> %zu bytes held)",
           s0.mapped_bytes, s1.mapped_bytes);
    CHECKF(gc_calls == want_gc, "gc ran %zu times", gc_calls);
}

TEST(a_request_larger_than_the_device_is_refused_before_any_driver_work)
{
    if (!device_up()) SKIP("the driver double did not start (cuInit or VMM unavailable)");
    struct msh_pool *pool = pool_new(0, false);
    REQUIRE(pool);
    uint64_t keep = 0, a = 0;
    warm(pool, 64 * MiB, 256 * MiB, &keep);
    check_refused(pool, 2 * CAPACITY, "twice the device", 0); /* the 16 GiB */
    struct msh_pool_oom o;
    msh_pool_last_oom(pool, &o);
    CHECKF(o.kind == MSH_OOM_DEVICE && o.steps == 0 && o.requested == 2 * CAPACITY && o.device_total == CAPACITY,
           "case %s, steps %#x", msh_oom_case_name(o.kind), o.steps);
    CHECK(!strcmp(msh_oom_case_name(o.kind), "larger_than_device"));
    CHECK(pool_ok(pool));
    /* what fits afterwards is served as before */
    CHECK(msh_pool_alloc(pool, 512 * MiB, MSH_STREAM_COMPLETED, &a) == 0 && msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
    CHECK(msh_pool_free(pool, keep, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
}

TEST(a_request_larger_than_the_limit_is_refused_before_any_driver_work_spill_or_not)
{
    if (!device_up()) SKIP("the driver double did not start");
    for (int spill = 0; spill < 2; spill++) {
        struct msh_pool *pool = pool_new(GiB, spill);
        REQUIRE(pool);
        uint64_t keep = 0, a = 0;
        warm(pool, 64 * MiB, 128 * MiB, &keep);
        msh_pool_mark_step(pool); /* the 64 MiB are cold: spill could move them */
        /* A new block lands on device pages only (spill moves cold blocks, never the new one), so
         * no request above the limit can be served, spill or not. */
        check_refused(pool, GiB + PAGE, spill ? "limit + 1 page, spill on" : "limit + 1 page", 0);
        struct msh_pool_stats st;
        msh_pool_get_stats(pool, &st);
        CHECK(st.spill_out_pages == 0);
        struct msh_pool_oom o;
        msh_pool_last_oom(pool, &o);
        CHECKF(o.kind == MSH_OOM_LIMIT && o.steps == 0 && o.limit_bytes == GiB, "case %s, steps %#x",
               msh_oom_case_name(o.kind), o.steps);
        CHECK(!strcmp(msh_oom_case_name(o.kind), "larger_than_limit"));
        /* the limit itself is served */
        CHECK(msh_pool_free(pool, keep, MSH_STREAM_COMPLETED) == 0);
        CHECK(msh_pool_alloc(pool, GiB, MSH_STREAM_COMPLETED, &a) == 0 && msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
        CHECK(pool_ok(pool));
        msh_pool_destroy(pool);
    }
}

/* The H200's second case: a request of the device's free memory + 4 GiB, with no limit, while
 * another allocator holds part of the device and the pool has live and cached memory. On the
 * H200 that was larger than the device too (139.9 GiB free of 140.4); on the double as well. */
TEST(free_plus_4g_is_refused_without_taking_the_device_or_the_cache)
{
    if (!device_up()) SKIP("the driver double did not start");
    CUdeviceptr other = 0;
    REQUIRE(cuMemAlloc(&other, 2 * GiB) == CUDA_SUCCESS); /* another process's memory */
    struct msh_pool *pool = pool_new(0, false);
    REQUIRE(pool);
    uint64_t keep = 0;
    warm(pool, GiB, 512 * MiB, &keep);
    check_refused(pool, device_free() + 4 * GiB, "free + 4 GiB", 0);
    struct msh_pool_oom o;
    msh_pool_last_oom(pool, &o);
    CHECKF(o.kind == MSH_OOM_DEVICE && o.steps == 0, "case %s, steps %#x", msh_oom_case_name(o.kind), o.steps);
    CHECK(pool_ok(pool));
    CHECK(msh_pool_free(pool, keep, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
    cuMemFree(other);
}

/* Smaller than the device, but more than its free memory, the pool's cache and (when gc is asked
 * to help) its live blocks could ever give while another allocator holds the rest: refused with
 * no create, the cache kept, the diagnosis naming the case and its figures. When a collection
 * could make room (the live blocks might be garbage), gc runs first: it costs no driver work.
 * Without reclaim (MEMSHIM_DEFRAG=0) the empty-cache step would run for such a request: not when
 * even the whole cache given back would leave it short. */
TEST(a_request_that_does_not_fit_now_is_refused_without_taking_the_device_or_the_cache)
{
    if (!device_up()) SKIP("the driver double did not start");
    CUdeviceptr other = 0;
    REQUIRE(cuMemAlloc(&other, 4 * GiB) == CUDA_SUCCESS); /* another process's memory */
    for (int run = 0; run < 4; run++) {
        int gc_helps = run & 1;
        g_no_defrag = run >= 2;
        struct msh_pool *pool = pool_new(0, false);
        g_no_defrag = false;
        REQUIRE(pool);
        uint64_t keep = 0;
        warm(pool, GiB, 512 * MiB, &keep);
        size_t fr = device_free(), held = msh_pool_mapped_bytes(pool);
        /* beyond free + held (gc cannot help), or between free + cached and free + held */
        size_t req = gc_helps ? fr + held - 128 * MiB : fr + held + 256 * MiB;
        REQUIRE(req < CAPACITY);
        check_refused(pool, req, run == 0 ? "over free + held" : run == 1 ? "under free + held, over free + cached"
                                 : run == 2 ? "over free + held, no reclaim" : "under free + held, over free + cached, no reclaim",
                      (size_t)gc_helps);
        struct msh_pool_oom o;
        msh_pool_last_oom(pool, &o);
        CHECKF(o.kind == MSH_OOM_NOW, "case %s", msh_oom_case_name(o.kind));
        CHECKF(o.steps == (gc_helps ? MSH_OOM_STEP_GC : 0u), "steps %#x", o.steps);
        struct msh_pool_counters k;
        msh_pool_counters(pool, &k);
        CHECKF(o.device_free == fr && o.cached_bytes == k.cached_pages * PAGE && o.cached_bytes >= 256 * MiB &&
               o.live_bytes == GiB && o.requested == req,
               "free %zu (device said %zu), cached %zu, live %zu", o.device_free, fr, o.cached_bytes, o.live_bytes);
        CHECK(!strcmp(msh_oom_case_name(o.kind), "does_not_fit_now"));
        CHECK(pool_ok(pool));
        CHECK(msh_pool_free(pool, keep, MSH_STREAM_COMPLETED) == 0);
        msh_pool_destroy(pool);
    }
    cuMemFree(other);
}

/* Another allocator holds `other` bytes; the pool holds `live` live and `cached` cached; a request
 * of the device's free memory + `over` (negative: less) is served, and the device's charge rises
 * by no more than the request. */
static void served_beside_another(size_t other_bytes, size_t live, size_t cached, long long over, const char *what)
{
    CUdeviceptr other = 0;
    REQUIRE(cuMemAlloc(&other, other_bytes) == CUDA_SUCCESS);
    struct msh_pool *pool = pool_new(0, false);
    REQUIRE(pool);
    uint64_t keep = 0, a = 0;
    if (live) warm(pool, live, cached, &keep);
    size_t req = (size_t)((long long)device_free() + over);
    struct drv d;
    drv_begin(&d);
    int rc = msh_pool_alloc(pool, req, MSH_STREAM_COMPLETED, &a);
    drv_end(&d);
    drv_print(what, req, rc, &d);
    CHECK(rc == 0);
    CHECKF(d.rise <= req, "the device's charge rose by %zu MiB for a %zu MiB request", d.rise / MiB, req / MiB);
    CHECK(pool_ok(pool));
    if (!rc) CHECK(msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
    if (keep) CHECK(msh_pool_free(pool, keep, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
    cuMemFree(other);
}

/* What fits in free memory plus the cache is served, and the device's free memory falls by no more
 * than the request (the cache is reused, not added to). */
TEST(what_fits_with_the_cache_is_served_and_takes_no_more_than_the_request)
{
    if (!device_up()) SKIP("the driver double did not start");
    served_beside_another(2 * GiB, GiB, 2 * GiB, (long long)GiB, "free + 1 GiB of a 2 GiB cache");
}

/* Far from any limit a block at the open end of the line is mapped with the next 20 MiB chunk
 * ahead (docs/pool.md "Handles"). When another allocator leaves the device just the request's room,
 * the request is still served: once the device's room is known, it is placed again within it,
 * without the chunk, even with nothing cached to reclaim. Free - 2 MiB is 1022 MiB here: its chunk
 * would end at 1040 MiB. */
TEST(what_fits_in_the_devices_free_memory_is_served_without_the_chunk_ahead)
{
    if (!device_up()) SKIP("the driver double did not start");
    served_beside_another(7 * GiB, 0, 0, -(long long)(2 * MiB), "free - 2 MiB beside 7 GiB of another allocator");
}

/* A create the driver refuses for memory ends the job's creates: what it made is given back and
 * nothing more is asked of the driver. The rescue steps that could not help are off here (no
 * reclaim, no release, no gc), so the one job is all the request does. */
TEST(a_create_refused_for_memory_stops_the_job_and_gives_back_what_it_made)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.limit_bytes = GiB; /* one handle per page: 32 creates for 64 MiB */
    p.defrag = false;
    p.no_release_on_oom = true;
    p.no_learn = true;
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&g_dev, &p, &pool) == 0);
    uint64_t a = 0;
    size_t used0 = 0;
    cudbl_device_mark_peak(0, 1, &used0);
    cudbl_fail_nth("cuMemCreate", 3, CUDA_ERROR_OUT_OF_MEMORY);
    struct drv d;
    drv_begin(&d);
    int rc = msh_pool_alloc(pool, 64 * MiB, MSH_STREAM_COMPLETED, &a);
    drv_end(&d);
    cudbl_fail_clear();
    drv_print("64 MiB, the 3rd create refused", 64 * MiB, rc, &d);
    CHECK(rc == ENOMEM);
    CHECKF(d.creates == 3, "%ld creates: the job went on after the driver refused one", d.creates);
    size_t used1 = 0;
    cudbl_device_mark_peak(0, 0, &used1);
    CHECKF(used1 == used0, "the device holds %zu bytes more after the refusal", used1 - used0);
    CHECK(msh_pool_mapped_bytes(pool) == 0);
    CHECK(pool_ok(pool));
    /* the next request is served */
    CHECK(msh_pool_alloc(pool, 64 * MiB, MSH_STREAM_COMPLETED, &a) == 0 && msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
}

/* ---- batch-size finders -------------------------------------------------------------------------
 * A training step of batch b: b samples' activations (ACT each), freed after the step; 1 GiB of
 * weights stay live. The finder doubles b until a step is refused, then
 * bisects between the last batch served and the first refused (Lightning's BatchSizeFinder in
 * "binsearch" mode does both). */
#define WEIGHTS GiB
#define ACT (24 * MiB)

static int step_try(struct msh_pool *pool, int b, int *refused, struct drv *refused_sum)
{
    struct drv d;
    drv_begin(&d);
    uint64_t y = 0;
    int rc = msh_pool_alloc(pool, (size_t)b * ACT, MSH_STREAM_COMPLETED, &y);
    drv_end(&d);
    if (y) msh_pool_free(pool, y, MSH_STREAM_COMPLETED);
    if (rc && refused) {
        (*refused)++;
        refused_sum->creates += d.creates;
        refused_sum->maps += d.maps;
        refused_sum->unmaps += d.unmaps;
        refused_sum->releases += d.releases;
        if (d.rise > refused_sum->rise) refused_sum->rise = d.rise;
        if (d.us > refused_sum->us) refused_sum->us = d.us;
    }
    return rc == 0;
}

/* The finder; the batches it served, in order, go to served[]. */
static int find_batch(struct msh_pool *pool, int *served, int *nserved, int *refused, struct drv *refused_sum)
{
    int lo = 0, hi = 0;
    for (int b = 1; b < 1 << 20; b *= 2) {
        if (!step_try(pool, b, refused, refused_sum)) {
            hi = b;
            break;
        }
        served[(*nserved)++] = lo = b;
    }
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (step_try(pool, mid, refused, refused_sum)) served[(*nserved)++] = lo = mid;
        else hi = mid;
    }
    return lo;
}

static void finder_case(size_t limit)
{
    struct msh_pool *pool = pool_new(limit, false);
    REQUIRE(pool);
    uint64_t w = 0;
    REQUIRE(msh_pool_alloc(pool, WEIGHTS, MSH_STREAM_COMPLETED, &w) == 0);
    long c0 = cudbl_call_count("cuMemCreate"), m0 = cudbl_call_count("cuMemMap"), u0 = cudbl_call_count("cuMemUnmap"),
         r0 = cudbl_call_count("cuMemRelease");
    int served[64], nserved = 0, refused = 0;
    struct drv rs;
    memset(&rs, 0, sizeof rs);
    double t0 = now_us();
    gc_calls = 0;
    int best = find_batch(pool, served, &nserved, &refused, &rs);
    double t1 = now_us();
    long creates = cudbl_call_count("cuMemCreate") - c0, maps = cudbl_call_count("cuMemMap") - m0,
         unmaps = cudbl_call_count("cuMemUnmap") - u0, releases = cudbl_call_count("cuMemRelease") - r0;
    CHECK(pool_ok(pool));
    CHECK(msh_pool_free(pool, w, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);

    /* The same successful steps alone, in a fresh pool: what they need from the driver. */
    pool = pool_new(limit, false);
    REQUIRE(pool);
    REQUIRE(msh_pool_alloc(pool, WEIGHTS, MSH_STREAM_COMPLETED, &w) == 0);
    long c1 = cudbl_call_count("cuMemCreate"), m1 = cudbl_call_count("cuMemMap"), u1 = cudbl_call_count("cuMemUnmap"),
         r1 = cudbl_call_count("cuMemRelease");
    for (int i = 0; i < nserved; i++) CHECK(step_try(pool, served[i], NULL, NULL));
    long creates_ok = cudbl_call_count("cuMemCreate") - c1, maps_ok = cudbl_call_count("cuMemMap") - m1,
         unmaps_ok = cudbl_call_count("cuMemUnmap") - u1, releases_ok = cudbl_call_count("cuMemRelease") - r1;
    CHECK(msh_pool_free(pool, w, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);

    /* the largest batch whose pages fit beside the weights */
    size_t room = (limit ? limit : CAPACITY) - WEIGHTS;
    int expect = (int)(room / ACT);
    printf("    limit %s: batch %d (expected %d), %d steps served, %d refused in %.1f ms (slowest refusal %.0f us); "
           "driver: create %ld / map %ld / unmap %ld / release %ld, the served steps alone %ld / %ld / %ld / %ld; "
           "during refusals %ld / %ld / %ld / %ld, device charge rose at most %zu MiB; gc %zu\n",
           limit ? "1/2 device" : "none", best, expect, nserved, refused, (t1 - t0) / 1e3, rs.us, creates, maps, unmaps,
           releases, creates_ok, maps_ok, unmaps_ok, releases_ok, rs.creates, rs.maps, rs.unmaps, rs.releases,
           rs.rise / MiB, gc_calls);
    CHECKF(best == expect, "the finder found batch %d, the device fits %d", best, expect);
    CHECKF(rs.creates == 0 && rs.maps == 0 && rs.unmaps == 0 && rs.releases == 0,
           "the refused steps cost the driver create %ld, map %ld, unmap %ld, release %ld", rs.creates, rs.maps,
           rs.unmaps, rs.releases);
    CHECKF(rs.rise == 0, "the device's charge rose by %zu MiB during a refused step", rs.rise / MiB);
    CHECK(creates == creates_ok && maps == maps_ok && unmaps == unmaps_ok && releases == releases_ok);
}

TEST(a_doubling_batch_finder_costs_the_driver_only_its_served_steps_no_limit)
{
    if (!device_up()) SKIP("the driver double did not start");
    finder_case(0);
}

TEST(a_doubling_batch_finder_costs_the_driver_only_its_served_steps_under_a_limit)
{
    if (!device_up()) SKIP("the driver double did not start");
    finder_case(CAPACITY / 2);
}

/* A handle whose release the driver refused waits on the pool's orphan list and goes with the next
 * job that releases. When that job stops before its driver work (its synchronize refused), the
 * orphan was never released and must stay on the list: it used to be counted released and
 * forgotten, a handle left on the device for good (found with issue 24's job_init change). */
TEST(an_orphan_stays_listed_when_its_job_stops_before_releasing_it)
{
    if (!device_up()) SKIP("the driver double did not start");
    struct cudbl_counts c0, c1;
    cudbl_get_counts(&c0);
    CUstream s;
    REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    struct msh_pool *pool = pool_new(64 * MiB, false);
    REQUIRE(pool);
    uint64_t a = 0, b = 0;
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, (uint64_t)(uintptr_t)s, &a) == 0);
    REQUIRE(msh_pool_free(pool, a, (uint64_t)(uintptr_t)s) == 0);
    cudbl_fail_nth("cuMemRelease", 1, CUDA_ERROR_UNKNOWN);
    msh_pool_empty_cache(pool); /* unmapped; its release refused: an orphan */
    cudbl_fail_clear();
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, (uint64_t)(uintptr_t)s, &b) == 0);
    REQUIRE(msh_pool_free(pool, b, (uint64_t)(uintptr_t)s) == 0);
    cudbl_fail_nth("cuCtxSynchronize", 1, CUDA_ERROR_UNKNOWN);
    msh_pool_empty_cache(pool); /* pages freed on a stream: the job synchronizes first, refused */
    cudbl_fail_clear();
    CHECK(pool_ok(pool));
    msh_pool_empty_cache(pool);
    msh_pool_destroy(pool);
    cuStreamDestroy(s);
    cudbl_get_counts(&c1);
    CHECKF(c1.handles == c0.handles, "%ld handles left on the device after the pool was destroyed",
           c1.handles - c0.handles);
}

TEST_MAIN()
